"""The compiled paged decode and prefill attention kernels against float64 math and the torch
paths (CPU), plain and with gpt-oss's sinks and sliding window."""

from __future__ import annotations

import contextlib

import pytest
import torch

from atom.kernels.attention import (
    AttentionMetadata,
    decode_attention,
    gather_kv,
    paged_decode_attention,
    prefill_attention,
)
from tests.kernels import isa_variants
from tests.utils import assert_sums_close

# Every test takes the `ops` fixture (conftest.py): a kernel that did not build fails them.


def _random_case(*, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, max_len: int, dtype: torch.dtype, seed: int = 0,
                 lens: list[int] | None = None):
    gen = torch.Generator().manual_seed(seed)
    if lens is None:
        lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
        lens[0] = max_len  # one full-length row; others ragged, some shorter than a block
    else:
        lens = torch.tensor(lens)
    max_blocks = -(-max_len // block_size)
    num_blocks = num_seqs * max_blocks + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    # Shuffled, non-contiguous blocks per sequence; padded table columns point at block 0.
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, -1)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables.contiguous(), lens


def _dense_float64(q, k, v, positions, scale, *, sinks=None, sliding_window=None):
    """Softmax attention in float64 of the query rows q ``[L_q, H, D]`` at ``positions`` over
    the keys and values k, v ``[L_k, H_kv, D]`` at positions ``0 .. L_k - 1``: causal, within
    ``sliding_window`` (a row at p sees keys in ``(p - W, p]``), and with ``sinks`` ``[H]`` a
    logit per head in every softmax's denominator (its column dropped after the softmax)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,thd->hqt", q.double(), k) * scale
    keys = torch.arange(k.shape[0])
    visible = keys[None, :] <= positions[:, None]
    if sliding_window is not None:
        visible &= keys[None, :] > positions[:, None] - sliding_window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = scores.softmax(-1)[..., : k.shape[0]]
    return torch.einsum("hqt,thd->qhd", probs, v)


@contextlib.contextmanager
def _num_threads(n: int):
    """torch's intra-op threads (the kernels' at::parallel_for) set to n inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _per_sequence_reference(q, k_cache, v_cache, tables, lens, scale, **options):
    """Decode attention per sequence over its gathered context, in float64 (``options``: sinks
    and sliding_window of :func:`_dense_float64`)."""
    out = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        k, v = gather_kv(k_cache, tables[i], n), gather_kv(v_cache, tables[i], n)
        out.append(_dense_float64(q[i:i + 1], k, v, torch.tensor([n - 1]), scale, **options)[0])
    return torch.stack(out)


# head_dim picks the kernel's path (kernels/csrc/attention_tiles.h): on an AVX512-BF16 CPU 64 is
# bfloat16's VDPBF16PS path (it needs D % 32 == 0), 48 and 24 the AVX2 path (float32 takes it
# for 64 too), 12 the scalar loop; on an AVX2 CPU 64, 48 and 24 are AVX2. What no CPU's own
# build runs beside that, the builds of isa_variants.py run (test_other_cpus_decode_paths...).
HEAD_DIMS = [64, 48, 24, 12]
# The longest context of any case here (the decode and prefill lengths below).
MAX_CONTEXT_LEN = 83


def assert_attention_close(out: torch.Tensor, ref: torch.Tensor, *, head_dim: int) -> None:
    """A kernel's output against float64 math on the same inputs: float32 sums of q . k over
    head_dim and of p . v over the context (tests.utils.sum_tolerance); a bfloat16 output also
    carries its one rounding (rtol 2^-8)."""
    assert_sums_close(out, ref, reduction_len=head_dim + MAX_CONTEXT_LEN)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)])
def test_kernel_matches_float64_reference(ops, dtype, head_dim, num_heads, num_kv_heads):
    q, kc, vc, tables, lens = _random_case(num_seqs=7, num_heads=num_heads,
                                           num_kv_heads=num_kv_heads, head_dim=head_dim,
                                           block_size=16, max_len=70, dtype=dtype)
    scale = head_dim ** -0.5
    out = ops.paged_decode_attention(q, kc, vc, tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    ref = _per_sequence_reference(q, kc, vc, tables, lens, scale)
    assert_attention_close(out, ref, head_dim=head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 32])  # 8: every 16-token tile partial; 32: two tiles
