"""The collective log: what every rank recorded, how it is hashed, exchanged and printed.

Owned by :mod:`atom.dp.collectives` (its wrappers are the only callers of
:meth:`CollectiveLog.record`); split out so each module reads in one sitting. A record is
``(op, dtype, numel)`` as int codes; the hash chains xxh3-64 over ``(previous hash, record)``
packed little-endian, so equal hashes mean equal sequences (up to 64-bit collisions). The
lockstep record is the fixed-size int64 form of a log that ranks exchange: by all-gather in
:func:`atom.dp.collectives.check_lockstep`, through the rendezvous store after a failure
(:meth:`CollectiveLog.post_mortem`). Never pickled.
"""

from __future__ import annotations

import enum
import struct
import time
from collections import Counter, deque
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import xxhash

HISTORY_LEN = 64  # records kept and exchanged per rank (fixed: the exchange has a fixed size)
LOCKSTEP_MAGIC = int.from_bytes(b"ATOMLCK1", "big")  # marks a lockstep record; bump on change
_HEADER_LEN = 4  # magic, num_collectives, hash, num_history
LOCKSTEP_RECORD_LEN = _HEADER_LEN + 3 * HISTORY_LEN
POST_MORTEM_WAIT_S = 10.0  # how long a failed rank waits in the store for its peers' histories
_POST_MORTEM_POLL_S = 0.1  # between looks at the store: SIGTERM's handler runs in between
_POST_MORTEM_PREFIX = "atom/collectives/post_mortem"


class CollectiveOp(enum.IntEnum):
    """Wire-level collective kinds (codes are exchanged between ranks: never renumber)."""

    ALL_GATHER = 1
    ALL_REDUCE = 2
    ALL_TO_ALL = 3
    REDUCE_SCATTER = 4
    BARRIER = 5


_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.int64: 5,
    torch.int32: 6, torch.int16: 7, torch.int8: 8, torch.uint8: 9, torch.bool: 10,
    torch.float8_e4m3fn: 11, torch.float8_e5m2: 12, torch.float8_e4m3fnuz: 13,
    torch.float8_e5m2fnuz: 14,
}
_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in _DTYPE_CODES.items()}
NO_DTYPE = 0  # a barrier moves no tensor


class CollectiveRecord(NamedTuple):
    """One logged collective: op code, dtype code and element count (see module docstring)."""

    op: int
    dtype: int
    numel: int

    def describe(self) -> str:
        op = CollectiveOp(self.op).name.lower() if self.op in CollectiveOp._value2member_map_ \
            else f"op{self.op}"
        if self.op == CollectiveOp.BARRIER:
            return op
        shape = f"*,{self.numel}" if self.op == CollectiveOp.ALL_TO_ALL else str(self.numel)
        return f"{op} {_DTYPE_NAMES.get(self.dtype, f'dtype{self.dtype}')}[{shape}]"


class RankHistory(NamedTuple):
    """One rank's log as exchanged: count, hash (uint64) and its last records, oldest first."""

    num_collectives: int
    hash: int
    records: tuple[CollectiveRecord, ...]


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of ``dtype``. Raises TypeError for a dtype without one (add it above)."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"no collective dtype code for {dtype}: add it to _DTYPE_CODES in "
                        f"atom.dp.collective_log (dp/collective_log.py)") from None


def _to_int64(value: int) -> int:
    """uint64 → the int64 with the same bits (tensors hold int64)."""
    return value - (1 << 64) if value >= (1 << 63) else value


