"""The multi-node driver's pieces that need no deployment: the cluster file, the per-node
commands (what ``--method print`` shows), the per-rank numbers read from the server's real
``/metrics`` rendering, the report and ``--compare``. Deployments on real separate network
hosts: test_multinode_netns.py."""

from __future__ import annotations

import json
import shlex
import sys

import pytest

from atom.entrypoints.cli import main as atom_main
from atom.benchmarks.multinode.cluster import ClusterSpec, NodeSpec
from atom.benchmarks.multinode.deploy import node_commands
from atom.benchmarks.multinode.rank_stats import group_series, per_rank
from atom.benchmarks.multinode.report import compare, write_report
from atom.entrypoints.openai.metrics import ServerMetrics

TWO_NODES = {"name": "2x1", "nproc_per_node": 1, "master_port": 29511, "http_port": 8011,
             "nodes": [{"address": "10.3.0.10", "ssh": "gpu0"}, {"address": "10.3.0.11"}],
             "gloo_socket_ifname": "eth1", "env": {"OMP_NUM_THREADS": "4"}}


def test_cluster_file_round_trip_and_shape():
    cluster = ClusterSpec.from_json(TWO_NODES)
    assert (cluster.nnodes, cluster.world_size, cluster.master_addr) == (2, 2, "10.3.0.10")
    assert cluster.nodes[0] == NodeSpec(address="10.3.0.10", ssh="gpu0")
    assert ClusterSpec.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster
    assert str(cluster.subnet()) == "10.3.0.0/24"


