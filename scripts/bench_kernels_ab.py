"""This tree's CPU kernel paths against a git ref's (default ``main``), timed alternately in one
process (issue 37): per op on the embedded model's shapes (and the routed experts on bench_moe.py's two MoE shapes),
then W1 and a single-request decode
through one in-process engine with the paths switched between runs.

The machine is shared, so neither side is timed in a block of its own: every repetition times
the base and then the new path back to back (the W1 runs in the order base, new, new, base, ...),
and the report gives medians and the median of the per-repetition ratios (> 1: this tree is
faster). Engine runs are also counted per second of this process's CPU time, which other
tenants disturb less than wall time (``--num-threads 1`` removes the waits of one thread for
another that a crowded machine adds too).

The base is ``kernels/csrc`` at ``--base`` compiled again as it was (``-march=native``, the
build's flags), with its op library renamed ``atom_kernels_base`` so both load into one process
(cached under ``~/.cache/atom/kernels_base/<tree>``, by the hash of its ``kernels/csrc``), driven the way the base's Python
wrappers drove it; what it lacked is probed when it loads. For a base older than issue 37 that
means, per run dtype:

- float32: the base's kernels for everything, its decode attention on a contiguous copy of q;
- bfloat16: the torch references for RMSNorm, rotary and SiLU-and-mul (its fused kernels took
  float32 only), its decode kernel with float32 output converted back to bf16 (``.to``);
- both: prefill attention as one SDPA per sequence
  (:func:`atom.kernels.attention.paged_prefill_attention_reference`).

A newer base runs its own kernels for all of these. The MoE rows compare the base's
``fused_moe`` on stacked rows with what this tree's :class:`atom.layers.moe.MoE` runs fused.

    .venv/bin/python scripts/bench_kernels_ab.py [--dtype auto] [--base main] [--reps 30] \\
        [--w1-pairs 3] [--num-prompts 64] [--max-tokens 128] [--num-threads N]

Prints one table per part and writes ``results/bench_kernels_ab_<dtype>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import random
import statistics
import subprocess
import tempfile
import time

from bench_common import DEFAULT_DATASET, cpu_description, write_json_report

REPO = pathlib.Path(__file__).resolve().parents[1]
BASE_NAMESPACE = "atom_kernels_base"
# The embedded SmolLM2-135M's shapes.
HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64
BLOCK_SIZE = 16


def build_base(ref: str):
    """The kernels of ``ref`` as ``torch.ops.atom_kernels_base`` (built once per commit)."""
    import torch
    from torch.utils import cpp_extension

    from atom.kernels import build

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", ref], check=True,
                            capture_output=True, text=True).stdout.strip()
    tree = subprocess.run(["git", "-C", str(REPO), "rev-parse", f"{commit}:kernels/csrc"],
                          check=True, capture_output=True, text=True).stdout.strip()
    folder = pathlib.Path.home() / ".cache" / "atom" / "kernels_base" / tree[:16]
    library = folder / f"{BASE_NAMESPACE}.so"
    if not library.exists():
        names = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{commit}:kernels/csrc"],
                               check=True, capture_output=True, text=True).stdout.split()
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="atom-kernels-base-"))
        for name in names:
            text = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:kernels/csrc/{name}"],
                                  check=True, capture_output=True, text=True).stdout
            if name == "bindings.cpp":  # TORCH_LIBRARY stringifies its argument: rename it here
                text = text.replace("TORCH_LIBRARY(atom_kernels,", f"TORCH_LIBRARY({BASE_NAMESPACE},")
                text = text.replace("TORCH_LIBRARY_IMPL(atom_kernels,",
                                    f"TORCH_LIBRARY_IMPL({BASE_NAMESPACE},")
            (tmp / name).write_text(text)
        print(f"building the kernels of {ref} ({commit[:10]}) as {BASE_NAMESPACE} ...", flush=True)
        cpp_extension.load(name=BASE_NAMESPACE, sources=[str(tmp / n) for n in names if n.endswith(".cpp")],
                           extra_cflags=[*build.CFLAGS, f"-Datom_kernels={BASE_NAMESPACE}"],
                           extra_ldflags=list(build.LDFLAGS), build_directory=str(tmp),
                           is_python_module=False, verbose=False)
        folder.mkdir(parents=True, exist_ok=True)
        (tmp / f"{BASE_NAMESPACE}.so").replace(library)
    torch.ops.load_library(str(library))
    return commit


class BaseOps:
    """The base's ops as this tree's callers see them (``cpu_ops.load()`` returns this object
    inside :func:`base_paths`): each runs what the base ran for the same call, the base's kernel
    or, where the base had none for the dtype (probed: before issue 37 the fused ops took float32
    only), the torch reference. Ops not named here are the base's own."""

    def __init__(self) -> None:
        import torch

        self._ns = getattr(torch.ops, BASE_NAMESPACE)
        self._ops = {name: getattr(self._ns, name).default for name in (
            "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding_",
            "logsumexp_argmax", "paged_decode_attention")}
        self.logsumexp_argmax = self._ops["logsumexp_argmax"]
        try:
            self._ops["rms_norm"](torch.ones(1, 32, dtype=torch.bfloat16),
                                  torch.ones(32, dtype=torch.bfloat16), 1e-5)
            self._fused_bf16 = True
        except RuntimeError:
            self._fused_bf16 = False
        #: whether the base had the paged prefill attention kernel (else one SDPA per sequence)
        self.has_prefill_kernel = hasattr(self._ns, "paged_prefill_attention_")

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._ns, name).default

    def _has_fused(self, x) -> bool:
        import torch

        return x.dtype == torch.float32 or self._fused_bf16

    def _current(self, name: str, *args):
        """The base's op ``name`` as this tree calls it (a base with the bf16 kernels has
        today's signatures)."""
        return getattr(self._ns, name).default(*args)

    def paged_decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale,
                               sinks=None, sliding_window=None, *new_kv):
        """The base's kernel; before issue 37 it had no sinks, window or K/V write (a family
        without them never passes them; the write is done first) and returned float32."""
        if self._fused_bf16:
            return self._current("paged_decode_attention", q, k_cache, v_cache, block_tables,
                                  context_lens, scale, sinks, sliding_window, *new_kv)
        assert sinks is None and sliding_window is None, "the base kernel has no sinks/window"
        if new_kv and new_kv[0] is not None:
            from atom.kernels.attention import write_kv

            write_kv(k_cache, v_cache, *new_kv)
        return self._ops["paged_decode_attention"](q, k_cache, v_cache, block_tables,
                                                   context_lens, scale).to(q.dtype)

    def rms_norm(self, x, weight, eps):
        from atom.kernels import fused

        if self._has_fused(x):
            return self._ops["rms_norm"](x, weight, eps)
        return fused.rms_norm_reference(x, weight, eps)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        from atom.kernels import fused

        if self._has_fused(x):
            return self._ops["fused_add_rms_norm"](x, residual, weight, eps)
        return fused.rms_norm_reference(residual.add_(x), weight, eps)

    def silu_and_mul(self, x):
        return self._ops["silu_and_mul"](x) if self._has_fused(x) else _reference_silu_and_mul(x)

    def rotary_embedding_(self, qkv, cos, sin, num_heads, num_kv_heads, q_norm=None, k_norm=None,
                          eps=1e-6):
        if self._fused_bf16:
            return self._current("rotary_embedding_", qkv, cos, sin, num_heads, num_kv_heads,
                                 q_norm, k_norm, eps)
        assert q_norm is None and k_norm is None, "the base kernel has no QK-norm"
        if self._has_fused(qkv):
            return self._ops["rotary_embedding_"](qkv, cos, sin, num_heads, num_kv_heads)
        return _reference_rotary(qkv, cos, sin, num_heads, num_kv_heads)


