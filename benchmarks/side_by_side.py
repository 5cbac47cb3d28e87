"""Brokers side by side: what a broker costs per request when two share the load, against one
broker carrying it all, on this machine (docs/deployment.md, "Capacity").

    python -m benchmarks.side_by_side [--rounds 5] [--n 20000] [--window 64] [--gap 0]
                                      [--json FILE]

Each round runs four layouts, in turn (which goes first rotates): 4 echo workers
(``twist mdp-worker``, with ``--attach all`` for two brokers), a pipelined client process
(:class:`mdp.SpreadClient`, *window* requests out) and one or two ``twist mdp-broker`` over
TCP on 127.0.0.1: one broker and workers of concurrency 4; two brokers and the same
workers (each broker has half the sessions); two brokers and workers of concurrency 8 (each
has as many as the one); the same with two client processes (each broker also has as many
requests out as the one).  Brokers' and workers' CPU is read from /proc before and after the
timed requests (the client's is its own); ratios against one broker are per round, reported
as medians with their range.  With ``--gap S`` each of the client's *window* lanes waits S
seconds after each reply: a light load (``--window 1 --gap 0.003``: about 250 requests/s),
where each message wakes a sleeping process, against the pipelined load where many share a
wake-up."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.harness import cpu_seconds

WORKERS, CONCURRENCY = 4, 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def twist(log: str, *args: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "twist"),
                                 "--log-format", "text", *args], stdout=out, stderr=subprocess.STDOUT)


def wait_for(log: str, marker: bytes, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log, "rb") as f:
            if f.read().count(marker) >= count:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{log}: no {count} x {marker!r} within {timeout} s")


def run_layout(brokers: int, n: int, window: int, scratch: str,
               concurrency: int = CONCURRENCY, gap: float = 0.0, clients: int = 1) -> dict[str, Any]:
    """One timed run (*clients* client processes, *n* requests each): each role's CPU (ms)
    per 1,000 requests and the rate."""
    ports = [free_port() for _ in range(brokers)]
    endpoints = [f"tcp:127.0.0.1:{port}" for port in ports]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        logs = [os.path.join(scratch, f"broker-{port}.log") for port in ports]
        for port, log in zip(ports, logs):
            procs.append(twist(log, "mdp-broker", "--endpoint", f"tcp:{port}:interface=127.0.0.1"))
        attach = ["--attach", "all"] if brokers > 1 else []
        for w in range(WORKERS):
            procs.append(twist(os.path.join(scratch, f"worker-{w}.log"), "mdp-worker",
                               *(o for e in endpoints for o in ("--broker", e)), *attach,
                               "--concurrency", str(concurrency), "--service", "echo"))
        for log in logs:
            wait_for(log, b"ready for echo", WORKERS * concurrency // brokers)
        senders = [subprocess.Popen([sys.executable, "-m", "benchmarks.side_by_side", "client",
                                     str(n), str(window), str(gap), *endpoints],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(clients)]
        for sender in senders:
            assert sender.stdout is not None and sender.stdin is not None
            assert sender.stdout.readline().strip() == b"warm"
        before = [cpu_seconds(p.pid) for p in procs]
        for sender in senders:
            sender.stdin.write(b"go\n")  # type: ignore[union-attr]
            sender.stdin.flush()  # type: ignore[union-attr]
        results = [json.loads(sender.stdout.readline()) for sender in senders]  # type: ignore[union-attr]
        after = [cpu_seconds(p.pid) for p in procs]
        for sender in senders:
            sender.wait(60)
        total = n * clients
        sent: dict[str, int] = {}
        for result in results:
            for endpoint, count in result["sent"].items():
                sent[endpoint] = sent.get(endpoint, 0) + count
        broker_cpu = sum(after[:brokers]) - sum(before[:brokers])
        return {"brokers": brokers, "clients": clients, "broker_cpu_ms_per_1k": broker_cpu / total * 1e6,
                "workers_cpu_ms_per_1k": (sum(after[brokers:]) - sum(before[brokers:])) / total * 1e6,
                "client_cpu_ms_per_1k": sum(r["cpu"] for r in results) / total * 1e6,
                "per_broker_cpu_ms_per_1k": [(a - b) / total * 1e6
                                             for a, b in zip(after[:brokers], before)],
                "rate": total / max(r["elapsed"] for r in results), "sent": sent}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


def client(n: int, window: int, gap: float, endpoints: list[str]) -> None:
    """The client: warms up, says ``warm``, waits for ``go``, then sends *n* requests with
    *window* out (each lane waiting *gap* s after a reply) and prints the elapsed seconds (JSON)."""
    from twisted.internet import defer, task

    from mdp import SpreadClient

    async def main(reactor: Any) -> None:
        spread = SpreadClient(endpoints, reactor, stamp=False, timeout=10.0)

        async def send(count: int) -> None:
            left = iter(range(count))

            async def lane() -> None:
                for _ in left:
                    await spread.request("echo", b"x" * 16)
                    if gap:
                        await task.deferLater(reactor, gap)

            await defer.gatherResults([defer.ensureDeferred(lane()) for _ in range(window)])

        await send(n // 10)
        print("warm", flush=True)
        sys.stdin.readline()  # (blocking: nothing is out meanwhile)
        spread.sent.clear()
        started, cpu = time.monotonic(), time.process_time()
        await send(n)
        print(json.dumps({"elapsed": time.monotonic() - started, "cpu": time.process_time() - cpu,
                          "sent": dict(spread.sent)}), flush=True)
        await spread.close()

    task.react(lambda reactor: defer.ensureDeferred(main(reactor)))


def main(argv: list[str]) -> None:
    if argv[:1] == ["client"]:
        client(int(argv[1]), int(argv[2]), float(argv[3]), argv[4:])
        return
    parser = argparse.ArgumentParser(prog="python -m benchmarks.side_by_side", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three layouts (5)")
    parser.add_argument("--n", type=int, default=20000, help="timed requests per layout (20000)")
    parser.add_argument("--window", type=int, default=64, help="requests out at a time (64)")
    parser.add_argument("--gap", type=float, default=0.0,
                        help="seconds each lane waits after a reply (a light load)")
    parser.add_argument("--json", help="also write the rows and the report to this file")
    args = parser.parse_args(argv)
    layouts = {"one": (1, CONCURRENCY, 1), "two, the same workers": (2, CONCURRENCY, 1),
               "two, as many sessions at each": (2, 2 * CONCURRENCY, 1),
               "two, as many sessions and requests out at each": (2, 2 * CONCURRENCY, 2)}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            names = list(layouts)
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                brokers, concurrency, clients = layouts[name]
                row = run_layout(brokers, args.n, args.window, scratch, concurrency, args.gap, clients)
                rows[name].append(row)
                print(f"round {round_ + 1}/{args.rounds}, {name}: "
                      f"{row['broker_cpu_ms_per_1k']:.1f} ms broker CPU per 1k, {row['rate']:,.0f}/s",
                      file=sys.stderr)

    def against_one(two: str) -> dict[str, Any]:
        cpu = [t["broker_cpu_ms_per_1k"] / b["broker_cpu_ms_per_1k"] for b, t in zip(rows["one"], rows[two])]
        rate = [t["rate"] / b["rate"] for b, t in zip(rows["one"], rows[two])]
        return {"cpu_ratio_median": statistics.median(cpu), "cpu_ratio_range": [min(cpu), max(cpu)],
                "rate_ratio_median": statistics.median(rate), "rate_ratio_range": [min(rate), max(rate)]}

    report = {two: against_one(two) for two in layouts if two != "one"}
    report |= {
              f"{role}_cpu_ms_per_1k_median": {
                  name: statistics.median(r[f"{role}_cpu_ms_per_1k"] for r in rows[name]) for name in rows}
              for role in ("broker", "workers", "client")}
    report |= {
              "rate_median": {name: statistics.median(r["rate"] for r in rows[name]) for name in rows}}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "report": report, "args": vars(args)}, out, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
