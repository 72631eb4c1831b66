"""The tiny random MoE models shared by the MoE tests: Mixtral (the checkable model (b) of
docs/ARCHITECTURE.md), Qwen3 / Qwen3-MoE and gpt-oss, built by transformers, and the fused
checkpoint layout of transformers v5 (experts as 3-D tensors) next to the per-expert one
``save_pretrained`` writes; gpt-oss's MXFP4 layout."""

from __future__ import annotations

import json
import random
import time

import torch

from atom import LLM, SamplingParams
from tests.utils import GreedyResult

LOGPROB_TOLERANCE = 1e-3  # |ours - transformers| for the logprob of each agreed greedy token
# model (a) on two ranks: engine options, greedy parameters and prompts of the EP tests
OPTIONS = dict(dtype="float32", num_kv_blocks=64, max_model_len=512, num_threads=1)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3, [100 + i for i in range(7)],
           [400 + 3 * i for i in range(50)], [9000 + i for i in range(20)]]


def idle_rank_stats(llm: LLM) -> list[dict]:
    """Every rank's stats once all ranks are idle at the same tick (their counters final)."""
    deadline = time.monotonic() + 60.0  # liveness only
    while True:
        stats = llm.get_rank_stats()
        if all(s["idle"] for s in stats) and len({s["tick"] for s in stats}) == 1:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def one_rank_greedy(folder, prompts: list[list[int]]) -> list[GreedyResult]:
    """``prompts`` greedy (:data:`PARAMS`) on one rank of the model in ``folder``, in this
    process (no engine-core process: the reference the two-rank runs are checked against)."""
    from atom.config import EngineConfig
    from atom.engine.llm_engine import LLMEngine
    from tests.utils import ours_greedy

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(folder), **{**OPTIONS,
                                                "max_model_len": 256}, skip_tokenizer_init=True))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, PARAMS)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    engine.shutdown()
    return ours_greedy([finished[str(i)] for i in range(len(prompts))])


def run_on_two_ep_ranks(folder, prompts: list[list[int]], *, enable_tbo: bool, name: str,
                        reference: list[GreedyResult], one_at_a_time: bool = False,
                        **options) -> list[dict]:
    """``prompts`` greedy on two expert-parallel DP ranks of the model in ``folder`` (engine
    ``options`` added): all on rank 0 first (rank 1 steps dummy batches through every MoE
    collective), then spread, and with ``one_at_a_time`` each prompt alone on rank 0 too (with
    TBO its prefill splits at the token midpoint); each run's tokens and logprobs checked
    against ``reference`` (tie-aware), and both ranks checked to have issued the same
    collectives. Returns every rank's stats once idle."""
    from tests.utils import check_greedy_close, ours_greedy

    requests = [{"prompt_token_ids": p} for p in prompts]
    with LLM(str(folder), **{**OPTIONS, "max_model_len": 256, **options}, skip_tokenizer_init=True,
             data_parallel_size=2, enable_expert_parallel=True, enable_tbo=enable_tbo) as llm:
        runs = {"rank 1 idle": ours_greedy(llm.generate(requests, PARAMS, data_parallel_rank=0)),
                "both ranks": ours_greedy(llm.generate(requests, PARAMS))}
        if one_at_a_time:
            runs["one at a time"] = ours_greedy([llm.generate(r, PARAMS, data_parallel_rank=0)[0]
                                                 for r in requests])
        stats = idle_rank_stats(llm)
    for label, ours in runs.items():
        check_greedy_close(ours, reference, name=f"{name}, EP, {label}, tbo={enable_tbo}")
        assert_logprobs_close(ours, reference)
    assert len(stats) == 2  # no rank failed (a recovery would resume on fewer)
    assert stats[0]["collective_hash"] == stats[1]["collective_hash"]
    assert stats[0]["collective_count"] == stats[1]["collective_count"]
    return stats


def build_tiny_mixtral(folder):
    """A top-2-of-8 Mixtral built by transformers, fp32, saved to ``folder``; returns the model.

    Initialised with a large scale so both the LM head's logits and the routers' scores are
    peaked: a random tiny model otherwise has near-ties that rounding noise flips.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
                           initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1,
                           eos_token_id=2)
    model = MixtralForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def randomize_norms(model) -> None:
    """Give every RMSNorm weight (the layers', the final one, Qwen3's per-head q/k norms) random
    values in [0.5, 1.5]: transformers initialises them to ones, which would hide a norm loaded
    into the wrong place or not loaded at all."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))


