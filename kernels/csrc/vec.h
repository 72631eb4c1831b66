// Shared helpers of atom's CPU kernels: AVX2 / AVX-512 loads and stores of float32 and bfloat16
// lanes, horizontal reductions, a vectorised exp. ATOM_AVX2 is 1 when the build machine has AVX2
// and FMA (-march=native), else 0 and callers take their scalar loops.
//
// bfloat16 is the high half of a float32: a load shifts the 16 bits up (exact); a store rounds
// to nearest even as c10::BFloat16(float) does (a NaN becomes 0x7FC0), with one instruction
// (VCVTNEPS2BF16) where the CPU has AVX512-BF16 and integer arithmetic elsewhere.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#define ATOM_AVX2 1
#else
#define ATOM_AVX2 0
#endif

// ATOM_AVX512_VNNI is 1 when the build machine also has AVX-512 F/BW/VL and VNNI (VPDPBUSD):
// kernels with a 512-bit path take it, the rest keep their AVX2 one.
#if ATOM_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define ATOM_AVX512_VNNI 1
#else
#define ATOM_AVX512_VNNI 0
#endif

// ATOM_AVX512 is 1 with AVX-512 F/BW/VL (512-bit float32 lanes, bf16 loads by shifting);
// ATOM_AVX512_BF16 is 1 when the CPU also has AVX512-BF16 (VDPBF16PS dot products of bf16 pairs
// into float32, VCVTNEPS2BF16 rounding). Zen 4/5 and Sapphire Rapids have both; AVX2-only parts
// (Zen 3) neither.
#if ATOM_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ATOM_AVX512 1
#else
#define ATOM_AVX512 0
#endif
#if ATOM_AVX512 && defined(__AVX512BF16__)
#define ATOM_AVX512_BF16 1
#else
#define ATOM_AVX512_BF16 0
#endif

namespace atom_kernels {

#if ATOM_AVX2

// 8 consecutive elements as float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32: the 16 bits become the high half
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The bf16 bits of 8 float32 lanes (in the low half of each 32-bit lane), rounded to nearest
// even; a NaN becomes 0x7FC0 (c10::BFloat16's rounding).
inline __m256i bf16_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
}

// 8 float32 lanes rounded to bfloat16 precision, still as float32 (what a bf16 store and a load
// back would give).
inline __m256 round_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}

// 8 consecutive elements from float32 lanes (bf16: rounded to nearest even).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
#if ATOM_AVX512_BF16
  const __m128bh h = _mm256_cvtneps_pbh(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), reinterpret_cast<const __m128i&>(h));
#else
  // pack the 32-bit lanes to 16 bits: packus works per 128-bit half, the permute joins them
  const __m256i r = bf16_bits(v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

// The horizontal sums of four vectors, as one 4-lane vector [sum a, sum b, sum c, sum d].
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// e^x, 8 lanes, relative error about 2e-7 (1-2 ulp): x = n ln2 + r with |r| <= ln2 / 2, a
// degree-7 Taylor polynomial for e^r, 2^n built in the exponent bits. Inputs are clamped to
// [-87, 88] so 2^n stays a normal float; softmax only passes x <= 0, where e^-87 ~ 0.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2, high bits
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-6f), r);   // ln2, the rest
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

#endif  // ATOM_AVX2

#if ATOM_AVX512

// 16 consecutive elements as float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The first elements of 16 set in mask (the others 0), as float32 lanes; reads only those.
inline __m512 masked_load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 masked_load16(const c10::BFloat16* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 consecutive elements from float32 lanes (bf16: rounded to nearest even, as store8).
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
#if ATOM_AVX512_BF16
  const __m256bh h = _mm512_cvtneps_pbh(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(h));
#else
  store8(p, _mm512_castps512_ps256(v));
  store8(p + 8, _mm512_extractf32x8_ps(v, 1));
#endif
}

// 1 / d, 16 lanes: the 14-bit estimate and one Newton step (about 1 ulp of float32).
inline __m512 reciprocal16(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}

// e^x, 16 lanes: exp256's method and constants (the same value in every lane).
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// The sums of the 16 lanes of each of a[0..15], as one vector [sum a[0], ..., sum a[15]]:
// pairs of vectors are interleaved and added, halving the vectors and doubling the sums each
// holds, four times (45 shuffles and adds instead of 16 full horizontal sums).
inline __m512 hsum16x16(const __m512* a) {
  __m512 x[8], z[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a2i 0+2, a2i+1 0+2, a2i 1+3, a2i+1 1+3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: partial sums of a4i .. a4i+3
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
    z[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // 128-bit lanes L0..L3 of z: add L0 + L2 and L1 + L3, then the two halves
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x44),
                                   _mm512_shuffle_f32x4(z[0], z[1], 0xEE));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x44),
                                   _mm512_shuffle_f32x4(z[2], z[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}

#endif  // ATOM_AVX512

}  // namespace atom_kernels

