"""The modules an install compiles with Cython where it can (``setup.py``), and
the import hook that decides, module by module, whether the compiled one runs.

The hot paths of every node (the MDP machines, their drivers, the codecs and
the transports' framing) are plain Python; compiled, the same source costs a
request fewer instructions in the interpreter (docs/performance.md, round
two, item 16).  Nothing depends on it: without a C compiler or Python's
headers, on an interpreter other than CPython's, or with
``MDP_PURE_PYTHON=1`` at install, the package is the plain source.

A compiled module (``client.cpython-311-x86_64-linux-gnu.so`` beside
``client.py``) is what Python would import first.  In a working tree (an
editable install), a source edited after the build would then be shadowed by
its old compiled self.  So the build records, in :data:`RECORD` beside this
file, each source's size and modification time as it was compiled, and each
compiled module's; a module whose source or compiled file no longer matches
its record runs from source.  ``MDP_PURE_PYTHON`` set in the environment
runs every source.  An install from a wheel has no record: what it holds was
built together.

This module imports nothing of the package: ``setup.py`` runs it before
anything is installed.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec, PathFinder

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
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
    "mdp.transport.framed",
    "mdp.transport.router",
    "mdp.transport.dealer",
    "mdp.transport.channels",
    "mdp.transport.pipes",
    "mdp.transport.zeromq",
    "mdp.transport.zmqio",
)

#: modules written in Cython itself (``.pyx``: C that Python cannot say),
#: each an optional companion of a listed module that goes on without it:
#: ``_zmqframes`` reads and sends ZeroMQ messages with libzmq's calls,
#: ``_records`` encodes and splits stream records (their docstrings)
ACCELERATORS = ("mdp.transport._zmqframes", "mdp.transport._records")

#: compiled modules that use another's compiled classes (their ``.pxd``
#: files ``cimport`` them): each runs compiled only where those do too, for
#: its compiled self cannot import over the other's source
CIMPORTS = {
    "mdp.majordomo.client": ("mdp.machine",),
    "mdp.majordomo.worker": ("mdp.machine",),
    "mdp.majordomo.broker": ("mdp.machine",),
    "mdp.blocking": ("mdp.majordomo.client",),
}

#: set (to anything but "" or "0") at install: no compiling, and compiled
#: modules a working tree holds are removed; at run time: the sources run
#: even where compiled modules are installed
PURE_ENV = "MDP_PURE_PYTHON"

#: the build's record in a working tree (not part of a wheel): one line a
#: module, "name source-size source-mtime-ns compiled-size compiled-mtime-ns"
#: (and one of the build's settings, below)
RECORD = "_compiled.record"
#: the record's line naming the build's settings: "build FINGERPRINT"
_BUILD = "build"

_LISTED = frozenset(MODULES)
_RECORDED = (*MODULES, *ACCELERATORS)
_HERE = os.path.dirname(os.path.abspath(__file__))

#: directory -> its record, read once (None: there is none)
_records: dict[str, Optional[dict[str, tuple[int, ...]]]] = {}


def pure_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
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


def _signature(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns


def source_of(name: str) -> str:
    """The suffix of module *name*'s source."""
    return ".pyx" if name in ACCELERATORS else ".py"


def cimported(name: str) -> list[str]:
    """The modules whose classes module *name*'s compiled classes use
    (:data:`CIMPORTS`, and theirs in turn), nearest first."""
    found: list[str] = []
    for other in CIMPORTS.get(name, ()):
        for module in (other, *cimported(other)):
            if module not in found:
                found.append(module)
    return found


def source_signature(package: str, name: str) -> tuple[int, int]:
    """What the build of module *name* in *package* is made of: its source,
    the ``.pxd`` declaring its compiled classes where there is one, and the
    ``.pxd`` of every module it cimports (their sizes and their times
    summed: any of them changed, even to an older time, changes it)."""
    directory, leaf = _paths(package, name)
    size, mtime = _signature(os.path.join(directory, leaf + source_of(name)))
    for module in (name, *cimported(name)):
        where, last = _paths(package, module)
        declarations = os.path.join(where, last + ".pxd")
        if os.path.isfile(declarations):
            extra = _signature(declarations)
            size, mtime = size + extra[0], mtime + extra[1]
    return size, mtime


def _paths(package: str, name: str) -> tuple[str, str]:
    """The directory of module *name* under *package* (the ``mdp``
    directory) and its last name."""
    parts = name.split(".")[1:]
    return os.path.join(package, *parts[:-1]), parts[-1]


def _record_lines(package: str) -> Optional[list[list[str]]]:
    """The fields of each line of *package*'s build record, if it has one."""
    try:
        with open(os.path.join(package, RECORD), encoding="ascii") as f:
            return [line.split() for line in f.read().splitlines()]
    except OSError:
        return None


def read_record(package: str) -> Optional[dict[str, tuple[int, ...]]]:
    """The build record of the package directory *package*, if it has one."""
    lines = _record_lines(package)
    if lines is None:
        return None
    record = {}
    for fields in lines:
        if len(fields) == 5 and fields[0] in _RECORDED:
            try:
                record[fields[0]] = tuple(int(x) for x in fields[1:])
            except ValueError:
                continue
    return record


def _record_of(package: str) -> Optional[dict[str, tuple[int, ...]]]:
    if package not in _records:
        _records[package] = read_record(package)
    return _records[package]


def current(package: str, name: str, compiled: str,
            record: Optional[Mapping[str, tuple[int, ...]]]) -> bool:
    """Whether *compiled*, module *name*'s compiled file, was built from its
    source in *package* as it is now (:func:`source_signature`; True where
    there is no record at all)."""
    if record is None:
        return True
    entry = record.get(name)
    if entry is None:
        return False
    try:
        return (source_signature(package, name) == entry[:2]
                and _signature(compiled) == entry[2:])
    except OSError:
        return False


