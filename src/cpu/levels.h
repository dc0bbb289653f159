// SPDX-License-Identifier: Apache-2.0
// Fenwick level structure (docs/math/LOGLINEAR.md §2) and its degenerate "flat" form, so one set of
// primitive routines serves plain GLA / GDN (one state slot, every pair at level 0, lambda = 1)
// and their log-linear versions (slot = level, level(t,s) = bitlen(t xor s)).
#pragma once
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

}  // namespace hila::cpu
