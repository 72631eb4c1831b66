// Linear layers on GGUF's quantized blocks (Q4_1, Q8_0) for small batches: y = x @ W.T with
// W read in its quantized form, never dequantized to memory.
//
// The activations are quantized first, per row and per block of 32 values, to int8 with one
// float scale (and, for Q4_1 weights, the scaled sum of the block's int8 values): the scheme of
// llama.cpp's Q8_1 (ggml-quants.c, quantize_row_q8_1), with float instead of fp16 scales since
// the quantized activations live only for one call. The dot product of a weight block and an
// activation block is then an integer dot product (AVX2 _mm256_maddubs_epi16: 32 u8 x s8
// products summed pairwise into int16, then pairs into int32) times the two scales. Why int8
// activations: a weight block unpacks to 32 small integers in four instructions, but to float
// lanes in twelve, and one maddubs does the work of four float FMAs; a decode step is bound by
// the weight bytes streamed (97 MB a token for SmolLM2-135M's Q4_1 file, against 537 MB in
// float32), so the arithmetic per byte must stay small.
//
// Weight layout: a GGUF block's fields stored as planes, the same bytes as the file's blocks
// (atom.kernels.gguf.QuantizedWeight.from_gguf_blocks; llama.cpp's CPU backend likewise
// repacks blocks at load for its AVX2 / NEON kernels):
//   qs  uint8 [N, nb * 16] (Q4_1: block b's nibbles, q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4)
//       or int8 [N, nb * 32] (Q8_0)
//   d   fp16 [N, nb_pad] (block scales), m fp16 [N, nb_pad] (Q4_1 block minimums); nb_pad =
//       nb rounded up to 8, zeros after nb
//   Q4_1: w[j] = d * q[j] + m        Q8_0: w[j] = d * q[j]
// With the scales in planes, 8 blocks' scales convert (F16C) and multiply by the activation
// scales in three vector instructions, where the block layout needs two scalar conversions and
// a broadcast per block: about 10 instructions a block instead of 19.
// Dot products, one block of 32 (a = the activation block: scale da, int8 qa, sa = da * sum qa):
//   Q4_1: d * da * sum(q * qa) + m * sa        Q8_0: d * da * sum(qs * qa)
// The integer sums are exact; only the float accumulation order differs from the torch
// reference in atom.kernels.gguf (which quantizes the activations the same way).
//
// Paths, chosen at build time (-march=native): AVX-512 with VNNI (two blocks a 512-bit register,
// one VPDPBUSD for the 64 u8 x s8 products, no int16 intermediate), AVX2 (one block a 256-bit
// register, VPMADDUBSW + VPMADDWD), and scalar. scripts/bench_gguf_linear.py times the first
// against the second on a CPU that has both.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace atom_kernels {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGgmlTypeQ4_1 = 3;  // ggml_type enum values (gguf.GGMLQuantizationType)
constexpr int64_t kGgmlTypeQ8_0 = 8;

inline int64_t padded_blocks(int64_t nb) { return (nb + 7) / 8 * 8; }

// Quantized activations of M rows as planes: qs int8 [M, nb * 32], d and s float [M, nb_pad]
// (s = d * sum(qs) per block; zeros after nb).
struct QuantizedRows {
  std::vector<int8_t> qs;
  std::vector<float> d, s;
};

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// x (k floats, k a multiple of 32) -> k / 32 blocks. d = max|x| / 127, q = round(x * (1 / d)),
// rounding to nearest even, as torch.round in the reference.
void quantize_row_q8(const float* x, int8_t* qs, float* ds, float* ss, int64_t k) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
#if ATOM_AVX2
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
    }
    const float d = hmax(amax) / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vid),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    ds[b] = d;
    ss[b] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
    // int32 -> int8: two packs interleave the 128-bit lanes; the permute restores the order
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]);
    const __m256i p16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + b * kBlock), p8);
