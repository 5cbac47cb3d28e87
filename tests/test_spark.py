"""The PySpark bridge against a real broker and real workers over ZeroMQ.

One quiet ``local[2]`` SparkSession for the test session (UI off, driver on
127.0.0.1); broker and workers are ``twist`` processes, stopped afterwards.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

import pyspark  # noqa: F401  (installed by the test extra: a missing Spark must fail)
import pytest

from benchmarks.harness import Processes
from mdp.errors import TransportError

TWIST = os.path.join(os.path.dirname(sys.executable), "twist")
HB = ["--heartbeat", "0.25", "--liveness", "4"]


def twist(procs: Processes, *args: str) -> Any:
    return procs.start(argv=[TWIST, "--log-format", "text", *args])


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("txmajordomo-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "2000")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    with Processes() as procs:
        broker = twist(procs, "mdp-broker", "--endpoint", "zmq:tcp://127.0.0.1:*", *HB)
        line = broker.waitFor("MDP broker listening on", 60)
        endpoint = line.split("listening on ")[1].split()[0]
        workers = [twist(procs, "mdp-worker", "--broker", endpoint, "--service", "upper",
                         "--handler", "tests.handlers_for_tests:slow_upper", *HB)
                   for _ in range(2)]
        for worker in workers:
            worker.waitFor("sent READY", 60)
        yield {"endpoint": endpoint, "procs": procs, "workers": workers}


def test_ten_thousand_rows_each_get_their_own_reply(spark: Any, cluster: dict) -> None:
    from mdp.spark import call_service

    df = spark.range(10_000).selectExpr("id", "concat('row-', cast(id as string)) as value")
    out = call_service(df, "upper", broker=cluster["endpoint"], outputType="string")
    rows = out.collect()
    assert len(rows) == 10_000
    assert all(r.reply == f"ROW-{r.id}" for r in rows)
    # order within each partition is kept
    first = out.rdd.glom().first()
    assert [r.id for r in first] == sorted(r.id for r in first)


def test_jobs_in_a_row_reuse_executors(spark: Any, cluster: dict) -> None:
    from mdp.spark import call_service

    for n in range(3):
        df = spark.createDataFrame([(f"job{n}-{i}".encode(), f"x{i}") for i in range(500)],
                                   "value binary, extra string")
        out = call_service(df, "upper", cluster["endpoint"], inputCol=["value", "extra"],
                           outputType="frames").collect()
        assert [r.reply for r in out] == [[f"JOB{n}-{i}".encode(), f"X{i}".encode()]
                                          for i in range(500)]


def test_rdd_variant(spark: Any, cluster: dict) -> None:
    from mdp.spark import call_service_rdd

    rdd = spark.sparkContext.parallelize([b"a", "b", (b"c", "d")], 2)
    assert call_service_rdd(rdd, "upper", cluster["endpoint"]).collect() == [
        [b"A"], [b"B"], [b"C", b"D"]]


def test_errors_as_null_or_column(spark: Any, cluster: dict) -> None:
    from mdp.spark import call_service

    df = spark.createDataFrame([("ok",), (None,)], "value string")
    nulls = call_service(df, "upper", cluster["endpoint"], onError="null").collect()
    assert [r.reply for r in nulls] == [b"OK", None]
    column = call_service(df, "upper", cluster["endpoint"], onError="column").collect()
    assert column[0].error is None and column[1].error == "ValueError: null input"


def test_a_column_function_in_with_column_and_in_select(spark: Any, cluster: dict) -> None:
    from mdp.spark import service_column

    df = spark.createDataFrame([(f"r{i}", f"x{i}") for i in range(300)] + [(None, "z")],
                               "name string, other string")
    enrich = service_column("upper", cluster["endpoint"], outputType="string", onError="null")
    rows = df.withColumn("reply", enrich(df.name)).collect()
    assert [r.reply for r in rows] == [f"R{i}" for i in range(300)] + [None]
    # several columns are one frame each; errors in a struct beside the reply
    both = service_column("upper", cluster["endpoint"], outputType="frames", onError="column")
    out = df.select(both(df.name, df.other).alias("r")).collect()
    assert [r.r.reply for r in out[:2]] == [[b"R0", b"X0"], [b"R1", b"X1"]]
    assert (out[-1].r.reply, out[-1].r.error) == (None, "ValueError: null input")


def test_worker_killed_mid_job_loses_and_duplicates_nothing(spark: Any, cluster: dict) -> None:
    from mdp.spark import call_service

    procs, endpoint = cluster["procs"], cluster["endpoint"]
    victim = cluster["workers"][0]
    df = spark.range(10_000).selectExpr("id", "cast(id as string) as value")
    out = call_service(df, "upper", endpoint, outputType="string", timeout=2.0, retries=5)

    def kill_soon() -> None:
        time.sleep(1.5)  # the job is running by then (it takes several seconds)
        victim.proc.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_soon, daemon=True)
    killer.start()
    rows = out.collect()
    killer.join(10)
    assert victim.proc.wait(10) == -signal.SIGKILL
    assert len(rows) == 10_000
    assert sorted(r.id for r in rows) == list(range(10_000))  # none lost, none twice
    assert all(r.reply == str(r.id) for r in rows)
    # put a worker back for any later test
    cluster["workers"][0] = twist(procs, "mdp-worker", "--broker", endpoint, "--service", "upper",
                                  "--handler", "tests.handlers_for_tests:slow_upper", *HB)
    cluster["workers"][0].waitFor("sent READY", 60)


def test_broker_down_fails_the_job_in_time_naming_broker_and_service(spark: Any) -> None:
    import socket

    from mdp.spark import call_service

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"zmq:tcp://127.0.0.1:{port}"
    df = spark.createDataFrame([("x",)] * 10, "value string")
    started = time.monotonic()
    with pytest.raises(Exception) as info:
        call_service(df, "upper", dead, timeout=0.5, retries=2).collect()
    elapsed = time.monotonic() - started
    assert dead in str(info.value) and "'upper'" in str(info.value)
    assert elapsed < 60  # a bound, not a speed: timeout × retries plus Spark's own overhead


class _Untouchable:
    """Stands for a DataFrame or an RDD: any use of it fails the test (the
    arguments must be checked before it is touched, and without Spark)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"touched .{name} before checking the arguments")


