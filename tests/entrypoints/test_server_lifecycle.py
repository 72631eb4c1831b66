"""``atom serve`` lifecycle: /health follows the engine core; SIGTERM drains and exits 0; the
server under ``atom launch``, drained through its front end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import httpx
import psutil

from tests.entrypoints.remote_server import ATOM, MODEL, RemoteServer



def _engine_cores(server: RemoteServer) -> list[psutil.Process]:
    children = psutil.Process(server.proc.pid).children(recursive=True)
    return [p for p in children if "core_proc" in " ".join(p.cmdline())]


def test_health_fails_when_the_engine_core_dies():
    server = RemoteServer()
    try:
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        (core,) = _engine_cores(server)
        core.kill()  # the server reaps it (it is the server's child, not ours)
        deadline = time.monotonic() + 30
        status = 200
        while status == 200 and time.monotonic() < deadline:
            status = httpx.get(server.url + "/health", timeout=30).status_code
        assert status == 503
        # requests now fail with a server error (JSON), not a hang
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert httpx.get(server.url + "/health", timeout=30).status_code == 503
    finally:
        assert server.stop() == 0


def test_a_port_in_use_fails_in_one_line_before_the_engine_loads():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run([ATOM, "serve", "--port", str(port), "--log-level", "INFO"],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"atom serve: error: port {port} on 127.0.0.1 is already in "
                                   f"use: stop what holds it or pick another --port")


def test_sigterm_to_the_whole_process_group_drains_in_flight_requests_and_exits_0():
    """As from ``timeout`` or ``kill -- -PGID``: only the front end may act on it, and it
    drains (an engine core that got the signal too stopped at once, and the request failed
    with a 503 "dp rank 0 is dead ... exit code 0")."""
    # a generous grace period: on two shared, busy cores a short request can take a minute
    server = RemoteServer("--drain-timeout", "600", new_session=True, stderr=subprocess.PIPE)
    cores = _engine_cores(server)
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    os.killpg(server.proc.pid, signal.SIGTERM)
    chunks += list(stream)  # the in-flight request runs to its end
    assert chunks[-1].choices[0].finish_reason == "length"
    assert server.proc.wait(600) == 0
    stderr = server.proc.stderr.read().decode()
    assert "rank failure" not in stderr and "Traceback" not in stderr, stderr
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in cores)


def test_serve_under_atom_launch_uses_every_rank_and_drains_on_its_front_ends_sigterm():
    """The launcher's own SIGTERM stops the ranks at once (torchrun's way); a SIGTERM to the
    front end (``front_end_pid`` in /health) drains, stops the ranks, and the launcher exits 0."""
    server = RemoteServer("--drain-timeout", "600", launcher=("launch", "--nproc-per-node", "2"))
    processes = psutil.Process(server.proc.pid).children(recursive=True)
    try:
        client = server.client()
        out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                        max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
        assert server.metric("atom:num_kv_blocks_total") == 2 * 128  # both ranks report
        assert server.metric("atom:prefill_delayer_decisions_total") > 0
        front_end = httpx.get(server.url + "/health", timeout=30).json()["front_end_pid"]
        assert front_end in [p.pid for p in processes]
        stream = client.completions.create(model=MODEL, prompt="Once upon a time",
                                           max_tokens=24, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        os.kill(front_end, signal.SIGTERM)
        chunks += list(stream)  # the in-flight request runs to its end
        assert chunks[-1].choices[0].finish_reason == "length"
        assert server.proc.wait(600) == 0  # the launcher: every rank exited 0
    finally:
        server.stop()
    assert len(processes) >= 3  # two ranks and the front end
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)
