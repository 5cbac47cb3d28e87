"""Rows per second through ``mdp.spark.call_service`` on a 2-executor Spark
standalone cluster, against one plain client outside Spark on the same rows.

    python -m benchmarks.spark [--rows 200000] [--repeat 3] [--smoke] [--local]
                               [--reactor uvloop|epoll] [--executor-java-options OPTIONS]

Everything on 127.0.0.1, in one run:

* our broker and 4 echo workers (separate processes, ZeroMQ);
* a Spark standalone cluster started here: one Master and 2 Workers of 1 core
  and 1 GiB each (``spark-class`` subprocesses, each in its own session, ports
  and web UIs on ports the OS picks, the Master's REST server off, work and
  local dirs in a temporary directory), and a driver with one 1-core executor
  per Worker; ``--local`` uses ``local[2]`` instead, with no cluster;
* the rows: *rows* 16-byte strings, a DataFrame of 2 partitions, cached.

Each round (``--repeat``, default 3) times, once each: a plain client process
(our Twisted client; it, the broker and the workers run on ``--reactor``: uvloop
by default where it is installed)
sending the rows with 64 requests in flight, the same client stamping each request
(the keyed mode's baseline), then a Spark job for each of
:data:`MODES` sending them (``call_service(df, "echo", endpoint, window=64)``, the
same through ``service_column``, and ``call_service`` with ``keyCol``), checking
every reply is its row's value; each phase's CPU per 1,000 rows is measured too.
The cluster, the session and the executors (warmed up with a small call, then a
whole job of each mode) are shared by all rounds, and each round starts with
another mode.  The figure is the
median over rounds of the ratio Spark / plain client; the goal is >= 1.0.
Writes JSON (``benchmarks/results/spark-latest.json``), prints a table.

Every process started here is stopped on the way out, error or Ctrl-C
included: the cluster by signalling every process of its sessions (executors
and PySpark daemons too), the driver's JVM by closing its stdin.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Iterator, Optional

from benchmarks.harness import (
    REACTORS,
    ROOT,
    Processes,
    cpu_seconds,
    default_reactor,
    machine_cpu_seconds,
    use_reactor,
)

WINDOW = 64
SIZE = 16  # bytes per row, as the plain client's requests
GOAL = 1.0
START_TIMEOUT = 120.0


# --- the standalone cluster ---------------------------------------------------

def _spark_class() -> str:
    import pyspark

    return os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")


def _session_members(sid: int) -> dict[int, int]:
    """The live (non-zombie) processes of session *sid*: pid -> process group."""
    members = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            members[int(entry)] = int(fields[2])
    return members


def _stop_session(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM every process group of *proc*'s session (it was started with
    ``start_new_session``, so that is the JVM, the executors it launched and
    their PySpark daemons, which make process groups of their own); SIGKILL
    whatever is left after *grace* seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in set(_session_members(proc.pid).values()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10.0)
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
            if proc.poll() is not None and not _session_members(proc.pid):
                return
    proc.wait(timeout=10)


class StandaloneCluster:
    """A Spark standalone Master and *workers* Workers on 127.0.0.1, as
    subprocesses; a context manager that stops all of them on exit."""

    def __init__(self, workers: int = 2, cores: int = 1, memory: str = "1g",
                 timeout: float = START_TIMEOUT) -> None:
        self.workers, self.cores, self.memory, self.timeout = workers, cores, memory, timeout
        self.procs: list[tuple[subprocess.Popen, str]] = []
        self.dir = ""
        self.url = ""
        self.ui_port = 0

    def __enter__(self) -> StandaloneCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _env(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH")
        return {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOCAL_HOSTNAME": "127.0.0.1",
                "SPARK_LOCAL_DIRS": os.path.join(self.dir, "local"),
                "SPARK_WORKER_DIR": os.path.join(self.dir, "work"),
                "SPARK_LOG_DIR": os.path.join(self.dir, "logs"),
                "SPARK_CONF_DIR": os.path.join(self.dir, "conf"),
                "PYSPARK_PYTHON": sys.executable,
                # the executors' Python workers import mdp from this checkout
                "PYTHONPATH": ROOT + (os.pathsep + path if path else "")}

    def _spawn(self, name: str, *args: str) -> tuple[subprocess.Popen, str]:
        log = os.path.join(self.dir, "logs", f"{name}.log")
        with open(log, "wb") as out:
            proc = subprocess.Popen([_spark_class(), *args], cwd=self.dir, env=self._env(),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append((proc, log))
        return proc, log

    def _wait_log(self, proc: subprocess.Popen, log: str, pattern: str, deadline: float) -> re.Match:
        while True:
            with open(log, encoding="utf-8", errors="replace") as f:
                match = re.search(pattern, f.read())
            if match:
                return match
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[1:3]} exited ({proc.returncode}):\n{self._tail(log)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {pattern!r} in {log} within {self.timeout}s:\n{self._tail(log)}")
            time.sleep(0.1)

    @staticmethod
    def _tail(log: str, lines: int = 20) -> str:
        with open(log, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def state(self) -> dict[str, Any]:
        """The Master's own view (its web UI's ``/json/``)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return json.load(r)

    def start(self) -> None:
        deadline = time.monotonic() + self.timeout
        self.dir = tempfile.mkdtemp(prefix="mdp-spark-bench-")
        for sub in ("local", "work", "logs", "conf"):
            os.mkdir(os.path.join(self.dir, sub))
        props = os.path.join(self.dir, "conf", "cluster.properties")
        with open(props, "w", encoding="ascii") as f:
            f.write("spark.master.rest.enabled false\n")  # else it binds port 6066
        master, log = self._spawn("master", "org.apache.spark.deploy.master.Master",
                                  "--host", "127.0.0.1", "--port", "0", "--webui-port", "0",
                                  "--properties-file", props)
        self.url = self._wait_log(master, log, r"Starting Spark master at (spark://\S+)",
                                  deadline).group(1)
        self.ui_port = int(self._wait_log(master, log, r"Bound MasterWebUI to .* at http://\S+:(\d+)",
                                          deadline).group(1))
        self._wait_log(master, log, r"New state: ALIVE", deadline)
        for n in range(self.workers):
            self._spawn(f"worker-{n}", "org.apache.spark.deploy.worker.Worker",
                        "--host", "127.0.0.1", "--port", "0", "--webui-port", "0",
                        "--cores", str(self.cores), "--memory", self.memory,
                        "--work-dir", os.path.join(self.dir, "work"),
                        "--properties-file", props, self.url)
        while True:
            for proc, wlog in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[1:3]} exited ({proc.returncode}):\n"
                                       f"{self._tail(wlog)}")
            with contextlib.suppress(OSError, ValueError):
                if self.state().get("aliveworkers", 0) >= self.workers:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.workers} workers not registered with {self.url} "
                                   f"within {self.timeout}s")
            time.sleep(0.2)

    def close(self) -> None:
        try:
            for proc, _ in reversed(self.procs):
                _stop_session(proc)
        finally:
            self.procs.clear()
            if self.dir:
                shutil.rmtree(self.dir, ignore_errors=True)


