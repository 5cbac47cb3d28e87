"""Three hosts, simulated: network namespaces joined by a bridge with ``tc netem`` latency
(on a kernel without netem, by a switch process that delays each frame), two brokers side
by side, a worker and a Titanic on each of the first two hosts, PostgreSQL (Titanic's
shared store) on the second, and clients on the third. In the middle of a steady load the
first host is cut off (unplugged from the switch).

    sudo .venv/bin/python examples/simulated_hosts.py [--requests 3000] [--titanic 300]
                                                      [--lanes 16] [--latency-ms 2]
                                                      [--heartbeat 0.5] [--logs DIR]

It prints a JSON report: the latency and the round trip measured between hosts, every
request answered (those given up, with why), every Titanic request acknowledged answered,
how many ran twice (the workers share one reply store, as a network share would be, and
requests are stamped, Titanic submits by their client: one whose acknowledgement is lost
with the cut host, stored again under a new id, runs once), the longest wait between two
replies, the requests the brokers carried (Titanic's own and its clients' polls included),
each role's CPU per 1,000 of them, and what it spends with no load (in 2 s before it).
Needs root (``ip netns``), Debian's ``postgresql`` and the ``postgres`` extra."""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
SUBNET = "10.77.0"
PORT = 5555
METRICS_PORT = 9100
IDLE_SECONDS = 2.0


def counted(frames: list[bytes]) -> Any:
    """The workers' handler: after 5 ms, notes the run (``$RUNS/<pid>``) and echoes."""
    from twisted.internet import reactor, task

    def done() -> list[bytes]:
        with open(os.path.join(os.environ["RUNS"], str(os.getpid())), "ab") as runs:
            runs.write(frames[0] + b"\n")
        return [str(os.getpid()).encode(), *frames]

    return task.deferLater(reactor, 0.005, done)


