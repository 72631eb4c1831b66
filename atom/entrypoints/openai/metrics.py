"""Prometheus metrics of the server (``GET /metrics``), with vLLM-style names under ``atom:``.

Two sources:

- engine state, read from every engine core's ``get_stats`` when ``/metrics`` is scraped and
  labelled ``dp_rank``: running and waiting sequences, KV cache usage (blocks with ref count > 0
  over all blocks, a fraction in [0, 1]), used and total KV blocks, prefix-cache queries and hits
  (tokens) and their hit rate, preemptions, aborted and front-end-finished sequences, KV event
  batches published and dropped (when the ranks publish), with data parallelism the dummy
  batches the rank ran and the DP router's load (unfinished requests it charged to the rank)
  and decisions per reason (``atom.dp.router.REASONS``); with speculative decoding, its draft,
  accepted and emitted tokens, verifies, acceptance rate, tokens per forward and the
  accepted-length distribution (``atom:spec_decode_accepted_length{num_accepted=...}``), the
  per-position acceptance (``atom:spec_decode_num_accepted_tokens_per_pos{position=...}``) and
  the mean acceptance length; with
  EPLB, the durations of the rank's rebalances (``atom:eplb_rebalance_seconds``, a histogram);
- the DP group's values, which every rank holds a copy of (the ticks and the cross-rank
  decisions are identical on every rank), once and without ``dp_rank`` (summing them over
  ranks would count each step N times): the DP loop's ticks and forward steps (prefill,
  mixed-prefill, TBO, speculative), the cross-rank prefill policy's decisions per reason
  (``atom:prefill_policy_decisions``, labelled ``policy`` and ``reason``; they sum to its
  decisions), its hold rate and its longest run of holds (with the delayer, also under the
  names that predate the other policies: ``atom:prefill_delayer_decisions``,
  ``atom:prefill_delayer_hold_rate``), EPLB's rebalances (``atom:eplb_rebalances_total``) and,
  with EPLB or ``--record-expert-load``, the windows closed (``atom:eplb_windows_total``) and
  the last window's balancedness (``atom:eplb_balancedness``);
- the front end's own counters (no ``dp_rank``): the DP router's KV event subscriber
  (batches applied, gaps detected / healed / unhealed, lost batches, decode failures); rank
  failures (``atom:rank_failures{kind="dead"|"hung"}``), recoveries (fresh groups started),
  the seconds they took (``atom:rank_recovery_seconds``, sum, and the last one), requests
  resumed after them and requests they failed, the group's DP size and generation;
- per-request measurements taken by the front end as each request finishes, labelled with the
  ``dp_rank`` that ran it (``RequestMetrics.dp_rank``, as vLLM labels its engines' series;
  requests refused before they reached a rank are left out): TTFT, TPOT and E2E latency
  histograms (seconds), prompt and generation token counters; and finished requests per
  ``finished_reason`` (every request, no ``dp_rank``).

Every series carries ``model_name``. Nothing here talks to the engine: the server passes the
stats in (:meth:`ServerMetrics.render`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from atom.dp.eplb.controller import REBALANCE_SECONDS_BUCKETS
from atom.dp.router import REASONS
from atom.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                      160.0, 320.0)
_TPOT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)

# (metric name, stats key, help) of the engine counters and gauges
_ENGINE_GAUGES = (
    ("atom:num_requests_running", "num_running", "Sequences in the running batch."),
    ("atom:num_requests_waiting", "num_waiting", "Sequences waiting to be scheduled."),
    ("atom:num_kv_blocks_total", "num_total_blocks", "KV cache blocks in the pool."),
    ("atom:prefix_cache_hit_rate", "prefix_cache_hit_rate",
     "Prefix-cache hits / queries (prompt tokens) since start (0-1)."),
    ("atom:dp_router_load", "dp_router_load",
     "Unfinished requests the DP router charged to the rank (waiting + running + on the wire)."),
    ("atom:spec_decode_acceptance_rate", "spec_acceptance_rate",
     "Speculative decoding: accepted / proposed draft tokens since start (0-1)."),
    ("atom:spec_decode_mean_tokens_per_forward", "spec_mean_tokens_per_forward",
     "Speculative decoding: tokens emitted per verify since start (1 .. k + 1)."),
    ("atom:spec_decode_mean_acceptance_length", "spec_mean_acceptance_length",
     "Speculative decoding: 1 + accepted drafts / verifies since start (vLLM's convention)."),
    # P/D (--kv-role; atom.worker.tcp_kv_connector)
    ("atom:kv_transfer_kept_blocks", "kv_kept_blocks",
     "Producer: KV blocks of finished prefills kept until a consumer pulls them."),
    ("atom:num_requests_waiting_for_remote_kvs", "num_waiting_for_remote_kvs",
     "Consumer: sequences whose prompt KV is being pulled from a producer."),
)
_ENGINE_COUNTERS = (
    ("atom:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("atom:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("atom:num_preemptions", "num_preemptions", "Sequences preempted (recompute)."),
    ("atom:num_aborted_seqs", "num_aborted_seqs", "Sequences aborted by clients (disconnects)."),
    ("atom:num_front_end_finished_seqs", "num_front_end_finished_seqs",
     "Sequences ended by a stop string matched in the front end."),
    ("atom:kv_events_published_batches", "kv_events_published_batches",
     "KV event batches the rank published (one per step with events)."),
    ("atom:kv_events_dropped_batches", "kv_events_dropped_batches",
     "KV event batches dropped unsent because the publisher's queue was full."),
    ("atom:dp_dummy_steps", "num_dummy_steps", "Dummy batches this rank ran (no work of its own)."),
    # speculative decoding (engines with speculative_method only)
    ("atom:spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Draft tokens proposed and verified."),
    ("atom:spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Draft tokens accepted."),
    ("atom:spec_decode_num_emitted_tokens", "spec_num_emitted_tokens",
     "Tokens emitted by verifies (accepted drafts plus the target's token, cut at stops)."),
    ("atom:spec_decode_num_verifies", "spec_num_verifies",
     "Sequences x steps that verified drafts."),
    ("atom:spec_decode_num_drafts", "spec_num_verifies",
     "Draft proposals verified (vLLM's name for the verifies)."),
    ("atom:spec_decode_num_verify_steps", "spec_num_verify_steps",
     "Forward steps in which some sequence verified drafts."),
    # P/D (--kv-role; atom.worker.tcp_kv_connector)
    ("atom:kv_transfers", "kv_transfers",
     "KV transfers completed (consumer: pulls received; producer: pulls confirmed)."),
    ("atom:kv_transfer_bytes", "kv_transfer_bytes", "KV bytes received (consumer) or sent (producer)."),
    ("atom:kv_transfer_seconds", "kv_transfer_seconds",
     "Consumer: seconds from a pull's start to its last byte, summed."),
    ("atom:kv_transfer_failures", "kv_transfer_failures",
     "Consumer: pulls that failed (layout mismatch, producer gone, bad checksum)."),
    ("atom:kv_transfer_timeouts", "kv_transfer_timeouts",
     "Producer: kept requests freed on the keep timeout; consumer: pulls the producer never answered."),
)
# (metric name, stats key, help): the DP group's values, which every rank holds a copy of
# (DP ranks only): one series, no dp_rank label
_GROUP_COUNTERS = (
    ("atom:dp_ticks", "tick", "DP ticks (control syncs) of the group."),
    ("atom:dp_steps", "num_steps", "Forward steps of the DP group."),
    ("atom:dp_prefill_steps", "num_prefill_steps", "Group steps where some rank prefilled."),
    ("atom:dp_mixed_prefill_steps", "num_mixed_prefill_steps",
     "Group steps where some rank prefilled and another did not."),
    ("atom:dp_tbo_steps", "num_tbo_steps", "Group steps run as two micro-batches."),
    ("atom:dp_spec_steps", "num_spec_steps", "Group steps where some rank verified drafts."),
    ("atom:eplb_rebalances", "eplb_num_rebalances", "EPLB: rebalances that moved experts."),
    ("atom:eplb_windows", "eplb_num_windows",
     "EPLB or --record-expert-load: expert-load windows closed."),
)
_GROUP_GAUGES = (
    ("atom:eplb_balancedness", "eplb_balancedness",
     "EPLB: the last window's mean / max of the ranks' routed tokens, summed over layers (0-1]."),
)
_ROUTER_PREFIX = "dp_router_decisions_"
# (metric name, front-end stats key, help): the DP router's KV event subscriber
_SUBSCRIBER_COUNTERS = (
    ("atom:kv_events_subscriber_applied_batches", "kv_subscriber_num_applied_batches",
     "KV event batches the DP router's subscriber applied to its index."),
    ("atom:kv_events_subscriber_gaps_detected", "kv_subscriber_num_gaps_detected",
     "Seq gaps the subscriber saw in a rank's KV event stream."),
    ("atom:kv_events_subscriber_gaps_healed", "kv_subscriber_num_gaps_healed",
     "Seq gaps whose every missing batch came back by replay."),
    ("atom:kv_events_subscriber_gaps_unhealed", "kv_subscriber_num_gaps_unhealed",
     "Seq gaps with batches lost for good (that rank's index may be stale)."),
    ("atom:kv_events_subscriber_lost_batches", "kv_subscriber_num_lost_batches",
     "KV event batches that never arrived, live or replayed."),
    ("atom:kv_events_subscriber_decode_failures", "kv_subscriber_num_decode_failures",
     "Unreadable KV event messages, payloads or events."),
)
# (metric name, front-end stats key, help): rank failures and recoveries (every client)
_RECOVERY_COUNTERS = (
    ("atom:rank_recoveries", "rank_recoveries",
     "Fresh groups of engine cores started after rank failures."),
    ("atom:rank_recovery_seconds", "recovery_seconds_total",
     "Seconds from a rank failure's detection to the new group's ready messages, summed."),
    ("atom:resumed_requests", "num_resumed_requests",
     "In-flight requests resumed on a new group after a rank failure."),
    ("atom:unresumed_requests", "num_unresumed_requests",
     "In-flight requests a rank failure ended with an error instead."),
)
_RECOVERY_GAUGES = (
    ("atom:rank_recovery_last_seconds", "recovery_seconds_last",
     "Seconds the last recovery took (0 before any)."),
    ("atom:dp_size", "dp_size", "Engine-core ranks in the current group."),
    ("atom:group_generation", "generation",
     "Groups started before the current one (0 until a rank failure)."),
)
_DECISIONS_PREFIX = "prefill_policy_decisions_"  # + reason: the DP loop's stats keys
_POLICY_GAUGES = (
    ("hold_rate", "Prefill policy holds / ticks where some rank could admit a prefill."),
    ("max_consecutive_holds", "Longest run of consecutive prefill holds (ticks)."),
)


class _EngineCollector:
    """Yields the engine series from the last stats snapshot (one dict per DP rank)."""

    def __init__(self, model_name: str, prefill_policy: str):
        self.model_name = model_name
        self.prefill_policy = prefill_policy
        self.rank_stats: list[dict] = []
        self.front_end_stats: dict = {}

    def collect(self):
        labels = ["model_name", "dp_rank"]
        rows = [([self.model_name, str(s.get("dp_rank", i))], s) for i, s in enumerate(self.rank_stats)]
        usage = GaugeMetricFamily("atom:kv_cache_usage_perc",
                                  "KV cache usage: blocks with ref count > 0 / all blocks (0-1).",
                                  labels=labels)
        used = GaugeMetricFamily("atom:num_kv_blocks_used", "KV cache blocks with ref count > 0.",
                                 labels=labels)
        for values, s in rows:
            total, free = s.get("num_total_blocks", 0), s.get("num_free_blocks", 0)
            used.add_metric(values, total - free)
            usage.add_metric(values, (total - free) / total if total else 0.0)
        yield usage
        yield used
        for name, key, doc in _ENGINE_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=labels)
            for values, s in rows:
                if key in s:
                    family.add_metric(values, s[key])
            yield family
        for name, key, doc in _ENGINE_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=labels)
            for values, s in rows:
                if key in s:  # KV events only when on, the dp_* ones only on DP ranks
                    family.add_metric(values, s[key])
            yield family
        yield _spec_by_label(labels, rows, name="atom:spec_decode_accepted_length",
                             doc="Verifies that accepted exactly num_accepted draft tokens.",
                             prefix="spec_accepted_length_", label="num_accepted")
        yield _spec_by_label(labels, rows, name="atom:spec_decode_num_accepted_tokens_per_pos",
                             doc="Verifies that accepted the draft at this position (0-based).",
                             prefix="spec_num_accepted_tokens_pos_", label="position")
        yield _eplb_rebalance_seconds(labels, rows)
        model = [self.model_name]
        stats = [s for _, s in rows]
        for kind, name, key, doc in ([(CounterMetricFamily, *c) for c in _GROUP_COUNTERS]
                                     + [(GaugeMetricFamily, *g) for g in _GROUP_GAUGES]):
            family = kind(name, doc, labels=["model_name"])
            value = _group_value(stats, key)
            if value is not None:
                family.add_metric(model, value)
            yield family
        yield from self._policy_families(stats)
        yield _per_reason("atom:dp_router_decisions",
                          "DP router decisions per reason, by destination rank (DP only).",
                          rows, _ROUTER_PREFIX, REASONS)
        yield from self._front_end_families()

    def _front_end_families(self):
        stats, model = self.front_end_stats, [self.model_name]
        for kind, name, key, doc in ([(CounterMetricFamily, *c) for c in _SUBSCRIBER_COUNTERS]
                                     + [(CounterMetricFamily, *c) for c in _RECOVERY_COUNTERS]
                                     + [(GaugeMetricFamily, *g) for g in _RECOVERY_GAUGES]):
            family = kind(name, doc, labels=["model_name"])
            if key in stats:
                family.add_metric(model, stats[key])
            yield family
        failures = CounterMetricFamily("atom:rank_failures", "Engine-core ranks lost, by kind "
                                       "(dead: the process exited; hung: no heartbeat).",
                                       labels=["model_name", "kind"])
        for kind in ("dead", "hung"):
            if f"rank_failures_{kind}" in stats:
                failures.add_metric(model + [kind], stats[f"rank_failures_{kind}"])
        yield failures

    def _policy_families(self, stats: list[dict]):
        """The prefill policy's series (DP only: a single rank has no policy stats)."""
        yield from _decision_families("atom:prefill_policy", stats, model_name=self.model_name,
                                      policy=self.prefill_policy, gauges=_POLICY_GAUGES)
        if self.prefill_policy == "delayer":  # the names dashboards used before the policies
            yield from _decision_families("atom:prefill_delayer", stats,
                                          model_name=self.model_name, policy=None,
                                          gauges=_POLICY_GAUGES[:1])


