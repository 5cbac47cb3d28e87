"""Every code block of README.md and docs/*.md runs as written, or is checked,
or is listed here as one that cannot run, with the reason.  (Shell blocks and
transcripts are tests/test_docs_commands.py's; unmarked blocks are diagrams,
grammars and log lines.)

- A ``python`` block is a complete program.  It runs in a fresh interpreter,
  in an empty directory, and must exit 0 within :data:`TIMEOUT` seconds,
  with nothing on stderr.  Its entry in :data:`SNIPPETS` says what it prints
  (lines its comments show) and what it needs first: files the page's
  commands make, or servers the page names.  Those servers use the default
  port, 127.0.0.1:5555, so they and the snippet run in a network namespace of
  the test's own, as does a snippet that sends UDP beacons.  A ``.tac`` block
  (an Application for ``twistd -ny``) is run so, in a namespace, and a
  client command must get its answer.
- A ``toml``, ``yaml`` or ``text`` block is checked by its function in
  :data:`CHECKS`: the access policy loads and says what the page says, the
  scrape config targets the documented metrics port, the sample scrape names
  only metrics the broker has.
- :data:`EXCLUDED` lists the python blocks that cannot run alone, with the
  reason; each is still compiled, and checked as far as it can be.

A block is named by its page and a piece of its text that no other block of
the page has: ``"docs/sp.md: from mdp.sp.peers import"``.  A block that is
neither run, checked nor excluded fails
:func:`test_every_block_is_run_checked_or_excluded`; an entry that names no
block (or several) fails :func:`test_the_tables_name_one_block_each`.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from tests.test_docs_commands import FENCE, SHELL_LANGUAGES, doc_files
from tests.test_harmony_netns import namespace  # noqa: F401  (the fixture, for SNIPPETS' netns)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
#: seconds one snippet (or one server's start, or one command) may take
TIMEOUT = 45


# --- the blocks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: str
    line: int
    language: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse(text: str, page: str) -> list[Block]:
    """The fenced blocks of *text* with a language that is not a shell's."""
    found = []
    for fence in FENCE.finditer(text):
        language = fence.group(1).lower()
        if language and language not in SHELL_LANGUAGES:
            found.append(Block(page, text.count("\n", 0, fence.start()) + 1, language, fence.group(2)))
    return found