#else
    float amax = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const int32_t qi = static_cast<int32_t>(std::nearbyint(xb[i] * id));
      qs[b * kBlock + i] = static_cast<int8_t>(qi);
      sum += qi;
    }
    ds[b] = d;
    ss[b] = d * static_cast<float>(sum);
#endif
  }
}

QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), nb = k / kBlock, nbp = padded_blocks(nb);
  QuantizedRows a;
  a.qs.resize(static_cast<size_t>(rows * k));
  a.d.assign(static_cast<size_t>(rows * nbp), 0.f);
  a.s.assign(static_cast<size_t>(rows * nbp), 0.f);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m)
    quantize_row_q8(xp + m * x.stride(0), a.qs.data() + m * k, a.d.data() + m * nbp,
                    a.s.data() + m * nbp, k);
  return a;
}

// One weight row against MT activation rows (MT = 1..4): out[m * out_stride] for m < MT.
// qs: the row's quants; d, mn: its scale / minimum planes (nb_pad entries); a_*: activation
// planes of the MT rows (a_qs rows k apart, a_d / a_s rows nbp apart).
template <int64_t Type, int MT>
void dot_row(const uint8_t* qs, const uint16_t* d, const uint16_t* mn, const int8_t* a_qs,
             const float* a_d, const float* a_s, int64_t nb, int64_t k, int64_t nbp, float* out,
             int64_t out_stride) {
  constexpr int64_t qbytes = Type == kGgmlTypeQ4_1 ? 16 : 32;
#if ATOM_AVX512_VNNI
  // Two blocks a zmm: weights [block b: 32 values, block b + 1: 32 values] against the
  // activations' 64 bytes in their natural order; one VPDPBUSD sums 4 u8 x s8 products per int32
  // lane (lanes 0-7: block b, 8-15: block b + 1). Each lane is scaled by its block's d * da
  // (a permute of the group's 8 scales) and accumulated in float. An odd last block loads
  // half: the other half's weights and activations are zero.
  __m512 acc[MT];
  __m256 min_acc[MT];
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm512_setzero_ps();
    min_acc[m] = _mm256_setzero_ps();
  }
  const __m512i lo_mask = _mm512_set1_epi8(0x0F);
  const __m512i pair_lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t g = 0; g < nb; g += 8) {
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g)));
    __m512 sd[MT];  // d * da of the group's 8 blocks in the low 8 lanes, per activation row
    for (int m = 0; m < MT; ++m)
      sd[m] = _mm512_castps256_ps512(_mm256_mul_ps(dv, _mm256_loadu_ps(a_d + m * nbp + g)));
    if constexpr (Type == kGgmlTypeQ4_1) {
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + g)));
      for (int m = 0; m < MT; ++m)
        min_acc[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(a_s + m * nbp + g), min_acc[m]);
    }
    const int64_t n = std::min<int64_t>(8, nb - g);
    for (int64_t j = 0; j < n; j += 2) {
      const int64_t b = g + j;
      const bool both = j + 1 < n;
      const __mmask64 act_mask = both ? ~0ULL : 0xFFFFFFFFULL;
      __m512i w;            // the u8 operand of VPDPBUSD
      __mmask64 w_neg = 0;  // Q8_0 (signed x signed): |w| against a with w's sign (-128 -> 128)
      if constexpr (Type == kGgmlTypeQ4_1) {
        // raw = [b's 16 bytes, b + 1's 16 bytes] -> 128-bit lanes [b, b, b + 1, b + 1]; lanes 1
        // and 3 take the high nibbles (values 16-31)
        const __m256i raw = _mm256_maskz_loadu_epi8(both ? 0xFFFFFFFFu : 0xFFFFu, qs + b * qbytes);
        const __m512i wide = _mm512_castsi256_si512(raw);
        w = _mm512_shuffle_i64x2(wide, wide, _MM_SHUFFLE(1, 1, 0, 0));
        w = _mm512_and_si512(_mm512_mask_srli_epi16(w, 0xFF00FF00u, w, 4), lo_mask);
      } else {
        const __m512i raw = _mm512_maskz_loadu_epi8(act_mask, qs + b * qbytes);
        w = _mm512_abs_epi8(raw);
        w_neg = _mm512_movepi8_mask(raw);
      }
      const __m512i idx = _mm512_add_epi32(pair_lanes, _mm512_set1_epi32(static_cast<int>(j)));
      for (int m = 0; m < MT; ++m) {
        __m512i qa = _mm512_maskz_loadu_epi8(act_mask, a_qs + m * k + b * kBlock);
        if constexpr (Type == kGgmlTypeQ8_0) qa = _mm512_mask_sub_epi8(qa, w_neg, _mm512_setzero_si512(), qa);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, qa);
        acc[m] = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, sd[m]), _mm512_cvtepi32_ps(p), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) out[m * out_stride] = _mm512_reduce_add_ps(acc[m]) + hsum(min_acc[m]);
