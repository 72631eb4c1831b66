"""Linear layers on a GGUF file's own quantized blocks (``--quantization gguf``).

A GGUF weight of type Q4_1 or Q8_0 (the types the embedded SmolLM2 file uses for its matrices
and its embedding / tied LM head) is kept as ``uint8 [N, K / 32 * block_bytes]``: one row of
blocks per output feature, each block covering 32 consecutive input features, in ggml's layout
(``kernels/csrc/gguf_linear.cpp`` describes it). :func:`gguf_linear` multiplies float32
activations by such a weight with the compiled kernel: the activations are quantized to int8
per block of 32 (llama.cpp's Q8_1 scheme, ``ggml-quants.c``) and every block product is an
integer dot product times two scales.

The torch references here (:func:`dequantize`, :func:`quantize_activations`,
:func:`gguf_linear_reference`) compute the same numbers with plain torch ops (the kernel differs
only in float summation order); the tests compare the two, and :func:`dequantize` against the
``gguf`` package's own dequantizer.

Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.kernels import cpu_ops

#: ggml's type ids (``gguf.GGMLQuantizationType``) of the block types the kernel reads, and
#: their block size in bytes (32 weights each).
Q4_1, Q8_0 = 3, 8
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0"}
BLOCK = 32


@dataclass
class QuantizedWeight:
    """A linear weight ``[out_features, in_features]`` in GGUF blocks.

    Attributes:
        blocks: ``uint8 [out_features, in_features / 32 * BLOCK_BYTES[ggml_type]]``, contiguous.
        ggml_type: :data:`Q4_1` or :data:`Q8_0`.
    """

    blocks: torch.Tensor
    ggml_type: int

    def __post_init__(self) -> None:
        if self.ggml_type not in BLOCK_BYTES:
            raise ValueError(f"ggml type {self.ggml_type} is not supported; supported: "
                             f"{sorted(TYPE_NAMES.values())}")
        if (self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2
                or self.blocks.shape[1] % BLOCK_BYTES[self.ggml_type]):
            raise ValueError(f"{TYPE_NAMES[self.ggml_type]} blocks must be uint8 [N, "
                             f"multiple of {BLOCK_BYTES[self.ggml_type]}], got "
                             f"{self.blocks.dtype} {tuple(self.blocks.shape)}")
        self.blocks = self.blocks.contiguous()

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1] // BLOCK_BYTES[self.ggml_type] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts' rows one after the other (a fused qkv or gate/up weight).

        Raises:
            ValueError: the parts differ in type or in ``in_features``.
        """
        if len({(p.ggml_type, p.blocks.shape[1]) for p in parts}) != 1:
            raise ValueError("cannot fuse GGUF weights of different types or widths: "
                             + ", ".join(f"{TYPE_NAMES[p.ggml_type]} [{p.out_features}, "
                                         f"{p.in_features}]" for p in parts))
        return QuantizedWeight(torch.cat([p.blocks for p in parts]), parts[0].ggml_type)

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows ``index`` (int64 ``[N']``), e.g. a permutation of the output features."""
        return QuantizedWeight(self.blocks.index_select(0, index), self.ggml_type)


def _fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block, as float32 ``[..., 1]``."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 ``[out_features, in_features]`` values of ``weight`` (ggml's formulas:
    Q4_1 ``d * q + m``, Q8_0 ``d * q``)."""
    n, nb = weight.out_features, weight.in_features // BLOCK
    b = weight.blocks.view(n, nb, BLOCK_BYTES[weight.ggml_type])
    d = _fp16(b, 0)
    if weight.ggml_type == Q4_1:
        qs = b[..., 4:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # elements 0-15, then 16-31
        values = d * q + _fp16(b, 2)
    else:
        values = d * b[..., 2:].contiguous().view(torch.int8).float()
    return values.reshape(n, nb * BLOCK)


def embedding(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[T]``) of an embedding matrix in GGUF blocks: float32 ``[T, dim]``."""
    return dequantize(weight.select_rows(ids))


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32 ``[M, K]``, K a multiple of 32) after the kernel's int8 quantization,
    dequantized back to float32: per block of 32, ``d = max|x| / 127``,
    ``q = round_half_even(x * (1 / d))``, value ``d * q``."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(m, k)


def gguf_linear_reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """What :func:`gguf_linear` computes, in torch: ``quantize_activations(x) @ dequantize(W).T``."""
    return quantize_activations(x) @ dequantize(weight).T


def kernel_available() -> bool:
    """Whether the compiled kernel is loaded (:mod:`atom.kernels.cpu_ops`)."""
    return cpu_ops.load() is not None


def gguf_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x @ W.T`` with ``W`` in GGUF blocks, by the compiled kernel (multi-threaded over output
    rows, torch's intra-op thread count), or the torch reference when it is not built.

    Args:
        x: float32 ``[M, in_features]`` (any M, zero included), CPU.
    Returns:
        float32 ``[M, out_features]``.
    Raises:
        RuntimeError: ``x`` is not float32 ``[M, in_features]``.
    """
    ops = cpu_ops.load()
    if ops is None:
        return gguf_linear_reference(x, weight)
    return ops.gguf_linear(x if x.stride(-1) == 1 else x.contiguous(), weight.blocks,
                           weight.ggml_type)
