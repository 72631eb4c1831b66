"""The simulator's cost model: how long a step of the DP group lasts, from its batches.

Only the forward pass is modelled; every decision comes from the engine's own code. The form
(seconds; coefficients in a :class:`Profile`, fitted by ``atom sim calibrate``,
:mod:`atom.dp.sim.calibrate`)::

    micro-batch on rank r   c_r = k·(step_s + token_s·T_r + sampled_s·S_r + seq_s·N_r
                                     + prefill_pair_s·P_r + decode_context_s·D_r)
      with EP and M > 0     c_r = k·(step_s − mlp_step_s·(1 − 1/W) + (token_s − mlp_token_s)·T_r
                                     + mlp_token_s·R + sampled_s·S_r + ...)
    a dummy micro-batch     c_r = k·dummy_s;  with EP and M > 0: k·(dummy_s + mlp_step_s/W
                                                                   + mlp_token_s·R)
    rank r's step           t_r = (1 + contention·b_r/(W-1)) · c_r + seq_overhead_s·N_r,
                                  c_r = Σ over its micro-batches (1, or 2 with TBO)
    EP collectives          e   = n_mb · (ep_fixed_s + ep_row_s·M·(W-1))     (M > 0)
    the group's step        t   = max_r t_r + e + tick_s
    rank r's outputs        at tick_s + t_r after the step's start (no EP: a rank sends its
                            tokens when its own forward ends; the next tick's sync is what
                            waits for the slowest); at t with EP (every layer's collectives
                            hold the ranks to the slowest)

T tokens of the micro-batch, S sequences sampled (the LM head and the sampler), N sequences,
P prefill attention pairs (Σ over prompt chunks of n·(c + (n+1)/2): n new tokens after c
computed ones), D decode context tokens (Σ context lengths of the decodes), M the step's
largest token count over the ranks, W the DP size, n_mb the micro-batches, k the
``compute_scale`` (the real ranks' compute relative to the calibration grid's), b_r how much of
rank r's compute the other ranks spend computing too: Σ over the other ranks that compute (a
real batch, or with expert parallelism any batch of a step with M > 0) of
min(c_r, c_s) / c_r (:func:`overlap_shares`: the ranks start together, and a rank that is done
stops contending). ``contention`` is how much slower a rank computes while the others compute
too: ranks that share a machine's memory bandwidth and caches (CPU ranks on one socket) slow
each other; ranks on their own accelerators do not (0). (Until issue 39, b_r counted every
other rank that computed at all, for the whole of rank r's compute: a long prefill beside a
short decode paid the contention for its whole length, and the model over-predicted the
steps without a prefill policy by about 20 % on a Zen 4 VM.) Without
expert parallelism ``token_s`` and ``step_s`` cover the MLP; with it every rank runs its
experts on the W·M padded rows of every rank at 1/W of the experts, so the MLP's share of
``token_s`` (``mlp_token_s``) moves to R = M·I rows, dummy batches included, and a rank reads
1/W of the experts' weights: of the MLP's fixed part per forward (``mlp_step_s``, in
``step_s``: the intercept of the grid's MLP seconds over its tokens) it pays 1/W, a dummy batch
of a step with tokens too (before run G of docs/DP_EXPERIMENTS.md every EP rank paid all of it:
fitted at W = 2 the EP collectives' ``ep_fixed_s`` took the difference, which does not carry
to other W). I is the
step's expert imbalance (Σ_layers max-over-ranks / Σ_layers mean-over-ranks of the routed
tokens: every layer's combine waits for its busiest rank; 1 when balanced, the default, and
from a routing-skew model and the placement otherwise: :mod:`atom.dp.sim.experts`).
``tick_s`` is the per-tick overhead outside the forward (the two gathers, scheduling,
outputs) and ``seq_overhead_s`` the per-sequence one (N_r: the sequences rank r steps, over
its micro-batches): what a real rank does per sequence around the forward the grid times
(scheduling, sampling parameters, output frames) and the front end's per-token work where it
shares the cores. Both are fitted on real ranks (``calibrate.fit_group``); on an AVX2 Zen 3
the grid alone under-predicted real decode steps of 5-8 sequences by about 10 % (run G).

Where it is a guess: the per-rank terms are measured on this machine's model runner; the EP
and tick terms are fitted on W = 2 real runs, so the ``(W-1)`` bandwidth factor (ring
all-gather / reduce-scatter) and a W-independent latency are assumptions beyond W = 2; TBO
overlaps nothing here (the CPU collectives compete with the compute: docs/PERFORMANCE.md).
``contention`` is fitted at W = 2 (one other rank); that it grows with the other ranks'
overlapping compute is an assumption beyond.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field

PROFILE_FORMAT = "atom-sim-profile"
PROFILE_VERSION = 1
PROFILES_DIR = pathlib.Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class Coefficients:
    """The cost model's coefficients (seconds per unit; module docstring)."""

    step_s: float = 0.0
    token_s: float = 0.0
    mlp_token_s: float = 0.0
    mlp_step_s: float = 0.0  # the MLP's part of step_s (its weights, read once per forward)
    sampled_s: float = 0.0
    seq_s: float = 0.0
    prefill_pair_s: float = 0.0
    decode_context_s: float = 0.0
    dummy_s: float = 0.0
    ep_fixed_s: float = 0.0
    ep_row_s: float = 0.0
    tick_s: float = 0.0
    wake_s: float = 0.0  # an idle group's first tick after a request arrives
    compute_scale: float = 1.0  # real ranks' compute ÷ the grid's (calibrate.fit_group)
    contention: float = 0.0  # a rank's slow-down while every other rank computes beside it
    seq_overhead_s: float = 0.0  # per sequence a real rank steps, outside the grid's forward

    def __post_init__(self):
        negative = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) < 0]
        if negative:
            raise ValueError(f"cost coefficients must be >= 0: {negative}")


