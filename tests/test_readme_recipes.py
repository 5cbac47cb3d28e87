"""Every recipe of README.md runs as written, after the two commands of its
first screen: each command as the page shows it, run by ``bash`` in a
terminal of its own (a fresh process tree, started from an empty
environment) that did only what the README says to do first, activate the
venv.  Each recipe runs in a network namespace of its own, with only
loopback: the README's ports (5555, 9464, ...) stay as written, and nothing
reaches the machine's own ports or network.

The first two commands (the install and the demo, the install and the
tests) are .ci/run's and tests/test_docs_commands.py's; the clone and
``pip install`` recipes install (tests/test_docs_commands.py lists them).
"""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import pytest_twisted

from tests.procs import Process, reactor
from tests.test_docs_commands import documented
from tests.test_harmony_netns import namespace  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

#: what the README says to do in each new terminal
ACTIVATE = ". .venv/bin/activate"


def readme_commands() -> list[str]:
    """Every command of the README's shell blocks, as
    tests/test_docs_commands.py reads them (comments dropped, continuations
    joined, single spaces)."""
    return [entry.text for entry in documented()
            if entry.where.startswith("README.md:") and not entry.synopsis]


def shown(command: str) -> str:
    """*command*, which the README must show as it is."""
    assert command in readme_commands(), f"the README no longer shows: {command}"
    return command


def venv_of_this_run() -> Path:
    """The venv the README's activation names, where this run's Python is
    that venv (.ci/run); else this run's own environment."""
    checkout = ROOT / ".venv"
    if checkout.is_dir() and Path(sys.prefix).resolve() == checkout.resolve():
        return checkout
    return Path(sys.prefix)


class Terminal:
    """One terminal (a pseudo-terminal, as a user's: ``twist`` logs text to
    it, Ctrl-C and Ctrl-D are keys): a ``bash`` with an empty environment
    (but for a HOME and a plain PATH), in which the README's activation
    then *command* run, in the directory *cwd*."""

    def __init__(self, ns: str, cwd: Path, command: str) -> None:
        venv = venv_of_this_run()
        activate = (ACTIVATE if venv == ROOT / ".venv"
                    else ". " + shlex.quote(str(venv / "bin" / "activate")))
        script = (f"cd {shlex.quote(str(ROOT))} && {activate} && cd {shlex.quote(str(cwd))} "
                  f"&& exec {command}")
        ip, env, bash = (shutil.which(p) for p in ("ip", "env", "bash"))
        assert ip and env and bash
        self.command = command
        self.proc = Process(reactor(), [
            ip, "netns", "exec", ns, env, "-i", f"HOME={cwd}", "PATH=/usr/local/bin:/usr/bin:/bin",
            "LANG=C.UTF-8", "TERM=dumb", bash, "--norc", "--noprofile", "-c", script], usePTY=True)

    @property
    def text(self) -> str:
        return self.proc.output.decode(errors="replace").replace("\r\n", "\n")

    async def waitFor(self, pattern: str, timeout: float = 30) -> None:
        await self.proc.waitFor(pattern, timeout)

    async def ended(self, timeout: float = 30) -> int:
        """The exit status, as the shell would say it (128 + a signal's number)."""
        await self.proc.ended(timeout)
        if self.proc.exitCode is None:
            return 128 + (self.proc.signal or 0)
        return self.proc.exitCode

    def type(self, line: str) -> None:
        self.proc.transport.write(line.encode() + b"\n")

    def interrupt(self) -> None:
        """Ctrl-C."""
        self.proc.transport.write(b"\x03")

    def endInput(self) -> None:
        """Ctrl-D."""
        self.proc.transport.write(b"\x04")


class Desk:
    """The terminals of one recipe, all stopped at its end."""

    def __init__(self, ns: str, cwd: Path) -> None:
        self.ns = ns
        self.cwd = cwd
        self.terminals: list[Terminal] = []

    def open(self, command: str) -> Terminal:
        terminal = Terminal(self.ns, self.cwd, shown(command))
        self.terminals.append(terminal)
        return terminal

    async def start(self, command: str, ready: Optional[str] = None) -> Terminal:
        terminal = self.open(command)
        if ready is not None:
            await terminal.waitFor(ready)
        return terminal

    async def run(self, command: str, subs: Optional[dict[str, str]] = None,
                  timeout: float = 30) -> list[str]:
        """Run *command* (its placeholders filled from *subs*) to its end;
        it must succeed; its output lines."""
        shown(command)
        for old, new in (subs or {}).items():
            command = re.sub(rf"(?<![\w.]){re.escape(old)}(?!\w)", new, command)
        terminal = Terminal(self.ns, self.cwd, command)
        self.terminals.append(terminal)
        status = await terminal.ended(timeout)
        assert status == 0, f"{command}: exit {status}:\n{terminal.text}\n{self.transcript()}"
        return terminal.text.splitlines()

    def transcript(self) -> str:
        """What every terminal of the recipe showed so far (for a failure's message)."""
        return "\n".join(f"--- terminal {n}: {t.command}\n{t.text}"
                         for n, t in enumerate(self.terminals, 1))

    async def close(self) -> None:
        for terminal in reversed(self.terminals):
            await terminal.proc.stop()


@pytest_twisted.async_yield_fixture
async def desk(namespace: str, tmp_path: Path) -> Any:  # noqa: F811
    """The recipe's terminals, every one stopped at its end (before the
    namespace goes)."""
    terminals = Desk(namespace, tmp_path)
    try:
        yield terminals
    finally:
        await terminals.close()