def _group_value(stats: list[dict], key: str):
    """A group value every rank holds a copy of: the largest (the ranks answer the stats call
    at slightly different ticks; the counters only grow), or None when no rank has it."""
    values = [s[key] for s in stats if key in s]
    return max(values) if values else None


def _decision_families(prefix: str, stats: list[dict], *, model_name: str, policy: str | None,
                       gauges: tuple[tuple[str, str], ...]):
    """``{prefix}_decisions`` per reason and the ``gauges``, the group's, from the
    ``prefill_policy_*`` stats of the ranks; a ``policy`` label unless ``policy`` is None."""
    extra, extra_values = (["policy"], [policy]) if policy is not None else ([], [])
    decisions = CounterMetricFamily(f"{prefix}_decisions",
                                    "Cross-rank prefill decisions of the DP group per reason.",
                                    labels=["model_name", *extra, "reason"])
    keys = dict.fromkeys(k for s in stats for k in s if k.startswith(_DECISIONS_PREFIX))
    for key in keys:
        decisions.add_metric([model_name, *extra_values, key.removeprefix(_DECISIONS_PREFIX)],
                             _group_value(stats, key))
    yield decisions
    for name, doc in gauges:
        family = GaugeMetricFamily(f"{prefix}_{name}", doc, labels=["model_name", *extra])
        value = _group_value(stats, f"prefill_policy_{name}")
        if value is not None:
            family.add_metric([model_name, *extra_values], value)
        yield family


