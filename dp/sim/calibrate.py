"""``atom sim calibrate``: measure this machine and fit the cost model (:mod:`atom.dp.sim.cost_model`).

Two parts, both on the real engine:

1. **the grid** (one process, the per-rank terms): the real :class:`~atom.engine.core.EngineCore`'s
   model runner and sampler over a grid of batches (:data:`GRID`: decodes of 1-32 sequences
   at 64-512 tokens of context, prompt chunks of 16-512 tokens after 0-512 computed ones,
   mixed batches, the dummy batch, TBO splits), with the deployment's per-rank thread count;
   the MLP's share is timed with hooks on every layer's MLP, the KV pool written once before
   (:func:`_fill_kv_pool`). Fitted by non-negative least
   squares on relative errors (every point weighs the same whatever its length);
2. **the group** (real DP ranks, the level and the per-tick and EP terms): a short
   tick-clocked replay of :func:`calibration_workload` (the ranks computing together, one
   alone, one prefilling beside the other's decodes) on ``dp_size`` real ranks with the
   per-tick trace on; the simulator replays the same workload (its steps equal the real
   run's, tick for tick) with the grid's coefficients, and every tick's duration for the
   group (:func:`group_step_durations`) is fitted, by non-negative least squares in seconds,
   as ``compute_scale`` × the grid's slowest-rank compute × (1 + ``contention`` × the share
   of it the other ranks spend computing beside it,
   :func:`~atom.dp.sim.cost_model.overlap_shares`) + ``seq_overhead_s`` × its sequences +
   ``tick_s``, on each tick's median over
   :data:`GROUP_REPLAYS` replays (one disturbed replay does not move it); with expert
   parallelism a second set of replays, the experts now sharded, fits ``ep_fixed_s`` and
   ``ep_row_s`` per micro-batch on what that leaves. The grid gives the
   relative costs of batch shapes; the real ranks, which share the cores with each other, the
   front end and whatever else runs, give their level.

The profile records the machine (CPU model and flags, threads), dtype, model, date, the raw
measurements (the grid's points with their micro-batches, every replay's seconds per tick) and
the fits' errors: :func:`refit` fits a profile again from them, to try a change of the cost
model on a machine's measurements without measuring again. Runs take a few minutes on two
cores.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time

import numpy as np

from atom.config import EngineConfig, resolve_num_threads
from atom.dp.sim.cost_model import Coefficients, CostModel, MicroBatch, Profile, micro_batch
from atom.dp.sim.workload import TraceRequest, bursty, synthetic_prompt

logger = logging.getLogger(__name__)

# one batch: (prefill tokens, context) chunks and (decode sequences, context length) groups
GRID: list[dict] = (
    [{"decode": (b, ctx)} for b in (1, 2, 4, 8, 16, 32) for ctx in (64, 512)]
    + [{"prefill": [(n, 0)]} for n in (16, 64, 128, 256, 512)]
    + [{"prefill": [(n, ctx)]} for n, ctx in ((64, 256), (64, 512), (256, 512))]
    + [{"prefill": [(32, 0), (32, 0)]}, {"prefill": [(96, 0)] * 3}]
    + [{"prefill": [(64, 0)], "decode": (4, 128)}, {"prefill": [(256, 0)], "decode": (8, 256)},
       {"prefill": [(16, 128)], "decode": (16, 128)}]
    + [{"prefill": [(128, 0)], "tbo": True}, {"prefill": [(64, 0), (64, 0)], "tbo": True},
       {"prefill": [(256, 0)], "decode": (4, 128), "tbo": True}]
    + [{}, {"tbo": True}]  # the dummy batch, whole and split
)
GRID_KV_BLOCKS = 1200  # 19,200 tokens: the grid's largest batch (32 x 512) with room
GROUP_REPLAYS = 3  # real replays the group terms are fitted on (each tick's median)
_FEATURES = ("step_s", "token_s", "sampled_s", "seq_s", "prefill_pair_s", "decode_context_s",
             "dummy_s")


def machine_info(num_threads: int) -> dict:
    """The CPU model and its SIMD flags (the ones that matter to the kernels), the threads."""
    cpu, flags = platform.processor(), []
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                    if line.startswith("model name")), cpu)
        line = next((line for line in info.splitlines() if line.startswith("flags")), "")
        flags = sorted(f for f in line.split() if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return {"cpu": cpu, "flags": flags, "num_threads": num_threads, "platform": platform.platform()}


def _entries(point: dict, block_manager, vocab_size: int) -> list:
    """Sequences with blocks for ``point`` (module docstring), as scheduler entries; token ids
    inside a vocabulary of ``vocab_size``."""
    from atom.sampling_params import SamplingParams
    from atom.core.sequence import Sequence

    entries, params = [], SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    for i, (n, ctx) in enumerate(point.get("prefill", [])):
        prompt = synthetic_prompt(f"p{i}", ctx + n, vocab_size=vocab_size)
        seq = Sequence(f"p{i}", list(prompt), params, num_computed_tokens=ctx)
        block_manager.allocate(seq)
        entries.append((seq, n))
    num_decodes, ctx = point.get("decode", (0, 0))
    for i in range(num_decodes):
        # one output token after the prompt, all but it computed: the next step decodes
        seq = Sequence(f"d{i}", [*synthetic_prompt(f"d{i}", ctx - 1, vocab_size=vocab_size),
                                 min(100, vocab_size - 1)], params,
                       num_prompt_tokens=ctx - 1, num_computed_tokens=ctx - 1)
        block_manager.allocate(seq)
        entries.append((seq, 1))
    return entries


class _MLPTimer:
    """Accumulates the seconds spent in every layer's MLP (forward hooks)."""

    def __init__(self, model):
        self.total_s = 0.0
        self._start = 0.0
        self._handles = []
        for layer in model.layers:
            self._handles.append(layer.mlp.register_forward_pre_hook(self._pre))
            self._handles.append(layer.mlp.register_forward_hook(self._post))

    def _pre(self, module, args):
        self._start = time.perf_counter()

    def _post(self, module, args, output):
        self.total_s += time.perf_counter() - self._start

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _num_kv_cache_groups(model: str | None) -> int:
    """KV cache groups of ``model`` (:func:`atom.kv_cache_spec.kv_cache_groups`) from its
    ``config.json`` alone; 1 for a GGUF file (the embedded model)."""
    from atom.kv_cache_spec import kv_cache_groups
    from atom.worker.model_loader import arch_config_from_hf
    from atom.worker.model_runner import ModelRunner

    path = os.path.join(model, "config.json") if model else None
    if path is None or not os.path.isfile(path):
        return 1
    with open(path) as f:
        arch = arch_config_from_hf(json.load(f), source=path)
    return len(kv_cache_groups(ModelRunner.kv_cache_specs_of(arch)))


