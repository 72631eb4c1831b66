"""The DP router: which rank a new request goes to (pure Python: no I/O, no sockets).

Policies (``--dp-load-balance``, :data:`atom.config.DP_LOAD_BALANCE_POLICIES`):

- ``round_robin``: ranks in turn, 0, 1, …, N-1, 0, …
- ``least_requests``: the rank with the least load; ties rotate (among the least-loaded ranks,
  the first at or after the rank after the previous pick).
- ``cache_aware`` (:func:`cache_aware_choice`), in this order:

  1. *cache hit*: the ranks whose cached prefix of the prompt (from a :class:`PrefixIndex`, in
     practice the :class:`atom.engine.kv_subscriber.KVCacheIndex` the KV events rebuild) covers at
     least ``min_match_ratio`` of the prompt's full blocks; the longest prefix wins;
  2. *session*: else the rank the request's session was last sent to;
  3. *least load*: else the least-loaded rank.

  Behind the **load guard** (:class:`LoadGuard`): a preferred rank (1 or 2) whose load is
  over the least-loaded rank's by more than ``abs_threshold`` requests *and* more than
  ``rel_threshold`` times it is given up for the least-loaded rank (*guard fallback*).
  **Ties never rotate a session away**: among equally good ranks (equal prefixes, or equal
  loads in a fallback) the session's rank wins; only then the least loaded, then the rotation.

  **A new session is placed by load**: the first request of a session id the router has not
  seen goes to the least-loaded rank (*least load*; among those, the longest cached prefix,
  then the rotation). Every later turn follows the session to that rank, so its first placement
  decides a share of the load for the whole conversation, and all a new session can match is
  a prefix other sessions share (a long system prompt): a hit there would draw every new
  session to the one rank that cached it first, up to the guard (4 of 6 concurrent sessions at
  DP 2, and all their turns with them), where the other rank pays that prefix's prefill once.

An explicit per-request rank hint (``data_parallel_rank``) wins over every policy.

**Load** is each rank's unfinished requests as this router dispatched them: charged at dispatch
(so a burst sent before any rank reports back sees its own load) and released exactly once, at
finish or abort (:meth:`DPRouter.release` is idempotent). It counts the rank's waiting and
running requests plus those still on the wire to it. Requests rather than tokens: the router
knows them exactly and at once from its own bookkeeping (no stats to poll, nothing stale), and
it is the one counter ``least_requests`` already balances; tokens would weigh long prompts
better, at the price of estimating cache hits and decode lengths.

Every decision is counted per destination rank and reason (:data:`REASONS`).

Lineage: SGLang's router (cache-aware policy: ``cache_threshold``, the absolute and relative
balance thresholds); the failures it avoids: affinity piling identical prompts or all
same-prefix traffic onto one rank (tpu-inference #3307, vLLM router #179), ties rotating away a
session's locality (vLLM #52463).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from atom.config import DP_LOAD_BALANCE_POLICIES, EngineConfig

HINT, ROUND_ROBIN, LEAST_LOAD = "hint", "round_robin", "least_load"
CACHE_HIT, SESSION, GUARD_FALLBACK = "cache_hit", "session", "guard_fallback"
REASONS = (HINT, ROUND_ROBIN, LEAST_LOAD, CACHE_HIT, SESSION, GUARD_FALLBACK)

_MAX_SESSIONS = 100_000  # sessions remembered (least recently used forgotten first)


class PrefixIndex(Protocol):
    """What the router asks of the KV cache index (:class:`atom.engine.kv_subscriber.KVCacheIndex`,
    or the simulator's: any object fed with plain in-memory events will do)."""

    def longest_prefix_match(self, block_hashes: Sequence[int | bytes]) -> dict[int, int]:
        """Per rank, how many leading blocks of ``block_hashes`` it holds."""


@dataclass(frozen=True)
class LoadGuard:
    """Gives a preferred rank up when it is overloaded against the least-loaded rank.

    Attributes:
        abs_threshold: requests a preferred rank may be over the least-loaded one.
        rel_threshold: ... and how many times its load (both must be exceeded to trip).
    """

    abs_threshold: int
    rel_threshold: float

    def trips(self, loads: Sequence[int], rank: int) -> bool:
        low = min(loads)
        return loads[rank] - low > self.abs_threshold and loads[rank] > self.rel_threshold * low


@dataclass(frozen=True)
class CacheAwareSettings:
    """``cache_aware``'s knobs (EngineConfig's ``dp_cache_aware_*`` and ``dp_load_guard_*``).

    Attributes:
        min_match_ratio: fraction of a prompt's full blocks a cached prefix must cover to
            count as a hit (in [0, 1]; a hit needs at least one block).
        guard: the load guard.
    """

    min_match_ratio: float
    guard: LoadGuard

    @classmethod
    def from_config(cls, config: EngineConfig) -> CacheAwareSettings:
        return cls(config.dp_cache_aware_min_match_ratio,
                   LoadGuard(config.dp_load_guard_abs_threshold, config.dp_load_guard_rel_threshold))


def least_loaded(loads: Sequence[int], rotation: int, *, among: Sequence[int] | None = None,
                 prefer: int | None = None) -> int:
    """The least-loaded rank of ``among`` (default: all); ties go to ``prefer`` when it is
    tied, else to the first at or after ``rotation`` (ranks taken modulo ``len(loads)``)."""
    candidates = range(len(loads)) if among is None else among
    low = min(loads[r] for r in candidates)
    tied = {r for r in candidates if loads[r] == low}
    if prefer in tied:
        return prefer
    n = len(loads)
    return next(r % n for r in range(rotation, rotation + n) if r % n in tied)


def cache_aware_choice(loads: Sequence[int], matches: Mapping[int, int], *, num_blocks: int,
                       session_rank: int | None, settings: CacheAwareSettings,
                       rotation: int, new_session: bool = False) -> tuple[int, str]:
    """The rank and reason of one ``cache_aware`` decision (module docstring), a pure function.

    Args:
        loads: unfinished requests per rank.
        matches: per rank, the cached leading blocks of the prompt (ranks left out: none).
        num_blocks: full blocks of the prompt.
        session_rank: the rank the request's session was last sent to (None: no session, or
            its first request).
        settings: the hit threshold and the load guard.
        rotation: where least-load ties resume.
        new_session: the request is the first of its session (placed by load).
    """
    preferred, reason = None, LEAST_LOAD
    threshold = max(1.0, settings.min_match_ratio * num_blocks)
    hits = [r for r, m in matches.items() if m >= threshold]
    if new_session:
        low = min(loads)
        tied_hits = [r for r in hits if loads[r] == low]
        best = max(tied_hits, key=lambda r: matches[r], default=None)
        return least_loaded(loads, rotation, prefer=best), LEAST_LOAD
    if hits:
        best = max(matches[r] for r in hits)
        tied = [r for r in hits if matches[r] == best]
        preferred = (session_rank if session_rank in tied
                     else least_loaded(loads, rotation, among=tied))
        reason = CACHE_HIT
    elif session_rank is not None:
        preferred, reason = session_rank, SESSION
    if preferred is not None and not settings.guard.trips(loads, preferred):
        return preferred, reason
    rank = least_loaded(loads, rotation, prefer=session_rank)
    return rank, (LEAST_LOAD if preferred is None else GUARD_FALLBACK)


class DPRouter:
    """Chooses ranks; owns the per-rank load, the session table and the decision counters.

    Args:
        policy: one of :data:`atom.config.DP_LOAD_BALANCE_POLICIES`.
        num_ranks: DP size.
        cache_aware: the settings of ``cache_aware`` (required by that policy only).
        index: where ``cache_aware`` reads cached prefixes; None: no cache hits (sessions and
            load still route).
    Raises:
        ValueError: an unknown policy, ``num_ranks < 1``, or cache_aware without settings.
    """

    def __init__(self, policy: str, num_ranks: int, *,
                 cache_aware: CacheAwareSettings | None = None, index: PrefixIndex | None = None):
        if policy not in DP_LOAD_BALANCE_POLICIES:
            raise ValueError(f"unknown DP load-balance policy {policy!r}: use one of "
                             f"{DP_LOAD_BALANCE_POLICIES}")
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks} must be >= 1")
        if policy == "cache_aware" and cache_aware is None:
            raise ValueError("the cache_aware policy needs its settings (CacheAwareSettings)")
        self.policy = policy
        self.num_ranks = num_ranks
        self.cache_aware = cache_aware
        self.index = index
        self._loads = [0] * num_ranks
        self._next = 0  # where the rotation (round robin, or least-load ties) resumes
        self._rank_of: dict[str, int] = {}
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._decisions = [dict.fromkeys(REASONS, 0) for _ in range(num_ranks)]

    @property
    def loads(self) -> list[int]:
        """Unfinished requests per rank (a copy)."""
        return list(self._loads)

    def rank_of(self, request_id: str) -> int | None:
        """The rank an unfinished request was dispatched to (None: unknown or released)."""
        return self._rank_of.get(request_id)

    def session_rank(self, session_id: str) -> int | None:
        """The rank ``session_id`` was last sent to (cache_aware; None: not known)."""
        return self._sessions.get(session_id)

    def dispatch(self, request_id: str, rank_hint: int | None = None, *,
                 session_id: str | None = None,
                 block_hashes: Sequence[int | bytes] = ()) -> int:
        """Pick a rank for ``request_id`` and charge it one request.

        Args:
            request_id: unique among unfinished requests.
            rank_hint: pins the rank.
            session_id: the request's session (cache_aware; ignored by the other policies).
            block_hashes: the prompt's chained full-block hashes in wire form
                (:func:`atom.engine.kv_subscriber.wire_block_hashes`; cache_aware only).
        Raises:
            ValueError: ``request_id`` is already dispatched and unfinished, or ``rank_hint`` is
                not a rank.
        """
        if request_id in self._rank_of:
            raise ValueError(f"request_id {request_id!r} is already running on DP rank "
                             f"{self._rank_of[request_id]}")
        if rank_hint is not None:
            if isinstance(rank_hint, bool) or not 0 <= rank_hint < self.num_ranks:
                raise ValueError(f"data_parallel_rank={rank_hint!r} is outside [0, "
                                 f"{self.num_ranks})")
            rank, reason = rank_hint, HINT
        elif self.policy == "round_robin":
            rank, reason = self._next, ROUND_ROBIN
        elif self.policy == "least_requests":
            rank, reason = least_loaded(self._loads, self._next), LEAST_LOAD
        else:
            rank, reason = self._cache_aware(session_id, block_hashes)
        if reason != HINT:
            self._next = (rank + 1) % self.num_ranks
        self._loads[rank] += 1
        self._rank_of[request_id] = rank
        self._decisions[rank][reason] += 1
        if session_id is not None and self.policy == "cache_aware":
            self._sessions[session_id] = rank
            self._sessions.move_to_end(session_id)
            if len(self._sessions) > _MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return rank

    def _cache_aware(self, session_id: str | None,
                     block_hashes: Sequence[int | bytes]) -> tuple[int, str]:
        assert self.cache_aware is not None
        matches = (self.index.longest_prefix_match(block_hashes)
                   if self.index is not None and block_hashes else {})
        session_rank = None if session_id is None else self._sessions.get(session_id)
        return cache_aware_choice(self._loads, matches, num_blocks=len(block_hashes),
                                  session_rank=session_rank, settings=self.cache_aware,
                                  rotation=self._next,
                                  new_session=session_id is not None and session_rank is None)

    def release(self, request_id: str) -> int | None:
        """The request finished or was aborted: release its load. Idempotent (a second release
        of the same id does nothing). Returns the rank released, or None."""
        rank = self._rank_of.pop(request_id, None)
        if rank is not None:
            self._loads[rank] -= 1
        return rank

    def reset(self, num_ranks: int) -> int:
        """A new group of ``num_ranks`` ranks replaced the old one (a rank failure): release
        every request still charged (each exactly once: they were lost with the old group and
        are dispatched again if resumed), forget the sessions (their ranks may be gone) and
        restart the rotation. Decision counters are kept for the ranks that still exist.
        Returns how many requests were released.

        Raises:
            ValueError: ``num_ranks < 1``.
        """
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks} must be >= 1")
        released = len(self._rank_of)
        for request_id in list(self._rank_of):
            self.release(request_id)
        assert not any(self._loads), self._loads
        self.num_ranks = num_ranks
        self._loads = [0] * num_ranks
        self._next = 0
        self._sessions.clear()
        self._decisions = (self._decisions + [dict.fromkeys(REASONS, 0)
                                              for _ in range(num_ranks)])[:num_ranks]
        return released

    def rank_stats(self) -> list[dict[str, int]]:
        """Per rank: ``dp_router_load`` (unfinished requests) and ``dp_router_decisions_<reason>``
        (requests sent there for that reason, since start)."""
        return [{"dp_router_load": load,
                 **{f"dp_router_decisions_{reason}": n for reason, n in decisions.items()}}
                for load, decisions in zip(self._loads, self._decisions)]
