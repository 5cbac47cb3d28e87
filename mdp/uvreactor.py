"""Twisted's asyncio reactor over a uvloop event loop, for throughput (every
node runs on any reactor).  Install it before anything imports
``twisted.internet.reactor``::

    from mdp import uvreactor
    uvreactor.install()

or ``twist --reactor=uvloop mdp-broker``.  uvloop is the ``speed`` extra.
"""

from __future__ import annotations

from typing import Any

from twisted.python.usage import UsageError

INSTALL_HINT = "pip install 'txmajordomo[speed]' (or pip install uvloop; not on Windows)"


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
    """:class:`twisted.internet.asyncioreactor.AsyncioSelectorReactor` with timer
    waits rounded up to whole milliseconds (uvloop rounds to the nearest: a timer
    would fire early and spin), and readers called without a legacy log context
    where they need none (:func:`_needsLogContext`)."""
    from mdp.transport.twisted_private import uvloop_reactor_class

    return uvloop_reactor_class(_needsLogContext)


def _needsLogContext(reader: Any) -> bool:
    """Whether *reader* (or its protocol) needs Twisted's legacy log context."""
    needs = getattr(reader, "needsLogContext", None)
    if needs is None:
        needs = getattr(getattr(reader, "protocol", None), "needsLogContext", True)
    return bool(needs)


def install() -> Any:
    """Install :func:`reactor_class` over a new uvloop loop (the thread's
    current one) and return the reactor.  Raises :class:`UVLoopMissing` or
    ``ReactorAlreadyInstalledError``, installing nothing."""
    import asyncio
    import sys

    if "twisted.internet.reactor" in sys.modules:
        from twisted.internet.error import ReactorAlreadyInstalledError

        raise ReactorAlreadyInstalledError("reactor already installed")
    loop = new_loop()
    from twisted.internet.main import installReactor

    asyncio.set_event_loop(loop)
    installReactor(reactor_class()(loop))
    from twisted.internet import reactor
    from twisted.logger import Logger

    Logger(namespace=__name__).info("reactor: Twisted's asyncio reactor over uvloop {version}",
                                    version=sys.modules["uvloop"].__version__)
    return reactor


__all__ = ["INSTALL_HINT", "UVLoopMissing", "install", "new_loop", "reactor_class"]
