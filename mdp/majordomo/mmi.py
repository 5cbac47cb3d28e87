"""Majordomo Management Interface (ZeroMQ RFC 8): the ``mmi.*`` services the broker answers
itself, ``mmi.service``, ``mmi.services``, ``mmi.workers``, ``mmi.binarystar`` and
``mmi.extensions`` (mdp.majordomo.extension), any other
``501`` (docs/mdp.md).  Under an access policy a peer hears only of the services it may call
(workers are listed without peer ids).  Listings hold at most :data:`MAX_ENTRIES`
(``mmi.services``: those with workers first); a second frame ``{"truncated": true, "total": n}``
says when there were more."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from mdp.majordomo import extension

if TYPE_CHECKING:
    from mdp.majordomo.broker_machine import BrokerMachine

PREFIX = b"mmi."
BINARYSTAR = b"mmi.binarystar"
FOUND = b"200"
NOT_FOUND = b"404"
NOT_IMPLEMENTED = b"501"

#: Most entries in one ``mmi.services`` or ``mmi.workers`` reply.
MAX_ENTRIES = 1000


def _listing(entries: Any, total: int) -> list[bytes]:
    """The reply frames for *entries* (at most MAX_ENTRIES) out of *total*."""
    frames = [json.dumps(entries, sort_keys=True).encode()]
    if total > len(entries):
        frames.append(json.dumps({"truncated": True, "total": total}).encode())
    return frames


def workers_listed(reply: Sequence[bytes]) -> Optional[int]:
    """How many workers an ``mmi.workers`` *reply* lists (its total if truncated),
    or None if it is no such listing (a ``501``, say)."""
    try:
        listing = json.loads(reply[0])
        more = json.loads(reply[1]) if len(reply) > 1 else {}
        count = more.get("total", len(listing)) if more.get("truncated") else len(listing)
    except (ValueError, IndexError, AttributeError, TypeError, UnicodeDecodeError):
        return None
    if not isinstance(listing, list) or not isinstance(count, int) or isinstance(count, bool):
        return None
    return count


def answer(broker: BrokerMachine, service: bytes, body: Sequence[bytes],
           visible: Optional[Callable[[bytes], bool]] = None) -> list[bytes]:
    """The FINAL body answering an ``mmi.*`` request; with *visible*, services it
    does not allow are answered as if they did not exist."""
    if service == b"mmi.service":
        name = bytes(body[0])
        return [FOUND if (visible is None or visible(name)) and broker.isServiceAvailable(name)
                else NOT_FOUND]
    if service == b"mmi.services":
        return _services(broker, visible)
    if service == b"mmi.workers":
        wanted = bytes(body[0]) if body and body[0] else None
        snapshot = broker.snapshot(serviceLimit=0, workerLimit=MAX_ENTRIES, service=wanted,
                                   visible=visible)
        # under a policy, without their peer ids: under ZeroMQ a freed id can be claimed
        return _listing([{"service": w.service.decode("ascii"), "busy": w.busy, "dialect": w.dialect,
                          "silence": round(w.silence, 3), **({"id": w.peer} if visible is None else {})}
                         for w in snapshot.workers], snapshot.workerCount)
    if service == extension.MMI_EXTENSIONS:
        return [FOUND, extension.FEATURES]
    status = broker.admissionStatus() if service == BINARYSTAR else None
    return [NOT_IMPLEMENTED] if status is None else [json.dumps(status, sort_keys=True).encode()]


def _services(broker: BrokerMachine, visible: Optional[Callable[[bytes], bool]]) -> list[bytes]:
    """Those with workers first: a truncated listing naming one without holds every
    one with (requests for names nobody serves cannot push a served one out)."""
    served = {w.service for w in broker.snapshot(serviceLimit=0, visible=visible).workers}
    first = broker.snapshot(serviceLimit=MAX_ENTRIES, workerLimit=0, visible=served.__contains__)
    room = MAX_ENTRIES - len(first.services)
    rest = broker.snapshot(serviceLimit=max(room, 1), workerLimit=0, visible=lambda name: (
        name not in served and (visible is None or visible(name))))
    table = {each.name.decode("ascii"): {"workers": each.workers, "idle": each.idle,
                                         "queued": each.queued}
             for each in first.services + rest.services[:room]}
    return _listing(table, first.serviceCount + rest.serviceCount)
