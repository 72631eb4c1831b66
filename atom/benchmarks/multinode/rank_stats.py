"""Each rank's numbers, read from node 0's ``/metrics`` (Prometheus text, ``dp_rank`` labels).

:func:`per_rank` turns one scrape into ``{dp_rank: {series: value}}``; :func:`group_series`
gives the series of no rank (the DP group's values, such as its steps, and the front end's);
:class:`MetricsSampler` scrapes every ``interval_s`` while the benchmark runs, for the per-rank
load over time. Series names drop the ``atom:`` prefix and a counter's ``_total`` suffix
(``atom:dp_steps_total`` → ``dp_steps``); per-reason counters become ``name.reason``.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: the series a load-over-time sample keeps, per rank
SAMPLED = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
           "dp_dummy_steps")


def _short(family, sample_name: str) -> str:
    """``atom:dp_steps_total`` (a counter's sample) → ``dp_steps``; a gauge keeps its name
    (``atom:num_kv_blocks_total`` → ``num_kv_blocks_total``)."""
    if family.type == "counter" and sample_name == family.name + "_total":
        sample_name = family.name
    return sample_name.removeprefix("atom:")


def per_rank(text: str) -> dict[int, dict[str, float]]:
    """The per-rank series of a ``/metrics`` scrape (module docstring); histograms leave
    their buckets out."""
    ranks: dict[int, dict[str, float]] = {}
    for family, sample, name in _series(text):
        if "dp_rank" in sample.labels:
            ranks.setdefault(int(sample.labels["dp_rank"]), {})[name] = sample.value
    return dict(sorted(ranks.items()))


def group_series(text: str) -> dict[str, float]:
    """The series of a ``/metrics`` scrape that carry no ``dp_rank``: the DP group's values
    (``dp_steps``, ``dp_prefill_steps``, the prefill policy's decisions, ...) and the front
    end's. Series that differ only by another label (``finished_reason``, ``kind``) are summed."""
    out: dict[str, float] = {}
    for family, sample, name in _series(text):
        if "dp_rank" not in sample.labels:
            out[name] = out.get(name, 0.0) + sample.value
    return out


def _series(text: str):
    """``(family, sample, short name)`` of every sample but histogram buckets."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            name = _short(family, sample.name)
            if "reason" in sample.labels:
                name = f"{name}.{sample.labels['reason']}"
            yield family, sample, name


def scrape(base_url: str, *, timeout_s: float = 30.0) -> str:
    """Node 0's ``/metrics`` text. Raises httpx.HTTPError when it cannot be read."""
    response = httpx.get(base_url + "/metrics", timeout=timeout_s)
    response.raise_for_status()
    return response.text


class MetricsSampler:
    """A thread that scrapes ``/metrics`` every ``interval_s`` into :attr:`samples` (one dict
    per scrape: ``t_s`` since :meth:`start`, and :data:`SAMPLED` per rank). Owns the thread;
    a failed scrape is counted in :attr:`num_failed`, never raised."""

    def __init__(self, base_url: str, *, interval_s: float = 1.0):
        self.base_url = base_url
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self.num_failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="metrics-sampler")
        self._start = 0.0

    def start(self) -> None:
        self._start = time.monotonic()
        self._thread.start()

    def stop(self) -> list[dict]:
        """Stop and return the samples."""
        self._stop.set()
        self._thread.join()
        return self.samples

    def _run(self) -> None:
        while not self._stop.is_set():
            t_s = time.monotonic() - self._start
            try:
                ranks = per_rank(scrape(self.base_url, timeout_s=max(5.0, self.interval_s)))
            except (httpx.HTTPError, ValueError):
                self.num_failed += 1
            else:
                self.samples.append({"t_s": round(t_s, 3), "ranks": {
                    str(r): {k: v for k, v in s.items() if k in SAMPLED}
                    for r, s in ranks.items()}})
            self._stop.wait(self.interval_s)

    def write_jsonl(self, path) -> None:
        with open(path, "w") as f:
            for sample in self.samples:
                f.write(json.dumps(sample) + "\n")
