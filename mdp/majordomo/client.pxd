# Compiled, the client's drivers are extension types (see client_machine.pxd).

from mdp.majordomo.client_machine cimport ClientMachine, _Call, _Channel

# what both drivers share (mdp.blocking.Client cimports it)
cdef class ClientDriver:
    cdef public ClientMachine machine
    cdef public object curve, limits, throttle, _wakeTime

# the Twisted driver: an instance dictionary and weak references, as a class
# of the source has (a caller may hang its own attributes on a client)
cdef class Client(ClientDriver):
    cdef dict __dict__
    cdef object __weakref__
    cdef public object reactor, _timer
    cdef public dict _links

    cpdef _perform(self, list actions)
    cdef _send(self, _Channel channel, frames)

# the receiver of a channel's transport: its events reach the client's
# machine and driver through C calls
cdef class _ChannelPipe:
    cdef public Client client
    cdef public _Channel channel
