"""The one module through which every cross-rank collective goes, and the lockstep check.

Every wrapper records ``(op, dtype, numel)`` in a :class:`CollectiveLog` *before* it issues the
collective, so the last entry of a failed rank's history is the collective it died in. The log
keeps a count, a rolling 64-bit hash of the whole sequence (xxh3 over the packed record chained
with the previous hash) and the last :data:`HISTORY_LEN` records. Ranks compare count and hash,
never only the count: a rank that issued the same number of collectives in a different order or
shape has a different hash. ``numel`` is what must agree across ranks: the local element count,
except for ``all_to_all_single``, whose per-rank sizes legitimately differ (uneven splits), where
it is the element count of one row (``prod(shape[1:])``).

No ``*_object`` collective exists here on purpose: they pickle (docs/ARCHITECTURE.md, "Rules": no
pickle on any wire). Everything crossing ranks is a fixed-layout int64 tensor.

What gloo does when one rank skips a collective (measured, torch 2.13 CPU, world size 2; the
outcomes below are what ``tests/dp/test_dp_multiproc.py`` asserts):

* **nothing can pair** (the usual case: the skipped op is the tick's last on the device group and
  the skipping rank's next op is on the control group, so each rank waits on a different group):
  both ranks block until the group timeout, then gloo raises ``RuntimeError`` ("Timed out
  waiting ... ms"); here both raise :class:`CollectiveError` with both histories. This is the
  last resort: ``ProcessGroup.abort()``/``shutdown()``/``destroy_process_group`` do not close
  gloo's sockets, so a rank cannot release its peers early; only its process exit does;
* the skipping rank's next op on the same group has the **same byte size**: gloo pairs them
  silently and both ranks carry on with the other op's data, one op out of step. A control,
  batch-shape or lockstep vector paired this way lacks its magic word, so the rank that reads
  it raises :class:`LockstepError` at once (its peer then fails at the timeout); between two
  data ops the offset travels on until it meets such a vector, a size difference (next case)
  or a wait with nothing to pair (previous case);
* **different byte size** on the same group: the rank that receives more bytes than its buffer
  holds is killed by gloo (``EnforceNotMet`` on gloo's I/O thread → ``std::terminate`` →
  SIGABRT, "Received data size doesn't match expected size. Is there a distributed collective
  mismatch in your code?"; no Python exception, no traceback); the other rank keeps a partly
  filled output and its next collective fails at once with "Connection reset by peer".

A rank that issues the same number of collectives but changes one (say float32 where its peer
all-reduces int32, same bytes) is paired silently too; the next control sync sees different
hashes on every rank, all ranks run :func:`check_lockstep`, and all raise LockstepError at once.

So gloo pairs wrong data silently, kills a process, or times out; it does not hang past the group
timeout. Every Python-visible outcome becomes an error that says what went wrong, with every
rank's recent history: :class:`LockstepError` when ranks compare logs and differ,
:class:`CollectiveError` when a collective itself fails (the histories then travel through the
rendezvous store, since the collectives themselves are out of step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Callable

import torch
import torch.distributed as dist

from atom.dp.collective_log import (
    HISTORY_LEN,
    LOCKSTEP_RECORD_LEN,
    CollectiveLog,
    CollectiveOp,
    CollectiveRecord,
    RankHistory,
    decode_lockstep_record,
    format_histories,
    process_collective_log,
)

__all__ = [
    "HISTORY_LEN", "LOCKSTEP_RECORD_LEN", "CollectiveError", "CollectiveLog", "CollectiveOp",
    "CollectiveRecord", "CollectiveWork", "LockstepError", "RankHistory", "all_gather_int64",
    "all_gather_into_tensor", "all_gather_into_tensor_async", "all_reduce", "all_reduce_async",
    "all_to_all_single", "all_to_all_single_async", "all_to_all_split_sizes", "barrier",
    "check_lockstep", "process_collective_log", "reduce_scatter_tensor",
    "reduce_scatter_tensor_async",
]


class CollectiveError(RuntimeError):
    """A collective failed (gloo timeout, peer died, connection reset); says which and where."""


class LockstepError(RuntimeError):
    """Ranks issued different collective sequences; the message shows every rank's history."""


def _failure_message(log: CollectiveLog, rec: CollectiveRecord, error: BaseException) -> str:
    return (f"[rank {log.rank}] collective #{log.num_collectives - 1} ({rec.describe()}) failed: "
            f"{error}\nEither a peer died or the ranks are out of step (one skipped, added or "
            f"changed a collective). Recent collectives:\n{format_histories(log.post_mortem())}")


def _issue(op: CollectiveOp, dtype: torch.dtype | None, numel: int, log: CollectiveLog | None,
           launch: Callable[[], dist.Work | None]) -> tuple[dist.Work | None, CollectiveLog,
                                                              CollectiveRecord]:
    log = process_collective_log() if log is None else log
    rec = log.record(op, dtype, numel)
    try:
        return launch(), log, rec
    except RuntimeError as e:  # gloo timeouts and resets (DistBackendError is a RuntimeError)
        raise CollectiveError(_failure_message(log, rec, e)) from e


