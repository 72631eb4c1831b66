"""Sampling exactness end to end: a tiny random Llama with a 16-token vocabulary, temperature 1.

2000 unseeded requests of one prompt generate 4 tokens each without speculation and with the
early-exit draft (2 of 2 layers, proposing the argmax, k = 3: tokens 2-4 of every request come from verifies). At each
output position the token counts of the two runs must pass a chi-square homogeneity test at
significance 0.001; the negative control (the verifier's rule replaced by one that resamples
from ``p`` instead of ``norm(max(0, p - q))``) must fail it at 1e-6 at some position.
"""

from __future__ import annotations

import pytest
import torch

from atom import SamplingParams
from atom.config import EngineConfig
from atom.worker.embedded_model import embedded_gguf_path
from atom.engine.llm_engine import LLMEngine
from tests.spec_utils import homogeneity_p_value, wrong_rule

VOCAB = 16
NUM_REQUESTS = 2000
MAX_TOKENS = 4
PROMPT = [3, 4, 5, 6, 7]
SIGNIFICANCE = 1e-3
CONTROL_P_VALUE = 1e-6


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, initializer_range=0.4,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    folder = tmp_path_factory.mktemp("tiny-llama-16")
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def _counts(folder: str, **spec) -> tuple[torch.Tensor, dict]:
    """Token counts [MAX_TOKENS, VOCAB] by output position, and the engine's stats."""
    engine = LLMEngine(EngineConfig(model=folder, dtype="float32", skip_tokenizer_init=True,
                                    num_kv_blocks=1024, max_num_seqs=256, max_model_len=64,
                                    num_threads=1, **spec))
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        engine.add_request(f"r{i}", PROMPT, params)
    counts = torch.zeros(MAX_TOKENS, VOCAB)
    num_finished = 0
    while num_finished < NUM_REQUESTS:
        for out in engine.step():
            if out.finished:
                num_finished += 1
                for pos, token in enumerate(out.outputs[0].token_ids):
                    counts[pos, token] += 1
    stats = engine.core.get_stats()
    engine.shutdown()
    return counts, stats


# the draft is the target (both layers): it proposes the argmax, accepted with probability p(argmax)
SPEC = dict(speculative_method="draft", draft_num_layers=2, num_speculative_tokens=3)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return _counts(tiny_llama)[0]


def test_speculative_sampling_keeps_the_distribution(tiny_llama, reference):
    counts, stats = _counts(tiny_llama, **SPEC)
    assert counts.sum(1).tolist() == [NUM_REQUESTS] * MAX_TOKENS
    assert stats["spec_num_draft_tokens"] > 0 and 0 < stats["spec_acceptance_rate"] < 1
    p_values = [homogeneity_p_value(counts[pos], reference[pos]) for pos in range(MAX_TOKENS)]
    print(f"spec vs non-spec chi-square p-values by position: {p_values}; acceptance "
          f"{stats['spec_acceptance_rate']:.3f}")
    assert min(p_values) > SIGNIFICANCE


def test_a_wrong_acceptance_rule_fails_the_same_test(tiny_llama, reference, monkeypatch):
    monkeypatch.setattr("atom.worker.rejection_sampler.rejection_sample", wrong_rule)
    counts, _ = _counts(tiny_llama, **SPEC)
    p_values = [homogeneity_p_value(counts[pos], reference[pos]) for pos in range(MAX_TOKENS)]
    print(f"wrong rule: chi-square p-values by position: {p_values}")
    assert min(p_values) < CONTROL_P_VALUE


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_llama):
    config = EngineConfig(model=tiny_llama, dtype="float32", skip_tokenizer_init=True,
                          num_kv_blocks=16, max_model_len=64, num_threads=1,
                          speculative_method="draft", draft_model=str(embedded_gguf_path()))
    with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens, the target's has 16: a "
                                         r"draft must share the target's tokenizer"):
        LLMEngine(config)
