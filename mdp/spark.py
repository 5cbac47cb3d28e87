"""Push Spark data through MDP services: one request per row, each reply on its row
(``DataFrame.mapInArrow``).  Executors use a blocking client cached per thread, or a
running Twisted reactor (docs/spark.md)."""

from __future__ import annotations

import hashlib
import itertools
import sys
import threading
import uuid
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import attrs

from mdp.errors import MDPSparkError
from mdp.majordomo.idempotence import stamp
from mdp.policy import positive_seconds, whole_number

ON_ERROR = ("fail", "null", "column")
OUTPUT_TYPES = ("binary", "string", "frames")
_failure = "{0.__class__.__name__}: {0}".format  # a failed row's error text

@attrs.frozen
class ServiceCall:
    """Everything an executor needs to call the service (picklable)."""

    service: str
    brokers: tuple[str, ...]
    timeout: float = 2.5
    retries: int = 3
    window: int = 64
    dialect: str = "rfc"
    onError: str = "fail"

    def describe(self) -> str:
        return f"service {self.service!r} via broker {', '.join(self.brokers)}"


# --- executor side ---------------------------------------------------------------

_clients: dict[ServiceCall, Any] = {}  # the running reactor's clients (reactor thread only)


def running_reactor() -> Any:
    """The Twisted reactor running in this process, unless there is none or this
    is its thread.  Never imports, so never installs, a reactor."""
    reactor = sys.modules.get("twisted.internet.reactor")
    if not getattr(reactor, "running", False):
        return None
    from twisted.python import threadable

    return None if threadable.isInIOThread() else reactor


def call_many(call: ServiceCall, requests: Sequence[Optional[list[bytes]]]) -> list[Any]:
    """Send *requests* (None: a row that cannot be sent); return each reply's frames
    or exception, in order.  Blocks, about ``timeout × retries`` per window at most."""
    reactor = running_reactor()
    if reactor is None:
        return _call_many_blocking(call, requests)
    from twisted.internet.threads import blockingCallFromThread

    return blockingCallFromThread(reactor, _call_many, call, list(requests))


_local = threading.local()


def _client(clients: dict[ServiceCall, Any], kind: Any, call: ServiceCall) -> Any:
    """The client of *clients* for *call*; a new one (a *kind*) if it has none or a forked one."""
    client = clients.get(call)
    if client is None or getattr(client, "forked", False):
        client = clients[call] = kind(list(call.brokers), timeout=call.timeout, retries=call.retries,
                                      maxConnections=call.window, dialect=call.dialect)
    return client


def _call_many_blocking(call: ServiceCall, requests: Sequence[Optional[list[bytes]]]) -> list[Any]:
    from mdp.blocking import Client

    client = _client(_local.__dict__.setdefault("clients", {}), Client, call)
    replies = client.map(call.service, (r for r in requests if r is not None), window=call.window,
                         returnExceptions=True)
    results: list[Any] = []
    try:
        for frames in requests:
            value: Any = ValueError("null input") if frames is None else next(replies)
            if isinstance(value, BaseException) and call.onError == "fail":
                raise MDPSparkError(f"{call.describe()}: {value}") from value
            results.append(value)
    finally:
        replies.close()  # abandons what is still in flight after a failure
    return results


