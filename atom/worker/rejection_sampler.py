"""Verification of speculative drafts: which proposed tokens a sequence keeps, and one more.

The verify forward gives, for a sequence with drafts ``d_1 .. d_m``, the target's logits at
``m + 1`` positions: row ``j`` predicts the token after ``d_j`` (row 0: after the last real
token). Each row goes through the same logits processors as an ordinary step would apply at
that position (:meth:`atom.worker.sampler.Sampler.process_row`, with the drafts before it as the
would-be output tokens: penalties, ``min_tokens`` and logit bias see exactly what they would
have seen without speculation), then temperature, min_p / top_k / top_p.

- **Greedy**: accept ``d_{j+1}`` while it equals the argmax of row ``j``; then emit the argmax
  of the first row that disagrees (or of row ``m`` when all were accepted). The output is the
  non-speculative greedy output, token for token.
- **Sampling**: the rejection rule of Leviathan et al. 2023 ("Fast Inference from Transformers
  via Speculative Decoding", arXiv:2211.17192) and Chen et al. 2023 (arXiv:2302.01318):
  accept ``d`` with probability ``min(1, p(d) / q(d))``; at the first rejection emit a token
  from ``norm(max(0, p - q))`` and stop; when all are accepted emit one from the last row's
  ``p``. Every emitted token is then distributed as ``p``, the target's distribution, whatever
  the proposal. Our proposers are deterministic (``q`` a point mass at the draft), so a draft
  is accepted with probability ``p(d)`` and a rejection resamples from ``p`` with ``d`` removed.

Rows are evaluated lazily, in order, and only up to the first rejection. The uniform draws and
the resampling noise come from the sequence's generator (:meth:`Sampler.generator_for`: its own
for a seeded request), so a seeded request with the same drafts draws the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from atom.kernels import fused
from atom.worker.sampler import Sampler, filter_probs, needs_processing, sample_from, top_logprobs
from atom.core.sequence import Sequence


@dataclass
class VerifyOutput:
    """Per sequence, in input order.

    Attributes:
        token_ids: the emitted tokens: the accepted drafts, then one token (1 .. m + 1 ids).
        logprobs: per emitted token, {token_id: logprob} as the sampler reports them, or None
            when the request did not ask for logprobs.
        sampled_logprobs: per emitted token, its raw logprob (float).
    """

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float] | None]]
    sampled_logprobs: list[list[float]]


def rejection_sample(target_probs: Callable[[int], torch.Tensor] | torch.Tensor,
                     draft_token_ids: list[int], generator: torch.Generator, *,
                     draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens a sampled sequence keeps of its drafts, plus one (module docstring).

    Args:
        target_probs: the target's float32 probabilities, ``[m + 1, vocab]`` or a function of
            the row ``j`` returning ``[vocab]`` (called for rows 0, 1, ... up to the first
            rejection only).
        draft_token_ids: the ``m`` drafts.
        generator: source of the uniform draws and of the resampling noise.
        draft_probs: float32 ``[m, vocab]``, the distributions the drafts were drawn from;
            None = a deterministic proposer (a point mass at each draft).
    Returns:
        1 .. m + 1 token ids.
    """
    row = target_probs.__getitem__ if isinstance(target_probs, torch.Tensor) else target_probs
    out: list[int] = []
    for j, draft in enumerate(draft_token_ids):
        p = row(j)
        q_draft = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        u = float(torch.rand((), generator=generator))
        if u * q_draft < float(p[draft]):  # u < p / q: accepted with probability min(1, p / q)
            out.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:  # only by rounding: p and q equal where q > 0
            residual = p
        out.append(sample_from(residual, generator))
        return out
    out.append(sample_from(row(len(draft_token_ids)), generator))
    return out


class RejectionSampler:
    """Verifies drafts for a batch of sequences (module docstring); reads the sequences only.

    Args:
        sampler: the engine's sampler (its EOS ids for the min_tokens mask, its generators).
    """

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], *,
                 token_bitmask: dict | None = None) -> VerifyOutput:
        """Verify each sequence's drafts.

        Args:
            logits: float32 ``[R, vocab]``, ``R = sum(len(d) + 1 for d in drafts)``: for each
                sequence in order, its ``len(drafts[i]) + 1`` rows (module docstring).
            seqs: the verified sequences.
            drafts: their draft tokens (possibly empty: one ordinary sampled token).
            token_bitmask: seq_id -> its grammar's allowed tokens
                (:func:`atom.worker.sampler.apply_token_bitmask`), for constrained sequences,
                which never have drafts (the scheduler reserves none for them).
        Raises:
            ValueError: ``logits`` does not have ``R`` rows.
        """
        num_rows = sum(len(d) + 1 for d in drafts)
        if logits.shape[0] != num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows for {num_rows} verify positions")
        logits = logits.float()
        log_norm, raw_argmax = fused.logsumexp_argmax(logits)
        argmax = raw_argmax.tolist()
        out = VerifyOutput([], [], [])
        start = 0
        for seq, seq_drafts in zip(seqs, drafts):
            mask = (token_bitmask or {}).get(seq.seq_id)
            assert mask is None or not seq_drafts, "a constrained sequence got drafts"
            tokens = self._verify_one(logits, start, argmax, seq, seq_drafts, mask)
            rows = range(start, start + len(tokens))
            k = seq.sampling_params.logprobs
            out.token_ids.append(tokens)
            out.sampled_logprobs.append([float(logits[r, t] - log_norm[r]) for r, t in zip(rows, tokens)])
            out.logprobs.append([None if k is None else top_logprobs(logits[r] - log_norm[r], t, k)
                                 for r, t in zip(rows, tokens)])
            start += len(seq_drafts) + 1
        return out

    def _verify_one(self, logits: torch.Tensor, start: int, argmax: list[int], seq: Sequence,
                    drafts: list[int], mask=None) -> list[int]:
        params = seq.sampling_params
        # later rows have more output tokens: a min_tokens mask can only end, never start
        processing = needs_processing(params, seq.num_output_tokens) or mask is not None

        def processed(j: int) -> torch.Tensor:
            row = logits[start + j].clone()
            if processing:
                self.sampler.process_row(row, params, seq.prompt_token_ids,
                                         seq.output_token_ids + drafts[:j], token_bitmask=mask)
            return row

        if params.greedy:
            out = []
            for j in range(len(drafts) + 1):
                target = argmax[start + j] if not processing else int(processed(j).argmax())
                out.append(target)
                if j == len(drafts) or drafts[j] != target:
                    return out
            return out

        def probs(j: int) -> torch.Tensor:
            return filter_probs(processed(j) / params.temperature, top_k=params.top_k,
                                top_p=params.top_p, min_p=params.min_p)

        first = probs(0)
        generator = self.sampler.generator_for(seq, first)
        return rejection_sample(lambda j: first if j == 0 else probs(j), drafts, generator)
