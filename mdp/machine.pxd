# Compiled, Machine is an extension type: its attributes are fields of a C
# struct, which the compiled machines read without a lookup.  The source
# (machine.py) is the same class.

cdef class Machine:
    cdef public object now
    cdef public list _outbox

    cpdef list _drain(self)
