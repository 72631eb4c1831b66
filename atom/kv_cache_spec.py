"""The geometry of a model's paged KV cache, one spec per attention layer (torch-free).

The model decides it (``kv_cache_specs(config)`` on its class, :mod:`atom.models`): the model
runner allocates one tensor per layer of :meth:`KVCacheSpec.shape`, the KV memory budget
divides by :func:`kv_cache_bytes_per_block`, the P/D handshake compares the specs
(:class:`atom.core.kv_connector.KVLayout`: equal specs mean equal KV cache groups, so a
consumer grouped differently from its producer is refused there) and the simulator sizes its pools from the bytes per
token the calibration records. Every layer shares the block manager's block ids and block size;
only what one token takes in a layer differs:

- standard attention (Llama, Qwen3, Mixtral): K and V, ``num_kv_heads x head_dim`` each;
- a sliding-window layer (gpt-oss, Mistral): the same per token, and ``sliding_window`` says how
  many of the latest tokens a query sees;
- multi-head latent attention (DeepSeek-V2/V3, arXiv:2405.04434): one latent vector per token
  (``latent=True``, ``num_kv_heads=1``, ``head_dim = kv_lora_rank + qk_rope_head_dim``), no
  separate K and V.

**KV cache groups** (:func:`kv_cache_groups`; lineage: vLLM's hybrid KV cache manager): a model
whose layers mix windows (gpt-oss: full and sliding layers alternate) gets one group per window,
full attention first. The groups share one block pool and one block size, and each sequence
has a block table per group (:class:`atom.core.block_manager.BlockManager`): a sliding group
frees the blocks no future query can see. Layer ``j`` of every group shares one cache tensor
(``slot`` ``j``), so one block id holds ``max(layers per group)`` layers' worth of KV, not all
layers': at long context gpt-oss fits about twice the tokens. A model with one window (Llama,
Qwen3, Mixtral, DeepSeek) is one group with no window: every layer its own tensor, as always.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class KVCacheSpec(msgspec.Struct, frozen=True):
    """What one attention layer caches per token.

    Attributes:
        num_kv_heads: heads cached per token (KV heads of grouped-query attention; 1 for a
            latent cache).
        head_dim: values per head.
        latent: one latent vector per token instead of a key and a value (MLA).
        sliding_window: the latest tokens a query attends to; None = all of them.
    """

    num_kv_heads: int
    head_dim: int
    latent: bool = False
    sliding_window: int | None = None

    @property
    def num_parts(self) -> int:
        """Arrays per token: 2 (key, value) or 1 (latent)."""
        return 1 if self.latent else 2

    def values_per_token(self) -> int:
        return self.num_parts * self.num_kv_heads * self.head_dim

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """The layer's cache tensor: ``[num_parts, num_blocks, block_size, num_kv_heads,
        head_dim]`` (index 0 the keys or the latent, 1 the values)."""
        return (self.num_parts, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def describe(self) -> str:
        kind = (f"latent {self.head_dim}" if self.latent
                else f"K+V {self.num_kv_heads} heads x {self.head_dim}")
        return kind + ("" if self.sliding_window is None else f", window {self.sliding_window}")


class KVCacheGroup(msgspec.Struct, frozen=True):
    """Layers that share one block table per sequence.

    Attributes:
        sliding_window: the window of every layer in the group, in tokens; None = full attention.
        layer_ids: the group's layers, in model order; layer ``layer_ids[j]`` keeps its KV in
            cache tensor (slot) ``j``.
    """

    sliding_window: int | None
    layer_ids: tuple[int, ...]


def kv_cache_groups(specs: Sequence[KVCacheSpec]) -> list[KVCacheGroup]:
    """The model's KV cache groups: one with no window and every layer when the layers do not
    mix windows (today's single group; a model whose every layer slides keeps its whole KV too),
    else one group per window, full attention first then by window.

    Hybrid groups share cache tensors across groups, so every layer must cache the same shape;
    a hybrid model whose layers differ in shape stays one group (its windows only mask).
    """
    windows = sorted({spec.sliding_window for spec in specs},
                     key=lambda w: (w is not None, w or 0))
    if len(windows) <= 1 or len({spec.shape(1, 1) for spec in specs}) > 1:
        return [KVCacheGroup(sliding_window=None, layer_ids=tuple(range(len(specs))))]
    return [KVCacheGroup(sliding_window=w, layer_ids=tuple(
        i for i, spec in enumerate(specs) if spec.sliding_window == w)) for w in windows]


def first_block_in_window(window: int | None, num_tokens: int, *, block_size: int) -> int:
    """Index of the first block a query at position ``num_tokens`` (or later) sees in a group
    of sliding ``window`` tokens (None: full attention, 0): the window starts at
    ``num_tokens - window + 1``. The block manager releases the blocks before it; a P/D
    producer sends the consumer only the blocks from it on."""
    if window is None:
        return 0
    return max(0, num_tokens - window + 1) // block_size


def kv_cache_slots(specs: Sequence[KVCacheSpec]) -> list[int]:
    """Per layer, the index of the cache tensor it reads and writes (its position within its
    group, :class:`KVCacheGroup`); one tensor per layer for a single group."""
    slots = [0] * len(specs)
    for group in kv_cache_groups(specs):
        for j, layer in enumerate(group.layer_ids):
            slots[layer] = j
    return slots


def kv_cache_bytes_per_block(specs: Sequence[KVCacheSpec], *, itemsize: int,
                             block_size: int) -> int:
    """Bytes one block takes: ``block_size`` tokens x values per token x ``itemsize`` (bytes
    per value of the cache dtype), summed over the layers of one group's worth of cache
    tensors (every layer for a single group; the largest group's layers for hybrid groups,
    whose tensors the other groups share)."""
    groups = kv_cache_groups(specs)
    return block_size * itemsize * max(sum(specs[i].values_per_token() for i in g.layer_ids)
                                       for g in groups) if specs else 0


def describe_groups(specs: Sequence[KVCacheSpec], *, itemsize: int) -> str:
    """``"2 KV cache groups: full 12 layers 24576 bytes per token, window 128 12 layers 24576
    bytes per token (shared tensors)"`` (``itemsize``: bytes per value), or ``""`` for a single
    group (nothing to add to the layers' description)."""
    groups = kv_cache_groups(specs)
    if len(groups) == 1:
        return ""
    parts = [("full" if g.sliding_window is None else f"window {g.sliding_window}")
             + f" {len(g.layer_ids)} layers "
             + f"{itemsize * sum(specs[i].values_per_token() for i in g.layer_ids)} bytes per token"
             for g in groups]
    return f"{len(groups)} KV cache groups: {', '.join(parts)} (shared tensors)"


def describe_layers(specs: Sequence[KVCacheSpec]) -> str:
    """Consecutive equal layers grouped: ``"layers 0-1: K+V 2 heads x 16; layer 2: ..."``."""
    groups: list[tuple[int, int, KVCacheSpec]] = []
    for i, spec in enumerate(specs):
        if groups and groups[-1][2] == spec and groups[-1][1] == i - 1:
            groups[-1] = (groups[-1][0], i, spec)
        else:
            groups.append((i, i, spec))
    return "; ".join((f"layer {a}" if a == b else f"layers {a}-{b}") + f": {s.describe()}"
                     for a, b, s in groups) or "no layers"
