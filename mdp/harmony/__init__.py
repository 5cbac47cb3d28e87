"""Harmony peers: peer-to-peer messaging, wire-compatible with ZRE (ZeroMQ RFC 36;
Zyre, zeromq-pyre).  See docs/harmony.md.
"""

from mdp.harmony.codec import DISCOVERY_PORT, MalformedZre, UnknownCommand
from mdp.harmony.machine import EVENTS, Event, HarmonyMachine, UnknownPeer
from mdp.harmony.node import BeaconDiscovery, EndpointDiscovery, EventStream, Node

ENTER, EXIT, JOIN, LEAVE, WHISPER, SHOUT, EVASIVE = EVENTS

__all__ = ["DISCOVERY_PORT", "ENTER", "EVASIVE", "EVENTS", "EXIT", "JOIN", "LEAVE", "SHOUT", "WHISPER",
           "BeaconDiscovery", "EndpointDiscovery", "Event", "EventStream", "HarmonyMachine",
           "MalformedZre", "Node", "UnknownCommand", "UnknownPeer"]
