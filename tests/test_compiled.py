"""The hot modules compiled at install (mdp/_compiled.py, setup.py): which one
runs, compiled or source; that an install that could compile did; and what
compiling would change unseen (log namespaces, interface signatures)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import sysconfig
import time
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from mdp import _compiled

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(60)

NAME = "mdp.majordomo.client_machine"


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package directory "mdp" with majordomo/client.py and machine.py, each
    with a compiled module beside it (stand-ins: the finder only looks at
    files; compiled, the client's classes extend the machine's)."""
    monkeypatch.delenv(_compiled.PURE_ENV, raising=False)
    package = tmp_path / "mdp"
    (package / "majordomo").mkdir(parents=True)
    (package / "majordomo" / "client_machine.py").write_text("WHO = 'source'\n")
    (package / "majordomo" / ("client_machine" + EXTENSION_SUFFIXES[0])).write_bytes(b"compiled")
    (package / "machine.py").write_text("")
    (package / ("machine" + EXTENSION_SUFFIXES[0])).write_bytes(b"compiled")
    return package


def find(package: Path) -> object:
    _compiled._record_of.cache_clear()  # read the record afresh
    return _compiled.SourceFirst.find_spec(NAME, [str(package / "majordomo")])


def test_a_module_no_longer_compiled_runs_its_source_not_an_older_build(tree: Path) -> None:
    """A module dropped from the list keeps, in a working tree built before,
    its compiled file beside the source: the source runs."""
    source = tree / "majordomo" / "dropped.py"
    source.write_text("WHO = 'source'\n")
    (tree / "majordomo" / ("dropped" + EXTENSION_SUFFIXES[0])).write_bytes(b"older code")
    spec = _compiled.SourceFirst.find_spec("mdp.majordomo.dropped", [str(tree / "majordomo")])
    assert spec is not None and spec.origin == str(source)
    (tree / "majordomo" / "plain.py").write_text("")  # no compiled file: the usual import
    assert _compiled.SourceFirst.find_spec("mdp.majordomo.plain", [str(tree / "majordomo")]) is None


def test_without_a_build_record_a_compiled_module_is_trusted(tree: Path) -> None:
    # an install from a wheel: built together
    assert find(tree) is None
    assert _compiled.status(str(tree))[NAME] == "compiled"


def test_a_module_built_from_its_source_as_it_is_runs_compiled(tree: Path) -> None:
    _compiled.write_record(str(tree), builtSince=0)
    assert find(tree) is None
    assert _compiled.status(str(tree))[NAME] == "compiled"


def test_a_source_changed_since_the_build_runs_instead_of_its_compiled_module(tree: Path) -> None:
    _compiled.write_record(str(tree), builtSince=0)
    source = tree / "majordomo" / "client_machine.py"
    info = os.stat(source)
    # the same size, and a time only a nanosecond apart: still not the source compiled
    os.utime(source, ns=(info.st_atime_ns, info.st_mtime_ns + 1))
    spec = find(tree)
    assert spec is not None and spec.origin == str(source)
    assert _compiled.status(str(tree))[NAME] == "stale"
    # older, as a copy that keeps times would leave it: changed all the same
    os.utime(source, ns=(info.st_atime_ns, info.st_mtime_ns - 10**10))
    assert find(tree) is not None


def test_a_declarations_file_changed_since_the_build_runs_the_source(tree: Path) -> None:
    """The ``.pxd`` beside a source (its compiled classes' fields) is part
    of what was built: changed or removed since, the source runs."""
    declarations = tree / "majordomo" / "client_machine.pxd"
    declarations.write_text("cdef class _Call:\n    cdef public object service\n")
    _compiled.write_record(str(tree), builtSince=0)
    assert find(tree) is None
    declarations.write_text("cdef class _Call:\n    cdef public object state\n")
    assert find(tree) is not None
    assert _compiled.status(str(tree))[NAME] == "stale"
    declarations.unlink()
    assert _compiled.status(str(tree))[NAME] == "stale"


