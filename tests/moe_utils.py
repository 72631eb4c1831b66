"""The tiny random Mixtral (the checkable model (b) of docs/ARCHITECTURE.md) shared by the MoE tests."""

from __future__ import annotations

import random
import time

import torch

from atom import LLM, SamplingParams
from tests.utils import GreedyResult

LOGPROB_TOLERANCE = 1e-3  # |ours - transformers| for the logprob of each agreed greedy token
# model (a) on two ranks: engine options, greedy parameters and prompts of the EP tests
OPTIONS = dict(dtype="float32", num_kv_blocks=64, max_model_len=512, num_threads=1)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3, [100 + i for i in range(7)],
           [400 + 3 * i for i in range(50)], [9000 + i for i in range(20)]]


def idle_rank_stats(llm: LLM) -> list[dict]:
    """Every rank's stats once all ranks are idle at the same tick (their counters final)."""
    deadline = time.monotonic() + 60.0  # liveness only
    while True:
        stats = llm.get_rank_stats()
        if all(s["idle"] for s in stats) and len({s["tick"] for s in stats}) == 1:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def build_tiny_mixtral(folder):
    """A top-2-of-8 Mixtral built by transformers, fp32, saved to ``folder``; returns the model.

    Initialised with a large scale so both the LM head's logits and the routers' scores are
    peaked: a random tiny model otherwise has near-ties that rounding noise flips.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
                           initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1,
                           eos_token_id=2)
    model = MixtralForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def tiny_prompts(num: int = 6) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 60))] for _ in range(num)]


def assert_logprobs_close(ours: list[GreedyResult], ref: list[GreedyResult]) -> None:
    """Each greedy token both sides agree on has the same logprob within LOGPROB_TOLERANCE."""
    for a, b in zip(ours, ref):
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                break
            assert abs(a.top_logprobs[pos][ta] - b.top_logprobs[pos][tb]) < LOGPROB_TOLERANCE, (
                pos, a.top_logprobs[pos], b.top_logprobs[pos])
