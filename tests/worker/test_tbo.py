"""The two-batch-overlap executor and batch split (no processes: fake sequences and handles)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from atom.core.tbo_split import can_split, split_batch
from atom.worker.tbo import run_interleaved


@dataclass(eq=False)
class FakeSeq:
    is_prefill: bool = True


def test_split_by_requests_halves_the_tokens():
    a, b, c, d = FakeSeq(), FakeSeq(), FakeSeq(), FakeSeq()
    first, second = split_batch([(a, 10), (b, 30), (c, 25), (d, 5)])
    assert [(s, o, n) for s, o, n in first] == [(a, 0, 10), (b, 0, 30)]
    assert [(s, o, n) for s, o, n in second] == [(c, 0, 25), (d, 0, 5)]
    first, second = split_batch([(a, 100), (b, 1)])  # each side keeps a request
    assert len(first) == 1 and len(second) == 1


def test_one_request_splits_at_the_token_midpoint():
    seq = FakeSeq()
    assert split_batch([(seq, 7)]) == ([(seq, 0, 3)], [(seq, 3, 4)])
    assert split_batch([]) == ([], [])
    with pytest.raises(ValueError, match="cannot be split"):
        split_batch([(seq, 1)])


def test_eligibility():
    prefill, decode = FakeSeq(True), FakeSeq(False)
    assert can_split([])  # a dummy batch splits into two empty ones
    assert can_split([(prefill, 2)]) and not can_split([(prefill, 1)])
    assert can_split([(prefill, 5), (decode, 1)])
    assert not can_split([(decode, 1), (FakeSeq(False), 1)])  # decode steps: not by default
    assert can_split([(decode, 1), (FakeSeq(False), 1)], prefill_only=False)


class Handle:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(f"wait {self.name}")


def _program(log, mb, num_layers):
    for layer in range(num_layers):
        log.append(f"attn {mb}{layer}")
        log.append(f"dispatch {mb}{layer}")
        yield Handle(log, f"dispatch {mb}{layer}")
        log.append(f"experts {mb}{layer}")
        log.append(f"combine {mb}{layer}")
        yield Handle(log, f"combine {mb}{layer}")
    log.append(f"done {mb}")


def test_collectives_of_one_micro_batch_overlap_the_others_compute():
    log: list[str] = []
    run_interleaved([_program(log, "a", 2), _program(log, "b", 2)])
    collectives = [e for e in log if e.startswith(("dispatch", "combine"))]
    assert collectives == ["dispatch a0", "dispatch b0", "combine a0", "combine b0",
                           "dispatch a1", "dispatch b1", "combine a1", "combine b1"]
    # b's attention runs while a's dispatch is in flight; a waits only when resumed
    assert log.index("attn b0") < log.index("wait dispatch a0") < log.index("experts a0")
    assert log[-4:] == ["wait combine a1", "done a", "wait combine b1", "done b"]
