"""The processes a benchmark run is made of: ``python -m benchmarks.roles ROLE ...``.

Every role prints ``READY [info]`` on stdout once set up.  Client roles then
wait for a ``GO`` line on stdin, run the timed requests and print ``RESULT
<json>`` with their latencies (seconds), wall-clock start/end and the CPU
seconds they used while timed.

Roles:
  broker  ours|majortomo|bare  BIND           (prints READY <endpoint>)
  worker  ours|majortomo|bare|blocking  ENDPOINT [--dialect D] [--service echo|stream]
  worker  nats|rabbitmq  URL                  (the reference stacks: benchmarks.peers)
  farm    ENDPOINT COUNT SERVICES             (COUNT idle workers of ours in one process)
  client  ours|majortomo|bare|blocking  ENDPOINT MODE N WARMUP SIZE [WINDOW] [--dialect D] [--stamp yes]
          MODE: sync | pipelined | stream
  client  nats|rabbitmq  URL MODE N WARMUP SIZE [WINDOW]  (MODE: sync | pipelined)
  filler  ENDPOINT N                          (queues N requests on one raw socket; after
                                               GO, reads the N replies)
  inproc  MODE N WARMUP SIZE CLIENTS WORKERS [WINDOW] (everything over loopback, one process)
  fserver BIND                                (a Freelance echo server; READY <endpoint>)
  fclient MODEL N WARMUP ENDPOINT...          (a Freelance client of model 1, 2 or 3)
  tclient ENDPOINT N WARMUP SIZE WINDOW POLL  (a Titanic client, two timed phases: see
                                               titanic_client)

Roles that run Twisted run it on the reactor ``MDP_BENCH_REACTOR`` names
(benchmarks.harness.REACTOR_ENV): ``uvloop`` installs :mod:`mdp.uvreactor`;
anything else, or nothing, leaves Twisted's default.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from benchmarks.harness import on_uvloop

SERVICE = b"echo"


def curve_server() -> dict[str, str]:
    """Our broker's CURVE keyword arguments when the run asks for CURVE
    (``MDP_BENCH_CURVE``: the directory of keys, see benchmarks.security)."""
    keys = os.environ.get("MDP_BENCH_CURVE")
    if not keys:
        return {}
    return {"curveSecret": os.path.join(keys, "broker.key_secret"),
            "curveAllow": os.path.join(keys, "allowed")}


def extensions() -> dict[str, Any]:
    """``MDP_BENCH_EXTENSIONS=0``: our client without the request-context extension
    (benchmarks.extension); unset, our default."""
    return {"extensions": False} if os.environ.get("MDP_BENCH_EXTENSIONS") == "0" else {}


def curve_client() -> dict[str, str]:
    """Our workers' and clients' CURVE keyword arguments, likewise."""
    keys = os.environ.get("MDP_BENCH_CURVE")
    if not keys:
        return {}
    return {"curveServerPublic": os.path.join(keys, "broker.key"),
            "curveSecret": os.path.join(keys, "peer.key_secret")}


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def wait_go() -> None:
    line = sys.stdin.readline()
    if line.strip() != "GO":
        raise SystemExit(f"expected GO, got {line!r}")


def result(latencies: list[float], start: float, end: float, cpu: float, **extra: Any) -> None:
    emit("RESULT " + json.dumps({"latencies": latencies, "start": start, "end": end,
                                 "cpu": cpu, "reactor": reactor_name(), **extra}))


def reactor_name() -> Any:
    """What this role's Twisted code ran on: "uvloop", "epoll" (or another
    reactor's class name); None if it ran no Twisted."""
    reactor = sys.modules.get("twisted.internet.reactor")  # the reactor, once installed
    if reactor is None:
        return None
    loop = getattr(reactor, "_asyncioEventloop", None)
    if loop is not None and type(loop).__module__.startswith("uvloop"):
        return "uvloop"
    name = type(reactor).__name__
    return "epoll" if name == "EPollReactor" else name


# --- brokers -----------------------------------------------------------------

