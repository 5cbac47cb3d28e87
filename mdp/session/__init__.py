"""CLIENT/SERVER sessions: heartbeats and invisible reconnects ("Revisiting
multipart", "Heartbeating and Sessions").  The codec and the pure machines;
see :mod:`mdp.session.machines`."""

from mdp.session.codec import MalformedSession
from mdp.session.machines import (
    ClientSessionMachine,
    ServerSessionMachine,
    SessionQueueFull,
    UnknownSession,
)

__all__ = [
    "ClientSessionMachine",
    "MalformedSession",
    "ServerSessionMachine",
    "SessionQueueFull",
    "UnknownSession",
]