#elif ATOM_AVX2
  __m256 acc[MT], min_acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = min_acc[m] = _mm256_setzero_ps();
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m128i lo_mask = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < nb; g += 8) {
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g)));
    __m256 sd[MT];  // d * da of the group's 8 blocks, per activation row
    for (int m = 0; m < MT; ++m) sd[m] = _mm256_mul_ps(dv, _mm256_loadu_ps(a_d + m * nbp + g));
    if constexpr (Type == kGgmlTypeQ4_1) {
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + g)));
      for (int m = 0; m < MT; ++m)
        min_acc[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(a_s + m * nbp + g), min_acc[m]);
    }
    const int64_t n = std::min<int64_t>(8, nb - g);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t b = g + j;
      __m256i q;
      if constexpr (Type == kGgmlTypeQ4_1) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * qbytes));
        q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), lo_mask),
                             _mm_and_si128(raw, lo_mask));
      } else {
        q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + b * qbytes));
      }
      const __m256i lane = _mm256_set1_epi32(static_cast<int>(j));
      for (int m = 0; m < MT; ++m) {
        const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a_qs + m * k + b * kBlock));
        __m256i p;
        if constexpr (Type == kGgmlTypeQ4_1)
          p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, qa), ones16);
        else  // signed x signed: |w| times a with w's sign
          p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(qa, q)),
                                ones16);
        acc[m] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sd[m], lane), _mm256_cvtepi32_ps(p), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) out[m * out_stride] = hsum(acc[m]) + hsum(min_acc[m]);
#else
  for (int m = 0; m < MT; ++m) {
    float total = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* qa = a_qs + m * k + b * kBlock;
      int32_t sumi = 0;
      if constexpr (Type == kGgmlTypeQ4_1) {
        const uint8_t* qb = qs + b * qbytes;
        for (int64_t j = 0; j < kBlock / 2; ++j)
          sumi += (qb[j] & 15) * qa[j] + (qb[j] >> 4) * qa[j + kBlock / 2];
        total += half_to_float(d[b]) * a_d[m * nbp + b] * static_cast<float>(sumi) +
                 half_to_float(mn[b]) * a_s[m * nbp + b];
      } else {
        const int8_t* qb = reinterpret_cast<const int8_t*>(qs + b * qbytes);
        for (int64_t j = 0; j < kBlock; ++j) sumi += qb[j] * qa[j];
        total += half_to_float(d[b]) * a_d[m * nbp + b] * static_cast<float>(sumi);
      }
    }
    out[m * out_stride] = total;
  }
#endif
}

// Software prefetch distance in weight rows: while a thread computes row r it asks for the
// cache lines of row r + kPrefetchRows (quants, scales, minimums: 2-6 kB ahead for these
// shapes). With the hardware prefetcher alone a decode step's linears were 1.16-1.19x slower
// (docs/PERFORMANCE.md): each thread's share of a small matrix is a few tens of kB, too short
// a stream for the prefetcher to ramp up to the memory's bandwidth.
#ifndef ATOM_PREFETCH_ROWS
#define ATOM_PREFETCH_ROWS 8
#endif
constexpr int64_t kPrefetchRows = ATOM_PREFETCH_ROWS;

