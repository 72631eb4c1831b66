"""SpawnedRanks without processes: the group after a rank failure (slots kept by shrink, all
of them by replace, none by stop or when no rank is left), the devices a shrunk group sees, and
the group's reserved MASTER_PORT."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

import atom.engine.spawned_ranks as spawned
from atom.engine.liveness import DEAD, RankFailedError, RankFailure
from atom.engine.spawned_ranks import SpawnedRanks


def _lost(*ranks: int) -> RankFailedError:
    return RankFailedError([RankFailure(r, DEAD, "gone") for r in ranks])


def test_successor_slots_per_policy():
    ranks = SpawnedRanks("atom.dp.dp_core_proc", slots=[0, 1, 2])
    try:
        shrunk = ranks.successor(_lost(1), policy="shrink")
        replaced = ranks.successor(_lost(1), policy="replace")
        assert (shrunk.slots, shrunk.generation) == ([0, 2], 1)
        assert (replaced.slots, replaced.generation) == ([0, 1, 2], 1)
        assert shrunk.address("output") != ranks.address("output")  # a fresh ipc folder
        assert ranks.successor(_lost(1), policy="stop") is None
        assert ranks.successor(_lost(0, 1, 2), policy="shrink") is None
        assert shrunk.successor(_lost(0), policy="shrink").slots == [2]
    finally:
        for r in (ranks, shrunk, replaced):
            r.cleanup()


def test_a_shrunk_group_sees_only_its_slots_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert spawned._visible_devices([0, 1]) is None
    assert spawned._visible_devices([0, 2]) == "0,2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert spawned._visible_devices([1, 2]) == "5,6"


def test_a_reserved_port_stays_free_for_the_store_only():
    # the group's MASTER_PORT: no other socket may take it before rank 0's TCPStore binds it
    holder, port = spawned.reserve_port()
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
        assert store.port == port
        del store
    finally:
        holder.close()
