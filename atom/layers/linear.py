"""The linear layer every family's projections use: a plain ``[out, in]`` weight until
:meth:`Linear.pack_weight` swaps in oneDNN's packed copy (:mod:`atom.kernels.linear`), and
optionally a GGUF file's own quantized blocks for small steps (``--quantization gguf``; the
Llama family attaches them, :meth:`atom.models.llama.LlamaForCausalLM.attach_quantized`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.kernels.gguf import QuantizedWeight, TiledWeight, gguf_linear
from atom.kernels.linear import pack_weight, packed_linear, small_linear, small_linear_max_rows

#: The most rows (tokens of a step; sampled rows for the LM head) a linear layer with GGUF
#: blocks computes with the row kernel; above it the float GEMM is faster on this machine's
#: measurements (``scripts/bench_gguf_linear.py``, docs/PERFORMANCE.md). Where the tiled kernel
#: has its AVX-512 VNNI path, it beats the float GEMM at every row count measured (1-2,048)
#: and takes every forward; this limit then only bounds the one-call decode layer.
QUANTIZED_MAX_ROWS = 16


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)``; :meth:`pack_weight` swaps in oneDNN's packed copy.

    Before packing, ``weight`` is an ``[out_features, in_features]`` parameter and the forward is
    ``F.linear``. After a successful :meth:`pack_weight`, ``weight`` is None and the forward runs
    on ``packed_weight`` (:func:`atom.kernels.linear.packed_linear`); the dense copy is dropped,
    so pack only once nothing reads ``weight`` any more. Where the compiled small-linear kernel
    runs (float32 / bfloat16 on AVX-512 CPUs), ``weight`` is kept too and forwards of at most
    ``small_rows`` rows run that kernel on it
    (:func:`~atom.kernels.linear.small_linear_max_rows`: 16 for a weight of at most 256 KB such
    as a MoE router, 1 for larger ones): a oneDNN call's fixed cost is more than a small
    product, and its one-row path reads a large weight slower than the kernel. Such weights are
    then held twice (the plain and the packed copy).

    With ``qweight`` (the GGUF file's own blocks, ``--quantization gguf``), a forward of at most
    :data:`QUANTIZED_MAX_ROWS` rows runs the quantized kernel
    (:func:`atom.kernels.gguf.gguf_linear`) and a larger one the float GEMM above; when
    ``qweight`` is tiled (:class:`~atom.kernels.gguf.TiledWeight`, AVX-512 VNNI CPUs), every
    forward runs the quantized kernel.

    With ``bias=True`` (gpt-oss's attention and experts) a ``bias`` parameter ``[out_features]``
    is added on every path but the GGUF one (GGUF models have no biases).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False) if bias
                     else None)
        self.packed_weight: torch.Tensor | None = None
        self.qweight: QuantizedWeight | TiledWeight | None = None
        self.small_rows = 0  # forwards of at most this many rows run small_linear (pack_weight)

    def pack_weight(self) -> None:
        """Add oneDNN's packed copy of the weight, and drop the plain one unless the
        small-linear kernel runs here (``small_rows``, class docstring); a no-op where it cannot
        be packed. With tiled GGUF blocks (every forward reads them) the float weight is dropped
        instead."""
        if isinstance(self.qweight, TiledWeight):
            self.weight = None
            return
        if self.weight is None:
            return
        packed = pack_weight(self.weight)
        if packed is not None:
            self.packed_weight = packed
            self.small_rows = small_linear_max_rows(self.weight) if self.qweight is None else 0
            if not self.small_rows:
                self.weight = None

    @property
    def dtype(self) -> torch.dtype:
        """The float weight's dtype (packed or not)."""
        return (self.weight if self.weight is not None else self.packed_weight).dtype

    @property
    def device(self) -> torch.device:
        """The float weight's device (packed or not)."""
        return (self.weight if self.weight is not None else self.packed_weight).device

    def dense_weight(self) -> torch.Tensor:
        """The ``[out_features, in_features]`` weight, read back from oneDNN's packed copy
        when packed (a new tensor then)."""
        return self.weight.detach() if self.weight is not None else self.packed_weight.to_dense()

    def set_weight(self, weight: torch.Tensor) -> None:
        """Make ``weight`` (``[out_features, in_features]``, kept as given: a view stays a
        view) this layer's unpacked weight."""
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.packed_weight = None
        self.small_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None and (isinstance(self.qweight, TiledWeight)
                                         or x.shape[0] <= QUANTIZED_MAX_ROWS):
            return gguf_linear(x, self.qweight)
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        if x.dim() == 2 and 0 < x.shape[0] <= self.small_rows and x.stride(-1) == 1:
            return small_linear(x, self.weight, self.bias)
        return packed_linear(x, self.packed_weight, self.bias)
