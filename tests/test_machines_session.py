"""The session machines alone: a client and a server machine joined by a
wire the test controls (it can cut the connection and lose what is in
flight), with the time given explicitly."""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mdp.session import codec
from mdp.session.codec import MalformedSession
from mdp.session.machines import (
    ClientSessionMachine,
    Deliver,
    Dropped,
    DropPeer,
    Expired,
    Full,
    Notice,
    Opened,
    Reconnect,
    Refusal,
    Send,
    SendTo,
    ServerSessionMachine,
    SessionQueueFull,
    Skipped,
    UnknownSession,
)


class Wire:
    """One client machine and one server machine; each connection has a
    new peer id on the server, as a new socket would."""

    def __init__(self, **client: Any) -> None:
        self.now = 0.0
        self.client = ClientSessionMachine(os.urandom(16), **client)
        self.server = ServerSessionMachine(expiry=30.0)
        self.peer = 0
        self.up = False
        self.toServer: list[list[bytes]] = []
        self.toClient: list[list[bytes]] = []
        self.atServer: list[tuple[bytes, ...]] = []
        self.atClient: list[tuple[bytes, ...]] = []
        self.events: list[Any] = []

    def _client(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Send) and self.up:
                self.toServer.append(action.frames)
            elif isinstance(action, Deliver):
                self.atClient.append(action.payload)
            else:
                self.events.append(action)

    def _server(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, SendTo):
                if self.up and action.peer == self.peer:
                    self.toClient.append(action.frames)
            elif isinstance(action, Deliver):
                self.atServer.append(action.payload)
                self.routingId = action.routingId
            else:
                self.events.append(action)

    def count(self, kind: type, server: bool) -> int:
        """The *kind* actions (Dropped, Skipped) of the server or the client."""
        return sum(1 for e in self.events if isinstance(e, kind) and bool(e.routingId) == server)

    def connect(self) -> None:
        self.peer += 1
        self.up = True
        self._client(self.client.handleConnected(self.now))

    def cut(self) -> None:
        """The connection breaks: what is in flight is lost."""
        self.up = False
        self.toServer.clear()
        self.toClient.clear()
        self._client(self.client.handleDisconnected(self.now))
        self._server(self.server.handlePeerGone(self.peer, self.now))

    def flow(self, steps: int = 10_000) -> None:
        for _ in range(steps):
            if self.toServer:
                self._server(self.server.handleMessage(self.peer, self.toServer.pop(0), self.now))
            elif self.toClient:
                self._client(self.client.handleMessage(self.toClient.pop(0), self.now))
            else:
                return

    def restartLosingWelcome(self, at: Optional[float] = None) -> None:
        """The connection breaks and the server restarts; the client connects
        again (at *at*, if given) and its HELLO reaches the new server, whose
        WELCOME (a new epoch) is lost."""
        self.cut()
        self.server = ServerSessionMachine(expiry=30.0)
        if at is not None:
            self.now = at
        self.connect()
        self.flow(steps=1)
        self.toClient.clear()

    def send(self, *payload: bytes) -> None:
        self._client(self.client.send(payload, self.now))

    def reply(self, routingId: int, *payload: bytes) -> None:
        self._server(self.server.reply(routingId, payload, self.now))

    def tick(self, to: float, reconnect: bool = False) -> None:
        """Time passes; with *reconnect*, a Reconnect is done as a driver
        does it (the connection dropped, a new one made)."""
        self.now = to
        before = len(self.events)
        self._client(self.client.handleTick(to))
        self._server(self.server.handleTick(to))
        if reconnect and any(isinstance(e, Reconnect) for e in self.events[before:]):
            self.cut()
            self.connect()


