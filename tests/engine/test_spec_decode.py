"""Speculative decoding end to end on the embedded model (fp32, one rank).

Greedy outputs with the n-gram proposer, the early-exit draft and a separate draft model (the
embedded GGUF file loaded again with its own KV cache, 24 of its 30 layers) equal the
non-speculative outputs token for token (the tie-aware comparator of tests/utils.py); a draft
identical to the target (the separate model, all layers) accepts every draft, k + 1 tokens per
verify; a stop string, EOS (with and without ``min_tokens``), preemption and an abort between
scheduling and the verify forward cut exactly and leave every KV block free.
"""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from atom.config import EngineConfig
from atom.worker.embedded_model import embedded_gguf_path
from atom.engine.llm_engine import LLMEngine
from tests.utils import check_greedy_close, ours_greedy

K = 3
COMMON = dict(dtype="float32", num_kv_blocks=96, max_model_len=512, num_threads=1)
PROMPTS = [
    "Repeat this text exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "List the numbers from 1 to 20 separated by commas:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "The capital of France is",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, logprobs=5)


@pytest.fixture(scope="module")
def engines():
    built = {
        "base": LLM(**COMMON),
        "ngram": LLM(**COMMON, speculative_method="ngram", num_speculative_tokens=K),
        "draft": LLM(**COMMON, speculative_method="draft", num_speculative_tokens=K,
                     draft_num_layers=24),
        "draft_model": LLM(**COMMON, speculative_method="draft", num_speculative_tokens=K,
                           draft_model=str(embedded_gguf_path()), draft_num_layers=24),
        "target": LLM(**COMMON, speculative_method="draft", num_speculative_tokens=K,
                      draft_model=str(embedded_gguf_path())),
    }
    yield built
    for llm in built.values():
        llm.shutdown()


def _assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0


@pytest.mark.parametrize("method", ["ngram", "draft", "draft_model"])
def test_greedy_outputs_equal_non_speculative(engines, method):
    ref = ours_greedy(engines["base"].generate(PROMPTS, GREEDY))
    llm = engines[method]
    before = llm.get_stats()
    ours = ours_greedy(llm.generate(PROMPTS, GREEDY))
    check_greedy_close(ours, ref, name=f"spec {method}")
    stats = llm.get_stats()
    assert stats["spec_num_verifies"] > before["spec_num_verifies"]
    assert stats["spec_num_accepted_tokens"] > before["spec_num_accepted_tokens"]
    _assert_all_blocks_free(llm)


def test_draft_identical_to_target_accepts_every_draft(engines):
    llm = engines["target"]
    before = llm.get_stats()
    # the first token comes from the prefill, then verifies of exactly K drafts each
    params = SamplingParams(temperature=0.0, max_tokens=1 + 6 * (K + 1), ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    stats = {k: v - before.get(k, 0) for k, v in llm.get_stats().items() if k.startswith("spec_num")
             or k.startswith("spec_accepted_length")}
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    assert stats["spec_num_verifies"] == 6 * len(PROMPTS)
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] == 6 * K * len(PROMPTS)
    assert stats[f"spec_accepted_length_{K}"] == stats["spec_num_verifies"]
    assert stats["spec_num_emitted_tokens"] == (K + 1) * stats["spec_num_verifies"]
    assert llm.get_stats()["spec_acceptance_rate"] == 1.0
    _assert_all_blocks_free(llm)


def test_stop_string_inside_an_accepted_run_cuts_exactly(engines):
    prompt = PROMPTS[1]  # "1, 2, 3, ...": long accepted n-gram runs
    base = engines["base"].generate(prompt, SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert "7, 8" in base.outputs[0].text
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=["7, 8"])
    ref = engines["base"].generate(prompt, params)[0].outputs[0]
    for method in ("ngram", "target"):
        out = engines[method].generate(prompt, params)[0].outputs[0]
        assert (out.text, out.token_ids, out.finish_reason) == (ref.text, ref.token_ids, "stop")
        assert out.stop_reason == "7, 8"
        _assert_all_blocks_free(engines[method])


def test_eos_mid_run_and_min_tokens_cut_exactly(engines):
    conversation = [{"role": "user", "content": "What is 2 + 2? Reply with just the number."}]
    params = [SamplingParams(temperature=0.0, max_tokens=60, logprobs=5),
              SamplingParams(temperature=0.0, max_tokens=60, min_tokens=12, logprobs=5)]
    ref = engines["base"].chat([conversation, conversation], params)
    assert ref[0].outputs[0].finish_reason == "stop"  # EOS before max_tokens
    assert len(ref[0].outputs[0].token_ids) < 12 <= len(ref[1].outputs[0].token_ids)
    for method in ("ngram", "target"):
        outs = engines[method].chat([conversation, conversation], params)
        check_greedy_close(ours_greedy(outs), ours_greedy(ref), name=f"eos {method}")
        assert [o.outputs[0].finish_reason for o in outs] == [o.outputs[0].finish_reason for o in ref]
        _assert_all_blocks_free(engines[method])


def test_preemption_with_drafts_outstanding_leaks_nothing(engines):
    ref = ours_greedy(engines["base"].generate(PROMPTS, GREEDY))
    small = LLM(**{**COMMON, "num_kv_blocks": 9}, speculative_method="ngram",
                num_speculative_tokens=K)
    try:
        ours = ours_greedy(small.generate(PROMPTS, GREEDY))
        stats = small.get_stats()
        assert stats["num_preemptions"] > 0 and stats["spec_num_verifies"] > 0
        check_greedy_close(ours, ref, name="spec under preemption")
        _assert_all_blocks_free(small)
    finally:
        small.shutdown()


def test_abort_between_scheduling_and_verify_frees_the_draft_slots(engines):
    """A request aborted after its drafts were proposed and their slots reserved (schedule)
    but before the verify forward (execute): the step runs without it, its blocks are free,
    and the other request's tokens are the non-speculative ones."""
    engine = LLMEngine(EngineConfig(**COMMON, speculative_method="ngram",
                                    num_speculative_tokens=K))  # its core in this process
    core = engine.core
    tokenizer = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ref = engines["base"].generate(PROMPTS[:2], params)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"abort-{i}", tokenizer.encode(prompt), params)
    aborted = False
    outputs = {}
    for _ in range(200):
        if not core.has_work():
            break
        sched = core.schedule()
        victim = next((seq for seq, _ in sched.scheduled
                       if seq.request_id == "abort-0" and seq.seq_id in sched.spec_budget), None)
        if victim is not None and not aborted:
            assert len(victim.block_table) * core.block_manager.block_size >= \
                len(victim.token_ids) + len(victim.spec_token_ids)
            engine.abort_request("abort-0")
            aborted = True
        for out in engine.output_processor.process_outputs(core.execute(sched)).request_outputs:
            outputs[out.request_id] = out
    assert aborted
    assert list(outputs["abort-1"].outputs[0].token_ids) == list(ref[1].outputs[0].token_ids)
    assert "abort-0" not in outputs or not outputs["abort-0"].finished
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
    engine.shutdown()
