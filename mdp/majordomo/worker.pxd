# Compiled, the worker's machine is an extension type (see client.pxd);
# docs/performance.md, item 26.

from mdp.machine cimport Machine

cdef class WorkerMachine(Machine):
    cdef public object _rotation, service, heartbeat, backoff, dialect, limits, throttle
    cdef public object state, liveness, failures, refusals, current, answered, generation
    cdef public object connectWhy, connectSaidAt

    cpdef list handleMessage(self, frames, now)
    cpdef tuple handleReply(self, job, kind, frames, now, store=*)
    # a request's path: C calls (only the machine calls these)
    cdef _received(self, frames)
    cdef _request(self, client, body)
    cdef bint _replyPart(self, job, kind, frames, store) except -1

# the Twisted driver: an instance dictionary and weak references, as a class
# of the source has
cdef class Worker(WorkerMachine):
    cdef dict __dict__
    cdef object __weakref__
    cdef public object handler, curve, reactor, replies, transport, requestsServed
    cdef public object streamPauses, _reconnectCall, _ticker, _lastTick, _handlerBlockEnded
    cdef public object metrics

    # a request's path, through C calls (cpdef: also callbacks and Python's)
    cpdef _perform(self, list actions)
    cpdef _run(self, job, body)
    cpdef _finish(self, value, job)
    cpdef bint _reply(self, job, kind, frames, store=*, failure=*) except -1
