// Decode attention straight from the paged KV cache (CPU), for atom.kernels.attention.
//
// One query token per sequence attends to the first context_len tokens of its own KV (with a
// sliding window W, to the last W of them), read block by block through its block table: no
// gathered copy of the context is ever made. A sink logit per query head, when given, joins
// each softmax's denominator at the end (softmax_normalizer). Work
// items are (sequence, range of KV heads, range of whole blocks), run with at::parallel_for on
// torch's intra-op threads (the extension is built with -fopenmp; without it at::parallel_for
// runs serially):
// - with at least 4 sequences per thread an item takes all KV heads, so each block's K and V are
//   read as one contiguous run (and the next block is prefetched); with fewer, one KV head;
// - with fewer sequences than threads each context is split into chunks of whole blocks, an item
//   per (sequence, chunk) over all heads (split-K, as in flash-decoding), so a one-request decode
//   keeps every thread busy; each item keeps per query head its chunk's max score m, sum of
//   exponentials l and unnormalised output o, and the merge rescales them by exp(m_c - max m).
// For the G = H / H_kv query heads that share a KV head, two passes over the item's blocks:
// scores for all its tokens, a softmax per query head in float32, then the values
// (attention_tiles.h has the block-level pieces and the SIMD paths). The math is that of vLLM's
// CPU paged attention v1 (csrc/cpu/attention.cpp). Every path accumulates in float32; the output
// is rounded to q's dtype once.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

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
  const float* sinks;      // [H] one logit per query head, or nullptr
  int64_t sliding_window;  // a query sees its last this many tokens; 0 = all
};

// Per-thread buffers of a work item.
template <typename T>
struct Scratch {
  std::vector<float> qf;      // [nq, D] the item's query heads, float32, times scale
  std::vector<const T*> q;    // [nq] the item's query rows in q (VDPBF16PS reads bf16 as is)
  std::vector<float> scores;  // [nq, n_tok]
  std::vector<float> o;       // [nq, D] unnormalised output
  std::vector<float> m, l;    // [nq]
  std::vector<T> pad;         // [16, D] a partial tile of K, zero-padded
};

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

// Query head h's sink logit, or nullptr.
template <typename T>
inline const float* sink(const Problem<T>& P, int64_t h) {
  return P.sinks == nullptr ? nullptr : P.sinks + h;
}

