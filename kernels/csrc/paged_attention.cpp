// Decode attention straight from the paged KV cache (CPU), for atom.kernels.attention.
//
// One query token per sequence attends to the first context_len tokens of its own KV, read
// block by block through its block table: no gathered copy of the context is ever made. Work
// items are (sequence, range of KV heads, range of whole blocks), run with at::parallel_for on
// torch's intra-op threads (the extension is built with -fopenmp; without it at::parallel_for
// runs serially):
// - with at least 4 sequences per thread an item takes all KV heads, so each block's K and V are
//   read as one contiguous run (and the next block is prefetched); with fewer, one KV head;
// - with fewer sequences than threads each context is split into chunks of whole blocks, an item
//   per (sequence, chunk) over all heads (split-K, as in flash-decoding), so a one-request decode
//   keeps every thread busy; each item keeps per query head its chunk's max score m, sum of
//   exponentials l and unnormalised output o, and the merge rescales them by exp(m_c - max m).
// For the G = H / H_kv query heads that share a KV head:
//   pass 1  scores[g][t] = scale * q_g . k_t          register tiles of 16 tokens (AVX-512) or 8
//   softmax per g in float32                           vectorised exp (vec.h)
//   pass 2  o[g] = sum_t p[g][t] v_t, / sum_t p[g][t]   per block, up to 4 heads x 64 lanes of
//                                                      accumulators in registers
// The math is that of vLLM's CPU paged attention v1 (csrc/cpu/attention.cpp). The register
// tiling is what makes it fast: a dot product per (g, t) with one accumulator is a chain of
// dependent FMAs, latency-bound at a few GFLOP/s.
//
// Paths, by what the build machine has (-march=native) and head_dim (D):
// - AVX-512 (F/BW/VL), D % 16 == 0 (bfloat16: D % 32 == 0): 16-token score tiles summed with
//   one transpose-add (vec.h hsum16x16), 16-lane value accumulators. bfloat16 K with
//   AVX512-BF16: q . k by VDPBF16PS on the raw bf16 pairs (exact products, float32 sums; no
//   conversion of K at all); without it K is widened to float32 lanes by a shift.
// - AVX2 + FMA, D % 8 == 0: 8-token score tiles, 8-lane accumulators (bf16 widened by a shift).
// - otherwise a scalar loop that computes the same.
// Every path accumulates in float32; the output is rounded to q's dtype once.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace atom_kernels {
namespace {

using BF16 = c10::BFloat16;

// The problem of one call: q [S, H, D] (strided rows and heads, contiguous D), caches
// [num_blocks, block_size, H_kv, D] contiguous, block tables [S, table_stride].
template <typename T>
struct Problem {
  const T* q;
  const T* k_cache;
  const T* v_cache;
  const int64_t* block_tables;
  const int64_t* context_lens;
  int64_t q_seq_stride, q_head_stride;
  int64_t num_heads, num_kv_heads, head_dim, group, block_size, table_stride;
  int64_t token_stride;  // elements between tokens of a block: H_kv * D
  int64_t block_stride;  // elements between blocks: block_size * H_kv * D
  float scale;
};

enum class Path { kScalar, kAvx2, kAvx512 };

template <typename T>
Path path_for(int64_t head_dim) {
  if (ATOM_AVX512 && head_dim % (std::is_same_v<T, BF16> ? 32 : 16) == 0) return Path::kAvx512;
  if (ATOM_AVX2 && head_dim % 8 == 0) return Path::kAvx2;
  return Path::kScalar;
}

// Per-thread buffers of a work item.
template <typename T>
struct Scratch {
  std::vector<float> qf;      // [nq, D] the item's query heads, float32, times scale
  std::vector<BF16> qb;       // [nq, D] the same, raw (bf16 only: VDPBF16PS on the bf16 pairs)
  std::vector<float> scores;  // [nq, n_tok]
  std::vector<float> o;       // [nq, D] unnormalised output
  std::vector<float> m, l;    // [nq]
  std::vector<T> pad;         // [16, D] a partial tile of K, zero-padded
};

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
inline float softmax_numerators(float* s, int64_t n, float* max_out) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
  float mx = hmax(mv);
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  *max_out = mx;
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

#if ATOM_AVX512

// One query head's scores against the 16 tokens k_i = kb + i * token_stride, as 16 lanes: 16
// independent accumulators over D (token by token, so one pointer walks the rows), then one
// transpose-add. q is the head's float32 row times scale, or (VDPBF16PS, T = bf16) its raw bf16
// row, the scale applied to the sums.
template <typename T, typename Q>
inline __m512 score_tile16(const Q* q, const T* kb, int64_t token_stride, int64_t head_dim,
                           float scale) {
  __m512 acc[16];
  if constexpr (std::is_same_v<Q, BF16>) {
#if ATOM_AVX512_BF16
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const T* k = kb + i * token_stride;
      __m512 a = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + d),
                             (__m512bh)_mm512_loadu_si512(k + d));
      acc[i] = a;
    }
    return _mm512_mul_ps(hsum16x16(acc), _mm512_set1_ps(scale));
