"""Scheduler + update_from_output overhead per running sequence per step (issue 7).

Drives the real :class:`~atom.core.scheduler.Scheduler` and :class:`~atom.core.block_manager.BlockManager`
with a fake model step (the "sampled" token is a constant, nothing is computed) at
``--num-seqs`` running sequences (default 256, all decoding, W1-like prompts of 112-144 tokens),
with ``--num-waiting`` more requests queued behind them that cannot be admitted (the running
batch is full), as under overload. Timed per step: ``schedule()``, ``update_from_output()``, and the
model runner's host-side batch preparation (``ModelRunner._prepare``: token ids, positions,
slots, block tables as tensors) — the per-step Python work outside the forward pass.

Then, in the same run, it times one real batch-``--num-seqs`` decode step of the embedded model
(``ModelRunner.execute_model`` + sampler, contexts of about 200 tokens), split into attention,
the rest of the model and sampling, and reports the overhead as a percentage of it. The issue's bar: scheduler + update_from_output <= 5 % of that step.

    .venv/bin/python scripts/bench_scheduler.py [--num-seqs 256] [--steps 200] [--dtype auto]

Prints a table and writes ``results/bench_scheduler.json``.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import time

from bench_common import write_json_report

_FAKE_TOKEN = 1000


def _tokens(token_ids: dict):
    """A worker's output emitting ``token_ids`` (seq_id -> token)."""
    from atom.core.model_runner_output import ModelRunnerOutput

    return ModelRunnerOutput.from_tokens(token_ids)


def make_scheduler(num_seqs: int, num_waiting: int, *, block_size: int, max_model_len: int,
                   num_blocks: int):
    """A scheduler with ``num_seqs`` W1-like sequences already prefilled and decoding."""
    from atom.core.block_manager import BlockManager
    from atom.sampling_params import SamplingParams
    from atom.core.scheduler import Scheduler, SchedulerConfig
    from atom.core.sequence import Sequence

    rng = random.Random(0)
    config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs),
                             max_model_len=max_model_len)
    scheduler = Scheduler(config, BlockManager(num_blocks, block_size), eos_token_ids=(2,))
    params = SamplingParams(temperature=0.0, max_tokens=max_model_len, ignore_eos=True)
    for i in range(num_seqs + num_waiting):
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(112, 144))]
        scheduler.add(Sequence(f"r{i}", prompt, params))
    # Prefill until every admitted sequence decodes (fake tokens, no model).
    while any(seq.is_prefill for seq in scheduler.running) or not scheduler.running:
        out = scheduler.schedule()
        scheduler.update_from_output(out, _tokens({s.seq_id: _FAKE_TOKEN for s in out.sampled_seqs()}))
    return scheduler