def _call_many(call: ServiceCall, requests: list[Optional[list[bytes]]]) -> Any:
    """In the reactor thread: ``window`` senders, each sending its next row once the
    last is answered (a request waiting for a free connection would spend its
    attempts); on a failure with ``onError="fail"``, cancel the rest, send no more."""
    from twisted.internet import defer

    from mdp.majordomo.client import Client

    client = _client(_clients, Client, call)
    results: list[Any] = [None] * len(requests)
    rows = iter(enumerate(requests))
    inFlight: set[defer.Deferred] = set()
    failures: list[MDPSparkError] = []

    async def sender() -> None:
        # a loop: rows that finish at once (a null input, a request over the limits) cost no recursion
        for index, frames in rows:
            if failures:
                return
            try:
                if frames is None:
                    raise ValueError("null input")
                request = client.request(call.service, *frames)
                inFlight.add(request)
                try:
                    results[index] = await request
                finally:
                    inFlight.discard(request)
            except Exception as e:
                if call.onError != "fail":
                    results[index] = e
                elif not failures:  # the first: the requests it cancels come back here
                    failures.append(MDPSparkError(f"{call.describe()}: {e}"))
                    for other in list(inFlight):
                        other.cancel()

    def finished(_: object) -> list[Any]:
        if failures:
            raise failures[0]
        return results

    return defer.gatherResults([defer.ensureDeferred(sender()) for _ in range(call.window)]
                               ).addCallback(finished)


def _request(values: Sequence[Any]) -> Optional[list[bytes]]:
    """A row's frames (str sent UTF-8); None if it has none or a null."""
    none = not values or any(v is None for v in values)
    return None if none else [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values]


def request_stamp(service: str, key: Any, frames: Sequence[bytes], scope: str,
                  sequence: int) -> tuple[bytes, int]:
    """The idempotence stamp (client id, sequence) of the row with *key* and request *frames*:
    the same whenever that row is sent again within *scope* and *sequence* (a streaming query's
    id and micro-batch, as when it replays a batch from its checkpoint; see :func:`stamp_scope`)."""
    return _row_digest(service, scope)(key, frames), sequence


def _row_digest(service: str, scope: str) -> Callable[[Any, Sequence[bytes]], bytes]:
    """:func:`request_stamp`'s client id for many rows of one *service* and *scope*: a blake2b
    over each part, length first, with the parts all rows share hashed once."""
    head = hashlib.blake2b(digest_size=16)
    head.update(b"".join(len(p).to_bytes(8, "big") + p
                         for p in (service.encode("ascii"), scope.encode("utf-8"))))

    def digest(key: Any, frames: Sequence[bytes]) -> bytes:
        row = head.copy()
        raw = key if isinstance(key, bytes) else str(key).encode("utf-8")
        row.update(b"".join([len(p).to_bytes(8, "big") + p for p in (raw, *frames)]))
        return row.digest()
    return digest


def stamp_scope(own: str) -> tuple[str, int]:
    """What this task's stamps are made within: its streaming query's id (kept across restarts
    from the checkpoint, also under ``foreachBatch``) and micro-batch; elsewhere *own*, one per
    ``call_service`` (a retried task sends the same stamps, a new call new ones), and 0."""
    from pyspark import TaskContext

    context = TaskContext.get()
    query = batch = None
    if context is not None:
        query = context.getLocalProperty("sql.streaming.queryId")
        batch = context.getLocalProperty("streaming.sql.batchId")
    return (query, int(batch)) if query and batch else (own, 0)


def _replies(call: ServiceCall, requests: list[Optional[list[bytes]]],
             keys: Optional[Sequence[Any]] = None, own: str = "") -> list[Any]:
    """Each request sent (stamped from its key within :func:`stamp_scope`, if *keys*): its
    reply's frames, or what went wrong (an exception)."""
    if keys is not None:
        scope, sequence = stamp_scope(own)
        digest = _row_digest(call.service, scope)
        requests = [None if f is None or k is None else stamp(digest(k, f), sequence, f)
                    for f, k in zip(requests, keys)]
    return call_many(call, requests) if requests else []


