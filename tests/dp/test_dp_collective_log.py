"""The collective log (hash, history, lockstep record) and the ban on pickling collectives."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from atom.dp.collective_log import (
    HISTORY_LEN,
    LOCKSTEP_RECORD_LEN,
    CollectiveLog,
    CollectiveOp,
    CollectiveRecord,
    decode_lockstep_record,
    format_histories,
)

REPO = Path(__file__).resolve().parents[2]
SEQUENCE = [(CollectiveOp.ALL_GATHER, torch.int64, 11), (CollectiveOp.ALL_REDUCE, torch.float32, 8),
            (CollectiveOp.ALL_TO_ALL, torch.bfloat16, 576), (CollectiveOp.BARRIER, None, 0)]


def logged(sequence) -> CollectiveLog:
    log = CollectiveLog()
    for op, dtype, numel in sequence:
        log.record(op, dtype, numel)
    return log


def test_equal_sequences_equal_hashes_any_change_differs():
    a, b = logged(SEQUENCE), logged(SEQUENCE)
    assert (a.num_collectives, a.hash) == (b.num_collectives, b.hash) == (4, a.hash)
    assert a.hash != 0
    variants = [
        SEQUENCE[1:],  # skipped one
        SEQUENCE[:1] + SEQUENCE[2:3] + SEQUENCE[1:2] + SEQUENCE[3:],  # same ops, other order
        [(op, torch.float16 if dt is torch.float32 else dt, n) for op, dt, n in SEQUENCE],
        [(op, dt, n + 1 if op is CollectiveOp.ALL_REDUCE else n) for op, dt, n in SEQUENCE],
    ]
    for variant in variants:
        assert logged(variant).hash != a.hash


def test_hash_int64_has_the_same_bits():
    log = logged(SEQUENCE * 3)
    assert -(2**63) <= log.hash_int64 < 2**63
    assert log.hash_int64 & (2**64 - 1) == log.hash


def test_history_is_bounded_and_counts_per_op():
    log = logged(SEQUENCE * 40)
    assert log.num_collectives == 160
    assert len(log.history) == HISTORY_LEN
    assert log.history[-1] == CollectiveRecord(CollectiveOp.BARRIER, 0, 0)
    assert log.op_counts == {"all_gather": 40, "all_reduce": 40, "all_to_all": 40, "barrier": 40}


def test_unknown_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="_DTYPE_CODES"):
        CollectiveLog().record(CollectiveOp.ALL_REDUCE, torch.complex64, 1)


@pytest.mark.parametrize("num_records", [0, 3, 200])
def test_lockstep_record_round_trip(num_records):
    log = logged((SEQUENCE * 50)[:num_records])
    rec = log.lockstep_record()
    assert rec.dtype == torch.int64 and rec.shape == (LOCKSTEP_RECORD_LEN,)
    assert decode_lockstep_record(rec) == log.snapshot()
    assert decode_lockstep_record(rec.numpy()[::-1].copy()) is None  # no magic word


def test_format_histories_marks_the_first_difference():
    full = logged(SEQUENCE * 20)  # rank 0: 80 collectives
    skipped = logged(SEQUENCE * 10 + SEQUENCE[1:] + SEQUENCE * 9)  # rank 1 skipped #40
    text = format_histories({0: full.snapshot(), 1: skipped.snapshot(), 2: None})
    lines = text.splitlines()
    assert lines[0].startswith("  rank 0: 80 collectives, hash 0x")
    assert lines[1].startswith("  rank 1: 79 collectives, hash 0x")
    assert lines[2].startswith("  rank 2: no history")
    marked = [line for line in lines if line.startswith("  !")]
    assert len(marked) == 1
    assert marked[0].split()[1] == "#40"
    assert "all_gather int64[11]" in marked[0] and "all_reduce float32[8]" in marked[0]
    assert any("all_to_all bfloat16[*,576]" in line for line in lines)


def _calls_named(path: Path, suffix: str) -> list[str]:
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", "")
            if name.endswith(suffix):
                hits.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}(...)")
    return hits


def test_a_sigterm_ends_a_post_mortem_waiting_for_a_dead_peer():
    """A rank whose collective failed because its peer died waits in the store for the peer's
    history; the launcher's SIGTERM (whose handler detaches the store) ends that wait at once,
    instead of the rank sitting there until the launcher's SIGKILL."""
    import datetime
    import signal
    import time

    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    log = logged(SEQUENCE)
    log.attach_store(store, rank=0, world_size=2, group_timeout_s=30.0)  # waits up to 35 s
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: log.detach_store())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        start = time.monotonic()
        histories = log.post_mortem()
        waited_s = time.monotonic() - start
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert histories[0] is not None and histories[1] is None  # the dead peer never reported
    assert waited_s < 10.0, waited_s  # liveness bound (the wait itself is 35 s)


def test_no_object_collectives_anywhere():
    """``*_object`` collectives pickle (docs/ARCHITECTURE.md bans pickle across ranks): none may be called."""
    files = [p for folder in ("atom", "dp", "launch", "kernels")
             for p in (REPO / folder).rglob("*.py")]
    assert any(p.name == "collectives.py" for p in files)  # the scan sees dp/
    hits = [hit for p in files for hit in _calls_named(p, "_object")]
    assert not hits, "pickling collectives found:\n" + "\n".join(hits)
