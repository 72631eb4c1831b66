"""MTP speculative decoding (``--speculative-method mtp``, issue 51): acceptance and decode
speed-up on a small DeepSeek-V3-shaped model whose MTP layer is *trained* here.

Random MTP weights accept almost no draft, so the script makes one that predicts something:

1. **model** — a DeepSeek-V3 built by transformers (random weights, seeded, fp32, no hub
   download: :data:`MODEL`, hidden 512, 16 layers of which the first dense, MLA, 8 routed experts
   top-2 + one shared, vocabulary 1024), its residual branches' output projections scaled by
   ``--branch-scale`` (0.001). A plain random model's next token is a hash of its whole context
   (measured: the previous token alone predicts under 10 % of it, and a drafter trained for
   minutes learns nothing that carries to new prompts); scaled by 0.001, about 55-60 % of this
   target's next token follows from the previous token, a stand-in for a trained model's text
   following mostly from its recent tokens. The ``bigram`` line says how much: the share of
   the spec-off output that the training data's most frequent successor of the previous token
   predicts;
2. **self-distillation data** — the target's own greedy continuations (atom, spec off) of
   random *training* prompts (seeded apart from the benchmark's prompts);
3. **training** — the MTP layer (``enorm``, ``hnorm``, ``eh_proj``, one decoder block,
   ``shared_head.norm``; the embedding and head are the target's, frozen) with plain torch
   autograd for ``--train-seconds``: at position ``p`` it reads the target's last hidden state
   ``h_p`` *after the final norm* (what atom feeds it, :mod:`atom.models.deepseek_mtp`) and the
   embedding of ``t_{p+1}``, and is fitted to the target's greedy ``t_{p+2}`` (cross-entropy
   against the argmax of the target's logits at ``p + 1``: greedy verification accepts only
   that); a second pass feeds its own output back as the hidden state (as drafts 2 .. k do),
   with half the weight. An eighth of the sequences (at most 32) is held out: the log's
   draft-1 top-1 agreement on them is the layer's acceptance on unseen text, roughly. The block is transformers'
   ``DeepseekV3DecoderLayer`` (initialised from the target's last layer), written at the
   checkpoint's names ``model.layers.{num_hidden_layers}.*`` with
   ``num_nextn_predict_layers: 1``. The trained folder is cached in ``--work-dir`` (default
   ``~/.cache/atom/bench_mtp/<hash of the settings>``): a rerun skips steps 1-3;
4. **benchmark** — the benchmark prompts (greedy, ``ignore_eos``, run together) on spec off,
   mtp k = 1 and k = 3 (and n-gram k = 3, the free baseline a looping text favours), each its
   own engine, all open at once, run ``--rounds`` times in alternating order (every round the
   same prompts: the acceptance comes from ``--num-prompts`` distinct continuations); on one rank, then on DP = 2 with
   expert parallelism. Reported: acceptance per draft position, mean acceptance length
   (tokens per target forward of a verifying sequence), decode tokens/s and its ratio to spec
   off, and how many outputs equal spec off's token for token.

A random target's greedy text may loop; the table's ``rep4`` column is the share of the
outputs' 4-grams that already occurred earlier in the same output (0: no repetition), so a
speed-up that only comes from loops is visible as such.

    .venv/bin/python scripts/bench_mtp.py --output-json results/bench_mtp.json

``--train-seconds 20 --rounds 1 --max-tokens 32`` is a quick end-to-end check (not a
measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import cpu_description, write_json_report  # noqa: E402

#: the target: DeepSeek-V3's structure (MLA with a low-rank query, sigmoid routing with the
#: selection bias, group-limited top-k, a shared expert, a dense first layer) at a size where a
#: forward costs something on a CPU core
MODEL = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
             num_hidden_layers=16, first_k_dense_replace=1, num_attention_heads=8,
             num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=16,
             qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
             num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True,
             routed_scaling_factor=2.5, max_position_embeddings=1024, initializer_range=0.2,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
TOKEN_RANGE = (3, MODEL["vocab_size"])  # prompt ids: clear of bos / eos


def random_prompts(num: int, length: int, *, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(*TOKEN_RANGE) for _ in range(length)] for _ in range(num)]


def repeated_ngram_share(tokens: list[int], n: int = 4) -> float:
    """Share of ``tokens``' n-grams that already occurred earlier in ``tokens``."""
    seen, repeated, total = set(), 0, 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        repeated += gram in seen
        total += 1
        seen.add(gram)
    return repeated / total if total else 0.0


