"""Greedy parity with transformers on a tiny random Llama in Hugging Face format (fp32).

The model is built by transformers with a large init scale so its logits are peaked (random tiny
models otherwise have nearly flat logits and greedy choices flip on rounding noise). It has no
tokenizer: the engine runs with ``skip_tokenizer_init`` on token ids.
"""

from __future__ import annotations

import random

import pytest
import torch

from atom import LLM, SamplingParams
from tests.utils import check_greedy_close, hf_greedy, ours_greedy

MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=10000.0, initializer_range=0.2, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 70))] for _ in range(8)]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    return hf_greedy(tiny_llama[1], prompts, MAX_NEW_TOKENS)


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5)


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 7},
    {"num_kv_blocks": 14, "block_size": 8},
], ids=["batch", "chunked", "preemption"])
def test_tiny_llama_greedy_matches_transformers(tiny_llama, prompts, reference, options):
    llm = LLM(str(tiny_llama[0]), dtype="float32", skip_tokenizer_init=True, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    check_greedy_close(ours_greedy(outs), reference, name=f"tiny llama {options}")
    if "num_kv_blocks" in options:
        assert llm.get_stats()["num_preemptions"] > 0
    one_by_one = [llm.generate({"prompt_token_ids": p}, PARAMS)[0] for p in prompts]
    again = ours_greedy(one_by_one)
    check_greedy_close(again, reference, name=f"tiny llama one at a time {options}")
    assert all(o.outputs[0].text == "" for o in outs)
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
