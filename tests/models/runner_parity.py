"""Logits parity of a ModelRunner with transformers, step by step (shared by the model tests):
a whole prompt then decodes, and a chunked prompt batched with another sequence; and a
checkpoint that records what a model read from it."""

from __future__ import annotations

import torch

from atom.core.sequence import Sequence
from atom.sampling_params import SamplingParams
from atom.worker.checkpoint import Checkpoint
from atom.worker.model_runner import ModelRunner

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 64
ATOL = 1e-3  # fp32, same math, different GEMM shapes (fused QKV / gate-up): ~1e-5 seen


class BlockPool:
    """Trivial allocator: hands out blocks from a shuffled free list (non-contiguous tables)."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(NUM_KV_BLOCKS, generator=gen).tolist()

    def grow(self, seq: Sequence, num_tokens: int, num_groups: int = 1) -> None:
        """Cover ``num_tokens`` tokens in each of ``num_groups`` KV cache groups' tables (a
        hybrid model's groups take distinct blocks: they share the cache tensors)."""
        while len(seq.group_block_tables) < num_groups - 1:
            seq.group_block_tables.append([])
        for table in (seq.block_table, *seq.group_block_tables):
            while len(table) * BLOCK_SIZE < num_tokens:
                table.append(self.free.pop())


def seq_of(token_ids: list[int], *, prompt_logprobs: int | None = None) -> Sequence:
    return Sequence(request_id="r", token_ids=list(token_ids),
                    sampling_params=SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs))


def step(runner: ModelRunner, pool: BlockPool, scheduled: list[tuple[Sequence, int]]):
    """Allocate, run and advance like the scheduler would (the runner itself mutates nothing)."""
    for seq, n in scheduled:
        pool.grow(seq, seq.num_computed_tokens + n, len(runner.kv_cache_groups))
    out = runner.execute_model(scheduled)
    for seq, n in scheduled:
        seq.num_computed_tokens += n
    return out


def fp32_runner(folder, *, expert_shard=None) -> ModelRunner:
    """A float32 runner of the model in ``folder`` (:data:`NUM_KV_BLOCKS` blocks of
    :data:`BLOCK_SIZE`, 512 positions)."""
    from atom.worker.model_loader import load_model_weights

    config, weights = load_model_weights(str(folder), torch.float32)
    return ModelRunner(config, weights, dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS,
                       block_size=BLOCK_SIZE, max_model_len=512, expert_shard=expert_shard)


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def check_prefill_then_decode(runner, hf_model, prompt: list[int]) -> None:
    """Whole prompt in one step (with prompt logits), then two decode steps."""
    pool = BlockPool()
    seq = seq_of(prompt, prompt_logprobs=0)
    out = step(runner, pool, [(seq, len(prompt))])
    ref = hf_logits(hf_model, prompt)
    assert out.sampled_seq_ids == [seq.seq_id]
    assert_close(out.logits, ref[-1:])
    assert_close(out.prompt_logits[seq.seq_id], ref[:-1])
    for _ in range(2):
        seq.token_ids.append(int(out.logits[0].argmax()))
        out = step(runner, pool, [(seq, 1)])
        assert seq.seq_id not in out.prompt_logits  # decode computes no prompt position
        assert_close(out.logits, hf_logits(hf_model, seq.token_ids)[-1:])


def check_chunked_mixed_batch(runner, hf_model, vocab: int) -> None:
    """A 50-token prompt in two chunks (20 + 30), batched with another sequence that prefills in
    the first step and decodes in the second; the second step lists the chunk first, so the
    runner's decode-first reordering must not leak into the output order."""
    pool = BlockPool(seed=1)
    chunked = seq_of(random_tokens(50, vocab, seed=2), prompt_logprobs=0)
    other = seq_of(random_tokens(11, vocab, seed=3))
    out1 = step(runner, pool, [(chunked, 20), (other, 11)])
    assert out1.sampled_seq_ids == [other.seq_id]  # the half-done prompt is not sampled
    assert_close(out1.logits, hf_logits(hf_model, other.token_ids)[-1:])
    other.token_ids.append(int(out1.logits[0].argmax()))
    out2 = step(runner, pool, [(chunked, 30), (other, 1)])
    assert out2.sampled_seq_ids == [chunked.seq_id, other.seq_id]
    ref = hf_logits(hf_model, chunked.token_ids)
    assert_close(out2.logits[:1], ref[-1:])
    assert_close(out2.logits[1:], hf_logits(hf_model, other.token_ids)[-1:])
    prompt_logits = torch.cat(
        [out1.prompt_logits[chunked.seq_id], out2.prompt_logits[chunked.seq_id]])
    assert_close(prompt_logits, ref[:-1])


class CountingCheckpoint(Checkpoint):
    """A checkpoint that records what the model read: whole tensors and row ranges."""

    def __init__(self, inner: Checkpoint):
        self.inner, self.dtype, self.read, self.rows_read = inner, inner.dtype, set(), {}

    @property
    def device(self):
        return self.inner.device

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)

    def __contains__(self, name):
        return name in self.inner

    def __getitem__(self, name):
        self.read.add(name)
        return self.inner[name]

    def rows(self, name, start, end):
        self.rows_read[name] = (start, end)
        return self.inner.rows(name, start, end)


def check_runner_matches_transformers(runner, hf_model, *, vocab: int,
                                      prompt_len: int = 23) -> None:
    """A model family's runner against transformers: DP dummy batches (no token, or padding
    only) give no logits, then :func:`check_prefill_then_decode` on a ``prompt_len``-token prompt
    and :func:`check_chunked_mixed_batch`."""
    for num_padding_tokens in (0, 3):
        out = runner.execute_model([], num_padding_tokens=num_padding_tokens)
        assert out.logits.shape == (0, vocab)
    check_prefill_then_decode(runner, hf_model, random_tokens(prompt_len, vocab, seed=5))
    check_chunked_mixed_batch(runner, hf_model, vocab)
