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

**KV cache groups** (hybrid models: gpt-oss's full and sliding-window layers;
:func:`atom.kv_cache_spec.kv_cache_groups`): one pool, one block size, one block table per
group (``seq.block_table`` for group 0, ``seq.group_block_tables`` for the others). A sliding
group with window ``W`` holds, per sequence, only the blocks some future query can see: a query
at position ``p`` reads keys ``(p - W, p]`` and future queries start at ``num_computed_tokens``,
so every block wholly before ``num_computed_tokens - W + 1`` is released after each step (its
table entry becomes None, a hole the model runner fills with block 0, which the kernels never
read: the window masks it). Its table also grows lazily, one step's tokens at a time (admission
covers the first chunk, :meth:`BlockManager.append_slots` the next ones), so a sequence holds
at most ``ceil((W + chunk - 1) / block_size) + 1`` blocks of a sliding group however long it
is (:meth:`BlockManager.max_blocks_held`); a P/D consumer's sequence holds from admission
on only the blocks of its first decode's window (its prompt KV is loaded, not computed). Prefix hits are per group with the hybrid rule:
the longest prefix of ``k`` blocks for which every full group has all ``k`` blocks cached and
every sliding group has the blocks its window needs before the hit point. Each group keeps its
own hash index (a block's KV differs per group). KV events describe every group the way
vLLM 0.32 does (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``; none
of them for a single group, whose events stay as they were), so the cache-aware DP router can
apply the hybrid hit rule (:class:`atom.engine.kv_subscriber.KVCacheIndex`); the engine
refuses events for a model without a full group (:mod:`atom.worker.worker`).

Every change to the prefix-cache index is logged in ``events`` as the KV event wire structs of
``atom.kv_events`` (``BlockStored`` when hashes are published, ``BlockRemoved`` on eviction,
``AllBlocksCleared`` on a reset), hashes in their signed wire form; the engine core takes them
once per step (``take_events``) for the KV event publisher.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from atom.kv_cache_spec import first_block_in_window
from atom.kv_events import (AllBlocksCleared, GroupFields, KVCacheEvent, removed_event,
                             stored_event, to_wire_hash)
from atom.core.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: list[int] | tuple[int, ...]) -> int:
    """Chained xxhash64 of one full block: ``H(parent_hash, token_ids)`` as an unsigned int."""
    h = xxhash.xxh64()
    h.update((parent_hash if parent_hash is not None else 0).to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "parent", "generation",
                 "group")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.group = 0  # the KV cache group whose hash index holds block_hash
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
        group_windows: each KV cache group's sliding window in tokens (None: full attention);
            the default one full group is every model without sliding layers.

    Guarantees: ``num_free_blocks + num_used_blocks == num_blocks`` at all times; a block is in
    the free queue iff its ref count is 0; every block returns to the free queue once every
    sequence holding it was freed.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 group_windows: tuple[int | None, ...] = (None,)):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        if not group_windows or any(w is not None and w < 1 for w in group_windows):
            raise ValueError(f"group_windows={group_windows!r}: give at least one group, each "
                             "window None or >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # one prefix-cache index per group; hash_to_block is group 0's
        self._hash_index: list[dict[int, int]] = [{} for _ in group_windows]
        self.hash_to_block = self._hash_index[0]
        self.events: list[KVCacheEvent] = []
        # what a hybrid pool's events say of each group (None: one group, events name none)
        self._event_groups: list[GroupFields | None] = (
            [None] if len(group_windows) == 1
            else [GroupFields(g, w) for g, w in enumerate(group_windows)])
        # per group, per sequence: number of leading blocks of its table already hashed and
        # published (holes of a sliding group included)
        self._num_hashed: list[dict[int, int]] = [{} for _ in group_windows]
        self._num_hashed_blocks = self._num_hashed[0]
        self.prefix_cache_queries = 0  # prompt tokens looked up (tokens)
        self.prefix_cache_hits = 0  # prompt tokens served from the cache (tokens)

    # ----- read-only queries (used by admission and by its dry run) -----

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

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
        """Blocks that hold ``num_tokens`` tokens in one group (one table's length)."""
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, *, chunk_tokens: int) -> int:
        """The most blocks one sequence of ``num_tokens`` tokens ever holds over all groups
        when each step computes at most ``chunk_tokens`` of its tokens: every block in a full
        group, at most ``ceil((W + chunk - 1) / block_size) + 1`` in a sliding one (its
        window before the step's first query plus the step's tokens), never more than the
        sequence has. The "can never fit" check of admission."""
        num_blocks = self.num_required_blocks(num_tokens)
        return sum(num_blocks if w is None else
                   min(num_blocks, self.num_required_blocks(w + chunk_tokens - 1) + 1)
                   for w in self.group_windows)

    def tables(self, seq: Sequence) -> list[list[int | None]]:
        """``seq``'s block table of each group (group 0's is ``seq.block_table``)."""
        return [seq.block_table, *seq.group_block_tables]

    def first_live_block(self, group: int, num_computed_tokens: int) -> int:
        """Index of the first block of ``group`` a query at ``num_computed_tokens`` or later
        can see (0 for a full group): its window starts at ``num_computed_tokens - W + 1``."""
        return first_block_in_window(self.group_windows[group], num_computed_tokens,
                                     block_size=self.block_size)

    def num_blocks_to_cover(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq``'s tables need, over all groups, to hold ``num_tokens`` tokens."""
        need = self.num_required_blocks(num_tokens)
        return sum(max(0, need - len(table)) for table in self.tables(seq))

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Group 0's block ids whose computed KV can serve ``seq``'s leading full blocks (no
        side effects; :meth:`find_cached` for every group's).

        The block holding the last token is excluded, so at least one token is computed. A
        request that asks for prompt logprobs gets no hits: the cached positions would have none.
        """
        return [b for b in self.find_cached(seq)[1][0] if b is not None]

    def find_cached(self, seq: Sequence, taken: set[int] | frozenset[int] = frozenset()
                    ) -> tuple[int, list[list[int | None]]]:
        """(``k``, per group the first ``k`` table entries) of the longest cached prefix of
        ``k`` full blocks that serves ``seq`` in every group (module docstring: the hybrid
        rule); a sliding group's entries before its window are None. Blocks in ``taken`` (a
        dry run's evictions) count as not cached."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return 0, [[] for _ in self.group_windows]
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        hashes = self.block_hashes(seq, max_blocks)
        found: list[list[int | None]] = []
        num_hit_blocks = max_blocks
        for group, window in enumerate(self.group_windows):
            chain = self._lookup(seq, group, hashes, taken, chained=window is None)
            found.append(chain)
            if window is None:
                num_hit_blocks = min(num_hit_blocks, chain.index(None) if None in chain
                                     else len(chain))
        # the sliding groups: the longest k <= the full groups' whose window is all cached
        while num_hit_blocks > 0 and not all(
                None not in found[g][self.first_live_block(g, num_hit_blocks * self.block_size)
                                     :num_hit_blocks]
                for g, w in enumerate(self.group_windows) if w is not None):
            num_hit_blocks -= 1
        tables = []
        for group, chain in enumerate(found):
            first = self.first_live_block(group, num_hit_blocks * self.block_size)
            tables.append([None] * first + chain[first:num_hit_blocks])
        return num_hit_blocks, tables

    def _lookup(self, seq: Sequence, group: int, hashes: list[int], taken, *,
                chained: bool) -> list[int | None]:
        """Per full block of ``hashes``, ``group``'s cached block for it or None. ``chained``
        (full groups): stop at the first miss, and check each block's parent link too (the
        collision guard); a sliding group keeps no parent links (its earlier blocks may be
        gone) and checks the tokens only."""
        index, bs = self._hash_index[group], self.block_size
        out: list[int | None] = []
        parent_block: tuple[int, int] | None = None
        for i, block_hash in enumerate(hashes):
            block_id = index.get(block_hash)
            block = None if block_id is None or block_id in taken else self.blocks[block_id]
            if block is not None and (
                    block.token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs])
                    or (chained and block.parent != parent_block)):
                block = None
            if block is None:
                if chained:
                    break
                out.append(None)
                continue
            out.append(block.block_id)
            parent_block = (block.block_id, block.generation)
        return out

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

    def _covered_tokens(self, group: int, seq: Sequence, num_cached_tokens: int,
                        token_budget: int | None) -> int:
        """Tokens ``group``'s table covers at admission: all of them in a full group; in a
        sliding group only the first step's (its table grows step by step)."""
        if (self.group_windows[group] is None or token_budget is None
                or _remote_tokens(seq) is not None):
            return len(seq.token_ids)
        return min(len(seq.token_ids), num_cached_tokens + token_budget)

    def _admission_tables(self, seq: Sequence, claims: DryRunClaims | None
                          ) -> tuple[int, list[list[int | None]]]:
        """:meth:`find_cached`'s hits, and for a P/D consumer's sequence (its prompt KV comes
        from a producer) the sliding groups' entries before the window of its first query
        None: those blocks are neither loaded nor held."""
        num_hit_blocks, tables = self._hits(seq, claims)
        num_remote = _remote_tokens(seq)
        if num_remote is not None:
            for group, table in enumerate(tables):
                first = self.first_live_block(group, num_remote)
                if first:
                    tables[group] = [None] * first + table[first:]
        return num_hit_blocks, tables

    def admission_cost(self, seq: Sequence, claims: DryRunClaims | None = None, *,
                       token_budget: int | None = None) -> tuple[int, int]:
        """(free blocks needed, cached tokens) to admit ``seq``: blocks for all its tokens in
        each full group, and in each sliding group for those of its first step (at most
        ``token_budget`` tokens after the cached ones; None: all).

        Cached blocks with ref count 0 sit in the free queue, so taking them also costs a free
        block; cached blocks already in use cost nothing. With ``claims``, the cost is the one
        ``seq`` would have after the dry run's earlier claims (see :meth:`claim`).
        """
        num_hit_blocks, tables = self._admission_tables(seq, claims)
        num_cached = num_hit_blocks * self.block_size
        needed = 0
        for group, hits in enumerate(tables):
            covered = self._covered_tokens(group, seq, num_cached, token_budget)
            needed += self.num_required_blocks(covered) - len(hits)
            needed += sum(1 for b in hits if b is not None and self.blocks[b].ref_count == 0
                          and (claims is None or b not in claims.revived))
        return needed, num_cached

    def fitting_first_chunk(self, seq: Sequence, claims: DryRunClaims | None, *,
                            token_budget: int, num_free_blocks: int) -> int:
        """The largest first step (at most ``token_budget`` tokens after the cached ones)
        whose blocks fit ``num_free_blocks``: the full groups need the whole prompt whatever
        the step, the sliding groups one block fewer per block of tokens cut; 0 when nothing
        fits (always 0 without a sliding group)."""
        num_sliding = sum(w is not None for w in self.group_windows)
        needed, num_cached = self.admission_cost(seq, claims, token_budget=token_budget)
        budget = min(token_budget, len(seq.token_ids) - num_cached)
        while needed > num_free_blocks and num_sliding and budget > 0:
            num_cut_blocks = -(-(needed - num_free_blocks) // num_sliding)
            end = (self.num_required_blocks(num_cached + budget) - num_cut_blocks) * self.block_size
            budget = end - num_cached
            if budget > 0:
                needed, _ = self.admission_cost(seq, claims, token_budget=budget)
        return budget if needed <= num_free_blocks and budget > 0 else 0

    def max_tokens_to_cover(self, seq: Sequence, num_tokens: int, num_free_blocks: int) -> int:
        """The most tokens, at most ``num_tokens``, ``seq``'s tables can cover with
        ``num_free_blocks`` new blocks (a running prefill's chunk cut to the free blocks)."""
        bs = self.block_size
        end = num_tokens
        while end > 0 and self.num_blocks_to_cover(seq, end) > num_free_blocks:
            end = (self.num_required_blocks(end) - 1) * bs
        return end

    def num_unclaimed_free_blocks(self, claims: DryRunClaims | None) -> int:
        """Free blocks, less those a dry run's ``claims`` hold (None: no dry run)."""
        if claims is None:
            return self.num_free_blocks
        return self.num_free_blocks - len(claims.revived) - len(claims.taken)

    def claim_append(self, seq: Sequence, claims: DryRunClaims,
                     num_tokens: int | None = None) -> bool:
        """The dry run of :meth:`can_append` then :meth:`append_slots` for ``seq`` to hold
        ``num_tokens`` tokens (default: one more token, all it has): record its new blocks
        in ``claims``; False (nothing recorded) when they are not free."""
        num_new_blocks = self.num_blocks_to_cover(
            seq, len(seq.token_ids) if num_tokens is None else num_tokens)
        if num_new_blocks > self.num_unclaimed_free_blocks(claims):
            return False
        self.claim_new_blocks(num_new_blocks, claims)
        return True

    def claim(self, seq: Sequence, claims: DryRunClaims, *,
              token_budget: int | None = None) -> None:
        """Record in ``claims`` the blocks ``allocate(seq, token_budget=...)`` would take;
        changes nothing else."""
        num_hit_blocks, tables = self._admission_tables(seq, claims)
        num_new = 0
        for group, hits in enumerate(tables):
            claims.revived.update(b for b in hits if b is not None
                                  and self.blocks[b].ref_count == 0)
            covered = self._covered_tokens(group, seq, num_hit_blocks * self.block_size,
                                           token_budget)
            num_new += self.num_required_blocks(covered) - len(hits)
        self.claim_new_blocks(num_new, claims)

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

    def _hits(self, seq: Sequence, claims: DryRunClaims | None
              ) -> tuple[int, list[list[int | None]]]:
        # a block a claimed allocation would evict is no longer cached
        return self.find_cached(seq, claims.taken if claims is not None else frozenset())

    # ----- mutations -----

    def allocate(self, seq: Sequence, *, token_budget: int | None = None) -> int:
        """Give ``seq`` blocks for its tokens, reusing cached prefix blocks: all of them in a
        full group, in a sliding group those of its first step (``token_budget`` tokens after
        the cached ones; None: all).

        Returns the number of tokens served from the prefix cache (a multiple of block_size).
        Raises:
            RuntimeError: not enough free blocks (callers check ``admission_cost`` first).
        """
        assert not seq.block_table, f"seq {seq.seq_id} already has blocks"
        needed, _ = self.admission_cost(seq, token_budget=token_budget)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"allocate: need {needed} free blocks, have {self.num_free_blocks}")
        num_hit_blocks, tables = self._admission_tables(seq, None)
        num_cached_tokens = num_hit_blocks * self.block_size
        # every group's hits first: a new block taken from the free queue must not evict a
        # cached block another group of this sequence is about to reuse
        for block_id in (b for table in tables for b in table if b is not None):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        for group, table in enumerate(tables):
            self._num_hashed[group][seq.seq_id] = num_hit_blocks
            covered = self._covered_tokens(group, seq, num_cached_tokens, token_budget)
            for _ in range(self.num_required_blocks(covered) - len(table)):
                table.append(self._take_free_block())
        seq.block_table, *seq.group_block_tables = tables
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(seq.token_ids)
            self.prefix_cache_hits += num_cached_tokens
        return num_cached_tokens

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Whether the pool can hold ``num_new_tokens`` more tokens of ``seq``."""
        return (self.num_blocks_to_cover(seq, len(seq.token_ids) + num_new_tokens - 1)
                <= self.num_free_blocks)

    def append_slots(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Grow ``seq``'s block tables to cover ``num_tokens`` tokens (default: all its tokens)."""
        num_tokens = len(seq.token_ids) if num_tokens is None else num_tokens
        for table in self.tables(seq):
            while len(table) * self.block_size < num_tokens:
                table.append(self._take_free_block())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink ``seq``'s block tables to the blocks ``num_tokens`` tokens need, freeing the
        rest: the slots speculative decoding reserved for draft tokens that were rejected.

        The freed blocks lie past the sequence's computed tokens, so they were never hashed or
        shared (ref count 1); they go to the free queue's tail.
        """
        keep = self.num_required_blocks(num_tokens)
        for table in self.tables(seq):
            while len(table) > keep:
                block = self.blocks[table.pop()]
                assert block.ref_count == 1 and block.block_hash is None, block.block_id
                block.ref_count = 0
                self.free_queue[block.block_id] = None

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """After a step: publish hashes of ``seq``'s full blocks whose KV is now computed, then
        release the sliding groups' blocks no future query of ``seq`` can see.

        Called after a step, so a hash never points at KV that was not written yet.
        """
        if self.enable_prefix_caching:
            self._publish(seq)
            for group in range(1, self.num_groups):
                self._publish_group(seq, group)
        for group, window in enumerate(self.group_windows):
            if window is not None:
                self._release_outside_window(seq, group)

    def _release_outside_window(self, seq: Sequence, group: int) -> None:
        """Release the blocks of ``group``'s table before the window of ``seq``'s next query
        (to the free queue's tail, oldest first; a hashed block stays cached there until
        evicted); their entries become None. The released run is a prefix: walk back from its
        end to the first hole."""
        table = self.tables(seq)[group]
        end = min(self.first_live_block(group, seq.num_computed_tokens), len(table))
        start = end
        while start > 0 and table[start - 1] is not None:
            start -= 1
        for i in range(start, end):
            block = self.blocks[table[i]]
            assert block.ref_count > 0, f"block {block.block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None
            table[i] = None

    def _publish_group(self, seq: Sequence, group: int) -> None:
        """Index the newly computed full blocks of a group other than 0 (no parent links:
        :meth:`_lookup`), with their KV events (one per run of consecutive blocks it indexed)."""
        table = self.tables(seq)[group]
        num_hashed = self._num_hashed[group].get(seq.seq_id, 0)
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        if num_full <= num_hashed:
            return
        hashes = self.block_hashes(seq, num_full)
        index, bs = self._hash_index[group], self.block_size
        runs: list[tuple[int | None, list[int], list[int]]] = []  # (parent, hashes, tokens)
        last_stored = None
        for i in range(num_hashed, num_full):
            if table[i] is None:
                continue
            block = self.blocks[table[i]]
            if block.block_hash is None:
                tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                block.block_hash, block.group, block.token_ids = hashes[i], group, tokens
                if hashes[i] not in index:  # first writer wins
                    index[hashes[i]] = block.block_id
                    if runs and last_stored == i - 1:
                        runs[-1][1].append(hashes[i])
                        runs[-1][2].extend(tokens)
                    else:
                        runs.append((hashes[i - 1] if i else None, [hashes[i]], list(tokens)))
                    last_stored = i
        self._num_hashed[group][seq.seq_id] = num_full
        self.events.extend(stored_event(run_hashes, run_parent, run_tokens, bs,
                                        self._event_groups[group])
                           for run_parent, run_hashes, run_tokens in runs)

    def _publish(self, seq: Sequence) -> None:
        """:meth:`cache_computed_blocks` for group 0, with its KV events."""
        num_hashed = self._num_hashed_blocks.get(seq.seq_id, 0)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= num_hashed:
            return
        prev_id = seq.block_table[num_hashed - 1] if num_hashed else None
        prev = self.blocks[prev_id] if prev_id is not None else None
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
            if seq.block_table[i] is None:  # a sliding group 0 (no full group): a hole
                parent, link = block_hash, None
                continue
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash, block.token_ids, block.parent = block_hash, tokens, link
                block.group = 0
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
        self.events.extend(stored_event(run_hashes, run_parent, run_tokens, self.block_size,
                                        self._event_groups[0])
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
        for table in self.tables(seq):
            for block_id in reversed(table):
                if block_id is None:  # a sliding group's block released earlier
                    continue
                block = self.blocks[block_id]
                assert block.ref_count > 0, f"block {block_id} freed twice"
                block.ref_count -= 1
                if block.ref_count == 0:
                    self.free_queue[block_id] = None
        seq.block_table = []
        seq.group_block_tables = []
        for num_hashed in self._num_hashed:
            num_hashed.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Returns False (and does nothing) while blocks are in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = block.token_ids = block.parent = None
        for index in self._hash_index:
            index.clear()
        self.events.append(AllBlocksCleared())
        return True

    def wire_block_hashes(self) -> list[int]:
        """The prefix cache's block hashes (group 0's) in KV events' wire form, sorted."""
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
        for group, index in enumerate(self._hash_index):
            for block_hash, block_id in index.items():
                assert self.blocks[block_id].block_hash == block_hash
                assert self.blocks[block_id].group == group

    def _take_free_block(self) -> int:
        if not self.free_queue:
            raise RuntimeError("KV pool exhausted (callers check can_append/admission_cost first)")
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # evict the cached content this block held
            index = self._hash_index[block.group]
            if index.get(block.block_hash) == block_id:
                del index[block.block_hash]
                self.events.append(removed_event([block.block_hash],
                                                 self._event_groups[block.group]))
            block.block_hash = block.token_ids = block.parent = None
        block.generation += 1
        block.ref_count = 1
        return block_id


def _remote_tokens(seq: Sequence) -> int | None:
    """Prompt tokens whose KV a P/D consumer's ``seq`` loads from its producer instead of
    computing them (:mod:`atom.core.kv_connector`), or None: every other sequence."""
    params = seq.kv_transfer_params
    return params.remote_num_tokens if params is not None and params.do_remote_prefill else None
