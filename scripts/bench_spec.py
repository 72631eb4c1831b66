"""Speculative decoding benchmark: decode tokens/s and TPOT with spec off / n-gram / draft.

Workloads (greedy, the embedded model, token ids through the chat template):

- ``copy``: "repeat and edit this text" prompts (a paragraph to copy back with one word
  changed): long n-gram matches, the case prompt lookup exists for; as a batch, and one request
  at a time (``copy_single``: where a verify forward costs about what a decode step does);
- ``w1``: the standard W1 prompts (``atom/data/w1_prompts.json``), ``ignore_eos``.

Every configuration runs in the same invocation on a fresh engine (spec off is the baseline;
ratios are against it), with a warm-up first. Greedy outputs of every configuration are
compared with spec off's token for token (the count of identical requests is reported: a
differing one is a rounding tie, or a bug). Prints a table and writes JSON.

    .venv/bin/python scripts/bench_spec.py --output-json results/bench_spec.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import DEFAULT_DATASET, cpu_description, write_json_report  # noqa: E402

PARAGRAPHS = [
    "The library opens at nine in the morning and closes at six in the evening. Members may "
    "borrow up to five books at a time, and each loan lasts three weeks. Late returns cost ten "
    "cents per day, and lost books must be replaced or paid for at their full price.",
    "To make the soup, chop two onions, three carrots and a stick of celery. Fry them gently in "
    "olive oil for ten minutes, add a litre of stock and a tin of tomatoes, then simmer for half "
    "an hour. Season with salt, pepper and a little fresh thyme before serving.",
    "Our team meets every Monday at ten to review the past week and plan the next one. Each "
    "person gives a short update on their work, names anything that blocks them, and says what "
    "they will finish by Friday. Notes are shared in the team channel after the meeting.",
    "The train to the coast leaves from platform four every hour on the hour. The journey takes "
    "two hours and ten minutes, with stops at the old market town and the river crossing. "
    "Tickets bought online are cheaper than those bought at the station on the day.",
]
EDITS = [("nine", "eight"), ("onions", "leeks"), ("Monday", "Tuesday"), ("four", "six")]


def copy_prompts(tokenizer, num: int) -> list[list[int]]:
    prompts = []
    for i in range(num):
        text, (old, new) = PARAGRAPHS[i % len(PARAGRAPHS)], EDITS[i % len(EDITS)]
        message = (f"Repeat the following text exactly, but replace the word '{old}' with "
                   f"'{new}'. Output only the edited text.\n\n{text}")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                            add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def run_workload(llm, prompts: list[list[int]], params, *, one_at_a_time: bool) -> dict:
    """Time the workload; returns throughput, TPOT, the outputs and the spec stats' deltas."""
    before = llm.get_stats()
    start = time.perf_counter()
    if one_at_a_time:
        outputs = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in prompts]
    else:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed_s = time.perf_counter() - start
    after = llm.get_stats()
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    tpots = [o.metrics.tpot_s for o in outputs if o.metrics.tpot_s is not None]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in
             ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_emitted_tokens",
              "spec_num_verifies")}
    return {
        "num_requests": len(outputs), "num_output_tokens": num_output, "elapsed_s": elapsed_s,
        "output_tokens_per_s": num_output / elapsed_s,
        "tpot_ms_p50": float(np.median(tpots) * 1000) if tpots else None,
        "tpot_ms_mean": float(np.mean(tpots) * 1000) if tpots else None,
        "acceptance_rate": (delta["spec_num_accepted_tokens"] / delta["spec_num_draft_tokens"]
                            if delta["spec_num_draft_tokens"] else None),
        "tokens_per_verify": (delta["spec_num_emitted_tokens"] / delta["spec_num_verifies"]
                              if delta["spec_num_verifies"] else None),
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="k (default 3)")
    parser.add_argument("--draft-num-layers", type=int, default=24,
                        help="early-exit draft layers of the 30 (default 24)")
    parser.add_argument("--num-copy-prompts", type=int, default=8, help="copy batch size (8)")
    parser.add_argument("--num-single-prompts", type=int, default=2,
                        help="copy prompts run one at a time (2)")
    parser.add_argument("--num-w1-prompts", type=int, default=16, help="W1 prompts (16 of 64)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens (128)")
    parser.add_argument("--methods", default="off,ngram,draft", help="comma-separated")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads")
    parser.add_argument("--output-json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    from atom import LLM, SamplingParams

    copy_params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    w1_params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    w1 = [p["ids"] for p in json.loads(DEFAULT_DATASET.read_text())][: args.num_w1_prompts]
    methods = {
        "off": {},
        "ngram": {"speculative_method": "ngram", "num_speculative_tokens": args.num_speculative_tokens},
        "draft": {"speculative_method": "draft", "num_speculative_tokens": args.num_speculative_tokens,
                  "draft_num_layers": args.draft_num_layers},
    }
    results: dict[str, dict[str, dict]] = {}
    for method in args.methods.split(","):
        with LLM(dtype="float32", num_kv_blocks=1200, num_threads=args.num_threads,
                 **methods[method]) as llm:
            copy = copy_prompts(llm.get_tokenizer(), args.num_copy_prompts)
            llm.generate([{"prompt_token_ids": p} for p in copy[:2]],
                         SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
            results[method] = {
                "copy": run_workload(llm, copy, copy_params, one_at_a_time=False),
                "copy_single": run_workload(llm, copy[: args.num_single_prompts], copy_params,
                                            one_at_a_time=True),
                "w1": run_workload(llm, w1, w1_params, one_at_a_time=False),
            }
        print(f"{method}: done", flush=True)
    base = results.get("off")
    rows = []
    for method, workloads in results.items():
        for name, r in workloads.items():
            same = None if base is None else sum(
                a == b for a, b in zip(r["token_ids"], base[name]["token_ids"]))
            r["num_identical_to_off"] = same
            r["ratio_tokens_per_s_vs_off"] = (None if base is None else
                                              r["output_tokens_per_s"] / base[name]["output_tokens_per_s"])
            rows.append((name, method, r))

    def fmt(v, spec="{:.2f}"):
        return "-" if v is None else spec.format(v)

    print(f"\nCPU: {platform.processor() or platform.machine()}; k={args.num_speculative_tokens}, "
          f"draft layers {args.draft_num_layers}/30, {args.max_tokens} output tokens, fp32")
    print(f"{'workload':<12} {'method':<6} {'tok/s':>7} {'vs off':>7} {'TPOT p50 ms':>11} "
          f"{'accept':>7} {'tok/verify':>10} {'same as off':>11}")
    for name, method, r in sorted(rows, key=lambda row: row[0]):
        print(f"{name:<12} {method:<6} {r['output_tokens_per_s']:>7.1f} "
              f"{fmt(r['ratio_tokens_per_s_vs_off']):>7} {fmt(r['tpot_ms_p50'], '{:.1f}'):>11} "
              f"{fmt(r['acceptance_rate'], '{:.3f}'):>7} {fmt(r['tokens_per_verify']):>10} "
              f"{fmt(r['num_identical_to_off'], '{}'):>5}/{r['num_requests']}")
    if args.output_json is not None:
        for workloads in results.values():
            for r in workloads.values():
                r.pop("token_ids")
        write_json_report(args.output_json, {"args": {k: str(v) for k, v in vars(args).items()},
                                             "cpu": cpu_description(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