def base_prefill_attention(q, k, v, k_cache, v_cache, meta, *, scale, out, sinks=None,
                           sliding_window=None) -> None:
    """Prefill attention as the base ran it: one SDPA per sequence (the reference; a base
    without sinks or a window never passes them)."""
    from atom.kernels import attention

    attention.paged_prefill_attention_reference(q, k, v, k_cache, v_cache, meta, scale=scale,
                                                seq_range=range(meta.num_decodes, meta.num_seqs),
                                                out=out, sinks=sinks,
                                                sliding_window=sliding_window)


@contextlib.contextmanager
def base_paths(base_ops: BaseOps):
    """Inside: the engine's kernel calls go the base's way (see :class:`BaseOps`)."""
    from atom.kernels import attention, cpu_ops

    saved = cpu_ops.load, attention.prefill_attention
    cpu_ops.load = lambda: base_ops
    if not base_ops.has_prefill_kernel:
        attention.prefill_attention = base_prefill_attention
    try:
        yield
    finally:
        cpu_ops.load, attention.prefill_attention = saved


def alternate(base_fn, new_fn, reps: int) -> dict:
    """Median ms of each side over ``reps`` back-to-back pairs, and the median base/new ratio."""
    base_fn(), new_fn()  # warm-up
    base_ms, new_ms = [], []
    for _ in range(reps):
        for fn, times in ((base_fn, base_ms), (new_fn, new_ms)):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return {"base_ms": statistics.median(base_ms), "new_ms": statistics.median(new_ms),
            "ratio": statistics.median(b / n for b, n in zip(base_ms, new_ms))}


