// Prefill attention straight from the paged KV cache (CPU), for atom.kernels.attention: every
// new token of a sequence attends causally to its sequence's KV up to its own position (earlier
// prefill chunks and prefix-cached blocks included; with a sliding window W only its last W
// positions), read block by block through the block table; the step's new K/V are in the cache
// already. One call covers all the prefill sequences of a step, so no context is gathered and no
// per-sequence SDPA is dispatched.
//
// Work items are (sequence, KV head, tile of up to 16 consecutive new tokens), run with
// at::parallel_for. An item's rows are its tokens x the G = H / H_kv query heads of its KV head;
// it walks the key blocks from its first token's window start (0 without a window) to its last
// token's position once, keeping per row the running max m, sum l and unnormalised output o (the
// online softmax of FlashAttention, Dao et al. 2022, arXiv:2205.14135): for each block, scores
// by the tiles of attention_tiles.h, keys outside a row's range dropped (past its position: the
// causal mask, only in the tile's last blocks; before its window: only in its first ones), o and
// l rescaled by exp(m_old - m_new), then o += p v; a head's sink logit joins l at the end.
// Everything accumulates in float32 (p too, where torch's flash attention rounds p to bf16 for
// its bf16 GEMM); the output is rounded to q's dtype once.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "attention_options.h"
#include "attention_tiles.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace atom_kernels {
namespace {

using namespace attention_tiles;

constexpr int64_t kTokensPerItem = 16;

// One call: q and out [T, H, D] (strided rows and heads, contiguous D), caches [num_blocks,
// block_size, H_kv, D] contiguous; per prefill sequence i its block table row, context length
// and the rows [query_start_loc[i], query_start_loc[i + 1]) of its new tokens, which sit at
// positions [context_len - query_len, context_len).
template <typename T>
struct Prefill {
  const T* q;
  T* out;
  const T* k_cache;
  const T* v_cache;
  const int64_t* block_tables;
  const int64_t* context_lens;
  const int64_t* query_start_loc;
  int64_t q_row_stride, q_head_stride, out_row_stride, out_head_stride;
  int64_t head_dim, group, block_size, table_stride, token_stride, block_stride;
  float scale;
  const float* sinks;      // [H] one logit per query head, or nullptr
  int64_t sliding_window;  // a query sees its last this many positions; 0 = all
};

// An item: new tokens [first, first + num) of sequence s (token indices within the sequence's
// new tokens), against KV head h.
struct Tile {
  int64_t s, first, num, h;
};

template <typename T>
struct TileScratch {
  std::vector<float> qf;  // [rows, D] the rows' queries, float32, times scale
  std::vector<const T*> q;  // [rows] the rows in q (VDPBF16PS reads bf16 as is)
  std::vector<float> s;   // [rows, block_size] one block's scores, then probabilities
  std::vector<float> o;   // [rows, D] unnormalised output
  std::vector<float> m, l;
  std::vector<T> pad;     // [16, D] a partial tile of K, zero-padded
};

// Row r of a tile is token first + r / G and query head h * G + r % G.
template <typename T>
void load_tile(const Prefill<T>& P, const Tile& tile, TileScratch<T>& w) {
  const int64_t G = P.group, D = P.head_dim, rows = tile.num * G;
  w.qf.resize(rows * D);
  w.q.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    w.q[r] = P.q + (P.query_start_loc[tile.s] + tile.first + r / G) * P.q_row_stride +
             (tile.h * G + r % G) * P.q_head_stride;
    load_query_row(w.q[r], D, P.scale, w.qf.data() + r * D);
  }
  w.s.resize(rows * P.block_size);
  w.o.assign(rows * D, 0.f);
  w.m.assign(rows, -std::numeric_limits<float>::infinity());
  w.l.assign(rows, 0.f);
  w.pad.resize(16 * D);
}

// The scores of every row against the n keys kh + i * token_stride into w.s (row stride
// block_size).
template <typename T>
void score_rows(const Prefill<T>& P, Path path, const T* kh, int64_t n, int64_t rows,
                TileScratch<T>& w) {
  const int64_t D = P.head_dim, bs = P.block_size;
  if (path == Path::kScalar) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i) {
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d)
          dot += w.qf[r * D + d] * static_cast<float>(kh[i * P.token_stride + d]);
        w.s[r * bs + i] = dot;
      }
    return;
  }
