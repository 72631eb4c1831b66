"""The cluster description of a multi-node benchmark run (a JSON file; torch-free).

::

    {"name": "2x1",                      # names the run's report folder
     "nproc_per_node": 1,                # ranks per node (every node the same)
     "nodes": [{"address": "10.0.0.1", "ssh": "gpu1"},
               {"address": "10.0.0.2", "ssh": "gpu2"}],
     "master_port": 29500,               # node 0's rendezvous store (default 29500)
     "http_port": 8000,                  # node 0's OpenAI server (default 8000)
     "gloo_socket_ifname": "eth0",       # optional: GLOO_SOCKET_IFNAME on every node
     "python": "/opt/atom/.venv/bin/python",  # optional: atom's Python on the nodes
     "workdir": "/opt/atom",             # optional (ssh): where to cd before starting
     "env": {"OMP_NUM_THREADS": "8"}}    # optional: extra environment on every node

``nodes[i].address`` is node i's address as the other nodes and the benchmark client reach it;
node 0's is every launcher's ``--master-addr`` and the server's ``--host``. ``ssh`` (default:
the address) is the ssh destination. With the ``netns`` method the addresses may be left out
(``"nodes": [{}, {}]``): the driver gives the namespaces addresses of its own
(:mod:`atom.benchmarks.multinode.netns`); given ones must share one /24. Unknown keys are
errors, like everywhere in atom's configuration.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import pathlib
import re
from dataclasses import dataclass, field

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class NodeSpec:
    """One node: its reachable address (None: netns assigns one) and ssh destination."""

    address: str | None = None
    ssh: str | None = None  # ssh destination ("user@host"); None: the address


@dataclass(frozen=True)
class ClusterSpec:
    """A deployment's nodes and ports (module docstring). Raises ValueError when invalid."""

    name: str
    nodes: tuple[NodeSpec, ...]
    nproc_per_node: int = 1
    master_port: int = 29500  # torchrun's default
    http_port: int = 8000  # atom serve's default
    gloo_socket_ifname: str | None = None
    python: str | None = None  # atom's Python on the nodes; None: this driver's interpreter
    # path (right for netns, and for ssh hosts with the same layout)
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if not _NAME.match(self.name):
            raise ValueError(f"cluster name {self.name!r}: use letters, digits and _ . - only "
                             f"(it names the report folder)")
        if not self.nodes:
            raise ValueError("the cluster has no nodes: list at least one under 'nodes'")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node={self.nproc_per_node} must be at least 1")
        for port_name in ("master_port", "http_port"):
            if not 1 <= getattr(self, port_name) <= 65535:
                raise ValueError(f"{port_name}={getattr(self, port_name)} is not a TCP port")
        given = [n.address for n in self.nodes if n.address is not None]
        if given and len(given) != len(self.nodes):
            raise ValueError("give every node an address, or none (netns then assigns them)")
        if len(set(given)) != len(given):
            raise ValueError(f"two nodes share an address: {given}")

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def master_addr(self) -> str:
        """Node 0's address. Raises ValueError while the addresses are unassigned."""
        address = self.nodes[0].address
        if address is None:
            raise ValueError("the nodes have no addresses: give them in the cluster file, or "
                             "use --method netns, which assigns them")
        return address

    def with_addresses(self, addresses: list[str]) -> ClusterSpec:
        """The same cluster with node ``i`` at ``addresses[i]`` (what netns assigned)."""
        nodes = tuple(dataclasses.replace(n, address=a) for n, a in zip(self.nodes, addresses))
        return dataclasses.replace(self, nodes=nodes)

    def subnet(self) -> ipaddress.IPv4Network | None:
        """The /24 of the given addresses (netns), None when unassigned.

        Raises:
            ValueError: the addresses are not IPv4, not in one /24, or one ends in .0, .1
                (the bridge's) or .255.
        """
        if self.nodes[0].address is None:
            return None
        try:
            hosts = [ipaddress.IPv4Address(n.address) for n in self.nodes]
        except ValueError as e:
            raise ValueError(f"netns needs IPv4 node addresses: {e}") from None
        net = ipaddress.IPv4Network(f"{hosts[0]}/24", strict=False)
        bad = [str(h) for h in hosts if h not in net or int(h) & 0xFF in (0, 1, 255)]
        if bad:
            raise ValueError(f"netns node addresses must share one /24 ({net}) and not end in "
                             f".0, .1 (the host side's bridge) or .255: {bad}")
        return net

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ClusterSpec:
        """Build from parsed JSON (module docstring).

        Raises:
            ValueError: an unknown key, a wrong type, or invalid values.
        """
        if not isinstance(data, dict):
            raise ValueError("the cluster file must hold a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown cluster key(s) {unknown}: known are {sorted(known)}")
        raw_nodes = data.get("nodes")
        if not isinstance(raw_nodes, list) or not all(isinstance(n, dict) for n in raw_nodes):
            raise ValueError("'nodes' must be a list of objects, e.g. [{\"address\": "
                             "\"10.0.0.1\"}, {\"address\": \"10.0.0.2\"}]")
        node_keys = {f.name for f in dataclasses.fields(NodeSpec)}
        for node in raw_nodes:
            if set(node) - node_keys:
                raise ValueError(f"unknown node key(s) {sorted(set(node) - node_keys)}: known "
                                 f"are {sorted(node_keys)}")
        env = data.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise ValueError("'env' must map names to strings")
        return cls(**{**data, "nodes": tuple(NodeSpec(**n) for n in raw_nodes), "env": env})

    @classmethod
    def load(cls, path: str | pathlib.Path) -> ClusterSpec:
        """Read a cluster file. Raises ValueError (bad JSON or values), OSError."""
        try:
            data = json.loads(pathlib.Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        return cls.from_json(data)
