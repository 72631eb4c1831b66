// The (token, slot) pairs of a MoE call sorted by local expert (a counting sort), shared by
// fused_moe.cpp and fused_moe_packed.cpp so both visit an expert's tokens in the same order.
#pragma once

#include <cstdint>
#include <vector>

namespace atom_kernels {

struct ExpertPairs {
  // order[offset[e] .. offset[e + 1]) are expert e's pair indices p (token p / k, slot p % k),
  // ascending; pairs whose id is outside [0, E) (another rank's experts) are left out.
  std::vector<int64_t> offset, order;
  std::vector<int64_t> active;  // the experts with at least one pair, ascending
  int64_t pairs = 0;

  ExpertPairs(const int64_t* ids, int64_t num_pairs, int64_t E) : offset(E + 1, 0) {
    for (int64_t p = 0; p < num_pairs; ++p)
      if (ids[p] >= 0 && ids[p] < E) ++offset[ids[p] + 1];
    for (int64_t e = 0; e < E; ++e) offset[e + 1] += offset[e];
    pairs = offset[E];
    order.resize(pairs);
    std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
    for (int64_t p = 0; p < num_pairs; ++p)
      if (ids[p] >= 0 && ids[p] < E) order[fill[ids[p]]++] = p;
    for (int64_t e = 0; e < E; ++e)
      if (offset[e + 1] > offset[e]) active.push_back(e);
  }

  int64_t count(int64_t e) const { return offset[e + 1] - offset[e]; }
};

}  // namespace atom_kernels
