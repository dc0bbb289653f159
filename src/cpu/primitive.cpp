// SPDX-License-Identifier: Apache-2.0
// Forms of the hila primitive (see primitive.h). The segment routines below are the masked-matrix
// form over rows [s, e) with an incoming canonical state: docs/math/LOGLINEAR.md §3.3 (mamba) and §6.4
// (delta). The naive form is one segment over the whole call (= the masked-matrix oracle, §3.1 /
// §6.2); the chunk form cuts the call into segments that never cross a multiple of C, so only
// levels <= log2 C occur inside a segment and the O(T^2) work becomes O(T C).
#include "cpu/primitive.h"

#include <cmath>
#include <algorithm>
#include <stdexcept>

#include "cpu/backend.h"
#include "cpu/blelloch.h"

namespace hila::cpu {

std::vector<std::pair<int64_t, int64_t>> segments(int64_t n0, int64_t n, int64_t C) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t s = n0, end = n0 + n; s < end;) {
    const int64_t e = std::min((s / C + 1) * C, end);
    out.emplace_back(s, e);
    s = e;
  }
  return out;
}

template <class R>
void rekey_add(Canon<R>& out, const Canon<R>& H, const Levels& lv, int64_t n, int64_t e, R f,
               const Mat<R>* M, int64_t dk, int64_t dv) {
  for (int l = 0; l < static_cast<int>(H.slot.size()); ++l) {
    const Mat<R>* X = H.get(l);
    if (!X || !lv.live(n, l)) continue;
    Mat<R>& Y = out.at(lv.read_level(e, n, l), dk, dv);
    if (M) {
      gemm<R>(Y, *M, false, *X, false, f, R(1));  // [dk,dk] x [dk,dv]
    } else {
      axpy<R>(Y, *X, f);
    }
  }
}

namespace {

// Per-row vectors of a segment (storage from the block cache of linalg.h).
template <class R>
using Vec = std::vector<R, NoInitAlloc<R>>;

// m as an [r, c] matrix: kept when it has that shape, else a new zero-filled one (so entries a
// user never writes, such as those above a diagonal, stay 0 across reuses).
template <class R>
void fit(Mat<R>& m, int64_t r, int64_t c) {
  if (m.r != r || m.c != c) m = Mat<R>(r, c);
}
// m as a zero [r, c] matrix (storage kept when it has that shape)
template <class R>
void fit_zero(Mat<R>& m, int64_t r, int64_t c) {
  if (m.r == r && m.c == c) {
    std::fill(m.row(0), m.row(0) + r * c, R(0));
  } else {
    m = Mat<R>(r, c);
  }
}

// Per-segment quantities shared by forward, backward and summaries. Rows [i0, i1) of the call,
// absolute positions [s, e).
//
// Decays inside a segment are sums of log-gates over (j, i], and every one is summed directly
// rather than as a difference of cumulative sums b_i - b_j: a reset token (g = -inf, or a finite g
// so negative that exp(g) underflows) makes b_i huge or -inf, and b_i - b_j would then cancel the
// gates that follow it (or give -inf - -inf = NaN). With direct sums a decay across a reset is
// exactly 0 and a decay after it is exp of the gates after it alone, as in the serial form.
template <class R>
struct Seg {
  int64_t i0 = 0, i1 = 0, nr = 0, s = 0, e = 0;
  Vec<R> b;    // b[i] = sum_{r<=i} g_r: decay exp(b[i]) of the incoming state at row i
  Vec<R> rest; // rest[j] = sum_{j<r<nr} g_r: decay exp(rest[j]) from row j to the end
  R B = 0;             // sum of all g: decay exp(B) across the segment
  // their exponentials, each formed once: ea[i] = exp(g_i) (the gate of row i), eb[i] = exp(b[i]),
  // er[j] = exp(rest[j])
  Vec<R> ea, eb, er;
  MRef<const R> q, k, v;
  // delta only (docs/math/LOGLINEAR.md §6.4): Tm = (I + tril_-1(diag(beta) K K^T))^-1; W (wy())
  Mat<R> bk, KK, Tm;

  // ut: form the UT quantities bk, KK, Tm, W (delta; not for the gated-inverse form below)
  Seg() = default;
  Seg(const PrimArgs<R>& a, int64_t i0_, int64_t i1_, bool ut = true) { form(a, i0_, i1_, ut); }
  // (re)forms every member for rows [i0_, i1_), reusing storage (fit)
  void form(const PrimArgs<R>& a, int64_t i0_, int64_t i1_, bool ut = true) {
    i0 = i0_, i1 = i1_, nr = i1_ - i0_, s = a.n0 + i0_, e = a.n0 + i1_;
    B = 0;
    w_ok = false;
    b.resize(static_cast<size_t>(nr));
    q = a.q.rows(i0, i1);
    k = a.k.rows(i0, i1);
    v = a.v.rows(i0, i1);
    R c = 0;
    for (int64_t i = 0; i < nr; ++i) b[i] = (c += a.gate(i0 + i));
    B = nr ? b[nr - 1] : R(0);
    rest.assign(static_cast<size_t>(nr), R(0));
    c = 0;
    for (int64_t j = nr - 1; j > 0; --j) rest[j - 1] = (c += a.gate(i0 + j));
    ea.resize(static_cast<size_t>(nr));
    eb.resize(static_cast<size_t>(nr));
    er.resize(static_cast<size_t>(nr));
    for (int64_t i = 0; i < nr; ++i) {
      ea[i] = std::exp(a.gate(i0 + i));
      eb[i] = std::exp(b[i]);
      er[i] = std::exp(rest[i]);
    }
    if (!a.delta || !ut) return;
    const int64_t dk = a.dk();
    fit(bk, nr, dk);
    for (int64_t i = 0; i < nr; ++i) scaled(bk.row(i), k.row(i), a.beta[i0 + i], dk);
    fit(KK, nr, nr);
    gemm<R>(KK, k, false, k, true, R(1), R(0), kCLower | kCUnset);  // [R,dk] x [dk,R], strict lower read
    fit(Tm, nr, nr);  // every entry written
    unit_lower_inverse(Tm.row(0), nr, KK.row(0), nr, a.beta + i0, nr);
  }
  // W = Tm diag(beta) K [R, dk], formed on first use: only the erase of incoming levels (and a
  // scan summary) reads it, so a segment without a live incoming level never forms it
  const Mat<R>& wy() const {
    if (!w_ok) {
      fit(W, nr, bk.c);
      gemm<R>(W, Tm, false, bk, false, R(1), R(0), kALower);  // [R,R] x [R,dk]
      w_ok = true;
    }
    return W;
  }
  // Whether the segment reads an incoming level of Hin (a live, non-zero slot at s).
  bool reads(const PrimArgs<R>& a, const Canon<R>& Hin) const {
    for (int l = 0; l < static_cast<int>(Hin.slot.size()); ++l)
      if (Hin.get(l) && a.lv.live(s, l)) return true;
    return false;
  }

