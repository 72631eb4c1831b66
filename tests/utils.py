"""Shared test helpers: the tie-aware greedy comparator and Hugging Face reference generation."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GreedyResult:
    """Greedy tokens of one sequence and, per token, the top-k {token_id: logprob}."""

    token_ids: list[int]
    top_logprobs: list[dict[int, float]]


def check_greedy_close(ours: list[GreedyResult], ref: list[GreedyResult], *, name: str) -> int:
    """Assert greedy outputs agree, allowing only rounding ties (vLLM's check_logprobs_close).

    At the first differing token of a sequence, pass only if each side's token is in the other
    side's top-k logprobs; then stop comparing that sequence. Returns how many sequences ended
    on such a tie (callers report it).
    """
    assert len(ours) == len(ref)
    num_ties = 0
    for i, (a, b) in enumerate(zip(ours, ref)):
        n = min(len(a.token_ids), len(b.token_ids))
        for pos in range(n):
            ta, tb = a.token_ids[pos], b.token_ids[pos]
            if ta == tb:
                continue
            assert ta in b.top_logprobs[pos] and tb in a.top_logprobs[pos], (
                f"{name}: prompt {i} differs at token {pos}: ours {ta} vs reference {tb}, "
                f"not a tie (ours top-k {a.top_logprobs[pos]}, reference top-k {b.top_logprobs[pos]})")
            num_ties += 1
            break
        else:
            assert len(a.token_ids) == len(b.token_ids), f"{name}: prompt {i} length differs"
    if num_ties:
        print(f"{name}: {num_ties} of {len(ours)} sequences ended on a rounding tie")
    return num_ties


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, k: int = 5) -> list[GreedyResult]:
    """Greedy generation with transformers, one prompt at a time (no padding), with top-k logprobs.

    An explicit all-ones attention mask is passed: this tokenizer's pad id is also <|im_end|>.
    """
    results = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
        tokens = out.sequences[0, len(ids):].tolist()
        tops = []
        for step_logits in out.logits:
            logprobs = torch.log_softmax(step_logits[0].float(), dim=-1)
            values, idx = logprobs.topk(k)
            tops.append(dict(zip(idx.tolist(), values.tolist())))
        results.append(GreedyResult(tokens, tops))
    return results


def ours_greedy(outputs) -> list[GreedyResult]:
    """GreedyResults from atom RequestOutputs generated with ``logprobs=k``."""
    return [GreedyResult(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in outputs]


RANK_CONTRACT_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")


def launcher_env(**extra: str) -> dict[str, str]:
    """This process's environment for starting a launcher: without any rank contract or
    atom/torchelastic variables the test runner might carry (``ATOM_CACHE_DIR`` kept: where
    the model is), one torch thread per rank."""
    import os

    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("ATOM_", "TORCHELASTIC_")) and k != "ATOM_CACHE_DIR")
           and k not in RANK_CONTRACT_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


TINY_VOCAB_SIZE = 512


def save_tiny_llama(folder, *, tokenizer: bool = True, seed: int = 0,
                    vocab_size: int = TINY_VOCAB_SIZE, max_position_embeddings: int = 256) -> None:
    """A tiny random Llama folder (2 layers, hidden 64, ``vocab_size`` tokens, fp32, init scale
    0.2 for peaked logits) saved with transformers' ``save_pretrained``; with ``tokenizer``, a
    real word-level tokenizer over the same vocabulary (``w0`` .. ``w511``, EOS ``w2``) saved
    beside it (tokenizer.json), built with the ``tokenizers`` library.

    For tests about control flow (scheduling, routing, processes, failures), where the embedded
    135M model would only add load and forward time; seeded, so two builds are the same model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings, initializer_range=0.2,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)},
                                           unk_token="w0"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", bos_token="w1",
                                eos_token="w2").save_pretrained(folder)
