"""``atom serve --data-parallel-size 2 --dp-load-balance cache_aware`` over HTTP with the official
``openai`` client: the ``X-Session-ID`` header keeps a conversation on its rank, vLLM's
``X-data-parallel-rank`` header pins a request's rank (a value that is not a rank: 400), the
router's load returns to 0 after a finish, an abort, a client disconnect and an engine error
(streaming and not, completions and chat), and ``/metrics`` carries the routing and KV event
series, each request's latencies and tokens under the rank that ran it, and the group's steps
once.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.remote_server import API_KEY, MODEL, RemoteServer


DEADLINE_S = 30.0  # liveness: a released request shows in /metrics within this
MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer("--dp-load-balance", "cache_aware", api_key=API_KEY, data_parallel_size=2)
    yield srv
    assert srv.stop() == 0


def samples(server: RemoteServer, name: str) -> dict[tuple, float]:
    """``{sorted label items (model_name left out): value}`` of one sample name."""
    text = httpx.get(server.url + "/metrics", timeout=30.0).text
    return {tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


def decisions(server: RemoteServer) -> dict[tuple[str, str], float]:
    """``{(dp_rank, reason): requests}`` of the router."""
    return {(dict(k)["dp_rank"], dict(k)["reason"]): v
            for k, v in samples(server, "atom:dp_router_decisions_total").items()}


def wait_no_load(server: RemoteServer) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while sum(samples(server, "atom:dp_router_load").values()) != 0:
        assert time.monotonic() < deadline, samples(server, "atom:dp_router_load")
        time.sleep(0.1)  # polling /metrics until the engine thread released the request


def test_session_header_keeps_a_conversation_on_its_rank(server):
    client = server.client()
    before = decisions(server)
    messages = list(MESSAGES)
    for _ in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0,
            extra_headers={"X-Session-ID": "conversation-1"})
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "And three more?"}]
    delta = {k: v - before.get(k, 0) for k, v in decisions(server).items() if v != before.get(k, 0)}
    (first,) = [k for k in delta if k[1] == "least_load"]
    assert sum(delta.values()) == 3
    assert {rank for rank, _ in delta} == {first[0]}, delta  # every turn on the first one's rank
    assert all(reason in ("least_load", "session", "cache_hit") for _, reason in delta), delta
    wait_no_load(server)


def per_rank(server: RemoteServer, name: str) -> dict[str, float]:
    """``{dp_rank: value}`` of a per-rank series."""
    return {dict(k)["dp_rank"]: v for k, v in samples(server, name).items()}


def test_rank_header_pins_the_rank_and_the_latencies_are_that_ranks(server):
    client = server.client()
    pin = {"X-data-parallel-rank": "1"}
    before = decisions(server)
    ttft_before = per_rank(server, "atom:time_to_first_token_seconds_count")
    tokens_before = per_rank(server, "atom:generation_tokens_total")
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_headers=pin)
    list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True,
                                   extra_headers=pin))
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                   extra_headers={**pin, "X-Session-ID": "pinned"})
    list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                        stream=True, extra_headers=pin))
    delta = {k: v - before.get(k, 0) for k, v in decisions(server).items() if v != before.get(k, 0)}
    assert delta == {("1", "hint"): 4}, delta  # the router's policy was bypassed
    ttft = per_rank(server, "atom:time_to_first_token_seconds_count")
    assert ttft["1"] - ttft_before.get("1", 0) == 4 and ttft.get("0") == ttft_before.get("0")
    tokens = per_rank(server, "atom:generation_tokens_total")
    assert tokens["1"] - tokens_before.get("1", 0) == 12 and tokens.get("0") == tokens_before.get("0")
    for name in ("atom:time_per_output_token_seconds_count", "atom:e2e_request_latency_seconds_count",
                 "atom:prompt_tokens_total"):
        assert per_rank(server, name)["1"] >= 4, name
    # the group's steps once (every rank counts the same), the rank's own dummy batches per rank
    assert set(samples(server, "atom:dp_steps_total")) == {()}
    assert set(samples(server, "atom:dp_prefill_steps_total")) == {()}
    assert set(per_rank(server, "atom:dp_dummy_steps_total")) == {"0", "1"}
    wait_no_load(server)


@pytest.mark.parametrize("value", ["2", "-1", "one", "1.0", ""])
def test_a_rank_header_that_is_no_rank_is_400(server, value):
    client = server.client()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=stream,
                                      extra_headers={"X-data-parallel-rank": value})
        error = info.value.body
        assert error["param"] == "X-data-parallel-rank", error
        assert error["message"] == (f"the X-data-parallel-rank header is {value!r}: send a DP "
                                    f"rank of this server, an integer in [0, 2) (it runs 2 DP "
                                    f"ranks)")


def test_a_rank_in_the_body_is_400_naming_the_header(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                extra_body={"data_parallel_rank": 5})
    assert info.value.body["param"] == "data_parallel_rank"
    assert "send the X-data-parallel-rank header" in info.value.body["message"]


def test_too_long_session_header_is_400(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60.0,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                   headers={**server.headers(), "X-Session-ID": "x" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-ID"


def test_router_load_returns_to_zero_on_every_path(server):
    client = server.client()
    session = {"X-Session-ID": "paths"}
    # finish: non-streaming and streaming, completions and chat
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_headers=session)
    list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                        stream=True, extra_headers=session))
    wait_no_load(server)
    # abort: a stream the client closes part way
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400,
                                       stream=True, extra_body={"ignore_eos": True},
                                       extra_headers=session)
    for _, _chunk in zip(range(3), stream):
        pass
    assert sum(samples(server, "atom:dp_router_load").values()) == 1
    stream.close()
    wait_no_load(server)
    # disconnect: a non-streaming request whose client stops waiting
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=1.0).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1500, extra_body={"ignore_eos": True},
            extra_headers=session)
    wait_no_load(server)
    # error: a prompt the engine cannot fit in its KV pool (finishes with an error: a 400)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[7] * 2100, max_tokens=4,
                                  extra_headers=session)
    wait_no_load(server)


def test_metrics_carry_routing_hit_rates_and_kv_events(server):
    # a prompt of several full blocks, so that a rank stores blocks and publishes events
    server.client().completions.create(model=MODEL, prompt="The capital of France is " * 12,
                                       max_tokens=2)
    for name in ("atom:prefix_cache_hit_rate", "atom:kv_events_published_batches_total",
                 "atom:kv_events_dropped_batches_total", "atom:dp_router_load"):
        ranks = {dict(k)["dp_rank"] for k in samples(server, name)}
        assert ranks == {"0", "1"}, name
    assert sum(samples(server, "atom:kv_events_published_batches_total").values()) > 0
    assert sum(samples(server, "atom:kv_events_dropped_batches_total").values()) == 0
    assert {reason for _, reason in decisions(server)} == {
        "hint", "round_robin", "least_load", "cache_hit", "session", "guard_fallback"}
    for name in ("atom:kv_events_subscriber_applied_batches_total",
                 "atom:kv_events_subscriber_gaps_healed_total",
                 "atom:kv_events_subscriber_lost_batches_total",
                 "atom:kv_events_subscriber_decode_failures_total"):
        assert len(samples(server, name)) == 1, name
    assert sum(samples(server, "atom:kv_events_subscriber_applied_batches_total").values()) > 0
    assert sum(samples(server, "atom:kv_events_subscriber_lost_batches_total").values()) == 0