// The item's query rows: w.q points at them, w.qf holds them in float32 times scale; sizes the
// other buffers.
template <typename T>
void load_queries(const Problem<T>& P, const Item& it, Scratch<T>& w) {
  const int64_t D = P.head_dim, nq = (it.h_end - it.h_begin) * P.group;
  w.qf.resize(nq * D);
  w.q.resize(nq);
  for (int64_t r = 0; r < nq; ++r) {
    w.q[r] = P.q + it.s * P.q_seq_stride + (it.h_begin * P.group + r) * P.q_head_stride;
    load_query_row(w.q[r], D, P.scale, w.qf.data() + r * D);
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
// its tokens in range), the next K block (after the last one, the first V block) prefetched a
// slice per query head.
template <typename T>
void score_pass(const Problem<T>& P, Path path, const Item& it, Scratch<T>& w) {
  const int64_t G = P.group, D = P.head_dim, nq = (it.h_end - it.h_begin) * G;
  const int64_t n_tok = it.t_end - it.t_begin, bs = P.block_size, ts = P.token_stride;
  const int64_t* table = P.block_tables + it.s * P.table_stride;
  for (int64_t t0 = it.t_begin; t0 < it.t_end; t0 += bs - t0 % bs) {
    const int64_t n = std::min(bs - t0 % bs, it.t_end - t0);
    const T* kb = P.k_cache + token_offset(P, table, t0);
    const T* next = t0 + n < it.t_end ? P.k_cache + token_offset(P, table, t0 + n)
                                      : P.v_cache + token_offset(P, table, it.t_begin);
    for (int64_t r = 0; r < nq; ++r) {
      score_row(path, w.scores.data() + r * n_tok + (t0 - it.t_begin), w.qf.data() + r * D,
                w.q[r], kb + (it.h_begin + r / G) * D, n, ts, D, P.scale, w.pad.data());
      prefetch_rows(next, bs, ts, it.h_begin * D, (it.h_end - it.h_begin) * D, r, nq);
    }
  }
}

// Pass 2 of the vector paths: w.o += p v, block by block, all G query heads of a KV head at
// once; the next V block prefetched a slice per KV head.
template <typename T>
void value_pass(const Problem<T>& P, Path path, const Item& it, Scratch<T>& w) {
  const int64_t G = P.group, D = P.head_dim, n_tok = it.t_end - it.t_begin;
  const int64_t bs = P.block_size, ts = P.token_stride;
  const int64_t* table = P.block_tables + it.s * P.table_stride;
  for (int64_t t0 = it.t_begin; t0 < it.t_end; t0 += bs - t0 % bs) {
    const int64_t n = std::min(bs - t0 % bs, it.t_end - t0);
    const T* vb = P.v_cache + token_offset(P, table, t0);
    const int64_t heads = it.h_end - it.h_begin;
    for (int64_t h = it.h_begin; h < it.h_end; ++h) {
      const int64_t r = (h - it.h_begin) * G;
      pv_rows(path, w.o.data() + r * D, G, D, w.scores.data() + r * n_tok + (t0 - it.t_begin),
              n_tok, vb + h * D, n, ts);
      if (t0 + n < it.t_end)
        prefetch_rows(P.v_cache + token_offset(P, table, t0 + n), bs, ts, it.h_begin * D,
                      heads * D, h - it.h_begin, heads);
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
      // the visible keys [lo, len), split in chunks of whole blocks from lo's block on
      const int64_t len = P.context_lens[s], bs = P.block_size;
      const int64_t lo = first_visible_key(len - 1, P.sliding_window);
      const int64_t num_blocks = (len + bs - 1) / bs - lo / bs;
      const int64_t per_chunk = (num_blocks + chunks - 1) / chunks;
      const int64_t t_begin = std::min(len, std::max(lo, (lo / bs + c * per_chunk) * bs));
      const int64_t t_end = std::min(len, (lo / bs + (c + 1) * per_chunk) * bs);
      if (t_begin >= t_end) continue;  // a short context leaves the last chunks empty (l = 0)
      attend(P, path, Item{s, h_begin, h_begin + heads_per_item, t_begin, t_end}, w);
      const int64_t q_begin = h_begin * P.group, nq = heads_per_item * P.group;
      if (chunks == 1) {
        for (int64_t r = 0; r < nq; ++r)
          store_scaled(out + (s * H + q_begin + r) * D, w.o.data() + r * D,
                       softmax_normalizer(w.m[r], w.l[r], sink(P, q_begin + r)), D);
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
      store_scaled(out + (s * H + r) * D, o.data(), softmax_normalizer(mx, total, sink(P, r)), D);
    }
}

}  // namespace

// Arguments as in ops.h.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens,
                                  double scale, const std::optional<at::Tensor>& sinks,
                                  std::optional<int64_t> sliding_window,
                                  const std::optional<at::Tensor>& key,
                                  const std::optional<at::Tensor>& value,
                                  const std::optional<at::Tensor>& slot_mapping) {
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
  const AttentionOptions options("paged_decode_attention", sinks, sliding_window, num_heads);
  TORCH_CHECK(key.has_value() == value.has_value() && key.has_value() == slot_mapping.has_value(),
              "paged_decode_attention: give key, value and slot_mapping together, or none");
  if (key) {
    for (const at::Tensor* t : {&*key, &*value})
      TORCH_CHECK(t->dim() == 3 && t->size(0) == num_seqs && t->size(1) == num_kv_heads &&
                      t->size(2) == head_dim && t->stride(2) == 1 &&
                      t->scalar_type() == q.scalar_type(),
                  "paged_decode_attention: key and value must be [S, H_kv, D] in q's dtype");
    TORCH_CHECK(slot_mapping->scalar_type() == at::kLong && slot_mapping->dim() == 1 &&
                    slot_mapping->size(0) >= num_seqs,
                "paged_decode_attention: slot_mapping must be int64 [>= S]");
  }
  auto out = at::empty({num_seqs, num_heads, head_dim}, q.options());
  if (num_seqs == 0) return out;
  const auto launch = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (key) {  // the step's new K/V into their slots first (what write_kv does), then attend
      const int64_t slots = k_cache.size(0) * block_size, row = num_kv_heads * head_dim;
      const int64_t* sp = slot_mapping->data_ptr<int64_t>();
      const int64_t ss = slot_mapping->stride(0);
      for (const auto& [src, cache] : {std::pair{&*key, &k_cache}, std::pair{&*value, &v_cache}}) {
        const T* s = src->template data_ptr<T>();
        T* c = cache->template data_ptr<T>();
        for (int64_t i = 0; i < num_seqs; ++i) {
          const int64_t slot = sp[i * ss];
          if (slot < 0) continue;  // NO_KV_WRITE_SLOT
          TORCH_CHECK(slot < slots, "paged_decode_attention: slot ", slot, " outside the cache");
          for (int64_t h = 0; h < num_kv_heads; ++h)
            std::copy_n(s + i * src->stride(0) + h * src->stride(1), head_dim,
                        c + slot * row + h * head_dim);
        }
      }
    }
    const Problem<T> P{qc.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                       tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), qc.stride(0),
                       qc.stride(1), num_heads, num_kv_heads, head_dim, num_heads / num_kv_heads,
                       block_size, tables.size(1), num_kv_heads * head_dim,
                       block_size * num_kv_heads * head_dim, static_cast<float>(scale),
                       options.sinks(), options.sliding_window};
    decode_kernel(out.data_ptr<T>(), P, num_seqs);
  };
  if (q.scalar_type() == at::kFloat) launch(static_cast<float*>(nullptr));
  else launch(static_cast<BF16*>(nullptr));
  return out;
}

}  // namespace atom_kernels
