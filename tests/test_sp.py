"""SPClient and SPServer over TCP on 127.0.0.1, and against pynng."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer, task, threads

from mdp.sp.peers import SPClient, SPServer
from tests.sp_peers import pynng_port

pytestmark = pytest.mark.timeout(60)


def reactor() -> Any:
    from twisted.internet import reactor as r

    return r


def url_of(router: Any) -> str:
    return f"tcp://127.0.0.1:{router.port.getHost().port}"


@pytest_twisted.ensureDeferred
async def test_our_req_and_rep_many_in_flight() -> None:
    server = SPServer(lambda payload: payload.upper(), reactor())
    router = await server.listen("tcp://127.0.0.1:0")
    client = SPClient(url_of(router), reactor())
    try:
        replies = await defer.gatherResults([client.request(b"m%d" % n) for n in range(50)])
        assert replies == [b"M%d" % n for n in range(50)]
    finally:
        await client.close()
        await server.close()


@pytest_twisted.ensureDeferred
async def test_a_coroutine_handler_replies_when_it_returns() -> None:
    async def handler(payload: bytes) -> bytes:
        await task.deferLater(reactor(), 0.01, lambda: None)
        return b"later:" + payload

    server = SPServer(handler, reactor())
    router = await server.listen("tcp://127.0.0.1:0")
    client = SPClient(url_of(router), reactor())
    try:
        assert await client.request(b"x") == b"later:x"
    finally:
        await client.close()
        await server.close()


@pytest_twisted.ensureDeferred
async def test_pynng_req0_to_our_rep_and_our_req_to_pynng_rep0() -> None:
    import pynng

    server = SPServer(lambda payload: b"ours:" + payload, reactor())
    router = await server.listen("tcp://127.0.0.1:0")
    address = url_of(router)

    def ask() -> list[bytes]:
        with pynng.Req0(dial=address, recv_timeout=10_000) as req:
            out = []
            for n in range(5):
                req.send(b"%d" % n)
                out.append(req.recv())
            return out

    try:
        assert await threads.deferToThread(ask) == [b"ours:%d" % n for n in range(5)]
    finally:
        await server.close()

    rep = pynng.Rep0(listen="tcp://127.0.0.1:0", recv_timeout=10_000)
    port = pynng_port(rep)

    def answer(count: int) -> None:
        for _ in range(count):
            rep.send(b"nng:" + rep.recv())

    client = SPClient(f"tcp://127.0.0.1:{port}", reactor())
    try:
        serving = threads.deferToThread(answer, 5)
        for n in range(5):
            assert await client.request(b"%d" % n) == b"nng:%d" % n
        await serving
    finally:
        await client.close()
        rep.close()


@pytest_twisted.ensureDeferred
async def test_a_cancelled_request_gets_no_reply_and_the_client_goes_on() -> None:
    held: list[defer.Deferred] = []

    def slow(payload: bytes) -> Any:
        if payload == b"hold":
            d: defer.Deferred = defer.Deferred()
            held.append(d)
            return d
        return payload

    server = SPServer(slow, reactor())
    router = await server.listen("tcp://127.0.0.1:0")
    client = SPClient(url_of(router), reactor(), resend=0.2)
    try:
        waiting = client.request(b"hold")
        deadline = reactor().seconds() + 10
        while not held:
            assert reactor().seconds() < deadline
            await task.deferLater(reactor(), 0.01)
        waiting.cancel()
        with pytest.raises(defer.CancelledError):
            await waiting
        assert await client.request(b"next") == b"next"
        # resends of the held request came while it was in hand: run once
        assert len(held) == 1
    finally:
        for d in held:
            d.cancel()
        await client.close()
        await server.close()


@pytest_twisted.ensureDeferred
async def test_a_rep_at_max_pending_drops_requests_until_it_has_room_and_the_resend_gets_in(
) -> None:
    held: list[defer.Deferred] = []
    payloads: list[bytes] = []

    def slow(payload: bytes) -> Any:
        payloads.append(payload)
        d: defer.Deferred = defer.Deferred()
        held.append(d)
        return d

    server = SPServer(slow, reactor(), maxPending=1)
    router = await server.listen("tcp://127.0.0.1:0")
    client = SPClient(url_of(router), reactor(), resend=0.2)
    try:
        first, second = client.request(b"first"), client.request(b"second")
        deadline = reactor().seconds() + 10
        while server.overloaded < 2:  # the second, and a resend of it, met a full server
            assert reactor().seconds() < deadline
            await task.deferLater(reactor(), 0.01)
        assert payloads == [b"first"]
        held[0].callback(b"FIRST")
        assert await first == b"FIRST"
        while len(payloads) < 2:  # a resend of the second now gets in
            assert reactor().seconds() < deadline
            await task.deferLater(reactor(), 0.01)
        held[1].callback(b"SECOND")
        assert await second == b"SECOND" and payloads == [b"first", b"second"]
    finally:
        await client.close()
        await server.close()


@pytest_twisted.ensureDeferred
async def test_pynng_req0_through_two_of_our_devices_to_pynng_rep0() -> None:
    import pynng

    from mdp.sp.peers import SPDevice

    rep = pynng.Rep0(listen="tcp://127.0.0.1:0", recv_timeout=10_000)
    port = pynng_port(rep)
    inner = SPDevice(f"tcp://127.0.0.1:{port}", reactor())
    innerFront = await inner.listen("tcp://127.0.0.1:0")
    outer = SPDevice(url_of(innerFront), reactor())
    outerFront = await outer.listen("tcp://127.0.0.1:0")
    address = url_of(outerFront)

    def answer(count: int) -> list[bytes]:
        seen = []
        for _ in range(count):
            request = rep.recv()
            seen.append(request)
            rep.send(b"nng:" + request)
        return seen

    def ask(count: int) -> list[bytes]:
        with pynng.Req0(dial=address, recv_timeout=10_000) as req:
            out = []
            for n in range(count):
                req.send(b"%d" % n)
                out.append(req.recv())
            return out

    try:
        serving = threads.deferToThread(answer, 5)
        assert await threads.deferToThread(ask, 5) == [b"nng:%d" % n for n in range(5)]
        assert await serving == [b"%d" % n for n in range(5)]
    finally:
        await outer.close()
        await inner.close()
        rep.close()


@pytest_twisted.ensureDeferred
async def test_twist_sp_rep_and_sp_device_and_mdp_sp_request() -> None:
    """The entry points as processes: a pynng Req0 and ``mdp sp-request``
    through ``twist sp-device`` to ``twist sp-rep``."""
    import pynng

    from tests.procs import ENV, Process, bounded, script

    rep = Process(reactor(), [script("twist"), "--log-format", "text", "sp-rep",
                              "--endpoint", "tcp://127.0.0.1:0", "--handler", "echo"], ENV)
    processes = [rep]
    try:
        bound = await bounded(rep.waitFor(r"SP REP listening on tcp:host=127.0.0.1:port=(\d+)", 60), 60)
        device = Process(reactor(), [script("twist"), "--log-format", "text", "sp-device",
                                     "--front", "tcp://127.0.0.1:0",
                                     "--back", f"tcp://127.0.0.1:{int(bound.group(1))}"], ENV)
        processes.append(device)
        front = await bounded(device.waitFor(
            r"SP device listening on tcp:host=127.0.0.1:port=(\d+)", 60), 60)
        address = f"tcp://127.0.0.1:{int(front.group(1))}"

        def ask() -> bytes:
            with pynng.Req0(dial=address, recv_timeout=10_000) as req:
                req.send(b"via the device")
                return req.recv()

        assert await threads.deferToThread(ask) == b"via the device"
        call = Process(reactor(), [script("mdp"), "sp-request", "--endpoint", address, "hello"], ENV)
        processes.append(call)
        await call.ended(30)
        assert call.exitCode == 0 and call.output.strip() == b"hello", call.output
    finally:
        for process in processes:
            await process.stop()


@pytest_twisted.ensureDeferred
async def test_a_pynng_rep_killed_and_restarted_mid_stream_loses_no_request() -> None:
    """Our client resends what the killed REP never answered, to the REP
    restarted on the same port: every request completes."""
    import signal

    from tests.procs import ENV, Process, bounded, python, wait_until

    rep = Process(reactor(), python("-m", "tests.sp_peers", "rep", "tcp://127.0.0.1:0"), ENV)
    processes = [rep]
    client = None
    try:
        port = int((await bounded(rep.waitFor(r"listening on (\d+)", 60), 60)).group(1))
        client = SPClient(f"tcp://127.0.0.1:{port}", reactor(), resend=0.5)
        replies = [client.request(b"%d" % n) for n in range(20)]
        await wait_until(lambda: replies[0].called, 30)
        rep.signalProcess(signal.SIGKILL)
        await rep.ended(30)
        later = [client.request(b"%d" % n) for n in range(20, 40)]
        again = Process(reactor(), python("-m", "tests.sp_peers", "rep",
                                          f"tcp://127.0.0.1:{port}"), ENV)
        processes.append(again)
        await bounded(again.waitFor("listening on", 60), 60)
        got = await bounded(defer.gatherResults(replies + later), 30)
        assert got == [b"nng:%d" % n for n in range(40)]
    finally:
        if client is not None:
            await client.close()
        for process in processes:
            await process.stop()


@pytest_twisted.ensureDeferred
async def test_the_hop_limit_is_nng_s() -> None:
    """Raw requests with 7 and 8 hop words: nng's Rep0 answers the first and
    drops the second, and so does our REP."""
    import pynng

    from mdp.sp.codec import BOTTOM, word
    from mdp.transport.spframing import REQ, SPFraming
    from mdp.transport.stream import StreamDealer
    from tests.procs import wait_until

    def raw(hops: int) -> bytes:
        return b"".join(word(n) for n in range(hops)) + word(BOTTOM | hops) + b"p"

    class Raw:
        def __init__(self) -> None:
            self.got: list[bytes] = []
            self.up = False

        def connectionMade(self) -> None:
            self.up = True

        def connectionLost(self, reason: object) -> None:
            self.up = False

        def messageReceived(self, frames: list[bytes]) -> None:
            self.got.append(frames[0])

    async def answered(port: int, serve: Any = None) -> list[int]:
        peer = Raw()
        dealer = StreamDealer(f"tcp:host=127.0.0.1:port={port}", peer, reactor(),
                              framing=SPFraming(REQ))
        try:
            await wait_until(lambda: peer.up, 10)
            for hops in (7, 8):
                dealer.sendMessage([raw(hops)])
            if serve is not None:
                await threads.deferToThread(serve)
            await wait_until(lambda: len(peer.got) >= 1, 10)
            await task.deferLater(reactor(), 0.3)  # time for a second, wrong reply
            return [(len(m) - 1) // 4 - 1 for m in peer.got]  # hop words of each reply
        finally:
            await dealer.close()

    rep = pynng.Rep0(listen="tcp://127.0.0.1:0", recv_timeout=500)
    port = pynng_port(rep)

    def serve() -> None:
        for _ in range(2):
            try:
                rep.send(rep.recv())
            except pynng.Timeout:
                return

    try:
        assert await answered(port, serve) == [7]
    finally:
        rep.close()

    server = SPServer(lambda payload: payload, reactor())
    router = await server.listen("tcp://127.0.0.1:0")
    try:
        assert await answered(router.port.getHost().port) == [7]
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_our_req_through_an_nng_device_to_our_rep() -> None:
    """nng's own device (raw Rep0 + raw Req0, nng_device) in its own process
    between our SPClient and our SPServer."""
    from tests.procs import ENV, Process, bounded, python

    server = SPServer(lambda payload: b"ours:" + payload, reactor())
    router = await server.listen("tcp://127.0.0.1:0")
    device = Process(reactor(), python("-m", "tests.sp_peers", "device", url_of(router)), ENV)
    client = None
    try:
        port = int((await bounded(device.waitFor(r"listening on (\d+)", 60), 60)).group(1))
        client = SPClient(f"tcp://127.0.0.1:{port}", reactor(), resend=1.0)
        got = await bounded(defer.gatherResults([client.request(b"%d" % n) for n in range(20)]), 30)
        assert got == [b"ours:%d" % n for n in range(20)]
    finally:
        if client is not None:
            await client.close()
        await device.stop()
        await server.close()


def test_twist_sp_rep_bounds_reach_the_server_and_are_checked() -> None:
    from twisted.python import usage

    from mdp.app.tap import SPRepOptions

    options = SPRepOptions()
    options.parseOptions(["--max-pending", "3", "--max-pending-bytes", "1KiB"])
    machine = options.makeService().server.machine
    assert (machine.maxPending, machine.maxPendingBytes) == (3, 1024)
    with pytest.raises(usage.UsageError, match="--max-pending must be at least 1"):
        SPRepOptions().parseOptions(["--max-pending", "0"])


# --- the SP handshake: a connection is a peer once the headers are exchanged ----------------


@pytest_twisted.ensureDeferred
async def test_a_peer_that_never_says_its_header_gets_no_request() -> None:
    """A connection whose far side accepts and says nothing (a hung
    process, another service on the port) is not a REQ channel: every
    request goes to the REP that did say its header, none waits for a
    resend; the silent connection is dropped after ``handshakeTimeout``."""
    from twisted.internet import protocol

    from mdp.policy import Limits
    from tests.procs import wait_until

    accepted: list[Any] = []

    class Silent(protocol.Protocol):
        def connectionMade(self) -> None:
            accepted.append(self)

    silent = reactor().listenTCP(0, protocol.Factory.forProtocol(Silent), interface="127.0.0.1")
    server = SPServer(lambda payload: payload, reactor())
    router = await server.listen("tcp://127.0.0.1:0")
    client = SPClient([f"tcp://127.0.0.1:{silent.getHost().port}", url_of(router)], reactor(),
                      resend=60.0, limits=Limits(handshakeTimeout=0.5))
    try:
        await wait_until(lambda: accepted and router.connections, 10)
        replies = [client.request(b"r%d" % n).addTimeout(5, reactor()) for n in range(4)]
        assert await defer.gatherResults(replies) == [b"r%d" % n for n in range(4)]
        # and it is let go once its header is overdue (then dialed again)
        await wait_until(lambda: not accepted[0].transport.connected, 10)
    finally:
        await client.close()
        await server.close()
        await silent.stopListening()


@pytest_twisted.ensureDeferred
async def test_an_idle_pynng_req_is_kept_past_the_handshake_timeout() -> None:
    """nng keeps an idle pipe for good: a REQ that said its header and sends
    nothing yet is a peer, not a connection that failed its handshake."""
    import pynng

    from mdp.policy import Limits
    from tests.procs import wait_until

    server = SPServer(lambda payload: payload, reactor(), limits=Limits(handshakeTimeout=0.2))
    router = await server.listen("tcp://127.0.0.1:0")
    req = pynng.Req0(recv_timeout=10_000)
    req.dial(url_of(router), block=False)  # (a blocking dial would hold up this reactor)
    try:
        await wait_until(lambda: len(router.connections) == 1, 10)
        (peer,) = list(router.connections)
        await task.deferLater(reactor(), 1.0, lambda: None)  # five deadlines pass, idle
        assert list(router.connections) == [peer]

        def ask() -> bytes:
            req.send(b"late")
            return req.recv()

        assert await threads.deferToThread(ask) == b"late"
        assert list(router.connections) == [peer]
    finally:
        req.close()
        await server.close()


@pytest_twisted.ensureDeferred
async def test_a_device_holds_a_request_until_its_upstream_is_up() -> None:
    """As nng's send queue: a request that reaches a device before any
    upstream connection is up goes out once one is, not at the requester's
    next resend."""
    import socket

    from mdp.sp.peers import SPDevice

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    device = SPDevice(f"tcp://127.0.0.1:{port}", reactor())
    front = await device.listen("tcp://127.0.0.1:0")
    client = SPClient(url_of(front), reactor(), resend=60.0)
    server = SPServer(lambda payload: b"up:" + payload, reactor())
    try:
        reply = client.request(b"early").addTimeout(20, reactor())
        from tests.procs import wait_until

        await wait_until(lambda: device.backs[0].transport.queue, 10)  # held there
        await server.listen(f"tcp://127.0.0.1:{port}")
        assert await reply == b"up:early"
    finally:
        await client.close()
        await device.close()
        await server.close()


# --- the client's driver: a caller's callback that re-enters the client ---------------------


class _Connection:
    """Stands in for a pipe's connection: keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def sendMessage(self, frames: list[bytes]) -> None:
        self.sent.append(frames[0])

    def close(self) -> defer.Deferred[None]:
        return defer.succeed(None)