def _spec_by_label(labels: list[str], rows, *, name: str, doc: str, prefix: str,
                   label: str) -> CounterMetricFamily:
    """A speculative-decoding counter family from each rank's ``{prefix}{value}`` stats,
    labelled ``label=value``: the accepted-length distribution (verifies by drafts accepted)
    and the per-position acceptance (vLLM's ``spec_decode_num_accepted_tokens_per_pos``)."""
    family = CounterMetricFamily(name, doc, labels=labels + [label])
    for values, s in rows:
        for key, count in s.items():
            if key.startswith(prefix):
                family.add_metric(values + [key.removeprefix(prefix)], count)
    return family


def _eplb_rebalance_seconds(labels: list[str], rows) -> HistogramMetricFamily:
    """EPLB's rebalances (all-reduce, plan, move) by duration, from each rank's buckets."""
    family = HistogramMetricFamily("atom:eplb_rebalance_seconds",
                                   "EPLB: seconds a rebalance paused the rank (all-reduce, plan, "
                                   "weight move).", labels=labels)
    bounds = [str(b) for b in REBALANCE_SECONDS_BUCKETS] + ["+Inf"]
    for values, s in rows:
        counts = s.get("eplb_rebalance_seconds_buckets")
        if counts is not None:
            cumulative = [sum(counts[:i + 1]) for i in range(len(counts))]
            family.add_metric(values, list(zip(bounds, cumulative)),
                              s["eplb_rebalance_seconds_sum"])
    return family


