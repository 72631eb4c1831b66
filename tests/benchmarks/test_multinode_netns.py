"""Multi-node on real separate network hosts: network namespaces on one bridge
(atom.benchmarks.multinode.netns), each with its own loopback, so an address that only works
on one host fails here as it would between machines.

One 2-host × 1-rank ``atom launch ... serve`` deployment, started by the driver's own code, is
reused for the positive checks: the official openai client on the host side gets the greedy
completions of a single-rank engine, ``/metrics`` shows both ranks, the driver's benchmark
and report run against it, and it stops cleanly with the namespaces gone. Two more
deployments: node 0 given a loopback ``--master-addr`` (its gloo and ZMQ would bind loopback)
fails every node with a clear error long before any rendezvous timeout, and a SIGKILLed
node-1 launcher ends node 0's processes with a report naming the lost node.

Needs root and iproute2 (CI runs as root); float32, small KV pools, one torch thread per rank.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

from atom.benchmarks.multinode.cluster import ClusterSpec, NodeSpec
from atom.benchmarks.multinode.deploy import Deployment, LocalNode, log_tail, node_commands
from atom.benchmarks.multinode.driver import benchmark, hosts_for, run_summary, start_nodes
from atom.benchmarks.multinode.netns import NetnsHosts, list_links, list_netns
from atom.benchmarks.multinode.rank_stats import group_series, per_rank, scrape
from atom.benchmarks.multinode.report import write_report
from atom.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="network namespaces need root and iproute2")

SERVE_ARGS = ("--dtype", "float32", "--num-kv-blocks", "64", "--num-threads", "1",
              "--max-model-len", "1024", "--log-level", "INFO")
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Write a short poem about the sea."]
MAX_TOKENS = 12
STARTUP_S = 300.0  # liveness only: model loading on two busy cores
EXIT_S = 120.0  # liveness: far below the 600 s group and 300 s rendezvous timeouts


def _cluster(name: str) -> ClusterSpec:
    return ClusterSpec(name=name, nodes=(NodeSpec(), NodeSpec()), nproc_per_node=1)


def _wait_exit(nodes: list[LocalNode], timeout_s: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout_s
    while any(n.poll() is None for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling process exits with a deadline
    codes = {n.node_rank: n.poll() for n in nodes}
    assert None not in codes.values(), f"launchers still running after {timeout_s}s: {codes}"
    return codes


def _wait_empty(hosts: NetnsHosts, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(hosts.pids(i) for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(hosts.pids(i) for i in range(2)), [hosts.pids(i) for i in range(2)]


_LISTEN = ("import socket; s = socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen(); "
           "print('up', flush=True); "
           "[(c := s.accept()[0]).sendall(b'hi') or c.close() for _ in range(2)]")
_CONNECT = "import socket, sys; print(socket.create_connection((sys.argv[1], 7000), 5).recv(2))"


def test_network_hosts_are_separate_hosts_and_are_removed():
    with NetnsHosts(2) as hosts:
        assert hosts.leftovers() == sorted([*hosts.namespaces, *hosts.veths, hosts.bridge])
        node0 = hosts.addresses[0]
        listener = subprocess.Popen(hosts.exec_argv(0, [sys.executable, "-c", _LISTEN]),
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert listener.stdout.readline() == "up\n"
            # node 0's address is reached from node 1 and from the host side ...
            from_node1 = subprocess.run(hosts.exec_argv(1, [sys.executable, "-c", _CONNECT,
                                                            node0]),
                                        capture_output=True, text=True, timeout=60)
            assert from_node1.stdout == "b'hi'\n", from_node1.stderr
            assert socket.create_connection((node0, 7000), 5).recv(2) == b"hi"
            # ... but node 1's loopback is its own
            loopback = subprocess.run(hosts.exec_argv(1, [sys.executable, "-c", _CONNECT,
                                                          "127.0.0.1"]),
                                      capture_output=True, text=True, timeout=60)
            assert "ConnectionRefusedError" in loopback.stderr
            assert listener.wait(30) == 0
        finally:
            listener.kill()
            listener.wait()
    assert hosts.leftovers() == []
    assert not set(hosts.namespaces) & set(list_netns())
    assert hosts.bridge not in list_links()


def test_stale_hosts_of_a_dead_run_are_removed_first_and_a_live_runs_kept():
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names the "dead run"
    stale_ns, stale_bridge = f"atom-{dead.pid:x}-0-n0", f"atb{dead.pid:x}-0"
    subprocess.run(["ip", "netns", "add", stale_ns], check=True)
    subprocess.run(["ip", "link", "add", stale_bridge, "type", "bridge"], check=True)
    with NetnsHosts(1) as hosts, NetnsHosts(1) as other:  # another live run: ours, kept
        assert stale_ns not in list_netns() and stale_bridge not in list_links()
        assert set(hosts.namespaces) <= set(list_netns())
        assert other.leftovers() and hosts.leftovers()


def test_network_hosts_take_the_cluster_files_addresses_on_a_free_subnet():
    cluster = ClusterSpec.from_json({"name": "given", "nodes": [{"address": "10.207.5.20"},
                                                                {"address": "10.207.5.31"}]})
    with hosts_for(cluster, "netns") as (cluster, hosts):
        assert [n.address for n in cluster.nodes] == hosts.addresses == ["10.207.5.20",
                                                                         "10.207.5.31"]
        assert hosts.host_address == "10.207.5.1" and cluster.gloo_socket_ifname == "eth0"
        with pytest.raises(RuntimeError, match="10.207.5.0/24 is in use on this machine"):
            NetnsHosts(2, addresses=["10.207.5.40", "10.207.5.41"]).create()
    assert hosts.leftovers() == []


# ----- one 2-host × 1-rank deployment for the positive checks -----


@pytest.fixture(scope="module")
def one_rank_texts() -> list[str]:
    """Greedy completions of a single-rank engine, one prompt at a time (as the server gets
    them below)."""
    from atom.entrypoints.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(dtype="float32", num_kv_blocks=64, num_threads=1, max_model_len=1024) as llm:
        return [llm.generate([p], params)[0].outputs[0].text for p in PROMPTS]


class Live:
    """The module's deployment: its hosts, nodes and run folder."""

    def __init__(self, cluster: ClusterSpec, hosts: NetnsHosts, deployment: Deployment,
                 run_dir):
        self.cluster, self.hosts, self.deployment, self.run_dir = (cluster, hosts, deployment,
                                                                   run_dir)
        self.url = deployment.base_url


