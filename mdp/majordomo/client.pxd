# Compiled, the client's records and machine are extension types: their
# attributes are fields of C structs, read and set without a lookup by the
# machine's own methods (and by the drivers' through the same descriptors a
# slotted class has).  The source (client.py) is the same classes, and runs
# as it is where nothing is compiled; docs/performance.md, item 26.

from mdp.machine cimport Machine

cdef class _Channel

cdef class _Call:
    cdef public object service, message, deferred, result, onPartial, onRestart
    cdef public object timeout, retries, attempts, startedAt, deadline, state
    cdef public _Channel channel
    cdef public list tried

cdef class _Channel:
    cdef public object endpoint, state, pipe
    cdef public _Call call

cdef class ClientMachine(Machine):
    cdef public object _rotation, maxConnections, dialect, _throttle, _waiting
    cdef public object _waitingDone, _live, _closed, _order, _wakeAt, _everUp
    cdef public object _abandoned
    cdef public list _idle, _deadlines
    cdef public set _channels
    cdef public dict _failures, _unreachable

    # the request's path: C calls between the machine's own methods (cdef:
    # only the machine calls them)
    cpdef list handleRequest(self, _Call call, now)
    cpdef list handleMessage(self, _Channel channel, frames, now)
    cdef _carry(self, _Channel channel, _Call call)
    cdef _sendOn(self, _Channel channel)
    cpdef _schedule(self, _Call call)
    cdef _wakeBy(self, deadline)
    cpdef bint _done(self, _Call call) except -1

cdef class ClientCore(ClientMachine):
    cdef public object curve, timeout, retries, stamp, limits, clientId, _sequence
    cdef public dict _names

    cpdef _Call _newCall(self, service, frames, timeout, retries, onPartial, onRestart, now,
                         canceller=*)

# the Twisted driver: an instance dictionary and weak references, as a class
# of the source has (a caller may hang its own attributes on a client)
cdef class Client(ClientCore):
    cdef dict __dict__
    cdef object __weakref__
    cdef public object reactor, _timer

    cpdef _perform(self, list actions)

# the receiver of a channel's transport: its events reach the client's
# machine and driver through C calls
cdef class _ChannelPipe:
    cdef public Client client
    cdef public _Channel channel
