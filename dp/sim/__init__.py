"""atom.dp.sim: the DP/EP simulator — N virtual ranks running the engine's own scheduling code.

Every virtual rank runs the real :class:`~atom.core.scheduler.Scheduler` and
:class:`~atom.core.block_manager.BlockManager` (:mod:`atom.dp.sim.rank`); the group ticks through
the engine's own tick pieces (:mod:`atom.dp.tick`), prefill policies
(:mod:`atom.dp.prefill_policy`) and router (:mod:`atom.dp.router`, cache-aware over a
:class:`~atom.engine.kv_subscriber.KVCacheIndex` fed the block managers' KV events), with the control
and batch-shape vectors gathered in memory (:mod:`atom.dp.simulator`). Only the forward pass
is a model (:mod:`atom.dp.sim.cost_model`, calibrated on this machine by ``atom sim
calibrate``: :mod:`atom.dp.sim.calibrate`), and the sampled tokens come from the trace's
output lengths. With tick-clocked arrivals (:mod:`atom.dp.sim.workload`) a simulated run takes
the same steps as the real engine's replay (:mod:`atom.dp.sim.replay`), tick for tick.

Python API::

    from atom.config import EngineConfig
    from atom.dp.sim import simulate, workload

    config = EngineConfig(data_parallel_size=8, prefill_policy="delayer", num_kv_blocks=64)
    result = simulate(workload.bursty(num_requests=200, burst_size=16, burst_interval=2.0),
                      config)          # the committed profile for the config's model
    print(result["mixed_step_fraction"], result["ttft_ms"]["p99"])

Command line: ``atom sim run | sweep | calibrate | workload`` (:mod:`atom.dp.sim.cli`). The
simulation imports no torch (the calibration does).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from atom.config import EngineConfig
from atom.dp.sim import workload
from atom.dp.sim.cost_model import CostModel, Profile, list_profiles, load_profile
from atom.dp.sim.experts import (ExpertPopularity, RecordedExpertLoad, RoutingSource,
                                 SimExperts)
from atom.dp.sim.metrics import format_sweep, format_table, run_header, sim_result
from atom.dp.sim.simulator import Simulator, run_timed
from atom.dp.sim.workload import TraceRequest, read_workload

__all__ = ["simulate", "default_profile_name", "load_profile", "list_profiles", "Profile",
           "TraceRequest", "read_workload", "workload", "format_table", "format_sweep",
           "run_header", "ExpertPopularity", "RecordedExpertLoad"]

DENSE_PROFILE = "smollm2-fp32-cpu"
MOE_PROFILE = "smollm2-moe4-fp32-cpu"


def default_profile_name(config: EngineConfig) -> str:
    """The committed profile for ``config``'s model: the MoE one when it splits the MLPs into
    experts (model (a)), else the dense one (both measured on the embedded model, float32,
    this project's 2-core machine; docs/DP_EXPERIMENTS.md)."""
    return MOE_PROFILE if config.moe_split_experts else DENSE_PROFILE


def simulate(requests: Sequence[TraceRequest], config: EngineConfig,
             profile: Profile | str | pathlib.Path | None = None, *, name: str | None = None,
             trace_dir: str | pathlib.Path | None = None, slowest_rank: bool = True,
             dummy_cost: bool = True, routing: RoutingSource | None = None) -> dict:
    """Simulate ``requests`` on the deployment ``config`` describes; returns the result dict
    (:mod:`atom.dp.sim.metrics`).

    Args:
        requests: the workload (one clock: ticks or seconds).
        config: ``data_parallel_size`` ranks and the engine options they run (policy,
            routing, budgets, KV pool, TBO, expert parallelism).
        profile: the cost model's profile (a :class:`Profile`, a file, or a committed name);
            None = :func:`default_profile_name`.
        name: the run's label (default: the policy).
        trace_dir: write the per-tick trace there (the ``--dp-trace`` format).
        slowest_rank, dummy_cost: the cost model's rules (off only for ablations).
        routing: where the routed tokens go (:mod:`atom.dp.sim.experts`: a skew model, or a
            real run's recorded counts; expert parallelism only): the step's expert compute
            follows it, and ``enable_eplb`` runs EPLB's controller on it. None = balanced.
    Raises:
        ValueError: a bad workload, a profile that cannot be read, expert parallelism on a
            model with fewer experts than ranks, EPLB without a routing source, or a routing
            source without expert parallelism.
    """
    profile_name = None  # a Profile object given in memory has no name
    if not isinstance(profile, Profile):
        profile_name = str(profile or default_profile_name(config))
        profile = load_profile(profile_name)
    facts = profile.model_facts
    if config.resolved_record_expert_load() and routing is None:
        raise ValueError("EPLB and record_expert_load in the simulator count routed tokens: "
                         "give it a routing source (atom.dp.sim.experts: ExpertPopularity.zipf "
                         "or .read, or RecordedExpertLoad.from_trace; --routing-zipf or "
                         "--routing-load)")
    if routing is not None and not config.enable_expert_parallel:
        raise ValueError("a routing skew costs time only under expert parallelism (without it "
                         "every rank computes every expert): set enable_expert_parallel "
                         "(--enable-expert-parallel) too")
    if config.enable_expert_parallel:
        num_experts = (routing.num_experts if routing is not None
                       else config.moe_split_experts or facts.get("num_experts"))
        if not num_experts or num_experts < config.data_parallel_size:
            raise ValueError(f"expert parallelism over {config.data_parallel_size} ranks needs "
                             f"an MoE model with at least that many experts (got {num_experts}): "
                             f"set moe_split_experts")
    if config.num_kv_blocks is None and "kv_cache_bytes_per_token" not in facts:
        raise ValueError("the profile has no kv_cache_bytes_per_token to size the KV pool "
                         "with: set num_kv_blocks")
    kv_bytes_per_block = facts.get("kv_cache_bytes_per_token", 1) * config.block_size
    experts = None if routing is None else SimExperts(config, routing,
                                                      num_ranks=config.data_parallel_size)
    sim = Simulator(config, CostModel(profile, expert_parallel=config.enable_expert_parallel,
                                      slowest_rank=slowest_rank, dummy_cost=dummy_cost),
                    num_kv_blocks=config.resolved_num_kv_blocks(kv_bytes_per_block),
                    kv_cache_group_windows=tuple(facts.get("kv_cache_group_windows") or (None,)),
                    max_model_len=config.resolved_max_model_len(
                        facts.get("max_position_embeddings", 8192)),
                    trace_dir=trace_dir, experts=experts)
    host_s, cpu_s = run_timed(sim, requests)
    result = sim_result(sim, name=name or sim.decider.policy.name, host_s=host_s, cpu_s=cpu_s)
    result["profile"] = profile_name
    return result
