"""Token sampling for one step: logits processors, greedy / random sampling, logprobs.

Order of operations on the float32 logits of the sequences sampled this step (vLLM's order):
logit_bias → min_tokens mask (EOS and stop ids) → penalties (repetition, then frequency and
presence) → the grammar's token bitmask (structured outputs: disallowed tokens to -inf) → greedy argmax, or temperature → min_p / top_k / top_p → sample. Logprobs are
reported from the raw model distribution (before any processing), as vLLM v1 does by default.

Random sampling uses the exponential-race form of the Gumbel trick: ``argmax(p / E)`` with
``E ~ Exp(1)`` draws from ``p``. A seeded request draws its noise from its own
``torch.Generator`` (seeded with ``seed`` for choice 0 and ``seed + index`` for choice ``index``
of an ``n > 1`` request, as vLLM derives its child requests' seeds), so its tokens do not depend
on the other sequences in the batch, nor on the DP rank that runs it. Unseeded requests share
their rank's generator, seeded from the engine's ``seed`` *and* the DP rank
(:func:`rank_stream_seed`): ranks built from one config never share a stream, or the k-th
unseeded request of every rank would draw the same noise (and, for identical prompts, the same
text).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from atom.kernels import fused
from atom.sampling_params import SamplingParams
from atom.core.sequence import Sequence

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    """Results for S sampled sequences, in input order.

    Attributes:
        token_ids: list of S sampled token ids.
        logprobs: per sequence, {token_id: logprob} of the top ``logprobs`` tokens plus the
            sampled token (see :func:`top_logprobs`), or None when the request did not ask
            for logprobs.
        sampled_logprobs: per sequence, the raw logprob of the sampled token (float).
    """

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    sampled_logprobs: list[float]


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from float32 ``[vocab]`` probabilities (unnormalized is fine) by the
    exponential race (``argmax(p / E)``, ``E ~ Exp(1)``): every sampled token's, the
    speculative verifier's resampling included."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def rank_stream_seed(seed: int, dp_rank: int) -> int:
    """The seed of DP rank ``dp_rank``'s shared generator (unseeded requests): numpy's
    ``SeedSequence`` over ``(seed, dp_rank)``, so every rank of one deployment has an
    independent stream and the same ``(seed, dp_rank)`` always gives the same one.

    Raises:
        ValueError: a negative ``seed`` or ``dp_rank``.
    """
    if seed < 0 or dp_rank < 0:
        raise ValueError(f"seed and dp_rank must be >= 0, got {seed} and {dp_rank}")
    return int(np.random.SeedSequence([seed, dp_rank]).generate_state(1, np.uint64)[0])


class Sampler:
    """Samples one token per sequence; owns this rank's shared generator (unseeded requests)
    and the per-request generators of seeded requests.

    Args:
        eos_token_ids: ids masked while a sequence is below its ``min_tokens``.
        seed: the engine's seed; with ``dp_rank`` it seeds the shared generator
            (:func:`rank_stream_seed`).
        dp_rank: the DP rank this sampler runs on.
    """

    def __init__(self, eos_token_ids: tuple[int, ...] = (), seed: int = 0, *, dp_rank: int = 0):
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator().manual_seed(rank_stream_seed(seed, dp_rank))
        self._seq_generators: dict[int, torch.Generator] = {}

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's generator."""
        self._seq_generators.pop(seq_id, None)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], *,
                 token_bitmask: dict[int, np.ndarray] | None = None) -> SamplerOutput:
        """Sample the next token of each sequence.

        Args:
            logits: float32 ``[S, vocab]`` next-token logits, one row per sequence of ``seqs``.
            seqs: the sampled sequences (read only; the scheduler appends the tokens).
            token_bitmask: seq_id -> its grammar's allowed tokens (int32 ``[ceil(vocab / 32)]``
                bits, :mod:`atom.core.structured_output`) for the constrained sequences.
        """
        logits = logits.float()
        bitmask = token_bitmask or {}
        # [S]: raw logprob = logit - log_norm; and the raw argmax, the greedy token when no
        # logits processor applies (one fused pass: atom.kernels.fused)
        log_norm, raw_argmax = fused.logsumexp_argmax(logits)
        if bitmask or any(_needs_processing(seq) for seq in seqs):
            processed = self._process(logits.clone(), seqs, bitmask)
            token_ids = self._sample(processed, seqs, processed.argmax(dim=-1))
        else:
            token_ids = self._sample(logits, seqs, raw_argmax)
        sampled_lp = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1) - log_norm
        token_list = token_ids.tolist()
        logprobs: list[dict[int, float] | None] = []
        for row, seq in enumerate(seqs):
            k = seq.sampling_params.logprobs
            logprobs.append(None if k is None else
                            top_logprobs(logits[row] - log_norm[row], token_list[row], k))
        return SamplerOutput(token_list, logprobs, sampled_lp.tolist())

    def _process(self, logits: torch.Tensor, seqs: list[Sequence],
                 bitmask: dict[int, np.ndarray]) -> torch.Tensor:
        for row, seq in enumerate(seqs):
            if _needs_processing(seq):
                self.process_row(logits[row], seq.sampling_params, seq.prompt_token_ids,
                                 seq.output_token_ids)
        rows = [row for row, seq in enumerate(seqs) if seq.seq_id in bitmask]
        if rows:  # last, as process_row does; one unpack for every constrained row
            masks = np.stack([bitmask[seqs[row].seq_id] for row in rows])
            allowed = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")
            index = torch.tensor(rows)
            logits[index] = logits[index].masked_fill(
                torch.from_numpy(allowed[:, :logits.shape[1]] == 0), _NEG_INF)
        return logits

    def process_row(self, logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int], *, token_bitmask: np.ndarray | None = None) -> None:
        """Apply the logits processors to one position's float32 ``[vocab]`` logits in place:
        logit_bias, the min_tokens mask, penalties, as if the sequence had ``output_ids``
        (the speculative verifier passes each draft position's would-be outputs), then
        ``token_bitmask`` (a grammar's allowed tokens: :func:`apply_token_bitmask`)."""
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            logits[ids] += torch.tensor(list(params.logit_bias.values()))
        if len(output_ids) < params.min_tokens:
            masked = params.stop_token_ids + ([] if params.ignore_eos else self.eos_token_ids)
            if masked:
                logits[masked] = _NEG_INF
        if params.needs_penalties:
            apply_penalties(logits, prompt_ids, output_ids,
                            presence_penalty=params.presence_penalty,
                            frequency_penalty=params.frequency_penalty,
                            repetition_penalty=params.repetition_penalty)
        if token_bitmask is not None:
            apply_token_bitmask(logits, token_bitmask)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy_ids: torch.Tensor
                ) -> torch.Tensor:
        """Greedy rows keep ``greedy_ids`` (the argmax of ``logits``); the others are drawn."""
        token_ids = greedy_ids
        for row, seq in enumerate(seqs):
            params = seq.sampling_params
            if params.greedy:
                continue
            probs = filter_probs(logits[row] / params.temperature, top_k=params.top_k,
                                 top_p=params.top_p, min_p=params.min_p)
            token_ids[row] = sample_from(probs, self.generator_for(seq, probs))
        return token_ids

    def generator_for(self, seq: Sequence, probs: torch.Tensor) -> torch.Generator:
        """The generator of ``seq``'s noise (``probs``: this draw's row).

        A seeded sequence's generator is made at its first draw and advanced by one draw per
        output token it already has: none for a new sequence, and for a request resumed after a
        rank failure exactly the draws that produced its tokens (each token took one row of
        noise of this shape), so it samples what it would have sampled undisturbed."""
        seed = seq.sampling_params.seed
        if seed is None:
            return self.generator
        gen = self._seq_generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator().manual_seed(seed + seq.index)
            for _ in range(seq.num_output_tokens):
                torch.empty_like(probs).exponential_(generator=gen)
            self._seq_generators[seq.seq_id] = gen
        return gen


