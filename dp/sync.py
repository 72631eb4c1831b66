"""The two per-tick exchanges of the DP tick: the control sync and the batch-shape exchange.

Per tick, on every rank, in this order (docs/ARCHITECTURE.md, "The DP tick"):

1. **control sync** (control group, before scheduling): each rank packs a :class:`ControlState`
   into a fixed-length int64 vector; one all-gather gives every rank a :class:`GatheredControl`;
   every decision of the tick (step or idle, admit prefills, stop) is a pure function of it;
2. **batch-shape exchange** (device group, after scheduling): a :class:`BatchShape` per rank →
   :class:`GatheredBatchShape` (token counts for EP splits and padding, dummy flags, and TBO
   agreed only when every rank is eligible).

Both vectors start with a magic word that names the layout and its version, so a vector
gathered together with some other collective (ranks out of step) is recognised as garbage
instead of being read as numbers. The control vector also carries each rank's collective
count and hash (taken just before the sync), so the lockstep check runs every tick for free:
:func:`exchange_control` raises :class:`~atom.dp.collectives.LockstepError` as soon as ranks
disagree (see :mod:`atom.dp.collectives` for what gloo itself does when they do).

Everything here except the two ``exchange_*`` functions is pure and unit-tested without
processes, and imports no torch until a vector is packed for a collective (the simulator,
:mod:`atom.dp.sim`, gathers the same values in memory with :meth:`GatheredControl.from_states`
and :meth:`GatheredBatchShape.from_shapes`, torch-free). Vectors are int64 CPU tensors;
fields are integers with units in their names.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from atom.dp.collectives import CollectiveLog

CONTROL_MAGIC = int.from_bytes(b"ATOMCTL3", "big")  # 3: the prefill inputs first
BATCH_SHAPE_MAGIC = int.from_bytes(b"ATOMBSH2", "big")
KV_USAGE_PPM_MAX = 1_000_000  # kv_usage is sent in parts per million (an int64 vector)


def kv_usage_to_ppm(kv_usage: float) -> int:
    """A KV usage fraction in [0, 1] as parts per million. Raises ValueError outside [0, 1]."""
    if not 0.0 <= kv_usage <= 1.0:
        raise ValueError(f"kv_usage={kv_usage} is not a fraction in [0, 1]")
    return round(kv_usage * KV_USAGE_PPM_MAX)


class _Row:
    """The codec of one rank's vector, shared by :class:`ControlState` and :class:`BatchShape`
    (frozen dataclasses of integer and ``bool`` fields): the vector is the magic word
    ``MAGIC``, then the fields as int64 in declaration order. Every field is a count (>= 0)
    but those in ``SIGNED``."""

    MAGIC: ClassVar[int]
    WHAT: ClassVar[str]  # the vector's name in error messages
    SIGNED: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    @functools.cache
    def layout(cls) -> tuple[tuple[str, ...], frozenset[str]]:
        """(field names in vector order, the names of the flag fields)."""
        fields = dataclasses.fields(cls)
        return tuple(f.name for f in fields), frozenset(f.name for f in fields if f.type == "bool")

    @classmethod
    def vector_len(cls) -> int:
        return 1 + len(cls.layout()[0])

    def __post_init__(self):
        names, flags = self.layout()
        negative = [f for f in names if f not in flags and f not in self.SIGNED
                    and getattr(self, f) < 0]
        if negative:
            raise ValueError(f"{', '.join(negative)} must be >= 0: {self}")

    def row(self) -> tuple[int, ...]:
        """The vector's ``vector_len()`` integers: the magic word, then the fields in
        declaration order."""
        return (self.MAGIC, *(int(getattr(self, f)) for f in self.layout()[0]))

    def pack(self) -> torch.Tensor:
        """int64 [vector_len()]: :meth:`row` as the tensor the exchange gathers."""
        import torch

        return torch.tensor(self.row(), dtype=torch.int64)

    @classmethod
    def unpack(cls, vec: torch.Tensor | np.ndarray):
        """Inverse of :meth:`pack`. Raises ValueError when ``vec`` is not this kind of vector."""
        names, flags = cls.layout()
        row = cls.checked(vec)
        return cls(**{f: (bool(v) if f in flags else int(v)) for f, v in zip(names, row[1:].tolist())})

    @classmethod
    def checked(cls, vec) -> np.ndarray:
        """``vec`` as an int64 array. Raises ValueError when its length or magic word is not
        this vector's."""
        row = np.asarray(vec, dtype=np.int64)
        length = cls.vector_len()
        if row.shape != (length,) or int(row[0]) != cls.MAGIC:
            raise ValueError(f"not a {cls.WHAT} vector (expected int64 [{length}] starting with "
                             f"0x{cls.MAGIC:016x}): {row.tolist()}")
        return row


