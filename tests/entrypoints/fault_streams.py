"""Helpers of the rank-failure tests: engine-core processes of a server, streams that record
what arrives and when, faults injected once every stream has started.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.remote_server import MODEL, RemoteServer

PROMPTS = [f"Write one sentence about the number {i}." for i in range(16)]
MAX_TOKENS = 16
STREAM_DEADLINE_S = 240.0  # liveness: a stream ends (completes or errs) within this
START_DEADLINE_S = 120.0  # every stream got its first token within this
RESUME_DEADLINE_S = 30.0  # liveness: tokens flow again within this of a fault


def body(prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def reference_texts(server: RemoteServer, prompts: list[str]) -> list[str]:
    """The undisturbed greedy texts (one non-streaming request with every prompt)."""
    r = server.post("/v1/completions", json={**body(""), "prompt": prompts}, timeout=300.0)
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def engine_cores(server: RemoteServer) -> dict[int, psutil.Process]:
    """``{dp rank: process}`` of the server's engine cores (spawned ones: by ``RANK``)."""
    cores = {}
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "core_proc" in " ".join(p.cmdline()):
                cores[int(p.environ()["RANK"])] = p
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return cores


def launched_ranks(server: RemoteServer) -> dict[int, psutil.Process]:
    """``{rank: process}`` of a launched deployment's rank processes (not the front end)."""
    ranks = {}
    for p in psutil.Process(server.proc.pid).children(recursive=False):
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if "RANK" in env and not env.get("ATOM_FRONT_END_FD"):
            ranks[int(env["RANK"])] = p
    return ranks


@dataclass
class Stream:
    """One streaming completion run on a thread: its text, finish, error, chunk times."""

    prompt: str
    max_tokens: int = MAX_TOKENS
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None
    status: int | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    end_time_s: float | None = None
    done_event: bool = False  # the stream ended with ``data: [DONE]``

    def run(self, server: RemoteServer) -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers(),
                              json={**body(self.prompt, self.max_tokens), "stream": True},
                              timeout=STREAM_DEADLINE_S) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done_event = True
                    elif line.startswith("data: "):
                        self._on_event(json.loads(line[6:]))
        finally:
            self.end_time_s = time.monotonic()
            self.started.set()
            self.done.set()

    def _on_event(self, event: dict) -> None:
        if "error" in event:
            self.error = event["error"]
            return
        for choice in event.get("choices", []):
            self.text += choice.get("text", "")
            if choice.get("text"):
                self.chunk_times_s.append(time.monotonic())
                self.started.set()
            self.finish_reason = choice.get("finish_reason") or self.finish_reason


def start_streams(server: RemoteServer, prompts: list[str], *,
                  max_tokens: int = MAX_TOKENS) -> list[Stream]:
    """One thread per prompt; returns once every stream has its first token."""
    streams = [Stream(p, max_tokens) for p in prompts]
    for s in streams:
        threading.Thread(target=s.run, args=(server,), daemon=True).start()
    deadline = time.monotonic() + START_DEADLINE_S
    for s in streams:
        assert s.started.wait(max(0.0, deadline - time.monotonic())), "a stream never started"
    return streams


def wait_streams(streams: list[Stream]) -> None:
    deadline = time.monotonic() + STREAM_DEADLINE_S
    for s in streams:
        assert s.done.wait(max(0.0, deadline - time.monotonic())), f"stream hung: {s}"


def first_token_after(streams: list[Stream], t_s: float) -> float | None:
    """When the first token after ``t_s`` arrived on any stream (None: none did)."""
    after = [t for s in streams for t in s.chunk_times_s if t > t_s]
    return min(after) if after else None


def samples(server: RemoteServer, name: str) -> list[tuple[dict, float]]:
    text = httpx.get(server.url + "/metrics", timeout=30.0).text
    return [(s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name]


def wait_no_kv_in_use(server: RemoteServer, deadline_s: float = 10.0) -> list[tuple[dict, float]]:
    """Poll ``/metrics`` until every rank's KV blocks are free and the router charges nothing;
    returns the final per-rank used blocks."""
    deadline = time.monotonic() + deadline_s
    while True:
        used = samples(server, "atom:num_kv_blocks_used")
        load = samples(server, "atom:dp_router_load")
        if used and all(v == 0 for _, v in used + load):
            return used
        assert time.monotonic() < deadline, (used, load)
        time.sleep(0.2)  # polling the server until the finished requests' blocks are freed


def health(server: RemoteServer, *, timeout_s: float = 60.0) -> tuple[int, dict]:
    r = httpx.get(server.url + "/health", timeout=timeout_s)
    return r.status_code, r.json()


def kill_signal(proc: psutil.Process, sig: int) -> float:
    """Send ``sig``; returns the time it was sent."""
    os.kill(proc.pid, sig)
    return time.monotonic()


def check_resumed(streams: list[Stream], reference: list[str], *, fault_s: float) -> None:
    """Every stream ended without an error, tokens flowed again within
    :data:`RESUME_DEADLINE_S` of the fault, and each text equals the undisturbed one."""
    wait_streams(streams)
    resumed_s = first_token_after(streams, fault_s)
    assert resumed_s is not None and resumed_s - fault_s < RESUME_DEADLINE_S, resumed_s
    for s, ref in zip(streams, reference):
        assert s.error is None and s.finish_reason == "length", s
        assert s.text == ref, (s.prompt, s.text, ref)


def check_serves_new_requests(server: RemoteServer) -> None:
    out = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    assert out.usage.completion_tokens == 4
