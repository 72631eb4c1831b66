"""Greedy parity of the whole engine with Hugging Face transformers (fp32), real embedded model.

Every configuration (one at a time, one batch, small chunks, prefix-cache hits, preemption)
must produce transformers' greedy tokens; the tie-aware comparator is the only exception. The
default configuration's tests share one engine, each from an empty prefix cache.
"""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from tests.utils import check_greedy_close, hf_greedy, ours_greedy


QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves falling in the park.",
    "List three prime numbers.",
    "Explain photosynthesis to a ten year old child in simple words, please.",
    "Who wrote Romeo and Juliet?",
    "Give me a recipe idea for dinner tonight using rice, beans and tomatoes.",
    "What is 12 plus 30?",
    "Describe the color blue to someone who cannot see.",
]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from atom.worker.model_files import load_tokenizer

    tok = load_tokenizer(None)
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


@pytest.fixture(scope="module")
def reference(prompts, embedded_hf_model):
    return hf_greedy(embedded_hf_model, prompts, MAX_NEW_TOKENS)


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5)


@pytest.fixture(scope="module")
def llm():
    """The default configuration (fp32), for the tests that need nothing else."""
    with LLM(dtype="float32") as llm:
        yield llm


def _requests(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_one_request_at_a_time(llm, prompts, reference):
    assert llm.reset_prefix_cache()
    outs = [llm.generate({"prompt_token_ids": p}, PARAMS)[0] for p in prompts]
    check_greedy_close(ours_greedy(outs), reference, name="one at a time")


def test_one_batch(llm, prompts, reference):
    assert llm.reset_prefix_cache()
    outs = llm.generate(_requests(prompts), PARAMS)
    assert outs[0].num_cached_tokens == 0  # the reset emptied the cache
    check_greedy_close(ours_greedy(outs), reference, name="one batch")
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_chunked_prefill_small_budget(prompts, reference):
    shortest = min(len(p) for p in prompts)
    assert shortest // 3 < shortest
    with LLM(dtype="float32", max_num_batched_tokens=shortest // 3) as llm:
        outs = llm.generate(_requests(prompts), PARAMS)
    check_greedy_close(ours_greedy(outs), reference, name="chunked prefill")


def test_prefix_cache_second_run(llm, prompts, reference):
    assert llm.reset_prefix_cache()
    llm.generate(_requests(prompts), PARAMS)
    hits_before = llm.get_stats()["prefix_cache_hits"]
    second = llm.generate(_requests(prompts), PARAMS)
    assert all(o.num_cached_tokens > 0 for o in second)
    assert llm.get_stats()["prefix_cache_hits"] > hits_before
    check_greedy_close(ours_greedy(second), reference, name="prefix cache")


def test_preemption(prompts, reference):
    longest = max(len(p) for p in prompts) + MAX_NEW_TOKENS
    num_blocks = -(-longest // 16) + 4  # every request fits alone, the batch does not
    with LLM(dtype="float32", num_kv_blocks=num_blocks) as llm:
        outs = llm.generate(_requests(prompts), PARAMS)
        stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    check_greedy_close(ours_greedy(outs), reference, name="preemption")
