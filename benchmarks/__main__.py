"""Run the benchmark suite: ``python -m benchmarks [--smoke] [--repeat R] [--only NAME...]
[--part K/N] [--reactor uvloop|epoll]``.

Every case starts its own processes (broker, workers, clients; all separate,
127.0.0.1, ports picked by the OS), warms up, then times the clients together;
goal 2's two clients share their broker and workers, alternated four times a
round (run_clients).  Cases run round-robin, ``--repeat`` rounds; the table
shows the median and the range.  Results are compared as ratios against
baselines measured in the same run (the median of the per-round ratios), and
written as JSON (``--json``, default ``benchmarks/results/latest.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any, Callable, Iterator, Optional

from benchmarks import peers, security
from benchmarks.harness import (
    REACTOR_ENV,
    REACTORS,
    ROOT,
    Processes,
    cpu_seconds,
    default_reactor,
    established_to,
    reactor_of,
    rss_bytes,
    thread_cpu_seconds,
    use_reactor,
    zmq_mmi,
)
from mdp import _compiled

BINDS = {"zmq": "zmq:tcp://127.0.0.1:*", "tcp": "tcp:host=127.0.0.1:port=0"}

# (broker, workers, clients, dialect of our peers).  In this order, the stacks
# a goal compares run next to each other in every round (cases())
STACKS = {
    # the reference stacks, what users would pick instead (benchmarks.peers):
    # their server where our broker is; run in the cases PEER_SHAPES names,
    # next to ours, where installed
    "rabbitmq": ("rabbitmq", "rabbitmq", "rabbitmq", None),
    "nats": ("nats", "nats", "nats", None),
    # our broker and Twisted peers, then the same peers on the bare forwarder
    # (goal 6) and the ceiling (goal 1)
    "bare+ours": ("bare", "ours", "ours", "rfc"),
    "ours": ("ours", "ours", "ours", "rfc"),
    # the ceiling for any Python MDP stack: bare forwarder and blocking pyzmq peers
    "bare": ("bare", "bare", "bare", None),
    # our whole stack without Twisted peers: the broker, mdp.blocking workers and clients
    "ours-blocking": ("ours", "blocking", "blocking", None),
    # our broker and workers with our blocking client (mdp.blocking), and with
    # the blocking pyzmq loop client it is measured against (goal 2)
    "ours+blocking-client": ("ours", "ours", "blocking", None),
    "ours+bare-client": ("ours", "ours", "bare", None),
    "majortomo": ("majortomo", "majortomo", "majortomo", None),
    "ours-broker+majortomo-peers": ("ours", "majortomo", "majortomo", None),
    "majortomo-broker+our-peers": ("majortomo", "ours", "ours", "majortomo"),
    "ours-broker+bare-peers": ("ours", "bare", "bare", None),
}

#: the reference stacks (benchmarks.peers), and the cases they run: a
#: ratio "ours / nats" and "ours / rabbitmq" each (references)
PEER_STACKS = ("nats", "rabbitmq")
PEER_SHAPES = ("sync 1x1", "sync 4x4", "pipelined w100 x4")

#: the same stacks run from the plain source (``MDP_PURE_PYTHON=1``), where the
#: install compiled the hot modules (mdp/_compiled.py): what compiling buys
SOURCE_STACKS = {f"{stack} (source)": stack for stack in ("ours", "ours-blocking")}

#: our Twisted stack with workers of several sessions each, and with a handler
#: that waits (an async 10 ms): (the stack, sessions per worker, handler ms)
CONCURRENT_STACKS = {
    "ours (concurrency 4)": ("ours", 4, 0),
    "ours (10 ms handler)": ("ours", 1, 10),
    "ours (10 ms handler, concurrency 32)": ("ours", 32, 10),
}
#: what benchmarks.roles' workers read them from
CONCURRENCY_ENV, HANDLER_MS_ENV = "MDP_BENCH_CONCURRENCY", "MDP_BENCH_HANDLER_MS"

#: our Twisted stack on Twisted's default reactor, whatever the run's (--reactor):
#: what the reactor buys (benchmarks/NOTES.md, round two, item 25)
EPOLL_STACKS = {"ours (epoll reactor)": "ours"}

#: the code the second round's goals were set against: its run (benchmarks/NOTES.md,
#: 2026-11-22) gave the goals' "today" figures (0.68 of the ceiling, 1.9% of a core
#: for 1,000 idle workers, 40 streams of 1,000 PARTIALs a second).  The suite runs
#: its stream case (goal 4) and its broker under the idle workers (goal 6) in the
#: same run, from this revision's tree (earlier_tree).
BEFORE_ROUND_TWO = "d2ef5ce1077dab2a3f4f581dae79c29fbf3eae71"
#: the stack that runs it (the stream case; heartbeat_cost runs its broker alone)
BEFORE_STACK = "ours before round two"
#: that run's stream rate: goal 4's baseline only where the earlier tree cannot be
#: had (no git, or a clone without the history), from another run and machine
STREAM_BASELINE_PARTIALS_PER_S = 40_000


@contextlib.contextmanager
def earlier_tree(revision: str = BEFORE_ROUND_TWO) -> Iterator[tuple[Optional[str], str]]:
    """``(directory, note)``: *revision*'s ``mdp`` and ``benchmarks`` taken from
    this checkout's history into a temporary directory (removed on the way
    out), whose roles run that code as it was (plain source, its own reactor
    choice); ``(None, why)`` if git, the history or the revision is not there."""
    with tempfile.TemporaryDirectory(prefix="mdp-bench-earlier-") as directory:
        why = ""
        try:
            archive = subprocess.run(
                ["git", "-C", ROOT, "archive", "--format=tar", revision, "mdp", "benchmarks"],
                capture_output=True, timeout=60, check=False, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            why = f"git archive failed: {e}"
        else:
            if archive.returncode != 0:
                why = (f"git archive {revision[:12]}: "
                       f"{archive.stderr.decode(errors='replace').strip()}")
        if why:
            yield None, why
            return
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(directory, filter="data")
            else:  # a Python before extraction filters; the archive is this checkout's own
                tar.extractall(directory)
        yield directory, f"{revision[:12]} from this checkout's history"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def run_case(stack: str, transport: str, mode: str, clients: int, workers: int, n: int,
             warmup: int, size: int, window: int = 1, root: str = ROOT) -> dict[str, Any]:
    """One repetition of one case; returns throughput, latency and CPU.  The
    processes run *root*'s roles and ``mdp``: this checkout's, or an earlier
    revision's (earlier_tree)."""
    concurrent = CONCURRENT_STACKS.get(stack)
    base = (SOURCE_STACKS.get(stack) or EPOLL_STACKS.get(stack)
            or (concurrent[0] if concurrent else stack))
    curve = security.directory() if transport == "curve" else None
    pure = "1" if stack in SOURCE_STACKS else None
    reactor = "epoll" if stack in EPOLL_STACKS else None
    sessions, handlerMs = (str(concurrent[1]), str(concurrent[2])) if concurrent else (None, None)
    with Processes(root) as procs, environ("MDP_BENCH_CURVE", curve), \
            environ(_compiled.PURE_ENV, pure), environ(REACTOR_ENV, reactor), \
            environ(CONCURRENCY_ENV, sessions), environ(HANDLER_MS_ENV, handlerMs):
        servers, endpoint = _start_servers(procs, base, transport, mode, workers)
        return _timed_clients(procs, servers, endpoint, base, mode, clients, n, warmup, size,
                              window)


