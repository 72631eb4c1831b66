"""Replay a workload on the real engine: real DP rank processes, greedy, ``ignore_eos``.

The real counterpart of :func:`atom.dp.sim.simulate`, used by ``scripts/dp_experiment.py``,
the calibration's real run (:mod:`atom.dp.sim.calibrate`), the step-parity test and the
accuracy benchmark. Two clocks, as the workload says (:mod:`atom.dp.sim.workload`):

- **tick-clocked** (``arrival_tick``): every request is sent before the first step, with its
  arrival tick; its rank holds it until that tick of the wave (``EngineCoreRequest.arrival_tick``,
  :mod:`atom.dp.dp_core_proc`) and the DP client starts the wave only after the last one
  is sent. Routing happens at submission, in trace order, against the loads of the requests
  sent before (none has finished yet): the per-rank batch shapes of the run are then fixed by
  the workload and the configuration, whatever the machine's speed;
- **time-clocked** (``arrival_s``): each request is sent once its time has come (seconds
  after the start) and the loop gets control (between ``LLMEngine.step()`` calls, which wait
  for the ranks' next outputs; the simulator models this:
  :class:`atom.dp.sim.simulator.SimFrontEnd`), and routed then; its TTFT counts from its
  arrival time; step counts move with the machine's speed.

Returns :mod:`atom.dp.sim.metrics`' result dict (plus ``ttft_ms_by_request`` and
``tpot_ms_by_request``: each request's, in milliseconds).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from atom.config import EngineConfig
from atom.dp.sim.metrics import latency_metrics, step_metrics
from atom.dp.sim.workload import TraceRequest, workload_clock
from atom.sampling_params import SamplingParams

IDLE_TIMEOUT_S = 120.0  # liveness: the ranks end their wave this long after the last finish


def build_dp_engine(config: EngineConfig):
    """An :class:`atom.engine.llm_engine.LLMEngine` over ``config.data_parallel_size`` spawned DP rank
    processes (what ``atom.entrypoints.llm.build_engine`` builds off a launcher)."""
    from atom.dp.dp_client import DPEngineCoreClient
    from atom.engine.llm_engine import LLMEngine

    return LLMEngine(config, client_factory=lambda config, extra_eos: DPEngineCoreClient(
        config, extra_eos_token_ids=extra_eos))


def run_real(workload: Sequence[TraceRequest], config: EngineConfig, *, name: str) -> dict:
    """Run ``workload`` on a fresh real engine built from ``config`` (``data_parallel_size``
    > 1; set ``dp_trace`` for the per-tick trace) and return its result dict.

    Raises:
        ValueError: a mixed-clock workload, one rank (tick-clocked needs DP), or prompt token
            ids outside the model's vocabulary.
        RuntimeError: a request failed, or the ranks did not go idle after the last finish.
    """
    clock = workload_clock(workload)
    engine = build_dp_engine(config)
    try:
        check_vocabulary(workload, engine.runtime.vocab_size, model=config.model)
        finished, token_times, elapsed_s = drive(engine, workload, tick_clocked=clock == "tick")
        errors = [o.outputs[0].error for o in finished.values()
                  if o.outputs[0].finish_reason not in ("length", "stop")]
        if errors:
            raise RuntimeError(f"{name}: {len(errors)} requests failed, e.g. {errors[0]}")
        ranks = idle_rank_stats(engine)
    finally:
        engine.shutdown()
    return real_result(name, config, finished, token_times, ranks, elapsed_s)


def check_vocabulary(workload: Sequence[TraceRequest], vocab_size: int, *, model) -> None:
    """Raise ValueError (one line: what to change) when a prompt token id of ``workload`` is
    outside ``[0, vocab_size)``, the vocabulary of ``model`` (a path, None = embedded)."""
    bad = next(((r.request_id, t) for r in workload for t in r.prompt_token_ids
                if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"request {bad[0]}'s prompt has token id {bad[1]}, outside "
                         f"{model or 'the embedded model'}'s vocabulary of {vocab_size} tokens: "
                         f"draw the workload with vocab_size={vocab_size} (atom.dp.sim.workload)")


def drive(engine, workload: Sequence[TraceRequest], *, tick_clocked: bool):
    """Send ``workload``'s requests to ``engine`` (an :class:`atom.engine.llm_engine.LLMEngine`)
    by their clock, step until every one finished; returns the finished outputs
    (:class:`~atom.outputs.RequestOutput` by request id), each request's token arrival times
    (front-end clock) and the elapsed seconds from the first send to the last finish. An
    engine may take several workloads one after the other (each tick-clocked one is a wave of
    its own)."""
    def send(request: TraceRequest) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        engine.add_request(request.request_id, list(request.prompt_token_ids), params,
                           data_parallel_rank=request.dp_rank, session_id=request.session_id,
                           arrival_tick=request.arrival_tick,
                           arrival_time_s=None if tick_clocked else start + request.arrival_s)

    pending = sorted(workload, key=lambda r: r.arrival)
    finished, token_times = {}, {r.request_id: [] for r in workload}
    start = time.monotonic()
    if tick_clocked:  # all before the first step: the wave starts after the last
        for request in pending:
            send(request)
        pending = []
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival_s <= time.monotonic() - start:
            send(pending.pop(0))
        for out in engine.step():
            times = token_times[out.request_id]
            times += [time.monotonic()] * (len(out.outputs[0].token_ids) - len(times))
            if out.finished:
                finished[out.request_id] = out
        if pending and not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.05, pending[0].arrival_s - (time.monotonic() - start))))
    return finished, token_times, time.monotonic() - start


def idle_rank_stats(engine, timeout_s: float = IDLE_TIMEOUT_S) -> list[dict]:
    """Every rank's stats once the group has ended its wave (the counters are final).

    Raises:
        RuntimeError: the ranks did not go idle within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = engine.get_rank_stats()
        if all(r["idle"] for r in ranks) and len({r["tick"] for r in ranks}) == 1:
            return ranks
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ranks did not go idle within {timeout_s:.0f} s: {ranks}")
        time.sleep(0.05)


