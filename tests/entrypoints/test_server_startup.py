"""``atom serve`` says where it is and what its ranks did (issue 38): ``--port`` is checked like
every option, the URL is printed once the server listens, and a DP/EP server prints the ranks'
summary line when it shuts down, and serves the expert load with EPLB off (issue 54). A real
server process (DP 2, EP) on a tiny random Mixtral folder and the official openai client."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from atom.dp.dp_trace import read_trace
from atom.dp.eplb.plan import balancedness as balancedness_of
from atom.entrypoints.cli import main
from tests.entrypoints.remote_server import RemoteServer
from tests.moe_utils import build_tiny_mixtral
from tests.utils import save_tiny_llama


@pytest.mark.parametrize("argv", [["serve", "--port", "99999"], ["serve", "--port", "0"],
                                  ["pd-proxy", "--prefill", "http://a:1", "--decode",
                                   "http://b:2", "--port", "http"]])
def test_a_port_outside_1_to_65535_is_a_one_line_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    port = argv[argv.index("--port") + 1]
    assert info.value.code == 2
    assert err == (f"atom {argv[0]}: error: argument --port: '{port}' is not a TCP port: use 1 "
                   f"to 65535\n")


def test_a_dp_ep_server_prints_its_url_serves_its_expert_load_and_at_shutdown_what_its_ranks_did(
        tmp_path):
    """On a tiny random Mixtral (top-2 of 8, with the word-level tokenizer) and
    ``--record-expert-load`` with EPLB off: ``GET /expert_load`` gives the last window's routed
    tokens and the placement (never moved), whose balancedness under the contiguous shards is
    the one ``/metrics``, the DP trace and the shutdown line report; both ranks issued the same
    collectives at every tick."""
    folder, trace = tmp_path / "tiny", tmp_path / "trace"
    save_tiny_llama(folder)  # the tokenizer; the Mixtral replaces its config and weights
    build_tiny_mixtral(folder)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        server = RemoteServer("--model", str(folder), "--enable-expert-parallel",
                              "--record-expert-load", "--eplb-window-size", "3",
                              "--eplb-step-interval", "3", "--dp-trace", str(trace),
                              data_parallel_size=2, stderr=stderr)
        try:
            out = server.client().completions.create(model=str(folder), prompt="w5 w6 w7 w8",
                                                     max_tokens=8, temperature=0, seed=0)
            assert out.usage.completion_tokens == 8
            body = httpx.get(server.url + "/expert_load", timeout=30.0).json()
            # the group's values: every rank holds a copy, shown once without dp_rank
            [balancedness] = [s.value for s in _samples(server, "atom:eplb_balancedness")]
            [windows] = [s.value for s in _samples(server, "atom:eplb_windows_total")]
        finally:
            assert server.stop() == 0
    print(f"expert load: {body}")
    load = np.array(body["logical_count"])
    assert (body["num_layers"], body["num_experts"], body["num_slots"]) == (2, 8, 8)
    assert body["physical_to_logical_map"] == [list(range(8))] * 2  # nothing moved
    assert body["num_windows"] >= 2 and windows == body["num_windows"]
    # each rank's 4 experts (the contiguous shards): the window's balancedness
    expected = balancedness_of(load.reshape(2, 2, 4).sum(axis=2))
    assert load.sum() > 0 and body["balancedness"] == pytest.approx(expected)
    assert balancedness == body["balancedness"]
    ranks = read_trace(trace)
    last = [e for e in ranks[0].events if e["event"] == "eplb_window"][-1]
    assert last["logical_load"] == body["logical_count"] and not last["rebalanced"]
    assert ranks[0].rows[-1]["eplb_balancedness"] == body["balancedness"]
    assert [(r["collective_count"], r["collective_hash"]) for r in ranks[0].rows] == [
        (r["collective_count"], r["collective_hash"]) for r in ranks[1].rows]
    lines = log.read_text().splitlines()
    assert lines.count(f"serving on {server.url} (model {folder}, DP 2, EP on)") == 1
    (summary,) = [line for line in lines if line.startswith("atom: DP 2")]
    assert re.fullmatch(r"atom: DP 2, EP 8 experts \(4 a rank, expert load balancedness "
                        + f"{body['balancedness']:.2f}" + r"\), TBO off; per rank: requests "
                        r"(1 / 0|0 / 1), steps \d+ / \d+, dummy \d+ / \d+, TBO 0 / 0; prefill "
                        r"policy delayer: \d+ holds \(hold rate \d\.\d\d, longest \d+ ticks\)",
                        summary), summary


def _samples(server: RemoteServer, name: str) -> list:
    text = httpx.get(server.url + "/metrics", timeout=30.0).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]
