"""How a step's batch splits into TBO's two micro-batches, and whether it may: the torch-free
rules that the engine core (eligibility), the model runner (:mod:`atom.worker.tbo`: the
overlapped forward) and the simulator's cost model share.

A batch splits by requests when it has at least two (the token counts as even as the request
boundaries allow), else a single request's new tokens at their midpoint (the second half
attends to the first half's KV, written by micro-batch 0's attention of the same layer, which
always runs first). A rank with an empty (dummy) batch runs two empty micro-batches. Whether a
step is split is decided by all ranks together (the DP loop's batch-shape exchange), so either
every rank splits or none does.
"""

from __future__ import annotations

from atom.core.sequence import Sequence as Seq

Entry = tuple["Seq", int, int]  # (sequence, first new token's offset past num_computed, count)


def split_batch(scheduled: list[tuple[Seq, int]]) -> tuple[list[Entry], list[Entry]]:
    """Two micro-batches of ``(seq, offset, num_new_tokens)`` entries (module docstring).

    With two or more requests, the cut is the request boundary that best halves the tokens
    (each side keeps at least one request); with one request of ``n >= 2`` new tokens, the
    first ``n // 2`` and the rest; an empty batch splits into two empty ones.

    Raises:
        ValueError: a single request with one new token (nothing to split).
    """
    if not scheduled:
        return [], []
    if len(scheduled) == 1:
        seq, n = scheduled[0]
        if n < 2:
            raise ValueError("a single one-token entry cannot be split into two micro-batches")
        return [(seq, 0, n // 2)], [(seq, n // 2, n - n // 2)]
    total = sum(n for _, n in scheduled)
    best, running = 1, 0
    best_gap = None
    for cut in range(1, len(scheduled)):
        running += scheduled[cut - 1][1]
        gap = abs(2 * running - total)
        if best_gap is None or gap < best_gap:
            best, best_gap = cut, gap
    return ([(s, 0, n) for s, n in scheduled[:best]], [(s, 0, n) for s, n in scheduled[best:]])


def can_split(scheduled: list[tuple[Seq, int]], *, prefill_only: bool = True) -> bool:
    """Whether this rank's batch is eligible for TBO: empty (a dummy batch splits trivially),
    or at least two requests or one request of two or more new tokens — and, with
    ``prefill_only`` (the default), it computes some prompt tokens."""
    if not scheduled:
        return True
    if prefill_only and not any(seq.is_prefill for seq, _ in scheduled):
        return False
    return len(scheduled) >= 2 or scheduled[0][1] >= 2