def _run_point(worker, block_manager, point: dict, timer: _MLPTimer, vocab_size: int
               ) -> tuple[float, float, list[MicroBatch]]:
    """One timed ``Worker.execute_model`` (forward + sampling) of ``point``: seconds, MLP
    seconds, its micro-batches."""
    from atom.core.scheduler_output import SchedulerOutput
    from atom.core.tbo_split import split_batch

    entries = _entries(point, block_manager, vocab_size)
    tbo = point.get("tbo", False)
    parts = split_batch(entries) if tbo else [[(seq, 0, n) for seq, n in entries]]
    try:
        timer.total_s = 0.0
        start = time.perf_counter()
        worker.execute_model(SchedulerOutput(scheduled=entries), two_batch_overlap=tbo)
        seconds = time.perf_counter() - start
    finally:
        for seq, _ in entries:
            block_manager.free(seq)
    return seconds, timer.total_s, [micro_batch(part) for part in parts]


def _fill_kv_pool(worker) -> None:
    """Write every block of ``worker``'s KV pool once (seeded normal values). The grid's
    sequences read context no step wrote, and the pool comes from ``calloc``'s lazy zero pages
    (:func:`atom.worker.model_runner.zeroed_kv_cache`): unfilled, their first reads and writes
    of each page fault, which on a VM doubled a decode point's seconds (16 sequences of 64
    tokens: 220 against 102 ms) in the cores whose pool the allocator had not reused, and not
    in the others. A serving rank reads only blocks its prefills wrote."""
    import torch

    generator = torch.Generator().manual_seed(0)
    for cache in worker.runner.kv_caches:
        cache.normal_(0.0, 0.5, generator=generator)


