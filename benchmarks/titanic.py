"""Titanic against plain requests: ``python -m benchmarks.titanic [--smoke] [--json PATH] [--repeat R]
[--reactor uvloop|epoll]``.

Every process is separate (ZeroMQ on 127.0.0.1, ports picked by the OS): our
broker, one echo worker, and a client; for the Titanic cases also Titanic itself
(``twist mdp-titanic``, default concurrency 4) over a SQLite file in a
temporary directory or over the memory store.  Each round runs, in this order:

* **plain**: ``Client.request("echo", 16 bytes)`` N times, one after the other;
* for each store, a fresh broker, worker and Titanic, and one client that
  times two phases (see ``titanic_client`` in :mod:`benchmarks.roles`):

  - **stored/s**: N submits one after the other, each awaited (the request is
    committed when it is acknowledged); the dispatcher runs meanwhile, so each
    request is also sent to the worker and its reply stored;
  - **end-to-end/s**: N submits, up to 16 outstanding, then the N replies
    collected with ``result`` (polling every 20 ms), up to 16 at once: N over
    the time from the first submit to the last reply in hand.  The phase-1
    requests are collected and closed before it (untimed), so it starts with
    an idle Titanic and an empty store; nothing is closed while timed.

Rates are compared with the plain client's rate of the same round (the median
of the per-round ratios, as in ``python -m benchmarks``).  Prints a Markdown
table, writes JSON (default ``benchmarks/results/titanic-latest.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

from benchmarks.__main__ import percentile, ratio
from benchmarks.harness import (
    REACTORS,
    ROOT,
    Processes,
    cpu_seconds,
    default_reactor,
    on_uvloop,
    use_reactor,
    zmq_mmi,
)

BIND = "zmq:tcp://127.0.0.1:*"
SIZE = 16
#: outstanding submits (and result polls) in the end-to-end phase
WINDOW = 16
#: seconds between two polls of one pending reply
POLL = 0.02
#: requests Titanic sends out at once (``--concurrency``; the default)
CONCURRENCY = 4
STORES = ("sqlite", "memory")
SERVICES = (b"titanic.request", b"titanic.reply", b"titanic.close", b"echo")


def wait_registered(endpoint: str, timeout: float = 60.0) -> None:
    """Until the broker knows a worker for Titanic's three services and echo:
    "Titanic started" is logged before its workers' READY reach the broker."""
    deadline = time.monotonic() + timeout
    for service in SERVICES:
        while zmq_mmi(endpoint, b"mmi.service", service) != b"200":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{service.decode()} has no worker after {timeout:.0f} s")
            time.sleep(0.05)


def cpu_split(used: dict[str, float], n: int) -> dict[str, float]:
    """CPU seconds per 1,000 requests, per role and in all."""
    split = {f"cpu_{role}_s_per_1k": seconds / n * 1000 for role, seconds in used.items()}
    return {"cpu_s_per_1k": sum(used.values()) / n * 1000, **split}


def run_plain(n: int, warmup: int) -> dict[str, Any]:
    """The baseline: sequential ``Client.request`` through our broker to one
    echo worker."""
    with Processes() as procs:
        broker = procs.start("broker", "ours", BIND)
        endpoint = broker.ready()
        worker = procs.start("worker", "ours", endpoint)
        worker.ready()
        client = procs.start("client", "ours", endpoint, "sync", str(n), str(warmup), str(SIZE))
        client.ready(timeout=120)
        servers = {"broker": broker, "worker": worker}
        before = {role: cpu_seconds(p.pid) for role, p in servers.items()}
        client.go()
        res = client.result(timeout=600)
        used = {role: cpu_seconds(p.pid) - before[role] for role, p in servers.items()}
    elapsed = res["end"] - res["start"]
    return {"requests": n, "elapsed": elapsed, "rate": n / elapsed,
            "p50_us": percentile(res["latencies"], 0.5) * 1e6,
            "p99_us": percentile(res["latencies"], 0.99) * 1e6,
            **cpu_split({**used, "titanic": 0.0, "client": res["cpu"]}, n)}


