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
from twisted.application.service import ServiceMaker
from twisted.internet.interfaces import IStreamServerEndpointStringParser
from twisted.plugin import IPlugin
from twisted.python.reflect import namedAny
from zope.interface import implementer


class _OptionsMaker(ServiceMaker):
    """A ServiceMaker whose "module", imported on use, is an options class of :mod:`mdp.app.tap`:
    ``makeService(options)`` is then the parsed options' own."""

    options = property(lambda self: namedAny(self.module))


def _plugin(tapname: str, options: str, description: str) -> ServiceMaker:
    return _OptionsMaker(tapname, f"mdp.app.tap.{options}", description, tapname)


mdpBroker = _plugin("mdp-broker", "BrokerOptions", "MDP/0.2 (Majordomo) broker.")
mdpWorker = _plugin("mdp-worker", "WorkerOptions", "MDP/0.2 (Majordomo) worker running a handler.")
mdpFreelanceServer = _plugin("mdp-freelance-server", "FreelanceServerOptions",
                             "Freelance (brokerless) request-reply server, answering PING with PONG.")
mdpTitanic = _plugin("mdp-titanic", "TitanicOptions",
                     "Titanic: disk-backed, disconnected requests through an MDP broker.")
spRep = _plugin("sp-rep", "SPRepOptions", "SP (nng) REP server running a handler.")
spDevice = _plugin("sp-device", "SPDeviceOptions", "SP (nng) REQ/REP device forwarding requests upstream.")

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