class _Gathered:
    """Every rank's row of one exchange: for each field of ``ROW``, an attribute of the same
    name holding the ranks' values as an array of shape [world_size] (``bool`` for flags, the
    rest int64). Identical on every rank after the gather; read-only."""

    ROW: ClassVar[type[_Row]]

    def __init__(self, columns: dict[str, np.ndarray]):
        self.__dict__.update(columns)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v.tolist()}' for k, v in vars(self).items())})"

    @classmethod
    def from_matrix(cls, matrix: torch.Tensor | np.ndarray):
        """From the gathered int64 [world_size, ROW.vector_len()] matrix.

        Raises ValueError when a row is not a ``ROW`` vector (wrong length or magic).
        """
        names, flags = cls.ROW.layout()
        rows = np.asarray(matrix, dtype=np.int64)
        if rows.ndim != 2:
            raise ValueError(f"expected [world_size, {cls.ROW.vector_len()}], got {rows.shape}")
        for row in rows:
            cls.ROW.checked(row)
        return cls({f: (rows[:, 1 + i].astype(bool) if f in flags else rows[:, 1 + i].copy())
                    for i, f in enumerate(names)})

    @classmethod
    def from_rows(cls, rows: list[_Row]):
        """What the gather of ``rows`` (rank order) would give; for tests and simulation."""
        return cls.from_matrix(np.array([r.row() for r in rows], dtype=np.int64))


@dataclass(frozen=True)
class PrefillInputs:
    """A rank's prefill fields of the control vector: the inputs of every prefill policy
    (:mod:`atom.dp.prefill_policy`), all computed before scheduling from the rank's scheduler
    (:func:`atom.dp.prefill_policy.local_prefill_inputs`), so one gather serves whichever
    policy the deployment runs; every policy reads the gathered copies.

    Attributes:
        num_admittable: prefills it could start or continue now (the scheduler's admission
            dry run, ``Scheduler.preview_admission``).
        num_prefill_tokens: tokens those admittable prefills would compute this step (after
            prefix-cache hits, within the token budget left by the decodes): the coalescer's
            fill signal.
        has_pending_prefill: waiting or partial-prefill work exists.
        has_partial_prefill: a running sequence is part way through its prompt.
        num_running_decodes: running sequences past their prompt.
        oldest_waiting_age_ticks: ticks the longest-waiting sequence has been in the waiting
            queue (the scheduler steps once per stepping tick); 0 when none waits.
        kv_usage_ppm: KV blocks in use, parts per million of the pool (the delayer's low and
            the coalescer's high watermark compare it with the deployment's).
    """

    num_admittable: int = 0
    num_prefill_tokens: int = 0
    has_pending_prefill: bool = False
    has_partial_prefill: bool = False
    num_running_decodes: int = 0
    oldest_waiting_age_ticks: int = 0
    kv_usage_ppm: int = 0


@dataclass(frozen=True, kw_only=True)
class ControlState(PrefillInputs, _Row):
    """What one rank tells the others at the start of a tick (all integers or flags): its
    :class:`PrefillInputs` (inherited: the vector's first fields), then these.

    Attributes:
        has_work: the rank has unfinished requests (waiting or running).
        shutdown: the rank was asked to shut down.
        wave_id: the wave this rank is stepping in (docs/ARCHITECTURE.md, "The DP tick", idle and waves).
        tick: ticks this rank has run (identical on every rank while in step).
        collective_count, collective_hash: the collective log before this sync (the hash as
            the int64 with the same bits); :func:`exchange_control` fills them in.
    """

    MAGIC: ClassVar[int] = CONTROL_MAGIC
    WHAT: ClassVar[str] = "control"
    SIGNED: ClassVar[frozenset[str]] = frozenset(("collective_hash",))  # any int64

    has_work: bool
    shutdown: bool = False
    wave_id: int = 0
    tick: int = 0
    collective_count: int = 0
    collective_hash: int = 0

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.kv_usage_ppm <= KV_USAGE_PPM_MAX:
            raise ValueError(f"kv_usage_ppm={self.kv_usage_ppm} is outside [0, {KV_USAGE_PPM_MAX}]")


