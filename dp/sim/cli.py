"""``atom sim ...``: the simulator's command line (every engine option is accepted, as by the
other ``atom`` commands; ``--data-parallel-size`` is the number of virtual ranks).

- ``atom sim run --workload NAME|FILE``: one simulated run; prints the table, writes JSON
  (``--output-json``) and, with ``--trace-dir``, the per-tick trace of every virtual rank;
  with ``--routing-zipf S`` or ``--routing-load FILE`` the MoE tokens follow a routing skew
  (:mod:`atom.dp.sim.experts`), and ``--enable-eplb`` balances it;
- ``atom sim sweep --workloads ... --dp-sizes ... --policies ...``: a sweep, its JSON and PNG;
- ``atom sim calibrate``: measure this machine (the real model runner, then a short real DP
  run) and write a profile JSON (``--output``);
- ``atom sim workload NAME --output FILE``: write a generated workload as a trace file.

Workloads: a generator name (``dp_experiment``, ``bursty``, ``kv_skewed``, ``sessions``; sized
for ``--data-parallel-size`` by :func:`atom.dp.sim.workload.scaled`, its arguments replaced
with ``--workload-arg KEY=VALUE``, values in JSON) or a JSON-lines trace file
(:mod:`atom.dp.sim.workload`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from atom.config import add_engine_args, config_from_args


def _workload_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: use KEY=VALUE")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key.replace("-", "_"), tuple(parsed) if isinstance(parsed, list) else parsed


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="dp_experiment",
                   help="a generator name (dp_experiment, bursty, kv_skewed, sessions) or a "
                        "JSON-lines trace file")
    p.add_argument("--workload-arg", type=_workload_arg, action="append", default=[],
                   metavar="KEY=VALUE", help="a generator argument (repeat)")
    p.add_argument("--clock", choices=["time", "tick"], default="time",
                   help="generated workloads: arrivals in seconds or ticks")
    p.add_argument("--workload-seed", type=int, default=0)


def _workload(args: argparse.Namespace, dp_size: int):
    """The generated workload, or the trace file's; ValueError listing the generators for a
    name that is neither."""
    from atom.dp.sim.workload import GENERATORS, read_workload, scaled

    if args.workload not in GENERATORS and pathlib.Path(args.workload).exists():
        if args.workload_arg:
            raise ValueError("--workload-arg applies to generated workloads, not to a file")
        return read_workload(args.workload)
    return scaled(args.workload, dp_size=dp_size, clock=args.clock, seed=args.workload_seed,
                  **dict(args.workload_arg))


def _workload_label(args: argparse.Namespace) -> str:
    """The workload as the header names it: the generator with the arguments given, or the
    file."""
    changed = ", ".join(f"{k}={v}" for k, v in args.workload_arg)
    clock = "" if args.clock == "time" else f", {args.clock}-clocked"
    return f"{args.workload}{f' ({changed}{clock})' if changed else f' ({clock[2:]})' if clock else ''}"


def _write_json(path: str, data) -> None:
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def _routing(args: argparse.Namespace):
    """The routing-skew model of ``--routing-zipf`` / ``--routing-load``, or None."""
    from atom.dp.sim.experts import ExpertPopularity

    if args.routing_load is not None:
        try:
            return ExpertPopularity.read(args.routing_load, top_k=args.routing_top_k)
        except ValueError as exc:
            raise ValueError(f"--routing-load {args.routing_load} with --routing-top-k "
                             f"{args.routing_top_k}: {exc}") from None
    if args.routing_zipf is not None:
        try:
            return ExpertPopularity.zipf(args.routing_layers, args.routing_experts,
                                         top_k=args.routing_top_k, exponent=args.routing_zipf,
                                         seed=args.workload_seed)
        except ValueError as exc:
            raise ValueError(f"{exc}: change --routing-zipf, --routing-experts, "
                             f"--routing-layers or --routing-top-k") from None
    return None


def cmd_run(args: argparse.Namespace) -> int:
    from atom.dp.sim import format_table, run_header, simulate

    config = config_from_args(args)
    result = simulate(_workload(args, config.data_parallel_size), config, args.profile,
                      name=args.name, trace_dir=args.trace_dir,
                      slowest_rank=args.slowest_rank, dummy_cost=args.dummy_cost,
                      routing=_routing(args))
    result["workload"] = _workload_label(args)
    print("\n".join(run_header(result)))
    print(format_table([result]))
    sim = result["sim"]
    print(f"simulated {sim['simulated_s']:.1f} s in {sim['cpu_s']:.2f} CPU s "
          f"({sim['num_ticks']} ticks, {sim['cpu_us_per_tick']:.0f} µs per tick)")
    experts = result.get("experts")
    if experts is not None:
        windows = experts.get("windows", [])
        eplb = ""
        if windows:
            eplb = (f"; {'EPLB' if config.enable_eplb else 'expert load'} windows "
                    f"{len(windows)}, balancedness first {windows[0]['balancedness']:.3f}, last "
                    f"{windows[-1]['balancedness']:.3f}"
                    + (f", {experts['num_rebalances']} rebalance(s)" if config.enable_eplb
                       else ""))
        elif config.resolved_record_expert_load():
            eplb = (f"; {'EPLB' if config.enable_eplb else 'the expert load'} never acted: "
                    f"the run's {result['num_steps']} steps ended before the first window closed, at step {config.eplb_step_interval} "
                    f"(--eplb-step-interval; shorten it and --eplb-window-size, or run longer)")
        print(f"experts: mean step imbalance {experts['mean_imbalance']:.2f}{eplb}")
    if args.output_json:
        _write_json(args.output_json, result)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from atom.dp.sim import format_sweep
    from atom.dp.sim.metrics import wrap
    from atom.dp.sim.sweep import plot, sweep

    base = config_from_args(args)
    results = sweep(base=base, workloads=args.workloads,
                    dp_sizes=args.dp_sizes, policies=args.policies, profile=args.profile,
                    clock=args.clock, seed=args.workload_seed, trace_root=args.trace_dir)
    first = results[0]
    print("\n".join(wrap(f"sweep: policies {' '.join(args.policies)} x DP {' '.join(map(str, args.dp_sizes))} "
          f"x workloads {' '.join(args.workloads)} ({args.clock}-clocked); EP "
          f"{'on' if base.enable_expert_parallel else 'off'}, TBO "
          f"{'on' if base.enable_tbo else 'off'}, {first['num_kv_blocks']} KV blocks a rank; "
          f"profile {first['profile'] or '(given)'}")), end="\n\n")
    print(format_sweep(results))
    _write_json(args.output_json, results)
    if args.plot:
        plot(results, args.plot, title=args.title)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from atom.dp.sim.calibrate import calibrate

    replays = {} if args.group_replays is None else {"group_replays": args.group_replays}
    profile = calibrate(config_from_args(args), repeats=args.repeats, group=args.group,
                        **replays)
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    grid = profile.fit["grid"]
    print(f"grid fit: mean |error| {grid['mean_abs_rel_error']:.1%}, max "
          f"{grid['max_abs_rel_error']:.1%} over {grid['num_points']} batches")
    for part in ("group", "group_ep"):
        if part in profile.fit:
            group = profile.fit[part]
            print(f"{part} fit: mean |error| per tick {group['mean_abs_rel_error']:.1%}, total "
                  f"{group['total_rel_error']:.1%} over {group['num_points']} ticks")
    print(f"wrote {out}")
    return 0


def cmd_workload(args: argparse.Namespace) -> int:
    from atom.dp.sim.workload import write_workload

    requests = _workload(args, args.data_parallel_size)
    write_workload(args.output, requests)
    print(f"wrote {len(requests)} requests to {args.output}")
    return 0


def _engine_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--log-level", default="WARNING", help="Python logging level (stderr)")
    p.set_defaults(runs_engine=False)  # never a launched rank: the simulator runs in-process


def add_sim_parser(sub, fmt) -> None:
    """Register ``atom sim`` and its subcommands on the ``atom`` parser's subparsers."""
    sim = sub.add_parser("sim", help="the DP/EP simulator: run, sweep, calibrate, workload",
                         description=__doc__.split("\n\n")[0])
    sim_sub = sim.add_subparsers(dest="sim", required=True)

    run = sim_sub.add_parser("run", help="simulate one deployment", formatter_class=fmt)
    _engine_args(run)
    _add_workload_args(run)
    run.add_argument("--profile", help="a profile JSON or committed name (default: the one "
                                       "for the model: atom.dp.sim.default_profile_name)")
    run.add_argument("--name", help="the run's label")
    run.add_argument("--trace-dir", help="write every virtual rank's per-tick trace here")
    run.add_argument("--output-json", help="write the result here")
    run.add_argument("--slowest-rank", action=argparse.BooleanOptionalAction, default=True,
                     help="the group waits for its slowest rank (off: the mean; ablation)")
    run.add_argument("--dummy-cost", action=argparse.BooleanOptionalAction, default=True,
                     help="dummy batches cost time (off: nothing; ablation)")
    routing = run.add_mutually_exclusive_group()
    routing.add_argument("--routing-zipf", type=float, metavar="EXPONENT",
                         help="route the MoE tokens with a Zipf expert popularity (needs "
                              "--enable-expert-parallel: the experts' imbalance costs time; "
                              "--enable-eplb needs a routing)")
    routing.add_argument("--routing-load", metavar="FILE",
                         help="route with the popularity of a recorded LLM.get_expert_load() "
                              "(.npy or JSON [layers, experts])")
    run.add_argument("--routing-experts", type=int, default=64, help="with --routing-zipf")
    run.add_argument("--routing-layers", type=int, default=8, help="with --routing-zipf")
    run.add_argument("--routing-top-k", type=int, default=4, help="experts per token")
    run.set_defaults(func=cmd_run)

    sw = sim_sub.add_parser("sweep", help="policy x DP size x workload", formatter_class=fmt)
    _engine_args(sw)
    sw.add_argument("--workloads", nargs="+", default=["bursty", "kv_skewed"])
    sw.add_argument("--dp-sizes", nargs="+", type=int, default=[2, 8, 32])
    sw.add_argument("--policies", nargs="+", default=["none", "delayer", "coalescer"])
    sw.add_argument("--clock", choices=["time", "tick"], default="time")
    sw.add_argument("--workload-seed", type=int, default=0)
    sw.add_argument("--profile")
    sw.add_argument("--trace-dir", help="each run's trace in a folder here")
    sw.add_argument("--output-json", default="results/sim_sweep.json")
    sw.add_argument("--plot", help="write the sweep's PNG here")
    sw.add_argument("--title", default="atom sim sweep")
    sw.set_defaults(func=cmd_sweep)

    cal = sim_sub.add_parser("calibrate", help="measure this machine, write a profile",
                             formatter_class=fmt)
    _engine_args(cal)
    cal.add_argument("--repeats", type=int, default=3, help="timed rounds over the grid")
    cal.add_argument("--group", action=argparse.BooleanOptionalAction, default=True,
                     help="also fit the per-tick and EP terms on a short real DP run")
    cal.add_argument("--group-replays", type=int, default=None,
                     help="real replays per group fit, each tick's median (default: "
                          "atom.dp.sim.calibrate.GROUP_REPLAYS; fewer: quicker, noisier)")
    cal.add_argument("--output", default="results/sim_profile.json")
    cal.set_defaults(func=cmd_calibrate, data_parallel_size=2, dtype="float32")

    wl = sim_sub.add_parser("workload", help="write a generated workload as a trace file",
                            formatter_class=fmt)
    _engine_args(wl)
    _add_workload_args(wl)
    wl.add_argument("--output", required=True)
    wl.set_defaults(func=cmd_workload)