def kind(package: str, name: str, record: Optional[Mapping[str, tuple[int, ...]]]) -> str:
    """What an import of module *name* in *package* runs: ``compiled``;
    ``source``, none being built; ``stale``, the source of a compiled module
    not built from it (or the ``.pxd`` files it uses) as it is now, or of
    one whose :data:`CIMPORTS` run from source; ``pure``, the source because
    :data:`PURE_ENV` asks for it."""
    directory, leaf = _paths(package, name)
    compiled = compiled_file(directory, leaf)
    if compiled is None:
        return "source"
    if pure_requested():
        return "pure"
    if not current(package, name, compiled, record):
        return "stale"
    if any(kind(package, other, record) != "compiled" for other in CIMPORTS.get(name, ())):
        return "stale"  # what it cimports runs from source
    return "compiled"


def recorded_build(package: str) -> Optional[str]:
    """The build settings (``setup.py``'s fingerprint) the record of
    *package* names, if any."""
    return next((fields[1] for fields in _record_lines(package) or ()
                 if len(fields) == 2 and fields[0] == _BUILD), None)


def reusable(package: str, name: str, build: str) -> Optional[str]:
    """The working tree's compiled module *name*, if an earlier build under
    the settings *build* (a fingerprint) made it from its sources as they
    are now (the record says so; :func:`current`): a build takes it instead
    of compiling again (``setup.py``)."""
    if recorded_build(package) != build:
        return None
    directory, leaf = _paths(package, name)
    compiled = compiled_file(directory, leaf)
    record = read_record(package)
    if compiled is None or record is None or not current(package, name, compiled, record):
        return None
    return compiled


def write_record(package: str, builtSince: float, build: Optional[str] = None) -> None:
    """After a build in the working tree *package*: record each compiled
    module written there since *builtSince* (a time), keep the entries of
    those untouched since an earlier build, and forget the rest; and the
    build's settings, *build* (:func:`reusable`)."""
    old = read_record(package) or {}
    lines = []
    for name in _RECORDED:
        directory, leaf = _paths(package, name)
        compiled = compiled_file(directory, leaf)
        if compiled is None:
            continue
        signature = _signature(compiled)
        if old.get(name, ())[2:] == signature:
            entry = old[name]  # not rebuilt: its source as it was then
        elif signature[1] >= builtSince * 1e9:
            entry = source_signature(package, name) + signature
        else:
            continue  # from no build we know of: runs as source
        lines.append(" ".join([name, *map(str, entry)]) + "\n")
    path = os.path.join(package, RECORD)
    if lines and build:
        lines.insert(0, f"{_BUILD} {build}\n")
    if not lines:
        if os.path.exists(path):
            os.remove(path)
        return
    with open(path, "w", encoding="ascii") as f:
        f.writelines(lines)


def remove_compiled(package: str) -> None:
    """Remove the compiled modules and the record of the working tree
    *package* (an install that asks for the plain sources)."""
    for name in _RECORDED:
        directory, leaf = _paths(package, name)
        compiled = compiled_file(directory, leaf)
        if compiled is not None:
            os.remove(compiled)
    try:
        os.remove(os.path.join(package, RECORD))
    except FileNotFoundError:
        pass


class SourceFirst:
    """A meta path finder for :data:`MODULES`: the plain source when the
    environment asks for it or the compiled module is not the build of the
    source as it is now; else nothing (the usual finder takes the compiled
    module, or the source where there is none)."""

    @staticmethod
    def find_spec(name: str, path: Optional[Sequence[str]] = None,
                  target: object = None) -> Optional[ModuleSpec]:
        if name not in _LISTED or not path:
            return None
        leaf = name.rpartition(".")[2]
        depth = name.count(".")
        for directory in path:
            source = os.path.join(directory, leaf + ".py")
            if not os.path.isfile(source):
                continue
            package = os.path.normpath(os.path.join(directory, *[os.pardir] * (depth - 1)))
            if kind(package, name, _record_of(package)) in ("pure", "stale"):
                from importlib.util import spec_from_file_location

                return spec_from_file_location(name, source)
            return None
        return None


def install() -> None:
    """Put :class:`SourceFirst` just ahead of the path finder (once): hooks
    installed before it (an import checker, a profiler) still come first."""
    if any(finder is SourceFirst for finder in sys.meta_path):
        return
    where = next((i for i, finder in enumerate(sys.meta_path) if finder is PathFinder),
                 len(sys.meta_path))
    sys.meta_path.insert(where, SourceFirst)  # type: ignore[arg-type]


def in_use() -> dict[str, bool]:
    """For each listed module that is imported: whether it runs compiled."""
    loaded = {}
    for name in MODULES:
        module = sys.modules.get(name)
        if module is not None:
            origin = getattr(module, "__file__", None) or ""
            loaded[name] = not origin.endswith(".py")
    return loaded


def status(package: str = _HERE) -> dict[str, str]:
    """For each listed module and accelerator, what an import of it would
    run (:func:`kind`; an accelerator's ``source`` is: none), without
    importing it."""
    record = read_record(package)
    return {name: kind(package, name, record) for name in _RECORDED}


def accelerator(name: str) -> Optional[object]:
    """The accelerator *name* (one of :data:`ACCELERATORS`), imported, if it
    is built from its source as it is now and the sources are not asked for
    (:func:`kind`); else None: its caller does the same in Python."""
    if kind(_HERE, name, _record_of(_HERE)) != "compiled":
        return None
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None
