"""Process groups of a data-parallel deployment, built from the torchrun-style rank contract.

Rank contract (the variables torchrun sets; ``atom launch`` sets the same ones):

=================  ==========================================================================
``RANK``           global rank of this process, ``0 <= RANK < WORLD_SIZE``
``WORLD_SIZE``     number of processes in the deployment (= DP size while ``tp_size`` is 1)
``LOCAL_RANK``     rank among the processes on this node (picks the GPU when there is one)
``LOCAL_WORLD_SIZE`` processes on this node; optional, defaults to ``WORLD_SIZE`` (one node)
``MASTER_ADDR``    host of the rendezvous store (a ``TCPStore``; rank 0 hosts it by default)
``MASTER_PORT``    its TCP port; 0 (pick a free port) only works with ``WORLD_SIZE=1``
=================  ==========================================================================

Tensor parallelism is out of scope: :class:`RankInfo` records ``tp_size = 1`` so that the DP
rank and size stay derived quantities (``rank // tp_size``) when TP arrives.

Three groups exist after :func:`init_process_groups` (see DESIGN.md, "Processes and data flow"):
the default group (gloo; used by nothing hot), the **control group** (gloo, always: the per-tick
control sync is a tiny CPU gather, and a CPU group keeps it off the GPU stream) and the **device
group** (gloo on CPU; NCCL when CUDA is available, which is RCCL on ROCm: batch-shape exchange and
MoE dispatch/combine). Every collective on them goes through :mod:`atom.dp.collectives`.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from atom.dp.collective_log import process_collective_log

logger = logging.getLogger(__name__)

_CONTRACT = "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
# torch's own rendezvous keys live under this prefix so that atom's keys in the same store
# (ZMQ endpoints, collective post-mortems) can never collide with them
_TORCH_STORE_PREFIX = "atom/torch"


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
                   master_port=_env_int(env, "MASTER_PORT"))


def _env_str(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if value == "":
        raise ValueError(f"{name} is not set: set {_CONTRACT} (as torchrun does), or start the "
                         f"ranks with `atom launch`")
    return value


def _env_int(env: Mapping[str, str], name: str) -> int:
    value = _env_str(env, name)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer: set it to a whole number") from None


@dataclass
class DPGroups:
    """The process groups of this rank and the rendezvous store they were built from.

    Owns the default group, ``control`` and ``device`` until :meth:`destroy`. ``store`` is the
    raw rendezvous store: other ``atom.dp`` code may put keys in it under an ``atom/`` prefix
    (ZMQ endpoints, collective post-mortems); torch's own keys sit under ``atom/torch``.
    """

    rank_info: RankInfo
    store: dist.Store
    control: dist.ProcessGroup
    device: dist.ProcessGroup
    device_backend: str  # "gloo" or "nccl"
    timeout_s: float

    def destroy(self) -> None:
        """Tear down every group (idempotent). The groups are unusable afterwards."""
        process_collective_log().detach_store()
        if dist.is_initialized():
            dist.destroy_process_group()  # the default group takes every subgroup with it


def init_process_groups(rank_info: RankInfo, *, timeout_s: float,
                        store: dist.Store | None = None) -> DPGroups:
    """Rendezvous with the other ranks and create the default, control and device groups.

    Every rank must call this once, in the same order relative to other rendezvous work.

    Args:
        rank_info: this process's place in the deployment.
        timeout_s: seconds a collective may wait for its peers before it fails (gloo raises
            ``RuntimeError``); also the rendezvous and store timeout. A rank that never shows up
            therefore fails the others within ``timeout_s`` instead of hanging them.
        store: a store another process already hosts (a launcher that runs the ``TCPStore``
            itself, as torchrun's agent does); by default rank 0 hosts one at
            ``MASTER_ADDR:MASTER_PORT`` and the other ranks connect to it; when
            ``TORCHELASTIC_USE_AGENT_STORE=True`` (torchrun, atom launch) every rank connects.
    Returns:
        The groups; call :meth:`DPGroups.destroy` at shutdown.
    Raises:
        ValueError: ``timeout_s`` is not positive.
        RuntimeError: torch.distributed is already initialized in this process, or the
            rendezvous failed (a peer did not connect within ``timeout_s``).
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: it must be a positive number of seconds")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: call "
                           "DPGroups.destroy() before initializing again")
    info = rank_info
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        # torch's convention (torchrun's agent, atom launch): the launcher already hosts the
        # store at MASTER_ADDR:MASTER_PORT, so every rank connects as a client.
        agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"
        store = dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                              is_master=info.rank == 0 and not agent_hosts_store, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(_TORCH_STORE_PREFIX, store),
                            rank=info.rank, world_size=info.world_size, timeout=timeout)
    # new_group is itself a collective over the store: every rank creates the same groups in
    # the same order
    control = dist.new_group(backend="gloo", timeout=timeout, group_desc="atom_control")
    device_backend = "gloo"
    if torch.cuda.is_available():  # GPU path: NCCL (RCCL on ROCm) for the device group
        device_backend = "nccl"
        torch.cuda.set_device(info.local_rank)
    device = dist.new_group(backend=device_backend, timeout=timeout, group_desc="atom_device")
    process_collective_log().attach_store(store, rank=info.rank, world_size=info.world_size,
                                          group_timeout_s=timeout_s)
    rank_logger(logger, info.dp_rank).info(
        "process groups ready: rank %d/%d, local rank %d/%d, device backend %s, timeout %.0fs",
        info.rank, info.world_size, info.local_rank, info.local_world_size, device_backend,
        timeout_s)
    return DPGroups(rank_info=info, store=store, control=control, device=device,
                    device_backend=device_backend, timeout_s=timeout_s)