def measure_grid(config: EngineConfig, *, repeats: int = 3,
                 grid: list[dict] = GRID) -> tuple[list[dict], dict]:
    """Time every grid point on an in-process worker (:class:`atom.worker.worker.Worker`, the
    middle part of a real step) built from ``config`` (its ``num_threads`` and model; the KV
    pool is the grid's): a warm-up round, then ``repeats`` rounds over the whole grid (so a
    burst of load from other processes spreads over the points instead of skewing one), the
    median per point. Returns one dict per point and the model's facts (KV bytes per token,
    context length, experts, vocabulary: the synthetic token ids are drawn inside it)."""
    from atom.core.block_manager import BlockManager
    from atom.worker.worker import Worker

    # a hybrid model's (gpt-oss) groups each hold the grid's tokens, at the bytes of one group
    num_groups = _num_kv_cache_groups(config.model)
    worker = Worker(dataclasses.replace(
        config, data_parallel_size=1, num_kv_blocks=GRID_KV_BLOCKS * num_groups,
        enable_prefix_caching=False,
        prefill_policy=None, prefill_decode_interval=0, enable_expert_parallel=False,
        dp_trace=None, dp_load_balance="least_requests", max_model_len=2048))
    runtime = worker.runtime
    block_manager = BlockManager(runtime.num_kv_blocks, config.block_size,
                                 enable_prefix_caching=False,
                                 group_windows=runtime.kv_cache_group_windows)
    _fill_kv_pool(worker)
    timer = _MLPTimer(worker.model)
    try:
        runs: list[list[tuple]] = [[] for _ in grid]
        for round_ in range(repeats + 1):
            for i, point in enumerate(grid):
                run = _run_point(worker, block_manager, point, timer, runtime.vocab_size)
                if round_:
                    runs[i].append(run)
            logger.info("calibration grid: round %d of %d done", round_, repeats)
        arch = worker.runner.arch_config
        facts = {"kv_cache_bytes_per_token": runtime.kv_cache_bytes
                 // (runtime.num_kv_blocks * config.block_size),
                 "max_position_embeddings": arch.max_position_embeddings,
                 "num_experts": runtime.num_experts, "architecture": arch.architecture,
                 "vocab_size": runtime.vocab_size}
        if num_groups > 1:  # the simulator's pools follow the same groups
            facts["kv_cache_group_windows"] = list(runtime.kv_cache_group_windows)
    finally:
        timer.remove()
        worker.close()
    return [{"point": point, "seconds": statistics.median(r[0] for r in point_runs),
             "mlp_seconds": statistics.median(r[1] for r in point_runs),
             "micro_batches": [dataclasses.asdict(mb) for mb in point_runs[0][2]]}
            for point, point_runs in zip(grid, runs)], facts


SPEED_PROBE: list[dict] = [{"decode": (1, 64)}, {"decode": (8, 64)}, {"prefill": [(64, 0)]}]


def _point_key(point: dict) -> str:
    return json.dumps(point, sort_keys=True)  # tuples and the JSON's lists alike


def machine_speed(config: EngineConfig, profile: Profile, *,
                  points: list[dict] = SPEED_PROBE) -> float:
    """How much slower this machine runs now than when ``profile`` was measured: ``points``
    (calibration grid points) timed again on an in-process engine core built from ``config``
    (:func:`measure_grid`, 3 rounds), the median over the points of seconds now ÷ the
    profile's seconds. 1.0: the same speed; 1.2: 20 % slower (other processes, the host's
    CPU steal or clock). The accuracy benchmark times it around each real run: a run's error
    is the model's only if the machine kept the calibration's speed.

    Raises:
        ValueError: the profile's grid did not measure one of ``points``.
    """
    recorded = {_point_key(p["point"]): p["measured_s"]
                for p in profile.fit.get("grid", {}).get("points", [])}
    missing = [p for p in points if _point_key(p) not in recorded]
    if missing:
        raise ValueError(f"the profile's calibration grid has no measurement of {missing}: "
                         "probe with points of its grid")
    measured, _ = measure_grid(config, grid=points)
    return statistics.median(m["seconds"] / recorded[_point_key(m["point"])] for m in measured)


