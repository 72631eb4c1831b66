// Decode attention straight from the paged KV cache (CPU), for atom.kernels.attention.
//
// One query token per sequence attends to the first context_len tokens of its own KV, read
// block by block through its block table: no gathered copy of the context is ever made. Work
// items are (sequence, range of KV heads), run with at::parallel_for on torch's intra-op threads
// (the extension is built with -fopenmp; without it at::parallel_for runs serially). With at
// least 4 sequences per thread an item takes all KV heads, so each block's K and V are read as
// one contiguous run (and the next block is prefetched). For the G = H / H_kv query heads that
// share a KV head:
//   pass 1  scores[g][t] = (q_g * scale) . k_t       8 tokens per register tile
//   softmax per g in float32                          vectorised exp (vec.h)
//   pass 2  out[g] = sum_t p[g][t] v_t / sum_t p[g][t]   per block, up to 4 heads x 16 lanes of
//                                                     accumulators in registers
// The math is that of vLLM's CPU paged attention v1 (csrc/cpu/attention.cpp). The register
// tiling is what makes it fast: a dot product per (g, t) with one accumulator is a chain of
// dependent FMAs, latency-bound at a few GFLOP/s. With AVX2+FMA (-march=native on such a
// machine) and head_dim % 8 == 0 the tiled path runs; otherwise a scalar loop computes the same.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace atom_kernels {
namespace {

#if ATOM_AVX2

template <typename T>
inline void prefetch_block(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * (int64_t)sizeof(T); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// scores[i] = q . k_i for n tokens of one block (k_i = kb + i * token_stride); D % 8 == 0.
// Eight tokens at a time: eight independent FMA chains instead of one.
template <typename T>
inline void score_block(float* scores, const float* q, const T* kb, int64_t n,
                        int64_t token_stride, int64_t head_dim) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const T* k = kb + i * token_stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < head_dim; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(qv, load8(k + d), a0);
      a1 = _mm256_fmadd_ps(qv, load8(k + token_stride + d), a1);
      a2 = _mm256_fmadd_ps(qv, load8(k + 2 * token_stride + d), a2);
      a3 = _mm256_fmadd_ps(qv, load8(k + 3 * token_stride + d), a3);
      a4 = _mm256_fmadd_ps(qv, load8(k + 4 * token_stride + d), a4);
      a5 = _mm256_fmadd_ps(qv, load8(k + 5 * token_stride + d), a5);
      a6 = _mm256_fmadd_ps(qv, load8(k + 6 * token_stride + d), a6);
      a7 = _mm256_fmadd_ps(qv, load8(k + 7 * token_stride + d), a7);
    }
    _mm_storeu_ps(scores + i, hsum4(a0, a1, a2, a3));
    _mm_storeu_ps(scores + i + 4, hsum4(a4, a5, a6, a7));
  }
  for (; i < n; ++i) {
    const T* k = kb + i * token_stride;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
    scores[i] = hsum(acc);
  }
}