def _per_reason(name: str, doc: str, rows, prefix: str, reasons) -> CounterMetricFamily:
    """A counter family with a ``reason`` label from the stats keys ``prefix + reason``."""
    family = CounterMetricFamily(name, doc, labels=["model_name", "dp_rank", "reason"])
    for values, s in rows:
        for reason in reasons:
            if prefix + reason in s:
                family.add_metric(values + [reason], s[prefix + reason])
    return family


class ServerMetrics:
    """The server's registry: per-request histograms and counters plus the engine collector.

    Thread-safe for :meth:`record_finished` (prometheus_client metrics are); :meth:`render`
    runs on the event loop.
    """

    def __init__(self, model_name: str, *, prefill_policy: str = "none"):
        self.model_name = model_name
        disable_created_metrics()  # no *_created series (process-wide; this is the server)
        self.registry = CollectorRegistry()
        kw = dict(labelnames=["model_name", "dp_rank"], registry=self.registry)
        self.ttft_s = Histogram("atom:time_to_first_token_seconds", "Time to first token (TTFT).",
                                buckets=_LATENCY_BUCKETS_S, **kw)
        self.tpot_s = Histogram("atom:time_per_output_token_seconds",
                                "Mean time per output token after the first (TPOT).",
                                buckets=_TPOT_BUCKETS_S, **kw)
        self.e2e_s = Histogram("atom:e2e_request_latency_seconds", "End-to-end request latency.",
                               buckets=_LATENCY_BUCKETS_S, **kw)
        self.prompt_tokens = Counter("atom:prompt_tokens", "Prompt tokens of finished requests.", **kw)
        self.generation_tokens = Counter("atom:generation_tokens",
                                         "Output tokens of finished requests (all choices).", **kw)
        self.request_success = Counter("atom:request_success", "Finished requests per reason.",
                                       labelnames=["model_name", "finished_reason"],
                                       registry=self.registry)
        self._engine = _EngineCollector(model_name, prefill_policy)
        self.registry.register(self._engine)

    def record_finished(self, out: RequestOutput) -> None:
        """Account one finished request (called on the engine thread): its latencies and
        tokens under the ``dp_rank`` that ran it (none for a request that never reached a
        rank), its finish reason."""
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.request_success.labels(self.model_name, str(reason)).inc()
        m = out.metrics
        if m is None or m.dp_rank is None:
            return
        labels = (self.model_name, str(m.dp_rank))
        for histogram, value in ((self.ttft_s, m.ttft_s), (self.tpot_s, m.tpot_s),
                                 (self.e2e_s, m.e2e_latency_s)):
            if value is not None:
                histogram.labels(*labels).observe(value)
        self.prompt_tokens.labels(*labels).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(*labels).inc(sum(len(c.token_ids) for c in out.outputs))

    def render(self, rank_stats: list[dict], front_end_stats: dict | None = None) -> bytes:
        """The exposition text, with the engine series from ``rank_stats`` (one dict per rank)
        and the front end's from ``front_end_stats`` (:meth:`atom.engine.llm_engine.LLMEngine.front_end_stats`)."""
        self._engine.rank_stats = rank_stats
        self._engine.front_end_stats = front_end_stats or {}
        return generate_latest(self.registry)