def feature_row(mbs: list[MicroBatch]) -> list[float]:
    """One design-matrix row: the per-rank terms of the cost model summed over micro-batches
    (order of :data:`_FEATURES`)."""
    real = [mb for mb in mbs if not mb.is_dummy]
    return [len(real), sum(mb.num_tokens for mb in real), sum(mb.num_sampled for mb in real),
            sum(mb.num_seqs for mb in real), sum(mb.prefill_pairs for mb in real),
            sum(mb.decode_context for mb in real), len(mbs) - len(real)]


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (active set: drop the most negative
    coefficient and refit until none is negative; enough for a handful of columns)."""
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        if active:
            x[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if (x >= 0).all():
            return x
        active.remove(int(np.argmin(np.where(np.isin(range(a.shape[1]), active), x, np.inf))))


def rel_errors(predicted: np.ndarray, measured: np.ndarray) -> dict:
    err = np.abs(predicted - measured) / measured
    return {"num_points": int(len(err)), "mean_abs_rel_error": float(err.mean()),
            "max_abs_rel_error": float(err.max()),
            "total_rel_error": float(abs(predicted.sum() - measured.sum()) / measured.sum())}


def fit_grid(measurements: list[dict]) -> tuple[dict, dict]:
    """The per-rank coefficients and the fit's errors (relative, per point)."""
    mbs = [[MicroBatch(**mb) for mb in m["micro_batches"]] for m in measurements]
    t = np.array([m["seconds"] for m in measurements])
    a = np.array([feature_row(x) for x in mbs], dtype=float)
    coef = nnls(a / t[:, None], np.ones(len(t)))  # relative residuals
    tokens = np.array([sum(mb.num_tokens for mb in x) for x in mbs], dtype=float)
    mlp = np.array([m["mlp_seconds"] for m in measurements])
    real = tokens > 0
    slope, intercept = np.polyfit(tokens[real], mlp[real], 1)
    coefficients = dict(zip(_FEATURES, coef.tolist()), mlp_token_s=max(0.0, float(slope)),
                        mlp_step_s=min(max(0.0, float(intercept)), float(coef[0])))
    predicted = a @ coef
    points = [{"point": m["point"], "measured_s": m["seconds"], "predicted_s": float(p),
               "mlp_s": m["mlp_seconds"], "micro_batches": m["micro_batches"]}
              for m, p in zip(measurements, predicted)]
    return coefficients, {**rel_errors(predicted, t), "points": points}


def calibration_bursts(vocab_size: int | None = None) -> list[TraceRequest]:
    """The first part of :func:`calibration_workload` (ticks 0-36; the whole of it before run G
    of docs/DP_EXPERIMENTS.md, so run A's committed profiles were fitted on it alone)."""
    return bursty(num_requests=16, burst_size=4, burst_interval=12, clock="tick",
                  prompt_len=(16, 320), output_len=(4, 24), seed=7, vocab_size=vocab_size)


