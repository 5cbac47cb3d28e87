"""The blocking client at its edges, against small scripted brokers in
threads of the test (plain pyzmq and plain sockets on 127.0.0.1): a caller's
callback that raises or makes a request of its own, no socket to be had, a
pool held by abandoned requests, a host name with several addresses, a local
listener with a full backlog, a reply far over the limits."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any, Optional

import pytest
import zmq
from twisted.logger import formatEvent

from mdp import errors
from mdp.blocking import Client, _Loop
from mdp.policy import Limits
from mdp.transport.framing import RecordDecoder, encode_record
from mdp.transport.pipes import _StreamPipe
from tests.conftest import Script, ScriptedBroker, ScriptReply, failures_logged
from tests.procs import ENV, ROOT

HEADER, PARTIAL, FINAL = b"MDPC02", b"\x02", b"\x03"


@pytest.fixture
def broker(request: Any) -> Iterator[ScriptedBroker]:
    running = ScriptedBroker(request.param)
    try:
        yield running
    finally:
        running.stop()


# --- a caller's callbacks ---------------------------------------------------------------

attempts: dict[bytes, int] = {}


def restarts_once(peer: bytes, body: list[bytes]) -> list[ScriptReply]:
    """A part, then nothing the first time (the attempt runs out); a part
    and the end the second."""
    if body != [b"stream"]:
        return [(peer, FINAL, body)]
    attempts[b"stream"] = attempts.get(b"stream", 0) + 1
    if attempts[b"stream"] == 1:
        return [(peer, PARTIAL, [b"p1"])]
    return [(peer, PARTIAL, [b"p1"]), (peer, FINAL, [b"end"])]


@pytest.mark.parametrize("broker", [restarts_once], indirect=True)
def test_callbacks_that_raise_are_logged_and_the_request_goes_on(broker: ScriptedBroker) -> None:
    """As the Twisted client: an exception from *onPartial* or *onRestart*
    is logged with the service, and the request (and the next) still runs:
    nothing the machine asked for after the callback is lost."""
    attempts.clear()
    parts: list[list[bytes]] = []

    def onPartial(body: list[bytes]) -> None:
        parts.append(body)
        raise RuntimeError("the caller's part handler failed")

    def onRestart() -> None:
        parts.append([b"restart"])
        raise RuntimeError("the caller's restart handler failed")

    with failures_logged() as events:
        with Client(broker.endpoint, timeout=0.5, retries=2) as client:
            reply = client.request("s", b"stream", onPartial=onPartial, onRestart=onRestart)
            after = client.request("s", b"next")
    failures = [formatEvent(event) for event in events]
    assert reply == [b"end"] and after == [b"next"]
    assert parts == [[b"p1"], [b"restart"], [b"p1"]]
    assert failures.count("onPartial callback for s failed") == 2
    assert failures.count("onRestart callback for s failed") == 1


def test_parts_stay_in_order_while_a_callback_waits_on_the_loop() -> None:
    """A callback that waits on the client's loop (a request made from
    inside *onPartial*) has the same stream connection read meanwhile: that
    read hands on the parts already read, then its own, in order (and the
    reply's FINAL, which frees its connection for the nested request)."""
    here, there = socket.socketpair()
    loop = _Loop(Limits(), None)

    class Owner:
        def __init__(self) -> None:
            self.got: list[bytes] = []

        def _pipeMessage(self, tag: Any, frames: list[bytes], now: float) -> None:
            self.got.append(frames[0])
            if frames[0] == b"p1":  # the wait: the rest comes, and is read
                there.sendall(encode_record([b"p3"]) + encode_record([b"end"]))
                pipe.ready(select_in, now)
                assert self.got == [b"p1", b"p2", b"p3", b"end"]

    owner = Owner()
    select_in = 1  # POLLIN
    pipe = _StreamPipe(loop, owner, None, socket.AF_UNIX, "unused")
    try:
        here.setblocking(False)
        pipe.socket, pipe.key, pipe.up = here, here.fileno(), True
        there.sendall(encode_record([b"p1"]) + encode_record([b"p2"]))
        pipe.ready(select_in, 0.0)
        assert owner.got == [b"p1", b"p2", b"p3", b"end"]
    finally:
        here.close()
        there.close()
        loop.shutdown()


# --- sockets that cannot be had ---------------------------------------------------------

OUT_OF_DESCRIPTORS = r"""
import faulthandler, os, resource, sys, threading, zmq
faulthandler.dump_traceback_later(40, exit=True)  # (a hang fails the test with every stack)
from mdp.blocking import Client

context = zmq.Context()
router = context.socket(zmq.ROUTER)
port = router.bind_to_random_port("tcp://127.0.0.1")
stop = threading.Event()
def serve():
    while not stop.is_set():
        if router.poll(50):
            peer, _, _, service, *body = router.recv_multipart()
            router.send_multipart([peer, b"MDPC02", b"\x03", service, *body])
thread = threading.Thread(target=serve, daemon=True)  # (an error below ends the process)
thread.start()
client = Client(f"zmq:tcp://127.0.0.1:{port}", timeout=5, retries=1, context=context)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
spare = []
try:
    while True:
        spare.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    client.request("s", b"x")
except Exception as e:  # (TransportError expected: anything else is shown, not raised)
    print("raised", type(e).__name__, "|", e)
print("connections left", len(client.machine._channels))
for fd in spare:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print("then", client.request("s", b"y"))
client.close()
stop.set()
thread.join()
router.close()
context.term()
"""


def test_no_socket_to_be_had_fails_the_request_with_a_transport_error() -> None:
    """Out of descriptors, a request that needs a new connection fails at
    once with TransportError (as the Twisted client's does), holds nothing,
    and the client works again once descriptors are free.  In a process of
    its own: it takes every descriptor."""
    proc = subprocess.run([sys.executable, "-u", "-c", OUT_OF_DESCRIPTORS], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=55, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-6000:])
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("raised TransportError | cannot open a connection to zmq:tcp://")
    assert "Too many open files" in lines[0]
    assert lines[1:] == ["connections left 0", "then [b'y']"]


def test_a_local_socket_path_too_long_is_refused_at_once() -> None:
    path = "/tmp/" + "x" * 200 + ".sock"
    for make in (lambda: Client(f"unix:{path}"),
                 lambda: Client(f"unix:path={path}")):
        with pytest.raises(errors.TransportError, match="a socket's path is at most"):
            make()


