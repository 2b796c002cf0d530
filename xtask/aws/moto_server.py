"""The suites' local AWS endpoint: moto's server, DynamoDB requests one at a time.

moto's threaded server runs each request on its own thread, and its DynamoDB
backend takes no lock between a ConditionExpression's check and the write:
two conditional PutItems of one item can both succeed, a promise real
DynamoDB keeps (a conditional write is atomic per item). This wrapper runs
every DynamoDB request under one lock, so the emulator keeps that promise;
the control test (idem-dynamodb tests/it/control.rs) checks it does. SQS
requests stay concurrent: a long-polling ReceiveMessage must not block the
rest.

Usage: python3 moto_server.py PORT (with moto[server] on PYTHONPATH).
"""

import sys
import threading

from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

DYNAMODB_LOCK = threading.Lock()


class SerialDynamoDB:
    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        target = environ.get("HTTP_X_AMZ_TARGET", "")
        if not target.startswith("DynamoDB"):
            return self.app(environ, start_response)
        with DYNAMODB_LOCK:
            # The body is read whole under the lock: a lazy iterable would
            # let the write happen after the lock is released.
            return list(self.app(environ, start_response))


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 4566
    app = SerialDynamoDB(DomainDispatcherApplication(create_backend_app))
    run_simple("127.0.0.1", port, app, threaded=True, use_reloader=False)


if __name__ == "__main__":
    main()
