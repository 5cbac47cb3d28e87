"""The benchmark suite runs end to end (tiny N) and writes well-formed JSON.

Only a smoke run: no speed is asserted here (see docs/performance.md)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Optional

import pytest

from benchmarks.harness import default_reactor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke_run(module: str, out: object, timeout: float, *extra: str) -> subprocess.CompletedProcess:
    """``python -m MODULE --smoke --json OUT [EXTRA...]`` from the checkout; it must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--smoke", "--json", str(out), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


#: the smoke run, in parts of well under a minute each (``--part K/N``)
PARTS = 6


def smoke_names(part: Optional[tuple[int, int]] = None) -> set[str]:
    """The cases of a smoke run (of one part of it), as this checkout has them."""
    from benchmarks.__main__ import BEFORE_ROUND_TWO, cases, in_part

    earlier = ROOT if _have_revision(BEFORE_ROUND_TWO) else None  # (names only: nothing runs)
    return {name for names, _, _ in in_part(cases(True, earlier), part) for name in names}


def test_the_parts_together_are_the_whole_smoke_run() -> None:
    from benchmarks.__main__ import cases, in_part, part_of

    whole = cases(True)
    parts = [in_part(whole, (k, PARTS)) for k in range(1, PARTS + 1)]
    assert sorted(e[0] for part in parts for e in part) == sorted(e[0] for e in whole)
    assert parts[-1] == []  # the last part: the scale scenarios alone
    assert all(parts[:-1])
    assert part_of("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "1/1", "x", "1/2/3"):
        with pytest.raises(argparse.ArgumentTypeError):
            part_of(bad)


@pytest.mark.parametrize("part", range(1, PARTS + 1))
def test_benchmark_smoke_run(part: int, tmp_path) -> None:
    out = tmp_path / "bench.json"
    proc = smoke_run("benchmarks", out, 55, "--part", f"{part}/{PARTS}")
    assert "| case |" in proc.stdout and "| target |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["smoke"] is True and report["part"] == f"{part}/{PARTS}"
    assert set(report["cases"]) == smoke_names((part, PARTS))
    for name, case in report["cases"].items():
        assert case["rate"] > 0, name
        assert case["p50_us"] <= case["p99_us"], name
        assert case["cpu_s_per_1k"] > 0, name
        assert len(case["runs"]) == 1
        if case["transport"] != "loopback":  # where the CPU went, per role
            parts = [case[f"cpu_{role}_s_per_1k"] for role in ("broker", "workers", "clients")]
            assert abs(sum(parts) - case["cpu_s_per_1k"]) < 1e-6, name
    # our Twisted nodes ran on the run's reactor (uvloop, installed with the
    # tests), but for the stack that shows what that buys, which ran on epoll
    reactor = default_reactor()
    assert reactor == report["reactor"] == "uvloop"
    cases = report["cases"]
    for name, client, servers in (
            ("sync 4x4 / ours", [reactor], [reactor]),
            ("sync 4x4 / ours (epoll reactor)", ["epoll"], ["epoll"]),
            ("sync 4x4 / ours+blocking-client", [], [reactor]),
            ("sync 4x4 / bare", [], ["epoll"])):  # no Twisted: nothing mapped
        if name in cases:
            run = cases[name]["runs"][0]
            assert (run["client_reactors"], run["server_reactors"]) == (client, servers), name
    # goal 4's baseline: the same stream case, run from the code before the
    # round (from this checkout's history, which a clone has): that code's
    # roles ignore the run's reactor, so its processes are on epoll where ours
    # are on uvloop (test_the_earlier_tree... shows they import its mdp)
    earlier = report["before_round_two"]
    assert earlier["available"] == _have_revision(earlier["revision"]), earlier["note"]
    before = "stream 1000 partials / ours before round two"
    if before in cases:
        assert cases[before]["revision"] == earlier["revision"]
        assert cases[before]["runs"][0]["server_reactors"] == ["epoll"]
    if "stream 1000 partials / ours" in cases:
        assert cases["stream 1000 partials / ours"]["runs"][0]["server_reactors"] == [reactor]
    if part < PARTS:
        assert "heartbeat" not in report["scale"]
        return
    heartbeat = report["scale"]["heartbeat"]
    assert heartbeat["idle_workers"] == 100
    # goal 6's floor: the bare forwarder under the same idle workers, and
    # both brokers' CPU split between their own thread and libzmq's
    # and, with the history, the broker of the code before the round (the
    # goal's "today") under the same workers, on this machine
    measured_brokers = [heartbeat, heartbeat["bare"]]
    if earlier["available"]:
        measured_brokers.append(heartbeat["before_round_two"])
        # that tree's broker ran (its roles ignore the run's reactor), ours on the run's
        assert heartbeat["before_round_two"]["reactor"] == "epoll"
        assert heartbeat["reactor"] == reactor
        assert "The broker of the code before this round" in proc.stdout
        assert any(r["reference"].endswith("ours before round two's (same workers)")
                   for r in report["references"]) == (heartbeat["before_round_two"]["busy"] > 0)
    else:
        assert "before_round_two" not in heartbeat
    for measured in measured_brokers:
        assert set(measured["threads"]) == {"main", "zmq"}
        assert all(v >= 0 for v in measured["threads"].values())
    assert "The bare forwarder, answering each HEARTBEAT" in proc.stdout
    assert report["scale"]["drain"]["queued"] == 1000
    rows = {c["target"]: c for c in report["targets"]}
    assert rows["6. 1000 idle workers: broker CPU (fraction of a core)"]["value"] is not None


def test_every_goal_has_its_row_when_every_case_ran() -> None:
    """What a whole run's cases give :func:`targets` and :func:`references`:
    every goal numbered as in docs/performance.md, with a value (the runs
    themselves are checked part by part above)."""
    from benchmarks.__main__ import BEFORE_STACK, aggregate, references, targets

    run = {"rate": 1000.0, "p50_us": 100.0, "p99_us": 200.0, "cpu_s_per_1k": 0.5}
    scale = {"heartbeat": {"core_fraction": 0.01, "idle_workers": 100, "bare": {"busy": 0.01}},
             "drain": {"rss_growth_mb": 1.0}}
    for with_history in (True, False):
        names = smoke_names()
        if not with_history:
            names.discard(f"stream 1000 partials / {BEFORE_STACK}")
        table = {name: aggregate([dict(run)]) for name in names}
        rows = {c["target"]: c for c in targets(table, scale)}
        numbered = {name[0] for name in rows if re.match(r"\d\. ", name)}
        assert numbered == {"1", "2", "3", "4", "5", "6"}  # 7 (Spark) is not in a smoke run
        for name, row in rows.items():
            assert row["value"] is not None and isinstance(row["met"], bool), name
        goal4 = ("4. stream: PARTIALs per second / the code before this round (same run)"
                 if f"stream 1000 partials / {BEFORE_STACK}" in table else
                 "4. stream: PARTIALs per second / 40,000 (before this round; another run)")
        assert goal4 in rows
        found = {r["reference"] for r in references(table, scale)}
        assert "4x4 sync zmq: ceiling (bare stack) / majortomo" in found
        assert "4x4 sync zmq: our stack on the run's reactor / on epoll (Twisted peers)" in found


def test_freelance_benchmark_smoke_run(tmp_path) -> None:
    out = tmp_path / "freelance.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.freelance", "--smoke", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=55, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["reactor"] == default_reactor()
    runs = report["runs"]
    assert [(r["model"], r["first_server_killed"]) for r in runs] == [
        (1, False), (2, False), (3, False), (1, True), (2, True), (3, True)]
    assert all(r["rate"] > 0 and r["p50_us"] <= r["p99_us"] for r in runs)


def test_ratios_pair_repetitions_of_the_same_round() -> None:
    """A slow round slows both sides of a ratio: the suite compares round by
    round, so one bad round does not skew the result as a ratio of medians would."""
    from benchmarks.__main__ import aggregate, ratio

    a = [{"rate": r, "p50_us": 1.0, "p99_us": 2.0, "cpu_s_per_1k": 1.0} for r in (90, 45, 92)]
    b = [{"rate": r, "p50_us": 1.0, "p99_us": 2.0, "cpu_s_per_1k": 1.0} for r in (100, 50, 46)]
    table = {"a": aggregate(a), "b": aggregate(b)}
    assert ratio(table, "a", "b") == 0.9  # rounds: 0.9, 0.9, 2.0
    assert table["a"]["rate"] / table["b"]["rate"] == 1.8  # what medians alone would say
    assert ratio(table, "a", "missing") is None


def test_runs_made_in_pairs_cancel_a_drift_of_the_machine() -> None:
    """Goal 2's clients run in pairs against the same servers, alternated (A B,
    B A, ...): a round's ratio is the geometric mean of its pairs', so a
    machine slowing down steadily through the round favours neither side."""
    from benchmarks.__main__ import aggregate, ratio

    def runs(rates: list[float]) -> list[dict[str, float]]:
        return [{"rate": r, "p50_us": 1.0, "p99_us": 2.0, "cpu_s_per_1k": 1.0, "pair": n % 2}
                for n, r in enumerate(rates)]

    # the same speed, on a machine that loses 10% every run: A B | B A, twice
    slot = [100 * 0.9 ** t for t in range(8)]
    a = runs([slot[0], slot[3], slot[4], slot[7]])
    b = runs([slot[1], slot[2], slot[5], slot[6]])
    table = {"a": aggregate(a), "b": aggregate(b)}
    assert ratio(table, "a", "b") == pytest.approx(1.0)
    # the plain median of the pairs' ratios leans to the side run first
    unpaired = {name: aggregate([{k: v for k, v in run.items() if k != "pair"} for run in rows])
                for name, rows in (("a", a), ("b", b))}
    assert ratio(unpaired, "a", "b") > 1.0


def test_framing_benchmark_smoke_run(tmp_path) -> None:
    out = tmp_path / "framing.json"
    smoke_run("benchmarks.framing", out, 55)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["pieces"] > 1000
    for name in ("ours", "twisted_int32"):
        assert row[name]["trickle_s"] > 0 and row[name]["whole_s"] > 0


def test_titanic_benchmark_smoke_run(tmp_path) -> None:
    out = tmp_path / "titanic.json"
    proc = smoke_run("benchmarks.titanic", out, 55)
    assert "| case |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["smoke"] is True and report["repetitions"] == 1
    assert report["reactor"] == default_reactor()
    cases = {"plain Client.request", "titanic stored / sqlite", "titanic end-to-end / sqlite",
             "titanic stored / memory", "titanic end-to-end / memory"}
    assert set(report["cases"]) == cases
    for name, case in report["cases"].items():
        assert case["rate"] > 0, name
        assert len(case["runs"]) == 1, name
    assert set(report["ratios_to_plain"]) == cases - {"plain Client.request"}
    assert all(value > 0 for value in report["ratios_to_plain"].values())


def test_sp_benchmark_smoke_run(tmp_path) -> None:
    out = tmp_path / "sp.json"
    proc = smoke_run("benchmarks.sp", out, 55)
    assert "| case |" in proc.stdout and "ours / pynng" in proc.stdout
    report = json.loads(out.read_text())
    assert report["smoke"] is True and report["repetitions"] == 1
    assert set(report["cases"]) == {"pynng Req0 -> Rep0", "our SPClient -> twist sp-rep"}
    assert all(case["rate"] > 0 for case in report["cases"].values())
    assert report["ratio_ours_to_pynng"] > 0


def _have_revision(revision: str) -> bool:
    """This checkout's history holds *revision* (a clone does; a tarball not)."""
    try:
        return subprocess.run(["git", "-C", ROOT, "cat-file", "-e", f"{revision}^{{commit}}"],
                              capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


def test_the_earlier_tree_is_the_revision_before_the_round_or_none_with_the_reason() -> None:
    """Goal 4's baseline runs the code before the round from this checkout's
    history, its own ``mdp`` and not this checkout's; without the revision the
    suite says why (and falls back to the figure from another run)."""
    from benchmarks.__main__ import BEFORE_ROUND_TWO, earlier_tree
    from benchmarks.harness import Child

    with earlier_tree("0" * 40) as (tree, note):
        assert tree is None and "git archive" in note
    with earlier_tree() as (tree, note):
        if not _have_revision(BEFORE_ROUND_TWO):
            assert tree is None
            pytest.skip(f"no history of this checkout here: {note}")
        assert tree is not None and BEFORE_ROUND_TWO[:12] in note
        assert os.path.isfile(os.path.join(tree, "benchmarks", "roles.py"))
        # a process started in that tree (as the suite's roles are) imports
        # its mdp, the plain source: nothing of this checkout's build
        child = Child(argv=[sys.executable, "-c", "import mdp; print(mdp.__file__)"], root=tree)
        try:
            imported = child.readline(timeout=60).strip()
        finally:
            child.kill()
        assert imported == os.path.join(os.path.realpath(tree), "mdp", "__init__.py") \
            or imported == os.path.join(tree, "mdp", "__init__.py"), imported
        assert not [name for name in os.listdir(os.path.join(tree, "mdp")) if name.endswith(".so")]
    assert not os.path.exists(tree)
