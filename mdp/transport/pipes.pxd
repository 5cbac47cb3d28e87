# Compiled, the blocking nodes' ZeroMQ pipe is an extension type: its read
# and send are the blocking client's hot path.

cdef class _ZmqPipe:
    cdef public object loop
    cdef public object owner, tag, socket, handle, fd, backlog, up, waitMs, address, linger
    cdef public object curve, core, retryAt

    cpdef send(self, frames)
    cdef bint _trySend(self, frames) except -1
    cpdef wait(self, timeout)
    cdef _events(self)
    cdef _read(self, now)
    cdef _message(self, flags, bint limited=*)
    cdef _take(self, frames, now)