# --- the driver -----------------------------------------------------------------

@contextlib.contextmanager
def spark_session(master: str, executors: int, java_options: str = "") -> Iterator[Any]:
    """A SparkSession on *master*, once *executors* executors are registered
    (their JVMs started with *java_options*, if any); stopped on exit, and the
    driver's JVM too if this started it."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if SparkContext._active_spark_context is not None:
        raise RuntimeError("a SparkContext is already running in this process; stop it first")
    own_gateway = SparkContext._gateway is None
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = (SparkSession.builder.master(master).appName("mdp-spark-bench")
               .config("spark.ui.enabled", "false")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.executorEnv.PYTHONPATH", ROOT))
    if java_options:
        builder = builder.config("spark.executor.extraJavaOptions", java_options)
    if master.startswith("spark://"):
        builder = (builder.config("spark.executor.cores", "1")
                   .config("spark.cores.max", str(executors))
                   .config("spark.executor.memory", "1g"))
    spark = None
    try:
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        if master.startswith("spark://"):
            tracker = spark.sparkContext._jsc.sc().statusTracker()
            deadline = time.monotonic() + START_TIMEOUT
            while len(tracker.getExecutorInfos()) - 1 < executors:  # the driver is listed too
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{executors} executors not up within {START_TIMEOUT}s")
                time.sleep(0.2)
        yield spark
    finally:
        try:
            if spark is not None:
                spark.stop()
        finally:
            gateway = SparkContext._gateway
            if own_gateway and gateway is not None:
                _stop_gateway(gateway)
                SparkContext._gateway = None
                SparkContext._jvm = None


def _stop_gateway(gateway: Any) -> None:
    """The driver's JVM exits when its stdin closes."""
    proc = getattr(gateway, "proc", None)
    with contextlib.suppress(Exception):
        gateway.shutdown()
    if proc is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# --- the benchmark -----------------------------------------------------------------

