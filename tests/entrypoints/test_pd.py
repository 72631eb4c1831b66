"""Prefill/decode disaggregation end to end: a producer (``atom serve --kv-role producer``), a
consumer (``--kv-role consumer``) and ``atom pd-proxy`` in front, real processes, fp32, the
embedded model. The reference is the producer itself serving plain requests: a single
colocated engine with the same options (its prefix cache then also gives the P/D requests
prefix hits on the producer).

The tests share one set of servers and run in file order; the last one kills the producer."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from tests.entrypoints.remote_server import MODEL, Proxy, RemoteServer, wait_kv_free

# 64-token steps so that the long prompt below is a chunked prefill on the producer
_COMMON = ("--max-num-batched-tokens", "64")
# The disconnect test freezes the producer, sees the consumer's pull in flight and aborts it: on a
# machine the rest of the suite loads, that must fit in both windows (5 s / 8 s were once too
# short in CI). The unpulled test waits the keep timeout out once, the kill test the pull timeout.
KEEP_TIMEOUT_S = 20.0
PULL_TIMEOUT_S = 12.0


@pytest.fixture(scope="module")
def pd():
    producer = RemoteServer(*_COMMON, "--kv-role", "producer",
                            "--kv-transfer-keep-timeout-s", str(KEEP_TIMEOUT_S))
    consumer = RemoteServer(*_COMMON, "--kv-role", "consumer",
                            "--kv-transfer-timeout-s", str(PULL_TIMEOUT_S))
    proxy = Proxy(producer.url, consumer.url)
    yield producer, consumer, proxy
    proxy.stop()
    consumer.stop()
    producer.stop()


PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "Tell me a story about a dragon who learns to cook. " * 12,  # ~150 tokens: 3 chunks
    "Tell me a story about a dragon who learns to cook. " * 12 + "Start now.",  # prefix hit
    "Explain photosynthesis to a child in simple words.",
    "What is two plus two?",  # EOS first: no KV kept, the proxy sends it on as a plain request
]


def complete(client: openai.OpenAI, prompt: str, *, stream: bool) -> str:
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                   if c.choices)


def test_pd_completions_equal_the_colocated_engine(pd):
    producer, consumer, proxy = pd
    reference = [complete(producer.client(), p, stream=False) for p in PROMPTS]
    assert all(reference[:-1]) and reference[-1] == ""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one mixed batch at a time
        for stream in (False, True):
            got = list(pool.map(lambda p: complete(proxy.client(), p, stream=stream), PROMPTS))
            assert got == reference, f"stream={stream}"
    assert consumer.metric("atom:kv_transfers_total") >= len(PROMPTS) - 1
    assert consumer.metric("atom:kv_transfer_bytes_total") > 0
    assert producer.metric("atom:prefix_cache_hits_total") > 0
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
                temperature=0.0)
    assert (proxy.client().chat.completions.create(**chat).choices[0].message.content
            == producer.client().chat.completions.create(**chat).choices[0].message.content)
    resp = httpx.post(proxy.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2})
    assert resp.status_code == 400 and "n > 1" in resp.json()["error"]["message"]
    wait_kv_free(producer)
    wait_kv_free(consumer)
    assert producer.metric("atom:kv_transfer_timeouts_total") == 0


def prefill(producer: RemoteServer, prompt: str) -> dict:
    """The producer's half of a P/D request, as the proxy sends it: the kept KV's params."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    resp = producer.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    params = resp.json()["kv_transfer_params"]
    assert params is not None, resp.text  # None: the first token ended the request (EOS)
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    return params


def decode_body(prompt: str, params: dict, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "kv_transfer_params": params, **extra}


def test_unpulled_kv_is_freed_after_the_keep_timeout(pd):
    """A consumer that never pulls (it died after the prefill): the producer frees on its keep
    timeout; the stale params then fail on a consumer with an error, as do params whose address
    is malformed."""
    producer, consumer, _ = pd
    before = producer.metric("atom:kv_transfer_timeouts_total")
    params = prefill(producer, "One, two, three, four,")
    assert producer.metric("atom:kv_transfer_kept_blocks") == len(params["remote_block_ids"])
    wait_kv_free(producer, timeout_s=KEEP_TIMEOUT_S + 10)
    assert producer.metric("atom:kv_transfer_timeouts_total") == before + 1
    resp = consumer.post("/v1/completions", json=decode_body("One, two, three, four,", params))
    assert resp.status_code == 400 and "holds no KV" in resp.json()["error"]["message"]
    # an address ZMQ cannot parse: that request's 400 (it killed the consumer's transfer
    # thread once, and every later request of the server hung)
    resp = consumer.post("/v1/completions", json=decode_body(
        "One, two, three, four,", {**params, "remote_host": "not a host!!"}))
    assert resp.status_code == 400 and "neither an IP address nor a hostname" in \
        resp.json()["error"]["message"]
    wait_kv_free(consumer)