def calibration_workload(vocab_size: int | None = None) -> list[TraceRequest]:
    """The group fit's workload (tick-clocked; not the experiment's, which the accuracy
    benchmark checks), three kinds of ticks so the level and the contention separate:

    1. bursts of short and medium requests over both ranks (arriving at ticks 0-36, done by
       about tick 85): both ranks prefill, then decode, together;
    2. rank 0 alone (from tick 90): one prompt of 48-288 tokens at a time, rank 1 idle (its
       dummy batch contends with nothing);
    3. one rank prefills while the other decodes (from tick 120): rank 1 decodes seven long
       outputs (the experiments' batches reach 8 sequences; the bursts' decodes stay at 1-4)
       while rank 0 takes prompts of 64-256 tokens.

    Fitted on the first kind alone, the level and the contention trade off against each other
    (every tick had the ranks computing together): on an AVX2 Zen 3 the dense fit came out
    0.83 and 0.27 and under-predicted the experiment's prefill ticks of one rank beside
    another's decodes by 10-20 % (docs/DP_EXPERIMENTS.md, run G).

    Token ids inside a vocabulary of ``vocab_size`` (:func:`atom.dp.sim.workload.vocab_range`:
    the same workload for any vocabulary of 20000 tokens or more, and for None)."""
    def pinned(request_id: str, prompt_len: int, output_len: int, rank: int, tick: int):
        return TraceRequest(request_id, synthetic_prompt(request_id, prompt_len,
                                                         vocab_size=vocab_size), output_len,
                            arrival_tick=tick, dp_rank=rank)

    together = calibration_bursts(vocab_size)
    alone = [pinned(f"a{i}", n, 3, 0, 90 + 6 * i) for i, n in enumerate((48, 96, 160, 224, 288))]
    beside = ([pinned(f"d{i}", 32, 30, 1, 120) for i in range(7)]
              + [pinned(f"p{i}", n, 3, 0, 124 + 6 * i) for i, n in enumerate((64, 128, 192, 256))])
    return together + alone + beside


def workload_digest(requests: list[TraceRequest]) -> str:
    """A short digest of a workload (every request's fields, prompt tokens included): a
    profile records its calibration workload's, so :func:`refit` can tell that the replays'
    ticks are the workload's it would simulate."""
    text = json.dumps([dataclasses.astuple(r) for r in requests])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measure_group(config: EngineConfig, requests: list[TraceRequest], *,
                  replays: int = GROUP_REPLAYS) -> list[dict[int, float]]:
    """Run ``requests`` tick-clocked on real ranks ``replays`` times: each replay's seconds
    per tick (:func:`group_step_durations`)."""
    from atom.dp.dp_trace import read_trace
    from atom.dp.sim.replay import run_real

    runs = []
    for _ in range(replays):
        with tempfile.TemporaryDirectory(prefix="atom-calibrate-") as folder:
            run_real(requests, dataclasses.replace(config, dp_trace=folder), name="calibration")
            runs.append(group_step_durations(read_trace(folder)[0].rows))
    return runs


def fit_group(config: EngineConfig, coefficients: dict, facts: dict,
              requests: list[TraceRequest], runs: list[dict[int, float]]
              ) -> tuple[dict, dict]:
    """Fit the group's terms on ``runs`` (:func:`measure_group`: real tick-clocked replays of
    ``requests``) against the simulator's replay of the same requests (with
    ``coefficients``), on every tick's duration, its median over the replays.
    Without expert parallelism: ``compute_scale``, ``contention``, ``seq_overhead_s`` and
    ``tick_s`` (``coefficients`` holds the grid's only): the tick lasts ``compute_scale`` ×
    the grid's slowest-rank compute × (1 + ``contention`` × the share of it the other ranks
    spend computing beside it) + ``seq_overhead_s`` × that rank's sequences + ``tick_s``.
    With it: ``ep_fixed_s`` and ``ep_row_s`` on what the
    level, the contention and the tick, fitted before on the same model without expert
    parallelism (in ``coefficients``), leave: the compute and the EP rows both grow with the
    step's tokens, so fitted together the collectives would take the compute's share. Returns
    the terms and the fit's errors, with the replays' seconds per tick (``tick_seconds``:
    ``[tick, [seconds per replay]]``, what a refit needs)."""
    profile = Profile(Coefficients(**{**coefficients, "ep_fixed_s": 0.0, "ep_row_s": 0.0}),
                      model_facts=facts)
    step_log = _simulate_with_log(requests, config, profile).step_log
    simulated = dict(step_log)
    for periods in runs:
        if not periods.keys() <= simulated.keys():
            raise RuntimeError("the simulated replay's ticks differ from the real run's "
                               f"({len(periods.keys() & simulated.keys())} of {len(periods)} "
                               "matched): step parity is broken")
    # each tick's median over the replays, as the accuracy benchmark takes the median of its
    # real runs: one disturbed replay, averaged in, moved ep_fixed_s by a third (114 against
    # 87 ms on an AVX2 Zen 3); fitted on each tick's fastest replay instead, a held-out real
    # run's ticks came out 8-17 % short (docs/DP_EXPERIMENTS.md, run F)
    ticks = sorted(set.intersection(*(set(periods) for periods in runs)))
    log = [simulated[tick] for tick in ticks]
    measured = np.array([statistics.median(periods[tick] for periods in runs) for tick in ticks])
    if not config.enable_expert_parallel:
        a = np.array([[cost.compute_s, cost.compute_s * cost.others_busy, cost.num_seqs, 1.0]
                      for cost in log])
        x = nnls(a, measured)
        terms = {"compute_scale": float(x[0]), "seq_overhead_s": float(x[2]),
                 "tick_s": float(x[3]), "contention": float(x[1] / x[0]) if x[0] > 0 else 0.0}
        predicted = a @ x
    else:
        rest = np.array([cost.total_s for cost in log])  # the scaled compute + the tick
        a = np.array([[cost.num_micro_batches * (cost.max_num_tokens > 0),
                       cost.num_micro_batches * cost.max_num_tokens
                       * (config.data_parallel_size - 1)] for cost in log])
        x = nnls(a, measured - rest)
        terms, predicted = {"ep_fixed_s": float(x[0]), "ep_row_s": float(x[1])}, rest + a @ x
    return terms, {**rel_errors(predicted, measured), "real_wall_s": float(measured.sum()),
                   "replays": len(runs), "workload": workload_digest(requests),
                   "tick_seconds": [[tick, [periods[tick] for periods in runs]]
                                    for tick in ticks]}


