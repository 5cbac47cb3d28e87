"""The suite cannot hang: a test past its time limit fails with its name and
the run goes on; a run that stops early says which tests did not run.

Three parts, each a pytest hook (tests/conftest.py imports them):

- **Overrun timers** (``pytest_timeout_set_timer``): at a test's limit (its
  ``timeout`` mark, else the ini's), a Twisted test's Deferred is cancelled
  in the reactor, or a plain test is interrupted (``SIGUSR2``) in its
  body; either way it fails as "ran past its N s limit" and this process
  goes on with the next test.  A test still running *GRACE* seconds later
  (stuck in a fixture, in C, or blocking its reactor) has its stacks
  written to stderr and its child processes killed, and the worker exits:
  the next part takes over.
- **A crashed worker's file goes on elsewhere** (``pytest_xdist_make_scheduler``):
  pytest-xdist's file scheduler hands a crashed worker's whole file, the
  test that crashed it included, to the replacement worker, which then
  crashes again until the restarts run out and the run waits for good.
  Here the crashed test is reported once and only the rest of its file runs
  again.
- **What did not run** (controller side): the run's summary lists the
  collected tests that never reported and then fails; and when no test has
  ended for *IDLE* seconds, the controller prints what is running and what
  is left, kills its workers and exits 1, instead of waiting in silence.
"""

from __future__ import annotations

__all__ = [  # the hooks (tests/conftest.py imports them all)
    "pytest_configure", "pytest_pyfunc_call", "pytest_runtest_logreport",
    "pytest_runtest_logstart", "pytest_runtest_protocol", "pytest_sessionfinish",
    "pytest_terminal_summary", "pytest_timeout_cancel_timer", "pytest_timeout_set_timer",
    "pytest_xdist_make_scheduler", "pytest_xdist_node_collection_finished",
]

import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

import pytest

#: no test's limit is longer (a mark asking for more gets this)
LONGEST = 60.0
#: seconds a test may run past its limit, once cancelled, before its worker is killed
GRACE = float(os.environ.get("SUITE_GUARD_GRACE", "10"))
#: seconds without any test ending after which the controller gives up on the run
IDLE = float(os.environ.get("SUITE_GUARD_IDLE", "240"))


# --- overrun timers (each test process) ---------------------------------------------------