def broker_ours(bind: str) -> None:
    from twisted.internet import reactor
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    from mdp import Broker

    predicate = LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)
    globalLogBeginner.beginLoggingTo(
        [FilteringLogObserver(textFileLogObserver(sys.stderr), [predicate])],
        redirectStandardIO=False,
    )
    broker = Broker(reactor, **curve_server())

    def bound(transport: Any) -> None:
        emit(f"READY {transport.endpoint}")

    broker.listen(bind).addCallback(bound)
    reactor.run()


def broker_majortomo(bind: str) -> None:
    import logging.config

    import figcan
    import zmq
    from majortomo.broker import Broker
    from majortomo.config import default_config

    # as shipped: majortomo's own default logging configuration (INFO)
    logging.config.dictConfig(figcan.Configuration(default_config)["logging"])
    broker = Broker(bind=bind.removeprefix("zmq:"))
    broker.bind()
    emit("READY zmq:" + broker._socket.getsockopt(zmq.LAST_ENDPOINT).decode())
    while True:  # Broker.run() without its second bind()
        message = broker.receive()
        if message:
            broker.handle_message(message)


def broker_bare(bind: str) -> None:
    """The ceiling: a minimal pyzmq loop passing READY, REQUEST and FINAL (and
    answering HEARTBEAT so workers stay registered).  No validation, no queues
    per service, no timers: an LRU of worker ids and one FIFO of requests."""
    from collections import deque

    import zmq

    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.bind(bind.removeprefix("zmq:"))
    emit("READY zmq:" + socket.getsockopt(zmq.LAST_ENDPOINT).decode())
    workers: deque[bytes] = deque()
    requests: deque[list[bytes]] = deque()
    recv, send = socket.recv_multipart, socket.send_multipart
    while True:
        frames = recv()
        sender, header, command = frames[0], frames[1], frames[2]
        if header == b"MDPC02":  # REQUEST: [client, MDPC02, 01, service, body...]
            if workers:
                send([workers.popleft(), b"MDPW02", b"\x02", sender, b"", *frames[4:]])
            else:
                requests.append(frames)
        elif command == b"\x04":  # FINAL: [worker, MDPW02, 04, client, "", body...]
            send([frames[3], b"MDPC02", b"\x03", SERVICE, *frames[5:]])
            if requests:
                pending = requests.popleft()
                send([sender, b"MDPW02", b"\x02", pending[0], b"", *pending[4:]])
            else:
                workers.append(sender)
        elif command == b"\x01":  # READY
            if requests:
                pending = requests.popleft()
                send([sender, b"MDPW02", b"\x02", pending[0], b"", *pending[4:]])
            else:
                workers.append(sender)
        elif command == b"\x05":  # HEARTBEAT
            send([sender, b"MDPW02", b"\x05"])


# --- workers -----------------------------------------------------------------

def worker_ours(endpoint: str, dialect: str = "rfc", service: str = "echo") -> None:
    """An echo worker, or with service "stream" one answering N PARTIALs + FINAL
    (N from the second request frame)."""
    from twisted.internet import reactor, task

    from mdp import Final, Worker

    async def stream(frames: list[bytes]) -> Any:
        for _ in range(int(frames[1])):
            yield frames[:1]
        yield Final(frames[:1])

    async def waits(frames: list[bytes]) -> list[bytes]:
        await task.deferLater(reactor, wait)
        return frames

    wait = int(os.environ.get("MDP_BENCH_HANDLER_MS") or 0) / 1000
    handler = stream if service == "stream" else waits if wait else (lambda frames: frames)
    Worker(endpoint, service, handler, reactor, dialect=dialect,
           concurrency=int(os.environ.get("MDP_BENCH_CONCURRENCY") or 1),
           **curve_client()).start()
    emit("READY")
    reactor.run()


