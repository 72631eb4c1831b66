"""The OpenAI-compatible server, driven over HTTP with the official ``openai`` client.

Tests taking ``any_server`` run against one rank and against ``--data-parallel-size 2``.
"""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import openai
import pytest

from tests.entrypoints.remote_server import ATOM, MODEL


PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


def _stream_text(chunks, *, chat: bool) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
    return texts


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_text_equals_non_stream_text(any_server, chat):
    client = any_server.client()
    if chat:
        full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                              temperature=0)
        text, finish = full.choices[0].message.content, full.choices[0].finish_reason
        chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                                     temperature=0, stream=True))
    else:
        full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        text, finish = full.choices[0].text, full.choices[0].finish_reason
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                                temperature=0, stream=True))
    assert text and finish in ("stop", "length")
    assert full.usage.completion_tokens >= 1 and full.usage.prompt_tokens >= 5
    assert _stream_text(chunks, chat=chat) == {0: text}
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [finish]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n2_stream_one_finish_chunk_per_choice_and_usage_last(any_server, chat):
    client = any_server.client()
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0.8, seed=3, n=2, stream=True,
                  stream_options={"include_usage": True})
    if chat:
        chunks = list(client.chat.completions.create(messages=MESSAGES, **kwargs))
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **kwargs))
    finishes = [(c.index, c.finish_reason) for chunk in chunks for c in chunk.choices
                if c.finish_reason is not None]
    assert sorted(i for i, _ in finishes) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(chunk.usage is None for chunk in chunks[:-1])
    texts = _stream_text(chunks, chat=chat)
    assert set(texts) == {0, 1}
    usage = chunks[-1].usage
    assert usage.completion_tokens >= 2 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if chat:  # OpenAI: the first chunk of every choice carries the role
        first = {}
        for chunk in chunks[:-1]:
            first.setdefault(chunk.choices[0].index, chunk.choices[0].delta)
        assert all(d.role == "assistant" for d in first.values())


def test_usage_only_when_asked(any_server):
    client = any_server.client()
    raw = httpx.post(any_server.url + "/v1/completions", headers=any_server.headers(), timeout=60,
                     json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True})
    events = [line for line in raw.text.splitlines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    assert all('"usage"' not in e for e in events)
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert full.usage.completion_tokens == 4


def test_usage_counts_cached_prompt_tokens(server):
    client = server.client()
    prompt = list(range(100, 148))  # 48 tokens: three full 16-token blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 48
    assert second.usage.prompt_tokens_details.cached_tokens >= 32


@pytest.mark.parametrize("content", ["Translate to Chinese: I love my family.",
                                     "Write three emoji that describe happiness:"],
                         ids=["cjk", "emoji"])
def test_multibyte_characters_never_split_across_chunks(any_server, content):
    client = any_server.client()
    messages = [{"role": "user", "content": content}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)]
    text = full.choices[0].message.content
    assert any(ord(ch) > 0xFFF for ch in text), f"no multi-byte characters in {text!r}"
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    # every piece is whole characters: each re-encodes to exactly the bytes it stands for
    assert b"".join(piece.encode() for piece in pieces) == text.encode()


def test_stop_string_spanning_tokens_ends_the_stream(any_server):
    client = any_server.client()
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     logprobs=0)
    tokens = full.choices[0].logprobs.tokens
    # the last character of one token and the first of the next: a stop string across tokens
    k = next(i for i in range(2, len(tokens) - 1)
             if tokens[i].strip() and tokens[i + 1].strip() and tokens[i].isascii()
             and tokens[i + 1].isascii())
    stop = tokens[k][-1] + tokens[k + 1][0]
    text = full.choices[0].text
    expected = text[: text.index(stop)]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stop=[stop], stream=True))
    assert _stream_text(chunks, chat=False) == {0: expected}
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert stop not in "".join(c.choices[0].text for c in chunks)


