"""A client of several brokers side by side (docs/deployment.md): brokers that share nothing,
with workers attached to all of them (``Worker(..., attach="all")``).  Each request goes to the
broker with the fewest of this client's requests out, among those that have not failed it
lately; an attempt that fails for want of its broker (a timeout, no connection, no worker there)
is tried on another, under the usual retry rules.  Requests are stamped once, with the same stamp
on every broker, so a worker with a reply store runs a request tried twice once."""

from __future__ import annotations

import itertools
import math
import uuid
from collections import Counter
from typing import Any, Callable, Collection, Optional, Sequence, Union

from twisted.internet import defer

from mdp import transport
from mdp.errors import (
    BrokerUnreachable,
    DeadlineExceeded,
    RequestTimeout,
    ServiceOverloaded,
    ServiceUnavailable,
    TransportError,
)
from mdp.majordomo.client import Client
from mdp.majordomo.client_machine import DEFAULT_RETRIES, DEFAULT_TIMEOUT, _check_attempts
from mdp.majordomo.codec import api_service_name
from mdp.majordomo.idempotence import stamp
from mdp.messages import request_frames
from mdp.policy import default_reactor, positive_seconds

#: Failures of one attempt after which the request is tried on another broker.
RETRY_ELSEWHERE = (RequestTimeout, BrokerUnreachable, TransportError, ServiceUnavailable,
                   ServiceOverloaded, DeadlineExceeded)
#: Of those, the broker's own: it is passed over for every service (the others: for the one).
BROKER_FAILED = (RequestTimeout, BrokerUnreachable, TransportError)
#: Seconds a broker that failed an attempt is passed over while another has not.
DEFAULT_AVOID = 5.0
#: Failures remembered (by broker, and by broker and service) before old ones are dropped.
MOST_REMEMBERED = 4096


def least_outstanding(endpoints: Sequence[str], outstanding: Counter[str], failedAt: dict[str, float],
                      now: float, avoid: float, turn: int, probing: Collection[str] = ()) -> str:
    """The broker for the next attempt: of those that have not failed in the last *avoid*
    seconds and are not *probing* with a request out already (all, if none is left), the one
    with the fewest *outstanding*; ties go round, starting at broker *turn*.  A broker that
    failed is *probing* until a request through it succeeds: one request at a time finds out
    whether it is back, instead of a share of them."""
    start = turn % len(endpoints)
    order = [*endpoints[start:], *endpoints[:start]]
    fresh = [e for e in order if now - failedAt.get(e, -math.inf) >= avoid
             and not (e in probing and outstanding[e] > 0)] or order
    return min(fresh, key=lambda e: outstanding[e])


def _why(failure: Exception, endpoint: str) -> str:
    """Why an attempt at *endpoint* failed, in a few words ("" for a timeout)."""
    if isinstance(failure, RequestTimeout):
        return ""
    if isinstance(failure, BrokerUnreachable):
        return failure.failures.get(endpoint, "unreachable")
    return str(failure)