CONTROL_VECTOR_LEN = ControlState.vector_len()


class GatheredControl(_Gathered):
    """Every rank's :class:`ControlState` of one tick: one array of shape [world_size] per
    field (``g.num_admittable``, ``g.has_work``, ...; flags as bool arrays, the rest int64).

    Identical on every rank after the gather, so any function of it (plus tick counters that
    are themselves identical) is a cross-rank decision.
    """

    ROW = ControlState

    @classmethod
    def from_states(cls, states: list[ControlState]) -> GatheredControl:
        """What the gather of ``states`` (rank order) would give; for tests and simulation."""
        return cls.from_rows(states)

    @property
    def world_size(self) -> int:
        return len(self.has_work)

    def any_has_work(self) -> bool:
        """Some rank has requests: every rank steps this tick (idle ranks with dummy batches)."""
        return bool(self.has_work.any())

    def all_shutdown(self) -> bool:
        return bool(self.shutdown.all())

    def any_shutdown(self) -> bool:
        return bool(self.shutdown.any())

    def in_lockstep(self) -> bool:
        """Every rank reports the same tick, collective count and collective hash."""
        return all(len(np.unique(a)) == 1
                   for a in (self.tick, self.collective_count, self.collective_hash))

    def describe_ranks(self) -> str:
        """One line per rank (tick, collectives, hash) for error messages."""
        return "\n".join(f"  rank {r}: tick {t}, {c} collectives, hash 0x{h & (2**64 - 1):016x}"
                         for r, (t, c, h) in enumerate(zip(self.tick.tolist(),
                                                           self.collective_count.tolist(),
                                                           self.collective_hash.tolist())))


@dataclass(frozen=True)
class BatchShape(_Row):
    """This rank's scheduled batch, as the other ranks need it (after scheduling).

    Attributes:
        num_tokens: tokens computed this step (a dummy batch counts its padding tokens).
        num_seqs: sequences in the batch (0 for a dummy batch).
        is_dummy: the rank had nothing to run and steps a dummy batch that writes no KV.
        tbo_eligible: this rank's batch could be split into two micro-batches.
        has_prefill: the batch computes prompt tokens (a prefill or a prefill chunk).
        num_prefill_tokens: tokens of the batch's prefills (prompt chunks, recomputation).
        num_decode_seqs: sequences in the batch that decode (one token each, plus drafts).
        num_spec_tokens: speculative draft tokens the batch's verify scores (included in
            ``num_tokens``: the forward runs them, and padded EP collectives size to them).
        num_draft_seqs: tokens of this rank's largest draft forward after the exchange: one
            per sequence a model-based proposer drafts for (the MTP draft's first forward: each
            sequence's positions not run by its MTP layer yet); the draft forwards' MoE
            collectives are sized to the largest over the ranks.
        num_draft_steps: draft forwards this rank needs (its longest reservation); every rank
            runs the largest over the ranks, on zero tokens when it has none.
    """

    MAGIC: ClassVar[int] = BATCH_SHAPE_MAGIC
    WHAT: ClassVar[str] = "batch-shape"

    num_tokens: int
    num_seqs: int
    is_dummy: bool = False
    tbo_eligible: bool = False
    has_prefill: bool = False
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_spec_tokens: int = 0
    num_draft_seqs: int = 0
    num_draft_steps: int = 0


BATCH_SHAPE_VECTOR_LEN = BatchShape.vector_len()