@pytest.mark.parametrize("kwargs, error, says", [
    ({"broker": "tcp://127.0.0.1:5555"}, TransportError, "this is a URL, not an endpoint"),
    ({"broker": ["zmq:tcp://127.0.0.1:5555", "zmq:tcp://127.0.0.1"]}, TransportError, "no port"),
    ({"broker": b"zmq:tcp://127.0.0.1:5555"}, TypeError, "endpoints are str"),
    ({"broker": []}, ValueError, "at least one broker or server endpoint"),
    ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds, got 0"),
    ({"timeout": -1.5}, ValueError, "timeout must be a positive"),
    ({"timeout": float("inf")}, ValueError, "timeout must be at most 1e.09 seconds"),
    ({"timeout": 1e308}, ValueError, "timeout must be at most"),
    ({"timeout": "2"}, TypeError, "timeout is a number"),
    ({"window": 2.5}, TypeError, "window is a whole number, not float"),
    ({"retries": 2.5}, TypeError, "retries is a whole number"),
    ({"retries": 0}, ValueError, "retries counts attempts and must be at least 1, got 0"),
    ({"window": 0}, ValueError, "window must be at least 1, got 0"),
    ({"window": -3}, ValueError, "window must be at least 1"),
    ({"dialect": "bogus"}, ValueError, "unknown MDP dialect 'bogus'"),
    ({"service": ""}, ValueError, "empty service name"),
    ({"onError": "ignore"}, ValueError, "onError must be one of"),
])
def test_arguments_are_checked_on_the_driver_before_any_task(kwargs: dict, error: Any,
                                                             says: str) -> None:
    """Not only inside each executor task, once Spark has started the job."""
    from mdp.spark import call_service, call_service_rdd, service_column

    arguments = {"service": "upper", "broker": "zmq:tcp://127.0.0.1:5555", **kwargs}
    service, broker = arguments.pop("service"), arguments.pop("broker")
    with pytest.raises(error, match=says):
        call_service(_Untouchable(), service, broker, **arguments)
    with pytest.raises(error, match=says):
        call_service_rdd(_Untouchable(), service, broker, **arguments)
    with pytest.raises(error, match=says):
        service_column(service, broker, **arguments)


@pytest.mark.parametrize("batch, error", [(0, ValueError), (-1, ValueError), ("9", TypeError)])
def test_the_rdd_batch_is_checked_on_the_driver(batch: Any, error: Any) -> None:
    from mdp.spark import call_service_rdd

    with pytest.raises(error, match="batch"):
        call_service_rdd(_Untouchable(), "upper", "zmq:tcp://127.0.0.1:5555", batch=batch)


