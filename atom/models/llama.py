"""The Llama family (Llama, SmolLM2, Mistral without a sliding window): the shared decoder
(:class:`atom.layers.decoder.DecoderForCausalLM`: RMSNorm, rotary embeddings in Hugging Face's
``rotate_half`` convention, so GGUF q/k rows are un-permuted at load, grouped-query attention,
SiLU-gated MLP, optionally tied input/output embeddings), plus what only this family has: a
GGUF file's own quantized blocks (``--quantization gguf``, :meth:`LlamaForCausalLM.attach_quantized`)
and, with them, each decoder layer of a small pure-decode step as one compiled call
(:meth:`LlamaDecoderLayer.decode_on_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from atom.kernels import cpu_ops
from atom.kernels.attention import AttentionMetadata
from atom.kernels.gguf import QuantizedWeight, TiledWeight, embedding, tiled_kernel_is_simd
from atom.layers.decoder import DecoderForCausalLM, DecoderLayer
from atom.layers.linear import QUANTIZED_MAX_ROWS
from atom.layers.mlp import GatedMLP


class LlamaDecoderLayer(DecoderLayer):
    """:class:`~atom.layers.decoder.DecoderLayer` plus the one-call decode on GGUF blocks."""

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


class LlamaForCausalLM(DecoderForCausalLM):
    """The Llama decoder plus LM head (:class:`~atom.layers.decoder.DecoderForCausalLM`), with
    GGUF blocks when attached. Build with :meth:`from_state_dict`."""

    layer_class = LlamaDecoderLayer

    def __init__(self, config, *, max_positions: int, expert_shard=None) -> None:
        super().__init__(config, max_positions=max_positions, expert_shard=expert_shard)
        self.embed_qweight: QuantizedWeight | None = None  # attach_quantized
        # every layer on GGUF blocks and the kernels built: pure decode steps of at most
        # QUANTIZED_MAX_ROWS tokens run each layer as one compiled call (set by pack_weights)
        self.decode_on_blocks = False

    def attach_quantized(self, blocks: dict[str, QuantizedWeight]) -> list[str]:
        """Give the linear layers (and the embedding) the GGUF file's own blocks
        (``--quantization gguf``; :func:`atom.worker.model_loader.load_gguf_blocks`): small-batch
        forwards then read those (:class:`~atom.layers.linear.Linear`), and the embedding lookup dequantizes its
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
        """:meth:`DecoderForCausalLM.pack_weights`; with GGUF blocks on the embedding
        (:meth:`attach_quantized`) its dense matrix is dropped and the lookup reads the blocks,
        and when every layer is on blocks, small decode steps run them as one call each."""
        super().pack_weights()
        if self.embed_qweight is not None:
            self.embed_tokens = None
        self.decode_on_blocks = all(
            isinstance(layer.mlp, GatedMLP) and all(
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

    def run_layers(self, layers: Sequence[LlamaDecoderLayer], x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        if (self.decode_on_blocks and 0 < num_tokens <= QUANTIZED_MAX_ROWS
                and meta.num_decodes == num_tokens):  # decodes only, no padding
            ops = cpu_ops.load()
            for layer in layers:
                layer.decode_on_blocks(ops, x, cos, sin, meta)
            return x
        return super().run_layers(layers, x, cos, sin, meta)
