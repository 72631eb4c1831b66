"""Offline throughput benchmark: ``atom bench offline`` (and ``scripts/bench_offline.py``).

Workload: prompts from a JSON file (W1 format: a list of ``{"text", "ids"}``; the ``ids`` are
used so every engine sees identical tokens), by default W1 itself (shipped in the package,
:data:`W1_DATASET`: 64 chat prompts of 112-144 tokens), or random token prompts
(``--random-input-len``, optionally varied by ``--random-range-ratio``). Every request
generates exactly ``--max-tokens`` tokens (greedy, ``ignore_eos``). All requests go to one
``LLM.generate`` call; a warm-up run on other (random) prompts comes first and is not measured.

Reports output and total (prompt + output) tokens/s and TTFT / TPOT percentiles (p50/p90/p99,
from ``RequestOutput.metrics``). ``--compare-hf`` runs the same prompts, in the same process and
run, through Hugging Face transformers ``generate`` on the same weights and dtype (batched with
left padding and an explicit attention mask, ``--hf-batch-size`` prompts per batch, EOS
suppressed so every prompt gets the same number of new tokens) and prints the ratio.

W1 (the reference workload): ``atom bench offline --max-tokens 128 --compare-hf`` (with
``--dtype auto``: bfloat16 on a CPU with native bf16 matmuls, float32 elsewhere).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import time
from dataclasses import asdict, dataclass, fields

import numpy as np

from atom.config import EngineConfig, add_engine_args


#: W1, the standard workload (64 chat-formatted prompts for the embedded model, 112-144 tokens).
W1_DATASET = pathlib.Path(__file__).resolve().parents[1] / "data" / "w1_prompts.json"
_PERCENTILES = (50, 90, 99)
_NUM_WARMUP_PROMPTS = 4
_NUM_WARMUP_TOKENS = 8


@dataclass
class RunResult:
    """One system's measurements on the workload."""

    system: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float
    ttft_ms: dict[str, float] | None = None  # "p50" -> ms
    tpot_ms: dict[str, float] | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s

    def to_json(self) -> dict:
        return {**asdict(self), "output_tokens_per_s": self.output_tokens_per_s,
                "total_tokens_per_s": self.total_tokens_per_s}


