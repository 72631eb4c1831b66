"""KV cache groups (issue 52), before and after, on a gpt-oss-shaped folder.

The folder is built here by transformers with random weights and gpt-oss-20b's attention
shape (24 layers alternating sliding / full, 8 KV heads x 64, window 128); hidden size,
experts and vocabulary are cut down (``--hidden-size``) so the weights stay small: the KV
cache per token is gpt-oss-20b's.

- **before**: one KV cache group, every layer keeping its whole KV (sliding layers mask their
  window and free nothing), which is what atom did before the groups: :func:`one_kv_cache_group`
  makes :func:`atom.kv_cache_spec.kv_cache_groups` answer one group for the run, the path a
  hybrid model whose layers differ in shape still takes;
- **after**: two groups (full, window 128) sharing the pool; the sliding group keeps a window.

(a) **capacity**: a fixed ``--kv-cache-memory`` (bytes), sequences of ``--context`` tokens:
the engine's own pool (blocks it sized) divided by the blocks one sequence holds (tokens per
byte: pool blocks x context / blocks per sequence; and whole sequences), from the
block manager's bound (:meth:`~atom.core.block_manager.BlockManager.max_blocks_held`): at
decode (what a running sequence holds) and at admission with the chunk of
``--max-num-batched-tokens`` (what the scheduler reserves).

(b) **throughput** (W1-style: every request submitted at once, greedy, ``ignore_eos``):
``--num-requests`` prompts of ``--prompt-len`` random tokens and ``--max-tokens`` outputs in
a pool of ``--throughput-kv-cache-memory`` bytes that holds about ``--before-seqs`` of them
before: the batch is memory-bound before, less so after. Reports output tokens/s, the peak of
running sequences, preemptions, and in how many requests the greedy tokens are equal before
and after (all of them in float32; bf16 rounds differently when the batches differ).

    python scripts/bench_kv_groups.py --json bench_kv_groups.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import pathlib
import random
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import cpu_description, write_json_report  # noqa: E402

import atom.kv_cache_spec as kv_cache_spec  # noqa: E402
from atom.kv_cache_spec import KVCacheGroup  # noqa: E402

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, WINDOW = 24, 8, 64, 128  # gpt-oss-20b's attention


def build_folder(folder: pathlib.Path, *, hidden_size: int) -> None:
    """A random gpt-oss with gpt-oss-20b's KV shape, saved by transformers (fp32)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=1024, hidden_size=hidden_size, intermediate_size=hidden_size,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_KV_HEADS,
        num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, sliding_window=WINDOW,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16384,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    GptOssForCausalLM(config).eval().save_pretrained(folder)


@contextlib.contextmanager
def one_kv_cache_group():
    """Every layer in one full group for the duration (atom before issue 52): the worker, the
    model runner and the spec helpers all ask :func:`atom.kv_cache_spec.kv_cache_groups`."""
    import atom.worker.model_runner as model_runner
    import atom.worker.worker as worker

    def one_group(specs):
        return [KVCacheGroup(sliding_window=None, layer_ids=tuple(range(len(specs))))]

    modules = (kv_cache_spec, model_runner, worker)
    saved = [m.kv_cache_groups for m in modules]
    for m in modules:
        m.kv_cache_groups = one_group
    try:
        yield
    finally:
        for m, f in zip(modules, saved):
            m.kv_cache_groups = f


def _engine(folder, args, *, kv_cache_memory_bytes: int, max_model_len: int):
    from atom.config import EngineConfig
    from atom.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(
        model=str(folder), dtype=args.dtype, kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_model_len=max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.num_threads, skip_tokenizer_init=True))


