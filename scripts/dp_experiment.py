"""DP experiment: the cross-rank prefill policies and the decode-protection interval on a bursty
workload with one KV-pressured rank.

Workload (token-id prompts, seeded, identical for every configuration):

- *pressure*: ``--pressure-prompts`` long prompts pinned to rank 0 at t=0; with a small KV pool
  (``--num-kv-blocks`` per rank) rank 0 cannot admit them all, so it keeps prefill work it
  cannot start while the other ranks are free;
- *bursts*: ``--num-bursts`` bursts of ``--burst-size`` short prompts, ``--burst-interval-s``
  apart, routed by the DP router (``least_requests``).

Configurations: every ``--prefill-policy`` (none, delayer, coalescer) × every
``--prefill-decode-interval`` (0 = off); with ``--moe-split-experts E`` the model is the
checkable model (a) of docs/ARCHITECTURE.md (the embedded model's MLPs split into E experts, sharded over the ranks: every MoE
layer exchanges tokens between the ranks), and with ``--enable-expert-parallel`` a real MoE
folder's experts are sharded over the ranks; either way each configuration runs with
two-batch overlap off and on. Prompt token ids are drawn inside the model's vocabulary
(:func:`atom.dp.sim.workload.vocab_range`: ids 100-19999, cut at a smaller vocabulary). Each
runs the same workload on ``--dp-size`` real EngineCore processes. Measured (the step
counters come from the batch-shape exchange, so every rank counts the same):

- mixed-step fraction: forward steps where some rank prefills and another does not, over all
  forward steps (in an expert-parallel model the decode-only ranks wait for the prefill);
- prefill-step fraction: forward steps where some rank prefills (the rest are decode-only on
  every rank: what the decode-protection interval protects);
- dummy-step fraction: (rank, step) pairs that ran a dummy batch, over steps × ranks;
- hold rate: the policy's holds over the ticks where some rank could admit a prefill, and the
  longest run of consecutive holds;
- output tokens/s from the first arrival to the last finish; TTFT and TPOT (mean, p50, p90);
- who paid (a second table): the policy's decisions per reason, each rank's preemptions and
  peak KV usage (from its trace), TTFT per request class (the pinned pressure prompts vs the
  bursts), and the min-max spread of tok/s and mean TTFT over ``--repeats N`` runs (the main
  table then shows each metric's median).

Warnings follow the tables when a configuration never exercised what it compares (a policy or
interval that never held, no KV-pressured rank, TBO on without a split step), when a ratio is
inside the runs' own spread, and after single runs (this machine's noise is about ±30 %).

By default arrivals are in wall-clock seconds, so step counts move a little between runs (the
ticks at which a burst lands depend on the machine's speed); the step counters themselves are
exact. ``--clock tick`` replays the workload tick-clocked (bursts ``--burst-interval-ticks``
apart, every request sent before the first tick: :mod:`atom.dp.sim.replay`): the per-rank
batch shapes are then identical on every run, and equal to the simulator's
(``atom sim run --workload dp_experiment --clock tick``). The workload is
:func:`atom.dp.sim.workload.dp_experiment`.
Every configuration writes its per-tick trace (``--trace-dir``/<configuration>/), its
Perfetto JSON and its PNG timeline (``scripts/dp_trace.py``). Prints a table and writes JSON
(``--output-json``). Wall-clock numbers move with machine load; compare configurations of the
same run, and step counts across runs.

    python scripts/dp_experiment.py --output-json results/dp_experiment.json
    python scripts/dp_experiment.py --moe-split-experts 4 --prefill-policy none delayer \
        --prefill-decode-interval 0 --output-json results/dp_experiment_moe.json
    python scripts/dp_experiment.py --clock tick --output-json results/dp_experiment_tick.json
    python scripts/dp_experiment.py --model ./tiny-qwen3-moe --enable-expert-parallel \
        --prefill-policy delayer --prefill-decode-interval 0
    python scripts/dp_experiment.py --repeats 3 --output-json results/dp_experiment_x3.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

import dp_trace  # scripts/dp_trace.py, beside this script
from atom.config import EngineConfig
from atom.dp.dp_trace import read_trace, to_perfetto
from atom.dp.sim import workload
from atom.dp.sim.metrics import format_table, summary
from atom.dp.sim.replay import run_real
from atom.engine.liveness import EngineStartError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a Hugging Face model folder or GGUF file (default: the embedded "
                        "SmolLM2-135M); the workload's token ids are drawn inside its "
                        "vocabulary (ids 100-19999, cut at a smaller one)")
    p.add_argument("--dp-size", type=int, default=2, help="DP ranks (real engine-core processes)")
    p.add_argument("--dtype", default="float32", help="model dtype")
    p.add_argument("--num-kv-blocks", type=int, default=32, help="per rank, 16 tokens each")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences per batch, per rank")
    p.add_argument("--prefill-policy", nargs="+", default=["none", "delayer", "coalescer"],
                   choices=["none", "delayer", "coalescer"], help="the policies to sweep")
    p.add_argument("--prefill-decode-interval", type=int, nargs="+", default=[0, 2],
                   help="the decode-protection intervals to sweep (ticks; 0 = off)")
    p.add_argument("--max-delay-passes", type=int, default=30, help="the delayer's bound")
    p.add_argument("--pressure-prompts", type=int, default=3,
                   help="long prompts pinned to rank 0 at t=0 (its KV pressure)")
    p.add_argument("--pressure-prompt-len", type=int, default=160, help="their prompt tokens")
    p.add_argument("--pressure-max-tokens", type=int, default=48, help="their output tokens")
    p.add_argument("--num-bursts", type=int, default=6, help="bursts of short routed prompts")
    p.add_argument("--burst-size", type=int, default=4, help="prompts per burst")
    p.add_argument("--burst-interval-s", type=float, default=1.0,
                   help="time-clocked arrivals: seconds between bursts")
    p.add_argument("--clock", choices=["time", "tick"], default="time",
                   help="tick: replay tick-clocked (bursts --burst-interval-ticks ticks apart; "
                        "the per-rank batch shapes are then the same on every run)")
    p.add_argument("--burst-interval-ticks", type=int, default=8,
                   help="tick-clocked arrivals: ticks between bursts")
    p.add_argument("--short-prompt-len", type=int, nargs=2, default=(24, 64),
                   help="burst prompt tokens: min max (uniform)")
    p.add_argument("--short-max-tokens", type=int, nargs=2, default=(8, 24),
                   help="burst output tokens: min max (uniform)")
    p.add_argument("--moe-split-experts", type=int, default=0,
                   help="E > 0: the model with every MLP split into E experts (model "
                        "(a) of docs/ARCHITECTURE.md), experts sharded over the ranks (expert parallelism), and "
                        "every configuration run with TBO off and on")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="shard a real MoE model's experts over the ranks (expert "
                        "parallelism), and run every configuration with TBO off and on")
    p.add_argument("--speculative-method", choices=["ngram", "draft"], default=None,
                   help="run every configuration with speculative decoding (its verify steps "
                        "are counted as spec steps); default off")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="k with speculation")
    p.add_argument("--draft-num-layers", type=int, default=24, help="early-exit draft layers")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (same seed, same prompts)")
    p.add_argument("--trace-dir", default="results/dp_trace",
                   help="each configuration's trace, Perfetto JSON and PNG go in a folder here")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per configuration; the table shows medians and the min-max spread")
    p.add_argument("--output-json", default="results/dp_experiment.json", help="the results")
    return p.parse_args(argv)


def configurations(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(name, EngineConfig options) of every configuration to run, in order."""
    base = dict(model=args.model, data_parallel_size=args.dp_size, dtype=args.dtype,
                num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                max_model_len=1024, enable_prefix_caching=False, skip_tokenizer_init=True,
                prefill_delayer_max_delay_passes=args.max_delay_passes)
    if args.speculative_method is not None:
        base.update(speculative_method=args.speculative_method,
                    num_speculative_tokens=args.num_speculative_tokens)
        if args.speculative_method == "draft":
            base.update(draft_num_layers=args.draft_num_layers)
    policies = [(f"{policy}, interval {n}", dict(prefill_policy=policy, prefill_decode_interval=n))
                for policy in args.prefill_policy for n in args.prefill_decode_interval]
    if not (args.moe_split_experts or args.enable_expert_parallel):
        return [(name, {**base, **options}) for name, options in policies]
    # model (a), or a real MoE, with its experts over the ranks; TBO off and on
    base.update(moe_split_experts=args.moe_split_experts or None, enable_expert_parallel=True)
    return [(f"{name}, TBO {'on' if tbo else 'off'}", {**base, **options, "enable_tbo": tbo})
            for name, options in policies for tbo in (False, True)]


