"""Twisted plugin dropin: ``twist mdp-broker``, ``twist mdp-worker``,
``twist mdp-freelance-server``, ``twist mdp-titanic``, ``twist sp-rep``,
``twist sp-device``."""

from mdp.app.tap import (
    BrokerServiceMaker,
    FreelanceServerServiceMaker,
    SPDeviceServiceMaker,
    SPRepServiceMaker,
    TitanicServiceMaker,
    WorkerServiceMaker,
)

mdpBroker = BrokerServiceMaker()
mdpWorker = WorkerServiceMaker()
mdpFreelanceServer = FreelanceServerServiceMaker()
mdpTitanic = TitanicServiceMaker()
spRep = SPRepServiceMaker()
spDevice = SPDeviceServiceMaker()

# ``twist --reactor=uvloop``: Twisted's asyncio reactor over uvloop (mdp.uvreactor)
from twisted.application.reactors import Reactor  # noqa: E402

uvloopReactor = Reactor("uvloop", "mdp.uvreactor",
                        "Twisted's asyncio reactor over uvloop (pip install 'txmajordomo[speed]')")
