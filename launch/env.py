"""Worker-side view of the launch environment: who started this process, and its rendezvous store.

The variables themselves are documented in :mod:`atom.launch.launcher` (the env contract). This
module is what an ``atom`` command calls at start-up to find out whether it is one rank of a
multi-rank run (started by ``atom launch`` or by ``torchrun``); which store a rank rendezvous
through is decided in one place, :func:`atom.dp.rank_contract.hosts_store`. It imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from atom.dp.rank_contract import AGENT_STORE_ENV

__all__ = ["AGENT_STORE_ENV", "rank_env_present"]

# The rank contract (what torchrun sets too); RankInfo.from_env reads these.
RANK_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Set by `atom launch` only: the launcher's pid (for a user's tools: who to blame for a SIGTERM).
LAUNCHER_PID_ENV = "ATOM_LAUNCHER_PID"
# Per-rank file a failing worker writes its traceback to (torchelastic's error-file format).
ERROR_FILE_ENV = "ATOM_ERROR_FILE"
TORCHELASTIC_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
NODE_RANK_ENV = "NODE_RANK"
# Set by `atom launch --max-restarts` only: where rank 0 writes the pid of the front end it
# starts, which then lives in a session of its own and outlives restarts (atom.launch.restarts).
FRONT_END_PID_FILE_ENV = "ATOM_FRONT_END_PID_FILE"
# Set by `atom launch --max-restarts` for rank 0 of the first start only: a descriptor of the
# launcher's own stderr, the front end's stderr. Rank 0's stderr is a pipe the launcher closes
# when that start's group has stopped; the front end outlives it (and holding it open would
# keep the launcher waiting for the pipe's end before it restarts the group).
FRONT_END_STDERR_FD_ENV = "ATOM_FRONT_END_STDERR_FD"


def rank_env_present(env: Mapping[str, str] | None = None) -> bool:
    """True when every rank-contract variable (:data:`RANK_ENV_VARS`) is set and non-empty,
    whoever set it (``atom launch``, ``torchrun``, or a user by hand). A command that sees this
    runs as one rank: ``RankInfo.from_env()`` then reads (and validates) the values."""
    env = os.environ if env is None else env
    return all(env.get(name, "") != "" for name in RANK_ENV_VARS)