def test_a_module_whose_cimports_run_from_source_runs_from_source(tree: Path) -> None:
    """Compiled, the client's classes extend the compiled machine's: where
    the machine runs from source (edited since the build), so does the
    client, whose compiled module could not import over it."""
    assert _compiled.CIMPORTS[NAME] == ("mdp.machine",)
    _compiled.write_record(str(tree), builtSince=0)
    machine = tree / "machine.py"
    info = os.stat(machine)
    os.utime(machine, ns=(info.st_atime_ns, info.st_mtime_ns + 1))
    assert _compiled.status(str(tree))["mdp.machine"] == "stale"
    assert _compiled.status(str(tree))[NAME] == "stale"
    assert find(tree) is not None
    # and where the machine was not compiled at all
    (tree / ("machine" + EXTENSION_SUFFIXES[0])).unlink()
    assert _compiled.status(str(tree))["mdp.machine"] == "source"
    assert find(tree) is not None


def test_a_module_is_stale_when_a_declarations_file_it_cimports_changed(tree: Path) -> None:
    """The blocking client's classes extend the client's: a rebuild after
    ``client.pxd`` changed that compiled the client again but not the
    blocking module (it failed) leaves the old blocking module to run from
    source, not against the new client's classes."""
    assert "mdp.majordomo.client_machine" in _compiled.cimported("mdp.blocking")
    assert _compiled.cimported("mdp.blocking")[-1] == "mdp.machine"  # (through the client)
    (tree / "majordomo" / "client.py").write_text("")  # (the blocking client's base)
    (tree / "majordomo" / ("client" + EXTENSION_SUFFIXES[0])).write_bytes(b"compiled")
    (tree / "blocking.py").write_text("")
    blocking = tree / ("blocking" + EXTENSION_SUFFIXES[0])
    blocking.write_bytes(b"compiled")
    os.utime(blocking, (1, 1))
    declarations = tree / "majordomo" / "client_machine.pxd"
    declarations.write_text("cdef class _Call:\n    cdef public object service\n")
    _compiled.write_record(str(tree), builtSince=0)
    assert _compiled.status(str(tree))["mdp.blocking"] == "compiled"
    declarations.write_text("cdef class _Call:\n    cdef public object service, state\n")
    (tree / "majordomo" / ("client_machine" + EXTENSION_SUFFIXES[0])).write_bytes(b"rebuilt")
    _compiled.write_record(str(tree), builtSince=time.time() - 60)  # the client's, not blocking's
    assert _compiled.status(str(tree))[NAME] == "compiled"
    assert _compiled.status(str(tree))["mdp.blocking"] == "stale"


def test_cimports_says_what_the_declarations_cimport() -> None:
    """``CIMPORTS`` is what each ``.pxd`` of the package cimports from it."""
    for name in _compiled.MODULES:
        path = Path(_compiled._base(str(ROOT / "mdp"), name) + ".pxd")
        said = set()
        if path.exists():
            for line in path.read_text().splitlines():
                words = line.split()
                if len(words) >= 4 and words[0] == "from" and words[2] == "cimport":
                    said.add(words[1])
                elif len(words) >= 2 and words[0] == "cimport":
                    said.update(w.strip(",") for w in words[1:])
        assert {m for m in said if m.startswith("mdp.")} == set(_compiled.CIMPORTS.get(name, ())), name


def test_every_cimport_is_a_listed_module_with_its_declarations() -> None:
    for name, others in _compiled.CIMPORTS.items():
        assert name in _compiled.MODULES
        for other in (name, *others):
            assert os.path.isfile(_compiled._base(str(ROOT / "mdp"), other) + ".pxd"), other


