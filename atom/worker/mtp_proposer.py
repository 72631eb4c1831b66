"""The MTP draft (``--speculative-method mtp``): DeepSeek's multi-token-prediction layer(s)
(:mod:`atom.models.deepseek_mtp`) propose ``m`` tokens from the target's last hidden states.

It runs at the same point of the step as the early-exit draft (after scheduling, into the slots
the scheduler reserved; :meth:`atom.engine.core.EngineCore.run_drafts`), so it draws on the same
lockstep rules under DP: ``num_steps`` forwards, the extra ones on zero tokens.

**Hidden states, kept until drafted from.** The MTP layer at position ``p`` needs the target's
hidden state ``h_p`` and the token ``t_{p+1}``, which for the last computed position is the
token sampled after the forward. So the worker hands every step's hidden rows to
:meth:`MTPProposer.record` (``ModelOutput.hidden_states``), and the proposer keeps, per
sequence, the rows of the positions its MTP layer has not run yet (from ``start``). A rejected
draft's row lies at or past the sequence's computed tokens and is cut off when the next forward's
rows arrive (they start at the computed count); a recompute after a preemption starts over.

**Forward ``j = 0`` catches up**: per drafting sequence with ``num_computed_tokens = c``, the
positions ``[start, c)`` (after a verify: the last token and the accepted drafts; after a
prefill: the prompt) with tokens ``t_{start+1} .. t_c`` and rows ``h_start .. h_{c-1}``, a
prefill-shaped entry over the MTP layer's KV of the earlier positions; its last row gives draft
1. **Forward ``j >= 1``** feeds draft ``j`` and the previous forward's output at position
``c - 1 + j`` (one token per sequence), with layer ``j % num_mtp_layers``. The MTP KV of those
positions lies in reserved slots and is rewritten by the next catch-up with the target's own
hidden states once the tokens are accepted; rejected positions are never read.

Limits, none of which changes an output token (the verifier decides): the MTP KV of prefix-cache
hits is whatever the blocks' first owner wrote (nothing when it never drafted), and that of a
full block's last position depends on the token after the block, which sharing sequences may not
agree on; with several MTP layers, layer ``i > 0`` only ever sees the draft positions (forward 0,
the catch-up, runs layer 0). Costs: a prompt's hidden rows are held until its first draft, which
runs the MTP layer over the whole prompt; under DP + EP every draft forward of a step pads its
MoE collectives to that step's largest draft forward (the catch-up's), one size for all ``k``.
"""

from __future__ import annotations

import torch

from atom.core.ngram_proposer import Proposer
from atom.core.sequence import Sequence
from atom.kernels.attention import AttentionMetadata


