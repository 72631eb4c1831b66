// The CPU ops of the atom_cpu_kernels library (registered as torch.ops.atom_kernels.* in
// bindings.cpp). Only the light ATen headers: <torch/extension.h> (pybind11 and the Python
// headers) would make every file take about a minute to compile.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace atom_kernels {

// q [S, H, D] (rows and heads may be strided; D contiguous); k_cache, v_cache [num_blocks,
// block_size, H_kv, D] (same dtype as q, float32 or bfloat16, contiguous); block_tables int64
// [S, >= max blocks]; context_lens int64 [S], >= 1. Returns [S, H, D] in q's dtype (float32
// accumulation, one rounding). With fewer sequences than threads each context is split across
// the threads (partial softmaxes merged: the same values up to float rounding). The layer's
// options (attention_options.h): sinks [H] (any float dtype) or none, sliding_window W > 0 (the
// query sees its last W tokens) or none.
// With key and value [S, H_kv, D] (heads and rows may be strided) and slot_mapping int64 [>= S],
// each sequence's new token's K/V are first written to its slot (none where the slot is -1).
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens,
                                  double scale, const std::optional<at::Tensor>& sinks,
                                  std::optional<int64_t> sliding_window,
                                  const std::optional<at::Tensor>& key,
                                  const std::optional<at::Tensor>& value,
                                  const std::optional<at::Tensor>& slot_mapping);

// Causal attention of the new tokens of S prefill sequences, read from the paged cache (their
// K/V written already), into out: q and out [T, H, D] (rows and heads may be strided, D
// contiguous), caches as paged_decode_attention; block_tables int64 [S, >= max blocks],
// context_lens int64 [S] (tokens with KV, new ones included), query_start_loc int64 [S + 1]:
// sequence i's new tokens are rows [query_start_loc[i], query_start_loc[i + 1]) of q, at the
// last positions of its context. Other rows of out are left as they are. sinks and
// sliding_window as paged_decode_attention's.
void paged_prefill_attention_(at::Tensor out, at::Tensor q, at::Tensor k_cache,
                              at::Tensor v_cache, at::Tensor block_tables,
                              at::Tensor context_lens, at::Tensor query_start_loc, double scale,
                              const std::optional<at::Tensor>& sinks,
                              std::optional<int64_t> sliding_window);

// The fused elementwise ops take float32 or bfloat16 (every tensor of a call in one dtype;
// bfloat16 computed in float32 and rounded once per output element).

// x [T, N] -> weight * x / sqrt(mean(x^2) + eps), [T, N].
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);

// residual += x (in place, rounded to its dtype), then returns rms_norm(residual); all [T, N].
at::Tensor fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                              double eps);

// x [T, 2 I] (gate columns, then up) -> silu(gate) * up, [T, I].
at::Tensor silu_and_mul(at::Tensor x);

// In place on qkv [T, (H + 2 H_kv) * D] (rows contiguous): rotates the H query heads and the
// H_kv key heads of each row with cos/sin [T, D] (Hugging Face rotate_half convention). With
// q_norm and k_norm [D] (Qwen3's QK-norm), each query / key head is first RMS-normalized with
// that weight and eps, rounded as rms_norm rounds.
void rotary_embedding_(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                       int64_t num_heads, int64_t num_kv_heads,
                       const std::optional<at::Tensor>& q_norm,
                       const std::optional<at::Tensor>& k_norm, double eps);

// Per row of x [S, V] float32: (logsumexp float32 [S], argmax int64 [S], the first maximum on
// ties), in two passes over the row instead of torch's three.
std::tuple<at::Tensor, at::Tensor> logsumexp_argmax(at::Tensor x);

// x [M, K] float32 (rows contiguous, K a multiple of 32) times a GGUF-quantized weight in
// planes (gguf_linear.cpp: quants qs [N, K / 32 * 16 or 32], scales d and, for Q4_1, minimums
// m float16 [N, K / 32 rounded up to 8]; ggml_type 3 = Q4_1, 8 = Q8_0, whose m is ignored),
// transposed: float32 [M, N]. The activations are quantized to int8 per block of 32 first.
at::Tensor gguf_linear(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m,
                       int64_t ggml_type);

