// Linear layers on GGUF's quantized blocks (Q4_1, Q8_0) for small batches: y = x @ W.T with
// W read in its GGUF block layout, never dequantized to memory.
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
// Block layouts (ggml's, read-only here):
//   Q4_1: {fp16 d; fp16 m; uint8 qs[16]}: 20 bytes; w[j] = d * q[j] + m, q[j] = qs[j] & 15,
//         q[j + 16] = qs[j] >> 4 (j < 16).
//   Q8_0: {fp16 d; int8 qs[32]}: 34 bytes; w[j] = d * qs[j].
// Dot products, one block of 32 (a = the activation block: scale da, int8 qa, sa = da * sum qa):
//   Q4_1: d * da * sum(q * qa) + m * sa        Q8_0: d * da * sum(qs * qa)
// The integer sums are exact; only the float accumulation order differs from the torch
// reference in atom.kernels.gguf (which quantizes the activations the same way).

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

// One quantized block of activations: scale d, sum s = d * sum(qs), 32 int8 values.
struct BlockQ8 {
  float d;
  float s;
  int8_t qs[kBlock];
};

inline float fp16_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// x (k floats, k a multiple of 32) -> k / 32 blocks. d = max|x| / 127, q = round(x * (1 / d)),
// rounding to nearest even, as torch.round in the reference.
void quantize_row_q8(const float* x, BlockQ8* out, int64_t k) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    BlockQ8& o = out[b];
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
    o.d = d;
    o.s = d * static_cast<float>(_mm_cvtsi128_si32(s4));
    // int32 -> int8: two packs interleave the 128-bit lanes; the permute restores the order
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]);
    const __m256i p16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.qs), p8);
#else
    float amax = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const int32_t qi = static_cast<int32_t>(std::nearbyint(xb[i] * id));
      o.qs[i] = static_cast<int8_t>(qi);
      sum += qi;
    }
    o.d = d;
    o.s = d * static_cast<float>(sum);
#endif
  }
}

// The dot products of RT consecutive weight rows (nb blocks each, row_bytes apart) with MT
// activation rows, RT = 1..2, MT = 1..4: out[m * out_stride + r] for r < RT, m < MT. One unpack
// of each weight block serves the MT activation rows, one load of each activation block the RT
// weight rows, and the RT * MT accumulators are independent chains (a single chain waits on its
// FMA latency every block).
template <int64_t Type, int RT, int MT>
void dot_rows(const uint8_t* w, int64_t row_bytes, const BlockQ8* const* a, int64_t nb,
              float* out, int64_t out_stride) {
  constexpr int64_t bytes = Type == kGgmlTypeQ4_1 ? 20 : 34;
#if ATOM_AVX2
  __m256 acc[RT][MT];
  float min_sum[RT][MT];
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) {
      acc[r][m] = _mm256_setzero_ps();
      min_sum[r][m] = 0.f;
    }
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i q[RT];
    float d[RT], mn[RT];
    for (int r = 0; r < RT; ++r) {
      const uint8_t* wb = w + r * row_bytes + b * bytes;
      d[r] = fp16_to_float(wb);
      if constexpr (Type == kGgmlTypeQ4_1) {
        mn[r] = fp16_to_float(wb + 2);
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 4));
        const __m128i lo_mask = _mm_set1_epi8(0x0F);
        q[r] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), lo_mask),
                                _mm_and_si128(raw, lo_mask));
      } else {
        q[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 2));
      }
    }
    for (int m = 0; m < MT; ++m) {
      const BlockQ8& ab = a[m][b];
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab.qs));
      for (int r = 0; r < RT; ++r) {
        __m256i p;
        if constexpr (Type == kGgmlTypeQ4_1) {
          p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[r], qa), ones16);
          min_sum[r][m] += mn[r] * ab.s;
        } else {  // signed x signed: |w| times a with w's sign
          p = _mm256_madd_epi16(
              _mm256_maddubs_epi16(_mm256_sign_epi8(q[r], q[r]), _mm256_sign_epi8(qa, q[r])),
              ones16);
        }
        acc[r][m] = _mm256_fmadd_ps(_mm256_set1_ps(d[r] * ab.d), _mm256_cvtepi32_ps(p), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) out[m * out_stride + r] = hsum(acc[r][m]) + min_sum[r][m];
