"""The serving benchmark's workload, arrivals and statistics (no server needed)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from atom.benchmarks.serving import (
    RequestResult,
    add_bench_serve_args,
    arrival_gaps_s,
    format_table,
    load_requests,
    parse_goodput,
    summarize,
)


class _Tokenizer:
    """Whitespace 'tokenizer': one token per word; vocabulary of 1000 ids, 0-2 special."""

    all_special_ids = [0, 1, 2]

    def __len__(self) -> int:
        return 1000

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + len(w) for w in text.split()]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    return parser.parse_args(list(argv))


def test_random_workload_lengths_and_ids():
    args = _args("--random-input-len", "100", "--random-output-len", "20",
                 "--random-range-ratio", "0.5")
    requests = load_requests(args, _Tokenizer(), 50, seed=1)
    assert len(requests) == 50
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in requests)
    assert all(3 <= t < 1000 for r in requests for t in r.prompt)  # no special tokens
    assert len({r.prompt_len for r in requests}) > 1
    assert load_requests(args, _Tokenizer(), 50, seed=1) == requests  # seeded


def test_sharegpt_workload_filters_and_lengths(tmp_path):
    conv = lambda prompt, reply: {"conversations": [{"from": "human", "value": prompt},  # noqa: E731
                                                    {"from": "gpt", "value": reply}]}
    data = [conv("a b c d e", "one two three four five six"), conv("too short", "x y z w v"),
            {"conversations": [{"from": "human", "value": "alone here with words"}]},
            conv("w " * 1100, "reply with enough words here"), conv("f g h i", "1 2 3 4")]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    args = _args("--dataset-name", "sharegpt", "--dataset-path", str(path))
    requests = load_requests(args, _Tokenizer(), 2, seed=0)
    assert sorted((r.prompt, r.prompt_len, r.output_len) for r in requests) == [
        ("a b c d e", 5, 6), ("f g h i", 4, 4)]
    with pytest.raises(ValueError, match="only 2 usable"):
        load_requests(args, _Tokenizer(), 3, seed=0)
    fixed = _args("--dataset-name", "sharegpt", "--dataset-path", str(path),
                  "--sharegpt-output-len", "9")
    assert {r.output_len for r in load_requests(fixed, _Tokenizer(), 2, seed=0)} == {9}


def test_arrival_gaps():
    assert arrival_gaps_s(5, float("inf"), 1.0, 0) == [0.0] * 5
    poisson = np.array(arrival_gaps_s(20000, 4.0, 1.0, 0))
    bursty = np.array(arrival_gaps_s(20000, 4.0, 0.25, 0))
    assert abs(poisson.mean() - 0.25) < 0.01 and abs(bursty.mean() - 0.25) < 0.02
    assert bursty.std() > 1.5 * poisson.std()  # gamma shape < 1: burstier, same rate
    with pytest.raises(ValueError):
        arrival_gaps_s(5, 0.0, 1.0, 0)


def test_goodput_parsing():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["latency:5"], ["ttft"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_summary_statistics():
    ok = RequestResult(success=True, ttft_s=0.1, e2e_s=1.1, itl_s=[0.2] * 5, prompt_tokens=10,
                       output_tokens=11)  # TPOT (1.1 - 0.1) / 10 = 0.1 s
    slow = RequestResult(success=True, ttft_s=0.3, e2e_s=2.3, itl_s=[0.4] * 5, prompt_tokens=10,
                         output_tokens=11)
    failed = RequestResult(error="HTTP 400: bad")
    s = summarize([ok, slow, failed], 2.0, percentiles=[50, 99], slos_ms={"ttft": 200})
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 400: bad"])
    assert s["total_input_tokens"] == 20 and s["total_output_tokens"] == 22
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 11.0
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_tpot_ms"] == pytest.approx(150.0)
    assert s["p99_itl_ms"] == pytest.approx(400.0) and s["mean_e2el_ms"] == pytest.approx(1700.0)
    assert s["goodput"] == 0.5  # only the fast request meets TTFT <= 200 ms


def test_the_table_prints_the_median_once():
    result = RequestResult(success=True, ttft_s=0.1, e2e_s=1.1, itl_s=[0.1] * 10,
                           prompt_tokens=10, output_tokens=11)
    summary = summarize([result], 1.0, percentiles=[50, 90, 99], slos_ms={})
    assert summary["p50_ttft_ms"] == summary["median_ttft_ms"]  # both stay in the JSON
    labels = [line.split(":")[0] for line in format_table(summary, [50, 90, 99]).splitlines()]
    assert [label for label in labels if "TTFT" in label] == [
        "Mean TTFT (ms)", "Median TTFT (ms)", "P90 TTFT (ms)", "P99 TTFT (ms)"]
