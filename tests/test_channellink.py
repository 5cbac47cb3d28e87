"""mdp.transport.channellink: the channels of one stream connection, the one
core of the Twisted StreamChannels and the blocking client's link.  Random
runs of the connection's events keep its rules: names unique among the open
channels, a channel up only while the connection is, closed ones gone, what
is held counted exactly, and each loss told once per channel that was up."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from mdp.policy import Limits, held_bytes
from mdp.transport.channellink import END, Channel, ChannelLink

EVENTS = st.lists(st.tuples(
    st.sampled_from(["open", "made", "lost", "refused", "ended", "comeUp", "hold", "release",
                     "close", "closeAll"]),
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
    link = ChannelLink(Limits(maxOutputBytes=1000), maxQueued=5)
    pipes: list[Channel] = []
    for kind, which in events:
        pipe = pipes[which % len(pipes)] if pipes else None
        if kind == "open" or pipe is None:
            pipe = Channel()
            link.open(pipe)
            pipes.append(pipe)
        elif kind == "made":
            for channel in link.made():
                assert not channel.up and not channel.closed and not channel.waiting
                link.comeUp(channel)
        elif kind in ("lost", "refused"):
            refused = pipe.id if kind == "refused" else None
            up = {channel.id for channel in link.channels.values() if channel.up}
            down = link.lost(refused)
            assert {channel.id for channel, _ in down} == up  # each told once
            assert all(own == (refused is None or channel.id == refused) for channel, own in down)
        elif kind == "ended" and link.channels.get(pipe.id) is pipe:
            old, was = pipe.id, pipe.up
            record, told = link.endedThere(pipe)
            assert record == old + END and told == was
            assert pipe.id != old and not pipe.up and pipe.waiting
        elif kind == "comeUp":
            link.comeUp(pipe)
        elif kind == "hold" and not pipe.closed:
            link.hold(pipe, [b"x" * which])
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
    link = ChannelLink(Limits())
    pipe = Channel()
    link.open(pipe)
    link.sending(pipe.id, 100)
    assert link.stale(pipe.id, 99)
    assert not link.stale(pipe.id, 100)
    assert not link.stale(pipe.id, 0)  # (known to have left: no longer tracked)


def test_the_twisted_and_the_blocking_shells_hold_the_same_core() -> None:
    """Both shells are made of the one core: their pipes are its channels."""
    from mdp.transport.channels import StreamChannels, _StreamChannel
    from mdp.transport.pipes import _LinkPipe, _StreamLink

    assert issubclass(_StreamChannel, Channel) and issubclass(_LinkPipe, Channel)
    shells: Any = (StreamChannels.__init__, _StreamLink.__init__)
    assert all("ChannelLink" in shell.__code__.co_names for shell in shells)
