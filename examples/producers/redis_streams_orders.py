"""A producer in another language: puts order events on a Redis stream for
`cargo run --example orders_consumer --features redis-streams -- <stream>
<ledger>` (docs/consumers.md, "A producer in Python").

    pip install redis
    python3 examples/producers/redis_streams_orders.py orders        # REDIS_URL or 127.0.0.1:6379

It sends what real producers send: three orders, one of them twice under
the same event id (a producer retry after a lost reply), and one
re-published with a new event id and timestamp (the consumer keys on the
payload without `sent_at`, so the same order is charged once). The message is the
JSON order in the entry's `payload` field and its event id in `id`.
"""

import json
import os
import sys
import time

import redis


def main() -> None:
    stream = sys.argv[1] if len(sys.argv) > 1 else "orders"
    r = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    run = f"{time.time_ns()}-{os.getpid()}"
    events = [
        ("evt-1", "o-1", 500),
        ("evt-2", "o-2", 1200),
        ("evt-2", "o-2", 1200),  # the same event again: a producer retry
        ("evt-3", "o-3", 90),
        ("evt-4", "o-1", 500),  # order o-1 re-published under a new event id
    ]
    for event, order, amount in events:
        body = {"order": f"{order}-{run}", "amount": amount, "sent_at": time.time_ns()}
        entry = r.xadd(stream, {"id": f"{event}-{run}", "payload": json.dumps(body)})
        print(f"sent {event} order {order} amount {amount} as {entry.decode()}")


if __name__ == "__main__":
    main()
