"""The modules an install compiles with Cython where it can (``setup.py``), and
the import hook that decides, module by module, whether the compiled one runs.

The hot paths of every node (the MDP machines, their drivers, the codecs and
the transports' framing) are plain Python; compiled, the same source costs a
request fewer instructions in the interpreter (docs/performance.md, round
two, item 16).  Nothing depends on it: without a C compiler, Cython or
Python's headers, or with ``MDP_PURE_PYTHON=1`` at install, the package is
the plain source.

A compiled module (``client.cpython-311-x86_64-linux-gnu.so`` beside
``client.py``) is what Python would import first.  In a working tree, a
source edited after the build would then be shadowed by its old compiled
self; so the source runs instead whenever it is newer than its compiled
module, and always when ``MDP_PURE_PYTHON`` is set in the environment.  The
check is one ``stat`` pair per listed module, once, when it is imported.

This module imports nothing of the package: ``setup.py`` reads :data:`MODULES`
from it before anything is installed.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec
from importlib.util import spec_from_file_location

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Optional

#: the compiled modules, in the package's own terms
MODULES = (
    "mdp.machine",
    "mdp.messages",
    "mdp.policy",
    "mdp.blocking",
    "mdp.majordomo.broker",
    "mdp.majordomo.client",
    "mdp.majordomo.codec",
    "mdp.majordomo.worker",
    "mdp.transport.framing",
    "mdp.transport.stream",
    "mdp.transport.zeromq",
)

#: set (to anything but "" or "0") at install: no compiling; at run time: the
#: sources run even where compiled modules are installed
PURE_ENV = "MDP_PURE_PYTHON"

#: a source this much newer than its compiled module is taken as edited since
#: the build (files written by one install differ by far less)
_SLACK_SECONDS = 2.0

_LISTED = frozenset(MODULES)


def pure_requested(environ: Optional[dict[str, str]] = None) -> bool:
    """Whether the environment asks for the plain sources."""
    value = (os.environ if environ is None else environ).get(PURE_ENV, "")
    return value not in ("", "0")


def compiled_file(directory: str, leaf: str) -> Optional[str]:
    """The compiled module *leaf* in *directory*, if there is one."""
    for suffix in EXTENSION_SUFFIXES:
        candidate = os.path.join(directory, leaf + suffix)
        if os.path.isfile(candidate):
            return candidate
    return None


def stale(source: str, compiled: str) -> bool:
    """Whether *source* was changed after *compiled* was built from it."""
    try:
        return os.stat(source).st_mtime > os.stat(compiled).st_mtime + _SLACK_SECONDS
    except OSError:
        return True


class SourceFirst:
    """A meta path finder for :data:`MODULES`: the plain source when the
    environment asks for it or the compiled module is older than it; else
    nothing (the usual finder takes the compiled module, or the source where
    there is none)."""

    @staticmethod
    def find_spec(name: str, path: Optional[Sequence[str]] = None,
                  target: object = None) -> Optional[ModuleSpec]:
        if name not in _LISTED or not path:
            return None
        leaf = name.rpartition(".")[2]
        for directory in path:
            source = os.path.join(directory, leaf + ".py")
            if not os.path.isfile(source):
                continue
            compiled = compiled_file(directory, leaf)
            if compiled is None:
                return None
            if pure_requested() or stale(source, compiled):
                return spec_from_file_location(name, source)
            return None
        return None


def install() -> None:
    """Put :class:`SourceFirst` ahead of the usual finders (once)."""
    if not any(finder is SourceFirst for finder in sys.meta_path):
        sys.meta_path.insert(0, SourceFirst)  # type: ignore[arg-type]


def in_use() -> dict[str, bool]:
    """For each listed module that is imported: whether it runs compiled."""
    loaded = {}
    for name in MODULES:
        module = sys.modules.get(name)
        if module is not None:
            origin = getattr(module, "__file__", None) or ""
            loaded[name] = not origin.endswith(".py")
    return loaded


def status() -> dict[str, str]:
    """For each listed module, what an import of it would run: ``compiled``,
    ``source`` (none built), ``stale`` (built from an older source) or
    ``pure`` (:data:`PURE_ENV` set), without importing it."""
    package = os.path.dirname(os.path.abspath(__file__))
    result = {}
    for name in MODULES:
        parts = name.split(".")[1:]
        directory = os.path.join(package, *parts[:-1])
        source = os.path.join(directory, parts[-1] + ".py")
        compiled = compiled_file(directory, parts[-1])
        if compiled is None:
            result[name] = "source"
        elif pure_requested():
            result[name] = "pure"
        elif stale(source, compiled):
            result[name] = "stale"
        else:
            result[name] = "compiled"
    return result
