"""The fused MoE experts kernel and the small-linear kernel against what they replace (issue 35).

Both on the Qwen3-MoE shape of ``bench_moe.py`` (hidden 1024, 32 experts of width 128, top-4),
24 layers' weights, one layer after the other as a forward runs them (so the weights come from
memory, not from a cache one layer's would fit in), reported per layer:

- experts: :meth:`atom.layers.moe.MoE.experts` with every expert's linears packed for oneDNN
  (the path without the kernel, and on CPUs without AVX-512) against the same layer fused
  (:meth:`~atom.layers.moe.MoE.fuse_experts`: one :func:`atom.kernels.moe.fused_moe` call), at
  ``--tokens`` tokens routed by the layer's own router; the bytes of the experts the tokens
  reach over the fused time gives its effective read bandwidth;
- router (``[32, 1024]``): oneDNN's packed GEMM against :func:`atom.kernels.linear.small_linear`
  at ``--router-rows`` rows.

Rounds alternate the two sides; medians. Prints a table (baseline ms, new ms, baseline / new)
and writes ``results/bench_fused_moe_<dtype>.json``.

    .venv/bin/python scripts/bench_fused_moe.py [--dtype bfloat16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import torch

from atom.kernels.linear import pack_weight, packed_linear, small_linear
from atom.kernels.moe import fused_moe_applies
from atom.layers.moe import MoE
from bench_common import cpu_description, write_json_report

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, LAYERS = 1024, 128, 32, 4, 24


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    p.add_argument("--router-rows", type=int, nargs="+", default=[1, 8, 16, 64])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--output-json", type=pathlib.Path, default=None)
    return p.parse_args(argv)


def per_layer_ms(fn, rounds: int) -> list[float]:
    """``fn(layer)`` over every layer, ``rounds`` times: ms per layer of each round."""
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for layer in range(LAYERS):
            fn(layer)
        out.append((time.perf_counter() - start) / LAYERS * 1e3)
    return out


def alternate(base, new, rounds: int) -> tuple[float, float]:
    """Medians of ``rounds`` single rounds of ``base`` and ``new`` in the order base, new, new,
    base, ... (after a warm-up round of each)."""
    times: dict[str, list[float]] = {"base": [], "new": []}
    per_layer_ms(base, 1), per_layer_ms(new, 1)
    for i in range(rounds):
        order = (("base", base), ("new", new)) if i % 2 == 0 else (("new", new), ("base", base))
        for side, fn in order:
            times[side] += per_layer_ms(fn, 1)
    return statistics.median(times["base"]), statistics.median(times["new"])


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    if not fused_moe_applies(dtype):
        raise SystemExit("the fused MoE kernel does not run here (needs the C++ kernels built on "
                         "an AVX-512 CPU, float32 or bfloat16)")
    torch.manual_seed(0)
    unfused, fused = [], []
    for _ in range(LAYERS):
        layer = MoE(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_experts=EXPERTS,
                    top_k=TOP_K, renormalize=True)
        for p in layer.parameters():
            p.data.normal_(0, 0.05)
        layer = layer.to(dtype)
        twin = MoE(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_experts=EXPERTS,
                   top_k=TOP_K, renormalize=True).to(dtype)
        twin.load_state_dict(layer.state_dict())
        for module in layer.modules():
            if hasattr(module, "pack_weight"):
                module.pack_weight()
        assert twin.fuse_experts()
        unfused.append(layer)
        fused.append(twin)
    expert_bytes = 3 * HIDDEN * INTERMEDIATE * torch.finfo(dtype).bits // 8
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN).to(dtype)
        routes = [layer.route(x) for layer in unfused]
        base, new = alternate(lambda i: unfused[i].experts(x, *routes[i]),
                              lambda i: fused[i].experts(x, *routes[i]), args.rounds)
        active = statistics.mean(len(set(ids.flatten().tolist())) for ids, _ in routes)
        rows.append({"case": f"experts, {tokens} tokens", "base_ms": base, "new_ms": new,
                     "active_experts": active,
                     "fused_gb_s": active * expert_bytes / new / 1e6})
    routers = [(torch.randn(EXPERTS, HIDDEN) * 0.05).to(dtype) for _ in range(LAYERS)]
    packed = [pack_weight(w) for w in routers]
    for n in args.router_rows:
        x = torch.randn(n, HIDDEN).to(dtype)
        base, new = alternate(lambda i: packed_linear(x, packed[i]),
                              lambda i: small_linear(x, routers[i]), args.rounds)
        rows.append({"case": f"router [32, 1024], {n} rows", "base_ms": base, "new_ms": new})
    print(f"{cpu_description()}; {args.dtype}, {args.num_threads} threads, {LAYERS} layers' "
          f"weights in turn, medians of {args.rounds} alternating rounds")
    print(f"{'case':34s} {'baseline ms':>12s} {'new ms':>9s} {'ratio':>7s}  note")
    for row in rows:
        note = (f"{row['active_experts']:.0f} experts active, fused reads {row['fused_gb_s']:.1f} GB/s"
                if "fused_gb_s" in row else "")
        print(f"{row['case']:34s} {row['base_ms']:12.3f} {row['new_ms']:9.3f} "
              f"{row['base_ms'] / row['new_ms']:6.2f}x  {note}")
    path = args.output_json or pathlib.Path(f"results/bench_fused_moe_{args.dtype}.json")
    write_json_report(path, {"cpu": cpu_description(), "dtype": args.dtype,
                             "num_threads": args.num_threads, "rounds": args.rounds,
                             "baseline": "per-expert oneDNN-packed linears / oneDNN router",
                             "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