def _reply_arrays(call: ServiceCall, columns: Sequence[Any], outputType: str,
                  keys: Any = None, own: str = "") -> tuple[Any, Any]:
    """One batch's request *columns* (string or binary Arrow arrays, a frame each; a row with
    a null is not sent) sent, stamped from *keys* if given: its reply and error arrays."""
    import pyarrow as pa

    values = [c.cast(pa.binary() if pa.types.is_string(c.type) else
                     pa.large_binary() if pa.types.is_large_string(c.type) else c.type).to_pylist()
              for c in columns]
    results = _replies(call, [None if None in row else list(row) for row in zip(*values)],
                       None if keys is None else keys.to_pylist(), own)
    pick = {"binary": lambda r: r[0], "frames": lambda r: r,
            "string": lambda r: r[0].decode("utf-8", "replace")}[outputType]
    failed = [isinstance(r, BaseException) for r in results]
    kind = {"binary": pa.binary(), "string": pa.string(), "frames": pa.list_(pa.binary())}[outputType]
    errors = (pa.array([_failure(r) if f else None for r, f in zip(results, failed)], type=pa.string())
              if any(failed) else pa.nulls(len(results), pa.string()))
    return pa.array([None if f else pick(r) for r, f in zip(results, failed)], type=kind), errors


# --- driver side -----------------------------------------------------------------

def _service_call(service: Union[str, bytes], broker: Union[str, Sequence[str]], timeout: float,
                  retries: int, window: int, dialect: str, onError: str,
                  outputType: str = "binary") -> ServiceCall:
    """Check every argument on the driver, so a mistake raises here rather than in
    each task: ``TransportError`` for a bad endpoint, ``TypeError``/``ValueError``."""
    from mdp import transport
    from mdp.majordomo import codec

    for option, value, choices in (("onError", onError, ON_ERROR), ("outputType", outputType, OUTPUT_TYPES)):
        if value not in choices:
            raise ValueError(f"{option} must be one of {choices}, not {value!r}")
    positive_seconds("timeout", timeout)  # finite, within MAX_SECONDS
    whole_number("retries", retries, rule="counts attempts and must be")
    whole_number("window", window)
    codec.check_dialect(dialect)
    brokers = tuple(transport.endpoint_list(broker))
    name = codec.api_service_name(service).decode("ascii")
    return ServiceCall(name, brokers, timeout, retries, window, dialect, onError)


def call_service(df: Any, service: Union[str, bytes], broker: Union[str, Sequence[str]],
                 inputCol: Union[str, Sequence[str]] = "value", outputCol: str = "reply", *,
                 outputType: str = "binary", onError: str = "fail", errorCol: str = "error",
                 window: int = 64, timeout: float = 2.5, retries: int = 3,
                 dialect: str = "rfc", keyCol: Optional[str] = None) -> Any:
    """One MDP request per row of *df* (its *inputCol* columns, one frame each); returns *df*
    with the reply added.  With *keyCol*, each request is stamped from its row's key and frames
    within :func:`stamp_scope`, so workers sharing a reply store run it once (docs/spark.md).
    The options are in docs/spark.md; they are checked at once."""
    call = _service_call(service, broker, timeout, retries, window, dialect, onError, outputType)
    inputs = [inputCol] if isinstance(inputCol, str) else list(inputCol)
    added = [outputCol, errorCol] if onError == "column" else [outputCol]
    schema = _output_schema(df, inputs, added, outputType)
    if keyCol is not None and keyCol not in df.columns:
        raise ValueError(f"no key column {keyCol!r} in {sorted(df.columns)}")
    own = uuid.uuid4().hex  # this call's stamp scope outside a streaming query

    def mapper(batches: Iterable[Any]) -> Iterator[Any]:
        import pyarrow as pa

        for batch in batches:
            keys = None if keyCol is None else batch.column(keyCol)
            replies, errors = _reply_arrays(call, [batch.column(n) for n in inputs], outputType,
                                            keys, own)
            arrays = [*batch.columns, *[replies, errors][:len(added)]]  # the error column if added
            yield pa.RecordBatch.from_arrays(arrays, names=[*batch.schema.names, *added])

    return df.mapInArrow(mapper, schema)