def test_kernel_block_sizes(ops, dtype, block_size):
    q, kc, vc, tables, lens = _random_case(num_seqs=5, num_heads=9, num_kv_heads=3, head_dim=64,
                                           block_size=block_size, max_len=75, dtype=dtype)
    out = ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125)
    ref = _per_sequence_reference(q, kc, vc, tables, lens, 0.125)
    assert_attention_close(out, ref, head_dim=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [1, 3])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_kernel_splits_contexts_when_sequences_are_fewer_than_threads(ops, dtype, num_seqs,
                                                                        head_dim):
    """With 4 threads, 1 and 3 sequences split each context into chunks of whole blocks (one
    chunk may be empty: the 1-token context); the merged softmax matches float64."""
    q, kc, vc, tables, lens = _random_case(num_seqs=num_seqs, num_heads=9, num_kv_heads=3,
                                           head_dim=head_dim, block_size=16, max_len=83,
                                           dtype=dtype, seed=num_seqs)
    if num_seqs == 3:
        lens[1] = 1
    with _num_threads(4):
        out = ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125)
    ref = _per_sequence_reference(q, kc, vc, tables, lens, 0.125)
    assert_attention_close(out, ref, head_dim=head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_q_as_a_strided_view_of_qkv(ops, dtype):
    q, kc, vc, tables, lens = _random_case(num_seqs=6, num_heads=9, num_kv_heads=3, head_dim=64,
                                           block_size=16, max_len=40, dtype=dtype)
    qkv = torch.cat([q.flatten(1), torch.randn(6, 6 * 64).to(dtype)], dim=1)
    view = qkv[:, : 9 * 64].view(6, 9, 64)
    assert not view.is_contiguous()
    assert torch.equal(ops.paged_decode_attention(view, kc, vc, tables, lens, 0.125),
                       ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125))


def test_torch_decode_path_matches_float64_reference():
    """The fallback without the kernels (gather + masked SDPA), float32."""
    q, kc, vc, tables, lens = _random_case(num_seqs=7, num_heads=9, num_kv_heads=3, head_dim=64,
                                           block_size=16, max_len=70, dtype=torch.float32)
    out = paged_decode_attention(q, kc, vc, tables, lens, scale=0.125)
    ref = _per_sequence_reference(q, kc, vc, tables, lens, 0.125)
    assert_attention_close(out, ref, head_dim=64)


def test_decode_attention_uses_kernel_and_keeps_dtype(ops):
    q, kc, vc, tables, lens = _random_case(num_seqs=3, num_heads=9, num_kv_heads=3, head_dim=64,
                                           block_size=16, max_len=33, dtype=torch.bfloat16)
    out = decode_attention(q, kc, vc, tables, lens, scale=0.125)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125))


def test_kernel_rejects_bad_inputs(ops):
    q, kc, vc, tables, lens = _random_case(num_seqs=2, num_heads=9, num_kv_heads=3, head_dim=64,
                                           block_size=16, max_len=20, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="int64"):
        ops.paged_decode_attention(q, kc, vc, tables.int(), lens, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.paged_decode_attention(q.bfloat16(), kc, vc, tables, lens, 0.125)


def _prefill_case(*, lens: list[tuple[int, int]], num_heads: int, num_kv_heads: int,
                  head_dim: int, block_size: int, dtype: torch.dtype, first_row: int):
    """Caches holding each sequence's context (shuffled blocks) and q rows for its new tokens
    (the last query_len positions), after ``first_row`` rows that belong to no sequence."""
    gen = torch.Generator().manual_seed(head_dim + block_size)
    width = max(-(-ctx // block_size) for ctx, _ in lens)
    num_blocks = len(lens) * width + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    starts = [first_row]
    for _, query_len in lens:
        starts.append(starts[-1] + query_len)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype)
    return (q, k_cache, v_cache, tables.contiguous(), torch.tensor([c for c, _ in lens]),
            torch.tensor(starts))


def _prefill_reference(q, k_cache, v_cache, tables, lens, starts, scale, **options):
    """Causal softmax attention per sequence over its gathered context, float64 (``options`` as
    :func:`_per_sequence_reference`); None for rows of no sequence."""
    out = [None] * q.shape[0]
    for i in range(len(lens)):
        ctx, a, b = int(lens[i]), int(starts[i]), int(starts[i + 1])
        k, v = gather_kv(k_cache, tables[i], ctx), gather_kv(v_cache, tables[i], ctx)
        rows = _dense_float64(q[a:b], k, v, torch.arange(ctx - (b - a), ctx), scale, **options)
        for j in range(b - a):
            out[a + j] = rows[j]
    return out


# (context_len, query_len): a fresh prompt over several 16-token tiles with a partial one, a
# chunk over an earlier chunk (not block aligned), one exact block, a one-token chunk, a longer
# chunk over cached context.
PREFILL_LENS = [(37, 37), (50, 20), (16, 16), (5, 1), (70, 33)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", [16, 8])
def test_prefill_kernel_matches_float64_reference(ops, dtype, head_dim, block_size):
    q, kc, vc, tables, lens, starts = _prefill_case(
        lens=PREFILL_LENS, num_heads=9, num_kv_heads=3, head_dim=head_dim,
        block_size=block_size, dtype=dtype, first_row=3)
    out = torch.full_like(q, 7.0)
    ops.paged_prefill_attention_(out, q, kc, vc, tables, lens, starts, head_dim ** -0.5)
    ref = _prefill_reference(q, kc, vc, tables, lens, starts, head_dim ** -0.5)
    assert (out[:3] == 7.0).all()  # rows of no sequence are left alone
    assert_attention_close(out[3:], torch.stack(ref[3:]), head_dim=head_dim)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 1)])
