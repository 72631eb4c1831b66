// The CPU ops of the atom_cpu_kernels library (registered as torch.ops.atom_kernels.* in
// bindings.cpp). Only the light ATen headers: <torch/extension.h> (pybind11 and the Python
// headers) would make every file take about a minute to compile.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace atom_kernels {

// q [S, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D] (same dtype as q, float32 or
// bfloat16, contiguous); block_tables int64 [S, >= max blocks]; context_lens int64 [S], >= 1.
// Returns float32 [S, H, D].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens,
                                     double scale);

// x [T, N] float32 -> weight * x / sqrt(mean(x^2) + eps), float32 [T, N].
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);

// residual += x (in place), then returns rms_norm(residual); all float32 [T, N].
at::Tensor fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                              double eps);

// x [T, 2 I] float32 (gate columns, then up) -> silu(gate) * up, float32 [T, I].
at::Tensor silu_and_mul(at::Tensor x);

// In place on qkv [T, (H + 2 H_kv) * D] float32 (rows contiguous): rotates the H query heads and
// the H_kv key heads of each row with cos/sin [T, D] (Hugging Face rotate_half convention).
void rotary_embedding_(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                       int64_t num_heads, int64_t num_kv_heads);

// Per row of x [S, V] float32: (logsumexp float32 [S], argmax int64 [S], the first maximum on
// ties), in two passes over the row instead of torch's three.
std::tuple<at::Tensor, at::Tensor> logsumexp_argmax(at::Tensor x);

}  // namespace atom_kernels
