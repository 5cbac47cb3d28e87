# Compiled, the broker's machine and its queues are extension types (see
# client.pxd); docs/performance.md, item 26.

cimport cython

from mdp.machine cimport Machine

cdef class Broker

# a transport's receiver (instance dictionary and weak references, as a
# class of the source has)
cdef class Binding:
    cdef dict __dict__
    cdef object __weakref__
    cdef public Broker broker
    cdef public object clients, workers, transport, copyOut

cdef class PendingRequest:
    cdef public object client, service, body, dialect, queuedAt, size, state, envelope
    cdef public object deliveries, partials, arrivedAt, assignedAt

cdef class ServiceQueue

cdef class WorkerRef:
    cdef public object key, dialect, liveness, state, lastEnvelope
    cdef public ServiceQueue service
    cdef public PendingRequest current

cdef class QueueLedger:
    cdef public object count, bytes, byAge
    cdef public dict byClient

cdef class ServiceQueue:
    cdef public object name, pending, idle, workers, size, bytes
    cdef public object abandonedAt, registered, unknownUntil, askedAt
    cdef public QueueLedger ledger

cdef class BrokerMachine(Machine):
    cdef public object heartbeat, requestExpiry, unknownServiceExpiry, serviceLinger
    cdef public object maxQueue, maxServiceQueue, maxQueueBytes, maxServiceQueueBytes
    cdef public object maxWorkers, maxServiceWorkers, maxDeliveries, limits, admission, access
    cdef public object throttle, _assignments, _abandoned, _unknown, _activeSince, _passive
    cdef public object _takenBack, invalid, metrics, logRequests, _gone
    cdef public QueueLedger _ledger
    cdef public dict services, workers

    cpdef list handleMessage(self, key, frames, now)
    cdef _received(self, key, frames)
    # the request's path, in C (only the machine calls these)
    @cython.locals(worker=WorkerRef, request=PendingRequest)
    cdef bint _fastPath(self, key, frames) except -1
    @cython.locals(request=PendingRequest, service=ServiceQueue)
    cdef _request(self, key, name, body, dialect)
    cdef _replyPart(self, WorkerRef worker, PendingRequest request, body, final)
    cdef _forward(self, WorkerRef worker, PendingRequest request, body, final)
    cdef _dispatch(self, ServiceQueue service)
    cdef _assign(self, WorkerRef worker, PendingRequest request)

# the Twisted driver (instance dictionary and weak references, as above)
cdef class Broker(BrokerMachine):
    cdef dict __dict__
    cdef object __weakref__
    cdef public object reactor, curve, bindings, _ticker, _wakeCall

    cpdef _perform(self, list actions)