def run_clients(stacks: tuple[str, ...], mode: str, clients: int, workers: int, n: int,
                warmup: int, size: int, pairs: int, backwards: bool) -> dict[str, list[dict[str, Any]]]:
    """The clients of *stacks* (which share their broker and workers) against
    one broker and its workers, over ZeroMQ: *pairs* times each, alternating
    (A B, B A, ...; B A first if *backwards*); each stack's rows, in order,
    each with its ``pair``.  A ratio of clients then pairs runs made seconds
    apart against the very same servers, and a drift of the machine over the
    pairs cancels out (ratio), so neither a restart of the servers nor a
    slow spell longer than a run weighs on one side (benchmarks/NOTES.md, item 33)."""
    servers_of = {STACKS[stack][:2] + STACKS[stack][3:] for stack in stacks}
    if len(servers_of) != 1:
        raise ValueError(f"{stacks} do not share their broker and workers")
    rows: dict[str, list[dict[str, Any]]] = {stack: [] for stack in stacks}
    with Processes() as procs:
        servers, endpoint = _start_servers(procs, stacks[0], "zmq", mode, workers)
        for pair in range(pairs):
            order = stacks if (pair % 2 == 1) == backwards else stacks[::-1]
            for stack in order:
                row = _timed_clients(procs, servers, endpoint, stack, mode, clients, n, warmup,
                                     size)
                rows[stack].append({**row, "pair": pair})
    return rows


def _start_servers(procs: Processes, stack: str, transport: str, mode: str,
                   workers: int) -> tuple[list[Any], str]:
    """*stack*'s broker and *workers* workers, ready: [broker, workers...] and
    the endpoint clients connect to."""
    broker_impl, worker_impl, _, dialect = STACKS[stack]
    if broker_impl in PEER_STACKS:  # nats-server or RabbitMQ, stopped with procs
        server = peers.Server(broker_impl)
        procs.children.append(server)
        servers = [server] + [procs.start("worker", worker_impl, server.endpoint)
                              for _ in range(workers)]
        for worker in servers[1:]:
            worker.ready()
        return servers, server.endpoint
    if transport == "tls":
        bind = security.tls_bind()
    else:
        bind = BINDS["zmq" if transport == "curve" else transport]
    broker = procs.start("broker", broker_impl, bind)
    endpoint = broker.ready()
    if transport == "tls":
        endpoint = security.tls_peer(endpoint)
    options = ["--dialect", dialect] if dialect else []
    service = ["--service", "stream"] if mode == "stream" else []
    servers = [broker] + [procs.start("worker", worker_impl, endpoint, *options, *service)
                          for _ in range(workers)]
    for worker in servers[1:]:
        worker.ready()
    return servers, endpoint


def _timed_clients(procs: Processes, servers: list[Any], endpoint: str, stack: str, mode: str,
                   clients: int, n: int, warmup: int, size: int,
                   window: int = 1) -> dict[str, Any]:
    """*clients* clients of *stack* sending *n* requests in all to the running
    *servers*, timed together: the case's row, with the servers' CPU meanwhile."""
    _, _, client_impl, dialect = STACKS[stack]
    options = ["--dialect", dialect] if dialect else []
    per_client = n // clients
    drivers = [
        procs.start("client", client_impl, endpoint, mode, str(per_client), str(warmup),
                    str(size), str(window), *options)
        for _ in range(clients)
    ]
    for driver in drivers:
        driver.ready(timeout=120)
    # what the broker and workers run on, read from outside (the clients say)
    server_reactors = sorted({reactor_of(p.pid) for p in servers})
    cpu_before = [cpu_seconds(p.pid) for p in servers]
    for driver in drivers:
        driver.go()
    results = [driver.result(timeout=300) for driver in drivers]
    used = [cpu_seconds(p.pid) - before for p, before in zip(servers, cpu_before)]
    for driver in drivers:
        driver.kill()
    count = per_client * clients
    row = summarise(results, sum(used), count)
    # where the CPU went, per role
    row["cpu_broker_s_per_1k"] = used[0] / count * 1000
    row["cpu_workers_s_per_1k"] = sum(used[1:]) / count * 1000
    row["cpu_clients_s_per_1k"] = sum(r["cpu"] for r in results) / count * 1000
    # what the clients' Twisted code ran on (none: they ran no Twisted)
    row["client_reactors"] = sorted({r["reactor"] for r in results if r.get("reactor")})
    row["server_reactors"] = server_reactors
    if all("replies" in r for r in results):  # counted and checked by the clients
        row["replies"] = sum(r["replies"] for r in results)
        if row["replies"] != count:
            raise RuntimeError(f"{stack}: {row['replies']} replies to {count} requests")
    return row


