// The CPU ops of the atom_cpu_kernels extension (bound to Python in bindings.cpp).
#pragma once

#include <torch/extension.h>

namespace atom_kernels {

// q [S, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D] (same dtype as q, float32 or
// bfloat16, contiguous); block_tables int64 [S, >= max blocks]; context_lens int64 [S], >= 1.
// Returns float32 [S, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale);

// x [T, N] float32 -> weight * x / sqrt(mean(x^2) + eps), float32 [T, N].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);

// residual += x (in place), then returns rms_norm(residual); all float32 [T, N].
torch::Tensor fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                 double eps);

// x [T, 2 I] float32 (gate columns, then up) -> silu(gate) * up, float32 [T, I].
torch::Tensor silu_and_mul(torch::Tensor x);

// In place on qkv [T, (H + 2 H_kv) * D] float32 (rows contiguous): rotates the H query heads and
// the H_kv key heads of each row with cos/sin [T, D] (Hugging Face rotate_half convention).
void rotary_embedding_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                       int64_t num_heads, int64_t num_kv_heads);

// Per row of x [S, V] float32: (logsumexp float32 [S], argmax int64 [S], the first maximum on
// ties), in two passes over the row instead of torch's three.
std::tuple<torch::Tensor, torch::Tensor> logsumexp_argmax(torch::Tensor x);

}  // namespace atom_kernels
