"""EPLB's clock, window and decision (dp/eplb/controller.py) and the replica rule
(dp/eplb/replicas.py, dp/eplb/expert_map.py), without processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atom.dp.eplb.controller import EplbController, initial_phy2log
from atom.dp.eplb.expert_map import ExpertMap
from atom.dp.eplb.plan import EplbPlan
from atom.dp.eplb.replicas import replica_split, replica_table


def controller(**overrides) -> EplbController:
    settings = dict(window_size=2, step_interval=5, min_balancedness=0.9, num_redundant=0,
                    num_layers=1, num_logical=4, num_ranks=2)
    return EplbController(**{**settings, **overrides})


def test_the_window_is_the_end_of_every_interval_and_every_step_counts():
    c = controller()
    recording, due = [], []
    for _ in range(10):
        recording.append(c.recording)
        due.append(c.end_step())
    assert recording == [False, False, False, True, True] * 2
    assert due == [False, False, False, False, True] * 2


def test_a_balanced_window_keeps_the_placement():
    c = controller()
    c.record(np.array([[5, 5, 5, 5]]))  # ranks 0 and 1 both get 10
    result = c.close_window(c.take_window())
    assert (result.balancedness, result.rebalanced, result.num_routed) == (1.0, False, 20)
    np.testing.assert_array_equal(c.plan.phy2log, initial_phy2log(1, 4, 4))
    assert c.take_window().sum() == 0  # taken: reset


def test_a_skewed_window_rebalances_on_the_summed_counts():
    ranks = [controller(), controller()]
    ranks[0].record(np.array([[9, 7, 1, 0]]))  # each rank counts its own tokens
    ranks[1].record(np.array([[1, 3, 0, 1]]))
    totals = sum(r.take_window() for r in ranks)  # the SUM all-reduce
    results = [r.close_window(totals) for r in ranks]
    assert results[0].balancedness == pytest.approx(11 / 20)  # rank 0: 20 of 22, rank 1: 2
    assert results[0].rebalanced and results[0].predicted_balancedness == pytest.approx(11 / 11)
    assert results[0].logical_load.tolist() == [[10, 10, 1, 1]]
    np.testing.assert_array_equal(ranks[0].plan.phy2log, ranks[1].plan.phy2log)
    assert {int(e) for e in ranks[0].plan.phy2log[0][:2]} in ({0, 2}, {0, 3}, {1, 2}, {1, 3})


def test_recording_only_measures_the_skewed_window_and_keeps_the_placement():
    ranks = [controller(rebalance=False), controller(rebalance=False)]
    ranks[0].record(np.array([[9, 7, 1, 0]]))  # the window that rebalances above
    ranks[1].record(np.array([[1, 3, 0, 1]]))
    totals = sum(r.take_window() for r in ranks)
    result = ranks[0].close_window(totals)
    assert result.balancedness == pytest.approx(11 / 20)
    assert not result.rebalanced and result.predicted_balancedness is None
    assert result.logical_load.tolist() == [[10, 10, 1, 1]] and ranks[0].num_rebalances == 0
    np.testing.assert_array_equal(ranks[0].plan.phy2log, initial_phy2log(1, 4, 4))


def test_recording_experts_that_do_not_divide_by_the_ranks_is_a_clear_error():
    with pytest.raises(ValueError, match="record_expert_load: 6 experts do not divide by the 4 "
                                         "ranks"):
        controller(num_logical=6, num_ranks=4, rebalance=False)


def test_no_rebalance_when_the_plan_predicts_nothing_better():
    c = controller()
    c.record(np.array([[0, 0, 8, 0]]))  # one hot expert, no redundant slot: nothing helps
    result = c.close_window(c.take_window())
    assert result.balancedness == 0.5 and not result.rebalanced and c.num_rebalances == 0


def test_a_placement_no_better_than_the_current_by_min_gain_is_kept():
    c = controller(min_balancedness=1.0)
    c.record(np.array([[100, 100, 99, 100]]))  # rank loads 200 / 199: the plan gains < 0.01
    result = c.close_window(c.take_window())
    assert result.balancedness < 1.0 and not result.rebalanced


def test_slots_that_do_not_divide_by_the_ranks_are_a_clear_error():
    with pytest.raises(ValueError, match="eplb_num_redundant_experts"):
        controller(num_redundant=1)


def test_a_replicated_experts_tokens_spread_over_its_replicas_by_token_index():
    phy2log = np.array([0, 0, 1, 2, 0, 3])  # rank 0: slots 0-2, rank 1: slots 3-5
    replicas, counts = replica_table(phy2log, num_logical=4)
    assert counts.tolist() == [3, 1, 1, 1]
    assert replicas.tolist() == [[0, 1, 4], [2, 2, 2], [3, 3, 3], [5, 5, 5]]
    split = replica_split(EplbPlan.from_phy2log(phy2log[None], 4))
    assert split[0, 0].tolist() == pytest.approx([1 / 3, 1 / 3, 0, 0, 1 / 3, 0])
    assert split[0].sum(axis=1).tolist() == [1.0] * 4


class _Dispatched:
    """The numbers ExpertMap reads of the expert-parallel dispatcher."""

    def __init__(self, rank: int, max_num_tokens: int, num_tokens: int):
        self.rank, self.world_size = rank, 2
        self._rows = (max_num_tokens, num_tokens)

    def computing_rows(self) -> tuple[int, int]:
        return self._rows


def test_the_map_applies_the_rule_and_counts_only_this_ranks_real_tokens():
    phy2log = np.array([0, 0, 1, 2, 0, 3])
    ids = torch.tensor([[0, 1]] * 3 + [[0, 3]] * 3)  # M = 3 rows per rank; rank 1 has T = 2
    slots = {}
    for rank in (0, 1):
        expert_map = ExpertMap(_Dispatched(rank, 3, 3 - rank), num_logical=4, num_physical=6)
        expert_map.set_placement(phy2log)
        expert_map.recording = True
        slots[rank] = expert_map.to_slots(ids)
        counts = expert_map.take_counts()
        mine = slots[rank][3 * rank:3 * rank + 3 - rank]  # its real tokens, not the padding
        assert counts.tolist() == torch.bincount(mine.flatten(), minlength=6).tolist()
        assert expert_map.take_counts().sum() == 0
    assert torch.equal(slots[0], slots[1])  # every rank routes every token the same way
    # expert 0 goes round its slots 0, 1, 4 by row; expert 1 lives in slot 2, expert 3 in 5
    assert slots[0].tolist() == [[0, 2], [1, 2], [4, 2], [0, 5], [1, 5], [4, 5]]


def test_fake_uniform_gives_every_expert_the_same_share():
    expert_map = ExpertMap(_Dispatched(0, 8, 8), num_logical=4, num_physical=4,
                           fake_uniform=True)
    expert_map.set_placement(np.arange(4))
    slots = expert_map.to_slots(torch.zeros(16, 2, dtype=torch.int64))
    assert torch.bincount(slots.flatten()).tolist() == [8, 8, 8, 8]
    assert (slots[:, 0] != slots[:, 1]).all()  # a token's choices stay distinct
