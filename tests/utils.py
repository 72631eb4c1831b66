"""Shared test helpers: float tolerances derived from the dtype and the reduction length, the
tie-aware greedy comparator and Hugging Face reference generation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


#: λ of :func:`sum_tolerance`: how many times the √n·u rounding-error model's scale a result
#: may be off (see there).
ROUNDING_LAMBDA = 8.0
#: The largest atol :func:`sum_tolerance` gives, as a fraction of ``magnitude``: a wrong value
#: off by this much relative must still fail the comparison.
MAX_ATOL_FRACTION = 1e-3


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of a float dtype, the largest relative error of one rounding to nearest: half its
    machine epsilon (float32 2^-24, bfloat16 2^-8)."""
    return torch.finfo(dtype).eps / 2


def sum_tolerance(dtype: torch.dtype, *, reduction_len: int, magnitude: float,
                  num_paths: int = 1) -> dict[str, float]:
    """``atol`` and ``rtol`` for ``torch.testing.assert_close`` of results in ``dtype`` that are
    float sums of ``reduction_len`` terms each (a dot product, a GEMM entry, a softmax).

    Model: n terms added in float32 in any order (our kernels' blocked SIMD sums, MKL's,
    oneDNN's AMX brgemm) give ``s + Σ δ_i T_i``: each addition's rounding ``|δ_i| <= u`` times
    the partial sum ``T_i`` it rounded (Higham, *Accuracy and Stability of Numerical
    Algorithms*, 2nd ed., SIAM 2002, §4.2, (4.3)). The worst case, ``(n - 1)·u·Σ|x_i|`` for any
    order (§4.2; §3.1 for dot products), grows like n·u and is orders of magnitude above what
    any run shows; rounding errors behave as independent and zero-mean, so the error grows like
    ``√n·u·max|T_i|`` (§2.8's rule of thumb; proven as a bound that holds with high probability
    by Higham and Mary, *A New Approach to Probabilistic Rounding Error Analysis*, SIAM J. Sci.
    Comput. 41(5), 2019, §3 for inner products). So::

        atol = num_paths · λ · √n · u_float32 · magnitude       rtol = num_paths · u(dtype)

    ``magnitude`` bounds the partial sums: the largest ``|expected|`` for the random-signed
    terms of these tests (a partial sum of such terms is a random walk that ends at the
    result), an absolute sum where terms share a sign. λ = :data:`ROUNDING_LAMBDA` (8) covers
    the walk straying above its end and the spread of the sum of errors (a uniform δ_i has a
    standard deviation of u/√3: λ is about 14 of them). ``rtol`` is each path's final rounding
    to ``dtype`` (2^-8 for bfloat16, negligible for float32). ``atol`` is float32's whatever
    ``dtype`` is: bfloat16 products are exact in float32, and every kernel here, MKL and oneDNN
    sum them in float32. For results of several reductions in a row (attention: D, then the
    context; a MoE expert: H, then I) pass the sum of the lengths: independent errors of
    similar size add in quadrature.

    Args:
        dtype: the results' dtype (float32 or bfloat16).
        reduction_len: terms per sum, n >= 1.
        magnitude: a bound of the partial sums' size, in the results' units.
        num_paths: sides of the comparison that are float sums: 1 against a float64
            reference, 2 for two float32 paths (each carries its own error).
    Raises:
        ValueError: the tolerance would let a value off by :data:`MAX_ATOL_FRACTION` of
            ``magnitude`` pass (n too large to test at float32): the test could not fail.
    """
    if reduction_len < 1 or num_paths < 1:
        raise ValueError(f"reduction_len ({reduction_len}) and num_paths ({num_paths}) must "
                         f"be at least 1")
    atol = num_paths * ROUNDING_LAMBDA * math.sqrt(reduction_len) * unit_roundoff(
        torch.float32) * magnitude
    if atol > MAX_ATOL_FRACTION * magnitude:
        raise ValueError(f"atol {atol:.3g} for {reduction_len} terms is more than "
                         f"{MAX_ATOL_FRACTION} of the magnitude {magnitude:.3g}: a test with it "
                         f"could not catch an error that size")
    return dict(atol=atol, rtol=num_paths * unit_roundoff(dtype))