  // Decay matrix E[i,j] = exp(sum_{j<r<=i} g_r) = prod_{j<r<=i} a_r, a_r = exp(g_r), on j <= i:
  // row by row, E[i, :i] = a_i E[i-1, :i] and E[i,i] = 1 (nr exps and O(nr^2) multiplies, the
  // cost of the mask itself; the row update is a unit-stride loop), so E is exactly 0 across a
  // reset (a_r = 0) and, after one, the product of the gates after it alone.
  Mat<R> decay(const PrimArgs<R>&) const {
    Mat<R> E(nr, nr);
    decay_into(E);
    return E;
  }
  // the same into E [nr, nr] whose entries above the diagonal are 0 (left alone)
  void decay_into(Mat<R>& E) const {
    for (int64_t i = 0; i < nr; ++i) {
      if (i > 0) scaled(E.row(i), E.row(i - 1), ea[i], i);
      E(i, i) = 1;
    }
  }
  // Mixing mask M[i,j] = lam_i^{l(s+i,s+j)} E[i,j] on j <= i (docs/math/LOGLINEAR.md §3.1).
  // Flat (lambda = 1): M = E.
  // (in place: E holds the decay matrix on entry, the mask on return)
  void mask_in_place(const PrimArgs<R>& a, Mat<R>& E) const {
    if (!a.lv.fenwick) return;
    for (int64_t i = 0; i < nr; ++i)
      level_ranges(a.lv, s, i, [&](int l, int64_t j0, int64_t j1) {
        const R lam = a.lam(i0 + i, l);
        R* __restrict e = E.row(i);
        for (int64_t j = j0; j < j1; ++j) e[j] *= lam;
      });
  }
  // X = tril(q k^T) and, for delta, Dd = X Tm. The un-masked intra-segment scores are
  // D = Dd (delta) or X (mamba); the caller picks (no copy of X for mamba).
  void scores(const PrimArgs<R>& a, Mat<R>& X, Mat<R>& Dd) const {
    fit(X, nr, nr);
    gemm<R>(X, q, false, k, true, R(1), R(0), kCLower | kCUnset);  // [R,dk] x [dk,R], upper set below
    for (int64_t i = 0; i < nr; ++i) std::fill(X.row(i) + i + 1, X.row(i) + nr, R(0));
    if (a.delta) {  // [R,R] x [R,R], lower x unit lower: D is lower (its upper triangle exactly 0)
      fit(Dd, nr, nr);
      gemm<R>(Dd, X, false, Tm, false, R(1), R(0), kALower);
    }
  }
  // Effective queries Q~ = q - D diag(beta) K (delta); empty for mamba, where Q~ = q (see qt).
  // (into Qt [R, dk]; left alone for mamba)
  void effective_q(const PrimArgs<R>& a, const Mat<R>& D, Mat<R>& Qt) const {
    if (!a.delta) return;
    fit(Qt, nr, q.c);
    for (int64_t i = 0; i < nr; ++i) std::copy(q.row(i), q.row(i) + q.c, Qt.row(i));
    gemm<R>(Qt, D, false, bk, false, R(-1), R(1), kALower);  // [R,R] x [R,dk]
  }
  MRef<const R> qt(const PrimArgs<R>& a, const Mat<R>& Qd) const { return a.delta ? Qd.ref() : q; }
  // Target slot of each own token in the state at e (tok [R]) and the distinct ones, ascending
  // (lvls): the token groups, row j in group tl when tok[j] == tl.
  void token_groups(const PrimArgs<R>& a, std::vector<int>& tok, std::vector<int>& lvls) const {
    tok.resize(static_cast<size_t>(nr));
    lvls.clear();
    for (int64_t j = 0; j < nr; ++j) {
      const int tl = a.lv.level(e, s + j);
      tok[j] = tl;
      if (std::find(lvls.begin(), lvls.end(), tl) == lvls.end()) lvls.push_back(tl);
    }
    std::sort(lvls.begin(), lvls.end());
  }

