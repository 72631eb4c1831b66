"""Structured outputs' cost: throughput of a json_schema request mix against unconstrained, and
grammar compile times.

Throughput: W1's prompts (``atom/data/w1_prompts.json``) on one engine, greedy, in three mixes
run in the same invocation (the unconstrained one is the baseline; ratios are against it):
``free`` (no constraint, ``max_tokens`` each, ``ignore_eos``), ``half`` (every other request
constrained to a JSON schema) and ``all``. A constrained request ends when its JSON is complete,
so mixes are compared by output tokens per second and TPOT, not by elapsed time. The mixes run
``--repeats`` times, interleaved (free, half, all, free, ...), and the median of each is
reported: on a shared machine one run's noise is larger than the effect. A warm-up
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
        "title": {"type": "string", "maxLength": 40},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "genre": {"enum": ["fiction", "science", "history", "poetry"]},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 16},
                     "maxItems": 4},
        "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
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


def run_mix(llm, prompts: list[list[int]], *, every: int | None, max_tokens: int) -> dict:
    """Generate ``prompts``; with ``every``, each ``every``-th request is JSON-constrained."""
    from atom import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=SPECS[
        "json_schema"]) if every and i % every == 0 else
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(len(prompts))]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [o.metrics.tpot_s for o in outs if o.metrics is not None and o.metrics.tpot_s]
    valid = sum(1 for o, p in zip(outs, params) if p.structured_outputs is not None
                and _is_json(o.outputs[0].text))
    return {"num_requests": len(prompts), "num_constrained": sum(
        p.structured_outputs is not None for p in params), "num_valid_json": valid,
            "output_tokens": num_tokens, "elapsed_s": elapsed,
            "output_tokens_per_s": num_tokens / elapsed,
            "tpot_ms_mean": 1e3 * sum(tpots) / len(tpots) if tpots else None}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    from atom import LLM, SamplingParams

    prompts = [p["ids"] for p in json.loads(DEFAULT_DATASET.read_text())][: args.num_prompts]
    results: dict = {"cpu": cpu_description()}
    with LLM(dtype="float32", num_kv_blocks=1200, num_threads=args.num_threads) as llm:
        runtime = llm.engine.runtime
        results["compile"] = compile_times(None, runtime.vocab_size, runtime.eos_token_ids)
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=8))  # kernels
        start = time.perf_counter()  # the core's first constrained request wraps the tokenizer
        llm.generate([{"prompt_token_ids": prompts[0]}],
                     SamplingParams(temperature=0, max_tokens=8,
                                    structured_outputs=SPECS["json_schema"]))
        results["first_constrained_request_s"] = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompts[0]}],
                     SamplingParams(temperature=0, max_tokens=8,
                                    structured_outputs=SPECS["json_schema"]))
        results["second_constrained_request_s"] = time.perf_counter() - start
        runs: dict[str, list[dict]] = {"free": [], "half": [], "all": []}
        for _ in range(args.repeats):
            for name, every in (("free", None), ("half", 2), ("all", 1)):
                runs[name].append(run_mix(llm, prompts, every=every, max_tokens=args.max_tokens))
    results["runs"] = runs
    results["mixes"] = {name: sorted(rows, key=lambda r: r["output_tokens_per_s"])[len(rows) // 2]
                        for name, rows in runs.items()}
    base = results["mixes"]["free"]["output_tokens_per_s"]
    print(f"CPU: {results['cpu']}")
    print(f"tokenizer load + wrap (once per engine core): "
          f"{results['compile']['tokenizer_wrap_s']:.2f} s; an 8-token constrained request: "
          f"{results['first_constrained_request_s']:.2f} s first, "
          f"{results['second_constrained_request_s']:.2f} s next")
    print(f"{'spec':<12} {'check ms':>9} {'compile ms':>11} {'1st mask ms':>12} {'apply ms':>9}")
    for name, row in results["compile"]["specs"].items():
        print(f"{name:<12} {row['check_ms']:>9.2f} {row['compile_ms']:>11.2f} "
              f"{row['first_mask_ms']:>12.2f} {row['apply_ms']:>9.2f}")
    print(f"{'mix':<6} {'constrained':>11} {'valid json':>10} {'out tok':>8} {'elapsed s':>10} "
          f"{'out tok/s':>10} {'ratio':>6} {'TPOT ms':>8}")
    for name, row in results["mixes"].items():
        tpot = "-" if row["tpot_ms_mean"] is None else f"{row['tpot_ms_mean']:.0f}"
        print(f"{name:<6} {row['num_constrained']:>11} {row['num_valid_json']:>10} "
              f"{row['output_tokens']:>8} {row['elapsed_s']:>10.1f} "
              f"{row['output_tokens_per_s']:>10.1f} {row['output_tokens_per_s'] / base:>6.2f} "
              f"{tpot:>8}")
    if args.output_json is not None:
        write_json_report(args.output_json, {"args": {k: str(v) for k, v in vars(args).items()},
                                             **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
