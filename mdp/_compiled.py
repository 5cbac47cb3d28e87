"""The modules ``setup.py`` compiles with Cython where it can, and the import hook that runs
a module's source where its compiled file no longer matches it (the build's :data:`RECORD`
of sizes and times).  Imports nothing of the package."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec, PathFinder

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Optional

MODULES = (
    "mdp.machine", "mdp.messages", "mdp.policy", "mdp.blocking",
    "mdp.majordomo.broker", "mdp.majordomo.broker_machine", "mdp.majordomo.broker_records",
    "mdp.majordomo.client", "mdp.majordomo.client_machine", "mdp.majordomo.codec", "mdp.majordomo.worker",
    "mdp.transport.framing", "mdp.transport.framed", "mdp.transport.router", "mdp.transport.dealer",
    "mdp.transport.channellink", "mdp.transport.channels", "mdp.transport.pipes", "mdp.transport.zeromq",
    "mdp.transport.zmqio",
)

#: ``.pyx`` modules, optional companions of listed modules that work without them
ACCELERATORS = ("mdp.transport._zmqframes", "mdp.transport._records")

#: modules whose ``.pxd`` cimports others': they run compiled only if those do
CIMPORTS = {
    "mdp.majordomo.client_machine": ("mdp.machine",), "mdp.majordomo.worker": ("mdp.machine",),
    "mdp.majordomo.client": ("mdp.majordomo.client_machine",),
    "mdp.majordomo.broker": ("mdp.majordomo.broker_machine",),
    "mdp.majordomo.broker_machine": ("mdp.machine", "mdp.majordomo.broker_records"),
    "mdp.blocking": ("mdp.majordomo.client", "mdp.majordomo.client_machine")}

PURE_ENV = "MDP_PURE_PYTHON"  # set (not "" or "0"): install compiles nothing, imports run the sources
#: the build's record in a working tree, one line a module ("name source-size source-mtime-ns
#: compiled-size compiled-mtime-ns"), and a line "build FINGERPRINT" naming its settings
RECORD = "_compiled.record"
_BUILD = "build"

_RECORDED = (*MODULES, *ACCELERATORS)
_HERE = os.path.dirname(os.path.abspath(__file__))


def pure_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    value = (os.environ if environ is None else environ).get(PURE_ENV, "")
    return value not in ("", "0")


def _base(package: str, name: str) -> str:
    """Module *name*'s path under *package*, without a suffix."""
    return os.path.join(package, *name.split(".")[1:])


def compiled_file(base: str) -> Optional[str]:
    """The compiled module at *base* (a path without its suffix), if there is one."""
    return next((base + suffix for suffix in EXTENSION_SUFFIXES if os.path.isfile(base + suffix)), None)