 private:
  mutable Mat<R> W;
  mutable bool w_ok = false;  // W formed for this segment
};

// Temporaries of seg_forward and seg_backward, kept across the segments of a call and, one per
// thread, across calls (fit: a call of another shape re-forms them; what stays held is the work
// space of the largest segment seen, O(slots R dv + R^2) values). The
// [R, R] members whose upper triangle the code never writes (P, E, M) keep it 0 across reuses.
// Per-slot matrices (Z, A, kD) are in use where the matching flag is set.
template <class R>
struct SegWork {
  Mat<R> X, Dd, Qd, P, bv, T, Y, E, M, dQt, S, dW, dYd, WH, Yr, cdO, dP, dbv, dD, dbk, TdW, dXm, dA;
  Vec<R> db, coef, dGcol, pd;
  std::vector<Mat<R>> Z, A, kD;
  std::vector<char> Zset, Aset, kDset;
  std::vector<int> tok, lvls;  // token groups (Seg::token_groups)
};

// n per-slot matrices, none in use (storage kept)
template <class R>
void slots(std::vector<Mat<R>>& m, std::vector<char>& set, size_t n) {
  if (m.size() < n) m.resize(n);
  set.assign(n, 0);
}

// Forward over one segment: O rows (optional) and the outgoing canonical state at e (empty
// when !state).
template <class R>
HILA_CPU_CLONES Canon<R> seg_forward(const PrimArgs<R>& a, const Seg<R>& sg, const Canon<R>& Hin,
                                     SegWork<R>& wk, MRef<R>* O = nullptr, bool state = true) {
  const int64_t nr = sg.nr, dk = a.dk(), dv = a.dv();
  if (O) {
    sg.scores(a, wk.X, wk.Dd);
    const Mat<R>& D = a.delta ? wk.Dd : wk.X;
    Mat<R>& P = wk.P;  // P = M o D, zero above the diagonal
    fit(P, nr, nr);
    sg.decay_into(P);
    sg.mask_in_place(a, P);
    for (int64_t i = 0; i < nr; ++i) hadamard_into(P.row(i), D.row(i), i + 1);
    Mat<R>& bv = wk.bv;  // diag(beta) V (delta) or V
    if (a.delta) {
      fit(bv, nr, dv);
      for (int64_t i = 0; i < nr; ++i) scaled(bv.row(i), sg.v.row(i), a.beta[sg.i0 + i], dv);
    }
    MRef<R> Or = *O;
    gemm<R>(Or, P, false, a.delta ? bv.ref() : sg.v, false, R(1), R(0), kALower);  // [R,R] x [R,dv]
    const bool reads = sg.reads(a, Hin);
    if (reads) sg.effective_q(a, D, wk.Qd);
    const MRef<const R> Qt = sg.qt(a, wk.Qd);  // read only when reads
    for (int l = 0; l < static_cast<int>(Hin.slot.size()); ++l) {
      const Mat<R>* H = Hin.get(l);
      if (!H || !a.lv.live(sg.s, l)) continue;
      Mat<R>& T = wk.T;
      fit(T, nr, dv);
      gemm<R>(T, Qt, false, *H, false);  // [R,dk] x [dk,dv]
      for (int64_t i = 0; i < nr; ++i) {
        const R coef = a.lambda(sg.i0 + i, a.lv.read_level(sg.s + i, sg.s, l)) * sg.eb[i];
        R* __restrict o = Or.row(i);
        const R* __restrict t = T.row(i);
        for (int64_t j = 0; j < dv; ++j) o[j] += coef * t[j];
      }
    }
  }
  Canon<R> Hout;
  if (!state) return Hout;
  Hout.resize(a.lv.slots(sg.e));
  const R eB = std::exp(sg.B);
  // delta: every live level is erased by the segment, e^B (H - K^T (W H)), and the new tokens add
  // K^T Tm Y; per outgoing slot l' one product K^T Z[l'] with
  // Z[l'] = sum of Tm Y of the tokens into l' - e^B sum of W H of the levels re-keyed into l'.
  std::vector<Mat<R>>& Z = wk.Z;
  std::vector<char>& Zset = wk.Zset;
  slots(Z, Zset, a.delta ? Hout.slot.size() : 0);
  if (a.delta) {
    for (int l = 0; l < static_cast<int>(Hin.slot.size()); ++l) {
      const Mat<R>* H = Hin.get(l);
      if (!H || !a.lv.live(sg.s, l)) continue;
      const int to = a.lv.read_level(sg.e, sg.s, l);
      axpy<R>(Hout.at(to, dk, dv), *H, eB);
      const bool first = !Zset[to];
      if (first) fit(Z[to], nr, dv);
      Zset[to] = 1;
      gemm<R>(Z[to], sg.wy(), false, *H, false, -eB, first ? R(0) : R(1));  // [R,dk] x [dk,dv]
    }
  } else {
    rekey_add<R>(Hout, Hin, a.lv, sg.s, sg.e, eB, nullptr, dk, dv);
  }
  sg.token_groups(a, wk.tok, wk.lvls);
  for (const int tl : wk.lvls) {
    Mat<R>& Y = wk.Y;  // diag(beta e^{B-b} 1_tl) V
    fit(Y, nr, dv);
    for (int64_t j = 0; j < nr; ++j) {
      const R m = wk.tok[j] == tl ? R(1) : R(0);
      scaled(Y.row(j), sg.v.row(j), m * a.b(sg.i0 + j) * sg.er[j], dv);
    }
    if (!a.delta) {
      gemm<R>(Hout.at(tl, dk, dv), sg.k, true, Y, false, R(1), R(1));  // [dk,R] x [R,dv]
    } else if (!Zset[tl]) {
      fit(Z[tl], nr, dv);
      Zset[tl] = 1;
      gemm<R>(Z[tl], sg.Tm, false, Y, false, R(1), R(0), kALower);  // [R,R] x [R,dv]
    } else {
      gemm<R>(Z[tl], sg.Tm, false, Y, false, R(1), R(1), kALower);
    }
  }
  for (size_t l = 0; l < Zset.size(); ++l)
    if (Zset[l]) gemm<R>(Hout.at(static_cast<int>(l), dk, dv), sg.k, true, Z[l], false, R(1), R(1));  // [dk,R] x [R,dv]
  return Hout;
}

// Reverse of seg_forward (docs/math/LOGLINEAR.md §5.2 for mamba, §6.5 for delta; the mamba path is the
// delta path with Tm = I and beta = 1). Accumulates rows [i0, i1) of G; returns the adjoint of Hin.
template <class R>
HILA_CPU_CLONES Canon<R> seg_backward(const PrimArgs<R>& a, const Seg<R>& sg, const Canon<R>& Hin,
                                      MRef<const R> dO, const Canon<R>& dHout, PrimGrads<R>& G,
                                      SegWork<R>& wk) {
  const int64_t nr = sg.nr, dk = a.dk(), dv = a.dv(), i0 = sg.i0;
  const bool delta = a.delta, fen = a.lv.fenwick;
  // without a live incoming level there are no reads, no erase and no re-key: Q~, W and their
  // cotangents are not formed
  const bool reads = sg.reads(a, Hin);
  sg.scores(a, wk.X, wk.Dd);
  const Mat<R>& D = delta ? wk.Dd : wk.X;
  if (reads) sg.effective_q(a, D, wk.Qd);
  const MRef<const R> Qt = sg.qt(a, wk.Qd);  // read only when reads
  Mat<R>& E = wk.E;
  fit(E, nr, nr);
  sg.decay_into(E);
  if (fen) {
    fit(wk.M, nr, nr);
    for (int64_t i = 0; i < nr; ++i) std::copy(E.row(i), E.row(i) + i + 1, wk.M.row(i));
    sg.mask_in_place(a, wk.M);
  }
  const Mat<R>& M = fen ? wk.M : E;
  Vec<R>& db = wk.db;
  db.assign(static_cast<size_t>(nr), R(0));
  R dB = 0;
  // delta: dNm = -tril_-1(S), S = Tm^T dTm Tm^T. Each term a b^T of dTm adds (Tm^T a)(Tm b)^T to
  // S, with both factors at hand (Tm^T K dH' and Tm Y of a token group, Tm^T dW and W, D and
  // dD Tm^T): no dTm is formed. S [R, R], strict lower read.
  Mat<R>&dQt = wk.dQt, &S = wk.S, &dW = wk.dW;
  bool have_dW = false;  // dW: formed by the erase of a level whose re-keyed slot has a cotangent
  if (reads) fit_zero(dQt, nr, dk);
  if (delta) fit_zero(S, nr, nr);
  MRef<R> dq = G.dq.rows(i0, sg.i1), dk_ = G.dk.rows(i0, sg.i1), dv_ = G.dv.rows(i0, sg.i1);
  R* dbeta = delta ? G.dbeta.data() + i0 : nullptr;
  auto dlam = [&](int64_t i, int l) -> R& { return G.dlam(i0 + i, l); };

  // new-token groups: Z_tl = K^T Tm diag(beta w 1_tl) V (none without a cotangent of the state)
  bool any_dout = false;
  for (int l = 0; l < static_cast<int>(dHout.slot.size()); ++l) any_dout |= dHout.get(l) != nullptr;
  if (any_dout) {
    sg.token_groups(a, wk.tok, wk.lvls);
  } else {
    wk.lvls.clear();
  }
  // K dH'[l'] [R, dv] per outgoing slot, formed once: the tokens into l' and (delta) the erase of
  // the levels re-keyed into l' both read it
  std::vector<Mat<R>>& kD = wk.kD;
  slots(kD, wk.kDset, dHout.slot.size());
  auto kd = [&](int l) -> const Mat<R>& {
    if (!wk.kDset[l]) {
      fit(kD[l], nr, dv);
      gemm<R>(kD[l], sg.k, false, *dHout.get(l), false);  // [R,dk] x [dk,dv]
      wk.kDset[l] = 1;
    }
    return kD[l];
  };
  // delta: dK += A[l'] dH'[l']^T once per slot, A[l'] = sum of Tm Y of the tokens into l'
  // - e^B sum of W H of the levels re-keyed into l' (the forward's Z)
  std::vector<Mat<R>>& A = wk.A;
  std::vector<char>& Aset = wk.Aset;
  slots(A, Aset, delta ? dHout.slot.size() : 0);
  for (const int tl : wk.lvls) {
    const Mat<R>* Dz = dHout.get(tl);
    if (!Dz) continue;
    Mat<R>& Y = wk.Y;
    fit(Y, nr, dv);
    Vec<R>& coef = wk.coef;
    coef.resize(static_cast<size_t>(nr));
    for (int64_t j = 0; j < nr; ++j) {
      const R m = wk.tok[j] == tl ? R(1) : R(0);
      coef[j] = m * a.b(i0 + j) * sg.er[j];
      scaled(Y.row(j), sg.v.row(j), coef[j], dv);
    }
    const Mat<R>& kDz = kd(tl);
    Mat<R>& dYd = wk.dYd;
    if (delta) {  // Z = K^T Tm Y:  dTm += (K dH') Y^T
      fit(A[tl], nr, dv);
      Aset[tl] = 1;
      gemm<R>(A[tl], sg.Tm, false, Y, false, R(1), R(0), kALower);  // Tm Y  [R,R] x [R,dv]
      fit(dYd, nr, dv);
      gemm<R>(dYd, sg.Tm, true, kDz, false, R(1), R(0), kAUpper);   // Tm^T K dH'  [R,R] x [R,dv]
      gemm<R>(S, dYd, false, A[tl], true, R(1), R(1), kCLower);  // [R,dv] x [dv,R]
    } else {
      gemm<R>(dk_, Y, false, *Dz, true, R(1), R(1));           // [R,dv] x [dv,dk]
    }
    const Mat<R>& dY = delta ? dYd : kDz;
    for (int64_t j = 0; j < nr; ++j) {
      const R tY = dot(dY.row(j), sg.v.row(j), dv);
      R* __restrict gv = dv_.row(j);
      const R* __restrict y = dY.row(j);
      for (int64_t c = 0; c < dv; ++c) gv[c] += coef[j] * y[c];
      const R w = sg.er[j];
      if (delta) dbeta[j] += w * (wk.tok[j] == tl ? R(1) : R(0)) * tY;
      const R dwm = coef[j] * tY;  // d/d(B - b_j)
      dB += dwm;
      db[j] -= dwm;
    }
  }
  // transitions (decay, erase, re-key) and reads of the incoming live levels
  Canon<R> dHin;
  dHin.resize(static_cast<int64_t>(Hin.slot.size()));
  const R eB = std::exp(sg.B);
  for (int l = 0; l < static_cast<int>(Hin.slot.size()); ++l) {
    const Mat<R>* H = Hin.get(l);
    if (!H || !a.lv.live(sg.s, l)) continue;
    Mat<R>& dX = dHin.at(l, dk, dv);
    if (const Mat<R>* Dout = dHout.get(a.lv.read_level(sg.e, sg.s, l))) {
      axpy<R>(dX, *Dout, eB);
      if (delta) {
        const int to = a.lv.read_level(sg.e, sg.s, l);
        Mat<R>& E = wk.WH;  // W H
        fit(E, nr, dv);
        gemm<R>(E, sg.wy(), false, *H, false);  // [R,dk] x [dk,dv]
        if (!Aset[to]) {
          fit(A[to], nr, dv);
          Aset[to] = 1;
          for (int64_t i = 0; i < nr; ++i) std::copy(E.row(i), E.row(i) + dv, A[to].row(i));
          scale<R>(A[to], -eB);
        } else {
          axpy<R>(A[to], E, -eB);
        }
        const Mat<R>& dE = kd(to);  // K dH' (times -e^B below)
        if (!have_dW) fit_zero(dW, nr, dk);
        have_dW = true;
        // d/dB of e^B <dH', H - K^T E> = e^B (<dH', H> - <K dH', E>): no [dk, dv] copy of H - K^T E
        dB += eB * (dot<R>(*Dout, *H) - dot<R>(dE, E));
        gemm<R>(dW, dE, false, *H, true, -eB, R(1));         // [R,dv] x [dv,dk]
        gemm<R>(dX, sg.wy(), true, dE, false, -eB, R(1));       // [dk,R] x [R,dv]
      } else {
        dB += eB * dot<R>(*Dout, *H);
      }
    }
    Mat<R>&Yr = wk.Yr, &cdO = wk.cdO;
    fit(Yr, nr, dk);
    gemm<R>(Yr, dO, false, *H, true);  // [R,dv] x [dv,dk]
    fit(cdO, nr, dv);
    for (int64_t i = 0; i < nr; ++i) {
      const int lvl = a.lv.read_level(sg.s + i, sg.s, l);
      const R eb = sg.eb[i];
      const R coef = a.lambda(i0 + i, lvl) * eb;
      const R* __restrict y = Yr.row(i);
      const R qY = dot(Qt.row(i), y, dk);
      R* __restrict dqt = dQt.row(i);
      for (int64_t c = 0; c < dk; ++c) dqt[c] += coef * y[c];
      if (fen) dlam(i, lvl) += eb * qY;
      db[i] += coef * qY;
      scaled(cdO.row(i), dO.row(i), coef, dv);
    }
    gemm<R>(dX, Qt, true, cdO, false, R(1), R(1));  // [dk,R] x [R,dv]
  }
  for (size_t l = 0; l < Aset.size(); ++l)
    if (Aset[l]) gemm<R>(dk_, A[l], false, *dHout.get(static_cast<int>(l)), true, R(1), R(1));  // [R,dv] x [dv,dk]
  // intra: O = (D o M) diag(beta) V
  {
    Mat<R>&bvd = wk.bv, &P = wk.P, &dP = wk.dP, &dbv = wk.dbv;  // bvd: diag(beta) V (delta; V for mamba)
    if (delta) {
      fit(bvd, nr, dv);
      for (int64_t i = 0; i < nr; ++i) scaled(bvd.row(i), sg.v.row(i), a.beta[i0 + i], dv);
    }
    const MRef<const R> bv = delta ? bvd.ref() : sg.v;
    fit(P, nr, nr);  // P = D o M, zero above the diagonal
    for (int64_t i = 0; i < nr; ++i) hadamard(P.row(i), D.row(i), M.row(i), i + 1);
    fit(dP, nr, nr);
    gemm<R>(dP, dO, false, bv, true, R(1), R(0), kCLower | kCUnset);  // [R,dv] x [dv,R], j <= i read
    fit(dbv, nr, dv);
    gemm<R>(dbv, P, true, dO, false, R(1), R(0), kAUpper);  // [R,R] x [R,dv]
    for (int64_t i = 0; i < nr; ++i) {
      const R bi = a.b(i0 + i);
      R* __restrict gv = dv_.row(i);
      const R* __restrict x = dbv.row(i);
      for (int64_t c = 0; c < dv; ++c) gv[c] += bi * x[c];
      if (delta) dbeta[i] += dot(x, sg.v.row(i), dv);
    }
    // dD = dP o M; dG = dP o D o M = d/d(b_i - b_j): db_i += sum_j dG_ij, db_j -= sum_i dG_ij
    Mat<R>& dD = wk.dD;
    fit_zero(dD, nr, nr);
    Vec<R>& dGcol = wk.dGcol;
    dGcol.assign(static_cast<size_t>(nr), R(0));
    Vec<R>& pd = wk.pd;  // dP o D of one row
    pd.resize(static_cast<size_t>(fen ? nr : 0));
    for (int64_t i = 0; i < nr; ++i) {
      const R *dPi = dP.row(i), *Di = D.row(i);
      db[i] += mask_row_backward(dPi, Di, M.row(i), dD.row(i), dGcol.data(), i + 1);
      if (fen) {  // dlam(i, l) += sum over the row's level-l run of dP o D o Gam
        const R* Ei = E.row(i);
        hadamard(pd.data(), dPi, Di, i + 1);
        level_ranges(a.lv, sg.s, i, [&](int l, int64_t j0, int64_t j1) {
          dlam(i, l) += dot(pd.data() + j0, Ei + j0, j1 - j0);
        });
      }
    }
    for (int64_t j = 0; j < nr; ++j) db[j] -= dGcol[j];
    if (reads) axpy<R>(dq, dQt);
    if (delta) {
      if (reads) {
        Mat<R>& dbk = wk.dbk;  // d(diag(beta) K)
        fit(dbk, nr, dk);
        gemm<R>(dD, dQt, false, sg.bk, true, R(-1), R(1));         // Q~ = q - D bk  [R,dk] x [dk,R]
        gemm<R>(dbk, D, true, dQt, false, R(-1), R(0), kAUpper);   // [R,R] x [R,dk]
        if (have_dW) {  // W = Tm bk: dTm += dW bk^T (S += (Tm^T dW) W^T), d(bk) += Tm^T dW
          Mat<R>& TdW = wk.TdW;
          fit(TdW, nr, dk);
          gemm<R>(TdW, sg.Tm, true, dW, false, R(1), R(0), kAUpper);  // [R,R] x [R,dk]
          gemm<R>(S, TdW, false, sg.wy(), true, R(1), R(1), kCLower);    // [R,dk] x [dk,R]
          axpy<R>(dbk, TdW);
        }
        for (int64_t i = 0; i < nr; ++i) {
          const R bi = a.beta[i0 + i];
          R* __restrict gk = dk_.row(i);
          const R* __restrict x = dbk.row(i);
          for (int64_t c = 0; c < dk; ++c) gk[c] += bi * x[c];
          dbeta[i] += dot(x, sg.k.row(i), dk);
        }
      }
    }
    Mat<R>& dXm = delta ? wk.dXm : dD;
    if (delta) {
      fit(dXm, nr, nr);
      gemm<R>(dXm, dD, false, sg.Tm, true, R(1), R(0), kCLower | kCUnset);  // D = X Tm, upper set below
      for (int64_t i = 0; i < nr; ++i) std::fill(dXm.row(i) + i + 1, dXm.row(i) + nr, R(0));
      // dTm += X^T dD:  S += Tm^T X^T dD Tm^T = D^T dXm; its strict lower triangle reads dXm(k, j)
      // at k > j alone (D^T upper), entries the fill above left as they were
      gemm<R>(S, D, true, dXm, false, R(1), R(1), kAUpper | kCLower);  // [R,R] x [R,R]
    }
    gemm<R>(dq, dXm, false, sg.k, false, R(1), R(1), kALower);  // [R,R] x [R,dk]
    gemm<R>(dk_, dXm, true, sg.q, false, R(1), R(1), kAUpper);  // [R,R] x [R,dk]
    // Tm = (I + Nm)^-1, Nm = tril_-1(diag(beta) K K^T):  dNm = -tril_-1(S);
    // dbeta += rowsum(dNm o K K^T), dK += (dA + dA^T) K with dA = diag(beta) dNm (one product:
    // dA + dA^T is formed)
    if (delta) {
      Mat<R>& dA = wk.dA;  // dA + dA^T, zero diagonal
      fit_zero(dA, nr, nr);
      for (int64_t i = 0; i < nr; ++i) {
        const R bi = a.beta[i0 + i];
        const R *Si = S.row(i), *KKi = sg.KK.row(i);
        R* __restrict di = dA.row(i);
        R sb = 0;
        for (int64_t j = 0; j < i; ++j) {
          const R dN = -Si[j];
          sb += dN * KKi[j];
          di[j] = bi * dN;
        }
        dbeta[i] += sb;
        for (int64_t j = 0; j < i; ++j) dA(j, i) = di[j];
      }
      gemm<R>(dk_, dA, false, sg.k, false, R(1), R(1));  // [R,R] x [R,dk]
    }
  }
  db[nr - 1] += dB;
  R acc = 0;
  for (int64_t i = nr - 1; i >= 0; --i) G.dg[i0 + i] = (acc += db[i]);
  // A reset token (exp(g) = 0 in R: g = -inf or below the underflow point) has dg = 0, as in the
  // serial form (dg_t = a_t <Hbar_t, H_{t-1}>): the telescoped sum above leaves only rounding there.
  for (int64_t i = 0; i < nr; ++i)
    if (sg.ea[i] == R(0)) G.dg[i0 + i] = 0;
  return dHin;
}

// ---- Flat delta rule (gdn) in the gated-inverse form (docs/math/LOGLINEAR.md §6.4) ----------
// The chunk form of a flat (non-Fenwick) delta primitive folds the decays into the inverse, so
// no [R, R] product with the ungated Tm (D = X Tm, Q~ = q - D diag(beta) K) is formed:
//   A = Gam o K K^T (strict lower),  Tg = (I + diag(beta) A)^-1,
//   [Wg | Ug] = Tg [diag(beta e^b) K | diag(beta) V],   Vn = Ug - Wg H,
//   O = diag(e^b) Q H + (X o Gam) Vn   (X = tril(Q K^T)),   H' = e^B H + K^T diag(e^{B-b}) Vn.
// Gam is the segment's decay matrix (Seg::decay: exactly 0 across a reset), e^b, e^{B-b}, e^B its
// direct-sum exponentials, so a reset only scales whole terms, as in the UT form.

template <class R>
struct GatedSeg {
  Mat<R> E;   // Gam [R, R], lower with unit diagonal, zero above
  Mat<R> A;   // Gam o K K^T [R, R], strict lower read
  Mat<R> Tg;  // (I + diag(beta) A)^-1 [R, R], unit lower, zero above
  Mat<R> Bm;  // [diag(beta e^b) K | diag(beta) V] [R, dk + dv]
  Mat<R> WU;  // [Wg | Ug] = Tg Bm [R, dk + dv]
  Mat<R> Vn;  // Ug - Wg H [R, dv]

