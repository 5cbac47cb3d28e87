"""SP REQ/REP machines with no transport: ids, resend, cancellation, stray
replies, round-robin as channels come and go, REP's drop rules and
duplicates, a device's hops."""

from __future__ import annotations

import random
from collections import Counter
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdp.sp.codec import BOTTOM, word
from mdp.sp.machines import (
    Complete,
    DeviceMachine,
    Dropped,
    Forward,
    Overloaded,
    RepMachine,
    ReqMachine,
    SendOn,
    Serve,
    WakeAt,
)


def sends(actions: list) -> list[tuple]:
    return [(a.channel, a.body) for a in actions if isinstance(a, SendOn)]


def test_request_ids_count_up_with_the_top_bit_set_and_wrap() -> None:
    req = ReqMachine(0x7FFFFFFF)
    req.handleChannelUp("a", 0.0)
    first, actions = req.handleRequest(b"x", 0.0)
    second, _ = req.handleRequest(b"y", 0.0)
    assert (first, second) == (0xFFFFFFFF, BOTTOM)
    assert sends(actions) == [("a", word(0xFFFFFFFF) + b"x")]


def test_a_request_waits_for_a_channel_then_resends_until_answered() -> None:
    req = ReqMachine(5, resend=60.0)
    rid, actions = req.handleRequest(b"hi", 0.0)
    assert sends(actions) == [] and WakeAt(None) not in actions
    actions = req.handleChannelUp("a", 1.0)
    assert sends(actions) == [("a", word(rid) + b"hi")] and WakeAt(61.0) in actions
    assert sends(req.handleWake(61.0)) == [("a", word(rid) + b"hi")]
    actions = req.handleReply("a", word(rid) + b"HI", 70.0)
    assert Complete(rid, b"HI") in actions and WakeAt(None) in actions
    # the same reply again, and one nobody asked for: dropped
    assert [type(a) for a in req.handleReply("a", word(rid) + b"HI", 71.0)] == [Dropped]
    assert [type(a) for a in req.handleReply("a", word(BOTTOM | 999) + b"?", 71.0)] == [Dropped]
    assert [type(a) for a in req.handleReply("a", b"ab", 71.0)] == [Dropped]


def test_a_cancelled_request_is_not_resent_and_its_reply_is_dropped() -> None:
    req = ReqMachine(1, resend=1.0)
    req.handleChannelUp("a", 0.0)
    rid, _ = req.handleRequest(b"x", 0.0)
    assert WakeAt(None) in req.handleCancel(rid, 0.5)
    assert sends(req.handleWake(1.0)) == []
    assert [type(a) for a in req.handleReply("a", word(rid) + b"late", 2.0)] == [Dropped]


def test_round_robin_stays_fair_as_channels_come_and_go() -> None:
    req = ReqMachine(1)
    for channel in "abc":
        req.handleChannelUp(channel, 0.0)
    used = [sends(req.handleRequest(b"%d" % n, 0.0)[1])[0][0] for n in range(6)]
    assert used == list("abcabc")
    req.handleChannelDown("b", 0.0)
    req.handleChannelUp("d", 0.0)
    used = [sends(req.handleRequest(b"x", 0.0)[1])[0][0] for _ in range(30)]
    assert Counter(used) == {"a": 10, "c": 10, "d": 10}


def test_requests_of_a_lost_channel_go_out_again_at_once() -> None:
    req = ReqMachine(1)
    req.handleChannelUp("a", 0.0)
    req.handleChannelUp("b", 0.0)
    ra, _ = req.handleRequest(b"1", 0.0)  # on a
    rb, _ = req.handleRequest(b"2", 0.0)  # on b
    assert sends(req.handleChannelDown("a", 1.0)) == [("b", word(ra) + b"1")]
    assert sends(req.handleChannelDown("b", 2.0)) == []  # both wait for a channel
    assert sorted(sends(req.handleChannelUp("c", 3.0))) == sorted(
        [("c", word(ra) + b"1"), ("c", word(rb) + b"2")])


def test_resend_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ReqMachine(1, resend=0)


def wake_of(actions: list, wake: Optional[float]) -> Optional[float]:
    """The wake-up asked for after *actions*, *wake* before them."""
    for action in actions:
        if isinstance(action, WakeAt):
            wake = action.when
    return wake


def test_the_resend_deadlines_stay_bounded_over_many_requests_and_replies() -> None:
    """Deadlines of answered requests do not pile up behind one never answered,
    whatever order the replies come in; answered in the order sent, none is
    kept at all."""
    req = ReqMachine(1, resend=60.0)
    req.handleChannelUp("a", 0.0)
    req.handleRequest(b"slow", 0.0)  # heads the heap, never answered
    for n in range(3000):
        now = n / 100
        newer = [req.handleRequest(b"x", now)[0] for _ in range(3)]
        for rid in reversed(newer):  # the newest first: the head stays live
            req.handleReply("a", word(rid) + b"r", now)
        assert len(req.requests) == 1
        assert len(req._sent) == 1
    in_order = ReqMachine(1, resend=60.0)
    in_order.handleChannelUp("a", 0.0)
    for n in range(1000):
        rids = [in_order.handleRequest(b"x", float(n))[0] for _ in range(3)]
        in_order.handleReply("a", word(rids[0]) + b"r", float(n))
        in_order.handleCancel(rids[1], float(n))
        in_order.handleReply("a", word(rids[2]) + b"r", float(n))
        assert not in_order._sent


