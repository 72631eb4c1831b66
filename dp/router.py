"""The DP router: which rank a new request goes to (pure Python, no I/O).

Policies (``--dp-load-balance``):

- ``round_robin``: ranks in turn, 0, 1, …, N-1, 0, …
- ``least_requests``: the rank with the fewest unfinished requests. A request's load is charged
  when it is dispatched (so a burst dispatched before any rank reports back still splits
  evenly) and released exactly once, when it finishes or is aborted. Ties rotate: among the
  least-loaded ranks, the first at or after the rank after the previous pick.

An explicit per-request rank hint (``data_parallel_rank``) wins over the policy (and is charged
like any dispatch).
"""

from __future__ import annotations

from atom.config import DP_LOAD_BALANCE_POLICIES


class DPRouter:
    """Chooses ranks and keeps the per-rank load (unfinished requests).

    Args:
        policy: one of :data:`atom.config.DP_LOAD_BALANCE_POLICIES`.
        num_ranks: DP size.
    Raises:
        ValueError: an unknown policy or ``num_ranks < 1``.
    """

    def __init__(self, policy: str, num_ranks: int):
        if policy not in DP_LOAD_BALANCE_POLICIES:
            raise ValueError(f"unknown DP load-balance policy {policy!r}: use one of "
                             f"{DP_LOAD_BALANCE_POLICIES}")
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks} must be >= 1")
        self.policy = policy
        self.num_ranks = num_ranks
        self._loads = [0] * num_ranks
        self._next = 0  # where the rotation (round robin, or least-requests ties) resumes
        self._rank_of: dict[str, int] = {}

    @property
    def loads(self) -> list[int]:
        """Unfinished requests per rank (a copy)."""
        return list(self._loads)

    def rank_of(self, request_id: str) -> int | None:
        """The rank an unfinished request was dispatched to (None: unknown or released)."""
        return self._rank_of.get(request_id)

    def dispatch(self, request_id: str, rank_hint: int | None = None) -> int:
        """Pick a rank for ``request_id`` and charge it one request.

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
            rank = rank_hint
        elif self.policy == "round_robin":
            rank = self._next
            self._next = (rank + 1) % self.num_ranks
        else:
            low = min(self._loads)
            rank = next(r % self.num_ranks for r in range(self._next, self._next + self.num_ranks)
                        if self._loads[r % self.num_ranks] == low)
            self._next = (rank + 1) % self.num_ranks
        self._loads[rank] += 1
        self._rank_of[request_id] = rank
        return rank

    def release(self, request_id: str) -> int | None:
        """The request finished or was aborted: release its load. Idempotent (a second release
        of the same id does nothing). Returns the rank released, or None."""
        rank = self._rank_of.pop(request_id, None)
        if rank is not None:
            self._loads[rank] -= 1
        return rank
