"""Speculative decoding on 2 real DP ranks with expert parallelism (gloo, fp32).

The embedded model with every MLP split into 4 experts (model (a): the dense model's function)
with the n-gram proposer and with the early-exit draft (whose own forwards run MoE layers, so
every rank runs the same number of them, agreed in the batch-shape exchange): greedy outputs equal the dense non-speculative model on one rank, first
with every request pinned to rank 0 (rank 1 runs dummy batches through every MoE collective
while rank 0's verify forwards carry k + 1 tokens per sequence: the batch shape's token count
includes the drafts, and the padded collectives size to it), then spread over both ranks; the
collective hashes agree, spec steps are counted for the group and the per-tick trace carries
each rank's draft tokens.
"""

from __future__ import annotations

import pytest

from atom import LLM
from atom.dp.dp_trace import read_trace
from tests.moe_utils import OPTIONS, PARAMS, PROMPTS, idle_rank_stats
from tests.utils import check_greedy_close, ours_greedy


@pytest.fixture(scope="module")
def dense_reference():
    with LLM(**OPTIONS) as llm:
        return ours_greedy(llm.generate(PROMPTS, PARAMS))


SPEC = {"ngram": dict(speculative_method="ngram", num_speculative_tokens=3),
        # the early-exit draft's forwards run MoE layers too: every rank runs as many (the
        # idle one on zero tokens), agreed in the batch-shape exchange
        "draft": dict(speculative_method="draft", num_speculative_tokens=3, draft_num_layers=20)}


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_on_two_ep_ranks_with_an_idle_rank(dense_reference, tmp_path, method):
    with LLM(**OPTIONS, moe_split_experts=4, data_parallel_size=2, enable_expert_parallel=True,
             **SPEC[method], dp_trace=str(tmp_path)) as llm:
        pinned = ours_greedy(llm.generate(PROMPTS, PARAMS, data_parallel_rank=0))
        check_greedy_close(pinned, dense_reference, name=f"spec {method}, EP, rank 1 idle")
        stats = idle_rank_stats(llm)
        assert stats[1]["num_dummy_steps"] == stats[1]["num_steps"] > 0
        assert stats[0]["spec_num_accepted_tokens"] > 0 and stats[1]["spec_num_verifies"] == 0
        assert stats[0]["num_spec_steps"] == stats[1]["num_spec_steps"] == stats[0]["spec_num_verify_steps"]
        assert stats[0]["collective_hash"] == stats[1]["collective_hash"]
        assert stats[0]["collective_count"] == stats[1]["collective_count"]
        spread = ours_greedy(llm.generate(PROMPTS, PARAMS))
        check_greedy_close(spread, dense_reference, name=f"spec {method}, EP, both ranks")
        stats = idle_rank_stats(llm)
        assert stats[1]["spec_num_verifies"] > 0
        assert stats[0]["collective_hash"] == stats[1]["collective_hash"]
        for s in stats:
            assert s["num_free_blocks"] == s["num_total_blocks"]
    rank0, rank1 = (t.rows for t in read_trace(tmp_path))  # the trace counts the drafts per rank
    assert sum(row["step_num_spec_tokens"] for row in rank0) == stats[0]["spec_num_draft_tokens"]
    assert sum(row["step_num_spec_tokens"] for row in rank1) == stats[1]["spec_num_draft_tokens"]