template <int64_t Type>
void gguf_linear_impl(const QuantizedRows& a, int64_t rows, int64_t k, const uint8_t* qs,
                      const uint16_t* d, const uint16_t* mn, int64_t n, float* out) {
  constexpr int64_t qbytes = Type == kGgmlTypeQ4_1 ? 16 : 32;
  const int64_t nb = k / kBlock, nbp = padded_blocks(nb);
  // Output rows (weight rows) split across threads; each weight row is read once from memory and
  // serves every activation row while it sits in L1. 16 rows per chunk at least: a small matrix
  // (576 rows) still splits across two threads, and a chunk is a few kB of weights.
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (kPrefetchRows > 0 && r + kPrefetchRows < end) {
        const int64_t p = r + kPrefetchRows;
        const char* pq = reinterpret_cast<const char*>(qs + p * nb * qbytes);
        for (int64_t o = 0; o < nb * qbytes; o += 64) _mm_prefetch(pq + o, _MM_HINT_T0);
        for (int64_t o = 0; o < nbp * 2; o += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(d + p * nbp) + o, _MM_HINT_T0);
          if (mn != nullptr) _mm_prefetch(reinterpret_cast<const char*>(mn + p * nbp) + o, _MM_HINT_T0);
        }
      }
      const uint8_t* wq = qs + r * nb * qbytes;
      const uint16_t* wd = d + r * nbp;
      const uint16_t* wm = mn == nullptr ? nullptr : mn + r * nbp;
      int64_t m = 0;
      for (; m + 4 <= rows; m += 4)
        dot_row<Type, 4>(wq, wd, wm, a.qs.data() + m * k, a.d.data() + m * nbp,
                         a.s.data() + m * nbp, nb, k, nbp, out + m * n + r, n);
      const int8_t* aq = a.qs.data() + m * k;
      const float* ad = a.d.data() + m * nbp;
      const float* as = a.s.data() + m * nbp;
      switch (rows - m) {
        case 3: dot_row<Type, 3>(wq, wd, wm, aq, ad, as, nb, k, nbp, out + m * n + r, n); break;
        case 2: dot_row<Type, 2>(wq, wd, wm, aq, ad, as, nb, k, nbp, out + m * n + r, n); break;
        case 1: dot_row<Type, 1>(wq, wd, wm, aq, ad, as, nb, k, nbp, out + m * n + r, n); break;
        default: break;
      }
    }
  });
}

// ----- the tiled GEMM: 16 weight rows a zmm (AVX-512 VNNI CPUs: every row count) -----
//
// Weight layout (atom.kernels.gguf.TiledWeight, repacked once at load): the output rows in tiles
// of 16 (the last tile padded with zero rows), per tile and block the quants of the 16 rows
// interleaved by 4 bytes: wq uint8 [T, nb * Q * 64], Q = 4 (Q4_1) or 8 (Q8_0) vectors a block,
// vector p = [row 0 bytes 4p..4p+3, row 1 bytes 4p..4p+3, ..., row 15]; Q8_0's int8 quants
// stored as u8 (q + 128). wd fp16 [T, nb, 16]: the 16 rows' block scales; wm fp16 [T, nb, 16]:
// Q4_1's block minimums (empty for Q8_0). The same bytes as the planes: a decode step streams
// the whole model from memory, so every byte counts (float32 scales made Q4_1 20 % larger).
// Per block and activation row, eight VPDPBUSD take the activation's 4-byte groups as broadcast
// dwords against the vectors and leave the 16 rows' integer block sums in one register; one
// conversion and one FMA scale them (d * da: a vector of 16 row scales times one activation
// scale). The row kernel instead spends a permute, a conversion and an FMA on every two blocks of
// every (weight row, activation row) pair; here they are shared by 16 weight rows, which makes
// it faster than the float GEMM at every row count measured (1-2,048; docs/PERFORMANCE.md) and
// than the row kernel at one row. The idea of interleaving rows' blocks is llama.cpp's
// repacked CPU layouts (ggml-cpu/repack.cpp, block_q4_0x8).
// Q4_1: vector p's low nibbles are elements 4p..4p+3, its high nibbles 16+4p..16+4p+3, so the 8
// operands pair with the activation's dwords 0-7 in order. Q8_0: sum((q + 128) * a) - 128 * sum(a)
// in int32 is the exact sum(q * a).
constexpr int64_t kTile = 16;

