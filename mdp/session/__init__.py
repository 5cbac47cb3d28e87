"""CLIENT/SERVER sessions: heartbeats and invisible reconnects ("Revisiting
multipart", "Heartbeating and Sessions").  :class:`SessionClient` and
:class:`SessionServer` for applications; ``session+tcp:`` and
``session+zmq:`` endpoints (:mod:`mdp.session.transport`) for MDP and the
other patterns; the pure machines in :mod:`mdp.session.machines`.  See
docs/sessions.md."""

from mdp.session.codec import MalformedSession
from mdp.session.machines import (
    ClientSessionMachine,
    ServerSessionMachine,
    SessionQueueFull,
    SessionRefused,
    UnknownSession,
)
from mdp.session.peers import SessionClient, SessionServer

__all__ = [
    "ClientSessionMachine",
    "MalformedSession",
    "ServerSessionMachine",
    "SessionClient",
    "SessionServer",
    "SessionQueueFull",
    "SessionRefused",
    "UnknownSession",
]
