# Compiled, the client's records, machine and driver are extension types:
# their attributes are fields of C structs, read and set without a lookup.
# The source (client.py) is the same classes, and runs as it is where nothing
# is compiled.

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
    cdef public object _rotation, timeout, retries, maxConnections, dialect, stamp, limits
    cdef public object clientId, _sequence, _waiting, _waitingDone, _live, _closed, _order
    cdef public object _wakeAt, _everUp, _abandoned
    cdef public dict _names, _failures, _unreachable
    cdef public list _idle, _deadlines
    cdef public set _channels

    cpdef _Call newCall(self, service, frames, timeout, retries, onPartial, onRestart, now)
    # the request's path: C calls between the machine's own methods (cdef:
    # only the machine calls them)
    cpdef list handleRequest(self, _Call call, now)
    cpdef list handleMessage(self, _Channel channel, frames, now)
    cdef _reply(self, _Channel channel, _Call call, bint final, body)
    cdef _release(self, _Channel channel)
    cdef _pump(self)
    cdef _assign(self, _Channel channel, _Call call)
    cdef _sendOn(self, _Channel channel)
    cpdef _schedule(self, _Call call)
    cdef _wakeBy(self, deadline)
    cpdef bint _done(self, _Call call) except -1

# the Twisted driver: an instance dictionary and weak references, as a class
# of the source has (a caller may hang its own attributes on a client)
cdef class Client:
    cdef dict __dict__
    cdef object __weakref__
    cdef public ClientMachine machine
    cdef public object reactor, curve, limits, throttle, _closed, _timer, _wakeTime
    cdef public dict _links

    cpdef _perform(self, list actions)
    cdef _send(self, _Channel channel, frames)

# the receiver of a channel's transport: its events reach the client's
# machine and driver through C calls
cdef class _ChannelPipe:
    cdef public Client client
    cdef public _Channel channel
