"""``--quantization gguf`` on 2 real DP ranks (gloo) equals the single-rank quantized engine.

Each rank picks the quantized kernel or the float GEMM by its own step's row count, and the
ranks' batches differ from the single rank's (a rank decodes 3 sequences where the single rank
decodes 6, prefills split differently), so outputs are compared with the tie-aware comparator.
The single-rank engine runs the same prompts in float32 too: the quantized outputs must not be
the float ones (the blocks are really used) and must stay close to them (sampled tokens'
logprobs within a few tenths).
"""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from tests.moe_utils import idle_rank_stats
from tests.utils import check_greedy_close, ours_greedy

OPTIONS = dict(dtype="float32", num_kv_blocks=64, max_model_len=512, num_threads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4 5",
           "What is the tallest mountain in the world? The tallest mountain is",
           "def fibonacci(n):", "Write a short poem about the sea. The waves"]


@pytest.fixture(scope="module")
def single_rank():
    with LLM(quantization="gguf", **OPTIONS) as llm:
        quantized = llm.generate(PROMPTS, GREEDY)
    with LLM(**OPTIONS) as llm:
        plain = llm.generate(PROMPTS, GREEDY)
    return quantized, plain


def test_dp2_quantized_equals_single_rank_quantized(single_rank):
    quantized, plain = single_rank
    with LLM(quantization="gguf", data_parallel_size=2, **OPTIONS) as llm:
        ours = llm.generate(PROMPTS, GREEDY)
        stats = idle_rank_stats(llm)
    check_greedy_close(ours_greedy(ours), ours_greedy(quantized), name="dp2 gguf vs 1 rank gguf")
    assert all(s["num_real_steps"] > 0 for s in stats), "both ranks should serve requests"
    assert all(s["num_free_blocks"] == s["num_total_blocks"] for s in stats)
    # the quantized path ran (its logprobs are not float32's) and stays near float32
    drift = _logprob_drift(quantized, plain)
    assert max(drift) > 0
    assert sum(drift) / len(drift) < 0.2, drift


def _logprob_drift(ours, ref) -> list[float]:
    """|logprob difference| of each sampled token, up to each sequence's first different token
    (past it the two sides condition on different text)."""
    drift = []
    for a, b in zip(ours, ref):
        for t, u, la, lb in zip(a.outputs[0].token_ids, b.outputs[0].token_ids,
                                a.outputs[0].logprobs, b.outputs[0].logprobs):
            if t != u:
                break
            drift.append(abs(la[t] - lb[t]))
    return drift
