# Compiled, the worker's machine is an extension type (see client.pxd);
# docs/performance.md, item 26.

from mdp.machine cimport Machine

cdef class WorkerMachine(Machine):
    cdef public object _rotation, service, heartbeat, backoff, dialect, limits, throttle
    cdef public object state, liveness, failures, refusals, current, answered, generation
    cdef public object connectWhy, connectSaidAt

    cpdef list handleMessage(self, frames, now)

# the Twisted driver: an instance dictionary and weak references, as a class
# of the source has
cdef class Worker(WorkerMachine):
    cdef dict __dict__
    cdef object __weakref__
    cdef public object handler, curve, reactor, replies, transport, requestsServed
    cdef public object streamPauses, _reconnectCall, _ticker, _lastTick, _handlerBlockEnded
    cdef public object metrics
