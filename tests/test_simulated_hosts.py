"""Three simulated hosts (network namespaces on a bridge; examples/simulated_hosts.py): two
brokers side by side, a worker and a Titanic on each of the first two, PostgreSQL on the
second, clients on the third; the first host is cut off under a steady load."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import pytest

from tests.postgres_server import need_bindir

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
import simulated_hosts  # noqa: E402


def sweep_stale() -> None:
    """Remove the namespaces of a simulation whose process is gone (one killed mid-run)."""
    import re
    import subprocess

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in re.findall(r"^(mdp(\d+)-(?:h[123]|sw))\b", listed, re.M):
        if not os.path.exists(f"/proc/{name[1]}"):
            subprocess.run(["ip", "netns", "del", name[0]], capture_output=True)


@pytest.mark.timeout(60)
def test_a_host_cut_off_under_load_loses_nothing_and_runs_nothing_twice() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (network namespaces)")
    need_bindir()
    sweep_stale()
    latency = 2.0
    report = simulated_hosts.simulate(argparse.Namespace(
        requests=2000, titanic=100, lanes=16, latency_ms=latency, heartbeat=0.5, logs=None))
    # a TCP connect takes one round trip: the latency each way (netem or the switch), in ms
    # (the bound above is loose: on a busy machine the switch is not always on a core)
    assert 2 * latency * 0.95 <= report["roundTripMs"] < 50, report
    assert report["failed"] == [], report  # (a request or submit given up: which, why, when)
    assert report["answered"] == 2000 and report["wrong"] == 0, report
    assert report["titanicAnswered"] == report["titanicAcknowledged"] == 100, report
    # a submit whose acknowledgement was lost with the cut host is stored again (a new id),
    # with the stamp its client gave it: it runs once
    assert report["titanicWrong"] == report["ranTwice"] == report["titanicRanTwice"] == 0, report
    assert report["longestGap"] < report["heartbeatExpiry"], report  # the load moved in time
    # the brokers' own count: every request and submit, Titanic's dispatches and the result polls
    assert report["carried"] >= 2000 + 3 * 100, report
    assert set(report["cpuMsPer1k"]) == {"broker", "worker", "titanic", "client"}, report
    assert all(ms > 0 for ms in report["cpuMsPer1k"].values()), report
    cut, kept = report["sent"].values()
    assert cut > 200 and kept > 1000, report  # both served before the cut, the second after
