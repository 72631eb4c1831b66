"""P/D with MLA's latent KV cache (in-process engines, fp32): a DeepSeek-V3 producer and a
DeepSeek-V3 consumer give the colocated greedy tokens, the latent blocks moved over the real
TCP connector; a Llama consumer of the DeepSeek producer is refused at the layout handshake,
the error naming both layouts."""

from __future__ import annotations

import pytest

from atom.sampling_params import SamplingParams
from atom.messages import KVTransferParams
from tests.entrypoints.pd_utils import run_engines
from tests.moe_utils import build_tiny_deepseek, engine_parity_prompts
from tests.utils import save_tiny_llama

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _engine(folder, **options):
    from atom.config import EngineConfig
    from atom.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(model=str(folder), dtype="float32",
                                              num_kv_blocks=64, block_size=8, max_model_len=128,
                                              num_threads=1, skip_tokenizer_init=True, **options))


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-v3")
    build_tiny_deepseek(folder)
    engine = _engine(folder, kv_role="producer")
    yield folder, engine
    engine.shutdown()


def _prefill(producer_engine, prompts) -> list[KVTransferParams]:
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    done = run_engines([producer_engine], [(producer_engine, f"p{i}", p, first,
                                     KVTransferParams(do_remote_decode=True))
                                    for i, p in enumerate(prompts)])
    return [done[f"p{i}"].kv_transfer_params for i in range(len(prompts))]


def test_deepseek_producer_and_consumer_give_the_colocated_tokens(producer):
    folder, engine = producer
    prompts = engine_parity_prompts()[:4]
    colocated = run_engines([engine], [(engine, f"c{i}", p, PARAMS, None)
                                for i, p in enumerate(prompts)])
    params = _prefill(engine, prompts)
    consumer = _engine(folder, kv_role="consumer")
    try:
        got = run_engines([engine, consumer], [(consumer, f"d{i}", p, PARAMS, kv)
                                        for i, (p, kv) in enumerate(zip(prompts, params))])
        stats = consumer.get_stats()
    finally:
        consumer.shutdown()
    for i in range(len(prompts)):
        assert got[f"d{i}"].outputs[0].token_ids == colocated[f"c{i}"].outputs[0].token_ids
    assert stats["kv_transfers"] == len(prompts)
    # latent bytes only: 3 layers x 40 values x 4 bytes per token, whole blocks of 8 tokens
    blocks = sum(-(-len(p) // 8) for p in prompts)
    assert stats["kv_transfer_bytes"] == blocks * 8 * 3 * 40 * 4


def test_llama_consumer_of_a_deepseek_producer_is_refused(producer, tmp_path):
    _, engine = producer
    save_tiny_llama(tmp_path, tokenizer=False)
    prompt = engine_parity_prompts()[0]
    (params,) = _prefill(engine, [prompt])
    consumer = _engine(tmp_path, kv_role="consumer")
    try:
        out = run_engines([engine, consumer], [(consumer, "d", prompt, PARAMS, params)])["d"]
    finally:
        consumer.shutdown()
    error = out.outputs[0].error
    assert out.outputs[0].finish_reason == "error" and "KV layout mismatch" in error, error
    assert "latent 40" in error and "K+V" in error, error
    assert "DeepseekV3ForCausalLM" in error and "LlamaForCausalLM" in error, error
