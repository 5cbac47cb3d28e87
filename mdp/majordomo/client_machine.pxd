# Compiled, the client's records and machine are extension types: their
# attributes are fields of C structs, read and set without a lookup.  The
# source (client_machine.py) is the same classes, and runs as it is where
# nothing is compiled.

from mdp.machine cimport Machine

cdef class _Channel

cdef class _Call:
    cdef public object service, message, deferred, result, onPartial, onRestart
    cdef public object timeout, retries, attempts, startedAt, deadline, state, trace
    cdef public _Channel channel
    cdef public list tried

cdef class _Channel:
    cdef public object endpoint, state, pipe, context
    cdef public _Call call

cdef class ClientMachine(Machine):
    cdef public object _rotation, timeout, retries, maxConnections, dialect, stamp, limits
    cdef public object clientId, _sequence, _waiting, _waitingDone, _live, closed, _order
    cdef public object _wakeAt, _everUp, _abandoned, extended, _probe, extensions
    cdef public object _askAgainAt, _askAgainIn
    cdef public dict _names, _failures, _unreachable
    cdef public list _idle, _deadlines
    cdef public set _channels

    cpdef _Call newCall(self, service, frames, timeout, retries, onPartial, onRestart, now, within=*)
    cdef _serviceName(self, service)
    cdef list _encode(self, name, body, bint mmi)
    # the request's path: C calls between the machine's own methods (cdef:
    # only the machine calls them)
    cpdef list handleRequest(self, _Call call, now)
    cpdef list handleMessage(self, _Channel channel, frames, now)
    cdef _reply(self, _Channel channel, _Call call, bint final, body)
    cdef _release(self, _Channel channel)
    cpdef _pump(self)
    cdef _assign(self, _Channel channel, _Call call)
    cdef _sendOn(self, _Channel channel)
    cpdef _schedule(self, _Call call)
    cdef _wakeBy(self, deadline)
    cpdef bint _done(self, _Call call) except -1
