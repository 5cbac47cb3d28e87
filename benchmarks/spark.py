"""Rows per second through ``mdp.spark.call_service`` against one plain client.

    python -m benchmarks.spark [--rows 200000] [--smoke]

Same run, same broker and 4 echo workers (separate processes, ZeroMQ on
127.0.0.1): first one plain client process outside Spark sends the rows with 64
requests in flight; then a ``local[2]`` Spark job sends them through
``call_service`` (window 64 per partition).  Writes JSON, prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.harness import ROOT, Processes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spark")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--smoke", action="store_true", help="2,000 rows")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results",
                                                       "spark-latest.json"))
    args = parser.parse_args(argv)
    rows = 2_000 if args.smoke else args.rows
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    with Processes() as procs:
        broker = procs.start("broker", "ours", "zmq:tcp://127.0.0.1:*")
        endpoint = broker.ready()
        for worker in [procs.start("worker", "ours", endpoint) for _ in range(4)]:
            worker.ready()

        client = procs.start("client", "ours", endpoint, "pipelined", str(rows), "200", "16", "64")
        client.ready(timeout=120)
        client.go()
        plain = client.result(timeout=900)
        plain_rate = rows / (plain["end"] - plain["start"])

        from pyspark.sql import SparkSession

        from mdp.spark import call_service

        spark = (SparkSession.builder.master("local[2]").appName("bench")
                 .config("spark.ui.enabled", "false")
                 .config("spark.driver.bindAddress", "127.0.0.1")
                 .config("spark.driver.host", "127.0.0.1").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        df = spark.range(rows, numPartitions=2).selectExpr("lpad(cast(id as string), 16, 'x') as value")
        df.cache().count()
        call_service(df.limit(1000), "echo", endpoint).count()  # warm the executors up
        started = time.monotonic()
        done = call_service(df, "echo", endpoint, window=64).selectExpr("count(reply)").first()[0]
        spark_rate = rows / (time.monotonic() - started)
        spark.stop()
    assert done == rows, (done, rows)
    report = {"rows": rows, "plain_client_rows_per_s": plain_rate,
              "spark_rows_per_s": spark_rate, "ratio": spark_rate / plain_rate}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print("| path | rows | rows/s |\n|---|---:|---:|")
    print(f"| one plain client process, window 64 | {rows:,} | {plain_rate:,.0f} |")
    print(f"| Spark local[2], call_service, window 64 | {rows:,} | {spark_rate:,.0f} |")
    print(f"\nSpark / plain client: {report['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