// The same product for batches (rows above the row kernel's range) on the weight repacked in
// tiles of 16 output rows (gguf_linear.cpp: wq uint8 [T, K / 32 * 256 or 512], wd and, for
// Q4_1, wm float16 [T, K / 32, 16]; T = ceil(n / 16)): float32 [M, n].
at::Tensor gguf_gemm_tiled(at::Tensor x, at::Tensor wq, at::Tensor wd, at::Tensor wm,
                           int64_t ggml_type, int64_t n);

// Whether gguf_gemm_tiled was built with its AVX-512 VNNI path (else it is a scalar loop).
bool gguf_gemm_tiled_is_simd();

// One Llama decoder layer for T decode tokens (one per sequence), in place on the residual
// stream x [T, hidden] float32: the Python layer's ops in its order, the four linear layers on
// GGUF planes: weights = (qs, d, m) of qkv, o, gate_up, down (12 tensors, as gguf_linear; or a
// linear's tiles wq, wd, wm as gguf_gemm_tiled, told apart by their 3-D scales), types
// their ggml types. kv_cache [2, num_blocks, block_size, H_kv, D] float32 gets the new tokens'
// K/V at slot_mapping int64 [>= T]; block_tables and context_lens as paged_decode_attention
// (context lens include the new token); cos, sin [T, D].
void llama_decode_layer_(at::Tensor x, at::Tensor input_norm, at::Tensor post_norm, double eps,
                         at::TensorList weights, at::IntArrayRef types, at::Tensor kv_cache,
                         at::Tensor slot_mapping, at::Tensor block_tables,
                         at::Tensor context_lens, at::Tensor cos, at::Tensor sin,
                         int64_t num_heads, int64_t num_kv_heads, double scale);

// The routed experts of a MoE layer (fused_moe.cpp): x [T, H] (rows contiguous), w13 [E, 2I, H]
// (each expert's gate rows, then up rows) and w2 [E, H, I] contiguous in x's dtype (float32 or
// bfloat16); ids int64 [T, k] (local expert of each of a token's k slots; outside [0, E): not
// this call's, skipped), gates float32 [T, k]. Returns [T, H] in x's dtype: per token the sum over
// its local slots of gate * down(silu(gate_proj(x)) * up_proj(x)) (float32 sums, the activations
// rounded to x's dtype, one rounding at the end); rows of tokens with no local slot are 0.
at::Tensor fused_moe(at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor ids,
                     at::Tensor gates);

// Whether fused_moe (and small_linear) were built with their AVX-512 path (else a scalar loop).
bool fused_moe_is_simd();

// fused_moe on bfloat16 weights packed for brgemm (fused_moe_packed.cpp): w13p
// [E, I/16, H/2, 32, 2], w2p [E, H/32, I/2, 32, 2] (atom.kernels.moe.pack_experts); an expert
// with more than max_small_tokens tokens runs oneDNN's brgemm (AMX tiles where the CPU has them),
// one with fewer a VDPBF16PS kernel. Same result contract as fused_moe, bfloat16 only.
at::Tensor fused_moe_packed(at::Tensor x, at::Tensor w13p, at::Tensor w2p, at::Tensor ids,
                            at::Tensor gates, int64_t max_small_tokens);

// Whether fused_moe_packed runs here: built with AVX512-BF16 and oneDNN enabled in torch.
bool fused_moe_packed_is_available();

// x [M, K] (rows contiguous) @ weight.T (+ bias) for small weights (small_linear.cpp): weight
// [N, K] contiguous and bias [N] in x's dtype (float32 or bfloat16); [M, N] in x's dtype,
// float32 sums rounded once.
at::Tensor small_linear(at::Tensor x, at::Tensor weight, const std::optional<at::Tensor>& bias);

}  // namespace atom_kernels