class CollectiveWork:
    """Handle of an async collective; :meth:`wait` raises :class:`CollectiveError` on failure."""

    def __init__(self, work: dist.Work, log: CollectiveLog, rec: CollectiveRecord):
        self._work, self._log, self._rec = work, log, rec

    def wait(self) -> None:
        try:
            self._work.wait()
        except RuntimeError as e:
            raise CollectiveError(_failure_message(self._log, self._rec, e)) from e

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _check_gather_sizes(output: torch.Tensor, shard: torch.Tensor, world_size: int, what: str):
    if output.dtype != shard.dtype or output.numel() != world_size * shard.numel():
        raise ValueError(f"{what}: the full tensor must have world_size ({world_size}) × the "
                         f"shard's elements and the same dtype; got {output.dtype} "
                         f"{tuple(output.shape)} vs shard {shard.dtype} {tuple(shard.shape)}")


def all_gather_int64(vec: Sequence[int] | torch.Tensor, group: dist.ProcessGroup, *,
                     log: CollectiveLog | None = None) -> torch.Tensor:
    """Gather one int64 vector per rank. Every rank must pass the same length ``n``.

    Args:
        vec: ``n`` integers (a 1-D int64 tensor or a sequence of ints).
        group: the group to gather over (on an NCCL group the vector travels on the GPU).
    Returns:
        int64 CPU tensor [world_size, n]; row ``r`` is rank ``r``'s vector.
    Raises:
        ValueError: ``vec`` is not 1-D int64. CollectiveError: the collective failed.
    """
    vec = torch.as_tensor(vec, dtype=torch.int64) if not isinstance(vec, torch.Tensor) else vec
    if vec.dim() != 1 or vec.dtype != torch.int64:
        raise ValueError(f"all_gather_int64 takes a 1-D int64 vector, got {vec.dtype} "
                         f"{tuple(vec.shape)}")
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    vec = vec.to(device).contiguous()
    out = torch.empty(dist.get_world_size(group) * vec.numel(), dtype=torch.int64, device=device)
    _issue(CollectiveOp.ALL_GATHER, torch.int64, vec.numel(), log,
           lambda: dist.all_gather_single(out, vec, group=group))
    return out.view(-1, vec.numel()).cpu()


def _all_gather(output, shard, group, log, async_op):
    _check_gather_sizes(output, shard, dist.get_world_size(group), "all_gather_into_tensor")
    return _issue(CollectiveOp.ALL_GATHER, shard.dtype, shard.numel(), log,
                  lambda: dist.all_gather_single(output, shard, group=group, async_op=async_op))


def all_gather_into_tensor(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
                           *, log: CollectiveLog | None = None) -> torch.Tensor:
    """Concatenate every rank's ``shard`` (equal shapes) along dim 0 into ``output``
    ([world_size × shard.shape[0], ...], same dtype/device). Returns ``output``.

    Raises ValueError on mismatched sizes, CollectiveError when the collective fails."""
    _all_gather(output, shard, group, log, False)
    return output


def all_gather_into_tensor_async(output: torch.Tensor, shard: torch.Tensor,
                                 group: dist.ProcessGroup, *,
                                 log: CollectiveLog | None = None) -> CollectiveWork:
    """Async :func:`all_gather_into_tensor`; ``output`` is valid after ``wait()``."""
    return CollectiveWork(*_all_gather(output, shard, group, log, True))


def _all_reduce(tensor, group, op, log, async_op):
    return _issue(CollectiveOp.ALL_REDUCE, tensor.dtype, tensor.numel(), log,
                  lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, *,
               op: dist.ReduceOp = dist.ReduceOp.SUM,
               log: CollectiveLog | None = None) -> torch.Tensor:
    """Reduce ``tensor`` (any shape; same on every rank) in place with ``op``. Returns it.

    Raises CollectiveError when the collective fails."""
    _all_reduce(tensor, group, op, log, False)
    return tensor


def all_reduce_async(tensor: torch.Tensor, group: dist.ProcessGroup, *,
                     op: dist.ReduceOp = dist.ReduceOp.SUM,
                     log: CollectiveLog | None = None) -> CollectiveWork:
    """Async :func:`all_reduce`; ``tensor`` holds the result after ``wait()``."""
    return CollectiveWork(*_all_reduce(tensor, group, op, log, True))


