# cython: language_level=3
"""ZeroMQ messages in and out in C (optional).

pyzmq's Python API says whether more frames follow only through a
``zmq.Frame`` (a Python object built, asked for ``bytes`` and ``more``
through its attribute hook, then freed) or a ``RCVMORE`` lookup; either
costs more than the frame itself, and each frame sent is a Python call.
This module reads and sends a whole message with libzmq's own
``zmq_msg_recv``, ``zmq_msg_more`` and ``zmq_send`` on the socket pyzmq made (its ``underlying`` address), through
the functions of the very libzmq pyzmq loaded (looked up through pyzmq's
compiled backend, so both use one library and one copy of its state).

A long frame the caller asks to keep is not copied: it stays the message
libzmq received, in a :class:`Held` (``len``, ``bytes()`` and the buffer
protocol, as a ``zmq.Frame``), and :func:`send` passes it on by sharing
libzmq's buffer (``zmq_msg_copy``).

:func:`events` asks a socket's ``ZMQ_EVENTS`` (``zmq_getsockopt``), which
every node does before it reads and after it sends.

:func:`bind` refuses where any of that is missing; the caller then goes
through pyzmq as before (``mdp/transport/zeromq.py``, ``mdp/blocking.py``),
with the same behaviour.  Without a C compiler the package is the same
without this module.
"""

from cpython.buffer cimport PyBuffer_FillInfo
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport uintptr_t

cdef extern from "dlfcn.h" nogil:
    void *dlopen(const char *filename, int flag)
    void *dlsym(void *handle, const char *symbol)
    int RTLD_NOW
    int RTLD_NOLOAD

cdef extern from *:
    """
    /* libzmq's zmq_msg_t since 4.1: 64 bytes, pointer-aligned */
    typedef union { unsigned char _[64]; void *p; } mdp_zmq_msg_t;
    typedef int (*mdp_msg_fn)(mdp_zmq_msg_t *);
    typedef int (*mdp_copy_fn)(mdp_zmq_msg_t *, mdp_zmq_msg_t *);
    typedef int (*mdp_io_fn)(mdp_zmq_msg_t *, void *, int);
    typedef int (*mdp_send_fn)(void *, const void *, size_t, int);
    typedef void *(*mdp_data_fn)(mdp_zmq_msg_t *);
    typedef size_t (*mdp_size_fn)(mdp_zmq_msg_t *);
    typedef int (*mdp_errno_fn)(void);
    typedef void (*mdp_version_fn)(int *, int *, int *);
    typedef int (*mdp_getopt_fn)(void *, int, void *, size_t *);
    """
    ctypedef struct mdp_zmq_msg_t:
        pass
    ctypedef int (*mdp_msg_fn)(mdp_zmq_msg_t *) nogil
    ctypedef int (*mdp_copy_fn)(mdp_zmq_msg_t *, mdp_zmq_msg_t *) nogil
    ctypedef int (*mdp_io_fn)(mdp_zmq_msg_t *, void *, int) nogil
    ctypedef int (*mdp_send_fn)(void *, const void *, size_t, int) nogil
    ctypedef void *(*mdp_data_fn)(mdp_zmq_msg_t *) nogil
    ctypedef size_t (*mdp_size_fn)(mdp_zmq_msg_t *) nogil
    ctypedef int (*mdp_errno_fn)() nogil
    ctypedef void (*mdp_version_fn)(int *, int *, int *) nogil
    ctypedef int (*mdp_getopt_fn)(void *, int, void *, size_t *) nogil

cdef extern from "errno.h":
    int EAGAIN
    int EINTR

cdef mdp_msg_fn msg_init = NULL
cdef mdp_msg_fn msg_close = NULL
cdef mdp_msg_fn msg_more = NULL
cdef mdp_copy_fn msg_copy = NULL
cdef mdp_copy_fn msg_move = NULL
cdef mdp_io_fn msg_recv = NULL
cdef mdp_io_fn msg_send = NULL
cdef mdp_send_fn zmq_send = NULL
cdef mdp_data_fn msg_data = NULL
cdef mdp_size_fn msg_size = NULL
cdef mdp_errno_fn zmq_errno = NULL
cdef mdp_getopt_fn zmq_getsockopt = NULL
cdef object Again = None
cdef object ZMQError = None

#: libzmq's ZMQ_SNDMORE and ZMQ_DONTWAIT (zmq.h; fixed since 3.x)
cdef int SNDMORE = 2
cdef int DONTWAIT = 1
#: libzmq's ZMQ_EVENTS option (zmq.h; fixed since 3.x)
cdef int EVENTS = 15

#: :func:`read`'s answer for a message over the limits
OVER = 1