def service_column(service: Union[str, bytes], broker: Union[str, Sequence[str]], *,
                   outputType: str = "binary", onError: str = "fail", window: int = 64,
                   timeout: float = 2.5, retries: int = 3, dialect: str = "rfc") -> Any:
    """A column function (``df.withColumn("reply", enrich(df.name))``): one MDP request per row
    of the columns it is given, one frame each; an iterator ``arrow_udf`` (Spark 4.1 or later),
    one client per task.  Options as :func:`call_service`'s (docs/spark.md)."""
    try:
        from pyspark.sql.functions import arrow_udf
    except ImportError as e:
        raise MDPSparkError("service_column needs Spark 4.1 or later (pyspark.sql.functions."
                            "arrow_udf); on older Spark use call_service") from e
    import pyarrow as pa

    call = _service_call(service, broker, timeout, retries, window, dialect, onError, outputType)
    reply_type = {"binary": "binary", "string": "string", "frames": "array<binary>"}[outputType]
    returns = f"struct<reply: {reply_type}, error: string>" if onError == "column" else reply_type

    def replies(batches: Iterator[Any]) -> Iterator[Any]:
        for columns in batches:
            values, errors = _reply_arrays(
                call, columns if isinstance(columns, tuple) else (columns,), outputType)
            if onError == "column":
                yield pa.StructArray.from_arrays([values, errors], names=["reply", "error"])
            else:
                yield values

    def udf(batches: Any) -> Any:
        """*replies* as a function of its own, named for the column ("enrich(name)") and
        with the iterator form Spark reads from the hints (evaluated: not strings)."""
        def function(batches):  # type: ignore[no-untyped-def]
            return replies(batches)

        function.__name__ = call.service
        function.__annotations__ = {"batches": Iterator[batches], "return": Iterator[pa.Array]}
        return arrow_udf(function, returns)

    single, multiple = udf(pa.Array), udf(tuple[pa.Array, ...])

    def column(*columns: Any) -> Any:
        if not columns:
            raise ValueError("give at least one column")
        return (single if len(columns) == 1 else multiple)(*columns)

    return column


def _output_schema(df: Any, inputs: list[str], added: list[str], outputType: str) -> Any:
    """*df*'s schema with the *added* columns, once checked: *inputs* are string or binary
    columns of *df*, and *added* are not its columns."""
    from pyspark.sql.types import ArrayType, BinaryType, StringType, StructField, StructType

    if not inputs:
        raise ValueError("give at least one input column")
    fields = {f.name: f for f in df.schema.fields}
    for name in inputs:
        if name not in fields:
            raise ValueError(f"no column {name!r} in {sorted(fields)}")
        if not isinstance(fields[name].dataType, (StringType, BinaryType)):
            raise ValueError(f"column {name!r} is {fields[name].dataType.simpleString()}; "
                             "only string and binary columns can be sent")
    for name in added:
        if name in fields:
            raise ValueError(f"column {name!r} already exists")
    reply_type = {"binary": BinaryType(), "string": StringType(),
                  "frames": ArrayType(BinaryType())}[outputType]
    types = [reply_type, StringType()]
    return StructType(list(df.schema.fields)
                      + [StructField(name, kind, True) for name, kind in zip(added, types)])


def call_service_rdd(rdd: Any, service: Union[str, bytes], broker: Union[str, Sequence[str]], *,
                     batch: int = 1000, onError: str = "fail", window: int = 64,
                     timeout: float = 2.5, retries: int = 3, dialect: str = "rfc") -> Any:
    """The RDD variant: each element (``bytes``, ``str`` or a sequence of them) is one
    request; the result holds each reply's frames in order (docs/spark.md)."""
    call = _service_call(service, broker, timeout, retries, window, dialect, onError)
    whole_number("batch", batch)

    def partition(elements: Iterable[Any]) -> Iterator[Any]:
        elements = iter(elements)
        while chunk := list(itertools.islice(elements, batch)):
            rows = [[e] if isinstance(e, (str, bytes, bytearray)) or e is None else list(e) for e in chunk]
            for r in _replies(call, [_request(row) for row in rows]):
                reply, failure = (None, _failure(r)) if isinstance(r, BaseException) else (r, None)
                yield (reply, failure) if call.onError == "column" else reply

    return rdd.mapPartitions(partition)