def test_codec_round_trip_and_refusals() -> None:
    messages = [codec.Hello(b"s" * 16, 3, 2), codec.Welcome(0), codec.Welcome(4, 2**63),
                codec.Hello(b"s" * 16, 3, 2, 9, 1000, 8), codec.Welcome(4, 5, 2**20, 0),
                codec.Data(1, 2, (b"a", b"")), codec.Skip(3, 2), codec.Ack(5),
                codec.Ping(2**64 - 1), codec.PingOk(0, 3), codec.Unknown(), codec.Refused("full")]
    for message in messages:
        assert codec.decode(codec.encode(message)) == message
    # a HELLO or WELCOME without limits (another make) says none
    assert codec.decode([b"SESS01", b"HELLO", b"s" * 16, bytes(8), bytes(8), bytes(8)]) == \
        codec.Hello(b"s" * 16, 0)
    assert codec.decode([b"SESS01", b"WELCOME", bytes(8), (1).to_bytes(8, "big")]) == \
        codec.Welcome(0, 1)
    assert codec.encode(codec.Data(1, 0, (b"x",))) == [b"SESS01", b"DATA", (1).to_bytes(8, "big"),
                                                      bytes(8), b"x"]
    for frames, reason in [([b"MDPC02"], "not a session"), ([b"SESS01", b"NOPE"], "unknown command"),
                           ([b"SESS01", b"DATA", bytes(8), bytes(8)], "numbered 0"),
                           ([b"SESS01", b"SKIP", bytes(8), bytes(8)], "numbered 0"),
                           ([b"SESS01", b"SKIP", bytes(8)], "not 2"),
                           ([b"SESS01", b"HELLO", b"s" * 16, bytes(8), bytes(8), bytes(8),
                             bytes(8)], "not 6"),
                           ([b"SESS01", b"HELLO", b"short", bytes(8), bytes(8), bytes(8)], "16 bytes"),
                           ([b"SESS01", b"WELCOME", bytes(8), bytes(8)], "epoch 0"),
                           ([b"SESS01", b"ACK", b"\x01"], "8 bytes, not 1"),
                           ([b"SESS01", b"PING"], "not 1"),
                           ([b"SESS01", b"UNKNOWN", b"x"], "not 0"),
                           ([b"SESS01", b"REFUSED", b"x" * 256], "at most 255 bytes")]:
        with pytest.raises(MalformedSession, match=reason):
            codec.decode(frames)


def test_messages_over_the_limits_the_other_side_said_go_as_skips() -> None:
    """Each side says in its HELLO or WELCOME the payload it takes; a DATA
    over it goes as a SKIP (now and at each resend), which the receiver
    counts and acknowledges: the message is lost, the ones after it come
    through, and nothing stays unacknowledged. Sides that say no limits
    send everything as DATA."""
    wire = Wire(limits=(1000, 4))
    wire.server.limits = (100, 0)
    wire.send(b"x" * 101)      # before the WELCOME: the server's limits are not known yet
    wire.send(b"fits")
    wire.connect()
    wire.flow()
    assert wire.atServer == [(b"fits",)]
    assert wire.count(Skipped, server=False) == 1 and wire.count(Dropped, server=True) == 1
    (session,) = wire.server.sessions.values()
    assert session.seq.peerLimits == (1000, 4)
    wire.reply(wire.routingId, *[b"f"] * 5)      # five frames, and it takes four
    wire.reply(wire.routingId, b"y" * 1001)
    wire.reply(wire.routingId, b"ok")
    wire.cut()                                  # lost in flight: resent at the next attach
    wire.connect()
    wire.flow()
    assert wire.atClient == [(b"ok",)]
    assert wire.count(Skipped, server=True) == 2 and wire.count(Dropped, server=False) == 2
    wire.tick(1.0)
    wire.flow()
    assert not session.seq.unacked and not wire.client.seq.unacked
    # a client saying no limits: everything goes as DATA
    quiet = Wire()
    quiet.connect()
    quiet.flow()
    quiet.send(b"x" * 5000)
    quiet.flow()
    assert quiet.atServer == [(b"x" * 5000,)]


def test_attach_opens_a_session_with_a_short_routing_id() -> None:
    wire = Wire()
    wire.connect()
    wire.flow()
    assert wire.client.state == "attached"
    assert [e for e in wire.events if isinstance(e, Opened)] == [Opened(1)]
    wire.send(b"hello")
    wire.flow()
    assert wire.atServer == [(b"hello",)] and wire.routingId == 1
    wire.reply(1, b"hi", b"there")
    wire.flow()
    assert wire.atClient == [(b"hi", b"there")]


def test_messages_sent_while_detached_are_delivered_once_attached() -> None:
    wire = Wire()
    wire.send(b"early 1")
    wire.send(b"early 2")
    wire.connect()
    wire.flow()
    assert wire.atServer == [(b"early 1",), (b"early 2",)]


