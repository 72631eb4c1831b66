"""Paged attention kernels against dense causal SDPA on random data (float32, CPU); with sinks
and a sliding window (gpt-oss) against dense attention written out in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom.kernels.attention import (
    NO_KV_WRITE_SLOT,
    AttentionMetadata,
    decode_attention,
    paged_attention,
    paged_attention_reference,
    paged_decode_attention,
    write_kv,
)
from tests.utils import assert_sums_close

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 64
SCALE = HEAD_DIM ** -0.5
# Terms per output of attention: q . k over the head dim, then p . v over a context of at most
# 32 tokens here (tests.utils.sum_tolerance).
ATTENTION_SUMS = HEAD_DIM + 32


class _Seq:
    """One sequence's full K/V/Q history; its blocks are taken from a shuffled pool."""

    def __init__(self, length: int, free_blocks: list[int], gen: torch.Generator) -> None:
        self.q = torch.randn(length, NUM_HEADS, HEAD_DIM, generator=gen)
        self.k = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        self.v = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        self.block_table = [free_blocks.pop() for _ in range(-(-length // BLOCK_SIZE))]

    def slots(self, start: int, end: int) -> list[int]:
        table = self.block_table
        return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]

    def dense_out(self, start: int, end: int) -> torch.Tensor:
        """Dense causal attention over the whole history, rows [start, end)."""
        k = self.k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        v = self.v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        out = F.scaled_dot_product_attention(
            self.q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            scale=SCALE)
        return out.transpose(0, 1)[start:end]

    def dense_out_sinks(self, start: int, end: int, *, sinks: torch.Tensor,
                        sliding_window: int | None) -> torch.Tensor:
        """Rows [start, end) of dense attention over the whole history in float64, with a sink
        logit per head in each softmax's denominator and keys within the window only."""
        group = NUM_HEADS // NUM_KV_HEADS
        q, k, v = (x.double().transpose(0, 1) for x in (self.q, self.k, self.v))
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = q @ k.transpose(1, 2) * SCALE  # [H, L, L]
        pos = torch.arange(len(self.q))
        visible = pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            visible &= pos[None, :] > pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        sink = sinks.double()[:, None, None].expand(-1, len(pos), 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        return (probs @ v).transpose(0, 1)[start:end].float()


def _kv_cache() -> torch.Tensor:
    return torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)


def _fill(cache: torch.Tensor, seq: _Seq, end: int) -> None:
    """Write tokens [0, end) of seq (its cached context) into the cache."""
    write_kv(cache[0], cache[1], seq.k[:end], seq.v[:end], torch.tensor(seq.slots(0, end)))


def _step(seqs_and_ranges: list[tuple[_Seq, int, int]], num_padding: int = 0):
    """Flatten a step where seq i computes tokens [start, end); returns q, k, v, metadata."""
    q, k, v, slots, qsl, ctx, tables = [], [], [], [], [0], [], []
    for seq, start, end in seqs_and_ranges:
        q.append(seq.q[start:end]); k.append(seq.k[start:end]); v.append(seq.v[start:end])
        slots += seq.slots(start, end)
        qsl.append(qsl[-1] + end - start)
        ctx.append(end)
        tables.append(seq.block_table)
    width = max(len(t) for t in tables)
    pad = lambda n, *rest: torch.zeros(n, *rest)  # noqa: E731
    q = torch.cat(q + [pad(num_padding, NUM_HEADS, HEAD_DIM)])
    k = torch.cat(k + [pad(num_padding, NUM_KV_HEADS, HEAD_DIM)])
    v = torch.cat(v + [pad(num_padding, NUM_KV_HEADS, HEAD_DIM)])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [NO_KV_WRITE_SLOT] * num_padding),
        query_start_loc=qsl, context_lens=ctx,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=_num_leading_decodes(qsl),
        context_lens_tensor=torch.tensor(ctx),
    )
    return q, k, v, meta


def _num_leading_decodes(query_start_loc: list[int]) -> int:
    n = 0
    while n + 1 < len(query_start_loc) and query_start_loc[n + 1] == n + 1:
        n += 1
    return n


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.fixture
def free_blocks(gen) -> list[int]:
    # Shuffled so block tables are non-contiguous, as after real allocation and frees.
    return torch.randperm(NUM_BLOCKS, generator=gen).tolist()


