// SPDX-License-Identifier: Apache-2.0
// Fenwick level structure (docs/math/LOGLINEAR.md §2) and its degenerate "flat" form, so one set of
// primitive routines serves plain GLA / GDN (one state slot, every pair at level 0, lambda = 1)
// and their log-linear versions (slot = level, level(t,s) = bitlen(t xor s)).
#pragma once
#include <algorithm>
#include <cstdint>

namespace hila::cpu {

inline int bitlen(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }
inline int ctz(uint64_t x) { return __builtin_ctzll(x); }
// Start of bucket l of position n (§2.2): sigma_l(n) = (n >> l) << l.
inline int64_t sigma(int64_t n, int l) { return l >= 63 ? 0 : (n >> l) << l; }

struct Levels {
  bool fenwick = false;

  int level(int64_t t, int64_t s) const { return fenwick ? bitlen(uint64_t(t ^ s)) : 0; }
  // Slots of the canonical state at position n: bitlen(n) + 1 (§2.5), or one flat slot.
  int64_t slots(int64_t n) const { return fenwick ? bitlen(uint64_t(n)) + 1 : 1; }
  // Whether slot l of the canonical state at n can be non-zero.
  bool live(int64_t n, int l) const {
    return fenwick ? (l >= 1 && l <= 63 && ((n >> (l - 1)) & 1)) : l == 0;
  }
  // Level at which query t >= n sees bucket l of the state at n; with t = e it is also the slot
  // that bucket re-keys into when the state advances from n to e (nesting lemma, §2.4).
  int read_level(int64_t t, int64_t n, int l) const {
    return fenwick ? bitlen(uint64_t(t ^ sigma(n, l))) : 0;
  }
};

// The columns j <= i of row i of a segment starting at absolute position s, cut into the
// contiguous ranges of one level l = level(s + i, s + j): f(l, j0, j1) for [j0, j1). With
// t = s + i, level 0 is j = i alone and level l >= 1 the positions [sigma_l(t), sigma_{l-1}(t))
// (same bits as t above bit l, not above bit l - 1); flat: one range at level 0.
template <class F>
inline void level_ranges(const Levels& lv, int64_t s, int64_t i, F f) {
  if (!lv.fenwick) return f(0, int64_t(0), i + 1);
  const int64_t t = s + i;
  f(0, i, i + 1);
  for (int l = 1; sigma(t, l - 1) > s; ++l) {
    const int64_t lo = std::max(sigma(t, l), s), hi = sigma(t, l - 1);
    if (lo < hi) f(l, lo - s, hi - s);
  }
}

}  // namespace hila::cpu
