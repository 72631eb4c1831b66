"""EPLB's manager on two real gloo ranks (``dp_worker.py``'s ``eplb`` scenario): two MoE layers
(float32 with its experts fused where the kernel runs, and bfloat16 on oneDNN-packed linears) whose expert weights are a function of
(layer, logical expert), loaded as contiguous shards; forwards of a batch skewed onto experts
4 and 5 (both on rank 0) through the expert-parallel dispatcher; a window, a rebalance with 4
redundant slots, another window.

After the start-up move (to the initial placement with its redundant slots) and after the
rebalance, every slot of every rank holds exactly its logical expert's weights (so all
replicas are equal); the same batch's outputs do not change across the rebalance; both ranks
hold the same placement and issued the same collectives (moves included)."""

from __future__ import annotations

import torch

from atom.kernels.moe import fused_moe_applies
from tests.dp.test_dp_multiproc import run_ranks


def test_a_rebalance_moves_every_slot_to_its_expert_and_changes_no_output(tmp_path):
    ranks = run_ranks("eplb", tmp_path)
    for r in ranks:
        assert r["error_type"] is None, r.get("error")
        assert r["checks"] == {"after_start": True, "after_rebalance": True}
        before, after = r["windows"]
        assert before["balancedness"] == 0.5 and before["rebalanced"]  # both hot experts on rank 0
        assert before["load"] == [[0, 0, 0, 0, 30, 30, 0, 0]] * 2  # 15 tokens x top-2 x 2 steps
        assert after["balancedness"] == 1.0 and not after["rebalanced"]
        assert max(r["max_output_change"]) == 0.0
        assert r["stats"]["eplb_num_rebalances"] == 1
        for layer in r["phy2log"]:
            assert sorted(set(layer)) == list(range(8)) and len(layer) == 12
            assert layer.count(4) + layer.count(5) == 6  # the redundant slots went to 4 and 5
        assert r["fused_rows_are_the_experts"] == [True, True]
        assert r["fused"] == [fused_moe_applies(torch.float32), False]
    assert ranks[0]["phy2log"] == ranks[1]["phy2log"]
    assert [r["local_slots"] for r in ranks] == [[[0, 6], [0, 6]], [[6, 6], [6, 6]]]
    assert ranks[0]["all_to_alls"] == ranks[1]["all_to_alls"] == 4  # 2 layers: start-up, rebalance
    assert sum(r["stats"]["eplb_last_move_bytes"] for r in ranks) > 0
