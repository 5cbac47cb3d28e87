"""The hot modules compiled at install (mdp/_compiled.py, setup.py): which one
runs, compiled or source, and that an install that could compile did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from mdp import _compiled

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(60)


def _pair(tmp_path: Path, source_age: float, compiled_age: float) -> tuple[Path, Path]:
    """machine.py and a compiled machine module in *tmp_path*, last written
    *source_age* and *compiled_age* seconds ago."""
    source = tmp_path / "machine.py"
    source.write_text("WHO = 'source'\n")
    compiled = tmp_path / ("machine" + EXTENSION_SUFFIXES[0])
    compiled.write_bytes(b"not really compiled")
    now = os.stat(source).st_mtime
    os.utime(source, (now - source_age, now - source_age))
    os.utime(compiled, (now - compiled_age, now - compiled_age))
    return source, compiled


def test_a_compiled_module_built_after_its_source_is_left_to_the_usual_finder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_compiled.PURE_ENV, raising=False)
    _pair(tmp_path, source_age=100, compiled_age=50)
    assert _compiled.SourceFirst.find_spec("mdp.machine", [str(tmp_path)]) is None


def test_a_source_edited_after_the_build_runs_instead_of_its_compiled_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_compiled.PURE_ENV, raising=False)
    source, _ = _pair(tmp_path, source_age=10, compiled_age=100)
    spec = _compiled.SourceFirst.find_spec("mdp.machine", [str(tmp_path)])
    assert spec is not None and spec.origin == str(source)


def test_the_environment_asks_for_the_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, _ = _pair(tmp_path, source_age=100, compiled_age=50)
    for value, pure in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv(_compiled.PURE_ENV, value)
        spec = _compiled.SourceFirst.find_spec("mdp.machine", [str(tmp_path)])
        assert (spec is not None and spec.origin == str(source)) is pure, value


def test_modules_not_listed_or_not_compiled_are_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_compiled.PURE_ENV, "1")
    _pair(tmp_path, source_age=10, compiled_age=100)
    assert _compiled.SourceFirst.find_spec("mdp.errors", [str(tmp_path)]) is None
    assert _compiled.SourceFirst.find_spec("machine", None) is None
    (tmp_path / ("machine" + EXTENSION_SUFFIXES[0])).unlink()
    assert _compiled.SourceFirst.find_spec("mdp.machine", [str(tmp_path)]) is None


def test_every_listed_module_exists_and_the_hook_is_installed() -> None:
    for name in _compiled.MODULES:
        assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name
    assert _compiled.SourceFirst in sys.meta_path


def _run(code: str, **env: str) -> dict[str, bool]:
    environ = {k: v for k, v in os.environ.items() if k != _compiled.PURE_ENV}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                          env={**environ, **env}, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


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
    """Where this checkout was installed with a compiler and Python's headers
    (CI, and `pip install -e .` on a developer's machine), every listed
    module runs compiled; the environment switch brings back the sources."""
    status = _compiled.status()
    if not any(kind != "source" for kind in status.values()):
        if not _can_compile():
            pytest.skip("no C compiler or Python headers: the package runs as source")
        pytest.fail(f"nothing compiled although this machine can: reinstall (pip install -e .) "
                    f"or set {_compiled.PURE_ENV}=1 for a source install; {status}")
    if _compiled.pure_requested():
        pytest.skip(f"{_compiled.PURE_ENV} is set")
    # a module the build left out is a broken build; one edited since is a working tree
    assert [name for name, kind in status.items() if kind == "source"] == [], status
    if "stale" in status.values():
        pytest.skip(f"sources edited since the build run as source; rebuild with pip install -e .: {status}")
    assert _run(_IMPORT_ALL) == {name: True for name in _compiled.MODULES}
    assert _run(_IMPORT_ALL, **{_compiled.PURE_ENV: "1"}) == {name: False for name in _compiled.MODULES}