def _client_on_a_clock(resend: float) -> tuple[Any, SPClient, Any, _Connection]:
    """An SPClient on a fake clock whose one pipe is up, on a connection
    that keeps what is sent (the replies are handed to the pipe)."""
    from twisted.internet.testing import MemoryReactorClock

    clock = MemoryReactorClock()
    client = SPClient("tcp://127.0.0.1:1", clock, resend=resend)
    pipe = client.pipes[0]
    pipe.transport = connection = _Connection()
    pipe.connectionMade()
    return clock, client, pipe, connection


def _sent(connection: _Connection, payload: bytes) -> int:
    return sum(1 for body in connection.sent if body[4:] == payload)


def _advance(clock: Any, seconds: int) -> None:
    for _ in range(seconds):  # a second at a time: each timer runs at its own time
        clock.advance(1.0)


def _wake_ups(clock: Any, client: SPClient) -> list[float]:
    return [call.getTime() for call in clock.getDelayedCalls() if call.func == client._wake]


def test_a_request_made_in_a_reply_callback_is_resent() -> None:
    """The reply's own, older wake-up (none left) must not undo the resend
    timer the new request armed: the request and those after it are sent
    again every resend interval until answered."""
    clock, client, pipe, connection = _client_on_a_clock(resend=10.0)
    first = client.request(b"A")
    made: list[defer.Deferred[bytes]] = []
    first.addCallback(lambda _: made.append(client.request(b"B")))
    clock.advance(1.0)
    pipe.messageReceived([connection.sent[0][:4] + b"reply"])
    assert first.called and len(made) == 1 and not made[0].called
    assert _wake_ups(clock, client) == [client.machine.wakeAt] == [11.0]
    clock.advance(1.0)
    later = client.request(b"C")
    _advance(clock, 30)
    assert _sent(connection, b"B") == 4  # at 1, 11, 21 and 31
    assert _sent(connection, b"C") == 4  # at 2, 12, 22 and 32
    made[0].cancel()
    later.cancel()
    assert _wake_ups(clock, client) == [] and client.machine.wakeAt is None