def test_a_full_local_backlog_is_a_failed_attempt_not_a_connection(tmp_path: Any) -> None:
    """A local listener whose backlog is full refuses a non-blocking connect
    with EAGAIN: that attempt failed (and is retried), the connection is not
    taken for made."""
    path = str(tmp_path / "full.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    queued: list[socket.socket] = []
    try:
        listener.bind(path)
        listener.listen(0)
        while True:  # fill the backlog (never accepted)
            waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            waiting.setblocking(False)
            queued.append(waiting)
            if waiting.connect_ex(path) == errno.EAGAIN:
                break
            assert len(queued) < 64
        with Client(f"unix:{path}", timeout=0.5, retries=1) as client:
            with pytest.raises(errors.RequestTimeout) as timedOut:
                client.request("s", b"x")
        assert os.strerror(errno.EAGAIN) in str(timedOut.value)
    finally:
        for each in queued:
            each.close()
        listener.close()


# --- the pool -------------------------------------------------------------------------------

held: list[tuple[bytes, list[bytes]]] = []


def all_four_at_once(peer: bytes, body: list[bytes]) -> list[ScriptReply]:
    """``fast`` answered, ``slow...`` never; ``q...`` held until four have
    come, then all answered: they must be in flight together."""
    if body[0].startswith(b"slow"):
        return []
    if body[0].startswith(b"q"):
        held.append((peer, body))
        if len(held) < 4:
            return []
        answers = [(to, FINAL, each) for to, each in held]
        held.clear()
        return answers
    return [(peer, FINAL, body)]


@pytest.mark.parametrize("broker", [all_four_at_once], indirect=True)
def test_requests_after_an_abandoned_map_are_sent_at_once(broker: ScriptedBroker) -> None:
    """Leaving a map early abandons its requests in flight, whose replies
    may still come: their connections are closed for the next requests,
    which do not wait for those replies with their own clocks running."""
    held.clear()
    with Client(broker.endpoint, timeout=30, retries=1, maxConnections=4) as client:
        for reply in client.map("s", [b"fast", b"slow1", b"slow2", b"slow3"], window=4):
            assert reply == [b"fast"]
            break
        replies = list(client.map("s", [b"q0", b"q1", b"q2", b"q3"], window=4, timeout=2))
        assert replies == [[b"q0"], [b"q1"], [b"q2"], [b"q3"]]
        assert len(client.machine._channels) == 4


# --- addresses ------------------------------------------------------------------------------

class RecordServer:
    """A plain stream listener (TCP on 127.0.0.1, or a local socket at
    *path*) that answers the request records of one connection at a time as
    :meth:`answer` says, in a thread until stopped.  It speaks channels as
    the broker does (the client asks for them): :meth:`record` is a record
    on the channel of the request being answered, and a channel the client
    ends is acknowledged."""

    #: the channel of the request being answered (None: the stream has none)
    channel: Optional[bytes] = None

    def __init__(self, path: Optional[str] = None) -> None:
        if path is not None:
            self.listener = socket.socket(socket.AF_UNIX)
            self.listener.bind(path)
            self.endpoint = f"unix:{path}"
        else:
            self.listener = socket.socket()
            self.listener.bind(("127.0.0.1", 0))
            self.port = self.listener.getsockname()[1]
            self.endpoint = f"tcp:host=127.0.0.1:port={self.port}"
        self.listener.listen(8)
        self.listener.settimeout(0.05)
        #: connections accepted so far
        self.connections = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            self.connections += 1
            with conn:
                try:
                    self._converse(conn)
                except OSError:  # the client closed (with an answer unread, or being written)
                    pass

    def _converse(self, conn: socket.socket) -> None:
        conn.settimeout(0.05)
        decoder = RecordDecoder(Limits())
        while not self.stopping.is_set():
            try:
                data = conn.recv(65536)
            except socket.timeout:
                continue
            if not data:
                break
            for message in decoder.feed(data):
                if decoder.channels:
                    self.channel, message = message
                    if not message:
                        self.ended(conn, self.channel)
                        continue
                self.answer(conn, message[2], message[3:])

    def ended(self, conn: socket.socket, channel: bytes) -> None:
        """The client ended *channel*: say it is known."""
        conn.sendall(channel + encode_record([]))

    def record(self, frames: list[bytes]) -> bytes:
        """*frames* as a record on the channel being answered."""
        return (self.channel or b"") + encode_record(frames)

    def answer(self, conn: socket.socket, service: bytes, body: list[bytes]) -> None:
        conn.sendall(self.record([HEADER, FINAL, service, *body]))

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.listener.close()



# --- a client's pipes over one stream connection (channels) ---------------------------------


class ChannelServer(RecordServer):
    """A RecordServer that notes each request's channel and body
    (``requests``) and the channels the client ends (``ends``), and answers
    as *script* says (the bytes to send, or None: the echo)."""

    def __init__(self, script: Any = None) -> None:
        self.script = script
        self.requests: list[tuple[bytes, bytes]] = []
        self.ends: list[bytes] = []
        super().__init__()

    def answer(self, conn: socket.socket, service: bytes, body: list[bytes]) -> None:
        assert self.channel is not None, "the client asked for no channels"
        self.requests.append((self.channel, body[0]))
        out = self.script(self, service, body) if self.script else None
        conn.sendall(self.record([HEADER, FINAL, service, *body]) if out is None else out)

    def ended(self, conn: socket.socket, channel: bytes) -> None:
        self.ends.append(channel)
        super().ended(conn, channel)


def test_a_clients_pipes_to_a_stream_endpoint_share_one_connection() -> None:
    """A ``map`` over ``tcp:`` with 8 in flight: one connection, the
    channels of its 8 pipes, the replies in order."""
    server = ChannelServer()
    try:
        with Client(server.endpoint, timeout=5, retries=1, maxConnections=8, extensions=False) as client:
            bodies = [b"%d" % n for n in range(40)]
            assert list(client.map("echo", bodies, window=8)) == [[b] for b in bodies]
        assert server.connections == 1
        assert len({channel for channel, _ in server.requests}) == 8
    finally:
        server.stop()


def test_a_channel_the_broker_ends_comes_back_under_a_new_one() -> None:
    """The broker ends the channel a request came on (as a broker ends a
    peer): the client says it knows, and sends the request again under a
    new channel of the same connection once the reconnection delay is
    over."""
    def end_the_first(server: ChannelServer, service: bytes, body: list[bytes]) -> Any:
        if len(server.requests) == 1:
            return server.channel + encode_record([])
        return None

    server = ChannelServer(end_the_first)
    try:
        with Client(server.endpoint, timeout=5, retries=1, extensions=False) as client:
            assert client.request("echo", b"again") == [b"again"]
        (first, _), (second, _) = server.requests
        assert first != second
        assert server.ends[0] == first  # the client's acknowledgment
        assert server.connections == 1
    finally:
        server.stop()


def test_a_reply_over_the_limits_on_one_channel_fails_that_request_alone() -> None:
    """A record over the client's limits on one channel ends the connection
    (the stream cannot be read past it): that request fails with
    ReplyTooLarge, the others in flight only lost the connection and are
    answered on the next."""
    def huge(server: ChannelServer, service: bytes, body: list[bytes]) -> Any:
        if body == [b"huge"]:
            return server.record([HEADER, FINAL, service, b"x" * 4096])
        return None

    server = ChannelServer(huge)
    try:
        with Client(server.endpoint, timeout=5, retries=2, maxConnections=4, extensions=False,
                    limits=Limits(maxMessageBytes=1024)) as client:
            got = list(client.map("echo", [b"a", b"huge", b"b", b"c"], window=4,
                                  returnExceptions=True))
        assert got[0] == [b"a"] and got[2] == [b"b"] and got[3] == [b"c"]
        assert isinstance(got[1], errors.ReplyTooLarge)
    finally:
        server.stop()


def test_what_comes_on_a_channel_ended_here_answers_nothing() -> None:
    """A request's attempt runs out: the client ends its channel and sends
    it again on another.  The late reply that comes on the ended channel
    before the broker says it knows is dropped: the request gets the
    reply of its second attempt, and the next request its own."""
    late: dict[str, Any] = {}

    def slow_once(server: ChannelServer, service: bytes, body: list[bytes]) -> Any:
        if body == [b"slow"] and not late:
            late["channel"], late["service"] = server.channel, service
            return b""  # answered only once the client ends the channel
        return None

    class LateServer(ChannelServer):
        def ended(self, conn: socket.socket, channel: bytes) -> None:
            if channel == late.get("channel"):
                conn.sendall(channel + encode_record([HEADER, FINAL, late["service"], b"late"]))
            super().ended(conn, channel)

    server = LateServer(slow_once)
    try:
        with Client(server.endpoint, timeout=0.5, retries=2, extensions=False) as client:
            assert client.request("echo", b"slow") == [b"slow"]
            assert client.request("echo", b"next") == [b"next"]
        assert late["channel"] in server.ends
    finally:
        server.stop()


class RefusedMidway(ChannelServer):
    """Answers ``stream`` with a PARTIAL and, in the same write, the header
    of a record over the client's limits; its payload, which holds a FINAL
    for that channel, follows only once another request comes (a callback
    of the PARTIAL makes one) or never, if the client drops the
    connection first."""

    #: the refused record's payload, still to send (on this connection)
    payload = b""

    def _converse(self, conn: socket.socket) -> None:
        self.payload = b""
        super()._converse(conn)

    def answer(self, conn: socket.socket, service: bytes, body: list[bytes]) -> None:
        self.requests.append((self.channel or b"", body[0]))
        if body == [b"stream"]:
            forged = self.record([HEADER, FINAL, service, b"forged"])
            self.payload = forged + b"\0" * (65536 - len(forged))
            conn.sendall(self.record([HEADER, PARTIAL, service, b"p1"])
                         + (self.channel or b"") + len(self.payload).to_bytes(4, "big"))
        else:
            conn.sendall(self.payload + self.record([HEADER, FINAL, service, *body]))
            self.payload = b""


def test_a_callback_of_what_came_before_a_refused_record_reads_nothing_past_it() -> None:
    """The PARTIAL that came before a record over the limits is handed on
    before the connection is dropped; its callback's own request must not
    read on past the refused record's header (its payload is no records):
    the outer request fails with ReplyTooLarge, never with a FINAL read out
    of that payload."""
    server = RefusedMidway()
    got: list[Any] = []
    try:
        with Client(server.endpoint, timeout=3, retries=1, maxConnections=2, extensions=False,
                    limits=Limits(maxMessageBytes=1024)) as client:
            def onPartial(body: list[bytes]) -> None:
                got.append(body)
                got.append(client.request("s", b"inner"))

            with pytest.raises(errors.ReplyTooLarge):
                client.request("s", b"stream", onPartial=onPartial,
                               onRestart=lambda: got.append("restart"))
        assert got[:2] == [[b"p1"], [b"inner"]]
    finally:
        server.stop()


class Backlogged(ChannelServer):
    """Once more than 1 MB of a record has come, sends a stray FINAL on
    every other channel it has seen (the client's requests for them still
    wait behind that record); answers each request with ``ok:`` and its
    first bytes."""

    def _converse(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        decoder = RecordDecoder(Limits(maxMessageBytes=64 << 20))
        seen: list[bytes] = []
        strayed = False
        while not self.stopping.is_set():
            data = conn.recv(1 << 20)
            if not data:
                return
            for channel, frames in decoder.feed(data):
                if frames:
                    seen += [channel] if channel not in seen else []
                    self.requests.append((channel, frames[3][:5]))
                    conn.sendall(channel + encode_record(
                        [HEADER, FINAL, frames[2], b"ok:" + frames[3][:5]]))
            if not strayed and decoder.inRecord and decoder.buffered > (1 << 20):
                strayed = True
                for channel in seen:
                    if channel != decoder._channel:
                        conn.sendall(channel + encode_record([HEADER, FINAL, b"echo", b"STALE"]))


def test_what_comes_while_a_request_waits_behind_another_channels_is_no_reply() -> None:
    """A small request queued behind another channel's 32 MiB one has not
    left while that one is written: a FINAL that comes on its channel
    meanwhile came before it, and is dropped; it gets its own reply."""
    server = Backlogged()
    try:
        with Client(server.endpoint, timeout=10, retries=1, maxConnections=2, extensions=False,
                    limits=Limits(maxMessageBytes=64 << 20)) as client:
            assert list(client.map("echo", [b"a", b"b"], window=2)) == [[b"ok:a"], [b"ok:b"]]
            got = list(client.map("echo", [b"B" * (32 << 20), b"small"], window=2))
        assert got == [[b"ok:BBBBB"], [b"ok:small"]]
    finally:
        server.stop()


class DropsOnce(ChannelServer):
    """On its first connection, holds ``slow`` unanswered and answers
    ``stream`` with a PARTIAL, then drops the connection; on the next,
    answers ``stream`` whole and everything else with its body."""

    def answer(self, conn: socket.socket, service: bytes, body: list[bytes]) -> None:
        self.requests.append((self.channel or b"", body[0]))
        first = self.connections == 1
        if body == [b"slow"] and first:
            return
        if body == [b"stream"]:
            conn.sendall(self.record([HEADER, PARTIAL, service, b"p1"]))
            if first:
                conn.shutdown(socket.SHUT_RDWR)
            else:
                conn.sendall(self.record([HEADER, FINAL, service, b"end"]))
            return
        conn.sendall(self.record([HEADER, FINAL, service, *body]))


def test_a_request_from_on_restart_during_a_loss_leaves_the_other_pipes_whole() -> None:
    """The connection goes while one pipe streams and another carries a
    request: the first's *onRestart* makes a request, whose wait brings the
    connection back.  The other pipe hears of the loss before it is up
    again, and its request goes out again and is answered."""
    server = DropsOnce()
    got: list[Any] = []
    try:
        with Client(server.endpoint, timeout=5, retries=1, maxConnections=3, extensions=False) as client:
            pending = client.map("s", [b"warm", b"slow"], window=2)
            assert next(pending) == [b"warm"]  # one pipe idle, one carrying slow

            def onRestart() -> None:
                got.append("restart")
                got.append(client.request("s", b"inner"))

            assert client.request("s", b"stream", onPartial=got.append,
                                  onRestart=onRestart) == [b"end"]
            assert next(pending) == [b"slow"]
        assert got[:2] == [[b"p1"], "restart"] and [b"inner"] in got
        assert server.connections == 2
    finally:
        server.stop()


class EndsTheIdleChannel(ChannelServer):
    """Once told (``end``), ends the channel of the last request it
    answered, and ignores what comes on it until the client says it knows."""

    def __init__(self) -> None:
        self.end = threading.Event()
        self.sent = threading.Event()
        self.unacknowledged: set[bytes] = set()
        super().__init__()

    def _converse(self, conn: socket.socket) -> None:
        def end_when_told() -> None:
            if self.end.wait(5):
                self.unacknowledged.add(self.channel or b"")
                conn.sendall((self.channel or b"") + encode_record([]))
                self.sent.set()

        threading.Thread(target=end_when_told, daemon=True).start()
        super()._converse(conn)

    def answer(self, conn: socket.socket, service: bytes, body: list[bytes]) -> None:
        if self.channel in self.unacknowledged:
            return  # (as the router: nothing on an ended channel until acknowledged)
        super().answer(conn, service, body)

    def ended(self, conn: socket.socket, channel: bytes) -> None:
        if channel in self.unacknowledged:
            self.unacknowledged.discard(channel)  # the client's acknowledgment
            self.ends.append(channel)
            return
        super().ended(conn, channel)


def test_an_end_waiting_in_the_socket_is_no_stale_reply() -> None:
    """The broker ends the idle channel between two requests; its end still
    waits in the socket when the next request is about to go there.  It is
    an end, not a stale message: the pipe is lost, the end acknowledged, and
    the request goes under a new channel."""
    server = EndsTheIdleChannel()
    try:
        with Client(server.endpoint, timeout=5, retries=1, extensions=False) as client:
            assert client.request("echo", b"first") == [b"first"]
            server.end.set()
            assert server.sent.wait(5)
            (link,) = client._loop.links.values()
            assert select.select([link.socket], [], [], 5)[0]  # the end is there, unread
            assert client.request("echo", b"second") == [b"second"]
        (first, _), (second, _) = server.requests
        assert first != second and server.ends[0] == first  # (then, maybe, the close's)
    finally:
        server.stop()


def test_each_address_of_a_host_is_tried_in_turn(monkeypatch: Any) -> None:
    """A name that resolves to several addresses (``localhost``: ``::1``
    and ``127.0.0.1``) is reached at the first that takes a connection."""
    server = RecordServer()
    nobody = socket.socket()  # a port bound and not listening: refused
    nobody.bind(("127.0.0.1", 0))
    resolve = socket.getaddrinfo

    def getaddrinfo(host: str, port: Any, *rest: Any) -> Any:
        if host != "broker.test":
            return resolve(host, port, *rest)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", nobody.getsockname()[1])),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", server.port))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    try:
        with Client(f"tcp:host=broker.test:port={server.port}", timeout=5, retries=1) as client:
            assert client.request("s", b"hello") == [b"hello"]
    finally:
        nobody.close()
        server.stop()