#if ATOM_AVX2
  for (int64_t r = 0; r < rows; ++r)
    score_row(path, w.s.data() + r * bs, w.qf.data() + r * D, w.q[r], kh, n, P.token_stride, D,
              P.scale, w.pad.data());
#endif
}

// o[r] += sum_i p[r][i] v_i over the n values vh + i * token_stride.
template <typename T>
void add_values(const Prefill<T>& P, Path path, const T* vh, int64_t n, int64_t rows,
                TileScratch<T>& w) {
  const int64_t D = P.head_dim, bs = P.block_size;
  if (path == Path::kScalar) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < D; ++d)
          w.o[r * D + d] += w.s[r * bs + i] * static_cast<float>(vh[i * P.token_stride + d]);
    return;
  }
#if ATOM_AVX2
  pv_rows(path, w.o.data(), rows, D, w.s.data(), bs, vh, n, P.token_stride);
#endif
}

// One row's step of the online softmax over a block: of its n scores s[0, n) those in
// [lo, hi) count (before lo: keys before its window; from hi on: keys after its token), with
// 0 <= lo < hi <= n. In place p[i] = exp(s[i] - m_new), 0 for the rest; returns
// m_new = max(m_old, max s[lo, hi)) and sets *sum = sum p.
inline float exp_row(float* s, int64_t n, int64_t lo, int64_t hi, float m_old, float* sum) {
#if ATOM_AVX512
  if (n <= 16) {  // one register; masked-off lanes (dropped keys, lanes past n) become 0
    const __mmask16 keep = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
    const __m512 sv = _mm512_maskz_loadu_ps(keep, s);
    const float m_new = std::max(m_old, _mm512_mask_reduce_max_ps(keep, sv));
    const __m512 e = _mm512_maskz_mov_ps(keep, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
    _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << n) - 1), e);
    *sum = _mm512_reduce_add_ps(e);
    return m_new;
  }
#endif
  std::fill(s, s + lo, 0.f);
  std::fill(s + hi, s + n, 0.f);
#if ATOM_AVX2
  const float m_new = std::max(m_old, max_of(s + lo, hi - lo));
  *sum = exp_minus(s + lo, hi - lo, m_new);
#else
  float m_new = m_old;
  for (int64_t i = lo; i < hi; ++i) m_new = std::max(m_new, s[i]);
  *sum = 0.f;
  for (int64_t i = lo; i < hi; ++i) { s[i] = std::exp(s[i] - m_new); *sum += s[i]; }
#endif
  return m_new;
}

// Online softmax over n keys starting at position t0 (within one block): row r (position
// p = pos0 + r / G) keeps the keys t0 + i in [first_visible_key(p), p]; its scores become
// probabilities (0 for dropped keys), its o and l are rescaled to the new running max.
template <typename T>
void softmax_block(const Prefill<T>& P, int64_t t0, int64_t n, int64_t pos0, int64_t rows,
                   TileScratch<T>& w) {
  const int64_t G = P.group, D = P.head_dim, bs = P.block_size;
  for (int64_t r = 0; r < rows; ++r) {
    float* s = w.s.data() + r * bs;
    const int64_t pos = pos0 + r / G;
    const int64_t lo = std::max<int64_t>(0, first_visible_key(pos, P.sliding_window) - t0);
    const int64_t hi = std::min(n, pos - t0 + 1);
    if (hi <= lo) {  // every key here is after this row's token or before its window
      std::fill(s, s + n, 0.f);
      continue;
    }
    float sum;
    const float m_new = exp_row(s, n, lo, hi, w.m[r], &sum);
    if (m_new > w.m[r]) {  // rescale what earlier blocks accumulated (nothing before the first)
      const float alpha = std::exp(w.m[r] - m_new);
      w.l[r] *= alpha;
      for (int64_t d = 0; d < D; ++d) w.o[r * D + d] *= alpha;
    }
    w.m[r] = m_new;
    w.l[r] += sum;
  }
}

