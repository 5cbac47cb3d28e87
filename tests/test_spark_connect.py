"""The PySpark bridge from a Spark Connect client: a connect server started from
the installed pyspark (its bundled spark-connect jar) on 127.0.0.1, a broker and
a worker as ``twist`` processes, and a client process whose session is
``SparkSession.builder.remote(...)``: ``call_service`` and the column function
run on the server's executors; the client imports neither a reactor nor ZeroMQ."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import grpc  # noqa: F401  (the test extra installs pyspark[connect]: a missing one must fail)
import pytest

from benchmarks.harness import Processes

pytestmark = pytest.mark.timeout(60)

BIN = os.path.dirname(sys.executable)
HB = ["--heartbeat", "0.25", "--liveness", "4"]

#: the client: argv[1] the connect server, argv[2] the broker; prints one JSON line
CLIENT = """
import json, sys
from pyspark.sql import SparkSession
from mdp.spark import call_service, service_column

spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
df = spark.createDataFrame([(f"r{i}", f"x{i}") for i in range(200)], "value string, other string")
whole = call_service(df, "upper", sys.argv[2], outputType="string").collect()
upper = service_column("upper", sys.argv[2], outputType="string")
column = df.withColumn("reply", upper(df.value)).collect()
both = df.select(service_column("upper", sys.argv[2], outputType="frames")(df.value, df.other)
                 .alias("reply")).collect()
print(json.dumps({
    "whole": [r.reply for r in whole], "column": [r.reply for r in column],
    "both": [[f.decode() for f in r.reply] for r in both[:2]],
    "imported": sorted(m for m in ("twisted.internet.reactor", "zmq", "mdp.blocking")
                       if m in sys.modules)}))
spark.stop()
"""


def test_a_connect_session_calls_services_from_its_executors(monkeypatch: Any) -> None:
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    with Processes() as procs:
        server = procs.start(argv=[
            os.path.join(BIN, "spark-submit"), "--master", "local[2]",
            "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
            "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
            "--conf", "spark.connect.grpc.binding.port=0",
            "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.host=127.0.0.1",
            "--conf", "spark.driver.bindAddress=127.0.0.1", "spark-internal"])
        broker = procs.start(argv=[os.path.join(BIN, "twist"), "--log-format", "text",
                                   "mdp-broker", "--endpoint", "zmq:tcp://127.0.0.1:*", *HB])
        endpoint = broker.waitFor("MDP broker listening on", 30).split("listening on ")[1].split()[0]
        worker = procs.start(argv=[os.path.join(BIN, "twist"), "--log-format", "text",
                                   "mdp-worker", "--broker", endpoint, "--service", "upper",
                                   "--handler", "tests.handlers_for_tests:slow_upper", *HB])
        worker.waitFor("sent READY", 30)
        started = server.waitFor("Spark Connect server started at:", 45)
        address = started.split("started at:")[1].strip()
        client = procs.start(argv=[sys.executable, "-c", CLIENT, f"sc://{address}", endpoint])
        line = client.waitFor('{"whole"', 45)
        result: dict[str, Any] = json.loads(line[line.index("{"):])
    assert result["whole"] == [f"R{i}" for i in range(200)]
    assert result["column"] == result["whole"]
    assert result["both"] == [["R0", "X0"], ["R1", "X1"]]
    # the closures are pickled on the client, which runs no reactor and no socket of ours
    assert result["imported"] == []