  GatedSeg() = default;
  GatedSeg(const PrimArgs<R>& a, const Seg<R>& sg, const Mat<R>* H) { form(a, sg, H); }
  // (re)forms every member for segment sg with incoming state H (null: zero), reusing storage
  void form(const PrimArgs<R>& a, const Seg<R>& sg, const Mat<R>* H) {
    const int64_t nr = sg.nr, dk = a.dk(), dv = a.dv(), w = dk + dv;
    fit(E, nr, nr);
    sg.decay_into(E);
    fit(A, nr, nr);
    gemm<R>(A, sg.k, false, sg.k, true, R(1), R(0), kCLower | kCUnset);  // [R,dk] x [dk,R]
    for (int64_t i = 0; i < nr; ++i) hadamard_into(A.row(i), E.row(i), i);
    fit(Tg, nr, nr);  // every entry written
    unit_lower_inverse(Tg.row(0), nr, A.row(0), nr, a.beta + sg.i0, nr);
    fit(Bm, nr, w);
    for (int64_t i = 0; i < nr; ++i) {
      const R bi = a.beta[sg.i0 + i];
      scaled(Bm.row(i), sg.k.row(i), bi * sg.eb[i], dk);
      scaled(Bm.row(i) + dk, sg.v.row(i), bi, dv);
    }
    fit(WU, nr, w);
    gemm<R>(WU, Tg, false, Bm, false, R(1), R(0), kALower);  // [R,R] x [R,dk+dv]
    fit(Vn, nr, dv);
    for (int64_t i = 0; i < nr; ++i) std::copy(WU.row(i) + dk, WU.row(i) + w, Vn.row(i));
    if (H) gemm<R>(Vn, Wg(dk), false, *H, false, R(-1), R(1));  // [R,dk] x [dk,dv]
  }
  MRef<const R> Wg(int64_t dk) const { return {WU.row(0), WU.r, dk, WU.c}; }
};

// Temporaries of gated_forward and gated_backward, kept across the segments of a call and, one per
// thread, across calls (fit, as SegWork).
template <class R>
struct GatedWork {
  Mat<R> P, QH, Ver, X, dWU, KdH, dP, dX, Yr, cdO, dBm, t2, dKK;
  Vec<R> db, gcol;
};

// Outputs of one segment (O rows, optional) and the state at its end (Hout, optional).
template <class R>
HILA_CPU_CLONES void gated_forward(const PrimArgs<R>& a, const Seg<R>& sg, const GatedSeg<R>& gs,
                                   const Mat<R>* H, MRef<R>* O, Mat<R>* Hout, GatedWork<R>& wk) {
  const int64_t nr = sg.nr, dk = a.dk(), dv = a.dv();
  if (O) {
    MRef<R> Or = *O;
    Mat<R>& P = wk.P;  // P = X o Gam, zero above the diagonal
    fit(P, nr, nr);
    gemm<R>(P, sg.q, false, sg.k, true, R(1), R(0), kCLower | kCUnset);  // X [R,dk] x [dk,R]
    for (int64_t i = 0; i < nr; ++i) {
      hadamard_into(P.row(i), gs.E.row(i), i + 1);
      std::fill(P.row(i) + i + 1, P.row(i) + nr, R(0));
    }
    gemm<R>(Or, P, false, gs.Vn, false, R(1), R(0), kALower);  // [R,R] x [R,dv]
    if (H) {
      Mat<R>& T = wk.QH;
      fit(T, nr, dv);
      gemm<R>(T, sg.q, false, *H, false);  // [R,dk] x [dk,dv]
      for (int64_t i = 0; i < nr; ++i) {
        const R eb = sg.eb[i];
        const R* t = T.row(i);
        R* o = Or.row(i);
        for (int64_t c = 0; c < dv; ++c) o[c] += eb * t[c];
      }
    }
  }
  if (!Hout) return;
  *Hout = Mat<R>(dk, dv);
  if (H) axpy<R>(*Hout, *H, std::exp(sg.B));
  Mat<R>& Ver = wk.Ver;  // diag(e^{B-b}) Vn
  fit(Ver, nr, dv);
  for (int64_t j = 0; j < nr; ++j) scaled(Ver.row(j), gs.Vn.row(j), sg.er[j], dv);
  gemm<R>(*Hout, sg.k, true, Ver, false, R(1), R(1));  // [dk,R] x [R,dv]
}

// Reverse of gated_forward for one segment: accumulates rows [i0, i1) of G from dO and the
// cotangent dHout of the state at its end (null: none); returns the cotangent of H (empty when H
// is null). With d(.) the cotangents and Gam's log-gradient g = d(b_i - b_j):
//   dVn = (X o Gam)^T dO + diag(e^{B-b}) K dH',  dX o ... = dO Vn^T o Gam,  dWg = -dVn H^T,
//   dBm = Tg^T [dWg | dVn],  dN = -tril_-1(Tg^T dTg Tg^T) = -tril_-1(dBm WU^T),
//   N = diag(beta) A: dbeta += rowsum(dN o A), g += dN o N, dK += (dKK + dKK^T) K with
//   dKK = diag(beta) dN o Gam; and the reads, the state update and Bm's row scales.
template <class R>
HILA_CPU_CLONES Mat<R> gated_backward(const PrimArgs<R>& a, const Seg<R>& sg, const GatedSeg<R>& gs,
                                      const Mat<R>* H, MRef<const R> dO, const Mat<R>* dHout,
                                      PrimGrads<R>& G, GatedWork<R>& wk) {
  const int64_t nr = sg.nr, dk = a.dk(), dv = a.dv(), w = dk + dv, i0 = sg.i0;
  MRef<R> dq = G.dq.rows(i0, sg.i1), dk_ = G.dk.rows(i0, sg.i1), dv_ = G.dv.rows(i0, sg.i1);
  R* dbeta = G.dbeta.data() + i0;
  const R* beta = a.beta + i0;
  Vec<R>& db = wk.db;
  Vec<R>& gcol = wk.gcol;
  db.assign(static_cast<size_t>(nr), R(0));
  gcol.assign(static_cast<size_t>(nr), R(0));
  R dB = 0;
  const R eB = std::exp(sg.B);
  Mat<R> dH;
  if (H) dH = Mat<R>(dk, dv);
  // X and P = X o Gam (zero above the diagonal)
  Mat<R>& X = wk.X;
  fit(X, nr, nr);
  gemm<R>(X, sg.q, false, sg.k, true, R(1), R(0), kCLower | kCUnset);  // [R,dk] x [dk,R]
  Mat<R>& P = wk.P;
  fit(P, nr, nr);
  for (int64_t i = 0; i < nr; ++i) {
    hadamard(P.row(i), X.row(i), gs.E.row(i), i + 1);
    std::fill(P.row(i) + i + 1, P.row(i) + nr, R(0));
  }
  // dWU = [dWg | dVn]
  Mat<R>& dWU = wk.dWU;
  fit(dWU, nr, w);
  MRef<R> dVn{dWU.row(0) + dk, nr, dv, w}, dWg{dWU.row(0), nr, dk, w};
  gemm<R>(dVn, P, true, dO, false, R(1), R(0), kAUpper);  // [R,R] x [R,dv]
  if (dHout) {  // H' = e^B H + K^T diag(e^{B-b}) Vn
    Mat<R>& KdH = wk.KdH;
    fit(KdH, nr, dv);
    gemm<R>(KdH, sg.k, false, *dHout, false);  // [R,dk] x [dk,dv]
    Mat<R>& Ver = wk.Ver;
    fit(Ver, nr, dv);
    for (int64_t j = 0; j < nr; ++j) {
      const R er = sg.er[j];
      const R x = er * dot(KdH.row(j), gs.Vn.row(j), dv);  // d(B - b_j)
      dB += x;
      db[j] -= x;
      R* d = dVn.row(j);
      const R* kd = KdH.row(j);
      for (int64_t c = 0; c < dv; ++c) d[c] += er * kd[c];
      scaled(Ver.row(j), gs.Vn.row(j), er, dv);
    }
    gemm<R>(dk_, Ver, false, *dHout, true, R(1), R(1));  // [R,dv] x [dv,dk]
    if (H) {
      dB += eB * dot(dHout->row(0), H->row(0), dk * dv);
      axpy<R>(dH, *dHout, eB);
    }
  }
  // intra: O += (X o Gam) Vn
  {
    Mat<R>& dP = wk.dP;
    fit(dP, nr, nr);
    gemm<R>(dP, dO, false, gs.Vn, true, R(1), R(0), kCLower | kCUnset);  // [R,dv] x [dv,R]
    Mat<R>& dX = wk.dX;  // written on j <= i, zero above
    fit(dX, nr, nr);
    for (int64_t i = 0; i < nr; ++i)
      db[i] += mask_row_backward(dP.row(i), X.row(i), gs.E.row(i), dX.row(i), gcol.data(), i + 1);
    gemm<R>(dq, dX, false, sg.k, false, R(1), R(1), kALower);  // [R,R] x [R,dk]
    gemm<R>(dk_, dX, true, sg.q, false, R(1), R(1), kAUpper);  // [R,R] x [R,dk]
  }
  if (H) {  // O += diag(e^b) Q H;  Vn = Ug - Wg H
    Mat<R>& Yr = wk.Yr;
    fit(Yr, nr, dk);
    gemm<R>(Yr, dO, false, *H, true);  // [R,dv] x [dv,dk]
    Mat<R>& cdO = wk.cdO;
    fit(cdO, nr, dv);
    for (int64_t i = 0; i < nr; ++i) {
      const R eb = sg.eb[i];
      const R* y = Yr.row(i);
      R* d = dq.row(i);
      for (int64_t c = 0; c < dk; ++c) d[c] += eb * y[c];
      db[i] += eb * dot(sg.q.row(i), y, dk);
      scaled(cdO.row(i), dO.row(i), eb, dv);
    }
    gemm<R>(dH, sg.q, true, cdO, false, R(1), R(1));             // [dk,R] x [R,dv]
    gemm<R>(dWg, dVn, false, *H, true, R(-1), R(0));             // [R,dv] x [dv,dk]
    gemm<R>(dH, gs.Wg(dk), true, dVn, false, R(-1), R(1));       // [dk,R] x [R,dv]
  } else {
    for (int64_t i = 0; i < nr; ++i) std::fill(dWg.row(i), dWg.row(i) + dk, R(0));
  }
  // [Wg | Ug] = Tg Bm
  Mat<R>& dBm = wk.dBm;
  fit(dBm, nr, w);
  gemm<R>(dBm, gs.Tg, true, dWU, false, R(1), R(0), kAUpper);  // Tg^T dWU  [R,R] x [R,w]
  for (int64_t i = 0; i < nr; ++i) {
    const R bi = beta[i], f = bi * sg.eb[i];
    const R* dkb = dBm.row(i);
    const R* dvb = dBm.row(i) + dk;
    const R t = dot(dkb, sg.k.row(i), dk);
    dbeta[i] += sg.eb[i] * t + dot(dvb, sg.v.row(i), dv);
    db[i] += f * t;
    R* gk = dk_.row(i);
    for (int64_t c = 0; c < dk; ++c) gk[c] += f * dkb[c];
    R* gv = dv_.row(i);
    for (int64_t c = 0; c < dv; ++c) gv[c] += bi * dvb[c];
  }
  // Tg = (I + N)^-1, N = diag(beta) A:  dN = tril_-1(-Tg^T dTg Tg^T) with dTg = dWU Bm^T, that
  // is dN = tril_-1(-dBm WU^T)  (Tg^T dWU = dBm, Bm^T Tg^T = WU^T): one product, no dTg
  {
    Mat<R>& t2 = wk.t2;
    fit(t2, nr, nr);
    gemm<R>(t2, dBm, false, gs.WU, true, R(1), R(0), kCLower | kCUnset);  // [R,w] x [w,R], strict lower read
    Mat<R>& dKK = wk.dKK;  // written on j < i, zero elsewhere
    fit(dKK, nr, nr);
    for (int64_t i = 0; i < nr; ++i) {
      const R bi = beta[i];
      const R *t = t2.row(i), *Ai = gs.A.row(i), *Ei = gs.E.row(i);
      R* d = dKK.row(i);
      R sb = 0, sg_ = 0;
      for (int64_t j = 0; j < i; ++j) {
        const R dN = -t[j];
        const R x = dN * Ai[j];  // dN o A; times beta: dN o N = d(b_i - b_j)
        sb += x;
        sg_ += bi * x;
        gcol[j] += bi * x;
        d[j] = bi * dN * Ei[j];
      }
      dbeta[i] += sb;
      db[i] += sg_;
    }
    gemm<R>(dk_, dKK, false, sg.k, false, R(1), R(1), kALower);  // (dKK + dKK^T) K
    gemm<R>(dk_, dKK, true, sg.k, false, R(1), R(1), kAUpper);
  }
  for (int64_t j = 0; j < nr; ++j) db[j] -= gcol[j];
  db[nr - 1] += dB;
  R acc = 0;
  for (int64_t i = nr - 1; i >= 0; --i) G.dg[i0 + i] = (acc += db[i]);
  // a reset token has dg = 0 (as in seg_backward)
  for (int64_t i = 0; i < nr; ++i)
    if (sg.ea[i] == R(0)) G.dg[i0 + i] = 0;
  return dH;
}

// Whether a call takes the gated-inverse form: the chunk form of a flat delta primitive.
template <class R>
bool gated_form(PForm form, const PrimArgs<R>& a) {
  return form == PForm::chunk && a.delta && !a.lv.fenwick;
}

template <class R>
PrimGrads<R> make_grads(const PrimArgs<R>& a) {
  PrimGrads<R> G;
  const int64_t n = a.n();
  G.dq = Mat<R>(n, a.dk());
  G.dk = Mat<R>(n, a.dk());
  G.dv = Mat<R>(n, a.dv());
  G.dg.assign(static_cast<size_t>(n), R(0));
  if (a.delta) G.dbeta.assign(static_cast<size_t>(n), R(0));
  if (a.lv.fenwick) G.dlam = Mat<R>(n, a.lam.c);
  return G;
}

// Serial reverse-time adjoint of flat GLA (docs/math/HLA.md §7.3 specialised to one primitive):
//   Hbar_t = q_t do_t^T + a_{t+1} Hbar_{t+1};  dq_t = H_t do_t;  dk_t = Hbar_t v_t;
//   dv_t = Hbar_t^T k_t;  dg_t = a_t <Hbar_t, H_{t-1}>;  dH0 = a_0 Hbar_0.
// States are recomputed forward from checkpoints every kBlock tokens (no decay inversion).
template <class R>
PrimGrads<R> serial_backward_flat(const PrimArgs<R>& a, const Canon<R>& init, MRef<const R> dO,
                                  const Canon<R>& dfinal) {
  constexpr int64_t kBlock = 64;
  const int64_t n = a.n(), dk = a.dk(), dv = a.dv();
  PrimGrads<R> G = make_grads(a);
  std::vector<Mat<R>> ckpt;  // H_{t0-1} for each block start t0
  Mat<R> H = init.get(0) ? *init.get(0) : Mat<R>(dk, dv);
  auto advance = [&](Mat<R>& S, int64_t i) {
    scale<R>(S, std::exp(a.gate(i)));
    for (int64_t r = 0; r < dk; ++r)
      for (int64_t c = 0; c < dv; ++c) S(r, c) += a.k(i, r) * a.v(i, c);
  };
  for (int64_t i = 0; i < n; ++i) {
    if (i % kBlock == 0) ckpt.push_back(H);
    advance(H, i);
  }
  Mat<R> Hbar = dfinal.get(0) ? *dfinal.get(0) : Mat<R>(dk, dv);
  R a_next = 0;  // a_{t+1}; Hbar_{T-1} = q do^T + dH_T
  for (int64_t blk = (n + kBlock - 1) / kBlock - 1; blk >= 0; --blk) {
    const int64_t t0 = blk * kBlock, t1 = std::min(n, t0 + kBlock);
    std::vector<Mat<R>> Hs(static_cast<size_t>(t1 - t0 + 1));  // H_{t0-1} .. H_{t1-1}
    Hs[0] = ckpt[blk];
    for (int64_t i = t0; i < t1; ++i) {
      Hs[i - t0 + 1] = Hs[i - t0];
      advance(Hs[i - t0 + 1], i);
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      if (t < n - 1) scale<R>(Hbar, a_next);
      for (int64_t r = 0; r < dk; ++r)
        for (int64_t c = 0; c < dv; ++c) Hbar(r, c) += a.q(t, r) * dO(t, c);
      const Mat<R>& Ht = Hs[t - t0 + 1];
      const Mat<R>& Hp = Hs[t - t0];
      for (int64_t r = 0; r < dk; ++r) {
        G.dq(t, r) = dot(Ht.row(r), dO.row(t), dv);
        G.dk(t, r) = dot(Hbar.row(r), a.v.row(t), dv);
      }
      for (int64_t c = 0; c < dv; ++c) {
        R s = 0;
        for (int64_t r = 0; r < dk; ++r) s += Hbar(r, c) * a.k(t, r);
        G.dv(t, c) = s;
      }
      a_next = std::exp(a.gate(t));
      G.dg[t] = a_next * dot<R>(Hbar, Hp);
    }
  }
  G.dinit.resize(1);
  Mat<R> dH0 = Hbar;
  if (n > 0) scale<R>(dH0, a_next);
  G.dinit.slot[0] = std::move(dH0);
  return G;
}

}  // namespace