template <typename T>
void attend_tile(const Prefill<T>& P, Path path, const Tile& tile, TileScratch<T>& w) {
  load_tile(P, tile, w);
  const int64_t rows = tile.num * P.group, D = P.head_dim;
  const int64_t query_len = P.query_start_loc[tile.s + 1] - P.query_start_loc[tile.s];
  const int64_t pos0 = P.context_lens[tile.s] - query_len + tile.first;  // the first row's token
  const int64_t end = pos0 + tile.num;  // up to the last row's token
  const int64_t* table = P.block_tables + tile.s * P.table_stride;
  const int64_t bs = P.block_size;
  for (int64_t t0 = first_visible_key(pos0, P.sliding_window); t0 < end; t0 += bs - t0 % bs) {
    const int64_t n = std::min(bs - t0 % bs, end - t0);  // to the end of t0's block
    const int64_t offset =
        table[t0 / bs] * P.block_stride + (t0 % bs) * P.token_stride + tile.h * D;
    score_rows(P, path, P.k_cache + offset, n, rows, w);
    softmax_block(P, t0, n, pos0, rows, w);
    add_values(P, path, P.v_cache + offset, n, rows, w);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = tile.h * P.group + r % P.group;
    T* out = P.out + (P.query_start_loc[tile.s] + tile.first + r / P.group) * P.out_row_stride +
             head * P.out_head_stride;
    store_scaled(out, w.o.data() + r * D,
                 softmax_normalizer(w.m[r], w.l[r], P.sinks ? P.sinks + head : nullptr), D);
  }
}

template <typename T>
void prefill_kernel(const Prefill<T>& P, int64_t num_seqs, int64_t num_kv_heads) {
  const Path path = path_for<T>(P.head_dim);
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, first token)
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t first = 0; first < P.query_start_loc[s + 1] - P.query_start_loc[s];
         first += kTokensPerItem)
      tiles.emplace_back(s, first);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, num_tiles * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    TileScratch<T> w;
    for (int64_t item = begin; item < end; ++item) {
      const auto [s, first] = tiles[item / num_kv_heads];
      const int64_t query_len = P.query_start_loc[s + 1] - P.query_start_loc[s];
      attend_tile(P, path,
                  Tile{s, first, std::min(kTokensPerItem, query_len - first), item % num_kv_heads},
                  w);
    }
  });
}

}  // namespace

void paged_prefill_attention_(at::Tensor out, at::Tensor q, at::Tensor k_cache,
                              at::Tensor v_cache, at::Tensor block_tables,
                              at::Tensor context_lens, at::Tensor query_start_loc, double scale,
                              const std::optional<at::Tensor>& sinks,
                              std::optional<int64_t> sliding_window) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes(),
              "paged_prefill_attention_: q and out [T, H, D], caches [num_blocks, block_size, "
              "H_kv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "paged_prefill_attention_: q, out and the caches must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_prefill_attention_: float32 or bfloat16 only, got ", q.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong,
              "paged_prefill_attention_: block_tables, context_lens and query_start_loc must be "
              "int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.stride(2) == 1,
              "paged_prefill_attention_: caches must be contiguous, out's last dim too");
  const int64_t num_seqs = context_lens.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "paged_prefill_attention_: head_dim mismatch or H not a multiple of H_kv");
  TORCH_CHECK(block_tables.size(0) == num_seqs && query_start_loc.size(0) == num_seqs + 1,
              "paged_prefill_attention_: one block table row and context length per sequence, "
              "query_start_loc one longer");
  const AttentionOptions options("paged_prefill_attention_", sinks, sliding_window, num_heads);
  auto qc = q.stride(2) == 1 ? q : q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto starts = query_start_loc.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(sp[s] >= 0 && sp[s] <= sp[s + 1] && sp[s + 1] <= q.size(0) &&
                    sp[s + 1] - sp[s] <= lp[s] &&
                    (lp[s] + block_size - 1) / block_size <= tables.size(1),
                "paged_prefill_attention_: sequence ", s, " has rows [", sp[s], ", ", sp[s + 1],
                ") of ", q.size(0), " and context length ", lp[s],
                ": rows must lie in q, be at most the context, and its blocks in the table");
  if (num_seqs == 0) return;
  const auto launch = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Prefill<T> P{qc.data_ptr<T>(), out.data_ptr<T>(), k_cache.data_ptr<T>(),
                       v_cache.data_ptr<T>(), tables.data_ptr<int64_t>(), lp, sp, qc.stride(0),
                       qc.stride(1), out.stride(0), out.stride(1), head_dim,
                       num_heads / num_kv_heads, block_size, tables.size(1),
                       num_kv_heads * head_dim, block_size * num_kv_heads * head_dim,
                       static_cast<float>(scale), options.sinks(), options.sliding_window};
    prefill_kernel(P, num_seqs, num_kv_heads);
  };
  if (q.scalar_type() == at::kFloat) launch(static_cast<float*>(nullptr));
  else launch(static_cast<BF16*>(nullptr));
}

}  // namespace atom_kernels
