"""What the per-tick DP trace costs a tick: building the row (``tick_row``) and queueing it
(``TraceWriter.write``), in µs per tick, against the same tick with the trace off (no writer:
the loop does nothing). Also how fast the background thread writes rows to disk.

    python scripts/bench_dp_trace.py --num-ticks 20000 --dp-size 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from atom.dp.dp_trace import TraceWriter, tick_row
from atom.dp.prefill_decision import Decision, DecisionReason
from atom.dp.sync import BatchShape, ControlState, GatheredBatchShape, GatheredControl


def one_tick_values(dp_size: int):
    gathered = GatheredControl.from_states([
        ControlState(has_work=True, num_admittable=r % 3, num_prefill_tokens=100 * r,
                     num_running_decodes=8, kv_usage_ppm=400_000, tick=7,
                     collective_hash=-12345) for r in range(dp_size)])
    shapes = GatheredBatchShape.from_shapes([
        BatchShape(num_tokens=9, num_seqs=9, num_decode_seqs=8, has_prefill=r == 0,
                   num_prefill_tokens=1) for r in range(dp_size)])
    return gathered, shapes, Decision(DecisionReason.HOLD, 3)


def per_tick_us(num_ticks: int, dp_size: int, writer: TraceWriter | None) -> list[float]:
    """µs per tick of the trace's work in the DP loop, in 10 batches."""
    gathered, shapes, decision = one_tick_values(dp_size)
    batches = []
    for _ in range(10):
        start = time.perf_counter()
        for _ in range(num_ticks // 10):
            t0 = time.perf_counter_ns()
            if writer is not None:  # exactly what DPEngineCoreProc._tick does
                writer.write(tick_row(dp_rank=0, gathered=gathered, decision=decision,
                                      shapes=shapes, start_ns=t0, synced_ns=t0 + 1000,
                                      end_ns=time.perf_counter_ns()))
        batches.append((time.perf_counter() - start) / (num_ticks // 10) * 1e6)
    return batches


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-ticks", type=int, default=20000)
    p.add_argument("--dp-size", type=int, default=2)
    args = p.parse_args(argv)
    off = per_tick_us(args.num_ticks, args.dp_size, None)
    with tempfile.TemporaryDirectory() as folder:
        writer = TraceWriter(folder, dp_rank=0, dp_size=args.dp_size, policy="delayer")
        on = per_tick_us(args.num_ticks, args.dp_size, writer)
        start = time.perf_counter()
        writer.close(timeout_s=600)  # the rows still queued
        drain_s = time.perf_counter() - start
        size = writer.path.stat().st_size
    print(f"| trace | µs per tick (median of 10 batches, {args.num_ticks} ticks, "
          f"dp_size {args.dp_size}) |")
    print("|---|---|")
    print(f"| off | {statistics.median(off):.3f} |")
    print(f"| on (row + queue) | {statistics.median(on):.2f} |")
    print(f"rows written: {size / args.num_ticks:.0f} bytes each; queue drained "
          f"{drain_s:.2f} s after the last tick", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