def run_titanic(store: str, n: int, warmup: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One Titanic over *store* ("sqlite" or "memory"): the stored and the
    end-to-end phase, each with Titanic's CPU while it ran."""
    twist = os.path.join(os.path.dirname(sys.executable), "twist")
    with tempfile.TemporaryDirectory(prefix="titanic-bench-") as tmp, Processes() as procs:
        broker = procs.start("broker", "ours", BIND)
        endpoint = broker.ready()
        worker = procs.start("worker", "ours", endpoint)
        worker.ready()
        db = os.path.join(tmp, "titanic.db") if store == "sqlite" else ":memory:"
        # Titanic on the run's reactor too (benchmarks.harness.use_reactor)
        reactor = ["--reactor=uvloop" if on_uvloop() else "--reactor=epoll"]
        titanic = procs.start(argv=[twist, *reactor, "--log-format", "text", "mdp-titanic",
                                    "--broker", endpoint, "--db", db,
                                    "--concurrency", str(CONCURRENCY)])
        titanic.waitFor("Titanic started", timeout=60)
        wait_registered(endpoint)
        client = procs.start("tclient", endpoint, str(n), str(warmup), str(SIZE), str(WINDOW),
                             str(POLL))
        servers = {"broker": broker, "worker": worker, "titanic": titanic}
        phases = []
        for _ in range(2):
            client.ready(timeout=300)
            before = {role: cpu_seconds(p.pid) for role, p in servers.items()}
            client.go()
            res = client.result(timeout=600)
            used = {role: cpu_seconds(p.pid) - before[role] for role, p in servers.items()}
            phases.append((res, {**used, "client": res["cpu"]}))
    (stored, stored_cpu), (e2e, e2e_cpu) = phases
    elapsed = stored["end"] - stored["start"]
    stored_row = {"requests": n, "elapsed": elapsed, "rate": n / elapsed,
                  "p50_us": percentile(stored["latencies"], 0.5) * 1e6,
                  "p99_us": percentile(stored["latencies"], 0.99) * 1e6,
                  "titanic_busy": stored_cpu["titanic"] / elapsed, **cpu_split(stored_cpu, n)}
    elapsed = e2e["end"] - e2e["start"]
    e2e_row = {"requests": n, "elapsed": elapsed, "rate": n / elapsed,
               "submit_s": e2e["submitted"] - e2e["start"],
               "collect_s": e2e["end"] - e2e["submitted"],
               "titanic_busy": e2e_cpu["titanic"] / elapsed, **cpu_split(e2e_cpu, n)}
    return stored_row, e2e_row


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and range of a case's rounds (and the median of its other numbers)."""
    rates = [r["rate"] for r in runs]
    keys = [k for k in runs[0] if k not in ("rate", "requests")]
    return {"runs": runs, "rate": statistics.median(rates), "rate_min": min(rates),
            "rate_max": max(rates), **{k: statistics.median(r[k] for r in runs) for k in keys}}


def case_names() -> list[str]:
    """The rows, baseline first."""
    return ["plain Client.request"] + [
        f"titanic {what} / {store}" for store in STORES for what in ("stored", "end-to-end")]


def markdown(table: dict[str, Any], ratios: dict[str, Optional[float]]) -> str:
    """The table, and a line on where the end-to-end time went."""
    lines = ["| case | per second (median) | range | × plain (same round) | p50 µs | p99 µs "
             "| CPU s / 1k | broker / worker / Titanic / client | Titanic busy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in table.items():
        scaled = ratios.get(name)
        cells = [f"{scaled:.3f}" if scaled is not None else "–"]
        cells += [f"{row[k]:,.0f}" if k in row else "–" for k in ("p50_us", "p99_us")]
        cells.append(f"{row['cpu_s_per_1k']:.3f}")
        cells.append(" / ".join(f"{row[f'cpu_{role}_s_per_1k']:.3f}"
                                for role in ("broker", "worker", "titanic", "client")))
        cells.append(f"{row['titanic_busy'] * 100:.0f}%" if "titanic_busy" in row else "–")
        lines.append(f"| {name} | {row['rate']:,.0f} | {row['rate_min']:,.0f}–{row['rate_max']:,.0f} "
                     f"| {' | '.join(cells)} |")
    for store in STORES:
        row = table[f"titanic end-to-end / {store}"]
        lines.append(f"\nEnd-to-end / {store}: submitting took {row['submit_s']:.2f} s, "
                     f"collecting the rest {row['collect_s']:.2f} s (medians).")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.titanic",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="N=50, one round (for CI)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--reactor", choices=REACTORS, default=default_reactor(),
                        help="what our Twisted nodes run on, as in python -m benchmarks")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results",
                                                       "titanic-latest.json"))
    args = parser.parse_args(argv)
    use_reactor(args.reactor)
    n, warm_plain, warm_titanic = (50, 10, 5) if args.smoke else (2000, 200, 20)
    rounds = 1 if args.smoke else max(1, args.repeat)

    names = case_names()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_ in range(rounds):
        print(f"… [{round_ + 1}/{rounds}] plain Client.request", file=sys.stderr, flush=True)
        runs[names[0]].append(run_plain(n, warm_plain))
        for store in STORES:
            print(f"… [{round_ + 1}/{rounds}] titanic / {store}", file=sys.stderr, flush=True)
            stored, e2e = run_titanic(store, n, warm_titanic)
            runs[f"titanic stored / {store}"].append(stored)
            runs[f"titanic end-to-end / {store}"].append(e2e)
    table = {name: aggregate(runs[name]) for name in names}
    ratios = {name: ratio(table, name, names[0]) for name in names[1:]}
    report = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform()},
        "smoke": args.smoke,
        "reactor": args.reactor,
        "repetitions": rounds,
        "requests": n,
        "body_bytes": SIZE,
        "window": WINDOW,
        "poll_interval_s": POLL,
        "concurrency": CONCURRENCY,
        "cases": table,
        "ratios_to_plain": ratios,
    }
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(markdown(table, ratios))
    print(f"\nJSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
