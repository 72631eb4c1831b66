"""EPLB on a real expert-parallel deployment: skewed workloads chosen from the router, and the
real MoE step's cost before and after a rebalance (``scripts/bench_eplb.py``).

**Workloads from the router.** A prompt that repeats one token routes every position alike
(identical keys and values: every position's attention output is the same), so transformers'
``output_router_logits`` on ``[t] * 8`` tells each token's top-k experts in every MoE layer
(:func:`router_topk`). :func:`tokens_within` picks the tokens whose choices all lie in a set of
experts (say rank 0's contiguous shard: re-placement can balance them);
:func:`hot_expert_tokens` the tokens that always choose one expert, their other choices spread
as evenly as the candidates allow (one expert takes 1/k of the pairs: only replicas split it).
:func:`repeated_token_workload` turns tokens into a tick-clocked replay: two requests a tick,
pinned to alternate ranks, so every run of it takes the same steps.

**The benchmark** (:func:`main`): a random Mixtral built by transformers (big enough that the
experts' compute shows on the clock), two expert-parallel DP ranks, workload A (everything on
rank 0's experts) with EPLB off, then with EPLB on (no redundant slot; the window the last half
of each interval, so each window follows unrecorded warm-up ticks) and the DP trace on. From the
EPLB run's trace: each rank's expert compute (the ``eplb_expert_us`` column, wall clock)
summed over the first window (the contiguous placement) and over the next (after the
rebalance), max and mean over the ranks, with each window's balancedness and step count
beside it; the rebalance's plan and move milliseconds and the ticks it spans (from the
``eplb_window`` event); every run's wall time and greedy tokens (equal with EPLB on and off).
Step counts reproduce (tick-clocked); the milliseconds move with the machine's load: run it on
a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

from atom.config import EngineConfig
from atom.dp.sim.workload import TraceRequest

PROMPT_LEN, OUTPUT_LEN = 32, 2


def router_topk(model) -> dict[int, list[set[int]]]:
    """Each token id's top-k experts in every MoE layer, for a prompt repeating it (module
    docstring). ``model``: a transformers MoE model whose forward takes
    ``output_router_logits`` (Mixtral, Qwen3-MoE)."""
    import torch

    top_k = model.config.num_experts_per_tok
    tokens = torch.arange(3, model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, None].repeat(1, 8),
                       output_router_logits=True).router_logits
    tops = [layer.view(len(tokens), 8, -1)[:, -1].topk(top_k).indices for layer in logits]
    return {int(t): [set(top[i].tolist()) for top in tops] for i, t in enumerate(tokens)}


def tokens_within(topk: dict[int, list[set[int]]], experts: set[int]) -> list[int]:
    """The tokens whose choices lie in ``experts`` in every layer."""
    return [t for t, layers in topk.items() if all(s <= experts for s in layers)]


def hot_expert_tokens(topk: dict[int, list[set[int]]], hot: int, num: int) -> list[int]:
    """``num`` tokens (repeats allowed) that choose expert ``hot`` in every layer, picked one
    by one so that the most loaded of their other choices (over the layers) stays as low as
    it can; ties: the smaller token. Raises ValueError when no token always chooses ``hot``."""
    candidates = [t for t, layers in topk.items() if all(hot in s for s in layers)]
    if not candidates:
        raise ValueError(f"no token chooses expert {hot} in every layer")
    num_layers = len(next(iter(topk.values())))
    counts = np.zeros((num_layers, 1 + max(e for ls in topk.values() for s in ls for e in s)))

    def others(token: int):
        return [(layer, e) for layer, s in enumerate(topk[token]) for e in s - {hot}]

    chosen = []
    for _ in range(num):
        def peak(token: int):
            added = counts.copy()
            for layer, e in others(token):
                added[layer, e] += 1
            return added.max(), token
        token = min(candidates, key=peak)
        for layer, e in others(token):
            counts[layer, e] += 1
        chosen.append(token)
    return chosen


def repeated_token_workload(name: str, tokens: list[int], *, num_requests: int,
                            prompt_len: int = PROMPT_LEN,
                            output_len: int = OUTPUT_LEN) -> list[TraceRequest]:
    """A tick-clocked replay: request ``i`` repeats ``tokens[i % len(tokens)]``, arrives at
    tick ``i // 2`` and is pinned to rank ``i % 2``."""
    return [TraceRequest(f"{name}{i}", (tokens[i % len(tokens)],) * prompt_len,
                         output_len=output_len, arrival_tick=i // 2, dp_rank=i % 2)
            for i in range(num_requests)]


def eplb_windows(folder) -> list[dict]:
    """The ``eplb_window`` events of a DP trace folder (rank 0's file)."""
    from atom.dp.dp_trace import read_trace

    return [e for e in read_trace(folder)[0].events if e["event"] == "eplb_window"]


def window_compute(folder, *, first_tick: int, last_tick: int) -> dict:
    """Each rank's expert compute (``eplb_expert_us``) summed over ticks ``first_tick ..
    last_tick`` of a trace: per rank (ms), max and mean over the ranks, and the steps."""
    from atom.dp.dp_trace import read_trace

    per_rank = [sum(r["eplb_expert_us"] or 0 for r in t.rows
                    if first_tick <= r["tick"] <= last_tick) / 1e3 for t in read_trace(folder)]
    steps = sum(first_tick <= r["tick"] <= last_tick for r in read_trace(folder)[0].rows)
    mean = statistics.fmean(per_rank)
    return {"per_rank_ms": per_rank, "max_ms": max(per_rank), "mean_ms": mean,
            "max_over_mean": max(per_rank) / mean if mean else 1.0, "num_steps": steps}


def rebalance_ticks(folder, tick: int) -> int:
    """The ticks a rebalance closed at ``tick`` held the group: from ``tick`` to the next tick
    any rank ran a step in (rank 0's trace rows; every rank steps at the same ticks), so 1 when
    the next tick's forward already runs the new placement."""
    from atom.dp.dp_trace import read_trace

    later = [r["tick"] for r in read_trace(folder)[0].rows if r["tick"] > tick]
    if not later:
        raise ValueError(f"the trace has no step after the rebalance at tick {tick}")
    return min(later) - tick


def build_mixtral(folder, *, hidden_size: int, intermediate_size: int, num_layers: int):
    """A random top-2-of-8 Mixtral (fp32, a large init scale: peaked router scores), saved to
    ``folder``; returns the transformers model."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=512, hidden_size=hidden_size,
                           intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=512,
                           initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1,
                           eos_token_id=2)
    model = MixtralForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def run_workload(config: EngineConfig, workload: list[TraceRequest]) -> dict:
    """``workload`` on a fresh engine of ``config``: tokens by request, wall seconds."""
    from atom.dp.sim.replay import build_dp_engine, drive

    engine = build_dp_engine(config)
    try:
        finished, _, elapsed_s = drive(engine, workload, tick_clocked=True)
    finally:
        engine.shutdown()
    return {"tokens": {i: o.outputs[0].token_ids for i, o in finished.items()},
            "elapsed_s": elapsed_s}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--intermediate-size", type=int, default=1024, help="per expert")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=96, help="two arrive a tick")
    p.add_argument("--window", type=int, default=12,
                   help="eplb_window_size (ticks); the interval is twice it, so each window "
                        "follows as many unrecorded (warm-up) ticks")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--output-json", default="results/bench_eplb.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="atom-bench-eplb-") as tmp:
        folder = pathlib.Path(tmp) / "mixtral"
        model = build_mixtral(folder, hidden_size=args.hidden_size,
                              intermediate_size=args.intermediate_size,
                              num_layers=args.num_layers)
        workload = repeated_token_workload(
            "a", tokens_within(router_topk(model), {0, 1, 2, 3}), num_requests=args.num_requests)
        del model
        base = EngineConfig(model=str(folder), data_parallel_size=2, enable_expert_parallel=True,
                            dtype="float32", num_threads=args.num_threads, num_kv_blocks=128,
                            max_model_len=256, enable_prefix_caching=False,
                            skip_tokenizer_init=True, prefill_policy="none")
        trace = pathlib.Path(tmp) / "trace"
        start = time.monotonic()
        off = run_workload(base, workload)
        on = run_workload(dataclasses.replace(
            base, enable_eplb=True, eplb_window_size=args.window,
            eplb_step_interval=2 * args.window, eplb_min_balancedness=0.95,
            dp_trace=str(trace)), workload)
        windows = eplb_windows(trace)
        if len(windows) < 2 or not windows[0]["rebalanced"]:
            print(f"the run closed {len(windows)} window(s) and the first did not rebalance: "
                  f"lengthen the workload (--num-requests) or shorten --window", file=sys.stderr)
            return 1
        first, second = windows[0], windows[1]
        before, after = (window_compute(trace, first_tick=w["tick"] - args.window + 1,
                                        last_tick=w["tick"]) for w in (first, second))
        result = {
            "args": vars(args), "wall_s": time.monotonic() - start,
            "tokens_equal": on["tokens"] == off["tokens"],
            "elapsed_s": {"eplb_off": off["elapsed_s"], "eplb_on": on["elapsed_s"]},
            "before": {**before, "balancedness": first["balancedness"]},
            "after": {**after, "balancedness": second["balancedness"]},
            "rebalance": {"tick": first["tick"], "plan_ms": first["plan_ms"],
                          "move_ms": first["move_ms"],
                          "ticks_spanned": rebalance_ticks(trace, first["tick"])}}
    print_table(result)
    out = pathlib.Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


def print_table(result: dict) -> None:
    print("| window | steps | balancedness | expert compute max / mean over ranks (ms) | "
          "max / mean | per rank (ms) |")
    print("|---|---|---|---|---|---|")
    for name in ("before", "after"):
        w = result[name]
        print(f"| {name} the rebalance | {w['num_steps']} | {w['balancedness']:.3f} | "
              f"{w['max_ms']:.1f} / {w['mean_ms']:.1f} | {w['max_over_mean']:.2f} | "
              + ", ".join(f"{v:.1f}" for v in w["per_rank_ms"]) + " |")
    r = result["rebalance"]
    print(f"rebalance at tick {r['tick']}: plan {r['plan_ms']:.1f} ms (with the window's "
          f"all-reduce), move {r['move_ms']:.1f} ms, the next step {r['ticks_spanned']} tick(s) "
          f"later; "
          f"workload wall time EPLB off {result['elapsed_s']['eplb_off']:.2f} s, on "
          f"{result['elapsed_s']['eplb_on']:.2f} s; greedy tokens equal: "
          f"{result['tokens_equal']}")