def _needs_processing(seq: Sequence) -> bool:
    """Whether :meth:`Sampler._process` would change this sequence's logits."""
    return needs_processing(seq.sampling_params, seq.num_output_tokens)


def needs_processing(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether :meth:`Sampler.process_row` would change the logits of a sequence with
    ``num_output_tokens`` output tokens."""
    return bool(params.logit_bias) or params.needs_penalties or (
        num_output_tokens < params.min_tokens)


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    """Set the logits of the tokens ``bitmask`` does not allow to -inf, in place.

    Args:
        logits: float32 ``[vocab]`` logits of one position.
        bitmask: int32 ``[ceil(vocab / 32)]``: bit ``t % 32`` (least significant first) of word
            ``t // 32`` set = token ``t`` allowed (llguidance's and xgrammar's layout).
    """
    vocab = logits.shape[0]
    allowed = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), bitorder="little")
    logits.masked_fill_(torch.from_numpy(allowed[:vocab] == 0), _NEG_INF)


def top_logprobs(logprobs: torch.Tensor, token_id: int, k: int) -> dict[int, float]:
    """The ``k`` most likely tokens and ``token_id``: ``{token_id: logprob}`` (vLLM semantics).

    Args:
        logprobs: float32 ``[vocab]`` log-probabilities of one position.
        token_id: the sampled (or prompt) token, always included.
        k: number of top entries (0 = only ``token_id``).
    Returns:
        ``k`` entries in descending order, then ``token_id`` if it is not among them
        (``k + 1`` entries in that case, like vLLM and the OpenAI API).
    """
    entry: dict[int, float] = {}
    if k > 0:
        values, ids = logprobs.topk(k)
        entry = dict(zip(ids.tolist(), values.tolist()))
    entry.setdefault(token_id, float(logprobs[token_id]))
    return entry


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], *,
                    presence_penalty: float, frequency_penalty: float,
                    repetition_penalty: float) -> None:
    """Penalize repeated tokens in place (vLLM semantics).

    Args:
        logits: float32 ``[vocab]`` logits of one sequence, modified in place.
        prompt_ids / output_ids: token ids seen so far.
        presence_penalty: subtracted once from every token that appeared in the output.
        frequency_penalty: subtracted once per occurrence in the output.
        repetition_penalty: for tokens in prompt or output, positive logits are divided by it
            and negative ones multiplied (CTRL, Keskar et al. 2019).
    """
    vocab = logits.shape[0]
    if repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(prompt_ids + output_ids, dtype=torch.long)] = True
        penalized = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    if output_ids and (presence_penalty or frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab]
        logits -= frequency_penalty * counts.float()
        logits -= presence_penalty * (counts > 0).float()


def filter_probs(logits: torch.Tensor, *, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Probabilities after min_p, top_k and top_p filtering (renormalized).

    Args:
        logits: float32 ``[vocab]`` temperature-scaled logits.
        top_k: keep the k largest (0 = off). top_p: keep the smallest set whose mass ≥ top_p
            (1 = off). min_p: drop tokens below ``min_p × max prob`` (0 = off).
    Returns:
        float32 ``[vocab]`` probabilities summing to 1.
    """
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0.0:
        probs = torch.where(probs < min_p * probs.max(), 0.0, probs)
    if top_k > 0 and top_k < probs.shape[0]:
        kth = probs.topk(top_k).values[-1]
        probs = torch.where(probs < kth, 0.0, probs)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0) / sorted_probs.sum()
        # keep a token if the mass before it is still below top_p (the top token always stays)
        drop_sorted = (cumulative - sorted_probs / sorted_probs.sum()) >= top_p
        probs = probs.scatter(0, order, torch.where(drop_sorted, 0.0, sorted_probs))
    return probs / probs.sum()
