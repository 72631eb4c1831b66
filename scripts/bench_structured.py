"""Structured outputs' cost: throughput of a json_schema request mix against unconstrained, and
grammar compile times.

Throughput: W1's prompts (``atom/data/w1_prompts.json``) on one engine, greedy, in three mixes
run in the same invocation (the unconstrained one is the baseline; ratios are against it):
``free`` (no constraint, ``max_tokens`` each, ``ignore_eos``), ``half`` (every other request
constrained to a JSON schema) and ``all``. A constrained request ends when its JSON is complete,
so mixes are compared per output token: wall time, and this process's CPU time (every thread),
which a busy shared machine disturbs far less than wall time. The engine core runs in this
process (no front end). The mixes run ``--repeats`` times, interleaved (free, half, all, free,
...), and the run with the median CPU time per token of each is reported. A warm-up
request compiles the schema and wraps the tokenizer first, so the mixes measure the per-step
cost (a bitmask per constrained sequence, the mask applied before sampling, the matcher
advanced), not the one-off compile.

Compile times (``atom.core.structured_output``, in this process): wrapping the tokenizer
(``llguidance.LLTokenizer``, once per engine core), then per spec the front end's check
(``grammar_error``) and the matcher's construction, and one bitmask fill and one mask applied
to a logits row.

    .venv/bin/python scripts/bench_structured.py --output-json results/bench_structured.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import DEFAULT_DATASET, cpu_description, write_json_report  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "genre": {"enum": ["fiction", "science", "history", "poetry"]},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 10},
                     "maxItems": 3},
        "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                    "born": {"type": "integer", "minimum": 1000,
                                                             "maximum": 2025}},
                   "required": ["name"]},
    },
    "required": ["title", "rating", "genre", "keywords", "author"],
}
SPECS = {
    "json_schema": {"json": SCHEMA},
    "json_object": {"json_object": True},
    "regex": {"regex": r"[a-z]{1,12}@[a-z]{1,8}\.(com|org)"},
    "choice": {"choice": ["yes", "no", "maybe"]},
    "grammar": {"grammar": 'root ::= "(" expr ")"\nexpr ::= [0-9]+ | [0-9]+ "+" expr'},
}


def compile_times(model: str | None, vocab_size: int, eos: tuple[int, ...]) -> dict:
    """Seconds to wrap the tokenizer; per spec, ms to check, to build a matcher, to fill one
    bitmask and to apply it to one float32 logits row."""
    import llguidance
    import llguidance.numpy as llg_np
    import torch

    from atom.core.structured_output import grammar_error, grammar_of
    from atom.engine.core import tokenizer_json
    from atom.sampling_params import StructuredOutputsParams
    from atom.worker.sampler import apply_token_bitmask

    start = time.perf_counter()
    text = tokenizer_json(model)
    tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos))
    out = {"tokenizer_wrap_s": time.perf_counter() - start, "specs": {}}
    logits = torch.randn(vocab_size)
    for name, fields in SPECS.items():
        spec = StructuredOutputsParams(**fields)
        t0 = time.perf_counter()
        assert grammar_error(spec) is None
        t1 = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar_of(spec), log_level=0)
        t2 = time.perf_counter()
        mask = llg_np.allocate_token_bitmask(1, vocab_size)
        llg_np.fill_next_token_bitmask(matcher, mask, 0)
        t3 = time.perf_counter()
        apply_token_bitmask(logits.clone(), mask[0])
        t4 = time.perf_counter()
        out["specs"][name] = {"check_ms": (t1 - t0) * 1e3, "compile_ms": (t2 - t1) * 1e3,
                              "first_mask_ms": (t3 - t2) * 1e3, "apply_ms": (t4 - t3) * 1e3}
    return out


def run_mix(core, prompts: list[list[int]], *, every: int | None, max_tokens: int) -> dict:
    """Run ``prompts`` to the end on the in-process ``core``; with ``every``, each
    ``every``-th request is JSON-constrained. Wall seconds and this process's CPU seconds
    (every thread: the forward's, the grammar thread's) per output token."""
    from atom.messages import EngineCoreRequest
    from atom.sampling_params import SamplingParams, StructuredOutputsParams

    constrained = [bool(every) and i % every == 0 for i in range(len(prompts))]
    for i, (prompt, c) in enumerate(zip(prompts, constrained)):
        params = (SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=
                                 StructuredOutputsParams(**SPECS["json_schema"])) if c else
                  SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        core.add_request(EngineCoreRequest(f"{every}-{i}-{time.monotonic_ns()}", prompt, params,
                                           time.monotonic()))
    tokens: dict[str, list[int]] = {}
    num_steps, wall, cpu = 0, time.perf_counter(), time.process_time()
    while core.has_work():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        num_steps += 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    num_tokens = sum(len(t) for t in tokens.values())
    return {"num_requests": len(prompts), "num_constrained": sum(constrained),
            "num_ended_by_grammar": sum(1 for rid, t in tokens.items()
                                        if len(t) < max_tokens),
            "output_tokens": num_tokens, "num_steps": num_steps, "elapsed_s": wall,
            "output_tokens_per_s": num_tokens / wall, "cpu_ms_per_token": 1e3 * cpu / num_tokens,
            "step_ms": 1e3 * wall / num_steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    from atom.config import EngineConfig
    from atom.engine.core_proc import build_engine_core

    prompts = [p["ids"] for p in json.loads(DEFAULT_DATASET.read_text())][: args.num_prompts]
    results: dict = {"cpu": cpu_description()}
    core = build_engine_core(EngineConfig(dtype="float32", num_kv_blocks=1200,
                                          num_threads=args.num_threads))
    try:
        runtime = core.runtime
        results["compile"] = compile_times(None, runtime.vocab_size, runtime.eos_token_ids)
        run_mix(core, prompts[:1], every=None, max_tokens=8)  # kernels warm
        start = time.perf_counter()  # the core's first constrained request wraps the tokenizer
        run_mix(core, prompts[:1], every=1, max_tokens=8)
        results["first_constrained_request_s"] = time.perf_counter() - start
        start = time.perf_counter()
        run_mix(core, prompts[:1], every=1, max_tokens=8)
        results["second_constrained_request_s"] = time.perf_counter() - start
        runs: dict[str, list[dict]] = {"free": [], "half": [], "all": []}
        for _ in range(args.repeats):
            for name, every in (("free", None), ("half", 2), ("all", 1)):
                runs[name].append(run_mix(core, prompts, every=every, max_tokens=args.max_tokens))
    finally:
        core.close()
    results["runs"] = runs
    results["mixes"] = {name: sorted(rows, key=lambda r: r["cpu_ms_per_token"])[len(rows) // 2]
                        for name, rows in runs.items()}
    print(f"CPU: {results['cpu']}")
    print(f"tokenizer load + wrap (once per engine core): "
          f"{results['compile']['tokenizer_wrap_s']:.2f} s; an 8-token constrained request: "
          f"{results['first_constrained_request_s']:.2f} s first, "
          f"{results['second_constrained_request_s']:.2f} s next")
    print(f"{'spec':<12} {'check ms':>9} {'compile ms':>11} {'1st mask ms':>12} {'apply ms':>9}")
    for name, row in results["compile"]["specs"].items():
        print(f"{name:<12} {row['check_ms']:>9.2f} {row['compile_ms']:>11.2f} "
              f"{row['first_mask_ms']:>12.2f} {row['apply_ms']:>9.2f}")
    base = results["mixes"]["free"]["cpu_ms_per_token"]
    print(f"{'mix':<6} {'constrained':>11} {'ended':>6} {'out tok':>8} {'steps':>6} "
          f"{'step ms':>8} {'out tok/s':>10} {'CPU ms/tok':>11} {'ratio':>6}")
    for name, row in results["mixes"].items():
        print(f"{name:<6} {row['num_constrained']:>11} {row['num_ended_by_grammar']:>6} "
              f"{row['output_tokens']:>8} {row['num_steps']:>6} {row['step_ms']:>8.1f} "
              f"{row['output_tokens_per_s']:>10.1f} {row['cpu_ms_per_token']:>11.2f} "
              f"{row['cpu_ms_per_token'] / base:>6.2f}")
    if args.output_json is not None:
        write_json_report(args.output_json, {"args": {k: str(v) for k, v in vars(args).items()},
                                             **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