def add_offline_args(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags plus every engine option (generated from EngineConfig)."""
    parser.add_argument("--dataset", type=pathlib.Path,
                        help="JSON list of {'text', 'ids'} prompts (default: W1, shipped with "
                             "atom, unless --random-input-len is given)")
    parser.add_argument("--random-input-len", type=int,
                        help="use random token prompts of this length instead of --dataset")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="random prompt lengths uniform in [len*(1-r), len*(1+r)] (default 0)")
    parser.add_argument("--random-output-len", type=int,
                        help="output tokens per random prompt (default: --max-tokens)")
    parser.add_argument("--num-prompts", type=int,
                        help="prompts to run (default: all of --dataset, 64 random)")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="output tokens per request, EOS ignored (W1: 128)")
    parser.add_argument("--compare-hf", action="store_true",
                        help="also run transformers generate on the same workload and print the ratio")
    parser.add_argument("--hf-batch-size", type=int, default=32,
                        help="prompts per transformers generate call (default 32)")
    parser.add_argument("--output-json", type=pathlib.Path, default=pathlib.Path("results/bench_offline.json"),
                        help="where to write the results (default results/bench_offline.json)")
    parser.add_argument("--progress", action="store_true", help="show the progress bar")
    add_engine_args(parser)


def load_prompts(args: argparse.Namespace, vocab_size: int, special_ids: list[int]) -> tuple[list[list[int]], int]:
    """(prompt token ids, output tokens per request) of the workload.

    Raises:
        ValueError: both --dataset and --random-input-len, or a bad dataset.
    """
    check_workload_args(args)
    if args.random_input_len is None:
        items = json.loads(args.dataset.read_text())
        if not isinstance(items, list) or not all(isinstance(x, dict) and "ids" in x for x in items):
            raise ValueError(f"{args.dataset}: expected a JSON list of {{'text', 'ids'}} objects")
        prompts = [list(x["ids"]) for x in items[: args.num_prompts]]
        return prompts, args.max_tokens
    return (random_prompts(args.num_prompts or 64, args.random_input_len, args.random_range_ratio,
                           vocab_size=vocab_size, special_ids=special_ids, seed=args.seed),
            args.random_output_len or args.max_tokens)


def check_workload_args(args: argparse.Namespace) -> None:
    """Check the workload flags before the (slow) engine start; with neither ``--dataset`` nor
    ``--random-input-len``, ``args.dataset`` becomes W1.

    Raises:
        ValueError: both given, or a dataset file that does not exist.
    """
    if args.dataset is not None and args.random_input_len is not None:
        raise ValueError("pass one of --dataset FILE or --random-input-len N, not both")
    if args.random_input_len is None:
        args.dataset = args.dataset or W1_DATASET
        if not args.dataset.is_file():
            raise ValueError(f"--dataset {args.dataset}: no such file (leave --dataset out to "
                             f"use W1, which ships with atom)")


def random_prompts(num_prompts: int, input_len: int, range_ratio: float, *, vocab_size: int,
                   special_ids: list[int], seed: int) -> list[list[int]]:
    """Random token prompts (special tokens excluded), lengths uniform around ``input_len``."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.array(special_ids, dtype=np.int64))
    low = max(1, int(input_len * (1 - range_ratio)))
    high = max(low, int(input_len * (1 + range_ratio)))
    lengths = rng.integers(low, high + 1, size=num_prompts)
    return [rng.choice(allowed, size=int(n)).tolist() for n in lengths]


def _percentiles_ms(values_s: list[float]) -> dict[str, float] | None:
    if not values_s:
        return None
    points = np.percentile(np.array(values_s) * 1000.0, _PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(_PERCENTILES, points)}


def run_atom(llm, prompts: list[list[int]], max_tokens: int, *, progress: bool) -> RunResult:
    """Warm up on random prompts, then time one ``generate`` call over the whole workload."""
    from atom import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokenizer = llm.get_tokenizer()
    warmup = random_prompts(_NUM_WARMUP_PROMPTS, int(np.mean([len(p) for p in prompts])), 0.0,
                            vocab_size=len(tokenizer), special_ids=tokenizer.all_special_ids, seed=12345)
    llm.generate([{"prompt_token_ids": p} for p in warmup],
                 SamplingParams(temperature=0.0, max_tokens=_NUM_WARMUP_TOKENS, ignore_eos=True))
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress)
    elapsed_s = time.perf_counter() - start
    errors = [o.outputs[0].error for o in outputs if o.outputs[0].finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g.: {errors[0]}")
    metrics = [o.metrics for o in outputs]
    return RunResult(
        system="atom", num_requests=len(outputs),
        num_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        num_output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs), elapsed_s=elapsed_s,
        ttft_ms=_percentiles_ms([m.ttft_s for m in metrics if m.ttft_s is not None]),
        tpot_ms=_percentiles_ms([m.tpot_s for m in metrics if m.tpot_s is not None]))