def group_step_durations(rows: list[dict]) -> dict[int, float]:
    """Seconds each tick of a real run's trace (one rank's rows) lasted for the group: from
    the end of its control sync to the end of the next one. The sync ends on every rank at
    once (it is an all-gather), so this includes waiting for the slowest rank, which a rank's
    own ``step_us`` does not."""
    synced = [(r["tick"], (r["start_us"] + r["sync_us"]) * 1e-6) for r in rows]
    return {tick: b - a for (tick, a), (next_tick, b) in zip(synced, synced[1:])
            if next_tick == tick + 1}


def _simulate_with_log(requests, config: EngineConfig, profile: Profile):
    """A simulator run whose per-step costs (``step_log``) the group fit reads."""
    from atom.dp.sim.simulator import Simulator, run_timed

    sim = Simulator(config, CostModel(profile, expert_parallel=config.enable_expert_parallel),
                    num_kv_blocks=config.num_kv_blocks,
                    max_model_len=config.resolved_max_model_len(
                        profile.model_facts["max_position_embeddings"]))
    run_timed(sim, requests)
    return sim


def _group_configs(config: EngineConfig) -> dict[str, EngineConfig]:
    """The group fits' deployments, in fit order: ``group`` (no expert parallelism) and, for
    an expert-parallel ``config``, ``group_ep``."""
    group_config = dataclasses.replace(config, num_kv_blocks=config.num_kv_blocks or 64,
                                       max_model_len=1024, enable_prefix_caching=False)
    configs = {"group": dataclasses.replace(group_config, enable_expert_parallel=False)}
    if config.enable_expert_parallel:
        configs["group_ep"] = group_config
    return configs


def fit_all(config: EngineConfig, measurements: list[dict], facts: dict,
            runs: dict[str, list[dict[int, float]]]) -> tuple[dict, dict]:
    """Every coefficient from the measurements: the grid's (:func:`measure_grid`) and the
    group replays' (``runs``: :func:`measure_group`'s per part of :func:`_group_configs`;
    empty: no group terms). Returns the coefficients and the fits' errors by part."""
    coefficients, grid_fit = fit_grid(measurements)
    fit, requests = {"grid": grid_fit}, calibration_workload(facts.get("vocab_size"))
    for part, group_config in _group_configs(config).items():
        if part in runs:
            terms, fit[part] = fit_group(group_config, coefficients, facts, requests,
                                         runs[part])
            coefficients.update(terms)
    return coefficients, fit


