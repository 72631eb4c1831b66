"""P/D with hybrid KV cache groups (in-process engines, fp32): the tiny gpt-oss of
tests/moe_utils.py (sliding, full, sliding; a window of 8 tokens, blocks of 4, prompts up to
seven windows long) through the real TCP connector:

- the consumer's greedy tokens and top-5 logprobs equal transformers' (tie-aware), the
  producer prefilling in chunks of 16 tokens and the consumer hitting its own prefix cache
  (full and sliding blocks) for a prompt that extends an earlier one;
- the bytes moved are the full group's blocks and, of the sliding group, only the blocks of
  the consumer's first query's window; the consumer never holds a sliding block before its
  window, and every block is back on both sides after the requests finish and after an
  abort right after admission;
- a consumer whose layers group differently (every layer full) is refused in one line;
- a producer and a consumer of two expert-parallel DP ranks each give the same tokens.
"""

from __future__ import annotations

import time

import pytest

from atom.kv_cache_spec import first_block_in_window
from atom.messages import KVTransferParams
from atom.sampling_params import SamplingParams
from tests.entrypoints.pd_utils import run_engines
from tests.moe_utils import (GPT_OSS, assert_logprobs_close, build_tiny_gpt_oss,
                             engine_parity_prompts)
from tests.utils import check_greedy_close, hf_greedy, ours_greedy

BS = 4
WINDOW = GPT_OSS["sliding_window"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, ignore_eos=True)
#: bytes one token takes in one layer: K and V, 2 heads x 24, fp32
LAYER_TOKEN_BYTES = 2 * GPT_OSS["num_key_value_heads"] * GPT_OSS["head_dim"] * 4


def _engine(folder, **options):
    """An in-process engine, or with ``data_parallel_size`` one over real rank processes."""
    from atom.config import EngineConfig
    from atom.engine.llm_engine import LLMEngine
    from atom.entrypoints.llm import build_engine

    config = EngineConfig.from_kwargs(model=str(folder), dtype="float32", num_kv_blocks=96,
                                      block_size=BS, max_model_len=128,
                                      max_num_batched_tokens=16, num_threads=1,
                                      skip_tokenizer_init=True, **options)
    return build_engine(config) if config.data_parallel_size > 1 else LLMEngine(config)


def _check_windows(engine) -> None:
    """No sequence of ``engine`` holds a sliding block its next query cannot see."""
    scheduler = engine.core.scheduler
    seqs = [*scheduler.running, *scheduler.waiting_for_remote_kvs.values()]
    for seq in seqs:
        params = seq.kv_transfer_params
        num_tokens = (params.remote_num_tokens if params is not None and params.do_remote_prefill
                      else seq.num_computed_tokens)
        (table,) = seq.group_block_tables
        first = first_block_in_window(WINDOW, num_tokens, block_size=BS)
        assert all(b is None for b in table[:first]), (seq.seq_id, num_tokens, table)
        assert all(b is not None for b in table[first:]), (seq.seq_id, num_tokens, table)


def _prefill(producer, prompts, tag) -> tuple[list[KVTransferParams], list[dict[int, float]]]:
    """(each prompt's kv_transfer_params, the top-5 logprobs of its first token)."""
    first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)
    done = run_engines([producer], [(producer, f"{tag}{i}", p, first,
                              KVTransferParams(do_remote_decode=True))
                             for i, p in enumerate(prompts)])
    outs = [done[f"{tag}{i}"] for i in range(len(prompts))]
    return [o.kv_transfer_params for o in outs], [o.outputs[0].logprobs[0] for o in outs]


def _wait_all_free(engine) -> dict:
    deadline = time.monotonic() + 5.0  # liveness: the producer frees on the consumer's release
    while True:
        stats = engine.get_stats()
        if stats["num_free_blocks"] == stats["num_total_blocks"] or time.monotonic() > deadline:
            return stats
        if engine.core is not None:  # in process: an idle core still collects the connector's
            engine.core.step()       # results (rank processes do so in their own loops)
        time.sleep(0.01)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt-oss")
    hf_model = build_tiny_gpt_oss(folder)
    producer = _engine(folder, kv_role="producer")
    yield folder, hf_model, producer
    producer.shutdown()


