"""GGUF block linears (kernels/csrc/gguf_linear.cpp, atom.kernels.gguf) against their torch
references, on random blocks of every supported type and on the embedded model's own blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from atom.kernels import gguf as G
from atom.kernels.linear import pack_weight
from atom.layers.linear import QUANTIZED_MAX_ROWS, Linear
from tests.utils import assert_sums_close

TYPES = {G.Q4_1: gguf.GGMLQuantizationType.Q4_1, G.Q8_0: gguf.GGMLQuantizationType.Q8_0}


def random_gguf_rows(ggml_type: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of GGUF blocks (uint8 [n, k / 32 * block bytes], ggml's layout) with random
    quantized values and plausible fp16 scales (and Q4_1 minimums)."""
    gen = torch.Generator().manual_seed(seed)
    nb, size = k // G.BLOCK, G.BLOCK_BYTES[ggml_type]
    b = torch.randint(0, 256, (n, nb, size), dtype=torch.uint8, generator=gen)
    b[..., 0:2] = (torch.rand(n, nb, generator=gen) * 0.02 + 1e-3).half().view(torch.uint8).view(n, nb, 2)
    if ggml_type == G.Q4_1:
        b[..., 2:4] = (torch.randn(n, nb, generator=gen) * 0.05).half().view(torch.uint8).view(n, nb, 2)
    return b.reshape(n, nb * size)


def random_blocks(ggml_type: int, n: int, k: int, seed: int = 0) -> G.QuantizedWeight:
    return G.QuantizedWeight.from_gguf_blocks(random_gguf_rows(ggml_type, n, k, seed), ggml_type)


def kernel(ops, x: torch.Tensor, w: G.QuantizedWeight) -> torch.Tensor:
    """The compiled op itself (not the Python wrapper's fallback)."""
    return ops.gguf_linear(x, w.qs, w.d, w.m, w.ggml_type)


@pytest.mark.parametrize("ggml_type", sorted(TYPES))
def test_dequantize_matches_the_gguf_package(ggml_type):
    rows = random_gguf_rows(ggml_type, 37, 96)
    expected = gguf_dequantize(rows.numpy(), TYPES[ggml_type]).reshape(37, 96)
    w = G.QuantizedWeight.from_gguf_blocks(rows, ggml_type)
    assert torch.equal(G.dequantize(w), torch.from_numpy(expected.astype(np.float32)))
    assert w.nbytes >= rows.numel()  # the same bytes, plus the scales' padding to 8 blocks
    assert torch.equal(G.dequantize(w.select_rows(torch.tensor([5, 0]))), G.dequantize(w)[[5, 0]])


def test_quantize_activations_per_block():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0] + [0.5] * 30])
    q = G.quantize_activations(x)
    assert torch.equal(q[0, :32], torch.zeros(32))  # an all-zero block: scale 0, no NaN
    d = 2.0 / 127
    assert q[0, 33].item() == pytest.approx(-2.0)
    assert q[0, 32].item() == pytest.approx(round(1.0 / d) * d)


