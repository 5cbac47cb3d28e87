# Compiled, the broker's machine is an extension type (its records:
# broker_records.pxd): its fields are slots of a C struct, and the request's
# path runs in C.

cimport cython

from mdp.machine cimport Machine
from mdp.majordomo.broker_records cimport PendingRequest, QueueLedger, ServiceQueue, WorkerRef

cdef class BrokerMachine(Machine):
    cdef public object heartbeat, requestExpiry, unknownServiceExpiry, serviceLinger
    cdef public object maxQueue, maxServiceQueue, maxQueueBytes, maxServiceQueueBytes
    cdef public object maxWorkers, maxServiceWorkers, maxDeliveries, limits, admission, access
    cdef public object observed, traced, _assignments, _abandoned, _unknown, _activeSince, _passive
    cdef public object _takenBack, _gone
    cdef public dict _usefulClients, _usefulBefore
    cdef public object _sweepAt
    cdef public list _deadlines
    cdef public dict _latest, _declared
    cdef public QueueLedger _ledger
    cdef public dict services, workers

    cpdef list handleMessage(self, key, frames, now, clients=*, workers=*, identity=*)
    # the request's path, in C (only the machine calls these)
    @cython.locals(request=PendingRequest, service=ServiceQueue)
    cdef _request(self, key, name, body, dialect, identity)
    cdef bint _admitted(self, PendingRequest request, identity) except -1
    @cython.locals(ledger=QueueLedger)
    cdef bint _queueHasRoom(self, ServiceQueue service, PendingRequest request) except -1
    cdef _enqueue(self, ServiceQueue service, PendingRequest request)
    cdef _fromWorker(self, WorkerRef worker, kind, address, body)
    cdef _replyPart(self, WorkerRef worker, PendingRequest request, body, final)
    cdef _reply(self, PendingRequest request, body, final)
    @cython.locals(service=ServiceQueue)
    cdef _finished(self, WorkerRef worker, PendingRequest request)
    cdef _dispatch(self, ServiceQueue service)
    cdef _assign(self, WorkerRef worker, PendingRequest request)
