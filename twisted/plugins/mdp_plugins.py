"""Twisted plugin dropin: ``twist mdp-broker``, ``twist mdp-worker``,
``twist mdp-freelance-server``."""

from mdp.app.tap import BrokerServiceMaker, FreelanceServerServiceMaker, WorkerServiceMaker

mdpBroker = BrokerServiceMaker()
mdpWorker = WorkerServiceMaker()
mdpFreelanceServer = FreelanceServerServiceMaker()
