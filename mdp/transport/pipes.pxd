# Compiled, the blocking nodes' ZeroMQ pipe is an extension type: its read
# and send are the blocking client's hot path.

cdef class _ZmqPipe:
    cdef public object loop, owner, tag, socket, handle, fd, backlog, up, waitMs, address
    cdef public object linger, curve, core, retryAt

    cpdef send(self, frames)
    cdef bint _trySend(self, frames) except -1
    cpdef wait(self, timeout)
    cdef _read(self, now)
    cdef _message(self, flags)
    cdef _take(self, frames, now)
