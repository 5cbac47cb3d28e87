"""What a built wheel holds: every module of every mdp subpackage, the type-hint
marker, the Twisted plugin dropin and the licence; and that it runs on its own.

An editable install hides a package missing from setup.cfg (the checkout is on
``sys.path``), so the wheel is built from a copy of the checkout and checked
file by file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent

#: not part of a build, and big or changing while other tests run
_SKIP = shutil.ignore_patterns(".git", ".venv", ".tox", ".hypothesis", ".ruff_cache", "build", "dist",
                               "site", "*.egg-info", "__pycache__", "dropin.cache", "results")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build one wheel from a copy of the checkout (no network: the venv's
    setuptools and wheel build it)."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "src"
    shutil.copytree(ROOT, source, ignore=_SKIP)
    out = tmp / "dist"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--quiet", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=90,
        # what the wheel holds, not the compiled modules (tests/test_compiled.py): not
        # compiling keeps the build within its timeout wherever Cython is installed
        env={**os.environ, "MDP_PURE_PYTHON": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = out.glob("txmajordomo-*.whl")
    return built


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def source_modules() -> list[str]:
    """Every module of the mdp package in the checkout, as a wheel path."""
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "mdp").rglob("*.py")
                  if "__pycache__" not in p.parts)


def test_a_wheel_built_without_compiling_is_pure_and_ships_anywhere(wheel: Path) -> None:
    """``MDP_PURE_PYTHON=1 pip wheel .`` is how a wheel for every platform is
    made (README, Install): no compiled module, tagged ``py3-none-any``."""
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    assert not [n for n in wheel_names(wheel) if n.endswith((".so", ".pyd", ".c"))]


def test_every_subpackage_is_a_package_of_the_wheel(wheel: Path) -> None:
    names = wheel_names(wheel)
    subpackages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "mdp").rglob("__init__.py"))
    assert {"mdp", "mdp/app", "mdp/majordomo", "mdp/transport"} <= set(subpackages)
    assert [p for p in subpackages if f"{p}/__init__.py" not in names] == []
    assert [m for m in source_modules() if m not in names] == []


def test_the_wheel_has_the_typing_marker_the_plugin_dropin_and_the_licence(wheel: Path) -> None:
    names = wheel_names(wheel)
    assert "mdp/py.typed" in names
    assert "twisted/plugins/mdp_plugins.py" in names
    # a dropin cache is written per install, never shipped; no other twisted files
    assert [n for n in names if n.startswith("twisted/")] == ["twisted/plugins/mdp_plugins.py"]
    # setuptools puts it in .dist-info/ (older) or .dist-info/licenses/ (newer)
    assert [n for n in names if n.endswith(".dist-info/LICENSE") or n.endswith(".dist-info/licenses/LICENSE")]


def test_the_metadata_names_the_licence_and_the_project_urls(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    assert "txmajordomo/txmajordomo/issues" in text
    assert "Project-URL: Documentation," in text
    assert "MIT" in text
    assert "Typing :: Typed" in text


def test_the_wheel_alone_runs_the_mdp_command_and_the_twist_plugin(wheel: Path, tmp_path: Path) -> None:
    """Unpacked first on ``sys.path``, the wheel's own files answer ``mdp
    --version`` and ``twist mdp-broker --help`` (not the checkout's)."""
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    env = dict(os.environ, PYTHONPATH=str(target), PYTHONDONTWRITEBYTECODE="1")
    program = (
        "import sys, mdp.app.tap, twisted.plugins.mdp_plugins as dropin\n"
        "for m in (mdp.app.tap, dropin):\n"
        "    assert m.__file__.startswith(sys.argv[1]), m.__file__\n"
        "from mdp.app.cli import main\n"
        "main(['--version'])\n"
    )
    version = subprocess.run([sys.executable, "-c", program, str(target)], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version.stdout + version.stderr
    assert "txmajordomo" in version.stdout
    twist = subprocess.run(
        [sys.executable, "-c", "from twisted.application.twist._twist import Twist; Twist.main()",
         "mdp-broker", "--help"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert twist.returncode == 0, twist.stdout + twist.stderr
    assert "--endpoint" in twist.stdout
