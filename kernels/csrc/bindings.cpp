// Registers the ops of ops.h as torch.ops.atom_kernels.<name> (loaded by atom.kernels.cpu_ops
// with torch.ops.load_library). Dispatcher registration, not a Python module: no pybind11 and no
// Python headers to compile, and the schemas tell torch which arguments an op writes (a!).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(atom_kernels, m) {
  // Decode attention read in place from the paged KV cache (output in q's dtype); optional
  // sinks [H] and sliding window (gpt-oss); optionally the step's new K/V written first. The
  // caches are written only then (the schema marks them as possibly written).
  m.def("paged_decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, Tensor? sinks=None, "
        "int? sliding_window=None, Tensor? key=None, Tensor? value=None, "
        "Tensor? slot_mapping=None) -> Tensor");
  // Causal prefill attention of several sequences read from the paged KV cache, into out.
  m.def("paged_prefill_attention_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, Tensor query_start_loc, float scale, "
        "Tensor? sinks=None, int? sliding_window=None) -> ()");
  // RMSNorm of float32 or bfloat16 rows.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // residual += x in place, then RMSNorm of residual (float32 or bfloat16).
  m.def("fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  // silu(gate) * up of [T, 2I] float32 or bfloat16 rows.
  m.def("silu_and_mul(Tensor x) -> Tensor");
  // Rotary embedding of the query and key heads of a fused qkv tensor, in place (float32 or
  // bfloat16), optionally after an RMSNorm of each head (Qwen3's QK-norm).
  m.def("rotary_embedding_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, "
        "int num_kv_heads, Tensor? q_norm=None, Tensor? k_norm=None, float eps=1e-6) -> ()");
  // Row-wise logsumexp and first argmax of float32 [S, V] (sampling).
  m.def("logsumexp_argmax(Tensor x) -> (Tensor, Tensor)");
  // x @ W.T with W in GGUF's Q4_1 / Q8_0 blocks (int8-quantized activations; float32 out).
  m.def("gguf_linear(Tensor x, Tensor qs, Tensor d, Tensor m, int ggml_type) -> Tensor");
  // The same on the weight repacked in tiles of 16 output rows (batches; float32 out).
  m.def("gguf_gemm_tiled(Tensor x, Tensor wq, Tensor wd, Tensor wm, int ggml_type, int n) "
        "-> Tensor");
  // Whether gguf_gemm_tiled has its AVX-512 VNNI path here (else a scalar loop). No tensor
  // argument to dispatch on: registered for every backend with its definition.
  m.def("gguf_gemm_tiled_is_simd() -> bool", &atom_kernels::gguf_gemm_tiled_is_simd);
  // A whole Llama decoder layer of a decode step on GGUF blocks, in place on x and the cache.
  // The routed experts of a MoE layer in one call: silu-gated MLPs weighted by the gates.
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor ids, Tensor gates) -> Tensor");
  m.def("fused_moe_is_simd() -> bool", &atom_kernels::fused_moe_is_simd);
  // The same on bf16 weights packed for oneDNN's brgemm (AMX tiles above a few tokens/expert).
  m.def("fused_moe_packed(Tensor x, Tensor w13p, Tensor w2p, Tensor ids, Tensor gates, "
        "int max_small_tokens) -> Tensor");
  m.def("fused_moe_packed_is_available() -> bool", &atom_kernels::fused_moe_packed_is_available);
  // x @ W.T (+ bias) for weights too small for a oneDNN call's fixed cost (MoE routers).
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("llama_decode_layer_(Tensor(a!) x, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor[] weights, int[] types, Tensor(b!) kv_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, Tensor cos, Tensor sin, int num_heads, "
        "int num_kv_heads, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(atom_kernels, CPU, m) {
  using namespace atom_kernels;
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention_", &paged_prefill_attention_);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding_", &rotary_embedding_);
  m.impl("logsumexp_argmax", &logsumexp_argmax);
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_gemm_tiled", &gguf_gemm_tiled);
  m.impl("llama_decode_layer_", &llama_decode_layer_);
  m.impl("fused_moe", &fused_moe);
  m.impl("fused_moe_packed", &fused_moe_packed);
  m.impl("small_linear", &small_linear);
}
