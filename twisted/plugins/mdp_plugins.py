"""Twisted plugin dropin: ``twist mdp-broker`` and ``twist mdp-worker``."""

from mdp.tap import BrokerServiceMaker, WorkerServiceMaker

mdpBroker = BrokerServiceMaker()
mdpWorker = WorkerServiceMaker()
