"""The simulator's DP loop: N virtual ranks ticking together, with the engine's decisions.

Each tick does what :meth:`atom.dp.dp_core_proc.DPEngineCoreProc._tick` does on every
rank, with the two all-gathers replaced by gathering the same values in memory:

1. hand each rank's engine core the requests that arrived (time-clocked: routed now by the
   real :class:`~atom.dp.router.DPRouter`; tick-clocked: held since submission and due now,
   :class:`~atom.dp.tick.TickArrivals`);
2. every rank's :func:`~atom.dp.tick.control_state` → ``GatheredControl.from_states`` →
   :func:`~atom.dp.tick.tick_action` (end the wave when no rank has work);
3. the deployment's :class:`~atom.dp.prefill_policy.PrefillDecider` decides once (its state
   is identical on every rank, so one object serves the group), then every rank's
   ``EngineCore.schedule(allow_prefill=...)`` (n-gram drafts included);
4. :func:`~atom.dp.tick.batch_shape` per rank → ``GatheredBatchShape.from_shapes``; a
   model-based draft's proposals (MTP, early exit: a real run's, replayed by the
   :class:`~atom.dp.sim.rank.SimWorker`) fill the reserved slots (``EngineCore.run_drafts``);
   every rank's :class:`~atom.dp.tick.StepCounters` counts the step and the TBO agreement;
5. the forward is the cost model (:class:`~atom.dp.sim.cost_model.CostModel`): the clock
   advances by the group's step; every rank's real ``EngineCore.execute`` completes its step
   (its :class:`~atom.dp.sim.rank.SimWorker` emits the workload's tokens, its scheduler's
   ``update_from_output`` runs), its outputs timed when its own forward ends (without EP it
   does not wait for the slowest);
6. KV events go to the router's :class:`~atom.engine.kv_subscriber.KVCacheIndex` (``cache_aware``),
   finished requests release their router load, and with a trace folder every rank's row is
   written in the ``--dp-trace`` format (:mod:`atom.dp.dp_trace`, on the simulated clock).

With a routing source (:mod:`atom.dp.sim.experts`), step 5 first routes the step's tokens:
the cost model's expert compute follows the step's imbalance over the ranks, and with
``enable_eplb`` EPLB's own controller records the counts, closes its windows and switches its
placement at the same steps as the real ranks (an ``eplb_window`` event in the trace).

Time-clocked workloads (``arrival_s``) go through a model of the real front end
(:class:`SimFrontEnd`: the offline driver, :func:`atom.dp.sim.replay.drive`, and the server's
engine thread send alike): while a request it sent is unfinished it waits in
``LLMEngine.step()`` for the next output frame of a rank (or ``LLMEngine``'s 1 s wait) and
sends what arrived meanwhile, routed then; with none unfinished it sends each request on
arrival. A rank takes what reached its socket when its tick starts (as soon as its previous
step ends and it has sent that step's outputs), so a request the front end sends on that
rank's own output frame reaches it just after it drained its socket and waits a tick. An
idle group woken by a send starts its first tick ``wake_s`` later with every request sent at
that instant. TTFT counts from the request's arrival (the real replay
passes the same arrival time to ``LLMEngine.add_request``). Tick-clocked workloads
(``arrival_tick``) replay as the real engine does (``atom.dp.sim.replay``): every request
is routed at submission, in trace order, before the first tick (so the router sees every
earlier request's load and no finish), and becomes visible at tick ``arrival_tick`` of the
one wave the replay runs. Imports no torch.
"""

from __future__ import annotations

import json
import math
import pathlib
import time
from collections import deque
from collections.abc import Sequence

from atom.config import EngineConfig
from atom.dp.dp_trace import format_row, spec_counts, spec_since, tick_row, trace_header
from atom.dp.prefill_decision import Decision
from atom.dp.prefill_policy import make_prefill_decider
from atom.dp.router import CacheAwareSettings, DPRouter
from atom.dp.sim.cost_model import CostModel, StepCost
from atom.dp.sim.experts import SimExperts
from atom.dp.sim.rank import RequestRecord, SimRank
from atom.dp.sim.workload import TraceRequest, workload_clock
from atom.dp.sync import GatheredBatchShape, GatheredControl
from atom.dp.tick import StepCounters, TickAction, batch_shape, control_state, tick_action
from atom.engine.kv_subscriber import KVCacheIndex, wire_block_hashes
from atom.core.scheduler_output import SchedulerOutput

