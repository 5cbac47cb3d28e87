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
