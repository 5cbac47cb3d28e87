"""The reference stacks: NATS and RabbitMQ, what users would pick instead.

Each case of the ``nats`` and ``rabbitmq`` stacks starts its server as a plain
process (never a system service) on free 127.0.0.1 ports, with its own
configuration in a temporary directory, and stops it at the end of the case,
removing that directory (:class:`Server`).  The server's CPU counts where our
broker's does.  Workers and clients are Python processes, one per role as for
our stack (``python -m benchmarks.roles worker|client nats|rabbitmq ...``):

* ``nats``: nats-server (Debian's package ``nats-server``), nats-py on uvloop.
  Workers ``subscribe(SUBJECT, queue=...)`` and ``msg.respond``; a client
  keeps *window* ``nc.request`` calls in flight on one connection.
* ``rabbitmq``: rabbitmq-server (Debian's ``rabbitmq-server``), pika's
  ``BlockingConnection``.  Workers consume one queue with manual acks and
  ``basic_qos(prefetch_count=PREFETCH)``; clients publish to it and read the
  replies through direct reply-to (``amq.rabbitmq.reply-to``), matched by
  correlation id.

Nothing logs per request.  Every request carries a body of its own, every
reply is checked to be its request's and counted (the RESULT's ``replies``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any, Callable, Optional

SUBJECT = "echo"
QUEUE = "echo"
#: a RabbitMQ worker's unacknowledged deliveries: the pipelined case's window
#: shared by its 4 workers, so the prefetch never bounds what is in flight
#: (an MDP worker holds one request at a time; NATS pushes without a bound)
PREFETCH = 25
#: Erlang without scheduler busy-waiting, RabbitMQ's advice for small hosts
#: (on 2 cores it serves 1.04-1.09x the rate with busy-waiting on)
ERL_ARGS = "+sbwt none +sbwtdcpu none +sbwtdio none"
RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
#: what a missing piece is installed with
INSTALL = {"nats": "apt-get install nats-server; pip install '.[bench]'",
           "rabbitmq": "apt-get install rabbitmq-server; pip install '.[bench]'"}
#: each reference stack's server, as the report names it (the broker column's CPU)
SERVER_NAMES = {"nats": "nats-server", "rabbitmq": "RabbitMQ (beam.smp)"}


def _which(name: str) -> Optional[str]:
    """*name* on PATH, or in /usr/sbin (where Debian puts nats-server)."""
    found = shutil.which(name)
    if found:
        return found
    candidate = os.path.join("/usr/sbin", name)
    return candidate if os.access(candidate, os.X_OK) else None


def missing(kind: str) -> Optional[str]:
    """Why the *kind* stack cannot run here (None: it can)."""
    if kind == "nats":
        needs = [("nats-server", _which("nats-server")), ("nats-py", _module("nats")),
                 ("uvloop", _module("uvloop"))]
    elif kind == "rabbitmq":
        needs = [("rabbitmq-server", RABBITMQ_SERVER if os.access(RABBITMQ_SERVER, os.X_OK)
                  else None), ("epmd", _which("epmd")), ("pika", _module("pika"))]
    else:
        raise ValueError(f"unknown reference stack {kind!r}")
    absent = [name for name, found in needs if not found]
    if not absent:
        return None
    return f"{', '.join(absent)} not installed ({INSTALL[kind]})"


def _module(name: str) -> Optional[str]:
    return name if importlib.util.find_spec(name) is not None else None


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Server:
    """A reference server, started as a plain process in a session of its own
    (so that :meth:`kill` reaches whatever it started) with its configuration,
    data and logs in a temporary directory.  ``pid`` is the process whose CPU
    the case counts (nats-server; RabbitMQ's beam.smp); ``endpoint`` the URL
    workers and clients connect to.  :meth:`kill` stops it, then removes the
    directory; a :class:`benchmarks.harness.Processes` calls it on exit."""

    def __init__(self, kind: str, timeout: float = 120.0) -> None:
        self.kind = kind
        self.directory = tempfile.mkdtemp(prefix=f"mdp-bench-{kind}-")
        self.helpers: list[subprocess.Popen] = []
        self.proc: Optional[subprocess.Popen] = None
        self.log = open(os.path.join(self.directory, "output.log"), "wb")
        try:
            self.port = free_port()
            start = self._nats if kind == "nats" else self._rabbitmq
            self.endpoint, env, argv = start()
            self.proc = subprocess.Popen(argv, cwd=self.directory, env=env,
                                         stdin=subprocess.DEVNULL, stdout=self.log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_end_with_parent)
            self._wait_ready(timeout)
            self.pid = self._measured_pid()
        except BaseException:
            self.kill()
            raise

    def _nats(self) -> tuple[str, dict[str, str], list[str]]:
        config = os.path.join(self.directory, "nats.conf")
        with open(config, "w", encoding="ascii") as f:
            f.write(f"listen: 127.0.0.1:{self.port}\n")
        return (f"nats://127.0.0.1:{self.port}", dict(os.environ),
                [_which("nats-server") or "nats-server", "-c", config])

    def _rabbitmq(self) -> tuple[str, dict[str, str], list[str]]:
        d = self.directory
        epmd_port, dist_port = free_port(), free_port()
        # our own epmd, in the foreground, so that it goes when the case does
        # (the Erlang VM would otherwise start one as a daemon that outlives it)
        epmd_env = {**os.environ, "ERL_EPMD_ADDRESS": "127.0.0.1"}
        self.helpers.append(subprocess.Popen(
            [_which("epmd") or "epmd", "-port", str(epmd_port)], env=epmd_env, cwd=d,
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_end_with_parent))
        deadline = time.monotonic() + 10
        while not _accepts(epmd_port):
            if time.monotonic() > deadline or self.helpers[0].poll() is not None:
                raise RuntimeError(f"epmd did not listen on {epmd_port}{self._said()}")
            time.sleep(0.05)
        with open(os.path.join(d, "rabbitmq.conf"), "w", encoding="ascii") as f:
            f.write("log.console = false\nlog.file.level = warning\n"
                    f"listeners.tcp.default = 127.0.0.1:{self.port}\n")
        with open(os.path.join(d, "enabled_plugins"), "w", encoding="ascii") as f:
            f.write("[].\n")
        env = {
            **epmd_env,
            "HOME": d,  # the Erlang cookie
            "RABBITMQ_NODENAME": f"mdp-bench-{self.port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(dist_port),
            "ERL_EPMD_PORT": str(epmd_port),
            "RABBITMQ_CONFIG_FILE": os.path.join(d, "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": os.path.join(d, "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": os.path.join(d, "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": os.path.join(d, "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": os.path.join(d, "mnesia"),
            "RABBITMQ_LOG_BASE": os.path.join(d, "log"),
            "RABBITMQ_PID_FILE": os.path.join(d, "rabbitmq.pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": ERL_ARGS,
        }
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F", env, [RABBITMQ_SERVER]

    def _wait_ready(self, timeout: float) -> None:
        """Until the server accepts connections (RabbitMQ opens its port once booted)."""
        deadline = time.monotonic() + timeout
        while not _accepts(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited ({self.proc.returncode}) early{self._said()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.kind} did not listen on {self.port} within "
                                   f"{timeout}s{self._said()}")
            time.sleep(0.1)

    def _measured_pid(self) -> int:
        """nats-server itself; for RabbitMQ the Erlang VM (beam.smp) under its script."""
        if self.kind == "nats":
            return self.proc.pid
        for pid in _session(self.proc.pid):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/comm", encoding="ascii", errors="replace") as f:
                    if f.read().strip().startswith("beam"):
                        return pid
        raise RuntimeError(f"no beam.smp in RabbitMQ's session{self._said()}")

    def _said(self, limit: int = 3000) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            text = f.read()[-limit:].decode(errors="replace").strip()
        return f"; it said:\n{text}" if text else ""

    def kill(self) -> None:
        """Stop the server (SIGTERM: RabbitMQ's script stops its node; then
        SIGKILL to whatever of its session is left), its epmd, and remove its
        directory."""
        for proc in ([self.proc] if self.proc else []) + self.helpers:
            _stop_session(proc)
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def _end_with_parent() -> None:
    """In the child, before it runs the server: SIGTERM when the suite dies
    without stopping it (Linux's PR_SET_PDEATHSIG; RabbitMQ's script then
    stops its node), so that a suite killed outright leaves no server behind."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _session(sid: int) -> list[int]:
    """The live processes of session *sid*."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: the session id
            pids.append(int(name))
    return pids


def _stop_session(proc: subprocess.Popen, grace: float = 30.0) -> None:
    sid = proc.pid
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    deadline = time.monotonic() + 10
    while _session(sid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of session {sid} outlived SIGKILL: {_session(sid)}")
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


# --- roles (python -m benchmarks.roles worker|client nats|rabbitmq ...) --------

def bodies(size: int) -> Callable[[], bytes]:
    """A maker of request bodies, each its own (a counter), *size* bytes at least."""
    count = 0

    def body() -> bytes:
        nonlocal count
        count += 1
        return b"%d:" % count + b"x" * max(size - len(b"%d:" % count), 0)

    return body


def worker(kind: str, endpoint: str) -> None:
    from benchmarks.roles import emit

    if kind == "nats":
        import asyncio

        import nats
        import uvloop

        async def main() -> None:
            nc = await nats.connect(endpoint)

            async def echo(msg: Any) -> None:
                await msg.respond(msg.data)

            await nc.subscribe(SUBJECT, queue="workers", cb=echo)
            await nc.flush()
            emit("READY")
            await asyncio.Event().wait()

        uvloop.install()
        asyncio.run(main())
    else:
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(endpoint))
        channel = connection.channel()
        channel.queue_declare(queue=QUEUE)
        channel.basic_qos(prefetch_count=PREFETCH)

        def echo(ch: Any, method: Any, props: Any, body: bytes) -> None:
            ch.basic_publish("", props.reply_to, body,
                             pika.BasicProperties(correlation_id=props.correlation_id))
            ch.basic_ack(method.delivery_tag)

        channel.basic_consume(QUEUE, echo)
        emit("READY")
        channel.start_consuming()


def client(kind: str, endpoint: str, mode: str, n: int, warmup: int, size: int,
           window: int = 1) -> None:
    """*n* timed requests after *warmup*, *window* in flight (1: sync)."""
    if mode not in ("sync", "pipelined"):
        raise SystemExit(f"the {kind} client runs sync and pipelined only")
    window = 1 if mode == "sync" else window
    (_nats_client if kind == "nats" else _rabbitmq_client)(endpoint, n, warmup, size, window)


def _nats_client(endpoint: str, n: int, warmup: int, size: int, window: int) -> None:
    import asyncio

    import nats
    import uvloop

    from benchmarks.roles import emit, result, wait_go

    body = bodies(size)
    clock = time.perf_counter

    async def main() -> None:
        nc = await nats.connect(endpoint)

        async def run(count: int, latencies: list[float]) -> int:
            todo = iter(range(count))
            replies = 0

            async def lane() -> None:  # one request in flight, again and again
                nonlocal replies
                for _ in todo:
                    sent = body()
                    t0 = clock()
                    reply = await nc.request(SUBJECT, sent, timeout=60)
                    latencies.append(clock() - t0)
                    if reply.data != sent:
                        raise SystemExit(f"a reply is not its request's: {reply.data!r} to {sent!r}")
                    replies += 1

            await asyncio.gather(*(lane() for _ in range(min(window, count))))
            return replies

        await run(warmup, [])
        emit("READY")
        await asyncio.get_running_loop().run_in_executor(None, wait_go)
        latencies: list[float] = []
        cpu0, start = time.process_time(), time.time()
        replies = await run(n, latencies)
        result(latencies, start, time.time(), time.process_time() - cpu0, replies=replies)
        await nc.close()

    uvloop.install()
    asyncio.run(main())


def _rabbitmq_client(endpoint: str, n: int, warmup: int, size: int, window: int) -> None:
    import pika

    from benchmarks.roles import emit, result, wait_go

    body = bodies(size)
    clock = time.perf_counter
    connection = pika.BlockingConnection(pika.URLParameters(endpoint))
    channel = connection.channel()
    pending: dict[str, tuple[bytes, float]] = {}  # correlation id: (body, when sent)
    state = {"issued": 0, "count": 0, "replies": 0, "latencies": []}
    ids = iter(range(1, 1 << 62))

    def send() -> None:
        sent, cid = body(), str(next(ids))
        pending[cid] = (sent, clock())
        channel.basic_publish("", QUEUE, sent, pika.BasicProperties(
            reply_to="amq.rabbitmq.reply-to", correlation_id=cid))
        state["issued"] += 1

    def on_reply(ch: Any, method: Any, props: Any, reply: bytes) -> None:
        sent, t0 = pending.pop(props.correlation_id, (None, 0.0))
        if reply != sent:
            raise SystemExit(f"a reply is not its request's: {reply!r} to {sent!r}")
        state["latencies"].append(clock() - t0)
        state["replies"] += 1
        if state["issued"] < state["count"]:
            send()

    channel.basic_consume("amq.rabbitmq.reply-to", on_reply, auto_ack=True)

    def run(count: int, latencies: list[float]) -> int:
        state.update(issued=0, count=count, replies=0, latencies=latencies)
        for _ in range(min(window, count)):
            send()
        while state["replies"] < count:
            connection.process_data_events(time_limit=None)
        return state["replies"]

    run(warmup, [])
    emit("READY")
    wait_go()
    latencies: list[float] = []
    cpu0, start = time.process_time(), time.time()
    replies = run(n, latencies)
    result(latencies, start, time.time(), time.process_time() - cpu0, replies=replies)
    connection.close()


def versions(kind: str) -> str:
    """What the *kind* stack runs, for the report: the server's and the client
    library's versions."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return f"{package} {version(package)}"
        except PackageNotFoundError:
            return f"{package} (version unknown)"

    if kind == "nats":
        try:
            server = subprocess.run([_which("nats-server") or "nats-server", "--version"],
                                    capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            server = "nats-server (version unknown)"
        return f"{server}, {of('nats-py')} on {of('uvloop')}"
    lib = os.path.join(os.path.dirname(os.path.dirname(RABBITMQ_SERVER)), "lib")
    found = sorted(name for name in (os.listdir(lib) if os.path.isdir(lib) else ())
                   if name.startswith("rabbitmq_server-"))
    server = found[-1].replace("rabbitmq_server-", "rabbitmq-server ") if found \
        else "rabbitmq-server (version unknown)"
    return f"{server}, {of('pika')} (prefetch {PREFETCH}, direct reply-to)"
