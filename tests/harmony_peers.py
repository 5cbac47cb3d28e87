"""Harmony nodes run as separate processes by the network-namespace tests.

    python -m tests.harmony_peers ours NAME [GROUP...]    # our mdp.harmony.Node
    python -m tests.harmony_peers pyre NAME [GROUP...]    # a zeromq-pyre node

Both speak the same line protocol.  Commands come on stdin, one JSON object a
line: ``{"op": "join"|"leave", "group": G}``, ``{"op": "whisper", "peer": HEX,
"frames": [TEXT, ...]}``, ``{"op": "shout", "group": G, "frames": [...]}``,
``{"op": "stop"}``, and for ours ``{"op": "stats"}``: ``STATS {"peers": N,
"strangers": N, "most": N}`` (*most*: the most strangers it ever kept).  Each
event goes to stdout as ``EVENT {json}`` with ``kind``, ``peer`` (hex UUID),
``name``, ``group`` and ``frames`` (text); the node announces itself with
``READY {"uuid": HEX, "endpoint": EP}``.

Timing comes from the environment: ``HARMONY_EVASIVE`` and ``HARMONY_EXPIRED``
(seconds; pyre's are class constants of ``PyrePeer``, set here); ours takes
``HARMONY_MAX_PEERS``, ``HARMONY_MAX_STRANGERS`` and ``HARMONY_HELLO_WAIT`` too.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from typing import Any, Callable

EVASIVE = float(os.environ.get("HARMONY_EVASIVE", "1"))
EXPIRED = float(os.environ.get("HARMONY_EXPIRED", "3"))


def emit(tag: str, payload: dict[str, Any]) -> None:
    sys.stdout.write(f"{tag} {json.dumps(payload)}\n")
    sys.stdout.flush()


def event(kind: str, peer: Any, name: str, group: Any = None, frames: Any = ()) -> None:
    emit("EVENT", {"kind": kind, "peer": peer.hex, "name": name, "group": group,
                   "frames": [f.decode("utf-8", "replace") for f in frames or ()]})


def carry_out(line: bytes, join: Callable[[str], Any], leave: Callable[[str], Any],
              whisper: Callable[[uuid.UUID, list[bytes]], Any],
              shout: Callable[[str, list[bytes]], Any]) -> bool:
    """Do the command on *line*; False for ``stop``."""
    command = json.loads(line)
    op = command["op"]
    frames = [f.encode() for f in command.get("frames", [])]
    if op == "join":
        join(command["group"])
    elif op == "leave":
        leave(command["group"])
    elif op == "whisper":
        whisper(uuid.UUID(hex=command["peer"]), frames)
    elif op == "shout":
        shout(command["group"], frames)
    return op != "stop"


def ours(name: str, *groups: str) -> None:
    from twisted.internet import reactor, stdio
    from twisted.logger import globalLogBeginner, textFileLogObserver
    from twisted.protocols.basic import LineReceiver

    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stderr)])

    from mdp.harmony import BeaconDiscovery, Node

    beacon = os.environ.get("HARMONY_BEACON", "udp:5670")
    bounds = {option: kind(os.environ[variable]) for option, variable, kind in (
        ("maxPeers", "HARMONY_MAX_PEERS", int), ("maxStrangers", "HARMONY_MAX_STRANGERS", int),
        ("helloWait", "HARMONY_HELLO_WAIT", float)) if variable in os.environ}
    node = Node(name, reactor, headers={"X-ROLE": "ours"}, evasive=EVASIVE, expired=EXPIRED,
                discovery=BeaconDiscovery(beacon, reactor=reactor), **bounds)
    most = [0]
    handleBeacon = node.machine.handleBeacon

    def counted(*args: Any) -> Any:
        actions = handleBeacon(*args)
        most[0] = max(most[0], len(getattr(node.machine, "strangers", node.machine.peers)))
        return actions

    node.machine.handleBeacon = counted  # type: ignore[method-assign]
    node.subscribe(lambda e: event(e.kind, e.peer, e.name, e.group, e.frames))
    for group in groups:
        node.join(group)

    class Commands(LineReceiver):
        delimiter = b"\n"

        def lineReceived(self, line: bytes) -> None:
            if json.loads(line)["op"] == "stats":
                emit("STATS", {"peers": len(node.peers()), "most": most[0],
                               "strangers": len(getattr(node.machine, "strangers", ()))})
            elif not carry_out(line, node.join, node.leave, lambda p, f: node.whisper(p, *f),
                             lambda g, f: node.shout(g, *f)):
                stop()

        def connectionLost(self, reason: Any) -> None:
            stop()

    def stop() -> None:
        if node.running:
            node.stop().addBoth(lambda _: reactor.stop() if not reactor._stopped else None)

    # SIGTERM: leave with a port-0 beacon before the reactor closes the sockets
    reactor.addSystemEventTrigger("before", "shutdown",
                                  lambda: node.stop() if node.running else None)
    stdio.StandardIO(Commands())
    node.start().addCallback(lambda _: emit("READY", {"uuid": node.uuid.hex,
                                                      "endpoint": node.endpoint}))
    reactor.run()


def pyre_node(name: str, *groups: str) -> None:
    import pyre
    import zmq
    from pyre.pyre_peer import PyrePeer

    PyrePeer.PEER_EVASIVE = int(EVASIVE)  # pyre sizes its queue from these: whole seconds
    PyrePeer.PEER_EXPIRED = int(EXPIRED)
    node = pyre.Pyre(name)
    node.set_header("X-ROLE", "pyre")
    for group in groups:
        node.join(group)
    node.start()
    emit("READY", {"uuid": node.uuid().hex, "endpoint": node.endpoint()})
    poller = zmq.Poller()
    poller.register(node.socket(), zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    pending = b""  # read the descriptor: lines in sys.stdin's buffer would not wake the poller
    running = True
    while running:
        items = dict(poller.poll(1000))
        if node.socket() in items:
            e = pyre.PyreEvent(node)
            event(e.type, e.peer_uuid, e.peer_name, e.group, e.msg)
        if sys.stdin.fileno() in items or sys.stdin in items:
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if not carry_out(line, node.join, node.leave, node.whisper, node.shout):
                    running = False
                    break
    node.stop()
    emit("STOPPED", {})


if __name__ == "__main__":
    {"ours": ours, "pyre": pyre_node}[sys.argv[1]](*sys.argv[2:])