def test_tcp6_is_not_a_blocking_client_endpoint() -> None:
    """``tcp6:`` only listens (as for the Twisted client); ``tcp:`` reaches
    IPv6 hosts."""
    with pytest.raises(errors.TransportError, match="tcp6: endpoints cannot connect"):
        Client(r"tcp6:host=\:\:1:port=5555")
    Client(r"tcp:host=\:\:1:port=5555").close()


# --- a reply over the limits ----------------------------------------------------------------

HUGE = b"x" * (32 << 20)  # made once, before any allocation is traced


def huge(peer: bytes, body: list[bytes]) -> list[ScriptReply]:
    return [(peer, FINAL, [HUGE] if body == [b"huge"] else body)]


@pytest.mark.parametrize("broker", [huge], indirect=True)
def test_a_reply_far_over_the_limits_is_not_copied(broker: ScriptedBroker) -> None:
    """A 32 MiB reply to a client whose limit is 1 MB fails the request with
    ReplyTooLarge without the client copying it into Python (the socket
    that carried it goes, and the rest with it); the client goes on."""
    with Client(broker.endpoint, timeout=10, retries=1,
                limits=Limits(maxMessageBytes=1 << 20)) as client:
        assert client.request("s", b"warm") == [b"warm"]
        tracemalloc.start()
        try:
            with pytest.raises(errors.ReplyTooLarge):
                client.request("s", b"huge")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20
        assert client.request("s", b"after") == [b"after"]


