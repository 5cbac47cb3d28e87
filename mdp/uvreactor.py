"""Twisted's asyncio reactor over a uvloop event loop: what the ``twist`` plugins, the ``mdp`` command
and :func:`react` run on when no reactor is installed yet and uvloop imports (else Twisted's default).
A program installs it (``uvreactor.install()``) before anything imports ``twisted.internet.reactor``,
or runs its main in :func:`react`; ``twist --reactor=epoll`` (or ``default``) opts out."""

from __future__ import annotations

import sys
from typing import Any, Callable, NoReturn, Sequence

from twisted.logger import Logger
from twisted.python.usage import UsageError

log = Logger()
INSTALL_HINT = "pip install uvloop (txmajordomo installs it, except on Windows and PyPy)"


class UVLoopMissing(ImportError, UsageError):
    """uvloop is missing; a usage error too, so ``twist`` says it in one line."""


def new_loop() -> Any:
    """A new uvloop event loop, or :class:`UVLoopMissing`."""
    try:
        import uvloop
    except ImportError as e:
        raise UVLoopMissing(f"the uvloop reactor needs uvloop: {INSTALL_HINT} ({e})") from e
    return uvloop.new_event_loop()


def reactor_class() -> type:
    """Twisted's ``AsyncioSelectorReactor`` with timer waits rounded up to whole milliseconds
    (uvloop rounds to the nearest: a timer would fire early and spin), and readers called
    without a legacy log context where they need none."""
    from mdp.transport.twisted_private import uvloop_reactor_class

    return uvloop_reactor_class(_needsLogContext)


def _needsLogContext(reader: Any) -> bool:
    """Whether *reader* (or its protocol) needs Twisted's legacy log context."""
    needs = getattr(reader, "needsLogContext", None)
    if needs is None:
        needs = getattr(getattr(reader, "protocol", None), "needsLogContext", True)
    return bool(needs)


def install() -> Any:
    """Install :func:`reactor_class` over a new uvloop loop (the thread's current one) and
    return it; :class:`UVLoopMissing` or ``ReactorAlreadyInstalledError``, installing nothing."""
    import asyncio

    if "twisted.internet.reactor" in sys.modules:
        from twisted.internet.error import ReactorAlreadyInstalledError

        raise ReactorAlreadyInstalledError("reactor already installed")
    loop = new_loop()
    from twisted.internet.main import installReactor

    asyncio.set_event_loop(loop)
    installReactor(reactor_class()(loop))
    from twisted.internet import reactor

    log.info("reactor: Twisted's asyncio reactor over uvloop {version}",
             version=sys.modules["uvloop"].__version__)
    return reactor


def install_default() -> Any:
    """The reactor: :func:`install`'s if no reactor is installed yet and uvloop
    imports, else the installed one (Twisted's default if none was)."""
    if "twisted.internet.reactor" not in sys.modules:
        try:
            return install()
        except UVLoopMissing as e:
            log.info("reactor: Twisted's default, as uvloop does not import ({error})",
                     error=e.__cause__ or e)
    from twisted.internet import reactor

    return reactor


def react(main: Callable[..., Any], argv: Sequence[Any] = ()) -> NoReturn:
    """``task.react`` on :func:`install_default`'s reactor: ``main(reactor, *argv)`` (a Deferred
    or a coroutine) runs until done, then exit (0, 1 on a failure, a ``SystemExit``'s code)."""
    from twisted.internet import defer, task

    install_default()
    task.react(lambda reactor, *args: defer.ensureDeferred(main(reactor, *args)), argv)


__all__ = ["INSTALL_HINT", "UVLoopMissing", "install", "install_default", "new_loop", "react",
           "reactor_class"]