def blocks() -> list[Block]:
    """Every block of README.md and docs/*.md this file covers, in page order."""
    found: list[Block] = []
    for path in doc_files():
        found += parse(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
    return found


def matching(key: str, among: Optional[list[Block]] = None) -> list[Block]:
    """The blocks *key* (``"PAGE: TEXT"``) names: those of PAGE holding TEXT."""
    page, text = key.split(": ", 1)
    return [b for b in (blocks() if among is None else among) if b.page == page and text in b.text]


def block(key: str) -> Block:
    (found,) = matching(key)
    return found


def page_text(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


# --- what each python block needs and prints -----------------------------------------------


@dataclass(frozen=True)
class Tac:
    """A ``.tac`` block: once ``twistd -ny`` logs *ready*, *check* must print *answer*."""

    ready: str
    check: str
    answer: str


@dataclass(frozen=True)
class Snippet:
    #: its stdout, line by line; each line as the block shows it in a comment
    prints: tuple[str, ...] = ()
    #: or a pattern its whole stdout must match (a port the OS picked)
    matches: str = ""
    #: commands of its page run first, in its directory (files it reads)
    setup: tuple[str, ...] = ()
    #: commands its page names, started first (ready once they log READY[program])
    servers: tuple[str, ...] = ()
    #: run in a network namespace with only loopback (servers and tacs always are)
    netns: bool = False
    tac: Optional[Tac] = None

    @property
    def isolated(self) -> bool:
        return self.netns or bool(self.servers) or self.tac is not None


#: what a ``twist`` server logs once it serves
READY = {"mdp-broker": "MDP broker listening on", "mdp-worker": "sent READY"}

BROKER = "twist mdp-broker"
ECHO_WORKER = "twist mdp-worker --service echo --handler echo"

#: python block -> how it runs (blocks not listed run plainly and print nothing)
SNIPPETS: dict[str, Snippet] = {
    "README.md: async def main(reactor):": Snippet(prints=("[b'HELLO', b'WORLD']",)),
    'docs/binarystar.md: BinaryStar("primary"': Snippet(tac=Tac(
        "MDP broker listening on", "mdp call mmi.binarystar", '"role": "primary"')),
    "docs/blocking.md: client.map(": Snippet(
        servers=(BROKER, ECHO_WORKER), prints=("[b'hello']", "[b'a']", "[b'b']", "[b'c']")),
    "docs/blocking.md: worker.run": Snippet(servers=(BROKER,), prints=("[b'HELLO']",)),
    "docs/cli.md: WorkerService(": Snippet(tac=Tac("sent READY", "mdp call reverse hello", "olleh")),
    "docs/cli.md: strports.service(": Snippet(tac=Tac(
        "Factory starting on", "mdp status --broker tcp:host=127.0.0.1:port=5555", "no services")),
    "docs/freelance.md: bound = await server.listen": Snippet(prints=("[b'ok', b'hello']",)),
    "docs/freelance.md: server.streamFactory()": Snippet(prints=("[b'ok', b'hello']",)),
    "docs/freelance.md: SequentialClient(endpoints": Snippet(prints=("[b'done', b'job']",)),
    "docs/harmony.md: from mdp.harmony import": Snippet(netns=True, prints=(
        "SHOUT alice (b'hello, everyone',)", "WHISPER alice (b'just for you', b'a second frame')")),
    'docs/mdp.md: dialect="majortomo")': Snippet(prints=("[b'hi']",)),
    'docs/mdp.md: "mmi.service"': Snippet(prints=("b'200' [b'404']",)),
    "docs/mdp.md: MemoryReplyStore(": Snippet(prints=("[b'paid', b'42']",)),
    "docs/metrics.md: Broker(reactor, metrics=metrics)": Snippet(
        matches=r"http://127\.0\.0\.1:\d+/metrics\n"),
    "docs/security.md: curveAllow=": Snippet(
        setup=("mdp keygen broker", "mdp keygen worker", "mdp keygen alice", "mkdir allowed",
               "cp worker.key alice.key allowed/"),
        prints=("[b'hello']",)),
    "docs/sessions.md: session+tcp:": Snippet(prints=("[b'over a session']",)),
    "docs/sessions.md: SessionServer(": Snippet(prints=("got [b'ok', b'hello']",)),
    "docs/sp.md: SPServer(": Snippet(prints=("b'HELLO'",)),
    "docs/titanic.md: TitanicClient(": Snippet(prints=("[b'HELLO'] [b'AGAIN']",)),
}

#: python block -> why it is not run
EXCLUDED: dict[str, str] = {
    "docs/binarystar.md: class PairedServer(FreelanceServer):":
        "a class to put in a program: examples/binarystar_freelance.py has it in full, and "
        "tests/test_examples.py runs that (test_the_paired_server_is_the_examples: they agree)",
    "docs/spark.md: out = call_service(":
        "a call on the DataFrame `df` of a Spark job, with a broker at broker:5555: "
        "examples/spark_enrich.py is a whole job, run by tests/test_docs_commands.py "
        "(test_the_spark_call_takes_call_services_arguments: its keywords are the API's)",
    "docs/spark.md: rows = spark.readStream":
        "a streaming query of a Spark job reading in/, with a broker at broker:5555: "
        "tests/test_spark.py runs one (test_a_streaming_query_restarted_from_its_checkpoint_"
        "runs_each_request_once)",
    "docs/spark.md: enrich = service_column(":
        "calls on the DataFrame `df` of a Spark job, whose session must exist (arrow_udf), with "
        "a broker at broker:5555: tests/test_spark.py makes the same calls "
        "(test_a_column_function_in_with_column_and_in_select)",
}


# --- running ---------------------------------------------------------------------------------


def argv(command: str) -> list[str]:
    """*command* as this checkout runs it: ``twist``, ``twistd`` and ``mdp``
    of this interpreter's environment, anything else from PATH."""
    words = shlex.split(command)
    beside = Path(sys.executable).parent / words[0]
    if words[0] in ("twist", "twistd", "mdp"):
        program = [str(beside)] + (["--log-format", "text"] if words[0] == "twist" else [])
        return program + words[1:]
    found = shutil.which(words[0])
    assert found is not None, f"no {words[0]} on PATH"
    return [found, *words[1:]]


def inside(netns: Optional[str], args: list[str]) -> list[str]:
    if netns is None:
        return args
    ip = shutil.which("ip")
    assert ip is not None
    return [ip, "netns", "exec", netns, *args]


ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=TIMEOUT, env=ENV)


@dataclass
class Server:
    """A process in the background, its stdout and stderr read as it writes."""

    args: list[str]
    cwd: Path
    output: bytes = b""
    proc: subprocess.Popen[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.proc = subprocess.Popen(self.args, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)

    def waitFor(self, pattern: str) -> None:
        """Read until *pattern* is in the output; fail after TIMEOUT seconds or at its exit."""
        assert self.proc.stdout is not None
        wanted = pattern.encode()
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + TIMEOUT
            while wanted not in self.output:
                left = deadline - time.monotonic()
                assert left > 0 and selector.select(left), f"no {pattern!r} from {self.args}:\n{self.text}"
                data = os.read(self.proc.stdout.fileno(), 65536)
                assert data, f"{self.args} ended before {pattern!r}:\n{self.text}"
                self.output += data

    def stop(self) -> int:
        """SIGTERM (as Ctrl-C or a service manager would stop it); its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = self.proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rest, _ = self.proc.communicate()
        self.output += rest
        return self.proc.returncode

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")


def run_tac(path: Path, tac: Tac, netns: str) -> None:
    twistd = Server(inside(netns, [*argv("twistd"), "--pidfile=", "-ny", path.name]), path.parent)
    try:
        twistd.waitFor(tac.ready)
        done = run(inside(netns, argv(tac.check)), path.parent)
        assert done.returncode == 0 and tac.answer in done.stdout, (done, twistd.text)
    finally:
        status = twistd.stop()
    # twistd stops, then ends itself by the signal it was stopped with
    assert status in (0, -signal.SIGTERM) and "Server Shut Down." in twistd.text, twistd.text
    assert "Traceback" not in twistd.text and "Unhandled" not in twistd.text, twistd.text


def python_blocks() -> list[Block]:
    return [b for b in blocks() if b.language == "python"]


def run_blocks() -> list[tuple[Block, Snippet]]:
    """Each python block that is not excluded, and how it runs."""
    found = python_blocks()
    excluded = {b for key in EXCLUDED for b in matching(key, found)}
    runs = []
    for b in found:
        if b in excluded:
            continue
        named = [key for key in SNIPPETS if matching(key, [b])]
        runs.append((b, SNIPPETS[named[0]] if len(named) == 1 else Snippet()))
    return runs


@pytest.mark.parametrize("entry", run_blocks(), ids=lambda e: e[0].where)
def test_the_snippet_runs_as_written(entry: tuple[Block, Snippet], tmp_path: Path,
                                     request: Any) -> None:
    b, snippet = entry
    path = tmp_path / ("snippet.tac" if snippet.tac else "snippet.py")
    path.write_text(b.text, encoding="utf-8")
    for command in snippet.setup:
        done = run(argv(command), tmp_path)
        assert done.returncode == 0, (command, done)
    netns = request.getfixturevalue("namespace") if snippet.isolated else None
    if snippet.tac is not None:
        assert netns is not None
        run_tac(path, snippet.tac, netns)
        return
    servers: list[Server] = []
    try:
        for command in snippet.servers:
            servers.append(Server(inside(netns, argv(command)), tmp_path))
            servers[-1].waitFor(READY[shlex.split(command)[1]])
        done = run(inside(netns, [sys.executable, path.name]), tmp_path)
    finally:
        for server in servers:
            server.stop()
    assert done.returncode == 0 and not done.stderr, f"{b.where}:\n{done.stdout}{done.stderr}"
    if snippet.matches:
        assert re.fullmatch(snippet.matches, done.stdout), (b.where, done.stdout)
    else:
        assert done.stdout.splitlines() == list(snippet.prints), b.where


# --- the blocks that are not python ------------------------------------------------------------


def check_access_policy(b: Block, tmp_path: Path) -> None:
    """The policy loads (as ``--access FILE``) and says what the page says."""
    from mdp.policy import AccessPolicy

    path = tmp_path / "access.toml"
    path.write_text(b.text, encoding="utf-8")
    policy = AccessPolicy.load(str(path))
    key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
    assert policy.mayCall(key, b"billing.invoices") and policy.mayCall(key, b"echo")
    assert not policy.mayServe(key, b"echo")
    assert policy.mayServe("CN=worker-1,O=Example", b"billing.x")
    assert not policy.mayCall("CN=worker-1,O=Example", b"echo")
    assert policy.mayCall("CN=someone else", b"echo") and not policy.mayCall("CN=someone else", b"x")
    assert not policy.mayCall(None, b"echo")


def check_scrape_config(b: Block, tmp_path: Path) -> None:
    """A Prometheus scrape config for the metrics endpoint the page's commands open."""
    import yaml  # PyYAML: installed with majortomo, of the test extra

    (job,) = yaml.safe_load(b.text)["scrape_configs"]
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.rsplit(":", 1)
    assert f"--metrics tcp:{port}:interface={host}" in page_text(b.page)


def check_sample_scrape(b: Block, tmp_path: Path) -> None:
    """Every series of the sample is one a broker's metrics have."""
    from twisted.internet.task import Clock

    from mdp import Broker
    from mdp.metrics import BrokerMetrics

    metrics = BrokerMetrics()
    Broker(Clock(), metrics=metrics)  # its states are read from it at each scrape
    families = {m.name for m in metrics.registry.collect()}
    for line in b.text.strip().split("\n"):
        name = re.match(r"[a-z_]+", line)
        assert name, line
        base = re.sub(r"_(total|count|sum|bucket|created)$", "", name.group())
        assert name.group() in families or base in families, line


def check_systemd_unit(b: Block, tmp_path: Path) -> None:
    """A unit systemd can read ([Unit], [Service], [Install]) whose ExecStart runs a twist
    plugin with options that plugin has."""
    import configparser
    import shlex
    import subprocess

    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  (keys are case-sensitive)
    unit.read_string(b.text)
    assert unit.sections() == ["Unit", "Service", "Install"], unit.sections()
    argv = shlex.split(unit["Service"]["ExecStart"].replace("\\\n", " "))
    assert argv[0].endswith("/twist"), argv
    plugin = next(arg for arg in argv if arg.startswith("mdp-"))
    twist = os.path.join(os.path.dirname(sys.executable), "twist")
    helped = subprocess.run([twist, plugin, "--help"], capture_output=True, text=True, timeout=60).stdout
    for arg in argv[argv.index(plugin) + 1:]:
        if arg.startswith("--"):
            assert f"{arg.split('=')[0]}=" in helped or f"{arg} " in helped, (plugin, arg)


#: block that is not python -> the check of it
CHECKS: dict[str, Callable[[Block, Path], None]] = {
    "docs/deployment.md: mdp-broker.service": check_systemd_unit,
    "docs/deployment.md: mdp-worker@.service": check_systemd_unit,
    "docs/deployment.md: mdp-titanic.service": check_systemd_unit,
    "docs/security.md: [[peer]]": check_access_policy,
    "docs/metrics.md: scrape_configs:": check_scrape_config,
    "docs/metrics.md: mdp_broker_requests_total{": check_sample_scrape,
}


@pytest.mark.parametrize("key", CHECKS)
def test_the_block_says_what_the_library_does(key: str, tmp_path: Path) -> None:
    CHECKS[key](block(key), tmp_path)


# --- the excluded blocks, as far as they can be checked --------------------------------------


@pytest.mark.parametrize("key", EXCLUDED)
def test_an_excluded_block_compiles(key: str) -> None:
    compile(block(key).text, key, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def _without_annotations(tree: ast.AST) -> str:
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                node.body = node.body[1:] or [ast.Pass()]
        elif isinstance(node, ast.ClassDef) and isinstance(node.body[0], ast.Expr):
            node.body = node.body[1:]
    return ast.unparse(tree)


def test_the_paired_server_is_the_examples() -> None:
    shown = ast.parse(block("docs/binarystar.md: class PairedServer(FreelanceServer):").text)
    example = ast.parse((ROOT / "examples" / "binarystar_freelance.py").read_text(encoding="utf-8"))
    (cls,) = [n for n in example.body if isinstance(n, ast.ClassDef) and n.name == "PairedServer"]
    assert _without_annotations(shown) == _without_annotations(ast.Module([cls], []))


def test_the_spark_call_takes_call_services_arguments() -> None:
    from mdp.spark import call_service

    (call,) = [n for n in ast.walk(ast.parse(block("docs/spark.md: out = call_service(").text))
               if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "call_service"]
    arguments = inspect.signature(call_service).bind(
        *[ast.unparse(a) for a in call.args], **{k.arg: ast.literal_eval(k.value) for k in call.keywords})
    assert "broker" in arguments.arguments


# --- the tables -----------------------------------------------------------------------------------


def test_every_block_is_run_checked_or_excluded() -> None:
    found = blocks()
    assert len([b for b in found if b.language == "python"]) > 15, "the docs' python blocks were not found"
    checked = {b for key in CHECKS for b in matching(key, found)}
    unknown = [f"{b.where}: ```{b.language}" for b in found if b.language != "python" and b not in checked]
    assert not unknown, ("blocks no test checks (make them python, or add a check to CHECKS):\n"
                         + "\n".join(unknown))


def test_the_tables_name_one_block_each() -> None:
    found = blocks()
    problems = []
    for table, language in ((SNIPPETS, "python"), (EXCLUDED, "python"), (CHECKS, None)):
        for key in table:
            named = [b for b in matching(key, found) if language in (None, b.language)]
            if len(named) != 1:
                problems.append(f"{key!r} names {len(named)} blocks ({', '.join(b.where for b in named)})")
    for b in found:
        keys = [key for table in (SNIPPETS, EXCLUDED, CHECKS) for key in table if matching(key, [b])]
        if len(keys) > 1:
            problems.append(f"{b.where} is named by {len(keys)} entries: {keys}")
    assert not problems, "update the tables:\n" + "\n".join(problems)


def test_what_a_snippet_prints_and_needs_is_on_its_page() -> None:
    for key, snippet in SNIPPETS.items():
        b = block(key)
        for line in snippet.prints:
            assert line in b.text, f"{key}: prints {line!r}, which the block does not show"
        for command in (*snippet.setup, *snippet.servers):
            assert command in page_text(b.page), f"{key}: needs {command!r}, which {b.page} does not show"
        assert not (snippet.tac and snippet.servers), key


def test_the_parser_reads_blocks_as_documented() -> None:
    sample = "text\n```python\nprint(1)\n```\n\n```sh\nls\n```\n```\nraw\n```\n```toml\na = 1\n```\n"
    assert parse(sample, "p.md") == [Block("p.md", 2, "python", "print(1)\n"),
                                     Block("p.md", 12, "toml", "a = 1\n")]
