// Block-level pieces of atom's paged attention kernels (decode: paged_attention.cpp, prefill:
// prefill_attention.cpp), for one KV head's block of tokens and a set of query rows:
//   scores   s[t] = scale * q . k_t             register tiles of 16 tokens (AVX-512) or 8 (AVX2)
//   softmax  p[t] = exp(s[t] - max)              vectorised exp (vec.h); a sink logit per head
//                                                joins only the denominator (softmax_normalizer)
//   values   o += sum_t p[t] v_t                 up to 4 query rows x 64 lanes of accumulators
// The register tiling is what makes them fast: a dot product per (row, token) with one
// accumulator is a chain of dependent FMAs, latency-bound at a few GFLOP/s.
//
// Paths, by what the build machine has (-march=native), the dtype and head_dim (D):
// - bfloat16 on AVX512-BF16, D % 32 == 0: q . k by VDPBF16PS on the raw bf16 pairs (exact
//   products, float32 sums; K is never converted), 16 tokens a register tile summed with one
//   transpose-add (vec.h hsum16x16); values widened to 16 float32 lanes by a shift.
// - AVX2 + FMA, D % 8 == 0 (float32 everywhere, bfloat16 elsewhere): 8-token score tiles,
//   8-lane accumulators (bf16 widened by a shift). float32 keeps these 256-bit tiles on AVX-512
//   CPUs too: a 512-bit float32 variant (16-token tiles) was no faster on a Zen 4, which runs a
//   512-bit op as two 256-bit halves (issue 37's alternating timings: within their noise).
// - otherwise the callers' scalar loops, which compute the same.
// Everything accumulates in float32.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace atom_kernels {
namespace attention_tiles {

using BF16 = c10::BFloat16;

enum class Path { kScalar, kAvx2, kAvx512Bf16 };

template <typename T>
Path path_for(int64_t head_dim) {
  if (std::is_same_v<T, BF16> && ATOM_AVX512_BF16 && head_dim % 32 == 0) return Path::kAvx512Bf16;
  if (ATOM_AVX2 && head_dim % 8 == 0) return Path::kAvx2;
  return Path::kScalar;
}

#if ATOM_AVX2

// Prefetch slice `part` of `parts` of a block's rows (bs rows, row i's elements [i * ts + first,
// i * ts + first + width): the KV heads of a work item). Callers spread a block's prefetch over
// the work of the block before it: issued all at once, the prefetches filled the core's miss
// buffers and stalled it (the decode step then ran at about half the memory bandwidth).
template <typename T>
inline void prefetch_rows(const T* block, int64_t bs, int64_t ts, int64_t first, int64_t width,
                          int64_t part, int64_t parts) {
  for (int64_t i = bs * part / parts; i < bs * (part + 1) / parts; ++i) {
    const char* c = reinterpret_cast<const char*>(block + i * ts + first);
    for (int64_t off = 0; off < width * static_cast<int64_t>(sizeof(T)); off += 64)
      _mm_prefetch(c + off, _MM_HINT_T0);
  }
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

// max_t s[t] over n >= 1 scores.
inline float max_of(const float* s, int64_t n) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
  float mx = hmax(mv);
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

// In place p[t] = exp(s[t] - mx) over n scores; returns sum_t p[t].
inline float exp_minus(float* s, int64_t n, float mx) {
  const __m256 mb = _mm256_set1_ps(mx);
  __m256 sv = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mb));
    _mm256_storeu_ps(s + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum(sv);
  for (; t < n; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
  return sum;
}

// In place p[t] = exp(s[t] - max s) over n scores; returns sum_t p[t] (and max s in *max_out).
inline float softmax_numerators(float* s, int64_t n, float* max_out) {
  *max_out = max_of(s, n);
  return exp_minus(s, n, *max_out);
}

#endif  // ATOM_AVX2

#if ATOM_AVX512_BF16

// One query head's scores against the 16 bf16 tokens k_i = kb + i * token_stride, as 16 lanes:
// 16 independent VDPBF16PS accumulators over D (token by token, so one pointer walks the rows)
// on the raw bf16 q row, one transpose-add, then the scale.
inline __m512 score_tile16(const BF16* q, const BF16* kb, int64_t token_stride, int64_t head_dim,
                           float scale) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    const BF16* k = kb + i * token_stride;
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 32)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + d),
                           (__m512bh)_mm512_loadu_si512(k + d));
    acc[i] = a;
  }
  return _mm512_mul_ps(hsum16x16(acc), _mm512_set1_ps(scale));
}

// The scores of the n tokens of one block against one query head into s[0, n): whole tiles of
// 16 in place, a last partial tile through a zero-padded copy (never reading past the block).
inline void score_block512(float* s, const BF16* q, const BF16* kb, int64_t n,
                           int64_t token_stride, int64_t head_dim, float scale, BF16* pad) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(s + i, score_tile16(q, kb + i * token_stride, token_stride, head_dim, scale));
  if (i == n) return;
  std::fill(pad, pad + 16 * head_dim, BF16(0));
  for (int64_t j = i; j < n; ++j)
    std::copy(kb + j * token_stride, kb + j * token_stride + head_dim, pad + (j - i) * head_dim);
  _mm512_mask_storeu_ps(s + i, static_cast<__mmask16>((1u << (n - i)) - 1),
                        score_tile16(q, pad, head_dim, head_dim, scale));
}

#endif  // ATOM_AVX512_BF16

#if ATOM_AVX2

