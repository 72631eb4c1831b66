"""Expert parallelism on 2 real DP ranks (gloo), fp32.

Model (a): the embedded SmolLM2 with every MLP split into 4 experts (all routed, gate 1) —
greedy text equal to the dense model on one rank, including a run where every request is pinned
to rank 0 (rank 1 steps dummy batches through every MoE collective), with equal collective
hashes on both ranks after it. Model (b): a tiny random Mixtral (top-2 of 8) — greedy tokens
and their logprobs equal transformers' with its experts split over the two ranks, with and
without two-batch overlap, after an uneven workload too, with equal collective hashes.
"""

from __future__ import annotations

import pytest

from atom import LLM
from tests.moe_utils import (OPTIONS, PARAMS, PROMPTS, build_tiny_mixtral, idle_rank_stats,
                             run_on_two_ep_ranks, tiny_prompts)
from tests.utils import check_greedy_close, hf_greedy, ours_greedy


@pytest.fixture(scope="module")
def dense_reference():
    with LLM(**OPTIONS) as llm:
        return ours_greedy(llm.generate(PROMPTS, PARAMS))


def test_split_experts_on_two_ranks_equal_the_dense_model(dense_reference):
    with LLM(**OPTIONS, moe_split_experts=4, data_parallel_size=2,
             enable_expert_parallel=True) as llm:
        pinned = ours_greedy(llm.generate(PROMPTS, PARAMS, data_parallel_rank=0))
        check_greedy_close(pinned, dense_reference, name="model (a), EP, rank 1 idle")
        stats = idle_rank_stats(llm)
        assert stats[1]["num_dummy_steps"] == stats[1]["num_steps"] > 0  # never had work
        assert stats[0]["collective_hash"] == stats[1]["collective_hash"]
        assert stats[0]["collective_count"] == stats[1]["collective_count"]
        spread = ours_greedy(llm.generate(PROMPTS, PARAMS))
        check_greedy_close(spread, dense_reference, name="model (a), EP, both ranks")
        stats = idle_rank_stats(llm)
        assert stats[0]["collective_hash"] == stats[1]["collective_hash"]


@pytest.mark.parametrize("enable_tbo", [False, True], ids=["unsplit", "tbo"])
def test_tiny_mixtral_experts_over_two_ranks_match_transformers(tmp_path, enable_tbo):
    model = build_tiny_mixtral(tmp_path)
    prompts = tiny_prompts()
    stats = run_on_two_ep_ranks(tmp_path, prompts, enable_tbo=enable_tbo, name="tiny mixtral",
                                reference=hf_greedy(model, prompts, 12), one_at_a_time=enable_tbo)
    assert (stats[0]["num_tbo_steps"] > 0) == enable_tbo
