"""mdp.transport.twisted_private: every private attribute of Twisted the
package relies on still exists in the installed Twisted, and each use does
what it is there for.  A Twisted upgrade that renames or removes one fails
here, by name."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from twisted.internet import protocol, tcp
from twisted.internet.endpoints import serverFromString
from twisted.internet.task import Clock

from mdp.transport import twisted_private
from mdp.transport.tls import server_endpoint


@pytest.mark.parametrize("module,name,attribute,why", twisted_private.PRIVATE,
                         ids=[f"{entry[1]}.{entry[2]}" for entry in twisted_private.PRIVATE])
def test_each_private_attribute_exists_in_this_twisted(module: str, name: str, attribute: str,
                                                       why: str) -> None:
    cls = twisted_private.private_class(module, name)
    assert cls is not None, f"{module}.{name} is gone ({why})"
    assert _defines(cls, attribute), f"{module}.{name}.{attribute} is gone ({why})"


def _defines(cls: type, attribute: str) -> bool:
    """*cls* has *attribute*, or its source sets it on instances (the whole
    name: ``self._protocolInstance`` is no ``_protocol``)."""
    if hasattr(cls, attribute):
        return True
    import inspect
    import re

    return re.search(rf"\bself\.{re.escape(attribute)}\b", inspect.getsource(cls)) is not None


class _Renamed:
    def __init__(self) -> None:
        self._protocolInstance = None


def test_an_attribute_renamed_to_a_longer_name_counts_as_gone() -> None:
    assert not _defines(_Renamed, "_protocol")
    assert _defines(_Renamed, "_protocolInstance")


def test_no_other_module_touches_a_private_attribute_of_twisted() -> None:
    """The adapter names them all: no other module of the package spells one."""
    import pathlib

    import mdp

    names = {entry[2] for entry in twisted_private.PRIVATE}
    root = pathlib.Path(mdp.__file__).parent
    for path in root.rglob("*.py"):
        if path.name == "twisted_private.py":
            continue
        text = path.read_text()
        for name in names:
            assert not any(spelt in text for spelt in (f".{name}", f'"{name}"', f"'{name}'")), (
                f"{path}: {name}")


class _Sink(protocol.Protocol):
    def __init__(self) -> None:
        self.data = b""

    def dataReceived(self, data: bytes) -> None:
        self.data += data


def test_a_direct_write_reaches_the_socket_and_leaves_twisted_s_buffer_empty() -> None:
    """write_direct sends at once on an idle plain connection, and declines
    while Twisted holds something to send."""
    from twisted.internet import reactor

    here, there = socket.socketpair()
    try:
        connection = tcp.Connection(here, _Sink(), reactor)
        connection.connected = 1
        assert twisted_private.direct_capable(connection)
        assert twisted_private.write_direct(connection, [b"hel", b"lo"])
        assert there.recv(16) == b"hello"
        assert not connection.dataBuffer and not connection._tempDataBuffer
        connection._tempDataBuffer.append(b"queued")
        assert not twisted_private.write_direct(connection, [b"later"])
    finally:
        here.close()
        there.close()


def test_reads_skip_the_wrappers_of_an_endpoint_and_of_client_service() -> None:
    """shortcut_reads points the outer wrapper's dataReceived at the protocol."""
    from twisted.internet.endpoints import _WrappingProtocol

    inner = _Sink()
    wrapper = _WrappingProtocol(None, inner)  # type: ignore[arg-type]

    class Transport:
        protocol = wrapper

    inner.transport = Transport()  # type: ignore[assignment]
    twisted_private.shortcut_reads(inner)
    wrapper.dataReceived(b"x")
    assert inner.data == b"x"
    assert wrapper.dataReceived == inner.dataReceived


def test_call_soon_uses_the_asyncio_loop_of_an_asyncio_reactor() -> None:
    import asyncio

    from twisted.internet.asyncioreactor import AsyncioSelectorReactor

    loop = asyncio.new_event_loop()
    try:
        reactor: Any = AsyncioSelectorReactor(loop)
        ran: list[str] = []
        twisted_private.call_soon(reactor, ran.append, "soon")
        loop.call_soon(loop.stop)
        loop.run_forever()
        assert ran == ["soon"]
    finally:
        loop.close()
    clock = Clock()
    twisted_private.call_soon(clock, ran.append, "later")
    clock.advance(0)
    assert ran == ["soon", "later"]


def test_the_mtls_endpoint_parser_is_offered_to_twisted(tmp_path: Any) -> None:
    """The dropin's ``mtls:`` parser is a Twisted endpoint string parser:
    Twisted's own ``serverFromString`` finds it and hands it the options."""
    from twisted.internet.interfaces import IStreamServerEndpointStringParser

    from mdp.errors import TransportError
    from twisted.plugins import mdp_plugins

    assert IStreamServerEndpointStringParser.providedBy(mdp_plugins.mutualTLS)
    missing = tmp_path / "missing.pem"
    with pytest.raises(TransportError, match=f"caCerts={missing}: cannot read"):
        serverFromString(Clock(), f"mtls:0:privateKey={missing}:caCerts={missing}")
    with pytest.raises(TransportError, match="takes only port"):
        server_endpoint(Clock(), "0", privateKey="k.pem", caCerts="ca.pem", method="TLS")