// float32 register types for the value pass: 8 lanes (AVX2) and 16 (AVX-512).
struct Lanes8 {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T> static V widen(const T* p) { return load8(p); }
  static V broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#if ATOM_AVX512_BF16
struct Lanes16 {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  template <typename T> static V widen(const T* p) { return load16(p); }
  static V broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#endif

// acc[g][d0 : d0 + W NV] += sum_i p[g][i] * v_i[d0 : d0 + W NV] over the n tokens of one block
// (v_i = vb + i * token_stride; W = L::kWidth), for GN query rows: GN * NV accumulators live in
// registers for the block, and each V slice is loaded once for all GN rows.
template <typename L, int GN, int NV, typename T>
inline void pv_block(float* acc, int64_t acc_stride, const float* p, int64_t p_stride,
                     const T* vb, int64_t n, int64_t token_stride, int64_t d0) {
  constexpr int W = L::kWidth;
  typename L::V a[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < NV; ++j) a[g][j] = L::load(acc + g * acc_stride + d0 + W * j);
  for (int64_t i = 0; i < n; ++i) {
    typename L::V v[NV];
    for (int j = 0; j < NV; ++j) v[j] = L::widen(vb + i * token_stride + d0 + W * j);
    for (int g = 0; g < GN; ++g) {
      const typename L::V pb = L::broadcast(p + g * p_stride + i);
      for (int j = 0; j < NV; ++j) a[g][j] = L::fmadd(pb, v[j], a[g][j]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < NV; ++j) L::store(acc + g * acc_stride + d0 + W * j, a[g][j]);
}

// pv_block for `group` query rows (p: stride len) and the whole of head_dim, up to 4 rows at a
// time.
template <typename L, int NV, typename T>
void pv_block_heads(float* acc, int64_t group, int64_t head_dim, const float* p, int64_t len,
                    const T* vb, int64_t n, int64_t token_stride) {
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    float* a = acc + g0 * head_dim;
    const float* pg = p + g0 * len;
    for (int64_t d0 = 0; d0 < head_dim; d0 += L::kWidth * NV) {
      switch (std::min<int64_t>(4, group - g0)) {
#define ATOM_PV_CASE(GN)                                                        \
  case GN:                                                                      \
    pv_block<L, GN, NV>(a, head_dim, pg, len, vb, n, token_stride, d0);         \
    break;
        ATOM_PV_CASE(1) ATOM_PV_CASE(2) ATOM_PV_CASE(3) ATOM_PV_CASE(4)
#undef ATOM_PV_CASE
      }
    }
  }
}

// The scores of one query row against the n tokens of one block into s[0, n) (kh: the row's KV
// head in the block's first token, ts: elements between tokens). qf is the row times scale in
// float32; q the row as stored (read only for bf16 caches on AVX512-BF16); pad: scratch of
// 16 * D elements for a partial 16-token tile.
template <typename T>
inline void score_row(Path path, float* s, const float* qf, const T* q, const T* kh,
                      int64_t n, int64_t ts, int64_t head_dim, float scale, T* pad) {
#if ATOM_AVX512_BF16
  if constexpr (std::is_same_v<T, BF16>) {
    if (path == Path::kAvx512Bf16) return score_block512(s, q, kh, n, ts, head_dim, scale, pad);
  }
#endif
  score_block(s, qf, kh, n, ts, head_dim);
}

// o[r] += sum_i p[r][i] v_i for `rows` query rows (o: stride D; p: stride p_stride) over the n
// tokens v_i = vh + i * ts of one block and KV head.
template <typename T>
inline void pv_rows(Path path, float* o, int64_t rows, int64_t head_dim, const float* p,
                    int64_t p_stride, const T* vh, int64_t n, int64_t ts) {
#if ATOM_AVX512_BF16
  if (path == Path::kAvx512Bf16) {
    if (head_dim % 64 == 0) pv_block_heads<Lanes16, 4>(o, rows, head_dim, p, p_stride, vh, n, ts);
    else pv_block_heads<Lanes16, 2>(o, rows, head_dim, p, p_stride, vh, n, ts);  // D % 32 == 0
    return;
  }
#endif
  if (head_dim % 16 == 0) pv_block_heads<Lanes8, 2>(o, rows, head_dim, p, p_stride, vh, n, ts);
  else pv_block_heads<Lanes8, 1>(o, rows, head_dim, p, p_stride, vh, n, ts);
}

#endif  // ATOM_AVX2

// qf = q * scale in float32 over a query row of D elements.
template <typename T>
inline void load_query_row(const T* q, int64_t head_dim, float scale, float* qf) {
  int64_t d = 0;
#if ATOM_AVX2
  const __m256 sv = _mm256_set1_ps(scale);
  for (; d + 8 <= head_dim; d += 8) _mm256_storeu_ps(qf + d, _mm256_mul_ps(load8(q + d), sv));
#endif
  for (; d < head_dim; ++d) qf[d] = static_cast<float>(q[d]) * scale;
}

// The factor that turns a row's unnormalised output o into its attention output: 1 / the
// softmax's denominator, l = sum_t exp(s_t - m) over the row's keys (m: their max), plus
// exp(sink - m) when the row's head has a sink logit (gpt-oss: one learned logit per head in the
// denominator only, so the key weights sum to less than 1). A sink far above m gives 0, the
// limit of the exact value.
inline float softmax_normalizer(float m, float l, const float* sink) {
  return 1.f / (sink == nullptr ? l : l + std::exp(*sink - m));
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

}  // namespace attention_tiles
}  // namespace atom_kernels
