"""Two real processes on gloo: collective hashes, uneven all-to-all data, out-of-step ranks.

Each test starts two ranks of ``dp_worker.py`` with the rank contract in the environment
(rendezvous on a free ephemeral port, one torch thread each) and reads their JSON results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atom.engine.spawned_ranks import reserve_port

WORKER = Path(__file__).with_name("dp_worker.py")
REPO = Path(__file__).resolve().parents[2]
GROUP_TIMEOUT_S = 15  # gloo's collective timeout inside the workers (the fault tests wait it out)
DEADLINE_S = 120  # liveness: both ranks must have exited by then (generous: 2 shared cores)


def run_ranks(scenario: str, tmp_path: Path, *, world_size: int = 2) -> list[dict]:
    """Run ``scenario`` on ``world_size`` worker processes; their results in rank order."""
    holder, port = reserve_port()  # held until the ranks are gone (no other socket takes it)
    procs, logs = [], []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "ATOM_TEST_TIMEOUT_S": str(GROUP_TIMEOUT_S), "OMP_NUM_THREADS": "1"}
        log = open(tmp_path / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), scenario, str(tmp_path)],
                                      env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + DEADLINE_S
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{scenario}: the ranks did not exit within {DEADLINE_S}s (a hang)\n"
                    + _logs(tmp_path, world_size))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
        holder.close()
    results = []
    for rank, p in enumerate(procs):
        out = tmp_path / f"rank{rank}.json"
        assert p.returncode == 0 and out.exists(), (
            f"{scenario}: rank {rank} exited with {p.returncode}\n" + _logs(tmp_path, world_size))
        results.append(json.loads(out.read_text()))
    return results


def _logs(tmp_path: Path, world_size: int) -> str:
    return "\n".join(f"--- rank {r} ---\n{(tmp_path / f'rank{r}.log').read_text()[-4000:]}"
                     for r in range(world_size))


def test_uneven_workloads_end_with_equal_collective_hashes(tmp_path):
    r0, r1 = run_ranks("uneven_sequence", tmp_path)
    assert r0["error_type"] is None and r1["error_type"] is None, (r0, r1)
    # per tick: 5 all-gathers (control, batch shape, split sizes, forward, metrics), one
    # all-reduce, one all-to-all; reduce-scatter on ticks 0,3,6,9; barrier on 0,5,10; 3 lockstep
    # checks in the loop and one at the end
    assert r0["op_counts"] == {"all_gather": 12 * 5 + 4, "all_reduce": 12, "all_to_all": 12,
                               "reduce_scatter": 4, "barrier": 3}
    assert r0["num_collectives"] == r1["num_collectives"] == 95
    assert r0["hash"] == r1["hash"]
    assert r0["op_counts"] == r1["op_counts"]
    # batch-shape exchange: rank 0 always has 7*tick tokens, rank 1 7*tick+3 until it goes idle
    expected = [7 * t + 3 if t < 4 else 7 * t for t in range(12)]
    assert r0["max_tokens"] == r1["max_tokens"] == expected


def test_all_to_all_uneven_splits_deliver_the_right_rows(tmp_path):
    r0, r1 = run_ranks("all_to_all", tmp_path)
    assert r0["error_type"] is None and r1["error_type"] is None, (r0, r1)
    # rank 0 sends 1 row to itself and 3 to rank 1; rank 1 sends 2 to rank 0 and none to itself
    # (row value: 100 * sender + 10 * receiver + index)
    assert r0["out_splits"] == [1, 2] and r1["out_splits"] == [3, 0]
    assert r0["rows"] == [[0.0] * 3, [100.0] * 3, [101.0] * 3]
    assert r1["rows"] == [[10.0] * 3, [11.0] * 3, [12.0] * 3]
    assert r0["ids"] == [0, 1000, 1001] and r1["ids"] == [1, 2, 3]
    assert r0["gathered"] == r1["gathered"] == [[0.0, 0.0]] * 2 + [[1.0, 1.0]] * 2
    # sum over ranks of arange(4) * (rank + 1) = 3 * [0, 1, 2, 3], split in halves
    assert r0["scattered"] == [0.0, 3.0] and r1["scattered"] == [6.0, 9.0]


def _assert_history_shows_both_ranks(message: str, first_diff: str) -> None:
    assert "rank 0:" in message and "rank 1:" in message and "no history" not in message
    marked = [line for line in message.splitlines() if line.startswith("  !")]
    assert len(marked) == 1 and marked[0].split()[1] == first_diff, message


def test_rank_skipping_a_device_collective_fails_both_ranks_not_hangs(tmp_path):
    """Rank 1 skips its last device-group all-gather of tick 2: rank 0 waits in it on the device
    group while rank 1 waits in the next control-group collective. Nothing can pair, so both
    fail at gloo's group timeout (the last resort) with each rank's history side by side."""
    r0, r1 = run_ranks("skip", tmp_path)
    for r in (r0, r1):
        assert r["error_type"] == "CollectiveError", r
        assert "Timed out" in r["error"]
        _assert_history_shows_both_ranks(r["error"], "#21")
    assert "all_gather int64[13]" in r0["error"].splitlines()[0]  # the device op rank 1 skipped


def test_control_sync_paired_with_another_collective_is_caught(tmp_path):
    """Rank 1 skips a control-group all-gather the size of the control vector, so rank 0's copy
    pairs silently with rank 1's next control sync: rank 1 sees a row without the control magic
    and raises LockstepError at once; rank 0, left alone in its own control sync, fails at the
    group timeout. Both messages carry both histories."""
    r0, r1 = run_ranks("same_group", tmp_path)
    assert r1["error_type"] == "LockstepError" and "paired with a different" in r1["error"], r1
    assert r0["error_type"] == "CollectiveError", r0
    for r in (r0, r1):
        _assert_history_shows_both_ranks(r["error"], "#23")


def test_changed_collective_is_caught_by_the_hash_in_the_control_vector(tmp_path):
    """Rank 1 all-reduces float32 where rank 0 uses int32 (same bytes, same count: gloo pairs
    them). The next control sync sees different hashes on every rank, all ranks run the full
    lockstep check, and both raise LockstepError right away, without any timeout."""
    r0, r1 = run_ranks("dtype", tmp_path)
    for r in (r0, r1):
        assert r["error_type"] == "LockstepError", r
        assert "collective sequences differ" in r["error"] and "Timed out" not in r["error"]
        _assert_history_shows_both_ranks(r["error"], "#18")
        marked = next(line for line in r["error"].splitlines() if line.startswith("  !"))
        assert "all_reduce int32[13]" in marked and "all_reduce float32[13]" in marked
