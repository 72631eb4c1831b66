// Decode attention straight from the paged KV cache (CPU), for atom.kernels.paged_decode.
//
// One query token per sequence attends to the first context_len tokens of its own KV, read
// block by block through its block table: no gathered copy of the context is ever made (the
// torch path copied every sequence's whole context, per layer and step). Work is split over
// (sequence, KV head) pairs with at::parallel_for, so it runs on torch's intra-op threads.
// Per pair: pass 1 computes the scores of the G = H / H_kv query heads that share the KV head
// (K read once), a softmax in float32, pass 2 accumulates the values (V read once). Same math
// as vLLM's CPU paged attention v1 (csrc/cpu/attention.cpp); the head_dim loops use AVX2/FMA
// when the build machine has them (-march=native), a scalar loop otherwise.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Loads 8 consecutive elements as float32 lanes (AVX2) or through a scalar loop.
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32: the 16 bits become the high half
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}
#define ATOM_AVX2 1
#else
#define ATOM_AVX2 0
#endif

// q_scaled [D] . k [D] (k in the cache dtype).
template <typename T>
inline float dot(const float* q, const T* k, int64_t head_dim) {
#if ATOM_AVX2
  if (head_dim % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
    return hsum(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) acc += q[d] * static_cast<float>(k[d]);
  return acc;
}

// acc [D] += p * v [D] (v in the cache dtype).
template <typename T>
inline void axpy(float* acc, float p, const T* v, int64_t head_dim) {
#if ATOM_AVX2
  if (head_dim % 8 == 0) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t d = 0; d < head_dim; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(acc + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * static_cast<float>(v[d]);
}

template <typename T>
void decode_kernel(float* out, const T* q, const T* k_cache, const T* v_cache,
                   const int64_t* block_tables, const int64_t* context_lens,
                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int64_t table_stride, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;    // elements between tokens of a block
  const int64_t block_stride = block_size * token_stride;  // elements between blocks
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores, inv_sum(group);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / num_kv_heads, h = work % num_kv_heads;
      const int64_t len = context_lens[s];
      const int64_t* table = block_tables + s * table_stride;
      for (int64_t g = 0; g < group; ++g) {
        const T* qp = q + (s * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(qp[d]) * scale;
      }
      scores.resize(group * len);
      // pass 1: scores[g][t] = (q_g * scale) . k_t, block by block (K read once)
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* kb = k_cache + table[t0 / block_size] * block_stride + h * head_dim;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t g = 0; g < group; ++g)
            scores[g * len + t0 + i] = dot(qf.data() + g * head_dim, kb + i * token_stride, head_dim);
      }
      // softmax per query head, float32
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        inv_sum[g] = 1.f / sum;
      }
      // pass 2: acc[g] = sum_t p[g][t] * v_t (V read once)
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* vb = v_cache + table[t0 / block_size] * block_stride + h * head_dim;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t g = 0; g < group; ++g)
            axpy(acc.data() + g * head_dim, scores[g * len + t0 + i], vb + i * token_stride, head_dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* op = out + (s * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) op[d] = acc[g * head_dim + d] * inv_sum[g];
      }
    }
  });
}

// q [S, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D] (same dtype as q, float32 or
// bfloat16, contiguous); block_tables int64 [S, >= max blocks]; context_lens int64 [S], >= 1.
// Returns float32 [S, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q [S, H, D], caches [num_blocks, block_size, H_kv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and context_lens must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: caches must be contiguous");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "paged_decode_attention: head_dim mismatch or H not a multiple of H_kv");
  TORCH_CHECK(block_tables.size(0) == num_seqs && context_lens.size(0) == num_seqs,
              "paged_decode_attention: one block table row and context length per sequence");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty({num_seqs, num_heads, head_dim}, q.options().dtype(at::kFloat));
  if (num_seqs == 0) return out;
  const auto launch = [&](auto* q_ptr, auto* k_ptr, auto* v_ptr) {
    decode_kernel(out.data_ptr<float>(), q_ptr, k_ptr, v_ptr, tables.data_ptr<int64_t>(),
                  lens.data_ptr<int64_t>(), num_seqs, num_heads, num_kv_heads, head_dim,
                  block_size, tables.size(1), static_cast<float>(scale));
  };
  if (q.scalar_type() == at::kFloat) {
    launch(qc.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16,
                "paged_decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
    launch(qc.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
           v_cache.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention read in place from the paged KV cache (float32 output)");
}