def engine_processes(server: RemoteServer) -> list[psutil.Process]:
    parent = psutil.Process(server.proc.pid)
    return [parent, *parent.children(recursive=True)]


def wait_pull_in_flight(consumer: RemoteServer, failures_before: float, timeout_s: float = 60.0,
                        conn: socket.socket | None = None) -> None:
    """Liveness: the consumer's one pull is in flight within ``timeout_s`` (and has not already
    ended: a pull that failed before the test saw it says so, instead of "never started"). On a
    timeout the message gives the consumer's queues and what it answered on ``conn`` (the raw
    connection the request went on), if anything."""
    deadline = time.monotonic() + timeout_s
    while consumer.metric("atom:num_requests_waiting_for_remote_kvs") != 1:
        failures = consumer.metric("atom:kv_transfer_failures_total")
        assert failures == failures_before, f"the pull failed before it was seen ({failures} failures)"
        if time.monotonic() >= deadline:
            state = {name: consumer.metric(f"atom:{name}") for name in (
                "num_requests_waiting_for_remote_kvs", "num_requests_waiting",
                "num_requests_running", "num_kv_blocks_used", "kv_transfers_total")}
            answer = b""
            if conn is not None:
                conn.setblocking(False)
                try:
                    answer = conn.recv(2048)
                except BlockingIOError:
                    pass
            raise AssertionError(f"the pull never started: consumer {state}; it answered "
                                 f"{answer[:2048]!r}")
        time.sleep(0.1)  # polling a gauge


def test_client_disconnect_mid_transfer_frees_both_sides(pd):
    """The producer is frozen (SIGSTOP) so the consumer's pull is in flight when the client
    leaves: the consumer aborts and frees at once, and releases the producer's kept blocks."""
    producer, consumer, _ = pd
    before = producer.metric("atom:kv_transfer_timeouts_total")
    failures_before = consumer.metric("atom:kv_transfer_failures_total")
    prompt = "Once upon a time, there was a"
    params = prefill(producer, prompt)
    procs = engine_processes(producer)
    for p in procs:
        p.suspend()
    frozen_at = time.monotonic()
    try:
        # a raw connection: an HTTP client would wait for the response headers, which a
        # stream only sends with its first token, after the pull
        body = json.dumps(decode_body(prompt, params, stream=True)).encode()
        with socket.create_connection(("127.0.0.1", int(consumer.url.rsplit(":", 1)[1]))) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            wait_pull_in_flight(consumer, failures_before, conn=conn)
        # the client is gone
        wait_kv_free(consumer)  # aborted while the producer is still frozen
        assert consumer.metric("atom:kv_transfer_failures_total") == failures_before  # not timed out
    finally:
        for p in procs:
            p.resume()
    frozen_s = time.monotonic() - frozen_at
    assert frozen_s < KEEP_TIMEOUT_S, f"the test froze the producer for {frozen_s:.1f} s"
    wait_kv_free(producer, timeout_s=KEEP_TIMEOUT_S - frozen_s)  # released, not timed out
    assert producer.metric("atom:kv_transfer_timeouts_total") == before


def test_producer_killed_mid_transfer_fails_the_request_and_the_consumer_stays_healthy(pd):
    """The producer is frozen while the consumer's pull is in flight, then killed: the request
    fails with an error (the pull timeout), the consumer frees its blocks and serves on."""
    producer, consumer, _ = pd
    failures_before = consumer.metric("atom:kv_transfer_failures_total")
    prompt = "The capital of Italy is"
    params = prefill(producer, prompt)
    procs = engine_processes(producer)
    for p in procs:
        p.suspend()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(consumer.post, "/v1/completions", json=decode_body(prompt, params))
        wait_pull_in_flight(consumer, failures_before)
        for p in procs:
            p.kill()
        resp = pending.result()
    producer.proc.wait(30)
    assert resp.status_code == 400
    assert "no reply from the producer" in resp.json()["error"]["message"]
    wait_kv_free(consumer)
    assert httpx.get(consumer.url + "/health", timeout=10).status_code == 200
    out = consumer.client().completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                               temperature=0.0)
    assert out.choices[0].text
