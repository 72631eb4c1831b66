"""ModelRunner + Llama model against Hugging Face transformers (fp32 logits parity).

The embedded SmolLM2 GGUF is compared with transformers' own GGUF loader (which also checks our
dequantization and q/k un-permute); a tiny random Llama saved as safetensors checks the HF
folder path, untied heads and GQA with other shapes.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from atom.worker.embedded_model import ensure_embedded_gguf
from atom.worker.model_loader import load_model_weights
from atom.worker.model_runner import ModelRunner
from atom.sampling_params import SamplingParams
from atom.core.sequence import Sequence

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 64
ATOL = 1e-3  # fp32, same math, different GEMM shapes (fused QKV / gate-up): ~1e-5 seen


class BlockPool:
    """Trivial allocator: hands out blocks from a shuffled free list (non-contiguous tables)."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(NUM_KV_BLOCKS, generator=gen).tolist()

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * BLOCK_SIZE < num_tokens:
            seq.block_table.append(self.free.pop())


def _seq(token_ids: list[int], *, prompt_logprobs: int | None = None) -> Sequence:
    return Sequence(request_id="r", token_ids=list(token_ids),
                    sampling_params=SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs))


def _step(runner: ModelRunner, pool: BlockPool, scheduled: list[tuple[Sequence, int]]):
    """Allocate, run and advance like the scheduler would (the runner itself mutates nothing)."""
    for seq, n in scheduled:
        pool.grow(seq, seq.num_computed_tokens + n)
    out = runner.execute_model(scheduled)
    for seq, n in scheduled:
        seq.num_computed_tokens += n
    return out


def _random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def _check_prefill_then_decode(runner, hf_model, prompt: list[int]) -> None:
    """Whole prompt in one step (with prompt logits), then two decode steps."""
    pool = BlockPool()
    seq = _seq(prompt, prompt_logprobs=0)
    out = _step(runner, pool, [(seq, len(prompt))])
    ref = _hf_logits(hf_model, prompt)
    assert out.sampled_seq_ids == [seq.seq_id]
    _assert_close(out.logits, ref[-1:])
    _assert_close(out.prompt_logits[seq.seq_id], ref[:-1])
    for _ in range(2):
        seq.token_ids.append(int(out.logits[0].argmax()))
        out = _step(runner, pool, [(seq, 1)])
        assert seq.seq_id not in out.prompt_logits  # decode computes no prompt position
        _assert_close(out.logits, _hf_logits(hf_model, seq.token_ids)[-1:])


def _check_chunked_mixed_batch(runner, hf_model, vocab: int) -> None:
    """A 50-token prompt in two chunks (20 + 30), batched with another sequence that prefills in
    the first step and decodes in the second; the second step lists the chunk first, so the
    runner's decode-first reordering must not leak into the output order."""
    pool = BlockPool(seed=1)
    chunked = _seq(_random_tokens(50, vocab, seed=2), prompt_logprobs=0)
    other = _seq(_random_tokens(11, vocab, seed=3))
    out1 = _step(runner, pool, [(chunked, 20), (other, 11)])
    assert out1.sampled_seq_ids == [other.seq_id]  # the half-done prompt is not sampled
    _assert_close(out1.logits, _hf_logits(hf_model, other.token_ids)[-1:])
    other.token_ids.append(int(out1.logits[0].argmax()))
    out2 = _step(runner, pool, [(chunked, 30), (other, 1)])
    assert out2.sampled_seq_ids == [chunked.seq_id, other.seq_id]
    ref = _hf_logits(hf_model, chunked.token_ids)
    _assert_close(out2.logits[:1], ref[-1:])
    _assert_close(out2.logits[1:], _hf_logits(hf_model, other.token_ids)[-1:])
    prompt_logits = torch.cat(
        [out1.prompt_logits[chunked.seq_id], out2.prompt_logits[chunked.seq_id]])
    _assert_close(prompt_logits, ref[:-1])


# --------------------------------------------------------------------------------------------
# embedded SmolLM2 GGUF


@pytest.fixture(scope="module")
def smol_runner():
    config, state_dict = load_model_weights(None, torch.float32)
    return ModelRunner(config, state_dict, dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS,
                       block_size=BLOCK_SIZE, max_model_len=512)


@pytest.fixture(scope="module")
def smol_hf():
    path = ensure_embedded_gguf()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_smollm2_prefill_and_decode_match_transformers(smol_runner, smol_hf):
    _check_prefill_then_decode(smol_runner, smol_hf, _random_tokens(37, 49152, seed=0))


def test_smollm2_chunked_prefill_in_mixed_batch_matches_transformers(smol_runner, smol_hf):
    _check_chunked_mixed_batch(smol_runner, smol_hf, 49152)


def test_empty_step_and_padding_write_no_kv(smol_runner):
    before = [c.clone() for c in smol_runner.kv_caches]
    for num_padding_tokens in (0, 3):
        out = smol_runner.execute_model([], num_padding_tokens=num_padding_tokens)
        assert out.logits.shape == (0, 49152) and out.logits.dtype == torch.float32
        assert out.sampled_seq_ids == [] and out.prompt_logits == {}
    assert all(torch.equal(a, b) for a, b in zip(before, smol_runner.kv_caches))


