"""Compare the Freelance models: ``python -m benchmarks.freelance [--smoke]
[--reactor uvloop|epoll]``.

Three echo servers (separate processes) and one client process per model,
sequential requests.  Healthy: all servers up.  Failover: the first server is
SIGKILLed before the timed run (model 1 then pays its 0.25 s attempt timeout on
every request; models 2 and 3 do not).  Prints a Markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from benchmarks.__main__ import percentile
from benchmarks.harness import REACTORS, ROOT, Processes, cpu_seconds, default_reactor, use_reactor

MESSAGES_PER_REQUEST = {1: "1 (per attempt)", 2: "3 (one per server)", 3: "1 (+1 PING/s per server)"}


def run(model: int, n: int, warmup: int, kill_first: bool) -> dict[str, Any]:
    with Processes() as procs:
        servers = [procs.start("fserver", "zmq:tcp://127.0.0.1:*") for _ in range(3)]
        endpoints = [server.ready() for server in servers]
        client = procs.start("fclient", str(model), str(n), str(warmup), *endpoints)
        client.ready(timeout=120)
        if kill_first:
            servers[0].proc.kill()
            servers[0].proc.wait(timeout=30)
        alive = servers[1:] if kill_first else servers
        cpu0 = sum(cpu_seconds(s.pid) for s in alive)
        client.go()
        res = client.result(timeout=600)
        cpu = sum(cpu_seconds(s.pid) for s in alive) - cpu0 + res["cpu"]
    elapsed = res["end"] - res["start"]
    lat = res["latencies"]
    return {"model": model, "first_server_killed": kill_first, "requests": n,
            "rate": n / elapsed, "p50_us": percentile(lat, 0.5) * 1e6,
            "p99_us": percentile(lat, 0.99) * 1e6, "cpu_s_per_1k": cpu / n * 1000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.freelance")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--reactor", choices=REACTORS, default=default_reactor(),
                        help="what the servers and clients run on, as in python -m benchmarks")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results",
                                                       "freelance-latest.json"))
    args = parser.parse_args(argv)
    use_reactor(args.reactor)
    n, n_failover, warm = (50, 8, 5) if args.smoke else (2000, 40, 100)
    rows = []
    for kill_first in (False, True):
        for model in (1, 2, 3):
            count = n_failover if (kill_first and model == 1) else n
            print(f"… model {model}{' after a kill' if kill_first else ''}", file=sys.stderr)
            rows.append(run(model, count, warm, kill_first))
    lines = ["| model | servers | req/s | p50 µs | p99 µs | CPU s / 1k req | messages / request |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        state = "first of 3 killed" if r["first_server_killed"] else "3 healthy"
        lines.append(f"| {r['model']} | {state} | {r['rate']:,.0f} | {r['p50_us']:,.0f} | "
                     f"{r['p99_us']:,.0f} | {r['cpu_s_per_1k']:.3f} | "
                     f"{MESSAGES_PER_REQUEST[r['model']]} |")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"smoke": args.smoke, "reactor": args.reactor, "runs": rows}, f, indent=2)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
