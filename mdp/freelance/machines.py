"""The Freelance clients' decisions, one machine per model: events with their
time in, actions out; no reactor, no transport, no Deferred (docs/freelance.md
has their tables)."""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from typing import Any, Optional, Sequence

import attrs

from mdp import messages
from mdp.errors import ClientClosed, NoServerAvailable, RemoteError, RequestTimeout, ServiceOverloaded
from mdp.machine import Machine, action_type
from mdp.policy import HeartbeatPolicy, Liveness, positive_seconds

PING = b"PING"
PONG = b"PONG"
SERVICE = b"freelance"  # what RequestTimeout names


#: where a client's request is: WAITING for a server (model 3 only), SENT (an attempt and its
#: timer run), DONE (answered, failed, timed out, cancelled or closed: a late reply is dropped)
RequestState = enum.Enum("RequestState", {"WAITING": "waiting", "SENT": "sent", "DONE": "done"})
#: what the agent (model 3) believes of one server: UNKNOWN (not heard from yet), ALIVE
#: (heard from within ``heartbeat.expiry``: gets requests), SUSPECT (let an attempt time out
#: or answered 429: no requests until it speaks again), DEAD (silent beyond
#: ``heartbeat.expiry``).  All are PINGed; only ALIVE ones get requests.
ServerState = enum.Enum("ServerState", {"UNKNOWN": "unknown", "ALIVE": "alive", "SUSPECT": "suspect",
                                        "DEAD": "dead"})


def remote_error(body: Sequence[bytes]) -> Optional[RemoteError]:
    """The :class:`~mdp.errors.RemoteError` a reply body stands for, or ``None``."""
    return messages.remote_error(SERVICE, body)


@attrs.define(eq=False)
class _Call:
    """One request: its attempts and where it is."""

    sequence: bytes
    body: list[bytes]
    startedAt: float
    timeout: float  # seconds per attempt
    deadline: Optional[float]  # seconds for the whole request, or None
    state: RequestState = RequestState.WAITING
    attempts: int = 0
    tried: list[str] = attrs.Factory(list)  # model 3: servers tried in this round
    server: Optional[str] = None  # where the current attempt went
    round: list[str] = attrs.Factory(list)  # model 1: the servers it goes to, in turn
    refusals: set[Any] = attrs.Factory(set)  # model 2: servers that answered 429 this round


DEADLINE, ATTEMPT = "deadline", "attempt"  # the two timers of a request


#: call ``handleTimer(call, kind)`` after *delay* seconds (replacing a pending one)
Later = action_type(__name__, "Later", "call", "kind", "delay")
#: forget that timer of *call*, if pending
Cancel = action_type(__name__, "Cancel", "call", "kind")
ClosePipe = action_type(__name__, "ClosePipe", "key")
#: add *endpoint* to the connecting router (model 3)
ConnectPeer = action_type(__name__, "ConnectPeer", "endpoint")
#: the request's outcome: its reply's frames, or an error
Resolve = action_type(__name__, "Resolve", "call", "frames")
Reject = action_type(__name__, "Reject", "call", "error")
#: the agent's view of the server at *endpoint* is now *state* (model 3)
ServerChanged = action_type(__name__, "ServerChanged", "endpoint", "state")


def _call_action(name: str, *fields: str) -> Any:
    """An action with *fields*, then its request (``call``: not compared, None for a PING)."""
    made = {**{field: attrs.field() for field in fields},
            "call": attrs.field(default=None, eq=False, repr=False)}
    kind = attrs.make_class(name, made, slots=True, weakref_slot=False)
    kind.__module__ = __name__
    return kind


#: open a connection to *endpoint*, known as *key*; replies go to ``handleReply``
OpenPipe = _call_action("OpenPipe", "key", "endpoint")
SendPipe = _call_action("SendPipe", "key", "frames")
#: send *frames* to the server at *endpoint* through the router (model 3)
SendPeer = _call_action("SendPeer", "endpoint", "frames")