def test_write_kv_places_tokens_and_skips_no_write_slot(gen):
    cache = _kv_cache()
    k = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    slots = torch.tensor([5, NO_KV_WRITE_SLOT, 2 * BLOCK_SIZE + 1])
    write_kv(cache[0], cache[1], k, v, slots)
    assert torch.equal(cache[0, 1, 1], k[0]) and torch.equal(cache[1, 1, 1], v[0])
    assert torch.equal(cache[0, 2, 1], k[2]) and torch.equal(cache[1, 2, 1], v[2])
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[[5, 2 * BLOCK_SIZE + 1]] = True
    flat = cache.flatten(1, 2)  # [2, slots, Hkv, D]
    assert flat[:, ~written].abs().sum() == 0  # the -1 token wrote nothing (nor wrapped to the end)


def test_write_kv_all_padding_writes_nothing(gen):
    cache = _kv_cache()
    k = torch.randn(4, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    write_kv(cache[0], cache[1], k, k, torch.full((4,), NO_KV_WRITE_SLOT))
    assert cache.abs().sum() == 0


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_reference])
def test_full_prefill_matches_dense(fn, gen, free_blocks):
    seqs = [_Seq(n, free_blocks, gen) for n in (7, 13, 1)]
    q, k, v, meta = _step([(s, 0, len(s.q)) for s in seqs])
    out = fn(q, k, v, _kv_cache(), meta, scale=SCALE)
    expected = torch.cat([s.dense_out(0, len(s.q)) for s in seqs])
    assert_sums_close(out, expected, reduction_len=ATTENTION_SUMS, num_paths=2)


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_reference])
def test_mixed_batch_with_cached_context_matches_dense(fn, gen, free_blocks):
    """Decodes, a second prefill chunk over an earlier chunk, a prefix-cached prompt and a fresh
    prompt in one step, plus padding tokens at the end."""
    decode_a, decode_b = _Seq(9, free_blocks, gen), _Seq(17, free_blocks, gen)
    chunked, fresh = _Seq(21, free_blocks, gen), _Seq(5, free_blocks, gen)
    cache = _kv_cache()
    _fill(cache, decode_a, 8)
    _fill(cache, decode_b, 16)
    _fill(cache, chunked, 10)  # first chunk (not block aligned) computed in an earlier step
    step = [(decode_a, 8, 9), (decode_b, 16, 17), (chunked, 10, 21), (fresh, 0, 5)]
    q, k, v, meta = _step(step, num_padding=3)
    out = fn(q, k, v, cache, meta, scale=SCALE)
    expected = torch.cat([s.dense_out(a, b) for s, a, b in step])
    assert_sums_close(out[:-3], expected, reduction_len=ATTENTION_SUMS, num_paths=2)
    assert out[-3:].abs().sum() == 0  # padding tokens attend to nothing
    # After the step the cache holds every sequence's full history.
    for s in (decode_a, decode_b, chunked, fresh):
        slots = torch.tensor(s.slots(0, len(s.k)))
        torch.testing.assert_close(cache[0].flatten(0, 1)[slots], s.k)
        torch.testing.assert_close(cache[1].flatten(0, 1)[slots], s.v)


def test_batched_decode_equals_reference(gen, free_blocks):
    lengths = [1, 3, 4, 5, 16, 31]
    seqs = [_Seq(n, free_blocks, gen) for n in lengths]
    cache = _kv_cache()
    for s in seqs:
        _fill(cache, s, len(s.k))
    q, k, v, meta = _step([(s, len(s.q) - 1, len(s.q)) for s in seqs])
    batched = paged_decode_attention(q, cache[0], cache[1], meta.block_tables,
                                     meta.context_lens_tensor, scale=SCALE)
    reference = paged_attention_reference(q, k, v, cache.clone(), meta, scale=SCALE)
    assert_sums_close(batched, reference, reduction_len=ATTENTION_SUMS, num_paths=2)
    expected = torch.cat([s.dense_out(len(s.q) - 1, len(s.q)) for s in seqs])
    assert_sums_close(batched, expected, reduction_len=ATTENTION_SUMS, num_paths=2)


