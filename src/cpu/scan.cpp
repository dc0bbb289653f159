// SPDX-License-Identifier: Apache-2.0
// Scan form of hla2 / ahla / hla3 with their own associative segment operators:
// docs/math/HLA.md §3.4 (HLA2: S, Z, Y), §5.3 (AHLA: P, R, E), §6.3 (HLA3: S, P, X, Phi, Psi, Omega).
// Each chunk is reduced to its summary from a zero carry; a Blelloch exclusive scan gives every
// chunk its carry-in; each chunk then reruns the chunk form from it. This is exactly the
// context-parallel protocol (one summary per rank instead of per chunk).
#include <cmath>

#include "cpu/blelloch.h"
#include "cpu/compose.h"
#include "cpu/scan.h"

namespace hila::cpu {

namespace {

template <class R>
Mat<R> mm(const Mat<R>& A, const Mat<R>& B) {
  return matmul<R>(A, false, B, false);
}
// Y = a * A + b * B  (missing = zero)
template <class R>
Mat<R> lin(R a, const Mat<R>& A, R b, const Mat<R>& B) {
  Mat<R> Y = A.empty() ? Mat<R>(B.r, B.c) : A;
  scale<R>(Y, a);
  if (!B.empty()) axpy<R>(Y, B, b);
  return Y;
}
template <class R>
void add(Mat<R>& Y, const Mat<R>& X) {
  if (!X.empty()) axpy<R>(Y, X);
}

template <class R>
std::vector<R> cumsum(const R* g, int64_t n) {
  std::vector<R> b(static_cast<size_t>(n));
  R c = 0;
  for (int64_t i = 0; i < n; ++i) b[i] = (c += g ? g[i] : R(0));
  return b;
}

// A^T diag(w) B for row-aligned A [n, a], B [n, b]
template <class R>
Mat<R> weighted_tn(MRef<const R> A, const std::vector<R>& w, MRef<const R> B) {
  Mat<R> WB(B.r, B.c);
  for (int64_t i = 0; i < B.r; ++i)
    for (int64_t j = 0; j < B.c; ++j) WB(i, j) = w[i] * B(i, j);
  return matmul<R>(A, true, WB, false);  // [a,n] x [n,b]
}

template <class R>
Mat<R> slot0(const Canon<R>& c, int64_t r, int64_t cols) {
  const Mat<R>* m = c.get(0);
  return m ? *m : Mat<R>(r, cols);
}
template <class R>
Canon<R> as_canon(Mat<R> m) {
  Canon<R> c;
  c.slot.push_back(std::move(m));
  return c;
}

}  // namespace

template <class R>
HlaSummary<R> hla_summarize(const OpPlan& p, int64_t C, const HeadView<R>& x) {
  const int64_t n = x.n(), dk = x.k.c, dvp = x.v.c;
  HlaSummary<R> s;
  s.identity = false;
  s.a = x.n0;
  s.b = x.n0 + n;
  const std::vector<R> bS = cumsum(p.has_S ? x.g[p.gS] : nullptr, n);
  const std::vector<R> bP = cumsum(p.has_P ? x.g[p.gP] : nullptr, n);
  const std::vector<R> bO = cumsum(x.g[p.gO], n);
  s.lS = p.has_S ? bS[n - 1] : R(0);
  s.lP = p.has_P ? bP[n - 1] : R(0);
  s.lO = bO[n - 1];
  // local zero-carry run: U^X, H^X and the final states S_X, P_X, Y_X
  Mat<R> U, Hh;
  MRef<const R> key = x.k, val = x.v;
  PrimArgs<R> a;
  a.q = x.q;
  a.n0 = x.n0;
  if (p.has_S) {
    U = Mat<R>(n, dk);
    a.k = x.k, a.v = x.k, a.g = x.g[p.gS];
    s.S = slot0(prim_forward<R>(PForm::chunk, C, a, {}, U), dk, dk);
    if (p.ridge != 0) axpy<R>(U, x.q, R(p.ridge));
    key = U;
  }
  if (p.has_P) {
    Hh = Mat<R>(n, dvp);
    a.k = x.k, a.v = x.v, a.g = x.g[p.gP];
    s.P = slot0(prim_forward<R>(PForm::chunk, C, a, {}, Hh), dk, dvp);
    val = Hh;
  }
  Mat<R> Odummy(n, dvp);
  a.k = key, a.v = val, a.g = x.g[p.gO];
  s.Y = slot0(prim_forward<R>(PForm::chunk, C, a, {}, Odummy), dk, dvp);
  // cross terms (closed forms of docs/math/HLA.md §3.4, §5.3, §6.3), w_i = e^{bO_e - bO_i}, the
  // exponent summed directly (sum_{i<r<n} gO_r) so that a reset token (g = -inf) gives exact
  // zeros, never -inf - -inf
  std::vector<R> w(static_cast<size_t>(n));
  {
    R c = 0;
    const R* gO = x.g[p.gO];
    w[n - 1] = 1;
    for (int64_t i = n - 1; i > 0; --i) w[i - 1] = std::exp(c += gO ? gO[i] : R(0));
  }
  auto wt = [&](const std::vector<R>& extra) {
    std::vector<R> out(w);
    for (int64_t i = 0; i < n; ++i) out[i] *= std::exp(extra[i]);
    return out;
  };
  switch (p.op) {
    case Op::hla2:  // Z = Q^T diag(w e^{bS}) V'
      s.X1 = weighted_tn<R>(x.q, wt(bS), x.v);
      break;
    case Op::ahla:  // R = K^T diag(w e^{bP}) Q
      s.X1 = weighted_tn<R>(x.k, wt(bP), x.q);
      break;
    default: {  // hla3: Phi = Q^T diag(w e^{bS}) H^X, Psi = U^T diag(w e^{bP}) Q, Omega = Q^T diag(w e^{bS+bP}) Q
      std::vector<R> bSP(bS);
      for (int64_t i = 0; i < n; ++i) bSP[i] += bP[i];
      // Psi uses the zero-carry U without ridge (hla3 takes no ridge)
      s.X1 = weighted_tn<R>(x.q, wt(bS), Hh);
      s.X2 = weighted_tn<R>(U, wt(bP), x.q);
      s.X3 = weighted_tn<R>(x.q, wt(bSP), x.q);
    }
  }
  return s;
}

template <class R>
HlaSummary<R> hla_compose(const OpPlan& p, const HlaSummary<R>& A, const HlaSummary<R>& B) {
  if (A.identity) return B;
  if (B.identity) return A;
  HlaSummary<R> C;
  C.identity = false;
  C.a = A.a;
  C.b = B.b;
  C.lS = A.lS + B.lS;
  C.lP = A.lP + B.lP;
  C.lO = A.lO + B.lO;
  const R rSA = std::exp(A.lS), rPA = std::exp(A.lP), rSB = std::exp(B.lS),
          rPB = std::exp(B.lP), rOB = std::exp(B.lO);
  switch (p.op) {
    case Op::hla2:
      C.S = lin(rSB, A.S, R(1), B.S);
      C.X1 = lin(rOB, A.X1, rSA, B.X1);     // Z_AB = rY_B Z_A + rS_A Z_B
      C.Y = lin(rOB, A.Y, R(1), B.Y);       // Y_AB = rY_B Y_A + Y_B + S_A Z_B
      add(C.Y, mm(A.S, B.X1));
      break;
    case Op::ahla:
      C.P = lin(rPB, A.P, R(1), B.P);
      C.X1 = lin(rOB, A.X1, rPA, B.X1);     // R_AB = rE_B R_A + rP_A R_B
      C.Y = lin(rOB, A.Y, R(1), B.Y);       // E_AB = rE_B E_A + E_B + R_B P_A
      add(C.Y, mm(B.X1, A.P));
      break;
    default: {
      C.S = lin(rSB, A.S, R(1), B.S);
      C.P = lin(rPB, A.P, R(1), B.P);
      const Mat<R> OmPA = mm(B.X3, A.P);   // Omega_B P_A
      C.Y = lin(rOB, A.Y, R(1), B.Y);       // X_AB = rX_B X_A + X_B + S_A Phi_B + Psi_B P_A + S_A Omega_B P_A
      add(C.Y, mm(A.S, B.X1));
      add(C.Y, mm(B.X2, A.P));
      add(C.Y, mm(A.S, OmPA));
      C.X1 = lin(rOB, A.X1, rSA, B.X1);     // Phi_AB = rX_B Phi_A + rS_A Phi_B + rS_A Omega_B P_A
      axpy<R>(C.X1, OmPA, rSA);
      C.X2 = lin(rOB, A.X2, rPA, B.X2);     // Psi_AB = rX_B Psi_A + rP_A Psi_B + rP_A S_A Omega_B
      axpy<R>(C.X2, mm(A.S, B.X3), rPA);
      C.X3 = lin(rOB, A.X3, rSA * rPA, B.X3);  // Omega_AB = rX_B Omega_A + rS_A rP_A Omega_B
    }
  }
  return C;
}

template <class R>
OpState<R> hla_apply(const OpPlan& p, const HlaSummary<R>& X, const OpState<R>& st, int64_t dk,
                     int64_t dvp) {
  if (X.identity) return st;
  const Mat<R> S = slot0(st.S, dk, dk), P = slot0(st.P, dk, dvp), Y = slot0(st.H, dk, dvp);
  OpState<R> out;
  Mat<R> Yn = lin(std::exp(X.lO), Y, R(1), X.Y);
  switch (p.op) {
    case Op::hla2:  // (rS S + S_X, rY Y + Y_X + S Z_X)
      add(Yn, mm(S, X.X1));
      break;
    case Op::ahla:  // (rP P + P_X, rE E + E_X + R_X P)
      add(Yn, mm(X.X1, P));
      break;
    default:  // (.., .., rX X + X_X + S Phi + Psi P + S Omega P)
      add(Yn, mm(S, X.X1));
      add(Yn, mm(X.X2, P));
      add(Yn, mm(S, mm(X.X3, P)));
  }
  if (p.has_S) out.S = as_canon(lin(std::exp(X.lS), S, R(1), X.S));
  if (p.has_P) out.P = as_canon(lin(std::exp(X.lP), P, R(1), X.P));
  out.H = as_canon(std::move(Yn));
  return out;
}

template <class R>
OpState<R> hla_scan_forward(const OpPlan& p, int64_t C, const HeadView<R>& x,
                            const OpState<R>& init, MRef<R> Oraw) {
  const int64_t n = x.n(), dk = x.k.c, dvp = x.v.c;
  const auto segs = segments(x.n0, n, C);
  std::vector<HlaSummary<R>> sums(segs.size());
  for (size_t c = 0; c < segs.size(); ++c)
    sums[c] = hla_summarize(p, C, x.rows(segs[c].first - x.n0, segs[c].second - x.n0));
  HlaSummary<R> total;
  const auto prefix = blelloch_exclusive(
      sums, HlaSummary<R>{}, [&](const HlaSummary<R>& A, const HlaSummary<R>& B) {
        return hla_compose(p, A, B);
      },
      &total);
  for (size_t c = 0; c < segs.size(); ++c) {
    const int64_t i0 = segs[c].first - x.n0, i1 = segs[c].second - x.n0;
    op_forward_raw(p, PForm::chunk, C, x.rows(i0, i1), hla_apply(p, prefix[c], init, dk, dvp),
                   Oraw.rows(i0, i1));
  }
  return hla_apply(p, total, init, dk, dvp);
}

#define HILA_INSTANTIATE(R)                                                                     \
  template HlaSummary<R> hla_summarize<R>(const OpPlan&, int64_t, const HeadView<R>&);          \
  template HlaSummary<R> hla_compose<R>(const OpPlan&, const HlaSummary<R>&,                    \
                                        const HlaSummary<R>&);                                  \
  template OpState<R> hla_apply<R>(const OpPlan&, const HlaSummary<R>&, const OpState<R>&,      \
                                   int64_t, int64_t);                                           \
  template OpState<R> hla_scan_forward<R>(const OpPlan&, int64_t, const HeadView<R>&,           \
                                          const OpState<R>&, MRef<R>);
HILA_INSTANTIATE(float)
HILA_INSTANTIATE(double)
#undef HILA_INSTANTIATE

}  // namespace hila::cpu
