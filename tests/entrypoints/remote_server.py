"""A real ``atom serve`` process on a free port, for tests that drive it over HTTP.

A module of its own (not the conftest): a ``from conftest import`` finds whichever conftest
was imported first (tests/kernels has one too)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from atom.engine.spawned_ranks import reserve_port

ATOM = str(pathlib.Path(sys.executable).parent / "atom")
API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
_STARTUP_TIMEOUT_S = 300.0
# small and fast: fp32, a 2048-token KV pool (so a long prompt can fail to fit), eager
# one torch thread: the front end needs the second core
_ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "128", "--num-threads", "1",
                "--log-level", "WARNING"]


class RemoteServer:
    """``atom serve ARGS`` in a subprocess (``launcher``: e.g. ``("launch", "--nproc-per-node",
    "2")`` to start it as a launched deployment; ``stderr``: a file for its stderr, else
    ours; ``new_session``: in a process group of its own, which a test may signal as a whole,
    as ``timeout`` or a service manager does); ready once ``/health`` answers 200.

    Raises:
        RuntimeError: the process exited or was not healthy within the start-up timeout.
    """

    def __init__(self, *args: str, api_key: str | None = None, data_parallel_size: int = 1,
                 launcher: tuple[str, ...] = (), stderr=None, new_session: bool = False):
        holder, self.port = reserve_port()  # held until the server is up (no other socket takes it)
        self.data_parallel_size = data_parallel_size
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [ATOM, *launcher, "serve", "--port", str(self.port), *_ENGINE_ARGS,
               "--data-parallel-size", str(data_parallel_size), *args]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env={**os.environ},
                                     stderr=stderr, start_new_session=new_session)
        with holder:
            self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"atom serve exited with code {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)  # polling a server that is still loading, not synchronizing
        self.stop()
        raise RuntimeError("atom serve was not healthy in time")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=120.0)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, *, timeout: float | httpx.Timeout = 120.0, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, headers=self.headers(), timeout=timeout, **kwargs)

    def metric(self, name: str) -> float:
        """Sum of a metric's samples over all labels (e.g. all DP ranks) from ``/metrics``."""
        text = httpx.get(self.url + "/metrics", timeout=30.0).text
        return sum(s.value for family in text_string_to_metric_families(text)
                   for s in family.samples if s.name == name)

    def stop(self) -> int:
        """SIGTERM, then wait (SIGKILL after 60 s); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Proxy:
    """``atom pd-proxy`` in front of a prefill and a decode server; ready once ``/health``
    answers 200."""

    def __init__(self, prefill: str, decode: str):
        holder, port = reserve_port()  # held until the proxy is up
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([ATOM, "pd-proxy", "--prefill", prefill, "--decode", decode,
                                      "--port", str(port), "--log-level", "WARNING"],
                                     stdin=subprocess.DEVNULL)
        with holder:
            self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)  # polling a process that is starting
        raise RuntimeError("atom pd-proxy did not come up")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def wait_kv_free(server: RemoteServer, timeout_s: float = 15.0) -> None:
    """Liveness: every KV block of ``server`` is free within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while server.metric("atom:num_kv_blocks_used") != 0:
        assert time.monotonic() < deadline, (f"{server.url}: {server.metric('atom:num_kv_blocks_used')} "
                                             f"KV blocks still in use")
        time.sleep(0.2)  # polling a gauge