def descendants(pid: int) -> list[int]:
    """The processes below *pid* (Linux ``/proc``; none elsewhere), deepest last."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    queue = [pid]
    while queue:
        for child in children.get(queue.pop(0), ()):
            found.append(child)
            queue.append(child)
    return found


def kill_descendants() -> None:
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class Overrun:
    """The time limit of one test in this process (see the module docstring)."""

    def __init__(self, item: Any, limit: float) -> None:
        self.item = item
        self.limit = limit
        #: the test's Deferred, once its body has returned one
        self.deferred: Any = None
        #: the test's body is running on the main thread (a plain test)
        self.inBody = False
        self.overran = False
        self._soft = threading.Timer(limit, self._expired)
        self._hard = threading.Timer(limit + GRACE, self._kill)
        self._soft.daemon = self._hard.daemon = True

    @property
    def message(self) -> str:
        return f"{self.item.nodeid} ran past its {self.limit:g} s limit"

    def start(self) -> None:
        self._soft.start()
        self._hard.start()

    def settled(self) -> None:
        """The test failed (pytest-timeout cancels on every failure): no soft
        stop from now on, but its teardown is still bounded."""
        self._soft.cancel()

    def cancel(self) -> None:
        self._soft.cancel()
        self._hard.cancel()

    def _expired(self) -> None:
        """At the limit (timer thread): stop the test where it waits."""
        self.overran = True
        sys.stderr.write(f"\n{self.message}: stopping it\n")
        if self.deferred is not None:
            from twisted.internet import reactor

            reactor.callFromThread(self._cancelDeferred)
        elif self.inBody:
            signal.pthread_kill(threading.main_thread().ident, INTERRUPT)

    def _cancelDeferred(self) -> None:
        if self.deferred is not None and not self.deferred.called:
            self.deferred.cancel()

    def failed(self, failure: Any) -> Any:
        """A Twisted test's outcome after its cancel: the overrun, by name."""
        if self.overran:
            pytest.fail(f"{self.message} (its Deferred was cancelled)", pytrace=False)
        return failure

    def guard(self, test: Any) -> Any:
        """*test*, run so that this can reach it: its body marked as running
        (a coroutine's first steps too), a Deferred it returns kept."""
        import functools
        import inspect

        from twisted.internet import defer

        @functools.wraps(test)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.overran:  # run again after its overrun (hypothesis replays a failure)
                pytest.fail(self.message, pytrace=False)
            self.inBody = True
            try:
                result = test(*args, **kwargs)
                if inspect.iscoroutine(result):
                    result = defer.ensureDeferred(result)
            finally:
                self.inBody = False
            if isinstance(result, defer.Deferred):
                self.deferred = result
                result.addErrback(self.failed)
            elif self.overran:
                pytest.fail(self.message, pytrace=False)
            return result

        return guarded

    def _kill(self) -> None:
        """Well past the limit (timer thread): the test did not stop; end this worker."""
        capture = self.item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:  # this process's own stderr, not the test's captured one
            capture.suspend_global_capture(in_=True)
        out = sys.__stderr__ or sys.stderr
        out.write(f"\n{self.message} and did not stop within {GRACE:g} s of being "
                  "cancelled; the stacks of this test process, then its child processes "
                  "are killed and it exits:\n")
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()
        kill_descendants()
        os._exit(1)


#: the signal that stops a plain test's body (no test of ours uses it)
INTERRUPT = signal.SIGUSR2
#: the test with a limit running in this process
_current: Optional[Overrun] = None


def _interrupted(number: int, frame: Any) -> None:
    """INTERRUPT, on the main thread: fail the current test's body if it
    overran and still runs; a signal that comes after it returned does
    nothing (the handler stays, so it cannot end the process either)."""
    overrun = _current
    if overrun is not None and overrun.overran and overrun.inBody:
        pytest.fail(overrun.message, pytrace=True)


def _running(item: Any) -> Optional[Overrun]:
    return getattr(item, "_suite_guard_overrun", None)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: Any, settings: Any) -> Optional[bool]:
    global _current
    if not settings.timeout or settings.timeout <= 0:
        return None
    if signal.getsignal(INTERRUPT) is not _interrupted:
        signal.signal(INTERRUPT, _interrupted)
    overrun = Overrun(item, min(settings.timeout, LONGEST))
    item._suite_guard_overrun = _current = overrun
    overrun.start()
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: Any) -> Optional[bool]:
    """pytest-timeout cancels at a test's end and at each failure (its
    ``pytest_exception_interact``): only the soft stop ends here; the
    protocol's end (below) ends the rest."""
    overrun = _running(item)
    if overrun is None:
        return None
    overrun.settled()
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any) -> Iterator[None]:
    global _current
    try:
        yield
    finally:
        overrun = _running(item)
        if overrun is not None:
            overrun.cancel()
            del item._suite_guard_overrun
            if _current is overrun:
                _current = None


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem: Any) -> Iterator[None]:
    """Run the test's body (or each example's, under hypothesis) so that its
    Overrun can reach it (:meth:`Overrun.guard`)."""
    overrun = _running(pyfuncitem)
    if overrun is None:
        yield
        return
    test = pyfuncitem.obj
    hypothesis = getattr(test, "hypothesis", None)
    if hypothesis is not None:
        inner = hypothesis.inner_test
        hypothesis.inner_test = overrun.guard(inner)
        try:
            yield
        finally:
            hypothesis.inner_test = inner
        return
    pyfuncitem.obj = overrun.guard(test)
    try:
        yield
    finally:
        pyfuncitem.obj = test


