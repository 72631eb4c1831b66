"""Qwen3-MoE under DP = 2 with expert parallelism and two-batch overlap (real gloo ranks, fp32).

The tiny Qwen3-MoE of tests/moe_utils.py (a dense middle layer, local to each rank: no
collective) with its experts split over two ranks, each rank reading only its own from the
checkpoint: greedy tokens and top-5 logprobs equal one rank's (and transformers'), with every
request on rank 0 (rank 1 steps dummy batches through every MoE collective) and spread over both;
prefill steps split into two micro-batches (TBO), decode steps unsplit; both ranks issue the
same collectives.
"""

from __future__ import annotations

import pytest

from tests.moe_utils import build_tiny_qwen3, one_rank_and_transformers, run_on_two_ep_ranks
from tests.utils import check_greedy_close


@pytest.fixture(scope="module")
def folder_and_references(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-moe")
    return (folder, *one_rank_and_transformers(folder, build_tiny_qwen3(folder)))


def test_experts_over_two_ranks_with_tbo_match_one_rank(folder_and_references):
    folder, prompts, one_rank, transformers = folder_and_references
    check_greedy_close(one_rank, transformers, name="tiny qwen3_moe, one rank")
    stats = run_on_two_ep_ranks(folder, prompts, enable_tbo=True, name="tiny qwen3_moe",
                                reference=one_rank)
    assert stats[1]["num_dummy_steps"] > 0  # rank 1 stepped dummy batches while pinned
    # prefills split into micro-batches, decodes not: both forms ran under EP
    assert 0 < stats[0]["num_tbo_steps"] < stats[0]["num_steps"]