#else
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* wb = w + r * row_bytes + b * bytes;
        const BlockQ8& ab = a[m][b];
        const float d = fp16_to_float(wb);
        int32_t sumi = 0;
        if constexpr (Type == kGgmlTypeQ4_1) {
          const uint8_t* qs = wb + 4;
          for (int64_t j = 0; j < kBlock / 2; ++j)
            sumi += (qs[j] & 15) * ab.qs[j] + (qs[j] >> 4) * ab.qs[j + kBlock / 2];
          total += d * ab.d * static_cast<float>(sumi) + fp16_to_float(wb + 2) * ab.s;
        } else {
          const int8_t* qs = reinterpret_cast<const int8_t*>(wb + 2);
          for (int64_t j = 0; j < kBlock; ++j) sumi += qs[j] * ab.qs[j];
          total += d * ab.d * static_cast<float>(sumi);
        }
      }
      out[m * out_stride + r] = total;
    }
#endif
}

// RT weight rows from wr against every activation row: tiles of 4 activation rows, then 1-3.
template <int64_t Type, int RT>
void rows_against_all(const uint8_t* wr, int64_t row_bytes, const BlockQ8* xq, int64_t rows,
                      int64_t nb, float* out, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) {
    const BlockQ8* a[4] = {xq + m * nb, xq + (m + 1) * nb, xq + (m + 2) * nb, xq + (m + 3) * nb};
    dot_rows<Type, RT, 4>(wr, row_bytes, a, nb, out + m * n, n);
  }
  const BlockQ8* a[3] = {xq + m * nb, xq + (m + 1) * nb, xq + (m + 2) * nb};
  switch (rows - m) {
    case 3: dot_rows<Type, RT, 3>(wr, row_bytes, a, nb, out + m * n, n); break;
    case 2: dot_rows<Type, RT, 2>(wr, row_bytes, a, nb, out + m * n, n); break;
    case 1: dot_rows<Type, RT, 1>(wr, row_bytes, a, nb, out + m * n, n); break;
    default: break;
  }
}

template <int64_t Type>
void gguf_linear_impl(const BlockQ8* xq, int64_t rows, int64_t nb, const uint8_t* w,
                      int64_t row_bytes, int64_t n, float* out) {
  // Output rows (weight rows) split across threads, in pairs; each weight row is read once from
  // memory and serves every activation row while it sits in L1. 16 rows per chunk at least: a
  // small matrix (576 rows) still splits across two threads, and a chunk is a few kB of weights.
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    int64_t r = begin;
    for (; r + 2 <= end; r += 2)
      rows_against_all<Type, 2>(w + r * row_bytes, row_bytes, xq, rows, nb, out + r, n);
    if (r < end) rows_against_all<Type, 1>(w + r * row_bytes, row_bytes, xq, rows, nb, out + r, n);
  });
}

}  // namespace

at::Tensor gguf_linear(at::Tensor x, at::Tensor weight, int64_t ggml_type) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "gguf_linear: x must be a float32 [M, K] tensor with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "gguf_linear: weight must be a contiguous uint8 [N, row_bytes] tensor of blocks");
  TORCH_CHECK(ggml_type == kGgmlTypeQ4_1 || ggml_type == kGgmlTypeQ8_0,
              "gguf_linear: ggml type ", ggml_type, " is not supported (Q4_1 = 3, Q8_0 = 8)");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  const int64_t block_bytes = ggml_type == kGgmlTypeQ4_1 ? 20 : 34;
  TORCH_CHECK(k % kBlock == 0 && weight.size(1) == k / kBlock * block_bytes,
              "gguf_linear: x has ", k, " columns, weight rows have ", weight.size(1),
              " bytes; expected K a multiple of 32 and ", k / kBlock * block_bytes, " bytes");
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const int64_t nb = k / kBlock;
  std::vector<BlockQ8> xq(static_cast<size_t>(rows * nb));
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m) quantize_row_q8(xp + m * x.stride(0), xq.data() + m * nb, k);
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (ggml_type == kGgmlTypeQ4_1)
    gguf_linear_impl<kGgmlTypeQ4_1>(xq.data(), rows, nb, wp, weight.size(1), n, op);
  else
    gguf_linear_impl<kGgmlTypeQ8_0>(xq.data(), rows, nb, wp, weight.size(1), n, op);
  return out;
}

}  // namespace atom_kernels
