"""Worker-side view of the launch environment: who started this process, and its rendezvous store.

The variables themselves are documented in :mod:`atom.launch.launcher` (the env contract). This
module is what an ``atom`` command calls at start-up to find out whether it is one rank of a
multi-rank run (started by ``atom launch`` or by ``torchrun``) and, if so, which store to
rendezvous through. It imports no torch at module level so that the checks stay cheap.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

    from atom.dp.groups import RankInfo

# The rank contract (what torchrun sets too); RankInfo.from_env reads these.
RANK_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Set by `atom launch` only: the launcher's pid (a marker, and who to blame for a SIGTERM).
LAUNCHER_PID_ENV = "ATOM_LAUNCHER_PID"
# Per-rank file a failing worker writes its traceback to (torchelastic's error-file format).
ERROR_FILE_ENV = "ATOM_ERROR_FILE"
TORCHELASTIC_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
NODE_RANK_ENV = "NODE_RANK"
# "True" when the launcher (atom launch, or torchrun's agent) hosts the TCPStore at
# MASTER_ADDR:MASTER_PORT, so that every rank, rank 0 included, must connect to it as a client.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
TORCHRUN_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def rank_env_present(env: Mapping[str, str] | None = None) -> bool:
    """True when every rank-contract variable (:data:`RANK_ENV_VARS`) is set and non-empty,
    whoever set it (``atom launch``, ``torchrun``, or a user by hand). A command that sees this
    runs as one rank: ``RankInfo.from_env()`` then reads (and validates) the values."""
    env = os.environ if env is None else env
    return all(env.get(name, "") != "" for name in RANK_ENV_VARS)


def launched_by_launcher(env: Mapping[str, str] | None = None) -> bool:
    """True when this process is a worker that ``atom launch`` started."""
    env = os.environ if env is None else env
    return env.get(LAUNCHER_PID_ENV, "") != "" and rank_env_present(env)


def launched_by_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """True when this process is a worker that ``torchrun`` (torchelastic) started."""
    env = os.environ if env is None else env
    return env.get(TORCHRUN_RUN_ID_ENV, "") != "" and rank_env_present(env)


def agent_hosts_store(env: Mapping[str, str] | None = None) -> bool:
    """True when the launcher hosts the rendezvous store (``atom launch`` always does; so does
    ``torchrun``), i.e. rank 0 must *not* start a ``TCPStore`` server on ``MASTER_PORT``."""
    env = os.environ if env is None else env
    return env.get(AGENT_STORE_ENV, "") == "True"


def worker_store(rank_info: RankInfo, *, timeout_s: float) -> dist.Store | None:
    """The store to pass as ``init_process_groups(rank_info, timeout_s=..., store=...)``.

    Under ``atom launch`` and ``torchrun`` the launcher hosts a ``TCPStore`` at
    ``MASTER_ADDR:MASTER_PORT`` and every rank connects to it as a client; rank 0 trying to host
    its own server on that port would fail with "address already in use". Elsewhere (the
    variables set by hand) this returns ``None`` and rank 0 hosts the store as usual.

    Args:
        rank_info: this process's rank contract (``RankInfo.from_env()``).
        timeout_s: how long to keep retrying the connection, and the default timeout of every
            store operation (seconds).
    Returns:
        A connected client store, or ``None``.
    Raises:
        ValueError: ``timeout_s`` is not positive.
        torch.distributed.DistStoreError: the launcher's store did not answer within
            ``timeout_s`` (the launcher is gone, or MASTER_ADDR/MASTER_PORT are wrong).
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: it must be a positive number of seconds")
    if not agent_hosts_store():
        return None
    import torch.distributed as dist  # lazy: keep `import atom.launch.env` torch-free

    return dist.TCPStore(rank_info.master_addr, rank_info.master_port, None, False,
                         timeout=datetime.timedelta(seconds=timeout_s))
