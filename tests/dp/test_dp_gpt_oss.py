"""gpt-oss under DP = 2 with expert parallelism and two-batch overlap (real gloo ranks, fp32).

The tiny gpt-oss of tests/moe_utils.py (sinks, a sliding window of 8 tokens in layers 0 and 2,
YaRN, a router with a bias, clamped SwiGLU experts with biases) with its experts split over two
ranks, each rank reading only its own from the checkpoint, under the coalescer prefill policy
and cache-aware routing (fed by every rank's KV events): greedy tokens and top-5 logprobs equal
one rank's (and one rank's equal transformers'), with every request on rank 0 (rank 1 steps
dummy batches through every MoE collective) and spread over both; prefill steps split into two
micro-batches (TBO), decode steps unsplit; both ranks issue the same collectives. On two KV
cache groups (full, sliding) with blocks of 4 tokens, a pool small enough that rank 0 preempts
when it holds every request, prefills in chunks of 16 tokens, and the spread run hitting the
prefix cache the first run filled.
"""

from __future__ import annotations

import pytest

from tests.moe_utils import build_tiny_gpt_oss, one_rank_and_transformers, run_on_two_ep_ranks
from tests.utils import check_greedy_close


@pytest.fixture(scope="module")
def folder_and_references(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt-oss")
    return (folder, *one_rank_and_transformers(folder, build_tiny_gpt_oss(folder)))


def test_experts_over_two_ranks_with_tbo_match_one_rank(folder_and_references):
    folder, prompts, one_rank, transformers = folder_and_references
    assert max(map(len, prompts)) > 8  # past the window
    check_greedy_close(one_rank, transformers, name="tiny gpt-oss, one rank")
    stats = run_on_two_ep_ranks(folder, prompts, enable_tbo=True, name="tiny gpt-oss",
                                reference=one_rank, prefill_policy="coalescer",
                                dp_load_balance="cache_aware", block_size=4, num_kv_blocks=40,
                                max_num_batched_tokens=16)
    assert stats[0]["num_preemptions"] > 0  # rank 0 alone could not hold every request
    assert sum(s["prefix_cache_hits"] for s in stats) > 0
    assert stats[1]["num_dummy_steps"] > 0  # rank 1 stepped dummy batches while pinned
    # prefills split into micro-batches, decodes not: both forms ran under EP
    assert 0 < stats[0]["num_tbo_steps"] < stats[0]["num_steps"]
    assert stats[0]["prefill_policy_num_decisions"] > 0
    assert all(s["kv_events_published_batches"] > 0 for s in stats)