# --- signals ------------------------------------------------------------------------------


def never(peer: bytes, body: list[bytes]) -> list[ScriptReply]:
    return []


class Signals:
    """SIGUSR1 to the main thread every 20 ms, with a handler that does
    nothing (as a profiler's, a watchdog's or a SIGCHLD handler would), until
    stopped (at most 60 s)."""

    def __init__(self) -> None:
        import signal

        self.count = 0
        self.stopping = threading.Event()
        self.previous = signal.signal(signal.SIGUSR1, self._handled)
        main = threading.main_thread().ident
        assert main is not None

        def send() -> None:
            for _ in range(3000):
                if self.stopping.wait(0.02):
                    return
                signal.pthread_kill(main, signal.SIGUSR1)

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()

    def _handled(self, signum: int, frame: Any) -> None:
        self.count += 1

    def stop(self) -> None:
        import signal

        self.stopping.set()
        self.thread.join(5)
        signal.signal(signal.SIGUSR1, self.previous)


@pytest.mark.timeout(30)  # without the fix, the waits start over for as long as the signals last
@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("broker", [never], indirect=True)
def test_signals_do_not_make_a_wait_start_over(broker: ScriptedBroker, compiled: bool,
                                               monkeypatch: Any) -> None:
    """A wait on the only socket cut short by a signal waits for what is
    left of its time, not its whole time again: under signals more frequent
    than the timeout, a request still times out, and a worker still stops."""
    import mdp.transport.pipes
    from mdp.blocking import Worker
    from mdp.policy import HeartbeatPolicy
    from mdp.transport.zmqio import socket_calls

    if not compiled:
        calls = zip(("_read", "_send", "_events", "_native"), socket_calls(native=False))
        for name, call in calls:
            monkeypatch.setattr(mdp.transport.pipes, name, call)
    elif not mdp.transport.pipes._native:
        pytest.skip("the compiled reader is not built")
    signals = Signals()
    try:
        client = Client(broker.endpoint, timeout=0.3, retries=2)
        try:
            with pytest.raises(errors.RequestTimeout):
                client.request("echo", b"x")
        finally:
            client.close()
        context = zmq.Context()
        silent = context.socket(zmq.ROUTER)  # takes the worker's READY, says nothing
        silent.setsockopt(zmq.LINGER, 0)
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        try:
            worker = Worker(f"zmq:tcp://127.0.0.1:{port}", "echo", lambda frames: frames,
                            heartbeat=HeartbeatPolicy(interval=0.3, liveness=3))
            threading.Thread(target=lambda: (signals.stopping.wait(0.5), worker.stop()),
                             daemon=True).start()
            worker.run()
        finally:
            silent.close()
            context.term()
    finally:
        signals.stop()
    assert signals.count > 10


