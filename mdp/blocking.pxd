# Compiled, the blocking client and its ZeroMQ pipes are extension types (see
# majordomo/client.pxd); the client keeps an instance dictionary and weak
# references, as a class of the source would.  docs/performance.md, item 26.

from mdp.majordomo.client cimport ClientCore

cdef class _Loop:
    cdef public object limits, _zmqContext, poller
    cdef public dict pipes
    cdef public set streams, unchecked

cdef class _ZmqPipe:
    cdef public _Loop loop
    cdef public object owner, tag, socket, handle, fd, backlog, up, waitMs, address, linger
    cdef public object curve

cdef class Client(ClientCore):
    cdef dict __dict__
    cdef object __weakref__
    cdef public _Loop _loop
    cdef public object _wakeTime, _madeUp, _forks
