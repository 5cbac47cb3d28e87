"""Stream framing under a trickle: ``python -m benchmarks.framing [--smoke]``.

A peer that sends a large record 64 bytes at a time.  Measured in one run:
our :class:`~mdp.transport.framing.RecordDecoder` and, as the baseline, Twisted's
``Int32StringReceiver`` (which re-joins everything buffered on every read), each
fed the same record whole and in 64-byte pieces.  Reported: seconds per MiB and
the ratio trickled/whole for each; ours stays flat as the record grows, the
baseline's grows with the record (every piece copies what came before).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

from mdp.transport.framing import RecordDecoder, encode_record

PIECE = 64
MiB = 1024 * 1024


def ours(data: list[bytes]) -> None:
    decoder = RecordDecoder()
    out = []
    for piece in data:
        out += decoder.feed(piece)
    assert len(out) == 1


def baseline(data: list[bytes]) -> None:
    from twisted.protocols.basic import Int32StringReceiver

    got: list[bytes] = []
    receiver = Int32StringReceiver()
    receiver.MAX_LENGTH = 64 * MiB
    receiver.stringReceived = got.append  # type: ignore[method-assign]
    for piece in data:
        receiver.dataReceived(piece)
    assert len(got) == 1


def timed(fn: Callable[[list[bytes]], None], data: list[bytes]) -> float:
    start = time.perf_counter()
    fn(data)
    return time.perf_counter() - start


def measure(size: int) -> dict[str, Any]:
    record = encode_record([b"x" * size])
    whole = [record]
    trickle = [record[i:i + PIECE] for i in range(0, len(record), PIECE)]
    row: dict[str, Any] = {"record_bytes": len(record), "pieces": len(trickle)}
    for name, fn in (("ours", ours), ("twisted_int32", baseline)):
        w = min(timed(fn, whole) for _ in range(3))
        t = timed(fn, trickle)
        row[name] = {"whole_s": w, "trickle_s": t, "trickle_s_per_mib": t / (len(record) / MiB),
                     "trickle_over_whole": t / max(w, 1e-9)}
    row["baseline_over_ours_trickled"] = row["twisted_int32"]["trickle_s"] / row["ours"]["trickle_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.framing")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sizes = [64 * 1024] if args.smoke else [256 * 1024, 1 * MiB, 4 * MiB]
    rows = [measure(size) for size in sizes]
    print("| record | pieces of 64 B | ours s/MiB trickled | Int32StringReceiver s/MiB trickled "
          "| baseline / ours |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['record_bytes'] / MiB:.2f} MiB | {r['pieces']} "
              f"| {r['ours']['trickle_s_per_mib']:.4f} | {r['twisted_int32']['trickle_s_per_mib']:.4f} "
              f"| {r['baseline_over_ours_trickled']:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"smoke": args.smoke, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