def test_prefill_kernel_group_sizes(ops, num_heads, num_kv_heads):
    q, kc, vc, tables, lens, starts = _prefill_case(
        lens=PREFILL_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
        block_size=16, dtype=torch.bfloat16, first_row=0)
    qkv = torch.cat([q.flatten(1), torch.randn(q.shape[0], 5).to(q.dtype)], 1)  # rows strided
    view = qkv[:, : q[0].numel()]
    out = torch.empty_like(q)
    ops.paged_prefill_attention_(out, view.view_as(q), kc, vc, tables, lens, starts, 0.125)
    ref = _prefill_reference(q, kc, vc, tables, lens, starts, 0.125)
    assert_attention_close(out, torch.stack(ref), head_dim=64)


def test_prefill_kernel_rejects_rows_past_the_context(ops):
    q, kc, vc, tables, lens, starts = _prefill_case(
        lens=[(10, 10)], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
        dtype=torch.float32, first_row=0)
    with pytest.raises(RuntimeError, match="at most the context"):
        ops.paged_prefill_attention_(torch.empty_like(q), q, kc, vc, tables, lens - 1, starts,
                                     0.125)


# gpt-oss's options: sinks (random, large enough to matter) and a window of WINDOW tokens, which
# straddles the 16-token blocks. Decode contexts around it: shorter than the window, one short
# of it, exactly it, one past it, a block past it, several blocks past it (the window starting
# mid-block); a window of 1 (each token sees itself only, plus the sink).
WINDOW = 20
DECODE_LENS_AROUND_WINDOW = [1, 7, 19, 20, 21, 36, 83]
# (context_len, query_len) for prefill: a fresh prompt longer than the window (its later tiles
# start past the first blocks), a chunk whose window starts in the cached earlier chunk, a short
# chunk far past the window, a prompt shorter than the window, a decode-like one-token chunk.
PREFILL_LENS_AROUND_WINDOW = [(45, 45), (50, 20), (83, 3), (12, 12), (21, 1)]


def _sinks(num_heads: int) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(7)) * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("sliding_window", [WINDOW, 1, None])
@pytest.mark.parametrize("threads", [1, 4])  # 4 with 7 sequences: whole contexts; see below
def test_kernel_with_sinks_and_window_matches_float64_reference(ops, dtype, head_dim,
                                                                 sliding_window, threads):
    """Decode with sinks (and a window) against float64 dense attention, contexts straddling the
    window, shuffled block tables; the tolerances of the plain kernel."""
    q, kc, vc, tables, lens = _random_case(num_seqs=7, num_heads=9, num_kv_heads=3,
                                           head_dim=head_dim, block_size=16, max_len=83,
                                           dtype=dtype, lens=DECODE_LENS_AROUND_WINDOW)
    sinks = _sinks(9)
    with _num_threads(threads):
        out = ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125, sinks, sliding_window)
    ref = _per_sequence_reference(q, kc, vc, tables, lens, 0.125, sinks=sinks,
                                  sliding_window=sliding_window)
    assert_attention_close(out, ref, head_dim=head_dim)
    plain = _per_sequence_reference(q, kc, vc, tables, lens, 0.125)
    assert (ref - plain).abs().max() > 1e-2  # the options changed the result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_kernel_split_contexts_with_sinks_and_window(ops, dtype, num_seqs):
    """Fewer sequences than threads: a context split in chunks of whole blocks from its window's
    first block (chunks before the window are empty), merged with the sink."""
    lens = [83, 1, 37][:num_seqs]
    q, kc, vc, tables, lens = _random_case(num_seqs=num_seqs, num_heads=9, num_kv_heads=3,
                                           head_dim=64, block_size=8, max_len=83, dtype=dtype,
                                           lens=lens)
    sinks = _sinks(9)
    with _num_threads(4):
        out = ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125, sinks, WINDOW)
    ref = _per_sequence_reference(q, kc, vc, tables, lens, 0.125, sinks=sinks,
                                  sliding_window=WINDOW)
    assert_attention_close(out, ref, head_dim=64)


