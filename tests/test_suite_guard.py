"""The suite cannot hang (tests/suite_guard.py): each case runs a small suite
of its own in two test processes, as the README's test command runs ours
(in three on two cores),
with limits of a few seconds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = """\
from tests.suite_guard import *  # noqa: F401,F403
"""

INI = """\
[pytest]
addopts = -p no:cacheprovider -n 2 --dist loadfile -p no:randomly
timeout = 60
timeout_method = thread
"""

PLAIN = """\
import subprocess, sys, time, pytest

@pytest.mark.timeout(1)
def test_sleeps():
    time.sleep(30)

@pytest.mark.timeout(1)
def test_waits_for_a_process():
    subprocess.run([sys.executable, "-c", "import time; time.sleep(30)"])

def test_after_the_plain_ones():
    pass
"""

TWISTED = """\
import os, subprocess, sys, time, pytest, pytest_twisted
from twisted.internet import defer

@pytest.mark.timeout(1)
@pytest_twisted.ensureDeferred
async def test_waits_for_ever():
    try:
        await defer.Deferred()
    finally:
        print("cleanup ran")

@pytest.mark.timeout(1)
@pytest_twisted.ensureDeferred
async def test_does_not_stop_when_cancelled():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(os.environ["CHILD_PID_FILE"], "w") as f:
        f.write(str(child.pid))
    try:
        await defer.Deferred()
    except BaseException:
        time.sleep(60)

def test_after_the_twisted_ones():
    pass
"""

MORE = """\
import time, pytest, pytest_twisted
from hypothesis import given, settings, strategies
from twisted.internet import defer

@pytest_twisted.async_yield_fixture
async def hangs_when_done():
    yield
    await defer.Deferred()

@pytest.mark.timeout(1)
@settings(deadline=None, max_examples=3)
@given(strategies.integers())
def test_an_example_sleeps(number):
    time.sleep(30)

@pytest.mark.timeout(1)
@pytest_twisted.ensureDeferred
async def test_blocks_before_its_first_await():
    time.sleep(30)

@pytest.mark.timeout(1)
def test_fails_and_its_fixture_never_ends(hangs_when_done):
    assert False, "failed at once"

def test_after_the_others():
    pass
"""

OTHER = """\
def test_one():
    pass

def test_two():
    pass
"""


def run_suite(tmp_path: Path, files: dict[str, str], *args: str,
              env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run pytest on *files* (with the guard) in *tmp_path*; its status and output."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text(INI)
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "SUITE_GUARD_GRACE": "2",
               "CHILD_PID_FILE": str(tmp_path / "child.pid"), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rf", *args], cwd=tmp_path,
                          env=environ, capture_output=True, text=True, timeout=50,
                          stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout + proc.stderr


def outcomes(output: str) -> dict[str, str]:
    """test name -> PASSED or FAILED, from the verbose lines."""
    return {m.group(2): m.group(1)
            for m in re.finditer(r"(PASSED|FAILED) \S+::(\w+)", output)}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_tests_past_their_limit_fail_by_name_and_the_rest_run(tmp_path: Path) -> None:
    status, output = run_suite(tmp_path, {"test_plain.py": PLAIN, "test_twisted.py": TWISTED,
                                          "test_more.py": MORE, "test_other.py": OTHER})
    assert status == 1, output
    assert outcomes(output) == {
        "test_sleeps": "FAILED", "test_waits_for_a_process": "FAILED",
        "test_after_the_plain_ones": "PASSED",
        "test_waits_for_ever": "FAILED", "test_does_not_stop_when_cancelled": "FAILED",
        "test_after_the_twisted_ones": "PASSED",
        "test_an_example_sleeps": "FAILED", "test_blocks_before_its_first_await": "FAILED",
        "test_fails_and_its_fixture_never_ends": "FAILED", "test_after_the_others": "PASSED",
        "test_one": "PASSED", "test_two": "PASSED"}, output
    for name in ("test_sleeps", "test_waits_for_a_process", "test_waits_for_ever",
                 "test_an_example_sleeps", "test_blocks_before_its_first_await"):
        assert f"{name} ran past its 1 s limit" in output, output
    # a failed test's teardown that hangs is still bounded: its worker is
    # killed, the rest of its file goes on
    assert re.search(r"crashed while running 'test_more.py::test_fails_and_its_fixture_never_ends'",
                     output), output
    assert "cleanup ran" in output  # the cancelled test's finally: ran
    # the test that would not stop: its worker was killed with its child process,
    # the crash reported once, and the rest of its file ran on a new worker
    assert "did not stop within 2 s of being cancelled" in output, output
    assert re.search(r"crashed while running 'test_twisted.py::test_does_not_stop_when_cancelled'",
                     output), output
    assert not alive(int((tmp_path / "child.pid").read_text()))
    assert "did not run" not in output


def test_a_run_that_stops_early_lists_what_did_not_run(tmp_path: Path) -> None:
    crashes = """\
        import os

        def test_crashes_its_worker():
            os._exit(1)

        def test_behind_it():
            pass
        """
    status, output = run_suite(tmp_path, {"test_crashes.py": crashes, "test_other.py": OTHER},
                               "--max-worker-restart=0")
    assert status == 1, output
    left = re.search(r"=+ (\d+) tests did not run =+\n((?:\S+\n)+)", output)
    assert left is not None, output
    assert "test_crashes.py::test_behind_it" in left.group(2).split()


def test_a_run_where_nothing_ends_is_stopped_with_what_ran_and_what_did_not(tmp_path: Path) -> None:
    stuck = """\
        import time, pytest

        @pytest.mark.timeout(0)
        def test_never_ends():
            time.sleep(120)

        def test_behind_it():
            pass
        """
    status, output = run_suite(tmp_path, {"test_stuck.py": stuck},
                               env={"SUITE_GUARD_IDLE": "3"})
    assert status == 1, output
    assert "no test has ended for 3 s: stopping the run." in output, output
    assert re.search(r"still running \(\d+ s\): test_stuck.py::test_never_ends", output), output
    assert "test_stuck.py::test_behind_it" in output.split("tests did not run:")[1]


@pytest.mark.parametrize("name", ["setup.cfg"])
def test_no_test_of_ours_may_ask_for_more_than_a_minute(name: str) -> None:
    """The suite's limit, and every mark, at most a minute (the guard caps them too)."""
    from tests.suite_guard import LONGEST

    assert re.search(r"^timeout = 60$", (ROOT / name).read_text(), re.M)
    assert LONGEST == 60
    marks = [(path.name, int(m)) for path in (ROOT / "tests").glob("test_*.py")
             for m in re.findall(r"mark\.timeout\((\d+)\)", path.read_text())]
    assert marks and not [mark for mark in marks if mark[1] > 60]
