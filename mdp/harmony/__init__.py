"""Harmony peers: true peer-to-peer messaging, wire-compatible with ZRE
(ZeroMQ RFC 36; Zyre, zeromq-pyre).

Each :class:`Node` binds one ROUTER for everything it hears and connects one
DEALER to each peer it talks to; it finds peers with UDP beacons or a list of
endpoints, greets each with HELLO, and tells the application who enters,
leaves, joins and speaks.  See docs/harmony.md.
"""

from mdp.harmony.codec import DISCOVERY_PORT, MalformedZre, UnknownCommand
from mdp.harmony.machine import (
    ENTER,
    EVASIVE,
    EVENTS,
    EXIT,
    JOIN,
    LEAVE,
    SHOUT,
    WHISPER,
    Event,
    HarmonyMachine,
    UnknownPeer,
)
from mdp.harmony.node import BeaconDiscovery, EndpointDiscovery, EventStream, Node

__all__ = [
    "DISCOVERY_PORT",
    "ENTER",
    "EVASIVE",
    "EVENTS",
    "EXIT",
    "JOIN",
    "LEAVE",
    "SHOUT",
    "WHISPER",
    "BeaconDiscovery",
    "EndpointDiscovery",
    "Event",
    "EventStream",
    "HarmonyMachine",
    "MalformedZre",
    "Node",
    "UnknownCommand",
    "UnknownPeer",
]