def _all_to_all(output, input, group, output_split_sizes, input_split_sizes, log, async_op):
    world_size = dist.get_world_size(group)
    for name, splits, t in (("output_split_sizes", output_split_sizes, output),
                            ("input_split_sizes", input_split_sizes, input)):
        if splits is not None and (len(splits) != world_size or sum(splits) != t.shape[0]):
            raise ValueError(f"all_to_all_single: {name}={list(splits)} must have world_size "
                             f"({world_size}) entries summing to dim 0 ({t.shape[0]})")
    if output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
        raise ValueError(f"all_to_all_single: output {output.dtype} {tuple(output.shape)} and "
                         f"input {input.dtype} {tuple(input.shape)} must agree past dim 0")
    # per-rank sizes differ with uneven splits: log the row size, which must agree
    return _issue(CollectiveOp.ALL_TO_ALL, input.dtype, math.prod(input.shape[1:]), log,
                  lambda: dist.all_to_all_single(output, input, output_split_sizes,
                                                 input_split_sizes, group=group,
                                                 async_op=async_op))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, *,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      log: CollectiveLog | None = None) -> torch.Tensor:
    """Scatter rows of ``input`` [num_rows_in, ...] to the ranks and gather theirs into
    ``output`` [num_rows_out, ...] (dim 0 split per rank; None = equal splits). Rank ``r``'s
    ``input_split_sizes[s]`` must equal rank ``s``'s ``output_split_sizes[r]`` (use
    :func:`all_to_all_split_sizes`). Returns ``output``.

    Raises ValueError on inconsistent local sizes, CollectiveError when the collective fails."""
    _all_to_all(output, input, group, output_split_sizes, input_split_sizes, log, False)
    return output


def all_to_all_single_async(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                            *, output_split_sizes: Sequence[int] | None = None,
                            input_split_sizes: Sequence[int] | None = None,
                            log: CollectiveLog | None = None) -> CollectiveWork:
    """Async :func:`all_to_all_single`; ``output`` is valid after ``wait()``."""
    return CollectiveWork(*_all_to_all(output, input, group, output_split_sizes,
                                       input_split_sizes, log, True))


def all_to_all_split_sizes(input_split_sizes: Sequence[int], group: dist.ProcessGroup, *,
                           log: CollectiveLog | None = None) -> list[int]:
    """The output split sizes matching this rank's ``input_split_sizes`` (rows sent to each
    rank): entry ``s`` is how many rows rank ``s`` sends here. One int64 all-gather."""
    matrix = all_gather_int64(list(input_split_sizes), group, log=log)  # [sender, receiver]
    return matrix[:, dist.get_rank(group)].tolist()


def _reduce_scatter(output, input, group, op, log, async_op):
    _check_gather_sizes(input, output, dist.get_world_size(group), "reduce_scatter_tensor")
    return _issue(CollectiveOp.REDUCE_SCATTER, input.dtype, input.numel(), log,
                  lambda: dist.reduce_scatter_single(output, input, op=op, group=group,
                                                     async_op=async_op))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                          *, op: dist.ReduceOp = dist.ReduceOp.SUM,
                          log: CollectiveLog | None = None) -> torch.Tensor:
    """Reduce ``input`` [world_size × n, ...] across ranks and keep this rank's dim-0 slice in
    ``output`` [n, ...]. Returns ``output``.

    Raises ValueError on mismatched sizes, CollectiveError when the collective fails."""
    _reduce_scatter(output, input, group, op, log, False)
    return output


def reduce_scatter_tensor_async(output: torch.Tensor, input: torch.Tensor,
                                group: dist.ProcessGroup, *,
                                op: dist.ReduceOp = dist.ReduceOp.SUM,
                                log: CollectiveLog | None = None) -> CollectiveWork:
    """Async :func:`reduce_scatter_tensor`; ``output`` is valid after ``wait()``."""
    return CollectiveWork(*_reduce_scatter(output, input, group, op, log, True))


def barrier(group: dist.ProcessGroup, *, log: CollectiveLog | None = None) -> None:
    """Block until every rank of ``group`` arrives. Raises CollectiveError on failure."""
    _issue(CollectiveOp.BARRIER, None, 0, log, lambda: dist.barrier(group=group))


def check_lockstep(log: CollectiveLog, group: dist.ProcessGroup) -> int:
    """Compare collective count and hash across ``group``; raise if any rank differs.

    One all-gather of every rank's lockstep record (count, hash and history together, int64
    [LOCKSTEP_RECORD_LEN]), so a mismatch needs no second collective to explain itself: every
    rank that took part sees the same rows and raises the same error.

    Returns:
        The agreed number of collectives before this check.
    Raises:
        LockstepError: counts or hashes differ, or a row is not a lockstep record (this check
            was paired with another collective); the message shows every rank's history.
        CollectiveError: the gather itself failed.
    """
    gathered = all_gather_int64(log.lockstep_record(), group, log=log)
    histories = {r: decode_lockstep_record(row) for r, row in enumerate(gathered.numpy())}
    states = {(h.num_collectives, h.hash) if h else None for h in histories.values()}
    if len(states) == 1 and None not in states:
        return next(iter(states))[0]
    raise LockstepError(
        f"[rank {dist.get_rank(group)}] the ranks' collective sequences differ (a rank skipped, "
        f"added or changed a collective). Recent collectives:\n{format_histories(histories)}")