def write_trace_views(folder: pathlib.Path, name: str) -> None:
    """The configuration's Perfetto JSON and PNG timeline, beside its trace rows."""
    traces = read_trace(folder)
    (folder / "perfetto.json").write_text(json.dumps(to_perfetto(traces)))
    dp_trace.plot(traces, folder / "timeline.png", title=name)


def model_vocab_size(model: str | None) -> int | None:
    """The vocabulary of a Hugging Face folder (its config.json's ``vocab_size``, or its
    ``text_config``'s); None for the embedded model and GGUF files (their vocabularies hold
    the default ids: the embedded one has 49152 tokens; a run still checks every id).

    Raises:
        ValueError: a folder whose config.json names no vocabulary size.
    """
    if model is None or not pathlib.Path(model, "config.json").is_file():
        return None
    hf_config = json.loads(pathlib.Path(model, "config.json").read_text())
    size = hf_config.get("vocab_size") or (hf_config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int):
        raise ValueError(f"{model}/config.json has no vocab_size: the workload's token ids "
                         f"must be drawn inside the vocabulary")
    return size


def make_workload(args: argparse.Namespace) -> list[workload.TraceRequest]:
    """The experiment's workload (:func:`atom.dp.sim.workload.dp_experiment`) on the chosen
    clock, its token ids inside ``--model``'s vocabulary."""
    return workload.dp_experiment(vocab_size=model_vocab_size(args.model),
        clock=args.clock, burst_interval=(args.burst_interval_s if args.clock == "time"
                                          else args.burst_interval_ticks),
        pressure_prompts=args.pressure_prompts, pressure_prompt_len=args.pressure_prompt_len,
        pressure_max_tokens=args.pressure_max_tokens, num_bursts=args.num_bursts,
        burst_size=args.burst_size, short_prompt_len=tuple(args.short_prompt_len),
        short_max_tokens=tuple(args.short_max_tokens), seed=args.seed)