def test_a_second_build_reuses_only_what_an_earlier_build_made_of_todays_sources(tree: Path) -> None:
    """setup.py takes a compiled module of the working tree as its build
    (the test extras installed after the demo's install compile nothing)
    only where the record says it is the build of the sources as they are."""
    compiled = str(tree / "majordomo" / ("client_machine" + EXTENSION_SUFFIXES[0]))
    assert _compiled.reusable(str(tree), NAME, "b1") is None  # no record: from no build we know
    _compiled.write_record(str(tree), builtSince=0, build="b1")
    assert _compiled.reusable(str(tree), NAME, "b1") == compiled
    assert _compiled.reusable(str(tree), NAME, "b2") is None  # other settings (a new Cython)
    assert _compiled.read_record(str(tree)) and _compiled.status(str(tree))[NAME] == "compiled"
    (tree / "majordomo" / "client_machine.pxd").write_text("cdef class Client: pass\n")
    assert _compiled.reusable(str(tree), NAME, "b1") is None  # its declarations changed
    (tree / "majordomo" / "client_machine.pxd").unlink()
    assert _compiled.reusable(str(tree), NAME, "b1") == compiled
    (tree / "majordomo" / "client_machine.py").write_text("WHO = 'edited'\n")
    assert _compiled.reusable(str(tree), NAME, "b1") is None  # its source changed: compile
    assert _compiled.reusable(str(tree), "mdp.machine", "b1") is not None
    _compiled.write_record(str(tree), builtSince=0)  # a record from before the settings line
    assert _compiled.reusable(str(tree), "mdp.machine", "b1") is None


def test_a_compiled_module_replaced_since_the_record_runs_as_source(tree: Path) -> None:
    _compiled.write_record(str(tree), builtSince=0)
    (tree / "majordomo" / ("client_machine" + EXTENSION_SUFFIXES[0])).write_bytes(b"another build")
    assert find(tree) is not None


def test_a_rebuild_keeps_modules_it_left_alone_and_forgets_old_ones(tree: Path) -> None:
    _compiled.write_record(str(tree), builtSince=0)
    first = _compiled.read_record(str(tree))
    # a later build that compiled nothing: the module untouched since keeps its entry
    _compiled.write_record(str(tree), builtSince=2**40)
    assert _compiled.read_record(str(tree)) == first
    # a compiled module from a build the record does not know of, not written by this one
    compiled = tree / "majordomo" / ("client_machine" + EXTENSION_SUFFIXES[0])
    compiled.write_bytes(b"from elsewhere")
    os.utime(compiled, (1, 1))
    _compiled.write_record(str(tree), builtSince=2**40)
    assert set(_compiled.read_record(str(tree)) or {}) == {"mdp.machine"}
    assert find(tree) is not None  # a record without it: source ...
    for other in (compiled, tree / ("machine" + EXTENSION_SUFFIXES[0])):
        other.write_bytes(b"from elsewhere")
        os.utime(other, (1, 1))
    _compiled.write_record(str(tree), builtSince=2**40)
    assert not (tree / _compiled.RECORD).exists()
    assert find(tree) is None  # ... but no record at all: trusted


def test_the_environment_asks_for_the_sources(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _compiled.write_record(str(tree), builtSince=0)
    for value, pure in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv(_compiled.PURE_ENV, value)
        assert (find(tree) is not None) is pure, value
        assert _compiled.status(str(tree))[NAME] == ("pure" if pure else "compiled")


def test_modules_not_listed_or_not_compiled_are_left_alone(
        tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_compiled.PURE_ENV, "1")
    assert _compiled.SourceFirst.find_spec("mdp.majordomo.mmi", [str(tree / "majordomo")]) is None
    assert _compiled.SourceFirst.find_spec("client", None) is None
    (tree / "majordomo" / ("client_machine" + EXTENSION_SUFFIXES[0])).unlink()
    assert find(tree) is None
    assert _compiled.status(str(tree))[NAME] == "source"


def test_a_pure_install_removes_what_an_earlier_build_left(tree: Path) -> None:
    _compiled.write_record(str(tree), builtSince=0)
    _compiled.remove_compiled(str(tree))
    assert sorted(p.name for p in tree.rglob("*") if p.is_file()) == ["client_machine.py", "machine.py"]


def test_an_accelerator_is_recorded_from_its_cython_source(tree: Path) -> None:
    """A module written in Cython (``ACCELERATORS``) is current while its
    ``.pyx`` is as it was built, stale after, and removed by a pure install;
    the import hook leaves it alone (it has no Python source to run)."""
    name = _compiled.ACCELERATORS[0]
    directory, leaf = os.path.split(_compiled._base(str(tree), name))
    os.makedirs(directory, exist_ok=True)
    source = Path(directory, leaf + ".pyx")
    source.write_text("# cython\n")
    Path(directory, leaf + EXTENSION_SUFFIXES[0]).write_bytes(b"compiled")
    _compiled.write_record(str(tree), builtSince=0)
    assert name in (_compiled.read_record(str(tree)) or {})
    assert _compiled.status(str(tree))[name] == "compiled"
    assert _compiled.SourceFirst.find_spec(name, [directory]) is None
    info = os.stat(source)
    os.utime(source, ns=(info.st_atime_ns, info.st_mtime_ns + 1))
    assert _compiled.status(str(tree))[name] == "stale"
    _compiled.remove_compiled(str(tree))
    assert _compiled.status(str(tree))[name] == "source"


def test_every_listed_module_exists_and_the_hook_is_installed() -> None:
    for name in _compiled.MODULES:
        assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name
    for name in _compiled.ACCELERATORS:
        assert (ROOT / (name.replace(".", "/") + ".pyx")).is_file(), name
    assert _compiled.SourceFirst in sys.meta_path


def test_every_listed_module_logs_under_its_own_name() -> None:
    """twisted.logger's Logger() names itself from its caller's frame, which a
    compiled module has not: each says its name."""
    for name in _compiled.MODULES:
        log = getattr(importlib.import_module(name), "log", None)
        if log is not None:
            assert log.namespace == name


def _run(code: str, timeout: float = 100, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != _compiled.PURE_ENV}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**environ, **env}, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


