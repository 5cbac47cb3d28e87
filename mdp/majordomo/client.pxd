# Compiled, the client's driver is an extension type (see client_machine.pxd).

from mdp.majordomo.client_machine cimport ClientMachine, _Call, _Channel

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
