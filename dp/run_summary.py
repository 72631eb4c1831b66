"""One line that says what a DP / EP deployment did: printed on stderr at the end of an ``atom
generate`` / ``atom chat`` run and when ``atom serve`` shuts down (issue 38).

Everything in it comes from :meth:`atom.entrypoints.llm.LLM.get_rank_stats` (the ranks' own
counters, :meth:`atom.dp.dp_core_proc.DPEngineCoreProc.dp_stats`), the deployment's options and
the model's expert count (:attr:`atom.messages.EngineRuntime.num_experts`). Values that differ
by rank are written ``rank 0 / rank 1 / ...``::

    atom: DP 2, EP 4 experts (2 a rank), TBO on; per rank: requests 2 / 1, steps 7 / 7,
    dummy 0 / 1, TBO 1 / 1; prefill policy delayer: 0 holds (hold rate 0.00, longest 0 ticks)

(one line). With EPLB the layout reads ``EP 4 experts + 2 redundant slots (3 a rank), EPLB 2
rebalance(s), last balancedness 0.97``; with ``--record-expert-load`` alone ``EP 4 experts (2
a rank, expert load balancedness 0.62)``, the last closed window's. The prefill policy's
counters are the group's (identical on every rank).
"""

from __future__ import annotations

import sys

from atom.config import EngineConfig
from atom.engine.liveness import EngineDeadError

__all__ = ["dp_summary_line", "print_dp_summary"]

#: how long the summary waits for the ranks' stats at shutdown (a launched deployment's ranks
#: may have left on the launcher's SIGTERM before the front end asks: it must not wait for
#: their hang timeout, past the launcher's SIGTERM-to-SIGKILL grace)
SUMMARY_TIMEOUT_S = 3.0

_ROUTED = "dp_router_decisions_"  # the DP client's per-rank decision counters
# the policy's hold reasons (hold, hold_fill, hold_decode_interval: prefill_decision.HOLDS)
_HOLDS = "prefill_policy_decisions_hold"


def dp_summary_line(rank_stats: list[dict], *, config: EngineConfig,
                    num_experts: int | None, started_dp_size: int | None = None) -> str | None:
    """The summary line (module docstring), or None for a deployment of one rank (nothing to
    say). A group that rank failures shrank (``started_dp_size`` over the ranks now) reads
    ``DP 1 (2 at start: rank failures shrank the group; counters since)``.

    Args:
        rank_stats: each rank's stats, in rank order (``get_rank_stats()``).
        config: the current group's options (TBO, expert parallelism, the prefill policy).
        num_experts: experts of each MoE layer (``runtime.num_experts``); None for a dense
            model.
        started_dp_size: the DP size the deployment started with (None: as now).
    """
    num_ranks = len(rank_stats)
    started = started_dp_size or num_ranks
    if num_ranks < 1 or started < 2:
        return None
    size = (f"DP {num_ranks}" if started == num_ranks else
            f"DP {num_ranks} ({started} at start: rank failures shrank the group; counters since)")

    def per_rank(key: str) -> str:
        return " / ".join(str(int(stats.get(key, 0))) for stats in rank_stats)

    requests = " / ".join(str(sum(int(v) for k, v in stats.items() if k.startswith(_ROUTED)))
                          for stats in rank_stats)
    policy = rank_stats[0]
    num_holds = sum(int(v) for k, v in policy.items() if k.startswith(_HOLDS))
    holds = (f"prefill policy {config.resolved_prefill_policy()}: {num_holds} holds (hold rate "
             f"{policy.get('prefill_policy_hold_rate', 0.0):.2f}, longest "
             f"{int(policy.get('prefill_policy_max_consecutive_holds', 0))} ticks)")
    return (f"atom: {size}, {_expert_layout(config, num_experts, rank_stats)}, TBO "
            f"{'on' if config.enable_tbo else 'off'}; per rank: requests {requests}, steps "
            f"{per_rank('num_steps')}, dummy {per_rank('num_dummy_steps')}, TBO "
            f"{per_rank('num_tbo_steps')}; {holds}")


def _expert_layout(config: EngineConfig, num_experts: int | None, rank_stats: list[dict]) -> str:
    num_ranks = len(rank_stats)
    if num_experts is None:
        return "EP off (dense model)"
    if not config.enable_expert_parallel:
        return f"EP off ({num_experts} experts on every rank)"
    if config.enable_eplb:  # EPLB's slots: as many on every rank (config checks)
        redundant = config.eplb_num_redundant_experts
        slots = f" + {redundant} redundant slots" if redundant else ""
        eplb = rank_stats[0]  # the group's counters, identical on every rank
        balancedness = eplb.get("eplb_balancedness")
        return (f"EP {num_experts} experts{slots} ({(num_experts + redundant) // num_ranks} a "
                f"rank), EPLB {int(eplb.get('eplb_num_rebalances', 0))} rebalance(s), last "
                f"balancedness " + ("none (no window closed)" if balancedness is None
                                    else f"{balancedness:.2f}"))
    # imported here: this module is imported before an engine starts (atom serve), torch-free
    from atom.dp.expert_parallel import expert_range

    sizes = [end - start for start, end in (expert_range(num_experts, rank, num_ranks)
                                            for rank in range(num_ranks))]
    per = f"{sizes[0]} a rank" if len(set(sizes)) == 1 else " / ".join(map(str, sizes))
    if config.record_expert_load:  # the window's figure, identical on every rank
        balancedness = rank_stats[0].get("eplb_balancedness")
        per += ", expert load balancedness " + ("none (no window closed)" if balancedness is None
                                                 else f"{balancedness:.2f}")
    return f"EP {num_experts} experts ({per})"


def print_dp_summary(engine) -> None:
    """:func:`dp_summary_line` of a running engine on stderr (also after rank failures shrank
    it to one rank); nothing for a deployment started with one rank or once the engine is dead.

    Args:
        engine: the deployment's :class:`~atom.engine.llm_engine.LLMEngine` (``LLM.engine``),
            used from the thread that drives it.
    """
    if engine is None or engine.config.data_parallel_size == 1:
        return
    try:
        rank_stats = engine.get_rank_stats(timeout_s=SUMMARY_TIMEOUT_S)
    except EngineDeadError:
        return
    except TimeoutError:  # the ranks left first (atom launch's SIGTERM stops them at once)
        print("atom: no DP summary: the ranks did not answer within "
              f"{SUMMARY_TIMEOUT_S:g} s (stopped already)", file=sys.stderr, flush=True)
        return
    started = engine.config.data_parallel_size
    # a shrunk group runs its client's config (the options that need several ranks dropped)
    config = engine.config if len(rank_stats) == started else engine.client.config
    line = dp_summary_line(rank_stats, config=config, num_experts=engine.runtime.num_experts,
                           started_dp_size=started)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
