"""A client of Titanic: submit a request now, collect its reply later, from any process.
A worker's error reply is raised as the same typed error as from
:meth:`Client.request <mdp.majordomo.client.Client.request>`."""

from __future__ import annotations

import itertools
import uuid
from typing import Any, Optional, Sequence, Union

from twisted.internet import defer, task
from twisted.logger import Logger

from mdp import errors
from mdp.errors import RemoteError, TitanicError, UnknownRequest
from mdp.majordomo import codec
from mdp.majordomo.client import DEFAULT_RETRIES, DEFAULT_TIMEOUT, Client
from mdp.majordomo.idempotence import stamp as stamped_body
from mdp.messages import Frame, remote_error, request_frames
from mdp.policy import Limits, default_reactor, positive_seconds
from mdp.titanic import protocol

log = Logger()

#: Seconds between two ``titanic.reply`` polls.
DEFAULT_POLL_INTERVAL = 1.0
#: Requests submitted here whose service is remembered (to name it in errors).
_REMEMBERED = 10_000
#: Poll failures meaning only that Titanic (or the broker) is away for a while.
TRANSIENT = (errors.RequestTimeout, errors.ServiceUnavailable, errors.ServiceOverloaded,
             errors.TransportError)


def _check_id(requestId: str) -> bytes:
    if not isinstance(requestId, str):
        raise TypeError(f"a request id is str, not {type(requestId).__name__}")
    try:
        return str(uuid.UUID(requestId)).encode("ascii")
    except ValueError:
        raise ValueError(f"{requestId!r} is not a Titanic request id (a UUID)") from None