DEFAULT_MAX_TICKS = 10_000_000  # a runaway guard, far above any workload's need
STEP_WAIT_S = 1.0  # LLMEngine.step()'s longest wait for outputs (atom.engine.llm_engine)


class SimTraceWriter:
    """Every virtual rank's ``dp<rank>.jsonl`` (the ``--dp-trace`` format), written as the
    simulation goes (synchronously: nothing else runs). Owns the files until :meth:`close`."""

    def __init__(self, folder: str | pathlib.Path, *, dp_size: int, policy: str):
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._files = [open(folder / f"dp{r}.jsonl", "w", buffering=1 << 16)
                       for r in range(dp_size)]
        for r, f in enumerate(self._files):
            f.write(trace_header(dp_rank=r, dp_size=dp_size, policy=policy,
                                 wall_minus_perf_us=0) + "\n")

    def write(self, dp_rank: int, row: tuple) -> None:
        self._files[dp_rank].write(format_row(row) + "\n")

    def write_event(self, event: dict) -> None:
        """One event (a JSON object with an ``event`` key) in every rank's file, as every
        real rank writes its own."""
        for f in self._files:
            f.write(json.dumps(event) + "\n")

    def close(self) -> None:
        for f in self._files:
            f.close()


class Simulator:
    """Owns the virtual ranks, the router (and its KV index), the prefill decider, the
    simulated clock and the tick and wave counters. One :meth:`run` per instance.

    Args:
        config: the deployment (``data_parallel_size`` ranks, its budgets, policy, routing,
            TBO; ``num_kv_blocks`` and ``max_model_len`` as resolved by the caller).
        cost: the cost model.
        num_kv_blocks, max_model_len: each rank's pool and sequence limit.
        kv_cache_group_windows: the model's KV cache groups (the profile's facts; one full
            group unless the model has sliding layers).
        trace_dir: write the per-tick trace there; None = off.
        max_ticks: stop with RuntimeError after this many ticks (a runaway guard).
        experts: the routed tokens' skew and placement (with expert parallelism; EPLB's
            controller with ``enable_eplb``); None = balanced experts.
    """

    def __init__(self, config: EngineConfig, cost: CostModel, *, num_kv_blocks: int,
                 max_model_len: int, trace_dir: str | pathlib.Path | None = None,
                 max_ticks: int = DEFAULT_MAX_TICKS, experts: SimExperts | None = None,
                 kv_cache_group_windows: tuple[int | None, ...] = (None,)):
        n = config.data_parallel_size
        self.config = config
        self.cost = cost
        cache_aware = config.dp_load_balance == "cache_aware"
        self.index = KVCacheIndex(range(n)) if cache_aware else None
        self.ranks = [SimRank(config, dp_rank=r, num_kv_blocks=num_kv_blocks,
                              max_model_len=max_model_len, index=self.index,
                              kv_cache_group_windows=kv_cache_group_windows)
                      for r in range(n)]
        self.counters = [StepCounters() for _ in range(n)]
        self.decider = make_prefill_decider(config, log_every_n_decisions=None)
        self.router = DPRouter(config.dp_load_balance, n, index=self.index,
                               cache_aware=CacheAwareSettings.from_config(config)
                               if cache_aware else None)
        self.trace = (None if trace_dir is None else
                      SimTraceWriter(trace_dir, dp_size=n, policy=self.decider.policy.name))
        self.max_ticks = max_ticks
        self.experts = experts
        self.front_end: SimFrontEnd | None = None  # time-clocked workloads' sends (run)
        self._rank_ends_s: list[float] = []  # each rank's last step end (the trace's clock)
        self.now_s = 0.0
        self.tick = 0
        self.wave_id = 0
        self.wave_start_tick = 0
        self.idle = True
        self.last_shapes: GatheredBatchShape | None = None
        self.records: list[RequestRecord] = []
        self.samples: list[tuple[int, float, list[int], list[float]]] = []  # load, KV per tick
        self.step_log: list[tuple[int, StepCost]] = []  # (tick, its cost) of every step

    # ----- requests -----

    def _dispatch(self, request: TraceRequest) -> SimRank:
        """Route ``request`` (charging its rank one request, as the DP client does)."""
        hashes = (wire_block_hashes(request.prompt_token_ids, self.config.block_size)
                  if self.index is not None and request.dp_rank is None else ())
        rank = self.router.dispatch(request.request_id, request.dp_rank,
                                    session_id=request.session_id, block_hashes=hashes)
        return self.ranks[rank]

    def _add(self, rank: SimRank, request: TraceRequest, arrival_s: float | None = None) -> None:
        self.records.append(rank.add(request, now_s=self.now_s, tick=self.tick,
                                     arrival_s=arrival_s))

    def _take_sent(self) -> None:
        """Every rank takes the requests that reached its socket before its tick started
        (time-clocked: :class:`SimFrontEnd`)."""
        for rank, intake in zip(self.ranks, self.front_end.intake):
            if not rank.inbox:
                continue
            taken = [(key, request) for key, request in rank.inbox if key < intake]
            rank.inbox = [(key, request) for key, request in rank.inbox if not key < intake]
            for _, request in taken:
                self._add(rank, request, arrival_s=request.arrival_s)

    def _release_due(self) -> None:
        tick_in_wave = self.tick - self.wave_start_tick
        for rank in self.ranks:
            for arrival_tick, request in rank.arrivals.due(tick_in_wave):
                rank.num_late_arrivals += arrival_tick < tick_in_wave
                self._add(rank, request)

    # ----- the run -----

    def run(self, workload: Sequence[TraceRequest]) -> None:
        """Simulate ``workload`` to its last finish (see the module docstring for the clocks).

        Raises:
            ValueError: a mixed-clock workload, or a rank hint outside the deployment.
            RuntimeError: more than ``max_ticks`` ticks.
        """
        scripts = {r.request_id: r.output_token_ids for r in workload
                   if r.output_token_ids is not None}
        drafts = {r.request_id: r.draft_token_ids for r in workload
                  if r.draft_token_ids is not None}
        if self.ranks[0].core.worker.proposes_drafts and not drafts:
            raise ValueError(f"speculative_method={self.config.speculative_method!r} has no "
                             f"model to draft with here: give the workload a real run's "
                             f"recorded drafts (workload.with_drafts(requests, "
                             f"workload.drafts_from_trace(its --dp-trace folder)))")
        for rank in self.ranks:  # what each request emits (TraceRequest.output_token_ids)
            rank.core.worker.scripts = scripts  # and drafts (.draft_token_ids)
            rank.core.worker.drafts = drafts
        if workload_clock(workload) == "tick":
            for request in sorted(workload, key=lambda r: r.arrival_tick):
                self._dispatch(request).arrivals.hold(request.arrival_tick, request)
            self.idle = False  # the replay's StartWave
        else:
            self.front_end = SimFrontEnd(workload, self._dispatch, len(self.ranks))
        while True:
            if self.idle:
                if self.front_end is None:
                    return
                wake_s = self.front_end.wake(self.now_s)
                if wake_s is None:
                    return
                self.now_s = wake_s + self.cost.c.wake_s
                self.idle = False
            if self.front_end is not None:
                self.front_end.send_on_arrival(self.now_s)
                self._take_sent()
            self._tick()
            if self.tick > self.max_ticks:
                raise RuntimeError(f"the simulation ran {self.max_ticks} ticks: a runaway?")

    def _tick(self) -> None:
        """One tick of every rank (module docstring)."""
        self._release_due()
        for r in self.ranks:  # as the DP loop: compiled grammars join before the dry run
            r.core.scheduler.queue_ready_grammars()
        gathered = GatheredControl.from_states([
            control_state(r.core.scheduler, has_work=r.has_work(), shutdown=False,
                          wave_id=self.wave_id, tick=self.tick) for r in self.ranks])
        self.tick += 1
        if tick_action(gathered) is TickAction.END_WAVE:
            self._end_wave()
            return
        decision = self.decider.decide(gathered, self.last_shapes)
        scheds = [r.core.schedule(allow_prefill=decision.allow, defer_drafts=True)
                  for r in self.ranks]
        shapes = GatheredBatchShape.from_shapes([
            batch_shape(s, tbo_eligible=r.core.tbo_eligible(s),
                        num_draft_tokens=r.core.num_draft_tokens(s))
            for r, s in zip(self.ranks, scheds)])
        if shapes.max_num_draft_steps:  # a model draft's proposals (replayed), after the exchange
            for r, s in zip(self.ranks, scheds):
                r.core.run_drafts(s, num_steps=shapes.max_num_draft_steps)
        tbo = [c.count_step(shapes, is_dummy=s.is_empty)
               for c, s in zip(self.counters, scheds)][0]
        start_s = self.now_s
        imbalance = (1.0 if self.experts is None
                     else self.experts.step(self.tick - 1, shapes.num_tokens.tolist()))
        cost = self.cost.step([r.micro_batches(s, tbo=tbo) for r, s in zip(self.ranks, scheds)],
                              expert_imbalance=imbalance)
        self.step_log.append((self.tick - 1, cost))
        self.now_s += cost.total_s
        ends_s = [start_s + done for done in cost.rank_done_s]
        spec_before = [spec_counts(r.scheduler) for r in self.ranks]
        self._complete(scheds, ends_s, tbo=tbo)
        spec = [spec_since(r.scheduler, before) for r, before in zip(self.ranks, spec_before)]
        self.last_shapes = shapes
        window = None if self.experts is None else self.experts.end_step(self.tick - 1)
        if self.trace is not None:
            self._trace(gathered, decision, shapes, start_s, ends_s, spec)
            if window is not None:
                self.trace.write_event(window.event(tick=self.tick - 1,
                                                    phy2log=self.experts.controller.plan.phy2log))
        self.samples.append((self.tick - 1, start_s,
                             [r.scheduler.num_running + r.scheduler.num_waiting for r in self.ranks],
                             [r.block_manager.kv_usage for r in self.ranks]))

    def _complete(self, scheds: list[SchedulerOutput], ends_s: list[float], *, tbo: bool
                  ) -> None:
        """Complete every rank's step (its outputs at ``ends_s[r]``; its KV events reach the
        index there); release finished requests; the front end gets every rank's output
        frame."""
        frames = []
        for rank, sched, end_s in zip(self.ranks, scheds, ends_s):
            finished = rank.complete(sched, tbo=tbo, end_s=end_s, tick=self.tick - 1)
            for record in finished:
                self.router.release(record.request.request_id)
            if self.front_end is not None and rank.sent_frame:
                frames.append((end_s, [r.request.request_id for r in finished]))
        if self.front_end is not None:
            self.front_end.step_ended(ends_s, sorted(frames))

    def _end_wave(self) -> None:
        self.wave_id += 1
        self.wave_start_tick = self.tick
        for c in self.counters:
            c.num_waves_completed += 1
        self.idle = True
        self.decider.end_wave()
        self.last_shapes = None

    def _trace(self, gathered: GatheredControl, decision: Decision, shapes: GatheredBatchShape,
               start_s: float, ends_s: list[float],
               spec: list[tuple[int, int] | None]) -> None:
        """Every rank's row as a real rank writes it: the tick starts when the rank's last step
        ended (the group's start after an idle gap), its sync ends with the group's (a rank
        that finished early waits there), its step ends with its own forward."""
        contiguous = self._rank_ends_s and abs(max(self._rank_ends_s) - start_s) < 1e-9
        starts = self._rank_ends_s if contiguous else [start_s] * len(self.ranks)
        synced_ns = round((start_s + self.cost.c.tick_s) * 1e9)
        for r in range(len(self.ranks)):
            self.trace.write(r, tick_row(dp_rank=r, gathered=gathered, decision=decision,
                                         shapes=shapes, start_ns=round(starts[r] * 1e9),
                                         synced_ns=synced_ns, end_ns=round(ends_s[r] * 1e9),
                                         eplb=None if self.experts is None
                                         else self.experts.row(r), spec=spec[r]))
        self._rank_ends_s = ends_s

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


