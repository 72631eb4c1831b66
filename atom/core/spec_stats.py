"""Speculative decoding statistics of one engine core (ATOM's ``SpecStats`` quantities).

Counted per *verify*: one sequence scoring its drafts in one forward. Torch-free.

- accepted-length distribution: how many verifies accepted 0, 1, ..., k drafts;
- acceptance rate: accepted draft tokens / proposed draft tokens;
- mean tokens per forward: tokens a verify emitted (accepted drafts plus the one the target
  adds, after any stop cut) averaged over verifies: 1 without speculation, at most k + 1;
- per-position acceptance (vLLM's ``num_accepted_tokens_per_pos``): how many verifies accepted
  draft ``j`` (and so every draft before it), ``j = 0 .. k - 1``;
- mean acceptance length: ``1 + accepted / verifies`` (the convention of vLLM and ATOM: the
  tokens a verify would emit without stop cuts).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters; mutated by the engine core's step only.

    Attributes:
        num_speculative_tokens: k, the most drafts a verify scores.
        num_verify_steps: forward steps in which some sequence verified drafts.
        num_verifies: (sequence, step) pairs that verified at least one draft.
        num_draft_tokens: draft tokens proposed and scored.
        num_accepted_tokens: draft tokens accepted.
        num_emitted_tokens: tokens the verifies appended (a stop, ``max_tokens`` or EOS in the
            middle of a run cuts it: only tokens up to it count).
        accepted_length_counts: index ``a``: verifies that accepted exactly ``a`` drafts.
        accepted_per_position: index ``j``: verifies that accepted draft ``j`` (0-based).
    """

    num_speculative_tokens: int
    num_verify_steps: int = 0
    num_verifies: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_length_counts: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_length_counts:
            self.accepted_length_counts = [0] * (self.num_speculative_tokens + 1)
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, *, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        """One verify: ``num_drafts`` scored, ``num_accepted`` accepted, ``num_emitted``
        tokens appended. Raises ValueError on counts that cannot happen."""
        if not 0 <= num_accepted <= num_drafts <= self.num_speculative_tokens or \
                not 0 <= num_emitted <= num_accepted + 1:
            raise ValueError(f"impossible verify: {num_drafts} drafts, {num_accepted} accepted, "
                             f"{num_emitted} emitted (k={self.num_speculative_tokens})")
        self.num_verifies += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted
        self.accepted_length_counts[num_accepted] += 1
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_tokens_per_forward(self) -> float:
        """Tokens emitted per verify (0 before any)."""
        return self.num_emitted_tokens / self.num_verifies if self.num_verifies else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """``1 + accepted / verifies`` (0 before any verify)."""
        return 1 + self.num_accepted_tokens / self.num_verifies if self.num_verifies else 0.0

    def as_stats(self) -> dict[str, int | float]:
        """The ``spec_*`` entries of ``EngineCore.get_stats()``."""
        stats: dict[str, int | float] = {
            "spec_num_verify_steps": self.num_verify_steps,
            "spec_num_verifies": self.num_verifies,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_emitted_tokens": self.num_emitted_tokens,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_tokens_per_forward": self.mean_tokens_per_forward,
            "spec_mean_acceptance_length": self.mean_acceptance_length,
        }
        for num_accepted, count in enumerate(self.accepted_length_counts):
            stats[f"spec_accepted_length_{num_accepted}"] = count
        for position, count in enumerate(self.accepted_per_position):
            stats[f"spec_num_accepted_tokens_pos_{position}"] = count
        return stats

    def summary(self) -> str:
        """One log line."""
        dist = " ".join(f"{a}:{c}" for a, c in enumerate(self.accepted_length_counts))
        per_position = " ".join(f"{c / self.num_verifies:.3f}" if self.num_verifies else "0"
                                for c in self.accepted_per_position)
        return (f"speculative decoding: {self.num_verify_steps} verify steps, acceptance rate "
                f"{self.acceptance_rate:.3f} ({self.num_accepted_tokens}/{self.num_draft_tokens}), "
                f"{self.mean_tokens_per_forward:.2f} tokens per forward, mean acceptance length "
                f"{self.mean_acceptance_length:.2f}, per position {per_position}, accepted "
                f"lengths {dist}")