@pytest.fixture(scope="module")
def live(one_rank_texts, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("multinode-2x1")
    with hosts_for(_cluster("t2x1"), "netns") as (cluster, hosts):
        deployment = start_nodes(cluster, hosts, run_dir=run_dir, serve_args=SERVE_ARGS,
                                 launch_args=())
        try:
            deployment.wait_healthy(STARTUP_S)
            yield Live(cluster, hosts, deployment, run_dir)
        finally:
            deployment.stop(timeout_s=60.0)  # a no-op once the last test has stopped it


def test_openai_client_on_the_host_side_gets_the_single_rank_engines_completions(
        live, one_rank_texts):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0,
                           timeout=120.0)
    model = client.models.list().data[0].id
    texts = [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS,
                                       temperature=0).choices[0].text for p in PROMPTS]
    assert texts == one_rank_texts


def test_metrics_show_both_ranks_each_with_work_and_the_groups_steps(live):
    text = scrape(live.url)
    ranks = per_rank(text)
    assert list(ranks) == [0, 1]
    # least_requests rotates ties, so the prompts above went to both nodes
    assert all(r["prefix_cache_queries"] > 0 for r in ranks.values()), ranks
    assert group_series(text)["dp_steps"] > 0  # the group's steps, shown once


def test_the_driver_benchmarks_reports_and_stops_cleanly_leaving_no_host(live):
    args = argparse.Namespace(method="netns", startup_timeout_s=STARTUP_S, sample_interval_s=0.5,
                              bench_args="--num-prompts 4 --random-input-len 32 "
                                         "--random-output-len 6 --num-warmups 1",
                              serve_args=" ".join(SERVE_ARGS), extra_command=None)
    result = benchmark(live.deployment, args, live.run_dir)
    assert result["bench_rc"] == 0 and result["bench"]["completed"] == 4, result["bench"]
    assert set(result["ranks"]) == {"0", "1"} and result["samples"]
    codes = live.deployment.stop(timeout_s=60.0)
    # a requested stop on every node (128 + SIGTERM), every rank exiting 0 on its own
    assert codes == {0: 128 + signal.SIGTERM, 1: 128 + signal.SIGTERM}, codes
    for node in live.deployment.nodes:
        log = open(node.log_path).read()
        assert f"rank {node.node_rank} exited with exit code 0" in log, log_tail(node.log_path)
        assert "failed with" not in log and "Traceback" not in log, log_tail(node.log_path)
    assert live.deployment.leftovers() == {}  # nothing left in either namespace
    summary = run_summary(live.cluster, args, result, codes=codes, leftovers={},
                          started="now", command="(test)")
    report = write_report(live.run_dir, summary, result["samples"]).read_text()
    assert "| 1 | " + live.cluster.nodes[1].address + " | 143 |" in report
    assert "| 0 | " in report.split("## Per rank")[1] and "| 1 | " in report.split("## Per rank")[1]
    live.hosts.remove()
    assert live.hosts.leftovers() == []
    assert not set(live.hosts.namespaces) & set(list_netns())


