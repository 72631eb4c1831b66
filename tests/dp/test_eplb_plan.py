"""EPLB's placement plan (dp/eplb/plan.py) on hand-made loads with known best balancedness."""

from __future__ import annotations

import numpy as np
import pytest

from atom.dp.eplb.plan import (EplbPlan, balanced_packing, balancedness, rank_loads, rebalance,
                               replicate_experts)


def test_balanced_packing_puts_the_heaviest_first_on_the_lightest_pack_with_room():
    pack, position = balanced_packing(np.array([9, 7, 6, 5, 3, 2]), 2)
    # 9 -> p0; 7 -> p1; 6 -> p1 (7 < 9); 5 -> p0 (9 < 13); 3 -> p1 (13 < 14; then full); 2 -> p0
    assert pack.tolist() == [0, 1, 1, 0, 1, 0]
    assert position.tolist() == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="pack evenly"):
        balanced_packing(np.ones(5), 2)


def test_replication_gives_each_redundant_slot_to_the_largest_load_per_replica():
    phy2log, logcnt = replicate_experts(np.array([8.0, 3.0, 5.0]), 6)
    # 8 -> slot 3 (8/1); then 5 (4 < 5) -> slot 4; then 8/2 = 4 > 3 and > 5/2 -> slot 5
    assert phy2log.tolist() == [0, 1, 2, 0, 2, 0]
    assert logcnt.tolist() == [3, 1, 2]


def test_zero_load_keeps_the_contiguous_placement():
    plan = rebalance(np.zeros((2, 8), dtype=np.int64), num_physical=8, num_ranks=2)
    np.testing.assert_array_equal(plan.phy2log, EplbPlan.identity(2, 8).phy2log)


def test_replacement_alone_balances_hot_experts_that_start_on_one_rank():
    load = np.array([[10, 10, 1, 1], [0, 5, 5, 0]])  # layer 0: both hot experts on rank 0
    before = balancedness(rank_loads(load, EplbPlan.identity(2, 4), 2))
    assert before == pytest.approx((11 + 5) / (20 + 5))
    plan = rebalance(load, num_physical=4, num_ranks=2)
    assert balancedness(rank_loads(load, plan, 2)) == 1.0
    assert sorted(plan.phy2log[0].tolist()) == [0, 1, 2, 3]  # no replicas: a permutation
    assert {int(plan.phy2log[0][0]), int(plan.phy2log[0][2])} == {0, 1}  # one hot expert a rank


def test_a_single_hot_expert_needs_replicas():
    load = np.array([[120, 0, 0, 0]])
    placed = rebalance(load, num_physical=4, num_ranks=2)
    # re-placement cannot split one expert's tokens: one rank takes everything
    assert balancedness(rank_loads(load, placed, 2)) == 0.5
    replicated = rebalance(load, num_physical=8, num_ranks=2)  # 4 redundant slots
    assert replicated.logcnt[0].tolist() == [5, 1, 1, 1]
    assert balancedness(rank_loads(load, replicated, 2)) == pytest.approx(60 / 72)
    np.testing.assert_array_equal(np.sort(replicated.log2phy[0, 0]), replicated.log2phy[0, 0])
    for slot in replicated.log2phy[0, 0]:
        assert replicated.phy2log[0, slot] == 0


def test_hierarchical_mode_keeps_each_group_on_one_node():
    rng = np.random.default_rng(0)
    load = rng.integers(0, 1000, size=(3, 16))
    plan = rebalance(load, num_physical=20, num_ranks=4, num_groups=4, num_nodes=2)
    for layer in range(3):
        assert (plan.logcnt[layer] >= 1).all() and plan.logcnt[layer].sum() == 20
        for node in range(2):
            groups = {int(e) // 4 for e in plan.phy2log[layer, node * 10:(node + 1) * 10]}
            assert len(groups) == 2, groups  # two whole groups of 4 experts per node
    again = rebalance(load.copy(), num_physical=20, num_ranks=4, num_groups=4, num_nodes=2)
    np.testing.assert_array_equal(again.phy2log, plan.phy2log)  # deterministic
    # groups that do not divide by the nodes: global mode, still a valid plan
    odd = rebalance(load, num_physical=20, num_ranks=4, num_groups=2, num_nodes=4)
    assert (odd.logcnt >= 1).all()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        rebalance(np.ones((1, 8)), num_physical=9, num_ranks=2)
    with pytest.raises(ValueError, match="no physical slot"):
        EplbPlan.from_phy2log(np.array([[0, 0, 1]]), 3)
