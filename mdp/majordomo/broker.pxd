# Compiled, the driver and its bindings are extension types (the machine
# and its records: broker_machine.pxd).

# (under another name: the source imports BrokerMachine, which it re-exports)
from mdp.majordomo.broker_machine cimport BrokerMachine as CompiledMachine

cdef class Broker

# a transport's receiver (instance dictionary and weak references, as a
# class of the source has)
cdef class Binding:
    cdef dict __dict__
    cdef object __weakref__
    cdef public Broker broker
    cdef public object clients, workers, transport, copyOut

cdef class Broker:
    cdef dict __dict__
    cdef object __weakref__
    cdef public CompiledMachine machine
    cdef public object reactor, curve, bindings, metrics, logRequests, invalid
    cdef public object throttle, _ticker, _wakeCall, _reporters

    cpdef _perform(self, list actions)