# ----- failures -----


def test_a_node_publishing_a_loopback_endpoint_fails_every_node_with_a_clear_error(tmp_path):
    with hosts_for(_cluster("loopback"), "netns") as (cluster, hosts):
        commands = node_commands(cluster, log_dir=lambda r: str(tmp_path / f"node{r}"),
                                 serve_args=SERVE_ARGS)
        argv = list(commands[0].argv)  # node 0 believes it is 127.0.0.1 (a common mistake)
        argv[argv.index("--master-addr") + 1] = "127.0.0.1"
        commands[0] = type(commands[0])(0, tuple(argv), commands[0].env)
        nodes = [LocalNode(c, log_path=str(tmp_path / f"node{c.node_rank}.log"),
                           wrap=lambda a, i=c.node_rank: hosts.exec_argv(i, a),
                           leftovers=lambda i=c.node_rank: hosts.pids(i)) for c in commands]
        try:
            codes = _wait_exit(nodes, STARTUP_S)  # not a hang until the 600 s group timeout
            _wait_empty(hosts)
        finally:
            Deployment(nodes, base_url="").stop(timeout_s=10.0)
    # its front end bound and published 127.0.0.1 (gloo is on eth0: GLOO_SOCKET_IFNAME); rank 1
    # refuses the endpoint, and node 0 stops because node 1 did, quoting the error
    assert codes == {0: 2, 1: 2}, codes
    for node in nodes:
        log = open(node.log_path).read()
        assert re.search(r"endpoint 'tcp://127\.0\.0\.1:\d+' for 'dp/front_end/input/1' is "
                         r"local to one host, but MASTER_ADDR=10\.[\d.]+ is not loopback",
                         log), log_tail(node.log_path)
    assert "stopped because another node stopped: rank 1 (node 1" in open(nodes[0].log_path).read()


def test_killing_the_node1_launcher_stops_node0_with_a_report_naming_the_lost_node(tmp_path):
    with hosts_for(_cluster("lost"), "netns") as (cluster, hosts):
        deployment = start_nodes(cluster, hosts, run_dir=tmp_path, serve_args=SERVE_ARGS,
                                 launch_args=("--node-timeout-s", "8"))
        try:
            deployment.wait_healthy(STARTUP_S)
            node0, node1 = deployment.nodes
            node1.send_signal(signal.SIGKILL)  # the launcher only: its rank is orphaned
            codes = _wait_exit(deployment.nodes, EXIT_S)
            _wait_empty(hosts)  # node 0's ranks and front end, and node 1's orphan
        finally:
            deployment.stop(timeout_s=10.0)
    assert codes == {0: 1, 1: -signal.SIGKILL}, codes
    log = open(node0.log_path).read()
    assert "node 1 is lost: its launcher has not been heard from for" in log, log_tail(node0.log_path)
    assert "stopped every rank of this node" in log