def worker_blocking(endpoint: str, service: str = "echo") -> None:
    """Our blocking worker (:mod:`mdp.blocking`): no reactor."""
    from mdp import Final
    from mdp.blocking import Worker

    def stream(frames: list[bytes]) -> Any:
        for _ in range(int(frames[1])):
            yield frames[:1]
        yield Final(frames[:1])

    worker = Worker(endpoint, service, stream if service == "stream" else (lambda frames: frames),
                    concurrency=int(os.environ.get("MDP_BENCH_CONCURRENCY") or 1),
                    **curve_client())
    emit("READY")
    worker.run()


def worker_majortomo(endpoint: str) -> None:
    from majortomo import Worker
    from majortomo.worker import WorkerRequestsIterator

    requests = WorkerRequestsIterator(Worker(endpoint.removeprefix("zmq:"), SERVICE))
    emit("READY")
    for request in requests:
        requests.send_reply_final(request)


def worker_bare(endpoint: str) -> None:
    """The cheapest possible echo worker: a blocking pyzmq loop, READY then
    REQUEST -> FINAL; it answers a broker's HEARTBEAT but sends none of its own."""
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoint.removeprefix("zmq:"))
    socket.send_multipart([b"MDPW02", b"\x01", SERVICE])
    emit("READY")
    recv, send = socket.recv_multipart, socket.send_multipart
    while True:
        frames = recv()  # [MDPW02, 02, client, "", body...]
        if frames[1] == b"\x02":
            send([b"MDPW02", b"\x04", frames[2], b"", *frames[4:]])
        elif frames[1] == b"\x05":
            send([b"MDPW02", b"\x05"])


def farm(endpoint: str, count: int, services: int) -> None:
    from twisted.internet import reactor

    from mdp import Worker

    for n in range(count):
        Worker(endpoint, f"idle-{n % services}", lambda frames: frames, reactor).start()
    emit("READY")
    reactor.run()


# --- clients -----------------------------------------------------------------

def client_ours(endpoint: str, mode: str, n: int, warmup: int, size: int, window: int = 1,
                dialect: str = "rfc", stamp: bool = False) -> None:
    from twisted.internet import defer, reactor

    from mdp import Client

    body = b"x" * size
    client = Client(endpoint, reactor, timeout=60, retries=1, maxConnections=max(window, 1),
                    dialect=dialect, stamp=stamp, **curve_client(), **extensions())
    clock = time.perf_counter

    async def timed_sync(count: int, latencies: list[float]) -> None:
        for _ in range(count):
            t0 = clock()
            await client.request(SERVICE, body)
            latencies.append(clock() - t0)

    async def timed_window(count: int, latencies: list[float]) -> None:
        issued = 0
        done: defer.Deferred = defer.Deferred()
        outstanding = 0

        def one() -> None:
            nonlocal issued, outstanding
            issued += 1
            outstanding += 1
            t0 = clock()
            client.request(SERVICE, body).addCallback(finished, t0)

        def finished(_: Any, t0: float) -> None:
            nonlocal outstanding
            latencies.append(clock() - t0)
            outstanding -= 1
            if issued < count:
                one()
            elif outstanding == 0:
                done.callback(None)

        for _ in range(min(window, count)):
            one()
        await done

    async def timed_stream(count: int, latencies: list[float]) -> None:
        for _ in range(count):
            t0 = clock()
            parts = 0
            async for _part in client.stream(b"stream", body, b"1000"):
                parts += 1
            assert parts == 1001, parts
            latencies.append(clock() - t0)

    run = {"sync": timed_sync, "pipelined": timed_window, "stream": timed_stream}[mode]
    timed(run, n, warmup, client.close)


def timed(run: Any, n: int, warmup: int, close: Any) -> None:
    """Under the reactor: warm up, say READY, wait for GO, time *run* over *n*
    requests, print the RESULT, then *close*."""
    from twisted.internet import defer, task, threads

    async def main(_: Any) -> None:
        await run(warmup, [])
        emit("READY")
        await threads.deferToThread(wait_go)
        latencies: list[float] = []
        cpu0, start = time.process_time(), time.time()
        await run(n, latencies)
        result(latencies, start, time.time(), time.process_time() - cpu0)
        await close()

    task.react(lambda r: defer.ensureDeferred(main(r)))