def assert_sums_close(actual: torch.Tensor, expected: torch.Tensor, *, reduction_len: int,
                      num_paths: int = 1, magnitude: float | None = None) -> None:
    """``torch.testing.assert_close`` (in float64) with :func:`sum_tolerance` for
    ``actual.dtype``; ``magnitude`` defaults to the largest ``|expected|``.

    Raises:
        AssertionError: a value is off by more than the tolerance (the message gives it).
    """
    if magnitude is None:
        magnitude = float(expected.abs().max()) if expected.numel() else 0.0
    tol = sum_tolerance(actual.dtype, reduction_len=reduction_len, magnitude=magnitude,
                        num_paths=num_paths)
    torch.testing.assert_close(
        actual.double(), expected.double(), **tol,
        msg=lambda m: f"{m}\n(sums of {reduction_len} terms, magnitude {magnitude:.4g}, "
                      f"{num_paths} float path(s): atol {tol['atol']:.3g}, rtol {tol['rtol']:.3g})")


@dataclass
class GreedyResult:
    """Greedy tokens of one sequence and, per token, the top-k {token_id: logprob}."""

    token_ids: list[int]
    top_logprobs: list[dict[int, float]]


#: The share of a comparison's sequences that may end on a rounding tie: at most
#: ``ceil(MAX_TIE_FRACTION * num_sequences)`` (so one tie in up to four sequences, two in five to
#: eight). In float32 ties are the exception (DESIGN.md: exact greedy equality is the
#: expectation); a model that diverges in most sequences is wrong, whatever its top-k says.
MAX_TIE_FRACTION = 0.25


def check_greedy_close(ours: list[GreedyResult], ref: list[GreedyResult], *, name: str,
                       max_tie_fraction: float = MAX_TIE_FRACTION,
                       allow_first_token_tie: bool = False) -> int:
    """Assert greedy outputs agree, allowing only a few rounding ties (vLLM's
    check_logprobs_close, capped).

    At the first differing token of a sequence, pass only if each side's token is in the other
    side's top-k logprobs; then stop comparing that sequence. Such a tie may not be at the first
    output token (the prefill's logits: nothing has been generated yet, and a model that is
    wrong there would otherwise pass on top-k alone) unless ``allow_first_token_tie``, and at
    most ``ceil(max_tie_fraction * len(ours))`` sequences may end on one. Prints and returns
    how many did.

    Raises:
        AssertionError: a sequence differs by more than a tie, a tie at the first token, more
            ties than allowed, or a length that differs without a tie.
    """
    assert len(ours) == len(ref), f"{name}: {len(ours)} sequences against {len(ref)}"
    ties: list[tuple[int, int]] = []  # (prompt, position) of each tie
    for i, (a, b) in enumerate(zip(ours, ref)):
        n = min(len(a.token_ids), len(b.token_ids))
        for pos in range(n):
            ta, tb = a.token_ids[pos], b.token_ids[pos]
            if ta == tb:
                continue
            assert ta in b.top_logprobs[pos] and tb in a.top_logprobs[pos], (
                f"{name}: prompt {i} differs at token {pos}: ours {ta} vs reference {tb}, "
                f"not a tie (ours top-k {a.top_logprobs[pos]}, reference top-k {b.top_logprobs[pos]})")
            assert pos > 0 or allow_first_token_tie, (
                f"{name}: prompt {i} differs at its first output token (ours {ta} vs reference "
                f"{tb}): a tie there is not allowed")
            ties.append((i, pos))
            break
        else:
            assert len(a.token_ids) == len(b.token_ids), f"{name}: prompt {i} length differs"
    max_ties = math.ceil(max_tie_fraction * len(ours))
    if ties:
        print(f"{name}: {len(ties)} of {len(ours)} sequences ended on a rounding tie "
              f"(prompt, token): {ties}; at most {max_ties} allowed")
    assert len(ties) <= max_ties, (
        f"{name}: {len(ties)} of {len(ours)} sequences ended on a rounding tie (prompt, token): "
        f"{ties}; at most {max_ties} (a fraction {max_tie_fraction}) may")
    return len(ties)


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
