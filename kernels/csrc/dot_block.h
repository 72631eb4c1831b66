// The dot-product block of the fused MoE and small-linear kernels: 8 weight rows against 1 or 2
// activation rows over K, the 16 sums in one vector (AVX512-BF16's VDPBF16PS on bf16 pairs, else
// float32 FMAs on 16 lanes, bf16 widened exactly; a scalar loop without AVX-512).
#pragma once

#include <c10/util/BFloat16.h>

#include "vec.h"

#include <cstdint>
#include <type_traits>

namespace atom_kernels {
namespace dot {

using BF16 = c10::BFloat16;

inline float to_f(float v) { return v; }
inline float to_f(BF16 v) { return static_cast<float>(v); }

constexpr int kRows = 8;    // weight rows per block (gate/up: 4 gate + 4 up)
constexpr int kTokens = 2;  // tokens per pass over a block (2 x 8 = 16 accumulators)

// sums[m * 8 + r] = dot(x[m], w[r]) over K, for m < MR (lanes of m >= MR are 0).
template <int MR, typename T>
inline void dot_block(const T* const* x, const T* const* w, int64_t K, float* sums) {
#if ATOM_AVX512
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
#if ATOM_AVX512_BF16
  if constexpr (std::is_same_v<T, BF16>) {  // 32 bf16 a step, VDPBF16PS
    for (; k < K; k += 32) {
      const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
      __m512i xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = _mm512_maskz_loadu_epi16(mask, x[m] + k);
      for (int r = 0; r < kRows; ++r) {
        const __m512i wv = _mm512_maskz_loadu_epi16(mask, w[r] + k);
        for (int m = 0; m < MR; ++m)
          acc[m * kRows + r] = _mm512_dpbf16_ps(acc[m * kRows + r], (__m512bh)xv[m], (__m512bh)wv);
      }
    }
  } else
#endif
  {  // 16 lanes a step: float32, or bf16 widened
    for (; k < K; k += 16) {
      const __mmask16 mask = K - k >= 16 ? ~__mmask16(0) : (__mmask16(1) << (K - k)) - 1;
      __m512 xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = masked_load16(x[m] + k, mask);
      for (int r = 0; r < kRows; ++r) {
        const __m512 wv = masked_load16(w[r] + k, mask);
        for (int m = 0; m < MR; ++m) acc[m * kRows + r] = _mm512_fmadd_ps(xv[m], wv, acc[m * kRows + r]);
      }
    }
  }
  _mm512_storeu_ps(sums, hsum16x16(acc));
#else
  for (int i = 0; i < 16; ++i) sums[i] = 0.f;
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < kRows; ++r) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += to_f(x[m][k]) * to_f(w[r][k]);
      sums[m * kRows + r] = s;
    }
#endif
}

// Runs f(mr, first) over tokens [0, count) of an expert in passes of kTokens (the last may be 1).
template <typename F>
inline void token_passes(int64_t count, F&& f) {
  int64_t m = 0;
  for (; m + kTokens <= count; m += kTokens) f(std::integral_constant<int, kTokens>{}, m);
  if (m < count) f(std::integral_constant<int, 1>{}, m);
}

}  // namespace dot
}  // namespace atom_kernels
