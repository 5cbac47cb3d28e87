"""mdp.transport.channellink: the channels of one stream connection, the one
core of the Twisted StreamChannels and the blocking client's link.  Random
runs of the connection's events keep its rules: names unique among the open
channels, a channel up only while the connection is, closed ones gone, what
is held counted exactly, and each loss told once per channel that was up."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from mdp.errors import RecordTooLarge
from mdp.policy import Limits, held_bytes
from mdp.transport.channellink import DELIVER, END, ENDED, IGNORE, STALE, Channel, ChannelLink

EVENTS = st.lists(st.tuples(
    st.sampled_from(["open", "made", "lost", "refused", "ended", "message", "comeUp", "hold",
                     "release", "close", "closeAll"]),
    st.integers(0, 7)), max_size=60)


def _check(link: ChannelLink, pipes: list[Channel]) -> None:
    names = [channel.id for channel in link.channels.values()]
    assert len(set(names)) == len(names)
    assert all(link.channels[channel.id] is channel for channel in link.channels.values())
    for channel in pipes:
        if channel.up:
            assert link.connected and not channel.closed and not channel.waiting
            assert link.channels.get(channel.id) is channel
        if channel.closed:
            assert link.channels.get(channel.id) is not channel and channel.held is None
    held = [frames for channel in link.channels.values() for frames in channel.held or ()]
    assert link.queued == len(held)
    assert link.queuedBytes == sum(held_bytes(frames) for frames in held)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_any_run_of_events_keeps_the_rules_of_the_channels(events: list[tuple[str, int]]) -> None:
    link = ChannelLink()
    pipes: list[Channel] = []
    for kind, which in events:
        pipe = pipes[which % len(pipes)] if pipes else None
        if kind == "open" or pipe is None:
            pipe = Channel()
            link.open(pipe)
            pipes.append(pipe)
        elif kind == "made":
            down = [channel for channel in link.channels.values()
                    if not channel.up and not channel.closed and not channel.waiting]
            assert list(link.made()) == down and all(channel.up for channel in down)
        elif kind in ("lost", "refused"):
            why = RecordTooLarge("over")
            if kind == "refused":
                why.channel = pipe.id  # type: ignore[attr-defined]
            up = {channel.id for channel in link.channels.values() if channel.up}
            lost = link.lost(why)
            assert {channel.id for channel, _ in lost} == up  # each told once
            assert all((reason is why) == (kind == "lost" or channel is pipe)
                       for channel, reason in lost)
        elif kind == "ended" and link.channels.get(pipe.id) is pipe:
            old, was = pipe.id, pipe.up
            assert link.received(pipe, []) == ENDED
            record, why, delay = link.endedThere(pipe)
            assert record == old + END and (why is not None) == was and delay > 0
            assert pipe.id != old and not pipe.up and pipe.waiting
        elif kind == "message" and link.channels.get(pipe.id) is pipe:
            pipe.ends = which
            what = link.received(pipe, [b"x"])
            assert what == (DELIVER if pipe.up else IGNORE) and pipe.ends == (0 if pipe.up else which)
        elif kind == "comeUp":
            link.comeUp(pipe)
        elif kind == "hold" and not pipe.closed:
            link.hold(pipe, [b"x" * which], held_bytes([b"x" * which]))
        elif kind == "release":
            link.release(pipe)
        elif kind == "close":
            record = link.close(pipe)
            assert record is None or record.endswith(END)
        elif kind == "closeAll":
            link.closeAll()
            assert not link.channels
        _check(link, pipes)


def test_stale_is_what_comes_before_a_channels_message_left_whole() -> None:
    link = ChannelLink()
    pipe = Channel()
    link.open(pipe)
    link.unsent[pipe.id] = 100
    assert link.stale(pipe.id, 99)
    assert not link.stale(pipe.id, 100)
    assert not link.stale(pipe.id, 0)  # (known to have left: no longer tracked)
    link.connected = True
    link.comeUp(pipe)
    link.unsent[pipe.id] = 100
    assert link.received(pipe, [b"early"], 99) == STALE
    assert link.received(pipe, [b"reply"], 100) == DELIVER


def test_the_twisted_and_the_blocking_shells_hold_the_same_core() -> None:
    """Both shells are made of the one core: their pipes are its channels."""
    from mdp.transport.channels import _StreamChannel
    from mdp.transport.pipes import _LinkPipe

    assert issubclass(_StreamChannel, Channel) and issubclass(_LinkPipe, Channel)
    heard = _Heard()
    twisted, blocking = _TwistedShell(heard), _BlockingShell(heard)
    assert isinstance(twisted.links.core, ChannelLink) and isinstance(blocking.link.core, ChannelLink)
    assert all(isinstance(pipe, Channel) for pipe in (*twisted.pipes, *blocking.pipes))


# --- the two shells, driven alike, tell their pipes the same ----------------------

SHELL_EVENTS = st.lists(st.tuples(
    st.sampled_from(["made", "failed", "lost", "refused", "message", "end", "wait", "close"]),
    st.integers(0, 2)), max_size=40)


class _Heard:
    """What a pipe's owner hears, in order, across all pipes."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def lost(self, index: int, why: Any) -> None:
        text = str(getattr(why, "value", why))
        self.events.append(("lost", index, "another channel" in text))


