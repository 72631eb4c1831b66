"""This node's address and gloo's interface (atom.dp.node_address), on this machine's real
interfaces; the cross-host check on hand-made records (one per rank, as the store carries
them). The same rules on real separate hosts: tests/benchmarks/test_multinode_netns.py."""

from __future__ import annotations

import pytest

from atom.dp.node_address import (
    check_rank_addresses,
    gloo_address,
    interface_address,
    interface_of,
    is_loopback,
    route_source_address,
)


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True), ("::1", True),
    ("10.0.0.1", False), ("192.0.2.7", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_the_loopback_route_and_interface():
    assert route_source_address("127.0.0.1", 29500) == "127.0.0.1"
    assert interface_address("lo") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_address("no-such-if0") is None
    assert interface_of("203.0.113.254") is None  # TEST-NET-3: on no interface here


def test_gloo_address_follows_the_route_to_the_master_unless_the_interface_is_set():
    assert gloo_address("127.0.0.1", 29500, env={}) == ("127.0.0.1", "lo")
    assert gloo_address("10.9.9.9", 1, env={"GLOO_SOCKET_IFNAME": "lo"}) == ("127.0.0.1", "lo")
    assert gloo_address("127.0.0.1", 1, env={"GLOO_SOCKET_IFNAME": "lo,eth7"}) == ("127.0.0.1",
                                                                                  "lo")
    with pytest.raises(ValueError, match="GLOO_SOCKET_IFNAME=nope0: this node has no interface"):
        gloo_address("127.0.0.1", 1, env={"GLOO_SOCKET_IFNAME": "nope0"})


def _record(address: str, master: str = "10.1.0.10") -> dict:
    return {"address": address, "interface": "lo" if address.startswith("127.") else "eth0",
            "master_addr": master, "host": "vm"}


@pytest.mark.parametrize("addresses", [["127.0.0.1", "127.0.0.1"], ["10.1.0.10", "10.1.0.11"],
                                       ["10.1.0.10"]])
def test_all_loopback_or_none_is_fine(addresses):
    check_rank_addresses([_record(a) for a in addresses])


def test_a_loopback_rank_among_remote_ones_is_refused_naming_it():
    records = [_record("127.0.0.1", master="127.0.0.1"), _record("10.1.0.11"),
               _record("10.1.0.12")]
    with pytest.raises(ValueError) as info:
        check_rank_addresses(records)
    message = str(info.value)
    assert "rank 0 on vm (MASTER_ADDR=127.0.0.1, interface lo) would bind 127.0.0.1" in message
    assert "rank 1 binds 10.1.0.11" in message
    assert "--master-addr" in message and "GLOO_SOCKET_IFNAME" in message
