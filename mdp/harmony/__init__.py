"""Harmony peers: peer-to-peer messaging, wire-compatible with ZRE (ZeroMQ RFC 36;
Zyre, zeromq-pyre).  See docs/harmony.md.
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
    "DISCOVERY_PORT", "ENTER", "EVASIVE", "EVENTS", "EXIT", "JOIN", "LEAVE", "SHOUT", "WHISPER",
    "BeaconDiscovery", "EndpointDiscovery", "Event", "EventStream", "HarmonyMachine",
    "MalformedZre", "Node", "UnknownCommand", "UnknownPeer",
]
