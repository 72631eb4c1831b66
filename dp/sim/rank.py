"""One virtual DP rank of the simulator: the real :class:`~atom.engine.core.EngineCore` (its
scheduler, block manager, request checks, speculative bookkeeping and outputs) with the torch
worker replaced by :class:`SimWorker`, which emits the tokens the workload dictates and runs
no model. A simulated step is the real step's three parts: ``EngineCore.schedule`` →
``SimWorker.execute_model`` → ``Scheduler.update_from_output`` (inside
``EngineCore.execute``), so nothing of the step is copied here. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atom.config import EngineConfig
from atom.core.kv_connector import KVConnectorMetadata, KVConnectorOutput
from atom.core.model_runner_output import ModelRunnerOutput
from atom.core.scheduler_output import SchedulerOutput
from atom.core.sequence import Sequence
from atom.core.tbo_split import split_batch
from atom.dp.sim.cost_model import MicroBatch, micro_batch
from atom.dp.sim.workload import SIM_OUTPUT_TOKEN_ID, TraceRequest
from atom.dp.tick import TickArrivals
from atom.engine.core import EngineCore
from atom.messages import EngineCoreRequest, EngineRuntime
from atom.sampling_params import SamplingParams

#: the simulator has no tokenizer: every id of a workload is in its vocabulary
SIM_VOCAB_SIZE = 1 << 31
#: speculative methods whose drafts come from a model: replayed from a recording
MODEL_DRAFTS = ("mtp", "draft")


@dataclass
class RequestRecord:
    """One request's life in the simulation (times on the simulated clock, seconds).

    ``token_times_s`` has one entry per output token (the end of the step that emitted it).
    """

    request: TraceRequest
    dp_rank: int
    arrival_s: float
    arrival_tick: int  # the simulator's tick counter when the scheduler got it
    token_times_s: list[float] = field(default_factory=list)
    first_token_tick: int | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SimWorker:
    """The simulator's worker (:class:`atom.engine.step_worker.StepWorker`): no model, no KV
    tensors. Each sequence that reaches its last token emits the request's next output token
    (``TraceRequest.output_token_ids``, else :data:`SIM_OUTPUT_TOKEN_ID`); a sequence with
    drafts (n-gram speculation) keeps those that equal the tokens it would emit, then one
    more, as greedy verification does on a model that emits those tokens.

    A model-based draft (``mtp``, ``draft``: ``proposes_drafts``) has no model here: each
    drafting sequence proposes its request's next recorded proposal
    (``TraceRequest.draft_token_ids``, a real run's, cut to the slots reserved), so it accepts
    as many drafts as the real verify did, in the same steps.

    Args:
        runtime: the rank's pool and sequence limit (vocabulary and EOS ids unused).
        scripts: request id → the output tokens to emit (the simulator sets it from the
            workload's ``output_token_ids``).
        proposes_drafts: replay a model-based draft's recorded proposals (the simulator sets
            ``drafts`` from the workload's ``draft_token_ids``).
    """

    kv_transfer_port = None

    def __init__(self, runtime: EngineRuntime,
                 scripts: dict[str, tuple[int, ...]] | None = None, *,
                 proposes_drafts: bool = False):
        self.runtime = runtime
        self.scripts = scripts or {}
        self.proposes_drafts = proposes_drafts
        self.drafts: dict[str, tuple[tuple[int, ...], ...]] = {}
        self._num_proposed: dict[str, int] = {}  # request id -> recorded proposals used

    def execute_model(self, sched: SchedulerOutput, *, two_batch_overlap: bool = False
                      ) -> ModelRunnerOutput:
        return ModelRunnerOutput.from_tokens({seq.seq_id: self._emit(seq)
                                              for seq in sched.sampled_seqs()})

    def _emit(self, seq: Sequence) -> list[int]:
        script = self.scripts.get(seq.request_id, ())
        start = seq.num_output_tokens
        tokens = [script[i] if i < len(script) else SIM_OUTPUT_TOKEN_ID
                  for i in range(start, start + len(seq.spec_token_ids) + 1)]
        accepted = 0
        while accepted < len(seq.spec_token_ids) and seq.spec_token_ids[accepted] == tokens[accepted]:
            accepted += 1
        return tokens[:accepted + 1]

    def execute_dummy_batch(self, *, two_batch_overlap: bool = False) -> None:
        pass

    def propose_drafts(self, seqs: list[Sequence], max_num_tokens: list[int], *,
                       num_steps: int | None = None) -> list[list[int]]:
        """Each sequence's next recorded proposal, cut to its reserved slots.

        Raises:
            RuntimeError: a sequence drafts more often than its request did in the recorded
                run (the replay has left the recorded steps).
        """
        drafts = []
        for seq, limit in zip(seqs, max_num_tokens):
            recorded = self.drafts.get(seq.request_id, ())
            index = self._num_proposed.get(seq.request_id, 0)
            if index >= len(recorded):
                raise RuntimeError(f"request {seq.request_id} drafts a {index + 1}th time; the "
                                   f"recorded run drafted {len(recorded)} times for it")
            self._num_proposed[seq.request_id] = index + 1
            drafts.append(list(recorded[index][:limit]))
        return drafts

    def num_draft_tokens(self, seqs: list[Sequence]) -> int:
        """One per drafting sequence: the draft forwards' size is not modelled (an MTP
        catch-up runs several positions per sequence; only EP padding depends on it)."""
        return len(seqs)

    def start_kv_transfers(self, meta: KVConnectorMetadata) -> None:
        pass

    def get_kv_connector_output(self) -> KVConnectorOutput:
        return KVConnectorOutput()

    def has_pending_kv_output(self) -> bool:
        return False

    def wait_for_kv_transfers(self, timeout_s: float) -> None:
        pass

    def get_stats(self) -> dict[str, int | float]:
        return {}

    def close(self) -> None:
        pass


class _EventsToIndex:
    """The core's KV events publisher in the simulator: each step's batch goes straight to
    the router's KV index (``cache_aware``) or nowhere."""

    def __init__(self, index, dp_rank: int):
        self.index, self.dp_rank = index, dp_rank

    def publish(self, events) -> None:
        if self.index is not None:
            self.index.apply(self.dp_rank, events)

    def stats(self) -> dict[str, int]:
        return {"num_published_batches": 0, "num_dropped_batches": 0}

    def close(self) -> None:
        pass


class SimRank:
    """A virtual rank. Owns its engine core (over a :class:`SimWorker`), held tick-clocked
    requests and the records of the requests it was given; the simulator drives it one tick
    at a time.

    Args:
        config: the deployment's engine options (budgets, block size, prefix caching, TBO,
            speculation: n-gram, or a model-based draft replayed from the workload).
        dp_rank: this rank.
        num_kv_blocks: its KV pool (``config.resolved_num_kv_blocks`` of the model).
        kv_cache_group_windows: the model's KV cache groups (the profile's facts).
        max_model_len: ``config.resolved_max_model_len`` of the model.
        index: the router's KV index, fed this rank's KV events every step; None = off.
    Raises:
    """

    def __init__(self, config: EngineConfig, *, dp_rank: int, num_kv_blocks: int,
                 max_model_len: int, index=None,
                 kv_cache_group_windows: tuple[int | None, ...] = (None,)):
        self.dp_rank = dp_rank
        runtime = EngineRuntime(num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
                                vocab_size=SIM_VOCAB_SIZE, eos_token_ids=(), kv_cache_bytes=0,
                                dtype="simulated",
                                kv_cache_group_windows=kv_cache_group_windows)
        worker = SimWorker(runtime, proposes_drafts=config.speculative_method in MODEL_DRAFTS)
        self.core = EngineCore(config, worker, dp_rank=dp_rank,
                               kv_event_publisher=_EventsToIndex(index, dp_rank))
        self.arrivals: TickArrivals[TraceRequest] = TickArrivals()
        # time-clocked: requests sent to this rank, not yet taken ((send key, request))
        self.inbox: list[tuple[tuple[float, float], TraceRequest]] = []
        self.sent_frame = False  # complete(): its step sent an output frame
        self.records: dict[str, RequestRecord] = {}
        self.num_late_arrivals = 0

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def block_manager(self):
        return self.core.block_manager

    def has_work(self) -> bool:
        """The core's work or held tick-clocked requests (the control vector's
        ``has_work``, as the real DP loop computes it)."""
        return self.core.has_work() or len(self.arrivals) > 0

    def add(self, request: TraceRequest, *, now_s: float, tick: int,
            arrival_s: float | None = None) -> RequestRecord:
        """Give the core ``request`` (greedy, ``ignore_eos``: ``output_len`` tokens) at
        ``now_s``; its TTFT counts from ``arrival_s`` (default ``now_s``). A request that can
        never run finishes with ``error`` in the next step, as on a real rank."""
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        record = RequestRecord(request, self.dp_rank, now_s if arrival_s is None else arrival_s,
                               tick)
        self.records[request.request_id] = record
        self.core.add_request(EngineCoreRequest(
            request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=params, arrival_time_s=now_s))
        return record

    def micro_batches(self, sched: SchedulerOutput, *, tbo: bool) -> list[MicroBatch]:
        """The cost model's view of this rank's step (before it runs): one micro-batch, or
        the two :func:`atom.core.tbo_split.split_batch` makes."""
        if not tbo:
            return [micro_batch([(seq, 0, n) for seq, n in sched.scheduled])]
        return [micro_batch(half) for half in split_batch(sched.scheduled)]

    def complete(self, sched: SchedulerOutput, *, tbo: bool, end_s: float,
                 tick: int) -> list[RequestRecord]:
        """The rest of the step (``EngineCore.execute``: the worker's tokens, the scheduler's
        update); its outputs are timed at ``end_s``. Returns the records of the requests that
        finished in this step (rejected ones and those the pool cannot hold included)."""
        for seq in sched.preempted:
            if not seq.is_finished:
                self.records[seq.request_id].num_preemptions += 1
        outputs = self.core.execute(sched, two_batch_overlap=tbo)
        self.sent_frame = bool(outputs)  # the real rank sends a frame when it has outputs
        finished = []
        for out in outputs:
            record = self.records[out.request_id]
            if out.new_token_ids and record.first_token_tick is None:
                record.first_token_tick = tick
                record.num_cached_tokens = out.num_cached_tokens
            record.token_times_s += [end_s] * len(out.new_token_ids)
            if out.finish_reason is not None:
                record.finish_reason = out.finish_reason
                finished.append(record)
        return finished
