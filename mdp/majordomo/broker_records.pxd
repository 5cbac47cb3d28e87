# Compiled, the broker's records are extension types: their fields are
# slots of a C struct, read by the compiled machine without a lookup.

cdef class PendingRequest:
    cdef public object client, service, body, dialect, queuedAt, size, state, envelope
    cdef public object deliveries, partials, arrivedAt, assignedAt, context, deadline, holder, givenUp

cdef class ServiceQueue

cdef class WorkerRef:
    cdef public object key, dialect, liveness, state, lastEnvelope, useful, extended
    cdef public ServiceQueue service
    cdef public PendingRequest current

cdef class QueueLedger:
    cdef public object count, bytes, byAge
    cdef public dict byClient

cdef class ServiceQueue:
    cdef public object name, pending, idle, workers, size, bytes
    cdef public object abandonedAt, registered, unknownUntil, askedAt, wanted
    cdef public QueueLedger ledger
