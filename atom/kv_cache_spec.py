"""The geometry of a model's paged KV cache, one spec per attention layer (torch-free).

The model decides it (``kv_cache_specs(config)`` on its class, :mod:`atom.models`): the model
runner allocates one tensor per layer of :meth:`KVCacheSpec.shape`, the KV memory budget
divides by :func:`kv_cache_bytes_per_block`, the P/D handshake compares the specs
(:class:`atom.core.kv_connector.KVLayout`) and the simulator sizes its pools from the bytes per
token the calibration records. Every layer shares the block manager's block ids and block size;
only what one token takes in a layer differs:

- standard attention (Llama, Qwen3, Mixtral): K and V, ``num_kv_heads x head_dim`` each;
- a sliding-window layer (gpt-oss, Mistral): the same per token, and ``sliding_window`` says how
  many of the latest tokens a query sees;
- multi-head latent attention (DeepSeek-V2/V3, arXiv:2405.04434): one latent vector per token
  (``latent=True``, ``num_kv_heads=1``, ``head_dim = kv_lora_rank + qk_rope_head_dim``), no
  separate K and V.
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


def kv_cache_bytes_per_block(specs: Sequence[KVCacheSpec], *, itemsize: int,
                             block_size: int) -> int:
    """Bytes one block takes across every layer: ``block_size`` tokens x each layer's values
    per token x ``itemsize`` (bytes per value of the cache dtype)."""
    return block_size * itemsize * sum(spec.values_per_token() for spec in specs)


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
