"""DeepSeek-V2/V3's multi-token-prediction (MTP) layers, the drafter of
``--speculative-method mtp`` (DeepSeek-V3 report, arXiv:2412.19437, section 2.2; vLLM's
``deepseek_mtp.py`` and SGLang's NextN are the serving references).

A checkpoint with ``num_nextn_predict_layers = n`` stores ``n`` such layers at
``model.layers.{num_hidden_layers + i}.*``. Layer ``i`` at position ``p`` takes the target's
last hidden state ``h_p`` (after its final norm: what the target's forward returns, as vLLM and
SGLang feed it) and the embedding of the *next* token ``t_{p+1}``::

    x = eh_proj(concat(enorm(embed(t_{p+1})), hnorm(h_p)))     # 2H -> H
    x = block(x)               # one decoder layer: MLA attention + the layer's MoE or dense MLP
    logits(t_{p+2}) = head(shared_head.norm(x))

and ``x`` (before ``shared_head.norm``) stands in for ``h_{p+1}`` when the layer runs again for
the next draft (one layer reused ``k`` times: vLLM's ``spec_step_idx % num_mtp_layers``). The
embedding and the head are the target's unless the checkpoint has the layer's own
(``embed_tokens``, ``shared_head.head``; DeepSeek-V3's published files repeat the target's).
Its attention keeps a latent KV cache of its own, an extra layer of the target's paged pool
(the same block ids), bound by the model runner.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.kernels.attention import AttentionMetadata
from atom.layers.decoder import DecoderLayer, _materialize
from atom.layers.linear import Linear
from atom.layers.norm import RMSNorm
from atom.layers.weights import CheckpointReader, WeightSource


class MTPLayer(DecoderLayer):
    """One MTP layer: :class:`~atom.layers.decoder.DecoderLayer` (its block, under the
    checkpoint's names) plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``;
    ``embed_tokens`` / ``shared_head.head`` only when the checkpoint has them (else None: the
    target's)."""

    def __init__(self, *, self_attn: nn.Module, mlp: nn.Module, hidden_size: int,
                 rms_norm_eps: float, vocab_size: int, own_embed: bool, own_head: bool) -> None:
        super().__init__(self_attn=self_attn, mlp=mlp, hidden_size=hidden_size,
                         rms_norm_eps=rms_norm_eps)
        self.enorm = RMSNorm(hidden_size, rms_norm_eps)
        self.hnorm = RMSNorm(hidden_size, rms_norm_eps)
        self.eh_proj = Linear(2 * hidden_size, hidden_size)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.shared_head.head = Linear(hidden_size, vocab_size) if own_head else None
        self.embed_tokens = (nn.Embedding(vocab_size, hidden_size,
                                          _weight=torch.empty(vocab_size, hidden_size))
                             if own_embed else None)


class DeepseekMTP(nn.Module):
    """The MTP layers of a DeepSeek model, run beside the target ``target`` (whose embedding,
    head and rotary tables they share). Build with :meth:`from_checkpoint`.

    Owns its layers' weights; the KV caches (one latent cache per layer) belong to the model
    runner (:meth:`bind_kv_caches`). Holds no per-sequence state. The runner attaches it to the
    target as ``target.mtp`` before packing the weights, so the target's
    ``pack_weights`` packs it too and expert parallelism (``moe_layers``) shards its MoE.
    """

    def __init__(self, target: nn.Module, layers: list[MTPLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        # a plain attribute, not a submodule: the target owns (and packs) its weights
        object.__setattr__(self, "target", target)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def from_checkpoint(cls, target, weights: WeightSource, *, num_layers: int,
                        dtype: torch.dtype, expert_shard=None) -> DeepseekMTP:
        """The first ``num_layers`` MTP layers of the checkpoint ``weights`` (Hugging Face
        names) beside the loaded ``target`` (a :class:`~atom.models.deepseek.DeepseekV3ForCausalLM`),
        in ``dtype`` on the target's device; only this rank's experts with ``expert_shard``.

        Raises:
            ValueError: the config has fewer MTP layers, or a tensor is missing, unexpected or
                of the wrong shape.
        """
        config = target.config
        base, available = config.num_hidden_layers, config.family.num_nextn_predict_layers
        if not 1 <= num_layers <= available:
            raise ValueError(f"{num_layers} MTP layer(s) asked for; config.json has "
                             f"num_nextn_predict_layers={available}")
        device = target.embed_tokens.weight.device
        names = set(weights.keys())
        layers = []
        with torch.device("meta"):
            for i in range(num_layers):
                hf = f"model.layers.{base + i}."
                layers.append(MTPLayer(
                    self_attn=target.make_attention(config, base + i),
                    mlp=target.make_mlp(config, base + i, expert_shard),
                    hidden_size=config.hidden_size, rms_norm_eps=config.rms_norm_eps,
                    vocab_size=config.vocab_size, own_embed=hf + "embed_tokens.weight" in names,
                    own_head=hf + "shared_head.head.weight" in names))
            mtp = cls(target, layers)
        _materialize(mtp, device=device, dtype=dtype)
        reader = CheckpointReader(weights)
        params = dict(mtp.named_parameters())
        for i, layer in enumerate(mtp.layers):
            hf, ours = f"model.layers.{base + i}.", f"layers.{i}."
            loaded = list(target.layer_weights(reader, layer, hf=hf, ours=ours))
            loaded += [(ours + name.removeprefix(hf), reader.take(name))
                       for name in reader.unread() if name.startswith(hf)]
            for name, tensor in loaded:
                param = params.pop(name, None)
                if param is None or param.shape != tensor.shape:
                    raise ValueError(f"MTP weight {hf}{name.removeprefix(ours)} of shape "
                                     f"{tuple(tensor.shape)} does not fit this model's MTP layer")
                param.data.copy_(tensor)
        if params:
            raise ValueError(f"missing MTP weights: {sorted(params)[:8]}")
        for layer in mtp.layers:
            layer.self_attn.prepare_absorbed()
        mtp.requires_grad_(False)
        return mtp.eval()

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """One latent KV cache per MTP layer (runner-owned: extra layers of the pool)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} MTP KV caches, got {len(kv_caches)}")
        for layer, cache in zip(self.layers, kv_caches):
            layer.self_attn.kv_cache = cache

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, *, step_idx: int) -> torch.Tensor:
        """One MTP forward with layer ``step_idx % num_layers``.

        Args:
            input_ids: int64 ``[T]``, the token after each position (``t_{p+1}``).
            hidden: ``[T, hidden]`` run dtype: the target's last hidden state at each position
                (or the previous MTP forward's output, for a later draft).
            positions: int64 ``[T]``; the MTP layer's latent rows are written at their slots.
        Returns:
            ``[T, hidden]``, the layer's output before ``shared_head.norm`` (the next draft's
            ``hidden``; :meth:`compute_logits` for the logits).
        """
        target, layer = self.target, self.layers[step_idx % len(self.layers)]
        embed = (layer.embed_tokens(input_ids) if layer.embed_tokens is not None
                 else target.embed(input_ids))
        x = layer.eh_proj(torch.cat([layer.enorm(embed), layer.hnorm(hidden)], dim=-1))
        cos = target.rope_cos.index_select(0, positions)
        sin = target.rope_sin.index_select(0, positions)
        return layer(x, cos, sin, meta)

    def compute_logits(self, x: torch.Tensor, *, step_idx: int) -> torch.Tensor:
        """``x`` ``[S, hidden]`` (:meth:`forward`'s rows) → float32 logits ``[S, vocab]``."""
        layer = self.layers[step_idx % len(self.layers)]
        x = layer.shared_head.norm(x)
        head = layer.shared_head.head
        return head(x).float() if head is not None else self.target.compute_logits(x)