# a policy's hold decisions (prefill_policy_stats keys), and the interval's
HOLD_REASONS = ("decisions_hold", "decisions_hold_fill")
INTERVAL_HOLD = "decisions_hold_decode_interval"
NOISE_NOTE = ("one run per configuration: wall-clock differences under about 30 % are within "
              "this machine's run-to-run noise (docs/PERFORMANCE.md); use --repeats 3")


def request_classes(requests: list[workload.TraceRequest]) -> dict[str, str]:
    """``{request_id: "pressure" | "burst"}``: the pinned long prompts and the routed ones."""
    return {r.request_id: "pressure" if r.dp_rank is not None else "burst" for r in requests}


def class_latencies(run: dict, classes: dict[str, str]) -> dict[str, dict[str, float]]:
    """TTFT and TPOT summaries (ms) of each request class of one run."""
    out = {}
    for cls in sorted(set(classes.values())):
        ids = [i for i, c in classes.items() if c == cls]
        out[cls] = {"ttft_ms": summary([run["ttft_ms_by_request"][i] for i in ids
                                        if i in run["ttft_ms_by_request"]]),
                    "tpot_ms": summary([run["tpot_ms_by_request"][i] for i in ids
                                        if i in run["tpot_ms_by_request"]])}
    return out


def peak_kv_usage(folder: pathlib.Path) -> list[float]:
    """Each rank's highest KV usage (0-1) over the run's ticks, from its trace."""
    return [max((row["kv_usage_ppm"] for row in t.rows), default=0) / 1e6
            for t in read_trace(folder)]


def median_of(runs: list):
    """The element-wise median of equally shaped run results: numbers -> median (integers:
    the lower median, an observed count), dicts and lists -> recursively, anything else
    (names, paths) -> the first run's."""
    first = runs[0]
    if isinstance(first, bool) or not isinstance(first, (int, float, dict, list)):
        return first
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in runs]) if all(k in r for r in runs) else v
                for k, v in first.items()}
    if isinstance(first, list):
        if any(len(r) != len(first) for r in runs):
            return first
        return [median_of([r[i] for r in runs]) for i in range(len(first))]
    if all(isinstance(r, int) for r in runs):  # counts stay counts: the lower median
        return statistics.median_low(runs)
    return statistics.median(runs)


def aggregate(runs: list[dict]) -> dict:
    """One configuration's result: the medians over its runs, the min-max spread of the
    wall-clock figures, and every run (with more than one)."""
    result = median_of(runs)
    spread = {"output_tokens_per_s": [r["output_tokens_per_s"] for r in runs],
              "ttft_mean_ms": [r["ttft_ms"].get("mean", 0.0) for r in runs],
              "mixed_step_fraction": [r["mixed_step_fraction"] for r in runs]}
    result["repeats"] = len(runs)
    result["spread"] = {k: [min(v), max(v)] for k, v in spread.items()}
    if len(runs) > 1:
        result["runs"] = runs
    return result