// In place p[t] = exp(s[t] - max s) over n scores; returns sum_t p[t] (and max s in *max_out).
inline float softmax_numerators(float* s, int64_t n, float* max_out = nullptr) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
  float mx = hmax(mv);
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  if (max_out != nullptr) *max_out = mx;
  const __m256 mb = _mm256_set1_ps(mx);
  __m256 sv = _mm256_setzero_ps();
  t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mb));
    _mm256_storeu_ps(s + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum(sv);
  for (; t < n; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
  return sum;
}

// acc[g][d0 : d0 + 8 NV] += sum_i p[g][i] * v_i[d0 : d0 + 8 NV] over the n tokens of one block
// (v_i = vb + i * token_stride), for GN query heads: GN * NV accumulators live in registers for
// the block, and each V slice is loaded once for all GN heads.
template <int GN, int NV, typename T>
inline void pv_block(float* acc, int64_t acc_stride, const float* p, int64_t p_stride,
                     const T* vb, int64_t n, int64_t token_stride, int64_t d0) {
  __m256 a[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < NV; ++j) a[g][j] = _mm256_loadu_ps(acc + g * acc_stride + d0 + 8 * j);
  for (int64_t i = 0; i < n; ++i) {
    __m256 v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load8(vb + i * token_stride + d0 + 8 * j);
    for (int g = 0; g < GN; ++g) {
      const __m256 pb = _mm256_broadcast_ss(p + g * p_stride + i);
      for (int j = 0; j < NV; ++j) a[g][j] = _mm256_fmadd_ps(pb, v[j], a[g][j]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc + g * acc_stride + d0 + 8 * j, a[g][j]);
}

// pv_block for all `group` query heads of one KV head and the whole of head_dim.
template <int NV, typename T>
void pv_block_heads(float* acc, int64_t group, int64_t head_dim, const float* p, int64_t len,
                    const T* vb, int64_t n, int64_t token_stride) {
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    float* a = acc + g0 * head_dim;
    const float* pg = p + g0 * len;
    for (int64_t d0 = 0; d0 < head_dim; d0 += 8 * NV) {
      switch (std::min<int64_t>(4, group - g0)) {
#define ATOM_PV_CASE(GN)                                                        \
  case GN:                                                                      \
    pv_block<GN, NV>(a, head_dim, pg, len, vb, n, token_stride, d0);            \
    break;
        ATOM_PV_CASE(1) ATOM_PV_CASE(2) ATOM_PV_CASE(3) ATOM_PV_CASE(4)
#undef ATOM_PV_CASE
      }
    }
  }
}

#endif  // ATOM_AVX2

// One (sequence, KV head) pair, any head_dim, scalar: the reference the tiled path must match.
template <typename T>
void pair_scalar(float* acc, float* scores, const float* qf, const T* k_head, const T* v_head,
                 const int64_t* table, int64_t len, int64_t group, int64_t head_dim,
                 int64_t block_size, int64_t block_stride, int64_t token_stride) {
  for (int64_t t = 0; t < len; ++t) {
    const int64_t off = table[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < head_dim; ++d)
        s += qf[g * head_dim + d] * static_cast<float>(k_head[off + d]);
      scores[g * len + t] = s;
    }
  }
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    const float mx = *std::max_element(sg, sg + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
    for (int64_t t = 0; t < len; ++t) {
      const int64_t off = table[t / block_size] * block_stride + (t % block_size) * token_stride;
      for (int64_t d = 0; d < head_dim; ++d)
        acc[g * head_dim + d] += sg[t] * static_cast<float>(v_head[off + d]);
    }
    for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] /= sum;
  }
}

template <typename T>
void decode_kernel(float* out, const T* q, const T* k_cache, const T* v_cache,
                   const int64_t* block_tables, const int64_t* context_lens,
                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int64_t table_stride, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;    // elements between tokens of a block
  const int64_t block_stride = block_size * token_stride;  // elements between blocks
  const bool tiled = ATOM_AVX2 && head_dim % 8 == 0;
  // A work item is one sequence and a range of its KV heads. With enough sequences to go round
  // the threads, an item takes all heads: it then reads each block's [block_size, H_kv, D] K
  // and V as one contiguous run, which the hardware prefetcher streams (per-head items read
  // head_dim-wide pieces at a stride of H_kv * head_dim and were memory-latency bound).
  const int64_t heads_per_item =
      num_seqs >= 4 * at::get_num_threads() || !tiled ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_heads * head_dim), scores, inv(num_heads);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / items_per_seq;
      const int64_t h_begin = (work % items_per_seq) * heads_per_item;
      const int64_t h_end = h_begin + heads_per_item;
      const int64_t len = context_lens[s];
      const int64_t* table = block_tables + s * table_stride;
      // Query heads [h_begin * G, h_end * G) are the ones these KV heads serve, adjacent in q.
      const int64_t q_begin = h_begin * group, nq = heads_per_item * group;
      const T* qp = q + (s * num_heads + q_begin) * head_dim;
      for (int64_t i = 0; i < nq * head_dim; ++i) qf[i] = static_cast<float>(qp[i]) * scale;
      scores.resize(nq * len);  // scores[(h - h_begin) * G + g][t]
      float* o = out + (s * num_heads + q_begin) * head_dim;
      if (!tiled) {
        for (int64_t h = h_begin; h < h_end; ++h) {
          const int64_t r = (h - h_begin) * group;
          pair_scalar(o + r * head_dim, scores.data() + r * len, qf.data() + r * head_dim,
                      k_cache + h * head_dim, v_cache + h * head_dim, table, len, group,
                      head_dim, block_size, block_stride, token_stride);
        }
        continue;
      }