def bigram_hit_rate(train_sequences, prompts, outputs) -> float:
    """Share of ``outputs``' tokens equal to the most frequent successor of the previous
    token in ``train_sequences``: how much of the target's text the last token alone predicts
    (a drafter that learnt only a bigram table would reach about this acceptance at draft 1)."""
    from collections import Counter, defaultdict

    successors = defaultdict(Counter)
    for seq in train_sequences:
        for a, b in zip(seq, seq[1:]):
            successors[a][b] += 1
    best = {a: c.most_common(1)[0][0] for a, c in successors.items()}
    hits = total = 0
    for prompt, out in zip(prompts, outputs):
        seq = prompt[-1:] + out
        hits += sum(best.get(a) == b for a, b in zip(seq, seq[1:]))
        total += len(out)
    return hits / total if total else 0.0


# ----- 1. the target, 2. its own continuations -----

def build_target(folder: pathlib.Path, *, branch_scale: float, config: dict | None = None):
    """The target (:data:`MODEL`, or ``config``), saved to ``folder``: every residual
    branch's output projection (attention ``o_proj``, the MLPs' and experts' ``down_proj``)
    scaled by ``branch_scale``."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**(config or MODEL))).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # non-zero, as a trained model's
                buffer.copy_(torch.rand(buffer.shape, generator=gen) * 0.3)
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                param.mul_(branch_scale)
    model.save_pretrained(folder)
    return model


def greedy(folder, prompts, max_tokens: int, **options) -> list[list[int]]:
    from atom import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(folder), dtype="float32", skip_tokenizer_init=True, num_threads=2,
             num_kv_blocks=2048, max_model_len=1024, **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


# ----- 3. training the MTP layer -----

def _rms(x, weight, eps: float):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class MTPTrainee:
    """The MTP layer's trainable parameters around transformers' decoder block; the target's
    embedding, rotary tables and head are used frozen."""

    def __init__(self, target):
        import copy

        import torch

        config, hidden = target.config, target.config.hidden_size
        self.target, self.eps = target, config.rms_norm_eps
        self.block = copy.deepcopy(target.model.layers[-1]).train()  # an MoE layer's shape
        self.enorm = torch.nn.Parameter(torch.ones(hidden))
        self.hnorm = torch.nn.Parameter(torch.ones(hidden))
        self.head_norm = torch.nn.Parameter(target.model.norm.weight.detach().clone())
        gen = torch.Generator().manual_seed(3)
        self.eh_proj = torch.nn.Parameter(torch.cat(  # start by passing the embedding through
            [torch.eye(hidden), 0.02 * torch.randn(hidden, hidden, generator=gen)], dim=1))
        for p in target.parameters():
            p.requires_grad_(False)

    def parameters(self):
        return [self.enorm, self.hnorm, self.head_norm, self.eh_proj,
                *[p for p in self.block.parameters() if p.requires_grad]]

    def forward(self, hidden, next_ids, positions):
        """``hidden`` [B, T, H] (h_p), ``next_ids`` [B, T] (t_{p+1}), ``positions`` [T] (p)
        → (block output [B, T, H], logits [B, T, V])."""
        import torch

        model = self.target.model
        e = model.embed_tokens(next_ids)
        x = torch.cat([_rms(e, self.enorm, self.eps), _rms(hidden, self.hnorm, self.eps)], -1)
        x = x @ self.eh_proj.T
        pos = positions[None]
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, position_ids=pos,
                         position_embeddings=model.rotary_emb(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        return out, self.target.lm_head(_rms(out, self.head_norm, self.eps))

    def state_dict(self, index: int) -> dict:
        """The layer's tensors at the checkpoint's names (``model.layers.{index}.*``), the
        experts one by one as ``save_pretrained`` writes the target's (transformers v5 keeps
        them fused in memory: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])."""
        prefix = f"model.layers.{index}."
        tensors = {}
        for name, value in self.block.state_dict().items():
            if name == "mlp.experts.gate_up_proj":
                inter = value.shape[1] // 2
                for e in range(value.shape[0]):
                    tensors[f"mlp.experts.{e}.gate_proj.weight"] = value[e, :inter]
                    tensors[f"mlp.experts.{e}.up_proj.weight"] = value[e, inter:]
            elif name == "mlp.experts.down_proj":
                for e in range(value.shape[0]):
                    tensors[f"mlp.experts.{e}.down_proj.weight"] = value[e]
            else:
                tensors[name] = value
        tensors.update({"enorm.weight": self.enorm, "hnorm.weight": self.hnorm,
                        "eh_proj.weight": self.eh_proj,
                        "shared_head.norm.weight": self.head_norm})
        return {prefix + k: v.detach().clone().contiguous() for k, v in tensors.items()}


def distillation_data(target, sequences: list[list[int]]):
    """(ids [N, T], post-norm hidden [N, T, H], the target's greedy next token [N, T]) of
    ``sequences`` (prompt + greedy continuation, equal lengths)."""
    import torch

    ids = torch.tensor(sequences)
    hidden, labels = [], []
    with torch.no_grad():
        for chunk in ids.split(16):
            h = target.model(chunk).last_hidden_state
            hidden.append(h)
            labels.append(target.lm_head(h).argmax(-1))
    return ids, torch.cat(hidden), torch.cat(labels)


def mtp_loss(trainee, ids, hidden, labels):
    """Cross-entropy of draft 1 (from ``h_p`` and ``t_{p+1}``) against the target's greedy
    ``t_{p+2}`` (greedy verification accepts the argmax only), and of draft 2 (the first
    pass's output as the hidden state at ``p + 1``, as in drafts 2 .. k); draft 1's top-1
    agreement with the target."""
    import torch
    from torch.nn.functional import cross_entropy

    n = ids.shape[1]
    out1, logits1 = trainee.forward(hidden[:, :-1], ids[:, 1:], torch.arange(n - 1))
    loss1 = cross_entropy(logits1.flatten(0, 1), labels[:, 1:].flatten())
    _, logits2 = trainee.forward(out1[:, :-1], ids[:, 2:], torch.arange(1, n - 1))
    loss2 = cross_entropy(logits2.flatten(0, 1), labels[:, 2:].flatten())
    agree = (logits1.argmax(-1) == labels[:, 1:]).float().mean()
    return loss1 + 0.5 * loss2, float(agree)


def train_mtp(target, sequences, *, seconds: float, seed: int = 0) -> dict:
    """Train the MTP layer for about ``seconds`` (AdamW, batches of 8 sequences, an eighth of
    the sequences held out); returns its tensors and the training log."""
    import torch

    torch.manual_seed(seed)
    num_held_out = max(2, min(32, len(sequences) // 8))
    ids, hidden, labels = distillation_data(target, sequences)
    trainee = MTPTrainee(target)
    optimizer = torch.optim.AdamW(trainee.parameters(), lr=1e-3, weight_decay=0.01)
    num_train = ids.shape[0] - num_held_out
    log, start, step = [], time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        batch = torch.randint(num_train, (8,)) + num_held_out
        loss, _ = mtp_loss(trainee, ids[batch], hidden[batch], labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 50 == 0:
            with torch.no_grad():
                held = mtp_loss(trainee, ids[:num_held_out], hidden[:num_held_out],
                                labels[:num_held_out])
            log.append({"step": step, "s": round(time.perf_counter() - start, 1),
                        "loss": round(float(loss.detach()), 4),
                        "held_out_loss": round(float(held[0]), 4),
                        "held_out_top1_agreement": round(held[1], 4)})
            print(f"  train step {step}: loss {float(loss.detach()):.3f}, held-out loss "
                  f"{float(held[0]):.3f}, held-out draft-1 top-1 agreement {held[1]:.3f}",
                  flush=True)
    return {"tensors": trainee.state_dict(target.config.num_hidden_layers), "log": log,
            "num_steps": step, "train_s": time.perf_counter() - start}


def write_mtp_layer(folder: pathlib.Path, mtp: dict) -> None:
    """Add the MTP tensors to the folder's safetensors; ``num_nextn_predict_layers: 1``."""
    from safetensors.torch import load_file, save_file

    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1, files  # a small model: one shard
    tensors = load_file(str(files[0]))
    index = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    last = {k.removeprefix(f"model.layers.{index - 1}.") for k in tensors
            if k.startswith(f"model.layers.{index - 1}.")}
    block = {k.removeprefix(f"model.layers.{index}.") for k in mtp} - {
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
    if block != last:  # the block's names must be the checkpoint's own
        raise RuntimeError(f"MTP block names differ from layer {index - 1}'s: "
                           f"{sorted(block ^ last)[:6]}")
    save_file({**tensors, **mtp}, str(files[0]), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1},
                                                   indent=2))


def prepare(args) -> tuple[pathlib.Path, dict]:
    """The trained model folder (built, distilled and trained unless cached) and its facts."""
    key = json.dumps({"model": MODEL, "branch_scale": args.branch_scale,
                      "train_seconds": args.train_seconds,
                      "num_train_prompts": args.num_train_prompts,
                      "train_len": args.train_len, "version": 1}, sort_keys=True)
    folder = args.work_dir / hashlib.sha256(key.encode()).hexdigest()[:12]
    facts_path = folder / "bench_mtp_training.json"
    if facts_path.exists():
        print(f"trained MTP model cached in {folder}", flush=True)
        return folder, json.loads(facts_path.read_text())
    import torch

    torch.set_num_threads(args.num_train_threads)
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    target = build_target(folder, branch_scale=args.branch_scale)
    prompts = random_prompts(args.num_train_prompts, args.prompt_len, seed=1000)
    continuations = greedy(folder, prompts, args.train_len)
    sequences = [p + c for p, c in zip(prompts, continuations)]
    data_s = time.perf_counter() - t0
    print(f"distillation data: {len(sequences)} sequences of {len(sequences[0])} tokens "
          f"({data_s:.0f} s); training the MTP layer for {args.train_seconds:.0f} s", flush=True)
    trained = train_mtp(target, sequences, seconds=args.train_seconds)
    write_mtp_layer(folder, trained["tensors"])
    facts = {"model": MODEL, "data_s": data_s, "train_s": trained["train_s"],
             "num_train_steps": trained["num_steps"], "train_log": trained["log"],
             "train_rep4": sum(repeated_ngram_share(c) for c in continuations) / len(continuations),
             "train_sequences": sequences}
    facts_path.write_text(json.dumps(facts, indent=2))
    return folder, facts


# ----- 4. the benchmark -----

SPEC_KEYS = ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_emitted_tokens",
             "spec_num_verifies")


