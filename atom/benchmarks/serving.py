"""Serving benchmark: ``atom bench serve`` (and ``scripts/bench_serving.py``).

Sends requests to any OpenAI-compatible server (``atom serve``, vLLM, ...) over HTTP, streaming
``/v1/completions`` (``stream_options.include_usage`` for exact token counts), and measures per
request the TTFT (time to the first text chunk), ITL (gaps between text chunks), TPOT ((E2E −
TTFT) / (output tokens − 1)) and E2E latency.

Workloads (``--dataset-name``):
- ``random``: prompts of random token ids (special tokens excluded) sent as token-id lists, so
  every server sees the same prompt lengths; ``--random-input-len`` / ``--random-output-len``,
  lengths varied uniformly by ``--random-range-ratio``; ``ignore_eos`` so outputs have their
  length (vLLM's extension; ``--no-ignore-eos`` for servers without it);
- ``sharegpt``: a ShareGPT-format JSON file (a list of ``{"conversations": [{"from", "value"},
  ...]}``): the first turn is the prompt, the second turn's token count the output length.

Arrivals: ``--request-rate`` requests/s (``inf``: all at once) with gamma-distributed gaps
(``--burstiness`` 1 = Poisson), at most ``--max-concurrency`` in flight. ``--num-warmups``
requests go first and are not measured. Reports mean / median / p90 / p99 (``--percentiles``),
request and token throughput and goodput (requests/s meeting every ``--goodput`` SLO, e.g.
``ttft:500 tpot:50`` in ms); prints a table, shows a progress bar and writes a JSON file.
Lineage: vLLM's ``benchmarks/benchmark_serving.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from atom.benchmarks.offline import random_prompts, script_main

_SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    """What one request measured (seconds; tokens from the final usage chunk; ``text`` the
    output of choice 0)."""

    success: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL")
    parser.add_argument("--endpoint", default="/v1/completions", help="completions endpoint")
    parser.add_argument("--model", help="model name to request (default: the server's first)")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--tokenizer", help="atom model (.gguf or HF folder) whose tokenizer makes "
                        "and measures prompts (default: the embedded model)")
    parser.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random")
    parser.add_argument("--dataset-path", type=pathlib.Path, help="ShareGPT JSON file")
    parser.add_argument("--num-prompts", type=int, default=200, help="measured requests")
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len*(1-r), len*(1+r)]")
    parser.add_argument("--sharegpt-output-len", type=int,
                        help="output tokens per ShareGPT request (default: the reply's length)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (inf: send all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps (1 = Poisson)")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight")
    parser.add_argument("--num-warmups", type=int, default=2, help="unmeasured requests first")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="send ignore_eos so each output has its requested length")
    parser.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (ms)")
    parser.add_argument("--percentiles", default="50,90,99", help="percentiles to report")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=pathlib.Path,
                        default=pathlib.Path("results/bench_serving.json"))
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_bench_serve_parser(subparsers, formatter_class=argparse.ArgumentDefaultsHelpFormatter) -> None:
    """Register ``serve`` on ``atom bench``'s subparsers."""
    parser = subparsers.add_parser("serve", help="serving benchmark (scripts/bench_serving.py)",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=formatter_class)
    add_bench_serve_args(parser)
    parser.set_defaults(func=run)


# ----- workload -----


