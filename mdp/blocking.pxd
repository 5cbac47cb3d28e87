# Compiled, the blocking client and its loop are extension types (see
# majordomo/client.pxd); the client keeps an instance dictionary and weak
# references, as a class of the source would.

from mdp.majordomo.client cimport ClientDriver
from mdp.majordomo.client_machine cimport _Call, _Channel

cdef class _Loop:
    cdef public object limits, _zmqContext, poller, pollUnit, closed
    cdef public dict pipes, watched, links
    cdef public set timed, unchecked, idle

    cpdef turn(self, when)
    cpdef closeIdle(self)
    cdef _poll(self, timeout, now)
    cdef _soonest(self, when)
    cdef _wakeDue(self, now)

cdef class Client(ClientDriver):
    cdef dict __dict__
    cdef object __weakref__
    cdef public _Loop _loop
    cdef public object _unanswered, _forks

    cdef _Call _submit(self, service, frames, timeout, retries, onPartial, onRestart, trace=*)
    cdef _waitFor(self, _Call call)
    cdef _perform(self, list actions)
    cdef _send(self, _Channel channel, frames)
