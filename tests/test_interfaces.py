"""Every class that declares an interface provides it (``verifyObject``).

The test finds the declaring classes itself, by walking the package: a new
``@implementer`` class without an entry in ``FACTORIES`` fails
:func:`test_every_declaring_class_is_verified`.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any, Callable

import pytest
import pytest_twisted
from twisted.internet import task
from zope.interface import implementedBy
from zope.interface.verify import verifyObject

import mdp
from mdp.handlers import echo


def _modules() -> list[Any]:
    found = []
    for info in pkgutil.walk_packages(mdp.__path__, "mdp."):
        if info.name == "mdp.spark":
            continue  # needs the spark extra; declares no interface
        found.append(importlib.import_module(info.name))
    return found


def declaring_classes() -> dict[str, type]:
    classes = {}
    for module in _modules():
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and cls.__module__ == module.__name__:
                if list(implementedBy(cls).declared):
                    classes[f"{module.__name__}.{name}"] = cls
    return classes


# --- how to make one of each, with no network --------------------------------------

def _clock() -> task.Clock:
    return task.Clock()


def _broker() -> Any:
    from mdp import Broker

    return Broker(_clock())


def _binding() -> Any:
    from mdp.majordomo.broker import Binding

    return Binding(_broker(), True, True)


def _worker() -> Any:
    from mdp import Worker

    return Worker("loopback:verify", "echo", echo, _clock())


def _client() -> Any:
    from mdp import Client

    return Client("loopback:verify", _clock())


def _channel() -> Any:
    from mdp.majordomo.client import _Channel, _ChannelPipe

    return _ChannelPipe(_client(), _Channel("loopback:verify"))


def _freelance_binding() -> Any:
    from mdp.freelance import FreelanceServer, _Binding

    return _Binding(FreelanceServer(echo, _clock()))


def _agent() -> Any:
    from mdp.freelance import AgentClient

    return AgentClient(["loopback:verify"], _clock())


def _loopback_router() -> Any:
    from mdp.transport.loopback import LoopbackNetwork, LoopbackRouter

    return LoopbackRouter("verify", _Receiver(), _clock(), net=LoopbackNetwork())


def _loopback_dealer() -> Any:
    from mdp.transport.loopback import LoopbackDealer, LoopbackNetwork

    return LoopbackDealer("verify", _Receiver(), _clock(), net=LoopbackNetwork())


class _Receiver:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args: None


def _stream_router() -> Any:
    from mdp.transport.stream import StreamRouter

    return StreamRouter(_Receiver(), _clock())


def _stream_dealer() -> Any:
    from mdp.transport.stream import StreamDealer

    dealer = StreamDealer("tcp:host=127.0.0.1:port=1", _Receiver(), _clock())
    dealer.close()
    return dealer


def _stream_channels() -> Any:
    from mdp.transport.stream import StreamChannels

    return StreamChannels("tcp:host=127.0.0.1:port=1", _clock())


def _stream_channel() -> Any:
    channels = _stream_channels()
    channel = channels.open(_Receiver())
    channels.close()
    return channel


def _separately() -> Any:
    from mdp import transport

    return transport.connect_channels("loopback:verify-channels", _clock())


def _zmq_channels() -> Any:
    from mdp.transport.zmqchannels import ZmqChannels

    return ZmqChannels("zmq:inproc://verify-router", _clock(), [b"probe"])


def _zmq_channel() -> Any:
    channels = _zmq_channels()
    channels.open(_Receiver())
    pipe = channels.open(_Receiver())  # (a second at once: waits for the probe's answer)
    channels.close()
    return pipe


def _zmq_router() -> Any:
    from mdp.transport.zeromq import ZmqRouter

    return ZmqRouter("zmq:inproc://verify-router", _Receiver(), _clock())


def _zmq_dealer() -> Any:
    from mdp.transport.zeromq import ZmqDealer

    return ZmqDealer("zmq:inproc://verify-router", _Receiver(), _clock())


def _peer_router() -> Any:
    from mdp.transport import PeerRouter

    return PeerRouter(_Receiver(), _clock())


def _script_router() -> Any:
    from mdp.testing import Script, _Router

    return _Router(Script(), "script:x/y", _Receiver())


def _script_pipe() -> Any:
    from mdp.testing import Script, _Pipe

    return _Pipe(Script(), "script:x/y", "script:x/y#1", _Receiver())


def _sqlite_store() -> Any:
    from mdp.titanic.store import SQLiteStore

    return SQLiteStore(":memory:", _clock())


def _postgres_store() -> Any:
    from mdp.titanic.pgstore import PostgresStore

    return PostgresStore("postgresql://titanic@/titanic?host=/nowhere", _clock())  # (not opened)


def _binarystar() -> Any:
    from mdp.binarystar import BinaryStar

    return BinaryStar("primary", "loopback:bstar-a", "loopback:bstar-b", _clock())


def _sp_pipe() -> Any:
    from mdp.sp.peers import SPClient, _Pipe

    client = SPClient("tcp://127.0.0.1:9", _clock())
    return _Pipe(client, "tcp://127.0.0.1:9")


def _sp_listener() -> Any:
    from mdp.sp.peers import SPServer, _Listener

    return _Listener(SPServer(lambda payload: payload, _clock()))


def _harmony_node() -> Any:
    from mdp.harmony import EndpointDiscovery, Node

    return Node("verify", _clock(), discovery=EndpointDiscovery())


def _harmony(name: str) -> Callable[[], Any]:
    def make() -> Any:
        from mdp.harmony import node

        if name == "BeaconDiscovery":
            return node.BeaconDiscovery("loopback:verify", reactor=_clock())
        return getattr(node, name)()

    return make


def _datagrams(name: str) -> Callable[[], Any]:
    def make() -> Any:
        from mdp.transport import datagram

        spec = datagram.resolve("loopback:verify" if name == "LoopbackDatagrams"
                                else "udp:5670:interface=127.0.0.1")
        made = getattr(datagram, name)(spec, None, _clock())
        if name == "LoopbackDatagrams":
            made.close()
        return made

    return make


def _session_router() -> Any:
    from mdp.session.transport import SessionRouter

    return SessionRouter(None, _clock())


def _session_dealer() -> Any:
    from mdp.session.transport import SessionDealer

    return SessionDealer("session+loopback:verify", None, _clock())


def _session_inner() -> Any:
    from mdp.session.transport import _Inner

    return _Inner(_session_dealer())


def _session_server() -> Any:
    from mdp.session import SessionServer

    return SessionServer(lambda routingId, frames: None, _clock())


def _bare(path: str, *args: Any) -> Callable[[], Any]:
    def make() -> Any:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)(*args)

    return make


FACTORIES: dict[str, Callable[[], Any]] = {
    "mdp.majordomo.broker.Broker": _broker,
    "mdp.majordomo.broker.Binding": _binding,
    "mdp.majordomo.worker.Worker": _worker,
    "mdp.majordomo.client.Client": _client,
    "mdp.majordomo.client._ChannelPipe": _channel,
    "mdp.majordomo.idempotence.MemoryReplyStore": _bare("mdp.majordomo.idempotence.MemoryReplyStore"),
    "mdp.majordomo.idempotence.SQLiteReplyStore": _bare("mdp.majordomo.idempotence.SQLiteReplyStore",
                                                        ":memory:"),
    "mdp.freelance._Binding": _freelance_binding,
    "mdp.freelance.AgentClient": _agent,
    "mdp.transport.framing.RecordDecoder": _bare("mdp.transport.framing.RecordDecoder"),
    "mdp.transport.framing.LengthPrefixedFraming": _bare("mdp.transport.framing.LengthPrefixedFraming"),
    "mdp.transport.spframing.SPFraming": _bare("mdp.transport.spframing.SPFraming", 0x31),
    "mdp.transport.spframing.SPDecoder": _bare("mdp.transport.spframing.SPDecoder", 0x30),
    "mdp.transport.loopback.LoopbackRouter": _loopback_router,
    "mdp.transport.loopback.LoopbackDealer": _loopback_dealer,
    "mdp.transport.router.StreamRouter": _stream_router,
    "mdp.transport.dealer.StreamDealer": _stream_dealer,
    "mdp.transport.channels.StreamChannels": _stream_channels,
    "mdp.transport.channels._StreamChannel": _stream_channel,
    "mdp.transport._Separately": _separately,
    "mdp.transport.router._RouterConnection": _bare("mdp.transport.router._RouterConnection"),
    "mdp.transport.dealer._DealerConnection": _bare("mdp.transport.dealer._DealerConnection"),
    "mdp.transport.zeromq.ZmqRouter": _zmq_router,
    "mdp.transport.zeromq.ZmqDealer": _zmq_dealer,
    "mdp.transport.zmqchannels.ZmqChannels": _zmq_channels,
    "mdp.transport.zmqchannels.ZmqChannel": _zmq_channel,
    "mdp.transport.PeerRouter": _peer_router,
    "mdp.testing._Router": _script_router,
    "mdp.testing._Pipe": _script_pipe,
    "mdp.interfaces.DealerReceiver": _bare("mdp.interfaces.DealerReceiver"),
    "mdp.binarystar.BinaryStar": _binarystar,
    "mdp.sp.peers._Pipe": _sp_pipe,
    "mdp.sp.peers._Listener": _sp_listener,
    "mdp.harmony.node.Node": _harmony_node,
    "mdp.harmony.node.BeaconDiscovery": _harmony("BeaconDiscovery"),
    "mdp.harmony.node.EndpointDiscovery": _harmony("EndpointDiscovery"),
    "mdp.transport.datagram.UDPDatagrams": _datagrams("UDPDatagrams"),
    "mdp.transport.datagram.LoopbackDatagrams": _datagrams("LoopbackDatagrams"),
    "mdp.session.transport.SessionRouter": _session_router,
    "mdp.session.transport.SessionDealer": _session_dealer,
    "mdp.session.transport._Inner": _session_inner,
    "mdp.session.transport.SessionServer": _session_server,
    "mdp.titanic.store.MemoryStore": _bare("mdp.titanic.store.MemoryStore"),
    "mdp.titanic.store.SQLiteStore": _sqlite_store,
    "mdp.titanic.pgstore.PostgresStore": _postgres_store,
}


def test_every_declaring_class_is_verified() -> None:
    missing = sorted(set(declaring_classes()) - set(FACTORIES))
    assert not missing, f"add a factory for {missing}"


@pytest.mark.parametrize("path", sorted(FACTORIES))
@pytest_twisted.ensureDeferred
async def test_declared_interfaces_are_provided(path: str) -> None:
    classes = declaring_classes()
    assert path in classes, f"{path} no longer declares an interface: drop its factory"
    obj = FACTORIES[path]()
    try:
        for interface in implementedBy(classes[path]).declared:
            assert verifyObject(interface, obj)
    finally:
        close = getattr(obj, "close", None)
        if close is not None and path.startswith(("mdp.transport.zeromq",
                                                  "mdp.transport.zmqchannels")):
            await close()


def test_twisted_plugins_verify() -> None:
    from twisted.application.service import IServiceMaker
    from twisted.plugin import IPlugin, getPlugins

    makers = [p for p in getPlugins(IServiceMaker) if p.tapname.startswith(("mdp-", "sp-"))]
    assert sorted(p.tapname for p in makers) == ["mdp-broker", "mdp-freelance-server", "mdp-titanic",
                                                         "mdp-worker", "sp-device", "sp-rep"]
    for maker in makers:
        verifyObject(IServiceMaker, maker)
        verifyObject(IPlugin, maker)