class SpreadClient:
    """A :class:`~mdp.Client` of each of *endpoints* (brokers side by side).  A request makes
    up to *retries* attempts (as a Client's *retries* counts them) of *timeout* seconds each,
    each to the broker :func:`least_outstanding` picks; a broker that timed out or could not
    be reached is passed over *avoid* seconds for every service, one that answered ``503`` or
    ``429`` for that service.  *options* are each :class:`~mdp.Client`'s.  With *stamp* (the
    default) requests carry an idempotence stamp, which our workers take; give
    ``stamp=False`` for workers that would see it as frames of the body."""

    def __init__(self, endpoints: Union[str, Sequence[str]], reactor: Optional[Any] = None, *,
                 timeout: float = DEFAULT_TIMEOUT, retries: int = DEFAULT_RETRIES, stamp: bool = True,
                 avoid: float = DEFAULT_AVOID, **options: Any) -> None:
        _check_attempts(timeout, retries)
        self.reactor = default_reactor(reactor)
        self.endpoints = transport.endpoint_list(endpoints)
        self.timeout, self.retries = timeout, retries
        self.stamp = stamp
        self.avoid = positive_seconds("avoid", avoid)
        #: each broker's client
        self.clients = {e: Client(e, self.reactor, timeout=timeout, retries=1, **options)
                        for e in self.endpoints}
        #: requests out at each broker now, and sent to it in all
        self.outstanding: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self._failedAt: dict[Any, float] = {}  # by broker, and by (broker, service)
        #: brokers (and (broker, service)) that failed, until a request through them succeeds
        self._probing: set[Any] = set()
        self._turns = itertools.count()
        self._clientId = uuid.uuid4().bytes
        self._sequence = itertools.count()

    def request(self, service: Union[str, bytes], *frames: Any, timeout: Optional[float] = None,
                retries: Optional[int] = None,
                onPartial: Optional[Callable[[list[bytes]], Any]] = None) -> defer.Deferred[list[bytes]]:
        """The reply of *service* to *frames*, from whichever broker's workers serve it; a
        streamed reply's PARTIALs go to *onPartial*, and a stream that fails part-way is not
        tried on another broker (its parts would come twice)."""
        name = api_service_name(service)
        mmi = name.startswith(b"mmi.")
        body = request_frames(frames, empty=mmi)  # (a caller's mistake raises here)
        if self.stamp and not mmi:
            body = stamp(self._clientId, next(self._sequence), body)
        attempts = self.retries if retries is None else retries
        _check_attempts(self.timeout if timeout is None else timeout, attempts)
        return defer.ensureDeferred(self._request(name, body, timeout, attempts, onPartial))

    async def _request(self, service: bytes, body: list[bytes], timeout: Optional[float],
                       attempts: int, onPartial: Optional[Callable[[list[bytes]], Any]]) -> list[bytes]:
        failure: Optional[Exception] = None
        parts: list[None] = []  # (one for each PARTIAL heard)

        def partial(frames: list[bytes]) -> Any:
            parts.append(None)
            return onPartial(frames)  # type: ignore[misc]

        startedAt = self.reactor.seconds()
        tried: dict[str, str] = {}  # each broker tried, and why it failed unless it timed out
        for _ in range(attempts):
            now = self.reactor.seconds()
            failed = {e: max(self._failedAt.get(e, -math.inf), self._failedAt.get((e, service), -math.inf))
                      for e in self.endpoints}
            probing = [e for e in self.endpoints if e in self._probing or (e, service) in self._probing]
            endpoint = least_outstanding(self.endpoints, self.outstanding, failed, now, self.avoid,
                                         next(self._turns), probing)
            self.outstanding[endpoint] += 1
            self.sent[endpoint] += 1
            try:
                reply = await self.clients[endpoint].request(
                    service, *body, timeout=timeout, retries=1,
                    onPartial=None if onPartial is None else partial)
            except RETRY_ELSEWHERE as e:
                if parts:
                    raise
                failure = e
                tried[endpoint] = _why(e, endpoint)
                key = endpoint if isinstance(e, BROKER_FAILED) else (endpoint, service)
                if not isinstance(e, DeadlineExceeded):  # (the handler's time, not the broker's)
                    self._failed(key)
            else:
                self._probing.difference_update((endpoint, (endpoint, service)))
                return reply
            finally:
                self.outstanding[endpoint] -= 1
        assert failure is not None
        if isinstance(failure, BROKER_FAILED):  # (not the service's own answer: name every broker)
            raise RequestTimeout(service, attempts, self.reactor.seconds() - startedAt, list(tried),
                                 failures={e: why for e, why in tried.items() if why})
        raise failure

    def _failed(self, key: Any) -> None:
        now = self.reactor.seconds()
        if len(self._failedAt) >= MOST_REMEMBERED:  # (one per service at most: bounded)
            stale = [k for k, at in self._failedAt.items() if now - at >= 10 * self.avoid]
            for k in stale:
                del self._failedAt[k]
                self._probing.discard(k)
        self._failedAt[key] = now
        self._probing.add(key)

    def close(self) -> defer.Deferred[None]:
        """Close each broker's client (what is in flight fails with ClientClosed)."""
        closing = [client.close() for client in self.clients.values()]
        return defer.gatherResults(closing, consumeErrors=True).addCallback(lambda _: None)