BROKER_READY = "MDP broker listening on"
WORKER_READY = "sent READY"

BROKER = "twist mdp-broker --endpoint zmq:tcp://127.0.0.1:5555 --metrics tcp:9464:interface=127.0.0.1"
WORKER = "twist mdp-worker --broker zmq:tcp://127.0.0.1:5555 --service echo --handler echo"
CALL = "mdp call --broker zmq:tcp://127.0.0.1:5555 echo hello world"
STATUS = "mdp status --broker zmq:tcp://127.0.0.1:5555"
SCRAPE = "curl -s http://127.0.0.1:9464/metrics"
TITANIC = "twist mdp-titanic --broker zmq:tcp://127.0.0.1:5555 --db titanic.db"
SUBMIT = "mdp titanic submit --broker zmq:tcp://127.0.0.1:5555 echo hello"
RESULT = "mdp titanic result --broker zmq:tcp://127.0.0.1:5555 --wait ID"

PRIMARY = ("twist mdp-broker --endpoint zmq:tcp://127.0.0.1:5555 --bstar primary "
           "--bstar-local zmq:tcp://127.0.0.1:5003 --bstar-remote zmq:tcp://127.0.0.1:5004")
BACKUP = ("twist mdp-broker --endpoint zmq:tcp://127.0.0.1:5565 --bstar backup "
          "--bstar-local zmq:tcp://127.0.0.1:5004 --bstar-remote zmq:tcp://127.0.0.1:5003")
PAIR_WORKER = ("twist mdp-worker --broker zmq:tcp://127.0.0.1:5555 --broker zmq:tcp://127.0.0.1:5565 "
               "--service echo")
PAIR_CALL = "mdp call --broker zmq:tcp://127.0.0.1:5555 --broker zmq:tcp://127.0.0.1:5565 --retries 6 echo hi"

ALICE = "mdp chat --name alice --group CHAT --interface 127.0.0.1"
BOB = "mdp chat --name bob --group CHAT --interface 127.0.0.1"

#: every README command this file runs, and the ones it leaves to others
COVERED = {BROKER, WORKER, CALL, STATUS, SCRAPE, TITANIC, SUBMIT, RESULT, PRIMARY, BACKUP,
           PAIR_WORKER, PAIR_CALL, ALICE, BOB}
ELSEWHERE = {
    "git clone https://github.com/txmajordomo/txmajordomo && cd txmajordomo":
        "fetches the repository from the network",
    "pip install .": "tests/test_packaging.py (a wheel of the checkout, run alone)",
    "pip install -e . --config-settings editable_mode=compat": "how .ci/run installs the checkout",
}


def test_every_readme_recipe_is_run_here_or_said_where() -> None:
    first_two = readme_commands()[:2]
    rest = set(readme_commands()[2:])
    assert rest == COVERED | set(ELSEWHERE), (
        f"README commands no test runs: {sorted(rest - COVERED - set(ELSEWHERE))}; "
        f"listed but gone: {sorted((COVERED | set(ELSEWHERE)) - rest)}")
    assert all("pip install" in command for command in first_two)
    text = README.read_text(encoding="utf-8")
    assert f"`{ACTIVATE}`" in text and text.index(ACTIVATE) < text.index(BROKER)


@pytest_twisted.ensureDeferred
async def test_broker_worker_call_status_metrics_and_titanic(desk: Desk) -> None:
    broker = await desk.start(BROKER, BROKER_READY)
    await broker.waitFor(r"metrics at http://127\.0\.0\.1:9464/metrics")
    await desk.start(WORKER, WORKER_READY)
    assert (await desk.run(CALL))[-2:] == ["hello", "world"]
    status = await desk.run(STATUS)
    (echo,) = [line.split() for line in status if line.startswith("echo ")]
    assert echo[1] == "1", status  # one worker
    scrape = await desk.run(SCRAPE)
    assert 'mdp_broker_requests_total{service="echo"} 1.0' in scrape, scrape
    await desk.start(TITANIC, "Titanic started")
    request = (await desk.run(SUBMIT))[-1]
    assert re.fullmatch(r"[\w-]+", request), request
    assert (await desk.run(RESULT, subs={"ID": request}))[-1] == "hello"


@pytest_twisted.ensureDeferred
async def test_binary_star_pair_and_its_failover(desk: Desk) -> None:
    primary = await desk.start(PRIMARY, BROKER_READY)
    backup = await desk.start(BACKUP, BROKER_READY)
    await desk.start(PAIR_WORKER, WORKER_READY)
    assert (await desk.run(PAIR_CALL))[-1] == "hi"
    # as the README says: a backup that never saw the primary active does not
    # take over (the primary publishes its state every second)
    assert "`backup -> passive`" in README.read_text(encoding="utf-8")
    await backup.waitFor("backup -> passive")
    primary.interrupt()  # Ctrl-C in terminal 1
    assert await primary.ended() == 128 + signal.SIGINT, primary.text
    assert (await desk.run(PAIR_CALL, timeout=45))[-1] == "hi"


@pytest_twisted.ensureDeferred
async def test_chat_on_loopback(desk: Desk) -> None:
    alice = await desk.start(ALICE)
    bob = await desk.start(BOB)
    await alice.waitFor(r"\* bob is here")
    await bob.waitFor(r"\* alice is here")
    alice.type("hello, bob")
    await bob.waitFor("alice: hello, bob")
    alice.endInput()
    assert await alice.ended() == 0, alice.text
    await bob.waitFor(r"\* alice left")
