"""What one ``Scheduler.schedule()`` hands out (torch-free): the step's batch,
:class:`SchedulerOutput`, which the worker executes and the DP tick, the simulator and
``Scheduler.update_from_output`` read; and the admission dry run's :class:`AdmissionPreview`,
which the prefill policies gather across ranks. Lineage: vLLM v1's ``SchedulerOutput``
(vllm/v1/core/sched/output.py), its own module there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atom.core.kv_connector import KVConnectorMetadata
from atom.core.sequence import Sequence


@dataclass(frozen=True)
class AdmissionPreview:
    """What ``schedule(allow_prefill=True)`` would start or continue now (a dry run's result).

    Attributes:
        num_prefills: prefills it would schedule (admissions plus partial-prefill chunks).
        num_prefill_tokens: prompt tokens those prefills would compute this step (after
            prefix-cache hits, within the token budget left by the running decodes).
    """

    num_prefills: int = 0
    num_prefill_tokens: int = 0


@dataclass
class SchedulerOutput:
    """One step's batch: ``scheduled`` holds (sequence, tokens to compute this step)."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # speculative decoding: seq_id -> draft slots reserved after its last token this step (the
    # drafts themselves are seq.spec_token_ids); empty without speculation
    spec_budget: dict[int, int] = field(default_factory=dict)
    # sequences finished since the previous schedule(): the worker drops their state (a seeded
    # request's generator), as vLLM's finished_req_ids
    finished_seq_ids: list[int] = field(default_factory=list)
    # P/D: what the connector's worker side must start or register before this step's forward
    kv_connector_metadata: KVConnectorMetadata | None = None
    # structured outputs: seq_id -> int32 [ceil(vocab / 32)] allowed-token bits, for each
    # constrained sequence this step samples (atom.core.structured_output); the worker masks
    # its logits with it before sampling
    grammar_bitmask: dict = field(default_factory=dict)
    # sequences this schedule() finished with error (a grammar that did not compile); reported
    # by update_from_output
    failed: list[Sequence] = field(default_factory=list)

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens the verify forward scores this step (on top of num_batched_tokens)."""
        return sum(self.spec_budget.values())

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_prefill_seqs(self) -> int:
        """Scheduled sequences in prefill (read before update_from_output; in a dry run's output,
        :meth:`Scheduler.preview_admission`'s count)."""
        return sum(1 for seq, _ in self.scheduled if seq.is_prefill)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens computed for prefills (prompt chunks, recomputation) this step."""
        return sum(n for seq, n in self.scheduled if seq.is_prefill)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def sampled_seqs(self) -> list[Sequence]:
        """The sequences whose next token this step samples
        (:meth:`~atom.core.sequence.Sequence.samples_next_token`), in batch order. Call before
        :meth:`Scheduler.update_from_output` (it reads ``num_computed_tokens`` before the
        step). The model runner returns logits for the same sequences (in micro-batch order
        with TBO); the simulator's worker supplies their tokens instead of a model."""
        return [seq for seq, n in self.scheduled if seq.samples_next_token(n)]
