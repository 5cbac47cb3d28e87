"""What the request-context extension (deadlines, cancellation, trace context) costs:
CPU per request of broker, workers and client over TCP, for the code before it, the code
with it unused (the client asks for no extensions: requests carry no context) and with it
used (the default: each request carries its deadline), alternated within each round; and
how soon a handler hears that its client gave up (a broker, a worker and a client in this
process, over TCP and ZeroMQ on 127.0.0.1).

    python -m benchmarks.extension [--rounds 5] [--n 20000] [--trials 20] [--json FILE]

Ratios are per round against the code before, reported as medians with their range."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Optional

from benchmarks.__main__ import earlier_tree, environ, run_case
from benchmarks.harness import ROOT

#: the code before the extension
BEFORE = "3140884"
#: (name, root: None for this checkout, MDP_BENCH_EXTENSIONS)
VARIANTS = (("before", "earlier", None), ("unused", None, "0"), ("used", None, None))
#: (name, mode, clients, workers, window)
CASES = (("pipelined w100, 4 workers", "pipelined", 1, 4, 100), ("sync 1x1", "sync", 1, 1, 1))


def measure(rounds: int, n: int, earlier: str) -> dict[str, Any]:
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {case[0]: {v[0]: [] for v in VARIANTS}
                                                        for case in CASES}
    for round_ in range(rounds):
        for name, mode, clients, workers, window in CASES:
            order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
            for variant, root, flag in order:
                with environ("MDP_BENCH_EXTENSIONS", flag):
                    count = n if mode != "sync" else n // 4
                    row = run_case("ours", "tcp", mode, clients, workers, count, count // 10, 16,
                                   window, root=earlier if root else ROOT)
                rows[name][variant].append(row)
                print(f"round {round_ + 1}/{rounds} {name} {variant}: "
                      f"{row['cpu_s_per_1k'] * 1000:.1f} ms CPU per 1k, {row['rate']:,.0f}/s",
                      file=sys.stderr)
    return rows


def ratios(rows: dict[str, list[dict[str, Any]]], variant: str, key: str) -> list[float]:
    return [row[key] / before[key] for row, before in zip(rows[variant], rows["before"])]


def report(rows: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, variants in rows.items():
        out[case] = {}
        for variant in ("unused", "used"):
            cpu = ratios(variants, variant, "cpu_s_per_1k")
            rate = ratios(variants, variant, "rate")
            out[case][variant] = {
                "cpu_ratio_median": statistics.median(cpu), "cpu_ratio_range": [min(cpu), max(cpu)],
                "rate_ratio_median": statistics.median(rate), "rate_ratio_range": [min(rate), max(rate)]}
        out[case]["cpu_ms_per_1k_median"] = {
            v: statistics.median(r["cpu_s_per_1k"] * 1000 for r in variants[v]) for v in variants}
    return out


async def _lags(reactor: Any, kind: str, trials: int) -> list[float]:
    """Seconds from a client's cancel to its handler's CancelledError, *trials* times."""
    from twisted.internet import defer, task

    from mdp import Broker, Client, HeartbeatPolicy, Worker

    heard: list[float] = []

    async def slow(frames: list[bytes]) -> list[bytes]:
        if frames == [b"quick"]:
            return frames
        try:
            return await task.deferLater(reactor, 30.0, lambda: frames)
        except defer.CancelledError:
            heard.append(time.perf_counter())
            raise

    broker = Broker(reactor, heartbeat=HeartbeatPolicy(1.0, 3))
    bound = await broker.listen({"zmq": "zmq:tcp://127.0.0.1:*",
                                 "tcp": "tcp:host=127.0.0.1:port=0"}[kind])
    worker = Worker(bound.endpoint, "slow", slow, reactor)
    worker.start()
    client = Client(bound.endpoint, reactor, timeout=60, retries=1)
    lags = []
    try:
        while client.machine.extended is None:
            await client.request("slow", b"quick")
        for _ in range(trials):
            d = client.request("slow", b"work")
            while worker.busy == 0:
                await task.deferLater(reactor, 0.001, lambda: None)
            await task.deferLater(reactor, 0.01, lambda: None)
            count = len(heard)
            cancelled = time.perf_counter()
            d.addErrback(lambda f: f.trap(defer.CancelledError))
            d.cancel()
            while len(heard) == count:
                await task.deferLater(reactor, 0.0005, lambda: None)
            lags.append(heard[-1] - cancelled)
            while worker.busy:
                await task.deferLater(reactor, 0.001, lambda: None)
    finally:
        await client.close()
        await worker.stop()
        await broker.close()
    return lags


def lags(trials: int) -> dict[str, Any]:
    """Cancel-to-handler lag over TCP and ZeroMQ: median and range, in ms."""
    from twisted.internet import defer, task

    out: dict[str, Any] = {}

    async def run(reactor: Any) -> None:
        for kind in ("tcp", "zmq"):
            found = await _lags(reactor, kind, trials)
            out[kind] = {"median_ms": statistics.median(found) * 1000,
                         "range_ms": [min(found) * 1000, max(found) * 1000], "trials": trials}

    try:
        task.react(lambda reactor: defer.ensureDeferred(run(reactor)))
    except SystemExit:
        pass
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    with earlier_tree(BEFORE) as (earlier, note):
        if earlier is None:
            print(f"no earlier tree: {note}", file=sys.stderr)
            return 1
        rows = measure(args.rounds, args.n, earlier)
    summary = report(rows)
    print("| case | variant | CPU per request / before (median, range) | rate / before |")
    print("|---|---|---|---|")
    for case, variants in summary.items():
        for variant in ("unused", "used"):
            r = variants[variant]
            print(f"| {case} | {variant} | {r['cpu_ratio_median']:.3f} ({r['cpu_ratio_range'][0]:.3f}"
                  f"–{r['cpu_ratio_range'][1]:.3f}) | {r['rate_ratio_median']:.3f} "
                  f"({r['rate_ratio_range'][0]:.3f}–{r['rate_ratio_range'][1]:.3f}) |")
    lag = lags(args.trials)
    for kind, found in lag.items():
        print(f"cancel to handler over {kind}: {found['median_ms']:.2f} ms median "
              f"({found['range_ms'][0]:.2f}–{found['range_ms'][1]:.2f}), {found['trials']} trials")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"before": BEFORE, "rounds": args.rounds, "n": args.n, "summary": summary,
                       "cancel_lag": lag, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
