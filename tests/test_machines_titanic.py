"""Titanic's dispatcher as a pure machine: events with their time in, actions
out, no store, client or reactor."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdp.policy import Backoff
from mdp.titanic.dispatcher import (
    LIST_TRIES,
    CheckService,
    Dispatch,
    DispatchMachine,
    ListServices,
    LoadPending,
    Parked,
    Purge,
    ServiceState,
    StoreReply,
    WakeAt,
    services_listed,
)
from mdp.titanic.store import StoredRequest


def req(n: int, service: bytes = b"echo") -> StoredRequest:
    return StoredRequest(f"id-{n}", service, [b"%d" % n], float(n))


def kinds(actions: list[Any], kind: type) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def started(**options: Any) -> tuple[DispatchMachine, LoadPending]:
    options.setdefault("keep", 100.0)
    options.setdefault("purgeEvery", 60.0)
    machine = DispatchMachine(backoff=Backoff(1.0, 8.0), **options)
    actions = machine.handleStart(0.0)
    (load,) = kinds(actions, LoadPending)
    return machine, load


def test_start_purges_old_replies_and_reads_a_window_of_pending_requests() -> None:
    machine = DispatchMachine(concurrency=2, keep=100.0, purgeEvery=60.0, window=5)
    actions = machine.handleStart(1000.0)
    assert actions == [Purge(900.0), LoadPending(5, [], []), WakeAt(1060.0)]


def test_each_service_is_asked_once_before_its_first_request_goes_out() -> None:
    machine, load = started(concurrency=4)
    actions = machine.handleLoaded([req(1), req(2, b"down"), req(3)], load.limit, 1.0)
    assert kinds(actions, CheckService) == [CheckService(b"echo"), CheckService(b"down")]
    assert kinds(actions, Dispatch) == []
    actions = machine.handleChecked(b"echo", True, "", 1.1)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-1", "id-3"]  # oldest first
    actions = machine.handleChecked(b"down", False, "no worker", 1.2)
    assert kinds(actions, Parked) == [Parked(b"down", 1.0, "no worker")]
    assert machine.services[b"down"].state is ServiceState.PARKED
    assert machine.queue == [] and kinds(actions, Dispatch) == []
    assert kinds(actions, WakeAt) == [WakeAt(3.0)]  # on a whole second


def test_at_most_concurrency_requests_are_out_and_the_next_goes_when_one_is_stored() -> None:
    machine, load = started(concurrency=2)
    machine.handleLoaded([req(1), req(2), req(3)], load.limit, 1.0)
    actions = machine.handleChecked(b"echo", True, "", 1.0)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-1", "id-2"]
    assert machine.handleReply("id-2", [b"two"], 2.0) == [StoreReply("id-2", [b"two"])]
    assert kinds(machine.handleReply("id-9", [b"?"], 2.0), StoreReply) == []  # not ours
    actions = machine.handleReplyStored("id-2", 2.1)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-3"]
    assert set(machine.inflight) == {"id-1", "id-3"}


def test_a_failed_attempt_parks_the_service_with_growing_backoff_and_reads_it_again() -> None:
    machine, load = started(concurrency=1)
    machine.handleLoaded([req(1), req(2, b"other")], load.limit, 0.0)
    machine.handleChecked(b"echo", True, "", 0.0)
    machine.handleChecked(b"other", True, "", 0.0)
    assert list(machine.inflight) == ["id-1"]
    actions = machine.handleFailed("id-1", "timed out", 3.0)
    assert kinds(actions, Parked) == [Parked(b"echo", 1.0, "timed out")]
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-2"]  # others go on
    (reload,) = kinds(actions, LoadPending)
    assert reload.skipServices == [b"echo"] and reload.skipIds == ["id-2"]
    machine.handleLoaded([], reload.limit, 3.0)
    machine.handleReply("id-2", [b"x"], 3.5)
    machine.handleReplyStored("id-2", 3.5)
    actions = machine.handleWake(4.0)  # echo unparked: read again, ask again
    (again,) = kinds(actions, LoadPending)
    assert again.skipServices == []
    actions = machine.handleLoaded([req(1)], again.limit, 4.0)
    assert kinds(actions, CheckService) == [CheckService(b"echo")]
    actions = machine.handleChecked(b"echo", False, "no worker", 4.1)
    assert kinds(actions, Parked) == [Parked(b"echo", 2.0, "no worker")]  # doubled
    assert machine.queue == [] and kinds(actions, WakeAt) == [WakeAt(7.0)]


def test_backoff_restarts_once_a_reply_of_the_service_is_stored() -> None:
    machine, load = started(concurrency=1)
    machine.handleLoaded([req(1)], load.limit, 0.0)
    machine.handleChecked(b"echo", True, "", 0.0)
    machine.handleFailed("id-1", "timed out", 1.0)
    assert machine.services[b"echo"].failures == 1
    machine.handleWake(2.0)
    machine.handleLoaded([req(1)], 1, 2.0)
    machine.handleChecked(b"echo", True, "", 2.0)
    machine.handleReply("id-1", [b"ok"], 3.0)
    machine.handleReplyStored("id-1", 3.0)
    assert machine.services[b"echo"].failures == 0


def test_concurrent_failures_of_one_outage_park_the_service_once() -> None:
    machine, load = started(concurrency=3)
    machine.handleLoaded([req(1), req(2), req(3)], load.limit, 0.0)
    machine.handleChecked(b"echo", True, "", 0.0)
    parks = []
    for n in (1, 2, 3):
        parks += kinds(machine.handleFailed(f"id-{n}", "timed out", 5.0), Parked)
    assert parks == [Parked(b"echo", 1.0, "timed out")]


def test_reads_leave_out_held_requests_and_stop_when_the_store_has_no_more() -> None:
    machine, load = started(concurrency=1, window=3)
    assert load == LoadPending(3, [], [])
    actions = machine.handleLoaded([req(1), req(2), req(3)], 3, 0.0)  # full: maybe more
    assert kinds(actions, LoadPending) == []  # but no room
    machine.handleChecked(b"echo", True, "", 0.0)
    actions = machine.handleReply("id-1", [b"1"], 1.0) + machine.handleReplyStored("id-1", 1.0)
    assert kinds(actions, LoadPending) == [LoadPending(1, [], ["id-3", "id-2"])]
    actions = machine.handleLoaded([], 1, 1.0)  # the store has no more
    machine.handleReply("id-2", [b"2"], 2.0)
    actions = machine.handleReplyStored("id-2", 2.0)
    assert kinds(actions, LoadPending) == []  # nothing new was stored: no read
    actions = machine.handleStored("id-4", 2.5)
    assert kinds(actions, LoadPending) == [LoadPending(2, [], ["id-3"])]


def test_a_store_that_fails_is_read_again_after_a_backoff() -> None:
    machine, load = started(concurrency=1)
    actions = machine.handleLoadFailed("disk I/O error", 0.0)
    assert kinds(actions, LoadPending) == [] and kinds(actions, WakeAt) == [WakeAt(1.0)]
    assert kinds(machine.handleStored("id-1", 0.5), LoadPending) == []  # still waiting
    assert len(kinds(machine.handleWake(1.0), LoadPending)) == 1


def test_a_reply_the_store_could_not_keep_is_stored_again_not_run_again() -> None:
    machine, load = started(concurrency=1)
    machine.handleLoaded([req(1), req(2)], load.limit, 0.0)
    machine.handleChecked(b"echo", True, "", 0.0)
    machine.handleReply("id-1", [b"1"], 1.0)
    actions = machine.handleStoreFailed("id-1", "disk full", 1.0)
    assert list(machine.inflight) == ["id-1"]  # still out: id-2 waits, id-1 is not re-run
    assert kinds(actions, Dispatch) == [] and kinds(actions, WakeAt) == [WakeAt(2.0)]
    assert kinds(machine.handleWake(2.0), StoreReply) == [StoreReply("id-1", [b"1"])]
    actions = machine.handleStoreFailed("id-1", "disk full", 2.0)
    assert kinds(actions, WakeAt) == [WakeAt(4.0)]  # the backoff grows
    assert kinds(machine.handleLoaded([], 1, 3.0), Dispatch) == []  # a read is no write
    assert kinds(machine.handleWake(4.0), StoreReply) == [StoreReply("id-1", [b"1"])]
    actions = machine.handleReplyStored("id-1", 4.1)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-2"]
    machine.handleReply("id-2", [b"2"], 5.0)
    machine.handleStoreFailed("id-2", "disk full", 5.0)
    assert kinds(machine.handleWake(6.0), StoreReply) == [StoreReply("id-2", [b"2"])]  # reset


def test_a_closed_request_that_waits_to_go_out_does_not() -> None:
    machine, load = started(concurrency=1)
    machine.handleLoaded([req(1), req(2), req(3)], load.limit, 0.0)
    machine.handleChecked(b"echo", True, "", 0.0)
    machine.handleClosed("id-2", 0.5)
    machine.handleReply("id-1", [b"1"], 1.0)
    actions = machine.handleReplyStored("id-1", 1.0)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-3"]


def test_reloaded_requests_take_their_place_by_age() -> None:
    machine, load = started(concurrency=1)
    machine.handleLoaded([req(1), req(5), req(6)], load.limit, 0.0)
    machine.handleChecked(b"echo", True, "", 0.0)
    machine.handleLoaded([req(2)], 1, 0.5)  # an older one read later
    machine.handleReply("id-1", [b"1"], 1.0)
    actions = machine.handleReplyStored("id-1", 1.0)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-2"]


def test_services_nothing_is_held_for_are_forgotten() -> None:
    machine, load = started(concurrency=1, recheck=5.0)
    machine.handleLoaded([req(1, b"once")], load.limit, 0.0)
    machine.handleChecked(b"once", True, "", 0.0)
    machine.handleReply("id-1", [b"1"], 1.0)
    machine.handleReplyStored("id-1", 1.0)
    assert b"once" in machine.services
    machine.handleWake(60.0)
    assert b"once" not in machine.services


def test_replies_are_purged_every_purge_interval() -> None:
    machine, _ = started(concurrency=1, keep=100.0, purgeEvery=60.0)
    assert kinds(machine.handleWake(59.0), Purge) == []
    assert kinds(machine.handleWake(60.0), Purge) == [Purge(-40.0)]
    assert kinds(machine.handleWake(120.0), Purge) == [Purge(20.0)]


def test_an_available_answer_is_trusted_for_recheck_seconds() -> None:
    machine, load = started(concurrency=1, recheck=5.0)
    machine.handleLoaded([req(1), req(2)], load.limit, 0.0)
    machine.handleChecked(b"echo", True, "", 0.0)
    machine.handleReply("id-1", [b"1"], 1.0)
    actions = machine.handleReplyStored("id-1", 1.0)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-2"]
    machine.handleReply("id-2", [b"2"], 9.0)
    machine.handleStored("id-3", 9.0)
    actions = machine.handleReplyStored("id-2", 9.0)
    actions += machine.handleLoaded([req(3)], 1, 9.0)
    assert kinds(actions, CheckService) == [CheckService(b"echo")]
    assert kinds(actions, Dispatch) == []


def test_stop_forgets_what_is_held_and_sends_nothing_more() -> None:
    machine, load = started(concurrency=1)
    machine.handleLoaded([req(1), req(2)], load.limit, 0.0)
    machine.handleChecked(b"echo", True, "", 0.0)
    assert machine.handleStop(1.0) == [WakeAt(None)]
    assert machine.handleReply("id-1", [b"late"], 2.0) == []
    assert machine.handleStored("id-3", 2.0) == []
    assert machine.handleLoaded([req(3)], 1, 2.0) == []


@pytest.mark.parametrize("options", [dict(concurrency=0), dict(keep=0), dict(purgeEvery=-1),
                                     dict(recheck=0)])
def test_bad_settings_are_refused_at_once(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        DispatchMachine(**options)


def test_a_count_that_is_no_whole_number_is_refused_at_once() -> None:
    with pytest.raises(TypeError, match="concurrency is a whole number"):
        DispatchMachine(concurrency=True)


def test_a_service_has_as_many_requests_out_as_workers_and_twice_that_held() -> None:
    """Its requests beyond go back to the store's keeping (the window is for
    the others too), and are read again once one of its is done."""
    machine, load = started(concurrency=4, window=6)
    actions = machine.handleLoaded([req(n) for n in range(1, 7)], load.limit, 0.0)
    assert kinds(actions, CheckService) == [CheckService(b"echo")]
    actions = machine.handleCounted(b"echo", 2, 0.1)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-1", "id-2"]
    assert [r.id for r in machine.queue] == ["id-3", "id-4"]
    (reload,) = kinds(actions, LoadPending)  # the store may hold the others' requests
    assert reload.limit == 2 and reload.skipServices == [b"echo"]
    machine.handleLoaded([req(7, b"other")], reload.limit, 0.1)
    actions = machine.handleCounted(b"other", 1, 0.2)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-7"]
    machine.handleReply("id-1", [b"1"], 1.0)
    actions = machine.handleReplyStored("id-1", 1.0)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-3"]
    assert kinds(actions, LoadPending) == []  # its next ones are in hand: no read
    assert [r.id for r in machine.queue] == ["id-4", "id-5"]
    machine.handleReply("id-2", [b"2"], 2.0)
    assert kinds(machine.handleReplyStored("id-2", 2.0), LoadPending) == []
    machine.handleReply("id-3", [b"3"], 3.0)
    actions = machine.handleReplyStored("id-3", 3.0)  # none in hand: read the store
    (again,) = kinds(actions, LoadPending)
    assert again.skipServices == [] and set(again.skipIds) == {"id-4", "id-5", "id-6", "id-7"}
    assert kinds(machine.handleCounted(b"gone", 0, 2.0), Parked) == []  # never asked


def test_a_service_with_no_worker_counted_is_parked() -> None:
    machine, load = started(concurrency=4)
    machine.handleLoaded([req(1)], load.limit, 0.0)
    actions = machine.handleCounted(b"echo", 0, 0.1)
    assert kinds(actions, Parked) == [Parked(b"echo", 1.0, "no worker (mmi.workers)")]


def test_services_parked_about_the_same_time_are_read_again_together() -> None:
    """Many services with no worker (a retired name, a typo): they come back
    on whole seconds, so the store is read once for all that are due, not
    once a service."""
    machine, load = started(concurrency=4, window=64)
    machine.handleLoaded([req(n, b"gone-%d" % n) for n in range(10)], load.limit, 0.0)
    for n in range(10):
        machine.handleChecked(b"gone-%d" % n, False, "no worker", 0.05 * n + 0.01)
    assert {e.until for e in machine.services.values()} == {2.0}
    actions = machine.handleWake(2.0)
    (reload,) = kinds(actions, LoadPending)
    assert reload.skipServices == []


def test_places_freed_one_at_a_time_by_parked_services_make_one_read_for_many() -> None:
    machine, load = started(concurrency=4, window=16)
    machine.handleLoaded([req(n, b"gone-%d" % n) for n in range(16)], load.limit, 0.0)
    reads = []
    for n in range(16):
        reads += kinds(machine.handleCounted(b"gone-%d" % n, 0, 0.1 + n / 100), LoadPending)
    assert [r.limit for r in reads] == [8]  # after half the window, not after each one


def test_a_service_with_no_worker_the_broker_still_knows_gets_one_request_at_a_time() -> None:
    """mmi.workers counted none, mmi.service said 200: its worker is
    restarting (the broker keeps the service for its linger, and queues a
    request for it), so one request goes out to wait there rather than the
    service being parked; once it replied, the workers are counted again."""
    machine, load = started(concurrency=4)
    machine.handleLoaded([req(1), req(2), req(3), req(4, b"other")], load.limit, 0.0)
    actions = machine.handleLingering(b"echo", 0.1)
    assert kinds(actions, Parked) == []
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-1"]
    assert machine.services[b"echo"].state is ServiceState.AVAILABLE
    actions = machine.handleCounted(b"other", 1, 0.2)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-4"]  # others go on
    machine.handleReply("id-1", [b"1"], 0.6)  # the worker is back
    actions = machine.handleReplyStored("id-1", 0.6)
    assert kinds(actions, CheckService) == [CheckService(b"echo")]
    assert kinds(actions, Dispatch) == []
    actions = machine.handleCounted(b"echo", 2, 0.7)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-2", "id-3"]


def test_a_request_to_a_service_the_broker_stops_knowing_parks_it() -> None:
    """The one request sent while its worker restarted fails (the worker
    did not come back: the broker answers 503 once it expires): parked."""
    machine, load = started(concurrency=4)
    machine.handleLoaded([req(1), req(2)], load.limit, 0.0)
    machine.handleLingering(b"echo", 0.1)
    assert list(machine.inflight) == ["id-1"]
    actions = machine.handleFailed("id-1", "no worker for service 'echo'", 30.1)
    assert kinds(actions, Parked) == [Parked(b"echo", 1.0, "no worker for service 'echo'")]
    assert kinds(actions, Dispatch) == [] and machine.queue == []


def test_a_stale_zero_count_does_not_hold_a_service_to_one_request() -> None:
    """A count of no workers that parked a service does not hold it to one
    request out once the next check is answered without a count
    (``mmi.service``)."""
    machine, load = started(concurrency=4)
    machine.handleLoaded([req(1), req(2), req(3), req(4)], load.limit, 0.0)
    machine.handleCounted(b"echo", 0, 0.1)  # parked: no worker (mmi.workers)
    actions = machine.handleWake(2.0)  # unparked
    (load,) = kinds(actions, LoadPending)
    actions = machine.handleLoaded([req(1), req(2), req(3), req(4)], load.limit, 2.0)
    assert kinds(actions, CheckService) == [CheckService(b"echo")]
    # answered by mmi.service (the mmi.workers answer was no listing this time)
    actions = machine.handleChecked(b"echo", True, "", 2.1)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-1", "id-2", "id-3", "id-4"]


# --- with the broker's listing (mmi.services) ------------------------------------------


def listing_started(**options: Any) -> DispatchMachine:
    options.setdefault("keep", 100.0)
    options.setdefault("purgeEvery", 60.0)
    machine = DispatchMachine(backoff=Backoff(1.0, 8.0), listEvery=1.0, **options)
    actions = machine.handleStart(0.0)
    assert kinds(actions, ListServices) == [ListServices()]
    assert kinds(actions, LoadPending) == []  # nothing is read before the first listing
    return machine


def test_only_the_requests_of_listed_services_are_read_and_none_is_asked_about() -> None:
    machine = listing_started(concurrency=4, window=8)
    actions = machine.handleListed({b"echo": 2, b"titanic.request": 4, b"mmi.x": 1}, 0.1)
    assert kinds(actions, LoadPending) == [LoadPending(8, [], [], [b"echo"])]
    actions = machine.handleLoaded([req(1), req(2, b"nobody"), req(3), req(4)], 8, 0.2)
    assert kinds(actions, CheckService) == [] and kinds(actions, Parked) == []
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-1", "id-3"]  # 2 workers
    # the unlisted one went back to the store's keeping: no entry, no timer
    assert b"nobody" not in machine.services and [r.id for r in machine.queue] == ["id-4"]


def test_a_service_a_listing_names_is_read_at_once_and_a_parked_one_woken() -> None:
    machine = listing_started(concurrency=4)
    machine.handleListed({b"late": 0}, 0.1)  # known, no worker: asked about
    actions = machine.handleLoaded([req(1, b"late")], 16, 0.2)
    assert kinds(actions, CheckService) == [CheckService(b"late")]
    actions = machine.handleCounted(b"late", 0, 0.3)
    assert kinds(actions, Parked) == [Parked(b"late", 1.0, "no worker (mmi.workers)")]
    actions = machine.handleListed({b"late": 1, b"new": 3}, 1.1)  # both appear
    assert machine.services[b"late"].state is ServiceState.UNKNOWN
    (load,) = kinds(actions, LoadPending)
    assert load.onlyServices == [b"late", b"new"]
    actions = machine.handleLoaded([req(1, b"late"), req(2, b"new")], load.limit, 1.2)
    assert [a.request.id for a in kinds(actions, Dispatch)] == ["id-1", "id-2"]


def test_the_listing_is_asked_every_interval_and_soon_after_a_submit() -> None:
    machine = listing_started(concurrency=1)
    actions = machine.handleListed({}, 0.1)
    assert kinds(actions, LoadPending) == [] and kinds(actions, WakeAt) == [WakeAt(1.1)]
    assert kinds(machine.handleWake(1.1), ListServices) == [ListServices()]
    actions = machine.handleListed({}, 1.15)
    actions = machine.handleStored("id-1", 1.2)  # its service may be new: list soon
    assert kinds(actions, WakeAt) == [WakeAt(1.35)]  # a quarter interval after the last
    assert kinds(machine.handleWake(1.35), ListServices) == [ListServices()]
    actions = machine.handleListFailed("timed out", 6.35)  # broker away: keep the last
    assert kinds(actions, WakeAt) == [WakeAt(7.35)]


def test_without_a_full_listing_each_service_is_asked_about() -> None:
    machine = listing_started(concurrency=1)
    actions = machine.handleListed(None, 0.1)  # a 501, or a truncated listing
    (load,) = kinds(actions, LoadPending)
    assert load.onlyServices is None
    actions = machine.handleLoaded([req(1)], load.limit, 0.2)
    assert kinds(actions, CheckService) == [CheckService(b"echo")]
    assert kinds(machine.handleWake(8.1), ListServices) == [ListServices()]  # the longest backoff


def test_a_broker_that_never_answers_the_listing_is_gone_on_without() -> None:
    """A broker that queues ``mmi.services`` as a service nobody serves: after
    LIST_TRIES failures in a row the requests are read and each service asked
    about, and the listing asked for every backoff maximum."""
    machine = listing_started(concurrency=1)
    for n in range(1, LIST_TRIES):
        actions = machine.handleListFailed("timed out", float(n))
        assert kinds(actions, LoadPending) == []  # a broker away a moment: wait for it
        assert kinds(machine.handleWake(n + 1.0), ListServices) == [ListServices()]
    actions = machine.handleListFailed("timed out", float(LIST_TRIES))
    (load,) = kinds(actions, LoadPending)
    assert load.onlyServices is None
    actions = machine.handleLoaded([req(1)], load.limit, LIST_TRIES + 0.1)
    assert kinds(actions, CheckService) == [CheckService(b"echo")]
    assert kinds(machine.handleWake(LIST_TRIES + 8.0), ListServices) == [ListServices()]


@pytest.mark.parametrize("reply, listed", [
    ([b'{"echo": {"workers": 2, "idle": 1, "queued": 0}}'], {b"echo": 2}),
    ([b"{}"], {}),
    ([b"501"], None),
    ([b'{"echo": {"workers": 2}}', b'{"truncated": true, "total": 1001}'], None),
    # truncated, but naming one without workers: every one with workers is in it
    ([b'{"echo": {"workers": 2}, "x": {"workers": 0}}', b'{"truncated": true, "total": 1001}'],
     {b"echo": 2, b"x": 0}),
    ([b'{"echo": {}}'], None),
    ([], None),
])
def test_an_mmi_services_reply_is_a_listing_only_when_it_names_every_served_one(reply: list[bytes],
                                                            listed: Any) -> None:
    assert services_listed(reply) == listed


NAMES = st.sampled_from([b"a", b"b", b"c", b"d"])


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(NAMES, st.integers(0, 3)),
       st.lists(NAMES, min_size=1, max_size=12), st.integers(1, 4))
def test_with_a_listing_only_listed_services_are_read_sent_or_asked_about(
        listing: dict[bytes, int], services: list[bytes], concurrency: int) -> None:
    """Whatever the store holds: requests go out only to services listed with
    workers (at most that many each), the broker is asked only about services
    listed with none, and nothing unlisted is parked or kept."""
    machine = listing_started(concurrency=concurrency)
    actions = machine.handleListed(listing, 0.1)
    loads = kinds(actions, LoadPending)
    assert all(set(load.onlyServices) <= set(listing) for load in loads)
    requests = [req(n, service) for n, service in enumerate(services)]
    actions = machine.handleLoaded(requests, 16, 0.2)
    sent = [a.request.service for a in kinds(actions, Dispatch)]
    assert all(listing.get(s) for s in sent)
    assert all(sent.count(s) <= listing[s] for s in sent) and len(sent) <= concurrency
    assert {a.service for a in kinds(actions, CheckService)} <= {
        s for s, workers in listing.items() if workers == 0}
    assert kinds(actions, Parked) == []
    held = [r.service for r in machine.queue + machine._spare]
    assert all(s in listing for s in held) and set(machine.services) <= set(listing)


@pytest.mark.parametrize("rereadEvery", [None, 1.0])
def test_a_store_shared_with_other_titanics_is_read_again_on_its_own(rereadEvery: Any) -> None:
    """What another Titanic stored, or held when it died, is found within *rereadEvery*;
    a store of one's own is read only when something happened."""
    machine = DispatchMachine(backoff=Backoff(1.0, 8.0), keep=100.0, purgeEvery=60.0,
                              rereadEvery=rereadEvery)
    actions = machine.handleStart(0.0)
    (load,) = kinds(actions, LoadPending)
    actions += machine.handleLoaded([], load.limit, 0.1)
    assert kinds(actions, LoadPending) == [load]
    assert kinds(actions, WakeAt)[-1].when == (1.0 if rereadEvery else 60.0)
    actions = machine.handleWake(1.0)
    assert len(kinds(actions, LoadPending)) == (1 if rereadEvery else 0)


def test_a_stamp_made_of_the_request_id_is_the_same_from_any_titanic() -> None:
    import uuid

    from mdp.majordomo.idempotence import stamp, unstamp
    from mdp.titanic.dispatcher import stamped

    request = StoredRequest(str(uuid.uuid4()), b"s", [b"a", b""], 1.0)
    key, frames = unstamp(stamped(request))
    assert key is not None and key[0] == uuid.UUID(request.id).bytes and frames == [b"a", b""]
    assert stamped(request) == stamped(StoredRequest(request.id, b"s", [b"a", b""], 9.0))
    came = stamp(b"c" * 16, 7, [b"a"])  # stamped by its own client: kept as it came
    assert stamped(StoredRequest(request.id, b"s", came, 1.0)) == came
    assert stamped(StoredRequest("id-1", b"s", [b"a"], 1.0)) == [b"a"]  # not a UUID: as it is