def _plain_round(procs: Processes, endpoint: str, rows: int, stamped: bool = False) -> float:
    client = procs.start("client", "ours", endpoint, "pipelined", str(rows), "200", str(SIZE),
                         str(WINDOW), *(["--stamp", "yes"] if stamped else []))
    client.ready(timeout=120)
    client.go()
    plain = client.result(timeout=900)
    client.kill()
    return plain["end"] - plain["start"]


def _kind(pid: int, servers: list[int]) -> str:
    """What a process is, for the CPU table: ours, Spark's JVMs, Spark's
    Python workers, this driver, or anything else on the machine."""
    if pid == servers[0]:
        return "broker"
    if pid in servers:
        return "workers"
    if pid == os.getpid():
        return "driver (Python)"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "other"
    if argv and argv[0].endswith(b"java"):
        if b"org.apache.spark.executor.CoarseGrainedExecutorBackend" in argv:
            return "Spark executor JVMs"
        if b"org.apache.spark.deploy.SparkSubmit" in argv:
            return "Spark driver JVM"
        return "Spark JVMs"  # the cluster's Master and Workers
    if any(b"pyspark" in a for a in argv):
        return "Spark Python workers"
    if b"benchmarks.roles" in argv and b"client" in argv:
        return "plain client"
    return "other"