def test_a_streaming_query_restarted_from_its_checkpoint_runs_each_request_once(
        spark: Any, tmp_path: Any, monkeypatch: Any) -> None:
    # a file source read one file a micro-batch; a worker is killed while it holds a request
    # of the second batch, once half of that batch is answered, and the query is stopped
    # there, then started again from its checkpoint: the batch is replayed, and the workers'
    # shared reply store answers what already ran.  The second batch reuses the first's keys:
    # half with the same data (a new request: a later batch), half with other data
    import json

    from mdp.spark import call_service

    runs, source = tmp_path / "runs", tmp_path / "in"
    runs.mkdir()
    source.mkdir()
    parts = [[(n, f"row{n}") for n in range(60)],
             [(n, f"row{n}" if n < 30 else f"new{n}") for n in range(60)],
             [(n, f"row{n}") for n in range(120, 180)]]
    for number, part in enumerate(parts):
        lines = [json.dumps({"id": n, "value": value}) for n, value in part]
        (source / f"part{number}.json").write_text("\n".join(lines))
    monkeypatch.setenv("MDP_TEST_RUNS", str(runs))
    monkeypatch.setenv("MDP_TEST_TRAP", "new59")  # in the second batch

    def executed() -> list[str]:
        return [line for f in runs.iterdir() if f.name != "trapped" for line in f.read_text().split()]

    with Processes() as procs:
        broker = twist(procs, "mdp-broker", "--endpoint", "zmq:tcp://127.0.0.1:*", *HB)
        endpoint = broker.waitFor("MDP broker listening on", 60).split("listening on ")[1].split()[0]
        workers = [twist(procs, "mdp-worker", "--broker", endpoint, "--service", "upper",
                         "--reply-db", str(tmp_path / "replies.db"),
                         "--handler", "tests.handlers_for_tests:counted_upper", *HB) for _ in range(2)]
        for worker in workers:
            worker.waitFor("sent READY", 60)

        def start() -> Any:
            stream = spark.readStream.schema("id long, value string").option("maxFilesPerTrigger", 1)
            out = call_service(stream.json(str(source)), "upper", endpoint, outputType="string",
                               keyCol="id", timeout=1.0, retries=10)
            return (out.writeStream.format("json").option("path", str(tmp_path / "out"))
                    .option("checkpointLocation", str(tmp_path / "checkpoint"))
                    .trigger(availableNow=True).start())

        query = start()
        deadline = time.monotonic() + 40
        while not ((runs / "trapped").exists() and len(executed()) >= 60 + 30):
            assert time.monotonic() < deadline, f"ran {len(executed())}, {sorted(runs.iterdir())}"
            time.sleep(0.05)
        trapped = int((runs / "trapped").read_text())
        victim = next(w for w in workers if w.proc.pid == trapped)
        victim.proc.send_signal(signal.SIGKILL)
        assert victim.proc.wait(10) == -signal.SIGKILL
        query.stop()
        query = start()
        query.awaitTermination(40)
        assert query.exception() is None

    out = spark.read.json(str(tmp_path / "out")).collect()
    rows = sorted(row for part in parts for row in part)
    assert sorted((r.id, r.value) for r in out) == rows  # none lost, none twice
    assert all(r.reply == r.value.upper() for r in out)  # each its own reply, none a stored one
    assert sorted(executed()) == sorted(value for _, value in rows)  # each request ran once


def test_a_rows_stamp_depends_on_its_service_key_request_and_scope_only() -> None:
    from mdp.majordomo.idempotence import CLIENT_ID_BYTES
    from mdp.spark import request_stamp

    query = "0f4c9b1e-query"
    first = request_stamp("upper", 42, [b"row42"], query, 7)
    assert first == request_stamp("upper", 42, [b"row42"], query, 7)  # a replayed batch: the same
    assert len(first[0]) == CLIENT_ID_BYTES and first[1] == 7
    assert request_stamp("upper", "42", [b"row42"], query, 7) == first  # a key is its text
    for other in (request_stamp("upper", 43, [b"row42"], query, 7),  # another row
                  request_stamp("lower", 42, [b"row42"], query, 7),  # another service
                  request_stamp("upper", 42, [b"other"], query, 7),  # the key reused for other data
                  request_stamp("upper", 42, [b"row4", b"2"], query, 7),  # frames are not joined
                  request_stamp("upper", 42, [b"row42"], "another-query", 7)):  # another query
        assert other[0] != first[0]
    assert request_stamp("upper", 42, [b"row42"], query, 8) != first  # in a later batch: runs again
    assert len(request_stamp("s" * 255, 42, [b"row42"], query, 7)[0]) == CLIENT_ID_BYTES


def test_outside_a_streaming_query_each_call_stamps_within_its_own_scope() -> None:
    from mdp.spark import stamp_scope

    assert stamp_scope("call-1") == ("call-1", 0)  # no task here: a call's own scope


def test_a_missing_key_column_is_refused_on_the_driver(spark: Any) -> None:
    from mdp.spark import call_service

    df = spark.range(3).selectExpr("cast(id as string) as value")
    with pytest.raises(ValueError, match="no key column 'id'"):
        call_service(df, "upper", "zmq:tcp://127.0.0.1:5555", keyCol="id")
