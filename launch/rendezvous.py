"""The launchers' rendezvous store: hosted by node 0's launcher, shared with every rank.

Node 0's launcher hosts a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` (port 0: a free port,
single node only) for as long as any rank may need it; its workers and every other node's
launcher and workers connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``, as under
torchrun). Hosting it in the launcher rather than in rank 0 means a free port is picked without a
bind-then-release race, and the store outlives any one rank (so a dying rank 0 cannot take the
post-mortem keys of the others with it).

Between launchers (``--nnodes`` > 1) the store carries three things, all JSON bytes, under
``atom/launch/``:

* ``node/<R>``: node R joined, with its ``--nproc-per-node``; every launcher waits for all
  nodes before it starts a worker, and refuses a duplicate node rank or unequal sizes;
* ``stop``: the first reason any launcher stops (a failed rank, a signal, a lost node); the
  other launchers poll it every :data:`STORE_POLL_S` and stop their own workers, so a dead rank
  ends every node even when the others are blocked somewhere no collective error reaches them
  (an idle ZMQ wait);
* ``heartbeat/<R>``: a counter every launcher but node 0's bumps each :data:`STORE_POLL_S`
  while its workers run; node 0's launcher (:class:`NodeWatch`) declares a node **lost** when
  its counter has not moved for ``--node-timeout-s`` (by node 0's clock) and it is not done: a
  launcher killed with SIGKILL, a crashed host, a cut network. Node 0 then stops as for a
  failure, naming the lost node, and publishes it as the stop reason. The other direction
  needs no key: a node that loses the store (node 0 gone) stops by itself;
* ``done/<R>``: node R's workers have all exited (the exit barrier); node 0 keeps the store up
  until every launcher is done or lost.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

STORE_POLL_S = 1.0  # how often a launcher looks for another node's stop record and beats
_PREFIX = "atom/launch/"
_STOP_KEY = _PREFIX + "stop"
_OP_TIMEOUT_S = 30.0  # any single store operation once connected


def _node_key(node_rank: int) -> str:
    return f"{_PREFIX}node/{node_rank}"


def _heartbeat_key(node_rank: int) -> str:
    return f"{_PREFIX}heartbeat/{node_rank}"


def _done_key(node_rank: int) -> str:
    return f"{_PREFIX}done/{node_rank}"


@dataclass(frozen=True)
class StopRecord:
    """Why launcher ``node_rank`` stopped its workers: a failed rank (``rank``/``exit_code``
    set), a stop signal to it (``signal``), a node it found lost (``lost_node``), or a lost
    store (``reason`` only)."""

    node_rank: int
    reason: str
    rank: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    lost_node: int | None = None

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> StopRecord:
        return cls(**json.loads(data.decode("utf-8")))


class LaunchStore:
    """This launcher's connection to the rendezvous store (the server itself on node 0).

    Owns the ``TCPStore`` object: on node 0 dropping it stops the server, so keep it alive
    until :meth:`wait_all_done` returns.
    """

    def __init__(self, store: dist.TCPStore, *, node_rank: int, nnodes: int, address: str):
        self.store = store
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.address = address  # "host:port", for messages

    @property
    def port(self) -> int:
        """The store's TCP port (the one actually bound when ``--master-port 0``)."""
        return self.store.port

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @classmethod
    def open(cls, *, master_addr: str, master_port: int, node_rank: int, nnodes: int,
             timeout_s: float) -> LaunchStore:
        """Host the store (node 0) or connect to it (other nodes, retrying for ``timeout_s``).

        Raises:
            RuntimeError: node 0 cannot bind ``master_port``, or another node cannot reach
                node 0's store within ``timeout_s``; the message says what to check.
        """
        import torch.distributed as dist  # lazy: `atom launch --help` should not wait for torch

        is_host = node_rank == 0
        address = f"{master_addr}:{master_port}"
        try:
            store = dist.TCPStore(master_addr, master_port, None, is_host,
                                  timeout=datetime.timedelta(seconds=timeout_s),
                                  wait_for_workers=False)
        except RuntimeError as e:  # DistNetworkError: bind or connect failed
            first_line = str(e).splitlines()[0]
            if is_host:
                raise RuntimeError(f"cannot host the rendezvous store on port {master_port}: "
                                   f"{first_line}. Pick another --master-port (0 picks a free "
                                   f"one on a single node)") from None
            raise RuntimeError(f"could not reach node 0's launcher at {address} within "
                               f"{timeout_s:g}s ({first_line}): start it with the same "
                               f"--master-addr/--master-port, and check the address is "
                               f"reachable from this node") from None
        store.set_timeout(datetime.timedelta(seconds=_OP_TIMEOUT_S))
        return cls(store, node_rank=node_rank, nnodes=nnodes,
                   address=f"{master_addr}:{store.port}")

    def join(self, nproc_per_node: int, *, timeout_s: float) -> None:
        """Register this node and wait until all ``nnodes`` launchers have (multi-node only).

        Raises:
            ValueError: another launcher already runs this ``--node-rank``, or the nodes were
                given different ``--nproc-per-node``.
            TimeoutError: some node did not join within ``timeout_s``.
        """
        me = json.dumps({"nproc_per_node": nproc_per_node, "host": socket.gethostname(),
                         "pid": os.getpid(), "token": os.urandom(8).hex()})
        got = self.store.compare_set(_node_key(self.node_rank), "", me).decode("utf-8")
        if got != me:
            raise ValueError(f"--node-rank {self.node_rank} is already taken by another "
                             f"launcher ({got}): give every node a distinct --node-rank in "
                             f"[0, {self.nnodes})")
        import torch.distributed as dist

        keys = [_node_key(r) for r in range(self.nnodes)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except dist.DistStoreError:
            missing = [r for r in range(self.nnodes) if not self.store.check([_node_key(r)])]
            raise TimeoutError(f"node(s) {missing} did not join within {timeout_s:g}s: start "
                               f"one launcher per node with --nnodes {self.nnodes} and "
                               f"--master-addr/--master-port {self.address}") from None
        sizes = {r: json.loads(self.store.get(k))["nproc_per_node"] for r, k in enumerate(keys)}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"the nodes were given different --nproc-per-node {sizes}: every "
                             f"node must run the same number of ranks")

    def publish_stop(self, record: StopRecord) -> None:
        """Tell the other launchers to stop (the first record wins; no-op on one node)."""
        if not self.multi_node:
            return
        try:
            self.store.compare_set(_STOP_KEY, "", record.to_bytes())
        except RuntimeError:
            pass  # the store is gone: the other nodes see that themselves

    def remote_stop(self) -> StopRecord | None:
        """Another node's stop record, a synthetic one if the store is unreachable (node 0's
        launcher is gone), or ``None``."""
        if not self.multi_node:
            return None
        try:
            if not self.store.check([_STOP_KEY]):
                return None
            record = StopRecord.from_bytes(self.store.get(_STOP_KEY))
        except RuntimeError as e:  # DistNetworkError / DistStoreError
            return StopRecord(node_rank=0, reason=f"lost the rendezvous store at "
                                                  f"{self.address} (node 0's launcher exited?): "
                                                  f"{str(e).splitlines()[0]}")
        return None if record.node_rank == self.node_rank else record

    def beat(self) -> None:
        """Bump this node's heartbeat (nodes other than 0, multi-node only; module docstring)."""
        if self.multi_node and self.node_rank != 0:
            try:
                self.store.add(_heartbeat_key(self.node_rank), 1)
            except RuntimeError:
                pass  # the store is gone: remote_stop() reports it

    def mark_done(self) -> None:
        """This launcher's workers are all gone (the exit barrier's arrival)."""
        if self.multi_node:
            try:
                self.store.set(_done_key(self.node_rank), b"1")
            except RuntimeError:
                pass  # node 0 is gone; nobody is waiting for us

    def is_done(self, node_rank: int) -> bool:
        """True once node ``node_rank`` called :meth:`mark_done`."""
        return self.store.check([_done_key(node_rank)])

    def all_done(self) -> bool:
        """True once every node called :meth:`mark_done` (always true on one node)."""
        return not self.multi_node or all(self.is_done(r) for r in range(self.nnodes))


class NodeWatch:
    """Node 0's watch over the other launchers' heartbeats (module docstring).

    Owns, per other node, the last heartbeat count seen and when (``time.monotonic()`` of this
    launcher) it last moved; a node counts from the moment the watch starts.
    """

    def __init__(self, store: LaunchStore, *, node_timeout_s: float, now: float):
        self.store = store
        self.node_timeout_s = node_timeout_s
        self._seen = {r: (0, now) for r in range(1, store.nnodes)}

    def lost(self, now: float) -> list[tuple[int, float]]:
        """``(node_rank, seconds silent)`` of every node lost by ``now``, in node order.

        Raises:
            RuntimeError: the store (this launcher's own) cannot be read.
        """
        found = []
        for node, (count, since) in self._seen.items():
            latest = self.store.store.add(_heartbeat_key(node), 0)
            if latest != count:
                self._seen[node] = (latest, now)
            elif now - since > self.node_timeout_s and not self.store.is_done(node):
                found.append((node, now - since))
        return found