def _signature(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns


def cimported(name: str) -> list[str]:
    """The modules *name* cimports (:data:`CIMPORTS`), transitively, nearest first."""
    return list(dict.fromkeys(module for other in CIMPORTS.get(name, ())
                              for module in (other, *cimported(other))))


def source_signature(package: str, name: str) -> tuple[int, int]:
    """Sizes and times, summed, of *name*'s source and its and its cimports' ``.pxd`` files."""
    paths = [_base(package, name) + (".pyx" if name in ACCELERATORS else ".py")]
    paths += filter(os.path.isfile, [_base(package, module) + ".pxd" for module in (name, *cimported(name))])
    size, mtime = map(sum, zip(*map(_signature, paths)))
    return size, mtime


def _record_lines(package: str) -> Optional[list[list[str]]]:
    try:
        with open(os.path.join(package, RECORD), encoding="ascii") as f:
            return [line.split() for line in f.read().splitlines()]
    except OSError:
        return None


def read_record(package: str) -> Optional[dict[str, tuple[int, ...]]]:
    lines = _record_lines(package)
    return None if lines is None else {
        fields[0]: tuple(map(int, fields[1:])) for fields in lines
        if len(fields) == 5 and fields[0] in _RECORDED and all(x.isdigit() for x in fields[1:])}


_record_of = functools.lru_cache(maxsize=None)(read_record)  # what the import hook reads, once


def current(package: str, name: str, compiled: str, record: Optional[Mapping[str, tuple[int, ...]]]) -> bool:
    """Whether *compiled* was built from *name*'s current source (True without a record)."""
    if record is None:
        return True
    try:
        return name in record and (*source_signature(package, name), *_signature(compiled)) == record[name]
    except OSError:
        return False


def kind(package: str, name: str, record: Optional[Mapping[str, tuple[int, ...]]]) -> str:
    """What an import of *name* runs: ``compiled``, ``source`` (none built), ``pure`` (:data:`PURE_ENV`)
    or ``stale`` (other sources, or :data:`CIMPORTS` not compiled)."""
    compiled = compiled_file(_base(package, name))
    if compiled is None:
        return "source"
    if pure_requested():
        return "pure"
    if not current(package, name, compiled, record) or any(
            kind(package, other, record) != "compiled" for other in CIMPORTS.get(name, ())):
        return "stale"
    return "compiled"


def reusable(package: str, name: str, build: str) -> Optional[str]:
    """The compiled *name*, if a build with fingerprint *build* made it from the current sources."""
    compiled = compiled_file(_base(package, name))
    built = [_BUILD, build] in (_record_lines(package) or []) and compiled is not None
    return compiled if built and current(package, name, compiled, read_record(package) or {}) else None


def write_record(package: str, builtSince: float, build: Optional[str] = None) -> None:
    """Record the modules compiled since *builtSince* (and by an earlier build) and *build*."""
    old = read_record(package) or {}
    lines = []
    for name in _RECORDED:
        compiled = compiled_file(_base(package, name))
        if compiled is None:
            continue
        signature = _signature(compiled)
        if old.get(name, ())[2:] == signature:
            entry = old[name]  # not rebuilt
        elif signature[1] >= builtSince * 1e9:
            entry = source_signature(package, name) + signature
        else:
            continue  # from no build we know of: runs as source
        lines.append(" ".join([name, *map(str, entry)]) + "\n")
    path = os.path.join(package, RECORD)
    if lines:
        with open(path, "w", encoding="ascii") as f:
            f.writelines(([f"{_BUILD} {build}\n"] if build else []) + lines)
    elif os.path.exists(path):
        os.remove(path)


def remove_compiled(package: str) -> None:
    for name in _RECORDED:
        compiled = compiled_file(_base(package, name))
        if compiled is not None:
            os.remove(compiled)
    write_record(package, builtSince=0)  # of no module: removes the record


class SourceFirst:
    """A meta path finder: a module's source where :func:`kind` says ``pure`` or ``stale``, or
    where it is no longer listed and a compiled file is beside it; else the usual finder's."""

    @staticmethod
    def find_spec(name: str, path: Optional[Sequence[str]] = None,
                  target: object = None) -> Optional[ModuleSpec]:
        if not path or not name.startswith("mdp.") or name in ACCELERATORS:
            return None
        leaf = name.rpartition(".")[2]
        for directory in path:
            source = os.path.join(directory, leaf + ".py")
            if not os.path.isfile(source):
                continue
            if name in MODULES:
                package = os.path.normpath(os.path.join(directory, *[os.pardir] * (name.count(".") - 1)))
                runSource = kind(package, name, _record_of(package)) in ("pure", "stale")
            else:
                runSource = compiled_file(os.path.join(directory, leaf)) is not None
            if not runSource:
                return None
            from importlib.util import spec_from_file_location

            return spec_from_file_location(name, source)
        return None


def install() -> None:
    """Put :class:`SourceFirst` just ahead of the path finder (once)."""
    if any(finder is SourceFirst for finder in sys.meta_path):
        return
    where = next((i for i, finder in enumerate(sys.meta_path) if finder is PathFinder), len(sys.meta_path))
    sys.meta_path.insert(where, SourceFirst)  # type: ignore[arg-type]


def in_use() -> dict[str, bool]:
    """For each listed module that is imported: whether it runs compiled."""
    return {name: not (getattr(sys.modules[name], "__file__", None) or "").endswith(".py")
            for name in MODULES if sys.modules.get(name) is not None}


def status(package: str = _HERE) -> dict[str, str]:
    """:func:`kind` of each listed module and accelerator, without importing it."""
    record = read_record(package)
    return {name: kind(package, name, record) for name in _RECORDED}


def accelerator(name: str) -> Optional[object]:
    """The accelerator *name*, imported, if :func:`kind` says ``compiled``; else None."""
    if kind(_HERE, name, _record_of(_HERE)) != "compiled":
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