def test_a_cut_is_a_lull_nothing_lost_nothing_twice_both_ways() -> None:
    wire = Wire()
    wire.connect()
    wire.flow()
    for n in range(50):
        wire.send(b"c%d" % n)
        wire.reply(1, b"s%d" % n)
        if n % 7 == 3:
            wire.flow(steps=5)  # part of it arrives, the rest is lost with the connection
            wire.cut()
            wire.connect()
    wire.flow()
    assert wire.atServer == [(b"c%d" % n,) for n in range(50)]
    assert wire.atClient == [(b"s%d" % n,) for n in range(50)]
    assert [e for e in wire.events if isinstance(e, Opened)] == [Opened(1)]  # one session


def test_duplicates_are_dropped() -> None:
    wire = Wire()
    wire.connect()
    wire.flow()
    wire.send(b"once")
    frames = list(wire.toServer)
    wire.flow()
    for copy in frames * 3:
        wire._server(wire.server.handleMessage(wire.peer, copy, 0))
    assert wire.atServer == [(b"once",)]


def test_acknowledged_messages_are_forgotten() -> None:
    wire = Wire()
    wire.connect()
    wire.flow()
    for n in range(100):
        wire.send(b"%d" % n)
    wire.flow()
    wire.tick(0.5)  # the server's pending ACK goes
    wire.flow()
    assert len(wire.client.seq.unacked) == 0


def test_idle_client_pings_at_most_liveness_times_then_reconnects() -> None:
    wire = Wire(pingInterval=1.0, liveness=3)
    wire.connect()
    wire.flow()
    wire.up = False  # the server hears nothing more, and says nothing
    pings = []
    for t in range(1, 10):
        wire.toServer.clear()
        wire.up = True
        wire.tick(float(t))
        pings.append(sum(1 for f in wire.toServer if f[1] == codec.PING))
        wire.toServer.clear()
        if any(isinstance(e, Reconnect) for e in wire.events):
            break
    assert pings[:2] == [1, 1] and sum(pings) <= 3
    reconnect = [e for e in wire.events if isinstance(e, Reconnect)]
    assert len(reconnect) == 1 and wire.now == 3.0 and "nothing from the server" in reconnect[0].reason


def test_an_answering_server_keeps_the_client_attached() -> None:
    wire = Wire(pingInterval=1.0, liveness=3)
    wire.connect()
    wire.flow()
    for t in range(1, 30):
        wire.tick(float(t))
        wire.flow()
    assert not any(isinstance(e, Reconnect) for e in wire.events)
    assert not any(isinstance(e, Expired) for e in wire.events)


def test_silent_sessions_expire_and_the_client_attaches_anew() -> None:
    wire = Wire(pingInterval=100.0, liveness=3)
    wire.connect()
    wire.flow()
    wire.tick(29.0)
    assert not any(isinstance(e, Expired) for e in wire.events)
    wire.tick(30.0)
    assert [e for e in wire.events if isinstance(e, Expired)] == [Expired(1)]
    with pytest.raises(UnknownSession):
        wire.reply(1, b"too late")
    wire.send(b"after")  # the server answers UNKNOWN; the client says HELLO again
    wire.flow()
    assert [e for e in wire.events if isinstance(e, Opened)] == [Opened(1), Opened(2)]
    assert wire.atServer == [(b"after",)]


def test_the_queue_is_bounded() -> None:
    wire = Wire(maxQueued=3)
    for n in range(3):
        wire.send(b"%d" % n)
    with pytest.raises(SessionQueueFull, match="3 messages .* already wait"):
        wire.send(b"one too many")


def test_a_bound_of_one_is_room_for_one_and_a_bound_below_one_is_refused() -> None:
    """``maxQueued=1``: an empty session has room (half of 1 taken as 1), so
    a sender waiting for room is not kept waiting for ever; a bound below
    one message or one byte is refused when the machine is made."""
    client = ClientSessionMachine(bytes(16), maxQueued=1)
    assert client.seq.hasRoom
    client.send((b"x",), 0)
    assert not client.seq.hasRoom
    with pytest.raises(SessionQueueFull):
        client.send((b"y",), 0)
    client.seq.acked(1)
    assert client.seq.hasRoom
    assert ClientSessionMachine(bytes(16), maxQueuedBytes=1).seq.hasRoom
    for bad in ({"maxQueued": 0}, {"maxQueued": -1}, {"maxQueuedBytes": 0}):
        with pytest.raises(ValueError, match="at least 1"):
            ClientSessionMachine(bytes(16), **bad)
        with pytest.raises(ValueError, match="at least 1"):
            ServerSessionMachine(**bad)