# --- a reply with no request ----------------------------------------------------------------


class StrayingBroker(RecordServer):
    """Answers each request, and after the reply to ``dup`` sends a second,
    stray FINAL: whole, or (``half``) its first half at once and the rest
    just before the next reply.  ``strayed`` is set once the stray bytes are
    sent."""

    def __init__(self, family: str, tmp_path: Any) -> None:
        self.strayed = threading.Event()
        self.rest = b""
        super().__init__(str(tmp_path / "broker.sock") if family == "unix" else None)

    def answer(self, conn: socket.socket, service: bytes, body: list[bytes]) -> None:
        conn.sendall(self.rest + self.record([HEADER, FINAL, service, *body]))
        self.rest = b""
        if body[0] in (b"dup", b"half"):
            stray = self.record([HEADER, FINAL, service, b"stray"])
            if body[0] == b"half":
                stray, self.rest = stray[:len(stray) // 2], stray[len(stray) // 2:]
            conn.sendall(stray)
            self.strayed.set()


@pytest.mark.parametrize("how", ["dup", "half"])
@pytest.mark.parametrize("family", ["tcp", "unix"])
def test_a_stray_reply_waiting_in_the_socket_answers_no_later_request(
        family: str, how: str, tmp_path: Any) -> None:
    """A FINAL that came after its request was answered (a duplicate) and
    waits unread in the socket, whole or begun, is dropped when the next
    request goes out: it never completes that request."""
    broker = StrayingBroker(family, tmp_path)
    client = Client(broker.endpoint, timeout=5, retries=1)
    try:
        assert client.request("echo", how.encode()) == [how.encode()]
        assert broker.strayed.wait(5)
        assert client.request("echo", b"next") == [b"next"]
        assert client.request("echo", b"then") == [b"then"]
    finally:
        client.close()
        broker.stop()


# --- map: items that cannot be sent -------------------------------------------------------


def echo(peer: bytes, body: list[bytes]) -> list[ScriptReply]:
    return [(peer, FINAL, body)]


def items_then(error: Exception) -> Iterator[Any]:
    yield b"a"
    yield b"b"
    raise error


@pytest.mark.parametrize("broker", [echo], indirect=True)
def test_map_keeps_each_failure_in_its_place(broker: ScriptedBroker) -> None:
    """An item over the limits or not frames fails in its place (yielded
    with *returnExceptions*, else raised after the replies before it); an
    error reading the items is raised after the replies to those read."""
    with Client(broker.endpoint, timeout=5, retries=1,
                limits=Limits(maxMessageBytes=1024)) as client:
        got = list(client.map("echo", [b"a", b"x" * 2000, 5, b"b"], window=4,
                              returnExceptions=True))
        assert got[0] == [b"a"] and got[3] == [b"b"]
        assert isinstance(got[1], errors.RequestTooLarge) and isinstance(got[2], TypeError)
        seen: list[Any] = []
        with pytest.raises(errors.RequestTooLarge):
            for reply in client.map("echo", [b"a", b"b", b"x" * 2000, b"c"], window=4):
                seen.append(reply)
        assert seen == [[b"a"], [b"b"]]
        seen.clear()
        with pytest.raises(LookupError, match="the source failed"):
            for reply in client.map("echo", items_then(LookupError("the source failed")),
                                    window=4, returnExceptions=True):
                seen.append(reply)
        assert seen == [[b"a"], [b"b"]]
        with pytest.raises(ValueError):  # a mistake of the whole call: at once
            client.map("echo" * 100, [b"a"])
        assert client.request("echo", b"after") == [b"after"]


# --- a caller's callback that waits on the client, or closes it -----------------------------


class InprocBroker(ScriptedBroker):
    """A :class:`ScriptedBroker` on an ``inproc`` endpoint of *context* (the
    client's): a reply is in the client's socket as soon as it is sent, no
    I/O thread in between.  ``replied[body]`` is set once a request of that
    (first) body frame has been answered."""

    def __init__(self, script: Script, context: zmq.Context, *bodies: bytes) -> None:
        self.replied = {body: threading.Event() for body in bodies}
        super().__init__(script, context, f"inproc://blocking-edges-{id(self)}")

    def served(self, body: list[bytes]) -> None:
        if body and body[0] in self.replied:
            self.replied[body[0]].set()

    def stop(self) -> None:  # (the context is the test's)
        self.stopping.set()
        self.thread.join(5)
        self.socket.close()


class CountingContext:
    """A ZeroMQ context that keeps the sockets made through it, and whether
    its *client* was closed when each was made."""

    def __init__(self) -> None:
        self.real = zmq.Context()
        self.client: Any = None
        self.made: list[tuple[Any, bool]] = []

    def socket(self, kind: int) -> Any:
        sock = self.real.socket(kind)
        self.made.append((sock, bool(self.client is not None and self.client.machine.closed)))
        return sock

    def finish(self) -> None:
        """Check that no socket was made after its client was closed and
        none is left open (one that is is closed here first, so that the
        context ends either way)."""
        late = sum(closed for _, closed in self.made)
        left = [sock for sock, _ in self.made if not sock.closed]
        for sock in left:
            sock.close(0)
        self.real.term()
        assert self.made and late == 0 and left == []


streamed: dict[bytes, int] = {}


def a_part_then_silence_once(peer: bytes, body: list[bytes]) -> list[ScriptReply]:
    """``stream``: a part, then nothing the first time (the attempt runs
    out), the end at once after; ``slow``: never answered."""
    if body == [b"slow"]:
        return []
    if body != [b"stream"]:
        return [(peer, FINAL, body)]
    streamed[b"stream"] = streamed.get(b"stream", 0) + 1
    if streamed[b"stream"] == 1:
        return [(peer, PARTIAL, [b"p1"])]
    return [(peer, FINAL, [b"end"])]


@pytest.mark.parametrize("broker", [a_part_then_silence_once], indirect=True)
def test_no_connection_is_opened_for_a_channel_given_up_inside_a_callback(
        broker: ScriptedBroker) -> None:
    """*onRestart* makes a request of its own that outlasts the restarted
    attempt, whose fresh connection the machine gives up (and replaces)
    meanwhile: that connection is not opened afterwards, left to nobody."""
    streamed.clear()
    context = CountingContext()
    client = Client(broker.endpoint, timeout=0.3, retries=4, context=context)
    context.client = client
    inner: list[Any] = []
    try:
        def onRestart() -> None:
            if not inner:
                with pytest.raises(errors.RequestTimeout):  # longer than the attempt
                    client.request("s", b"slow", timeout=1.0, retries=1)
                inner.append("timed out")

        assert client.request("s", b"stream", onPartial=lambda body: None,
                              onRestart=onRestart) == [b"end"]
        assert inner == ["timed out"]
        assert [pipe for pipe in client._loop.pipes.values()
                if pipe.tag not in client.machine._channels] == []
    finally:
        client.close()
        context.finish()


@pytest.mark.parametrize("broker", [a_part_then_silence_once], indirect=True)
def test_no_socket_is_made_after_a_callback_closed_the_client(broker: ScriptedBroker) -> None:
    """*onRestart* closes the client: the request ends with ClientClosed, and
    the fresh connection of its next attempt is not opened (no socket made
    after the close, none left open)."""
    streamed.clear()
    context = CountingContext()
    client = Client(broker.endpoint, timeout=0.3, retries=4, context=context)
    context.client = client
    try:
        with pytest.raises(errors.ClientClosed):
            client.request("s", b"stream", onPartial=lambda body: None, onRestart=client.close)
    finally:
        client.close()
        context.finish()


class PartAndEndAtOnce(RecordServer):
    """Answers ``stream`` with a part and the end in one write (the client
    reads both at once), anything else with its body; ``seen`` holds the
    requests' first frames."""

    def __init__(self, path: Optional[str] = None) -> None:
        self.seen: list[bytes] = []
        super().__init__(path)

    def answer(self, conn: socket.socket, service: bytes, body: list[bytes]) -> None:
        self.seen.append(body[0])
        if body[0] == b"stream":
            conn.sendall(self.record([HEADER, PARTIAL, service, b"p1"])
                         + self.record([HEADER, FINAL, service, b"end"]))
        else:
            conn.sendall(self.record([HEADER, FINAL, service, *body]))


@pytest.mark.parametrize("family", ["tcp", "unix"])
def test_a_request_inside_on_partial_gets_the_connection_the_end_already_read_frees(
        family: str, tmp_path: Any) -> None:
    """One connection; the part and the end of a reply are read at once, and
    the part's *onPartial* makes a request, which waits for that connection:
    its wait hands on the end already read (it does not wait for more bytes
    first), so the first request is done and the second gets the connection
    at once; neither waits out an attempt, nothing is sent twice."""
    server = PartAndEndAtOnce(str(tmp_path / "broker.sock") if family == "unix" else None)
    client = Client(server.endpoint, timeout=3, retries=2, maxConnections=1, extensions=False)
    got: list[Any] = []
    try:
        def onPartial(body: list[bytes]) -> None:
            got.append(body)
            got.append(client.request("s", b"inner", timeout=10, retries=1))

        assert client.request("s", b"stream", onPartial=onPartial,
                              onRestart=lambda: got.append("restart")) == [b"end"]
        assert got == [[b"p1"], [b"inner"]]
        assert server.seen == [b"stream", b"inner"]
    finally:
        client.close()
        server.stop()


def part_and_end(peer: bytes, body: list[bytes]) -> list[ScriptReply]:
    """``stream``: a part and the end; ``slow``: never answered; anything
    else: its body."""
    if body == [b"stream"]:
        return [(peer, PARTIAL, [b"p1"]), (peer, FINAL, [b"end"])]
    if body == [b"slow"]:
        return []
    return [(peer, FINAL, body)]


def test_a_request_inside_on_partial_gets_the_zmq_connection_whose_end_came() -> None:
    """ZeroMQ, two connections (the loop polls their descriptors): the end of
    the reply is in the socket behind the part whose *onPartial* makes a
    request, its descriptor's signal spent by that read; the request waits
    for that connection (the other carries an unanswered request): its wait
    asks that socket before it blocks, and reads the end there."""
    context = zmq.Context()
    broker = InprocBroker(part_and_end, context, b"stream")
    client = Client(broker.endpoint, timeout=5, retries=1, maxConnections=2, context=context)
    got: list[Any] = []
    try:
        pending = client.map("s", [b"warm", b"slow"], window=2)
        assert next(pending) == [b"warm"]  # one connection idle, the other carries "slow"

        def onPartial(body: list[bytes]) -> None:
            got.append(body)
            assert broker.replied[b"stream"].wait(10)  # the end is in the socket now
            got.append(client.request("s", b"inner"))

        assert client.request("s", b"stream", onPartial=onPartial,
                              onRestart=lambda: got.append("restart")) == [b"end"]
        assert got == [[b"p1"], [b"inner"]]
        assert broker.seen.count([b"stream"]) == 1
        pending.close()
    finally:
        client.close()
        broker.stop()
        context.term()


def parts_then_end(peer: bytes, body: list[bytes]) -> list[ScriptReply]:
    """``many``: 300 parts and the end; anything else: its body."""
    if body == [b"many"]:
        return [(peer, PARTIAL, [b"%d" % n]) for n in range(300)] + [(peer, FINAL, [b"end"])]
    return [(peer, FINAL, body)]


def test_closing_the_client_from_a_callback_ends_the_request_with_client_closed() -> None:
    """*onPartial* closes the client while the loop reads parts that were
    waiting in a socket before it looked (more than one read takes: the
    rest are read as the loop asks that socket before it waits): the loop
    does not wait on the poller the close released, and the request ends
    with ClientClosed."""
    context = zmq.Context()
    broker = InprocBroker(parts_then_end, context, b"many")
    client = Client(broker.endpoint, timeout=10, retries=1, maxConnections=2, context=context)
    parts: list[list[bytes]] = []
    try:
        assert list(client.map("s", [b"a", b"b"], window=2)) == [[b"a"], [b"b"]]

        def onPartial(body: list[bytes]) -> None:
            parts.append(body)
            if len(parts) == 1:
                assert broker.replied[b"many"].wait(10)  # all of them in the socket now
            elif len(parts) == 100:
                client.close()

        with pytest.raises(errors.ClientClosed):
            client.request("s", b"many", onPartial=onPartial)
        assert len(parts) == 100
    finally:
        client.close()
        broker.stop()
        context.term()


# --- the blocking worker's stream and its broker ------------------------------------------

WORKER, READY, REQUEST, W_HEARTBEAT = b"MDPW02", b"\x01", b"\x02", b"\x05"


class StreamedWorker:
    """A blocking :class:`~mdp.blocking.Worker` for ``s`` in a thread, on an
    ``inproc`` endpoint the test's ROUTER binds, its handler a generator
    that yields parts until ``ending`` is set (``closed``: its ``finally``
    ran)."""

    def __init__(self, interval: float = 0.1) -> None:
        from mdp.blocking import Worker
        from mdp.policy import Backoff, HeartbeatPolicy

        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        endpoint = f"inproc://blocking-stream-{id(self)}"
        self.router.bind(endpoint)
        self.ending = threading.Event()
        self.closed = threading.Event()
        self.worker = Worker(f"zmq:{endpoint}", "s", self.parts,
                             heartbeat=HeartbeatPolicy(interval, 3),
                             backoff=Backoff(0.05, 0.2), context=self.context)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.worker.run, args=(self.done.is_set,),
                                       daemon=True)
        self.thread.start()

    def parts(self, frames: list[bytes]) -> Any:
        try:
            n = 0
            while not self.ending.is_set():
                yield b"%d" % n
                n += 1
        finally:
            self.closed.set()

    def receive(self, timeout: float = 10.0) -> list[bytes]:
        assert self.router.poll(int(timeout * 1000)), "nothing from the worker"
        return self.router.recv_multipart()

    def ready(self, deadline: float) -> bytes:
        """The routing id of the next READY (what comes before it is dropped)."""
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "no READY from the worker"
            frames = self.receive(left)
            if frames[1:3] == [WORKER, READY]:
                return bytes(frames[0])

    def stop(self) -> None:
        self.ending.set()
        self.done.set()
        self.thread.join(10)
        alive = self.thread.is_alive()
        self.router.close()
        if not alive:
            self.context.term()
        assert not alive