def capacity(folder, args) -> dict:
    """(a) for the current grouping (see the module docstring)."""
    engine = _engine(folder, args, kv_cache_memory_bytes=args.kv_cache_memory,
                     max_model_len=args.context + 1)
    try:
        bm, stats = engine.core.block_manager, engine.get_stats()
        decode_blocks = bm.max_blocks_held(args.context, chunk_tokens=1)
        admit_blocks = bm.max_blocks_held(args.context,
                                          chunk_tokens=args.max_num_batched_tokens)
        return {"dtype": engine.runtime.dtype, "num_groups": bm.num_groups,
                "num_kv_blocks": bm.num_blocks, "block_size": bm.block_size,
                "kv_cache_bytes_per_token": stats["kv_cache_bytes_per_token"],
                "blocks_per_seq_decode": decode_blocks, "blocks_per_seq_admission": admit_blocks,
                "seqs_fit_decode": bm.num_blocks // decode_blocks,
                "tokens_fit_decode": bm.num_blocks * args.context // decode_blocks,
                "seqs_fit_admission": bm.num_blocks // admit_blocks,
                "tokens_fit_admission": bm.num_blocks * args.context // admit_blocks}
    finally:
        engine.shutdown()


def throughput(folder, args, prompts) -> dict:
    """(b) for the current grouping: every request at once, stepped until all finish."""
    from atom.sampling_params import SamplingParams

    engine = _engine(folder, args, kv_cache_memory_bytes=args.throughput_kv_cache_memory,
                     max_model_len=args.prompt_len + args.max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    try:
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        finished, peak_running, num_steps = {}, 0, 0
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            peak_running = max(peak_running, engine.core.scheduler.num_running)
            num_steps += 1
        elapsed_s = time.perf_counter() - start
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    num_output = sum(len(o.outputs[0].token_ids) for o in finished.values())
    return {"elapsed_s": elapsed_s, "num_steps": num_steps, "output_tokens": num_output,
            "output_tokens_per_s": num_output / elapsed_s,
            "total_tokens_per_s": (num_output + sum(map(len, prompts))) / elapsed_s,
            "peak_running": peak_running, "num_preemptions": stats["num_preemptions"],
            "num_kv_blocks": stats["num_total_blocks"],
            "token_ids": [list(finished[f"r{i}"].outputs[0].token_ids)
                          for i in range(len(prompts))]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30,
                        help="(a) the KV pool in bytes")
    parser.add_argument("--context", type=int, default=8192, help="(a) tokens per sequence")
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--prompt-len", type=int, default=768)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--before-seqs", type=float, default=4.5,
                        help="(b) sequences the pool holds before (sizes the pool)")
    parser.add_argument("--throughput-kv-cache-memory", type=int, default=None,
                        help="(b) the KV pool in bytes (default: from --before-seqs)")
    parser.add_argument("--json", type=pathlib.Path, default=pathlib.Path("bench_kv_groups.json"))
    args = parser.parse_args(argv)

    cpu = cpu_description()
    print(f"CPU: {cpu}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "gpt-oss-shape"
        build_folder(folder, hidden_size=args.hidden_size)
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 1024) for _ in range(args.prompt_len)]
                   for _ in range(args.num_requests)]
        results = {}
        for mode in ("before", "after"):
            with one_kv_cache_group() if mode == "before" else contextlib.nullcontext():
                cap = capacity(folder, args)
                if args.throughput_kv_cache_memory is None:  # sized on the before layout
                    args.throughput_kv_cache_memory = int(
                        args.before_seqs * (args.prompt_len + args.max_tokens)
                        * cap["kv_cache_bytes_per_token"])
                results[mode] = {"capacity": cap, "throughput": throughput(folder, args, prompts)}
    before, after = results["before"], results["after"]
    ratios = {"tokens_fit_decode": after["capacity"]["tokens_fit_decode"]
              / before["capacity"]["tokens_fit_decode"],
              "tokens_fit_admission": after["capacity"]["tokens_fit_admission"]
              / before["capacity"]["tokens_fit_admission"],
              "output_tokens_per_s": after["throughput"]["output_tokens_per_s"]
              / before["throughput"]["output_tokens_per_s"]}
    # greedy tokens per request, before vs after: equal in fp32; bf16 rounds differently in
    # different batches (the two runs batch differently), so report where they part
    first_diff = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
                  for x, y in zip(before["throughput"]["token_ids"], after["throughput"]["token_ids"])]
    same_tokens = {"num_requests_equal": first_diff.count(None), "num_requests": len(first_diff),
                   "first_differing_positions": [d for d in first_diff if d is not None]}
    _print_table(args, results, ratios, same_tokens)
    write_json_report(args.json, {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu, "args": {k: str(v) for k, v in vars(args).items()}, "results": results,
        "ratios": ratios, "greedy_tokens_before_vs_after": same_tokens})
    return 0


def _print_table(args, results, ratios, same_tokens) -> None:
    rows = [
        ("KV bytes per token (pool)", "kv_cache_bytes_per_token", "capacity", "{:,}"),
        ("KV blocks in --kv-cache-memory", "num_kv_blocks", "capacity", "{:,}"),
        (f"blocks / {args.context}-token seq, decode", "blocks_per_seq_decode", "capacity", "{:,}"),
        (f"tokens that fit at {args.context}, decode", "tokens_fit_decode", "capacity", "{:,}"),
        (f"whole {args.context}-token seqs, decode", "seqs_fit_decode", "capacity", "{:,}"),
        (f"blocks / seq, admission (chunk {args.max_num_batched_tokens})",
         "blocks_per_seq_admission", "capacity", "{:,}"),
        ("tokens that fit, admission", "tokens_fit_admission", "capacity", "{:,}"),
        ("(b) KV blocks", "num_kv_blocks", "throughput", "{:,}"),
        ("(b) peak running sequences", "peak_running", "throughput", "{}"),
        ("(b) preemptions", "num_preemptions", "throughput", "{}"),
        ("(b) elapsed s", "elapsed_s", "throughput", "{:.1f}"),
        ("(b) output tokens/s", "output_tokens_per_s", "throughput", "{:.1f}"),
    ]
    ratio_of = {"tokens_fit_decode": "tokens_fit_decode",
                "tokens_fit_admission": "tokens_fit_admission",
                "output_tokens_per_s": "output_tokens_per_s"}
    print(f"\ndtype {results['after']['capacity']['dtype']}, --kv-cache-memory "
          f"{args.kv_cache_memory:,} B; (b) {args.num_requests} x ({args.prompt_len} + "
          f"{args.max_tokens}) tokens in {args.throughput_kv_cache_memory:,} B")
    print(f"| {'':44} | {'before (1 group)':>16} | {'after (2 groups)':>16} | {'after/before':>12} |")
    print(f"|{'-' * 46}|{'-' * 18}|{'-' * 18}|{'-' * 14}|")
    for label, key, part, fmt in rows:
        ratio = f"{ratios[ratio_of[key]]:.2f}x" if key in ratio_of else ""
        print(f"| {label:44} | {fmt.format(results['before'][part][key]):>16} | "
              f"{fmt.format(results['after'][part][key]):>16} | {ratio:>12} |")
    print(f"(b) greedy tokens equal before/after in {same_tokens['num_requests_equal']} of "
          f"{same_tokens['num_requests']} requests; the others part at output positions "
          f"{same_tokens['first_differing_positions']}")


if __name__ == "__main__":
    sys.exit(main())
