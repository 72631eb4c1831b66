"""P/D with data parallelism on both sides: a producer and a consumer each with 2 DP ranks
(every producer rank binds its own KV transfer port and names it in its responses; a consumer
rank pulls from whichever producer rank prefilled), behind ``atom pd-proxy``. Greedy
completions equal the producer's own plain ones (the colocated reference), and both sides'
KV blocks all come back. Then the consumer is killed (SIGKILL, its ranks with it) after a
prefill it was to pull: the producer frees the kept blocks on its keep timeout."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import psutil

from tests.entrypoints.remote_server import MODEL, Proxy, RemoteServer, wait_kv_free

KEEP_TIMEOUT_S = 3.0

PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "Tell me a story about a dragon who learns to cook. " * 6,
    "Explain photosynthesis to a child in simple words.",
]


def test_pd_with_two_dp_ranks_on_each_side():
    producer = RemoteServer("--kv-role", "producer", "--kv-transfer-keep-timeout-s",
                            str(KEEP_TIMEOUT_S), data_parallel_size=2)
    try:
        consumer = RemoteServer("--kv-role", "consumer", data_parallel_size=2)
        try:
            proxy = Proxy(producer.url, consumer.url)
            try:
                kw = dict(model=MODEL, max_tokens=10, temperature=0.0)
                reference = [producer.client().completions.create(prompt=p, **kw).choices[0].text
                             for p in PROMPTS]
                with ThreadPoolExecutor(len(PROMPTS)) as pool:  # spread over both ranks
                    got = list(pool.map(lambda p: proxy.client().completions.create(
                        prompt=p, **kw).choices[0].text, PROMPTS))
                assert got == reference
                assert consumer.metric("atom:kv_transfers_total") == len(PROMPTS)
                wait_kv_free(producer)
                wait_kv_free(consumer)
            finally:
                proxy.stop()
            # the consumer dies after the prefill it was to pull (as the proxy sends it)
            resp = producer.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {"do_remote_decode": True}})
            assert resp.status_code == 200 and resp.json()["kv_transfer_params"], resp.text
            assert producer.metric("atom:kv_transfer_kept_blocks") > 0
            parent = psutil.Process(consumer.proc.pid)
            for process in [*parent.children(recursive=True), parent]:
                try:
                    process.kill()
                except psutil.NoSuchProcess:  # a rank that exited with its parent
                    pass
            consumer.proc.wait(30)
            wait_kv_free(producer, timeout_s=KEEP_TIMEOUT_S + 15)
            assert producer.metric("atom:kv_transfer_timeouts_total") == 1
        finally:
            consumer.stop()
    finally:
        producer.stop()