def client_majortomo(endpoint: str, mode: str, n: int, warmup: int, size: int) -> None:
    from majortomo import Client

    if mode != "sync":
        raise SystemExit("majortomo's client is synchronous only")
    body = b"x" * size
    client = Client(endpoint.removeprefix("zmq:"))
    client.connect()

    def once() -> None:
        client.send(SERVICE, body)
        client.recv_all_as_list(timeout=60)

    timed_blocking(once, n, warmup)
    client.close()


def timed_blocking(once: Any, n: int, warmup: int) -> None:
    """For blocking clients: warm up, say READY, wait for GO, time *n* calls
    of *once*, print the RESULT."""
    for _ in range(warmup):
        once()
    emit("READY")
    wait_go()
    latencies = []
    clock = time.perf_counter
    cpu0, start = time.process_time(), time.time()
    for _ in range(n):
        t0 = clock()
        once()
        latencies.append(clock() - t0)
    end, cpu = time.time(), time.process_time() - cpu0
    result(latencies, start, end, cpu)


def client_blocking(endpoint: str, mode: str, n: int, warmup: int, size: int,
                    window: int = 1) -> None:
    """Our blocking client (:mod:`mdp.blocking`): no reactor."""
    from mdp.blocking import Client

    body = b"x" * size
    client = Client(endpoint, timeout=60, retries=1, maxConnections=max(window, 1),
                    **curve_client())
    if mode == "sync":
        request = client.request

        def once() -> None:
            request(SERVICE, body)

        timed_blocking(once, n, warmup)
    elif mode == "pipelined":
        from collections import deque

        clock = time.perf_counter

        def run(count: int, latencies: list[float]) -> None:
            sent: deque[float] = deque()  # when each request was handed to map, in order

            def bodies() -> Any:
                for _ in range(count):
                    sent.append(clock())
                    yield body

            for _ in client.map(SERVICE, bodies(), window=window):
                latencies.append(clock() - sent.popleft())

        run(warmup, [])
        emit("READY")
        wait_go()
        latencies: list[float] = []
        cpu0, start = time.process_time(), time.time()
        run(n, latencies)
        result(latencies, start, time.time(), time.process_time() - cpu0)
    else:
        parts = []

        def once() -> None:
            parts.clear()
            client.request(b"stream", body, b"1000", onPartial=parts.append)
            assert len(parts) == 1000, len(parts)

        timed_blocking(once, n, warmup)
    client.close()


def client_bare(endpoint: str, mode: str, n: int, warmup: int, size: int) -> None:
    """The cheapest possible synchronous client: a blocking pyzmq DEALER."""
    import zmq

    if mode != "sync":
        raise SystemExit("the bare client is synchronous only")
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoint.removeprefix("zmq:"))
    request = [b"MDPC02", b"\x01", SERVICE, b"x" * size]
    recv, send = socket.recv_multipart, socket.send_multipart

    def once() -> None:
        send(request)
        recv()

    timed_blocking(once, n, warmup)
    socket.close(0)


# --- queue drain -------------------------------------------------------------

def filler(endpoint: str, n: int) -> None:
    """Queue N requests on one raw DEALER, then count the N replies."""
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.connect(endpoint.removeprefix("zmq:"))
    for i in range(n):
        socket.send_multipart([b"MDPC02", b"\x01", SERVICE, b"%016d" % i])
    emit("READY")
    wait_go()
    start = time.time()
    for _ in range(n):
        socket.recv_multipart()
    end = time.time()
    result([], start, end, 0.0)


# --- everything in one process over loopback ---------------------------------