@contextlib.contextmanager
def environ(name: str, value: Optional[str]) -> Iterator[None]:
    """The processes started meanwhile find *name* set to *value* in their
    environment (nothing changes if *value* is None): the run's CURVE keys
    (``MDP_BENCH_CURVE``, benchmarks.roles), or the plain sources
    (``MDP_PURE_PYTHON``, mdp/_compiled.py)."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def run_inproc(mode: str, clients: int, workers: int, n: int, warmup: int, size: int,
               window: int = 1) -> dict[str, Any]:
    with Processes() as procs:
        proc = procs.start("inproc", mode, str(n // clients), str(warmup), str(size),
                           str(clients), str(workers), str(window))
        proc.ready(timeout=120)
        proc.go()
        res = proc.result(timeout=300)
    return summarise([res], 0.0, (n // clients) * clients)


def summarise(results: list[dict[str, Any]], cpu_servers: float, count: int) -> dict[str, Any]:
    latencies = [x for r in results for x in r["latencies"]]
    elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
    cpu = cpu_servers + sum(r["cpu"] for r in results)
    return {
        "requests": count,
        "elapsed": elapsed,
        "rate": count / elapsed if elapsed > 0 else float("nan"),
        "p50_us": percentile(latencies, 0.50) * 1e6,
        "p99_us": percentile(latencies, 0.99) * 1e6,
        "cpu_s_per_1k": cpu / count * 1000 if count else float("nan"),
    }


def heartbeat_cost(idle: int, services: int, seconds: float,
                   earlier: Optional[str] = None) -> dict[str, Any]:
    """Broker CPU (fraction of one core) while *idle* workers only heartbeat:
    ours, then the bare forwarder with the same farm (the floor: it answers
    each HEARTBEAT and does nothing else), each split into the broker's own
    thread and libzmq's I/O thread; and, given the *earlier* tree
    (earlier_tree), the broker of the code before this round with the same
    farm (what the goal's "today" figure measured, on this machine; one
    window each, in that order, as for ours and the bare forwarder)."""
    ours = _idle_broker("ours", idle, services, seconds)
    bare = _idle_broker("bare", idle, services, seconds)
    result = {"idle_workers": idle, "seconds": seconds,
              "core_fraction": ours["busy"], "core_fraction_without_workers": ours["baseline"],
              "threads": ours["threads"], "reactor": ours["reactor"], "bare": bare}
    if earlier is not None:
        result["before_round_two"] = _idle_broker("ours", idle, services, seconds, root=earlier)
    return result


def _idle_broker(kind: str, idle: int, services: int, seconds: float,
                 root: str = ROOT) -> dict[str, Any]:
    """*kind*'s broker, from *root*'s tree, under a farm of *idle* of this
    tree's workers."""
    with Processes(root) as brokers, Processes() as procs:
        broker = brokers.start("broker", kind, BINDS["zmq"])
        endpoint = broker.ready()
        time.sleep(1.0)
        base0, t0 = cpu_seconds(broker.pid), time.monotonic()
        time.sleep(seconds)
        baseline = (cpu_seconds(broker.pid) - base0) / (time.monotonic() - t0)
        farm = procs.start("farm", endpoint, str(idle), str(services))
        farm.ready(timeout=120)
        deadline = time.monotonic() + 60
        port = int(endpoint.rsplit(":", 1)[1])
        while (zmq_mmi(endpoint, b"mmi.workers").count(b'"id"') < idle if kind == "ours"
               else established_to(port) < idle):  # the bare forwarder has no MMI
            if time.monotonic() > deadline:
                raise RuntimeError(f"idle workers did not all register with {kind}")
            time.sleep(0.2)
        if kind != "ours":
            time.sleep(2.0)  # connected: READY follows at once
        c0, threads0, t0 = cpu_seconds(broker.pid), thread_cpu_seconds(broker.pid), time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        busy = (cpu_seconds(broker.pid) - c0) / elapsed
        threads1 = thread_cpu_seconds(broker.pid)
        reactor = reactor_of(broker.pid)
    return {"busy": busy, "baseline": baseline, "reactor": reactor,
            "threads": {k: (threads1[k] - threads0[k]) / elapsed for k in threads1}}


