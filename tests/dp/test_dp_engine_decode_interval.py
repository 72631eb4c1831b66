"""Decode protection on 2 real DP processes: rank 0 runs 4 decodes while a 2,048-token prompt,
chunked at 256 tokens, prefills on rank 1.

With ``prefill_decode_interval=2`` at least 2 of every 3 ticks of that prefill are decode-only
on both ranks; with 0 they are not; the prefill completes either way; both ranks' decisions and
collective hashes are equal on every tick. Every count comes from the per-tick trace (the
gathered batch shapes), never from wall time. A tiny random Llama keeps the forward cheap: the
interval acts on batch shapes, not on what the model computes.
"""

from __future__ import annotations

import time

import pytest
import torch

from atom.config import EngineConfig
from atom.dp.dp_trace import read_trace
from atom.entrypoints.llm import build_engine
from atom.sampling_params import SamplingParams


LONG_PROMPT_LEN, CHUNK = 2048, 256
NUM_DECODES, DECODE_TOKENS = 4, 48  # enough tokens to decode through the protected prefill
DEADLINE_S = 600.0  # liveness only: generous on 2 shared cores


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, initializer_range=0.2,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _step_until(engine, done, outputs: dict) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, "the engine made no progress"
        for out in engine.step():
            outputs[out.request_id] = out


def run(model, interval: int, trace_dir) -> dict:
    """Decodes on rank 0, then the long prompt on rank 1; returns the finished outputs."""
    engine = build_engine(EngineConfig(
        model=str(model), skip_tokenizer_init=True, data_parallel_size=2, dtype="float32",
        num_threads=1, max_num_batched_tokens=CHUNK, num_kv_blocks=160,
        prefill_decode_interval=interval, dp_trace=str(trace_dir)))
    outputs: dict = {}
    try:
        decode = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
        for i in range(NUM_DECODES):
            engine.add_request(f"d{i}", [10 + 7 * i + j for j in range(8)], decode,
                               data_parallel_rank=0)
        # the long prompt arrives once every decode has its first token (is decoding)
        _step_until(engine, lambda: len(outputs) == NUM_DECODES, outputs)
        long_prompt = [(3 + 5 * j) % 509 + 3 for j in range(LONG_PROMPT_LEN)]
        engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                               ignore_eos=True),
                           data_parallel_rank=1)
        _step_until(engine, lambda: not engine.has_unfinished_requests(), outputs)
    finally:
        engine.shutdown()  # the ranks close their trace files
    return outputs


def prefill_window(trace_dir) -> tuple[list[dict], list[dict]]:
    """Both ranks' rows from the tick the long prompt is pending on rank 1 to its last chunk;
    checks on the way that the ranks agree on every tick."""
    rank0, rank1 = (t.rows for t in read_trace(trace_dir))
    assert [r["tick"] for r in rank0] == [r["tick"] for r in rank1]
    for a, b in zip(rank0, rank1):
        assert (a["allow"], a["reason"], a["num_consecutive_holds"], a["any_prefill"]) == (
            b["allow"], b["reason"], b["num_consecutive_holds"], b["any_prefill"]), a["tick"]
        assert (a["collective_count"], a["collective_hash"]) == (
            b["collective_count"], b["collective_hash"]), a["tick"]
    first = next(i for i, r in enumerate(rank1) if r["has_pending_prefill"])
    last = max(i for i, r in enumerate(rank1) if r["step_num_prefill_tokens"])
    assert sum(r["step_num_prefill_tokens"] for r in rank1[first:last + 1]) == LONG_PROMPT_LEN
    # rank 0 decodes all along: there is something to protect
    assert all(r["num_running_decodes"] == NUM_DECODES for r in rank0[first:last + 1])
    return rank0[first:last + 1], rank1[first:last + 1]


def check_completed(outputs: dict) -> None:
    assert sorted(outputs) == ["d0", "d1", "d2", "d3", "long"]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs.values())
    assert len(outputs["long"].outputs[0].token_ids) == 2
    assert [len(outputs[f"d{i}"].outputs[0].token_ids) for i in range(4)] == [DECODE_TOKENS] * 4


def test_interval_two_protects_two_of_every_three_ticks(tiny_llama, tmp_path):
    outputs = run(tiny_llama, 2, tmp_path / "trace")
    check_completed(outputs)
    rows, _ = prefill_window(tmp_path / "trace")
    prefilled = [r["any_prefill"] for r in rows]
    assert len(rows) >= 3 * (LONG_PROMPT_LEN // CHUNK) - 2, prefilled
    for i in range(len(rows) - 2):
        assert sum(prefilled[i:i + 3]) <= 1, (i, prefilled)  # 2 of every 3 decode-only
    holds = [r["reason"] for r in rows if not r["allow"]]
    assert holds and set(holds) == {"hold_decode_interval"}


def test_interval_zero_prefills_back_to_back(tiny_llama, tmp_path):
    outputs = run(tiny_llama, 0, tmp_path / "trace")
    check_completed(outputs)
    rows, _ = prefill_window(tmp_path / "trace")
    prefilled = [r["any_prefill"] for r in rows]
    assert sum(prefilled) == LONG_PROMPT_LEN // CHUNK  # a chunk every tick
    assert sum(not p for p in prefilled) / len(rows) < 2 / 3, prefilled
    assert all(r["allow"] for r in rows)
