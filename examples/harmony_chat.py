"""A terminal chat between Harmony (ZRE) peers, in a page.

Run it in two terminals on one network; they find each other with UDP
beacons, and talk with Zyre and zeromq-pyre chats as well::

    python examples/harmony_chat.py alice
    python examples/harmony_chat.py bob

Where beacons cannot go (no broadcast, or a test that must not send UDP),
give the peers' endpoints instead, and bind where the others expect you::

    python examples/harmony_chat.py alice --endpoint zmq:tcp://127.0.0.1:7001 --peer tcp://127.0.0.1:7002
    python examples/harmony_chat.py bob   --endpoint zmq:tcp://127.0.0.1:7002 --peer tcp://127.0.0.1:7001

Each line you type goes to everyone in the group; Ctrl-D leaves.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from twisted.internet import defer, stdio, task
from twisted.protocols.basic import LineReceiver

from mdp.harmony import BeaconDiscovery, EndpointDiscovery, Node


class Keyboard(LineReceiver):
    """Typed lines go to the group; the end of input ends the chat."""

    delimiter = b"\n"

    def __init__(self, node: Node, group: str, done: defer.Deferred[None]) -> None:
        self.node, self.group, self.done = node, group, done

    def lineReceived(self, line: bytes) -> None:
        if line.strip():
            self.node.shout(self.group, line.rstrip(b"\r"))

    def connectionLost(self, reason: object) -> None:
        if not self.done.called:
            self.done.callback(None)


async def main(reactor: Any, argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="Chat with Harmony (ZRE) peers.")
    parser.add_argument("name")
    parser.add_argument("--group", default="CHAT")
    parser.add_argument("--interface", help="for beacons: a name or an address")
    parser.add_argument("--peer", action="append", default=[], help="tcp://HOST:PORT of a peer")
    parser.add_argument("--endpoint", help="where to bind, e.g. zmq:tcp://127.0.0.1:7001")
    args = parser.parse_args(argv)
    # go on once the reactor runs: Ctrl-C is then its own (it stops it, and
    # the chat leaves as on Ctrl-D) from the first line printed on
    await task.deferLater(reactor, 0, lambda: None)

    if args.peer:
        discovery: Any = EndpointDiscovery(args.peer)
    else:
        where = f":interface={args.interface}" if args.interface else ""
        discovery = BeaconDiscovery(f"udp:5670{where}", reactor=reactor)
    node = Node(args.name, reactor, discovery=discovery, endpoint=args.endpoint)
    node.join(args.group)
    await node.start()
    print(f"* {args.name} at {node.endpoint}, talking in {args.group}", flush=True)

    done: defer.Deferred[None] = defer.Deferred()
    stdio.StandardIO(Keyboard(node, args.group, done), reactor=reactor)

    async def show() -> None:
        async for event in node:  # ends when the node stops
            if event.kind == "ENTER":
                print(f"* {event.name} joined", flush=True)
            elif event.kind == "EXIT":
                print(f"* {event.name} left", flush=True)
            elif event.kind == "SHOUT" and event.group == args.group:
                text = b" ".join(event.frames).decode("utf-8", "replace")
                print(f"{event.name}: {text}", flush=True)

    showing = defer.ensureDeferred(show())
    await done
    await node.stop()
    await showing


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, sys.argv[1:])))
