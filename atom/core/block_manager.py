"""Paged KV-cache block pool with prefix caching.

The block manager owns every KV block's bookkeeping: ref counts, the free queue, the prefix-cache
index and each sequence's block table. It imports no torch: the KV tensors live in the model
runner, indexed by the block ids handed out here.

Layout of one sequence (block size 4, 10 tokens, the first two blocks full)::

    token_ids    t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .  .
    block_table  [   17      ,     4       ,    9     ]
    hashes       h0=H(-,b0)    h1=H(h0,b1)   (partial: no hash)

Prefix caching (lineage: vLLM's automatic prefix caching, SGLang's radix cache): every *full*
block gets a chained hash ``H(parent_hash, tokens)`` (xxhash64 over the parent hash and the token
ids), published only after the block's KV was computed. A new prompt walks its full blocks and
reuses blocks whose hash, tokens *and* parent block match (the token and parent comparisons guard
against hash collisions: a cached block is reused only on top of the very block it was computed
after). The block holding a prompt's last token is never served from the cache, so every
prefill computes at least one token and produces logits.

Freed blocks go to the tail of the free queue (a sequence's blocks in reverse order, so its
prefix outlives its tail); allocation takes from the head. A free block keeps its hash until it
is handed out again, so cached blocks are evicted least-recently-freed first.

Every change to the prefix-cache index is logged in ``events`` as the KV event wire structs of
``atom.kv_events`` (``BlockStored`` when hashes are published, ``BlockRemoved`` on eviction,
``AllBlocksCleared`` on a reset), hashes in their signed wire form; the engine core takes them
once per step (``take_events``) for the KV event publisher.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from atom.kv_events import (AllBlocksCleared, KVCacheEvent, removed_event, stored_event,
                             to_wire_hash)
from atom.core.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: list[int] | tuple[int, ...]) -> int:
    """Chained xxhash64 of one full block: ``H(parent_hash, token_ids)`` as an unsigned int."""
    h = xxhash.xxh64()
    h.update((parent_hash if parent_hash is not None else 0).to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "parent", "generation")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept for the collision guard
        # (block id, generation) of the block before this one when it was hashed (None: first
        # block); with token_ids, makes a hit independent of the hash (collision guard)
        self.parent: tuple[int, int] | None = None
        self.generation = 0  # bumped each time the block is handed out for new content


class DryRunClaims:
    """Blocks a side-effect-free dry run of admission has handed out so far.

    ``revived``: cached free blocks an admission would take out of the free queue (free for the
    next admission that hits them); ``taken``: free-queue blocks handed out as new blocks, whose
    cached content would be evicted.
    """

    def __init__(self) -> None:
        self.revived: set[int] = set()
        self.taken: set[int] = set()


class BlockManager:
    """Hands out KV blocks to sequences; the only owner of ref counts and block tables.

    Args:
        num_blocks: size of the KV pool in blocks.
        block_size: tokens per block.
        enable_prefix_caching: reuse computed full blocks across sequences.

    Guarantees: ``num_free_blocks + num_used_blocks == num_blocks`` at all times; a block is in
    the free queue iff its ref count is 0; every block returns to the free queue once every
    sequence holding it was freed.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.events: list[KVCacheEvent] = []
        # per sequence: number of leading blocks of its table already hashed and published
        self._num_hashed_blocks: dict[int, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up (tokens)
        self.prefix_cache_hits = 0  # prompt tokens served from the cache (tokens)

    # ----- read-only queries (used by admission and by its dry run) -----

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def kv_usage(self) -> float:
        """Fraction of blocks with ref count > 0."""
        return self.num_used_blocks / self.num_blocks

    def num_required_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Block ids whose computed KV can serve ``seq``'s leading full blocks (no side effects).

        The block holding the last token is excluded, so at least one token is computed. A
        request that asks for prompt logprobs gets no hits: the cached positions would have none.
        """
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        parent_block: tuple[int, int] | None = None
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        for i, block_hash in enumerate(self.block_hashes(seq, max_blocks)):
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block.token_ids != tokens or block.parent != parent_block:
                break
            hits.append(block_id)
            parent_block = (block_id, block.generation)
        return hits

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chained hashes of ``seq``'s first ``num_blocks`` full blocks (the ones in
        ``seq.block_hashes`` plus any not hashed yet, which are appended there).

        A full block's tokens never change (tokens are only appended), so each hash is computed
        once per sequence rather than on every admission attempt: a waiting prompt is looked up
        every tick while it does not fit.
        """
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    def admission_cost(self, seq: Sequence, claims: DryRunClaims | None = None) -> tuple[int, int]:
        """(free blocks needed, cached tokens) to give ``seq`` blocks for all its tokens.

        Cached blocks with ref count 0 sit in the free queue, so taking them also costs a free
        block; cached blocks already in use cost nothing. With ``claims``, the cost is the one
        ``seq`` would have after the dry run's earlier claims (see :meth:`claim`).
        """
        hits = self._hits(seq, claims)
        num_new = self.num_required_blocks(len(seq.token_ids)) - len(hits)
        num_revived = sum(1 for b in hits if self.blocks[b].ref_count == 0
                          and (claims is None or b not in claims.revived))
        return num_new + num_revived, len(hits) * self.block_size

    def num_unclaimed_free_blocks(self, claims: DryRunClaims | None) -> int:
        """Free blocks, less those a dry run's ``claims`` hold (None: no dry run)."""
        if claims is None:
            return self.num_free_blocks
        return self.num_free_blocks - len(claims.revived) - len(claims.taken)

    def claim_append(self, seq: Sequence, claims: DryRunClaims) -> bool:
        """The dry run of :meth:`can_append` then :meth:`append_slots` for one more token of
        ``seq``: record its new blocks in ``claims``; False (nothing recorded) when they are
        not free."""
        num_new_blocks = self.num_required_blocks(len(seq.token_ids)) - len(seq.block_table)
        if num_new_blocks > self.num_unclaimed_free_blocks(claims):
            return False
        self.claim_new_blocks(num_new_blocks, claims)
        return True

    def claim(self, seq: Sequence, claims: DryRunClaims) -> None:
        """Record in ``claims`` the blocks ``allocate(seq)`` would take; changes nothing else."""
        hits = self._hits(seq, claims)
        claims.revived.update(b for b in hits if self.blocks[b].ref_count == 0)
        self.claim_new_blocks(self.num_required_blocks(len(seq.token_ids)) - len(hits), claims)

    def claim_new_blocks(self, num_blocks: int, claims: DryRunClaims) -> None:
        """Record in ``claims`` the ``num_blocks`` free-queue blocks the next allocations take."""
        if num_blocks <= 0:
            return
        for block_id in self.free_queue:
            if block_id not in claims.revived and block_id not in claims.taken:
                claims.taken.add(block_id)
                num_blocks -= 1
                if num_blocks == 0:
                    return
        raise RuntimeError("dry run claimed more blocks than are free")

    def _hits(self, seq: Sequence, claims: DryRunClaims | None) -> list[int]:
        hits = self.find_cached_blocks(seq)
        if claims is not None:
            for i, block_id in enumerate(hits):
                if block_id in claims.taken:  # a claimed allocation would evict it: chain ends
                    return hits[:i]
        return hits

    # ----- mutations -----

    def allocate(self, seq: Sequence) -> int:
        """Give ``seq`` blocks for all its current tokens, reusing cached prefix blocks.

        Returns the number of tokens served from the prefix cache (a multiple of block_size).
        Raises:
            RuntimeError: not enough free blocks (callers check ``admission_cost`` first).
        """
        assert not seq.block_table, f"seq {seq.seq_id} already has blocks"
        needed, _ = self.admission_cost(seq)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"allocate: need {needed} free blocks, have {self.num_free_blocks}")
        hits = self.find_cached_blocks(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        self._num_hashed_blocks[seq.seq_id] = len(hits)
        for _ in range(self.num_required_blocks(len(seq.token_ids)) - len(hits)):
            seq.block_table.append(self._take_free_block())
        num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(seq.token_ids)
            self.prefix_cache_hits += num_cached_tokens
        return num_cached_tokens

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Whether the pool can hold ``num_new_tokens`` more tokens of ``seq``."""
        needed = self.num_required_blocks(len(seq.token_ids) + num_new_tokens - 1) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Grow ``seq``'s block table to cover ``num_tokens`` tokens (default: all its tokens)."""
        num_tokens = len(seq.token_ids) if num_tokens is None else num_tokens
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take_free_block())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink ``seq``'s block table to the blocks ``num_tokens`` tokens need, freeing the
        rest: the slots speculative decoding reserved for draft tokens that were rejected.

        The freed blocks lie past the sequence's computed tokens, so they were never hashed or
        shared (ref count 1); they go to the free queue's tail.
        """
        keep = self.num_required_blocks(num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.block_hash is None, block.block_id
            block.ref_count = 0
            self.free_queue[block.block_id] = None

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish hashes of ``seq``'s full blocks whose KV is now computed.

        Called after a step, so a hash never points at KV that was not written yet.
        """
        if not self.enable_prefix_caching:
            return
        num_hashed = self._num_hashed_blocks.get(seq.seq_id, 0)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= num_hashed:
            return
        prev = self.blocks[seq.block_table[num_hashed - 1]] if num_hashed else None
        parent = prev.block_hash if prev is not None else None
        link = self._canonical_link(prev) if prev is not None else None
        # one event per run of consecutive newly published blocks, so that each event's parent
        # and tokens match its hashes (blocks another sequence published first are skipped);
        # a run is (parent hash, hashes, tokens)
        runs: list[tuple[int | None, list[int], list[int]]] = []
        last_stored = None
        hashes = self.block_hashes(seq, num_full)
        for i in range(num_hashed, num_full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_hash = hashes[i]
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash, block.token_ids, block.parent = block_hash, tokens, link
                # first writer wins: an identical block computed twice keeps the older entry
                if block_hash not in self.hash_to_block:
                    self.hash_to_block[block_hash] = block.block_id
                    if runs and last_stored == i - 1:
                        runs[-1][1].append(block_hash)
                        runs[-1][2].extend(tokens)
                    else:
                        runs.append((parent, [block_hash], list(tokens)))
                    last_stored = i
            parent, link = block_hash, self._canonical_link(block)
        self._num_hashed_blocks[seq.seq_id] = num_full
        self.events.extend(stored_event(run_hashes, run_parent, run_tokens, self.block_size)
                           for run_parent, run_hashes, run_tokens in runs)

    def _canonical_link(self, block: Block) -> tuple[int, int]:
        """(id, generation) a following block records as its parent: the indexed block with the
        same content as ``block`` when there is one (a duplicate computed concurrently), so that
        later blocks stay reachable from the cached chain."""
        other_id = self.hash_to_block.get(block.block_hash) if block.block_hash is not None else None
        if other_id is not None:
            other = self.blocks[other_id]
            if other.token_ids == block.token_ids and other.parent == block.parent:
                block = other
        return block.block_id, block.generation

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks reaching ref count 0 go to the free queue tail."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        self._num_hashed_blocks.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Returns False (and does nothing) while blocks are in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = block.token_ids = block.parent = None
        self.hash_to_block.clear()
        self.events.append(AllBlocksCleared())
        return True

    def wire_block_hashes(self) -> list[int]:
        """The prefix cache's block hashes in KV events' wire form, sorted."""
        return sorted(to_wire_hash(h) for h in self.hash_to_block)

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (tests call this after every step)."""
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue)
        for block in self.blocks:
            assert (block.ref_count == 0) == (block.block_id in free), block.block_id
            assert block.ref_count >= 0
        for block_hash, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].block_hash == block_hash

    def _take_free_block(self) -> int:
        if not self.free_queue:
            raise RuntimeError("KV pool exhausted (callers check can_append/admission_cost first)")
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # evict the cached content this block held
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
                self.events.append(removed_event([block.block_hash]))
            block.block_hash = block.token_ids = block.parent = None
        block.generation += 1
        block.ref_count = 1
        return block_id