template <class R>
void prim_step(const PrimArgs<R>& a, int64_t i, int64_t t, Canon<R>& st, R* o) {
  const int64_t dk = a.dk(), dv = a.dv();
  const Levels& lv = a.lv;
  if (static_cast<int64_t>(st.slot.size()) < lv.slots(t + 1)) st.resize(lv.slots(t + 1));
  const R at = std::exp(a.gate(i)), bt = a.b(i);
  const R* q = a.q.row(i);
  const R* k = a.k.row(i);
  const R* v = a.v.row(i);
  // o = lam^0 beta (q.k) v + sum_live lam^l H[l]^T q, after decay (and erase) of every live level
  const R diag = a.lambda(i, 0) * bt * dot(q, k, dk);
  for (int64_t c = 0; c < dv; ++c) o[c] = diag * v[c];
  std::vector<R> kH(static_cast<size_t>(dv));
  for (int l = 0; l < static_cast<int>(st.slot.size()); ++l) {
    if (!lv.live(t, l) || st.slot[l].empty()) continue;
    Mat<R>& H = st.slot[l];
    if (a.delta) {  // rank-1 erase: H <- a (H - beta k (k^T H)), O(dk dv) per level
      std::fill(kH.begin(), kH.end(), R(0));
      for (int64_t r = 0; r < dk; ++r)
        for (int64_t c = 0; c < dv; ++c) kH[c] += k[r] * H(r, c);
      for (int64_t r = 0; r < dk; ++r)
        for (int64_t c = 0; c < dv; ++c) H(r, c) = at * (H(r, c) - bt * k[r] * kH[c]);
    } else {
      scale<R>(H, at);
    }
    const R lam = a.lambda(i, lv.read_level(t, t, l));
    for (int64_t r = 0; r < dk; ++r)
      for (int64_t c = 0; c < dv; ++c) o[c] += lam * q[r] * H(r, c);
  }
  // merge: flat adds to its one slot; Fenwick moves levels 1..r and the token into slot r+1
  Mat<R>* target;
  if (lv.fenwick) {
    const int r = ctz(uint64_t(t + 1));
    Mat<R> merged(dk, dv);
    for (int l = 1; l <= r; ++l) {
      if (!st.slot[l].empty()) axpy<R>(merged, st.slot[l]);
      st.slot[l] = Mat<R>();
    }
    st.slot[r + 1] = std::move(merged);
    target = &st.slot[r + 1];
  } else {
    target = &st.at(0, dk, dv);
  }
  for (int64_t r = 0; r < dk; ++r)
    for (int64_t c = 0; c < dv; ++c) (*target)(r, c) += bt * k[r] * v[c];
}

