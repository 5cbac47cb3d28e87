"""Run a real majortomo (PyPI) broker or worker, for interop tests.

    python -m tests.majortomo_peers broker            # prints "BOUND <endpoint>"
    python -m tests.majortomo_peers worker ENDPOINT SERVICE

The broker binds tcp://127.0.0.1:* so the OS picks the port.  The worker
answers each request with the frames prefixed by b"mt:" (a request b"slow": after a second).
"""

from __future__ import annotations

import logging
import sys
import time

import zmq


def broker() -> None:
    from majortomo.broker import Broker

    b = Broker(bind="tcp://127.0.0.1:*", heartbeat_interval=0.5, heartbeat_timeout=5.0)
    b.bind()
    endpoint = b._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    print(f"BOUND {endpoint}", flush=True)
    while True:  # Broker.run() would bind again; this is its loop body
        try:
            message = b.receive()
            if message:
                b.handle_message(message)
        except Exception:
            logging.exception("majortomo broker: message handling failed")


def worker(endpoint: str, service: str) -> None:
    from majortomo import Worker
    from majortomo.worker import WorkerRequestsIterator

    requests = WorkerRequestsIterator(
        Worker(endpoint, service.encode(), heartbeat_interval=0.5, heartbeat_timeout=5.0)
    )
    print("WORKER STARTED", flush=True)
    for request in requests:
        if request == [b"slow"]:
            time.sleep(1.0)
        requests.send_reply_final([b"mt:" + frame for frame in request])


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if sys.argv[1] == "broker":
        broker()
    else:
        worker(sys.argv[2], sys.argv[3])
