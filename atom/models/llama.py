"""Llama-family decoder in plain torch (gpt-fast style), over a paged KV cache.

Covers Llama / SmolLM2 / Mistral-without-sliding-window: RMSNorm, rotary embeddings (Hugging
Face ``rotate_half`` convention, so GGUF q/k rows must be un-permuted at load), grouped-query
attention, SiLU-gated MLP, optionally tied input/output embeddings; and Mixtral, the same
decoder with a top-k mixture of experts (:class:`atom.layers.moe.MoE`) in place of the MLP.

The forward takes the flattened tokens of a mixed batch (prefill chunks and decodes): no batch
dimension, no padding. Attention goes through :mod:`atom.kernels.attention`.

Weights are fused at load (``q/k/v_proj`` → ``qkv_proj``, ``gate/up_proj`` → ``gate_up_proj``):
one GEMM instead of three (two) per layer, which matters for small-batch decode where each GEMM
is latency bound. :meth:`LlamaForCausalLM.pack_weights` then swaps every linear weight for
oneDNN's pre-packed copy (:mod:`atom.kernels.linear`) once the model is final.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from atom.kernels import cpu_ops, fused
from atom.kernels.attention import AttentionMetadata, paged_attention
from atom.kernels.gguf import (QuantizedWeight, TiledWeight, embedding, gguf_linear,
                               tiled_kernel_is_simd)
from atom.kernels.linear import pack_weight, packed_linear
from atom.layers.moe import MoE

if TYPE_CHECKING:
    from atom.worker.model_loader import ModelArchConfig

#: The most rows (tokens of a step; sampled rows for the LM head) a linear layer with GGUF
#: blocks computes with the row kernel; above it the float GEMM is faster on this machine's
#: measurements (``scripts/bench_gguf_linear.py``, docs/PERFORMANCE.md). Where the tiled kernel
#: has its AVX-512 VNNI path, it beats the float GEMM at every row count measured (1-2,048)
#: and takes every forward; this limit then only bounds the one-call decode layer.
QUANTIZED_MAX_ROWS = 16


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as Hugging Face's ``LlamaRMSNorm``
    (:func:`atom.kernels.fused.rms_norm`). With ``residual``, normalizes ``residual + x`` and
    leaves that sum in ``residual`` (in place)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps, residual)


class Linear(nn.Module):
    """``y = x @ weight.T`` without bias; :meth:`pack_weight` swaps in oneDNN's packed copy.

    Before packing, ``weight`` is an ``[out_features, in_features]`` parameter and the forward is
    ``F.linear``. After a successful :meth:`pack_weight`, ``weight`` is None and the forward runs
    on ``packed_weight`` (:func:`atom.kernels.linear.packed_linear`); the dense copy is dropped,
    so pack only once nothing reads ``weight`` any more.

    With ``qweight`` (the GGUF file's own blocks, ``--quantization gguf``), a forward of at most
    :data:`QUANTIZED_MAX_ROWS` rows runs the quantized kernel
    (:func:`atom.kernels.gguf.gguf_linear`) and a larger one the float GEMM above; when
    ``qweight`` is tiled (:class:`~atom.kernels.gguf.TiledWeight`, AVX-512 VNNI CPUs), every
    forward runs the quantized kernel.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.packed_weight: torch.Tensor | None = None
        self.qweight: QuantizedWeight | TiledWeight | None = None

    def pack_weight(self) -> None:
        """Keep only oneDNN's packed copy of the weight; a no-op where it cannot be packed.
        With tiled GGUF blocks (every forward reads them) the float weight is dropped instead."""
        if isinstance(self.qweight, TiledWeight):
            self.weight = None
            return
        if self.weight is None:
            return
        packed = pack_weight(self.weight)
        if packed is not None:
            self.packed_weight = packed
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None and (isinstance(self.qweight, TiledWeight)
                                         or x.shape[0] <= QUANTIZED_MAX_ROWS):
            return gguf_linear(x, self.qweight)
        if self.packed_weight is None:
            return F.linear(x, self.weight)
        return packed_linear(x, self.packed_weight)


def rotary_cos_sin(
    *, head_dim: int, rope_theta: float, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, head_dim]`` float32 (HF default rope, no scaling).

    Frequencies are computed in float32 as HF does (``inv_freq = theta ** (-2i / d)``); the
    tables are cast to the run dtype at use, like HF's rotary embedding output.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_theta ** exponents)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class LlamaAttention(nn.Module):
    """Self-attention with fused QKV; reads/writes the layer's paged KV cache.

    ``kv_cache`` (``[2, num_blocks, block_size, H_kv, D]``) is bound by the model runner, which
    owns it; this module only writes the slots of the current step's tokens.
    """

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        fused.rotary_embedding_(qkv, cos, sin, num_heads=self.num_heads,
                                num_kv_heads=self.num_kv_heads)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        assert self.kv_cache is not None, "bind_kv_caches() must run before the forward"
        out = paged_attention(q, k, v, self.kv_cache, meta, scale=self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SiLU-gated MLP with fused gate/up projection: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config) if not config.num_experts else MoE(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_experts=config.num_experts, top_k=config.num_experts_per_tok)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, h = self.attention_stage(x, cos, sin, meta)
        return x + self.mlp(h)

    def decode_on_blocks(self, ops, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         meta: AttentionMetadata) -> None:
        """The layer for a pure decode step on GGUF blocks, as one compiled call
        (``llama_decode_layer_``, ``kernels/csrc/decode_layer.cpp``): the same ops as
        :meth:`forward` in the same order, so the same result, except that with fewer sequences
        than threads attention splits each context across the threads (equal up to rounding);
        ``x`` (float32 ``[T, hidden]``, contiguous) becomes the layer's output in place. Only for
        layers :meth:`LlamaForCausalLM.pack_weights` found ready (every linear on blocks)."""
        weights, (num_heads, num_kv_heads, scale) = self._block_args
        ops.llama_decode_layer_(x, *weights, self.self_attn.kv_cache, meta.slot_mapping,
                                meta.block_tables, meta.context_lens_tensor, cos, sin, num_heads,
                                num_kv_heads, scale)

    def bind_block_args(self) -> None:
        """Collect :meth:`decode_on_blocks`' fixed arguments once (module attribute lookups
        cost more than the call at one token a step)."""
        a, m = self.self_attn, self.mlp
        linears = [lin.qweight for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
        weights = (self.input_layernorm.weight, self.post_attention_layernorm.weight,
                   self.input_layernorm.eps,
                   [t for w in linears for t in ((w.wq, w.wd, w.wm) if isinstance(w, TiledWeight)
                                                 else (w.qs, w.d, w.m))],
                   [w.ggml_type for w in linears])
        self._block_args = (weights, (a.num_heads, a.num_kv_heads, a.scale))

    def attention_stage(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its MLP: returns (the residual stream after attention, the MLP's
        normalized input), both ``[T, hidden]``. The layer's output is ``x + mlp(h)``; the
        two-batch-overlap executor (:mod:`atom.worker.tbo`) runs the MLP's stages itself."""
        h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta),
                                          residual=x)  # x += attention output, in place
        return x, h


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. Build with :meth:`from_state_dict`.

    Owns its weights and the rotary tables; the KV caches belong to the model runner and are
    bound with :meth:`bind_kv_caches`.
    """

    def __init__(self, config: ModelArchConfig, *, max_positions: int) -> None:
        super().__init__()
        self.config = config
        # an explicit weight: nn.Embedding's own init (normal_) imports torch._dynamo under the
        # meta device (seconds of every engine start, and of every recovery from a rank failure)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied embeddings: from_state_dict points lm_head.weight at the embedding matrix.
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.embed_qweight: QuantizedWeight | None = None  # attach_quantized
        # every layer on GGUF blocks and the kernels built: pure decode steps of at most
        # QUANTIZED_MAX_ROWS tokens run each layer as one compiled call (set by pack_weights)
        self.decode_on_blocks = False
        self.max_positions = max_positions

    @classmethod
    def from_state_dict(
        cls, config: ModelArchConfig, state_dict: dict[str, torch.Tensor], *,
        dtype: torch.dtype, max_positions: int, device: torch.device | str = "cpu",
    ) -> LlamaForCausalLM:
        """Build the model from Hugging Face parameter names, fusing QKV and gate/up.

        Args:
            state_dict: HF names (``model.layers.N.self_attn.q_proj.weight``, ...);
                ``lm_head.weight`` is ignored when the embeddings are tied. Tensors are cast to
                ``dtype``.
            max_positions: size of the rotary tables (positions ``[0, max_positions)``).
        Raises:
            ValueError: a missing, unexpected or wrongly shaped weight.
        """
        # Meta device first: skips the random init of ~100M parameters we overwrite anyway.
        with torch.device("meta"):
            model = cls(config, max_positions=max_positions)
        model = model.to_empty(device=device).to(dtype)
        params = dict(model.named_parameters())
        if config.tie_word_embeddings:
            del params["lm_head.weight"]
        for name, tensor in _fused_hf_weights(config, state_dict).items():
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for a {config.architecture} model")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, the config implies "
                    f"{tuple(params[name].shape)}: check the model's config")
            params[name].data.copy_(tensor)
            del params[name]
        if params:
            raise ValueError(f"missing weights: {sorted(params)[:8]}")
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        cos, sin = rotary_cos_sin(head_dim=config.head_dim, rope_theta=config.rope_theta,
                                  max_positions=max_positions)
        model.register_buffer("rope_cos", cos.to(device=device, dtype=dtype), persistent=False)
        model.register_buffer("rope_sin", sin.to(device=device, dtype=dtype), persistent=False)
        model.requires_grad_(False)
        return model.eval()

    def attach_quantized(self, blocks: dict[str, QuantizedWeight]) -> list[str]:
        """Give the linear layers (and the embedding) the GGUF file's own blocks
        (``--quantization gguf``; :func:`atom.worker.model_loader.load_gguf_blocks`): small-batch
        forwards then read those (:class:`Linear`), and the embedding lookup dequantizes its
        rows. q/k/v and gate/up are fused like the float weights; a fused layer whose parts are
        not all in blocks of one type keeps the float path. Where the tiled kernel has its
        AVX-512 VNNI path (:func:`atom.kernels.gguf.tiled_kernel_is_simd`), each linear gets
        its blocks repacked in tiles instead of the planes (:class:`~atom.kernels.gguf.TiledWeight`)
        and every forward reads them (:meth:`pack_weights` then drops those linears' float
        weights); elsewhere steps of more than :data:`QUANTIZED_MAX_ROWS`
        rows use the float weights (the packed GEMM), which stay.

        Args:
            blocks: Hugging Face names -> blocks (rows in torch order).
        Returns:
            The names of the modules that got blocks (``layers.0.self_attn.qkv_proj``, ...,
            ``lm_head``, ``embed_tokens``).
        Raises:
            ValueError: a block matrix's shape differs from the layer's.
        """
        c = self.config
        hf = {k.removeprefix("model."): v for k, v in blocks.items()}
        if c.tie_word_embeddings and "embed_tokens.weight" in hf:
            hf["lm_head.weight"] = hf["embed_tokens.weight"]
        parts: dict[str, list[str]] = {"embed_tokens": ["embed_tokens.weight"],
                                       "lm_head": ["lm_head.weight"]}
        for i in range(c.num_hidden_layers):
            a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            parts[a + "qkv_proj"] = [a + f"{n}_proj.weight" for n in "qkv"]
            parts[a + "o_proj"] = [a + "o_proj.weight"]
            parts[m + "gate_up_proj"] = [m + "gate_proj.weight", m + "up_proj.weight"]
            parts[m + "down_proj"] = [m + "down_proj.weight"]
        modules = dict(self.named_modules())
        tiled = tiled_kernel_is_simd()
        attached = []
        for name, sources in parts.items():
            module = modules.get(name)
            if module is None or not all(s in hf for s in sources):
                continue  # an MoE block, or a tensor stored in a type the kernels do not read
            try:  # parts of different types or widths cannot fuse: that layer stays float
                weight = QuantizedWeight.cat([hf[s] for s in sources])
            except ValueError:
                continue
            expected = tuple(module.weight.shape)
            if (weight.out_features, weight.in_features) != expected:
                raise ValueError(f"GGUF blocks for {name} are [{weight.out_features}, "
                                 f"{weight.in_features}], the layer is {list(expected)}")
            if name == "embed_tokens":
                self.embed_qweight = weight
            else:
                module.qweight = TiledWeight.from_quantized(weight) if tiled else weight
            attached.append(name)
        return attached

    def pack_weights(self) -> None:
        """Swap every :class:`Linear`'s weight for oneDNN's packed copy (faster GEMMs on CPU,
        :mod:`atom.kernels.linear`). Call once the model is final (after any MoE split, which
        reads the dense MLP weights). With tied embeddings the LM head keeps a packed copy of
        the embedding matrix, which the embedding lookup still reads dense, unless the
        embedding has GGUF blocks (:meth:`attach_quantized`): then the dense matrix is dropped
        and the lookup reads the blocks."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_weight()
        if self.embed_qweight is not None:
            self.embed_tokens = None
        self.decode_on_blocks = all(
            isinstance(layer.mlp, LlamaMLP) and all(
                lin.qweight is not None for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj))
            for layer in self.layers) and self.rope_cos.dtype == torch.float32 and (
            self.rope_cos.device.type == "cpu" and cpu_ops.load() is not None)
        if self.decode_on_blocks:
            for layer in self.layers:
                layer.bind_block_args()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of int64 ``[T]`` ids: ``[T, hidden]`` in the run dtype."""
        if self.embed_tokens is None:
            return embedding(self.embed_qweight, input_ids)
        return self.embed_tokens(input_ids)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Bind each layer's ``[2, num_blocks, block_size, H_kv, D]`` KV cache (runner-owned)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} KV caches, got {len(kv_caches)}")
        for layer, cache in zip(self.layers, kv_caches):
            layer.self_attn.kv_cache = cache

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
        *, num_layers: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: int64 ``[T]``. Returns the final-norm hidden states ``[T, hidden]``
        in the run dtype. Writes the new tokens' K/V (non-padding slots) to every layer's cache.

        ``num_layers``: run only the first this many layers, then the final norm (the early-exit
        draft of speculative decoding, :mod:`atom.worker.draft_proposer`); None = all."""
        x = self.embed(input_ids)
        cos = self.rope_cos.index_select(0, positions)
        sin = self.rope_sin.index_select(0, positions)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        num_tokens = input_ids.shape[0]
        if (self.decode_on_blocks and 0 < num_tokens <= QUANTIZED_MAX_ROWS
                and attn_metadata.num_decodes == num_tokens):  # decodes only, no padding
            ops = cpu_ops.load()
            for layer in layers:
                layer.decode_on_blocks(ops, x, cos, sin, attn_metadata)
            return self.norm(x)
        for layer in layers:
            x = layer(x, cos, sin, attn_metadata)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[S, hidden]`` run dtype → logits ``[S, vocab]`` float32 (GEMM in run dtype,
        as Hugging Face does, then upcast)."""
        return self.lm_head(hidden).float()


def _fused_hf_weights(
    config: ModelArchConfig, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Map HF parameter names to this module's names, concatenating q/k/v and gate/up."""
    sd = dict(state_dict)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    out: dict[str, torch.Tensor] = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        try:
            qkv = [sd.pop(f"{p}self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
            if config.num_experts:  # Mixtral checkpoints: w1 = gate, w3 = up, w2 = down
                moe = f"{p}block_sparse_moe."
                experts = range(config.num_experts)
                out[f"layers.{i}.mlp.router.weight"] = sd.pop(f"{moe}gate.weight")
                out[f"layers.{i}.mlp.gate_up_proj"] = torch.stack([torch.cat(
                    [sd.pop(f"{moe}experts.{e}.w1.weight"), sd.pop(f"{moe}experts.{e}.w3.weight")])
                    for e in experts])
                out[f"layers.{i}.mlp.down_proj"] = torch.stack(
                    [sd.pop(f"{moe}experts.{e}.w2.weight") for e in experts])
            else:
                gate_up = [sd.pop(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
                out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(gate_up, dim=0)
        except KeyError as exc:
            raise ValueError(f"missing weight {exc.args[0]!r}") from None
        out[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(qkv, dim=0)
    for name, tensor in sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some old checkpoints carry; we compute our own
        out[name.removeprefix("model.")] = tensor
    return out