def test_logprobs_and_echo(any_server):
    client = any_server.client()
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logprobs=2, echo=True)
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == out.usage.prompt_tokens + 3
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(top) in (2, 3) for top in lp.top_logprobs[1:])
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:  # greedy: the sampled token is the most likely one
        assert len(entry.top_logprobs) == 2 and entry.logprob == entry.top_logprobs[0].logprob


def test_prompt_forms_and_sampling_fields(any_server):
    client = any_server.client()
    ids = client._client.post(any_server.url + "/tokenize", headers=any_server.headers(),
                              json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    many = client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, temperature=0)
    assert [c.text for c in many.choices] == [by_text.choices[0].text] * 2
    assert [c.text for c in by_ids.choices] == [by_text.choices[0].text] * 2
    extra = dict(top_k=5, min_p=0.05, min_tokens=4, repetition_penalty=1.1, ignore_eos=True,
                 stop_token_ids=[2], include_stop_str_in_output=False, skip_special_tokens=True,
                 unknown_field="ignored")
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.7,
                                        top_p=0.9, seed=7, presence_penalty=0.5,
                                        frequency_penalty=0.5, logit_bias={"13": -100},
                                        extra_body=extra)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.7,
                                      top_p=0.9, seed=7, presence_penalty=0.5,
                                      frequency_penalty=0.5, logit_bias={"13": -100}, extra_body=extra)
    assert sampled.choices[0].text == again.choices[0].text  # seeded
    assert sampled.usage.completion_tokens == 6
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=3)
    assert chat.usage.completion_tokens <= 3


def test_models_version_tokenize_detokenize(any_server):
    client = any_server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(any_server.url + "/version").json()["version"]
    ids = any_server.post("/tokenize", json={"prompt": PROMPT}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] >= 2048
    assert any_server.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": PROMPT}
    chat_ids = any_server.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat_ids["count"] > ids["count"]
    off = httpx.get(any_server.url + "/expert_load")  # a dense model: nothing recorded
    assert off.status_code == 400 and "--record-expert-load" in off.json()["error"]["message"]


def test_api_key_required_on_v1_routes(any_server):
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions",
                                                                 {"messages": MESSAGES})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(any_server.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(any_server.url + "/v1/models").status_code == 401
    assert httpx.get(any_server.url + "/health").status_code == 200  # /health needs no key


def _wait_metric(server, name: str, predicate, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = server.metric(name)
        if predicate(value) or time.monotonic() > deadline:
            return value


def test_disconnect_aborts_and_frees_kv(any_server):
    client = any_server.client()
    aborted = any_server.metric("atom:num_aborted_seqs_total")
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    assert any_server.metric("atom:kv_cache_usage_perc") > 0
    stream.close()  # the client disconnects
    assert _wait_metric(any_server, "atom:kv_cache_usage_perc", lambda v: v == 0) == 0
    assert any_server.metric("atom:num_kv_blocks_used") == 0
    assert any_server.metric("atom:num_aborted_seqs_total") == aborted + 1
    assert _wait_metric(any_server, "atom:dp_router_load", lambda v: v == 0) == 0  # released


def test_disconnect_aborts_non_streaming_request(any_server):
    aborted = any_server.metric("atom:num_aborted_seqs_total")
    with pytest.raises(httpx.ReadTimeout):
        # 1500 tokens take far longer than the 1 s the client waits
        any_server.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1500,
                                             "ignore_eos": True}, timeout=httpx.Timeout(60, read=1.0))
    assert _wait_metric(any_server, "atom:num_aborted_seqs_total", lambda v: v == aborted + 1) == aborted + 1
    assert _wait_metric(any_server, "atom:num_kv_blocks_used", lambda v: v == 0) == 0
    assert _wait_metric(any_server, "atom:dp_router_load", lambda v: v == 0) == 0  # released


def test_finishes_inside_the_engine_send_no_abort(any_server):
    client = any_server.client()
    aborted = any_server.metric("atom:num_aborted_seqs_total")
    stopped = any_server.metric("atom:num_front_end_finished_seqs_total")
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)  # length
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64,
                                          temperature=0)  # EOS, most likely
    text = chat.choices[0].message.content
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
                                   stop=[text[3:6]])  # a stop string, ended by the front end
    list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True))
    assert any_server.metric("atom:num_aborted_seqs_total") == aborted
    assert any_server.metric("atom:num_front_end_finished_seqs_total") == stopped + 1
    assert any_server.metric("atom:num_kv_blocks_used") == 0