_IMPORT_ALL = ("import importlib, json; from mdp import _compiled\n"
               "for name in _compiled.MODULES: importlib.import_module(name)\n"
               "print(json.dumps(_compiled.in_use()))")


def _can_compile() -> bool:
    """This interpreter has Python's headers and a C compiler to build with."""
    include = sysconfig.get_paths()["include"]
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return os.path.isfile(os.path.join(include, "Python.h")) and any(
        os.access(os.path.join(d, compiler), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))


def test_an_install_that_could_compile_did_and_every_module_runs_compiled() -> None:
    """On CI (a fresh `pip install -e .`, a compiler and Python's headers),
    every listed module runs compiled, and the environment switch brings back
    the sources.  Elsewhere a checkout may be installed otherwise: skipped."""
    if _compiled.pure_requested():
        pytest.skip(f"{_compiled.PURE_ENV} is set")
    status = _compiled.status()
    if set(status.values()) != {"compiled"}:
        if os.environ.get("CI") and _can_compile():
            pytest.fail(f"the install compiled not every module although this machine can: {status}")
        pytest.skip(f"not every module is compiled here (pip install -e . builds them): {status}")
    assert json.loads(_run(_IMPORT_ALL)) == {name: True for name in _compiled.MODULES}
    assert json.loads(_run(_IMPORT_ALL, **{_compiled.PURE_ENV: "1"})) == {
        name: False for name in _compiled.MODULES}
    # ZeroMQ messages go through the C module (tests/test_zmq_frames.py)
    probe = "from mdp.transport import zeromq; print(zeromq.zmq_frames() is not None)"
    assert _run(probe).strip() == "True"


def test_the_machines_behave_the_same_from_source() -> None:
    """Compiled, the machines and the broker's records are extension types
    (their ``.pxd``): the machine, broker, limits and behaviour tests (over
    the loopback transport) again, from source."""
    if not any(_compiled.in_use().values()) and _compiled.status()[NAME] != "compiled":
        pytest.skip("the modules run from source already")
    out = _run("import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
               "'tests/test_machines_majordomo.py', 'tests/test_broker.py', "
               "'tests/test_limits.py', 'tests/test_mdp_behaviour.py']))",
               **{_compiled.PURE_ENV: "1"})
    assert " passed" in out and "failed" not in out


def test_the_interfaces_hold_for_the_sources_too() -> None:
    """zope.interface checks methods' signatures only where they are Python
    functions, not compiled ones: the interface tests again, from source."""
    if not any(_compiled.in_use().values()) and _compiled.status()[NAME] != "compiled":
        pytest.skip("the modules run from source already")
    out = _run("import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
               "'tests/test_interfaces.py']))", **{_compiled.PURE_ENV: "1"})
    assert " passed" in out and "failed" not in out