Action = Any  # Later | Cancel | OpenPipe | ClosePipe | SendPipe | ConnectPeer | SendPeer | ...


class FreelanceMachine(Machine):
    """What the three models decide alike (sequence numbers, pending requests, the deadline,
    replies, close); each model's subclass adds its rules: ``_start``, ``_attemptOver``,
    ``_overloaded`` (a 429), ..."""

    def __init__(self, timeout: float, deadline: Optional[float], now: float = 0.0) -> None:
        super().__init__(now)
        self.timeout = positive_seconds("timeout", timeout)
        self.deadline = None if deadline is None else positive_seconds("deadline", deadline)
        self.endpoints: list[str] = []
        self.pending: dict[bytes, _Call] = {}
        self._sequence = itertools.count(1)
        self.closed = False

    def refusal(self) -> Optional[Exception]:
        """Why a new request fails at once, if it does."""
        if self.closed:
            return ClientClosed("client is closed")
        if not self.endpoints:
            return NoServerAvailable("no Freelance server configured")
        return None

    def newCall(self, body: list[bytes], timeout: float, deadline: Optional[float]) -> _Call:
        """A request with the next sequence number, starting now."""
        return _Call(str(next(self._sequence)).encode(), body, self.now, timeout, deadline)

    def handleConnect(self, endpoint: str, now: float) -> list[Action]:
        """A server to use (already checked)."""
        self.now = now
        if endpoint not in self.endpoints:
            self.endpoints.append(endpoint)
            self._connected(endpoint)
        return self._drain()

    def handleRequest(self, call: _Call, now: float) -> list[Action]:
        """Start *call* (made by :meth:`newCall`; :meth:`refusal` said yes)."""
        self.now = call.startedAt = now
        self.pending[call.sequence] = call
        if call.deadline is not None:
            self._outbox.append(Later(call, DEADLINE, call.deadline))
        self._start(call)
        return self._drain()

    def handleReply(self, frames: list[bytes], now: float, endpoint: Optional[str] = None) -> list[Action]:
        """A ``[sequence, reply...]`` from *endpoint* (if known); stale ones are dropped."""
        self.now = now
        self._reply(frames, endpoint)
        return self._drain()

    def handleTimer(self, call: _Call, kind: str, now: float) -> list[Action]:
        self.now = now
        if call.state is not RequestState.DONE:
            (self._expired if kind == DEADLINE else self._attemptOver)(call)
        return self._drain()

    def handleCancel(self, call: _Call, now: float) -> list[Action]:
        """The caller cancelled *call*: forget it."""
        self.now = now
        self._finish(call)
        return self._drain()

    def handleClose(self, now: float) -> list[Action]:
        self.now = now
        self.closed = True
        for call in list(self.pending.values()):
            self._fail(call, ClientClosed("client closed"))
        return self._drain()

    def _connected(self, endpoint: str) -> None:
        """A model's own work for a server added."""

    def _finish(self, call: _Call) -> bool:
        """*call* is DONE: forget it; False if it already was."""
        if call.state is RequestState.DONE:
            return False
        call.state = RequestState.DONE
        del self.pending[call.sequence]
        self._outbox += [Cancel(call, DEADLINE), Cancel(call, ATTEMPT)]
        return True

    def _expired(self, call: _Call) -> None:
        self._fail(call, RequestTimeout(SERVICE, call.attempts, self.now - call.startedAt))

    def _fail(self, call: _Call, error: Exception) -> None:
        if self._finish(call):
            self._outbox.append(Reject(call, error))

    def _reply(self, frames: list[bytes], endpoint: Optional[str] = None) -> bool:
        """A reply; True if a 429 for a pending request (nothing ran: another server may)."""
        if len(frames) < 2:
            return False
        call = self.pending.get(frames[0])
        if call is None or call.state is RequestState.DONE:
            return False
        body = frames[1:]
        error = remote_error(body)
        if isinstance(error, ServiceOverloaded):
            self._overloaded(call, error, endpoint)
            return True
        if self._finish(call):
            self._outbox.append(Resolve(call, body) if error is None else Reject(call, error))
        return False


