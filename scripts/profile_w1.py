"""Where a W1 run's time goes: torch profiler around W1 through an in-process ``LLMEngine``
(issue 37).

Runs W1 (``--num-prompts`` prompts x ``--max-tokens`` output tokens, greedy, EOS ignored) once
unprofiled as warm-up on other prompts, then once under ``torch.profiler`` (CPU activities, no
shapes or stacks), and sorts every top-level op (an op not called from another op) into a part of
the step by its name: the oneDNN linears, decode attention, prefill attention, the fused
norm/rotary/SiLU kernels, elementwise ops, dtype conversions, KV writes, sampling. The rest of the
wall time (Python between ops, scheduling, bookkeeping) is what the ops do not cover. Inclusive
time of top-level ops on the calling thread: time a parallel op spends on the other thread is
not added twice.

    .venv/bin/python scripts/profile_w1.py [--dtype auto] [--num-prompts 64] [--max-tokens 128] \
        [--base main] [--model FOLDER]

``--base REF`` profiles the same run on the kernel paths of git ref REF instead of this tree's
(``scripts/bench_kernels_ab.py`` builds them and says what they are): the "before" table.

Prints a table (part, seconds, share of the profiled wall time, calls, ms per call) and the 25
most expensive top-level op names; writes ``results/profile_w1_<dtype>[_base].json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import pathlib
import random
import time

from bench_common import DEFAULT_DATASET, cpu_description, write_json_report
from bench_kernels_ab import run_requests

#: (part, op-name prefixes) in match order; an op whose name starts with none of them is "other".
PARTS = (
    ("linear layers (oneDNN, LM head included)", ("mkldnn::_linear_pointwise", "aten::linear",
                                                  "aten::addmm", "aten::mm", "aten::matmul")),
    ("decode attention kernel", ("atom_kernels::paged_decode_attention",)),
    ("prefill attention (kernel, or SDPA per sequence)", ("atom_kernels::paged_prefill_attention_",
                                                          "aten::scaled_dot_product_attention",
                                                          "aten::_scaled_dot_product")),
    ("fused norm / rotary / SiLU kernels", ("atom_kernels::rms_norm",
                                            "atom_kernels::fused_add_rms_norm",
                                            "atom_kernels::silu_and_mul",
                                            "atom_kernels::rotary_embedding_")),
    ("KV writes (index_copy_)", ("aten::index_copy_",)),
    ("sampling (logsumexp_argmax)", ("atom_kernels::logsumexp_argmax",)),
    ("dtype conversions (to / copy_)", ("aten::to", "aten::_to_copy", "aten::copy_")),
    ("elementwise (mul, add, silu, pow, rsqrt, mean, cat, neg, ...)",
     ("aten::mul", "aten::add", "aten::silu", "aten::pow", "aten::rsqrt", "aten::mean",
      "aten::cat", "aten::neg", "aten::sub", "aten::div", "aten::exp")),
)


def part_of(name: str) -> str:
    """The part of :data:`PARTS` an op name belongs to ("other ops" when none); ``--base``'s ops
    (``atom_kernels_base::``) count as ours."""
    name = name.replace("atom_kernels_base::", "atom_kernels::")
    for part, prefixes in PARTS:
        if name.startswith(prefixes):
            return part
    return "other ops"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face folder or GGUF file (default: the "
                        "embedded model); W1's token ids must fit its vocabulary")
    parser.add_argument("--dataset", type=pathlib.Path, default=DEFAULT_DATASET)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--num-threads", type=int)
    parser.add_argument("--base", help="profile the kernel paths of this git ref instead")
    parser.add_argument("--output-json", type=pathlib.Path)
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from atom.config import EngineConfig
    from atom.engine.llm_engine import LLMEngine

    config = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.num_threads)
    dtype = config.resolved_dtype()
    output_json = args.output_json or pathlib.Path(
        f"results/profile_w1_{dtype}{'_base' if args.base else ''}.json")
    paths = contextlib.nullcontext  # the kernel paths to run: a fresh context each time
    if args.base:
        from bench_kernels_ab import BaseOps, base_paths, build_base

        build_base(args.base)
        base_ops = BaseOps()
        paths = lambda: base_paths(base_ops)  # noqa: E731
    engine = LLMEngine(config)
    prompts = [list(x["ids"]) for x in json.loads(args.dataset.read_text())[: args.num_prompts]]
    rng = random.Random(12345)  # ids >= 3: no special tokens
    with paths():
        run_requests(engine, [[rng.randrange(3, 4000) for _ in range(128)] for _ in range(4)], 8,
               "warmup")

    with paths(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        num_output = run_requests(engine, prompts, args.max_tokens, "w1")
        wall_s = time.perf_counter() - start

    parts: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    ops: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if (event.cpu_parent is not None or event.device_type != torch.autograd.DeviceType.CPU
                or getattr(event, "is_user_annotation", False)):
            continue
        seconds = event.time_range.elapsed_us() / 1e6
        for table in (parts[part_of(event.name)], ops[event.name]):
            table[0] += seconds
            table[1] += 1
    covered_s = sum(s for s, _ in parts.values())
    rows = sorted(([p, s, n] for p, (s, n) in parts.items()), key=lambda r: -r[1])
    rows.append(["Python between ops, scheduling, bookkeeping", wall_s - covered_s, 0])
    print(cpu_description())
    print(f"W1: {len(prompts)} prompts x {args.max_tokens} tokens, {dtype}, kernel paths of "
          f"{args.base or 'this tree'}, "
          f"{torch.get_num_threads()} threads: {wall_s:.1f} s profiled wall time, "
          f"{num_output / wall_s:.1f} output tok/s under the profiler")
    print(f"{'part':<64}{'s':>8}{'share':>8}{'calls':>8}{'ms/call':>9}")
    for part, seconds, calls in rows:
        per_call = f"{seconds / calls * 1e3:9.3f}" if calls else f"{'':>9}"
        print(f"{part:<64}{seconds:8.2f}{seconds / wall_s:8.1%}{calls:8d}{per_call}")
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:25]
    print("\ntop-level ops by time:")
    for name, (seconds, calls) in top:
        print(f"  {name:<58}{seconds:8.2f} s{seconds / wall_s:8.1%}{calls:8d} calls")
    write_json_report(output_json, {
        "cpu": cpu_description(), "dtype": dtype, "num_threads": torch.get_num_threads(),
        "kernel_paths": args.base or "this tree",
        "num_prompts": len(prompts), "max_tokens": args.max_tokens, "wall_s": wall_s,
        "num_output_tokens": num_output,
        "parts": [{"part": p, "seconds": s, "calls": n} for p, s, n in rows],
        "top_ops": [{"name": n, "seconds": s, "calls": c} for n, (s, c) in top]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
