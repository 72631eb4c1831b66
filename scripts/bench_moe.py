"""atom vs vLLM's CPU build on a mid-size random MoE model (issues 35 and 36): W1's prompt lengths
x 128 output tokens, and single-request decode, side by side in one run.

``--family`` picks the model (:data:`FAMILIES`), built once with transformers (random weights,
seeded), saved in bfloat16 with SmolLM2's tokenizer files (W1's token ids are SmolLM2's) and
cached under ``~/.cache/atom/hf/`` (``$ATOM_CACHE_DIR``) under a name derived from its config:

- ``qwen3-moe`` (default): hidden 1024, 24 layers, 32 experts of width 128 in every layer, 4 per
  token, 16 query / 4 KV heads of 64, untied embeddings of SmolLM2's 49,152 tokens; about
  0.47 B parameters;
- ``deepseek-v3``: hidden 1024, 12 layers (the first dense), multi-head latent attention with
  DeepSeek-V3's own latent dimensions (``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64,
  ``qk_nope_head_dim`` 128, ``v_head_dim`` 128, ``q_lora_rank`` 512; vLLM's CPU MLA accepts no
  other latent size), 16 heads, 16 routed experts of width 256 (top-4, sigmoid scores with the
  selection bias, 4 groups keeping 2) and one shared expert; ``config.json`` also carries
  ``topk_method`` / ``scoring_func``, which vLLM 0.32 needs and transformers does not write.

Both engines load that folder and run this machine's default dtype (``dtype="auto"``: bfloat16
where the CPU has native bf16 matmuls, else float32), greedy, EOS ignored, prefix caching on.

The systems run through ``scripts/bench_compare.py``'s worker, one after the other in their own
subprocesses (vLLM with ``--vllm-python``, started as /work/shared/bench/README.md says:
``VLLM_CPU_OMP_THREADS_BIND=0-(threads-1) VLLM_CPU_NUM_OF_RESERVED_CPU=0``, its ``LLM`` under
``__main__``), ``--rounds`` times in alternating order; the table shows medians and the JSON
every run. Metrics: W1 output tokens/s (64 prompts x 128 tokens) and single-request decode
ms/token (one 140-token prompt: (time for 128 tokens - time for 1) / 127).

    .venv/bin/python scripts/bench_moe.py --vllm-python "$VLLM_VENV"/bin/python
    .venv/bin/python scripts/bench_moe.py --family deepseek-v3 --vllm-python "$VLLM_VENV"/bin/python

ends with ``W1 output tok/s, atom / vLLM: X.XX`` and writes ``results/bench_moe_<family>.json``.
``--num-prompts 4 --max-tokens 8`` is a quick end-to-end check (not a measurement).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys

# bench_compare first: it records the launch environment before anything imports atom
from bench_compare import build_spec, format_report, median_result, run_rounds
from bench_common import DEFAULT_DATASET, cpu_description, write_json_report

#: the benchmark models: family -> (transformers config / model class names, config keys, keys
#: written into config.json after saving, folder name prefix)
FAMILIES = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=49152, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=128,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), {}, "qwen3-moe-bench"),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=49152, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256,
        num_hidden_layers=12, first_k_dense_replace=1, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=512, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, max_position_embeddings=8192, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
        {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}, "deepseek-v3-bench"),
}


def model_folder(family: str) -> pathlib.Path:
    """The benchmark model's Hugging Face folder, built on first use (a minute or two) and cached
    under a name derived from its config."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from atom.worker.embedded_model import cache_dir, ensure_embedded_gguf

    config_name, model_name, config, extra, prefix = FAMILIES[family]
    key = hashlib.sha256(json.dumps({**config, **extra}, sort_keys=True).encode()).hexdigest()[:12]
    folder = cache_dir() / "hf" / f"{prefix}-{key}"
    if (folder / "config.json").is_file():
        return folder
    print(f"building the benchmark model into {folder} ...", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    model_class = getattr(transformers, model_name)
    model = model_class(getattr(transformers, config_name)(**config)).to(torch.bfloat16).eval()
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(tmp))
    if extra:
        saved = json.loads((tmp / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps({**saved, **extra}, indent=2))
    gguf = ensure_embedded_gguf()  # SmolLM2's tokenizer: W1's ids are its ids
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
    tmp.rename(folder)
    return folder


def ratios(results: dict[str, dict]) -> dict[str, float]:
    """atom / vLLM: output tok/s of W1, and decode speed (vLLM's ms/token over atom's); > 1
    means atom is faster."""
    if not {"atom", "vllm"} <= set(results):
        return {}
    atom, vllm = results["atom"], results["vllm"]
    return {"W1 output tok/s, atom / vLLM": (atom["workloads"]["w1"]["output_tokens_per_s"]
                                             / vllm["workloads"]["w1"]["output_tokens_per_s"]),
            "single decode speed, atom / vLLM (vLLM ms/token / atom ms/token)": (
                vllm["single"]["decode_ms_per_token"] / atom["single"]["decode_ms_per_token"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3-moe",
                        help="the benchmark model (see the module docstring)")
    parser.add_argument("--dataset", type=pathlib.Path, default=DEFAULT_DATASET)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128, help="W1 output tokens (128)")
    parser.add_argument("--num-threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=2,
                        help="time each workload this many times in a row, keep the fastest")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each system this many times, alternating; medians in the table")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed")
    parser.add_argument("--skip-atom", action="store_true")
    parser.add_argument("--output-json", type=pathlib.Path,
                        help="default results/bench_moe_<family>.json")
    args = parser.parse_args(argv)
    output_json = args.output_json or pathlib.Path(f"results/bench_moe_{args.family}.json")

    from atom.config import EngineConfig

    dtype = EngineConfig().resolved_dtype()  # dtype="auto" on this machine
    folder = model_folder(args.family)
    model = FAMILIES[args.family][2]
    spec = build_spec(argparse.Namespace(dataset=args.dataset, num_prompts=args.num_prompts,
                                         max_tokens=args.max_tokens, dtype=dtype,
                                         num_threads=args.num_threads, repeats=args.repeats))
    del spec["workloads"]["w1_var"]  # W1 only: prompt lengths x max_tokens
    spec.update(model=str(folder), hf_folder=str(folder))
    systems = ([] if args.skip_atom else [("atom", sys.executable)]) + (
        [("vllm", args.vllm_python)] if args.vllm_python else [])
    if not systems:
        parser.error("nothing to run: drop --skip-atom or pass --vllm-python")
    runs = run_rounds(systems, spec, rounds=args.rounds, num_threads=args.num_threads)
    results = [median_result(runs[name]) for name, _ in systems]
    by_name = {r["system"]: r for r in results}
    found = ratios(by_name)
    print(cpu_description())
    print(f"random {args.family} ({folder.name}: hidden {model['hidden_size']}, "
          f"{model['num_hidden_layers']} layers, "
          f"{model.get('num_experts') or model['n_routed_experts']} experts top-"
          f"{model['num_experts_per_tok']}), {len(spec['workloads']['w1']['prompts'])} W1 prompts "
          f"x {args.max_tokens} tokens, {dtype}, {args.num_threads} threads, greedy, ignore_eos; "
          f"each workload the fastest of {args.repeats} run(s), {args.rounds} round(s)"
          f"{', medians' if args.rounds > 1 else ''}")
    print("\n".join(format_report(results)))
    for label, value in found.items():
        per_round = ""
        if args.rounds > 1:
            values = [ratios({n: runs[n][i] for n in runs})[label] for i in range(args.rounds)]
            per_round = " (per round: " + ", ".join(f"{v:.2f}" for v in values) + ")"
        print(f"{label}: {value:.2f}{per_round}")
    write_json_report(output_json, {
        "cpu": cpu_description(), "dtype": dtype, "num_threads": args.num_threads,
        "family": args.family, "model": model, "model_folder": str(folder), "rounds": args.rounds,
        "repeats": args.repeats, "results": results, "runs": runs, "ratios": found})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
