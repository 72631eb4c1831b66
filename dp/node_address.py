"""This node's network address as the other nodes see it, and the interface that holds it.

A deployment's nodes are told one address, ``MASTER_ADDR`` (node 0's). Everything that a rank
or the front end binds for peers on other nodes must sit on an address those peers can reach,
never on loopback: each node has its own ``127.0.0.1`` (separate hosts; on one machine, separate
network namespaces). The rule used everywhere (one home):

* **this node's address** is the source address of the route to ``MASTER_ADDR``
  (:func:`route_source_address`): on node 0 that is the address it was told to be reachable at,
  elsewhere the address on the network that reaches node 0. A loopback ``MASTER_ADDR`` gives
  ``127.0.0.1``: every node is then this machine (the loopback tests);
* **gloo's interface** (``GLOO_SOCKET_IFNAME``, torch's variable): when it is unset, the
  interface that holds this node's address (:func:`interface_of`). Without it gloo binds the
  address the machine's hostname resolves to, often ``127.0.0.1`` (a ``127.0.0.1 myhost`` line
  in ``/etc/hosts``, as on this project's machines), and peers on other nodes then fail to
  connect only after the group timeout. A set ``GLOO_SOCKET_IFNAME`` is respected
  (:func:`gloo_address` then reports that interface's address).

IPv4 only, and only an interface's primary address (``SIOCGIFADDR``): what gloo's
``createDeviceForInterface`` binds as well. Torch-free.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's primary IPv4 address


def is_loopback(host: str) -> bool:
    """True for ``localhost``, ``127.0.0.0/8`` and ``::1`` (a host name is resolved first;
    one that does not resolve is not loopback)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except OSError:
        return False


def route_source_address(host: str, port: int = 1) -> str:
    """This machine's IPv4 address on the route to ``host`` (a name or address); no packet is
    sent (a UDP ``connect`` only asks the kernel for the route).

    Raises:
        OSError: ``host`` does not resolve, or there is no route to it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), port or 1))
        return s.getsockname()[0]


def interface_address(ifname: str) -> str | None:
    """The primary IPv4 address of interface ``ifname``; None when it has none or is unknown."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def interface_of(address: str) -> str | None:
    """The name of the interface whose primary IPv4 address is ``address`` (``lo`` for
    ``127.0.0.1``); None when no interface holds it."""
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def gloo_address(master_addr: str, master_port: int,
                 env: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """``(address, interface)`` gloo will bind: the first ``GLOO_SOCKET_IFNAME`` interface's
    address when that is set, else this node's address (module docstring) and the interface
    that holds it (None if none does: gloo then falls back to the hostname).

    Raises:
        ValueError: ``GLOO_SOCKET_IFNAME`` names an interface with no IPv4 address here.
        OSError: ``master_addr`` does not resolve or has no route.
    """
    env = os.environ if env is None else env
    chosen = env.get(GLOO_IFNAME_ENV, "")
    if chosen:
        ifname = chosen.split(",")[0]
        address = interface_address(ifname)
        if address is None:
            raise ValueError(f"{GLOO_IFNAME_ENV}={chosen}: this node has no interface {ifname!r} "
                             f"with an IPv4 address (see `ip -br addr`); unset it to use the "
                             f"interface on the route to MASTER_ADDR={master_addr}")
        return address, ifname
    address = route_source_address(master_addr, master_port)
    return address, interface_of(address)


def check_rank_addresses(records: list[dict]) -> None:
    """Refuse a deployment in which some ranks bind loopback while others do not.

    ``records[r]`` is rank ``r``'s ``{"address", "interface", "master_addr", "host"}`` (what
    :func:`atom.dp.groups.init_process_groups` exchanges through the store before gloo starts).
    All loopback is fine (every node is this machine), none loopback is fine; a mixture means
    the loopback ranks' peers elsewhere would fail to connect to them only after the group
    timeout, so this fails every rank at once instead.

    Raises:
        ValueError: names the loopback ranks, their host and MASTER_ADDR, and what to change.
    """
    loopback = [r for r, rec in enumerate(records) if is_loopback(rec["address"])]
    if not loopback or len(loopback) == len(records):
        return
    elsewhere = next(r for r in range(len(records)) if r not in loopback)
    shown = ", ".join(f"rank {r} on {records[r]['host']} (MASTER_ADDR={records[r]['master_addr']}"
                      f", interface {records[r]['interface'] or '?'})" for r in loopback)
    raise ValueError(
        f"loopback address for gloo and ZMQ: {shown} would bind {records[loopback[0]]['address']}"
        f" while rank {elsewhere} binds {records[elsewhere]['address']}; ranks on other hosts "
        f"cannot reach a loopback address. Give every node node 0's reachable address as "
        f"--master-addr (not 127.0.0.1 or localhost), or set {GLOO_IFNAME_ENV} to a reachable "
        f"interface on those nodes")