class _TwistedShell:
    def __init__(self, heard: _Heard) -> None:
        from types import SimpleNamespace

        from twisted.internet import defer
        from twisted.internet.task import Clock

        from mdp.transport.channels import StreamChannels

        self.clock = Clock()
        self.links = StreamChannels("tcp:host=127.0.0.1:port=1", self.clock)
        self.links.service = SimpleNamespace(  # type: ignore[assignment]
            running=True, stopService=lambda: defer.succeed(None))
        self.proto: Any = None
        self.pipes = [self.links.open(self._receiver(heard, i)) for i in range(3)]

    @staticmethod
    def _receiver(heard: _Heard, index: int) -> Any:
        class Receiver:
            def connectionMade(self) -> None:
                heard.events.append(("up", index))

            def connectionLost(self, reason: Any) -> None:
                heard.lost(index, reason)

            def connectionFailed(self, reason: Any) -> None:
                heard.events.append(("failed", index))

            def messageReceived(self, frames: list[bytes]) -> None:
                heard.events.append(("message", index, frames))

        return Receiver()

    @property
    def connected(self) -> bool:
        return self.proto is not None

    def made(self) -> None:
        from types import SimpleNamespace

        self.proto = SimpleNamespace(closing=False, dropped=False, closedHere=False, refusal=None,
                                     transport=SimpleNamespace(disconnecting=False), paused=False,
                                     encode=lambda frames: b"", closeGracefully=lambda: None,
                                     _queue=lambda record, channel=None: None)
        self.links._made(self.proto)

    def lost(self, refused: Any) -> None:
        from twisted.internet.error import ConnectionLost
        from twisted.python.failure import Failure

        proto, self.proto = self.proto, None
        if refused is not None:
            proto.refusal = refused
        self.links._lost(proto, Failure(refused or ConnectionLost("gone")))

    def failed(self) -> None:
        self.links._failed(ConnectionRefusedError("refused"))

    def receive(self, index: int, frames: list[bytes]) -> None:
        self.links._dispatch(self.proto, [(self.pipes[index].id, frames)])

    def wait(self) -> None:
        self.clock.advance(1000)

    def close(self, index: int) -> None:
        self.pipes[index].close()


class _BlockingShell:
    def __init__(self, heard: _Heard) -> None:
        from types import SimpleNamespace

        from mdp.transport.pipes import _StreamLink

        self.loop = SimpleNamespace(limits=Limits(), timed=set(), unchecked=set(), idle=set(),
                                    unflushed=set(), links={}, close=lambda pipe: None)
        self.link = _StreamLink(self.loop, "tcp:host=127.0.0.1:port=1", 0, ("127.0.0.1", 1))
        self.now = 0.0
        self.pipes = [self.link.open(self._owner(heard), i) for i in range(3)]

    @staticmethod
    def _owner(heard: _Heard) -> Any:
        class Owner:
            def _pipeUp(self, index: int, now: float) -> None:
                heard.events.append(("up", index))

            def _pipeLost(self, index: int, why: Any, now: float) -> None:
                heard.lost(index, why)

            def _pipeFailed(self, index: int, error: Any, now: float) -> None:
                heard.events.append(("failed", index))

            def _pipeMessage(self, index: int, frames: list[bytes], now: float) -> None:
                heard.events.append(("message", index, frames))

        return Owner()

    @property
    def connected(self) -> bool:
        return bool(self.link.up)

    def made(self) -> None:
        self.link.up = True
        self.link._pipeUp(None, self.now)

    def lost(self, refused: Any) -> None:
        self.link.up = False
        self.link._pipeLost(None, refused or ConnectionError("gone"), self.now)

    def failed(self) -> None:
        self.link._pipeFailed(None, ConnectionRefusedError("refused"), self.now)

    def receive(self, index: int, frames: list[bytes]) -> None:
        self.link._pipeMessage(None, (self.pipes[index].id, frames), self.now)

    def wait(self) -> None:
        self.now += 1000
        for pipe in list(self.loop.timed):
            if pipe is not self.link and pipe.retryAt is not None:
                pipe.wake(self.now)

    def close(self, index: int) -> None:
        self.pipes[index].close()


def _drive(shell: Any, events: list[tuple[str, int]]) -> None:
    from mdp.errors import RecordTooLarge

    closed: set[int] = set()
    for kind, index in events:
        pipe = shell.pipes[index]
        if kind == "made" and not shell.connected:
            shell.made()
        elif kind == "failed" and not shell.connected:
            shell.failed()
        elif kind in ("lost", "refused") and shell.connected:
            refused = None
            if kind == "refused":
                refused = RecordTooLarge("over the limits")
                refused.channel = pipe.id  # type: ignore[attr-defined]
            shell.lost(refused)
        elif kind in ("message", "end") and shell.connected and index not in closed:
            shell.receive(index, [b"reply"] if kind == "message" else [])
        elif kind == "wait":
            shell.wait()
        elif kind == "close" and index not in closed and len(closed) < 2:
            closed.add(index)
            shell.close(index)


@settings(max_examples=200, deadline=None)
@given(SHELL_EVENTS)
def test_the_twisted_and_the_blocking_shells_tell_their_pipes_the_same(
        events: list[tuple[str, int]]) -> None:
    """The same run of a connection's events (made, an attempt failed, lost,
    lost for one channel's record, a message, the far side ending a channel,
    the reconnection delay passing, a pipe closed) through StreamChannels and
    through the blocking link: each pipe hears the same, in the same order."""
    twisted, blocking = _Heard(), _Heard()
    _drive(_TwistedShell(twisted), events)
    _drive(_BlockingShell(blocking), events)
    # (the pipes whose delays end in one wait come up in either order: the
    # delays have jitter)
    for index in range(3):
        assert ([event for event in twisted.events if event[1] == index]
                == [event for event in blocking.events if event[1] == index])