// Segments of the naive form (one) or the chunk form (cpu_segment_rows of the chunk).
template <class R>
std::vector<std::pair<int64_t, int64_t>> form_segments(PForm form, int64_t chunk, const PrimArgs<R>& a) {
  if (form == PForm::naive) return {{a.n0, a.n0 + a.n()}};
  return segments(a.n0, a.n(), detail::cpu_segment_rows(chunk, a.dk(), a.dv(), a.delta, a.lv.fenwick));
}

template <class R>
Canon<R> prim_forward(PForm form, int64_t chunk, const PrimArgs<R>& a, const Canon<R>& init,
                      MRef<R> O, bool want_state, std::vector<Canon<R>>* seg_in) {
  const int64_t n = a.n(), n0 = a.n0;
  Canon<R> st = trimmed(init, a.lv, n0);
  if (seg_in) seg_in->clear();
  if (n == 0) return st;
  if (gated_form(form, a)) {
    thread_local Seg<R> sg;
    thread_local GatedSeg<R> gs;
    thread_local GatedWork<R> wk;
    for (auto [s, e] : form_segments(form, chunk, a)) {
      sg.form(a, s - n0, e - n0, false);
      const Mat<R>* H = st.get(0);
      gs.form(a, sg, H);
      MRef<R> Or = O.rows(s - n0, e - n0);
      Canon<R> next;
      if (want_state || e < n0 + n) {
        next.resize(1);
        gated_forward(a, sg, gs, H, &Or, &next.slot[0], wk);
      } else {
        gated_forward(a, sg, gs, H, &Or, static_cast<Mat<R>*>(nullptr), wk);
      }
      if (seg_in) seg_in->push_back(std::move(st));
      st = std::move(next);
    }
    return st;
  }
  thread_local SegWork<R> wk;
  thread_local Seg<R> sg;
  switch (form) {
    case PForm::naive:
    case PForm::chunk:
      for (auto [s, e] : form_segments(form, chunk, a)) {
        sg.form(a, s - n0, e - n0);
        MRef<R> Or = O.rows(s - n0, e - n0);
        Canon<R> next = seg_forward(a, sg, st, wk, &Or, want_state || e < n0 + n);
        if (seg_in) seg_in->push_back(std::move(st));
        st = std::move(next);
      }
      return st;
    case PForm::serial:
      for (int64_t i = 0; i < n; ++i) prim_step(a, i, n0 + i, st, O.row(i));
      return trimmed(st, a.lv, n0 + n);
    case PForm::scan: {
      // chunk summaries -> Blelloch exclusive scan -> every chunk finishes from its carry-in
      const auto segs = segments(n0, n, chunk);
      std::vector<PrimSummary<R>> sums(segs.size());
      for (size_t c = 0; c < segs.size(); ++c)
        sums[c] = prim_summarize(a, segs[c].first - n0, segs[c].second - n0);
      const int64_t dk = a.dk(), dv = a.dv();
      auto comb = [&](const PrimSummary<R>& A, const PrimSummary<R>& B) {
        return prim_compose(A, B, a.lv, a.delta, dk, dv);
      };
      PrimSummary<R> total;
      const auto prefix = blelloch_exclusive(sums, PrimSummary<R>{}, comb, &total);
      for (size_t c = 0; c < segs.size(); ++c) {
        const auto [s, e] = segs[c];
        sg.form(a, s - n0, e - n0);
        MRef<R> Or = O.rows(s - n0, e - n0);
        seg_forward(a, sg, prim_apply(prefix[c], st, a.lv, a.delta, dk, dv), wk, &Or);
      }
      return trimmed(prim_apply(total, st, a.lv, a.delta, dk, dv), a.lv, n0 + n);
    }
  }
  throw std::logic_error("prim_forward: bad form");
}

