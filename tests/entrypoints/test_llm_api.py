"""Offline LLM API on the real embedded model: prompt forms, bad input, stats, lifecycle."""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams



@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=256, num_kv_blocks=12, block_size=16) as llm:
        yield llm


def test_prompt_forms_agree(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    ids = llm.get_tokenizer().encode("The capital of France is", add_special_tokens=False)
    a, b, c = llm.generate(["The capital of France is", ids, {"prompt_token_ids": ids}], params)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert a.prompt_token_ids == ids
    assert a.outputs[0].text and a.outputs[0].finish_reason == "length"
    assert len(a.outputs[0].token_ids) == 8


def test_bad_requests_fail_alone(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    good = "Hello there"
    too_long = list(range(100, 400))  # > max_model_len (256)
    too_big_for_pool = list(range(100, 100 + 12 * 16 + 5))  # more than the whole pool (12 blocks), under max_model_len
    outs = llm.generate(["", too_long, [5, 10**7], good, {"bogus": 1}, good], params)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons[:3] == ["error", "error", "error"]
    assert reasons[4] == "error"
    assert reasons[3] == reasons[5] == "length"
    assert "empty" in outs[0].outputs[0].error
    assert "max_model_len" in outs[1].outputs[0].error
    assert "vocabulary" in outs[2].outputs[0].error
    assert len(too_big_for_pool) < 256
    (big,) = llm.generate([too_big_for_pool], params)
    assert big.outputs[0].finish_reason == "error" and "KV blocks" in big.outputs[0].error
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("max_tokens", 0), ("top_k", -5), ("n", 0),
    ("logprobs", 100),
    # a wrong type is the same ValueError (a conversion raised TypeError for these once)
    ("stop", 5), ("stop_token_ids", 3), ("temperature", "hot"), ("top_p", None),
    ("logit_bias", [1]), ("logit_bias", {"x": 1.0}), ("logit_bias", {1: "a"}),
    ("max_tokens", True), ("seed", 1.5)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_engine_option_is_an_error():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)


def test_stats_keys(llm):
    assert set(llm.get_stats()) == {"num_free_blocks", "num_total_blocks", "kv_cache_bytes",
                                    "kv_cache_bytes_per_token", "num_running", "num_waiting",
                                    "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
                                    "prefix_cache_hit_rate", "num_aborted_seqs",
                                    "num_front_end_finished_seqs", "rank_failures_dead",
                                    "rank_failures_hung", "rank_recoveries",
                                    "recovery_seconds_total", "recovery_seconds_last", "dp_size",
                                    "generation", "num_resumed_requests",
                                    "num_unresumed_requests"}


def test_shutdown_is_final():
    llm = LLM(num_kv_blocks=8)
    llm.shutdown()
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("hi")


def test_reset_prefix_cache_makes_the_next_prompt_cold(llm):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    prompt = list(range(100, 100 + 3 * 16 + 4))  # three full blocks

    def hits_of_one_run() -> int:
        before = llm.get_stats()["prefix_cache_hits"]
        llm.generate([prompt], params)
        return llm.get_stats()["prefix_cache_hits"] - before

    hits_of_one_run()
    assert hits_of_one_run() == 3 * 16  # the three full blocks came from the cache
    assert llm.reset_prefix_cache() is True
    assert hits_of_one_run() == 0
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_the_front_end_process_never_imports_torch():
    """A real LLM over its spawned engine-core process (tokenizer, chat template, generation,
    detokenization, a structured output's grammar check) leaves torch out of the front end's own process: only the core loads it
    (docs/ARCHITECTURE.md, "The map"; tests/test_layering.py checks the imports statically)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from atom import LLM, SamplingParams\n"
        "with LLM(max_model_len=128, num_kv_blocks=8, block_size=16) as llm:\n"
        "    out = llm.chat([{'role': 'user', 'content': 'Hi'}],\n"
        "                   SamplingParams(temperature=0.0, max_tokens=2))\n"
        "    assert out[0].outputs[0].text, out\n"
        "    out = llm.generate('Yes or no?', SamplingParams(max_tokens=4, structured_outputs="
        "{'choice': ['yes', 'no']}))\n"  # the grammar check runs here (llguidance, no torch)
        "    assert out[0].outputs[0].text in ('yes', 'no'), out\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