def refit(profile: Profile, config: EngineConfig) -> Profile:
    """``profile`` fitted again from the measurements it records (the grid's points and the
    group replays' seconds per tick) with this code's cost model: a change to the model or
    its fit tried on a machine's measurements without measuring again. ``config``: the
    deployment it was calibrated for (as given to :func:`calibrate`).

    Raises:
        ValueError: a profile without the measurements (calibrated before they were kept), or
            whose replays ran another calibration workload.
    """
    points = profile.fit.get("grid", {}).get("points", [])
    if not points or "micro_batches" not in points[0]:
        raise ValueError("this profile does not keep its grid's micro-batches: calibrate again")
    measurements = [{"point": p["point"], "seconds": p["measured_s"], "mlp_seconds": p["mlp_s"],
                     "micro_batches": p["micro_batches"]} for p in points]
    runs = {}
    digest = workload_digest(calibration_workload(profile.model_facts.get("vocab_size")))
    for part in _group_configs(config):
        if part in profile.fit:
            if "tick_seconds" not in profile.fit[part]:
                raise ValueError(f"this profile does not keep its {part} replays' seconds per "
                                 "tick: calibrate again")
            if profile.fit[part].get("workload") != digest:
                raise ValueError(f"this profile's {part} replays ran another calibration "
                                 "workload than this code's: calibrate again")
            ticks = profile.fit[part]["tick_seconds"]
            runs[part] = [{tick: seconds[i] for tick, seconds in ticks}
                          for i in range(len(ticks[0][1]))]
    coefficients, fit = fit_all(config, measurements, profile.model_facts, runs)
    coefficients["wake_s"] = profile.coefficients.wake_s
    return dataclasses.replace(profile, coefficients=Coefficients(**coefficients), fit=fit)


def calibrate(config: EngineConfig, *, repeats: int = 3, group: bool = True,
              group_replays: int = GROUP_REPLAYS) -> Profile:
    """Measure and fit (module docstring). ``config``: the deployment to calibrate for
    (``data_parallel_size`` ranks, model, dtype, ``moe_split_experts``, expert parallelism;
    ``num_threads`` unset = the per-rank share of this machine's cores); ``group=False``
    skips the real DP run (the per-tick and EP terms stay 0); ``group_replays``: real replays
    per group fit (each tick's median).

    Raises:
        ValueError: a config that cannot run (e.g. expert parallelism without experts), or
            ``group_replays`` below 1.
        RuntimeError: a real rank failed, or the simulated replay diverged from the real one.
    """
    if group_replays < 1:
        raise ValueError(f"--group-replays {group_replays}: use at least 1 (default "
                         f"{GROUP_REPLAYS})")
    threads = resolve_num_threads(config.num_threads, num_local_ranks=config.data_parallel_size)
    # token-id workloads only: a folder without tokenizer files calibrates too
    config = dataclasses.replace(config, num_threads=threads, skip_tokenizer_init=True)
    start = time.monotonic()
    measurements, facts = measure_grid(config, repeats=repeats)
    runs = {}
    if group:
        requests = calibration_workload(facts["vocab_size"])
        for part, group_config in _group_configs(config).items():
            runs[part] = measure_group(group_config, requests, replays=group_replays)
    coefficients, fit = fit_all(config, measurements, facts, runs)
    model = config.model or "embedded SmolLM2-135M-Instruct"
    if config.moe_split_experts:
        model += f", MLPs split into {config.moe_split_experts} experts (model (a))"
    return Profile(
        Coefficients(**coefficients), kind="measured", machine=machine_info(threads),
        dtype=config.resolved_dtype(), model=model,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model_facts=facts, fit=fit,
        notes=(f"atom sim calibrate: grid of {len(measurements)} batches x {repeats} repeats "
               f"(median) on one in-process core, {threads} thread(s); group terms from a "
               f"tick-clocked replay ({group_replays} runs) on {config.data_parallel_size} real "
               f"ranks{', then with expert parallelism' if config.enable_expert_parallel else ''}; "
               f"{time.monotonic() - start:.0f} s"))