def drain(n: int, workers: int) -> dict[str, Any]:
    """Queue *n* requests with no worker, then drain them with *workers*."""
    with Processes() as procs:
        broker = procs.start("broker", "ours", BINDS["zmq"])
        endpoint = broker.ready()
        time.sleep(0.5)
        rss0 = rss_bytes(broker.pid)
        filler = procs.start("filler", endpoint, str(n))
        filler.ready(timeout=120)
        deadline = time.monotonic() + 120
        while json.loads(zmq_mmi(endpoint, b"mmi.services")).get("echo", {}).get("queued", 0) < n:
            if time.monotonic() > deadline:
                raise RuntimeError("requests were not all queued")
            time.sleep(0.1)
        rss_full = rss_bytes(broker.pid)
        drainers = [procs.start("worker", "ours", endpoint) for _ in range(workers)]
        for worker in drainers:
            worker.ready()
        filler.go()
        res = filler.result(timeout=300)
    elapsed = res["end"] - res["start"]
    return {"queued": n, "rss_before_mb": rss0 / 2**20, "rss_full_mb": rss_full / 2**20,
            "rss_growth_mb": (rss_full - rss0) / 2**20, "drain_seconds": elapsed,
            "drain_rate": n / elapsed if elapsed > 0 else float("nan")}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and range of one case's repetitions."""
    rates = [r["rate"] for r in runs]
    return {
        "runs": runs,
        "rate": statistics.median(rates),
        "rate_min": min(rates),
        "rate_max": max(rates),
        "p50_us": statistics.median(r["p50_us"] for r in runs),
        "p99_us": statistics.median(r["p99_us"] for r in runs),
        "cpu_s_per_1k": statistics.median(r["cpu_s_per_1k"] for r in runs),
        **{key: statistics.median(r[key] for r in runs)
           for key in ("cpu_broker_s_per_1k", "cpu_workers_s_per_1k", "cpu_clients_s_per_1k")
           if key in runs[0]},
    }


#: one entry of the suite: the names of its cases, their descriptions, and
#: what runs a round of them (told whether the round runs backwards) and
#: returns each case's rows
Entry = tuple[tuple[str, ...], dict[str, dict[str, Any]],
              Callable[[bool], dict[str, list[dict[str, Any]]]]]

#: the clients goal 2 compares (the same broker and workers)
CLIENT_PAIR = ("ours+blocking-client", "ours+bare-client")
#: how many times each round runs them, alternating (A B, B A, A B, B A: two
#: blocks whose drift cancels out), against the same servers
CLIENT_PAIRS = 4