def test_malformed_input_is_dropped_and_unknown_connections_told() -> None:
    server = ServerSessionMachine()
    (drop,) = server.handleMessage("p", [b"junk"], 0)
    assert isinstance(drop, DropPeer) and drop.peer == "p"  # its connection closed
    assert "not a session message" in drop.reason
    actions = server.handleMessage("q", codec.encode(codec.Data(1, 0, (b"x",))), 0)
    assert actions == [SendTo("q", codec.encode(codec.Unknown()))]
    client = ClientSessionMachine(bytes(16))
    (notice,) = client.handleMessage([b"junk"], 0)  # dropped, and said so
    assert isinstance(notice, Notice) and "not a session message" in notice.text


def drops(actions: list) -> list:
    return [(a.peer, a.reason) for a in actions if isinstance(a, DropPeer)]


def test_no_connection_holds_a_slot_without_a_session() -> None:
    """A session that ends closes its connection; a connection that goes on
    without one (PINGs only, say) is closed after the expiry; one a session
    moved away from is closed at once."""
    server = ServerSessionMachine(expiry=30)
    hello = codec.encode(codec.Hello(b"a" * 16, 0))
    server.handleMessage("c1", hello, 0)
    # the client attaches on a new connection: the one left behind is closed
    assert drops(server.handleMessage("c2", hello, 1)) == [
        ("c1", "its session 1 moved to another connection")]
    # a connection that only pings, never says HELLO
    ping = codec.encode(codec.Ping(0))
    assert server.handleMessage("idle", ping, 2) == [SendTo("idle", codec.encode(codec.Unknown()))]
    server.handleMessage("idle", ping, 20)
    server.handleMessage("c2", ping, 20)  # the session is alive
    assert drops(server.handleTick(31)) == []
    assert drops(server.handleTick(32)) == [("idle", "no session attached within 30s")]
    # the session falls silent: it ends, and its connection is closed
    actions = server.handleTick(50)
    assert drops(actions) == [("c2", "its session 1 ended: silent for 30s")]
    assert server.sessions == {} and server.handleTick(100) == []


def test_a_session_ended_for_being_full_closes_its_connection() -> None:
    server = ServerSessionMachine(maxQueued=1)
    server.handleMessage("c", codec.encode(codec.Hello(b"a" * 16, 0)), 0)
    assert drops(server.end(1, 1)) == [("c", "its session 1 ended: it could not hold what it "
                                             "was given")]


def test_connections_without_a_session_are_bounded() -> None:
    from mdp.session.machines import MAX_UNATTACHED

    server = ServerSessionMachine()
    ping = codec.encode(codec.Ping(0))
    for n in range(MAX_UNATTACHED):
        assert not drops(server.handleMessage(n, ping, 0))
    assert drops(server.handleMessage("one more", ping, 0)) == [
        (0, f"more than {MAX_UNATTACHED} connections without a session")]


def test_sessions_are_bounded() -> None:
    server = ServerSessionMachine(maxSessions=2)
    full = [a for n in range(5) for a in server.handleMessage(
        n, codec.encode(codec.Hello(bytes([n]) * 16, 0)), 0) if isinstance(a, Full)]
    assert len(server.sessions) == 2 and full == [Full(2, 2), Full(3, 2), Full(4, 2)]
    # a refused HELLO is answered (at most once a second a connection)
    refused = codec.encode(codec.Refused("the server holds 2 sessions, all it may (maxSessions)"))
    assert server.handleMessage(9, codec.encode(codec.Hello(b"\x09" * 16, 0)), 10) == [
        Full(9, 2), SendTo(9, refused)]
    assert server.handleMessage(9, codec.encode(codec.Hello(b"\x09" * 16, 0)), 10.5) == [
        Full(9, 2)]
    assert len(codec.encode(codec.Refused("\u00e9" * 200))[2]) <= codec.MAX_REASON_BYTES