def test_the_wake_up_after_many_replies_and_cancels_is_the_earliest_live_one() -> None:
    """Requests answered or cancelled in a scrambled order: each wake-up asked
    for is the earliest resend deadline of those still out."""
    req = ReqMachine(1, resend=1000.0)
    req.handleChannelUp("a", 0.0)
    sentAt: dict[int, float] = {}
    wake: Optional[float] = None
    for n in range(400):
        rid, actions = req.handleRequest(b"x", float(n))
        sentAt[rid] = float(n)
        wake = wake_of(actions, wake)
    order = list(sentAt)
    random.Random(7).shuffle(order)
    for k, rid in enumerate(order[:-5]):
        if k % 2:
            actions = req.handleReply("a", word(rid) + b"r", 400.0)
        else:
            actions = req.handleCancel(rid, 400.0)
        del sentAt[rid]
        wake = wake_of(actions, wake)
        assert wake == min(sentAt.values()) + 1000.0
        assert len(req._sent) == len(sentAt)
    for rid in order[-5:]:
        wake = wake_of(req.handleCancel(rid, 401.0), wake)
    assert wake is None and not req._sent


def test_a_request_sent_after_the_clock_went_back_is_resent_at_its_own_deadline() -> None:
    machine = ReqMachine(1, resend=60.0, now=1000.0)
    machine.handleChannelUp("ch", 1000.0)
    machine.handleRequest(b"A", 1000.0)  # due at 1060
    machine.handleRequest(b"B", 400.0)  # the clock stepped back: due at 460
    assert machine.wakeAt == 460.0
    assert [a.body[4:] for a in machine.handleWake(460.0) if isinstance(a, SendOn)] == [b"B"]


def test_a_late_wake_resends_all_that_is_due_oldest_request_first() -> None:
    """Requests due at one wake-up go out in the order they were made, not
    the order their deadlines fall in; what is not due stays put."""
    req = ReqMachine(1, resend=60.0)
    req.handleChannelUp("a", 0.0)
    req.handleChannelUp("b", 0.0)
    first, _ = req.handleRequest(b"1", 0.0)  # on a
    second, _ = req.handleRequest(b"2", 0.0)  # on b
    req.handleChannelDown("a", 1.0)  # first goes out again on b: due at 61, after second
    req.handleRequest(b"3", 50.0)
    assert sends(req.handleWake(59.0)) == []
    assert [body for _, body in sends(req.handleWake(70.0))] == [word(first) + b"1",
                                                                 word(second) + b"2"]
    assert sorted(r.resendAt for r in req.requests.values()) == [110.0, 130.0, 130.0]