class SequentialMachine(FreelanceMachine):
    """Model 1's rules: each server in turn, each attempt on a fresh pipe (open
    while ``call.server`` is set)."""

    def _start(self, call: _Call) -> None:
        call.round = list(self.endpoints)
        self._next(call)

    def _overloaded(self, call: _Call, error: ServiceOverloaded, endpoint: Optional[str]) -> None:
        if call.attempts < len(call.round):
            self._next(call)  # the next server, at once
        else:
            self._fail(call, error)

    def _next(self, call: _Call) -> None:
        self._drop(call)
        if call.attempts >= len(call.round):
            self._expired(call)
            return
        call.server = endpoint = call.round[call.attempts]
        call.attempts += 1
        call.state = RequestState.SENT
        self._outbox += [OpenPipe(call.sequence, endpoint, call),
                         SendPipe(call.sequence, [call.sequence, *call.body], call),
                         Later(call, ATTEMPT, call.timeout)]

    _attemptOver = _next  # the next server

    def _drop(self, call: _Call) -> None:
        if call.server is not None:
            call.server = None
            self._outbox.append(ClosePipe(call.sequence))

    def _finish(self, call: _Call) -> bool:
        finished = super()._finish(call)
        self._drop(call)
        return finished


class ShotgunMachine(FreelanceMachine):
    """Model 2's rules: one pipe per server (keyed by its endpoint), every request to all."""

    def _connected(self, endpoint: str) -> None:
        self._outbox.append(OpenPipe(endpoint, endpoint))

    def _start(self, call: _Call) -> None:
        call.attempts = len(self.endpoints)
        call.state = RequestState.SENT
        self._outbox += [SendPipe(endpoint, [call.sequence, *call.body], call) for endpoint in self.endpoints]
        self._outbox.append(Later(call, ATTEMPT, call.timeout))

    _attemptOver = FreelanceMachine._expired  # its one attempt is the whole request

    def _overloaded(self, call: _Call, error: ServiceOverloaded, endpoint: Optional[str]) -> None:
        # fail once every server said 429, counted by server (unknown origin: alone)
        call.refusals.add(object() if endpoint is None else endpoint)
        if len(call.refusals) >= call.attempts:
            self._fail(call, error)

    def handleClose(self, now: float) -> list[Action]:
        pipes = [] if self.closed else [ClosePipe(endpoint) for endpoint in self.endpoints]
        return super().handleClose(now) + pipes


@attrs.define(eq=False)
class KnownServer:
    """What the agent knows of one server: its state and liveness."""

    endpoint: str
    liveness: Liveness
    state: ServerState = ServerState.UNKNOWN