#endif
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const T* k = kb + i * token_stride;
      __m512 a = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 16)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), a);
      acc[i] = a;
    }
  }
  return hsum16x16(acc);
}

// The scores of the n tokens of one block against one query head into s[0, n): whole tiles of
// 16 in place, a last partial tile through a zero-padded copy (never reading past the block).
template <typename T, typename Q>
inline void score_block512(float* s, const Q* q, const T* kb, int64_t n, int64_t token_stride,
                           int64_t head_dim, float scale, T* pad) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(s + i, score_tile16(q, kb + i * token_stride, token_stride, head_dim, scale));
  if (i == n) return;
  std::fill(pad, pad + 16 * head_dim, T(0));
  for (int64_t j = i; j < n; ++j)
    std::copy(kb + j * token_stride, kb + j * token_stride + head_dim, pad + (j - i) * head_dim);
  _mm512_mask_storeu_ps(s + i, static_cast<__mmask16>((1u << (n - i)) - 1),
                        score_tile16(q, pad, head_dim, head_dim, scale));
}

// 512-bit pv_block: acc[g][d0 : d0 + 16 NV] += sum_i p[g][i] * v_i[d0 : d0 + 16 NV].
template <int GN, int NV, typename T>
inline void pv_block512(float* acc, int64_t acc_stride, const float* p, int64_t p_stride,
                        const T* vb, int64_t n, int64_t token_stride, int64_t d0) {
  __m512 a[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < NV; ++j) a[g][j] = _mm512_loadu_ps(acc + g * acc_stride + d0 + 16 * j);
  for (int64_t i = 0; i < n; ++i) {
    __m512 v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load16(vb + i * token_stride + d0 + 16 * j);
    for (int g = 0; g < GN; ++g) {
      const __m512 pb = _mm512_set1_ps(p[g * p_stride + i]);
      for (int j = 0; j < NV; ++j) a[g][j] = _mm512_fmadd_ps(pb, v[j], a[g][j]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + g * acc_stride + d0 + 16 * j, a[g][j]);
}

template <int NV, typename T>
void pv_block_heads512(float* acc, int64_t group, int64_t head_dim, const float* p, int64_t len,
                       const T* vb, int64_t n, int64_t token_stride) {
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    float* a = acc + g0 * head_dim;
    const float* pg = p + g0 * len;
    for (int64_t d0 = 0; d0 < head_dim; d0 += 16 * NV) {
      switch (std::min<int64_t>(4, group - g0)) {
#define ATOM_PV_CASE(GN)                                                        \
  case GN:                                                                      \
    pv_block512<GN, NV>(a, head_dim, pg, len, vb, n, token_stride, d0);         \
    break;
        ATOM_PV_CASE(1) ATOM_PV_CASE(2) ATOM_PV_CASE(3) ATOM_PV_CASE(4)
#undef ATOM_PV_CASE
      }
    }
  }
}

#endif  // ATOM_AVX512

// A work item: the query heads [h_begin * G, h_end * G) of sequence s (those its KV heads
// [h_begin, h_end) serve, adjacent in q) over its tokens [t_begin, t_end).
struct Item {
  int64_t s, h_begin, h_end, t_begin, t_end;
};

// The cache offset of token t of the sequence whose block table row is `table`.
template <typename T>
inline int64_t token_offset(const Problem<T>& P, const int64_t* table, int64_t t) {
  return table[t / P.block_size] * P.block_stride + (t % P.block_size) * P.token_stride;
}

// The item's query rows into w.qf (float32, times scale) and, for bf16, w.qb (raw); sizes the
// other buffers.
template <typename T>
void load_queries(const Problem<T>& P, const Item& it, Scratch<T>& w) {
  const int64_t D = P.head_dim, nq = (it.h_end - it.h_begin) * P.group;
  w.qf.resize(nq * D);
  if constexpr (std::is_same_v<T, BF16>) w.qb.resize(nq * D);
  for (int64_t r = 0; r < nq; ++r) {
    const T* qr = P.q + it.s * P.q_seq_stride + (it.h_begin * P.group + r) * P.q_head_stride;
    for (int64_t d = 0; d < D; ++d) {
      if constexpr (std::is_same_v<T, BF16>) w.qb[r * D + d] = qr[d];
      w.qf[r * D + d] = static_cast<float>(qr[d]) * P.scale;
    }
  }
  w.scores.resize(nq * (it.t_end - it.t_begin));
  w.o.assign(nq * D, 0.f);
  w.m.resize(nq);
  w.l.resize(nq);
  w.pad.resize(16 * D);
}

// attend() without SIMD: the reference the vector paths must match.
template <typename T>
void attend_scalar(const Problem<T>& P, const Item& it, Scratch<T>& w) {
  const int64_t G = P.group, D = P.head_dim, nq = (it.h_end - it.h_begin) * G;
  const int64_t n_tok = it.t_end - it.t_begin;
  const int64_t* table = P.block_tables + it.s * P.table_stride;
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t head = (it.h_begin + r / G) * D;
    float* sr = w.scores.data() + r * n_tok;
    for (int64_t t = it.t_begin; t < it.t_end; ++t) {
      const T* k = P.k_cache + token_offset(P, table, t) + head;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += w.qf[r * D + d] * static_cast<float>(k[d]);
      sr[t - it.t_begin] = dot;
    }
    w.m[r] = *std::max_element(sr, sr + n_tok);
    w.l[r] = 0.f;
    for (int64_t t = 0; t < n_tok; ++t) { sr[t] = std::exp(sr[t] - w.m[r]); w.l[r] += sr[t]; }
    for (int64_t t = it.t_begin; t < it.t_end; ++t) {
      const T* v = P.v_cache + token_offset(P, table, t) + head;
      for (int64_t d = 0; d < D; ++d) w.o[r * D + d] += sr[t - it.t_begin] * static_cast<float>(v[d]);
    }
  }
}