def test_runner_rejects_a_step_that_does_not_fit(smol_runner):
    seq = _seq([1, 2, 3, 4])
    with pytest.raises(ValueError, match="block table"):
        smol_runner.execute_model([(seq, 4)])  # no blocks allocated
    seq.block_table = [0]
    with pytest.raises(ValueError, match="num_new_tokens"):
        smol_runner.execute_model([(seq, 5)])


def test_kv_cache_bytes_per_block():
    config, _ = _tiny_llama_config_and_hf(tie=True)
    # 2 (K and V) x layers x block_size x kv heads x head_dim x 2 bytes (bf16)
    assert ModelRunner.kv_cache_bytes_per_block(
        config, dtype=torch.bfloat16, block_size=16) == 2 * 2 * 16 * 2 * 16 * 2


# --------------------------------------------------------------------------------------------
# tiny random Llama from a Hugging Face folder


def _tiny_llama_config_and_hf(*, tie: bool):
    from atom.worker.model_loader import arch_config_from_hf

    hf_config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=tie,
        initializer_range=0.2)  # peaked logits: argmax comparisons are not decided by noise
    return arch_config_from_hf(hf_config.to_dict()), hf_config


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_llama(request, tmp_path_factory):
    _, hf_config = _tiny_llama_config_and_hf(tie=request.param)
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(hf_config).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf_model.save_pretrained(folder)
    config, state_dict = load_model_weights(str(folder), torch.float32)
    runner = ModelRunner(config, state_dict, dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS,
                         block_size=BLOCK_SIZE, max_model_len=256)
    return runner, hf_model


def test_tiny_llama_prefill_and_decode_match_transformers(tiny_llama):
    runner, hf_model = tiny_llama
    _check_prefill_then_decode(runner, hf_model, _random_tokens(23, 256, seed=5))


def test_tiny_llama_chunked_prefill_in_mixed_batch_matches_transformers(tiny_llama):
    runner, hf_model = tiny_llama
    _check_chunked_mixed_batch(runner, hf_model, 256)


def test_torch_paths_without_compiled_kernels_match_transformers(monkeypatch, tmp_path):
    """With no C++ kernels (no compiler, or ATOM_DISABLE_CPP_KERNELS=1) and no oneDNN packing,
    the torch reference paths (attention, norms, rotary, SiLU, sampling helpers) run instead and
    compute the same model."""
    from atom.kernels import cpu_ops

    monkeypatch.setattr(cpu_ops, "load", lambda: None)
    monkeypatch.setattr("atom.layers.linear.pack_weight", lambda weight: None)
    _, hf_config = _tiny_llama_config_and_hf(tie=True)
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(hf_config).eval()
    hf_model.save_pretrained(tmp_path)
    config, state_dict = load_model_weights(str(tmp_path), torch.float32)
    runner = ModelRunner(config, state_dict, dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS,
                         block_size=BLOCK_SIZE, max_model_len=256)
    assert runner.model.layers[0].mlp.gate_up_proj.weight is not None  # left dense
    _check_prefill_then_decode(runner, hf_model, _random_tokens(23, 256, seed=5))
    _check_chunked_mixed_batch(runner, hf_model, 256)


def test_smollm2_bf16_is_as_close_to_fp32_as_transformers_bf16(smol_hf):
    """bf16 rounds differently from transformers' bf16 (fused GEMMs), so compare error sizes:
    our bf16 logits must be about as far from the fp32 reference as transformers' bf16 are."""
    import copy

    config, state_dict = load_model_weights(None, torch.bfloat16)
    runner = ModelRunner(config, state_dict, dtype=torch.bfloat16, num_kv_blocks=NUM_KV_BLOCKS,
                         block_size=BLOCK_SIZE, max_model_len=128)
    prompt = _random_tokens(40, 49152, seed=7)
    seq = _seq(prompt, prompt_logprobs=0)
    BlockPool().grow(seq, len(prompt))
    out = runner.execute_model([(seq, len(prompt))])
    ours = torch.cat([out.prompt_logits[seq.seq_id], out.logits])
    ref_fp32 = _hf_logits(smol_hf, prompt)
    ref_bf16 = _hf_logits(copy.deepcopy(smol_hf).to(torch.bfloat16), prompt)
    our_err = (ours - ref_fp32).abs().mean().item()
    hf_err = (ref_bf16 - ref_fp32).abs().mean().item()
    # Both are bf16 noise (~0.1-0.2 on logits of magnitude ~30) that varies by prompt, with
    # single positions swinging 5x; a real bug (rope, KV dtype, norm) is off by whole units.
    assert our_err < 2.0 * hf_err, (our_err, hf_err)
    top5 = ref_fp32.topk(5, dim=-1).indices
    assert (top5 == ours.argmax(-1, keepdim=True)).any(-1).all()  # bf16 only flips near-ties
