// SPDX-License-Identifier: Apache-2.0
// Work-efficient exclusive scan (Blelloch) over an associative, non-commutative operator.
// Used by every scan form: chunk summaries are combined in a tree, then each chunk finishes from
// its carry-in. `comb(A, B)` means "segment A, then the adjacent segment B".
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace hila::cpu {

template <class S, class Comb>
std::vector<S> blelloch_exclusive(std::vector<S> x, const S& ident, Comb comb, S* total = nullptr) {
  const int64_t n0 = static_cast<int64_t>(x.size());
  int64_t n = 1;
  while (n < n0) n *= 2;
  x.resize(static_cast<size_t>(n), ident);
  // up-sweep: node i holds the composition of its subtree, left before right
  for (int64_t d = 1; d < n; d *= 2) {
#pragma omp parallel for if (n / (2 * d) >= 8)
    for (int64_t i = 2 * d - 1; i < n; i += 2 * d) x[i] = comb(x[i - d], x[i]);
  }
  if (total) *total = x[n - 1];
  x[n - 1] = ident;
  // down-sweep: a right child gets prefix-before-parent composed with its left sibling's total
  for (int64_t d = n / 2; d >= 1; d /= 2) {
#pragma omp parallel for if (n / (2 * d) >= 8)
    for (int64_t i = 2 * d - 1; i < n; i += 2 * d) {
      S left = std::move(x[i - d]);
      x[i - d] = x[i];
      x[i] = comb(x[i], left);
    }
  }
  x.resize(static_cast<size_t>(n0));
  return x;
}

}  // namespace hila::cpu
