"""Linear layers on a GGUF file's own quantized blocks (``--quantization gguf``).

A GGUF weight of type Q4_1 or Q8_0 (the types the embedded SmolLM2 file uses for its matrices
and its embedding / tied LM head) is kept quantized, one row of blocks per output feature, each
block covering 32 consecutive input features. The blocks' fields are stored as planes, the same
bytes as the file (:meth:`QuantizedWeight.from_gguf_blocks`; ``kernels/csrc/gguf_linear.cpp``
says why): the quants, the fp16 scales and, for Q4_1, the fp16 minimums. :func:`gguf_linear`
multiplies float32 activations by such a weight with the compiled kernel: the activations are
quantized to int8 per block of 32 (llama.cpp's Q8_1 scheme, ``ggml-quants.c``) and every block
product is an integer dot product times two scales.

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
#: their block size in bytes in a GGUF file (32 weights each).
Q4_1, Q8_0 = 3, 8
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0"}
BLOCK = 32
_QUANT_BYTES = {Q4_1: 16, Q8_0: 32}  # per block, in the qs plane


@dataclass
class QuantizedWeight:
    """A linear weight ``[out_features, in_features]`` in GGUF blocks, as planes.

    Attributes:
        ggml_type: :data:`Q4_1` or :data:`Q8_0`.
        qs: ``uint8 [N, nb * 16]`` (Q4_1: block ``b``'s 16 bytes of nibbles, element ``j`` in the
            low nibble of byte ``j``, element ``j + 16`` in its high nibble) or ``int8
            [N, nb * 32]`` (Q8_0); ``nb = in_features / 32``.
        d: float16 ``[N, nb_pad]``: each block's scale; ``nb_pad`` = nb rounded up to 8, zeros
            after ``nb`` (the kernel reads the scales 8 blocks at a time).
        m: float16 ``[N, nb_pad]``: Q4_1's block minimums; for Q8_0 an empty tensor.
    """

    ggml_type: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @staticmethod
    def from_gguf_blocks(blocks: torch.Tensor, ggml_type: int) -> QuantizedWeight:
        """Planes from a GGUF tensor's rows of blocks (``uint8 [N, nb * BLOCK_BYTES]``, ggml's
        layout: Q4_1 ``{fp16 d, fp16 m, 16 bytes of nibbles}``, Q8_0 ``{fp16 d, 32 int8}``).

        Raises:
            ValueError: an unsupported type, or rows that are not whole blocks.
        """
        if ggml_type not in BLOCK_BYTES:
            raise ValueError(f"ggml type {ggml_type} is not supported; supported: "
                             f"{sorted(TYPE_NAMES.values())}")
        size = BLOCK_BYTES[ggml_type]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
            raise ValueError(f"{TYPE_NAMES[ggml_type]} blocks must be uint8 [N, multiple of "
                             f"{size}], got {blocks.dtype} {tuple(blocks.shape)}")
        n, nb = blocks.shape[0], blocks.shape[1] // size
        b = blocks.reshape(n, nb, size)

        def scales(offset: int) -> torch.Tensor:
            plane = torch.zeros(n, -(-nb // 8) * 8, dtype=torch.float16)
            plane[:, :nb] = b[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0]
            return plane

        if ggml_type == Q4_1:
            return QuantizedWeight(Q4_1, b[..., 4:].reshape(n, nb * 16).contiguous(), scales(0),
                                   scales(2))
        return QuantizedWeight(Q8_0, b[..., 2:].contiguous().view(torch.int8).reshape(n, nb * 32),
                               scales(0), torch.empty(0, dtype=torch.float16))

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] // _QUANT_BYTES[self.ggml_type] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts' rows one after the other (a fused qkv or gate/up weight); one part is
        returned as it is (no copy: a tied LM head shares the embedding's planes).

        Raises:
            ValueError: the parts differ in type or in ``in_features``.
        """
        if len({(p.ggml_type, p.in_features) for p in parts}) != 1:
            raise ValueError("cannot fuse GGUF weights of different types or widths: "
                             + ", ".join(f"{TYPE_NAMES[p.ggml_type]} [{p.out_features}, "
                                         f"{p.in_features}]" for p in parts))
        first = parts[0]
        if len(parts) == 1:
            return first
        m = torch.cat([p.m for p in parts]) if first.ggml_type == Q4_1 else first.m
        return QuantizedWeight(first.ggml_type, torch.cat([p.qs for p in parts]),
                               torch.cat([p.d for p in parts]), m)

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows ``index`` (int64 ``[N']``), e.g. a permutation of the output features."""
        m = self.m.index_select(0, index) if self.ggml_type == Q4_1 else self.m
        return QuantizedWeight(self.ggml_type, self.qs.index_select(0, index),
                               self.d.index_select(0, index), m)


#: Output rows a tile of :class:`TiledWeight` (the 16 int32 lanes of a 512-bit register).
TILE = 16


@dataclass
class TiledWeight:
    """A :class:`QuantizedWeight` repacked for the tiled kernel (:func:`gguf_linear` runs it on
    this type): the output rows in tiles of :data:`TILE` (the last one padded with zero rows),
    each tile's blocks with the 16 rows' quants interleaved 4 bytes at a time
    (``kernels/csrc/gguf_linear.cpp`` says why). It replaces the planes: a linear holds one or
    the other.

    Attributes:
        ggml_type: :data:`Q4_1` or :data:`Q8_0`.
        out_features: N, the rows before padding.
        wq: ``uint8 [T, nb * Q * 64]``, T = ceil(N / 16), Q = 4 (Q4_1) or 8 (Q8_0): per block,
            vector ``p`` holds bytes ``4p..4p+3`` of each of the 16 rows' quants in turn; Q8_0's
            int8 quants stored as ``q + 128``.
        wd: float16 ``[T, nb, 16]``: the block scales; wm: float16 ``[T, nb, 16]``, Q4_1's
            block minimums (empty for Q8_0). The same bytes as the planes, reordered.
    """

    ggml_type: int
    out_features: int
    wq: torch.Tensor
    wd: torch.Tensor
    wm: torch.Tensor

    @staticmethod
    def from_quantized(weight: QuantizedWeight) -> TiledWeight:
        """Repack ``weight``: the same bytes (Q8_0's quants offset by 128), reordered."""
        n, nb = weight.out_features, weight.in_features // BLOCK
        tiles = -(-n // TILE)
        pad = tiles * TILE - n
        qbytes = _QUANT_BYTES[weight.ggml_type]
        qs = weight.qs.view(torch.uint8)
        if weight.ggml_type == Q8_0:
            qs = qs ^ 0x80  # int8 q -> uint8 q + 128
        qs = torch.nn.functional.pad(qs, (0, 0, 0, pad))
        wq = (qs.reshape(tiles, TILE, nb, qbytes // 4, 4).permute(0, 2, 3, 1, 4)
              .reshape(tiles, nb * qbytes * TILE).contiguous())

        def plane(values: torch.Tensor) -> torch.Tensor:
            values = torch.nn.functional.pad(values[:, :nb], (0, 0, 0, pad))
            return values.reshape(tiles, TILE, nb).transpose(1, 2).contiguous()

        wm = plane(weight.m) if weight.ggml_type == Q4_1 else torch.empty(0, dtype=torch.float16)
        return TiledWeight(weight.ggml_type, n, wq, plane(weight.d), wm)

    @property
    def in_features(self) -> int:
        return self.wd.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.wq, self.wd, self.wm))


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 ``[out_features, in_features]`` values of ``weight`` (ggml's formulas:
    Q4_1 ``d * q + m``, Q8_0 ``d * q``)."""
    n, nb = weight.out_features, weight.in_features // BLOCK
    d = weight.d[:, :nb, None].float()
    if weight.ggml_type == Q4_1:
        qs = weight.qs.view(n, nb, 16)
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # elements 0-15, then 16-31
        values = d * q + weight.m[:, :nb, None].float()
    else:
        values = d * weight.qs.view(n, nb, 32).float()
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


def tiled_kernel_is_simd() -> bool:
    """Whether the tiled kernel (:func:`gguf_linear` on a :class:`TiledWeight`) runs its AVX-512
    VNNI path here (the kernels built on a CPU with AVX-512 F/BW/VL and VNNI); elsewhere it is a
    scalar loop and weights stay untiled."""
    ops = cpu_ops.load()
    return ops is not None and bool(ops.gguf_gemm_tiled_is_simd())


def gguf_linear(x: torch.Tensor, weight: QuantizedWeight | TiledWeight) -> torch.Tensor:
    """``x @ W.T`` with ``W`` in GGUF blocks, by the compiled kernel (multi-threaded over output
    rows, torch's intra-op thread count): the row kernel on a :class:`QuantizedWeight`'s planes
    (the torch reference when the kernels are not built), the tiled kernel on a
    :class:`TiledWeight` (16 output rows per 512-bit register, 8 activation rows a pass: AVX-512
    VNNI; elsewhere a scalar loop that only the tests call). Both quantize the activations the
    same way and compute the same integer block sums.

    Args:
        x: float32 ``[M, in_features]`` (any M, zero included), CPU.
    Returns:
        float32 ``[M, out_features]``.
    Raises:
        RuntimeError: ``x`` is not float32 ``[M, in_features]``, or a :class:`TiledWeight`
            without the compiled kernels (make setup builds them).
    """
    ops = cpu_ops.load()
    if isinstance(weight, TiledWeight):
        if ops is None:
            raise RuntimeError("a TiledWeight needs the compiled kernels (make setup builds "
                               "them); keep the planes (QuantizedWeight) without them")
        x = x if x.stride(-1) == 1 else x.contiguous()
        return ops.gguf_gemm_tiled(x, weight.wq, weight.wd, weight.wm, weight.ggml_type,
                                   weight.out_features)
    if ops is None:
        return gguf_linear_reference(x, weight)
    x = x if x.stride(-1) == 1 else x.contiguous()
    return ops.gguf_linear(x, weight.qs, weight.d, weight.m, weight.ggml_type)