def test_a_refused_connection_is_closed_after_the_expiry() -> None:
    """A connection whose HELLO was refused (maxSessions) holds no session:
    as any other without one, it is closed once it has gone on so for the
    expiry, asking again meanwhile or not; it does not hold a connection
    slot for ever."""
    server = ServerSessionMachine(expiry=30, maxSessions=1)
    server.handleMessage("held", codec.encode(codec.Hello(b"a" * 16, 0)), 0)
    refused = codec.encode(codec.Hello(b"b" * 16, 0))
    full = server.handleMessage("refused", refused, 1)
    ping = codec.encode(codec.Ping(0))
    for t in range(2, 31):
        server.handleMessage("held", ping, t)  # the session it waits for stays alive
        if t % 10 == 0:
            full += server.handleMessage("refused", refused, t)  # asking again
        assert drops(server.handleTick(t)) == []
    assert drops(server.handleTick(31)) == [("refused", "no session attached within 30s")]
    assert list(server.byPeer) == ["held"]
    assert [a for a in full if isinstance(a, Full)] == [Full("refused", 1)] * 4


def test_routing_ids_wrap_within_four_bytes_past_those_in_use() -> None:
    """Routing ids are reported in 4 bytes: after the last, they start from
    1 again, past the ids of sessions that still last (the 2**32nd session
    made every delivery on it fail)."""
    from mdp.session.machines import MAX_ROUTING_ID

    server = ServerSessionMachine()
    opened = []
    for n, now in ((1, 0), (2, 1), (3, 2)):
        actions = server.handleMessage(n, codec.encode(codec.Hello(bytes([n]) * 16, 0)), now)
        opened += [a.routingId for a in actions if isinstance(a, Opened)]
        if n == 1:
            server._routingIds = MAX_ROUTING_ID - 1  # as after that many sessions
    assert MAX_ROUTING_ID == 2**32 - 1
    assert opened == [1, MAX_ROUTING_ID, 2]  # 1 is in use, and 0 is never one
    assert set(server.byRouting) == {1, 2, MAX_ROUTING_ID}


def test_one_connection_holds_one_session_it_opened() -> None:
    """A client never opens two sessions on one connection; one that does
    ends the first, so one connection cannot take every slot.  A session it
    opened that another connection holds now (its client reconnected) stays."""
    server = ServerSessionMachine()
    server.handleMessage("a", codec.encode(codec.Hello(b"1" * 16, 0)), 0)
    first = server.sessions[b"1" * 16].routingId
    actions = server.handleMessage("a", codec.encode(codec.Hello(b"2" * 16, 0)), 1)
    assert Expired(first) in actions and set(server.sessions) == {b"2" * 16}
    server.handleMessage("b", codec.encode(codec.Hello(b"2" * 16, 0)), 2)  # moved to b
    actions = server.handleMessage("a", codec.encode(codec.Hello(b"3" * 16, 0)), 3)
    assert not any(isinstance(a, Expired) for a in actions)
    assert set(server.sessions) == {b"2" * 16, b"3" * 16}
    for n in range(100, 200):  # a flood from one connection keeps one session
        server.handleMessage("a", codec.encode(codec.Hello(bytes([n]) * 16, 0)), 4)
    assert len(server.sessions) == 2 and server.byPeer["a"].session == bytes([199]) * 16
    server.handlePeerGone("a", 5)
    assert server._opened == {}
    # nor can two connections pass sessions between them to hold more
    pair = ServerSessionMachine()
    for n in range(100, 150):
        hello = codec.encode(codec.Hello(bytes([n]) * 16, 0))
        pair.handleMessage("p", hello, 6)  # p opens it...
        pair.handleMessage("q", hello, 6)  # ...q takes it over, leaving its last one
    assert len(pair.sessions) <= 2


def test_a_refused_client_says_so_and_asks_again() -> None:
    client = ClientSessionMachine(b"c" * 16, pingInterval=1.0)
    client.handleConnected(0)
    refused = codec.encode(codec.Refused("full"))
    assert client.handleMessage(refused, 0.1) == [Refusal("full")]
    assert client.state == "attaching"
    [hello] = client.handleTick(1.1)
    assert isinstance(hello, Send) and hello.frames[1] == codec.HELLO
    client.handleMessage(codec.encode(codec.Welcome(0, 7)), 1.2)
    assert client.state == "attached"
    assert client.handleMessage(refused, 1.3) == []  # only an answer to a HELLO counts
    server = ServerSessionMachine()  # and a client that says REFUSED is ignored
    server.handleMessage("a", codec.encode(codec.Hello(b"1" * 16, 0)), 0)
    assert server.handleMessage("a", refused, 1) == []


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["send", "reply", "flow", "cut", "tick"]),
                          st.integers(0, 6)), max_size=60))
