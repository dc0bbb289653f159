// SPDX-License-Identifier: Apache-2.0
// Every hila operator as a composition of the primitive (docs/math/HLA.md §2, §11;
// docs/math/LOGLINEAR.md §7):
//   gla / loglinear / gdn / loglinear_gdn:  O = prim(Q, K, V)
//   hla2:  U = GLA_gS(Q, K, K) (+ ridge Q),  O = prim_gY(Q, U, V)
//   ahla:  Hh = GLA_gP(Q, K, V),             O = prim_gE(Q, K, Hh)
//   hla3:  U, Hh as above,                    O = prim_gX(Q, U, Hh)
// where the outer prim is flat (GLA) or Fenwick (log-linear). Normalize runs the op on [V | 1]
// and divides (docs/math/HLA.md §4). Per (sequence, head); q is pre-scaled (and l2-normalised if asked).
#pragma once
#include "core/plan.h"
#include "cpu/primitive.h"
#include "hila/ops.h"

namespace hila::cpu {

using detail::OpPlan;

template <class R>
struct HeadView {
  MRef<const R> q, k, v;            // [n, dk], [n, dk], [n, dv'] (v' carries the ones column)
  const R* g[3] = {nullptr, nullptr, nullptr};
  MRef<const R> lam;                // [n, nL]
  const R* beta = nullptr;
  int64_t n0 = 0;
  int64_t n() const { return q.r; }
  HeadView rows(int64_t i0, int64_t i1) const;
};

// S (dk x dk), P (dk x dv') and the outer state H, each a canonical state (flat: one slot).
template <class R>
struct OpState {
  Canon<R> S, P, H;
};

template <class R>
struct OpGrads {
  Mat<R> dq, dk, dv;          // dv without the ones column
  std::vector<R> dg[3], dbeta;
  Mat<R> dlam;
  OpState<R> dinit;
};

// Forward producing the final output O [n, dv] (normalized if asked; every entry written, none
// read first: O may be the caller's output tensor); returns the final state
// (want_state false: states the caller does not read may be left empty, see prim_forward).
template <class R>
OpState<R> op_forward(const OpPlan& p, PForm form, int64_t C, const HeadView<R>& x,
                      const OpState<R>& init, MRef<R> O, bool want_state = true);
// Raw forward: O' [n, dv'] before normalization.
template <class R>
OpState<R> op_forward_raw(const OpPlan& p, PForm form, int64_t C, const HeadView<R>& x,
                          const OpState<R>& init, MRef<R> Oraw, bool want_state = true);
template <class R>
OpGrads<R> op_backward(const OpPlan& p, PForm form, int64_t C, const HeadView<R>& x,
                       const OpState<R>& init, MRef<const R> dO, const OpState<R>& dfinal);
// One decode step of row i at absolute position t: o [dv] (normalized if asked).
template <class R>
void op_step(const OpPlan& p, const HeadView<R>& x, int64_t i, int64_t t, OpState<R>& st, R* o);

// Normalize's cotangent of O' = [N | D] [n, dv + 1] from dO [n, dv] (docs/math/HLA.md §4):
//   dN = dO / (D + eps),  dD = -sum_c (dO o N) / (D + eps)^2.
template <class R>
Mat<R> normalize_cotangent(MRef<const R> Oraw, MRef<const R> dO, R eps);

// Chunk form of hla2 / ahla / hla3 and their log-linear versions (flat or Fenwick outer primitive,
// mamba), all primitives of a segment in one sweep (hla_chunk.cpp); op_forward_raw and op_backward
// take it where hla_chunk_applies.
template <class R>
bool hla_chunk_applies(const OpPlan& p, PForm form, const HeadView<R>& x);
template <class R>
OpState<R> hla_chunk_forward(const OpPlan& p, int64_t C, const HeadView<R>& x,
                             const OpState<R>& init, MRef<R> Oraw, bool want_state);
template <class R>
OpGrads<R> hla_chunk_backward(const OpPlan& p, int64_t C, const HeadView<R>& x,
                              const OpState<R>& init, MRef<const R> dO, const OpState<R>& dfinal);

// Op-level scan for hla2 / ahla / hla3 (scan.cpp).
template <class R>
OpState<R> hla_scan_forward(const OpPlan& p, int64_t C, const HeadView<R>& x,
                            const OpState<R>& init, MRef<R> Oraw);

}  // namespace hila::cpu
