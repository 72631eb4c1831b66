"""GGUF block kernel vs the float GEMM per linear layer and row count (issue 20): where the
quantized path stops paying.

For each linear layer shape of the embedded SmolLM2-135M model (fused qkv, o_proj, fused
gate/up, down_proj: Q4_1 blocks; the tied LM head: Q8_0), and each row count (tokens of a step;
sampled rows for the LM head), times one pass over that layer in all 30 decoder layers, one
after the other as a forward runs them (so the weights come from memory, not from a cache that
one hot matrix would fit in), reported per layer:

- ``quantized``: :func:`atom.kernels.gguf.gguf_linear` on the file's own blocks (the row
  kernel on the planes);
- ``tiled``, on a CPU where the tiled kernel has its AVX-512 VNNI path (there the quantized mode
  runs it for every forward): :func:`atom.kernels.gguf.gguf_linear` on the same blocks
  repacked (:class:`atom.kernels.gguf.TiledWeight`);
- ``float``: oneDNN's packed float32 GEMM (:func:`atom.kernels.linear.packed_linear`), what the
  float32 mode runs.

and the whole model's linear time per step (30 layers x 4 matrices + the LM head at one row)
for both. Prints a table with the ratio float / quantized per row count (> 1: the quantized
kernel is faster) and the largest row count at which the quantized kernel wins for every
layer: the value to give :data:`atom.layers.linear.QUANTIZED_MAX_ROWS`. Baselines of the
quantized kernel itself, each ``gguf_linear.cpp`` built again with a compiler flag (about 20 s
each), timed on the same inputs, printed as baseline ms / ms per layer and per step:

- without software prefetch (``-DATOM_PREFETCH_ROWS=0``; JSON ``quantized_no_prefetch_ms``);
- on a CPU with AVX-512 VNNI (where the kernels take their 512-bit path), without AVX-512
  (``-mno-avx512f``: the AVX2 path; JSON ``quantized_avx2_ms``).

    .venv/bin/python scripts/bench_gguf_linear.py [--num-threads 2] [--rows 1 2 4 8 16 32 64]

Writes ``results/bench_gguf_linear.json``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

from bench_common import cpu_description, cpu_flags, write_json_report

ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 64)
LAYERS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "down_proj": ("mlp.down_proj",)}


# AVX-512 subsets the kernels' 512-bit path needs (kernels/csrc/vec.h: ATOM_AVX512_VNNI)
AVX512_VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
_BASELINE_BINDINGS = """
#include <torch/library.h>
#include "ops.h"
TORCH_LIBRARY(atom_kernels_NAME, m) {
  m.def("gguf_linear(Tensor x, Tensor qs, Tensor d, Tensor m, int ggml_type) -> Tensor");
}
TORCH_LIBRARY_IMPL(atom_kernels_NAME, CPU, m) { m.impl("gguf_linear", &atom_kernels::gguf_linear); }
"""


def _baseline_gguf_linear(name: str, flags: list[str]):
    """``gguf_linear.cpp`` built as the kernels are plus ``flags`` (``-mno-avx512f``: the AVX2
    path; ``-DATOM_PREFETCH_ROWS=0``: no software prefetch): its op, registered as
    ``torch.ops.atom_kernels_<name>.gguf_linear`` (its namespace renamed by a macro, so the
    builds' symbols never meet). About 20 s."""
    import tempfile

    import torch
    from torch.utils import cpp_extension

    from atom.kernels import build

    namespace = f"atom_kernels_{name}"
    folder = pathlib.Path(tempfile.mkdtemp(prefix=f"atom-gguf-{name}-"))
    (folder / "bindings.cpp").write_text(_BASELINE_BINDINGS.replace("atom_kernels_NAME", namespace))
    cpp_extension.load(name=f"atom_gguf_linear_{name}",
                       sources=[str(build.CSRC / "gguf_linear.cpp"), str(folder / "bindings.cpp")],
                       extra_cflags=[*build.CFLAGS, *flags, f"-Datom_kernels={namespace}"],
                       extra_ldflags=list(build.LDFLAGS), extra_include_paths=[str(build.CSRC)],
                       build_directory=str(folder), is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace).gguf_linear


def _best_ms(fn, x, *, min_time_s: float = 0.2) -> float:
    fn(x)
    best, spent = float("inf"), 0.0
    while spent < min_time_s:
        start = time.perf_counter()
        fn(x)
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--output-json", type=pathlib.Path,
                        default=pathlib.Path("results/bench_gguf_linear.json"))
    args = parser.parse_args(argv)

    import torch

    from atom.kernels import cpu_ops
    from atom.kernels.gguf import (QuantizedWeight, TiledWeight, gguf_linear,
                                   tiled_kernel_is_simd)
    from atom.kernels.linear import pack_weight, packed_linear
    from atom.worker.model_loader import load_gguf_blocks, load_model_weights

    torch.set_num_threads(args.num_threads)
    if cpu_ops.load() is None:
        raise SystemExit(f"the C++ kernels are not built: {cpu_ops.unavailable_reason()}")
    # builds of the kernel to time against, (name, what it lacks, extra compiler flags)
    baselines = [("no_prefetch", "software prefetch", ["-DATOM_PREFETCH_ROWS=0"])]
    if cpu_flags().issuperset(AVX512_VNNI_FLAGS):
        baselines.append(("avx2", "AVX-512 (its AVX2 path)", ["-mno-avx512f"]))
    baseline_ops = {}
    for name, lacks, flags in baselines:
        print(f"building gguf_linear.cpp without {lacks} ...", flush=True)
        baseline_ops[name] = _baseline_gguf_linear(name, flags)
    tiled = tiled_kernel_is_simd()
    arch, weights = load_model_weights(None, torch.float32)
    blocks = load_gguf_blocks(None)
    shapes = {}
    for name, parts in LAYERS.items():
        shapes[name] = [
            (QuantizedWeight.cat([blocks[f"model.layers.{i}.{p}.weight"] for p in parts]),
             torch.cat([weights[f"model.layers.{i}.{p}.weight"] for p in parts]))
            for i in range(arch.num_hidden_layers)]
    shapes["lm_head"] = [(blocks["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])]
    results: dict[str, dict[int, dict[str, float]]] = {}
    with torch.inference_mode():
        for name, layers in shapes.items():
            quantized = [qw for qw, _ in layers]
            tiles = [TiledWeight.from_quantized(qw) for qw in quantized] if tiled else []
            packed = [pack_weight(fw) for _, fw in layers]
            results[name] = {}
            for rows in args.rows:
                x = torch.randn(rows, quantized[0].in_features)
                q_ms = _best_ms(lambda t: [gguf_linear(t, qw) for qw in quantized], x)
                f_ms = _best_ms(lambda t: [packed_linear(t, pw) for pw in packed], x)
                results[name][rows] = {"quantized_ms": q_ms / len(layers),
                                       "float_ms": f_ms / len(layers)}
                if tiled:
                    t_ms = _best_ms(lambda t: [gguf_linear(t, tw) for tw in tiles], x)
                    results[name][rows]["tiled_ms"] = t_ms / len(layers)
                for base, op in baseline_ops.items():
                    b_ms = _best_ms(lambda t: [op(t, qw.qs, qw.d, qw.m, qw.ggml_type)
                                               for qw in quantized], x)
                    results[name][rows][f"quantized_{base}_ms"] = b_ms / len(layers)
    shapes = {name: layers[0] for name, layers in shapes.items()}
    print(f"{cpu_description()}; {args.num_threads} threads; best of >= 0.2 s per cell; ms per layer")
    print(f"{'layer':<14}{'[out, in]':>14}" + "".join(f"{r:>9}" for r in args.rows)
          + "   (float ms / quantized ms per row count)")
    for name, (qw, _) in shapes.items():
        ratios = [results[name][r]["float_ms"] / results[name][r]["quantized_ms"] for r in args.rows]
        print(f"{name:<14}{f'[{qw.out_features}, {qw.in_features}]':>14}"
              + "".join(f"{v:>8.2f}x" for v in ratios))
    def step_ms(rows: int, key: str) -> float:  # a decode step of `rows` sequences, LM head too
        return (sum(results[n][rows][key] for n in LAYERS) * arch.num_hidden_layers
                + results["lm_head"][rows][key])

    per_step = {r: {"quantized_ms": step_ms(r, "quantized_ms"), "float_ms": step_ms(r, "float_ms")}
                for r in args.rows}
    print(f"{'step linears':<14}{'(ms)':>14}" + "".join(
        f"{per_step[r]['quantized_ms']:.1f}/{per_step[r]['float_ms']:.0f}".rjust(10)
        for r in args.rows) + "   (quantized / float)")
    if tiled:
        print("the tiled kernel (float ms / tiled ms):")
        for name, (qw, _) in shapes.items():
            ratios = [results[name][r]["float_ms"] / results[name][r]["tiled_ms"] for r in args.rows]
            print(f"{name:<14}{f'[{qw.out_features}, {qw.in_features}]':>14}"
                  + "".join(f"{v:>8.2f}x" for v in ratios))
        for rows in args.rows:
            per_step[rows]["tiled_ms"] = step_ms(rows, "tiled_ms")
        print(f"{'step linears':<14}{'(ms)':>14}" + "".join(
            f"{per_step[r]['tiled_ms']:.1f}/{per_step[r]['float_ms']:.0f}".rjust(10)
            for r in args.rows) + "   (tiled / float)")
    for base, lacks, _ in baselines:
        key = f"quantized_{base}_ms"
        print(f"the quantized kernel against its build without {lacks} ({base} ms / ms):")
        for name, (qw, _) in shapes.items():
            ratios = [results[name][r][key] / results[name][r]["quantized_ms"] for r in args.rows]
            print(f"{name:<14}{f'[{qw.out_features}, {qw.in_features}]':>14}"
                  + "".join(f"{v:>8.2f}x" for v in ratios))
        for rows in args.rows:
            per_step[rows][key] = step_ms(rows, key)
        print(f"{'step linears':<14}{'(ms)':>14}" + "".join(
            f"{per_step[r]['quantized_ms']:.1f}/{per_step[r][key]:.1f}".rjust(10)
            for r in args.rows) + f"   (ms / {base} ms)")
    wins = [r for r in args.rows if all(results[n][r]["quantized_ms"] < results[n][r]["float_ms"]
                                        for n in results)]
    largest = max((r for r in args.rows if all(w in wins for w in args.rows if w <= r)), default=0)
    print(f"row kernel faster than the float GEMM for every layer up to {largest} rows")
    write_json_report(args.output_json, {
        "cpu": cpu_description(), "num_threads": args.num_threads, "results": results,
        "per_step": per_step, "quantized_wins_up_to_rows": largest})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