def test_any_schedule_of_cuts_delivers_everything_once_in_order(script: list[tuple[str, int]]) -> None:
    wire = Wire(pingInterval=1.0, liveness=3)
    wire.connect()
    wire.flow()
    sent = replied = 0
    for op, n in script:
        if op == "send":
            wire.send(b"c%d" % sent)
            sent += 1
        elif op == "reply":
            wire.reply(1, b"s%d" % replied)
            replied += 1
        elif op == "flow":
            wire.flow(steps=n)
        elif op == "cut":
            wire.cut()
            wire.connect()
        else:
            wire.tick(wire.now + 0.5, reconnect=True)
    wire.flow()
    assert wire.atServer == [(b"c%d" % n,) for n in range(sent)]
    assert wire.atClient == [(b"s%d" % n,) for n in range(replied)]


def test_messages_lost_without_a_cut_are_sent_again_after_a_new_hello() -> None:
    """ZeroMQ may lose messages with a connection it rebuilds unseen: a gap in
    the numbers makes the client attach again, and both sides resend."""
    wire = Wire()
    wire.connect()
    wire.flow()
    wire.now = 5.0  # a while after attaching
    for n in range(5):
        wire.send(b"c%d" % n)
        wire.reply(1, b"s%d" % n)
    del wire.toServer[1]  # c1 vanishes
    del wire.toClient[2]  # s2 vanishes
    wire.flow()
    wire.tick(6.5)  # what the throttled UNKNOWNs did not heal, the next PING does
    wire.flow()
    assert wire.atServer == [(b"c%d" % n,) for n in range(5)]
    assert wire.atClient == [(b"s%d" % n,) for n in range(5)]


def test_the_last_messages_lost_unseen_are_found_by_the_next_ping() -> None:
    """No later message reveals a gap: the idle client's PING does (its answer
    says what the server has, and what it sent)."""
    wire = Wire(pingInterval=1.0)
    wire.connect()
    wire.flow()
    wire.send(b"last from client")
    wire.reply(1, b"last from server")
    wire.toServer.clear()
    wire.toClient.clear()
    wire.tick(1.0)
    wire.flow()
    assert wire.atServer == [(b"last from client",)]
    assert wire.atClient == [(b"last from server",)]


def test_a_server_that_forgot_the_session_starts_afresh_and_gets_what_is_held() -> None:
    """The server restarted: the client's next numbers continue, the new
    session takes them from there, and the server's numbering starts at 1."""
    wire = Wire()
    wire.connect()
    wire.flow()
    for n in range(3):
        wire.send(b"before %d" % n)
        wire.reply(1, b"answer %d" % n)
    wire.flow()
    wire.tick(0.5)
    wire.flow()
    wire.cut()
    wire.server = ServerSessionMachine(expiry=30.0)  # restarted: no sessions
    wire.send(b"while down")
    wire.connect()
    wire.flow()
    wire.reply(1, b"from the new server")
    wire.flow()
    assert wire.atServer[-1:] == [(b"while down",)]
    assert wire.atClient[-1:] == [(b"from the new server",)]
    assert wire.client.seq.received == 1


def test_a_lost_welcome_from_a_restarted_server_loses_nothing() -> None:
    """The first WELCOME of the new incarnation is lost; the client's next
    HELLO still ends with its count started afresh (the epoch says so)."""
    wire = Wire()
    wire.connect()
    wire.flow()
    for n in range(3):
        wire.reply(1, b"old %d" % n)
    wire.flow()
    wire.restartLosingWelcome()
    wire.reply(1, b"new 1")
    wire.reply(1, b"new 2")
    wire.cut()
    wire.connect()
    wire.flow()
    assert wire.atClient[-2:] == [(b"new 1",), (b"new 2",)]


def test_a_gap_that_cannot_heal_does_not_storm() -> None:
    """A server that never gets one message: HELLOs stay at about one a
    second, not one per message."""
    wire = Wire(pingInterval=1.0)
    wire.connect()
    wire.flow()
    hellos = 0
    original = wire.server.handleMessage

    def lossy(peer: Any, frames: list[bytes], now: float) -> Any:
        nonlocal hellos
        if frames[1] == codec.HELLO:
            hellos += 1
        if frames[1] == codec.DATA and codec.decode(frames).seq == 3:
            return []  # this one never arrives
        return original(peer, frames, now)

    wire.server.handleMessage = lossy  # type: ignore[method-assign]
    for n in range(2000):
        wire.send(b"%d" % n)
        if n % 100 == 0:
            wire.tick(wire.now + 0.1)
        wire.flow(steps=50)
    assert hellos <= 25  # 2000 messages over 2 s: a few HELLOs, not thousands