def op_cases(dtype, base_ops: BaseOps, gen):
    """(name, base callable, new callable) per op and shape."""
    import torch

    from atom.kernels import attention, cpu_ops

    new = cpu_ops.load()
    cases = []
    for rows in (64, 2048):
        x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
        res = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
        w = torch.randn(HIDDEN, generator=gen).to(dtype)
        gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=gen).to(dtype)
        qkv = torch.randn(rows, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
        cos = torch.randn(rows, HEAD_DIM, generator=gen).to(dtype)
        sin = torch.randn(rows, HEAD_DIM, generator=gen).to(dtype)
        for name, args in (("rms_norm", (x, w, 1e-5)), ("fused_add_rms_norm", (x, res, w, 1e-5)),
                           ("silu_and_mul", (gate_up,)),
                           ("rotary_embedding_", (qkv, cos, sin, NUM_HEADS, NUM_KV_HEADS))):
            cases.append((f"{name} [{rows}, {args[0].shape[1]}]",
                          lambda f=getattr(base_ops, name), a=args: f(*a),
                          lambda f=getattr(new, name), a=args: f(*a)))
    for num_seqs, lens in ((64, None), (1, [200])):
        if lens is None:  # W1's decode steps: 112-144 prompt tokens plus up to 128 outputs
            rng = random.Random(0)
            lens = [rng.randint(129, 272) for _ in range(num_seqs)]
        q, k_cache, v_cache, tables, context_lens = _decode_case(dtype, lens, gen)
        scale = HEAD_DIM ** -0.5
        args = (q, k_cache, v_cache, tables, context_lens)
        cases.append((f"decode attention, {num_seqs} seqs x {max(lens) if num_seqs == 1 else 'W1'} ctx",
                      lambda a=args: base_ops.paged_decode_attention(*a, scale),
                      lambda a=args: attention.decode_attention(*a, scale=scale)))
    q, k, v, k_cache, v_cache, meta = _prefill_case(dtype, num_seqs=16, prompt_len=128, gen=gen)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5

    def base_prefill():
        with base_paths(base_ops):
            attention.prefill_attention(q, k, v, k_cache, v_cache, meta, scale=scale, out=out)

    cases.append(("prefill attention, 16 seqs x 128 new tokens", base_prefill,
                  lambda: attention.prefill_attention(q, k, v, k_cache, v_cache, meta,
                                                      scale=scale, out=out)))
    return cases + moe_cases(dtype, base_ops, gen)


# bench_moe.py's two expert shapes: (hidden, expert width, experts, top-k)
MOE_SHAPES = {"qwen3-moe": (1024, 128, 32, 4), "deepseek-v3": (1024, 256, 16, 4)}
MOE_LAYERS = 8  # one case runs this many layers' weights in turn, so they come from memory


def moe_cases(dtype, base_ops: BaseOps, gen):
    """The routed experts of :data:`MOE_LAYERS` layers, as :class:`atom.layers.moe.MoE` runs them
    fused (base: the base's ``fused_moe`` on stacked rows; new: this tree's choice, the packed
    blocks where :func:`atom.kernels.moe.packed_layout_applies`), at 1-2,048 tokens routed
    softmax-top-k over random logits."""
    import torch

    from atom.kernels import moe

    cases = []
    for family, (hidden, inter, experts, top_k) in MOE_SHAPES.items():
        rows = [((torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype),
                 (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype))
                for _ in range(MOE_LAYERS)]
        if moe.packed_layout_applies(dtype, hidden, inter):
            layers = [moe.pack_experts(w13, w2) for w13, w2 in rows]
            run = moe.fused_moe_packed
        else:
            layers, run = rows, moe.fused_moe
        for tokens in (1, 8, 64, 512, 2048):
            x = torch.randn(tokens, hidden, generator=gen).to(dtype)
            probs = torch.softmax(torch.randn(tokens, experts, generator=gen), dim=-1)
            gates, ids = torch.topk(probs, top_k, dim=-1)
            cases.append((f"MoE experts {family}, {tokens} tok x {MOE_LAYERS} layers",
                          lambda x=x, ids=ids, g=gates: [base_ops.fused_moe(x, w13, w2, ids, g)
                                                         for w13, w2 in rows],
                          lambda x=x, ids=ids, g=gates, run=run, layers=layers:
                          [run(x, a, b, ids, g) for a, b in layers]))
    return cases


def _prefill_case(dtype, *, num_seqs: int, prompt_len: int, gen):
    """A prefill step of fresh prompts: q, k, v views of a fused qkv, caches holding k and v,
    metadata."""
    import torch

    from atom.kernels.attention import AttentionMetadata, write_kv

    num_tokens, blocks_per_seq = num_seqs * prompt_len, -(-prompt_len // BLOCK_SIZE)
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1)
    q = q.view(num_tokens, NUM_HEADS, HEAD_DIM)
    k, v = (x.view(num_tokens, NUM_KV_HEADS, HEAD_DIM) for x in (k, v))
    shape = (num_seqs * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    tables = torch.arange(num_seqs * blocks_per_seq).view(num_seqs, blocks_per_seq)
    slots = torch.cat([tables[i].repeat_interleave(BLOCK_SIZE)[:prompt_len] * BLOCK_SIZE
                       + torch.arange(prompt_len) % BLOCK_SIZE for i in range(num_seqs)])
    write_kv(k_cache, v_cache, k, v, slots)
    meta = AttentionMetadata(slot_mapping=slots,
                             query_start_loc=list(range(0, num_tokens + 1, prompt_len)),
                             context_lens=[prompt_len] * num_seqs, block_tables=tables,
                             num_decodes=0,
                             context_lens_tensor=torch.full((num_seqs,), prompt_len))
    return q, k, v, k_cache, v_cache, meta


def _reference_silu_and_mul(x):
    import torch.nn.functional as F

    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _reference_rotary(qkv, cos, sin, num_heads, num_kv_heads):
    from atom.kernels import fused

    rows, head_dim = qkv.shape[0], cos.shape[-1]
    view = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(rows, num_heads + num_kv_heads,
                                                                head_dim)
    view.copy_(fused.apply_rotary_reference(view, cos, sin))


def _decode_case(dtype, lens: list[int], gen):
    """q as the model's view of a fused qkv [S, H, D], caches with shuffled blocks."""
    import torch

    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = 2048 + sum(blocks_per_seq)  # a KV pool larger than the batch, as in the engine
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    start = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = order[start:start + nb]
        start += nb
    qkv = torch.randn(len(lens), (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q = qkv[:, : NUM_HEADS * HEAD_DIM].view(len(lens), NUM_HEADS, HEAD_DIM)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


def run_requests(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> int:
    """``prompts`` through the in-process ``engine`` to completion; returns the output tokens."""
    from atom import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    num_output = 0
    while engine.has_unfinished_requests():
        num_output += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return num_output


def engine_pairs(engine, base_ops: BaseOps, prompts, max_tokens: int, pairs: int, tag: str) -> dict:
    """``pairs`` x (base run, new run) of ``prompts``, in the order base, new, new, base, ...;
    each run from an empty prefix cache. Per run: output tokens per second of wall time, and per
    second of this process's CPU time (all its threads; the engine runs in this process), which
    other tenants of the cores disturb less: their time slices do not count, only what they do
    to the caches. Per pair: the ratios new / base of both."""
    runs = {side: {"tok_s": [], "tok_cpu_s": []} for side in ("base", "new")}
    for pair in range(pairs):
        for side in (("base", "new") if pair % 2 == 0 else ("new", "base")):
            engine.reset_prefix_cache()
            with base_paths(base_ops) if side == "base" else contextlib.nullcontext():
                start, start_cpu = time.perf_counter(), time.process_time()
                num_output = run_requests(engine, prompts, max_tokens, f"{tag}-{pair}-{side}")
                elapsed_s = time.perf_counter() - start
                cpu_s = time.process_time() - start_cpu
            runs[side]["tok_s"].append(num_output / elapsed_s)
            runs[side]["tok_cpu_s"].append(num_output / cpu_s)
            print(f"  {tag} pair {pair} {side}: {num_output / elapsed_s:.1f} output tok/s, "
                  f"{num_output / cpu_s:.1f} per CPU second", flush=True)
    result = {"base": runs["base"], "new": runs["new"]}
    for metric in ("tok_s", "tok_cpu_s"):
        ratios = [n / b for b, n in zip(runs["base"][metric], runs["new"][metric])]
        result[f"ratios_{metric}"] = ratios
        result[f"median_ratio_{metric}"] = statistics.median(ratios)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--base", default="main", help="git ref whose kernels are the baseline")
    parser.add_argument("--reps", type=int, default=30, help="alternating pairs per op")
    parser.add_argument("--w1-pairs", type=int, default=3, help="alternating W1 run pairs (0: none)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dataset", type=pathlib.Path, default=DEFAULT_DATASET)
    parser.add_argument("--num-threads", type=int,
                        help="torch threads for the ops and the engine (default: the engine's "
                             "default, every core this process may use)")
    parser.add_argument("--output-json", type=pathlib.Path)
    args = parser.parse_args(argv)

    import torch

    from atom.config import EngineConfig
    from atom.engine.llm_engine import LLMEngine
    from atom.kernels import cpu_ops

    config = EngineConfig(dtype=args.dtype, num_threads=args.num_threads)
    dtype_name = config.resolved_dtype()
    dtype = getattr(torch, dtype_name)
    torch.set_num_threads(config.resolved_num_threads())
    if cpu_ops.load() is None:
        raise SystemExit(f"this tree's kernels are not built: {cpu_ops.unavailable_reason()}")
    commit = build_base(args.base)
    base_ops = BaseOps()
    report = {"cpu": cpu_description(), "dtype": dtype_name, "base": args.base,
              "base_commit": commit, "num_threads": torch.get_num_threads(), "ops": {}}
    print(f"{cpu_description()}\n{dtype_name}, {torch.get_num_threads()} threads, base "
          f"{args.base} ({commit[:10]}); medians of {args.reps} alternating pairs")
    print(f"{'op':<48}{'base ms':>10}{'new ms':>10}{'base/new':>10}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, base_fn, new_fn in op_cases(dtype, base_ops, gen):
            result = alternate(base_fn, new_fn, args.reps)
            report["ops"][name] = result
            print(f"{name:<48}{result['base_ms']:>10.3f}{result['new_ms']:>10.3f}"
                  f"{result['ratio']:>9.2f}x", flush=True)
    if args.w1_pairs:
        engine = LLMEngine(config)
        items = json.loads(args.dataset.read_text())
        prompts = [list(x["ids"]) for x in items[: args.num_prompts]]
        run_requests(engine, prompts[:4], 8, "warmup")
        report["w1"] = engine_pairs(engine, base_ops, prompts, args.max_tokens, args.w1_pairs, "w1")
        single = next(list(x["ids"])[:140] for x in items if len(x["ids"]) >= 140)
        report["single"] = engine_pairs(engine, base_ops, [single], 64, args.w1_pairs, "single")
        for part in ("w1", "single"):
            r = report[part]
            for metric, unit in (("tok_s", "output tok/s"), ("tok_cpu_s", "output tok per CPU s")):
                print(f"{part}: {unit} base {statistics.median(r['base'][metric]):.1f}, new "
                      f"{statistics.median(r['new'][metric]):.1f}; new/base per pair "
                      + ", ".join(f"{x:.2f}" for x in r[f"ratios_{metric}"])
                      + f" (median {r[f'median_ratio_{metric}']:.2f})")
    write_json_report(args.output_json or pathlib.Path(f"results/bench_kernels_ab_{dtype_name}.json"),
                      report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
