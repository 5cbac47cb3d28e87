"""mdp.transport.dealercore: the one core of the Twisted ZmqDealer and the
blocking nodes' ZeroMQ pipe."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mdp.errors import OversizedMessage
from mdp.policy import Limits, held_bytes
from mdp.transport.dealercore import DealerCore


@given(st.lists(st.binary(max_size=40), max_size=30))
def test_the_backlog_keeps_the_order_within_its_bound(bodies: list[bytes]) -> None:
    core = DealerCore(Limits(maxOutputBytes=400), lambda failures: 1.0)
    kept = [[body] for body in bodies if core.hold([body])]
    assert list(core.backlog) == kept
    assert core.backlogBytes == sum(held_bytes(frames) for frames in kept) <= 400
    while core.backlog:
        core.sent()
    assert core.backlogBytes == 0


def test_an_unbounded_backlog_refuses_nothing() -> None:
    core = DealerCore(Limits(maxOutputBytes=64), lambda failures: 1.0, bounded=False)
    assert all(core.hold([b"x" * 100]) for _ in range(5)) and len(core.backlog) == 5


def test_a_message_over_the_limits_drops_the_backlog_and_says_why() -> None:
    core = DealerCore(Limits(), lambda failures: 1.0)
    core.hold([b"waiting"])
    core.failures = 3
    why = core.oversized(2000, 3)
    assert isinstance(why, OversizedMessage) and "2000+ bytes in 3 frames" in str(why)
    assert not core.backlog and core.backlogBytes == 0 and core.failures == 0


def test_a_socket_not_had_is_tried_again_on_the_schedule_until_one_is() -> None:
    core = DealerCore(Limits(), lambda failures: 2.0 ** failures)
    assert [core.openFailed() for _ in range(3)] == [1.0, 2.0, 4.0]
    core.clear()  # a socket was had
    assert core.openFailed() == 1.0