def load_requests(args: argparse.Namespace, tokenizer, num: int, seed: int) -> list[BenchRequest]:
    """``num`` requests of the chosen dataset.

    Raises:
        ValueError: a bad length, a missing or malformed ShareGPT file, or too few usable entries.
    """
    rng = np.random.default_rng(seed)
    if args.dataset_name == "random":
        if args.random_input_len < 1 or args.random_output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be >= 1")
        prompts = random_prompts(num, args.random_input_len, args.random_range_ratio,
                                 vocab_size=len(tokenizer), special_ids=tokenizer.all_special_ids,
                                 seed=seed)
        low = max(1, int(args.random_output_len * (1 - args.random_range_ratio)))
        high = max(low, int(args.random_output_len * (1 + args.random_range_ratio)))
        outputs = rng.integers(low, high + 1, size=num)
        return [BenchRequest(p, len(p), int(o)) for p, o in zip(prompts, outputs)]
    if args.dataset_path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE")
    data = json.loads(args.dataset_path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{args.dataset_path}: expected a JSON list of conversations")
    order = rng.permutation(len(data))
    requests: list[BenchRequest] = []
    for i in order:
        turns = data[i].get("conversations", []) if isinstance(data[i], dict) else []
        if len(turns) < 2:
            continue
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = args.sharegpt_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        # vLLM's filter: skip tiny and very long conversations
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        requests.append(BenchRequest(prompt, prompt_len, output_len))
        if len(requests) == num:
            return requests
    raise ValueError(f"{args.dataset_path}: only {len(requests)} usable conversations, need {num}")


# ----- sending -----


async def send_request(client, url: str, payload: dict, headers: dict) -> RequestResult:
    """Stream one completion (``/v1/completions`` or ``/v1/chat/completions``) and time it;
    never raises (failures are in the result)."""
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                now = time.perf_counter()
                pieces = [c.get("text") or (c.get("delta") or {}).get("content")
                          for c in chunk.get("choices", []) if c.get("index", 0) == 0]
                if any(pieces):
                    result.text += "".join(p for p in pieces if p)
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.output_tokens = usage["completion_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens") or 0
        result.e2e_s = time.perf_counter() - start
        result.success = result.output_tokens > 0 or result.ttft_s > 0.0
        if not result.success:
            result.error = "no output"
    except Exception as exc:  # a network or protocol error fails this request, not the run
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _payload(model: str, request: BenchRequest, *, ignore_eos: bool) -> dict:
    payload = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len,
               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


def arrival_gaps_s(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between request sends: gamma(shape=burstiness, mean=1/rate); zeros for rate inf.

    Raises:
        ValueError: a non-positive rate or burstiness.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if rate == float("inf"):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num).tolist()


async def run_benchmark(args: argparse.Namespace, requests: list[BenchRequest],
                        warmups: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Warm up, then send ``requests`` on the arrival schedule; (results, duration in s)."""
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        model = args.model or await _first_model(client, base, headers)
        url = base + args.endpoint
        for request in warmups:
            warm = await send_request(client, url, _payload(model, request, ignore_eos=args.ignore_eos), headers)
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests")
        semaphore = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)

        async def one(request: BenchRequest) -> RequestResult:
            async with semaphore:
                result = await send_request(client, url, _payload(model, request, ignore_eos=args.ignore_eos), headers)
            bar.update(1)
            return result

        tasks = []
        start = time.perf_counter()
        for request, gap_s in zip(requests, arrival_gaps_s(len(requests), args.request_rate,
                                                         args.burstiness, args.seed)):
            tasks.append(asyncio.create_task(one(request)))
            await asyncio.sleep(gap_s)
        results = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - start
        bar.close()
    return list(results), duration_s


async def _first_model(client, base: str, headers: dict) -> str:
    response = await client.get(base + "/v1/models", headers=headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


# ----- report -----


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """``["ttft:500", ...]`` → ``{"ttft": 500.0}`` (ms). Raises ValueError on a bad spec."""
    slos = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in _SLO_METRICS or not value:
            raise ValueError(f"--goodput {spec!r}: use METRIC:MS with METRIC in {_SLO_METRICS}")
        slos[name] = float(value)
    return slos


def summarize(results: list[RequestResult], duration_s: float, *, percentiles: list[float],
              slos_ms: dict[str, float]) -> dict:
    """The report: counts, throughputs and latency statistics in ms."""
    ok = [r for r in results if r.success]
    summary: dict = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": len(ok) / duration_s,
        "errors": sorted({r.error for r in results if not r.success})[:5]}
    summary["output_throughput"] = summary["total_output_tokens"] / duration_s
    summary["total_token_throughput"] = (summary["total_input_tokens"]
                                         + summary["total_output_tokens"]) / duration_s
    series = {"ttft": [r.ttft_s for r in ok], "tpot": [r.tpot_s for r in ok if r.tpot_s is not None],
              "itl": [x for r in ok for x in r.itl_s], "e2el": [r.e2e_s for r in ok]}
    for name, values_s in series.items():
        values_ms = np.array(values_s) * 1000.0 if values_s else np.zeros(1)
        summary[f"mean_{name}_ms"] = float(values_ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(values_ms))
        for q in percentiles:
            summary[f"p{q:g}_{name}_ms"] = float(np.percentile(values_ms, q))
    if slos_ms:
        good = [r for r in ok if all(_measure_ms(r, name) <= limit for name, limit in slos_ms.items())]
        summary["goodput"] = len(good) / duration_s
    return summary


def _measure_ms(result: RequestResult, name: str) -> float:
    value_s = {"ttft": result.ttft_s, "tpot": result.tpot_s or 0.0, "e2el": result.e2e_s}[name]
    return value_s * 1000.0


def format_table(summary: dict, percentiles: list[float]) -> str:
    """The report as aligned ``label: value`` lines. The median's row stands for P50 too (the
    JSON keeps both keys: they are the same number)."""
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"]),
            ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
            ("Total input tokens", summary["total_input_tokens"]),
            ("Total generated tokens", summary["total_output_tokens"]),
            ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}")]
    if "goodput" in summary:
        rows.append(("Request goodput (req/s)", f"{summary['goodput']:.2f}"))
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        stats = [("Mean", "mean"), ("Median", "median")] + [(f"P{q:g}", f"p{q:g}")
                                                            for q in percentiles if q != 50]
        rows += [(f"{label} {title} (ms)", f"{summary[f'{key}_{name}_ms']:.2f}") for label, key in stats]
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k + ':':<{width}}{v:>12}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``: prints the table, writes the JSON; exit
    code 1 if any measured request failed."""
    from atom.worker.model_files import load_tokenizer

    percentiles = [float(q) for q in args.percentiles.split(",") if q]
    slos_ms = parse_goodput(args.goodput)
    tokenizer = load_tokenizer(args.tokenizer)
    requests = load_requests(args, tokenizer, args.num_prompts + args.num_warmups, args.seed)
    warmups, requests = requests[: args.num_warmups], requests[args.num_warmups:]
    results, duration_s = asyncio.run(run_benchmark(args, requests, warmups))
    summary = summarize(results, duration_s, percentiles=percentiles, slos_ms=slos_ms)
    print(format_table(summary, percentiles))
    if summary["errors"]:
        print("errors:", *summary["errors"], sep="\n  ")
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    report = {"args": {k: str(v) if isinstance(v, pathlib.Path) else v
                       for k, v in vars(args).items() if k not in ("func", "runs_engine", "api_key")},
              "summary": summary,
              "requests": [{k: v for k, v in asdict(r).items() if k != "text"} for r in results]}
    args.output_json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output_json}")
    return 1 if summary["failed"] else 0


def main(argv: list[str] | None = None) -> int:
    return script_main(argv, description=__doc__.split("\n\n")[0], add_args=add_bench_serve_args,
                       run_args=run)