#if ATOM_AVX512_VNNI
template <int64_t Type, int MR>
void gemm_tile(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, const int8_t* a_qs,
               const float* a_d, const float* a_s, const int32_t* a_sum, int64_t nb, int64_t k,
               int64_t nbp, float* out, int64_t out_stride, __mmask16 col_mask,
               const uint8_t* next_wq) {
  constexpr int64_t vecs = Type == kGgmlTypeQ4_1 ? 4 : 8;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i lo_mask = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = wq + b * vecs * 64;
    if (next_wq != nullptr)  // the next tile's block b: the memory stream stays ahead
      for (int64_t o = 0; o < vecs * 64; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next_wq + b * vecs * 64 + o), _MM_HINT_T0);
    __m512i w[8];
    if constexpr (Type == kGgmlTypeQ4_1) {
      for (int p = 0; p < 4; ++p) {
        const __m512i raw = _mm512_loadu_si512(wb + p * 64);
        w[p] = _mm512_and_si512(raw, lo_mask);
        w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo_mask);
      }
    } else {
      for (int p = 0; p < 8; ++p) w[p] = _mm512_loadu_si512(wb + p * 64);
    }
    __m512i sum[MR];
    for (int m = 0; m < MR; ++m) sum[m] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p)
      for (int m = 0; m < MR; ++m) {
        int32_t group;
        std::memcpy(&group, a_qs + m * k + b * kBlock + p * 4, 4);
        sum[m] = _mm512_dpbusd_epi32(sum[m], w[p], _mm512_set1_epi32(group));
      }
    const __m512 dv =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wd + b * kTile)));
    if constexpr (Type == kGgmlTypeQ4_1) {
      const __m512 mv =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wm + b * kTile)));
      for (int m = 0; m < MR; ++m) {
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m]),
                                 _mm512_mul_ps(dv, _mm512_set1_ps(a_d[m * nbp + b])), acc[m]);
        acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a_s[m * nbp + b]), acc[m]);
      }
    } else {
      for (int m = 0; m < MR; ++m) {
        const __m512i exact =
            _mm512_sub_epi32(sum[m], _mm512_set1_epi32(128 * a_sum[m * nbp + b]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact),
                                 _mm512_mul_ps(dv, _mm512_set1_ps(a_d[m * nbp + b])), acc[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(out + m * out_stride, col_mask, acc[m]);
}
#else
// Scalar: the same sums, lane by lane (CPUs without AVX-512 VNNI; atom.kernels.gguf does not
// repack there, so this serves the tests).
template <int64_t Type, int MR>
void gemm_tile(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, const int8_t* a_qs,
               const float* a_d, const float* a_s, const int32_t* a_sum, int64_t nb, int64_t k,
               int64_t nbp, float* out, int64_t out_stride, uint32_t col_mask,
               const uint8_t* /*next_wq*/) {
  constexpr int64_t vecs = Type == kGgmlTypeQ4_1 ? 4 : 8;
  for (int m = 0; m < MR; ++m)
    for (int64_t r = 0; r < kTile; ++r) {
      if (!((col_mask >> r) & 1u)) continue;
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* wb = wq + b * vecs * 64;
        const int8_t* qa = a_qs + m * k + b * kBlock;
        int32_t s = 0;
        for (int64_t p = 0; p < 8; ++p)
          for (int64_t c = 0; c < 4; ++c) {
            const int32_t w =
                Type == kGgmlTypeQ4_1
                    ? (p < 4 ? wb[p * 64 + r * 4 + c] & 15 : wb[(p - 4) * 64 + r * 4 + c] >> 4)
                    : wb[p * 64 + r * 4 + c];
            s += w * qa[p * 4 + c];
          }
        if constexpr (Type == kGgmlTypeQ8_0) s -= 128 * a_sum[m * nbp + b];
        total += half_to_float(wd[b * kTile + r]) * a_d[m * nbp + b] * static_cast<float>(s);
        if constexpr (Type == kGgmlTypeQ4_1)
          total += half_to_float(wm[b * kTile + r]) * a_s[m * nbp + b];
      }
      out[m * out_stride + r] = total;
    }
}
#endif

// Up to this many activation rows share one pass over a tile's weights (registers: MR sums, MR
// accumulators and the 8 weight operands of a block).
constexpr int kMaxTileRows = 8;

template <int64_t Type>
void gguf_gemm_tiled_impl(const QuantizedRows& a, const std::vector<int32_t>& a_sum, int64_t rows,
                          int64_t k, const uint8_t* wq, const uint16_t* wd, const uint16_t* wm,
                          int64_t n, float* out) {
  constexpr int64_t vecs = Type == kGgmlTypeQ4_1 ? 4 : 8;
  const int64_t nb = k / kBlock, nbp = padded_blocks(nb), tiles = (n + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tq = wq + t * nb * vecs * 64;
      const uint16_t* td = wd + t * nb * kTile;
      const uint16_t* tm = wm == nullptr ? nullptr : wm + t * nb * kTile;
      const uint8_t* next_q = t + 1 < end ? tq + nb * vecs * 64 : nullptr;
      const int64_t cols = std::min<int64_t>(kTile, n - t * kTile);
      const auto mask = static_cast<uint16_t>((1u << cols) - 1u);
      for (int64_t m = 0; m < rows; m += kMaxTileRows) {
        const int8_t* aq = a.qs.data() + m * k;
        const float* ad = a.d.data() + m * nbp;
        const float* as = a.s.data() + m * nbp;
        const int32_t* asum = a_sum.data() + m * nbp;
        float* o = out + m * n + t * kTile;
        switch (std::min<int64_t>(kMaxTileRows, rows - m)) {
#define ATOM_TILE_CASE(R) \
  case R:                                                                         \
    gemm_tile<Type, R>(tq, td, tm, aq, ad, as, asum, nb, k, nbp, o, n, mask,      \
                       m == 0 ? next_q : nullptr);                                \
    break;
          ATOM_TILE_CASE(8) ATOM_TILE_CASE(7) ATOM_TILE_CASE(6) ATOM_TILE_CASE(5)
          ATOM_TILE_CASE(4) ATOM_TILE_CASE(3) ATOM_TILE_CASE(2) ATOM_TILE_CASE(1)
#undef ATOM_TILE_CASE
          default: break;
        }
      }
    }
  });
}

}  // namespace

