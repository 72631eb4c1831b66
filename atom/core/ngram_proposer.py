"""Speculative decoding proposers: who guesses the next ``k`` tokens of a decoding sequence.

A proposer reads sequences and returns draft tokens; the target model then scores all of them
in one verify forward (:mod:`atom.worker.rejection_sampler` decides which are kept). Every proposer
here is *deterministic* given the sequence: its proposal distribution ``q`` is a point mass,
which is what the verifier's rejection rule assumes (accept a draft ``d`` with probability
``p(d)``, else resample from ``norm(max(0, p - q))``; Leviathan et al. 2023, Chen et al. 2023).

Two kinds, behind one interface (:class:`Proposer`):

- :class:`NgramProposer` (prompt lookup decoding, Saxena 2023; vLLM's ``ngram`` method): find
  the last ``n`` tokens earlier in the sequence's own tokens and propose what followed them. No
  model, no torch: the scheduler runs it while it reserves slots, so a step's token count is
  exact when it is scheduled (and the DP batch shape carries it).
- the early-exit draft (``atom.worker.draft_proposer.EarlyExitProposer``): the target's first ``L``
  layers, final norm and LM head, run ``k`` times after scheduling. It needs the model, so it
  lives beside the model runner.

Torch-free on purpose (the scheduler imports this module).
"""

from __future__ import annotations

import abc

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from atom.core.sequence import Sequence


class Proposer(abc.ABC):
    """Proposes draft tokens for decoding sequences.

    ``runs_in_scheduler``: True for proposers cheap and torch-free enough to run inside
    ``Scheduler.schedule`` (their proposal length sets the reservation); False for model-based
    proposers, which fill exactly the slots the scheduler reserved, after scheduling.
    """

    runs_in_scheduler: bool = False

    @abc.abstractmethod
    def propose(self, seqs: list[Sequence], max_num_tokens: list[int]) -> list[list[int]]:
        """Draft tokens for each sequence: at most ``max_num_tokens[i]`` for ``seqs[i]``
        (vocabulary ids, following ``seqs[i].token_ids``). Reads the sequences only."""


class NgramProposer(Proposer):
    """Prompt lookup: match the sequence's last ``n`` tokens (``prompt_lookup_max`` down to
    ``prompt_lookup_min``) against its earlier tokens, prompt and output alike; at the latest
    earlier match, propose the tokens that followed it (at most ``max_num_tokens``). No match:
    no drafts (the sequence decodes one token as without speculation).

    Args:
        prompt_lookup_min / prompt_lookup_max: n-gram lengths tried, longest first (tokens).
    Raises:
        ValueError: ``1 <= prompt_lookup_min <= prompt_lookup_max`` does not hold.
    """

    runs_in_scheduler = True

    def __init__(self, *, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({prompt_lookup_max})")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, seqs: list[Sequence], max_num_tokens: list[int]) -> list[list[int]]:
        return [self.propose_one(seq.token_ids, k) for seq, k in zip(seqs, max_num_tokens)]

    def propose_one(self, token_ids: list[int], max_num_tokens: int) -> list[int]:
        """Drafts following ``token_ids`` (see the class docstring); ``[]`` when none match."""
        num_tokens = len(token_ids)
        if max_num_tokens < 1 or num_tokens < self.prompt_lookup_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), self.prompt_lookup_min - 1, -1):
            # windows starting at 0 .. num_tokens - 1 - n: every earlier occurrence of the
            # suffix (the suffix itself, starting at num_tokens - n, is excluded)
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[num_tokens - n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start:start + max_num_tokens].tolist()
        return []
