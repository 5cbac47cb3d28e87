"""Broker and worker inside one Twisted Application:  twistd -ny examples/application.tac

A client can then call it:  mdp call --broker zmq:tcp://127.0.0.1:5555 reverse hello

If the port is taken, twistd logs why and exits with status 1 (with -n;
as a daemon, its first process has exited 0 already): the worker does not
start (it would register with whatever holds the port).
"""

from twisted.application.service import Application

from mdp import BrokerService, WorkerService


def reverse(frames):
    return [frame[::-1] for frame in frames]


application = Application("txmajordomo example")
BrokerService("zmq:tcp://127.0.0.1:5555").setServiceParent(application)
WorkerService("zmq:tcp://127.0.0.1:5555", "reverse", reverse).setServiceParent(application)