cdef class Held:
    """A frame kept as libzmq received it: ``len``, ``bytes()`` and the
    buffer protocol (read-only); sent on by :func:`send` without a copy."""

    cdef mdp_zmq_msg_t msg
    cdef bint live

    def __dealloc__(self):
        if self.live:
            msg_close(&self.msg)

    def __len__(self):
        return <Py_ssize_t>msg_size(&self.msg)

    def __bytes__(self):
        return PyBytes_FromStringAndSize(<char *>msg_data(&self.msg), msg_size(&self.msg))

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, msg_data(&self.msg), <Py_ssize_t>msg_size(&self.msg),
                          1, flags)

    def __releasebuffer__(self, Py_buffer *view):
        pass

    def __repr__(self):
        return f"<Held frame of {len(self)} bytes>"


cdef void *_symbol(void *library, const char *name) except NULL:
    cdef void *found = dlsym(library, name)
    if found == NULL:
        raise ImportError(f"libzmq has no {name.decode()}")
    return found


def bind(str library, again, error):
    """Use the libzmq that *library* (a file pyzmq loaded, linked with it)
    brought in; raise ``ImportError`` if it cannot be found or is older than
    4.1.  *again* and *error*: pyzmq's ``Again`` and ``ZMQError``."""
    global msg_init, msg_close, msg_more, msg_copy, msg_move, msg_recv, msg_send, zmq_send
    global msg_data, msg_size, zmq_errno, zmq_getsockopt, Again, ZMQError
    cdef bytes path = library.encode()
    cdef void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD)
    cdef int major = 0, minor = 0, patch = 0
    if handle == NULL:
        raise ImportError(f"{library} is not loaded")
    (<mdp_version_fn>_symbol(handle, b"zmq_version"))(&major, &minor, &patch)
    if (major, minor) < (4, 1):
        raise ImportError(f"libzmq {major}.{minor}.{patch}: its messages are laid out otherwise")
    msg_recv = <mdp_io_fn>_symbol(handle, b"zmq_msg_recv")
    msg_send = <mdp_io_fn>_symbol(handle, b"zmq_msg_send")
    zmq_send = <mdp_send_fn>_symbol(handle, b"zmq_send")
    msg_init = <mdp_msg_fn>_symbol(handle, b"zmq_msg_init")
    msg_close = <mdp_msg_fn>_symbol(handle, b"zmq_msg_close")
    msg_more = <mdp_msg_fn>_symbol(handle, b"zmq_msg_more")
    msg_copy = <mdp_copy_fn>_symbol(handle, b"zmq_msg_copy")
    msg_move = <mdp_copy_fn>_symbol(handle, b"zmq_msg_move")
    msg_data = <mdp_data_fn>_symbol(handle, b"zmq_msg_data")
    msg_size = <mdp_size_fn>_symbol(handle, b"zmq_msg_size")
    zmq_errno = <mdp_errno_fn>_symbol(handle, b"zmq_errno")
    zmq_getsockopt = <mdp_getopt_fn>_symbol(handle, b"zmq_getsockopt")
    Again, ZMQError = again, error


cdef int _failed(int error) except -1:
    """Raise pyzmq's exception for *error*; 0 for EINTR once signal
    handlers ran without raising (the call is then made again)."""
    if error == EINTR:
        PyErr_CheckSignals()  # a handler's exception (Ctrl-C) ends the wait
        return 0
    if error == EAGAIN:
        raise Again(error)
    raise ZMQError(error)


def events(uintptr_t socket):
    """The ``ZMQ_EVENTS`` of the libzmq socket at address *socket*
    (``POLLIN`` 1, ``POLLOUT`` 2): what pyzmq's ``get(EVENTS)`` answers,
    without its look-up of the option's type (an enum made each call, ten
    times the cost of the call itself).  Raises ``ZMQError`` as pyzmq
    does (a closed socket: ``ENOTSOCK``)."""
    cdef int value = 0
    cdef size_t size = sizeof(int)
    while zmq_getsockopt(<void *>socket, EVENTS, &value, &size) != 0:
        _failed(zmq_errno())
    return value