#if ATOM_AVX2
// Pass 1 of the vector paths: w.scores, block by block (t0: a block's first token in range, n:
// its tokens in range), the next block prefetched.
template <typename T>
void score_pass(const Problem<T>& P, Path path, const Item& it, Scratch<T>& w) {
  const int64_t G = P.group, D = P.head_dim, nq = (it.h_end - it.h_begin) * G;
  const int64_t n_tok = it.t_end - it.t_begin, bs = P.block_size, ts = P.token_stride;
  const int64_t* table = P.block_tables + it.s * P.table_stride;
  for (int64_t t0 = it.t_begin; t0 < it.t_end; t0 += bs - t0 % bs) {
    const int64_t n = std::min(bs - t0 % bs, it.t_end - t0);
    const T* kb = P.k_cache + token_offset(P, table, t0);
    if (t0 + n < it.t_end) prefetch_block(P.k_cache + token_offset(P, table, t0 + n), P.block_stride);
    for (int64_t r = 0; r < nq; ++r) {
      const T* kh = kb + (it.h_begin + r / G) * D;
      float* sr = w.scores.data() + r * n_tok + (t0 - it.t_begin);
#if ATOM_AVX512
      if (path == Path::kAvx512) {
        if constexpr (std::is_same_v<T, BF16> && ATOM_AVX512_BF16)  // VDPBF16PS on raw q
          score_block512(sr, w.qb.data() + r * D, kh, n, ts, D, P.scale, w.pad.data());
        else
          score_block512(sr, w.qf.data() + r * D, kh, n, ts, D, P.scale, w.pad.data());
        continue;
      }
#endif
      score_block(sr, w.qf.data() + r * D, kh, n, ts, D);
    }
  }
}