def cpu_seconds(pid: int) -> float:
    """User and system CPU of process *pid* so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=60)


class Hosts:
    """Namespaces ``<tag>-h1`` .. ``-h3`` on a bridge in ``<tag>-sw`` (or, without netem, on a
    delaying switch process); host *n* is SUBNET.n.
    :meth:`build` them; :meth:`remove` takes away whatever was built."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.names = [f"{tag}-h{n}" for n in (1, 2, 3)]
        self.switch = f"{tag}-sw"
        self.latency = "none"
        self.switchProcess: Optional[subprocess.Popen[str]] = None

    def build(self, latencyMs: float) -> None:
        for ns in self.names:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        if latencyMs and not self._hasNetem():
            self._switchInUserSpace(latencyMs)
            return
        sh("ip", "netns", "add", self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for n, ns in enumerate(self.names, 1):
            host, port = f"{self.tag}h{n}", f"{self.tag}s{n}"
            sh("ip", "link", "add", host, "type", "veth", "peer", "name", port)
            sh("ip", "link", "set", host, "netns", ns)
            sh("ip", "link", "set", port, "netns", self.switch)
            sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{n}/24", "dev", host)
            sh("ip", "-n", ns, "link", "set", host, "up")
            if latencyMs:
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", host, "root",
                   "netem", "delay", f"{latencyMs}ms")
                self.latency = f"{latencyMs} ms each way (tc netem)"

    def _hasNetem(self) -> bool:
        """Whether this kernel has ``tc netem`` (tried on a host's loopback, then taken off)."""
        ns = self.names[0]
        added = sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                   "delay", "1ms", check=False)
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
        return added.returncode == 0

    def _switchInUserSpace(self, latencyMs: float) -> None:
        """Without netem: one TAP per host, all held by a switch process that delays each frame."""
        self.switchProcess = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "switch", self.tag, str(latencyMs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        said = self.switchProcess.stdout.readline() if self.switchProcess.stdout else ""
        if said.strip() != "switching":
            raise RuntimeError(f"the delaying switch did not start: {said.strip()!r}")
        self.latency = f"{latencyMs} ms each way (a switch that delays each frame: no tc netem here)"

    def roundTrip(self, host: int, address: str, port: int) -> float:
        """From host *host*, the median time in ms of five TCP connects to *address*:*port*."""
        timed = ("import socket, statistics, time\n"
                 "def once():\n"
                 "    started = time.perf_counter()\n"
                 f"    socket.create_connection(({address!r}, {port}), 5).close()\n"
                 "    return time.perf_counter() - started\n"
                 "print(statistics.median(once() for _ in range(5)) * 1000)")
        return round(float(self.python(host, timed)), 2)

    def requestsCarried(self, n: int) -> int:
        """The requests the broker on host *n* has received (``mdp_broker_requests_total``)."""
        scrape = ("import urllib.request\n"
                  f"print(urllib.request.urlopen('http://{SUBNET}.{n}:{METRICS_PORT}/metrics', "
                  "timeout=5).read().decode())")
        counts = [float(line.rsplit(" ", 1)[1]) for line in self.python(n, scrape).splitlines()
                  if line.startswith("mdp_broker_requests_total")]
        if not counts:
            raise RuntimeError(f"broker {n}'s metrics have no mdp_broker_requests_total")
        return int(sum(counts))

    def python(self, host: int, code: str) -> str:
        """What Python *code* run on host *host* prints."""
        return sh("ip", "netns", "exec", self.names[host - 1], sys.executable, "-c", code).stdout

    def checkSwitch(self) -> None:
        """A RuntimeError if the delaying switch has exited (the hosts are apart)."""
        if self.switchProcess is not None and self.switchProcess.poll() is not None:
            raise RuntimeError(f"the delaying switch exited ({self.switchProcess.returncode})")

    def cut(self, n: int) -> None:
        """Unplug host *n* from the switch."""
        if self.switchProcess is not None and self.switchProcess.stdin is not None:
            self.checkSwitch()
            self.switchProcess.stdin.write(f"cut {n}\n")
            self.switchProcess.stdin.flush()
        else:
            sh("ip", "-n", self.switch, "link", "set", f"{self.tag}s{n}", "down")

    def remove(self) -> None:
        if self.switchProcess is not None:
            self.switchProcess.kill()  # (its TAPs go with it)
            self.switchProcess.communicate()  # (and closes the pipes)
        for ns in [*self.names, self.switch]:  # (a veth goes with its namespace)
            sh("ip", "netns", "del", ns, check=False)
        for n in (1, 2, 3):  # one made but not yet moved into its namespace
            sh("ip", "link", "del", f"{self.tag}h{n}", check=False)


def switch(tag: str, latencyMs: float) -> None:
    """The switch behind :meth:`Hosts._switchInUserSpace`: makes TAP ``<tag>t<n>`` for host
    *n*, moves it into the host's namespace, then forwards each frame *latencyMs* after it
    came (a learning switch). ``cut N`` on standard input unplugs host N; end of input stops."""
    import fcntl
    import select
    import struct
    from collections import deque

    ports: list[int] = []
    for n in (1, 2, 3):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        tunsetiff, tapWithoutHeader = 0x400454CA, 0x1002
        fcntl.ioctl(fd, tunsetiff, struct.pack("16sH22x", f"{tag}t{n}".encode(), tapWithoutHeader))
        ports.append(fd)
        ns = f"{tag}-h{n}"
        sh("ip", "link", "set", f"{tag}t{n}", "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{n}/24", "dev", f"{tag}t{n}")
        sh("ip", "-n", ns, "link", "set", f"{tag}t{n}", "up")
    print("switching", flush=True)
    delay = latencyMs / 1000
    where: dict[bytes, int] = {}  # (a MAC address: the port it was last seen on)
    cut: set[int] = set()
    due: deque[tuple[float, int, bytes]] = deque()  # (when, the port it came in on, frame)
    while True:
        wait = max(0.0, due[0][0] - time.monotonic()) if due else None
        readable, _, _ = select.select([0, *ports], [], [], wait)
        for source in readable:
            if source == 0:
                said = os.read(0, 4096)
                if not said:
                    return
                cut.update(int(words[1]) - 1 for words in map(str.split, said.decode().splitlines())
                           if words[:1] == ["cut"] and words[1:2] in (["1"], ["2"], ["3"]))
                continue
            port = ports.index(source)
            try:
                while True:  # (all that is waiting on this port)
                    frame = os.read(source, 65536)
                    if port not in cut:
                        where[frame[6:12]] = port
                        due.append((time.monotonic() + delay, port, frame))
            except BlockingIOError:
                pass
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, came, frame = due.popleft()
            to = where.get(frame[:6])
            for port in [to] if to is not None and not frame[0] & 1 else range(len(ports)):
                if port != came and port not in cut:
                    try:
                        os.write(ports[port], frame)
                    except OSError:
                        pass  # (a host whose link is down; a full queue: a frame lost)


class Run:
    """The processes of one simulation, their logs in *scratch*."""

    def __init__(self, hosts: Hosts, scratch: str) -> None:
        self.hosts, self.scratch = hosts, scratch
        self.procs: list[subprocess.Popen[bytes]] = []
        self.byName: dict[str, subprocess.Popen[bytes]] = {}
        self.database: Optional[subprocess.Popen[bytes]] = None
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)]),
                    "RUNS": os.path.join(scratch, "runs")}
        os.mkdir(self.env["RUNS"])

    def start(self, host: int, name: str, *argv: str, user: Optional[str] = None) -> subprocess.Popen[bytes]:
        command = ["ip", "netns", "exec", self.hosts.names[host - 1]]
        if user is not None:
            command += ["runuser", "-u", user, "--"]
        with open(os.path.join(self.scratch, f"{name}.log"), "wb") as log:
            proc = subprocess.Popen([*command, *argv], stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env, start_new_session=True)
        self.procs.append(proc)
        self.byName[name] = proc
        return proc

    def waitFor(self, names: str | list[str], marker: str, count: int = 1,
                timeout: float = 20.0) -> None:
        """Until *marker* is *count* times in the logs of *names* (one process or several)."""
        names = [names] if isinstance(names, str) else names
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = 0
            for name in names:
                with open(os.path.join(self.scratch, f"{name}.log"), "rb") as log:
                    found += log.read().count(marker.encode())
                proc = self.byName.get(name)
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) before {marker!r}")
            if found >= count:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{' and '.join(names)}: {marker!r} not {count} times within {timeout} s")

    def stop(self) -> None:
        for proc in self.procs:  # (PostgreSQL's SIGTERM waits for its clients: SIGINT does not)
            self._signal(proc, signal.SIGINT if proc is self.database else signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(8)
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                proc.wait(8)

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], signum: int) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass  # (it ended meanwhile)


