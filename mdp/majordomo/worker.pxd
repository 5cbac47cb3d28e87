# Compiled, the worker's machine and driver are extension types (see
# client.pxd).

from mdp.machine cimport Machine

cdef class WorkerMachine(Machine):
    cdef public object _rotation, service, heartbeat, backoff, dialect, limits
    cdef public object state, liveness, failures, refusals, current, answered, generation
    cdef public object connectWhy, connectSaidAt, extensions, asked, _unasked
    cdef public object homeward, homeAt, homeTries

    cpdef list handleMessage(self, frames, now)
    cpdef tuple handleReply(self, job, kind, frames, now, store=*)
    # a request's path: C calls (only the machine calls these)
    cdef _command(self, kind, client, body)
    cdef _request(self, client, body)
    cdef bint _replyPart(self, job, kind, frames, store) except -1

# what both drivers share (the blocking one is a class of the source)
cdef class WorkerDriver:
    cdef public WorkerMachine machine
    cdef public object handler, curve, throttle, requestsServed, replies, transport

# the Twisted driver: an instance dictionary and weak references, as a class
# of the source has
cdef class Worker(WorkerDriver):
    cdef dict __dict__
    cdef object __weakref__
    cdef public object reactor, streamPauses, _reconnectCall, _ticker
    cdef public object _lastTick, _handlerBlockEnded, metrics, held, _lapseCall

    # a request's path, through C calls (cpdef: also callbacks and Python's)
    cpdef _perform(self, list actions)
    cpdef _run(self, job, body)
    cpdef _handle(self, job, body)
    cpdef _finish(self, value, job)
    cpdef bint _reply(self, job, kind, frames, store=*, failure=*) except -1