def warnings_for(results: list[dict]) -> list[str]:
    """What a configuration never exercised, and ratios inside the runs' own spread."""
    out = []
    for r in results:
        stats, name = r["prefill_policy_stats"], r["name"]
        holds = sum(stats.get(k, 0) for k in HOLD_REASONS)
        if r["prefill_policy"] in ("delayer", "coalescer") and holds == 0:
            out.append(f"{name}: the {r['prefill_policy']} never held a prefill, so this run "
                       "compares nothing against 'none' (no rank was ever ready while another "
                       "was not)")
        if r["prefill_decode_interval"] and stats.get(INTERVAL_HOLD, 0) == 0:
            out.append(f"{name}: the decode interval never held a prefill")
        preempted = sum(p.get("num_preemptions", 0) for p in r["per_rank"])
        if max(r["peak_kv_usage"], default=0.0) < 0.9 and preempted == 0:
            out.append(f"{name}: no rank was KV-pressured (peak KV usage "
                       f"{max(r['peak_kv_usage'], default=0.0):.0%}, no preemption): lower "
                       "--num-kv-blocks or raise --pressure-prompts")
        if "TBO on" in name and r["num_tbo_steps"] == 0:
            out.append(f"{name}: no step ran as two micro-batches")
    base = results[0]
    lo, hi = base["spread"]["output_tokens_per_s"]
    for r in results[1:]:
        rlo, rhi = r["spread"]["output_tokens_per_s"]
        if r["repeats"] > 1 and rlo <= hi and lo <= rhi:
            out.append(f"{r['name']}: its tok/s range {rlo:.1f}-{rhi:.1f} overlaps "
                       f"{base['name']}'s {lo:.1f}-{hi:.1f}: the ratio is within the noise")
    if results and results[0]["repeats"] == 1 and len(results) > 1:
        out.append(NOISE_NOTE)
    return out


def details_table(results: list[dict]) -> str:
    """Who paid: per configuration, the policy's decisions, each rank's preemptions and peak
    KV usage, TTFT per request class, and the spread of the wall-clock figures."""
    def decisions(stats: dict) -> str:
        counts = sorted(((v, k.removeprefix("decisions_")) for k, v in stats.items()
                         if k.startswith("decisions_") and v), reverse=True)
        return ", ".join(f"{k} {v}" for v, k in counts) or "-"

    def ttft(r: dict, cls: str) -> str:
        s = r["by_class"].get(cls, {}).get("ttft_ms", {})
        return f"{s['mean']:.0f} / {s['p90']:.0f}" if s else "-"

    def span(r: dict, key: str, fmt: str) -> str:
        lo, hi = r["spread"][key]
        return format(lo, fmt) if r["repeats"] == 1 else f"{format(lo, fmt)}-{format(hi, fmt)}"

    lines = ["| configuration | decisions | preemptions per rank | peak KV usage per rank | "
             "TTFT pressure mean / p90 (ms) | TTFT bursts mean / p90 (ms) | tok/s min-max | "
             "TTFT mean min-max (ms) | runs |", "|" + "---|" * 9]
    for r in results:
        lines.append(" | ".join([
            f"| {r['name']}", decisions(r["prefill_policy_stats"]),
            " / ".join(str(round(p.get("num_preemptions", 0))) for p in r["per_rank"]),
            " / ".join(f"{u:.0%}" for u in r["peak_kv_usage"]),
            ttft(r, "pressure"), ttft(r, "burst"),
            span(r, "output_tokens_per_s", ".1f"), span(r, "ttft_mean_ms", ".0f"),
            f"{r['repeats']} |"]))
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> list[dict]:
    """Every configuration, ``--repeats`` times each, on real ranks: their aggregated results.

    Raises:
        ValueError: options the engine refuses, or a workload outside the model's vocabulary.
        EngineStartError: a rank failed to start (one line naming it and the cause).
    """
    requests = make_workload(args)
    classes = request_classes(requests)
    results = []
    for name, options in configurations(args):
        slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
        runs = []
        for i in range(args.repeats):
            folder = pathlib.Path(args.trace_dir) / slug
            if args.repeats > 1:
                folder /= f"run{i}"
            config = EngineConfig.from_kwargs(**options, dp_trace=str(folder))
            print(f"running: {name} ({i + 1}/{args.repeats}) ...", file=sys.stderr, flush=True)
            run = run_real(requests, config, name=name)
            write_trace_views(folder, name)
            run.update(trace=str(folder), by_class=class_latencies(run, classes),
                       peak_kv_usage=peak_kv_usage(folder))
            runs.append(run)
        results.append(aggregate(runs))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats} must be at least 1")
    try:
        results = run_all(args)
    except (ValueError, EngineStartError) as exc:  # what to change, in one line
        raise SystemExit(f"dp_experiment.py: error: {exc}") from None
    warnings = warnings_for(results)
    medians = " (medians of the runs)" if args.repeats > 1 else ""
    print(f"{format_table(results)}\n\nWho paid{medians}:\n\n{details_table(results)}")
    for w in warnings:
        print(f"warning: {w}")
    out = pathlib.Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results, "warnings": warnings},
                              indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