at::Tensor gguf_linear(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m,
                       int64_t ggml_type) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "gguf_linear: x must be a float32 [M, K] tensor with contiguous rows");
  TORCH_CHECK(ggml_type == kGgmlTypeQ4_1 || ggml_type == kGgmlTypeQ8_0,
              "gguf_linear: ggml type ", ggml_type, " is not supported (Q4_1 = 3, Q8_0 = 8)");
  const int64_t rows = x.size(0), k = x.size(1), n = qs.size(0);
  const int64_t nb = k / kBlock, qbytes = ggml_type == kGgmlTypeQ4_1 ? 16 : 32;
  TORCH_CHECK(k % kBlock == 0 && qs.dim() == 2 && qs.size(1) == nb * qbytes,
              "gguf_linear: x has ", k, " columns, the weight's quants ", qs.size(1),
              " bytes a row; expected K a multiple of 32 and ", nb * qbytes, " bytes");
  TORCH_CHECK(qs.is_contiguous() && (qs.scalar_type() == at::kByte || qs.scalar_type() == at::kChar),
              "gguf_linear: quants must be a contiguous uint8 / int8 [N, nb * bytes] tensor");
  const bool has_min = ggml_type == kGgmlTypeQ4_1;
  for (const at::Tensor* t : {&d, has_min ? &m : &d})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == n && t->size(1) == padded_blocks(nb),
                "gguf_linear: scales / minimums must be contiguous float16 [N, ",
                padded_blocks(nb), "] (blocks rounded up to 8)");
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const QuantizedRows a = quantize_rows(x);
  const auto* qp = static_cast<const uint8_t*>(qs.data_ptr());
  const auto* dp = static_cast<const uint16_t*>(d.data_ptr());
  float* op = out.data_ptr<float>();
  if (has_min)
    gguf_linear_impl<kGgmlTypeQ4_1>(a, rows, k, qp, dp, static_cast<const uint16_t*>(m.data_ptr()),
                                    n, op);
  else
    gguf_linear_impl<kGgmlTypeQ8_0>(a, rows, k, qp, dp, nullptr, n, op);
  return out;
}

