"""Enrich a dataset through an MDP service from Spark, then write Parquet.

Locally, with a broker and two workers this script starts for you::

    python examples/spark_enrich.py --output /tmp/enriched.parquet
    python examples/spark_enrich.py --input people.csv --column name --output out.parquet

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
import tempfile
from typing import Any

SERVICE = "enrich"


def enrich(frames: list[bytes]) -> list[bytes]:
    """The service: a normalised form of the value and its length."""
    value = frames[0].decode("utf-8").strip()
    return [f"{value.title()}|{len(value)}".encode()]


def serve(endpoint: str) -> None:
    """Run one worker for the ``enrich`` service (``--worker ENDPOINT``)."""
    from twisted.internet import reactor

    from mdp import Worker

    Worker(endpoint, SERVICE, enrich, reactor).start()
    print("worker ready", flush=True)
    reactor.run()


def start_local_services() -> tuple[str, list[subprocess.Popen]]:
    """A broker on a free 127.0.0.1 port and two workers, as child processes."""
    twist = os.path.join(os.path.dirname(sys.executable), "twist")
    broker = subprocess.Popen([twist, "--log-format", "text", "mdp-broker", "--endpoint",
                               "zmq:tcp://127.0.0.1:*"], stdout=subprocess.PIPE, text=True)
    endpoint = ""
    for line in broker.stdout:  # type: ignore[union-attr]
        if "MDP broker listening on" in line:
            endpoint = line.split("listening on ")[1].split()[0]
            break
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", endpoint],
                                stdout=subprocess.DEVNULL) for _ in range(2)]
    return endpoint, [broker, *workers]


def sample_csv(path: str, rows: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("id,name\n")
        for i in range(rows):
            f.write(f"{i},  person number {i}  \n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", help="CSV (with a header) or Parquet; default: a generated CSV")
    parser.add_argument("--column", default="name", help="column sent to the service")
    parser.add_argument("--output", help="Parquet directory to write (required)")
    parser.add_argument("--broker", help="broker endpoint; default: start one locally")
    parser.add_argument("--rows", type=int, default=10_000, help="rows of the generated CSV")
    parser.add_argument("--master", default=os.environ.get("SPARK_MASTER", "local[2]"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        serve(args.worker)
        return 0
    if not args.output:
        parser.error("--output is required")

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from mdp.spark import call_service

    children: list[subprocess.Popen] = []
    try:
        broker = args.broker
        if broker is None:
            broker, children = start_local_services()
        spark = (SparkSession.builder.master(args.master).appName("spark_enrich")
                 .config("spark.ui.enabled", "false").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        source = args.input
        if source is None:
            source = os.path.join(tempfile.mkdtemp(), "people.csv")
            sample_csv(source, args.rows)
        reader: Any = spark.read
        df = (reader.parquet(source) if source.endswith(".parquet")
              else reader.option("header", True).csv(source))
        enriched = call_service(df, SERVICE, broker, inputCol=args.column,
                                outputCol="enriched", outputType="string",
                                onError="column", timeout=5.0, retries=3)
        enriched.write.mode("overwrite").parquet(args.output)
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