def postgres(run: Run, host: int) -> str:
    """A PostgreSQL server on *host*, listening on its address; its URL."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                   key=lambda p: int(p.split("/")[-3]) if p.split("/")[-3].isdigit() else 0)
    on_path = shutil.which("postgres")
    if not found and on_path is None:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
    pgbin = os.path.dirname(found[-1] if found else on_path)
    data = os.path.join(run.scratch, "pg")
    os.mkdir(data, 0o700)
    shutil.chown(data, "postgres")
    secret = os.path.join(run.scratch, "pgpass")
    with open(secret, "w") as f:
        f.write("titanic\n")
    shutil.chown(secret, "postgres")
    sh("runuser", "-u", "postgres", "--", f"{pgbin}/initdb", "-D", data, "-U", "titanic",
       "--auth=scram-sha-256", f"--pwfile={secret}", "--no-sync")
    with open(os.path.join(data, "pg_hba.conf"), "a") as hba:
        hba.write(f"host all all {SUBNET}.0/24 scram-sha-256\n")
    run.database = run.start(host, "postgres", f"{pgbin}/postgres", "-D", data, "-k", data,
              "-c", f"listen_addresses={SUBNET}.{host}", "-c", "fsync=off", user="postgres")
    run.waitFor("postgres", "ready to accept connections")
    return f"postgresql://titanic:titanic@{SUBNET}.{host}/postgres"


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    hosts = Hosts(f"mdp{os.getpid()}")  # (interface names of 15 characters at most)
    scratch = tempfile.mkdtemp(prefix="mdp-hosts-")
    os.chmod(scratch, 0o755)
    run = Run(hosts, scratch)
    heartbeat = ["--heartbeat", str(args.heartbeat), "--liveness", "4"]
    brokers = [f"tcp:{SUBNET}.{n}:{PORT}" for n in (1, 2)]
    twist = [os.path.join(BIN, "twist"), "--log-format", "text"]
    try:
        hosts.build(args.latency_ms)
        url = postgres(run, 2)
        for n in (1, 2):
            run.start(n, f"broker{n}", *twist, "mdp-broker", "--endpoint",
                      f"tcp:{PORT}:interface={SUBNET}.{n}", "--metrics",
                      f"tcp:{METRICS_PORT}:interface={SUBNET}.{n}", *heartbeat)
        for n in (1, 2):
            run.waitFor(f"broker{n}", "MDP broker listening on")
            run.start(n, f"worker{n}", *twist, "mdp-worker", *(o for b in brokers for o in ("--broker", b)),
                      "--attach", "all", "--concurrency", "4", "--service", "work", "--handler",
                      "simulated_hosts:counted", "--reply-db", os.path.join(scratch, "replies.db"),
                      *heartbeat, "--backoff-max", "1")
            run.start(n, f"titanic{n}", *twist, "mdp-titanic", "--broker", brokers[n - 1], "--db", url,
                      "--stamp", "--lease", "3", "--concurrency", "4", "--timeout", "2",
                      "--backoff-max", "1", *heartbeat)
        # (each worker session registered: one that found its broker slow to answer on a busy
        # machine registers with the other, so the two brokers' READY lines are counted together)
        run.waitFor(["broker1", "broker2"], "ready for work", 8)
        roundTrip = hosts.roundTrip(3, f"{SUBNET}.1", PORT)
        for n in (1, 2):
            run.waitFor(f"titanic{n}", "Titanic started")
        roles = {role: [run.byName[f"{role}{n}"].pid for n in (1, 2)]
                 for role in ("broker", "worker", "titanic")}
        idleFrom = {role: sum(map(cpu_seconds, pids)) for role, pids in roles.items()}
        time.sleep(IDLE_SECONDS)  # (what each role costs with no load: heartbeats, polling)
        cpuBefore = {role: sum(map(cpu_seconds, pids)) for role, pids in roles.items()}
        idle = {role: (cpuBefore[role] - idleFrom[role]) / IDLE_SECONDS for role in roles}
        carriedBefore = sum(hosts.requestsCarried(n) for n in (1, 2))
        loadStarted = time.monotonic()
        client = run.start(3, "client", sys.executable, os.path.abspath(__file__), "client",
                           str(args.requests), str(args.titanic), str(args.lanes), *brokers)
        run.waitFor("client", "half answered", timeout=30)
        hosts.cut(1)
        client.wait(40)
        hosts.checkSwitch()
        cpu = {role: sum(map(cpu_seconds, pids)) - cpuBefore[role] for role, pids in roles.items()}
        carried = sum(hosts.requestsCarried(n) for n in (1, 2)) - carriedBefore
        loadSeconds = time.monotonic() - loadStarted
        with open(os.path.join(scratch, "client.log")) as log:
            said = log.read()
        try:
            report = json.loads(said.rstrip().splitlines()[-1])
        except (IndexError, ValueError):
            raise RuntimeError(f"the client ended ({client.returncode}) without a report:\n"
                               + said[-4000:]) from None
        runs: dict[bytes, int] = {}
        for path in glob.glob(os.path.join(run.env["RUNS"], "*")):
            with open(path, "rb") as f:
                for key in f.read().splitlines():
                    runs[key] = runs.get(key, 0) + 1
        twice = sorted(key.decode() for key, count in runs.items() if count > 1)
        report.update(latency=hosts.latency, roundTripMs=roundTrip,
                      heartbeatExpiry=args.heartbeat * 4, ran=sum(runs.values()),
                      carried=carried, carriedPerSecond=round(carried / loadSeconds),
                      idleCores={role: round(cores, 4) for role, cores in idle.items()},
                      cpuMsPer1k={role: round(seconds / carried * 1e6, 1)
                                  for role, seconds in [*cpu.items(), ("client", report.pop("cpu"))]},
                      cpuMsPer1kBeyondIdle={
                          role: round((seconds - idle[role] * loadSeconds) / carried * 1e6, 1)
                          for role, seconds in cpu.items()},
                      ranTwice=sum(1 for key in twice if key.startswith("r-")),
                      titanicRanTwice=sum(1 for key in twice if key.startswith("t-")), twice=twice[:10])
        return report
    finally:
        try:
            run.stop()
        finally:
            try:
                hosts.remove()
            finally:
                if args.logs:
                    os.makedirs(args.logs, exist_ok=True)
                    for path in glob.glob(os.path.join(scratch, "*.log")):
                        shutil.copy(path, args.logs)
                shutil.rmtree(scratch, ignore_errors=True)


def client(requests: int, titanic: int, lanes: int, brokers: list[str]) -> None:
    """On host 3: *requests* stamped requests, *lanes* out at a time, spread over the brokers, and
    *titanic* Titanic requests; prints ``half answered`` midway and a JSON report at the end."""
    from twisted.internet import defer, task

    from mdp import SpreadClient
    from mdp.titanic import TitanicClient

    async def main(reactor: Any) -> None:
        spread = SpreadClient(brokers, reactor, timeout=0.5, retries=30)
        titan = TitanicClient(brokers, reactor, timeout=1.0, retries=15, pollInterval=0.2,
                              stamp=True)
        cpuStarted = time.process_time()
        answered: list[float] = []
        acked: list[tuple[str, bytes]] = []
        wrong: list[Any] = []
        failed: list[str] = []  # (requests and submits that failed, why and when)
        started = time.time()
        left = iter(range(requests))

        async def lane() -> None:
            for n in left:
                body = b"r-%d" % n
                try:
                    reply = await spread.request("work", body)
                except Exception as e:
                    failed.append(f"{body.decode()}: {e!r} at {time.time() - started:.2f} s")
                    continue
                answered.append(time.time())
                if reply[1:] != [body]:
                    wrong.append(n)
                if len(answered) == requests // 2:
                    print("half answered", flush=True)

        async def submit() -> None:
            for n in range(titanic):
                body = b"t-%d" % n
                try:
                    acked.append((await titan.submit("work", body), body))
                except Exception as e:
                    failed.append(f"{body.decode()}: {e!r} at {time.time() - started:.2f} s")
                await task.deferLater(reactor, 0.03, lambda: None)  # (through the cut)

        await defer.gatherResults([defer.ensureDeferred(lane()) for _ in range(lanes)] +
                                  [defer.ensureDeferred(submit())])
        results = await defer.DeferredList(
            [titan.result(requestId).addTimeout(20, reactor) for requestId, _ in acked],
            consumeErrors=True)
        wrongTitanic = [body for (_, body), (ok, reply) in zip(acked, results)
                        if not ok or reply[1:] != [body]]
        failed.extend(f"{body.decode()} ({requestId}): {reply.value!r}"
                      for (requestId, body), (ok, reply) in zip(acked, results) if not ok)
        gaps = [b - a for a, b in zip(answered, answered[1:])]
        print(json.dumps({"requests": requests, "answered": len(answered), "wrong": len(wrong),
                          "titanicAcknowledged": len(acked),
                          "titanicAnswered": sum(1 for ok, _ in results if ok),
                          "titanicWrong": len(wrongTitanic), "longestGap": max(gaps or [0.0]),
                          "failed": failed[:10], "cpu": time.process_time() - cpuStarted,
                          "sent": dict(spread.sent)}), flush=True)
        await spread.close()
        await titan.client.close()

    task.react(lambda reactor: defer.ensureDeferred(main(reactor)))


def main(argv: list[str]) -> None:
    if argv[:1] == ["client"]:
        client(int(argv[1]), int(argv[2]), int(argv[3]), argv[4:])
        return
    if argv[:1] == ["switch"]:
        switch(argv[1], float(argv[2]))
        return
    parser = argparse.ArgumentParser(prog="simulated_hosts.py")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--titanic", type=int, default=300)
    parser.add_argument("--lanes", type=int, default=16, help="requests out at a time")
    parser.add_argument("--latency-ms", type=float, default=2.0)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument("--logs", metavar="DIR", help="copy each process's log to DIR")
    print(json.dumps(simulate(parser.parse_args(argv)), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