@pytest.mark.parametrize("ggml_type", sorted(TYPES))
@pytest.mark.parametrize("n,k", [(37, 96), (576, 576), (100, 1536), (5, 32), (1, 64)])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 7, 9])  # the 4-row tile, then 1-3 tails
def test_kernel_matches_reference(ops, ggml_type, n, k, rows):
    w = random_blocks(ggml_type, n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    out = kernel(ops, x, w)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    ref = G.gguf_linear_reference(x, w)
    # the integer block sums are exact: only the float accumulation order differs (the
    # reference's float32 GEMM sums k terms)
    assert_sums_close(out, ref, reduction_len=k, num_paths=2)


@pytest.mark.parametrize("ggml_type", sorted(TYPES))
@pytest.mark.parametrize("n,k", [(37, 96), (576, 576), (100, 1536), (5, 32), (16, 64)])
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 17, 64])  # the 8-row pass, then its tails
def test_tiled_kernel_matches_reference(ops, ggml_type, n, k, rows):
    """The tiled kernel (16 output rows a register; the last tile padded) against the same
    torch reference as the row kernel: the same int8 activations, exact integer sums."""
    w = random_blocks(ggml_type, n, k, seed=n + k)
    tiled = G.TiledWeight.from_quantized(w)
    assert tiled.wq.shape[0] == -(-n // G.TILE)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    out = G.gguf_linear(x, tiled)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    ref = G.gguf_linear_reference(x, w)
    assert_sums_close(out, ref, reduction_len=k, num_paths=2)


def test_tiled_kernel_rejects_a_mismatched_weight(ops):
    tiled = G.TiledWeight.from_quantized(random_blocks(G.Q4_1, 40, 64))
    with pytest.raises(RuntimeError, match="expected K a multiple of 32"):
        G.gguf_linear(torch.randn(2, 96), tiled)
    with pytest.raises(RuntimeError, match="float16"):
        ops.gguf_gemm_tiled(torch.randn(2, 64), tiled.wq, tiled.wd.float(), tiled.wm, G.Q4_1, 40)


@pytest.mark.parametrize("ggml_type", sorted(TYPES))
@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiled"])
def test_kernel_is_thread_count_independent(ops, ggml_type, tiled):
    w = random_blocks(ggml_type, 1000, 576)  # many 16-row chunks / tiles, split unevenly
    x = torch.randn(21 if tiled else 6, 576, generator=torch.Generator().manual_seed(1))
    run = (lambda: G.gguf_linear(x, G.TiledWeight.from_quantized(w))) if tiled else (
        lambda: kernel(ops, x, w))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(run())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])  # each output is one thread's, same order


def test_kernel_takes_strided_rows(ops):
    w = random_blocks(G.Q4_1, 64, 64)
    x = torch.randn(3, 128)[:, :64]  # rows 128 floats apart
    assert_sums_close(G.gguf_linear(x, w), G.gguf_linear_reference(x, w), reduction_len=64,
                      num_paths=2)


def test_kernel_rejects_bad_shapes_and_types(ops):
    w = random_blocks(G.Q4_1, 8, 64)
    with pytest.raises(RuntimeError, match="expected K a multiple of 32"):
        kernel(ops, torch.randn(2, 96), w)
    with pytest.raises(RuntimeError, match="not supported"):
        ops.gguf_linear(torch.randn(2, 64), w.qs, w.d, w.m, 2)  # Q4_0
    with pytest.raises(RuntimeError, match="float32"):
        kernel(ops, torch.randn(2, 64).double(), w)
    with pytest.raises(RuntimeError, match="float16"):
        ops.gguf_linear(torch.randn(2, 64), w.qs, w.d.float(), w.m, G.Q4_1)
    with pytest.raises(ValueError, match="not supported"):
        G.QuantizedWeight.from_gguf_blocks(random_gguf_rows(G.Q4_1, 8, 64), 12)


def test_embedded_model_blocks_match_its_float_weights(ops):
    """The loader's blocks (rows un-permuted like the float weights) dequantize to exactly the
    float weights; the kernel on them stays within int8-activation error of the float GEMM."""
    from atom.worker.model_loader import load_gguf_blocks, load_model_weights

    _, float_weights = load_model_weights(None, torch.float32)
    blocks = load_gguf_blocks(None)
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(G.dequantize(blocks[name]), float_weights[name]), name
    w = blocks["model.layers.3.mlp.gate_proj.weight"]
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(0))
    exact = x @ float_weights["model.layers.3.mlp.gate_proj.weight"].T
    out = kernel(ops, x, w)
    assert (out - exact).abs().max() < 0.02 * exact.abs().max()  # int8 activations: ~0.5 %
    ids = torch.tensor([0, 2, 49151, 5])
    assert torch.equal(G.embedding(blocks["model.embed_tokens.weight"], ids),
                       float_weights["model.embed_tokens.weight"][ids])


