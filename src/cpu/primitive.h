// SPDX-License-Identifier: Apache-2.0
// The one primitive every hila operator is built from (docs/math/HLA.md §1,
// docs/math/LOGLINEAR.md §3, §6):
//
//   o_t = sum_{n0<=s<=t} lam_t^{l(t,s)} q_t^T (A_t ... A_{s+1}) beta_s k_s v_s^T  + initial-state reads
//   A_r = a_r I                    (mamba: GLA / log-linear Mamba-2; beta = 1)
//   A_r = a_r (I - beta_r k_r k_r^T) (delta: Gated DeltaNet / log-linear GDN)
//
// with Fenwick levels (lam given) or flat (one state slot, lam = 1). Per head, per sequence;
// q is already scaled. State: the canonical state of docs/math/LOGLINEAR.md §2.5 (flat: one matrix).
#pragma once
#include <cstdint>
#include <vector>

#include "cpu/levels.h"
#include "cpu/linalg.h"

namespace hila::cpu {

enum class PForm { naive, serial, chunk, scan };

// Canonical state: slot l is [dk, dv]; an empty Mat is a zero slot.
template <class R>
struct Canon {
  std::vector<Mat<R>> slot;
  void resize(int64_t n) { slot.resize(static_cast<size_t>(n)); }
  // Slot l, allocated (zero) on first use.
  Mat<R>& at(int l, int64_t dk, int64_t dv) {
    if (static_cast<int64_t>(slot.size()) <= l) slot.resize(l + 1);
    if (slot[l].empty()) slot[l] = Mat<R>(dk, dv);
    return slot[l];
  }
  const Mat<R>* get(int l) const {
    return (l < static_cast<int>(slot.size()) && !slot[l].empty()) ? &slot[l] : nullptr;
  }
};

// H with exactly lv.slots(n) slots, the slots not live at n dropped.
template <class R>
Canon<R> trimmed(const Canon<R>& H, const Levels& lv, int64_t n) {
  Canon<R> out;
  out.resize(lv.slots(n));
  for (int l = 0; l < static_cast<int>(std::min(out.slot.size(), H.slot.size())); ++l)
    if (lv.live(n, l) && H.get(l)) out.slot[l] = H.slot[l];
  return out;
}

template <class R>
struct PrimArgs {
  MRef<const R> q, k, v;      // [n, dk], [n, dk], [n, dv]; q pre-scaled
  const R* g = nullptr;       // [n] log-gates, nullptr = 0
  MRef<const R> lam;          // [n, nL] (fenwick only)
  const R* beta = nullptr;    // [n] (delta only)
  int64_t n0 = 0;             // absolute position of row 0
  Levels lv;                  // fenwick iff lam is used
  bool delta = false;
  int64_t n() const { return q.r; }
  int64_t dk() const { return k.c; }
  int64_t dv() const { return v.c; }
  R gate(int64_t i) const { return g ? g[i] : R(0); }
  R lambda(int64_t i, int l) const { return lv.fenwick ? lam(i, l) : R(1); }
  R b(int64_t i) const { return delta ? beta[i] : R(1); }
};

template <class R>
struct PrimGrads {
  Mat<R> dq, dk, dv;          // [n, dk], [n, dk], [n, dv]
  std::vector<R> dg, dbeta;   // [n]
  Mat<R> dlam;                // [n, nL] (fenwick)
  Canon<R> dinit;             // gradient of the initial state (slots of position n0)
};

// Forward in the given form. `init` is the canonical state at n0 (may be empty = zero); O gets
// [n, dv]; returns the canonical state at n0 + n with exactly lv.slots(n0 + n) slots, or, with
// want_state false in the naive and chunk forms, an empty Canon (the last segment's state update
// is skipped).
// seg_in (naive and chunk forms, may be null): gets the canonical state entering each segment,
// what prim_backward of the same call (form, chunk, args, init) would otherwise recompute.
template <class R>
Canon<R> prim_forward(PForm form, int64_t chunk, const PrimArgs<R>& a, const Canon<R>& init,
                      MRef<R> O, bool want_state = true, std::vector<Canon<R>>* seg_in = nullptr);

// VJP (naive: one segment over the whole call; chunk: segment sweep; serial: flat mamba only).
// dfinal may be empty (no cotangent of the final state). seg_in: the states entering the segments
// from prim_forward's seg_in for the same call (null or empty: the backward recomputes them).
template <class R>
PrimGrads<R> prim_backward(PForm form, int64_t chunk, const PrimArgs<R>& a, const Canon<R>& init,
                           MRef<const R> dO, const Canon<R>& dfinal,
                           const std::vector<Canon<R>>* seg_in = nullptr);

// One decode step at absolute position t for row i of `a`: updates `st` (canonical at t ->
// t + 1, growing slots as needed) and writes o [dv].
template <class R>
void prim_step(const PrimArgs<R>& a, int64_t i, int64_t t, Canon<R>& st, R* o);

// Segment boundaries [s, e) in absolute positions that never cross a multiple of C (§3.3).
std::vector<std::pair<int64_t, int64_t>> segments(int64_t n0, int64_t n, int64_t C);

// Re-key a canonical state from position n to e >= n with a common factor (and, for delta,
// a left transition M): out[read_level(e, n, l)] += f * M * H[l]  (docs/math/LOGLINEAR.md §2.4, §10).
template <class R>
void rekey_add(Canon<R>& out, const Canon<R>& H, const Levels& lv, int64_t n, int64_t e, R f,
               const Mat<R>* M, int64_t dk, int64_t dv);

// Segment summary for the scan form (docs/math/LOGLINEAR.md §10): the affine map H_e = M rekey(H_s) + P.
template <class R>
struct PrimSummary {
  bool identity = true;
  int64_t a = 0, b = 0;
  R logm = 0;        // mamba: M = e^{logm} I
  Mat<R> M;          // delta: [dk, dk] transition
  Canon<R> P;        // canonical state at b of a zero-initialised run over [a, b)
};
template <class R>
PrimSummary<R> prim_summarize(const PrimArgs<R>& a, int64_t i0, int64_t i1);
template <class R>
PrimSummary<R> prim_compose(const PrimSummary<R>& A, const PrimSummary<R>& B, const Levels& lv,
                            bool delta, int64_t dk, int64_t dv);
template <class R>
Canon<R> prim_apply(const PrimSummary<R>& S, const Canon<R>& H, const Levels& lv, bool delta,
                    int64_t dk, int64_t dv);

}  // namespace hila::cpu
