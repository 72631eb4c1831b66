// Shared helpers of atom's CPU kernels: AVX2 loads, horizontal reductions, a vectorised exp.
// ATOM_AVX2 is 1 when the build machine has AVX2 and FMA (-march=native), else 0 and callers
// take their scalar loops.
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

namespace atom_kernels {

#if ATOM_AVX2

// 8 consecutive elements as float32 lanes.
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

}  // namespace atom_kernels