class GatheredBatchShape(_Gathered):
    """Every rank's :class:`BatchShape` of one step: one array of shape [world_size] per
    field (``shapes.num_tokens``, ``shapes.is_dummy``, ...; flags as bool arrays, the rest
    int64)."""

    ROW = BatchShape

    @classmethod
    def from_shapes(cls, shapes: list[BatchShape]) -> GatheredBatchShape:
        """What the gather of ``shapes`` (rank order) would give; for tests and simulation."""
        return cls.from_rows(shapes)

    @property
    def tbo_agreed(self) -> bool:
        """Split into two micro-batches only when every rank is eligible (the lockstep rule)."""
        return bool(self.tbo_eligible.all())

    @property
    def max_num_tokens(self) -> int:
        """The largest batch (what padded collectives size to)."""
        return int(self.num_tokens.max())

    @property
    def max_num_draft_steps(self) -> int:
        """Draft forwards every rank runs this step (the largest need over the ranks)."""
        return int(self.num_draft_steps.max())

    @property
    def max_num_draft_seqs(self) -> int:
        """The largest draft forward over the ranks, in tokens (:attr:`BatchShape.num_draft_seqs`)."""
        return int(self.num_draft_seqs.max())

    @property
    def any_spec(self) -> bool:
        """Some rank verifies speculative drafts this step."""
        return bool(self.num_spec_tokens.any())

    @property
    def any_prefill(self) -> bool:
        return bool(self.has_prefill.any())

    @property
    def mixed_prefill(self) -> bool:
        """Some rank prefills while another does not (decodes only, or steps a dummy batch):
        the misaligned step the PrefillDelayer exists to avoid, since in an expert-parallel
        model every rank's MoE layers wait for the slowest rank's batch."""
        return self.any_prefill and not bool(self.has_prefill.all())


def exchange_control(state: ControlState, group: dist.ProcessGroup, *,
                     log: CollectiveLog | None = None) -> GatheredControl:
    """The control sync: fill in the collective count and hash, gather, check lockstep.

    Args:
        state: this rank's state; its ``collective_*`` fields are overwritten from ``log``.
        group: the control group.
        log: default the process log.
    Returns:
        Every rank's state, identical on every rank.
    Raises:
        LockstepError: the ranks' ticks, collective counts or hashes differ (every rank then
            runs :func:`~atom.dp.collectives.check_lockstep` to exchange histories, and all
            raise), or a gathered row is not a control vector (this sync was paired with some
            other collective: this rank raises alone; its peers fail in their next collective
            or at the group timeout).
        CollectiveError: the gather itself failed (a peer died, or the group timed out).
    """
    from atom.dp.collective_log import format_histories
    from atom.dp.collectives import (LockstepError, all_gather_int64, check_lockstep,
                                     process_collective_log)

    log = process_collective_log() if log is None else log
    state = dataclasses.replace(state, collective_count=log.num_collectives,
                                collective_hash=log.hash_int64)
    matrix = all_gather_int64(state.pack(), group, log=log)
    try:
        gathered = GatheredControl.from_matrix(matrix)
    except ValueError as e:
        raise LockstepError(f"[rank {log.rank}] the control sync was paired with a different "
                            f"collective on some rank ({e}); the ranks are out of step. Recent "
                            f"collectives:\n{format_histories(log.post_mortem())}") from e
    if not gathered.in_lockstep():
        check_lockstep(log, group)  # every rank saw the same rows: all take this branch
        raise LockstepError(f"[rank {log.rank}] ranks disagree at the control sync:\n"
                            f"{gathered.describe_ranks()}")
    return gathered


def exchange_batch_shape(shape: BatchShape, group: dist.ProcessGroup, *,
                         log: CollectiveLog | None = None) -> GatheredBatchShape:
    """The batch-shape exchange (device group, after scheduling): one int64 all-gather.

    Raises:
        LockstepError: a gathered row is not a batch-shape vector (ranks out of step).
        CollectiveError: the gather failed.
    """
    from atom.dp.collective_log import format_histories
    from atom.dp.collectives import LockstepError, all_gather_int64, process_collective_log

    log = process_collective_log() if log is None else log
    matrix = all_gather_int64(shape.pack(), group, log=log)
    try:
        return GatheredBatchShape.from_matrix(matrix)
    except ValueError as e:
        raise LockstepError(f"[rank {log.rank}] the batch-shape exchange was paired with a "
                            f"different collective on some rank ({e}); the ranks are out of "
                            f"step. Recent collectives:\n{format_histories(log.post_mortem())}"
                            ) from e