@pytest.mark.parametrize("reads", [False, True])
def test_a_blocking_worker_streaming_to_a_silent_broker_stops_the_stream_and_reconnects(
        reads: bool) -> None:
    """The broker goes silent while the worker streams (and stops reading
    its parts, or reads them on): the worker notices its silence as between
    requests, closes the handler's generator (its ``finally`` runs) and
    registers again on a fresh socket."""
    running = StreamedWorker()
    try:
        first = running.ready(time.monotonic() + 10)
        running.router.send_multipart([first, WORKER, REQUEST, b"client", b"", b"go"])
        # nothing sent from now on: the broker is dead to the worker
        if reads:
            again = running.ready(time.monotonic() + 10)  # (the parts are read meanwhile)
            assert running.closed.is_set()
        else:
            assert running.closed.wait(10), "the stream went on with a silent broker"
            again = running.ready(time.monotonic() + 10)
        assert again != first  # a fresh socket
        assert not running.ending.is_set()
    finally:
        running.stop()


def test_a_blocking_worker_streaming_to_a_live_broker_goes_on() -> None:
    """A broker that reads the parts and sends its heartbeats keeps a
    stream going for many times the heartbeat expiry: the worker reads
    them meanwhile and does not give its broker up."""
    running = StreamedWorker()
    try:
        worker = running.ready(time.monotonic() + 10)
        running.router.send_multipart([worker, WORKER, REQUEST, b"client", b"", b"go"])
        start = last = time.monotonic()
        expiry = running.worker.machine.heartbeat.expiry
        parts = 0
        while time.monotonic() - start < 5 * expiry:
            frames = running.receive()
            assert frames[0] == worker and frames[2] != READY, "the worker registered again"
            parts += 1
            if time.monotonic() - last >= running.worker.machine.heartbeat.interval / 2:
                last = time.monotonic()
                running.router.send_multipart([worker, WORKER, W_HEARTBEAT])
        assert not running.closed.is_set() and parts > 1
        running.ending.set()
        while True:  # the end of the stream: a FINAL, on the same socket
            frames = running.receive()
            assert frames[0] == worker
            if frames[2] == b"\x04":
                break
        assert running.closed.wait(10)
    finally:
        running.stop()