@pytest.mark.skipif(pack_weight(torch.ones(8, 32)) is None, reason="oneDNN cannot pack here")
def test_linear_switches_to_the_float_gemm_above_the_row_limit(ops):
    w = random_blocks(G.Q4_1, 48, 64)
    layer = Linear(64, 48)
    layer.weight.data.copy_(G.dequantize(w))
    layer.qweight = w
    layer.pack_weight()
    for rows in (1, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        quantized = kernel(ops, x, w)
        out = layer(x)
        if rows <= QUANTIZED_MAX_ROWS:
            assert torch.equal(out, quantized)
        else:
            assert not torch.equal(out, quantized)
            assert_sums_close(out, x @ G.dequantize(w).T, reduction_len=64, num_paths=2)


def test_linear_with_tiles_takes_every_row_count(ops):
    """A tiled weight runs the quantized (tiled) kernel at every row count, the row limit
    notwithstanding (AVX-512 VNNI CPUs, where attach_quantized tiles)."""
    w = random_blocks(G.Q8_0, 48, 64)
    tiled = G.TiledWeight.from_quantized(w)
    assert (tiled.out_features, tiled.in_features) == (48, 64)
    layer = Linear(64, 48)
    layer.weight.data.copy_(G.dequantize(w))
    layer.qweight = tiled
    for rows in (1, QUANTIZED_MAX_ROWS + 1, 100):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        out = layer(x)
        assert torch.equal(out, G.gguf_linear(x, tiled))
        assert_sums_close(out, G.gguf_linear_reference(x, w), reduction_len=64, num_paths=2)
    layer.pack_weight()  # nothing reads the float weight any more: dropped, not packed
    assert layer.weight is None and layer.packed_weight is None
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), G.gguf_linear(x, tiled))


@pytest.fixture(scope="module")
def quantized_runner():
    from atom.worker.model_loader import load_gguf_blocks, load_model_weights
    from atom.worker.model_runner import ModelRunner

    arch, weights = load_model_weights(None, torch.float32)
    return ModelRunner(arch, weights, dtype=torch.float32, num_kv_blocks=64, block_size=16,
                       max_model_len=512, quantized_weights=load_gguf_blocks(None))


@pytest.mark.parametrize("num_seqs", [1, 3])  # 1: fewer sequences than threads, split attention
def test_decode_layer_in_one_call_equals_the_python_layers(ops, quantized_runner, num_seqs):
    """The compiled decoder layer (llama_decode_layer_) against the Python layers on the same
    blocks: the same ops in the same order (one attention kernel, which splits the context of a
    lone sequence in both), so the same logits."""
    from atom.sampling_params import SamplingParams
    from atom.core.sequence import Sequence

    runner, model = quantized_runner, quantized_runner.model
    assert model.decode_on_blocks
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(f"r{i}", list(range(10 + i, 60 + 7 * i)), SamplingParams(max_tokens=8))
        seq.block_table = list(range(8 * i, 8 * i + 8))
        runner.execute_model([(seq, len(seq.token_ids))])
        seq.num_computed_tokens = len(seq.token_ids)
        seq.token_ids.append(5 + i)
        seqs.append(seq)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        logits = {}
        for fused in (True, False):  # the same step twice: each rewrites the same KV slots
            model.decode_on_blocks = fused
            logits[fused] = runner.execute_model([(seq, 1) for seq in seqs]).logits
    finally:
        model.decode_on_blocks = True
        torch.set_num_threads(before)
    assert torch.equal(logits[True], logits[False])


def test_without_the_kernels_the_quantized_mode_runs_the_float_path():
    """No compiled kernels (ATOM_DISABLE_CPP_KERNELS): the torch reference would dequantize
    whole matrices at every small step, so the runner keeps the float path and says why."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from atom.worker.model_loader import load_gguf_blocks, load_model_weights\n"
        "from atom.worker.model_runner import ModelRunner\n"
        "arch, w = load_model_weights(None, torch.float32)\n"
        "r = ModelRunner(arch, w, dtype=torch.float32, num_kv_blocks=4, block_size=16,\n"
        "                max_model_len=64, quantized_weights=load_gguf_blocks(None))\n"
        "assert r.model.lm_head.qweight is None and not r.model.decode_on_blocks\n"
        "assert r.model.embed_tokens is not None\n")
    env = dict(os.environ, ATOM_DISABLE_CPP_KERNELS="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "quantization gguf needs atom's C++ kernels" in done.stderr
