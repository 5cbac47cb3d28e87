"""SP REQ/REP against nng: ``python -m benchmarks.sp [--smoke] [--json PATH] [--repeat R]``.

Two cases, each a REP process and a REQ process on 127.0.0.1 (ports picked by
the OS), N requests of 16 bytes one after the other (each awaited), echoed:

* **pynng**: ``pynng.Rep0`` and ``pynng.Req0`` (nng, in C, blocking calls);
* **ours**: ``twist sp-rep --handler echo`` and an :class:`~mdp.sp.peers.SPClient`
  on the Twisted reactor.

Cases run interleaved in each round; the ratio ours/pynng is the median of the
per-round ratios.  Prints a Markdown table and writes JSON (default
``benchmarks/results/sp-latest.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.__main__ import ratio
from benchmarks.harness import ROOT

SIZE = 16


# --- the roles, each run as its own process ----------------------------------------------


def pynng_rep() -> None:
    import pynng

    with pynng.Rep0(listen="tcp://127.0.0.1:0") as sock:
        print(str(sock.listeners[0].local_address).rpartition(":")[2], flush=True)
        while True:
            sock.send(sock.recv())


def pynng_req(url: str, n: int) -> None:
    import pynng

    payload = b"x" * SIZE
    with pynng.Req0(dial=url, recv_timeout=30_000) as sock:
        sock.send(payload)  # warm up: connected
        sock.recv()
        start = time.perf_counter()
        for _ in range(n):
            sock.send(payload)
            sock.recv()
        print(time.perf_counter() - start, flush=True)


def our_req(url: str, n: int) -> None:
    from twisted.internet import defer, task

    from mdp.sp.peers import SPClient

    async def run(reactor: Any) -> None:
        client = SPClient(url, reactor)
        payload = b"x" * SIZE
        await client.request(payload)  # warm up: connected
        start = time.perf_counter()
        for _ in range(n):
            await client.request(payload)
        print(time.perf_counter() - start, flush=True)
        await client.close()

    task.react(lambda reactor: defer.ensureDeferred(run(reactor)))


ROLES = {"pynng-rep": pynng_rep, "pynng-req": pynng_req, "our-req": our_req}


# --- orchestration --------------------------------------------------------------------------


def _spawn(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    proc.pending = b""  # type: ignore[attr-defined]
    return proc


def _next_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The child's next line of output (read straight from its pipe, so no
    line waits in a buffer that select() cannot see)."""
    import select

    deadline = time.monotonic() + timeout
    while b"\n" not in proc.pending:  # type: ignore[attr-defined]
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{proc.args} said nothing within {timeout:.0f} s")
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
            if not chunk:
                raise RuntimeError(f"{proc.args} ended: {proc.pending[-2000:]!r}")  # type: ignore[attr-defined]
            proc.pending += chunk  # type: ignore[attr-defined]
    line, _, proc.pending = proc.pending.partition(b"\n")  # type: ignore[attr-defined]
    return line.decode("utf-8", "replace").strip()


def run_case(case: str, n: int) -> dict[str, float]:
    twist = os.path.join(os.path.dirname(sys.executable), "twist")
    if case == "pynng":
        rep = _spawn(sys.executable, "-m", "benchmarks.sp", "role", "pynng-rep")
    else:
        rep = _spawn(twist, "--log-format", "text", "sp-rep", "--endpoint", "tcp://127.0.0.1:0",
                     "--handler", "echo")
    try:
        if case == "pynng":
            port = _next_line(rep)
        else:
            while True:
                line = _next_line(rep)
                if "SP REP listening on" in line:
                    port = line.rpartition("port=")[2]
                    break
        role = "pynng-req" if case == "pynng" else "our-req"
        req = _spawn(sys.executable, "-m", "benchmarks.sp", "role", role,
                     f"tcp://127.0.0.1:{port}", str(n))
        try:
            elapsed = float(_next_line(req, timeout=600))
        finally:
            req.kill()
            req.wait()
    finally:
        rep.kill()
        rep.wait()
    return {"rate": n / elapsed, "seconds": elapsed}


CASES = {"pynng Req0 -> Rep0": "pynng", "our SPClient -> twist sp-rep": "ours"}


def main(argv: list[str]) -> None:
    if argv[:1] == ["role"]:
        name, *args = argv[1:]
        ROLES[name](*[int(a) if a.isdigit() else a for a in args])
        return
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sp")
    parser.add_argument("--smoke", action="store_true", help="tiny run, to check it works")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results",
                                                       "sp-latest.json"))
    parser.add_argument("--repeat", type=int, default=3)
    options = parser.parse_args(argv)
    n = 200 if options.smoke else 5000
    repeat = 1 if options.smoke else options.repeat
    table: dict[str, Any] = {name: {"runs": []} for name in CASES}
    for _ in range(repeat):
        for name, case in CASES.items():
            table[name]["runs"].append(run_case(case, n))
    for entry in table.values():
        entry["rate"] = statistics.median(run["rate"] for run in entry["runs"])
    names = list(CASES)
    versus = ratio(table, names[1], names[0])
    print("| case | requests/s |")
    print("|---|---|")
    for name in names:
        print(f"| {name} | {table[name]['rate']:.0f} |")
    print(f"\nours / pynng: {versus:.2f}× (median of {repeat} round(s), {n} requests each)")
    report = {"smoke": options.smoke, "repetitions": repeat, "requests": n, "cases": table,
              "ratio_ours_to_pynng": versus, "python": platform.python_version()}
    os.makedirs(os.path.dirname(options.json), exist_ok=True)
    with open(options.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
