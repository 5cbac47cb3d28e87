"""Every exception the library raises, in one module.

The taxonomy:

* **Caller mistakes raise at once**, synchronously, from the call that made
  them: ``TypeError`` / ``ValueError`` for bad arguments (a frame that is not
  ``bytes``/``str``, a negative timeout, a request over the message limits:
  :class:`RequestTooLarge`), :class:`TransportError` for a malformed endpoint.
* **Everything that happens later fails the Deferred** the call returned:
  :class:`RequestTimeout`, :class:`BrokerUnreachable`, :class:`ClientClosed`,
  :class:`StreamRestarted`, :class:`NoServerAvailable`, a
  :class:`TransportError` from binding, ...
* **What a peer said is told apart from what happened here**: a
  :class:`RemoteError` (and its subclasses, one per status code) carries an
  error reply from the broker or a worker; a :class:`ProtocolError` is input
  from a peer that broke the wire protocol (transports log these and drop the
  peer; callers rarely see them).  Every other :class:`MDPError` is local.

Callers catch :class:`MDPError` for anything of ours, or the precise subclass
for one failure.  See :mod:`mdp.messages` for the wire form of error replies.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence


class MDPError(Exception):
    """Base class of all errors raised by this library."""


class ProtocolError(MDPError):
    """A message broke the wire protocol (bad header, command, frame count, ...)."""


class OversizedMessage(ProtocolError):
    """A transport refused a message over its limits (``mdp.policy.Limits``).
    When it ends a connection for one, ``connectionLost`` carries this."""


class RecordTooLarge(OversizedMessage):
    """A stream record exceeds the message limits (refused from its header,
    before it is buffered)."""

    #: on a connection that carries channels, the channel it came on
    channel: Optional[bytes] = None


class TransportError(MDPError):
    """An endpoint string could not be understood (raised at once, naming the
    endpoint and what was probably meant) or a transport failed to bind."""


class RequestTooLarge(MDPError, ValueError):
    """A request over the message limits, refused before it is sent."""


class ReplyTooLarge(MDPError):
    """A reply was over this client's own message limits, so its connection
    dropped it; the request fails with this instead of waiting for its
    timeout (sent again, it would only run again).  Local: a 413 error reply
    from a peer is a :class:`MessageTooLarge`."""


class RequestTimeout(MDPError):
    """No FINAL reply arrived within the request's timeout.  The message
    names the *endpoints* tried and, if the last connection to one failed,
    why (``connection refused``): ``no reply from broker at
    zmq:tcp://127.0.0.1:5555 after 3 attempts (7.5 s) to a request for
    service 'echo'``."""

    def __init__(self, service: bytes, attempts: int, elapsed: float,
                 endpoints: Sequence[str] = (), peer: str = "broker",
                 failures: Optional[Mapping[str, str]] = None) -> None:
        self.service = service
        self.attempts = attempts
        self.elapsed = elapsed
        self.endpoints = tuple(endpoints)
        self.failures = dict(failures or {})
        where = ""
        if self.endpoints:
            named = ", ".join(
                f"{e} ({self.failures[e]})" if e in self.failures else e for e in self.endpoints)
            where = f" from {peer if len(self.endpoints) == 1 else peer + 's'} at {named}"
        tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
        super().__init__(
            f"no reply{where} after {tries} ({elapsed:.1f} s) to a request for service "
            f"{service.decode('ascii', 'replace')!r}"
        )


class BrokerUnreachable(MDPError):
    """No broker of a client's list could be reached at all (the connection
    was refused, the host or socket file does not exist) and none ever was:
    failed at once rather than after the attempts' time.  Once a client has
    reached a broker, a refused reconnection is retried instead (a broker
    restarting)."""

    def __init__(self, failures: Mapping[str, str]) -> None:
        self.failures = dict(failures)
        named = "; ".join(f"{e}: {why}" for e, why in self.failures.items())
        super().__init__(f"cannot reach {'broker' if len(self.failures) == 1 else 'any broker'} "
                         f"at {named}")


class RemoteError(MDPError):
    """The broker or a worker answered the request with an error reply."""

    #: The status code carried by the error reply (for example ``b"500"``).
    code: bytes = b"500"

    def __init__(self, service: bytes, code: bytes, message: str) -> None:
        self.service = service
        self.code = code
        self.message = message
        super().__init__(
            f"service {service.decode('ascii', 'replace')!r} answered "
            f"{code.decode('ascii', 'replace')}: {message}"
        )


class WorkerError(RemoteError):
    """The worker's handler raised an exception while serving the request (500)."""


class ServiceUnavailable(RemoteError):
    """No worker served the service before the broker expired the request (503)."""


class ServiceOverloaded(RemoteError):
    """The broker refused the request because its queues are full (429)."""


class Forbidden(RemoteError):
    """The broker's access policy does not let this client call the service
    (403); the request reached no worker."""


class MessageTooLarge(RemoteError):
    """A 413 error reply from the broker or a worker: a request too large for
    a worker, or a reply too large for the link back to the client."""


class StreamRestarted(MDPError):
    """The reply stream of a request started over: the PARTIALs delivered so
    far belong to an attempt that was abandoned (its worker died and the
    broker gave the request to another, or the client retried after a
    timeout).  Raised only when the caller gave no ``onRestart`` callback."""


class ClientClosed(MDPError):
    """The client was closed while the request was pending."""


class NoServerAvailable(MDPError):
    """Every server a Freelance client knows is known to be dead (or it knows none)."""


class MDPSparkError(MDPError):
    """A Spark task's call through MDP failed; the message names the broker
    and the service."""


class StoreError(MDPError):
    """A store (Titanic's requests and replies) cannot be opened or used: a
    damaged or unreadable file, named in the message.  Never ignored: a store
    that refuses to open stops its service."""


class TitanicError(MDPError):
    """Titanic refused or failed a request (status ``500``: a malformed body,
    or a store that failed); the message says which."""


class UnknownRequest(TitanicError):
    """Titanic knows no request of that id (status ``400``): never stored,
    closed, or its reply purged."""