def _process_cpu() -> dict[int, float]:
    """CPU seconds of every process there is (what can be read)."""
    seconds = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                seconds[int(name)] = cpu_seconds(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return seconds


def _measured(phase: Any, servers: list[int], rows: int, *args: Any) -> tuple[float, dict[str, Any]]:
    """Run *phase* (which returns its seconds); with where the machine's CPU
    went meanwhile: ms per 1,000 rows for the broker and workers
    (*servers*: broker first), for the whole machine, and by kind of process
    (processes that ended meanwhile are in the machine's figure only), and
    the share of the machine's cores that was busy."""
    before = _process_cpu()
    busy0, idle0 = machine_cpu_seconds()
    seconds = phase(*args)
    busy1, idle1 = machine_cpu_seconds()
    after = _process_cpu()
    per1k = 1e6 / rows
    kinds: dict[str, float] = {}
    for pid, cpu in after.items():
        kind = _kind(pid, servers)
        kinds[kind] = kinds.get(kind, 0.0) + (cpu - before.get(pid, 0.0)) * per1k
    busy = busy1 - busy0
    return seconds, {
        "broker_ms_per_1k": kinds.get("broker", 0.0),
        "workers_ms_per_1k": kinds.get("workers", 0.0),
        "machine_ms_per_1k": busy * per1k,
        "by_kind_ms_per_1k": {k: round(v, 1) for k, v in sorted(kinds.items()) if v >= 0.5},
        "busy_share": busy / max(busy + idle1 - idle0, 1e-9),
    }


def _rows_frame(spark: Any, rows: int) -> Any:
    return spark.range(rows, numPartitions=2).selectExpr(
        "id", f"lpad(cast(id as string), {SIZE}, 'x') as value")


def _with_replies(mode: str, df: Any, endpoint: str) -> Any:
    """*df* with a ``reply`` column, called as *mode* (one of :data:`MODES`)."""
    from mdp.spark import call_service, service_column

    if mode == "service_column":
        return df.withColumn("reply", service_column("echo", endpoint, window=WINDOW)(df.value))
    keyed = {"keyCol": "id"} if mode == "call_service keyed" else {}
    return call_service(df, "echo", endpoint, window=WINDOW, **keyed)


#: how the Spark rounds call the service: the DataFrame function, the column function, and
#: the DataFrame function stamping each row from a key column (as for exactly-once streaming)
MODES = ("call_service", "service_column", "call_service keyed")
#: the Spark phase's CPU per row (JVMs, Python workers, clients) against the plain client's
CPU_GOAL = 1.1
#: the keyed mode's requests are stamped: it is compared with a plain client that stamps its own
STAMPED = ("call_service keyed",)


def _spark_round(df: Any, endpoint: str, rows: int, mode: str = "call_service") -> float:
    started = time.monotonic()
    replies, echoed = _with_replies(mode, df, endpoint).selectExpr(
        "count(reply)", "sum(cast(reply = cast(value as binary) as int))").first()
    elapsed = time.monotonic() - started
    if not replies == echoed == rows:
        raise RuntimeError(f"Spark job: {replies} replies, {echoed} echoes, for {rows} rows")
    return elapsed


def run(rows: int, repeat: int, local: bool = False,
        executor_java_options: str = "") -> dict[str, Any]:
    """Run the benchmark; return the report (what main() writes as JSON)."""
    if rows < 1 or repeat < 1:
        raise ValueError(f"rows and repeat must be at least 1, got {rows}, {repeat}")
    executors = 2
    setup: dict[str, float] = {}
    rounds = []
    with contextlib.ExitStack() as stack:
        procs = stack.enter_context(Processes())
        broker = procs.start("broker", "ours", "zmq:tcp://127.0.0.1:*")
        endpoint = broker.ready()
        workers = [procs.start("worker", "ours", endpoint) for _ in range(4)]
        for worker in workers:
            worker.ready()

        t0 = time.monotonic()
        if local:
            master = f"local[{executors}]"
        else:
            master = stack.enter_context(StandaloneCluster(workers=executors, cores=1,
                                                           memory="1g")).url
            setup["cluster_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        spark = stack.enter_context(spark_session(master, executors, executor_java_options))
        setup["session_s"] = time.monotonic() - t1

        from mdp.spark import call_service

        t2 = time.monotonic()
        df = _rows_frame(spark, rows).cache()
        if df.count() != rows:
            raise RuntimeError("cached DataFrame lost rows")
        # warm up every executor: its Python worker, mdp's import, its client
        warm = call_service(_rows_frame(spark, 2_000), "echo", endpoint, window=WINDOW)
        if warm.selectExpr("count(reply)").first()[0] != 2_000:
            raise RuntimeError("warm-up call lost replies")
        for mode in MODES:  # and each mode's whole job once: the JVMs' JIT, as in a long-lived job
            _spark_round(df, endpoint, rows, mode)
        setup["cache_and_warmup_s"] = time.monotonic() - t2

        servers = [broker.proc.pid] + [w.proc.pid for w in workers]
        for n in range(repeat):
            load = os.getloadavg()[0]  # other processes on this machine skew both timings
            plain_s, plain_cpu = _measured(_plain_round, servers, rows, procs, endpoint, rows)
            _, stamped_cpu = _measured(_plain_round, servers, rows, procs, endpoint, rows, True)
            modes = {}
            for mode in MODES[n % len(MODES):] + MODES[:n % len(MODES)]:  # each round starts elsewhere
                seconds, cpu = _measured(_spark_round, servers, rows, df, endpoint, rows, mode)
                baseline = stamped_cpu if mode in STAMPED else plain_cpu
                modes[mode] = {"s": seconds, "rows_per_s": rows / seconds, "cpu": cpu,
                               "cpu_ratio": cpu["machine_ms_per_1k"] / baseline["machine_ms_per_1k"]}
            spark_s, spark_cpu = modes["call_service"]["s"], modes["call_service"]["cpu"]
            rounds.append({"plain_client_s": plain_s, "spark_s": spark_s,
                           "plain_client_rows_per_s": rows / plain_s,
                           "spark_rows_per_s": rows / spark_s, "ratio": plain_s / spark_s,
                           "plain_cpu": plain_cpu, "plain_stamped_cpu": stamped_cpu,
                           "spark_cpu": spark_cpu, "modes": modes,
                           "load_1min_before": load})
            print(f"round {n + 1}/{repeat}: plain {rows / plain_s:,.0f} rows/s, "
                  f"Spark {rows / spark_s:,.0f} rows/s, ratio {plain_s / spark_s:.2f}; "
                  f"CPU ms per 1k rows: plain {plain_cpu['machine_ms_per_1k']:.0f}, "
                  f"Spark {spark_cpu['machine_ms_per_1k']:.0f} {spark_cpu['by_kind_ms_per_1k']}; "
                  + ", ".join(f"{mode} {m['cpu']['machine_ms_per_1k']:.0f}" for mode, m in modes.items()),
                  file=sys.stderr, flush=True)

    ratio = statistics.median(r["ratio"] for r in rounds)
    return {
        "rows": rows, "repeat": repeat, "window": WINDOW, "row_bytes": SIZE,
        "echo_workers": 4, "partitions": 2,
        "spark": (f"local[{executors}]" if local else
                  f"standalone, {executors} workers x 1 core, 1 executor each"),
        "executor_java_options": executor_java_options,
        "setup": setup,
        "rounds": rounds,
        "plain_client_rows_per_s": statistics.median(r["plain_client_rows_per_s"] for r in rounds),
        "spark_rows_per_s": statistics.median(r["spark_rows_per_s"] for r in rounds),
        "ratio": ratio,
        "goal": {"ratio_at_least": GOAL, "cpu_ratio_at_most": CPU_GOAL},
        "met": ratio >= GOAL,
        "cpu_ratio": {mode: statistics.median(r["modes"][mode]["cpu_ratio"] for r in rounds)
                      for mode in MODES},
    }


def table(report: dict[str, Any]) -> str:
    lines = [f"{report['rows']:,} rows, window {report['window']}, Spark: {report['spark']}", "",
             "| round | plain client rows/s | Spark call_service rows/s | Spark / plain "
             "| CPU ms per 1k rows, plain: broker / workers / machine (busy) "
             "| same, Spark |",
             "|---:|---:|---:|---:|---|---|"]

    def cpu(c: dict[str, float]) -> str:
        return (f"{c['broker_ms_per_1k']:.0f} / {c['workers_ms_per_1k']:.0f} / "
                f"{c['machine_ms_per_1k']:.0f} ({c['busy_share']:.0%})")

    for n, r in enumerate(report["rounds"], 1):
        lines.append(f"| {n} | {r['plain_client_rows_per_s']:,.0f} | {r['spark_rows_per_s']:,.0f} "
                     f"| {r['ratio']:.2f} | {cpu(r['plain_cpu'])} | {cpu(r['spark_cpu'])} |")
    lines.append(f"| median | {report['plain_client_rows_per_s']:,.0f} "
                 f"| {report['spark_rows_per_s']:,.0f} | {report['ratio']:.2f} | | |")
    goal = report["goal"]["ratio_at_least"]
    lines.append(f"\nSpark / plain client: {report['ratio']:.2f} "
                 f"(goal >= {goal}: {'met' if report['met'] else 'NOT met'})")
    rounds = report["rounds"]
    phases = {"plain client": [r["plain_cpu"] for r in rounds]}
    if all("plain_stamped_cpu" in r for r in rounds):  # (reports before the keyed mode have none)
        phases["plain client, stamped"] = [r["plain_stamped_cpu"] for r in rounds]
    phases.update({mode: [r["modes"][mode]["cpu"] for r in rounds] for mode in report["cpu_ratio"]})
    machine = {phase: statistics.median(c["machine_ms_per_1k"] for c in cpus)
               for phase, cpus in phases.items()}
    lines += ["", "| mode | CPU ms per 1k rows (median) | against the plain client |", "|---|---:|---:|",
              f"| plain client | {machine['plain client']:.0f} | 1.00 |"]
    if "plain client, stamped" in machine:
        lines.append(f"| plain client, stamped (the keyed mode's baseline) "
                     f"| {machine['plain client, stamped']:.0f} | |")
    for mode, ratio in report["cpu_ratio"].items():
        lines.append(f"| Spark, {mode} | {machine[mode]:.0f} | {ratio:.2f} |")
    lines.append(f"\nCPU per row goal: at most {report['goal']['cpu_ratio_at_most']}x the plain client")
    kinds = sorted({k for cpus in phases.values() for c in cpus for k in c["by_kind_ms_per_1k"]})
    lines += ["", "Where it goes, CPU ms per 1k rows (median; the plain client's own process is in "
              "the machine's figure only, as it ends before it is read):", "",
              "| phase | " + " | ".join(kinds) + " | machine |", "|---|" + "---:|" * (len(kinds) + 1)]
    for phase, cpus in phases.items():
        cells = [statistics.median(c["by_kind_ms_per_1k"].get(k, 0.0) for c in cpus) for k in kinds]
        lines.append(f"| {phase} | " + " | ".join(f"{v:.1f}" for v in cells) + f" | {machine[phase]:.0f} |")
    return "\n".join(lines)


def _terminate(signum: int, frame: Optional[Any]) -> None:
    raise SystemExit(128 + signum)  # unwinds through every cleanup


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spark")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--smoke", action="store_true", help="2,000 rows, 1 round")
    parser.add_argument("--local", action="store_true", help="local[2] instead of a cluster")
    parser.add_argument("--reactor", choices=REACTORS, default=default_reactor(),
                        help="the reactor of the broker, the workers and the plain client, "
                             "as in python -m benchmarks")
    parser.add_argument("--executor-java-options", default="", metavar="OPTIONS",
                        help="JVM options of the cluster's executors "
                             "(spark.executor.extraJavaOptions; with --local there are none), "
                             "e.g. '-XX:TieredStopAtLevel=1 -XX:+UseSerialGC'")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results",
                                                       "spark-latest.json"))
    args = parser.parse_args(argv)
    use_reactor(args.reactor)
    rows, repeat = (2_000, 1) if args.smoke else (args.rows, args.repeat)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        report = run(rows, repeat, local=args.local,
                     executor_java_options=args.executor_java_options)
    finally:
        signal.signal(signal.SIGTERM, previous)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