def _spec_counters(stats: dict, k: int) -> dict:
    keys = SPEC_KEYS + tuple(f"spec_num_accepted_tokens_pos_{j}" for j in range(k))
    return {key: stats.get(key, 0) for key in keys}


def bench_group(folder, methods: dict[str, dict], prompts, args, **engine) -> dict:
    """Every method's engine open at once; ``--rounds`` alternating timed runs of ``prompts``."""
    from atom import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    results = {m: {"elapsed_s": 0.0, "num_output_tokens": 0, "runs_s": []} for m in methods}
    with contextlib.ExitStack() as stack:
        llms = {m: stack.enter_context(LLM(str(folder), dtype="float32", skip_tokenizer_init=True,
                                           num_threads=args.num_threads, num_kv_blocks=1024,
                                           max_model_len=1024, **engine, **options))
                for m, options in methods.items()}
        for llm in llms.values():  # warm-up
            llm.generate(requests[:2], SamplingParams(temperature=0.0, max_tokens=8,
                                                      ignore_eos=True))
        before = {m: llm.get_stats() for m, llm in llms.items()}
        for r in range(args.rounds):
            order = list(methods) if r % 2 == 0 else list(reversed(methods))
            for m in order:
                start = time.perf_counter()
                outs = llms[m].generate(requests, params)
                elapsed = time.perf_counter() - start
                results[m]["elapsed_s"] += elapsed
                results[m]["runs_s"].append(round(elapsed, 3))
                results[m]["num_output_tokens"] += sum(len(o.outputs[0].token_ids) for o in outs)
                results[m]["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        for m, llm in llms.items():
            k = methods[m].get("num_speculative_tokens", 0)
            after, prior = _spec_counters(llm.get_stats(), k), _spec_counters(before[m], k)
            results[m]["spec"] = {key: after[key] - prior[key] for key in after}
    off = results.get("off")
    for m, r in results.items():
        r["output_tokens_per_s"] = r["num_output_tokens"] / r["elapsed_s"]
        r["ratio_vs_off"] = None if off is None else r["output_tokens_per_s"] / off["output_tokens_per_s"]
        r["num_identical_to_off"] = None if off is None else sum(
            a == b for a, b in zip(r["token_ids"], off["token_ids"]))
        r["rep4"] = sum(repeated_ngram_share(t) for t in r["token_ids"]) / len(r["token_ids"])
        spec, verifies = r["spec"], r["spec"]["spec_num_verifies"]
        k = methods[m].get("num_speculative_tokens", 0)
        r["acceptance_per_position"] = [spec[f"spec_num_accepted_tokens_pos_{j}"] / verifies
                                        if verifies else None for j in range(k)]
        r["acceptance_rate"] = (spec["spec_num_accepted_tokens"] / spec["spec_num_draft_tokens"]
                                if spec["spec_num_draft_tokens"] else None)
        r["mean_acceptance_length"] = (1 + spec["spec_num_accepted_tokens"] / verifies
                                       if verifies else 1.0)
    return results


def print_table(all_results: dict[str, dict], args, facts: dict) -> None:
    def fmt(v, spec="{:.2f}"):
        return "-" if v is None else spec.format(v)

    print(f"\nCPU: {cpu_description()}; {args.num_prompts} prompts of {args.prompt_len} tokens x "
          f"{args.max_tokens} output tokens, greedy, fp32, {args.rounds} alternating rounds; "
          f"MTP trained {facts['train_s']:.0f} s ({facts['num_train_steps']} steps)")
    print(f"{'setup':<14} {'method':<10} {'tok/s':>7} {'vs off':>7} {'accept/pos':>18} "
          f"{'accept':>7} {'tok/fwd':>7} {'rep4':>5} {'same':>6}")
    for setup, results in all_results.items():
        for m, r in results.items():
            pos = "/".join(fmt(a) for a in r["acceptance_per_position"]) or "-"
            print(f"{setup:<14} {m:<10} {r['output_tokens_per_s']:>7.1f} "
                  f"{fmt(r['ratio_vs_off']):>7} {pos:>18} {fmt(r['acceptance_rate'], '{:.3f}'):>7} "
                  f"{r['mean_acceptance_length']:>7.2f} {r['rep4']:>5.2f} "
                  f"{r['num_identical_to_off']:>3}/{len(r['token_ids'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=pathlib.Path,
                        default=pathlib.Path(os.environ.get("ATOM_CACHE_DIR",
                                                            pathlib.Path.home() / ".cache" / "atom"))
                        / "bench_mtp", help="where the trained model folder is cached")
    parser.add_argument("--train-seconds", type=float, default=180.0, help="training time (180)")
    parser.add_argument("--branch-scale", type=float, default=0.001,
                        help="the target's residual branches' scale (0.001; 1: plain random)")
    parser.add_argument("--num-train-prompts", type=int, default=768,
                        help="training prompts (768)")
    parser.add_argument("--train-len", type=int, default=80,
                        help="greedy tokens per training prompt (80)")
    parser.add_argument("--num-train-threads", type=int, default=2, help="torch threads (2)")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (16)")
    parser.add_argument("--num-prompts", type=int, default=2,
                        help="benchmark prompts, run together (2: one per rank under DP)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens (128)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timed rounds (5)")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per rank (1)")
    parser.add_argument("--no-dp", action="store_true", help="skip the DP = 2 + EP runs")
    parser.add_argument("--output-json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    folder, facts = prepare(args)
    prompts = random_prompts(args.num_prompts, args.prompt_len, seed=7)  # not the training's
    methods = {"off": {},
               "mtp k=1": {"speculative_method": "mtp", "num_speculative_tokens": 1},
               "mtp k=3": {"speculative_method": "mtp", "num_speculative_tokens": 3},
               "ngram k=3": {"speculative_method": "ngram", "num_speculative_tokens": 3}}
    all_results = {"1 rank": bench_group(folder, methods, prompts, args)}
    bigram = bigram_hit_rate(facts["train_sequences"], prompts,
                             all_results["1 rank"]["off"]["token_ids"])
    print("1 rank: done", flush=True)
    if not args.no_dp:
        dp_methods = {m: o for m, o in methods.items() if not m.startswith("ngram")}
        all_results["DP=2 + EP"] = bench_group(folder, dp_methods, prompts, args,
                                               data_parallel_size=2, enable_expert_parallel=True)
        print("DP=2 + EP: done", flush=True)
    print_table(all_results, args, facts)
    print(f"bigram table of the training data predicts {bigram:.2f} of spec off's tokens; "
          f"rep4 of the training continuations {facts['train_rep4']:.2f}")
    total_s = time.perf_counter() - started
    print(f"total {total_s:.0f} s (training data and training: "
          f"{facts['data_s'] + facts['train_s']:.0f} s when not cached)")
    if args.output_json is not None:
        for results in all_results.values():
            for r in results.values():
                r.pop("token_ids")
        write_json_report(args.output_json, {
            "args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu_description(),
            "model_folder": str(folder), "bigram_hit_rate": bigram, "total_s": total_s,
            "training": {k: v for k, v in facts.items() if k != "train_sequences"},
            "results": all_results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
