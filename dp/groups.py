"""Process groups of a data-parallel deployment, built from the torchrun-style rank contract.

The rank contract (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_USE_AGENT_STORE) and :class:`RankInfo` live in :mod:`atom.dp.rank_contract`.

Three groups exist after :func:`init_process_groups` (docs/ARCHITECTURE.md, "Across ranks"):
the default group (gloo; used by nothing hot), the **control group** (gloo, always: the per-tick
control sync is a tiny CPU gather, and a CPU group keeps it off the GPU stream) and the **device
group** (gloo on CPU; NCCL when CUDA is available, which is RCCL on ROCm: batch-shape exchange and
MoE dispatch/combine). Every collective on them goes through :mod:`atom.dp.collectives`.

Before gloo starts, every rank picks the address gloo binds (:mod:`atom.dp.node_address`: the
interface on the route to ``MASTER_ADDR``, set as ``GLOO_SOCKET_IFNAME`` unless that is set
already), publishes it in the store and checks every rank's: a rank that would bind loopback
while its peers are on other hosts fails every rank at once with a message saying what to
change, instead of gloo failing to connect after the group timeout.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from atom.dp.collective_log import process_collective_log
from atom.dp.node_address import GLOO_IFNAME_ENV, check_rank_addresses, gloo_address
from atom.dp.rank_contract import RankInfo, hosts_store, rank_logger

__all__ = ["DPGroups", "RankInfo", "init_process_groups", "rank_logger", "rendezvous_store"]

logger = logging.getLogger(__name__)

# torch's own rendezvous keys live under this prefix so that atom's keys in the same store
# (ZMQ endpoints, collective post-mortems) can never collide with them
_TORCH_STORE_PREFIX = "atom/torch"
_ADDRESS_PREFIX = "atom/dp/address/"


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


def rendezvous_store(rank_info: RankInfo, *, timeout_s: float) -> dist.Store:
    """The rendezvous store at ``MASTER_ADDR:MASTER_PORT``, hosted or joined as
    :func:`hosts_store` says; ``timeout_s`` bounds the connection and every store operation.

    Raises:
        ValueError: ``timeout_s`` is not positive.
        torch.distributed.DistStoreError: the store did not answer within ``timeout_s``.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: it must be a positive number of seconds")
    return dist.TCPStore(rank_info.master_addr, rank_info.master_port, rank_info.world_size,
                         is_master=hosts_store(rank_info),
                         timeout=datetime.timedelta(seconds=timeout_s))


def init_process_groups(rank_info: RankInfo, *, timeout_s: float) -> DPGroups:
    """Rendezvous with the other ranks and create the default, control and device groups.

    Every rank must call this once, in the same order relative to other rendezvous work.

    Args:
        rank_info: this process's place in the deployment.
        timeout_s: seconds a collective may wait for its peers before it fails (gloo raises
            ``RuntimeError``); also the rendezvous and store timeout
            (:func:`rendezvous_store`). A rank that never shows up therefore fails the others
            within ``timeout_s`` instead of hanging them.
    Returns:
        The groups; call :meth:`DPGroups.destroy` at shutdown.
    Raises:
        ValueError: ``timeout_s`` is not positive.
        RuntimeError: torch.distributed is already initialized in this process, or the
            rendezvous failed (a peer did not connect within ``timeout_s``).
        ValueError: some ranks would bind loopback while others are on other hosts
            (:func:`atom.dp.node_address.check_rank_addresses`), or ``GLOO_SOCKET_IFNAME``
            names an interface this node does not have.
        OSError: ``MASTER_ADDR`` does not resolve, or this node has no route to it.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: it must be a positive number of seconds")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: call "
                           "DPGroups.destroy() before initializing again")
    info = rank_info
    timeout = datetime.timedelta(seconds=timeout_s)
    store = rendezvous_store(info, timeout_s=timeout_s)
    # a launcher's store outlives a restart of the group: each start rendezvous under keys of
    # its own, never reading the previous group's
    prefix = (_TORCH_STORE_PREFIX if info.restart_count == 0
              else f"{_TORCH_STORE_PREFIX}/restart{info.restart_count}")
    _agree_on_addresses(store, info, timeout_s=timeout_s, key_prefix=f"{prefix}/{_ADDRESS_PREFIX}")
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store),
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
        "process groups ready: rank %d/%d, local rank %d/%d, device backend %s, timeout %.0fs, "
        "start %d of the group", info.rank, info.world_size, info.local_rank,
        info.local_world_size, device_backend, timeout_s, info.restart_count)
    return DPGroups(rank_info=info, store=store, control=control, device=device,
                    device_backend=device_backend, timeout_s=timeout_s)


def _agree_on_addresses(store: dist.Store, info: RankInfo, *, timeout_s: float,
                        key_prefix: str) -> None:
    """Choose gloo's interface, publish this rank's address under ``key_prefix`` (one per start
    of the group), check every rank's (module docstring). Raises as :func:`init_process_groups`."""
    address, ifname = gloo_address(info.master_addr, info.master_port)
    if ifname is not None and not os.environ.get(GLOO_IFNAME_ENV):
        # torch reads it each time it creates a gloo group; set once here, before the first
        os.environ[GLOO_IFNAME_ENV] = ifname
    record = {"address": address, "interface": ifname, "master_addr": info.master_addr,
              "host": socket.gethostname()}
    store.set(f"{key_prefix}{info.rank}", json.dumps(record))
    keys = [f"{key_prefix}{r}" for r in range(info.world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RuntimeError(f"rank(s) {missing} did not reach the rendezvous within "
                           f"{timeout_s:g}s (dp_group_timeout_s)") from None
    check_rank_addresses([json.loads(store.get(k)) for k in keys])
    rank_logger(logger, info.dp_rank).info("gloo binds %s (interface %s)", address,
                                           os.environ.get(GLOO_IFNAME_ENV, "from the hostname"))
