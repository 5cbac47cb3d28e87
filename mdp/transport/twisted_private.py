"""Every private attribute of Twisted the library uses, each named in :data:`PRIVATE` with its class and why
(``tests/test_twisted_private.py`` fails if a Twisted upgrade removes one)."""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable

from twisted.internet import tcp
from twisted.logger import Logger

log = Logger(namespace=__name__)

#: (module, class, attribute, why): what this module relies on
PRIVATE = (
    ("twisted.internet.abstract", "FileDescriptor", "_tempDataBuffer",
     "a batch goes straight to the socket only while Twisted buffers nothing"),
    ("twisted.internet.abstract", "FileDescriptor", "_writeDisconnected",
     "no direct write once Twisted has shut the write side"),
    ("twisted.internet.endpoints", "_WrappingProtocol", "_wrappedProtocol",
     "reads skip the endpoint's wrapper, which only passes them on"),
    ("twisted.application._client_service", "_ReconnectingProtocolProxy", "_protocol",
     "reads skip ClientService's proxy (a __getattr__ that fails first)"),
    ("twisted.internet.asyncioreactor", "AsyncioSelectorReactor", "_asyncioEventloop",
     "the loop's own call_soon, and readers added to uvloop directly"),
    ("twisted.internet.asyncioreactor", "AsyncioSelectorReactor", "_readers",
     "a reader added to the loop directly is still the reactor's reader"),
    ("twisted.internet.asyncioreactor", "AsyncioSelectorReactor", "_continuousPolling",
     "a descriptor Twisted polls (a file) stays Twisted's"),
    ("twisted.internet.asyncioreactor", "AsyncioSelectorReactor", "_unregisterFDInAsyncio",
     "undo a failed direct add_reader before Twisted's own path"),
    ("twisted.internet.asyncioreactor", "AsyncioSelectorReactor", "_readOrWrite",
     "a direct reader's read and its disconnect handling, as Twisted's"),
    ("twisted.web.http", "HTTPChannel", "_networkProducer",
     "the metrics endpoint stops reading while a client leaves its responses unread"),
    ("twisted.protocols.basic", "LineReceiver", "_buffer",
     "the metrics endpoint tells a half-sent request from an idle connection"),
    ("twisted.logger._global", "LogBeginner", "_temporaryObserver",
     "whether a program began Twisted's logging (a blocking node logs to stdlib if not)"),
)


def private_class(module: str, name: str) -> Any:
    """The class *name* of *module*, or None where this Twisted has none."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def direct_capable(transport: Any) -> bool:
    """*transport* is a plain TCP or UNIX connection (:func:`write_direct` works)."""
    return (isinstance(transport, tcp.Connection) and not getattr(transport, "TLS", False)
            and hasattr(transport, "_tempDataBuffer") and hasattr(transport, "dataBuffer"))


def write_direct(transport: Any, out: list[bytes]) -> bool:
    """Send *out* with one ``send`` while Twisted's write buffer is empty, the
    rest through ``write``; False where it cannot (the caller writes as usual)."""
    if (not transport.connected or transport.disconnecting or transport._writeDisconnected
            or transport.dataBuffer or transport._tempDataBuffer):
        return False
    data = out[0] if len(out) == 1 else b"".join(out)
    sent = transport.writeSomeData(data)
    if isinstance(sent, BaseException):
        return False  # Twisted's own write reports it
    if sent < len(data):
        transport.write(data[sent:])
    return True


#: wrappers that only pass reads on -> the attribute holding what they wrap
#: (a class this Twisted lacks is None, which no wrapper's type is)
_FORWARDERS = {private_class(module, name): inner for module, name, inner, _ in PRIVATE[2:4]}


def shortcut_reads(protocol: Any) -> None:
    """Hand *protocol*'s ``dataReceived`` to the outermost wrapper if all between only pass reads on."""
    outer = inner = getattr(protocol.transport, "protocol", None)
    for _ in range(len(_FORWARDERS)):  # (each kind of wrapper once: no loop on a cycle)
        if type(inner) not in _FORWARDERS:
            break
        inner = getattr(inner, _FORWARDERS[type(inner)], None)
    if inner is protocol and outer is not protocol:
        outer.dataReceived = protocol.dataReceived


def logging_begun() -> bool:
    """Whether Twisted's global logging began (until then events are buffered unseen)."""
    from twisted.logger import globalLogBeginner

    return getattr(globalLogBeginner, "_temporaryObserver", None) is None


def call_soon(reactor: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``callLater(0, fn, *args)``, or the asyncio loop's ``call_soon``; ``cancel()`` cancels either."""
    loop = getattr(reactor, "_asyncioEventloop", None)
    if loop is not None:
        return loop.call_soon(fn, *args)
    return reactor.callLater(0, fn, *args)


def uvloop_reactor_class(needsLogContext: Callable[[Any], bool]) -> type:
    """Twisted's asyncio reactor (see :func:`mdp.uvreactor.reactor_class`)."""
    from twisted.internet.asyncioreactor import AsyncioSelectorReactor

    class UVLoopReactor(AsyncioSelectorReactor):
        def timeout(self) -> Any:
            wait = super().timeout()
            if wait is None or wait <= 0:
                return wait
            return math.ceil(wait * 1000.0) / 1000.0

        def addReader(self, reader: Any) -> None:
            if (reader in self._readers or self._continuousPolling.isReading(reader)
                    or needsLogContext(reader)):
                return super().addReader(reader)  # type: ignore[no-any-return]
            fd = reader.fileno()
            readNow = getattr(reader, "readNow", None)
            read = (readNow,) if readNow is not None else (self._readDirect, reader)
            try:
                self._asyncioEventloop.add_reader(fd, *read)
            except OSError:  # not pollable: Twisted polls it
                self._unregisterFDInAsyncio(fd)
                return super().addReader(reader)  # type: ignore[no-any-return]
            self._readers[reader] = fd
            return None

        def _readDirect(self, reader: Any) -> None:
            try:
                self._readOrWrite(reader, True)
            except KeyboardInterrupt:
                raise
            except BaseException:  # as callWithLogger does
                log.failure("while reading from {reader!r}", reader=reader)

    return UVLoopReactor


def pause_channel_reads(channel: Any) -> None:
    """Stop reading an ``HTTPChannel``'s connection (its ``pauseProducing`` stops responses too)."""
    channel._networkProducer.pauseProducing()


def line_buffered(receiver: Any) -> bool:
    """A ``LineReceiver`` holds bytes of a line not yet whole."""
    return bool(receiver._buffer)