def read(uintptr_t socket, int flags, Py_ssize_t keepAfter, Py_ssize_t keepBytes,
         Py_ssize_t maxFrames, Py_ssize_t maxBytes, bint envelope):
    """Read one message from the libzmq socket at address *socket*.

    Its frames, as a list: ``bytes``, but a :class:`Held` for a frame past
    the first *keepAfter* (and the first) of at least *keepBytes*.  Or, for a message over
    *maxFrames* or *maxBytes* (the first frame not counted in bytes under an
    *envelope*; a lone first frame counted in any case), ``(OVER, [first
    frame or b"", frames, bytes, more follow])`` after the frame that went
    over, whose rest the caller reads off.  Raises ``Again`` if there is no
    message (with ``DONTWAIT`` in *flags*; without, once the socket's
    ``RCVTIMEO`` has passed, or a signal whose handler raised nothing cut the
    wait short), and ``ZMQError`` for any other failure."""
    cdef mdp_zmq_msg_t msg
    cdef int rc
    cdef Py_ssize_t count = 0, size = 0, length
    cdef bint more = True
    cdef list frames = []
    cdef Held held
    while more:
        msg_init(&msg)
        while True:
            with nogil:
                rc = msg_recv(&msg, <void *>socket, flags)
            if rc >= 0:
                break
            try:
                _failed(zmq_errno())
                if count == 0 and not flags & DONTWAIT:
                    # a blocking wait cut short by a signal: the caller
                    # waits again for what is left of its time, not afresh
                    raise Again(EAGAIN)
            except BaseException:
                msg_close(&msg)
                raise
        length = <Py_ssize_t>msg_size(&msg)
        more = msg_more(&msg)
        count += 1
        if count == 1:
            if not envelope:
                size = length
                if size > maxBytes:  # a lone first frame
                    msg_close(&msg)
                    return OVER, [b"", count, size, more]
        else:
            size += length
            if count > maxFrames or size > maxBytes:
                msg_close(&msg)
                return OVER, [frames[0], count, size, more]
            if count > keepAfter and length >= keepBytes:
                held = Held.__new__(Held)
                msg_init(&held.msg)
                held.live = True
                msg_move(&held.msg, &msg)
                msg_close(&msg)
                frames.append(held)
                continue
        try:
            frames.append(PyBytes_FromStringAndSize(<char *>msg_data(&msg), length))
        finally:
            msg_close(&msg)
    return frames


def send(uintptr_t socket, list frames, Py_ssize_t copyBelow, fallback, pysocket,
         Py_ssize_t largeAbove=-1):
    """Send *frames* as one message on the libzmq socket at address *socket*,
    without waiting: ``bytes`` under *copyBelow* copied into libzmq, a
    :class:`Held` shared; any other frame through ``fallback(pysocket,
    frame, flags, copy)`` (pyzmq's send).  Raises as pyzmq does: ``Again``
    when the message cannot go now (nothing of it was sent: ZeroMQ takes a
    message or refuses it at its first frame).  With *largeAbove* at 0 or
    more, a message of more bytes than that is not sent: its size is
    returned instead (None when the message went)."""
    cdef Py_ssize_t last = len(frames) - 1, i, total
    cdef int flags, rc
    cdef object frame
    cdef mdp_zmq_msg_t shared
    cdef Held held
    if largeAbove >= 0:
        total = 0
        for frame in frames:
            if type(frame) is bytes:
                total += PyBytes_GET_SIZE(frame)
            elif type(frame) is Held:
                total += <Py_ssize_t>msg_size(&(<Held>frame).msg)
            else:
                total += len(frame)
        if total > largeAbove:
            return total
    for i in range(last + 1):
        frame = frames[i]
        flags = DONTWAIT if i == last else DONTWAIT | SNDMORE
        if type(frame) is bytes and PyBytes_GET_SIZE(frame) < copyBelow:
            while zmq_send(<void *>socket, PyBytes_AS_STRING(frame), PyBytes_GET_SIZE(frame),
                           flags) < 0:
                _failed(zmq_errno())
        elif type(frame) is Held:
            held = frame
            msg_init(&shared)
            msg_copy(&shared, &held.msg)
            while True:
                rc = msg_send(&shared, <void *>socket, flags)
                if rc >= 0:
                    break
                try:
                    _failed(zmq_errno())
                except BaseException:
                    msg_close(&shared)
                    raise
        else:
            fallback(pysocket, frame, flags, len(frame) < copyBelow)


def skip(uintptr_t socket, Py_ssize_t budget):
    """Read off and drop up to *budget* frames of the message being read from
    the libzmq socket at address *socket*, into one reused message, in C:
    ``(frames, bytes, more follow)``.  Raises as :func:`read`."""
    cdef mdp_zmq_msg_t msg
    cdef int rc = 0, error = 0
    cdef Py_ssize_t count = 0, size = 0
    cdef bint more = True
    msg_init(&msg)
    try:
        while more and count < budget:
            with nogil:
                while more and count < budget:
                    rc = msg_recv(&msg, <void *>socket, DONTWAIT)
                    if rc < 0:
                        error = zmq_errno()
                        break
                    count += 1
                    size += rc
                    more = msg_more(&msg)
            if rc < 0:
                rc = 0
                _failed(error)
    finally:
        msg_close(&msg)
    return count, size, more
