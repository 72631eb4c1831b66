"""How far bfloat16 or ``--quantization gguf`` drifts from float32: sampled-token logprobs on
W1's first prompts (issues 7 and 20).

1. float32 engine: greedy, ``--max-tokens`` output tokens per prompt (EOS ignored), with the
   sampled tokens' logprobs (``logprobs=0``).
2. The other mode, teacher-forced on the *same* tokens, so it scores exactly the tokens fp32
   sampled (free-running, it would diverge after its first different token and compare unlike
   positions):

   - ``--mode bfloat16``: a bfloat16 engine with each prompt + its float32 output as the prompt,
     ``prompt_logprobs=1``;
   - ``--mode gguf``: a prompt's logprobs would come from a prefill, which on a CPU without
     AVX-512 VNNI runs the float GEMMs, not the quantized kernels a decode runs (steps of more
     than 16 rows stay float there); so the quantized model runner is driven directly: each
     prompt prefilled as the engine does (float layers there, the tiled quantized kernel where
     the CPU has AVX-512 VNNI; the LM head on GGUF blocks for the one sampled row), then one
     decode step per float32 output token with all prompts in the batch (at most 16 rows: every
     linear on GGUF blocks, every layer in one compiled call).

Reports the mean absolute difference of those logprobs over every output position, its p99
and max, and how often the mode's top-1 token differs from fp32's greedy token.

    .venv/bin/python scripts/bench_logprob_drift.py --mode gguf [--num-prompts 16] [--max-tokens 128]

Writes ``results/bench_logprob_drift_<mode>.json``.
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
    parser.add_argument("--mode", choices=("bfloat16", "gguf"), default="bfloat16")
    parser.add_argument("--output-json", type=pathlib.Path)
    args = parser.parse_args(argv)
    output_json = args.output_json or pathlib.Path(f"results/bench_logprob_drift_{args.mode}.json")

    from atom import LLM, SamplingParams

    prompts = [list(x["ids"]) for x in json.loads(args.dataset.read_text())[: args.num_prompts]]
    llm = LLM(dtype="float32")
    fp32 = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                       ignore_eos=True, logprobs=0))
    llm.shutdown()
    outputs = [list(o.outputs[0].token_ids) for o in fp32]
    fp32_lp = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, toks)] for o, toks in zip(fp32, outputs)]

    scored = (_bfloat16_teacher_forced if args.mode == "bfloat16" else _gguf_teacher_forced)(
        prompts, outputs)
    diffs, flips = [], 0
    for toks, ref, entries in zip(outputs, fp32_lp, scored):
        for token, ref_lp, entry in zip(toks, ref, entries):
            diffs.append(abs(entry[token] - ref_lp))
            flips += entry["top1"] != token
    d = np.array(diffs)
    report = {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "num_positions": len(d),
              "mean_abs_diff": float(d.mean()), "p99_abs_diff": float(np.percentile(d, 99)),
              "max_abs_diff": float(d.max()), "top1_differs_fraction": flips / len(d)}
    report["mode"] = args.mode
    print(f"{len(prompts)} W1 prompts x {args.max_tokens} tokens: {args.mode} vs fp32 "
          f"sampled-token logprob |diff| mean {report['mean_abs_diff']:.4f}, p99 "
          f"{report['p99_abs_diff']:.4f}, max {report['max_abs_diff']:.4f}; {args.mode} top-1 "
          f"differs from fp32's greedy token at {100 * report['top1_differs_fraction']:.2f} % of "
          f"positions")
    write_json_report(output_json, report)
    return 0


def _bfloat16_teacher_forced(prompts: list[list[int]], outputs: list[list[int]]) -> list[list[dict]]:
    """Per prompt and output position: {token: logprob, "top1": token} from a bfloat16 engine."""
    from atom import LLM, SamplingParams

    llm = LLM(dtype="bfloat16")
    bf16 = llm.generate([{"prompt_token_ids": p + o} for p, o in zip(prompts, outputs)],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    llm.shutdown()
    scored = []
    for p, out in zip(prompts, bf16):
        entries = out.prompt_logprobs[len(p):]  # the positions of fp32's output tokens
        scored.append([{**e, "top1": max(e.items(), key=lambda kv: kv[1])[0]} for e in entries])
    return scored


def _gguf_teacher_forced(prompts: list[list[int]], outputs: list[list[int]]) -> list[list[dict]]:
    """The same from the quantized model runner: prefill each prompt, then decode steps that
    feed fp32's tokens (all prompts in one batch)."""
    import torch

    from atom.worker.model_loader import load_gguf_blocks, load_model_weights
    from atom.worker.model_runner import ModelRunner
    from atom.sampling_params import SamplingParams
    from atom.core.sequence import Sequence

    block_size = 16
    longest = max(len(p) + len(o) for p, o in zip(prompts, outputs))
    per_seq = -(-longest // block_size)
    arch, weights = load_model_weights(None, torch.float32)
    runner = ModelRunner(arch, weights, dtype=torch.float32, num_kv_blocks=per_seq * len(prompts),
                         block_size=block_size, max_model_len=longest,
                         quantized_weights=load_gguf_blocks(None))
    del weights

    def scores(logits: torch.Tensor, tokens: list[int]) -> list[dict]:
        lp = torch.log_softmax(logits, dim=-1)
        return [{t: float(lp[i, t]), "top1": int(lp[i].argmax())} for i, t in enumerate(tokens)]

    seqs, scored = [], []
    for i, p in enumerate(prompts):
        seq = Sequence(f"p{i}", list(p), SamplingParams(max_tokens=len(outputs[i])))
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        out = runner.execute_model([(seq, len(p))])
        seq.num_computed_tokens = len(p)
        scored.append(scores(out.logits, [outputs[i][0]]))
        seqs.append(seq)
    for j in range(1, max(len(o) for o in outputs)):
        step = [(i, seq, o) for i, (seq, o) in enumerate(zip(seqs, outputs)) if j < len(o)]
        for _, seq, o in step:
            seq.token_ids.append(o[j - 1])
        out = runner.execute_model([(seq, 1) for _, seq, _ in step])
        for (i, seq, o), row in zip(step, scores(out.logits, [o[j] for _, _, o in step])):
            scored[i].append(row)
            seq.num_computed_tokens += 1
    return scored


if __name__ == "__main__":
    raise SystemExit(main())
