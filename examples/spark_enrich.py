"""Enrich a dataset through an MDP service from Spark, then write Parquet.

Locally, with a broker and two workers this script starts for you::

    python examples/spark_enrich.py --output /tmp/enriched.parquet
    python examples/spark_enrich.py --input people.csv --column name --output out.parquet

``--mode`` picks how Spark calls the service: ``batch`` (``call_service``, the default),
``column`` (``service_column`` in ``withColumn``) or ``streaming`` (a Structured Streaming
query over the input's directory, stamped by ``id`` and checkpointed beside the output, so
running it again after a stop or a crash runs no request twice).  ``--remote sc://HOST:PORT``
runs any mode from a Spark Connect client session.

Against your own broker (its workers serve the service ``enrich``)::

    python examples/spark_enrich.py --broker zmq:tcp://10.0.0.5:5555 --input in.parquet ...

On a cluster, the executors need this package: ship it with ``spark-submit
--py-files txmajordomo.zip`` (a zip of the ``mdp`` package, plus ``twisted``,
``txzmq``, ``pyzmq`` and ``crochet`` installed on the nodes), or better install
the wheel on every node (``pip install txmajordomo[spark]``) and run::

    spark-submit --master yarn examples/spark_enrich.py --broker zmq:tcp://broker:5555 \\
        --input hdfs:///data/people.parquet --output hdfs:///data/enriched.parquet
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

SERVICE = "enrich"


def enrich(frames: list[bytes]) -> list[bytes]:
    """The service: a normalised form of the value and its length."""
    value = frames[0].decode("utf-8").strip()
    return [f"{value.title()}|{len(value)}".encode()]


def serve(endpoint: str, replyDb: str | None) -> None:
    """Run one worker for the ``enrich`` service (``--worker ENDPOINT``), answering replayed
    requests from the SQLite reply store *replyDb* if given."""
    from twisted.internet import reactor

    from mdp import Worker
    from mdp.majordomo.idempotence import SQLiteReplyStore

    replies = SQLiteReplyStore(replyDb) if replyDb else None
    Worker(endpoint, SERVICE, enrich, reactor, replies=replies).start()
    print("worker ready", flush=True)
    reactor.run()


def start_local_services(replyDb: str) -> tuple[str, list[subprocess.Popen]]:
    """A broker on a free 127.0.0.1 port and two workers sharing the reply store *replyDb*,
    as child processes."""
    twist = os.path.join(os.path.dirname(sys.executable), "twist")
    broker = subprocess.Popen([twist, "--log-format", "text", "mdp-broker", "--endpoint",
                               "zmq:tcp://127.0.0.1:*"], stdout=subprocess.PIPE, text=True)
    endpoint = ""
    for line in broker.stdout:  # type: ignore[union-attr]
        if "MDP broker listening on" in line:
            endpoint = line.split("listening on ")[1].split()[0]
            break
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", endpoint, "--reply-db", replyDb],
                                stdout=subprocess.DEVNULL) for _ in range(2)]
    return endpoint, [broker, *workers]


def sample_csv(path: str, rows: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("id,name\n")
        for i in range(rows):
            f.write(f"{i},  person number {i}  \n")


def enrich_into(spark: Any, mode: str, source: str, column: str, broker: str, output: str) -> None:
    """Read *source*, add the service's reply to each row as ``enriched``, write Parquet to *output*."""
    from mdp.spark import call_service, service_column

    parquet = source.endswith(".parquet")
    df = spark.read.parquet(source) if parquet else spark.read.option("header", True).csv(source)
    if mode == "streaming":  # every file of the input's directory, one micro-batch each
        reader = spark.readStream.schema(df.schema).option("maxFilesPerTrigger", 1)
        directory = source if parquet else os.path.dirname(source)
        rows = reader.parquet(directory) if parquet else reader.option("header", True).csv(directory)
        enriched = call_service(rows, SERVICE, broker, inputCol=column, outputCol="enriched",
                                outputType="string", onError="column", keyCol="id")
        query = (enriched.writeStream.format("parquet").option("path", output)
                 .option("checkpointLocation", output.rstrip("/") + ".checkpoint")
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        return
    if mode == "column":
        enrich = service_column(SERVICE, broker, outputType="string", onError="null")
        enriched = df.withColumn("enriched", enrich(df[column]))
    else:
        enriched = call_service(df, SERVICE, broker, inputCol=column, outputCol="enriched",
                                outputType="string", onError="column", timeout=5.0, retries=3)
    enriched.write.mode("overwrite").parquet(output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", help="CSV (with a header) or Parquet; default: a generated CSV")
    parser.add_argument("--column", default="name", help="column sent to the service")
    parser.add_argument("--output", help="Parquet directory to write (required)")
    parser.add_argument("--broker", help="broker endpoint; default: start one locally")
    parser.add_argument("--rows", type=int, default=10_000, help="rows of the generated CSV")
    parser.add_argument("--master", default=os.environ.get("SPARK_MASTER", "local[2]"))
    parser.add_argument("--mode", choices=("batch", "column", "streaming"), default="batch")
    parser.add_argument("--remote", help="a Spark Connect server, sc://HOST:PORT")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--reply-db", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        serve(args.worker, args.reply_db)
        return 0
    if not args.output:
        parser.error("--output is required")

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    children: list[subprocess.Popen] = []
    try:
        broker = args.broker
        if broker is None:
            # the workers' reply store lives beside the output, as the checkpoint does: a
            # streaming run started again after a crash finds what the last one answered
            broker, children = start_local_services(args.output.rstrip("/") + ".replies.db")
        builder = SparkSession.builder.appName("spark_enrich")
        builder = (builder.remote(args.remote) if args.remote
                   else builder.master(args.master).config("spark.ui.enabled", "false"))
        spark = builder.getOrCreate()
        if not args.remote:
            spark.sparkContext.setLogLevel("ERROR")
        source = args.input
        if source is None:  # beside the output, so a streaming run started again reads the same
            source = os.path.join(args.output.rstrip("/") + ".input", "people.csv")
            if not os.path.exists(source):
                os.makedirs(os.path.dirname(source), exist_ok=True)
                sample_csv(source, args.rows)
        enrich_into(spark, args.mode, source, args.column, broker, args.output)
        written = spark.read.parquet(args.output)
        print(f"wrote {written.count()} rows to {args.output}")
        written.show(3, truncate=False)
        spark.stop()
    finally:
        for child in children:
            child.kill()
            child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
