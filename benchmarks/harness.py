"""Child processes for benchmarks: start, read their lines with a deadline,
measure CPU and memory from /proc, always kill them."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the reactor the roles that use Twisted run on (benchmarks.roles): "uvloop"
#: (mdp.uvreactor, Twisted's asyncio reactor over uvloop) or "epoll" (Twisted's
#: default on Linux); the environment variable passes it to the roles
REACTOR_ENV = "MDP_BENCH_REACTOR"
REACTORS = ("uvloop", "epoll")
_TICKS = os.sysconf("SC_CLK_TCK")


def default_reactor() -> str:
    """uvloop where it is installed (a dependency but on Windows and PyPy):
    the reactor our nodes run on by default; else Twisted's default."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "epoll"
    return "uvloop"


def use_reactor(name: str) -> None:
    """Roles started from now on run their Twisted code on reactor *name*."""
    if name not in REACTORS:
        raise ValueError(f"unknown reactor {name!r} (one of {', '.join(REACTORS)})")
    os.environ[REACTOR_ENV] = name


def on_uvloop() -> bool:
    """Whether the run asked for uvloop (use_reactor): roles install
    mdp.uvreactor, ``twist`` gets ``--reactor=uvloop``."""
    return os.environ.get(REACTOR_ENV) == "uvloop"


def reactor_of(pid: int) -> str:
    """What a live role runs on, seen from outside: "uvloop" if uvloop's
    compiled loop is mapped into it (only mdp.uvreactor imports it in a
    role), else "epoll"."""
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as f:
        return "uvloop" if any("/uvloop/loop." in line for line in f) else "epoll"


def _stat_cpu_seconds(path: str) -> float:
    """User + system CPU seconds in a ``/proc`` ``stat`` file (a process's or a thread's)."""
    with open(path, encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process."""
    return _stat_cpu_seconds(f"/proc/{pid}/stat")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU seconds of a live process's threads, summed by kind:
    "zmq" for libzmq's own threads (named ``ZMQbg/…``), "main" for the rest."""
    out = {"main": 0.0, "zmq": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="ascii", errors="replace") as f:
                name = f.read()
            seconds = _stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        out["zmq" if name.startswith("ZMQbg") else "main"] += seconds
    return out


def established_to(port: int) -> int:
    """TCP connections (IPv4) established to local *port*, seen from the
    listening side: how many peers a broker without MMI has."""
    count = 0
    with open("/proc/net/tcp", encoding="ascii") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole machine since boot, all cores."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / _TICKS, idle / _TICKS


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def zmq_mmi(endpoint: str, service: bytes, body: bytes = b"", timeout: float = 10.0) -> bytes:
    """Ask our broker an MMI question over a throwaway pyzmq DEALER."""
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(endpoint.removeprefix("zmq:"))
        socket.send_multipart([b"MDPC02", b"\x01", service, body])
        if not socket.poll(int(timeout * 1000)):
            raise TimeoutError(f"no answer to {service!r} from {endpoint}")
        return socket.recv_multipart()[-1]
    finally:
        socket.close()


class Child:
    """One ``python -m benchmarks.roles`` process (or, with *argv*, any command,
    its stderr merged into what :meth:`readline` reads).  A role's stderr is
    kept in an unnamed file: its end is quoted if the role fails."""

    def __init__(self, *args: str, argv: Optional[list[str]] = None, root: str = ROOT) -> None:
        self.args = tuple(argv) if argv else args
        self.stderr = None if argv else tempfile.TemporaryFile()
        # *root*: the tree whose benchmarks.roles and mdp the child runs (this
        # checkout, or an earlier revision's, see benchmarks.__main__.earlier_tree)
        self.proc = subprocess.Popen(
            argv or [sys.executable, "-m", "benchmarks.roles", *args],
            cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if argv else self.stderr,
            bufsize=0, env={**os.environ, "PYTHONPATH": root, "PYTHONUNBUFFERED": "1"},
        )
        self.pid = self.proc.pid
        self._buffer = b""

    def readline(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.args}: no output within {timeout}s{self.said()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    raise RuntimeError(
                        f"{self.args} exited ({self.proc.wait()}) early{self.said()}")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def said(self, limit: int = 4000) -> str:
        """The end of what the role wrote to stderr, as a suffix for an
        error message ("" if nothing)."""
        if self.stderr is None:
            return ""
        fd = self.stderr.fileno()
        size = os.fstat(fd).st_size
        # (pread: the role shares the file's offset and may still be writing)
        text = os.pread(fd, limit, max(size - limit, 0)).decode(errors="replace").strip()
        return f"; its stderr ends:\n{text}" if text else ""

    def waitFor(self, marker: str, timeout: float) -> str:
        """The first line containing *marker* (earlier lines are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.readline(max(deadline - time.monotonic(), 0.001))
            if marker in line:
                return line

    def expect(self, word: str, timeout: float) -> str:
        line = self.readline(timeout)
        if not line.startswith(word):
            raise RuntimeError(f"{self.args}: expected {word}, got {line[:200]!r}")
        return line[len(word):].strip()

    def ready(self, timeout: float = 60.0) -> str:
        return self.expect("READY", timeout)

    def go(self) -> None:
        self.proc.stdin.write(b"GO\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 300.0) -> dict[str, Any]:
        return json.loads(self.expect("RESULT", timeout))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout, self.stderr):
            if stream is not None:
                stream.close()


class Processes:
    """Starts children; kills every one of them on exit, whatever happened."""

    def __init__(self, root: str = ROOT) -> None:
        self.children: list[Child] = []
        self.root = root

    def start(self, *args: str, argv: Optional[list[str]] = None) -> Child:
        child = Child(*args, argv=argv, root=self.root)
        self.children.append(child)
        return child

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for child in reversed(self.children):
            child.kill()