@pytest.mark.parametrize("variant", sorted(isa_variants.VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 12])
@pytest.mark.parametrize("sliding_window", [WINDOW, None])
def test_other_cpus_decode_paths_match_float64_reference(isa_variant, variant, dtype, head_dim,
                                                         sliding_window):
    """Decode in the builds of isa_variants.py: without AVX512-BF16 (bfloat16 at D = 64 takes
    the AVX2 tiles and rounds its output by integers) and without any vector path (the whole
    kernel scalar), sinks and window included, 4 threads over 7 sequences."""
    variant_ops = isa_variant(variant)
    q, kc, vc, tables, lens = _random_case(num_seqs=7, num_heads=9, num_kv_heads=3,
                                           head_dim=head_dim, block_size=16, max_len=83,
                                           dtype=dtype, lens=DECODE_LENS_AROUND_WINDOW)
    sinks = _sinks(9) if sliding_window else None
    with _num_threads(4):
        out = variant_ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125, sinks,
                                                 sliding_window)
    ref = _per_sequence_reference(q, kc, vc, tables, lens, 0.125, sinks=sinks,
                                  sliding_window=sliding_window)
    assert out.dtype == dtype
    assert_attention_close(out, ref, head_dim=head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("sliding_window", [WINDOW, 1, None])
def test_prefill_kernel_with_sinks_and_window_matches_float64_reference(
        ops, dtype, head_dim, block_size, sliding_window):
    q, kc, vc, tables, lens, starts = _prefill_case(
        lens=PREFILL_LENS_AROUND_WINDOW, num_heads=9, num_kv_heads=3, head_dim=head_dim,
        block_size=block_size, dtype=dtype, first_row=2)
    sinks = _sinks(9)
    out = torch.full_like(q, 7.0)
    ops.paged_prefill_attention_(out, q, kc, vc, tables, lens, starts, head_dim ** -0.5, sinks,
                                 sliding_window)
    ref = _prefill_reference(q, kc, vc, tables, lens, starts, head_dim ** -0.5, sinks=sinks,
                             sliding_window=sliding_window)
    assert (out[:2] == 7.0).all()
    assert_attention_close(out[2:], torch.stack(ref[2:]), head_dim=head_dim)


def test_attention_entry_points_run_the_kernels_with_sinks_and_window(ops):
    """decode_attention and prefill_attention give the kernels' bits with the gpt-oss options
    (no torch fallback for them)."""
    q, kc, vc, tables, lens = _random_case(num_seqs=3, num_heads=9, num_kv_heads=3, head_dim=64,
                                           block_size=16, max_len=40, dtype=torch.bfloat16)
    sinks = _sinks(9).bfloat16()  # the layer's parameter in the run dtype
    out = decode_attention(q, kc, vc, tables, lens, scale=0.125, sinks=sinks,
                           sliding_window=WINDOW)
    assert torch.equal(out, ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125, sinks,
                                                       WINDOW))
    q, kc, vc, tables, lens, starts = _prefill_case(
        lens=PREFILL_LENS_AROUND_WINDOW, num_heads=9, num_kv_heads=3, head_dim=64,
        block_size=16, dtype=torch.float32, first_row=0)
    meta = AttentionMetadata(slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64),
                             query_start_loc=starts.tolist(), context_lens=lens.tolist(),
                             block_tables=tables, num_decodes=0, context_lens_tensor=lens)
    out, expected = torch.empty_like(q), torch.empty_like(q)
    prefill_attention(q, None, None, kc, vc, meta, scale=0.125, out=out, sinks=sinks,
                      sliding_window=WINDOW)
    ops.paged_prefill_attention_(expected, q, kc, vc, tables, lens, starts, 0.125, sinks, WINDOW)
    assert torch.equal(out, expected)


def test_kernels_reject_bad_options(ops):
    q, kc, vc, tables, lens = _random_case(num_seqs=2, num_heads=9, num_kv_heads=3, head_dim=64,
                                           block_size=16, max_len=20, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"one logit per query head, \[9\]"):
        ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125, torch.zeros(3), None)
    with pytest.raises(RuntimeError, match="sliding_window must be a positive"):
        ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125, None, 0)
    starts = torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match="sliding_window must be a positive"):
        ops.paged_prefill_attention_(torch.empty_like(q), q, kc, vc, tables, lens, starts, 0.125,
                                     None, -3)