// Pass 2 of the vector paths: w.o += p v, block by block, all G query heads of a KV head at once.
template <typename T>
void value_pass(const Problem<T>& P, Path path, const Item& it, Scratch<T>& w) {
  const int64_t G = P.group, D = P.head_dim, n_tok = it.t_end - it.t_begin;
  const int64_t bs = P.block_size, ts = P.token_stride;
  const int64_t* table = P.block_tables + it.s * P.table_stride;
  for (int64_t t0 = it.t_begin; t0 < it.t_end; t0 += bs - t0 % bs) {
    const int64_t n = std::min(bs - t0 % bs, it.t_end - t0);
    const T* vb = P.v_cache + token_offset(P, table, t0);
    if (t0 + n < it.t_end) prefetch_block(P.v_cache + token_offset(P, table, t0 + n), P.block_stride);
    for (int64_t h = it.h_begin; h < it.h_end; ++h) {
      const int64_t r = (h - it.h_begin) * G;
      float* o = w.o.data() + r * D;
      const float* p = w.scores.data() + r * n_tok + (t0 - it.t_begin);
      const T* vh = vb + h * D;
#if ATOM_AVX512
      if (path == Path::kAvx512) {
        if (D % 64 == 0) pv_block_heads512<4>(o, G, D, p, n_tok, vh, n, ts);
        else if (D % 32 == 0) pv_block_heads512<2>(o, G, D, p, n_tok, vh, n, ts);
        else pv_block_heads512<1>(o, G, D, p, n_tok, vh, n, ts);
        continue;
      }
#endif
      if (D % 16 == 0) pv_block_heads<2>(o, G, D, p, n_tok, vh, n, ts);
      else pv_block_heads<1>(o, G, D, p, n_tok, vh, n, ts);
    }
  }
}
#endif  // ATOM_AVX2

// One item: w.o [nq, D] (unnormalised), w.m and w.l [nq] (max score, sum of exp(score - max)).
template <typename T>
void attend(const Problem<T>& P, Path path, const Item& it, Scratch<T>& w) {
  load_queries(P, it, w);
  if (path == Path::kScalar) return attend_scalar(P, it, w);
#if ATOM_AVX2
  score_pass(P, path, it, w);
  const int64_t nq = (it.h_end - it.h_begin) * P.group, n_tok = it.t_end - it.t_begin;
  for (int64_t r = 0; r < nq; ++r)
    w.l[r] = softmax_numerators(w.scores.data() + r * n_tok, n_tok, &w.m[r]);
  value_pass(P, path, it, w);
#endif
}

// out[i] = T(o[i] * factor) for n elements
template <typename T>
inline void store_scaled(T* out, const float* o, float factor, int64_t n) {
  int64_t i = 0;
#if ATOM_AVX2
  const __m256 f = _mm256_set1_ps(factor);
  for (; i + 8 <= n; i += 8) store8(out + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), f));
#endif
  for (; i < n; ++i) out[i] = static_cast<T>(o[i] * factor);
}

