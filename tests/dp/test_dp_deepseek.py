"""DeepSeek-V3 and DeepSeek-V2 under DP = 2 with expert parallelism, two-batch overlap on and
off (real gloo ranks, fp32).

The tiny models of tests/moe_utils.py (a dense first layer, one shared expert per MoE layer:
both local to each rank, no collective; MLA with the latent cache on every rank) with their
routed experts split over two ranks: greedy tokens and top-5 logprobs equal one rank's (and
transformers'), with every request on rank 0 (rank 1 steps dummy batches through every MoE
collective) and spread over both; both ranks issue the same collectives.
"""

from __future__ import annotations

import pytest

from tests.moe_utils import build_tiny_deepseek, one_rank_and_transformers, run_on_two_ep_ranks
from tests.utils import check_greedy_close


@pytest.fixture(scope="module", params=[True, False], ids=["deepseek_v3", "deepseek_v2"])
def references(request, tmp_path_factory):
    """(name, folder, prompts, their greedy on one rank, in transformers), built once per
    family."""
    name = "tiny deepseek_v3" if request.param else "tiny deepseek_v2"
    folder = tmp_path_factory.mktemp(name.replace(" ", "-"))
    return (name, folder, *one_rank_and_transformers(
        folder, build_tiny_deepseek(folder, v3=request.param)))


@pytest.mark.parametrize("enable_tbo", [True, False], ids=["tbo", "no_tbo"])
def test_experts_over_two_ranks_match_one_rank(references, enable_tbo):
    name, folder, prompts, one_rank, transformers = references
    check_greedy_close(one_rank, transformers, name=f"{name}, one rank")
    stats = run_on_two_ep_ranks(folder, prompts, enable_tbo=enable_tbo, name=name,
                                reference=one_rank)
    assert stats[1]["num_dummy_steps"] > 0  # rank 1 stepped dummy batches while pinned
    if enable_tbo:  # prefills split into micro-batches, decodes not
        assert 0 < stats[0]["num_tbo_steps"] < stats[0]["num_steps"]
    else:
        assert stats[0]["num_tbo_steps"] == 0