EVENTS = st.lists(st.tuples(
    st.sampled_from(["request", "reply", "cancel", "wake", "up", "down"]),
    st.integers(min_value=0, max_value=3),  # how far time moves on
    st.integers(min_value=0, max_value=40)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(EVENTS, st.sampled_from([1.0, 2.0, 3.0]))
def test_wake_ups_and_resends_match_a_look_at_every_request(
        events: list[tuple[str, int, int]], resend: float) -> None:
    """Random requests, replies, cancels, wake-ups and channels coming and
    going: each wake-up asked for is the earliest deadline among all the
    requests out, a wake-up resends exactly those due, oldest first, and
    only the requests out have a deadline kept."""
    req = ReqMachine(1, resend=resend)
    now = 0.0
    issued: list[int] = []
    wake: Optional[float] = None
    for kind, step, pick in events:
        now += step
        chosen = issued[pick % len(issued)] if issued else BOTTOM
        expected = None
        if kind == "request":
            rid, actions = req.handleRequest(b"%d" % len(issued), now)
            issued.append(rid)
        elif kind == "reply":
            actions = req.handleReply("a", word(chosen) + b"r", now)
        elif kind == "cancel":
            actions = req.handleCancel(chosen, now)
        elif kind == "wake":
            expected = [r.body for r in req.requests.values()
                        if r.channel is not None and r.resendAt <= now]
            actions = req.handleWake(now)
        elif kind == "up":
            actions = req.handleChannelUp("abc"[pick % 3], now)
        else:
            actions = req.handleChannelDown("abc"[pick % 3], now)
        if expected is not None:
            assert [body for _, body in sends(actions)] == expected
        wake = wake_of(actions, wake)
        out = [r.resendAt for r in req.requests.values() if r.channel is not None]
        assert wake == (min(out) if out else None)
        assert len(req._sent) == len(out)


# --- REP ----------------------------------------------------------------------------------


def test_rep_serves_once_per_backtrace_and_routes_the_reply_back() -> None:
    rep = RepMachine(100)
    request = word(BOTTOM | 7) + b"payload"
    [serve] = rep.handleRequest("a", request, 0.0)
    assert isinstance(serve, Serve) and serve.payload == b"payload"
    # a resend of the same request while in hand: answered once
    assert [type(a) for a in rep.handleRequest("a", request, 1.0)] == [Dropped]
    assert sends(rep.handleReply(serve.token, b"done", 2.0)) == [("a", word(BOTTOM | 7) + b"done")]
    assert rep.handleReply(serve.token, b"again", 2.0) == []  # answered already
    # once answered, a new copy runs again (nng resends until it hears)
    assert [type(a) for a in rep.handleRequest("a", request, 3.0)] == [Serve]


def test_rep_drop_rules() -> None:
    rep = RepMachine(1)
    for bad in (b"", word(1) + word(2), word(1) * 9 + word(BOTTOM)):
        assert [type(a) for a in rep.handleRequest("a", bad, 0.0)] == [Dropped]
    [serve] = rep.handleRequest("a", word(BOTTOM | 1) + b"x", 0.0)
    rep.handleChannelDown("a", 1.0)
    assert [type(a) for a in rep.handleReply(serve.token, b"y", 2.0)] == [Dropped]
    [serve] = rep.handleRequest("b", word(BOTTOM | 2) + b"x", 3.0)
    assert rep.handleReply(serve.token, None, 4.0) == []  # the handler cancelled


def test_rep_holds_at_most_max_pending_requests_and_bytes_in_hand() -> None:
    """Beyond either bound a request is dropped (its requester resends it);
    each reply, or cancel, makes room again."""
    rep = RepMachine(1, maxPending=2, maxPendingBytes=10)
    serves = [rep.handleRequest("a", word(BOTTOM | n) + b"1234", 0.0)[0] for n in range(2)]
    assert all(isinstance(serve, Serve) for serve in serves)
    [over] = rep.handleRequest("b", word(BOTTOM | 3) + b"x", 0.0)  # a third request
    assert isinstance(over, Overloaded) and "maxPending 2" in over.reason
    rep.handleReply(serves[0].token, b"done", 1.0)
    [heavy] = rep.handleRequest("b", word(BOTTOM | 4) + b"1234567", 2.0)  # 4 + 7 > 10 bytes
    assert isinstance(heavy, Overloaded) and "(4 bytes) in hand" in heavy.reason
    rep.handleReply(serves[1].token, None, 3.0)  # cancelled: its room is free too
    assert [type(a) for a in rep.handleRequest("b", word(BOTTOM | 4) + b"1234567", 4.0)] == [Serve]
    assert rep.pendingBytes == 7 and len(rep.inHand) == 1
    alone = RepMachine(1, maxPending=2, maxPendingBytes=10)  # nothing in hand: any size gets in
    [big] = alone.handleRequest("a", word(BOTTOM | 1) + b"x" * 50, 0.0)
    assert isinstance(big, Serve)
    assert isinstance(alone.handleRequest("a", word(BOTTOM | 2) + b"x", 0.0)[0], Overloaded)
    with pytest.raises(ValueError):
        RepMachine(1, maxPending=0)


def test_channel_ids_start_where_told_wrap_and_skip_those_in_use() -> None:
    rep = RepMachine(0x7FFFFFFE)
    for channel in "abc":
        rep.handleRequest(channel, word(BOTTOM | 1) + b"x", 0.0)
    assert rep.byChannel == {"a": 0x7FFFFFFE, "b": 0x7FFFFFFF, "c": 0}


# --- device -------------------------------------------------------------------------------


def test_a_device_pushes_and_pops_its_channel_id() -> None:
    device = DeviceMachine(40)
    upstream = device.handleRequest("client", word(BOTTOM | 9) + b"q", 0.0)
    assert upstream == [Forward(word(40) + word(BOTTOM | 9) + b"q")]
    assert sends(device.handleReply(word(40) + word(BOTTOM | 9) + b"r", 1.0)) == [
        ("client", word(BOTTOM | 9) + b"r")]
    for bad in (word(41) + b"x", word(BOTTOM | 40) + b"x", b"ab"):
        assert [type(a) for a in device.handleReply(bad, 2.0)] == [Dropped]


def test_a_device_drops_a_request_that_would_go_over_the_hops() -> None:
    device = DeviceMachine(1)
    six = b"".join(word(n) for n in range(6))
    assert [type(a) for a in device.handleRequest("c", six + word(BOTTOM) + b"x", 0.0)] == [
        Forward]
    seven = six + word(6)  # the device's own word would make 8: over nng's limit
    assert [type(a) for a in device.handleRequest("c", seven + word(BOTTOM) + b"x", 0.0)] == [
        Dropped]