class AgentMachine(FreelanceMachine):
    """Model 3's rules (tabled in docs/freelance.md): PING every ``heartbeat.interval``,
    requests only to ALIVE servers."""

    def __init__(self, heartbeat: HeartbeatPolicy, timeout: float, deadline: Optional[float],
                 now: float = 0.0) -> None:
        if not isinstance(heartbeat, HeartbeatPolicy):
            raise TypeError(f"heartbeat is a HeartbeatPolicy, not {type(heartbeat).__name__}")
        super().__init__(timeout, deadline, now)
        self.heartbeat = heartbeat
        self.servers: OrderedDict[str, KnownServer] = OrderedDict()
        self.waiting: list[_Call] = []  # WAITING requests, oldest first

    wakeEvery = property(lambda self: self.heartbeat.interval)

    def live(self) -> list[str]:
        """The endpoints of the ALIVE servers, in the order they were added."""
        return [s.endpoint for s in self.servers.values() if s.state is ServerState.ALIVE]

    def _allDead(self) -> bool:
        return bool(self.servers) and all(s.state is ServerState.DEAD for s in self.servers.values())

    def refusal(self) -> Optional[Exception]:
        if not self.closed and self._allDead():
            return NoServerAvailable(
                f"all {len(self.servers)} Freelance servers are dead: {', '.join(self.servers)}")
        return super().refusal()

    def handleMessage(self, endpoint: str, frames: list[bytes], now: float) -> list[Action]:
        """A PONG or a reply from the server at *endpoint*: it is ALIVE."""
        self.now = now
        server = self.servers.get(endpoint)
        if server is not None:
            server.liveness.heard(now)
            # the reply first: the server's coming back then sends only what still waits
            if frames == [PONG] or not self._reply(frames, endpoint):
                self._becomes(server, ServerState.ALIVE)
        return self._drain()

    def handleTick(self, now: float) -> list[Action]:
        """Servers silent beyond ``heartbeat.expiry`` become DEAD; PING all; if all
        are DEAD, fail what is pending with NoServerAvailable."""
        self.now = now
        for server in list(self.servers.values()):
            if server.state is not ServerState.DEAD and server.liveness.dead(now):
                self._becomes(server, ServerState.DEAD)
            self._ping(server)
        if self._allDead():
            for call in list(self.pending.values()):
                self._fail(call, NoServerAvailable("every Freelance server is dead"))
        return self._drain()

    def _connected(self, endpoint: str) -> None:
        server = self.servers[endpoint] = KnownServer(endpoint, Liveness(self.heartbeat, self.now))
        self._outbox.append(ConnectPeer(endpoint))
        self._ping(server)

    def _ping(self, server: KnownServer) -> None:
        self._outbox.append(SendPeer(server.endpoint, [PING]))
        server.liveness.sent(self.now)

    def _becomes(self, server: KnownServer, state: ServerState) -> None:
        if server.state is state:
            return
        server.state = state
        self._emit(ServerChanged(server.endpoint, state))
        if state is ServerState.ALIVE:
            waiting, self.waiting = self.waiting, []
            for call in waiting:
                self._send(call)
        elif state is ServerState.DEAD:
            for call in list(self.pending.values()):
                if call.state is RequestState.SENT and call.server == server.endpoint:
                    self._send(call)  # do not wait for its attempt to time out

    def _send(self, call: _Call) -> None:
        """Send *call* to the first live server not tried this round (all tried: a
        new round); none live: WAITING."""
        self._outbox.append(Cancel(call, ATTEMPT))
        live = self.live()
        if not live:
            call.state = RequestState.WAITING
            self.waiting.append(call)
            return
        fresh = [e for e in live if e not in call.tried]
        if not fresh:
            call.tried = []
        call.server = endpoint = (fresh or live)[0]
        call.tried.append(endpoint)
        call.attempts += 1
        call.state = RequestState.SENT
        self._outbox += [SendPeer(endpoint, [call.sequence, *call.body], call),
                         Later(call, ATTEMPT, call.timeout)]

    _start = _send

    def _overloaded(self, call: _Call, error: ServiceOverloaded, endpoint: Optional[str]) -> None:
        """A 429: its server becomes SUSPECT and the request goes to a live server
        not tried this round; none: the 429 is the answer."""
        self._suspect(endpoint)
        if call.state is not RequestState.SENT or call.server != endpoint:
            return  # for an earlier attempt: the current one goes on
        if any(e not in call.tried for e in self.live()):
            self._send(call)
        else:
            self._fail(call, error)

    def _attemptOver(self, call: _Call) -> None:
        """An unanswered attempt: its server becomes SUSPECT; try another."""
        self._suspect(call.server)
        self._send(call)

    def _suspect(self, endpoint: Optional[str]) -> None:
        server = self.servers.get(endpoint or "")
        if server is not None and server.state is ServerState.ALIVE:
            self._becomes(server, ServerState.SUSPECT)

    def _finish(self, call: _Call) -> bool:
        if call.state is RequestState.WAITING:
            self.waiting.remove(call)
        return super()._finish(call)
