"""How far bfloat16 drifts from float32: sampled-token logprobs on W1's first prompts (issue 7).

1. float32 engine: greedy, ``--max-tokens`` output tokens per prompt (EOS ignored), with the
   sampled tokens' logprobs (``logprobs=0``).
2. bfloat16 engine, teacher-forced on the *same* tokens: each prompt + its float32 output as the
   prompt, ``prompt_logprobs=1``, so bf16 scores exactly the tokens fp32 sampled (free-running
   bf16 would diverge after its first different token and compare unlike positions).

Reports the mean absolute difference of those logprobs over every output position, its p99
and max, and how often bf16's top-1 token differs from fp32's greedy token.

    .venv/bin/python scripts/bench_bf16_logprobs.py [--num-prompts 16] [--max-tokens 128]

Writes ``results/bench_bf16_logprobs.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from bench_common import DEFAULT_DATASET, write_json_report



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", type=pathlib.Path, default=DEFAULT_DATASET)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--output-json", type=pathlib.Path,
                        default=pathlib.Path("results/bench_bf16_logprobs.json"))
    args = parser.parse_args(argv)

    from atom import LLM, SamplingParams

    prompts = [list(x["ids"]) for x in json.loads(args.dataset.read_text())[: args.num_prompts]]
    llm = LLM(dtype="float32")
    fp32 = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                       ignore_eos=True, logprobs=0))
    llm.shutdown()
    outputs = [list(o.outputs[0].token_ids) for o in fp32]
    fp32_lp = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, toks)] for o, toks in zip(fp32, outputs)]

    llm = LLM(dtype="bfloat16")
    bf16 = llm.generate([{"prompt_token_ids": p + o} for p, o in zip(prompts, outputs)],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    llm.shutdown()
    diffs, flips = [], 0
    for p, toks, ref, out in zip(prompts, outputs, fp32_lp, bf16):
        entries = out.prompt_logprobs[len(p):]  # the positions of fp32's output tokens
        for token, ref_lp, entry in zip(toks, ref, entries):
            diffs.append(abs(entry[token] - ref_lp))
            top = max(entry.items(), key=lambda kv: kv[1])[0]
            flips += top != token
    d = np.array(diffs)
    report = {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "num_positions": len(d),
              "mean_abs_diff": float(d.mean()), "p99_abs_diff": float(np.percentile(d, 99)),
              "max_abs_diff": float(d.max()), "top1_differs_fraction": flips / len(d)}
    print(f"{len(prompts)} W1 prompts x {args.max_tokens} tokens: bf16 vs fp32 sampled-token "
          f"logprob |diff| mean {report['mean_abs_diff']:.4f}, p99 {report['p99_abs_diff']:.4f}, "
          f"max {report['max_abs_diff']:.4f}; bf16 top-1 differs from fp32's greedy token at "
          f"{100 * report['top1_differs_fraction']:.2f} % of positions")
    write_json_report(args.output_json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
