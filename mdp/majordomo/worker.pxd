# Compiled, the worker's machine is an extension type (see client.pxd);
# docs/performance.md, item 26.

from mdp.machine cimport Machine

cdef class WorkerMachine(Machine):
    cdef public object _rotation, service, heartbeat, backoff, dialect, limits, throttle
    cdef public object state, liveness, failures, refusals, current, answered, generation