template <typename T>
void decode_kernel(T* out, const Problem<T>& P, int64_t num_seqs) {
  const Path path = path_for<T>(P.head_dim);
  const int64_t threads = at::get_num_threads(), H = P.num_heads, D = P.head_dim;
  // Fewer sequences than threads: split each context into chunks of whole blocks.
  const int64_t chunks = num_seqs < threads && path != Path::kScalar
                             ? (threads + num_seqs - 1) / num_seqs : 1;
  const int64_t heads_per_item =
      chunks > 1 || num_seqs >= 4 * threads || path == Path::kScalar ? P.num_kv_heads : 1;
  const int64_t items_per_seq = P.num_kv_heads / heads_per_item;
  // chunks > 1: each item's (o, m, l) per query head, merged below
  std::vector<float> part_o(chunks > 1 ? num_seqs * chunks * H * D : 0);
  std::vector<float> part_m(chunks > 1 ? num_seqs * chunks * H : 0);
  std::vector<float> part_l(chunks > 1 ? num_seqs * chunks * H : 0, 0.f);
  at::parallel_for(0, num_seqs * items_per_seq * chunks, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> w;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / (items_per_seq * chunks), rest = item % (items_per_seq * chunks);
      const int64_t h_begin = rest / chunks * heads_per_item, c = rest % chunks;
      const int64_t len = P.context_lens[s];
      const int64_t num_blocks = (len + P.block_size - 1) / P.block_size;
      const int64_t per_chunk = (num_blocks + chunks - 1) / chunks;
      const int64_t t_begin = std::min(len, c * per_chunk * P.block_size);
      const int64_t t_end = std::min(len, (c + 1) * per_chunk * P.block_size);
      if (t_begin >= t_end) continue;  // a short context leaves the last chunks empty (l = 0)
      attend(P, path, Item{s, h_begin, h_begin + heads_per_item, t_begin, t_end}, w);
      const int64_t q_begin = h_begin * P.group, nq = heads_per_item * P.group;
      if (chunks == 1) {
        for (int64_t r = 0; r < nq; ++r)
          store_scaled(out + (s * H + q_begin + r) * D, w.o.data() + r * D, 1.f / w.l[r], D);
        continue;
      }
      const int64_t part = (s * chunks + c) * H + q_begin;
      std::copy(w.o.begin(), w.o.end(), part_o.begin() + part * D);
      std::copy(w.m.begin(), w.m.end(), part_m.begin() + part);
      std::copy(w.l.begin(), w.l.end(), part_l.begin() + part);
    }
  });
  if (chunks == 1) return;
  std::vector<float> o(D);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t r = 0; r < H; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c)
        if (part_l[(s * chunks + c) * H + r] > 0.f) mx = std::max(mx, part_m[(s * chunks + c) * H + r]);
      std::fill(o.begin(), o.end(), 0.f);
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t i = (s * chunks + c) * H + r;
        if (part_l[i] == 0.f) continue;  // an empty chunk
        const float wc = std::exp(part_m[i] - mx);
        total += wc * part_l[i];
        const float* po = part_o.data() + i * D;
        for (int64_t d = 0; d < D; ++d) o[d] += wc * po[d];
      }
      store_scaled(out + (s * H + r) * D, o.data(), 1.f / total, D);
    }
}

}  // namespace

// q [S, H, D] (rows and heads may be strided, D contiguous); k_cache, v_cache [num_blocks,
// block_size, H_kv, D] (same dtype as q, float32 or bfloat16, contiguous); block_tables int64
// [S, >= max blocks]; context_lens int64 [S], >= 1. Returns [S, H, D] in q's dtype.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q [S, H, D], caches [num_blocks, block_size, H_kv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
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
  auto qc = q.stride(2) == 1 ? q : q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = at::empty({num_seqs, num_heads, head_dim}, q.options());
  if (num_seqs == 0) return out;
  const auto launch = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Problem<T> P{qc.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                       tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), qc.stride(0),
                       qc.stride(1), num_heads, num_kv_heads, head_dim, num_heads / num_kv_heads,
                       block_size, tables.size(1), num_kv_heads * head_dim,
                       block_size * num_kv_heads * head_dim, static_cast<float>(scale)};
    decode_kernel(out.data_ptr<T>(), P, num_seqs);
  };
  if (q.scalar_type() == at::kFloat) launch(static_cast<float*>(nullptr));
  else launch(static_cast<BF16*>(nullptr));
  return out;
}

}  // namespace atom_kernels