def test_metrics_names_and_histograms(any_server):
    any_server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    for name in ("atom:num_requests_running", "atom:num_requests_waiting",
                 "atom:prefix_cache_queries_total", "atom:prefix_cache_hits_total",
                 "atom:num_preemptions_total", "atom:prompt_tokens_total"):
        assert any_server.metric(name) >= 0
    assert any_server.metric("atom:time_to_first_token_seconds_count") >= 1
    assert any_server.metric("atom:e2e_request_latency_seconds_count") >= 1
    assert any_server.metric("atom:generation_tokens_total") >= 3
    assert any_server.metric("atom:prefix_cache_queries_total") > 0
    text = httpx.get(any_server.url + "/metrics").text
    ranks = {line.split('dp_rank="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("atom:kv_cache_usage_perc{")}
    assert ranks == {str(r) for r in range(any_server.data_parallel_size)}
    if any_server.data_parallel_size > 1:
        assert any_server.metric("atom:prefill_delayer_decisions_total") > 0
        assert any_server.metric("atom:dp_router_decisions_total") > 0


# ----- bad input: 400 / 404 with OpenAI error JSON, and the next request still works -----

BAD_REQUESTS = [
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 100}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [49152]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 49152]}, "prompt"),
    ("/v1/completions", {"prompt": [-1, 5]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 100000}, "prompt"),
    ("/v1/completions", {"prompt": [7] * 2100, "max_tokens": 4}, "prompt"),  # > the KV pool
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50},
     "logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS,
                         ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD_REQUESTS)])
def test_bad_input_is_400_and_the_server_keeps_serving(any_server, path, body, param):
    r = any_server.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    good = any_server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert good.usage.completion_tokens == 2


def test_malformed_json_nan_and_stream_errors_are_400(any_server):
    headers = {**any_server.headers(), "content-type": "application/json"}
    r = httpx.post(any_server.url + "/v1/completions", content=b"{not json", timeout=30, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    error = r.json()["error"]
    assert error["param"] is None and error["message"].startswith("the request body is not valid JSON")
    for body, param in ((b'{"prompt": "Hi", "temperature": NaN}', "temperature"),
                        (b'{"prompt": "Hi", "logit_bias": {"5": Infinity}}', "logit_bias")):
        r = httpx.post(any_server.url + "/v1/completions", content=body, timeout=30, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # a streaming request the engine refuses (prompt larger than the KV pool) is still a 400
    r = any_server.post("/v1/completions", json={"model": MODEL, "prompt": [7] * 2100,
                                             "max_tokens": 4, "stream": True})
    assert r.status_code == 400 and "error" in r.json()
    with pytest.raises(openai.BadRequestError):
        any_server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-2)


def test_unknown_model_is_404(any_server):
    with pytest.raises(openai.NotFoundError) as info:
        any_server.client().completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    assert any_server.client().completions.create(model=MODEL, prompt=PROMPT,
                                                  max_tokens=2).usage.completion_tokens == 2


def test_bench_serve_against_the_server(server, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [ATOM, "bench", "serve", "--base-url", server.url, "--api-key", server.api_key,
         "--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "4",
         "--random-range-ratio", "0.5", "--request-rate", "20", "--num-warmups", "1",
         "--goodput", "ttft:1000000", "--output-json", str(out), "--disable-tqdm"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Successful requests:" in proc.stdout and "P99 TTFT (ms):" in proc.stdout
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["completed"] == 8 and summary["failed"] == 0
    lengths = [r["output_tokens"] for r in report["requests"]]
    assert all(2 <= n <= 6 for n in lengths) and summary["total_output_tokens"] == sum(lengths)
    assert summary["goodput"] == summary["request_throughput"]  # a generous SLO: all meet it