class MTPProposer(Proposer):
    """Drafts with the MTP layers of the model runner's model (``runner.mtp``).

    Owns the per-sequence hidden rows not drafted from yet (:meth:`record`, :meth:`release`).

    Args:
        runner: the target's :class:`~atom.worker.model_runner.ModelRunner`, built with
            ``num_mtp_layers >= 1``.
    """

    runs_in_scheduler = False

    def __init__(self, runner):
        assert runner.mtp is not None, "the runner has no MTP layers"
        self.runner = runner
        self.mtp = runner.mtp
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (start, rows)

    # ----- the hidden rows -----

    def record(self, hidden_states: dict[int, tuple[int, torch.Tensor]]) -> None:
        """Keep a step's hidden rows (``seq_id -> (first position, [n, hidden])``, the
        :class:`~atom.worker.model_runner.ModelOutput`'s), after the rows kept before them."""
        for seq_id, (position, rows) in hidden_states.items():
            kept = self._pending.get(seq_id)
            if kept is not None and kept[0] <= position <= kept[0] + kept[1].shape[0]:
                start, earlier = kept
                self._pending[seq_id] = (start, torch.cat([earlier[:position - start], rows]))
            else:  # the first forward, or a recompute (preemption): start over
                self._pending[seq_id] = (position, rows.clone())

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's rows."""
        self._pending.pop(seq_id, None)

    def num_catch_up_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s first draft forward (its positions not run by the MTP yet); 0
        when it cannot draft (:meth:`_has_rows`)."""
        return seq.num_computed_tokens - self._pending[seq.seq_id][0] if self._has_rows(seq) else 0

    def _has_rows(self, seq: Sequence) -> bool:
        """Whether the rows up to ``seq``'s last computed position are here. Not for a
        sequence whose KV came from elsewhere (a P/D consumer's pulled prompt): it gets no
        drafts this step, and its rows build up from its next forward on."""
        kept = self._pending.get(seq.seq_id)
        return kept is not None and kept[0] < seq.num_computed_tokens <= kept[0] + kept[1].shape[0]

    # ----- drafting -----

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_num_tokens: list[int], *,
                num_steps: int | None = None) -> list[list[int]]:
        """``max_num_tokens[i]`` drafts for ``seqs[i]`` (their slots reserved up to position
        ``len(token_ids) - 1 + max_num_tokens[i]``), none for a sequence without its hidden
        rows (:meth:`_has_rows`); ``num_steps``: MTP forwards to run (default: the largest
        ``max_num_tokens``), the extra ones on zero tokens (a DP rank keeping its collectives
        in step with the others')."""
        drafts: list[list[int]] = [[] for _ in seqs]
        steps = max(max_num_tokens, default=0) if num_steps is None else num_steps
        max_num_tokens = [m if self._has_rows(seq) else 0 for seq, m in zip(seqs, max_num_tokens)]
        hidden: dict[int, torch.Tensor] = {}  # i -> the previous forward's last row [1, H]
        for j in range(steps):
            active = [i for i, m in enumerate(max_num_tokens) if m > j]
            if j == 0:
                entries = [self._catch_up(seqs[i]) for i in active]
            else:
                entries = [([drafts[i][-1]], hidden[i], len(seqs[i].token_ids) - 2 + j,
                            seqs[i].block_table) for i in active]
            last = self._forward(entries, step_idx=j)
            logits = self.mtp.compute_logits(last, step_idx=j) if active else None
            for row, i in enumerate(active):
                hidden[i] = last[row:row + 1]
                drafts[i].append(int(logits[row].argmax()))
        return drafts

    def _catch_up(self, seq: Sequence) -> tuple[list[int], torch.Tensor, int, list[int]]:
        """``seq``'s first-forward entry (tokens, hidden rows, first position, block table);
        its rows are consumed (the next ones start at its computed count)."""
        start, rows = self._pending[seq.seq_id]
        end = seq.num_computed_tokens
        self._pending[seq.seq_id] = (end, rows[end - start:])
        return seq.token_ids[start + 1:end + 1], rows[:end - start], start, seq.block_table

    def _forward(self, entries: list[tuple[list[int], torch.Tensor, int, list[int]]], *,
                 step_idx: int) -> torch.Tensor:
        """One MTP forward over ``entries`` (tokens, hidden rows, first position, block
        table); returns each entry's last output row ``[len(entries), hidden]``."""
        runner = self.runner
        device = runner.device
        # one-token entries first (the batched decode attention), as the model runner orders
        order = sorted(range(len(entries)), key=lambda e: len(entries[e][0]) != 1)
        bs = runner.block_size
        tokens, positions, slots, starts, lens, tables = [], [], [], [0], [], []
        for e in order:
            ids, _, first, table = entries[e]
            span = range(first, first + len(ids))
            tokens += ids
            positions += span
            slots += [table[p // bs] * bs + p % bs for p in span]
            starts.append(len(tokens))
            lens.append(span.stop)
            tables.append(table[: -(-span.stop // bs)])
        if not entries:
            meta = AttentionMetadata.empty(0, device=device)
            hidden = torch.empty(0, runner.arch_config.hidden_size, dtype=runner.dtype,
                                 device=device)
        else:
            width = max(len(t) for t in tables)

            def as_tensor(values) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int64, device=device)

            meta = AttentionMetadata(
                slot_mapping=as_tensor(slots), query_start_loc=starts, context_lens=lens,
                block_tables=as_tensor([t + [0] * (width - len(t)) for t in tables]),
                num_decodes=sum(1 for e in order if len(entries[e][0]) == 1),
                context_lens_tensor=as_tensor(lens))
            hidden = torch.cat([entries[e][1] for e in order])
        out = self.mtp(torch.tensor(tokens, dtype=torch.int64, device=device), hidden,
                       torch.tensor(positions, dtype=torch.int64, device=device), meta,
                       step_idx=step_idx)
        last = torch.empty(len(entries), out.shape[1], dtype=out.dtype, device=device)
        for k, e in enumerate(order):
            last[e] = out[starts[k + 1] - 1]
        return last
