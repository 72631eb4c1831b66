"""MLA decode: attention in the latent space (``kv_b_proj`` absorbed) against the latent expanded
to per-head K/V, on a mid-size random DeepSeek-V3-shaped model (issue 36).

The model (built by transformers, random, saved to a temporary folder): DeepSeek-V3's attention
geometry (``kv_lora_rank`` 512, rotary 64, ``qk_nope`` 128, ``v_head_dim`` 128, a low-rank
query of 384) with 16 heads, hidden 1024, 4 layers (the first dense, then 16 routed experts of
256 of which 4 per token, and one shared expert), a vocabulary of 4096. One model runner, one
latent cache: every timed step is the same decode step of ``--batch-size`` sequences at each
context length (the step rewrites its own slot, so the context stays put), run alternately with
every layer's ``absorb`` on and off (:class:`atom.layers.mla.MLAttention`). Both paths read the
same latent cache; the expanded one up-projects every context token of every layer each step,
the absorbed one reads the 576 latent values per token in place (the compiled paged decode
kernel when built: :func:`atom.kernels.mla.absorbed_decode_attention`).

    .venv/bin/python scripts/bench_mla.py [--dtype float32] [--contexts 128 1024 4096] \\
        [--batch-size 4] [--reps 5] [--num-threads N]

Prints a table (decode ms per step and per token, expanded / absorbed) and writes
``results/bench_mla_<dtype>.json``.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import torch

from bench_common import cpu_description, write_json_report
from bench_kernels_ab import alternate

BLOCK_SIZE = 16
MODEL = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
             num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
             n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
             topk_group=2, first_k_dense_replace=1, q_lora_rank=384, kv_lora_rank=512,
             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
             max_position_embeddings=8192, tie_word_embeddings=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096],
                   help="context lengths (tokens) of the decoding sequences")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per decode step")
    p.add_argument("--reps", type=int, default=5, help="timed pairs per context")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--output-json", type=pathlib.Path, default=None,
                   help="default: results/bench_mla_<dtype>.json")
    return p.parse_args(argv)


def build_runner(folder: pathlib.Path, dtype: torch.dtype, num_blocks: int, max_model_len: int):
    """The random model saved to ``folder`` and a runner over it with ``num_blocks`` blocks."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from atom.worker.model_loader import load_model_weights
    from atom.worker.model_runner import ModelRunner

    torch.manual_seed(0)
    DeepseekV3ForCausalLM(DeepseekV3Config(**MODEL)).save_pretrained(folder)
    config, weights = load_model_weights(str(folder), dtype)
    return ModelRunner(config, weights, dtype=dtype, num_kv_blocks=num_blocks,
                       block_size=BLOCK_SIZE, max_model_len=max_model_len)


def set_absorb(runner, absorb: bool) -> None:
    for layer in runner.model.layers:
        layer.self_attn.absorb = absorb


def decoding_batch(runner, context: int, batch_size: int, first_block: int) -> list:
    """``batch_size`` sequences prefilled to ``context - 1`` tokens (chunks of 1024) holding one
    more token to decode, blocks from ``first_block`` on."""
    from atom.core.sequence import Sequence
    from atom.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(context)
    seqs, next_block = [], first_block
    for i in range(batch_size):
        ids = torch.randint(3, MODEL["vocab_size"], (context,), generator=gen).tolist()
        seq = Sequence(request_id=f"r{context}-{i}", token_ids=ids,
                       sampling_params=SamplingParams(max_tokens=1))
        num_blocks = -(-context // BLOCK_SIZE)
        seq.block_table.extend(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        while seq.num_computed_tokens < context - 1:
            n = min(1024, context - 1 - seq.num_computed_tokens)
            runner.execute_model([(seq, n)])
            seq.num_computed_tokens += n
        seqs.append(seq)
    return seqs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    blocks_per_context = [args.batch_size * -(-c // BLOCK_SIZE) for c in args.contexts]
    print(cpu_description(), f"| {torch.get_num_threads()} threads | {args.dtype}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runner = build_runner(pathlib.Path(tmp), dtype, sum(blocks_per_context),
                              max(args.contexts) + BLOCK_SIZE)
        first_block = 0
        for context, num_blocks in zip(args.contexts, blocks_per_context):
            set_absorb(runner, True)
            seqs = decoding_batch(runner, context, args.batch_size, first_block)
            first_block += num_blocks
            step = [(seq, 1) for seq in seqs]
            logits = {}

            def run(absorb: bool) -> None:
                set_absorb(runner, absorb)
                logits[absorb] = runner.execute_model(step).logits

            timing = alternate(lambda: run(False), lambda: run(True), args.reps)
            rows.append({"context": context, "batch_size": args.batch_size,
                         "expanded_ms_per_step": timing["base_ms"],
                         "absorbed_ms_per_step": timing["new_ms"],
                         "expanded_ms_per_token": timing["base_ms"] / args.batch_size,
                         "absorbed_ms_per_token": timing["new_ms"] / args.batch_size,
                         "expanded_over_absorbed": timing["ratio"],
                         "max_abs_logit_diff": float((logits[True] - logits[False]).abs().max())})
    print(f"\n| context | expanded ms/token | absorbed ms/token | expanded / absorbed | "
          f"max |logit diff| |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['expanded_ms_per_token']:.2f} | "
              f"{r['absorbed_ms_per_token']:.2f} | {r['expanded_over_absorbed']:.2f}x | "
              f"{r['max_abs_logit_diff']:.1e} |")
    write_json_report(args.output_json or pathlib.Path(f"results/bench_mla_{args.dtype}.json"),
                      {"cpu": cpu_description(), "num_threads": torch.get_num_threads(),
                       "dtype": args.dtype, "model": MODEL, "block_size": BLOCK_SIZE,
                       "reps": args.reps, "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