def cases(smoke: bool, earlier: Optional[str] = None,
          revision: str = BEFORE_ROUND_TWO, references: tuple[str, ...] = ()) -> list[Entry]:
    """An entry per case, baselines included, or per group of cases run
    together (goal 2's clients); with *earlier* (*revision*'s tree, from
    earlier_tree), the stream case of that code too; with *references*
    (of PEER_STACKS), those stacks' cases (PEER_SHAPES)."""
    n_sync = 200 if smoke else 16000
    n_pipe = 400 if smoke else 10000
    warm = 20 if smoke else 300
    big = 65536
    out: list[Entry] = []

    def add(name: str, **kw: Any) -> None:
        stack = kw.get("stack", "ours")
        transport = kw.get("transport", "zmq")
        # a streamed request is 1,001 messages: warm up with a few
        warmup = min(warm, 5) if kw["mode"] == "stream" else warm
        if transport == "loopback":
            def thunk(backwards: bool, kw: dict[str, Any] = kw) -> dict[str, list[dict[str, Any]]]:
                return {name: [run_inproc(kw["mode"], kw["clients"], kw["workers"], kw["n"],
                                          warmup, kw.get("size", 16), kw.get("window", 1))]}
        else:
            def thunk(backwards: bool, kw: dict[str, Any] = kw, stack: str = stack,
                      transport: str = transport) -> dict[str, list[dict[str, Any]]]:
                return {name: [run_case(stack, transport, kw["mode"], kw["clients"],
                                        kw["workers"], kw["n"], warmup, kw.get("size", 16),
                                        kw.get("window", 1), root=kw.get("root", ROOT))]}
        described = {k: v for k, v in kw.items() if k != "root"}
        if stack in PEER_STACKS:  # whose CPU the broker's column counts
            described["server"] = peers.SERVER_NAMES[stack]
        out.append(((name,), {name: {"stack": stack, "transport": transport, **described}},
                    thunk))

    def add_clients(shape: str, clients: int, workers: int, n: int) -> None:
        names = {stack: f"sync {shape} / {stack}" for stack in CLIENT_PAIR}
        pairs = 1 if smoke else CLIENT_PAIRS

        def thunk(backwards: bool) -> dict[str, list[dict[str, Any]]]:
            rows = run_clients(CLIENT_PAIR, "sync", clients, workers, n, warm, 16, pairs,
                               backwards)
            return {names[stack]: rows[stack] for stack in CLIENT_PAIR}

        out.append((tuple(names.values()),
                    {name: {"stack": stack, "transport": "zmq", "mode": "sync",
                            "clients": clients, "workers": workers, "n": n,
                            "servers": "shared", "pairs_per_round": pairs}
                     for stack, name in names.items()}, thunk))

    # the cases a goal compares run one after the other (STACKS' order), and
    # main() runs every other round backwards: a drift of the machine within a
    # round favours neither side of a ratio
    for shape, clients, n in (("1x1", 1, n_sync // 2), ("4x4", 4, n_sync)):
        stacks = (*STACKS, *SOURCE_STACKS, *EPOLL_STACKS) if clients > 1 else tuple(STACKS)
        for stack in stacks:
            if stack == CLIENT_PAIR[0]:
                add_clients(shape, clients, clients, n)
            elif stack in PEER_STACKS and stack not in references:
                continue
            elif stack not in CLIENT_PAIR:
                add(f"sync {shape} / {stack}", stack=stack, mode="sync", clients=clients,
                    workers=clients, n=n)
    for stack in (*(s for s in STACKS if s in PEER_STACKS and s in references), "bare+ours",
                  "ours", "ours (concurrency 4)", "ours over tcp", "ours (concurrency 4) over tcp",
                  "majortomo-broker+our-peers",
                  "ours+blocking-client", "ours+blocking-client over tcp"):
        if stack == "ours over tcp":  # goal 5: against the row before it
            add(f"pipelined w100 x4 / {stack}", transport="tcp", mode="pipelined", clients=1,
                workers=4, n=n_pipe, window=100)
            # what compiling buys the stream transport's modules
            add(f"pipelined w100 x4 / {stack} (source)", stack="ours (source)", transport="tcp",
                mode="pipelined", clients=1, workers=4, n=n_pipe, window=100)
        elif stack.endswith(" over tcp"):  # channels on one connection (NOTES.md, item 34)
            add(f"pipelined w100 x4 / {stack}", stack=stack.removesuffix(" over tcp"),
                transport="tcp", mode="pipelined", clients=1, workers=4, n=n_pipe, window=100)
        else:
            add(f"pipelined w100 x4 / {stack}", stack=stack, mode="pipelined", clients=1,
                workers=4, n=n_pipe, window=100)
    # a handler that waits 10 ms: one worker, one session, then 32
    for stack, count in (("ours (10 ms handler)", 2 if smoke else 300),
                         ("ours (10 ms handler, concurrency 32)", 20 if smoke else 3000)):
        add(f"pipelined w100 x1 / {stack}", stack=stack, mode="pipelined", clients=1,
            workers=1, n=count, window=100)
    for stack in ("ours", "majortomo", "ours-blocking", "bare+ours"):
        add(f"sync 4x4 64KiB / {stack}", stack=stack, mode="sync", clients=4, workers=4,
            n=n_sync // 4, size=big)
    add("stream 1000 partials / ours", stack="ours", mode="stream", clients=1, workers=1,
        n=2 if smoke else 20)
    if earlier is not None:  # goal 4's baseline: the same case, the code before this round
        add(f"stream 1000 partials / {BEFORE_STACK}", stack="ours", mode="stream", clients=1,
            workers=1, n=2 if smoke else 20, root=earlier, revision=revision)
    add("stream 1000 partials / ours-blocking", stack="ours-blocking", mode="stream",
        clients=1, workers=1, n=2 if smoke else 20)
    for transport in ("tcp", "loopback"):
        add(f"sync 1x1 / ours over {transport}", transport=transport, mode="sync", clients=1,
            workers=1, n=n_sync // 2)
        add(f"sync 4x4 / ours over {transport}", transport=transport, mode="sync", clients=4,
            workers=4, n=n_sync)
        if transport != "tcp":  # (tcp's: next to zmq's, above)
            add(f"pipelined w100 x4 / ours over {transport}", transport=transport,
                mode="pipelined", clients=1, workers=4, n=n_pipe, window=100)
    # encrypted and authenticated links, each right after its plain transport's row
    add("sync 4x4 / ours over curve", transport="curve", mode="sync", clients=4, workers=4,
        n=n_sync)
    add("sync 4x4 / ours over tls", transport="tls", mode="sync", clients=4, workers=4, n=n_sync)
    return out


def ratio(table: dict[str, Any], a: str, b: str, key: str = "rate") -> Optional[float]:
    """*a* / *b*: the median of the ratios of the repetitions run in the same
    round (cases run interleaved, so a slow spell of the machine hits both
    sides of a ratio alike), or of the medians if the rounds do not pair up.
    Runs made in pairs against the same servers (run_clients: their rows
    number their ``pair`` within the round) give a round's ratio as the
    geometric mean of its pairs' ratios: alternated (A B, B A, ...), a drift
    of the machine within the round cancels out."""
    if a not in table or b not in table:
        return None
    runs_a, runs_b = table[a]["runs"], table[b]["runs"]
    pairs = [x[key] / y[key] for x, y in zip(runs_a, runs_b) if y[key]]
    if len(runs_a) != len(runs_b) or len(pairs) != len(runs_a):
        return table[a][key] / table[b][key] if table[b][key] else None
    if "pair" not in runs_a[0]:
        return statistics.median(pairs)
    rounds: list[list[float]] = []
    for run, value in zip(runs_a, pairs):
        if run["pair"] == 0:
            rounds.append([])
        rounds[-1].append(value)
    return statistics.median(statistics.geometric_mean(values) for values in rounds)


def targets(table: dict[str, Any], scale: dict[str, Any]) -> list[dict[str, Any]]:
    """Every goal of the suite, numbered as in docs/performance.md, with its
    same-run value (None if its cases did not run) and whether it is met."""
    checks = []

    def check(name: str, value: Optional[float], goal: float, higher: bool = True) -> None:
        ok = value is not None and (value >= goal if higher else value <= goal)
        checks.append({"target": name, "value": value, "goal": goal,
                       "comparison": ">=" if higher else "<=", "met": ok})

    check("1. 4x4 sync zmq: our full stack, blocking peers / bare stack",
          ratio(table, "sync 4x4 / ours-blocking", "sync 4x4 / bare"), 0.9)
    check("1. 4x4 sync zmq: our full stack, Twisted peers / bare stack",
          ratio(table, "sync 4x4 / ours", "sync 4x4 / bare"), 0.9)
    for shape in ("1x1", "4x4"):
        check(f"2. {shape} sync: blocking client / pyzmq loop client (our broker and workers)",
              ratio(table, f"sync {shape} / ours+blocking-client", f"sync {shape} / ours+bare-client"),
              0.95)
    check("3. 4x4 sync 64KiB: ours (Twisted peers) / majortomo",
          ratio(table, "sync 4x4 64KiB / ours", "sync 4x4 64KiB / majortomo"), 1.0)
    check("3. 4x4 sync 64KiB: ours (blocking peers) / majortomo",
          ratio(table, "sync 4x4 64KiB / ours-blocking", "sync 4x4 64KiB / majortomo"), 1.0)
    stream = table.get("stream 1000 partials / ours")
    if f"stream 1000 partials / {BEFORE_STACK}" in table:
        check("4. stream: PARTIALs per second / the code before this round (same run)",
              ratio(table, "stream 1000 partials / ours", f"stream 1000 partials / {BEFORE_STACK}"),
              1.5)
    else:
        check("4. stream: PARTIALs per second / 40,000 (before this round; another run)",
              None if stream is None else stream["rate"] * 1000 / STREAM_BASELINE_PARTIALS_PER_S,
              1.5)
    echo = table.get("sync 1x1 / ours")
    check("4. stream: CPU per PARTIAL / CPU per plain echo request (sync 1x1 / ours)",
          None if stream is None or echo is None
          else stream["cpu_s_per_1k"] / 1001 / echo["cpu_s_per_1k"], 1.5, higher=False)
    check("5. pipelined w100 x4: over tcp / over zmq",
          ratio(table, "pipelined w100 x4 / ours over tcp", "pipelined w100 x4 / ours"), 1.3)
    check("6. 1x1 sync: our broker / bare forwarder (same peers)",
          ratio(table, "sync 1x1 / ours", "sync 1x1 / bare+ours"), 0.95)
    check("6. 4x4 sync: our broker / bare forwarder (same peers)",
          ratio(table, "sync 4x4 / ours", "sync 4x4 / bare+ours"), 0.95)
    check("6. pipelined: our broker / bare forwarder (same peers)",
          ratio(table, "pipelined w100 x4 / ours", "pipelined w100 x4 / bare+ours"), 0.95)
    if "heartbeat" in scale:
        check("6. 1000 idle workers: broker CPU (fraction of a core)",
              scale["heartbeat"]["core_fraction"], 0.02, higher=False)
    if "spark" in scale:
        check("7. Spark standalone, 2 executors: call_service / plain pipelined client",
              scale["spark"]["ratio"], 1.0)
    check("1x1 p50 latency: ours / bare forwarder",
          ratio(table, "sync 1x1 / ours", "sync 1x1 / bare+ours", "p50_us"), 1.2, higher=False)
    if "drain" in scale:
        check("10,000 queued: broker RSS growth (MB)", scale["drain"]["rss_growth_mb"], 50, higher=False)
    check("4x4 sync zmq: ours / majortomo (first round's goal; see 'Why not 2.5x')",
          ratio(table, "sync 4x4 / ours", "sync 4x4 / majortomo"), 2.5)
    return checks


def references(table: dict[str, Any], scale: Optional[dict[str, Any]] = None
               ) -> list[dict[str, Any]]:
    """Same-run ratios that bound what the targets can reach: the bare stack
    (bare forwarder and blocking pyzmq peers, no Twisted, no checks) is the
    fastest any Python MDP stack over ZeroMQ can be on this machine; the
    bare forwarder's CPU under the same idle workers is the floor of goal 6's
    absolute one."""
    rows = [
        ("4x4 sync zmq: ceiling (bare stack) / majortomo", "sync 4x4 / bare", "sync 4x4 / majortomo"),
        ("4x4 sync zmq: ours / ceiling (bare stack)", "sync 4x4 / ours", "sync 4x4 / bare"),
        ("4x4 sync zmq: our broker / bare forwarder (blocking pyzmq peers)",
         "sync 4x4 / ours-broker+bare-peers", "sync 4x4 / bare"),
        ("4x4 sync zmq: our peers / blocking pyzmq peers (our broker)",
         "sync 4x4 / ours", "sync 4x4 / ours-broker+bare-peers"),
        ("4x4 sync zmq: our stack compiled / from source (Twisted peers)", "sync 4x4 / ours",
         "sync 4x4 / ours (source)"),
        ("4x4 sync zmq: our stack compiled / from source (blocking peers)",
         "sync 4x4 / ours-blocking", "sync 4x4 / ours-blocking (source)"),
        ("4x4 sync zmq: our stack on the run's reactor / on epoll (Twisted peers)",
         "sync 4x4 / ours", "sync 4x4 / ours (epoll reactor)"),
        ("pipelined w100 x4 over tcp: our stack compiled / from source",
         "pipelined w100 x4 / ours over tcp", "pipelined w100 x4 / ours over tcp (source)"),
        ("pipelined w100 x4: blocking client over tcp / over zmq",
         "pipelined w100 x4 / ours+blocking-client over tcp",
         "pipelined w100 x4 / ours+blocking-client"),
        ("pipelined w100 x4 over tcp: blocking client / Twisted client",
         "pipelined w100 x4 / ours+blocking-client over tcp", "pipelined w100 x4 / ours over tcp"),
        ("4x4 sync: CURVE (allow-list) / plain zmq", "sync 4x4 / ours over curve",
         "sync 4x4 / ours"),
        ("4x4 sync: mutual TLS (ssl:) / plain tcp", "sync 4x4 / ours over tls",
         "sync 4x4 / ours over tcp"),
    ]
    out = [{"reference": name, "value": ratio(table, a, b)} for name, a, b in rows
           if ratio(table, a, b) is not None]
    # what users would pick instead (benchmarks.peers): rate, then CPU per request
    for shape in PEER_SHAPES:
        for peer in PEER_STACKS:
            for stack in ("ours", "ours over tcp", "ours (concurrency 4)",
                          "ours (concurrency 4) over tcp"):
                ours, theirs = f"{shape} / {stack}", f"{shape} / {peer}"
                for what, key in (("", "rate"), ("CPU per request, ", "cpu_s_per_1k")):
                    value = ratio(table, ours, theirs, key)
                    if value is not None:
                        out.append({"reference": f"{shape}: {what}{stack} / {peer}",
                                    "value": value})
    value = ratio(table, "pipelined w100 x1 / ours (10 ms handler, concurrency 32)",
                  "pipelined w100 x1 / ours (10 ms handler)")
    if value is not None:
        out.append({"reference": "10 ms async handler, 1 worker: concurrency 32 / 1 (rate)",
                    "value": value})
    heartbeat = (scale or {}).get("heartbeat")
    if heartbeat and heartbeat.get("bare", {}).get("busy"):
        out.append({"reference": f"{heartbeat['idle_workers']} idle workers: our broker's CPU / "
                                 "the bare forwarder's (same workers)",
                    "value": heartbeat["core_fraction"] / heartbeat["bare"]["busy"]})
    if heartbeat and (heartbeat.get("before_round_two") or {}).get("busy"):
        out.append({"reference": f"{heartbeat['idle_workers']} idle workers: our broker's CPU / "
                                 f"{BEFORE_STACK}'s (same workers)",
                    "value": heartbeat["core_fraction"] / heartbeat["before_round_two"]["busy"]})
    return out


def markdown(table: dict[str, Any], scale: dict[str, Any], checks: list[dict[str, Any]],
             refs: Optional[list[dict[str, Any]]] = None) -> str:
    lines = ["| case | req/s (median) | range | p50 µs | p99 µs | CPU s / 1k req "
             "| broker / workers / clients |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, row in table.items():
        split = "–"
        if "cpu_broker_s_per_1k" in row:
            split = (f"{row['cpu_broker_s_per_1k']:.3f} / {row['cpu_workers_s_per_1k']:.3f} / "
                     f"{row['cpu_clients_s_per_1k']:.3f}")
        lines.append(f"| {name} | {row['rate']:,.0f} | {row['rate_min']:,.0f}–{row['rate_max']:,.0f} "
                     f"| {row['p50_us']:,.0f} | {row['p99_us']:,.0f} | {row['cpu_s_per_1k']:.3f} "
                     f"| {split} |")
    if "heartbeat" in scale:
        hb = scale["heartbeat"]

        def by_thread(threads: dict[str, float]) -> str:
            return (f"its own thread {threads['main'] * 100:.2f}%, "
                    f"libzmq's {threads['zmq'] * 100:.2f}%")

        lines.append(f"\nHeartbeat cost: {hb['idle_workers']} idle workers keep the broker at "
                     f"{hb['core_fraction'] * 100:.2f}% of one core "
                     f"({hb['core_fraction_without_workers'] * 100:.2f}% with none; "
                     f"{by_thread(hb['threads'])}). The bare forwarder, answering each "
                     f"HEARTBEAT and nothing more, with the same workers: "
                     f"{hb['bare']['busy'] * 100:.2f}% ({by_thread(hb['bare']['threads'])}).")
        if "before_round_two" in hb:
            before = hb["before_round_two"]
            lines.append(f"The broker of the code before this round ({BEFORE_ROUND_TWO[:7]}), "
                         f"same workers: {before['busy'] * 100:.2f}% "
                         f"({by_thread(before['threads'])}).")
    if "spark" in scale:
        sp = scale["spark"]
        lines.append(f"\nSpark: {sp['rows']:,} rows through call_service on a standalone cluster "
                     f"of 2 one-core executors at {sp['ratio']:.2f}x a plain pipelined client "
                     "(median of the rounds' ratios; benchmarks/spark.py).")
    if "drain" in scale:
        dr = scale["drain"]
        lines.append(f"\nQueue: {dr['queued']:,} requests queued grew the broker's RSS by "
                     f"{dr['rss_growth_mb']:.1f} MB; 4 workers drained them at "
                     f"{dr['drain_rate']:,.0f} req/s.")
    reference_rows = [name for name in table if name.rsplit(" / ", 1)[-1] in PEER_STACKS]
    if reference_rows:
        lines.append("\nThe `/ nats` and `/ rabbitmq` rows are what users would pick instead "
                     "(benchmarks/peers.py): their broker column is the server's CPU "
                     f"({', '.join(peers.SERVER_NAMES.values())}), their clients Python.")
    lines.append("\n| target | value | goal | met |\n|---|---:|---:|---|")
    for c in checks:
        value = "n/a" if c["value"] is None else f"{c['value']:.3f}"
        lines.append(f"| {c['target']} | {value} | {c['comparison']} {c['goal']} | "
                     f"{'yes' if c['met'] else 'NO'} |")
    if refs:
        lines.append("\n| reference (same run) | ratio |\n|---|---:|")
        lines.extend(f"| {r['reference']} | {r['value']:.3f} |" for r in refs)
    return "\n".join(lines)


def reference_stacks(smoke: bool) -> tuple[tuple[str, ...], dict[str, str]]:
    """The reference stacks (PEER_STACKS) this run runs, and a line on each:
    what runs, or why not (not installed; left out of a smoke run, which stays
    short where RabbitMQ takes 5-30 s to start)."""
    run: list[str] = []
    notes: dict[str, str] = {}
    for kind in PEER_STACKS:
        why = peers.missing(kind)
        if smoke:
            notes[kind] = (f"reference rows ({', '.join(PEER_STACKS)}): left out of a smoke run, "
                           "which stays short (RabbitMQ takes 5-30 s to start); a run without "
                           f"--smoke has them (--only {' '.join(PEER_STACKS)}: those alone)")
        elif why:
            notes[kind] = f"reference rows / {kind}: skipped, {why}"
        else:
            run.append(kind)
            notes[kind] = f"reference rows / {kind}: {peers.versions(kind)}"
    return tuple(run), notes


def part_of(text: str) -> tuple[int, int]:
    """``K/N`` of ``--part``: the K-th of N parts (N at least 2)."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K/N (such as 1/4)") from None
    if n < 2 or not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"{text!r}: K/N needs 1 <= K <= N and N >= 2")
    return k, n


def in_part(selected: list[Entry], part: Optional[tuple[int, int]]) -> list[Entry]:
    """The cases of *part* (all without one): dealt round-robin over the
    first N-1 parts; the last part runs the scale scenarios alone
    (:func:`main`).  The N parts together are the whole run, so a smoke run
    can be split into pieces of a few seconds each."""
    if part is None:
        return selected
    k, n = part
    return selected[k - 1::n - 1] if k < n else []


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny N, one repetition (for CI)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--only", nargs="*", help="run cases whose name contains one of these")
    parser.add_argument("--part", type=part_of, metavar="K/N",
                        help="run the K-th of N parts: the cases dealt over parts 1 to N-1, "
                             "the scale scenarios in part N (to split a smoke run)")
    parser.add_argument("--no-scale", action="store_true", help="skip the scale scenarios")
    parser.add_argument("--no-spark", action="store_true",
                        help="skip the Spark standalone cluster (target 7; never in --smoke)")
    parser.add_argument("--reactor", choices=REACTORS, default=default_reactor(),
                        help="what our Twisted nodes run on: uvloop (mdp.uvreactor; the "
                             "default where it is installed) or epoll (Twisted's default)")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "latest.json"))
    args = parser.parse_args(argv)
    use_reactor(args.reactor)
    repetitions = 1 if args.smoke else args.repeat

    with earlier_tree() as (earlier, earlier_note):
        print(f"… goals 4 and 6's baseline, the code before this round: {earlier_note}",
              file=sys.stderr, flush=True)
        references_run, reference_notes = reference_stacks(args.smoke)
        for line in sorted(set(reference_notes.values())):
            print(f"… {line}", file=sys.stderr, flush=True)
        selected = in_part([entry for entry in cases(args.smoke, earlier,
                                                     references=references_run)
                            if not args.only or any(word in name for name in entry[0]
                                                    for word in args.only)], args.part)
        scaled = not args.no_scale and not args.only and (args.part is None
                                                          or args.part[0] == args.part[1])
        runs: dict[str, list[dict[str, Any]]] = {name: [] for names, _, _ in selected
                                                 for name in names}
        # round-robin: every case once per round, so that the machine's slow and
        # fast spells spread over all cases instead of landing on a few; every
        # other round backwards, so that the side of a ratio run first in one
        # round runs second in the next
        for round_ in range(repetitions):
            backwards = round_ % 2 == 1
            for names, _, thunk in (selected[::-1] if backwards else selected):
                print(f"… [{round_ + 1}/{repetitions}] {' and '.join(names)}", file=sys.stderr,
                      flush=True)
                for name, rows in thunk(backwards).items():
                    runs[name].extend(rows)
        scale: dict[str, Any] = {}
        if scaled:
            print("… scale: idle workers' heartbeats", file=sys.stderr, flush=True)
            scale["heartbeat"] = heartbeat_cost(100 if args.smoke else 1000, 100,
                                                1.0 if args.smoke else 10.0, earlier)
    table = {name: aggregate(runs[name]) for names, _, _ in selected for name in names}
    described = {name: description for _, descriptions, _ in selected
                 for name, description in descriptions.items()}
    if scaled:
        print("… scale: draining a long queue", file=sys.stderr, flush=True)
        scale["drain"] = drain(1000 if args.smoke else 10000, 4)
    if not args.no_spark and not args.only and not args.smoke and args.part is None:
        print("… Spark: a standalone cluster of 2 executors", file=sys.stderr, flush=True)
        from benchmarks import spark

        scale["spark"] = spark.run(rows=100_000, repeat=min(3, repetitions))
    checks = targets(table, scale)
    refs = references(table, scale)
    report = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform()},
        # what the processes ran: each hot module compiled, or its source
        "modules": _compiled.status(),
        # what our Twisted nodes ran on (the "(epoll reactor)" stack: epoll)
        "reactor": args.reactor,
        "smoke": args.smoke,
        "part": None if args.part is None else "/".join(map(str, args.part)),
        "repetitions": repetitions,
        # goals 4 and 6's baseline: the code before this round, run here, or why not
        "before_round_two": {"revision": BEFORE_ROUND_TWO, "available": earlier is not None,
                             "note": earlier_note},
        "cases": {name: {**described[name], **row} for name, row in table.items()},
        # NATS and RabbitMQ: run, or why not (benchmarks.peers)
        "reference_stacks": {kind: {"run": kind in references_run,
                                    "note": reference_notes[kind]} for kind in PEER_STACKS},
        "scale": scale,
        "targets": checks,
        "references": refs,
    }
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(markdown(table, scale, checks, refs))
    kinds = sorted(set(report["modules"].values()))
    print(f"\nHot modules: {', '.join(kinds)} (mdp/_compiled.py; the (source) stacks run the source)")
    print(f"\nReactor of our Twisted nodes: {args.reactor} (the (epoll reactor) stack: epoll)")
    print(f"\nJSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
