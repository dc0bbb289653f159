// SPDX-License-Identifier: Apache-2.0
#include "cpu/compose.h"

#include <stdexcept>

namespace hila::cpu {

template <class R>
HeadView<R> HeadView<R>::rows(int64_t i0, int64_t i1) const {
  HeadView r = *this;
  r.q = q.rows(i0, i1);
  r.k = k.rows(i0, i1);
  r.v = v.rows(i0, i1);
  for (auto& gp : r.g)
    if (gp) gp += i0;
  if (lam.p) r.lam = lam.rows(i0, i1);
  if (beta) r.beta += i0;
  r.n0 = n0 + i0;
  return r;
}

namespace {

template <class R>
PrimArgs<R> inner_args(const HeadView<R>& x, int gate, MRef<const R> key, MRef<const R> val) {
  PrimArgs<R> a;
  a.q = x.q;
  a.k = key;
  a.v = val;
  a.g = x.g[gate];
  a.n0 = x.n0;
  return a;  // flat mamba: GLA
}

template <class R>
PrimArgs<R> outer_args(const OpPlan& p, const HeadView<R>& x, MRef<const R> key,
                       MRef<const R> val) {
  PrimArgs<R> a = inner_args(x, p.gO, key, val);
  a.lv.fenwick = p.fenwick;
  a.lam = x.lam;
  a.delta = p.delta;
  a.beta = x.beta;
  return a;
}

// Inner primitives of a composition: U = GLA(Q,K,K) (+ ridge Q), Hh = GLA(Q,K,V').
template <class R>
struct Inner {
  Mat<R> U, Hh;
  Canon<R> S, P;
  MRef<const R> key, val;            // what the outer primitive reads
  std::vector<Canon<R>> Sseg, Pseg;  // states entering each segment (kept for a backward)
};

// keep_segs: keep the inner primitives' segment states for their backward (prim_backward's
// seg_in), which then skips its own states sweep.
template <class R>
Inner<R> run_inner(const OpPlan& p, PForm form, int64_t C, const HeadView<R>& x,
                   const OpState<R>& init, bool want_state, bool keep_segs = false) {
  Inner<R> in;
  const int64_t n = x.n();
  in.key = x.k;
  in.val = x.v;
  if (p.has_S) {
    in.U = Mat<R>(n, x.k.c, Uninit{});  // every row written by the primitive
    in.S = prim_forward<R>(form, C, inner_args(x, p.gS, x.k, x.k), init.S, in.U, want_state,
                           keep_segs ? &in.Sseg : nullptr);
    if (p.ridge != 0) axpy<R>(in.U, x.q, R(p.ridge));  // u_j = (S_j + ridge I) q_j
    in.key = in.U;
  }
  if (p.has_P) {
    in.Hh = Mat<R>(n, x.v.c, Uninit{});
    in.P = prim_forward<R>(form, C, inner_args(x, p.gP, x.k, x.v), init.P, in.Hh, want_state,
                           keep_segs ? &in.Pseg : nullptr);
    in.val = in.Hh;
  }
  return in;
}

template <class R>
void accumulate(MRef<R> Y, const Mat<R>& X) {
  axpy<R>(Y, X);
}

// Backward of an inner primitive Y = GLA_gate(Q, K, W) (W = K for S, W = V' for P) from dY, the
// cotangent of Y [n, W.c]: adds dQ to G.dq, dK to dk and dW to dw (dk itself when W = K), sets
// G.dg[gate]; returns the gradient of the primitive's initial state.
template <class R>
Canon<R> inner_backward(PForm form, int64_t C, const HeadView<R>& x, int gate, MRef<const R> w,
                        const Canon<R>& init, const Mat<R>& dY, const Canon<R>& dfinal,
                        const std::vector<Canon<R>>& seg_in, OpGrads<R>& G, Mat<R>& dk, Mat<R>& dw) {
  PrimGrads<R> gi = prim_backward<R>(form, C, inner_args(x, gate, x.k, w), init, dY, dfinal, &seg_in);
  accumulate<R>(G.dq, gi.dq);
  accumulate<R>(dk, gi.dk);
  accumulate<R>(dw, gi.dv);
  G.dg[gate] = std::move(gi.dg);
  return std::move(gi.dinit);
}

}  // namespace

template <class R>
OpState<R> op_forward_raw(const OpPlan& p, PForm form, int64_t C, const HeadView<R>& x,
                          const OpState<R>& init, MRef<R> Oraw, bool want_state) {
  if (form == PForm::scan && p.op_level_scan) return hla_scan_forward(p, C, x, init, Oraw);
  if (hla_chunk_applies(p, form, x)) return hla_chunk_forward(p, C, x, init, Oraw, want_state);
  Inner<R> in = run_inner(p, form, C, x, init, want_state);
  OpState<R> out;
  out.H = prim_forward<R>(form, C, outer_args(p, x, in.key, in.val), init.H, Oraw, want_state);
  out.S = std::move(in.S);
  out.P = std::move(in.P);
  return out;
}

// o = num / (den + eps) with [num | den] = O' (docs/math/HLA.md §4).
template <class R>
static void normalize_rows(MRef<const R> Oraw, MRef<R> O, R eps) {
  const int64_t dv = O.c;
  for (int64_t i = 0; i < O.r; ++i) {
    const R den = Oraw(i, dv) + eps;
    for (int64_t c = 0; c < dv; ++c) O(i, c) = Oraw(i, c) / den;
  }
}

template <class R>
OpState<R> op_forward(const OpPlan& p, PForm form, int64_t C, const HeadView<R>& x,
                      const OpState<R>& init, MRef<R> O, bool want_state) {
  if (!p.normalize) return op_forward_raw(p, form, C, x, init, O, want_state);
  Mat<R> Oraw(x.n(), x.v.c);
  OpState<R> st = op_forward_raw(p, form, C, x, init, Oraw.ref(), want_state);
  normalize_rows<R>(Oraw, O, R(p.eps));
  return st;
}

template <class R>
Mat<R> normalize_cotangent(MRef<const R> Oraw, MRef<const R> dO, R eps) {
  const int64_t n = Oraw.r, dv = dO.c;
  Mat<R> d(n, dv + 1, Uninit{});
  for (int64_t i = 0; i < n; ++i) {
    const R den = Oraw(i, dv) + eps;
    R s = 0;
    for (int64_t c = 0; c < dv; ++c) {
      d(i, c) = dO(i, c) / den;
      s += dO(i, c) * Oraw(i, c);
    }
    d(i, dv) = -s / (den * den);
  }
  return d;
}

template <class R>
OpGrads<R> op_backward(const OpPlan& p, PForm form, int64_t C, const HeadView<R>& x,
                       const OpState<R>& init, MRef<const R> dO, const OpState<R>& dfinal) {
  if (hla_chunk_applies(p, form, x)) return hla_chunk_backward(p, C, x, init, dO, dfinal);
  const int64_t n = x.n(), dvp = x.v.c, dv = p.normalize ? dvp - 1 : dvp;
  Inner<R> in = run_inner(p, form, C, x, init, false, true);  // the inner final states are not read
  const PrimArgs<R> oa = outer_args(p, x, in.key, in.val);
  // cotangent of O' = [N | D]:  dN = dO / (D + eps),  dD = -sum_c(dO o N) / (D + eps)^2
  Mat<R> dOraw;
  MRef<const R> dOr = dO;
  if (p.normalize) {
    Mat<R> Oraw(n, dvp);
    prim_forward<R>(form, C, oa, init.H, Oraw.ref(), false);
    dOraw = normalize_cotangent<R>(Oraw, dO, R(p.eps));
    dOr = dOraw;
  }
  OpGrads<R> G;
  PrimGrads<R> go = prim_backward<R>(form, C, oa, init.H, dOr, dfinal.H);
  G.dq = std::move(go.dq);
  G.dg[p.gO] = std::move(go.dg);
  G.dlam = std::move(go.dlam);
  G.dbeta = std::move(go.dbeta);
  G.dinit.H = std::move(go.dinit);
  Mat<R> dk = p.has_S ? Mat<R>(n, x.k.c) : std::move(go.dk);
  Mat<R> dvfull = p.has_P ? Mat<R>(n, dvp) : std::move(go.dv);
  if (p.has_P)  // Hh = GLA_gP(Q, K, V'): its cotangent is the outer value gradient
    G.dinit.P = inner_backward<R>(form, C, x, p.gP, x.v, init.P, go.dv, dfinal.P, in.Pseg, G, dk,
                                      dvfull);
  if (p.has_S) {  // U = GLA_gS(Q, K, K) + ridge Q: cotangent is the outer key gradient
    if (p.ridge != 0) axpy<R>(G.dq, go.dk, R(p.ridge));
    G.dinit.S = inner_backward<R>(form, C, x, p.gS, x.k, init.S, go.dk, dfinal.S, in.Sseg, G, dk, dk);
  }
  G.dk = std::move(dk);
  if (p.normalize) {  // drop the ones column
    G.dv = Mat<R>(n, dv);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < dv; ++c) G.dv(i, c) = dvfull(i, c);
  } else {
    G.dv = std::move(dvfull);
  }
  return G;
}

