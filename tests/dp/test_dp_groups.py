"""Rank contract parsing and a one-rank process-group set-up (in process, world size 1)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from atom.dp import collectives as C
from atom.dp.groups import RankInfo, init_process_groups
from atom.engine.spawned_ranks import reserve_port

ENV = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
       "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_rank_info_from_env():
    info = RankInfo.from_env(ENV)
    assert info == RankInfo(rank=1, world_size=4, local_rank=1, local_world_size=2,
                            master_addr="10.0.0.1", master_port=29500)
    assert (info.tp_size, info.dp_rank, info.dp_size) == (1, 1, 4)


def test_local_world_size_defaults_to_world_size():
    env = {k: v for k, v in ENV.items() if k != "LOCAL_WORLD_SIZE"}
    assert RankInfo.from_env(env).local_world_size == 4


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                  "MASTER_PORT"])
def test_missing_variable_says_what_to_set(name):
    env = {k: v for k, v in ENV.items() if k != name}
    with pytest.raises(ValueError, match=f"{name} is not set: set RANK, WORLD_SIZE, LOCAL_RANK, "
                                         f"MASTER_ADDR and MASTER_PORT"):
        RankInfo.from_env(env)


@pytest.mark.parametrize("changes, match", [
    ({"RANK": "one"}, "RANK='one' is not an integer"),
    ({"RANK": "4"}, "RANK=4 is outside"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 is outside"),
    ({"LOCAL_WORLD_SIZE": "5"}, "LOCAL_WORLD_SIZE=5"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT=0"),
])
def test_invalid_values(changes, match):
    with pytest.raises(ValueError, match=match):
        RankInfo.from_env({**ENV, **changes})


def test_tp_size_must_be_one():
    with pytest.raises(ValueError, match="tensor parallelism"):
        RankInfo(0, 1, 0, 1, "127.0.0.1", 0, tp_size=2)


def test_init_rejects_bad_timeout():
    with pytest.raises(ValueError, match="timeout_s"):
        init_process_groups(RankInfo(0, 1, 0, 1, "127.0.0.1", 0), timeout_s=0)


def test_single_rank_groups_and_collectives():
    """World size 1 exercises the whole set-up path in this process; torn down afterwards."""
    holder, port = reserve_port()  # a free port for the rank-0-hosted store
    groups = init_process_groups(RankInfo(0, 1, 0, 1, "127.0.0.1", port), timeout_s=30)
    holder.close()
    try:
        assert dist.is_initialized() and groups.device_backend == "gloo"
        with pytest.raises(RuntimeError, match="already initialized"):
            init_process_groups(groups.rank_info, timeout_s=30)
        log = C.CollectiveLog()
        out = C.all_gather_int64([1, 2, 3], groups.control, log=log)
        assert out.tolist() == [[1, 2, 3]]
        x = torch.ones(4)
        C.all_reduce_async(x, groups.device, log=log).wait()
        C.barrier(groups.control, log=log)
        assert C.check_lockstep(log, groups.control) == 3
        assert log.num_collectives == 4
    finally:
        groups.destroy()
        groups.destroy()  # idempotent
    assert not dist.is_initialized()