class SimFrontEnd:
    """The real front end's sends of a time-clocked workload (module docstring), and when
    each rank drains its socket.

    A send is keyed ``(seconds, order)``; a rank takes at its tick the requests whose key is
    below its ``intake`` key. ``intake[r]`` is ``(end of rank r's last step, 0)``: the rank
    drains its socket right after sending that step's output frame, before the front end,
    woken by a frame at the same instant, sends (keys ``(t, 1..)``). At a wake the intake
    follows every send of that instant.

    Args:
        workload: the requests (time-clocked).
        dispatch: routes a request to its rank (the simulator's router, charging its load).
        num_ranks: the group's size.
    """

    def __init__(self, workload: Sequence[TraceRequest], dispatch, num_ranks: int):
        self.unsent = deque(sorted(workload, key=lambda r: r.arrival_s))
        self.dispatch = dispatch
        self.unfinished: set[str] = set()  # sent, its last output not yet received
        self.idle_since: float | None = 0.0  # None while it waits for outputs
        self.last_wake_s = 0.0  # when its current wait for outputs began
        self.intake: list[tuple[float, float]] = [(0.0, 0.0)] * num_ranks

    def _send_due(self, at_s: float) -> int:
        """Send (route, and put on the rank's socket) every request that arrived by ``at_s``;
        returns how many."""
        order = 0
        while self.unsent and self.unsent[0].arrival_s <= at_s:
            request = self.unsent.popleft()
            order += 1
            self.dispatch(request).inbox.append(((at_s, float(order)), request))
            self.unfinished.add(request.request_id)
        if order:
            self.idle_since = None
            self.last_wake_s = at_s
        return order

    def wake(self, now_s: float) -> float | None:
        """The group is idle at ``now_s``: when its next tick starts (its ranks' intake set),
        or None when every request has been served. Requests left on a socket when the wave
        ended wake their rank at once; otherwise the front end sends the next arrival."""
        if self.unfinished:  # sent, not yet taken: on a socket
            self.intake = [(now_s, math.inf)] * len(self.intake)
            return now_s
        if not self.unsent:
            return None
        at_s = max(now_s, self.unsent[0].arrival_s, self.idle_since or 0.0)
        self._send_due(at_s)
        # every request sent at that instant: the ranks drain their sockets after waking, and
        # in 10 of 12 real runs (run F3) the three t = 0 requests of rank 0 got their first
        # token together; in the other 2 the waking request (or two) ran a step alone
        self.intake = [(at_s, math.inf)] * len(self.intake)
        return at_s

    def step_ended(self, ends_s: Sequence[float], frames: Sequence[tuple[float, list[str]]]):
        """A step ended: rank r drains its socket at ``ends_s[r]``; ``frames`` are the output
        frames ``(seconds, the requests they finish)`` in time order. The front end, waiting
        for outputs, sends what arrived at each frame (and at each 1 s wait that timed out);
        once nothing it sent is unfinished it sends on arrival."""
        for at_s, finished in frames:
            self._timeouts_until(at_s)
            self.finished(finished, at_s=at_s)
        self._timeouts_until(max(ends_s))
        self.intake = [(end_s, 0.0) for end_s in ends_s]

    def finished(self, request_ids: list[str], *, at_s: float) -> None:
        """The front end receives a frame at ``at_s`` finishing ``request_ids``, then sends
        what arrived; with nothing unfinished it goes on sending on arrival."""
        if self.idle_since is not None:
            return
        self.unfinished.difference_update(request_ids)
        self.last_wake_s = at_s
        self._send_due(at_s)
        if not self.unfinished:
            self.idle_since = at_s

    def send_on_arrival(self, until_s: float) -> None:
        """While nothing it sent is unfinished (the group may still be ending its wave),
        the front end sends the next request that arrives by ``until_s`` on arrival."""
        if self.idle_since is not None and self.unsent and self.unsent[0].arrival_s <= until_s:
            self._send_due(max(self.unsent[0].arrival_s, self.idle_since))

    def _timeouts_until(self, at_s: float) -> None:
        """``LLMEngine.step()`` returns empty-handed after waiting ``STEP_WAIT_S``; the
        driver then sends what arrived."""
        while self.idle_since is None and self.last_wake_s + STEP_WAIT_S < at_s:
            self.last_wake_s += STEP_WAIT_S
            self._send_due(self.last_wake_s)


def run_timed(sim: Simulator, workload: Sequence[TraceRequest]) -> tuple[float, float]:
    """Run ``sim`` on ``workload`` (and close it); returns the wall-clock and the CPU seconds
    it took on this host (on shared cores the CPU time is the one that reproduces)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    try:
        sim.run(workload)
    finally:
        sim.close()
    return time.perf_counter() - start, time.process_time() - start_cpu