@dataclass(frozen=True)
class Profile:
    """A calibration profile: coefficients plus where they come from.

    Attributes:
        coefficients: the cost model's.
        kind: ``"measured"`` (``atom sim calibrate``) or ``"estimate"`` (roofline).
        machine, dtype, model, date: what was measured (machine: CPU model, flags, threads).
        model_facts: the model's KV bytes per block and context length (sizes the pools).
        fit: the fit's errors per part (``mean_abs_rel_error``, ``max_abs_rel_error``, ...).
        notes: how it was measured, in words.
    """

    coefficients: Coefficients
    kind: str = "measured"
    machine: dict = field(default_factory=dict)
    dtype: str = "float32"
    model: str = ""
    date: str = ""
    model_facts: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)
    notes: str = ""

    def to_json(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
                **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        """Raises ValueError when ``data`` is not a profile of this version."""
        if data.get("format") != PROFILE_FORMAT or data.get("version") != PROFILE_VERSION:
            raise ValueError(f"not an {PROFILE_FORMAT} v{PROFILE_VERSION} profile")
        fields = {k: v for k, v in data.items() if k not in ("format", "version")}
        return cls(**{**fields, "coefficients": Coefficients(**fields["coefficients"])})

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def load_profile(name_or_path: str | pathlib.Path) -> Profile:
    """A profile from a JSON file, or by name from the committed ones (``dp/sim/profiles``:
    ``list_profiles()``). Raises ValueError for an unknown name or a bad file."""
    path = pathlib.Path(name_or_path)
    if not path.exists():
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.exists():
        raise ValueError(f"no profile {str(name_or_path)!r}: give a JSON file or one of "
                         f"{list_profiles()}")
    return Profile.from_json(json.loads(path.read_text()))


def list_profiles() -> list[str]:
    """Names of the committed profiles."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


@dataclass(frozen=True)
class MicroBatch:
    """What the cost model reads of one micro-batch on one rank (module docstring's units).

    Attributes:
        num_tokens: T. num_seqs: N. num_sampled: S.
        prefill_pairs: P (query-key pairs of the prompt chunks).
        decode_context: D (context tokens the decodes attend to).
    """

    num_tokens: int = 0
    num_seqs: int = 0
    num_sampled: int = 0
    prefill_pairs: float = 0.0
    decode_context: int = 0

    @property
    def is_dummy(self) -> bool:
        return self.num_tokens == 0


def micro_batch(entries: Sequence[tuple[object, int, int]]) -> MicroBatch:
    """The features of ``(seq, offset, num_new_tokens)`` entries
    (:func:`atom.core.tbo_split.split_batch`'s form; offset > 0: the second half of a split
    request), read before the step runs. A verify's drafts are tokens of the forward too."""
    num_tokens = num_sampled = decode_context = 0
    prefill_pairs = 0.0
    for seq, offset, n in entries:
        start = seq.num_computed_tokens + offset
        num_tokens += n + len(seq.spec_token_ids)
        num_sampled += seq.samples_next_token(offset + n)
        if n == 1 and not seq.is_prefill:
            decode_context += start + 1
        else:
            prefill_pairs += n * (start + (n + 1) / 2)
    return MicroBatch(num_tokens, len(entries), num_sampled, prefill_pairs, decode_context)


@dataclass(frozen=True)
class StepCost:
    """One step of the group, in parts (seconds): the slowest rank's compute, the EP
    collectives, the tick's overhead; and what drove them (M, micro-batches, the share
    b_r/(W-1) of the other ranks computing beside the slowest, which ``contention`` scales,
    and the slowest rank's sequences);
    when each rank's outputs leave it (module docstring)."""

    compute_s: float
    ep_s: float
    tick_s: float
    max_num_tokens: int
    num_micro_batches: int
    others_busy: float = 0.0
    rank_done_s: tuple[float, ...] = ()  # per rank: seconds from the start to its outputs
    num_seqs: int = 0  # the slowest rank's N (its seq_overhead_s is in compute_s)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.ep_s + self.tick_s


def overlap_shares(alone: Sequence[float], busy: Sequence[bool]) -> list[float]:
    """Each rank's b_r/(W-1) (module docstring): the mean over the other ranks that compute
    (``busy``) of the fraction of rank r's own compute ``alone[r]`` they spend computing too,
    ``min(c_r, c_s) / c_r`` (every rank starts the step at once; one that finishes stops
    contending), over W - 1 (the ranks that do not compute count 0); 0 for a rank without
    compute or alone in its group. Sorted prefix sums: O(W log W)."""
    world_size = len(alone)
    if world_size < 2:
        return [0.0] * world_size
    active = sorted(c for c, b in zip(alone, busy) if b)
    prefix = [0.0]
    for c in active:
        prefix.append(prefix[-1] + c)
    out = []
    for c, b in zip(alone, busy):
        if c <= 0:
            out.append(0.0)
            continue
        shorter = bisect.bisect_left(active, c)  # the busy ranks that finish before r
        overlap = prefix[shorter] + c * (len(active) - shorter)  # Σ min(c_r, c_s), r included
        overlap -= c if b else 0.0  # not itself
        out.append(overlap / (c * (world_size - 1)))
    return out


class CostModel:
    """Step durations from a :class:`Profile` (module docstring's form).

    Args:
        profile: the coefficients.
        expert_parallel: the MLP runs on the step's largest batch and the EP collectives run.
        slowest_rank: the group waits for its slowest rank (off, for the ablation: the mean).
        dummy_cost: dummy batches cost ``dummy_s`` (off, for the ablation: nothing).
    """

    def __init__(self, profile: Profile, *, expert_parallel: bool = False,
                 slowest_rank: bool = True, dummy_cost: bool = True):
        self.profile = profile
        self.c = profile.coefficients
        self.expert_parallel = expert_parallel
        self.slowest_rank = slowest_rank
        self.dummy_cost = dummy_cost

    def micro_batch_s(self, mb: MicroBatch, *, max_num_tokens: int, world_size: int = 1,
                      expert_imbalance: float = 1.0) -> float:
        """One micro-batch's compute on one rank (``max_num_tokens``: the step's M;
        ``world_size``: W; ``expert_imbalance``: the step's I, 1 when the experts' tokens are
        balanced)."""
        c = self.c
        step, mlp = c.step_s, 0.0
        if self.expert_parallel:  # the MLP's share of token_s moves to the M padded rows
            per_token = max(0.0, c.token_s - c.mlp_token_s)
            if max_num_tokens:  # and of step_s to the rank's 1/W of the experts, dummies too
                step = max(0.0, c.step_s - c.mlp_step_s)
                mlp = c.mlp_step_s / world_size + c.mlp_token_s * max_num_tokens * expert_imbalance
        else:
            per_token = c.token_s
        if mb.is_dummy:
            return c.compute_scale * ((c.dummy_s if self.dummy_cost else 0.0) + mlp)
        return c.compute_scale * (
            step + per_token * mb.num_tokens + mlp + c.sampled_s * mb.num_sampled
            + c.seq_s * mb.num_seqs + c.prefill_pair_s * mb.prefill_pairs
            + c.decode_context_s * mb.decode_context)

    def step(self, batches: Sequence[Sequence[MicroBatch]], *,
             expert_imbalance: float = 1.0) -> StepCost:
        """The group's step: ``batches[r]`` are rank r's micro-batches (all ranks split the
        same way: one each, or two with TBO); ``expert_imbalance``: the step's I (with expert
        parallelism; :mod:`atom.dp.sim.experts`)."""
        max_num_tokens = max(sum(mb.num_tokens for mb in rank) for rank in batches)
        world_size = len(batches)
        busy = [max_num_tokens > 0 if self.expert_parallel else
                any(not mb.is_dummy for mb in rank) for rank in batches]
        alone = [sum(self.micro_batch_s(mb, max_num_tokens=max_num_tokens,
                                        world_size=world_size,
                                        expert_imbalance=expert_imbalance) for mb in rank)
                 for rank in batches]
        others = overlap_shares(alone, busy)
        num_seqs = [sum(mb.num_seqs for mb in rank) for rank in batches]
        times = [(1 + self.c.contention * o) * t + self.c.seq_overhead_s * n
                 for t, o, n in zip(alone, others, num_seqs)]
        slowest = max(range(world_size), key=times.__getitem__)
        compute = times[slowest] if self.slowest_rank else sum(times) / world_size
        num_micro_batches = len(batches[0])
        ep = self.ep_s(max_num_tokens, num_micro_batches=num_micro_batches,
                       world_size=world_size)
        total = compute + ep + self.c.tick_s
        done = tuple(total if self.expert_parallel else min(total, self.c.tick_s + t)
                     for t in times)
        return StepCost(compute, ep, self.c.tick_s, max_num_tokens, num_micro_batches,
                        others[slowest], done, num_seqs[slowest])

    def ep_s(self, max_num_tokens: int, *, num_micro_batches: int, world_size: int) -> float:
        """The EP collectives of one step (none without EP, or when every batch is empty)."""
        if not self.expert_parallel or max_num_tokens == 0:
            return 0.0
        c = self.c
        return num_micro_batches * (c.ep_fixed_s + c.ep_row_s * max_num_tokens * (world_size - 1))
