"""The rank contract of a data-parallel deployment: :class:`RankInfo` and who hosts the store.

Rank contract (the variables torchrun sets; ``atom launch`` sets the same ones):

================================  ===========================================================
``RANK``                          global rank of this process, ``0 <= RANK < WORLD_SIZE``
``WORLD_SIZE``                    processes in the deployment (= DP size while ``tp_size`` is 1)
``LOCAL_RANK``                    rank among the processes on this node (picks the GPU)
``LOCAL_WORLD_SIZE``              processes on this node; optional, default ``WORLD_SIZE``
``MASTER_ADDR``                   host of the rendezvous store (a ``TCPStore``)
``MASTER_PORT``                   its TCP port; 0 (pick a free port) only with ``WORLD_SIZE=1``
``TORCHELASTIC_USE_AGENT_STORE``  ``True``: the launcher (``atom launch``, torchrun's agent)
                                  hosts the store and every rank, rank 0 too, joins it;
                                  otherwise rank 0 hosts it
``TORCHELASTIC_RESTART_COUNT``    which start of the group this is (0 first; optional): the
                                  launcher's restarts (``--max-restarts``), or the front
                                  end's fresh groups after a rank failure
``TORCHELASTIC_MAX_RESTARTS``     restarts the launcher may still make in all (optional, 0)
================================  ===========================================================

:func:`hosts_store` is the one place that decides who hosts the store.

Tensor parallelism is out of scope: :class:`RankInfo` records ``tp_size = 1`` so that the DP
rank and size stay derived quantities (``rank // tp_size``) when TP arrives.

Imports no torch, so that launchers can read and write the contract cheaply.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

_CONTRACT = "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"


class RankLoggerAdapter(logging.LoggerAdapter):
    """Prefixes every message with ``[dpN]`` (STYLE.md: rank-prefixed logs)."""

    def process(self, msg, kwargs):
        return f"[dp{self.extra['dp_rank']}] {msg}", kwargs


def rank_logger(base: logging.Logger, dp_rank: int) -> RankLoggerAdapter:
    """``base`` with a ``[dp{dp_rank}]`` prefix on every message."""
    return RankLoggerAdapter(base, {"dp_rank": dp_rank})


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the deployment (immutable; one per process).

    Raises:
        ValueError: from ``__post_init__`` when the values are inconsistent; the message says
            which variable to change.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    tp_size: int = field(default=1)
    restart_count: int = 0
    max_restarts: int = 0

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"WORLD_SIZE={self.world_size}: it must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} is outside [0, WORLD_SIZE={self.world_size})")
        if not 1 <= self.local_world_size <= self.world_size:
            raise ValueError(f"LOCAL_WORLD_SIZE={self.local_world_size} must be in "
                             f"[1, WORLD_SIZE={self.world_size}]")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"LOCAL_RANK={self.local_rank} is outside "
                             f"[0, LOCAL_WORLD_SIZE={self.local_world_size})")
        if not self.master_addr:
            raise ValueError("MASTER_ADDR is empty: set it to the host of rank 0")
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"MASTER_PORT={self.master_port} is not a TCP port (0-65535)")
        if self.master_port == 0 and self.world_size > 1:
            raise ValueError("MASTER_PORT=0 leaves the other ranks no port to connect to: set a "
                             "fixed port (or let `atom launch` pick one)")
        if not 0 <= self.restart_count or not 0 <= self.max_restarts:
            raise ValueError(f"TORCHELASTIC_RESTART_COUNT={self.restart_count} and "
                             f"TORCHELASTIC_MAX_RESTARTS={self.max_restarts} must be >= 0")
        if self.tp_size != 1:
            raise ValueError(f"tp_size={self.tp_size}: tensor parallelism is not supported yet; "
                             f"use tp_size=1")

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank (one DP rank spans ``tp_size`` processes)."""
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks."""
        return self.world_size // self.tp_size

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankInfo:
        """Read the rank contract (module docstring) from ``env`` (default: ``os.environ``).

        Raises:
            ValueError: a required variable is missing or not an integer, or the values are
                inconsistent; the message names the variable and what to set.
        """
        env = os.environ if env is None else env
        world_size = _env_int(env, "WORLD_SIZE")
        local_world_size = (_env_int(env, "LOCAL_WORLD_SIZE")
                            if env.get("LOCAL_WORLD_SIZE", "") != "" else world_size)
        return cls(rank=_env_int(env, "RANK"), world_size=world_size,
                   local_rank=_env_int(env, "LOCAL_RANK"), local_world_size=local_world_size,
                   master_addr=_env_str(env, "MASTER_ADDR"),
                   master_port=_env_int(env, "MASTER_PORT"),
                   restart_count=_env_int(env, RESTART_COUNT_ENV, default=0),
                   max_restarts=_env_int(env, MAX_RESTARTS_ENV, default=0))


def _env_str(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if value == "":
        raise ValueError(f"{name} is not set: set {_CONTRACT} (as torchrun does), or start the "
                         f"ranks with `atom launch`")
    return value


def _env_int(env: Mapping[str, str], name: str, *, default: int | None = None) -> int:
    if default is not None and env.get(name, "") == "":
        return default
    value = _env_str(env, name)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer: set it to a whole number") from None


def hosts_store(rank_info: RankInfo, env: Mapping[str, str] | None = None) -> bool:
    """Whether this process hosts the rendezvous ``TCPStore``: rank 0 does, unless a launcher
    hosts it (``TORCHELASTIC_USE_AGENT_STORE=True``: ``atom launch`` and torchrun), in which case
    every rank connects to it as a client (hosting a second server on that port would fail with
    "address already in use")."""
    env = os.environ if env is None else env
    return rank_info.rank == 0 and env.get(AGENT_STORE_ENV, "") != "True"