def real_result(name: str, config: EngineConfig, finished: dict, token_times: dict,
                ranks: list[dict], elapsed_s: float) -> dict:
    """The result dict of a real run (the step counters are rank 0's: every rank counts the
    group's steps from the same gathered batch shapes)."""
    policy = {k.removeprefix("prefill_policy_"): v for k, v in ranks[0].items()
              if k.startswith("prefill_policy_")}
    counters = dict(ranks[0], num_dummy_steps=sum(r["num_dummy_steps"] for r in ranks))
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in finished.values())
    return {
        "name": name,
        "prefill_policy": config.resolved_prefill_policy(),
        "prefill_decode_interval": config.prefill_decode_interval,
        "dp_size": len(ranks),
        "num_requests": len(finished),
        "num_output_tokens": num_output_tokens,
        "elapsed_s": elapsed_s,
        "output_tokens_per_s": num_output_tokens / elapsed_s,
        **step_metrics(counters, num_ranks=len(ranks), policy_stats=policy),
        **latency_metrics(
            ttft_s=[o.metrics.ttft_s for o in finished.values() if o.metrics.ttft_s is not None],
            tpot_s=[o.metrics.tpot_s for o in finished.values() if o.metrics.tpot_s is not None],
            itl_s=itl),
        # per request, for latencies by request class (scripts/dp_experiment.py)
        "ttft_ms_by_request": {i: o.metrics.ttft_s * 1e3 for i, o in finished.items()
                               if o.metrics.ttft_s is not None},
        "tpot_ms_by_request": {i: o.metrics.tpot_s * 1e3 for i, o in finished.items()
                               if o.metrics.tpot_s is not None},
        # what each request emitted, for the simulator to emit the same (workload.with_outputs)
        "output_token_ids_by_request": {i: list(o.outputs[0].token_ids)
                                        for i, o in finished.items()},
        "per_rank": [{k: r[k] for k in ("dp_rank", "num_real_steps", "num_dummy_steps",
                                        "num_preemptions", "num_late_arrivals") if k in r}
                     for r in ranks],
    }