def test_data_before_a_lost_welcome_is_dropped_then_delivered_once() -> None:
    """The first WELCOME is lost while the DATA after it arrive (ZeroMQ may
    lose one message and deliver the next): the client, not knowing the
    server's epoch yet, neither delivers nor acknowledges them; it says
    HELLO again after a ping interval, and the server's resend after the
    WELCOME brings each once (it was delivered at once, then again after
    the WELCOME started the count afresh)."""
    wire = Wire(pingInterval=1.0)
    wire.connect()
    wire.flow(steps=1)                  # the HELLO arrives
    assert [f[1] for f in wire.toClient] == [codec.WELCOME]
    wire.toClient.clear()               # its WELCOME is lost
    wire.reply(1, b"s0")
    wire.reply(1, b"s1")
    wire.flow()
    assert wire.atClient == [] and wire.client.state == "attaching"
    assert not wire.toServer            # nothing acknowledged either
    wire.tick(1.0)                      # no WELCOME within a ping interval: HELLO again
    assert [f[1] for f in wire.toServer] == [codec.HELLO]
    wire.flow()
    assert wire.atClient == [(b"s0",), (b"s1",)]
    wire.tick(2.0)
    wire.flow()
    assert not wire.server.byRouting[1].seq.unacked


def test_a_lost_welcome_after_a_restart_loses_nothing_among_later_messages() -> None:
    """A restarted server's WELCOME (a new epoch) is lost, and more than
    ACK_EVERY of its DATA arrive on the same connection: taken before the
    WELCOME, they were numbered on from the old epoch's count, acknowledged
    so (the server forgot them unseen), then the WELCOME reset the count:
    some came twice and out of order, the rest never (a gap that never
    healed). Now each comes once, in order, after the next HELLO."""
    wire = Wire(pingInterval=1.0)
    wire.connect()
    wire.flow()
    for n in range(10):
        wire.reply(1, b"old %d" % n)
    wire.flow()
    wire.restartLosingWelcome(at=1.0)
    for n in range(50):
        wire.reply(1, b"new %d" % n)
        wire.flow()
    new = [(b"new %d" % n,) for n in range(50)]
    assert wire.atClient[10:] == []
    for step in range(1, 41):                          # 10 s, both sides healthy
        wire.tick(1.0 + step * 0.25)
        wire.flow()
    assert wire.atClient[10:] == new
    assert not wire.server.byRouting[1].seq.unacked


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["send", "reply", "flow", "lose to client",
                                           "lose the next welcome", "lose to server",
                                           "cut", "restart", "tick"]),
                          st.integers(0, 6)), min_size=5, max_size=60))
@example([("lose the next welcome", 0), ("flow", 1), ("reply", 0), ("flow", 6), ("tick", 0),
          ("reply", 0)])
@example([("flow", 6), ("reply", 0), ("flow", 6), ("lose the next welcome", 0), ("restart", 0),
          ("flow", 1), ("reply", 0), ("reply", 0), ("reply", 0), ("flow", 6), ("send", 0)])
