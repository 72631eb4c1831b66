"""Separate network hosts on this machine: Linux network namespaces joined by a bridge.

Topology (one per :class:`NetnsHosts`; ``T`` is a token unique to the run: the driver's pid in
hex and a counter)::

    root namespace (the host side: the driver, the benchmark client, a test's openai client)
      bridge atb<T>  10.X.Y.1/24
        ├── veth atv<T>-0 ══ eth0 in namespace atom-<T>-n0   10.X.Y.10/24   node 0
        ├── veth atv<T>-1 ══ eth0 in namespace atom-<T>-n1   10.X.Y.11/24   node 1
        └── ...

Each namespace has its own loopback (up, and private: node 1's ``127.0.0.1`` is not node 0's)
and one interface, ``eth0``, with the node's address; there is no default route, nothing beyond
the /24 is reachable. The host side reaches every node through the bridge's address, so a
benchmark client in the root namespace talks to node 0's server as a client on another host
would. The /24 is picked from 10.208.0.0/12 starting at one derived from the token, skipping any
that an address or route of the root namespace already uses (or taken from the cluster file's
addresses).

Lifetime: :meth:`NetnsHosts.create` first removes stale hosts of this prefix whose creating
process is gone (a driver killed with SIGKILL), then creates; :meth:`NetnsHosts.remove` kills
whatever still runs inside (by pid: only what this run started can be in its namespaces),
deletes the veths, namespaces and bridge, and checks that none is left. Use it as a context
manager so removal happens on every exit path. Needs root and iproute2 (``ip``).
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import re
import signal
import subprocess
import time

logger = logging.getLogger(__name__)

NETNS_PREFIX = "atom-"
BRIDGE_PREFIX = "atb"
VETH_PREFIX = "atv"
NODE_IFNAME = "eth0"  # the interface inside every namespace (the driver's GLOO_SOCKET_IFNAME)
_POOL = ipaddress.IPv4Network("10.208.0.0/12")
_FIRST_HOST = 10  # node i is .(10 + i); .1 is the bridge
_MAX_IFNAME = 15  # Linux IFNAMSIZ - 1
_STALE = re.compile(r"^(?:atom-|atb)([0-9a-f]+)-")
_REMOVE_TIMEOUT_S = 10.0
_seq = itertools.count()


def _ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS``; its stdout. Raises RuntimeError with ip's stderr when it fails."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def list_netns() -> list[str]:
    """Names of every network namespace (``ip netns list``)."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def list_links() -> list[str]:
    """Names of every link of the root namespace (a veth shows as ``name@peer``)."""
    names = re.findall(r"^\d+: ([^:]+):", _ip("-o", "link", "show"), flags=re.M)
    return [n.split("@")[0] for n in names]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces and bridges of this prefix whose creating process is gone;
    returns their names. Those of live processes (another run) are left alone."""
    removed = []
    for ns in list_netns():
        m = _STALE.match(ns)
        if m and not _alive(int(m.group(1), 16)):
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    for link in list_links():
        m = _STALE.match(link)
        if m and link.startswith(BRIDGE_PREFIX) and not _alive(int(m.group(1), 16)):
            _ip("link", "del", link, check=False)
            removed.append(link)
    if removed:
        logger.warning("removed stale network hosts of dead runs: %s", ", ".join(removed))
    return removed


def netns_pids(ns: str) -> list[int]:
    """Pids of the processes inside namespace ``ns`` (none once it is gone)."""
    return [int(p) for p in _ip("netns", "pids", ns, check=False).split()]


def _kill_inside(ns: str) -> list[int]:
    pids = netns_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = [ipaddress.IPv4Interface(a).network
            for a in re.findall(r"inet (\S+)", _ip("-4", "-o", "addr", "show"))]
    for line in _ip("-4", "route", "show").splitlines():
        dest = line.split()[0]
        if dest != "default":
            nets.append(ipaddress.IPv4Network(dest, strict=False))
    return nets


def pick_subnet(token_seed: int) -> ipaddress.IPv4Network:
    """A /24 of 10.208.0.0/12 that no address or route of the root namespace overlaps,
    trying from one derived from ``token_seed``. Raises RuntimeError when none is free."""
    subnets = list(_POOL.subnets(new_prefix=24))
    used = _used_networks()
    for k in range(len(subnets)):
        candidate = subnets[(token_seed + k) % len(subnets)]
        if not any(candidate.overlaps(u) for u in used):
            return candidate
    raise RuntimeError(f"no free /24 in {_POOL} for the network namespaces")


class NetnsHosts:
    """``num_hosts`` network hosts (module docstring). Owns the namespaces, veths and bridge
    from :meth:`create` until :meth:`remove`; guarantees, used as a context manager, that they
    are removed on every way out.

    Args:
        num_hosts: how many hosts (nodes).
        addresses: the hosts' addresses, all in one /24 whose .1 is free for the bridge
            (:meth:`atom.benchmarks.multinode.cluster.ClusterSpec.subnet` checks that); None
            picks a free /24 and puts host i at .10+i.
    Raises:
        ValueError: more hosts than names or addresses allow (at most 100), or as many
            addresses as hosts not given.
    """

    def __init__(self, num_hosts: int, *, addresses: list[str] | None = None):
        if not 1 <= num_hosts <= 100:
            raise ValueError(f"{num_hosts} network hosts: netns supports 1 to 100")
        seq = next(_seq)
        self.token = f"{os.getpid():x}-{seq:x}"
        self.bridge = f"{BRIDGE_PREFIX}{self.token}"
        self.namespaces = [f"{NETNS_PREFIX}{self.token}-n{i}" for i in range(num_hosts)]
        self.veths = [f"{VETH_PREFIX}{self.token}-{i}" for i in range(num_hosts)]
        if len(self.veths[-1]) > _MAX_IFNAME:
            raise ValueError(f"interface name {self.veths[-1]!r} is longer than {_MAX_IFNAME}")
        if addresses is not None and len(addresses) != num_hosts:
            raise ValueError(f"{len(addresses)} addresses for {num_hosts} network hosts")
        self._given = addresses
        self._seed = os.getpid() * 16 + seq
        self.addresses: list[str] = []
        self.host_address: str | None = None  # the bridge's: the root namespace's side

    def __enter__(self) -> NetnsHosts:
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def create(self) -> None:
        """Remove stale hosts, then create these (partly created ones are removed on failure).

        Raises:
            RuntimeError: an ``ip`` command failed (not root, no iproute2, ...), or the given
                addresses' /24 is in use here.
        """
        remove_stale()
        if self._given:
            net = ipaddress.IPv4Network(f"{self._given[0]}/24", strict=False)
            if any(net.overlaps(used) for used in _used_networks()):
                raise RuntimeError(f"{net} is in use on this machine (an address or route of "
                                   f"the root namespace): give the nodes other addresses, or "
                                   f"none (a free /24 is picked)")
            self.addresses = list(self._given)
        else:
            net = pick_subnet(self._seed)
            self.addresses = [str(net[_FIRST_HOST + i]) for i in range(len(self.namespaces))]
        self.host_address = str(net[1])
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for ns, veth, address in zip(self.namespaces, self.veths, self.addresses):
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", NODE_IFNAME,
                    "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", NODE_IFNAME)
                _ip("-n", ns, "link", "set", NODE_IFNAME, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        logger.info("network hosts %s at %s (host side %s on %s)", ", ".join(self.namespaces),
                    ", ".join(self.addresses), self.host_address, self.bridge)

    def exec_argv(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``host``'s namespace (``ip netns exec`` execs it: the
        process started is the command itself, same pid)."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def pids(self, host: int) -> list[int]:
        """Pids of the processes running inside host ``host``."""
        return netns_pids(self.namespaces[host])

    def leftovers(self) -> list[str]:
        """This run's namespaces and links that still exist."""
        mine = set(self.namespaces) | set(self.veths) | {self.bridge}
        return sorted(mine & (set(list_netns()) | set(list_links())))

    def remove(self) -> None:
        """Kill what runs inside, delete everything, and check it is gone.

        Raises:
            RuntimeError: something was still there ``_REMOVE_TIMEOUT_S`` later.
        """
        present_ns = set(list_netns())
        for ns, veth in zip(self.namespaces, self.veths):
            if ns in present_ns:
                killed = _kill_inside(ns)
                if killed:
                    logger.warning("killed processes left in %s: %s", ns, killed)
            _ip("link", "del", veth, check=False)  # takes its peer, eth0, along
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        deadline = time.monotonic() + _REMOVE_TIMEOUT_S
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)  # the kernel frees a namespace's devices asynchronously
        if left:
            raise RuntimeError(f"network hosts not removed: {left}")
