"""System calls and wake-ups per request, per role: ``python -m benchmarks.syscalls
[--transport zmq|tcp] [--mode pipelined|sync] [--n N] [--window W] [--workers K]
[--concurrency C] [--stack ours|nats]``.

Starts a case's processes as the suite does (benchmarks.roles), attaches
``perf stat`` to each (every thread) for the timed phase only, and prints, per
role, the system calls, the waits for readiness (``epoll_wait``/``epoll_pwait``/
``poll``: one per wake-up of a loop), the reads and the writes, the context
switches and the CPU (microseconds), each divided by the requests.  Needs ``perf`` and permission to read
tracepoints (root, or ``kernel.perf_event_paranoid`` ≤ -1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from benchmarks.__main__ import BINDS, CONCURRENCY_ENV, STACKS, environ
from benchmarks.harness import Processes, cpu_seconds, use_reactor

#: what perf counts: (column, tracepoints or events summed into it)
COLUMNS = (
    ("syscalls", ("raw_syscalls:sys_enter",)),
    ("waits", ("syscalls:sys_enter_epoll_wait", "syscalls:sys_enter_epoll_pwait",
               "syscalls:sys_enter_poll", "syscalls:sys_enter_ppoll")),
    ("reads", ("syscalls:sys_enter_read", "syscalls:sys_enter_recvfrom",
               "syscalls:sys_enter_recvmsg", "syscalls:sys_enter_readv")),
    ("writes", ("syscalls:sys_enter_write", "syscalls:sys_enter_sendto",
                "syscalls:sys_enter_sendmsg", "syscalls:sys_enter_writev")),
    ("switches", ("context-switches",)),
)
EVENTS = [event for _, events in COLUMNS for event in events]


def attach(pid: int, out: str) -> subprocess.Popen:
    """``perf stat`` on every thread of *pid* until SIGINT, as CSV into *out*."""
    return subprocess.Popen(["perf", "stat", "-x", ",", "-o", out, "-e", ",".join(EVENTS),
                             "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def counts(path: str) -> dict[str, float]:
    """The columns read from one perf CSV file."""
    seen: dict[str, float] = {}
    with open(path) as f:
        for line in f:
            fields = line.strip().split(",")
            if len(fields) > 2 and fields[0].replace(".", "").isdigit():
                seen[fields[2]] = seen.get(fields[2], 0) + float(fields[0])
    return {column: sum(seen.get(event, 0) for event in events) for column, events in COLUMNS}


def measure(stack: str, transport: str, mode: str, n: int, window: int, workers: int,
            concurrency: int) -> dict[str, dict[str, float]]:
    """Per role (broker, workers, client): each column per request."""
    broker_impl, worker_impl, client_impl, dialect = STACKS[stack]
    scratch = tempfile.mkdtemp(prefix="mdp-syscalls-")
    try:
        with Processes() as procs, environ(CONCURRENCY_ENV, str(concurrency)):
            if broker_impl == "nats":
                from benchmarks import peers

                server = peers.Server(broker_impl)
                procs.children.append(server)
                endpoint = server.endpoint
                roles = {"broker": [server.pid]}
            else:
                broker = procs.start("broker", broker_impl, BINDS[transport])
                endpoint = broker.ready()
                roles = {"broker": [broker.pid]}
            options = ["--dialect", dialect] if dialect else []
            started = [procs.start("worker", worker_impl, endpoint, *options)
                       for _ in range(workers)]
            for worker in started:
                worker.ready()
            client = procs.start("client", client_impl, endpoint, mode, str(n), str(n // 10),
                                 "16", str(window), *options)
            client.ready(timeout=120)
            roles.update(workers=[w.pid for w in started], client=[client.pid])
            perfs = [(role, attach(pid, os.path.join(scratch, f"{role}-{i}.csv")))
                     for role, pids in roles.items() for i, pid in enumerate(pids)]
            pids = {pid: role for role, group in roles.items() for pid in group}
            before = {pid: cpu_seconds(pid) for pid in pids}
            client.go()
            outcome = client.result(timeout=600)
            cpu = {role: 0.0 for role in roles}
            for pid, role in pids.items():
                cpu[role] += cpu_seconds(pid) - before[pid]
            for _, perf in perfs:
                perf.send_signal(signal.SIGINT)
            for _, perf in perfs:
                perf.wait(timeout=30)
        table: dict[str, dict[str, float]] = {}
        for role, pids in roles.items():
            total = {column: 0.0 for column, _ in COLUMNS}
            for i in range(len(pids)):
                for column, value in counts(os.path.join(scratch, f"{role}-{i}.csv")).items():
                    total[column] += value
            table[role] = {column: value / n for column, value in total.items()}
            table[role]["cpu_us"] = cpu[role] / n * 1e6
        table["all"] = {column: sum(row[column] for row in table.values())
                        for column in table["broker"]}
        table["all"]["rate"] = n / (outcome["end"] - outcome["start"])
        return table
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.syscalls",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="ours", choices=tuple(STACKS))
    parser.add_argument("--transport", default="zmq", choices=tuple(BINDS))
    parser.add_argument("--mode", default="pipelined", choices=("pipelined", "sync"))
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--reactor", default="uvloop", choices=("uvloop", "epoll"))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        raise SystemExit("python -m benchmarks.syscalls: needs perf (Debian: linux-perf)")
    use_reactor(args.reactor)
    window = args.window if args.mode == "pipelined" else 1
    table = measure(args.stack, args.transport, args.mode, args.n, window, args.workers,
                    args.concurrency)
    print(f"{args.stack} {args.transport} {args.mode} w{window} x{args.workers} "
          f"(concurrency {args.concurrency}), per request:")
    names = [column for column, _ in COLUMNS] + ["cpu_us"]
    print(f"{'role':<8}" + "".join(f"{name:>10}" for name in names))
    for role, row in table.items():
        print(f"{role:<8}" + "".join(f"{row[name]:>10.2f}" for name in names))
    print(f"rate {table['all']['rate']:,.0f} requests/s (perf attached)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "per_request": table}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