def test_a_request_cancelled_in_a_reply_callback_leaves_the_wake_up_of_the_others() -> None:
    clock, client, pipe, connection = _client_on_a_clock(resend=10.0)
    first = client.request(b"A")  # resent at 10
    clock.advance(1.0)
    second = client.request(b"B")  # at 11
    second.addErrback(lambda f: f.trap(defer.CancelledError))
    clock.advance(1.0)
    third = client.request(b"C")  # at 12
    first.addCallback(lambda _: second.cancel())
    clock.advance(1.0)
    pipe.messageReceived([connection.sent[0][:4] + b"reply"])
    assert first.called and second.called
    assert _wake_ups(clock, client) == [client.machine.wakeAt] == [12.0]
    _advance(clock, 9)
    assert (_sent(connection, b"B"), _sent(connection, b"C")) == (1, 2)
    third.cancel()


def test_a_client_closed_in_a_reply_callback_keeps_no_timer() -> None:
    from mdp.errors import ClientClosed

    clock, client, pipe, connection = _client_on_a_clock(resend=10.0)
    first = client.request(b"A")
    clock.advance(1.0)
    second = client.request(b"B")
    failed: list[Any] = []
    second.addErrback(failed.append)
    first.addCallback(lambda _: client.close())
    pipe.messageReceived([connection.sent[0][:4] + b"reply"])
    assert first.called and failed and failed[0].check(ClientClosed)
    assert _wake_ups(clock, client) == [] and client._timer is None
    _advance(clock, 60)
    assert _sent(connection, b"B") == 1
