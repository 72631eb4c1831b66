"""The early-exit draft: the target model's first ``L`` layers, final norm and LM head.

It proposes ``m`` draft tokens for a decoding sequence with ``m`` single-token forwards (greedy:
the argmax of the draft's logits, so the proposal is a point mass, as
:mod:`atom.worker.rejection_sampler` assumes): forward ``j`` feeds the last real token (``j = 0``) or
draft ``j`` at position ``len(token_ids) - 1 + j``. Lineage: early-exit / self-speculative
drafting (LayerSkip, Elhoushi et al. 2024; Draft & Verify, Zhang et al. 2023).

**A separate draft model** (``--draft-model``) runs the same way on its own runner: its KV
cache has the target's geometry in blocks (the same block ids, its own heads and layers), and
its forward runs on every step's batch beside the target's (``ModelRunner.shadow_model``), so
it holds the draft's KV of every token whose target KV exists (prefix-cache hits included:
a block's two caches are written by the same steps). Not for a P/D consumer's pulled blocks,
which bring the target's KV only: drafts there are poor, still verified exactly.

**KV cache: the target's own first ``L`` layers, reused.** The draft's layer ``i < L`` is the
target's layer ``i`` with the same weights, so for every token whose KV the target computed,
the draft's KV at layers ``< L`` is exactly what the target's cache already holds: the draft
needs no cache of its own and no prefill. Its forwards write K/V only at the positions the
scheduler reserved for this step's verify (the last token and the drafts but the last), and the
verify forward, which runs next, overwrites every one of those positions at every layer with
the target's values before any later step reads them; rejected positions lie past the
sequence's computed tokens, are never read, and their blocks are given back. Nothing the
draft writes is ever hashed into the prefix cache.
"""

from __future__ import annotations

import torch

from atom.kernels.attention import AttentionMetadata
from atom.core.ngram_proposer import Proposer
from atom.core.sequence import Sequence


class EarlyExitProposer(Proposer):
    """Drafts with the first ``num_layers`` layers of the model runner's model.

    Args:
        runner: the target's :class:`atom.worker.model_runner.ModelRunner` (its model and KV cache),
            or a separate draft model's (``--draft-model``: its own KV cache, which its forward
            beside every target step keeps filled, ``ModelRunner.shadow_model``).
        num_layers: draft layers, 1 .. the target's layer count.
    Raises:
        ValueError: ``num_layers`` outside that range.
    """

    runs_in_scheduler = False

    def __init__(self, runner, *, num_layers: int):
        num_target_layers = runner.arch_config.num_hidden_layers
        if not 1 <= num_layers <= num_target_layers:
            raise ValueError(f"draft_num_layers={num_layers} must be in 1..{num_target_layers} "
                             f"(the draft model's layers)")
        self.runner = runner
        self.num_layers = num_layers

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_num_tokens: list[int], *,
                num_steps: int | None = None) -> list[list[int]]:
        """Exactly ``max_num_tokens[i]`` drafts for ``seqs[i]`` (their slots must be reserved:
        positions up to ``len(token_ids) - 1 + max_num_tokens[i]``).

        ``num_steps``: draft forwards to run (default: the largest ``max_num_tokens``); more
        run on zero tokens, as a DP rank does to keep its forwards in step with the others'.
        """
        drafts: list[list[int]] = [[] for _ in seqs]
        steps = max(max_num_tokens, default=0) if num_steps is None else num_steps
        for j in range(steps):
            active = [i for i, m in enumerate(max_num_tokens) if m > j]
            tokens = [seqs[i].token_ids[-1] if j == 0 else drafts[i][-1] for i in active]
            positions = [len(seqs[i].token_ids) - 1 + j for i in active]
            logits = self._forward(tokens, positions, [seqs[i].block_table for i in active])
            for i, token in zip(active, logits.argmax(dim=-1).tolist()):
                drafts[i].append(token)
        return drafts

    def _forward(self, tokens: list[int], positions: list[int], tables: list[list[int]]
                 ) -> torch.Tensor:
        """One single-token-per-sequence forward of the draft; float32 ``[S, vocab]`` logits."""
        runner = self.runner
        bs, device = runner.block_size, runner.device
        if not tokens:
            meta = AttentionMetadata.empty(0, device=device)
        else:
            lens = [p + 1 for p in positions]
            trimmed = [t[: -(-n // bs)] for t, n in zip(tables, lens)]
            width = max(len(t) for t in trimmed)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions)],
                                          dtype=torch.int64, device=device),
                query_start_loc=list(range(len(tokens) + 1)),
                context_lens=lens,
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in trimmed],
                                          dtype=torch.int64, device=device),
                num_decodes=len(tokens),
                context_lens_tensor=torch.tensor(lens, dtype=torch.int64, device=device))
        hidden = runner.model(torch.tensor(tokens, dtype=torch.int64, device=device),
                              torch.tensor(positions, dtype=torch.int64, device=device),
                              meta, num_layers=self.num_layers)
        return runner.model.compute_logits(hidden)
