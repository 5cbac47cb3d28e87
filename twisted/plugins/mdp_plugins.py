"""Twisted plugin dropin: ``twist mdp-broker``, ``twist mdp-worker``,
``twist mdp-freelance-server``, ``twist mdp-titanic``, ``twist sp-rep``,
``twist sp-device``; the ``mtls:`` server endpoint (mutual TLS).

Each entry names its options class in :mod:`mdp.app.tap` and imports it only
when ``twist`` uses it (parsed, the options make the service): Twisted imports
every dropin to list its plugins, inside ``getPlugins``, which logs and goes
on past whatever an import raises, Ctrl-C included; the package's import
then happens outside it."""

from typing import Any

from twisted.application.reactors import Reactor
from twisted.application.service import IServiceMaker
from twisted.internet.interfaces import IStreamServerEndpointStringParser
from twisted.plugin import IPlugin
from zope.interface import implementer


@implementer(IServiceMaker, IPlugin)
class _Maker:
    """A ``twist`` plugin whose options (``mdp.app.tap.<options>``) are imported on use; the
    parsed options make the service."""

    def __init__(self, tapname: str, description: str, options: str) -> None:
        self.tapname = tapname
        self.description = description
        self.optionsName = options

    @property
    def options(self) -> Any:
        from mdp.app import tap

        return getattr(tap, self.optionsName)

    def makeService(self, options: Any) -> Any:
        return options.makeService()


mdpBroker = _Maker("mdp-broker", "MDP/0.2 (Majordomo) broker.", "BrokerOptions")
mdpWorker = _Maker("mdp-worker", "MDP/0.2 (Majordomo) worker running a handler.",
                   "WorkerOptions")
mdpFreelanceServer = _Maker(
    "mdp-freelance-server",
    "Freelance (brokerless) request-reply server, answering PING with PONG.",
    "FreelanceServerOptions")
mdpTitanic = _Maker("mdp-titanic",
                    "Titanic: disk-backed, disconnected requests through an MDP broker.",
                    "TitanicOptions")
spRep = _Maker("sp-rep", "SP (nng) REP server running a handler.", "SPRepOptions")
spDevice = _Maker("sp-device", "SP (nng) REQ/REP device forwarding requests upstream.",
                  "SPDeviceOptions")

# ``twist --reactor=uvloop``: Twisted's asyncio reactor over uvloop (mdp.uvreactor),
# what the plugins above install anyway when no --reactor is given
uvloopReactor = Reactor("uvloop", "mdp.uvreactor",
                        "Twisted's asyncio reactor over uvloop (txmajordomo's plugins' default)")


@implementer(IStreamServerEndpointStringParser, IPlugin)
class _MutualTLS:
    """``mtls:PORT:privateKey=…:certKey=…:caCerts=…``: what an ``ssl:``
    listener with ``caCerts=`` is (:func:`mdp.transport.tls.server_endpoint`)."""

    prefix = "mtls"

    def parseStreamServer(self, reactor: Any, *args: str, **kwargs: str) -> Any:
        from mdp.transport.tls import server_endpoint

        return server_endpoint(reactor, *args, **kwargs)


mutualTLS = _MutualTLS()