@pytest.mark.parametrize("change, match", [
    ({"nodez": []}, "unknown cluster key"),
    ({"nodes": [{"adress": "10.0.0.1"}]}, "unknown node key"),
    ({"nodes": []}, "no nodes"),
    ({"nodes": "10.0.0.1"}, "list of objects"),
    ({"nodes": [{"address": "10.0.0.1"}, {}]}, "every node an address, or none"),
    ({"nodes": [{"address": "10.0.0.1"}, {"address": "10.0.0.1"}]}, "share an address"),
    ({"nproc_per_node": 0}, "at least 1"),
    ({"master_port": 70000}, "not a TCP port"),
    ({"name": "a b"}, "cluster name"),
    ({"env": {"X": 1}}, "map names to strings"),
])
def test_cluster_file_errors_say_what_to_change(change, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec.from_json({**TWO_NODES, **change})


@pytest.mark.parametrize("addresses, match", [(["10.3.0.10", "10.3.1.11"], "share one /24"),
                                              (["10.3.0.1", "10.3.0.11"], "not end in")])
def test_netns_addresses_must_fit_one_bridge(addresses, match):
    cluster = ClusterSpec.from_json({**TWO_NODES, "nodes": [{"address": a} for a in addresses]})
    with pytest.raises(ValueError, match=match):
        cluster.subnet()


def test_every_node_gets_the_same_command_but_its_own_node_rank():
    cluster = ClusterSpec.from_json(TWO_NODES)
    commands = node_commands(cluster, log_dir=lambda r: f"/logs/node{r}",
                             serve_args=("--dtype", "float32"), launch_args=("--node-timeout-s", "9"))
    assert [c.node_rank for c in commands] == [0, 1]
    for rank, c in enumerate(commands):
        assert c.env == {"OMP_NUM_THREADS": "4", "GLOO_SOCKET_IFNAME": "eth1"}
        argv = list(c.argv)
        assert argv[:3] == [sys.executable, "-m", "atom.launch"]
        launcher, serve = argv[3:argv.index("--")], argv[argv.index("--") + 1:]
        assert launcher == ["--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                            "--master-addr", "10.3.0.10", "--master-port", "29511",
                            "--log-dir", f"/logs/node{rank}", "--node-timeout-s", "9"]
        # every node serves on node 0's address (only rank 0's front end listens)
        assert serve == ["serve", "--host", "10.3.0.10", "--port", "8011", "--dtype", "float32"]
        assert shlex.split(c.shell()) == ["env", "GLOO_SOCKET_IFNAME=eth1", "OMP_NUM_THREADS=4",
                                          *argv]


def test_print_method_prints_one_command_per_node(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(TWO_NODES))
    assert atom_main(["bench", "multinode", "--cluster", str(path), "--method", "print",
                      "--serve-args", "--num-kv-blocks 64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# node 0" and out[2] == "# node 1"
    assert "--node-rank 0" in out[1] and "--node-rank 1" in out[3]
    assert out[1].endswith("serve --host 10.3.0.10 --port 8011 --num-kv-blocks 64")


def test_print_needs_addresses(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"name": "x", "nodes": [{}, {}]}))
    assert atom_main(["bench", "multinode", "--cluster", str(path), "--method", "print"]) == 2
    assert "give them in the cluster file, or use --method netns" in capsys.readouterr().err


def _rank(dp_rank: int, steps: int) -> dict:
    return {"dp_rank": dp_rank, "num_total_blocks": 128, "num_free_blocks": 120,
            "num_running": 1, "num_waiting": 2, "num_preemptions": 0, "tick": steps + 3,
            "num_steps": steps, "num_dummy_steps": dp_rank, "num_prefill_steps": 2,
            "num_mixed_prefill_steps": 1, "num_tbo_steps": 0, "prefix_cache_queries": 64,
            "prefix_cache_hits": 16, "prefill_policy_decisions_hold": 3}


def test_per_rank_and_group_series_read_the_servers_metrics_rendering():
    text = ServerMetrics("m").render([_rank(0, 40), _rank(1, 40)]).decode()
    ranks = per_rank(text)
    assert list(ranks) == [0, 1]
    assert ranks[1]["dp_dummy_steps"] == 1 and ranks[0]["num_kv_blocks_used"] == 8
    assert ranks[0]["num_kv_blocks_total"] == 128  # a gauge: its name stays whole
    assert ranks[0]["kv_cache_usage_perc"] == pytest.approx(8 / 128)
    group = group_series(text)  # the group's values once, not on every rank
    assert "dp_steps" not in ranks[0] and group["dp_steps"] == 40 and group["dp_ticks"] == 43
    assert group["prefill_policy_decisions.hold"] == 3
    one_rank = ServerMetrics("m").render([{"num_total_blocks": 8}]).decode()
    assert "dp_steps" not in group_series(one_rank)  # the DP loop's series only on DP ranks


def _summary(name: str, nnodes: int, nproc: int, scale: float) -> dict:
    bench = {"completed": 8, "failed": 0, "duration_s": 4.0, "output_throughput": 50.0 * scale,
             "total_token_throughput": 250.0 * scale, "request_throughput": 2.0 * scale}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p50", "p90", "p99"):
            bench[f"{stat}_{metric}_ms"] = 100.0 / scale
    return {"name": name, "nnodes": nnodes, "nproc_per_node": nproc, "method": "netns",
            "started": "today", "cpu": "a CPU", "command": "atom bench multinode ...",
            "workload": "`--num-prompts 8`", "bench": bench,
            "nodes": [{"node_rank": r, "address": f"10.0.0.{10 + r}", "exit_code": 143}
                      for r in range(nnodes)],
            "ranks": {"0": {"dp_dummy_steps": 2.0, "num_kv_blocks_total": 128.0}},
            "group": {"dp_steps": 40.0, "dp_prefill_steps": 6.0},
            "leftovers": {}, "num_failed_samples": 0}


def test_report_and_compare(tmp_path):
    samples = [{"t_s": t, "ranks": {"0": {"num_requests_running": 1, "num_requests_waiting": t,
                                          "kv_cache_usage_perc": 0.1 * t}}} for t in range(4)]
    for name, nnodes, nproc, scale in (("1x2", 1, 2, 1.0), ("2x1", 2, 1, 0.8)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        write_report(run_dir, _summary(name, nnodes, nproc, scale), samples)
        for png in ("throughput.png", "latency.png", "rank_load.png"):
            assert (run_dir / png).read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "2x1" / "report.md").read_text()
    assert "2 node(s) × 1 rank(s) (world size 2), method `netns`" in text
    assert "| 1 | 10.0.0.11 | 143 |" in text  # every node's launcher exit code
    assert "| output tok/s | 40.00 |" in text and "| TTFT | 125 | 125 | 125 | 125 |" in text
    assert "| 0 | 2 | — | — | 128 | — | — |" in text  # per rank; — where not exported
    assert "| 40 | 6 | — | — |" in text  # the group's steps, once
    table = compare(tmp_path / "1x2", tmp_path / "2x1", output_dir=tmp_path / "cmp")
    assert "A = 1x2 (1×2), B = 2x1 (2×1)" in table
    assert "| output tok/s | 50 | 40 | 0.800 |" in table
    assert "| p99 TTFT (ms) | 100 | 125 | 1.250 |" in table
    assert (tmp_path / "cmp" / "compare.md").read_text().startswith("# 1x2 vs 2x1")
    with pytest.raises(ValueError, match="no summary.json"):
        compare(tmp_path, tmp_path / "2x1")
