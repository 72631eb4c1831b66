"""One virtual DP rank of the simulator: the engine's own scheduler and block manager, with
the forward pass and the sampler replaced (tokens come from the trace's output lengths).

What it shares with :class:`atom.engine.core.EngineCore` (no copy of either): the
:class:`~atom.core.scheduler.Scheduler` (its budgets from ``SchedulerConfig.from_engine_config``)
and :class:`~atom.core.block_manager.BlockManager`, ``SchedulerOutput.sampled_seqs`` (which
sequences a step samples), ``Scheduler.postprocess`` (counters, prefix-cache publication,
stop checks: ``max_tokens`` = the trace's output length, ``ignore_eos``) and
``atom.worker.tbo.can_split`` (TBO eligibility). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atom.core.block_manager import BlockManager
from atom.config import EngineConfig
from atom.dp.sim.cost_model import MicroBatch, micro_batch
from atom.dp.sim.workload import SIM_OUTPUT_TOKEN_ID, TraceRequest
from atom.dp.tick import TickArrivals
from atom.sampling_params import SamplingParams
from atom.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from atom.core.sequence import Sequence
from atom.worker.tbo import can_split, split_batch


@dataclass
class RequestRecord:
    """One request's life in the simulation (times on the simulated clock, seconds).

    ``token_times_s`` has one entry per output token (the end of the step that sampled it).
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


class SimRank:
    """A virtual rank. Owns its scheduler, block manager, held tick-clocked requests and the
    records of the requests it was given; the simulator drives it one tick at a time.

    Args:
        config: the deployment's engine options (budgets, block size, prefix caching, TBO).
        dp_rank: this rank.
        num_kv_blocks: its KV pool (``config.resolved_num_kv_blocks`` of the model).
        max_model_len: ``config.resolved_max_model_len`` of the model.
    Raises:
        ValueError: ``config`` turns speculative decoding on (not simulated).
    """

    def __init__(self, config: EngineConfig, *, dp_rank: int, num_kv_blocks: int,
                 max_model_len: int):
        if config.speculative_method is not None:
            raise ValueError("the simulator has no model to verify drafts with: run it without "
                             "speculative_method")
        self.dp_rank = dp_rank
        self.enable_tbo = config.enable_tbo
        self.block_manager = BlockManager(num_kv_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(config, max_model_len),
                                   self.block_manager)
        self.arrivals: TickArrivals[TraceRequest] = TickArrivals()
        # time-clocked: requests sent to this rank, not yet taken ((send key, request))
        self.inbox: list[tuple[tuple[float, float], TraceRequest]] = []
        self.sampled_last_step = False  # complete(): its step sampled a token
        self.records: dict[str, RequestRecord] = {}
        self._seqs: dict[int, RequestRecord] = {}  # seq_id -> its request's record
        self.num_late_arrivals = 0

    def has_work(self) -> bool:
        """Unfinished sequences or held tick-clocked requests (the control vector's
        ``has_work``)."""
        return self.scheduler.has_unfinished() or len(self.arrivals) > 0

    def add(self, request: TraceRequest, *, now_s: float, tick: int,
            arrival_s: float | None = None) -> RequestRecord:
        """Give the scheduler ``request`` (greedy, ``ignore_eos``: ``output_len`` tokens) at
        ``now_s``; its TTFT counts from ``arrival_s`` (default ``now_s``)."""
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        seq = Sequence(request.request_id, list(request.prompt_token_ids), params,
                       arrival_time_s=now_s)
        record = RequestRecord(request, self.dp_rank, now_s if arrival_s is None else arrival_s,
                               tick)
        self.records[request.request_id] = record
        self._seqs[seq.seq_id] = record
        if not self.scheduler.add(seq):
            record.finish_reason = "error"
        return record

    def tbo_eligible(self, sched: SchedulerOutput) -> bool:
        """As ``EngineCore.tbo_eligible``: TBO on and the batch can split."""
        return self.enable_tbo and can_split(sched.scheduled)

    def micro_batches(self, sched: SchedulerOutput, *, tbo: bool) -> list[MicroBatch]:
        """The cost model's view of this rank's step (before it runs): one micro-batch, or
        the two ``atom.worker.tbo.split_batch`` makes."""
        if not tbo:
            return [micro_batch([(seq, 0, n) for seq, n in sched.scheduled])]
        return [micro_batch(half) for half in split_batch(sched.scheduled)]

    def complete(self, sched: SchedulerOutput, *, end_s: float, tick: int) -> list[RequestRecord]:
        """Finish the step: the sampled sequences get the trace's token, the scheduler
        postprocesses; returns the records of the requests that finished in this step (a
        sequence the pool cannot hold even alone included)."""
        sampled = sched.sampled_seqs()
        self.sampled_last_step = bool(sampled)  # the real rank sends an output frame
        self.scheduler.postprocess(sched, {seq.seq_id: SIM_OUTPUT_TOKEN_ID for seq in sampled})
        finished = []
        for seq in sampled:
            record = self._seqs[seq.seq_id]
            record.token_times_s.append(end_s)
            if record.first_token_tick is None:
                record.first_token_tick = tick
                record.num_cached_tokens = seq.num_cached_tokens
            if seq.is_finished:
                finished.append(self._finish(seq))
        for seq in sched.preempted:
            if seq.is_finished:  # cut: the pool cannot hold it even alone
                finished.append(self._finish(seq))
        return finished

    def _finish(self, seq: Sequence) -> RequestRecord:
        record = self._seqs.pop(seq.seq_id)
        record.finish_reason = seq.finish_reason.value
        record.num_preemptions = seq.num_preemptions
        return record