def test_any_message_may_be_lost_welcome_included_and_none_comes_twice(
        script: list[tuple[str, int]]) -> None:
    """Any one message may vanish while the later ones on its connection
    arrive (a WELCOME too), connections break, the server restarts (a new
    epoch): nothing comes twice or out of order; what the last server was
    given reaches the client, and what the client sent reaches a server."""
    wire = Wire(pingInterval=1.0, liveness=3)
    wire.connect()
    servers = [wire.server]
    handed: list[tuple[int, bytes]] = []   # (server, reply)
    atServers: list[tuple[int, bytes]] = []
    sent = replied = 0
    loseWelcome = False
    fromServer = wire._server

    def losing(actions: list[Any]) -> None:
        nonlocal loseWelcome
        for action in actions:
            if loseWelcome and isinstance(action, SendTo) and action.frames[1] == codec.WELCOME:
                loseWelcome = False
                actions = [a for a in actions if a is not action]  # what follows it goes
                break
        fromServer(actions)

    wire._server = losing  # type: ignore[method-assign]

    def collect() -> None:
        atServers.extend((len(servers) - 1, p[0]) for p in wire.atServer)
        wire.atServer.clear()

    for op, n in script:
        if op == "send":
            wire.send(b"c%d" % sent)
            sent += 1
        elif op == "reply":
            if wire.server.byRouting:
                wire.reply(max(wire.server.byRouting), b"s%d" % replied)
                handed.append((len(servers) - 1, b"s%d" % replied))
                replied += 1
        elif op == "flow":
            wire.flow(steps=n)
        elif op == "lose to client" and wire.toClient:
            del wire.toClient[n % len(wire.toClient)]
        elif op == "lose the next welcome":
            loseWelcome = True
        elif op == "lose to server" and wire.toServer:
            del wire.toServer[n % len(wire.toServer)]
        elif op == "cut":
            wire.cut()
            wire.connect()
        elif op == "restart":
            wire.cut()
            collect()
            wire.server = ServerSessionMachine(expiry=30.0)
            servers.append(wire.server)
            wire.connect()
        else:
            wire.tick(wire.now + 0.25 * (n + 1), reconnect=True)
        collect()
    loseWelcome = False
    for _ in range(40):  # no more losses; time goes on
        wire.flow()
        wire.tick(wire.now + 0.25, reconnect=True)
        collect()
    wire.flow()
    collect()
    got = [p[0] for p in wire.atClient]
    order = [p for _, p in handed]
    assert len(got) == len(set(got)) and got == sorted(got, key=order.index)
    assert {p for s, p in handed if s == len(servers) - 1} <= set(got)
    for index in range(len(servers)):
        mine = [p for s, p in atServers if s == index]
        assert len(mine) == len(set(mine)) and mine == sorted(mine, key=lambda p: int(p[1:]))
    assert {p for _, p in atServers} == {b"c%d" % n for n in range(sent)}
    assert wire.client.state == "attached"


def test_a_client_whose_server_session_ended_is_told_and_the_server_may_get_one_twice() -> None:
    """The server's session ended while the client was away (expired here):
    the client attaches to a new one, with a new epoch. It says so in a
    Renewed action (its driver warns): what the server held for it is lost.
    What it sent that the server had not acknowledged goes again, to the new
    session, which may get it twice (at least once across a session's end)."""
    from mdp.session.machines import Renewed

    wire = Wire(pingInterval=1.0)
    wire.connect()
    wire.flow()
    wire.send(b"c0")
    wire.reply(1, b"s0")
    wire.flow()                  # c0 delivered; its ACK waits for the server's tick
    wire.cut()
    wire.reply(1, b"s1")         # held for the client, which is away
    wire.tick(31.0)              # the session expires
    assert Expired(1) in wire.events
    wire.connect()
    wire.flow()
    assert [e for e in wire.events if isinstance(e, Renewed)] == [
        Renewed("the server's session for this client ended; a new one began")]
    assert wire.atClient == [(b"s0",)]                 # s1 is lost, and the client was told
    assert wire.atServer == [(b"c0",), (b"c0",)]       # sent again to the new session
    # a re-attach to the same session is no news
    wire.cut()
    wire.connect()
    wire.flow()
    assert len([e for e in wire.events if isinstance(e, Renewed)]) == 1


def test_an_ack_only_counts_on_a_message_its_sender_may_send() -> None:
    """A server never says HELLO, a client never says WELCOME: the ack such a
    message carries discards nothing the other side still holds."""
    wire = Wire()
    wire.connect()
    wire.flow()
    wire.send(b"request")
    wire.flow()
    wire.reply(wire.routingId, b"answer")  # held by the server until the client acks it
    [session] = wire.server.byPeer.values()
    assert len(session.seq.unacked) == 1
    wire.toClient.clear()  # (the client does not hear the answer)
    wire._server(wire.server.handleMessage(wire.peer, codec.encode(codec.Welcome(5)), wire.now))
    assert len(session.seq.unacked) == 1
    wire.toServer.clear()
    wire.toClient = [codec.encode(codec.Hello(b"s" * 16, 5))]
    wire.send(b"second")  # held by the client until the server acks it
    before = len(wire.client.seq.unacked)
    wire._client(wire.client.handleMessage(wire.toClient.pop(0), wire.now))
    assert len(wire.client.seq.unacked) == before >= 1
    # an ACK itself still counts
    wire._server(wire.server.handleMessage(wire.peer, codec.encode(codec.Ack(5)), wire.now))
    assert len(session.seq.unacked) == 0