// A per-thread vector of per-segment quantities, at least n entries for one call; when the call
// ends at most kKeptSegs entries stay held (their storage reused by the next call), so a long
// call's quantities are released after it.
constexpr size_t kKeptSegs = 8;
template <class T>
struct KeptSegs {
  std::vector<T>& v;
  KeptSegs(std::vector<T>& v_, size_t n) : v(v_) {
    if (v.size() < n) v.resize(n);
  }
  ~KeptSegs() {
    if (v.size() > kKeptSegs) {
      v.resize(kKeptSegs);
      v.shrink_to_fit();
    }
  }
  KeptSegs(const KeptSegs&) = delete;
  KeptSegs& operator=(const KeptSegs&) = delete;
};

template <class R>
PrimGrads<R> prim_backward(PForm form, int64_t chunk, const PrimArgs<R>& a, const Canon<R>& init,
                           MRef<const R> dO, const Canon<R>& dfinal,
                           const std::vector<Canon<R>>* seg_in) {
  const int64_t n = a.n(), n0 = a.n0;
  const Canon<R> st0 = trimmed(init, a.lv, n0);
  const Canon<R> dst = trimmed(dfinal, a.lv, n0 + n);
  if (form == PForm::serial) {
    if (a.delta || a.lv.fenwick)
      throw std::logic_error("serial backward exists for the flat mamba primitive only");
    return serial_backward_flat(a, st0, dO, dst);
  }
  PrimGrads<R> G = make_grads(a);
  if (n == 0) {
    G.dinit = dst;
    return G;
  }
  const auto segs = form_segments(form, chunk, a);
  if (gated_form(form, a)) {
    // forward sweep: each segment's quantities and the state entering it (unless the forward
    // kept them), then the reverse sweep
    const bool kept = seg_in && seg_in->size() == segs.size();
    thread_local std::vector<Seg<R>> sg;
    thread_local std::vector<GatedSeg<R>> gs;
    thread_local GatedWork<R> wk;
    std::vector<Canon<R>> own(kept ? 0 : segs.size());
    const KeptSegs<Seg<R>> keep_sg(sg, segs.size());
    const KeptSegs<GatedSeg<R>> keep_gs(gs, segs.size());
    if (!kept) own[0] = st0;
    const std::vector<Canon<R>>& Hin = kept ? *seg_in : own;
    for (size_t c = 0; c < segs.size(); ++c) {
      sg[c].form(a, segs[c].first - n0, segs[c].second - n0, false);
      const Mat<R>* H = Hin[c].get(0);
      gs[c].form(a, sg[c], H);
      if (!kept && c + 1 < segs.size()) {
        own[c + 1].resize(1);
        gated_forward(a, sg[c], gs[c], H, static_cast<MRef<R>*>(nullptr), &own[c + 1].slot[0], wk);
      }
    }
    Mat<R> d = dst.get(0) ? *dst.get(0) : Mat<R>();
    for (size_t c = segs.size(); c-- > 0;)
      d = gated_backward(a, sg[c], gs[c], Hin[c].get(0), dO.rows(sg[c].i0, sg[c].i1),
                         d.empty() ? nullptr : &d, G, wk);
    Canon<R> di;
    di.resize(1);
    di.slot[0] = std::move(d);
    G.dinit = trimmed(di, a.lv, n0);
    return G;
  }
  // each segment's quantities, formed once for both sweeps
  thread_local std::vector<Seg<R>> sg;
  thread_local SegWork<R> wk;
  const KeptSegs<Seg<R>> keep_sg(sg, segs.size());
  for (size_t c = 0; c < segs.size(); ++c) sg[c].form(a, segs[c].first - n0, segs[c].second - n0);
  // states-only sweep: the canonical state entering each segment (unless the forward kept them)
  std::vector<Canon<R>> own;
  const std::vector<Canon<R>>* Hin = seg_in;
  if (!Hin || Hin->size() != segs.size()) {
    own.resize(segs.size());
    own[0] = st0;
    for (size_t c = 0; c + 1 < segs.size(); ++c) own[c + 1] = seg_forward(a, sg[c], own[c], wk);
    Hin = &own;
  }
  Canon<R> d = dst;
  for (size_t c = segs.size(); c-- > 0;)
    d = seg_backward(a, sg[c], (*Hin)[c], dO.rows(sg[c].i0, sg[c].i1), d, G, wk);
  G.dinit = trimmed(d, a.lv, n0);
  return G;
}

