"""CLIENT/SERVER sessions: heartbeats and invisible reconnects, for applications
(:class:`SessionClient`, :class:`SessionServer`) and as ``session+`` endpoints
(:mod:`mdp.session.transport`).  See docs/sessions.md."""

from mdp.session.codec import MalformedSession
from mdp.session.machines import (
    ClientSessionMachine,
    ServerSessionMachine,
    SessionQueueFull,
    SessionRefused,
    UnknownSession,
)
from mdp.session.transport import SessionClient, SessionServer

__all__ = ["ClientSessionMachine", "MalformedSession", "ServerSessionMachine", "SessionClient",
           "SessionServer", "SessionQueueFull", "SessionRefused", "UnknownSession"]