# --- an interrupt (Ctrl-C) anywhere in a request ---------------------------------------------

def _swallows(code: Any) -> bool:
    """Whether what *code* raises goes nowhere: a weak reference's callback
    or a finaliser, which the collector may run at any step (an interrupt
    raised there is printed and lost, and the request goes on)."""
    return code.co_name == "__del__" or code.co_filename.endswith(
        ("_weakrefset.py", "weakref.py"))


@contextlib.contextmanager
def interrupt_at(n: int) -> Iterator[None]:
    """Raise a KeyboardInterrupt as the *n*-th Python function run inside
    the block is entered (where a Ctrl-C lands: a signal's handler runs
    between the interpreter's steps)."""
    count = 0
    previous = sys.gettrace()

    def tracer(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call" and not _swallows(frame.f_code):
            count += 1
            if count == n:
                sys.settrace(previous)
                raise KeyboardInterrupt
        return None

    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


def interrupted_at(client: Client, n: int, body: bytes) -> bool:
    """``client.request("s", body)`` interrupted at its *n*-th step
    (:func:`interrupt_at`); whether that point was reached (the interrupt
    came)."""
    try:
        with interrupt_at(n):
            client.request("s", body)
    except KeyboardInterrupt:
        return True
    return False


def map_interrupted_at(client: Client, n: int, bodies: list[bytes]) -> bool:
    """``list(client.map("s", bodies, window=4))`` interrupted as in
    :func:`interrupted_at`; whether the interrupt came."""
    try:
        with interrupt_at(n):
            list(client.map("s", bodies, window=4))
    except KeyboardInterrupt:
        return True
    return False


def answers_at_once(client: Client, tag: bytes) -> None:
    """The next calls succeed at once, each with its own reply (never one
    left from the interrupted call)."""
    started = time.monotonic()
    assert client.request("s", tag + b"-one") == [tag + b"-one"]
    again = [tag + b"-%d" % i for i in range(6)]
    window = min(4, client.machine.maxConnections)
    assert list(client.map("s", again, window=window)) == [[body] for body in again]
    assert time.monotonic() - started < 1.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("connections", [1, 4])
@pytest.mark.parametrize("broker", [echo], indirect=True)
def test_after_an_interrupt_anywhere_in_a_request_the_next_call_starts_clean(
        broker: ScriptedBroker, connections: int) -> None:
    """A Ctrl-C at any step of a request (in the machine, in what it asked
    the driver to do, in the wait): that request raises it, the client drops
    its connections, and the next calls are answered at once, each with its
    own reply (docs/blocking.md, "An interrupted call")."""
    points = 0
    for n in range(1, 400):
        with Client(broker.endpoint, timeout=2.0, retries=1, maxConnections=connections) as client:
            assert client.request("s", b"first") == [b"first"]
            if not interrupted_at(client, n, b"cut"):
                break  # past the request's last step
            points += 1
            answers_at_once(client, b"after%d" % n)
    assert points >= 1  # (compiled, fewer steps are Python: the interrupt lands at those)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("broker", [echo], indirect=True)
def test_a_second_interrupt_during_the_clean_up_of_the_first_leaves_the_client_usable(
        broker: ScriptedBroker) -> None:
    """A Ctrl-C at any step of what the client does after an interrupt
    (``_drop``: close every connection, a fresh machine and loop): the next
    calls are still answered at once."""
    points = 0
    for n in range(1, 400):
        with Client(broker.endpoint, timeout=2.0, retries=1) as client:
            assert client.request("s", b"first") == [b"first"]
            try:
                with interrupt_at(n):
                    client._drop()
            except KeyboardInterrupt:
                points += 1
                answers_at_once(client, b"after%d" % n)
            else:
                break  # past its last step
    assert points >= 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("broker", [echo], indirect=True)
def test_after_an_interrupt_anywhere_in_a_map_the_next_call_starts_clean(
        broker: ScriptedBroker) -> None:
    """A Ctrl-C at any step of a ``map()``: the map raises it, none of its
    requests is sent a second time, and the next calls are answered at once
    with their own replies."""
    points = 0
    for n in range(1, 600, 3):
        with Client(broker.endpoint, timeout=2.0, retries=1, maxConnections=4) as client:
            assert client.request("s", b"first") == [b"first"]
            bodies = [b"%d-%d" % (n, i) for i in range(8)]
            if not map_interrupted_at(client, n, bodies):
                break
            points += 1
            answers_at_once(client, b"again%d" % n)
        sent = [body[0] for body in broker.seen if body and body[0] in bodies]
        assert len(sent) == len(set(sent)), (n, sent)
    assert points >= 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["map", "request"])