def inproc(mode: str, n: int, warmup: int, size: int, clients: int, workers: int,
           window: int = 1) -> None:
    from twisted.internet import defer, reactor, task, threads

    from mdp import Broker, Client, Worker

    body = b"x" * size
    clock = time.perf_counter

    async def main(_: Any) -> None:
        broker = Broker(reactor)
        bound = await broker.listen(f"loopback:bench-{os.getpid()}")
        for _ in range(workers):
            Worker(bound.endpoint, SERVICE, lambda frames: frames, reactor).start()
        pool = [Client(bound.endpoint, reactor, timeout=60, retries=1, maxConnections=window)
                for _ in range(clients)]

        async def run(client: Client, count: int, latencies: list[float]) -> None:
            if mode == "sync":
                for _ in range(count):
                    t0 = clock()
                    await client.request(SERVICE, body)
                    latencies.append(clock() - t0)
            else:
                async def lane(k: int) -> None:
                    for _ in range(k):
                        t0 = clock()
                        await client.request(SERVICE, body)
                        latencies.append(clock() - t0)
                per = [count // window + (1 if i < count % window else 0) for i in range(window)]
                await defer.gatherResults([defer.ensureDeferred(lane(k)) for k in per])

        await defer.gatherResults([defer.ensureDeferred(run(c, warmup, [])) for c in pool])
        emit("READY")
        await threads.deferToThread(wait_go)
        latencies: list[float] = []
        cpu0, start = time.process_time(), time.time()
        await defer.gatherResults([defer.ensureDeferred(run(c, n, latencies)) for c in pool])
        end, cpu = time.time(), time.process_time() - cpu0
        result(latencies, start, end, cpu)

    task.react(lambda r: defer.ensureDeferred(main(r)))


# --- Freelance ----------------------------------------------------------------

def freelance_server(bind: str) -> None:
    from twisted.internet import reactor

    from mdp.freelance import FreelanceServer

    server = FreelanceServer(lambda frames: frames, reactor)
    server.listen(bind).addCallback(lambda t: emit(f"READY {t.endpoint}"))
    reactor.run()


def freelance_client(model: int, n: int, warmup: int, endpoints: list[str]) -> None:
    from twisted.internet import reactor

    from mdp.freelance import freelance_client as make

    options = {1: {"timeout": 0.25}, 2: {}, 3: {"timeout": 0.25}}[model]
    client = make(endpoints, model, reactor, **options)
    clock = time.perf_counter

    async def run(count: int, latencies: list[float]) -> None:
        for _ in range(count):
            t0 = clock()
            await client.request(b"x" * 16)
            latencies.append(clock() - t0)

    timed(run, n, warmup, client.close)


# --- Titanic ------------------------------------------------------------------

def titanic_client(endpoint: str, n: int, warmup: int, size: int, window: int,
                   poll: float) -> None:
    """A :class:`~mdp.titanic.TitanicClient` timed in two phases, each after
    its own READY / GO (so that the caller can read Titanic's CPU around each):

    1. *stored*: *n* submits one after the other (each awaited: the request is
       committed when it fires); RESULT with each submit's latency.
    2. *end-to-end*: *n* submits with up to *window* outstanding, then the *n*
       replies collected with ``result`` (polling every *poll* seconds), again
       up to *window* at once; RESULT with when the submits were all acknowledged.

    Between the phases the requests of phase 1 are collected and closed
    (untimed), so phase 2 starts with an idle Titanic and an empty store.
    Nothing is closed while timed."""
    from twisted.internet import defer, task, threads

    from mdp.titanic import TitanicClient

    body = b"x" * size
    clock = time.perf_counter

    async def windowed(items: list[Any], one: Any, width: int) -> list[Any]:
        """``await one(item)`` for every item, at most *width* at once; the
        results in the items' order."""
        results: list[Any] = [None] * len(items)
        positions = iter(range(len(items)))

        async def lane() -> None:
            for i in positions:
                results[i] = await one(items[i])

        await defer.gatherResults([defer.ensureDeferred(lane()) for _ in range(width)])
        return results

    async def main(reactor: Any) -> None:
        client = TitanicClient(endpoint, reactor, pollInterval=poll, timeout=60, retries=1)
        for _ in range(warmup):  # the dispatcher's mmi.service check, connections, the store
            await client.call(SERVICE, body)
        emit("READY")

        await threads.deferToThread(wait_go)
        latencies: list[float] = []
        ids: list[str] = []
        cpu0, start = time.process_time(), time.time()
        for _ in range(n):
            t0 = clock()
            ids.append(await client.submit(SERVICE, body))
            latencies.append(clock() - t0)
        result(latencies, start, time.time(), time.process_time() - cpu0)

        async def collect_and_close(requestId: str) -> None:
            await client.result(requestId)
            await client.close(requestId)

        await windowed(ids, collect_and_close, window)

        emit("READY")
        await threads.deferToThread(wait_go)
        cpu0, start = time.process_time(), time.time()
        ids = await windowed(list(range(n)), lambda _: client.submit(SERVICE, body), window)
        submitted = time.time()
        replies = await windowed(ids, client.result, window)
        end, cpu = time.time(), time.process_time() - cpu0
        if any(reply != [body] for reply in replies):
            raise SystemExit("a Titanic reply is not the echo of its request")
        result([], start, end, cpu, submitted=submitted)
        await client.disconnect()

    task.react(lambda r: defer.ensureDeferred(main(r)))


#: (role, first argument) pairs that run on the reactor; None: every use of the role
_TWISTED_ROLES = {("broker", "ours"), ("worker", "ours"), ("client", "ours"), ("farm", None),
                  ("inproc", None), ("fserver", None), ("fclient", None), ("tclient", None)}


def install_reactor(role: str, first: str) -> None:
    """Before a role that runs Twisted imports its reactor: the one the run
    asked for (``MDP_BENCH_REACTOR``)."""
    if (role, first) not in _TWISTED_ROLES and (role, None) not in _TWISTED_ROLES:
        return
    if on_uvloop():
        from mdp import uvreactor

        uvreactor.install()


def main(argv: list[str]) -> None:
    role, rest = argv[0], argv[1:]
    install_reactor(role, rest[0] if rest else "")
    options: dict[str, str] = {}
    args = []
    while rest:
        item = rest.pop(0)
        if item.startswith("--"):
            options[item[2:]] = rest.pop(0)
        else:
            args.append(item)
    if role == "broker":
        {"ours": broker_ours, "majortomo": broker_majortomo, "bare": broker_bare}[args[0]](args[1])
    elif role == "worker":
        if args[0] in ("nats", "rabbitmq"):
            from benchmarks import peers

            peers.worker(args[0], args[1])
        elif args[0] == "ours":
            worker_ours(args[1], options.get("dialect", "rfc"), options.get("service", "echo"))
        elif args[0] == "bare":
            worker_bare(args[1])
        elif args[0] == "blocking":
            worker_blocking(args[1], options.get("service", "echo"))
        else:
            worker_majortomo(args[1])
    elif role == "farm":
        farm(args[0], int(args[1]), int(args[2]))
    elif role == "client":
        impl, endpoint, mode = args[0], args[1], args[2]
        n, warmup, size = int(args[3]), int(args[4]), int(args[5])
        if impl in ("nats", "rabbitmq"):
            from benchmarks import peers

            peers.client(impl, endpoint, mode, n, warmup, size, int(args[6]) if len(args) > 6 else 1)
        elif impl == "ours":
            window = int(args[6]) if len(args) > 6 else 1
            client_ours(endpoint, mode, n, warmup, size, window, options.get("dialect", "rfc"),
                        options.get("stamp") == "yes")
        elif impl == "bare":
            client_bare(endpoint, mode, n, warmup, size)
        elif impl == "blocking":
            window = int(args[6]) if len(args) > 6 else 1
            client_blocking(endpoint, mode, n, warmup, size, window)
        else:
            client_majortomo(endpoint, mode, n, warmup, size)
    elif role == "filler":
        filler(args[0], int(args[1]))
    elif role == "fserver":
        freelance_server(args[0])
    elif role == "fclient":
        freelance_client(int(args[0]), int(args[1]), int(args[2]), args[3:])
    elif role == "tclient":
        titanic_client(args[0], int(args[1]), int(args[2]), int(args[3]), int(args[4]),
                       float(args[5]))
    elif role == "inproc":
        inproc(args[0], *map(int, args[1:]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