def test_consumer_of_a_hybrid_model_matches_transformers(gpt_oss):
    folder, hf_model, producer = gpt_oss
    prompts = engine_parity_prompts()[:5]
    # 12 tokens (prompt 3) then 20 more: the consumer has prompt 3's full blocks and its
    # window's sliding blocks cached by then (a hybrid prefix hit of 12 tokens)
    prompts.append(prompts[3] + [(7 * i) % 500 + 3 for i in range(20)])
    reference = hf_greedy(hf_model, prompts, PARAMS.max_tokens)
    consumer = _engine(folder, kv_role="consumer")
    try:
        got, first_logprobs = {}, {}
        # round 1: no prefix hit on the consumer (the bytes are exact); round 2: a hit
        for tag, ids in (("a", range(5)), ("b", [5])):
            params, logprobs = _prefill(producer, [prompts[i] for i in ids], tag)
            first_logprobs.update(zip(ids, logprobs))
            bytes_before = consumer.get_stats()["kv_transfer_bytes"]
            done = run_engines([producer, consumer], [(consumer, f"d{i}", prompts[i], PARAMS, kv)
                                               for i, kv in zip(ids, params)],
                        check=_check_windows)
            got.update((i, done[f"d{i}"]) for i in ids)
            if tag == "a":
                moved = consumer.get_stats()["kv_transfer_bytes"] - bytes_before
        num_hits = consumer.get_stats()["prefix_cache_hits"]
        # an abort one step after admission (the pull in flight or just done: loopback is fast)
        (params,), _ = _prefill(producer, [prompts[0]], "x")
        consumer.add_request("aborted", prompts[0], PARAMS, kv_transfer_params=params)
        consumer.core.step()
        consumer.abort_request("aborted")
        stats = _wait_all_free(consumer)
    finally:
        consumer.shutdown()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    producer_stats = _wait_all_free(producer)
    assert producer_stats["num_free_blocks"] == producer_stats["num_total_blocks"], str(producer_stats)
    assert producer_stats["kv_kept_blocks"] == 0
    ours = ours_greedy([got[i] for i in range(len(prompts))])
    for i, result in enumerate(ours):  # the first token's logprobs are the producer's
        assert len(result.top_logprobs) == len(result.token_ids) - 1, result
        result.top_logprobs.insert(0, first_logprobs[i])
    check_greedy_close(ours, reference, name="tiny gpt-oss, P/D")
    assert_logprobs_close(ours, reference)
    # the full layer gets every prompt block, the two sliding layers the window's blocks only
    num_full = sum(-(-len(p) // BS) for p in prompts[:5])
    num_window = sum(-(-len(p) // BS) - first_block_in_window(WINDOW, len(p), block_size=BS)
                     for p in prompts[:5])
    assert moved == (num_full + 2 * num_window) * BS * LAYER_TOKEN_BYTES
    assert num_hits == 12


def test_a_consumer_grouped_differently_is_refused(gpt_oss, tmp_path):
    _, _, producer = gpt_oss
    build_tiny_gpt_oss(tmp_path, layer_types=["full_attention"] * 3)
    prompt = engine_parity_prompts()[0]
    (params,), _ = _prefill(producer, [prompt], "r")
    consumer = _engine(tmp_path, kv_role="consumer")
    try:
        out = run_engines([consumer], [(consumer, "d", prompt, PARAMS, params)])["d"]
    finally:
        consumer.shutdown()
    error = out.outputs[0].error
    assert out.outputs[0].finish_reason == "error", out
    assert "KV cache group" in error and "\n" not in error, error


def test_two_ep_ranks_on_each_side_match_transformers(gpt_oss):
    """The same transfer between a producer and a consumer of two expert-parallel DP ranks
    each (real rank processes; the router spreads the prompts, each consumer rank pulls from
    the producer rank that prefilled): tokens and top-5 logprobs as transformers', every
    block back on both sides."""
    folder, hf_model, _ = gpt_oss
    prompts = engine_parity_prompts()[:4]
    reference = hf_greedy(hf_model, prompts, PARAMS.max_tokens)
    dp = dict(data_parallel_size=2, enable_expert_parallel=True)
    producer = _engine(folder, kv_role="producer", **dp)
    try:
        consumer = _engine(folder, kv_role="consumer", **dp)
        try:
            params, first_logprobs = _prefill(producer, prompts, "p")
            done = run_engines([producer, consumer], [(consumer, f"d{i}", p, PARAMS, kv)
                                                      for i, (p, kv) in enumerate(zip(prompts, params))])
            consumer_stats = _wait_all_free(consumer)
        finally:
            consumer.shutdown()
        producer_stats = _wait_all_free(producer)
    finally:
        producer.shutdown()
    ours = ours_greedy([done[f"d{i}"] for i in range(len(prompts))])
    for result, logprobs in zip(ours, first_logprobs):  # the first token's are the producer's
        result.top_logprobs.insert(0, logprobs)
    check_greedy_close(ours, reference, name="tiny gpt-oss, P/D, DP 2 + EP")
    assert_logprobs_close(ours, reference)
    assert consumer_stats["kv_transfer_bytes"] > 0  # the prompts' KV came over the wire
    assert consumer_stats["num_free_blocks"] == consumer_stats["num_total_blocks"]
    assert producer_stats["num_free_blocks"] == producer_stats["num_total_blocks"]
