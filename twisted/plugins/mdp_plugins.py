"""Twisted plugin dropin: ``twist mdp-broker``, ``twist mdp-worker``,
``twist mdp-freelance-server``, ``twist mdp-titanic``."""

from mdp.app.tap import (
    BrokerServiceMaker,
    FreelanceServerServiceMaker,
    TitanicServiceMaker,
    WorkerServiceMaker,
)

mdpBroker = BrokerServiceMaker()
mdpWorker = WorkerServiceMaker()
mdpFreelanceServer = FreelanceServerServiceMaker()
mdpTitanic = TitanicServiceMaker()
