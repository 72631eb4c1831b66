"""The model runner: turns one scheduled step into a forward pass and returns logits.

It owns the model and the paged KV cache tensors (one per layer, of the shape the model's class
says: :meth:`ModelRunner.kv_cache_specs_of`, :mod:`atom.kv_cache_spec`). It reads sequences and
never mutates them: the scheduler owns sequence state and the block manager owns block tables
(already allocated for every slot this step writes).

A step flattens the scheduled sequences' new tokens into one batch of ``T`` tokens with no batch
dimension: sequences with one new token (decodes, or 1-token chunks) first so attention can run
them as one batched call, then the others (prefill chunks), each group in scheduled order. The
output rows follow the *scheduled* order, whatever the internal order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from atom.core.sequence import Sequence
from atom.kernels.attention import NO_KV_WRITE_SLOT, AttentionMetadata
from atom.kv_cache_spec import (KVCacheSpec, kv_cache_bytes_per_block, kv_cache_groups,
                                kv_cache_slots)
from atom.layers.moe import ExpertShard
from atom.models import get_model_class
from atom.worker.checkpoint import Checkpoint
from atom.worker.model_loader import ModelArchConfig

logger = logging.getLogger(__name__)


@dataclass
class ModelOutput:
    """What one step computed.

    Attributes:
        logits: float32 ``[num_sampled, vocab]``, row ``i`` for ``sampled_seq_ids[i]``.
        sampled_seq_ids: the sequences that reached their last token this step
            (:meth:`~atom.core.sequence.Sequence.samples_next_token`), in scheduled order.
        prompt_logits: ``seq_id -> float32 [n, vocab]`` for sequences that asked for prompt
            logprobs: the logits at the prompt positions ``p`` computed this step with
            ``p < num_prompt_tokens - 1`` (row for position ``p`` predicts token ``p + 1``), in
            position order. A sequence has an entry only if at least one such position ran.
            After a preemption the recomputed prompt positions appear again.
        num_rows: None when no sequence carried draft tokens; else, per sampled sequence, its
            rows in ``logits``: ``1 + len(seq.spec_token_ids)`` (the verify positions of
            speculative decoding: row ``j`` predicts the token after draft ``j``), the rows of
            each sequence consecutive, in ``sampled_seq_ids`` order.
        hidden_states: with MTP layers loaded (the MTP drafter reads them), ``seq_id ->
            (first position, [n, hidden])``: the target's last hidden states (after its final
            norm) at the ``n`` positions of every scheduled sequence computed this step, drafts
            included; None otherwise.
    """

    logits: torch.Tensor
    sampled_seq_ids: list[int]
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    num_rows: list[int] | None = None
    hidden_states: dict[int, tuple[int, torch.Tensor]] | None = None


@dataclass
class _Batch:
    """Host-side layout of one step (see :meth:`ModelRunner._prepare`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_rows: list[int]
    sampled_seq_ids: list[int]
    prompt_rows: dict[int, tuple[int, int]]
    num_rows: list[int] | None = None
    # seq_id -> (first row, rows, first position) of every entry
    seq_rows: dict[int, tuple[int, int, int]] = field(default_factory=dict)


#: Byte alignment of a CPU KV cache's first element: a 64-byte cache line, so a block's rows
#: load with whole-line SIMD reads (the kernels use unaligned loads; this keeps them fast).
_KV_CACHE_ALIGN = 64


def zeroed_kv_cache(shape: tuple[int, ...], *, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache tensor of ``shape`` and ``dtype`` on ``device``.

    On the CPU the memory comes from ``calloc`` (through ``numpy.zeros``), which maps large
    requests to the kernel's zero pages: a page costs memory and time only once a block on it is
    written, so an engine start does not fill its whole pool (about 1 s per 2 GiB here) and the
    resident size follows the blocks in use. The start is aligned to a cache line. Elsewhere
    ``torch.zeros``.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(num_bytes + _KV_CACHE_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _KV_CACHE_ALIGN
    return torch.from_numpy(raw[start:start + num_bytes]).view(dtype).view(shape)


class ModelRunner:
    """Owns the model and the KV cache; executes scheduled steps.

    Args:
        arch_config: the architecture (from :func:`atom.worker.model_loader.load_model_weights`).
        state_dict: Hugging Face-named weights (a :class:`~atom.worker.checkpoint.Checkpoint`,
            or any mapping of tensors); the model is built on their device.
        dtype: run dtype of weights, activations and the KV cache.
        num_kv_blocks: blocks in the KV cache pool (block ids ``0 .. num_kv_blocks - 1``).
        block_size: tokens per block.
        max_model_len: longest sequence (prompt + output) in tokens; sizes the rotary tables.
        moe_split_experts: split every dense MLP into this many experts (model (a) of docs/ARCHITECTURE.md,
            :func:`atom.layers.moe.split_mlps_into_experts`), or None.
        quantized_weights: the GGUF file's own blocks (``--quantization gguf``,
            :func:`atom.worker.model_loader.load_gguf_blocks`) for small steps, or None.
        expert_shard: under expert parallelism, read and hold only this rank's experts of every
            MoE layer (:class:`~atom.layers.moe.ExpertShard`); None = all.
        num_mtp_layers: load this many of the checkpoint's multi-token-prediction layers as
            ``model.mtp`` (``--speculative-method mtp``, :mod:`atom.models.deepseek_mtp`), their
            latent KV caches extra layers of the pool; 0 = none (they are skipped at load).
    Raises:
        ValueError: unsupported architecture, bad weights, or non-positive sizes.
    """

    def __init__(
        self, arch_config: ModelArchConfig, state_dict: Mapping[str, torch.Tensor], *,
        dtype: torch.dtype, num_kv_blocks: int, block_size: int, max_model_len: int,
        moe_split_experts: int | None = None, quantized_weights: dict | None = None,
        expert_shard: ExpertShard | None = None, num_mtp_layers: int = 0,
    ) -> None:
        for name, value in (("num_kv_blocks", num_kv_blocks), ("block_size", block_size),
                            ("max_model_len", max_model_len)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.arch_config = arch_config
        self.dtype = dtype
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        weights = Checkpoint.from_tensors(state_dict)
        self.device = weights.device
        model_cls = get_model_class(arch_config.architecture)
        self.model = model_cls.from_state_dict(
            arch_config, weights, dtype=dtype, max_positions=max_model_len, device=self.device,
            expert_shard=expert_shard)
        self.mtp = None
        if num_mtp_layers:  # a submodule: packed below, its MoE sharded by expert parallelism
            self.mtp = self.model.mtp = self.model.load_mtp(
                weights, num_layers=num_mtp_layers, dtype=dtype, expert_shard=expert_shard)
        del weights
        if quantized_weights is not None and self.device.type == "cpu":
            from atom.kernels import cpu_ops

            if cpu_ops.load() is None:  # the torch reference would dequantize at every step
                logger.warning("quantization gguf needs atom's C++ kernels (%s): running the "
                               "float32 path", cpu_ops.unavailable_reason())
                quantized_weights = None
        if quantized_weights is not None:
            if dtype != torch.float32:
                raise ValueError("GGUF blocks run in float32: pass dtype float32")
            attached = self.model.attach_quantized(quantized_weights)
            logger.info("quantization gguf: %d linear layers / embeddings on GGUF blocks",
                        len(attached))
        if moe_split_experts is not None:
            from atom.layers.moe import split_mlps_into_experts

            split_mlps_into_experts(self.model, moe_split_experts)
        # Last: packing drops the dense linear weights the split above reads.
        self.model.pack_weights()
        # Zero-filled, not empty: the batched decode path reads whole blocks (masked past each
        # context), and masked garbage that happens to be NaN would still poison softmax @ V.
        # Hybrid KV cache groups (atom.kv_cache_spec): layer j of every group shares tensor j
        # (the groups' block ids never overlap), so kv_caches lists one tensor per layer with
        # the same object at each layer of a slot. MTP layers (speculative_method mtp) are
        # extra layers of the pool, after the target's.
        self.kv_cache_specs = specs = self.kv_cache_specs_of(arch_config,
                                                             num_mtp_layers=num_mtp_layers)
        self.kv_cache_groups = kv_cache_groups(specs)
        slots = kv_cache_slots(specs)
        tensors: dict[int, torch.Tensor] = {}
        for spec, slot in zip(specs, slots):
            if slot not in tensors:
                tensors[slot] = zeroed_kv_cache(spec.shape(num_kv_blocks, block_size),
                                                dtype=dtype, device=self.device)
        self.kv_caches = [tensors[slot] for slot in slots]
        layer_groups = [0] * len(specs)
        for g, group in enumerate(self.kv_cache_groups):
            for layer in group.layer_ids:
                layer_groups[layer] = g
        num_target_layers = len(self.kv_caches) - num_mtp_layers
        self.model.bind_kv_caches(self.kv_caches[:num_target_layers],
                                  layer_groups[:num_target_layers])
        if self.mtp is not None:
            self.mtp.bind_kv_caches(self.kv_caches[num_target_layers:])
        # a separate draft model (speculative decoding) that runs every step's forward too, on
        # its own KV cache with the same block ids (atom.engine.core._make_proposers)
        self.shadow_model = None
        if self.device.type == "cpu":
            # Build (first run on this machine: about a minute) or load the compiled attention
            # kernels now, not inside the first decode step: a DP rank compiling mid-step would
            # leave its peers waiting in a collective, possibly past the group timeout.
            from atom.kernels import cpu_ops

            cpu_ops.load()
        logger.info("model runner: %s %s, %d KV blocks x %d tokens (%.1f MiB)",
                    arch_config.architecture, str(dtype).removeprefix("torch."), num_kv_blocks,
                    block_size, num_kv_blocks * self.kv_cache_bytes_per_block(
                        arch_config, dtype=dtype, block_size=block_size) / 2**20)

    @staticmethod
    def kv_cache_specs_of(arch_config: ModelArchConfig, *, num_mtp_layers: int = 0
                          ) -> list[KVCacheSpec]:
        """Each layer's KV cache geometry, as the architecture's model class says (from the
        config alone, before any model is built), then ``num_mtp_layers`` MTP layers' (the
        last layer's geometry: an MTP layer's attention is the target's)."""
        specs = get_model_class(arch_config.architecture).kv_cache_specs(arch_config)
        return specs + specs[-1:] * num_mtp_layers

    @staticmethod
    def kv_cache_bytes_per_block(
        arch_config: ModelArchConfig, *, dtype: torch.dtype, block_size: int,
        num_mtp_layers: int = 0,
    ) -> int:
        """Bytes one KV block takes across all layers (:func:`atom.kv_cache_spec.kv_cache_bytes_per_block`)."""
        return kv_cache_bytes_per_block(
            ModelRunner.kv_cache_specs_of(arch_config, num_mtp_layers=num_mtp_layers),
            itemsize=torch.empty((), dtype=dtype).element_size(), block_size=block_size)

    @torch.inference_mode()
    def execute_model(
        self, scheduled: list[tuple[Sequence, int]], *, num_padding_tokens: int = 0,
        two_batch_overlap: bool = False,
    ) -> ModelOutput:
        """Run one step.

        Args:
            scheduled: ``(sequence, num_new_tokens)`` pairs; computes
                ``seq.token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]``,
                then the sequence's draft tokens (``seq.spec_token_ids``, speculative decoding:
                their slots are reserved too) when that reaches its last token.
                An empty list still runs the forward (on zero tokens), so a DP dummy batch
                issues the same per-layer work and collectives as a real one.
            num_padding_tokens: extra tokens appended after the real ones that write no KV and
                whose outputs are dropped (padding to a token count agreed across ranks).
            two_batch_overlap: run the step as two micro-batches (:func:`atom.worker.tbo.split_batch`)
                whose MoE collectives overlap each other's compute (:mod:`atom.worker.tbo`); the
                outputs are the same. Every DP rank must pass the same value.
        Returns:
            :class:`ModelOutput`.
        Raises:
            ValueError: an entry that does not fit (no new tokens, past the sequence's end or
                ``max_model_len``, a block table too short for its slots), or a batch that
                cannot be split (:func:`atom.worker.tbo.can_split`).
        """
        if two_batch_overlap:
            return self._execute_two_micro_batches(scheduled)
        batch = self._prepare([(seq, 0, n) for seq, n in scheduled], num_padding_tokens)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata)
        if self.shadow_model is not None:  # the draft's KV for the same tokens
            self.shadow_model(batch.input_ids, batch.positions, batch.attn_metadata)
        return self._outputs([(batch, hidden)])

    def _execute_two_micro_batches(self, scheduled: list[tuple[Sequence, int]]) -> ModelOutput:
        from atom.core.tbo_split import split_batch
        from atom.worker.tbo import MicroBatch, forward_micro_batches

        batches = [self._prepare(half, 0) for half in split_batch(scheduled)]
        micro_batches = [MicroBatch(b.input_ids, b.positions, b.attn_metadata) for b in batches]
        forward_micro_batches(self.model, micro_batches)
        if self.shadow_model is not None:
            for b in batches:
                self.shadow_model(b.input_ids, b.positions, b.attn_metadata)
        return self._outputs([(b, mb.hidden) for b, mb in zip(batches, micro_batches)])

    def _outputs(self, parts: list[tuple[_Batch, torch.Tensor]]) -> ModelOutput:
        """Logits of the sampled rows (and prompt rows) of each (batch, hidden) part, in order."""
        logits, sampled, prompt_logits = [], [], {}
        hidden_states = None if self.mtp is None else {}
        for batch, hidden in parts:
            if hidden_states is not None:
                _collect_hidden_states(hidden_states, batch, hidden)
            rows = torch.tensor(batch.sample_rows, dtype=torch.int64, device=self.device)
            logits.append(self.model.compute_logits(hidden.index_select(0, rows)))
            sampled += batch.sampled_seq_ids
            for seq_id, (start, end) in batch.prompt_rows.items():
                part = self.model.compute_logits(hidden[start:end])
                earlier = prompt_logits.get(seq_id)  # a request split across micro-batches
                prompt_logits[seq_id] = part if earlier is None else torch.cat([earlier, part])
        num_rows = parts[0][0].num_rows if len(parts) == 1 else None  # no drafts with TBO
        return ModelOutput(logits=logits[0] if len(logits) == 1 else torch.cat(logits),
                           sampled_seq_ids=sampled, prompt_logits=prompt_logits, num_rows=num_rows,
                           hidden_states=hidden_states)

    def _check_entry(self, seq: Sequence, num_new_tokens: int) -> None:
        end = seq.num_computed_tokens + num_new_tokens
        if num_new_tokens < 1 or end > len(seq.token_ids):
            raise ValueError(
                f"seq {seq.seq_id}: num_new_tokens={num_new_tokens} with num_computed_tokens="
                f"{seq.num_computed_tokens} must cover 1..{len(seq.token_ids)} tokens")
        if end == len(seq.token_ids):
            end += len(seq.spec_token_ids)
        if end > self.max_model_len:
            raise ValueError(f"seq {seq.seq_id}: {end} tokens exceed max_model_len="
                             f"{self.max_model_len}")
        if len(seq.group_block_tables) != len(self.kv_cache_groups) - 1:
            raise ValueError(f"seq {seq.seq_id}: {1 + len(seq.group_block_tables)} block tables "
                             f"for {len(self.kv_cache_groups)} KV cache groups")
        for table in (seq.block_table, *seq.group_block_tables):
            if len(table) * self.block_size < end:
                raise ValueError(
                    f"seq {seq.seq_id}: block table of {len(table)} blocks cannot hold "
                    f"{end} tokens (block size {self.block_size}); allocate blocks before the step")
            if table[(end - 1) // self.block_size] is None:
                raise ValueError(f"seq {seq.seq_id}: the block of token {end - 1} was released")

    def _prepare(self, entries: list[tuple[Sequence, int, int]], num_padding_tokens: int) -> _Batch:
        """Flatten the step: token ids, positions, slots, block tables, output rows.

        ``entries``: ``(seq, offset, num_new_tokens)``, computing the tokens from
        ``seq.num_computed_tokens + offset`` (offset > 0: the second part of a request split
        across micro-batches)."""
        for seq, offset, num_new_tokens in entries:
            self._check_entry(seq, offset + num_new_tokens)
        spec = any(seq.spec_token_ids for seq, _, _ in entries)
        if spec:  # a verify entry computes its last token and its drafts: not a 1-token decode
            entries = [(seq, skip, n + len(seq.spec_token_ids))
                       if seq.spec_token_ids and seq.samples_next_token(skip + n)
                       else (seq, skip, n) for seq, skip, n in entries]
        # Stable partition: one-token entries first (batched decode attention), then the rest.
        order = ([e for e in entries if e[2] == 1] + [e for e in entries if e[2] != 1])
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        context_lens: list[int] = []
        num_groups = len(self.kv_cache_groups)
        group_slots: list[list[int]] = [[] for _ in range(num_groups)]
        group_tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        last_row: dict[int, int] = {}
        prompt_rows: dict[int, tuple[int, int]] = {}
        seq_rows: dict[int, tuple[int, int, int]] = {}
        for seq, skip, num_new_tokens in order:
            start = seq.num_computed_tokens + skip
            end = start + num_new_tokens
            offset = len(input_ids)
            input_ids += seq.token_ids[start:end]
            if end > len(seq.token_ids):  # a verify entry: the drafts follow the last token
                input_ids += seq.spec_token_ids
            positions += range(start, end)
            for g, table in enumerate((seq.block_table, *seq.group_block_tables)):
                group_slots[g] += [table[p // bs] * bs + p % bs for p in range(start, end)]
                # a sliding group's released blocks (None) read as block 0: masked, never read
                group_tables[g].append([0 if b is None else b for b in table[: -(-end // bs)]])
            query_start_loc.append(len(input_ids))
            context_lens.append(end)
            last_row[seq.seq_id] = offset + num_new_tokens - 1
            seq_rows[seq.seq_id] = (offset, num_new_tokens, start)
            if seq.sampling_params.prompt_logprobs is not None:
                prompt_end = min(end, seq.num_prompt_tokens - 1)
                if prompt_end > start:
                    prompt_rows[seq.seq_id] = (offset, offset + prompt_end - start)
        input_ids += [0] * num_padding_tokens
        positions += [0] * num_padding_tokens
        max_blocks = max((len(t) for t in group_tables[0]), default=1)

        def as_tensor(values, shape=None) -> torch.Tensor:
            t = torch.tensor(values, dtype=torch.int64)
            return (t if shape is None else t.view(shape)).to(self.device)

        def group_meta(g: int) -> AttentionMetadata:
            padded = [t + [0] * (max_blocks - len(t)) for t in group_tables[g]]  # block 0: masked
            return AttentionMetadata(
                slot_mapping=as_tensor(group_slots[g] + [NO_KV_WRITE_SLOT] * num_padding_tokens),
                query_start_loc=query_start_loc, context_lens=context_lens,
                block_tables=as_tensor(padded, (len(padded), max_blocks)),
                num_decodes=num_decodes, context_lens_tensor=context_lens_tensor)

        num_decodes = sum(1 for _, _, n in order if n == 1)
        context_lens_tensor = as_tensor(context_lens)
        meta = group_meta(0)
        meta.group_metadata = tuple(group_meta(g) for g in range(1, num_groups))
        sampled, sample_rows, num_rows = [], [], []
        for seq, skip, n in entries:
            if seq.samples_next_token(skip + n):  # rows for its last token and each draft
                num_drafts = seq.num_computed_tokens + skip + n - len(seq.token_ids)
                sampled.append(seq.seq_id)
                last = last_row[seq.seq_id]
                sample_rows += range(last - num_drafts, last + 1)
                num_rows.append(num_drafts + 1)
        return _Batch(
            input_ids=as_tensor(input_ids), positions=as_tensor(positions), attn_metadata=meta,
            sample_rows=sample_rows, sampled_seq_ids=sampled, prompt_rows=prompt_rows,
            num_rows=num_rows if spec else None, seq_rows=seq_rows,
        )


def _collect_hidden_states(out: dict[int, tuple[int, torch.Tensor]], batch: _Batch,
                           hidden: torch.Tensor) -> None:
    """Add ``batch``'s rows of ``hidden`` to ``out`` (``seq_id -> (first position, rows)``); a
    sequence split across two micro-batches continues where its first part ended."""
    for seq_id, (row, num, position) in batch.seq_rows.items():
        rows = hidden[row:row + num]
        earlier = out.get(seq_id)
        out[seq_id] = (position, rows) if earlier is None else (
            earlier[0], torch.cat([earlier[1], rows]))
