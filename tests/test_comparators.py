"""The shared comparators of tests/utils.py can fail: the greedy comparator's tie cap and the
tolerances derived from the dtype and the reduction length."""

from __future__ import annotations

import pytest
import torch

from tests.utils import (GreedyResult, assert_sums_close, check_greedy_close, sum_tolerance,
                         unit_roundoff)


REF_TOKENS = [1, 2, 3, 4]


def _seq(tokens: list[int]) -> GreedyResult:
    """Each step's top-k: the greedy token, 99 and the reference's token at that step (so a swap
    of the reference's token and 99 is a tie on both sides)."""
    return GreedyResult(tokens, [{t: -0.1, 99: -0.2, r: -0.3} for t, r in zip(tokens, REF_TOKENS)])


def _ref(num: int) -> list[GreedyResult]:
    return [_seq(REF_TOKENS) for _ in range(num)]


def test_equal_sequences_have_no_tie():
    assert check_greedy_close(_ref(4), _ref(4), name="equal") == 0


def test_one_tie_in_four_sequences_passes_after_the_first_token():
    ours = _ref(4)
    ours[2] = _seq([1, 2, 99, 7])  # the runner-up at token 2, then anything
    assert check_greedy_close(ours, _ref(4), name="one tie") == 1


def test_more_ties_than_a_quarter_of_the_sequences_fail():
    ours = _ref(4)
    ours[0], ours[3] = _seq([1, 99, 5, 6]), _seq([1, 2, 99, 8])
    with pytest.raises(AssertionError, match=r"2 of 4 sequences ended on a rounding tie"):
        check_greedy_close(ours, _ref(4), name="two ties")
    assert check_greedy_close(ours, _ref(4), name="two ties", max_tie_fraction=0.5) == 2
    # ceil: one tie is allowed in up to four sequences, two in five to eight
    assert check_greedy_close(ours + _ref(1), _ref(5), name="two ties in five") == 2


def test_a_tie_at_the_first_token_fails_unless_allowed():
    ours = _ref(4)
    ours[1] = _seq([99, 2, 3, 4])
    with pytest.raises(AssertionError, match="first output token"):
        check_greedy_close(ours, _ref(4), name="first token")
    assert check_greedy_close(ours, _ref(4), name="first token", allow_first_token_tie=True) == 1


def test_a_token_outside_the_other_top_k_fails():
    ours = _ref(1)
    ours[0] = _seq([1, 2, 5, 4])  # 5 is not in the reference's top-k
    with pytest.raises(AssertionError, match="not a tie"):
        check_greedy_close(ours, _ref(1), name="diverged")


def test_sum_tolerance_scales_with_sqrt_n_the_paths_and_the_dtype():
    tol = sum_tolerance(torch.float32, reduction_len=256, magnitude=58.3, num_paths=2)
    assert tol["atol"] == pytest.approx(2 * 8 * 16 * 2.0 ** -24 * 58.3)  # issue 49's case
    assert tol["rtol"] == 2 * 2.0 ** -24
    assert sum_tolerance(torch.bfloat16, reduction_len=256, magnitude=58.3,
                         num_paths=2)["atol"] == tol["atol"]  # float32 sums either way
    assert unit_roundoff(torch.bfloat16) == 2.0 ** -8
    one = sum_tolerance(torch.float32, reduction_len=64, magnitude=1.0)["atol"]
    assert sum_tolerance(torch.float32, reduction_len=256, magnitude=1.0)["atol"] == 2 * one
    with pytest.raises(ValueError, match="could not catch"):  # 2^23 terms: 8 sqrt(n) u > 1e-3
        sum_tolerance(torch.float32, reduction_len=2 ** 23, magnitude=1.0)


def test_assert_sums_close_catches_a_value_off_by_a_thousandth():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 256, generator=gen), torch.randn(300, 256, generator=gen)
    exact = x.double() @ w.double().T
    out = x @ w.T
    assert_sums_close(out, exact, reduction_len=256)
    out[4, 7] += 1e-3 * float(exact.abs().max())
    with pytest.raises(AssertionError, match="sums of 256 terms"):
        assert_sums_close(out, exact, reduction_len=256)