# --- a crashed worker's file goes on elsewhere (controller) ---------------------------------


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class CrashTolerantFileScheduling(LoadFileScheduling):
        """LoadFileScheduling whose crashed test does not run again."""

        def remove_node(self, node: Any) -> Optional[str]:
            workload = self.assigned_work.pop(node)
            crashed = next((nodeid for unit in workload.values()
                            for nodeid, done in unit.items() if not done), None)
            if crashed is None:
                return None
            for unit in workload.values():
                if crashed in unit:
                    unit[crashed] = True
            self.workqueue.update((scope, unit) for scope, unit in workload.items()
                                  if not all(unit.values()))
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

        def _reschedule(self, node: Any) -> None:
            """As the base class, and never leave a worker with one test and
            nothing more coming: a worker holds back its last test until it
            gets another or is told to stop (the next test's teardown needs
            to know), and only a test's end calls this again.  A replacement
            worker handed the one test left of a crashed file waited so."""
            if node not in self.registered_collections:
                return  # a replacement still collecting: schedule() comes when it is done
            super()._reschedule(node)
            while not node.shutting_down and self._pending_of(self.assigned_work[node]) < 2:
                if not self.workqueue:
                    node.shutdown()
                    break
                self._assign_work_unit(node)

    return CrashTolerantFileScheduling(config, log)


# --- what did not run (controller) ---------------------------------------------------------


class RunWatch:
    """The controller's view of the run: collected, ended, running."""

    def __init__(self, config: Any, idle: float = IDLE) -> None:
        self.config = config
        self.idle = idle
        self.collected: list[str] = []
        self.ended: set[str] = set()
        self.running: dict[str, float] = {}
        self.lastEnd = time.monotonic()
        self.finished = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="suite-guard", daemon=True)
        self._thread.start()

    def notRun(self) -> list[str]:
        return [nodeid for nodeid in self.collected if nodeid not in self.ended]

    def _watch(self) -> None:
        while not self.finished.wait(min(5.0, self.idle / 4)):
            if not self.collected or time.monotonic() - self.lastEnd < self.idle:
                continue
            now = time.monotonic()
            lines = [f"\nno test has ended for {self.idle:g} s: stopping the run."]
            lines += [f"  still running ({now - since:.0f} s): {nodeid}"
                      for nodeid, since in list(self.running.items())]
            left = self.notRun()
            lines.append(f"{len(left)} tests did not run:")
            lines += [f"  {nodeid}" for nodeid in left]
            out = sys.__stderr__ or sys.stderr
            out.write("\n".join(lines) + "\n")
            out.flush()
            kill_descendants()
            os._exit(1)


#: the controller's watch (one controller a process)
_watch: Optional[RunWatch] = None


def _is_controller(config: Any) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


@pytest.hookimpl(trylast=True)
def pytest_configure(config: Any) -> None:
    global _watch
    if _is_controller(config) and not config.getoption("collectonly", False):
        _watch = RunWatch(config)


def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    if _watch is not None and not _watch.collected:
        _watch.collected = list(ids)
        _watch.lastEnd = time.monotonic()


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    if _watch is not None:
        _watch.running[nodeid] = time.monotonic()


def pytest_runtest_logreport(report: Any) -> None:
    if _watch is None:
        return
    if report.when in ("teardown", "???"):  # (a failed setup or call has its teardown too)
        _watch.running.pop(report.nodeid, None)
        _watch.ended.add(report.nodeid)
        _watch.lastEnd = time.monotonic()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    watch = _watch
    if watch is None:
        return
    watch.finished.set()
    if watch.notRun() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    watch = _watch
    if watch is None or not watch.collected:
        return
    left = watch.notRun()
    if left:
        terminalreporter.section(f"{len(left)} tests did not run", sep="=", red=True, bold=True)
        for nodeid in left:
            terminalreporter.line(nodeid)