class TitanicClient:
    """Titanic's services through *broker* (one endpoint or a failover list).
    *timeout* and *retries* are those of each call to Titanic itself.  With *stamp*, each
    submitted request carries an idempotence stamp, the same on every attempt, that Titanic
    passes on: a submit tried again after its acknowledgement was lost is stored twice (under
    two ids), and the copy sent after the other finished is answered from the reply store of
    the service's workers, if they keep one.  Leave it off for
    workers that would see the stamp as frames of the body."""

    def __init__(self, broker: Union[str, Sequence[str]], reactor: Optional[Any] = None, *,
                 pollInterval: float = DEFAULT_POLL_INTERVAL, timeout: float = DEFAULT_TIMEOUT,
                 retries: int = DEFAULT_RETRIES, limits: Limits = Limits(), stamp: bool = False,
                 curveServerPublic: Optional[str] = None, curveSecret: Optional[str] = None) -> None:
        self.reactor = default_reactor(reactor)
        self.stamp = stamp
        self._clientId = uuid.uuid4().bytes
        self._sequence = itertools.count()
        self.pollInterval = positive_seconds("pollInterval", pollInterval)
        self.client = Client(broker, self.reactor, timeout=timeout, retries=retries, limits=limits,
                             curveServerPublic=curveServerPublic, curveSecret=curveSecret)
        self._services: dict[str, bytes] = {}

    async def _titanic(self, service: bytes, *body: bytes) -> list[bytes]:
        reply = await self.client.request(service, *body)
        refusal = protocol.REFUSALS.get(reply[2]) if len(reply) == 3 else None
        if refusal is not None and reply[0] == refusal.status:
            raise refusal(reply[1].decode("utf-8", "replace"))
        if reply[:1] == [protocol.FAILED]:
            message = b" ".join(reply[1:]).decode("utf-8", "replace")
            raise TitanicError(f"{service.decode()} failed: {message}")
        return reply

    def submit(self, service: Union[str, bytes], *frames: Frame) -> defer.Deferred[str]:
        """Store a request for *service*; fires with its id (UUID text) once committed.
        Arguments are checked at once, as by ``Client.request``."""
        name = codec.api_service_name(service)
        body = request_frames(frames)
        if self.stamp:
            body = stamped_body(self._clientId, next(self._sequence), body)

        async def submit() -> str:
            reply = await self._titanic(protocol.REQUEST, name, *body)
            if reply[:1] != [protocol.OK] or len(reply) != 2:
                raise TitanicError(f"titanic.request answered {reply[:2]!r}")
            requestId = reply[1].decode("ascii")
            if len(self._services) >= _REMEMBERED:
                del self._services[next(iter(self._services))]
            self._services[requestId] = name
            return requestId

        return defer.ensureDeferred(submit())

    def poll(self, requestId: str) -> defer.Deferred[Optional[list[bytes]]]:
        """Ask once: the reply frames, or ``None`` while pending.  Fails with
        :class:`~mdp.errors.UnknownRequest` for an unknown or closed id."""
        wire = _check_id(requestId)

        async def poll() -> Optional[list[bytes]]:
            try:
                reply = await self._titanic(protocol.REPLY, wire)
            except TRANSIENT:
                raise
            except RemoteError as e:  # titanic.reply itself refused (413)
                raise TitanicError(f"titanic.reply could not fetch the reply to {requestId} "
                                   f"({e}); it stays in Titanic's store") from e
            status = reply[:1]
            if status == [protocol.PENDING]:
                return None
            if status == [protocol.UNKNOWN]:
                raise UnknownRequest(f"Titanic knows no request {requestId} "
                                     f"(never stored, closed, or purged)")
            if status != [protocol.OK]:
                raise TitanicError(f"titanic.reply answered {status[0]!r}" if status
                                   else "titanic.reply answered with no status frame")
            frames = reply[1:]
            error = remote_error(self._services.get(requestId, b"titanic.reply"), frames)
            if error is not None:
                raise error
            return frames

        return defer.ensureDeferred(poll())

    def result(self, requestId: str, *, pollInterval: Optional[float] = None) -> defer.Deferred[list[bytes]]:
        """The reply frames, polling every *pollInterval* seconds (default: the client's) until done;
        :data:`TRANSIENT` failures are logged and polled again.  Cancel the Deferred to stop polling."""
        _check_id(requestId)
        interval = (self.pollInterval if pollInterval is None
                    else positive_seconds("pollInterval", pollInterval))

        async def result() -> list[bytes]:
            while True:
                try:
                    frames = await self.poll(requestId)
                    if frames is not None:
                        self._services.pop(requestId, None)
                        return frames
                except TRANSIENT as e:
                    log.warn("Titanic is not answering about {id} ({error}); polling on",
                             id=requestId, error=e)
                await task.deferLater(self.reactor, interval, lambda: None)

        return defer.ensureDeferred(result())

    def close(self, requestId: str) -> defer.Deferred[None]:
        """Have Titanic forget a request and its reply (idempotent)."""
        wire = _check_id(requestId)

        async def close() -> None:
            await self._titanic(protocol.CLOSE, wire)
            self._services.pop(requestId, None)

        return defer.ensureDeferred(close())

    def call(self, service: Union[str, bytes], *frames: Frame,
             pollInterval: Optional[float] = None) -> defer.Deferred[list[bytes]]:
        """:meth:`submit`, :meth:`result`, :meth:`close`: the reply frames.  The request is closed
        once its reply (or error reply) is in hand; if cancelled, or if the close fails (logged),
        it is left to Titanic's keep time."""
        submitted = self.submit(service, *frames)

        async def call() -> list[bytes]:
            requestId = await submitted
            try:
                reply = await self.result(requestId, pollInterval=pollInterval)
            except RemoteError:  # the worker's own error reply: close it too
                await self._closeAfter(requestId)
                raise
            await self._closeAfter(requestId)
            return reply

        return defer.ensureDeferred(call())

    async def _closeAfter(self, requestId: str) -> None:
        """Close a request whose reply is in hand; a failure is logged, not raised."""
        try:
            await self.close(requestId)
        except defer.CancelledError:
            raise
        except Exception as e:
            log.warn("titanic: request {requestId} answered, but titanic.close failed: {error}; "
                     "Titanic keeps its reply until its keep time", requestId=requestId, error=e)

    def disconnect(self) -> defer.Deferred[None]:
        """Close the connection to the broker (pending calls fail with ClientClosed)."""
        return self.client.close()