def time_overhead(scheduler, runner, num_steps: int) -> dict[str, list[float]]:
    """Per-step seconds of schedule / update_from_output / host batch prep over ``num_steps`` decode steps."""
    times: dict[str, list[float]] = {"schedule": [], "update": [], "prepare": []}
    for _ in range(num_steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        runner._prepare([(seq, 0, n) for seq, n in out.scheduled], 0)
        t2 = time.perf_counter()
        scheduler.update_from_output(out, _tokens({s.seq_id: _FAKE_TOKEN for s, _ in out.scheduled}))
        t3 = time.perf_counter()
        times["schedule"].append(t1 - t0)
        times["prepare"].append(t2 - t1)
        times["update"].append(t3 - t2)
    return times


def time_real_step(runner, sampler, scheduler, num_steps: int) -> dict[str, list[float]]:
    """Per-step seconds of real decode steps on the scheduler's running batch: ``step`` (forward
    + sampling), and its parts ``attention`` (every layer's paged attention, KV write included),
    ``forward`` (the whole model, attention included) and ``sampling``."""
    import atom.layers.attention as attention

    attention_s = [0.0]
    paged_attention = attention.paged_attention

    def timed_attention(*args, **kwargs):
        t = time.perf_counter()
        out = paged_attention(*args, **kwargs)
        attention_s[0] += time.perf_counter() - t
        return out

    times: dict[str, list[float]] = {"step": [], "forward": [], "attention": [], "sampling": []}
    attention.paged_attention = timed_attention
    try:
        for _ in range(num_steps + 1):
            out = scheduler.schedule()
            attention_s[0] = 0.0
            t0 = time.perf_counter()
            model_out = runner.execute_model(out.scheduled)
            t1 = time.perf_counter()
            by_id = {seq.seq_id: seq for seq, _ in out.scheduled}
            sampled = sampler(model_out.logits, [by_id[i] for i in model_out.sampled_seq_ids])
            t2 = time.perf_counter()
            for name, value in (("step", t2 - t0), ("forward", t1 - t0),
                                ("attention", attention_s[0]), ("sampling", t2 - t1)):
                times[name].append(value)
            scheduler.update_from_output(out, _tokens(dict(zip(model_out.sampled_seq_ids,
                                                               sampled.token_ids))))
    finally:
        attention.paged_attention = paged_attention
    return {name: values[1:] for name, values in times.items()}  # the first step warms up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=256, help="running sequences (default 256)")
    parser.add_argument("--num-waiting", type=int, default=64,
                        help="requests queued behind the full batch (default 64)")
    parser.add_argument("--steps", type=int, default=200, help="fake decode steps timed (default 200)")
    parser.add_argument("--real-steps", type=int, default=5, help="real decode steps timed (default 5)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--output-json", type=pathlib.Path,
                        default=pathlib.Path("results/bench_scheduler.json"))
    args = parser.parse_args(argv)

    from atom.config import EngineConfig  # before torch: atom sets GOMP_SPINCOUNT
    import torch

    from atom.worker.model_loader import load_model_weights
    from atom.worker.model_runner import ModelRunner
    from atom.worker.sampler import Sampler

    config = EngineConfig(dtype=args.dtype, num_threads=args.num_threads)
    torch.set_num_threads(config.resolved_num_threads())
    dtype = getattr(torch, config.resolved_dtype())
    block_size, max_model_len = 16, 1024
    num_blocks = (args.num_seqs + args.num_waiting) * (144 + args.steps + 64) // block_size + 64
    arch, weights = load_model_weights(None, dtype)
    runner = ModelRunner(arch, weights, dtype=dtype, num_kv_blocks=num_blocks,
                         block_size=block_size, max_model_len=max_model_len)
    scheduler = make_scheduler(args.num_seqs, args.num_waiting, block_size=block_size,
                               max_model_len=max_model_len, num_blocks=num_blocks)
    if scheduler.num_running != args.num_seqs:
        raise SystemExit(f"only {scheduler.num_running} sequences running; raise the pool")
    overhead = time_overhead(scheduler, runner, args.steps)
    real = time_real_step(runner, Sampler((2,)), scheduler, args.real_steps)

    def us_per_seq(values: list[float]) -> float:
        return statistics.median(values) / args.num_seqs * 1e6

    step_ms = statistics.median(real["step"]) * 1e3
    sched_post_us = us_per_seq(overhead["schedule"]) + us_per_seq(overhead["update"])
    report = {
        "num_seqs": args.num_seqs, "num_waiting": args.num_waiting, "dtype": str(dtype),
        "num_threads": torch.get_num_threads(),
        "us_per_seq_step": {k: us_per_seq(v) for k, v in overhead.items()},
        "scheduler_plus_postprocess_us_per_seq_step": sched_post_us,
        "real_decode_step_ms": step_ms,
        "real_decode_step_parts_ms": {k: statistics.median(v) * 1e3 for k, v in real.items()},
        "real_decode_step_us_per_seq": step_ms * 1e3 / args.num_seqs,
        "scheduler_plus_postprocess_pct_of_step": 100 * sched_post_us * args.num_seqs / 1e3 / step_ms,
        "host_prepare_pct_of_step": 100 * us_per_seq(overhead["prepare"]) * args.num_seqs / 1e3
                                    / step_ms,
    }
    print(f"{args.num_seqs} running decodes (+{args.num_waiting} waiting), {report['dtype']}, "
          f"{report['num_threads']} threads; medians over {args.steps} fake / {args.real_steps} "
          f"real steps")
    print(f"{'part':<34}{'us/seq/step':>12}{'ms/step':>10}")
    for name, values in overhead.items():
        print(f"{name:<34}{us_per_seq(values):>12.2f}{statistics.median(values) * 1e3:>10.2f}")
    print(f"{'schedule + update':<34}{sched_post_us:>12.2f}"
          f"{sched_post_us * args.num_seqs / 1e3:>10.2f}")
    print(f"{'real decode step (forward+sample)':<34}{report['real_decode_step_us_per_seq']:>12.2f}"
          f"{step_ms:>10.2f}")
    parts = report["real_decode_step_parts_ms"]
    print(f"real step: attention {parts['attention']:.1f} ms, rest of the model (linears, norms, "
          f"rotary, logits) {parts['forward'] - parts['attention']:.1f} ms, sampling "
          f"{parts['sampling']:.1f} ms")
    print(f"schedule + update_from_output = {report['scheduler_plus_postprocess_pct_of_step']:.2f} % of "
          f"a real batch-{args.num_seqs} decode step (host batch prep: "
          f"{report['host_prepare_pct_of_step']:.2f} %)")
    write_json_report(args.output_json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