#if ATOM_AVX2
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* kb = k_cache + table[t0 / block_size] * block_stride;
        const int64_t n = std::min(block_size, len - t0);
        if (t0 + block_size < len) prefetch_block(k_cache + table[t0 / block_size + 1] * block_stride, block_stride);
        for (int64_t h = h_begin; h < h_end; ++h)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = (h - h_begin) * group + g;
            score_block(scores.data() + r * len + t0, qf.data() + r * head_dim, kb + h * head_dim,
                        n, token_stride, head_dim);
          }
      }
      for (int64_t r = 0; r < nq; ++r) inv[r] = 1.f / softmax_numerators(scores.data() + r * len, len);
      std::fill(o, o + nq * head_dim, 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* vb = v_cache + table[t0 / block_size] * block_stride;
        const int64_t n = std::min(block_size, len - t0);
        if (t0 + block_size < len) prefetch_block(v_cache + table[t0 / block_size + 1] * block_stride, block_stride);
        for (int64_t h = h_begin; h < h_end; ++h) {
          const int64_t r = (h - h_begin) * group;
          if (head_dim % 16 == 0)
            pv_block_heads<2>(o + r * head_dim, group, head_dim, scores.data() + r * len + t0,
                              len, vb + h * head_dim, n, token_stride);
          else
            pv_block_heads<1>(o + r * head_dim, group, head_dim, scores.data() + r * len + t0,
                              len, vb + h * head_dim, n, token_stride);
        }
      }
      for (int64_t r = 0; r < nq; ++r)
        for (int64_t d = 0; d < head_dim; ++d) o[r * head_dim + d] *= inv[r];
#endif
    }
  });
}