def load_hf_model(model: str | None, dtype_name: str):
    """The same weights as the engine, loaded by transformers (a GGUF is dequantized by it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from atom.worker.model_files import resolve_model_path

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    path = resolve_model_path(model)
    if path.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return hf.eval()


def hf_generate(model, prompts: list[list[int]], max_tokens: int, *, batch_size: int) -> int:
    """Greedy ``generate`` over ``prompts`` in batches (left padding, explicit attention mask).

    ``min_new_tokens = max_new_tokens`` suppresses EOS, so every prompt gets ``max_tokens``
    new tokens (as with ignore_eos). Returns the number of new tokens generated.
    """
    import torch

    num_new = 0
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i: i + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        num_new += (out.shape[1] - width) * len(batch)
    return num_new


def run_hf(args: argparse.Namespace, config: EngineConfig, prompts: list[list[int]],
           max_tokens: int) -> RunResult:
    model = load_hf_model(config.model, config.resolved_dtype())
    hf_generate(model, prompts[: min(len(prompts), args.hf_batch_size)], _NUM_WARMUP_TOKENS,
                batch_size=args.hf_batch_size)  # warm-up
    start = time.perf_counter()
    num_output_tokens = hf_generate(model, prompts, max_tokens, batch_size=args.hf_batch_size)
    elapsed_s = time.perf_counter() - start
    return RunResult(system="transformers", num_requests=len(prompts),
                     num_prompt_tokens=sum(len(p) for p in prompts),
                     num_output_tokens=num_output_tokens, elapsed_s=elapsed_s)


def format_table(results: list[RunResult]) -> str:
    """A plain-text table, one column per system, plus the ratio when there are two."""
    def pct(d: dict[str, float] | None) -> str:
        return "-" if d is None else " / ".join(f"{d[f'p{p}']:.1f}" for p in _PERCENTILES)

    rows = [("requests", [str(r.num_requests) for r in results]),
            ("prompt tokens", [str(r.num_prompt_tokens) for r in results]),
            ("output tokens", [str(r.num_output_tokens) for r in results]),
            ("elapsed (s)", [f"{r.elapsed_s:.2f}" for r in results]),
            ("output tokens/s", [f"{r.output_tokens_per_s:.1f}" for r in results]),
            ("total tokens/s", [f"{r.total_tokens_per_s:.1f}" for r in results]),
            ("TTFT p50/p90/p99 (ms)", [pct(r.ttft_ms) for r in results]),
            ("TPOT p50/p90/p99 (ms)", [pct(r.tpot_ms) for r in results])]
    widths = [max(len(r.system), *(len(v[i]) for _, v in rows)) for i, r in enumerate(results)]
    lines = ["  ".join([f"{'metric':<22}"] + [f"{r.system:>{w}}" for r, w in zip(results, widths)])]
    lines += ["  ".join([f"{name:<22}"] + [f"{v:>{w}}" for v, w in zip(values, widths)])
              for name, values in rows]
    if len(results) == 2:
        lines.append(f"ratio {results[0].system}/{results[1].system}, output tokens/s: "
                     f"{results[0].output_tokens_per_s / results[1].output_tokens_per_s:.2f}x")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; prints the table, writes the JSON."""
    from atom import LLM

    check_workload_args(args)  # before the (slow) engine start
    config = EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
    llm = LLM(**asdict(config))
    tokenizer = llm.get_tokenizer()
    prompts, max_tokens = load_prompts(args, len(tokenizer), tokenizer.all_special_ids)
    results = [run_atom(llm, prompts, max_tokens, progress=args.progress)]
    llm.shutdown()
    if args.compare_hf:
        results.append(run_hf(args, config, prompts, max_tokens))
    print(f"workload: {len(prompts)} prompts x {max_tokens} output tokens, greedy, ignore_eos, "
          f"{config.resolved_dtype()}, {config.resolved_num_threads()} threads")
    print(format_table(results))
    report = {"workload": {"dataset": None if args.random_input_len else str(args.dataset),
                           "num_prompts": len(prompts), "max_tokens": max_tokens,
                           "random_input_len": args.random_input_len},
              "engine_config": asdict(config), "dtype": config.resolved_dtype(), "results": [r.to_json() for r in results]}
    if len(results) == 2:
        report["ratio_output_tokens_per_s"] = results[0].output_tokens_per_s / results[1].output_tokens_per_s
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output_json}")
    return 0


def script_main(argv: list[str] | None, *, description: str, add_args, run_args) -> int:
    """A benchmark script's ``main``: parse ``argv`` with ``add_args``, run ``run_args(args)``;
    a ``ValueError`` (bad flag values) exits like an argparse error."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return 2


def main(argv: list[str] | None = None) -> int:
    return script_main(argv, description=__doc__.split("\n\n")[0], add_args=add_offline_args,
                       run_args=run)
