"""The suites' local AWS endpoint: moto's server, DynamoDB requests one at a time.

moto's threaded server runs each request on its own thread, and its DynamoDB
backend takes no lock between a ConditionExpression's check and the write:
two conditional PutItems of one item can both succeed, a promise real
DynamoDB keeps (a conditional write is atomic per item). This wrapper runs
every DynamoDB request under one lock, so the emulator keeps that promise;
the control test (idem-dynamodb tests/it/control.rs) checks it does.

Its SQS backend is not thread-safe either: a ReceiveMessage on a FIFO queue
iterates the queue's in-flight groups while another request changes them
("Set changed size during iteration", answered as a 500). SQS requests run
one at a time too, under a lock of their own; a long-polling ReceiveMessage
is answered by short polls under the lock, 20 ms apart, until a message
comes or its wait ends, so it never blocks the other requests while it
waits.

Usage: python3 moto_server.py PORT (with moto[server] on PYTHONPATH).
"""

import io
import json
import sys
import threading
import time

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


SQS_LOCK = threading.Lock()


class SerialSqs:
    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        target = environ.get("HTTP_X_AMZ_TARGET", "")
        if not target.startswith("AmazonSQS."):
            return self.app(environ, start_response)
        if target != "AmazonSQS.ReceiveMessage":
            with SQS_LOCK:
                return list(self.app(environ, start_response))
        return self.receive(environ, start_response)

    def receive(self, environ, start_response):
        length = int(environ.get("CONTENT_LENGTH") or 0)
        raw = environ["wsgi.input"].read(length)
        try:
            request = json.loads(raw or b"{}")
        except ValueError:
            request = None
        if not isinstance(request, dict):
            # Not ours to judge: moto answers a malformed request itself.
            environ["wsgi.input"] = io.BytesIO(raw)
            with SQS_LOCK:
                return list(self.app(environ, start_response))
        wait = request.get("WaitTimeSeconds") or 0
        deadline = time.monotonic() + float(wait)
        request["WaitTimeSeconds"] = 0
        body = json.dumps(request).encode()
        while True:
            poll = dict(environ)
            poll["wsgi.input"] = io.BytesIO(body)
            poll["CONTENT_LENGTH"] = str(len(body))
            answer = {}

            def keep(status, headers, exc_info=None):
                answer["status"], answer["headers"] = status, headers
                return lambda data: None

            with SQS_LOCK:
                chunks = list(self.app(poll, keep))
            payload = b"".join(chunks)
            if (
                not answer.get("status", "").startswith("200")
                or time.monotonic() >= deadline
                or got_messages(payload)
            ):
                start_response(answer["status"], answer["headers"])
                return [payload]
            time.sleep(0.02)


def got_messages(payload):
    try:
        return bool(json.loads(payload or b"{}").get("Messages"))
    except (ValueError, AttributeError):
        return True


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 4566
    app = SerialSqs(SerialDynamoDB(DomainDispatcherApplication(create_backend_app)))
    run_simple("127.0.0.1", port, app, threaded=True, use_reloader=False)


if __name__ == "__main__":
    main()