#: the tiny Qwen3-MoE of the tests: 3 layers, the middle one dense (mlp_only_layers), 8 experts
#: of which 2 per token, the k gates renormalized (norm_topk_prob); head_dim 24 (not 64 / 4)
QWEN3_MOE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                 decoder_sparse_step=1, max_position_embeddings=512, initializer_range=0.2,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def build_tiny_qwen3(folder, *, moe: bool = True, **overrides):
    """A tiny random Qwen3-MoE (:data:`QWEN3_MOE`; ``moe=False``: the dense Qwen3 of the same
    shape) built by transformers, fp32, large init scale (peaked logits and router scores), random
    norms; saved to ``folder`` with ``save_pretrained`` (experts one by one). Returns the model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    settings = {**QWEN3_MOE, **overrides}
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**settings)).eval()
    else:
        for key in ("moe_intermediate_size", "num_experts", "num_experts_per_tok",
                    "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step"):
            settings.pop(key)
        model = Qwen3ForCausalLM(Qwen3Config(**settings)).eval()
    randomize_norms(model)
    model.save_pretrained(folder)
    return model


def save_fused_layout(model, folder) -> None:
    """Save ``model`` the way transformers v5 holds it in memory: every MoE layer's experts as
    3-D tensors (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
    ``[E, H, I]``, router ``mlp.gate.weight``), which ``save_pretrained`` turns back into
    per-expert names."""
    from safetensors.torch import save_file

    model.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))


def tiny_prompts(num: int = 6) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 60))] for _ in range(num)]


def one_rank_and_transformers(folder, hf_model) -> tuple:
    """The DP tests' references for the model in ``folder`` (``hf_model`` its transformers
    twin): (:func:`tiny_prompts`, their greedy on one rank, their greedy in transformers)."""
    from tests.utils import hf_greedy

    prompts = tiny_prompts()
    return prompts, one_rank_greedy(folder, prompts), hf_greedy(hf_model, prompts,
                                                                 PARAMS.max_tokens)


#: greedy parameters of the one-rank engine parity checks (:func:`check_engine_parity`)
ENGINE_PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)


def engine_parity_prompts() -> list[list[int]]:
    """Six prompts of 5-59 and 43-57 tokens, the last two sharing a 40-token prefix (prefix-cache
    hits across prompts)."""
    rng = random.Random(3)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    return ([[rng.randrange(3, 512) for _ in range(rng.randrange(5, 60))] for _ in range(4)]
            + [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 17)])


def parity_engine(folder) -> LLM:
    """An engine on the model in ``folder`` whose options make every case of
    :func:`check_engine_parity` happen: a 16-token budget (chunked prefill) and 12 blocks of 8
    tokens for batches of prompts up to 57 + 12 tokens (preemption). Use it as a context
    manager."""
    return LLM(str(folder), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=12,
               block_size=8, max_num_batched_tokens=16, max_model_len=128, num_threads=1)


def check_engine_parity(engine: LLM, hf_model, prompts: list[list[int]]) -> None:
    """The engine's greedy tokens and top-5 logprobs on ``prompts`` equal transformers'
    (tie-aware), run twice (the second time from the prefix cache); preemptions and prefix hits
    happened and every block came back."""
    from tests.utils import check_greedy_close, hf_greedy, ours_greedy

    reference = hf_greedy(hf_model, prompts, ENGINE_PARAMS.max_tokens)
    requests = [{"prompt_token_ids": p} for p in prompts]
    first = ours_greedy(engine.generate(requests, ENGINE_PARAMS))
    again = ours_greedy(engine.generate(requests, ENGINE_PARAMS))  # prompts cached: prefix hits
    stats = engine.get_stats()
    name = hf_model.config.model_type
    for label, ours in (("first", first), ("again", again)):
        check_greedy_close(ours, reference, name=f"tiny {name}, {label}")
        assert_logprobs_close(ours, reference)
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def check_ngram_speculation(engine: LLM, folder, prompts: list[list[int]], *,
                            max_tokens: int) -> None:
    """n-gram speculative decoding (3 tokens) on the model in ``folder`` gives the greedy tokens
    of ``engine`` (the same model, plain) on ``prompts``, and accepts some drafts (prompts whose
    continuations repeat: a random model rarely repeats itself)."""
    from tests.utils import check_greedy_close, ours_greedy

    requests = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
    plain = ours_greedy(engine.generate(requests, params))
    with LLM(str(folder), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
             max_model_len=128, num_threads=1, speculative_method="ngram",
             num_speculative_tokens=3) as llm:
        spec = ours_greedy(llm.generate(requests, params))
        stats = llm.get_stats()
    check_greedy_close(spec, plain, name=f"tiny {folder.name}, n-gram speculation")
    assert stats["spec_num_accepted_tokens"] > 0


def assert_logprobs_close(ours: list[GreedyResult], ref: list[GreedyResult]) -> None:
    """Each greedy token both sides agree on has the same logprob within LOGPROB_TOLERANCE."""
    for a, b in zip(ours, ref):
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                break
            assert abs(a.top_logprobs[pos][ta] - b.top_logprobs[pos][tb]) < LOGPROB_TOLERANCE, (
                pos, a.top_logprobs[pos], b.top_logprobs[pos])


# ----- gpt-oss -----

#: the tiny gpt-oss of the tests: 3 layers (sliding, full, sliding) with a window of 8 tokens
#: (shorter than the prompts), 8 experts of which 2 per token, head_dim 24 (not 64 / 4), YaRN
#: over an original context of 32 positions (shorter than the prompts too), widths multiples of
#: 32 (MXFP4 blocks)
GPT_OSS = dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_local_experts=8,
               num_experts_per_tok=2, sliding_window=8,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 32},
               max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2)


def build_tiny_gpt_oss(folder, **overrides):
    """A tiny random gpt-oss (:data:`GPT_OSS`) built by transformers, fp32, large init scale,
    random norms, and every bias (attention, router, experts) and sink random and non-zero
    (transformers starts most biases at zero, which would hide one not loaded); saved to
    ``folder`` with ``save_pretrained`` (experts fused, float). Returns the model."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**{**GPT_OSS, **overrides})).eval()
    randomize_norms(model)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    model.save_pretrained(folder)
    return model


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantize ``weight`` ``[..., cols]`` along its last dimension (the tests' own
    quantizer: per block of 32, the power-of-two scale that brings the largest magnitude to at
    most 6, each value rounded to the nearest FP4 E2M1 value). Returns (blocks uint8
    ``[..., cols / 32, 16]``, low nibble the even element; scales uint8 ``[..., cols / 32]``,
    the exponent + 127), the layout of gpt-oss checkpoints."""
    from atom.layers.weights import FP4_E2M1_VALUES

    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    exponents = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0))
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(FP4_E2M1_VALUES)).abs().argmin(-1)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponents + 127).to(torch.uint8)


def save_mxfp4_layout(model, folder) -> None:
    """Save gpt-oss ``model`` as the published checkpoints are: every expert matrix in MXFP4
    (``mlp.experts.gate_up_proj_blocks`` / ``_scales``, ``down_proj_blocks`` / ``_scales``, each
    stored ``[E, out, in / 32, ...]``), everything else float, and a ``quantization_config``
    naming mxfp4 (transformers dequantizes such a folder on a CPU)."""
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # transformers keeps [E, in, out]; the checkpoint quantizes rows of [E, out, in]
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(
                tensor.transpose(1, 2))
        else:
            tensors[name] = tensor.contiguous()
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"))


# ----- DeepSeek-V2 / V3 -----

#: the tiny DeepSeek-V3 of the tests: 3 layers, the first dense (first_k_dense_replace), 8 routed
#: experts in 4 groups of which 2 groups and 2 experts per token (noaux_tc), one shared expert,
#: a low-rank query (q_lora_rank 24), a latent of 32 + 8 rotary values, v_head_dim 12 != 16 + 8
DEEPSEEK_V3 = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                   n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
                   topk_group=2, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=32,
                   qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, norm_topk_prob=True,
                   routed_scaling_factor=2.5, max_position_embeddings=512, initializer_range=0.2,
                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
#: the tiny DeepSeek-V2 (V2-Lite-like: no q_lora_rank), softmax group-limited greedy routing
DEEPSEEK_V2 = {**{k: v for k, v in DEEPSEEK_V3.items() if k != "norm_topk_prob"},
               "q_lora_rank": None, "topk_method": "group_limited_greedy",
               "routed_scaling_factor": 1.5}


def build_tiny_deepseek(folder, *, v3: bool = True, **overrides):
    """A tiny random DeepSeek-V3 (:data:`DEEPSEEK_V3`) or V2 (:data:`DEEPSEEK_V2`) built by
    transformers, fp32, large init scale, random norms and a random non-zero
    ``e_score_correction_bias`` (V3; transformers starts it at zero, which would hide a bias
    not loaded or used for the gates); saved to ``folder``. Returns the model."""
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                              DeepseekV3ForCausalLM)

    torch.manual_seed(0)
    if v3:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**DEEPSEEK_V3, **overrides}))
    else:
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**{**DEEPSEEK_V2, **overrides}))
    model = model.eval()
    randomize_norms(model)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape, generator=gen) * 0.3)
    model.save_pretrained(folder)
    return model


def build_tiny_deepseek_mtp(folder):
    """:func:`build_tiny_deepseek` (V3) with a predictable MTP layer (:func:`add_mtp_layer`)."""
    build_tiny_deepseek(folder)
    add_mtp_layer(folder, predictable=True)
    return folder


def greedy_in_process(folder, prompts: list[list[int]], params: SamplingParams = PARAMS,
                      **options) -> tuple[list[GreedyResult], dict]:
    """``prompts`` greedy on one rank of the model in ``folder`` in this process (no
    engine-core process), engine ``options`` over :data:`OPTIONS`; (results, engine stats)."""
    from atom.config import EngineConfig
    from atom.engine.llm_engine import LLMEngine
    from tests.utils import ours_greedy

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(folder), **{**OPTIONS, **options},
                                                skip_tokenizer_init=True))
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        finished = {}
        while engine.has_unfinished_requests():
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
        return ours_greedy([finished[str(i)] for i in range(len(prompts))]), engine.get_stats()
    finally:
        engine.shutdown()


def add_mtp_layer(folder, *, predictable: bool = False) -> dict[str, torch.Tensor]:
    """Write one multi-token-prediction layer into the tiny DeepSeek-V3 in ``folder``
    (:func:`build_tiny_deepseek`; transformers does not model MTP) at the checkpoint's names,
    ``model.layers.3.*`` (after the 3 target layers): ``enorm``, ``hnorm``, ``eh_proj``, a
    decoder block (MLA attention + MoE: layer 2's tensors, perturbed), ``shared_head.norm``; no
    ``embed_tokens`` / ``shared_head.head`` (the target's are shared). Sets
    ``num_nextn_predict_layers: 1``. Returns the MTP tensors.

    Random MTP weights accept almost no draft. ``predictable`` makes the drafts often right:
    every layer's residual branches (``o_proj``, ``down_proj``) shrink, so the target's greedy
    token is mostly a function of the last token (its embedding through the final norm and the
    head), and the MTP layer passes the next token's embedding through (``eh_proj = [I, 0]``,
    ``shared_head.norm`` = the final norm): draft ``t_{p+2}`` from ``t_{p+1}`` the same way.
    """
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    hidden = DEEPSEEK_V3["hidden_size"]
    if predictable:
        for name in tensors:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = tensors[name] * 0.01
    mtp = {}
    for name, tensor in tensors.items():
        if name.startswith("model.layers.2."):
            noise = 0.05 * torch.randn(tensor.shape, generator=gen) * tensor.abs().mean()
            mtp[name.replace("model.layers.2.", "model.layers.3.")] = tensor + noise
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.3.{norm}.weight"] = 0.5 + torch.rand(hidden, generator=gen)
    mtp["model.layers.3.eh_proj.weight"] = 0.2 * torch.randn(hidden, 2 * hidden, generator=gen)
    if predictable:
        mtp["model.layers.3.enorm.weight"] = torch.ones(hidden)
        mtp["model.layers.3.shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        mtp["model.layers.3.eh_proj.weight"] = torch.cat(
            [torch.eye(hidden), 0.01 * torch.randn(hidden, hidden, generator=gen)], dim=1)
    save_file({**tensors, **mtp}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return mtp