def test_after_an_interrupt_while_a_stream_connection_comes_up_the_next_call_starts_clean(
        how: str) -> None:
    """The same over ``tcp:``, where the pipes share one connection that
    comes up after they are opened: a Ctrl-C at every third step of a
    first request or map, and the next calls get their own replies at once."""
    server = ChannelServer()
    try:
        for n in range(1, 3000, 3):
            with Client(server.endpoint, timeout=1.5, retries=1, maxConnections=4,
                        extensions=False) as client:
                if how == "map":
                    hit = map_interrupted_at(client, n, [b"%d-%d" % (n, i) for i in range(8)])
                else:
                    hit = interrupted_at(client, n, b"cut")
                if not hit:
                    break
                answers_at_once(client, b"again%d" % n)
        assert n > 1 and not hit, "the request was never done within the steps tried"
    finally:
        server.stop()


outer_runs: list[bytes] = []


def outer_then_release(peer: bytes, body: list[bytes]) -> list[ScriptReply]:
    """``outer``: a part, its end only once ``release`` comes (on the
    connection ``outer`` came on); ``inner``: nothing; else an echo."""
    if body == [b"outer"]:
        outer_runs.append(peer)
        return [(peer, PARTIAL, [b"p1"])]
    if body == [b"inner"]:
        return []
    if body == [b"release"]:
        return [(outer_runs[0], FINAL, [b"end"]), (peer, FINAL, body)]
    return [(peer, FINAL, body)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("broker", [outer_then_release], indirect=True)
def test_an_interrupt_of_a_request_inside_a_callback_fails_the_outer_request_too(
        broker: ScriptedBroker) -> None:
    """A request made from ``onPartial`` is interrupted (Ctrl-C) and the
    callback catches it: the client dropped every connection, so the outer
    request, in flight on one of them, fails with ClientClosed (it is not
    sent again, and its end, sent after, reaches nobody); a request made
    after the interrupt is answered."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    outer_runs.clear()
    events: list[Any] = []
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with Client(broker.endpoint, timeout=5.0, retries=1, maxConnections=4) as client:
            def onPartial(body: list[bytes]) -> None:
                events.append(body)
                signal.setitimer(signal.ITIMER_REAL, 0.2)
                try:
                    client.request("s", b"inner")
                except KeyboardInterrupt:
                    events.append("interrupted")
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                events.append(client.request("s", b"release"))

            with pytest.raises(errors.ClientClosed, match="interrupt"):
                client.request("s", b"outer", onPartial=onPartial)
            answers_at_once(client, b"later")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert events == [[b"p1"], "interrupted", [b"release"]]
    assert len(outer_runs) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("broker", [outer_then_release], indirect=True)
def test_a_client_closed_in_a_callback_stays_closed_after_an_interrupt(
        broker: ScriptedBroker) -> None:
    """A callback closes the client and an interrupt (Ctrl-C) then ends the
    request: the client stays closed, so the next request raises ClientClosed
    at once (not a timeout, spent polling a closed loop)."""
    outer_runs.clear()
    with Client(broker.endpoint, timeout=2.0, retries=1) as client:
        def onPartial(body: list[bytes]) -> None:
            client.close()
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            client.request("s", b"outer", onPartial=onPartial)
        started = time.monotonic()
        with pytest.raises(errors.ClientClosed):
            client.request("s", b"later")
        assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("broker", [echo], indirect=True)
def test_an_interrupt_in_a_maps_items_closes_the_connections(broker: ScriptedBroker) -> None:
    """A Ctrl-C raised by the items a ``map()`` reads (outside any call) ends
    the map as an interrupted call does: the connections are closed, and the
    next request is answered at once with its own reply."""
    def items() -> Iterator[bytes]:
        yield b"one"
        yield b"two"
        raise KeyboardInterrupt

    with Client(broker.endpoint, timeout=2.0, retries=1, maxConnections=4) as client:
        with pytest.raises(KeyboardInterrupt):
            for _ in client.map("s", items(), window=4):
                pass
        assert not client._loop.pipes and not client._loop.links
        answers_at_once(client, b"after")
