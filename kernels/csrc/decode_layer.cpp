// One Llama decoder layer of a small decode step on GGUF blocks, in one call: the ops the
// Python layer runs one by one (RMSNorm, fused qkv, rotary, KV write, paged decode attention,
// o_proj, residual add + RMSNorm, fused gate/up, SiLU-and-mul, down_proj, residual add), called
// here as C++ functions. At one token a step, each op's work is a few microseconds; the Python
// module calls and dispatches between them cost more than the work (about 0.2 ms a layer,
// measured on the development machine), which this removes. The ops and their order are those
// of the Python path, so the results are the same up to float rounding
// (tests/kernels/test_gguf_linear.py compares the two paths).

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "ops.h"

#include <cstring>

namespace atom_kernels {

void llama_decode_layer_(at::Tensor x, at::Tensor input_norm, at::Tensor post_norm, double eps,
                         at::TensorList weights, at::IntArrayRef types, at::Tensor kv_cache,
                         at::Tensor slot_mapping, at::Tensor block_tables,
                         at::Tensor context_lens, at::Tensor cos, at::Tensor sin,
                         int64_t num_heads, int64_t num_kv_heads, double scale) {
  TORCH_CHECK(weights.size() == 12 && types.size() == 4,
              "llama_decode_layer_: weights are (qs, d, m) of qkv, o, gate_up, down; types four");
  // Each linear's (qs, d, m) planes, or its tiles (wq, wd, wm: 3-D scales) with out_features
  // n: the layer's shapes give n (qkv: q + 2 kv heads, o and down: hidden, gate_up: twice down's
  // in_features).
  const auto linear = [&](const at::Tensor& in, int i, int64_t n) {
    if (weights[3 * i + 1].dim() == 3)
      return gguf_gemm_tiled(in, weights[3 * i], weights[3 * i + 1], weights[3 * i + 2], types[i],
                             n);
    return gguf_linear(in, weights[3 * i], weights[3 * i + 1], weights[3 * i + 2], types[i]);
  };
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "llama_decode_layer_: x must be a contiguous float32 [T, hidden] tensor");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == at::kFloat,
              "llama_decode_layer_: kv_cache must be a contiguous float32 [2, num_blocks, "
              "block_size, H_kv, D] tensor");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() >= x.size(0),
              "llama_decode_layer_: slot_mapping must be int64 with a slot per token");
  const int64_t tokens = x.size(0), head_dim = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(3) == num_kv_heads, "llama_decode_layer_: H_kv mismatch");
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t cache_slots = kv_cache.size(1) * kv_cache.size(2);

  const int64_t hidden = x.size(1);
  const int64_t down_quant_bytes = types[3] == 3 ? 16 : 32;  // per block: Q4_1 16, Q8_0 32
  const int64_t down_row_bytes =  // down's quants: weights[9], its scales weights[10]
      weights[9].size(1) / (weights[10].dim() == 3 ? 16 : 1);
  const int64_t intermediate = down_row_bytes / down_quant_bytes * 32;
  at::Tensor qkv = linear(rms_norm(x, input_norm, eps), 0, q_size + 2 * kv_size);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "llama_decode_layer_: qkv has ",
              qkv.size(1), " columns, expected ", q_size + 2 * kv_size);
  rotary_embedding_(qkv, cos, sin, num_heads, num_kv_heads, std::nullopt, std::nullopt, 0.0);
  // the new tokens' K and V rows into their cache slots
  const float* qkv_p = qkv.data_ptr<float>();
  float* k_cache_p = kv_cache.data_ptr<float>();
  float* v_cache_p = k_cache_p + cache_slots * kv_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < cache_slots, "llama_decode_layer_: slot ", slots[t],
                " of token ", t, " is outside the cache");
    const float* row = qkv_p + t * qkv.size(1);
    std::memcpy(k_cache_p + slots[t] * kv_size, row + q_size, kv_size * sizeof(float));
    std::memcpy(v_cache_p + slots[t] * kv_size, row + q_size + kv_size, kv_size * sizeof(float));
  }
  at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
  at::Tensor attn = paged_decode_attention(q, kv_cache.select(0, 0), kv_cache.select(0, 1),
                                           block_tables, context_lens, scale, std::nullopt,
                                           std::nullopt, std::nullopt, std::nullopt,
                                           std::nullopt);
  at::Tensor o = linear(attn.view({tokens, q_size}), 1, hidden);
  at::Tensor h = fused_add_rms_norm(o, x, post_norm, eps);  // x += attention output
  at::Tensor down = linear(silu_and_mul(linear(h, 2, 2 * intermediate)), 3, hidden);
  float* xp = x.data_ptr<float>();
  const float* dp = down.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) xp[i] = xp[i] + dp[i];  // x += MLP output
}

}  // namespace atom_kernels
