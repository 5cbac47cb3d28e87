"""Every shell command README.md and docs/*.md show is run by a test, or is
listed here as one that cannot be, with the reason.

What counts as a documented command:

- each command line of a fenced block marked ``sh``, ``shell``, ``bash`` or
  ``console`` (comments and a trailing ``&`` dropped, ``\\`` continuations
  joined); in a block where lines start with ``$ ``, only those are commands
  and the lines after one are its output;
- the lines of an unmarked block that start with ``$ `` (a transcript, as in
  docs/cli.md);
- the synopses of unmarked blocks whose lines start with ``twist`` or ``mdp``
  (docs/cli.md): every option a synopsis shows must be in that command's
  ``--help``.

Each command is in a scenario of :data:`SCENARIOS` (which runs the documented
text itself, with its 127.0.0.1 ports replaced by ports the OS picks and its
placeholders filled in), in :data:`RUN_ELSEWHERE` (another test runs it), or in
:data:`EXCLUDED` (with why it cannot run in a test).  A documented command in
none of them fails :func:`test_every_documented_command_is_covered`; an entry
whose command is no longer in the docs fails
:func:`test_the_tables_name_only_documented_commands`.

Adding a command to the docs means adding it to a scenario (one line in the
``@scenario(...)`` table, and what to check in its body) or to a table.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Awaitable, Callable, Optional

import pytest
import pytest_twisted
from twisted.internet import task

from tests.procs import ENV, Process, reactor, script, wait_until
from tests.test_harmony_netns import namespace  # noqa: F401  (the fixture, for the chat scenario)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGUAGES = {"sh", "shell", "bash", "console"}
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.M | re.S)
_COMMENT = re.compile(r"(^|\s+)#(\s.*)?$")


# --- what the docs show ------------------------------------------------------------------


def normalize(command: str) -> str:
    """One line, single spaces, no trailing ``&``: the form tables use."""
    text = " ".join(command.split())
    return text[:-2] if text.endswith(" &") else text


@dataclass(frozen=True)
class Documented:
    """One command as a page shows it."""

    text: str
    where: str
    output: tuple[str, ...] = ()
    background: bool = False
    synopsis: bool = False


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands(body: str, first: int, name: str, transcript: bool) -> list[Documented]:
    """The commands of one shell block (*first*: the line number of its first line)."""
    found: list[Documented] = []
    lines = body.split("\n")
    i = 0
    while i < len(lines):
        line, number = lines[i], first + i
        i += 1
        if transcript:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        line = _COMMENT.sub("", line).rstrip()
        if not line:
            continue
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + " " + _COMMENT.sub("", lines[i]).strip()
            i += 1
        output: list[str] = []
        while transcript and i < len(lines) and not lines[i].startswith("$ "):
            output.append(lines[i])
            i += 1
        while output and not output[-1].strip():
            output.pop()
        text = " ".join(line.split())
        found.append(Documented(normalize(text), f"{name}:{number}", tuple(output),
                                background=text.endswith(" &")))
    return found


def _synopses(body: str, first: int, name: str) -> list[Documented]:
    """The synopses of an unmarked block whose every unindented line starts
    with ``twist`` or ``mdp`` (indented lines continue the one above)."""
    entries: list[tuple[int, str]] = []
    for offset, line in enumerate(body.split("\n")):
        if not line.strip():
            continue
        if line[0].isspace() and entries:
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
        elif line.split()[0] in ("twist", "mdp"):
            entries.append((first + offset, line))
        else:
            return []
    return [Documented(normalize(text), f"{name}:{number}", synopsis=True) for number, text in entries]


def documented() -> list[Documented]:
    """Every command of README.md and docs/*.md, in page order."""
    found: list[Documented] = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT).as_posix()
        for fence in FENCE.finditer(text):
            language, body = fence.group(1).lower(), fence.group(2)
            first = text.count("\n", 0, fence.start()) + 2
            transcript = any(line.startswith("$ ") for line in body.split("\n"))
            if language in SHELL_LANGUAGES:
                found += _commands(body, first, name, transcript)
            elif not language and transcript:
                found += _commands(body, first, name, True)
            elif not language:
                found += _synopses(body, first, name)
    return found


def shown(command: str) -> Documented:
    """The documented entry of *command*: the first that shows its output,
    else the first, if several pages show it."""
    wanted = normalize(command)
    entries = [entry for entry in documented() if entry.text == wanted]
    if not entries:
        raise AssertionError(f"not in the docs any more: {command}")
    return next((entry for entry in entries if entry.output), entries[0])


# --- running a documented command ----------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """*count* different ports nothing listens on now (127.0.0.1, chosen by the
    OS), for the commands that need literal ones: all are held while chosen, so
    the OS cannot hand out one of them twice."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def free_port() -> int:
    """A port nothing listens on now (see :func:`free_ports`)."""
    return free_ports(1)[0]


def _pattern(old: str) -> re.Pattern[str]:
    """*old* as a whole word: ``ID`` but not ``IDS``, ``:5555`` but not ``:55550``."""
    before = r"(?<![\w.])" if re.match(r"\w", old) else ""
    after = r"(?![\w])" if re.search(r"\w$", old) else ""
    return re.compile(before + re.escape(old) + after)


#: documented program -> what runs it here (this checkout, this venv)
PROGRAMS: dict[str, Callable[[], list[str]]] = {
    "twist": lambda: [script("twist"), "--log-format", "text"],
    "mdp": lambda: [script("mdp")],
    "python": lambda: [sys.executable],
    "python3": lambda: [sys.executable],
    "cat": lambda: [_which("cat")],
    "mkdir": lambda: [_which("mkdir")],
    "cp": lambda: [_which("cp")],
    "openssl": lambda: [_which("openssl")],
    "curl": lambda: _curl(),
}

_GET = ("import sys, urllib.request\n"
        "sys.stdout.write(urllib.request.urlopen(sys.argv[-1], timeout=10).read().decode())\n")


def _curl() -> list[str]:
    """curl where installed, else the same GET in Python (the URL is the last argument)."""
    found = shutil.which("curl")
    return [found] if found else [sys.executable, "-c", _GET]


def _which(program: str) -> str:
    found = shutil.which(program)
    assert found is not None, f"no {program} on PATH"
    return found


@dataclass
class Shell:
    """Runs documented commands as the checkout's programs, in the directory
    *tmp* (files a command makes land there), with the replacements
    registered by :meth:`sub` and :meth:`port`; in the network namespace
    *netns* if given (default ports, beacons: nothing reaches the machine's
    own); stops every process it started in :meth:`stop`."""

    tmp: Path
    netns: Optional[str] = None
    env: dict[str, str] = field(default_factory=lambda: dict(ENV))
    subs: dict[str, str] = field(default_factory=dict)
    procs: list[Process] = field(default_factory=list)

    def sub(self, old: str, new: str) -> None:
        """Replace *old* (a whole word) by *new* in every command from now on."""
        self.subs[old] = new

    def port(self, documented: int) -> int:
        """Replace ``:PORT`` in every command by a free port, one no other
        ``:PORT`` of this shell got; return it."""
        taken = set(self.subs.values())
        port = next(p for p in iter(free_port, None) if f":{p}" not in taken)
        self.sub(f":{documented}", f":{port}")
        return port

    def argv(self, command: str, subs: Optional[dict[str, str]] = None) -> list[str]:
        text = normalize(command)
        for old, new in [*(subs or {}).items(), *self.subs.items()]:
            text = _pattern(old).sub(lambda _, new=new: new, text)
        words = shlex.split(text)
        program = os.path.basename(words[0])
        assert program in PROGRAMS, f"no way to run {program!r} here: {command}"
        args = [str(ROOT / w) if not w.startswith("-") and "/" in w and (ROOT / w).exists() else w
                for w in words[1:]]
        argv = [_which("env"), "-C", str(self.tmp), *PROGRAMS[program](), *args]
        if self.netns is not None:
            argv = [_which("ip"), "netns", "exec", self.netns, *argv]
        return argv

    async def start(self, command: str, ready: Optional[str] = None,
                    subs: Optional[dict[str, str]] = None, timeout: float = 30) -> Process:
        """Start *command* in the background (its own terminal, or ``&``);
        wait for the log line *ready*."""
        proc = Process(reactor(), self.argv(command, subs), self.env)
        self.procs.append(proc)
        if ready is not None:
            await proc.waitFor(ready, timeout)
        return proc

    async def run(self, command: str, subs: Optional[dict[str, str]] = None,
                  status: int = 0, timeout: float = 30) -> list[str]:
        """Run *command* to its end; check its exit status; return its output lines."""
        proc = await self.start(command, subs=subs)
        await proc.ended(timeout)
        output = proc.output.decode(errors="replace")
        assert proc.exitCode == status, f"{command}: exit {proc.exitCode}, not {status}:\n{output}"
        return output.splitlines()

    async def stop(self) -> None:
        for proc in reversed(self.procs):
            await proc.stop()


# --- scenarios: the documented commands, run together as a reader would -------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    #: label -> the documented command (its text as the docs show it)
    commands: dict[str, str]
    body: Callable[[Shell, Any], Awaitable[None]]
    #: run inside a network namespace with only loopback (UDP beacons)
    netns: bool = False
    env: tuple[tuple[str, str], ...] = ()


SCENARIOS: list[Scenario] = []


def scenario(netns: bool = False, env: Optional[dict[str, str]] = None,
             **commands: str) -> Callable[[Callable[[Shell, Any], Awaitable[None]]], Any]:
    """Register a scenario covering *commands* (label = documented text); its
    body gets a :class:`Shell` and the commands by label."""
    def register(body: Callable[[Shell, Any], Awaitable[None]]) -> Any:
        SCENARIOS.append(Scenario(body.__name__, {k: normalize(v) for k, v in commands.items()}, body,
                                  netns, tuple((env or {}).items())))
        return body
    return register


BROKER_READY = "MDP broker listening on"
WORKER_READY = "sent READY"

README_DEMO = ("python3 -m venv .venv && .venv/bin/pip install -e . --config-settings editable_mode=compat"
               " && .venv/bin/mdp demo")
SHELL_BROKER = "twist mdp-broker --endpoint zmq:tcp://127.0.0.1:5555"
SHELL_WORKER = "twist mdp-worker --broker zmq:tcp://127.0.0.1:5555 --service echo --handler echo"


@scenario(demo=README_DEMO)
async def readme_demo(sh: Shell, c: Any) -> None:
    """The part after the install: ``mdp demo`` (the venv and the install
    are what .ci/run does, tests/test_readme.py keeps the two the same)."""
    lines = await sh.run(c.demo.split("&&")[-1])
    assert "echo replied: hello 0" in lines and lines[-1] == "demo done", lines


@scenario(broker=SHELL_BROKER, worker=SHELL_WORKER,
          call="mdp call --broker zmq:tcp://127.0.0.1:5555 echo hello world")
async def readme_from_the_shell(sh: Shell, c: Any) -> None:
    sh.port(5555)
    await sh.start(c.broker, BROKER_READY)
    await sh.start(c.worker, WORKER_READY)
    assert (await sh.run(c.call))[-2:] == ["hello", "world"]


@scenario(broker="twist --reactor=epoll mdp-broker --endpoint zmq:tcp://127.0.0.1:5555",
          worker="twist --reactor=default mdp-worker --broker zmq:tcp://127.0.0.1:5555 "
                 "--service echo --handler echo")
async def cli_reactor_opt_out(sh: Shell, c: Any) -> None:
    """docs/cli.md, the reactor: given another reactor, neither server runs on
    uvloop, and both serve."""
    sh.port(5555)
    broker = await sh.start(c.broker, BROKER_READY)
    worker = await sh.start(c.worker, WORKER_READY)
    assert (await sh.run("mdp call --broker zmq:tcp://127.0.0.1:5555 echo hi"))[-1] == "hi"
    for server in (broker, worker):
        assert b"uvloop" not in server.output, server.output


@scenario(broker=SHELL_BROKER, worker=SHELL_WORKER,
          titanic="twist mdp-titanic --broker zmq:tcp://127.0.0.1:5555 --db titanic.db",
          submit="mdp titanic submit --broker zmq:tcp://127.0.0.1:5555 echo hello",
          result="mdp titanic result --broker zmq:tcp://127.0.0.1:5555 --wait ID")
async def readme_titanic(sh: Shell, c: Any) -> None:
    sh.port(5555)
    await sh.start(c.broker, BROKER_READY)
    await sh.start(c.worker, WORKER_READY)
    await sh.start(c.titanic, "Titanic started")
    sh.sub("ID", (await sh.run(c.submit))[-1])
    assert (await sh.run(c.result))[-1] == "hello"


@scenario(
    primary="twist mdp-broker --endpoint zmq:tcp://127.0.0.1:5555 --bstar primary "
            "--bstar-local zmq:tcp://127.0.0.1:5003 --bstar-remote zmq:tcp://127.0.0.1:5004",
    backup="twist mdp-broker --endpoint zmq:tcp://127.0.0.1:5565 --bstar backup "
           "--bstar-local zmq:tcp://127.0.0.1:5004 --bstar-remote zmq:tcp://127.0.0.1:5003",
    worker="twist mdp-worker --broker zmq:tcp://127.0.0.1:5555 --broker zmq:tcp://127.0.0.1:5565 "
           "--service echo",
    call="mdp call --broker zmq:tcp://127.0.0.1:5555 --broker zmq:tcp://127.0.0.1:5565 --retries 6 echo hi",
)
async def readme_binary_star(sh: Shell, c: Any) -> None:
    for port in (5555, 5565, 5003, 5004):
        sh.port(port)
    await sh.start(c.primary, BROKER_READY)
    await sh.start(c.backup, BROKER_READY)
    await sh.start(c.worker)
    assert (await sh.run(c.call, timeout=40))[-1] == "hi"


@scenario(
    a="twist mdp-broker --endpoint zmq:tcp://*:5555 --bstar primary "
      "--bstar-local zmq:tcp://*:5003 --bstar-remote zmq:tcp://B:5004",
    b="twist mdp-broker --endpoint zmq:tcp://*:5555 --bstar backup "
      "--bstar-local zmq:tcp://*:5004 --bstar-remote zmq:tcp://A:5003",
    worker="twist mdp-worker --broker zmq:tcp://A:5555 --broker zmq:tcp://B:5555 "
           "--service echo --handler echo",
    call="mdp call --broker zmq:tcp://A:5555 --broker zmq:tcp://B:5555 --retries 6 echo hello",
    status="mdp call --broker zmq:tcp://B:5555 mmi.binarystar ''",
)
async def binarystar_pair_of_brokers(sh: Shell, c: Any) -> None:
    """Machines A and B are both 127.0.0.1 here, each with its own ports."""
    a, b, a_state, b_state = free_ports(4)
    sh.sub("A:5555", f"127.0.0.1:{a}")
    sh.sub("B:5555", f"127.0.0.1:{b}")
    sh.sub("A:5003", f"127.0.0.1:{a_state}")
    sh.sub("B:5004", f"127.0.0.1:{b_state}")
    await sh.start(c.a, BROKER_READY, {"*:5555": f"127.0.0.1:{a}", "*:5003": f"127.0.0.1:{a_state}"})
    await sh.start(c.b, BROKER_READY, {"*:5555": f"127.0.0.1:{b}", "*:5004": f"127.0.0.1:{b_state}"})
    await sh.start(c.worker)
    assert (await sh.run(c.call, timeout=40))[-1] == "hello"
    # the backup turns passive once a state message of the now active primary
    # reaches it (one a heartbeat): ask until it has, as the page's output shows
    status = json.loads((await sh.run(c.status))[-1])
    for _ in range(20):
        if status["state"] != "backup":
            break
        await task.deferLater(reactor(), 0.25)
        status = json.loads((await sh.run(c.status))[-1])
    example = json.loads(shown(c.status).output[-1])
    assert status.keys() == example.keys()
    assert {k: status[k] for k in ("role", "state", "peer", "serving")} == {
        k: example[k] for k in ("role", "state", "peer", "serving")}


@scenario(
    broker="twist mdp-broker --endpoint zmq:tcp://127.0.0.1:5555",
    titanic="twist mdp-titanic --broker zmq:tcp://127.0.0.1:5555 --db titanic.db --concurrency 4",
    submit="mdp titanic submit --broker zmq:tcp://127.0.0.1:5555 shout hello",
    pending="mdp titanic result --broker zmq:tcp://127.0.0.1:5555 ID",
    worker="twist mdp-worker --broker zmq:tcp://127.0.0.1:5555 --service shout --handler echo",
    wait="mdp titanic result --broker zmq:tcp://127.0.0.1:5555 --wait ID",
    close="mdp titanic close --broker zmq:tcp://127.0.0.1:5555 ID",
)
async def titanic_run_it(sh: Shell, c: Any) -> None:
    sh.port(5555)
    await sh.start(c.broker, BROKER_READY)
    await sh.start(c.titanic, "Titanic started")
    sh.sub("ID", (await sh.run(c.submit))[-1])
    await sh.run(c.pending, status=3)
    await sh.start(c.worker)
    assert (await sh.run(c.wait))[-1] == "hello"
    await sh.run(c.close)
    assert (sh.tmp / "titanic.db").exists()


@scenario(
    a="twist mdp-broker --endpoint zmq:tcp://127.0.0.1:5555",
    b="twist mdp-broker --endpoint zmq:tcp://127.0.0.1:5556",
    worker="twist mdp-worker --broker zmq:tcp://127.0.0.1:5555 --broker zmq:tcp://127.0.0.1:5556 "
           "--attach all --concurrency 4 --service echo --handler echo",
    call="mdp call --broker zmq:tcp://127.0.0.1:5555 --broker zmq:tcp://127.0.0.1:5556 "
         "--side-by-side echo hello",
    status="mdp status --broker zmq:tcp://127.0.0.1:5555 --broker zmq:tcp://127.0.0.1:5556")
async def deployment_side_by_side(sh: Shell, c: Any) -> None:
    """docs/deployment.md: a worker attached to two brokers, a call and the summed status."""
    sh.port(5555)
    sh.port(5556)
    a = await sh.start(c.a, BROKER_READY)
    b = await sh.start(c.b, BROKER_READY)
    await sh.start(c.worker, WORKER_READY)
    for broker in (a, b):  # two sessions at each
        await wait_until(lambda broker=broker: broker.output.count(b"ready for echo") >= 2, 30)
    assert (await sh.run(c.call))[-1] == "hello"
    lines = await sh.run(c.status)
    total = lines.index("all 2 brokers")
    assert [line.split()[:2] for line in lines[total:] if line.startswith("echo")] == [["echo", "4"]]


@scenario(
    rep="twist sp-rep --endpoint tcp://127.0.0.1:5555 --handler echo",
    device="twist sp-device --front tcp://127.0.0.1:5556 --back tcp://127.0.0.1:5555",
    request="mdp sp-request --endpoint tcp://127.0.0.1:5556 hello",
)
async def sp_command_line(sh: Shell, c: Any) -> None:
    sh.port(5555)
    sh.port(5556)
    await sh.start(c.rep, "SP REP listening on")
    await sh.start(c.device, "SP device listening on")
    assert (await sh.run(c.request))[-1] == "hello"


SECURE_CALL = "hello"


@scenario(
    keys1="mdp keygen broker", keys2="mdp keygen worker", keys3="mdp keygen alice",
    allowed="mkdir allowed", copy="cp worker.key alice.key allowed/",
    broker="twist mdp-broker --endpoint zmq:tcp://127.0.0.1:5555 --curve-secret broker.key_secret "
           "--curve-allow allowed",
    worker="twist mdp-worker --broker zmq:tcp://127.0.0.1:5555 --service echo --handler echo "
           "--curve-server-public broker.key --curve-secret worker.key_secret",
    call="mdp call --broker zmq:tcp://127.0.0.1:5555 --curve-server-public broker.key "
         "--curve-secret alice.key_secret echo hello",
)
async def security_curve(sh: Shell, c: Any) -> None:
    """docs/security.md's CURVE recipe, as shown; a key left out of the
    allow-list gets nothing through (tests/test_security.py has the rest)."""
    sh.port(5555)
    for step in (c.keys1, c.keys2, c.keys3, c.allowed, c.copy):
        await sh.run(step)
    assert sorted(p.name for p in (sh.tmp / "allowed").iterdir()) == ["alice.key", "worker.key"]
    await sh.start(c.broker, BROKER_READY)
    await sh.start(c.worker, WORKER_READY)
    assert (await sh.run(c.call))[-1] == SECURE_CALL
    await sh.run("mdp keygen mallory")
    lines = await sh.run(c.call.replace("alice", "mallory") + " --timeout 1 --retries 1",
                         status=1)
    assert "no reply" in " ".join(lines).lower() or "timed out" in " ".join(lines).lower(), lines


_OPENSSL = [
    "openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj /CN=Example-CA -keyout ca-key.pem "
    "-out ca.pem",
    "openssl req -newkey rsa:2048 -nodes -subj /CN=broker -keyout broker-key.pem -out broker.csr",
    "openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 365 "
    "-out broker.pem",
    "openssl req -newkey rsa:2048 -nodes -subj /O=Example/CN=worker-1 -keyout worker-key.pem "
    "-out worker.csr",
    "openssl x509 -req -in worker.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 365 "
    "-out worker.pem",
    "openssl req -newkey rsa:2048 -nodes -subj /O=Example/CN=alice -keyout alice-key.pem -out alice.csr",
    "openssl x509 -req -in alice.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 365 "
    "-out alice.pem",
    "mkdir trusted",
    "cp ca.pem trusted/",
]


@scenario(
    **{f"step{n}": step for n, step in enumerate(_OPENSSL)},
    broker="twist mdp-broker --endpoint ssl:5555:interface=127.0.0.1:privateKey=broker-key.pem:"
           "certKey=broker.pem:caCerts=ca.pem",
    worker="twist mdp-worker --broker ssl:host=127.0.0.1:port=5555:caCertsDir=trusted:"
           "certKey=worker.pem:privateKey=worker-key.pem --service echo --handler echo",
    call="mdp call --broker ssl:host=127.0.0.1:port=5555:caCertsDir=trusted:certKey=alice.pem:"
         "privateKey=alice-key.pem echo hello",
    subject="openssl x509 -in worker.pem -noout -subject -nameopt RFC2253",
)
async def security_mutual_tls(sh: Shell, c: Any) -> None:
    """docs/security.md's mutual TLS recipe, as shown: openssl makes the
    authority and the certificates, the worker and the client get through;
    the subject is printed as the access policy names it."""
    port = sh.port(5555)
    sh.sub("port=5555", f"port={port}")
    for n in range(len(_OPENSSL)):
        await sh.run(getattr(c, f"step{n}"))
    assert (await sh.run(c.subject))[-1] == "subject=CN=worker-1,O=Example"
    await sh.start(c.broker, BROKER_READY)
    await sh.start(c.worker, WORKER_READY)
    assert (await sh.run(c.call))[-1] == SECURE_CALL


@scenario(call="mdp call --broker tcp://127.0.0.1:5555 echo x")
async def cli_bad_endpoint(sh: Shell, c: Any) -> None:
    """Refused before anything connects: the port can stay as shown."""
    assert await sh.run(c.call, status=2) == list(shown(c.call).output)


@scenario(netns=True, cat="cat shout.py", worker="twist mdp-worker --service shout --handler shout:shout")
async def cli_handler_from_the_current_directory(sh: Shell, c: Any) -> None:
    """The worker's default broker, 127.0.0.1:5555, in a network namespace of
    the test's own; shout.py as the docs show it, in the current directory."""
    (sh.tmp / "shout.py").write_text("\n".join(shown(c.cat).output) + "\n", encoding="utf-8")
    assert await sh.run(c.cat) == list(shown(c.cat).output)
    await sh.start("twist mdp-broker", BROKER_READY)
    await sh.start(c.worker, WORKER_READY)
    assert (await sh.run("mdp call shout hi"))[-1] == "HI!"


@scenario(worker="twist mdp-worker --service shout --handler shuot:shout")
async def cli_handler_that_cannot_load(sh: Shell, c: Any) -> None:
    """Refused while the options are read: nothing connects."""
    assert await sh.run(c.worker, status=2) == list(shown(c.worker).output)


@scenario(broker=SHELL_BROKER, worker=SHELL_WORKER, status="mdp status --broker zmq:tcp://127.0.0.1:5555")
async def cli_status(sh: Shell, c: Any) -> None:
    """Two echo workers; the tables as shown (headers, the echo row, a row per worker)."""
    port = sh.port(5555)
    broker = await sh.start(c.broker, BROKER_READY)
    for _ in range(2):
        await sh.start(c.worker, WORKER_READY)
    await wait_until(lambda: len(re.findall(rb"ready for (?:b')?echo\b", broker.output)) >= 2, 30)
    lines = await sh.run(c.status)
    example = shown(c.status).output
    assert lines[0] == example[0].replace(":5555", f":{port}")
    headers = [line.split() for line in example if line.startswith(("SERVICE", "WORKER"))]
    assert [line.split() for line in lines if line.startswith(("SERVICE", "WORKER"))] == headers
    (echo,) = [line.split() for line in lines if line.startswith("echo")]
    assert echo[1] == "2" and int(echo[2]) + int(echo[3]) == 2, lines
    workers = [line.split() for line in lines if re.match(r"[0-9a-f]{10} ", line)]
    assert [w[1:4] for w in workers] == [["echo", "idle", "rfc"]] * 2, lines


@scenario(status="mdp status --broker zmq:tcp://127.0.0.1:5555 --timeout 1 --retries 1")
async def cli_status_without_a_broker(sh: Shell, c: Any) -> None:
    port = sh.port(5555)  # nothing listens there

    def timeless(lines: Any) -> list[str]:
        return [re.sub(r"\d+\.\d+(?= ?s\b)", "T", line) for line in lines]

    lines = await sh.run(c.status, status=1)
    assert timeless(lines) == timeless(line.replace(":5555", f":{port}") for line in shown(c.status).output)


@scenario(server="twist mdp-freelance-server --endpoint zmq:tcp://127.0.0.1:5556 --handler echo",
          call="mdp freelance-call --server zmq:tcp://127.0.0.1:5556 hello world")
async def cli_freelance_call(sh: Shell, c: Any) -> None:
    sh.port(5556)
    await sh.start(c.server, "Freelance server listening on")
    assert await sh.run(c.call) == list(shown(c.call).output)


@scenario(
    broker="twist mdp-broker --endpoint zmq:tcp://127.0.0.1:5555 --metrics tcp:9464:interface=127.0.0.1",
    worker="twist mdp-worker --broker zmq:tcp://127.0.0.1:5555 --service echo "
           "--metrics tcp:9465:interface=127.0.0.1",
    scrape="curl -s http://127.0.0.1:9464/metrics",
)
async def metrics_scrape(sh: Shell, c: Any) -> None:
    """Three echo requests, then the broker's scrape counts them, as the example scrape shows."""
    for port in (5555, 9464, 9465):
        sh.port(port)
    broker = await sh.start(c.broker, BROKER_READY)
    await broker.waitFor(r"metrics at http://127\.0\.0\.1:\d+/metrics")
    worker = await sh.start(c.worker, WORKER_READY)
    await worker.waitFor(r"metrics at http://127\.0\.0\.1:\d+/metrics")
    for _ in range(3):
        assert (await sh.run("mdp call --broker zmq:tcp://127.0.0.1:5555 echo hi"))[-1] == "hi"
    scraped = await sh.run(c.scrape)
    for line in ('mdp_broker_requests_total{service="echo"} 3.0',
                 'mdp_broker_replies_total{service="echo"} 3.0',
                 'mdp_broker_workers{service="echo",state="idle"} 1.0',
                 'mdp_broker_peers{role="worker"} 1.0'):
        assert line in scraped, (line, scraped)


@scenario(netns=True, env={"PYTHONUTF8": "1"},
          alice="mdp chat --name alice --group CHAT", bob="mdp chat --name bob --group CHAT")
async def chat_in_two_terminals(sh: Shell, c: Any) -> None:
    """By UDP beacons, as documented, in a network namespace with only
    loopback (nothing leaves the machine)."""
    alice = await sh.start(c.alice)
    bob = await sh.start(c.bob)
    await alice.waitFor(r"\* bob is here", 30)
    await bob.waitFor(r"\* alice is here", 30)
    alice.transport.write(b"hello, bob\n")
    await bob.waitFor("alice: hello, bob", 15)
    alice.transport.closeStdin()  # Ctrl-D
    await alice.ended(15)
    assert alice.exitCode == 0, alice.output
    await bob.waitFor(r"\* alice left", 15)


@scenario(env={"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable},
          enrich="python examples/spark_enrich.py --output /tmp/enriched.parquet")
async def spark_example(sh: Shell, c: Any) -> None:
    sh.sub("/tmp/enriched.parquet", str(sh.tmp / "enriched.parquet"))
    lines = await sh.run(c.enrich, timeout=100)
    assert f"wrote 10000 rows to {sh.tmp / 'enriched.parquet'}" in lines


# --- what is run elsewhere, and what cannot be run -----------------------------------------

#: documented command -> the test that runs it ("path::function")
RUN_ELSEWHERE: dict[str, str] = {
    "mdp chat --name alice --group CHAT --interface 127.0.0.1":
        "tests/test_readme_recipes.py::test_chat_on_loopback",
    "mdp chat --name bob --group CHAT --interface 127.0.0.1":
        "tests/test_readme_recipes.py::test_chat_on_loopback",
    ".venv/bin/python -m benchmarks --smoke": "tests/test_benchmarks_smoke.py::test_benchmark_smoke_run",
    ".venv/bin/python -m benchmarks.titanic --smoke":
        "tests/test_benchmarks_smoke.py::test_titanic_benchmark_smoke_run",
    "pip install .":
        "tests/test_packaging.py::test_the_wheel_alone_runs_the_mdp_command_and_the_twist_plugin",
    "sudo .venv/bin/python examples/simulated_hosts.py --requests 3000 --titanic 300":
        "tests/test_simulated_hosts.py::test_a_host_cut_off_under_load_loses_nothing_and_runs_nothing_twice",
    "twist mdp-worker --service enrich --handler app:enrich --reply-db /var/lib/mdp/replies.db":
        "tests/test_spark.py::test_a_streaming_query_restarted_from_its_checkpoint_runs_each_request_once",
}

#: documented command -> why no test runs it
EXCLUDED: dict[str, str] = {
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' --config-settings editable_mode=compat"
    " && .venv/bin/python -m pytest":
        "the whole suite: .ci/run runs exactly this (tests/test_readme.py)",
    "git clone https://github.com/txmajordomo/txmajordomo && cd txmajordomo":
        "fetches the repository from the network",
    "pip install -e . --config-settings editable_mode=compat":
        "installs into the environment the tests run in (.ci/run installs it so)",
    ".venv/bin/python -m benchmarks --repeat 3": "the full benchmark suite, about 25 minutes",
    ".venv/bin/python -m benchmarks.spark --repeat 3":
        "a Spark standalone cluster and three rounds, about 5 minutes",
    '.venv/bin/python -m benchmarks --repeat 3 --only "sync 4x4" pipelined':
        "three rounds of benchmarks, about a minute",
    "tox -e bench": "the full benchmark suite in a tox environment",
    "pip install -e '.[postgres]' --config-settings editable_mode=compat":
        "installs into the environment the tests run in (the test extra has psycopg too)",
    "twist mdp-titanic --broker tcp:broker-a:5555 --db 'postgresql://titanic:SECRET@db-host/titanic' "
    "--stamp": "needs a PostgreSQL server at db-host; tests/test_titanic_postgres.py runs two such "
               "Titanics on a private server",
    ".venv/bin/python -m benchmarks.titanic --repeat 3": "three rounds of benchmarks, about a minute",
    "spark-submit --master yarn --py-files mdp.zip examples/spark_enrich.py "
    "--broker zmq:tcp://broker.internal:5555 --input hdfs:///in.parquet --output hdfs:///out.parquet":
        "needs a YARN cluster and HDFS",
}


def _covered() -> dict[str, str]:
    """Documented text -> what covers it."""
    covered = {normalize(k): f"excluded: {v}" for k, v in EXCLUDED.items()}
    covered.update({normalize(k): f"run by {v}" for k, v in RUN_ELSEWHERE.items()})
    for s in SCENARIOS:
        covered.update({command: f"scenario {s.name}" for command in s.commands.values()})
    return covered


def test_every_documented_command_is_covered() -> None:
    entries = documented()
    assert len(entries) > 30 and any(e.synopsis for e in entries), "the docs' commands were not found"
    covered = _covered()
    missing = [f"{e.where}: {e.text}" for e in entries if not e.synopsis and e.text not in covered]
    assert not missing, ("documented commands no test runs (add them to a scenario, or to "
                         "RUN_ELSEWHERE or EXCLUDED with the reason):\n" + "\n".join(missing))


def test_the_tables_name_only_documented_commands() -> None:
    texts = {e.text for e in documented()}
    stale = [f"{text} ({what})" for text, what in _covered().items() if text not in texts]
    assert not stale, "no longer in the docs (update the table):\n" + "\n".join(stale)


def test_tests_run_elsewhere_exist() -> None:
    for command, node in RUN_ELSEWHERE.items():
        path, function = node.split("::")
        assert f"def {function}(" in (ROOT / path).read_text(encoding="utf-8"), (command, node)


def test_the_parser_reads_blocks_as_documented() -> None:
    sample = "$ mdp call x \\\n    y   # a comment\nreply\n\nmore\n\n$ twist mdp-broker &\n"
    first, second = _commands(sample, 1, "page.md", transcript=True)
    assert (first.text, first.output, first.where) == ("mdp call x y", ("reply", "", "more"), "page.md:1")
    assert (second.text, second.background) == ("twist mdp-broker", True)
    (synopsis,) = _synopses("mdp call [--broker ENDPOINT]\n         [--retries N] SERVICE\n", 3, "p.md")
    assert (synopsis.text, synopsis.synopsis) == ("mdp call [--broker ENDPOINT] [--retries N] SERVICE", True)
    assert _synopses("stream = [ greeting ] *record\n", 1, "p.md") == []
    assert _pattern("ID").sub("42", "result ID IDS x.ID") == "result 42 IDS x.ID"
    assert _pattern(":5555").sub(":1", "tcp://h:5555 tcp://h:55550") == "tcp://h:1 tcp://h:55550"


@pytest.mark.parametrize("entry", SCENARIOS, ids=lambda s: s.name)
@pytest_twisted.ensureDeferred
async def test_documented_commands_run(entry: Scenario, tmp_path: Path, request: Any) -> None:
    shell = Shell(tmp_path, request.getfixturevalue("namespace") if entry.netns else None)
    shell.env.update(entry.env)
    try:
        await entry.body(shell, SimpleNamespace(**entry.commands))
    finally:
        await shell.stop()


# --- synopses: every option shown exists ----------------------------------------------------

_OPTION = re.compile(r"--[a-z][\w-]*")


def synopsis_program(text: str) -> list[str]:
    """The words naming the command: ``mdp titanic result`` of its synopsis."""
    words: list[str] = []
    for word in text.split():
        if word.startswith(("[", "-")) or not re.fullmatch(r"[a-z][\w-]*", word):
            break
        words.append(word)
    return words


@pytest.mark.parametrize("entry", [e for e in documented() if e.synopsis], ids=lambda e: e.where)
@pytest_twisted.ensureDeferred
async def test_synopsis_options_are_the_commands_options(entry: Documented, tmp_path: Path) -> None:
    shell = Shell(tmp_path)
    try:
        lines = await shell.run(" ".join([*synopsis_program(entry.text), "--help"]))
    finally:
        await shell.stop()
    help_text = "\n".join(lines)
    unknown = [o for o in _OPTION.findall(entry.text)
               if not re.search(re.escape(o) + r"(?![\w-])", help_text)]
    assert not unknown, f"{entry.where}: options not in --help: {unknown}"


# --- unix: endpoints as docs/transports.md spells them -------------------------------------


@pytest_twisted.ensureDeferred
async def test_the_documented_unix_endpoint_works_for_broker_worker_and_call(tmp_path: Path) -> None:
    spellings = set()
    for path in doc_files():
        spellings.update(re.findall(r"unix:path=[^\s`|)]+", path.read_text(encoding="utf-8")))
    assert spellings, "no unix:path= endpoint in the docs"
    shell = Shell(tmp_path)
    try:
        for n, spelling in enumerate(sorted(spellings)):
            sock = tmp_path / f"mdp{n}.sock"
            endpoint = spelling.replace(spelling.split("=", 1)[1], str(sock))
            await shell.start(f"twist mdp-broker --endpoint {endpoint}", BROKER_READY)
            await shell.start(f"twist mdp-worker --broker {endpoint} --service echo --handler echo",
                              WORKER_READY)
            assert (await shell.run(f"mdp call --broker {endpoint} echo hi"))[-1] == "hi"
    finally:
        await shell.stop()
