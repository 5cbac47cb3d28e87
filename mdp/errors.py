"""Every exception the library raises (catch :class:`MDPError` for any of them).
Caller mistakes raise at once; what happens later fails the returned Deferred."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence


class MDPError(Exception):
    """Base class of all errors raised by this library."""


class ProtocolError(MDPError):
    """A message broke the wire protocol (bad header, command, frame count, ...)."""


class OversizedMessage(ProtocolError):
    """A message over a transport's ``Limits``; also the ``connectionLost`` reason for one."""


class RecordTooLarge(OversizedMessage):
    """A stream record exceeds the limits (refused from its header, unbuffered)."""

    channel: Optional[bytes] = None  # on a connection that carries channels, the one it came on


class TransportError(MDPError):
    """An endpoint string is malformed (raised at once) or a transport failed to bind."""


class RequestTooLarge(MDPError, ValueError):
    """A request over the message limits, refused before it is sent."""


class ReplyTooLarge(MDPError):
    """A reply over the client's limits was dropped; the request fails (a peer's 413: MessageTooLarge)."""


class RequestTimeout(MDPError):
    """No FINAL reply within the timeout; the message names the *endpoints* tried and failures."""

    def __init__(self, service: bytes, attempts: int, elapsed: float, endpoints: Sequence[str] = (),
                 peer: str = "broker", failures: Optional[Mapping[str, str]] = None) -> None:
        self.service, self.attempts, self.elapsed = service, attempts, elapsed
        self.endpoints, self.failures = tuple(endpoints), dict(failures or {})
        where = ""
        if self.endpoints:
            named = ", ".join(
                f"{e} ({self.failures[e]})" if e in self.failures else e for e in self.endpoints)
            where = f" from {peer if len(self.endpoints) == 1 else peer + 's'} at {named}"
        tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
        super().__init__(f"no reply{where} after {tries} ({elapsed:.1f} s) to a request for service "
                         f"{service.decode('ascii', 'replace')!r}")


class BrokerUnreachable(MDPError):
    """No broker of a client's list was ever reached (refused, no such host); once one was, retried."""

    def __init__(self, failures: Mapping[str, str]) -> None:
        self.failures = dict(failures)
        named = "; ".join(f"{e}: {why}" for e, why in self.failures.items())
        super().__init__(f"cannot reach {'broker' if len(self.failures) == 1 else 'any broker'} at {named}")


class RemoteError(MDPError):
    """The broker or a worker answered the request with an error reply."""

    code: bytes = b"500"  # the error reply's status code

    def __init__(self, service: bytes, code: bytes, message: str) -> None:
        self.service, self.code, self.message = service, code, message
        super().__init__(f"service {service.decode('ascii', 'replace')!r} answered "
                         f"{code.decode('ascii', 'replace')}: {message}")


class WorkerError(RemoteError):
    """The worker's handler raised an exception while serving the request (500)."""


class ServiceUnavailable(RemoteError):
    """No worker served the service before the broker expired the request (503)."""


class ServiceOverloaded(RemoteError):
    """The broker refused the request because its queues are full (429)."""


class Forbidden(RemoteError):
    """The broker's access policy does not let this client call the service (403)."""


class MessageTooLarge(RemoteError):
    """A 413 error reply: a request or reply too large for some link."""


class RequestCancelled(RemoteError):
    """The request was given up because its caller cancelled it (499)."""


class DeadlineExceeded(RemoteError):
    """The request's deadline passed before it was served: in the broker's queue, or at the
    worker (504)."""


class StreamRestarted(MDPError):
    """The reply stream started over (its PARTIALs were an abandoned attempt); without ``onRestart``."""


class ClientClosed(MDPError):
    """The client was closed while the request was pending."""


class NoServerAvailable(MDPError):
    """Every server a Freelance client knows is known to be dead (or it knows none)."""


class MDPSparkError(MDPError):
    """A Spark task's call through MDP failed."""


class StoreError(MDPError):
    """A store (Titanic's) cannot be opened or used; its service stops."""


class StoreUnavailable(StoreError):
    """A store's database cannot be reached now (logged once by the store); the next call
    tries again."""


class TitanicError(MDPError):
    """Titanic refused or failed a request (status ``500``)."""


class UnknownRequest(TitanicError):
    """Titanic knows no request of that id (status ``400``): never stored, or closed."""