template <class R>
PrimSummary<R> prim_summarize(const PrimArgs<R>& a, int64_t i0, int64_t i1) {
  Seg<R> sg(a, i0, i1);
  PrimSummary<R> S;
  S.identity = false;
  S.a = sg.s;
  S.b = sg.e;
  SegWork<R> wk;
  S.P = seg_forward(a, sg, Canon<R>{}, wk);
  if (a.delta) {  // M = e^B (I - K^T W)
    const int64_t dk = a.dk();
    S.M = Mat<R>(dk, dk);
    for (int64_t i = 0; i < dk; ++i) S.M(i, i) = 1;
    gemm<R>(S.M, sg.k, true, sg.wy(), false, R(-1), R(1));  // [dk,R] x [R,dk]
    scale<R>(S.M, std::exp(sg.B));
  } else {
    S.logm = sg.B;
  }
  return S;
}

template <class R>
Canon<R> prim_apply(const PrimSummary<R>& S, const Canon<R>& H, const Levels& lv, bool delta,
                    int64_t dk, int64_t dv) {
  if (S.identity) return H;
  Canon<R> out;
  out.resize(lv.slots(S.b));
  rekey_add<R>(out, H, lv, S.a, S.b, delta ? R(1) : std::exp(S.logm), delta ? &S.M : nullptr, dk,
               dv);
  for (int l = 0; l < static_cast<int>(S.P.slot.size()); ++l)
    if (const Mat<R>* X = S.P.get(l)) axpy<R>(out.at(l, dk, dv), *X);
  return out;
}

template <class R>
PrimSummary<R> prim_compose(const PrimSummary<R>& A, const PrimSummary<R>& B, const Levels& lv,
                            bool delta, int64_t dk, int64_t dv) {
  if (A.identity) return B;
  if (B.identity) return A;
  if (A.b != B.a) throw std::logic_error("prim_compose: segments are not adjacent");
  PrimSummary<R> C;
  C.identity = false;
  C.a = A.a;
  C.b = B.b;
  if (delta) {
    C.M = matmul<R>(B.M, false, A.M, false);  // [dk,dk] x [dk,dk]
  } else {
    C.logm = A.logm + B.logm;
  }
  C.P = prim_apply(B, A.P, lv, delta, dk, dv);
  return C;
}

#define HILA_INSTANTIATE(R)                                                                      \
  template Canon<R> prim_forward<R>(PForm, int64_t, const PrimArgs<R>&, const Canon<R>&,         \
                                    MRef<R>, bool, std::vector<Canon<R>>*);                      \
  template PrimGrads<R> prim_backward<R>(PForm, int64_t, const PrimArgs<R>&, const Canon<R>&,    \
                                         MRef<const R>, const Canon<R>&,                         \
                                         const std::vector<Canon<R>>*);                          \
  template void prim_step<R>(const PrimArgs<R>&, int64_t, int64_t, Canon<R>&, R*);               \
  template void rekey_add<R>(Canon<R>&, const Canon<R>&, const Levels&, int64_t, int64_t, R,     \
                             const Mat<R>*, int64_t, int64_t);                                   \
  template PrimSummary<R> prim_summarize<R>(const PrimArgs<R>&, int64_t, int64_t);               \
  template PrimSummary<R> prim_compose<R>(const PrimSummary<R>&, const PrimSummary<R>&,          \
                                          const Levels&, bool, int64_t, int64_t);                \
  template Canon<R> prim_apply<R>(const PrimSummary<R>&, const Canon<R>&, const Levels&, bool,   \
                                  int64_t, int64_t);
HILA_INSTANTIATE(float)
HILA_INSTANTIATE(double)
#undef HILA_INSTANTIATE

}  // namespace hila::cpu
