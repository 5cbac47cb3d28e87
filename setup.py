"""Build: everything is in setup.cfg, but for the hot modules, which are
compiled with Cython where this machine can (mdp/_compiled.py lists them and
says why).  Each is an optional extension: without Cython, a C compiler or
Python's headers, or with MDP_PURE_PYTHON=1, the package installs as the plain
source, which is the same code."""

from __future__ import annotations

import os
import platform
import runpy
import shutil
import sys
import sysconfig
import time
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(HERE, "mdp")
_compiled = runpy.run_path(os.path.join(PACKAGE, "_compiled.py"))


#: how the modules are compiled (part of what makes a build, beside the sources)
COMPILER_DIRECTIVES = {"language_level": 3, "binding": True, "annotation_typing": False,
                       "emit_code_comments": False}
#: no debug information: a third of the compiler's time
COMPILE_ARGS = ["-g0"] if os.name == "posix" else []


def build_settings() -> str:
    """A fingerprint of what besides the sources makes a build: Cython's
    version, the directives and flags, the interpreter and the compiler's
    environment.  A compiled module of an earlier build is reused only
    under the same settings (:meth:`OptionalBuildExt._reused`)."""
    import hashlib
    import json

    try:
        import Cython

        cython = Cython.__version__
    except ImportError:
        cython = None
    settings = [cython, COMPILER_DIRECTIVES, COMPILE_ARGS, sys.version,
                sysconfig.get_config_var("EXT_SUFFIX"),
                {name: os.environ.get(name) for name in ("CC", "CFLAGS", "CPPFLAGS", "LDFLAGS")}]
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def cores() -> int:
    """The cores this build may use (its affinity, where the OS says), at
    most one a module."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:
        count = os.cpu_count() or 1
    return max(1, min(count, len(_compiled["MODULES"]) + len(_compiled["ACCELERATORS"])))


class OptionalBuildExt(build_ext):
    """build_ext that warns and goes on where a module does not compile (the
    source is installed in any case), and builds on every core by default."""

    def finalize_options(self) -> None:
        if self.parallel is None:
            self.parallel = cores()
        super().finalize_options()

    def run(self) -> None:
        started = time.time()
        settings = build_settings()
        # only a build into the working tree reuses what it holds (setuptools
        # builds elsewhere, then copies into it): a wheel is built afresh
        reusing = bool(self.inplace or getattr(self, "editable_mode", False)) and not self.force
        #: the settings under which an earlier build's module is reused (None: none is)
        self._reuseUnder = settings if reusing else None
        try:
            super().run()
        except Exception as e:  # no compiler at all: setuptools raises before any module
            self._skipped("all", e)
        # what the working tree now holds, for the import hook (mdp/_compiled.py)
        _compiled["write_record"](PACKAGE, started, build=settings)

    def build_extension(self, ext: object) -> None:
        if self._reused(ext):
            return
        try:
            super().build_extension(ext)
        except Exception as e:
            self._skipped(getattr(ext, "name", "?"), e)

    def _reused(self, ext: Any) -> bool:
        """Whether the working tree holds module *ext* compiled by an earlier
        build, under the same settings, from its sources as they are now (an
        editable install's build): then that is this build's
        (copied, with its time: the record stays true), not compiled again.
        A second install into the same checkout (the test extras after the
        demo's install) so takes seconds, not minutes."""
        settings = getattr(self, "_reuseUnder", None)
        built = _compiled["reusable"](PACKAGE, ext.name, settings) if settings else None
        if built is None:
            return False
        target = self.get_ext_fullpath(ext.name)
        if os.path.abspath(target) != os.path.abspath(built):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(built, target)
        sys.stderr.write(f"txmajordomo: {ext.name} is up to date, not compiled again\n")
        return True

    @staticmethod
    def _skipped(name: str, error: BaseException) -> None:
        sys.stderr.write(f"txmajordomo: not compiled ({name}): {error}; the source runs instead\n")


def extensions() -> list:
    """The listed modules as Cython extensions, or none (see the docstring)."""
    if _compiled["pure_requested"]():
        # compiled modules a working tree holds from an earlier build would run
        _compiled["remove_compiled"](PACKAGE)
        return []
    if platform.python_implementation() != "CPython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        # PyPy runs the source faster than compiled; on a free-threaded
        # CPython, importing these extensions would turn the GIL back on
        return []
    try:
        from Cython.Build import cythonize
        from setuptools import Extension
    except ImportError:
        sys.stderr.write("txmajordomo: Cython is not installed; the modules are not compiled\n")
        return []
    modules = [
        # (OptionalBuildExt does what optional=True would, for every error)
        Extension(name, [os.path.join(*name.split(".")) + ".py"],
                  extra_compile_args=COMPILE_ARGS)
        for name in _compiled["MODULES"]
    ]
    if os.name == "posix":
        # the modules written in Cython (the ZeroMQ one opens libzmq with
        # dlopen): no Python source of their own; their callers do without
        modules += [
            Extension(name, [os.path.join(*name.split(".")) + ".pyx"],
                      extra_compile_args=COMPILE_ARGS,
                      libraries=["dl"] if sys.platform.startswith("linux") else [])
            for name in _compiled["ACCELERATORS"]
        ]
    try:
        return cythonize(
            modules,
            build_dir=os.path.join("build", "cython"),
            quiet=True,
            # Cython's worker processes, where they fork (elsewhere they
            # would run this file again)
            nthreads=cores() if sys.platform == "linux" and sys.version_info < (3, 14) else 0,
            # a module Cython cannot compile stays source; the others compile
            exclude_failures=True,
            # plain Python semantics, Python 3 syntax; no C asserts of types:
            # the same behaviour as the source
            compiler_directives=COMPILER_DIRECTIVES,
        )
    except Exception as e:
        sys.stderr.write(f"txmajordomo: Cython failed ({e}); the modules are not compiled\n")
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
