"""One rank of a launcher test (run as a script by ``atom.launch`` or ``torchrun``; never
imported by pytest).

Usage: ``python worker.py OUT_DIR`` with the rank contract in the environment. Rendezvous through
the launcher's store, all-gather the ranks, exchange one ZMQ endpoint per rank through the store,
and write ``OUT_DIR/rank{RANK}.json`` (its pid goes to ``rank{RANK}.pid`` first). Environment
switches for the failure tests:

* ``ATOM_TEST_FAIL_RANK`` = R and ``ATOM_TEST_FAIL_MODE`` = ``exit`` (``os._exit(3)``),
  ``raise`` (an uncaught RuntimeError) or ``abort`` (SIGABRT): rank R writes the time to
  ``rank{R}.fail_time`` and fails right after the all-gather; every other rank blocks on a
  store key nobody sets, so only the launcher can end it (within the test's deadline, far
  below the store timeout); with ``ATOM_TEST_IGNORE_SIGTERM=1`` they also ignore SIGTERM;
* ``ATOM_TEST_BLOCK=1``: every rank starts a child process (a stand-in for rank 0's front end),
  writes its pid to ``rank{RANK}.child.pid``, prints ``READY <rank> <pid> <child pid>`` on
  stdout and blocks the same way.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time

import torch

from atom.dp import collectives as C
from atom.dp.groups import RankInfo, init_process_groups
from atom.launch import env as launch_env
from atom.launch.endpoints import lookup_endpoint, publish_endpoint
from atom.launch.errors import install_error_handler

# store and group timeout: far beyond any test deadline, so only a kill ends a wait
TIMEOUT_S = 120.0


def _block_forever(store) -> None:
    store.wait(["atom/test/never"], datetime.timedelta(seconds=TIMEOUT_S))
    raise AssertionError("nobody sets atom/test/never")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _fail(mode: str, out_dir: str, rank: int) -> None:
    _write(os.path.join(out_dir, f"rank{rank}.fail_time"), repr(time.time()))
    sys.stderr.write(f"rank failing on purpose ({mode})\n")
    sys.stderr.flush()
    if mode == "exit":
        os._exit(3)
    if mode == "abort":
        os.abort()
    raise RuntimeError("injected failure for the launcher test")


def main() -> None:
    install_error_handler()
    out_dir = sys.argv[1]
    info = RankInfo.from_env()
    fail_rank = os.environ.get("ATOM_TEST_FAIL_RANK")
    if (fail_rank is not None and int(fail_rank) != info.rank
            and os.environ.get("ATOM_TEST_IGNORE_SIGTERM") == "1"):
        # before the all-gather, after which the failing rank fails: set any later, a rank
        # still on its way there could get the launcher's SIGTERM first (seen in a fresh clone)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher must escalate
    groups = init_process_groups(info, timeout_s=TIMEOUT_S)
    gathered = C.all_gather_int64([info.rank, info.local_rank], groups.control)
    publish_endpoint(groups.store, f"test/rank{info.rank}", f"tcp://127.0.0.1:{40000 + info.rank}",
                     master_addr=info.master_addr)
    endpoints = [lookup_endpoint(groups.store, f"test/rank{r}", timeout_s=TIMEOUT_S,
                                 master_addr=info.master_addr) for r in range(info.world_size)]
    _write(os.path.join(out_dir, f"rank{info.rank}.pid"), str(os.getpid()))
    fail_mode = os.environ.get("ATOM_TEST_FAIL_MODE", "raise")
    if fail_rank is not None:
        if int(fail_rank) == info.rank:
            _fail(fail_mode, out_dir, info.rank)
        _block_forever(groups.store)
    if os.environ.get("ATOM_TEST_BLOCK") == "1":
        child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
        _write(os.path.join(out_dir, f"rank{info.rank}.child.pid"), str(child.pid))
        # one write of a whole line (atomic on a pipe): print() may write the newline apart,
        # and the two ranks share the launcher's stdout
        sys.stdout.write(f"READY {info.rank} {os.getpid()} {child.pid}\n")
        sys.stdout.flush()
        _block_forever(groups.store)
    result = {
        "rank": info.rank, "world_size": info.world_size, "local_rank": info.local_rank,
        "local_world_size": info.local_world_size, "node_rank": os.environ.get("NODE_RANK"),
        "gathered": gathered.tolist(), "endpoints": endpoints,
        "rank_env_present": launch_env.rank_env_present(),
        "launcher_pid": os.environ.get("ATOM_LAUNCHER_PID"),
        "torchrun_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
    }
    C.barrier(groups.control)  # nobody tears down the store-backed groups while a peer reads
    groups.destroy()
    with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
