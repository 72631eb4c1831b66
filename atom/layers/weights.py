"""Reading a checkpoint into a model: tensors by name, each read once, the experts of an MoE
layer in either of the layouts checkpoints use, and only this rank's experts.

A :class:`WeightSource` is what the loader hands the model
(:class:`atom.worker.checkpoint.Checkpoint`: safetensors files read lazily, or tensors in
memory); a :class:`CheckpointReader` takes tensors out of it by name and remembers what it
took, so the model can pass every other tensor through under its own name and name what is
missing or unexpected.

Expert layouts (:class:`ExpertNames`, relative to a layer's prefix ``model.layers.N.``):

- one expert at a time, as published checkpoints name them (Qwen3-MoE
  ``mlp.experts.{e}.gate_proj.weight``; Mixtral ``block_sparse_moe.experts.{e}.w1.weight``, w1 =
  gate, w3 = up, w2 = down): only the experts of this rank's range are read;
- fused 3-D tensors, as transformers v5 keeps them in memory (``mlp.experts.gate_up_proj``
  ``[E, 2 I, H]``, gate rows first; ``mlp.experts.down_proj`` ``[E, H, I]``; router
  ``mlp.gate.weight``): only the rows ``[start, end)`` of the expert dimension are read
  (:meth:`WeightSource.rows`).

Quantized experts: gpt-oss checkpoints store expert matrices in MXFP4 (``*_blocks`` /
``*_scales``), dequantized here at load (:func:`dequantize_mxfp4`); their layout is the family's
(:meth:`atom.models.gpt_oss.GptOssForCausalLM.read_moe`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


class WeightSource(Protocol):
    """Checkpoint tensors by name (Hugging Face names), in the run dtype."""

    def keys(self) -> Iterable[str]: ...

    def __contains__(self, name: object) -> bool: ...

    def __getitem__(self, name: str) -> torch.Tensor: ...

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of the tensor's first dimension, reading only those."""


class CheckpointReader:
    """Takes tensors out of a :class:`WeightSource`, each at most once.

    Raises (from :meth:`take`, :meth:`take_rows`): ValueError naming a missing weight.
    """

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self._unread = set(source.keys())

    def __contains__(self, name: str) -> bool:
        return name in self.source

    def take(self, name: str) -> torch.Tensor:
        self._check(name)
        self._unread.discard(name)
        return self.source[name]

    def take_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of ``name``'s first dimension; the rest is never read."""
        self._check(name)
        self._unread.discard(name)
        return self.source.rows(name, start, end)

    def skip(self, name: str) -> None:
        """Mark ``name`` as handled without reading it (another rank's expert, a tied head)."""
        self._unread.discard(name)

    def unread(self) -> list[str]:
        """The names not taken or skipped yet, sorted."""
        return sorted(self._unread)

    def _check(self, name: str) -> None:
        if name not in self.source:
            raise ValueError(f"missing weight {name!r}")


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names one MoE layer's tensors one expert at a time (module docstring):
    ``{module}{router}.weight`` and ``{module}experts.{e}.{gate|up|down}.weight``. The fused
    layout's names are transformers v5's for every family that uses this class."""

    module: str = "mlp."
    router: str = "gate"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


_FUSED_ROUTER = "mlp.gate.weight"
_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_FUSED_DOWN = "mlp.experts.down_proj"


def read_experts(reader: CheckpointReader, prefix: str, names: ExpertNames, *,
                 num_experts: int, start: int, end: int) -> dict[str, torch.Tensor]:
    """One MoE layer's router and experts ``[start, end)`` from either layout.

    Args:
        prefix: the layer's checkpoint prefix, e.g. ``"model.layers.3."``.
        num_experts: E, the layer's experts (the other ranks' are skipped, not read).
    Returns:
        :class:`atom.layers.moe.MoE`'s parameter names → tensors: ``router.weight`` ``[E, H]``,
        and for local expert ``i`` (expert ``start + i``) ``local_experts.{i}.gate_up_proj.weight``
        ``[2 I, H]`` (gate rows, then up) and ``local_experts.{i}.down_proj.weight`` ``[H, I]``.
    Raises:
        ValueError: a tensor of the layout found is missing.
    """
    out: dict[str, torch.Tensor] = {}
    if prefix + _FUSED_GATE_UP in reader:
        out["router.weight"] = reader.take(prefix + _FUSED_ROUTER)
        gate_up = reader.take_rows(prefix + _FUSED_GATE_UP, start, end)
        down = reader.take_rows(prefix + _FUSED_DOWN, start, end)
        for i in range(end - start):
            out[f"local_experts.{i}.gate_up_proj.weight"] = gate_up[i]
            out[f"local_experts.{i}.down_proj.weight"] = down[i]
        return out
    base = f"{prefix}{names.module}experts."
    out["router.weight"] = reader.take(f"{prefix}{names.module}{names.router}.weight")
    for e in range(num_experts):
        expert = [f"{base}{e}.{n}.weight" for n in (names.gate, names.up, names.down)]
        if not start <= e < end:
            for name in expert:
                reader.skip(name)
            continue
        out[f"local_experts.{e - start}.gate_up_proj.weight"] = torch.cat(
            [reader.take(expert[0]), reader.take(expert[1])])
        out[f"local_experts.{e - start}.down_proj.weight"] = reader.take(expert[2])
    return out


#: The 16 values of an FP4 (E2M1) code (OCP Microscaling Formats (MX) v1.0, section 5.3.3):
#: codes 0-7 positive, 8-15 their negatives.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK_SIZE = 32  # FP4 values sharing one scale
MXFP4_SCALE_BIAS = 127  # E8M0 scale: the power of two is the stored byte minus this


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 (OCP Microscaling v1.0): blocks of 32 FP4 E2M1 values sharing one E8M0 scale
    (a power of two), as gpt-oss checkpoints store their experts. Exact: every value is an FP4
    value times a power of two, which float32 and bfloat16 represent exactly.

    Args:
        blocks: uint8 ``[..., G, 16]``: each byte two codes, the low nibble the even element.
        scales: uint8 ``[..., G]``: the exponent plus 127.
        dtype: of the result.
    Returns:
        ``[..., G * 32]`` (row ``r`` of a ``[rows, cols]`` matrix stored as
        ``[rows, cols / 32, 16]`` blocks comes back as that row).
    Raises:
        ValueError: not uint8, or the shapes do not pair up.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} / {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                         f"do not pair up: need blocks [..., G, 16] and scales [..., G]")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]
    values = lut[codes].flatten(-2)  # [..., G, 32], element order restored
    exponents = scales.to(torch.int32).unsqueeze(-1) - MXFP4_SCALE_BIAS
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)


def concat(reader: CheckpointReader, names: Iterable[str]) -> torch.Tensor:
    """The tensors ``names`` concatenated along dim 0 (q/k/v into qkv, gate/up into gate_up)."""
    return torch.cat([reader.take(name) for name in names])


def passthrough(reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor not read yet under the module's name (the checkpoint's without
    ``model.``); a rotary ``inv_freq`` buffer some checkpoints carry is dropped (the model
    computes its own tables)."""
    for name in reader.unread():
        if name.endswith("rotary_emb.inv_freq"):
            reader.skip(name)
            continue
        yield name.removeprefix("model."), reader.take(name)
