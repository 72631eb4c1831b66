"""The DP EngineCore process: one rank's busy loop, in lockstep with the other ranks.

Started by :class:`atom.dp.dp_client.DPEngineCoreClient` as::

    python -m atom.dp.dp_core_proc --config-json '{...}' --input-addr ADDR --output-addr ADDR

with the same arguments and the same ``main()`` skeleton as :mod:`atom.engine.core_proc`
(:func:`atom.engine.core_proc.run_process`), plus the rank contract in the environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; see :mod:`atom.dp.groups`), from which the DP
rank comes. Under a launcher (``atom launch``, torchrun) the ``atom`` command itself is the
rank process and calls :func:`run_rank` (:mod:`atom.entrypoints.launched`).

Per tick, on every rank, in this order (docs/ARCHITECTURE.md, "The DP tick"), with no early
return before the control sync:

1. drain the input socket without blocking, and hand the scheduler the tick-clocked requests
   whose tick has come (below);
2. control sync (:func:`atom.dp.sync.exchange_control`): work, shutdown, the prefill
   policy's inputs (:func:`atom.dp.prefill_policy.local_prefill_inputs`), wave id, tick. Every
   rank asked to shut down → all run the lockstep check and exit together. No rank has work →
   the wave ends: every rank increments its wave counter, rank 0 reports ``wave_complete`` to
   the front end, and every rank goes idle (blocks on its input socket: no collectives, no
   spinning);
3. ``decision = PrefillDecider.decide(gathered, previous_shapes)`` (the policy and the
   decode-protection interval, from gathered values only), then
   ``EngineCore.schedule(allow_prefill=decision.allow)``: the decision travels as a value;
4. batch-shape exchange (:func:`atom.dp.sync.exchange_batch_shape`);
5. forward: the real step, or ``EngineCore.execute_dummy_batch`` (a zero-token forward that
   writes no KV) when this rank has nothing to run — the same collectives either way;
6. send the outputs; with ``--dp-trace``, queue the tick's trace row
   (:mod:`atom.dp.dp_trace`; a background thread writes it).

What the tick does with the gathered values (stop, end the wave or step; the batch shape; the
step counters and the TBO agreement) is :mod:`atom.dp.tick`, which the simulator
(:mod:`atom.dp.sim`) runs too. Every :data:`LOCKSTEP_CHECK_EVERY` ticks (and at shutdown) the
ranks compare their collective sequence hashes (:func:`atom.dp.collectives.check_lockstep`).

Tick-clocked replay: a request with ``arrival_tick`` set is held (:class:`atom.dp.tick.TickArrivals`)
and handed to the scheduler at the start of the first tick of the wave whose number (counted
from the wave's first tick, identical on every rank) is ≥ its arrival tick; a rank holding
requests has work, so the group keeps stepping (dummy batches) until the last is due. Such a
request does not wake an idle rank: the front end sends every request of a replay before the
``StartWave`` that starts it (:class:`atom.dp.dp_client.DPEngineCoreClient`), so every rank
holds all of its requests before the wave's first tick, and the per-rank batch shapes of the
replay are the same whatever the machine's speed (greedy, ``ignore_eos``). A request released
after its tick (sent once the wave was running) is counted in ``num_late_arrivals``.

Membership changes: a group started after a rank failure (generation ``g`` > 0, from
``TORCHELASTIC_RESTART_COUNT``: the front end's fresh group, or a launcher's restart) logs the
change at its first tick (tick 0, right after the control sync, on every rank of the new
group): a lockstep check, the WARNING ``[dpR] membership change at tick 0: generation g runs
N rank(s) ...``, and with ``--dp-trace`` a ``membership_change`` event in the trace (the
group's trace files are ``FOLDER/gen<g>/``, so the lost group's trace is kept).

Waves (docs/ARCHITECTURE.md, "The DP tick", idle and waves): an idle rank wakes on ``StartWave(w)`` with ``w`` equal to
its wave counter (a stale ``w`` is ignored), on Shutdown, or on a request. A request carries the
wave the front end believed current: when that is older than the rank's wave, the front end
dispatched without knowing the group had gone idle (so it sent no StartWave), and the rank sends
:class:`~atom.messages.WaveWakeup` so the front end wakes every other rank. (The front end sends
a request before the StartWave that goes with it, so the woken rank always has the request in its
first tick and no empty wave is run.)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from atom.config import EngineConfig
from atom.engine.core_proc import (RANKS_STOPPING_SIGNAL, EngineCoreProc, ShutdownRequested,
                                   build_engine_core, dump_stacks_if_still_running, run_process)
from atom.messages import (
    AbortRequests,
    CoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    StartWave,
    UtilityCall,
    UtilityResult,
    WaveWakeup,
    encode,
)
from atom.dp.tick import (StepCounters, TickAction, TickArrivals, batch_shape, control_state,
                          tick_action)

if TYPE_CHECKING:
    from atom.dp.dp_trace import TraceWriter
    from atom.dp.eplb.manager import EplbManager
    from atom.dp.groups import DPGroups
    from atom.dp.prefill_policy import PrefillDecider
    from atom.dp.sync import GatheredBatchShape
    from atom.core.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

LOCKSTEP_CHECK_EVERY = 64  # ticks between collective-hash comparisons
# after a SIGTERM, how long a rank waits for every rank to be shutting down before it leaves
# alone (a SIGTERM to this rank only); below the launcher's 10 s SIGTERM → SIGKILL grace
SIGTERM_GRACE_S = 5.0


class DPEngineCoreProc(EngineCoreProc):
    """One DP rank's loop (module docstring). Reuses the single-rank process's sockets and input
    handling; replaces :meth:`run_busy_loop`.

    Args:
        core: the loaded engine core.
        prefill: this rank's :class:`~atom.dp.prefill_policy.PrefillDecider` (its decision is
            passed to ``core.schedule``).
        groups: the process groups (control and device).
        input_addr, output_addr: the front end's ZMQ endpoints.
        front_end: the front end, when this rank started it as its child (rank 0 under a
            launcher). Otherwise the front end is this process's parent (spawned ranks) or
            elsewhere (other launched ranks), and the parent's exit ends the loop.
        expert_parallel: the model's :class:`~atom.dp.expert_parallel.ExpertParallel`, told
            each step's largest batch after the batch-shape exchange; None without EP.
        eplb: the rank's :class:`~atom.dp.eplb.manager.EplbManager`, called after every
            step; None without EPLB.
        trace: the per-tick trace writer (``--dp-trace``; closed by :meth:`close`); None = off.
    """

    def __init__(self, core, prefill: PrefillDecider, groups, *, input_addr: str,
                 output_addr: str, front_end: subprocess.Popen | None = None,
                 expert_parallel=None, eplb: EplbManager | None = None,
                 trace: TraceWriter | None = None):
        super().__init__(core, input_addr=input_addr, output_addr=output_addr,
                         dp_rank=groups.rank_info.dp_rank)
        self.front_end = front_end
        self.expert_parallel = expert_parallel
        self.eplb = eplb
        self.prefill = prefill
        self.trace = trace
        self.groups = groups
        self.generation = groups.rank_info.restart_count  # which start of the group this is
        self._last_shapes: GatheredBatchShape | None = None  # the previous stepping tick's
        self.wave_id = 0
        self.tick = 0
        self.wave_start_tick = 0  # the current (or next) wave's first tick
        self.idle = True  # ranks start idle, in wave 0
        self.counters = StepCounters()
        self.arrivals: TickArrivals[EngineCoreRequest] = TickArrivals()  # tick-clocked, held
        self.num_late_arrivals = 0
        self._sigterm_at: float | None = None  # time.monotonic() of the first SIGTERM

    # ----- inputs -----

    def handle_input(self, message: CoreInput) -> None:
        if isinstance(message, StartWave):
            if self.idle and message.wave_id == self.wave_id:
                self.idle = False
            elif message.wave_id > self.wave_id:  # cannot happen with one front end
                logger.warning("[dp%d] StartWave(%d) ahead of this rank's wave %d: ignored",
                               self.dp_rank, message.wave_id, self.wave_id)
            return  # stale, or already stepping in this wave
        timed = isinstance(message, EngineCoreRequest) and message.arrival_tick is not None
        if timed:  # held until its tick; its StartWave wakes the group (module docstring)
            self.arrivals.hold(message.arrival_tick, message)
        else:
            super().handle_input(message)
        if isinstance(message, AbortRequests):
            aborted = set(message.request_ids)
            self.arrivals.discard(lambda request: request.request_id in aborted)
        if isinstance(message, EngineCoreRequest) and self.idle and (
                not timed or message.wave_id < self.wave_id):
            self.idle = False
            if message.wave_id < self.wave_id:
                # the front end dispatched without knowing the group went idle: no StartWave
                # follows for the others, so ask it to send one
                self._output.send(encode(WaveWakeup(dp_rank=self.dp_rank, wave_id=self.wave_id)))
        elif isinstance(message, Shutdown):
            self.idle = False  # enter a tick: the ranks stop together

    def _run_utility(self, call: UtilityCall) -> UtilityResult:
        from atom.dp.eplb.manager import EPLB_UTILITIES

        if call.method in EPLB_UTILITIES:
            if self.eplb is None:
                return UtilityResult(dp_rank=self.dp_rank, call_id=call.call_id,
                                     error=f"{call.method} needs the expert load: start "
                                           f"the engine with record_expert_load "
                                           f"(--record-expert-load) or enable_eplb")
            return UtilityResult(dp_rank=self.dp_rank, call_id=call.call_id,
                                 result=self.eplb.call_utility(call.method))
        result = super()._run_utility(call)
        if call.method == "get_stats" and result.error is None:
            result = UtilityResult(dp_rank=self.dp_rank, call_id=call.call_id,
                                   result={**(result.result or {}), **self.dp_stats()})
        return result

    def dp_stats(self) -> dict[str, int | float]:
        """Loop counters, the collective log, the prefill policy's counters
        (``prefill_policy_*``: decisions per reason, summing to ``prefill_policy_num_decisions``;
        identical on every rank) and with EPLB its ``eplb_*`` figures
        (:meth:`atom.dp.eplb.manager.EplbManager.stats`)."""
        from atom.dp.collectives import process_collective_log

        log = process_collective_log()
        out: dict[str, int | float] = {
            "dp_rank": self.dp_rank, "tick": self.tick, "wave_id": self.wave_id,
            "idle": int(self.idle), **dataclasses.asdict(self.counters),
            "num_held_arrivals": len(self.arrivals), "num_late_arrivals": self.num_late_arrivals,
            "collective_count": log.num_collectives, "collective_hash": log.hash_int64}
        out.update({f"prefill_policy_{k}": v for k, v in self.prefill.stats().items()})
        if self.eplb is not None:
            out.update(self.eplb.stats())
        return out

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        super().close()

    # ----- the loop -----

    def run_busy_loop(self) -> None:
        """Run until every rank is asked to shut down (or the front end is gone).

        In the loop, SIGTERM asks this rank to shut down like a Shutdown message does, so the
        ranks still stop together at a control sync when a launcher stops them (each node's a
        second or so after node 0's): leaving at once would fail the collective the others are
        in. A rank whose peers are not all shutting down within :data:`SIGTERM_GRACE_S`, or
        that gets a second SIGTERM, leaves alone.

        Raises:
            LockstepError: the ranks' collective sequences differ.
            CollectiveError: a collective failed (a peer died, or the group timed out).
            ShutdownRequested: SIGTERM, and the other ranks did not follow (above).
        """
        signal.signal(signal.SIGTERM, self._on_sigterm)
        while True:
            if (self._sigterm_at is not None
                    and time.monotonic() - self._sigterm_at > SIGTERM_GRACE_S):
                raise ShutdownRequested()
            if self.parent_is_gone():
                logger.warning("[dp%d] the parent process is gone: exiting", self.dp_rank)
                return
            self._check_front_end()
            if self.idle:
                self.process_inputs(block=True)  # wakes on StartWave, a request or Shutdown
                if self.idle:
                    self.core.apply_kv_connector_output()  # P/D: a consumer released kept blocks
                continue
            self.process_inputs(block=False)
            if self._tick_unless_stopping():
                return

    def _on_sigterm(self, signum, frame) -> None:
        if self._sigterm_at is not None:
            raise ShutdownRequested()
        from atom.dp.collectives import process_collective_log

        self._sigterm_at = time.monotonic()
        self._shutdown = True
        if (self.front_end is not None and self.front_end.poll() is None
                and not self.groups.rank_info.max_restarts):  # restarts keep the front end
            self.front_end.send_signal(RANKS_STOPPING_SIGNAL)  # its requests cannot finish
        self.idle = False  # enter a tick: the ranks stop together
        # a collective failing from now on means a peer has left already: no post-mortem
        # wait for its history (up to a minute), this rank is stopping anyway
        process_collective_log().detach_store()

    def _tick_unless_stopping(self) -> bool:
        """:meth:`_tick`; after SIGTERM a failed collective (a peer gone first) is the stop."""
        from atom.dp.collectives import CollectiveError

        try:
            return self._tick()
        except CollectiveError:
            if self._sigterm_at is None:
                raise
            raise ShutdownRequested() from None

    def _check_front_end(self) -> None:
        """Rank 0's own front end exited: fine after it sent Shutdown (the ranks then stop
        together); otherwise (it crashed or was killed) raise, so this rank exits non-zero and
        the launcher stops the others.

        Raises:
            RuntimeError: the front end exited without shutting the ranks down.
        """
        if self.front_end is None or self._shutdown or self.front_end.poll() is None:
            return
        self.process_inputs(block=True)  # its Shutdown may still be on the way (≤ 1 s)
        if not self._shutdown:
            raise RuntimeError(f"the front end (pid {self.front_end.pid}) exited with code "
                               f"{self.front_end.returncode} without shutting the ranks down; "
                               f"its error is above in this rank's stderr")

    def _tick(self) -> bool:
        """One tick (module docstring); True when the ranks stop together."""
        from atom.dp.collectives import check_lockstep, process_collective_log
        from atom.dp.sync import exchange_control

        start_ns = time.perf_counter_ns()
        core = self.core
        self._release_due_arrivals()
        core.scheduler.queue_ready_grammars()  # before the dry run that the exchange carries
        state = control_state(core.scheduler, has_work=core.has_work() or len(self.arrivals) > 0,
                              shutdown=self._shutdown, wave_id=self.wave_id, tick=self.tick)
        gathered = exchange_control(state, self.groups.control)
        synced_ns = time.perf_counter_ns()
        self.tick += 1
        log = process_collective_log()
        if self.tick == 1 and self.generation > 0:  # tick 0 of a group after a failure
            self._log_membership_change(gathered)
        action = tick_action(gathered)
        if action is TickAction.STOP:
            check_lockstep(log, self.groups.control)
            logger.info("[dp%d] every rank asked to shut down: exiting after %d ticks",
                        self.dp_rank, self.tick)
            return True
        if action is TickAction.END_WAVE:
            self._end_wave()
            return False
        if self.tick % LOCKSTEP_CHECK_EVERY == 0:
            check_lockstep(log, self.groups.control)
        decision = self.prefill.decide(gathered, self._last_shapes)
        sched = core.schedule(allow_prefill=decision.allow, defer_drafts=True)
        if self.trace is not None:
            from atom.dp.dp_trace import spec_counts, spec_since, tick_row

            spec_before = spec_counts(core.scheduler)
        shapes = self._last_shapes = self._step(sched)  # the next tick's previous_shapes
        if self.trace is not None:
            spec = spec_since(core.scheduler, spec_before)
            self.trace.write(tick_row(dp_rank=self.dp_rank, gathered=gathered, decision=decision,
                                      shapes=shapes, start_ns=start_ns, synced_ns=synced_ns,
                                      end_ns=time.perf_counter_ns(), eplb=self.eplb, spec=spec))
        return False

    def _log_membership_change(self, gathered) -> None:
        """Tick 0 of a group started after a rank failure (module docstring). Every rank of
        the group runs it at the same tick (the gathered ticks are all 0, which the control
        sync already checked), so its lockstep check pairs with the others'.

        Raises:
            LockstepError: the new group's ranks disagree about what they ran so far.
        """
        from atom.dp.collectives import check_lockstep, process_collective_log

        tick = gathered.tick.item(self.dp_rank)
        num_collectives = check_lockstep(process_collective_log(), self.groups.control)
        dp_size = self.groups.rank_info.dp_size
        logger.warning("[dp%d] membership change at tick %d: generation %d runs %d rank(s); the "
                       "lockstep check agrees (%d collectives since the group formed)",
                       self.dp_rank, tick, self.generation, dp_size, num_collectives)
        if self.trace is not None:
            self.trace.write_event({"event": "membership_change", "tick": tick,
                                    "generation": self.generation, "dp_size": dp_size,
                                    "num_collectives": num_collectives})

    def _release_due_arrivals(self) -> None:
        """Hand the scheduler the tick-clocked requests due at this tick of the wave."""
        for arrival_tick, request in self.arrivals.due(self.tick - self.wave_start_tick):
            self.num_late_arrivals += arrival_tick < self.tick - self.wave_start_tick
            self.core.add_request(request)

    def _step(self, sched: SchedulerOutput) -> GatheredBatchShape:
        """Steps 4-6 of the tick: the batch-shape exchange, the forward (a dummy batch when
        this rank has nothing to run), the outputs; returns the gathered batch shapes."""
        from atom.dp.sync import exchange_batch_shape

        core = self.core
        shapes = exchange_batch_shape(batch_shape(sched, tbo_eligible=core.tbo_eligible(sched),
                                                  num_draft_tokens=core.num_draft_tokens(sched)),
                                      self.groups.device)
        if shapes.max_num_draft_steps:  # a model draft's forwards, as many on every rank
            if self.expert_parallel is not None:
                self.expert_parallel.begin_step(shapes.max_num_draft_seqs)
            core.run_drafts(sched, num_steps=shapes.max_num_draft_steps)
            if self.trace is not None:  # for the simulator to replay (atom.dp.sim.workload)
                drafts = {seq.request_id: list(seq.spec_token_ids) for seq, _ in sched.scheduled
                          if seq.spec_token_ids}
                if drafts:
                    self.trace.write_event({"event": "drafts", "tick": self.tick - 1,
                                            "drafts": drafts})
        if self.expert_parallel is not None:
            self.expert_parallel.begin_step(shapes.max_num_tokens)
        tbo = self.counters.count_step(shapes, is_dummy=sched.is_empty)
        if sched.is_empty:  # same forward (and collectives) on zero tokens
            core.execute_dummy_batch(two_batch_overlap=tbo)
        self.send_outputs(core.execute(sched, two_batch_overlap=tbo))
        if self.eplb is not None:  # every step counts, dummy ones too (same tick on every rank)
            self.eplb.end_step(tick=self.tick - 1)
        return shapes

    def _end_wave(self) -> None:
        """No rank has work: all ranks end the wave together and go idle."""
        completed = self.wave_id
        self.wave_id += 1
        self.wave_start_tick = self.tick  # the next tick is the next wave's first
        self.counters.num_waves_completed += 1
        self.idle = True
        self.prefill.end_wave()
        self._last_shapes = None
        if self.dp_rank == 0:
            self._output.send(encode(EngineCoreOutputs(
                dp_rank=0, outputs=[], timestamp_s=time.monotonic(), wave_complete=completed)))
        logger.debug("[dp%d] wave %d complete at tick %d: idle", self.dp_rank, completed,
                     self.tick)


def run_rank(config: EngineConfig, *, extra_eos_token_ids: tuple[int, ...],
             endpoints: Callable[[DPGroups], tuple[str, str]],
             front_end: subprocess.Popen | None = None) -> None:
    """Run this process as one DP rank until the ranks stop together.

    Joins the process groups (rank contract from the environment), loads the engine core,
    gets the front end's ``(input_addr, output_addr)`` from ``endpoints(groups)``, connects,
    sends the ready message and runs :meth:`DPEngineCoreProc.run_busy_loop`.

    Args:
        config: engine options (``data_parallel_size`` is the world size).
        extra_eos_token_ids: the tokenizer's EOS ids (the core has no tokenizer).
        endpoints: where the front end's sockets are (it may wait for them to be published).
        front_end: the front end, when this rank started it (see :class:`DPEngineCoreProc`).
    Raises:
        Whatever start-up or the loop raises (LockstepError, CollectiveError, ...); SIGTERM
        arrives as ``ShutdownRequested`` once the handler is installed.
    """
    from atom.dp.groups import RankInfo, init_process_groups
    from atom.dp.prefill_policy import make_prefill_decider

    info = RankInfo.from_env()
    if config.data_parallel_size != info.dp_size:
        raise ValueError(f"data_parallel_size={config.data_parallel_size} but WORLD_SIZE gives "
                         f"{info.dp_size} DP ranks")
    # groups first: the ranks start together, so the rendezvous never waits out one rank's
    # slower model load (under load that exceeded a short --dp-group-timeout-s); an idle rank
    # issues no collective until a wave starts, after every rank is ready
    groups = init_process_groups(info, timeout_s=config.dp_group_timeout_s)
    core = proc = None
    try:
        core = build_engine_core(config, extra_eos_token_ids=extra_eos_token_ids,
                                 dp_rank=info.dp_rank)
        expert_parallel = None
        if config.enable_expert_parallel:
            from atom.dp.expert_parallel import apply_expert_parallel

            expert_parallel = apply_expert_parallel(core.worker.model, groups.device,
                                                    rank=info.dp_rank, world_size=info.dp_size)
        input_addr, output_addr = endpoints(groups)
        prefill = make_prefill_decider(config, dp_rank=info.dp_rank)
        trace = None
        if config.dp_trace is not None:
            from atom.dp.dp_trace import TraceWriter

            trace = TraceWriter(config.dp_trace, dp_rank=info.dp_rank, dp_size=info.dp_size,
                                policy=prefill.policy.name, generation=info.restart_count)
        eplb = None
        if config.resolved_record_expert_load():  # EPLB's counting, moving or not
            from atom.dp.eplb.manager import EplbManager

            eplb = EplbManager(config, core.worker.model, expert_parallel, rank=info.dp_rank,
                               world_size=info.dp_size, trace=trace,
                               num_nodes=max(1, info.dp_size // info.local_world_size),
                               timeout_s=config.dp_group_timeout_s)
        proc = DPEngineCoreProc(core, prefill, groups, input_addr=input_addr,
                                output_addr=output_addr, front_end=front_end,
                                expert_parallel=expert_parallel, eplb=eplb, trace=trace)
        proc.send_ready()
        proc.run_busy_loop()
    finally:
        dump_stacks_if_still_running()
        if core is not None:
            core.close()
        if proc is not None:
            proc.close()
        groups.destroy()


def _run_spawned_rank(args: argparse.Namespace) -> None:
    run_rank(args.config, extra_eos_token_ids=tuple(args.extra_eos_token_ids),
             endpoints=lambda groups: (args.input_addr, args.output_addr))


def main(argv: list[str] | None = None) -> int:
    """Run one DP rank started by the DP client; returns its exit code (0 on a clean
    shutdown, 1 on error)."""
    return run_process(argv, _run_spawned_rank)


if __name__ == "__main__":
    sys.exit(main())
