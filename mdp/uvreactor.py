"""Twisted's asyncio reactor over a uvloop event loop: the reactor to run
MDP nodes on for throughput.

Every node runs on any reactor.  On this one the reactor's own work per
wake-up (waiting for descriptors, timers, dispatch) is uvloop's compiled
code instead of the Python of Twisted's epoll loop.

Install it before anything imports ``twisted.internet.reactor``::

    from mdp import uvreactor
    uvreactor.install()

or name it to ``twist``: ``twist --reactor=uvloop mdp-broker`` (the plugin
is in ``twisted/plugins/mdp_plugins.py``).  uvloop is the ``speed`` extra:
``pip install 'txmajordomo[speed]'``.
"""

from __future__ import annotations

from typing import Any

from twisted.python.usage import UsageError

#: how to get uvloop, for the error that says it is missing
INSTALL_HINT = "pip install 'txmajordomo[speed]' (or pip install uvloop; not on Windows)"


class UVLoopMissing(ImportError, UsageError):
    """uvloop is not installed (or does not import here); the message says
    how to install it.  Also a usage error, so that ``twist --reactor=uvloop``
    says it in one line with its usage instead of a traceback."""


def new_loop() -> Any:
    """A new uvloop event loop, or :class:`UVLoopMissing`."""
    try:
        import uvloop
    except ImportError as e:
        raise UVLoopMissing(f"the uvloop reactor needs uvloop: {INSTALL_HINT} ({e})") from e
    return uvloop.new_event_loop()


def reactor_class() -> type:
    """:class:`twisted.internet.asyncioreactor.AsyncioSelectorReactor` with
    its timer waits rounded up to whole milliseconds.

    uvloop rounds a timer's delay to the nearest millisecond and runs one
    under half a millisecond at once.  Twisted's asyncio reactor asks for
    the exact delay to its next call, so its timer fired a little early,
    found nothing due, asked again for the rest, and so on until the call
    was due.  Rounded up, a timer fires at most about a
    millisecond late, as on Twisted's epoll reactor, whose waits are whole
    milliseconds too.

    A reader whose ``needsLogContext`` is false (our ZeroMQ sockets), or a
    transport whose protocol's is (our stream connections), is called
    without Twisted's legacy log context: ``callWithLogger`` pushes
    the reader's ``logPrefix()`` as the ``system`` of ``twisted.python.log``
    messages, at every wake-up.  Such a
    reader logs with :mod:`twisted.logger`, which does not read that context;
    every other reader keeps it.  One that also has a ``readNow()`` method
    (our ZeroMQ sockets) has it called by the loop itself instead of
    ``doRead()`` through the reactor's dispatch: ``readNow`` reads, logs
    and handles its own failures, and never raises."""
    from mdp.transport.twisted_private import uvloop_reactor_class

    return uvloop_reactor_class(_needsLogContext)


def _needsLogContext(reader: Any) -> bool:
    """Whether *reader* must be read in Twisted's legacy log context: unless
    it says otherwise (``needsLogContext``), or it is a transport whose
    protocol does."""
    needs = getattr(reader, "needsLogContext", None)
    if needs is None:
        needs = getattr(getattr(reader, "protocol", None), "needsLogContext", True)
    return bool(needs)


def install() -> Any:
    """Install Twisted's asyncio reactor (:func:`reactor_class`) over a new
    uvloop loop (made the thread's current event loop) and return
    the reactor.  Raises :class:`UVLoopMissing` without uvloop, and
    :class:`twisted.internet.error.ReactorAlreadyInstalledError` if a reactor
    is installed already, as every Twisted reactor's ``install`` does; in
    either case nothing is installed."""
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

    # (twist buffers what is logged before its log starts, so this is seen)
    Logger(namespace=__name__).info("reactor: Twisted's asyncio reactor over uvloop {version}",
                                    version=sys.modules["uvloop"].__version__)
    return reactor


__all__ = ["INSTALL_HINT", "UVLoopMissing", "install", "new_loop", "reactor_class"]
