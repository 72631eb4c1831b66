"""``atom serve`` says where it is and what its ranks did (issue 38): ``--port`` is checked like
every option, the URL is printed once the server listens, and a DP/EP server prints the ranks'
summary line when it shuts down. A real server process (DP 2, EP) on a tiny random Llama folder
and the official openai client."""

from __future__ import annotations

import re

import pytest

from atom.entrypoints.cli import main
from tests.entrypoints.remote_server import RemoteServer
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


def test_a_dp_ep_server_prints_its_url_and_at_shutdown_what_its_ranks_did(tmp_path):
    folder = tmp_path / "tiny"
    save_tiny_llama(folder)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        server = RemoteServer("--model", str(folder), "--moe-split-experts", "4",
                              "--enable-expert-parallel", data_parallel_size=2, stderr=stderr)
        try:
            out = server.client().completions.create(model=str(folder), prompt="w5 w6 w7",
                                                     max_tokens=4, temperature=0)
            assert out.usage.completion_tokens == 4
        finally:
            assert server.stop() == 0
    lines = log.read_text().splitlines()
    assert lines.count(f"serving on {server.url} (model {folder}, DP 2, EP on)") == 1
    (summary,) = [line for line in lines if line.startswith("atom: DP 2")]
    assert re.fullmatch(r"atom: DP 2, EP 4 experts \(2 a rank\), TBO off; per rank: requests "
                        r"(1 / 0|0 / 1), steps \d+ / \d+, dummy \d+ / \d+, TBO 0 / 0; prefill "
                        r"policy delayer: \d+ holds \(hold rate \d\.\d\d, longest \d+ ticks\)",
                        summary), summary
