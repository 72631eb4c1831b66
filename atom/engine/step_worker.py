"""What an :class:`~atom.engine.core.EngineCore` asks of its worker: the torch
:class:`atom.worker.worker.Worker`, or the simulator's cost-model worker
(:class:`atom.dp.sim.rank.SimWorker`). Torch-free: the core and the front end never import a
worker module."""

from __future__ import annotations

from typing import Protocol

from atom.core.kv_connector import KVConnectorMetadata, KVConnectorOutput
from atom.core.model_runner_output import ModelRunnerOutput
from atom.core.scheduler_output import SchedulerOutput
from atom.core.sequence import Sequence
from atom.messages import EngineRuntime


class StepWorker(Protocol):
    """What the core asks of its worker (:class:`atom.worker.worker.Worker`; the simulator's
    ``SimWorker``)."""

    runtime: EngineRuntime
    proposes_drafts: bool
    kv_transfer_port: int | None

    def execute_model(self, sched: SchedulerOutput, *, two_batch_overlap: bool = False
                      ) -> ModelRunnerOutput: ...
    def execute_dummy_batch(self, *, two_batch_overlap: bool = False) -> None: ...
    def propose_drafts(self, seqs: list[Sequence], max_num_tokens: list[int], *,
                       num_steps: int | None = None) -> list[list[int]]: ...
    def num_draft_tokens(self, seqs: list[Sequence]) -> int: ...
    def start_kv_transfers(self, meta: KVConnectorMetadata) -> None: ...
    def get_kv_connector_output(self) -> KVConnectorOutput: ...
    def has_pending_kv_output(self) -> bool: ...
    def wait_for_kv_transfers(self, timeout_s: float) -> None: ...
    def get_stats(self) -> dict[str, int | float]: ...
    def close(self) -> None: ...