class CollectiveLog:
    """Owns one process's collective count, rolling hash, recent history and per-op counts.

    Mutated only by the wrappers of :mod:`atom.dp.collectives` (one ``record`` per
    collective). Two ranks that issued the same sequence of ``(op, dtype, numel)`` have equal
    ``num_collectives`` and ``hash``. Optionally holds the rendezvous store used to exchange
    histories after a failure.
    """

    _PACK = struct.Struct("<QHHq")  # previous hash, op, dtype, numel

    def __init__(self):
        self.num_collectives = 0
        self.hash = 0  # uint64
        self.history: deque[CollectiveRecord] = deque(maxlen=HISTORY_LEN)
        self.op_counts: Counter[str] = Counter()
        self._store: dist.Store | None = None
        self._post_mortem_wait_s = POST_MORTEM_WAIT_S
        self._rank = 0
        self._world_size = 1
        self._num_post_mortems = 0

    def record(self, op: CollectiveOp, dtype: torch.dtype | None, numel: int) -> CollectiveRecord:
        """Append one collective; ``dtype`` None for a barrier. Returns the record."""
        rec = CollectiveRecord(int(op), NO_DTYPE if dtype is None else dtype_code(dtype), numel)
        self.hash = xxhash.xxh3_64_intdigest(self._PACK.pack(self.hash, *rec))
        self.num_collectives += 1
        self.history.append(rec)
        self.op_counts[CollectiveOp(op).name.lower()] += 1
        return rec

    @property
    def hash_int64(self) -> int:
        """``hash`` as the int64 with the same bits (what control vectors carry)."""
        return _to_int64(self.hash)

    def snapshot(self) -> RankHistory:
        return RankHistory(self.num_collectives, self.hash, tuple(self.history))

    def lockstep_record(self) -> torch.Tensor:
        """int64 [LOCKSTEP_RECORD_LEN]: magic, count, hash, n, n × (op, dtype, numel), 0-padded."""
        out = torch.zeros(LOCKSTEP_RECORD_LEN, dtype=torch.int64)
        out[:_HEADER_LEN] = torch.tensor([LOCKSTEP_MAGIC, self.num_collectives, self.hash_int64,
                                          len(self.history)], dtype=torch.int64)
        if self.history:
            recs = torch.tensor(list(self.history), dtype=torch.int64).flatten()
            out[_HEADER_LEN:_HEADER_LEN + recs.numel()] = recs
        return out

    def attach_store(self, store: dist.Store, *, rank: int, world_size: int,
                     group_timeout_s: float = 0.0) -> None:
        """Use ``store`` to exchange histories when a collective fails (:meth:`post_mortem`).

        ``group_timeout_s``: the collectives' timeout. A rank that fails at once waits that long
        (plus a margin, capped at a minute so a failed rank still exits soon) for its peers,
        since a peer left alone in a collective only fails then.
        """
        self._store, self._rank, self._world_size = store, rank, world_size
        self._post_mortem_wait_s = min(max(POST_MORTEM_WAIT_S, group_timeout_s + 5.0), 60.0)

    def detach_store(self) -> None:
        """No more post-mortems; one in progress ends at its next look at the store (a SIGTERM
        handler calls this: the rank is stopping, and its dead peer will never report)."""
        self._store = None

    @property
    def rank(self) -> int:
        """Global rank of this process (0 before any process group exists)."""
        return dist.get_rank() if dist.is_initialized() else self._rank

    def post_mortem(self) -> dict[int, RankHistory | None]:
        """Exchange histories through the store after a collective failed (best effort, bounded).

        The collectives are out of step, so they cannot carry the histories; the store can.
        Each rank publishes its lockstep record, waits (see :meth:`attach_store`) for its peers',
        then waits (same budget) until every rank has read, so a rank hosting the store does
        not exit under a peer that is still reading. Returns rank → history, None for a rank
        that did not report (only this rank's own without an attached store).
        """
        rank, store = self.rank, self._store
        if store is None or self._world_size == 1:
            return {rank: self.snapshot()}
        out: dict[int, RankHistory | None] = {r: None for r in range(self._world_size)}
        out[rank] = self.snapshot()
        deadline = time.monotonic() + self._post_mortem_wait_s
        prefix = f"{_POST_MORTEM_PREFIX}/{self._num_post_mortems}"
        self._num_post_mortems += 1

        def wait(key: str) -> bool:
            # polled, not one blocking store.wait: a Python signal handler runs only between
            # bytecodes, and a SIGTERM (the launcher stopping this rank after a peer died)
            # must end the wait at once (detach_store), not when the launcher's SIGKILL comes
            while self._store is not None:
                if store.check([key]):  # RuntimeError: the store's host is gone
                    return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(_POST_MORTEM_POLL_S)
            raise _Detached()

        try:
            store.set(f"{prefix}/history/{rank}", self.lockstep_record().numpy().tobytes())
            for r in range(self._world_size):
                if r != rank and wait(f"{prefix}/history/{r}"):
                    out[r] = decode_lockstep_record(
                        np.frombuffer(store.get(f"{prefix}/history/{r}"), dtype=np.int64))
            store.set(f"{prefix}/done/{rank}", b"1")
            for r in range(self._world_size):
                wait(f"{prefix}/done/{r}")
        except (RuntimeError, _Detached):  # the store failed, or this rank is stopping
            pass
        return out


class _Detached(Exception):
    """:meth:`CollectiveLog.detach_store` was called during a post-mortem."""


def decode_lockstep_record(row: np.ndarray | torch.Tensor) -> RankHistory | None:
    """Inverse of :meth:`CollectiveLog.lockstep_record`; None when ``row`` is not one (no magic)."""
    row = np.asarray(row, dtype=np.int64)
    if row.shape != (LOCKSTEP_RECORD_LEN,) or int(row[0]) != LOCKSTEP_MAGIC:
        return None
    n = int(row[3])
    if not 0 <= n <= HISTORY_LEN:
        return None
    recs = row[_HEADER_LEN:_HEADER_LEN + 3 * n].reshape(n, 3)
    return RankHistory(int(row[1]), int(row[2]) & ((1 << 64) - 1),
                       tuple(CollectiveRecord(*map(int, r)) for r in recs))


def format_histories(histories: Mapping[int, RankHistory | None]) -> str:
    """Side-by-side recent collectives per rank, aligned by sequence number; '!' marks the
    first position (within the window every rank still remembers) where the ranks differ."""
    missing = "no history (not reported: the rank died, hung, or sat in another collective)"
    lines = [f"  rank {r}: " + (f"{h.num_collectives} collectives, hash 0x{h.hash:016x}"
                                if h else missing) for r, h in sorted(histories.items())]
    present = {r: h for r, h in sorted(histories.items()) if h and h.records}
    if not present:
        return "\n".join(lines)
    by_index = {r: {h.num_collectives - len(h.records) + j: rec for j, rec in enumerate(h.records)}
                for r, h in present.items()}
    common_start = max(min(idx) for idx in by_index.values())
    indexes = sorted(set().union(*by_index.values()))
    first_diff = next((i for i in indexes if i >= common_start
                       and len({by_index[r].get(i) for r in present}) > 1), None)
    width = 30
    lines.append("  " + " " * 9 + "".join(f"rank {r}".ljust(width) for r in present))
    for i in indexes:
        cells = "".join((by_index[r][i].describe() if i in by_index[r] else "-").ljust(width)
                        for r in present)
        lines.append(f"  {'!' if i == first_diff else ' '} #{i:<6}{cells}".rstrip())
    return "\n".join(lines)


_PROCESS_LOG = CollectiveLog()


def process_collective_log() -> CollectiveLog:
    """The log every wrapper uses unless given ``log=`` (one per process)."""
    return _PROCESS_LOG