def test_a_decode_step_writes_its_kv_in_the_attention_call(gen, free_blocks):
    # a pure decode step: the kernel writes the new tokens' K/V (what write_kv does) and attends
    seqs = [_Seq(n, free_blocks, gen) for n in (1, 4, 9, 17)]
    cache = _kv_cache()
    for s in seqs:
        _fill(cache, s, len(s.k) - 1)  # the context before this step's token
    q, k, v, meta = _step([(s, len(s.q) - 1, len(s.q)) for s in seqs])
    expected_cache = cache.clone()
    write_kv(expected_cache[0], expected_cache[1], k, v, meta.slot_mapping)
    out = paged_attention(q, k, v, cache, meta, scale=SCALE)
    assert torch.equal(cache, expected_cache)
    assert_sums_close(out, torch.cat([s.dense_out(len(s.q) - 1, len(s.q)) for s in seqs]),
                      reduction_len=ATTENTION_SUMS, num_paths=2)
    # a slot of -1 writes nothing (decode_attention's new_kv, in the kernel or before the torch path)
    before = cache.clone()
    slots = meta.slot_mapping.clone()
    slots[0] = NO_KV_WRITE_SLOT
    decode_attention(q, cache[0], cache[1], meta.block_tables, meta.context_lens_tensor,
                     scale=SCALE, new_kv=(k + 1, v + 1, slots))
    changed = (cache != before).flatten(1, 2).any(-1).any(-1).any(0)  # per slot
    assert changed.nonzero().flatten().tolist() == sorted(meta.slot_mapping[1:].tolist())


def test_dummy_batch_writes_nothing():
    cache = _kv_cache()
    for num_tokens in (0, 3):
        q = torch.ones(num_tokens, NUM_HEADS, HEAD_DIM)
        k = torch.ones(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        out = paged_attention(q, k, k, cache, AttentionMetadata.empty(num_tokens), scale=SCALE)
        assert out.shape == q.shape and out.abs().sum() == 0
    assert cache.abs().sum() == 0


@pytest.mark.parametrize("sliding_window", [5, None])
@pytest.mark.parametrize("fn", [paged_attention, paged_attention_reference])
def test_sinks_and_sliding_window_match_dense(fn, sliding_window, gen, free_blocks):
    """The mixed batch above with sinks and a window of 5 tokens (past a block boundary):
    decodes whose window starts mid-context, a chunk whose earlier chunk and the window's start
    are cached, a fresh prompt longer than the window, padding."""
    sinks = torch.randn(NUM_HEADS, generator=gen) * 2
    decode_a, decode_b = _Seq(9, free_blocks, gen), _Seq(17, free_blocks, gen)
    chunked, fresh = _Seq(21, free_blocks, gen), _Seq(7, free_blocks, gen)
    cache = _kv_cache()
    for seq, end in ((decode_a, 8), (decode_b, 16), (chunked, 10)):
        _fill(cache, seq, end)
    step = [(decode_a, 8, 9), (decode_b, 16, 17), (chunked, 10, 21), (fresh, 0, 7)]
    q, k, v, meta = _step(step, num_padding=3)
    out = fn(q, k, v, cache, meta, scale=SCALE, sinks=sinks, sliding_window=sliding_window)
    expected = torch.cat([s.dense_out_sinks(a, b, sinks=sinks, sliding_window=sliding_window)
                          for s, a, b in step])
    assert_sums_close(out[:-3], expected, reduction_len=ATTENTION_SUMS)  # float64's, rounded
    assert out[-3:].abs().sum() == 0
    plain = torch.cat([s.dense_out(a, b) for s, a, b in step])
    assert (out[:-3] - plain).abs().max() > 1e-2  # the sinks (and window) did change the output


@pytest.mark.parametrize("sliding_window", [1, 6, None])
def test_batched_decode_with_sinks_and_window_equals_dense(sliding_window, gen, free_blocks):
    lengths = [1, 3, 4, 5, 16, 31]
    seqs = [_Seq(n, free_blocks, gen) for n in lengths]
    sinks = torch.randn(NUM_HEADS, generator=gen)
    cache = _kv_cache()
    for s in seqs:
        _fill(cache, s, len(s.k))
    q, _, _, meta = _step([(s, len(s.q) - 1, len(s.q)) for s in seqs])
    batched = paged_decode_attention(q, cache[0], cache[1], meta.block_tables,
                                     meta.context_lens_tensor, scale=SCALE, sinks=sinks,
                                     sliding_window=sliding_window)
    expected = torch.cat([s.dense_out_sinks(len(s.q) - 1, len(s.q), sinks=sinks,
                                            sliding_window=sliding_window) for s in seqs])
    assert_sums_close(batched, expected, reduction_len=ATTENTION_SUMS)
