"""The Binary Star state machine: every (state, event) pair of the Guide's
table, the client vote, the configuration guard, with no transport."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from mdp.binarystar import (
    BinaryStarMachine,
    Changed,
    Conflict,
    Event,
    Fatal,
    PublishState,
    Resumed,
    Role,
    Stalled,
    State,
)

PEER_ROLE = {State.PRIMARY: Role.BACKUP, State.BACKUP: Role.PRIMARY,
             State.ACTIVE: Role.BACKUP, State.PASSIVE: Role.BACKUP}

# (state, event) -> (state after, served?, fatal?) with the peer heard from
# just now (so a client's vote does not count), as the Guide's table says
EXPECTED: dict[tuple[State, Event], tuple[State, bool, bool]] = {
    (State.PRIMARY, Event.PEER_PRIMARY): (State.PRIMARY, False, False),
    (State.PRIMARY, Event.PEER_BACKUP): (State.ACTIVE, False, False),
    (State.PRIMARY, Event.PEER_ACTIVE): (State.PASSIVE, False, False),
    (State.PRIMARY, Event.PEER_PASSIVE): (State.PRIMARY, False, False),
    (State.PRIMARY, Event.CLIENT_REQUEST): (State.PRIMARY, False, False),
    (State.BACKUP, Event.PEER_PRIMARY): (State.BACKUP, False, False),
    (State.BACKUP, Event.PEER_BACKUP): (State.BACKUP, False, False),
    (State.BACKUP, Event.PEER_ACTIVE): (State.PASSIVE, False, False),
    (State.BACKUP, Event.PEER_PASSIVE): (State.BACKUP, False, False),
    (State.BACKUP, Event.CLIENT_REQUEST): (State.BACKUP, False, False),
    (State.ACTIVE, Event.PEER_PRIMARY): (State.ACTIVE, False, False),
    (State.ACTIVE, Event.PEER_BACKUP): (State.ACTIVE, False, False),
    (State.ACTIVE, Event.PEER_ACTIVE): (State.ACTIVE, False, True),
    (State.ACTIVE, Event.PEER_PASSIVE): (State.ACTIVE, False, False),
    (State.ACTIVE, Event.CLIENT_REQUEST): (State.ACTIVE, True, False),
    (State.PASSIVE, Event.PEER_PRIMARY): (State.ACTIVE, False, False),
    (State.PASSIVE, Event.PEER_BACKUP): (State.ACTIVE, False, False),
    (State.PASSIVE, Event.PEER_ACTIVE): (State.PASSIVE, False, False),
    (State.PASSIVE, Event.PEER_PASSIVE): (State.PASSIVE, False, True),
    (State.PASSIVE, Event.CLIENT_REQUEST): (State.PASSIVE, False, False),
}


def machine_in(state: State, now: float = 10.0) -> BinaryStarMachine:
    """A machine in *state*, the peer heard from at *now*."""
    role = Role.BACKUP if state is State.BACKUP else Role.PRIMARY
    machine = BinaryStarMachine(role, now=0.0)
    machine.state = state
    machine.peerExpiry = now + machine.failoverTimeout
    machine.now = now
    return machine


def test_the_table_covers_every_pair() -> None:
    assert set(EXPECTED) == set(itertools.product(State, Event))


@pytest.mark.parametrize("state, event", sorted(EXPECTED))
def test_every_state_and_event(state: State, event: Event) -> None:
    after, served, fatal = EXPECTED[(state, event)]
    machine = machine_in(state)
    if event is Event.CLIENT_REQUEST:
        accepted, actions = machine.handleClientRequest(10.5)
        assert accepted is served
    else:
        peerRole = Role.BACKUP if machine.role is Role.PRIMARY else Role.PRIMARY
        actions = machine.handlePeerState(int(event), peerRole, 5.0, 10.5)
    assert machine.state is after
    assert [type(a) for a in actions if isinstance(a, Fatal)] == ([Fatal] if fatal else [])
    changes = [a for a in actions if isinstance(a, Changed)]
    assert changes == ([Changed(state, after, changes[0].reason)] if after is not state else [])
    if fatal:
        assert machine.stopped and not machine.serving
        assert machine.handleClientRequest(11.0)[0] is False  # stopped for good


def test_a_passive_server_takes_over_on_a_client_request_after_the_failover_timeout() -> None:
    machine = machine_in(State.PASSIVE, now=10.0)  # heartbeat 1 s: timeout 2 s
    assert machine.handleClientRequest(11.9) == (False, [])
    accepted, actions = machine.handleClientRequest(12.0)
    assert accepted and machine.state is State.ACTIVE
    assert actions == [Changed(State.PASSIVE, State.ACTIVE,
                               "failover: a vote, the peer silent")]


def test_silence_alone_changes_nothing_without_a_client_vote() -> None:
    machine = machine_in(State.PASSIVE, now=10.0)
    assert machine.handleTick(100.0) == [PublishState(State.PASSIVE, Role.PRIMARY, 100.0)]
    assert machine.state is State.PASSIVE


def test_a_primary_alone_serves_once_the_failover_timeout_has_passed_since_start() -> None:
    machine = BinaryStarMachine(Role.PRIMARY, heartbeat=1.0, now=100.0)
    assert machine.handleClientRequest(101.0)[0] is False  # the backup may be active
    accepted, actions = machine.handleClientRequest(102.0)
    assert accepted and [type(a) for a in actions] == [Changed]


def test_a_backup_alone_never_serves() -> None:
    machine = BinaryStarMachine(Role.BACKUP, now=0.0)
    assert machine.handleClientRequest(1000.0)[0] is False


def test_each_peer_message_puts_the_failover_back() -> None:
    machine = machine_in(State.PASSIVE, now=0.0)
    for t in (1.5, 3.0, 4.5):
        machine.handlePeerState(int(State.ACTIVE), Role.BACKUP, t, t)
        assert machine.handleClientRequest(t + 1.9)[0] is False
    assert machine.handleClientRequest(6.5)[0] is True


@pytest.mark.parametrize("role", list(Role))
def test_both_configured_alike_stops_the_later_one(role: Role) -> None:
    later = BinaryStarMachine(role, now=50.0)
    actions = later.handlePeerState(int(later.state), role, 30.0, 51.0)  # up 1 s, peer 30 s
    assert [type(a) for a in actions] == [Fatal]
    assert f"both servers are configured {role.value}" in actions[0].reason
    assert later.stopped and later.handleTick(52.0) == []
    earlier = BinaryStarMachine(role, now=0.0)
    actions = earlier.handlePeerState(int(earlier.state), role, 1.0, 30.0)
    assert [type(a) for a in actions] == [Conflict] and earlier.stopped is None


def test_a_message_that_is_no_state_is_ignored() -> None:
    machine = machine_in(State.PASSIVE, now=0.0)
    assert machine.handlePeerState(9, Role.BACKUP, 1.0, 1.0) == []
    assert machine.handlePeerState(int(Event.CLIENT_REQUEST), Role.BACKUP, 1.0, 1.0) == []
    assert machine.handleClientRequest(2.0)[0] is True  # and did not count as a heartbeat


@pytest.mark.parametrize("args, error", [((("primary",)), TypeError),
                                         (((Role.PRIMARY,)), None)])
def test_the_role_is_a_role(args: Any, error: Any) -> None:
    if error is None:
        BinaryStarMachine(*args)
    else:
        with pytest.raises(error):
            BinaryStarMachine(*args)
    with pytest.raises(ValueError):
        BinaryStarMachine(Role.BACKUP, heartbeat=0)


def test_a_server_hearing_its_own_run_id_stops() -> None:
    machine = BinaryStarMachine(Role.PRIMARY, instance="0123456789abcdef", now=0.0)
    actions = machine.handlePeerState(int(State.PRIMARY), Role.PRIMARY, 0.5, 0.5,
                                      peerInstance="0123456789abcdef")
    assert [type(a) for a in actions] == [Fatal] and "hears its own state" in machine.stopped


def test_a_different_heartbeat_is_fatal() -> None:
    machine = BinaryStarMachine(Role.PRIMARY, heartbeat=1.0, instance="a" * 16, now=0.0)
    actions = machine.handlePeerState(int(State.BACKUP), Role.BACKUP, 0.5, 0.5,
                                      peerInstance="b" * 16, peerHeartbeat=2.0)
    assert [type(a) for a in actions] == [Fatal] and machine.state is State.PRIMARY


@pytest.mark.parametrize("mine, theirs, stops", [("b" * 16, "a" * 16, True),
                                                  ("a" * 16, "b" * 16, False)])
def test_a_tie_of_start_times_is_broken_by_the_run_id(mine: str, theirs: str, stops: bool) -> None:
    machine = BinaryStarMachine(Role.PRIMARY, instance=mine, now=10.0)
    # the peer started 0.3 s earlier: closer than a heartbeat, a tie
    actions = machine.handlePeerState(int(State.PRIMARY), Role.PRIMARY, 0.8, 10.5,
                                      peerInstance=theirs)
    assert [type(a) for a in actions] == ([Fatal] if stops else [Conflict])


@pytest.mark.parametrize("mine, after", [("c" * 16, 2.5), ("a" * 16, 4.5)])
def test_a_peer_that_does_not_stop_for_a_conflict_stops_this_one(mine: str,
                                                                  after: float) -> None:
    """After the failover timeout (2 s) if this run's id is the greater one
    (both sides judge that alike), after twice that otherwise."""
    machine = BinaryStarMachine(Role.BACKUP, instance=mine, now=0.0)
    t = 30.0
    while t < 30.0 + after:  # the peer says it started at 29, this one at 0
        assert [type(a) for a in machine.handlePeerState(
            int(State.BACKUP), Role.BACKUP, t - 29.0, t, peerInstance="b" * 16)] == [Conflict]
        t += 0.5
    actions = machine.handlePeerState(int(State.BACKUP), Role.BACKUP, t - 29.0, t,
                                      peerInstance="b" * 16)
    assert [type(a) for a in actions] == [Fatal] and "did not stop" in machine.stopped


def test_a_conflict_ends_with_the_peers_silence_or_its_run() -> None:
    """A peer of the same role silent for the failover timeout, or another
    run of it (restarted), starts a new conflict: the time before this one
    gives up counts afresh."""
    machine = BinaryStarMachine(Role.BACKUP, instance="c" * 16, now=0.0)
    same = dict(peerInstance="b" * 16)
    assert [type(a) for a in machine.handlePeerState(
        int(State.BACKUP), Role.BACKUP, 1.0, 30.0, **same)] == [Conflict]
    # silent 3 s (> 2 s), then heard again: 2 s more before this one gives up
    for t in (33.0, 34.0, 35.0):
        assert [type(a) for a in machine.handlePeerState(
            int(State.BACKUP), Role.BACKUP, t - 29.0, t, **same)] == [Conflict]
    # another run of the peer at 36: afresh again
    for t in (36.0, 37.0, 38.0):
        assert [type(a) for a in machine.handlePeerState(
            int(State.BACKUP), Role.BACKUP, t - 35.5, t, peerInstance="a" * 16)] == [Conflict]
    assert machine.stopped is None
    assert [type(a) for a in machine.handlePeerState(
        int(State.BACKUP), Role.BACKUP, 3.0, 38.5, peerInstance="a" * 16)] == [Fatal]


# --- a stall: this server was stopped for longer than the failover timeout ---------------


def ticking(state: State, role: Role = Role.PRIMARY) -> BinaryStarMachine:
    """A machine in *state*, ticked every second up to 10 s, the peer heard at 10 s."""
    machine = BinaryStarMachine(role, now=0.0)
    machine.state = state
    for t in range(11):
        machine.handleTick(float(t))
    machine.handlePeerState(int(State.PASSIVE if state is State.ACTIVE else State.ACTIVE),
                            Role.BACKUP if role is Role.PRIMARY else Role.PRIMARY, 10.0, 10.0)
    return machine


def test_an_active_server_stalled_goes_passive_when_the_peer_took_over() -> None:
    machine = ticking(State.ACTIVE)
    # resumed at 13.5: what waited on the old channel (the peer still passive,
    # then active) is stale, and takes no effect
    actions = machine.handlePeerState(int(State.PASSIVE), Role.BACKUP, 11.0, 13.5, channel=0)
    assert actions == [Stalled(3.5, 1, True)]
    assert machine.handlePeerState(int(State.ACTIVE), Role.BACKUP, 12.5, 13.5, channel=0) == []
    assert machine.state is State.ACTIVE and not machine.serving and not machine.publishing
    assert machine.handleClientRequest(13.5) == (False, [])
    assert machine.handleTick(13.6) == []  # nothing published: not ACTIVE, not PASSIVE
    assert machine.handleSubscriber(13.6) == (False, [])
    # the fresh channel says the peer is active: passive, not a fatal dual active
    actions = machine.handlePeerState(int(State.ACTIVE), Role.BACKUP, 13.6, 13.7, channel=1)
    assert actions == [Changed(State.ACTIVE, State.PASSIVE,
                               "the peer took over while this server was stalled"),
                       PublishState(State.PASSIVE, Role.PRIMARY, 13.7)]  # at once
    assert machine.stopped is None and not machine.serving
    assert machine.handleTick(14.6) == [PublishState(State.PASSIVE, Role.PRIMARY, 14.6)]
    # from then on, the table as usual: a dual active would still be fatal
    assert machine.handleClientRequest(15.0) == (False, [])


def test_an_active_server_stalled_serves_again_when_the_peer_is_passive() -> None:
    machine = ticking(State.ACTIVE)
    assert machine.handleTick(14.0) == [Stalled(4.0, 1, True)]
    actions = machine.handlePeerState(int(State.PASSIVE), Role.BACKUP, 14.0, 14.1, channel=1)
    # its state goes out at once: the peer, which has not heard it since the
    # stall, must stop counting its silence before a vote makes it active too
    assert actions == [Resumed("the peer is passive"),
                       PublishState(State.ACTIVE, Role.PRIMARY, 14.1)]
    assert machine.state is State.ACTIVE and machine.serving
    assert machine.handleClientRequest(14.2) == (True, [])
    assert machine.handleTick(15.0) == [PublishState(State.ACTIVE, Role.PRIMARY, 15.0)]


def test_an_active_server_stalled_serves_again_after_a_failover_timeout_of_silence() -> None:
    machine = ticking(State.ACTIVE)
    served, actions = machine.handleClientRequest(20.0)
    assert (served, actions) == (False, [Stalled(10.0, 1, True)])
    assert machine.handleTick(21.0) == []
    assert machine.handleClientRequest(21.9) == (False, [])
    served, actions = machine.handleClientRequest(22.0)
    assert served and actions == [Resumed("the peer stayed silent"),
                                  PublishState(State.ACTIVE, Role.PRIMARY, 22.0)]


def test_a_backup_stalled_active_waits_twice_as_long_for_its_peer() -> None:
    """Of two servers stalled together, both active and both silent, the
    primary speaks first and the backup hears it: no crossed ACTIVEs."""
    primary, backup = ticking(State.ACTIVE), ticking(State.ACTIVE, Role.BACKUP)
    assert primary.handleTick(20.0) == [Stalled(10.0, 1, True)]
    assert backup.handleTick(20.0) == [Stalled(10.0, 1, True)]
    for t in (21.0, 21.5):
        assert primary.handleTick(t) == [] and backup.handleTick(t) == []
    spoken = primary.handleTick(22.0)
    assert spoken == [Resumed("the peer stayed silent"),
                      PublishState(State.ACTIVE, Role.PRIMARY, 22.0)]
    assert backup.handleTick(22.0) == [] and not backup.serving
    actions = backup.handlePeerState(int(State.ACTIVE), Role.PRIMARY, 22.0, 22.1, channel=1)
    assert [type(a) for a in actions] == [Changed, PublishState]
    assert backup.state is State.PASSIVE and backup.stopped is None
    # and the primary hears a passive backup: nothing to do
    assert primary.handlePeerState(int(State.PASSIVE), Role.BACKUP, 22.1, 22.2,
                                   channel=1) == []
    assert primary.serving and primary.stopped is None


def test_a_backup_alone_after_a_stall_serves_again_after_two_failover_timeouts() -> None:
    backup = ticking(State.ACTIVE, Role.BACKUP)
    assert backup.handleTick(20.0) == [Stalled(10.0, 1, True)]
    for t in (21.0, 22.0, 23.0):
        backup.handleTick(t)
        assert not backup.serving
    served, actions = backup.handleClientRequest(24.0)
    assert served and [type(a) for a in actions] == [Resumed, PublishState]


def test_a_state_without_its_channel_is_taken_as_current() -> None:
    """A driver that does not number its channels is not made deaf by a stall."""
    machine = ticking(State.ACTIVE)
    machine.handleTick(14.0)
    actions = machine.handlePeerState(int(State.ACTIVE), Role.BACKUP, 14.0, 14.1)
    assert [type(a) for a in actions] == [Changed, PublishState]


def test_a_passive_server_stalled_takes_no_vote_on_stale_silence() -> None:
    machine = ticking(State.PASSIVE)
    # a client request waited on its socket through the stall: not a vote yet,
    # though the peer has not been heard for 10 s
    served, actions = machine.handleClientRequest(20.0)
    assert (served, actions) == (False, [Stalled(10.0, 1, False)])
    assert machine.publishing  # a passive server tells its state as before
    assert machine.handleTick(20.0) == [PublishState(State.PASSIVE, Role.PRIMARY, 20.0)]
    assert machine.handleClientRequest(21.9)[0] is False
    # the peer heard on the fresh channel: still passive
    machine.handlePeerState(int(State.ACTIVE), Role.BACKUP, 20.0, 21.0, channel=1)
    machine.handleTick(21.0)
    machine.handleTick(22.0)
    assert machine.handleClientRequest(22.5)[0] is False
    # the peer really silent for the failover timeout: the vote counts
    assert machine.handleClientRequest(23.0)[0] is True and machine.state is State.ACTIVE


def test_gaps_within_the_failover_timeout_are_no_stall() -> None:
    machine = ticking(State.ACTIVE)
    assert machine.handleTick(12.0) == [PublishState(State.ACTIVE, Role.PRIMARY, 12.0)]
    assert machine.handleClientRequest(14.0) == (True, [])
    assert machine.channel == 0
    # a machine never ticked knows no stall (its driver does not tick it)
    quiet = machine_in(State.ACTIVE)
    assert quiet.handleClientRequest(1000.0) == (True, [])


def test_each_stall_opens_a_new_channel() -> None:
    machine = ticking(State.ACTIVE)
    assert machine.handleTick(14.0) == [Stalled(4.0, 1, True)]
    assert machine.handleTick(18.0) == [Stalled(4.0, 2, True)]
    # channel 1 is stale now too
    assert machine.handlePeerState(int(State.ACTIVE), Role.BACKUP, 17.0, 18.0, channel=1) == []
    assert machine.state is State.ACTIVE and not machine.serving
    actions = machine.handlePeerState(int(State.ACTIVE), Role.BACKUP, 18.0, 18.1, channel=2)
    assert [type(a) for a in actions] == [Changed, PublishState]