#if ATOM_AVX2
// Decode attention of float32 q [S, H, D] with each sequence's context split into chunks of
// whole blocks, one work item per (sequence, chunk) over all heads (split-K, as in
// flash-decoding): with fewer sequences than threads, the per-sequence items above leave
// threads idle, and an item per KV head reads each token's head_dim-wide slice at a stride of
// H_kv * head_dim. Each item keeps, per query head, its chunk's max score m, sum of exp l and
// unnormalised output o; the merge rescales them by exp(m_c - max_c m_c).
void decode_split_kernel(float* out, const float* q, const float* k_cache, const float* v_cache,
                         const int64_t* block_tables, const int64_t* context_lens,
                         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, int64_t table_stride, float scale,
                         int64_t chunks) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  std::vector<float> part_o(num_seqs * chunks * num_heads * head_dim, 0.f);
  std::vector<float> part_m(num_seqs * chunks * num_heads, -std::numeric_limits<float>::infinity());
  std::vector<float> part_l(num_seqs * chunks * num_heads, 0.f);
  at::parallel_for(0, num_seqs * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_heads * head_dim), scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / chunks, c = work % chunks, len = context_lens[s];
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      const int64_t per_chunk = (num_blocks + chunks - 1) / chunks;
      const int64_t t_begin = std::min(len, c * per_chunk * block_size);
      const int64_t t_end = std::min(len, (c + 1) * per_chunk * block_size);
      if (t_begin >= t_end) continue;  // a short context leaves the last chunks empty
      const int64_t n_tok = t_end - t_begin;
      const int64_t* table = block_tables + s * table_stride;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = q[s * num_heads * head_dim + i] * scale;
      scores.resize(num_heads * n_tok);  // scores[h * G + g][t - t_begin]
      for (int64_t t0 = t_begin; t0 < t_end; t0 += block_size) {
        const float* kb = k_cache + table[t0 / block_size] * block_stride;
        const int64_t n = std::min(block_size, t_end - t0);
        if (t0 + block_size < t_end) prefetch_block(k_cache + table[t0 / block_size + 1] * block_stride, block_stride);
        for (int64_t r = 0; r < num_heads; ++r)
          score_block(scores.data() + r * n_tok + (t0 - t_begin), qf.data() + r * head_dim,
                      kb + (r / group) * head_dim, n, token_stride, head_dim);
      }
      const int64_t part = (s * chunks + c) * num_heads;
      for (int64_t r = 0; r < num_heads; ++r)
        part_l[part + r] = softmax_numerators(scores.data() + r * n_tok, n_tok, &part_m[part + r]);
      float* o = part_o.data() + part * head_dim;
      for (int64_t t0 = t_begin; t0 < t_end; t0 += block_size) {
        const float* vb = v_cache + table[t0 / block_size] * block_stride;
        const int64_t n = std::min(block_size, t_end - t0);
        if (t0 + block_size < t_end) prefetch_block(v_cache + table[t0 / block_size + 1] * block_stride, block_stride);
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          float* oh = o + h * group * head_dim;
          const float* ph = scores.data() + h * group * n_tok + (t0 - t_begin);
          if (head_dim % 16 == 0)
            pv_block_heads<2>(oh, group, head_dim, ph, n_tok, vb + h * head_dim, n, token_stride);
          else
            pv_block_heads<1>(oh, group, head_dim, ph, n_tok, vb + h * head_dim, n, token_stride);
        }
      }
    }
  });
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t r = 0; r < num_heads; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part_m[(s * chunks + c) * num_heads + r]);
      float* o = out + (s * num_heads + r) * head_dim;
      std::fill(o, o + head_dim, 0.f);
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t i = (s * chunks + c) * num_heads + r;
        if (part_l[i] == 0.f) continue;  // an empty chunk
        const float w = std::exp(part_m[i] - mx);
        total += w * part_l[i];
        const float* po = part_o.data() + i * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] += w * po[d];
      }
      for (int64_t d = 0; d < head_dim; ++d) o[d] /= total;
    }
}
#endif  // ATOM_AVX2

}  // namespace

at::Tensor paged_decode_attention_split(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                        at::Tensor block_tables, at::Tensor context_lens,
                                        double scale) {
#if ATOM_AVX2
  const int64_t threads = at::get_num_threads();
  if (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
      q.size(0) < threads && q.size(2) % 8 == 0 && threads > 1) {
    TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                    v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                    k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
                "paged_decode_attention_split: q [S, H, D], contiguous caches [num_blocks, "
                "block_size, H_kv, D]");
    auto qc = q.contiguous();
    auto tables = block_tables.contiguous();
    auto lens = context_lens.contiguous();
    auto out = at::empty(q.sizes(), q.options());
    const int64_t num_seqs = q.size(0);
    decode_split_kernel(out.data_ptr<float>(), qc.data_ptr<float>(), k_cache.data_ptr<float>(),
                        v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
                        lens.data_ptr<int64_t>(), num_seqs, q.size(1), k_cache.size(2),
                        q.size(2), k_cache.size(1), tables.size(1), static_cast<float>(scale),
                        (threads + num_seqs - 1) / num_seqs);
    return out;
  }
#endif
  return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale);
}

// q [S, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D] (same dtype as q, float32 or
// bfloat16, contiguous); block_tables int64 [S, >= max blocks]; context_lens int64 [S], >= 1.
// Returns float32 [S, H, D].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens,
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
  auto out = at::empty({num_seqs, num_heads, head_dim}, q.options().dtype(at::kFloat));
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

}  // namespace atom_kernels
