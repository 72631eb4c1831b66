"""gpt-oss's attention options (sinks, a sliding window) in the compiled paged attention kernels
against the torch paths that ran them before (issue 35), timed alternately in one process.

Shapes of gpt-oss-20b's attention (64 query heads, 8 KV heads, head_dim 64, window 128, a sink
per head), blocks of 16 tokens through shuffled block tables:

- decode: 8 sequences of 2048 tokens, one new token each
  (``ops.paged_decode_attention`` vs :func:`atom.kernels.attention.paged_decode_attention`);
- prefill: a 512-token chunk over 1536 cached tokens
  (``ops.paged_prefill_attention_`` vs
  :func:`atom.kernels.attention.paged_prefill_attention_reference`);

each with the window (a sliding layer) and without it (a full layer, sinks only). Every
repetition times the torch path and then the kernel back to back; the table gives medians and
the median of the per-repetition ratios (torch / kernel: > 1, the kernel is faster).

    .venv/bin/python scripts/bench_attention_options.py [--dtype bfloat16] [--reps 5] \\
        [--num-threads 1]

Prints a table and writes ``results/bench_attention_options_<dtype>.json``.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from bench_common import cpu_description, write_json_report
from bench_kernels_ab import alternate

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, WINDOW, BLOCK_SIZE = 64, 8, 64, 128, 16
NUM_SEQS, CONTEXT, CHUNK = 8, 2048, 512


def cases(dtype: torch.dtype):
    """(name, torch callable, kernel callable) per case."""
    from atom.kernels import cpu_ops
    from atom.kernels.attention import (AttentionMetadata, paged_decode_attention,
                                        paged_prefill_attention_reference)

    ops = cpu_ops.load()
    if ops is None:
        raise SystemExit(f"the C++ kernels are not built: {cpu_ops.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    num_blocks = NUM_SEQS * CONTEXT // BLOCK_SIZE
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=gen).view(NUM_SEQS, -1).contiguous()
    lens = torch.full((NUM_SEQS,), CONTEXT)
    sinks = torch.randn(NUM_HEADS, generator=gen).to(dtype)
    scale = HEAD_DIM ** -0.5
    q = torch.randn(NUM_SEQS, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q_chunk = torch.randn(CHUNK, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.zeros(CHUNK, dtype=torch.int64),
                             query_start_loc=[0, CHUNK], context_lens=[CONTEXT],
                             block_tables=tables[:1], num_decodes=0, context_lens_tensor=lens[:1])
    out = torch.empty_like(q_chunk)
    for label, window in (("window", WINDOW), ("full", None)):
        yield (f"decode {NUM_SEQS}x{CONTEXT}, {label}",
               lambda w=window: paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                       scale=scale, sinks=sinks,
                                                       sliding_window=w),
               lambda w=window: ops.paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                           scale, sinks, w))
        yield (f"prefill {CHUNK} over {CONTEXT - CHUNK}, {label}",
               lambda w=window: paged_prefill_attention_reference(
                   q_chunk, None, None, k_cache, v_cache, meta, scale=scale, seq_range=range(1),
                   out=out, sinks=sinks, sliding_window=w),
               lambda w=window: ops.paged_prefill_attention_(
                   out, q_chunk, k_cache, v_cache, tables[:1], lens[:1],
                   meta.query_start_loc_tensor, scale, sinks, w))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--reps", type=int, default=5, help="alternating pairs per case")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--output-json", type=pathlib.Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    rows = []
    print(f"{'case':34} {'torch ms':>10} {'kernel ms':>10} {'torch/kernel':>13}")
    for name, torch_fn, kernel_fn in cases(dtype):
        result = alternate(torch_fn, kernel_fn, args.reps)
        rows.append({"case": name, "torch_ms": result["base_ms"], "kernel_ms": result["new_ms"],
                     "ratio": result["ratio"]})
        print(f"{name:34} {result['base_ms']:10.2f} {result['new_ms']:10.2f} "
              f"{result['ratio']:13.1f}")
    write_json_report(args.output_json or pathlib.Path(f"results/bench_attention_options_"
                                                       f"{args.dtype}.json"),
                      {"cpu": cpu_description(), "dtype": args.dtype,
                       "num_threads": args.num_threads, "reps": args.reps, "cases": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