template <class R>
void op_step(const OpPlan& p, const HeadView<R>& x, int64_t i, int64_t t, OpState<R>& st, R* o) {
  const int64_t dk = x.k.c, dvp = x.v.c;
  MRef<const R> key = x.k, val = x.v;
  Mat<R> U, Hh;
  if (p.has_S) {  // S <- a S + k k^T;  u = S q (+ ridge q)
    U = Mat<R>(x.n(), dk);
    prim_step<R>(inner_args(x, p.gS, x.k, x.k), i, t, st.S, U.row(i));
    if (p.ridge != 0)
      for (int64_t c = 0; c < dk; ++c) U(i, c) += R(p.ridge) * x.q(i, c);
    key = U;
  }
  if (p.has_P) {  // P <- a P + k v^T;  h = P^T q
    Hh = Mat<R>(x.n(), dvp);
    prim_step<R>(inner_args(x, p.gP, x.k, x.v), i, t, st.P, Hh.row(i));
    val = Hh;
  }
  if (!p.normalize) {
    prim_step<R>(outer_args(p, x, key, val), i, t, st.H, o);
    return;
  }
  std::vector<R> raw(static_cast<size_t>(dvp));
  prim_step<R>(outer_args(p, x, key, val), i, t, st.H, raw.data());
  const R den = raw[dvp - 1] + R(p.eps);
  for (int64_t c = 0; c + 1 < dvp; ++c) o[c] = raw[c] / den;
}

#define HILA_INSTANTIATE(R)                                                                     \
  template struct HeadView<R>;                                                                  \
  template OpState<R> op_forward<R>(const OpPlan&, PForm, int64_t, const HeadView<R>&,          \
                                    const OpState<R>&, MRef<R>, bool);                          \
  template OpState<R> op_forward_raw<R>(const OpPlan&, PForm, int64_t, const HeadView<R>&,      \
                                        const OpState<R>&, MRef<R>, bool);                      \
  template OpGrads<R> op_backward<R>(const OpPlan&, PForm, int64_t, const HeadView<R>&,         \
                                     const OpState<R>&, MRef<const R>, const OpState<R>&);      \
  template void op_step<R>(const OpPlan&, const HeadView<R>&, int64_t, int64_t, OpState<R>&, R*); \
  template Mat<R> normalize_cotangent<R>(MRef<const R>, MRef<const R>, R);
HILA_INSTANTIATE(float)
HILA_INSTANTIATE(double)
#undef HILA_INSTANTIATE

}  // namespace hila::cpu