at::Tensor gguf_gemm_tiled(at::Tensor x, at::Tensor wq, at::Tensor wd, at::Tensor wm,
                           int64_t ggml_type, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "gguf_gemm_tiled: x must be a float32 [M, K] tensor with contiguous rows");
  TORCH_CHECK(ggml_type == kGgmlTypeQ4_1 || ggml_type == kGgmlTypeQ8_0,
              "gguf_gemm_tiled: ggml type ", ggml_type, " is not supported (Q4_1 = 3, Q8_0 = 8)");
  const int64_t rows = x.size(0), k = x.size(1), nb = k / kBlock;
  const int64_t vecs = ggml_type == kGgmlTypeQ4_1 ? 4 : 8, tiles = (n + kTile - 1) / kTile;
  const bool has_min = ggml_type == kGgmlTypeQ4_1;
  TORCH_CHECK(k % kBlock == 0 && wq.is_contiguous() && wq.scalar_type() == at::kByte &&
                  wq.dim() == 2 && wq.size(0) == tiles && wq.size(1) == nb * vecs * 64,
              "gguf_gemm_tiled: expected K a multiple of 32 and uint8 tiles [", tiles, ", ",
              nb * vecs * 64, "], got K = ", k, " and ", wq.sizes());
  for (const at::Tensor* t : {&wd, has_min ? &wm : &wd})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == tiles && t->size(1) == nb && t->size(2) == kTile,
                "gguf_gemm_tiled: scales / minimums must be contiguous float16 [", tiles, ", ",
                nb, ", 16]");
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const QuantizedRows a = quantize_rows(x);
  const int64_t nbp = padded_blocks(nb);
  std::vector<int32_t> a_sum(static_cast<size_t>(rows * nbp), 0);  // Q8_0's correction
  if (!has_min)
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        int32_t s = 0;
        for (int64_t j = 0; j < kBlock; ++j) s += a.qs[m * k + b * kBlock + j];
        a_sum[m * nbp + b] = s;
      }
  const auto* qp = static_cast<const uint8_t*>(wq.data_ptr());
  float* op = out.data_ptr<float>();
  if (has_min)
    gguf_gemm_tiled_impl<kGgmlTypeQ4_1>(a, a_sum, rows, k, qp,
                                        static_cast<const uint16_t*>(wd.data_ptr()),
                                        static_cast<const uint16_t*>(wm.data_ptr()), n, op);
  else
    gguf_gemm_tiled_impl<kGgmlTypeQ8_0>(a, a_sum, rows, k, qp,
                                        static_cast<const uint16_t*>(wd.data_ptr()), nullptr, n,
                                        op);
  return out;
}

bool gguf_gemm_tiled_is_simd() { return ATOM_AVX512_VNNI; }

}  // namespace atom_kernels
