"""Majordomo Management Interface (ZeroMQ RFC 8): ``mmi.*`` services answered
by the broker itself.

========================  =====================================================
``mmi.service`` NAME      ``200`` if NAME has a live worker (or lost its last one
                          less than the broker's ``serviceLinger`` ago), else ``404``
``mmi.services``          one JSON frame: ``{"name": {"workers": n, "idle": n,
                          "queued": n}, ...}``
``mmi.workers`` [NAME]    one JSON frame: ``[{"id": hex, "service": name, "busy":
                          bool, "dialect": "rfc"|"majortomo", "silence": seconds},
                          ...]``, only NAME's workers if a non-empty NAME is given
any other ``mmi.*``       ``501``
========================  =====================================================
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from mdp.broker import Broker

PREFIX = b"mmi."
FOUND = b"200"
NOT_FOUND = b"404"
NOT_IMPLEMENTED = b"501"


def answer(broker: Broker, service: bytes, body: Sequence[bytes]) -> list[bytes]:
    """The FINAL body answering an ``mmi.*`` request."""
    if service == b"mmi.service":
        return [FOUND if broker.isServiceAvailable(bytes(body[0])) else NOT_FOUND]
    if service == b"mmi.services":
        table = {
            name.decode("ascii"): {
                "workers": queue.workers,
                "idle": len(queue.idle),
                "queued": queue.size,
            }
            for name, queue in sorted(broker.services.items())
        }
        return [json.dumps(table, sort_keys=True).encode()]
    if service == b"mmi.workers":
        wanted = bytes(body[0]) if body and body[0] else None
        now = broker.reactor.seconds()
        workers = [
            {
                "id": worker.key[1].hex(),
                "service": worker.service.name.decode("ascii"),
                "busy": worker.current is not None,
                "dialect": worker.dialect,
                "silence": round(now - worker.lastSeen, 3),
            }
            for worker in broker.workers.values()
            if wanted is None or worker.service.name == wanted
        ]
        return [json.dumps(workers).encode()]
    return [NOT_IMPLEMENTED]
