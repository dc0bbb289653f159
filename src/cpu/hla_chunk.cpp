// SPDX-License-Identifier: Apache-2.0
// Chunk form of hla2 / ahla / hla3 and of loglinear_hla2 / loglinear_ahla / loglinear_hla3, every
// primitive of the composition worked segment by segment in one sweep (docs/math/HLA.md §3.5,
// §5.4, §6.4, §7.1, §7.2; docs/math/LOGLINEAR.md §3.3, §5.2, §7):
//   U  = GLA_gS(Q, K, K) (+ ridge Q),  Hh = GLA_gP(Q, K, V'),  O' = prim_gO(Q, key, val)
// with key = U or K and val = Hh or V', the inner primitives flat (GLA) and the outer one flat or
// Fenwick (log-linear Mamba-2). A segment of rows [i0, i1) of one head (absolute positions [s, e),
// never crossing a multiple of the segment rows R) with incoming states is, per flat primitive
// Y = GLA_g(Q, Kp, Vp) with state H (docs/math/LOGLINEAR.md §3.3 at one level):
//   Y = (X o E) Vp + diag(eb) Q H_in,      X = tril(Q Kp^T),  E[i,j] = prod_{j<r<=i} a_r
//   H_out = eB H_in + Kp^T diag(er) Vp,   eb[i] = prod_{r<=i} a_r, er[j] = prod_{j<r<nr} a_r
// and for the Fenwick outer primitive, with canonical states of slots l and L(t, u) = bitlen(t xor u):
//   Y = (X o M) Vp + sum_l diag(lam_i^{L(s+i, sigma_l(s))} eb) Q H_in[l],
//   M[i,j] = lam_i^{L(s+i, s+j)} E[i,j],
//   H_out[L(e, sigma_l(s))] += eB H_in[l],  H_out[L(e, s+j)] += Kp_j^T er[j] Vp_j
// What the generic path (compose.cpp over primitive.cpp) forms once per primitive is formed here
// once per segment and shared: the gate exponentials and the decay matrix E of each distinct gate
// column (the three primitives of a tied-gate op read one), tril(Q K^T) (both inner primitives,
// and ahla's outer one) and each masked product X o E. The backward keeps them from
// its forward sweep (which also forms the outer primitive's segment states) for the reverse
// sweep, where the outer segment backward gives the cotangents of this segment's key and val rows
// and the inner segment backwards follow at once (no [n, d] cotangent passes between sweeps).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/backend.h"
#include "cpu/compose.h"

namespace hila::cpu {

namespace {

template <class R>
using Vec = std::vector<R, NoInitAlloc<R>>;

// One gate column over one segment of nr rows: a_i = e^{g_i} and the decay matrix
// E[i, j] = prod_{j<r<=i} a_r (j <= i) by the row recurrence E[i, :i] = a_i E[i-1, :i], and the
// decays of the incoming state and to the segment end read from it:
//   eb[i] = prod_{r<=i} a_r = a_0 E[i, 0],   er[j] = prod_{j<r<nr} a_r = E[nr-1, j],   eB = eb[nr-1].
// Every decay is a product of the gates it spans (never a difference of prefix sums), so a reset
// (a_r = 0, g_r = -inf or below the underflow point) gives exact zeros across it and the gates
// after it alone (docs/math/HLA.md §1); nr exponentials per segment.
template <class R>
struct GateSeg {
  const R* g = nullptr;  // the column at the segment's first row (null: no gates, all a = 1)
  Vec<R> ea, eb;         // a_i, eb[i]
  R eB = 1;
  Mat<R> E;              // [nr, nr], entries j <= i set (the rest never read)

  const R* er() const { return E.row(E.r - 1); }  // er[j], row nr-1 of E
  // Same gate values over the segment (then every quantity above is the same).
  bool same(const R* gp, int64_t nr) const {
    if (gp == g) return true;
    if (!gp || !g) return false;
    return std::equal(gp, gp + nr, g);
  }
};

// p[0, n) = 0 in fixed-size pieces the compiler inlines as register stores (a std::fill of a short
// row becomes a memset call, and a segment fills two per row).
template <class R>
inline void zero_fill(R* p, int64_t n) {
  char* b = reinterpret_cast<char*>(p);
  size_t bytes = static_cast<size_t>(n) * sizeof(R);
  for (; bytes >= 32; bytes -= 32, b += 32) std::memset(b, 0, 32);
  if (bytes >= 16) std::memset(b, 0, 16), b += 16, bytes -= 16;
  if (bytes >= 8) std::memset(b, 0, 8), b += 8, bytes -= 8;
  if (bytes >= 4) std::memset(b, 0, 4);
}

// m as an [r, c] matrix of unset entries, its storage kept when it has that shape already.
template <class R>
void reshape(Mat<R>& m, int64_t r, int64_t c) {
  if (m.r != r || m.c != c) m = Mat<R>(r, c, Uninit{});
}

// An [r, c] view of unset entries in buf (grown when too small).
template <class R>
MRef<R> scratch(Vec<R>& buf, int64_t r, int64_t c) {
  if (static_cast<int64_t>(buf.size()) < r * c) buf.resize(static_cast<size_t>(r * c));
  return {buf.data(), r, c, c};
}

// G for the gate column gp (null: no gates) over nr rows.
template <class R>
HILA_CPU_CLONES void make_gates(GateSeg<R>& G, const R* gp, int64_t nr) {
  G.g = gp;
  G.ea.resize(static_cast<size_t>(nr));
  G.eb.resize(static_cast<size_t>(nr));
  for (int64_t i = 0; i < nr; ++i) G.ea[i] = gp ? std::exp(gp[i]) : R(1);
  reshape(G.E, nr, nr);
  for (int64_t i = 0; i < nr; ++i) {
    if (i > 0) scaled(G.E.row(i), G.E.row(i - 1), G.ea[i], i);
    G.E(i, i) = 1;
    G.eb[i] = G.ea[0] * G.E(i, 0);
  }
  G.eB = G.eb[nr - 1];
}

// X = tril(A B^T) [nr, nr] for A, B [nr, dk]: entries j <= i (the rest unset, never read).
template <class R>
void lower_scores(Mat<R>& X, MRef<const R> A, MRef<const R> B) {
  reshape(X, A.r, B.r);
  gemm<R>(X, A, false, B, true, R(1), R(0), kCLower | kCUnset);  // [R,dk] x [dk,R]
}

// PM = X o E on j <= i, exact zeros above (a causal factor of gemm's kALower / kAUpper products).
template <class R>
HILA_CPU_CLONES void masked(Mat<R>& P, const Mat<R>& X, const Mat<R>& E) {
  const int64_t nr = X.r;
  reshape(P, nr, nr);
  for (int64_t i = 0; i < nr; ++i) {
    hadamard(P.row(i), X.row(i), E.row(i), i + 1);
    zero_fill(P.row(i) + i + 1, nr - i - 1);
  }
}

// One primitive over one segment: its queries (the head's q rows), keys, values, gates, tril(q
// key^T), its mask and masked product, each owned by the segment or shared with another
// primitive; and its level structure. Flat: one state slot, mask E. Fenwick (the outer primitive
// of a log-linear composition, docs/math/LOGLINEAR.md §3.3, §7): the mask is
// M[i, j] = lam_i^{l(s+i, s+j)} E[i, j], slot l of the incoming canonical state is read by row i
// at level read_level(s+i, s, l) and re-keyed into slot read_level(e, s, l) of the outgoing one,
// and token j enters slot level(e, s+j).
template <class R>
struct PrimSeg {
  MRef<const R> q, key, val;  // [nr, dk], [nr, dk], [nr, dv]
  const GateSeg<R>* gs = nullptr;
  const Mat<R>* X = nullptr;   // tril(q key^T)
  const Mat<R>* M = nullptr;   // mask: gs->E (flat) or the level-weighted E
  const Mat<R>* PM = nullptr;  // X o M
  Levels lv;
  MRef<const R> lam;      // [nr, nL] level weights (Fenwick)
  int64_t s = 0, e = 0;   // absolute positions of the segment's rows [s, e)

  // slot l of the incoming state H_in where it can be non-zero (else null)
  const Mat<R>* slot_in(const Canon<R>& Hin, int l) const {
    return lv.live(s, l) ? Hin.get(l) : nullptr;
  }
  int read_level(int64_t i, int l) const { return lv.read_level(s + i, s, l); }
  R lambda(int64_t i, int l) const { return lv.fenwick ? lam(i, l) : R(1); }
};

// The segment's tokens by the slot of the outgoing state they enter: rows [j0, j1) into slot
// tl = level(e, s+j). For t < e the highest bit where t and e differ does not grow with t, so each
// slot takes one contiguous range (flat: all rows into slot 0). A plain array, not a callback, so
// the loops over the ranges stay in the (cloned) callers.
struct TokenRange {
  int tl;
  int64_t j0, j1;
};
struct TokenRanges {
  TokenRange r[65];
  int n = 0;
  const TokenRange* begin() const { return r; }
  const TokenRange* end() const { return r + n; }
};
template <class R>
TokenRanges token_ranges(const PrimSeg<R>& ps) {
  TokenRanges out;
  const int64_t nr = ps.q.r;
  for (int64_t j0 = 0; j0 < nr;) {
    const int tl = ps.lv.level(ps.e, ps.s + j0);
    int64_t j1 = j0 + 1;
    while (j1 < nr && ps.lv.level(ps.e, ps.s + j1) == tl) ++j1;
    out.r[out.n++] = {tl, j0, j1};
    j0 = j1;
  }
  return out;
}

// M [nr, nr] = the level-weighted E of a Fenwick primitive on j <= i (the rest unset, never read).
template <class R>
HILA_CPU_CLONES void level_mask(Mat<R>& M, const PrimSeg<R>& ps, const Mat<R>& E) {
  const int64_t nr = E.r;
  reshape(M, nr, nr);
  for (int64_t i = 0; i < nr; ++i)
    level_ranges(ps.lv, ps.s, i, [&](int l, int64_t j0, int64_t j1) {
      scaled(M.row(i) + j0, E.row(i) + j0, ps.lam(i, l), j1 - j0);
    });
}

// Whether some slot of c is set.
template <class R>
bool any_slot(const Canon<R>& c) {
  for (const Mat<R>& m : c.slot)
    if (!m.empty()) return true;
  return false;
}

// Y [nr, dv] = PM val + sum_l diag(lam_i^{read_level(i, l)} eb) q H_in[l] (H_in null: a zero
// state); tmp: work space.
template <class R>
HILA_CPU_CLONES void prim_seg_out(const PrimSeg<R>& ps, const Canon<R>* Hin, MRef<R> Y,
                                  Vec<R>& tmp) {
  gemm<R>(Y, *ps.PM, false, ps.val, false, R(1), R(0), kALower);  // [R,R] x [R,dv]
  if (!Hin) return;
  const int64_t nr = ps.q.r, dk = ps.q.c;
  const MRef<R> Qe = scratch(tmp, nr, dk);  // diag(lam eb) q
  for (int l = 0; l < static_cast<int>(Hin->slot.size()); ++l) {
    const Mat<R>* H = ps.slot_in(*Hin, l);
    if (!H) continue;
    for (int64_t i = 0; i < nr; ++i)
      scaled(Qe.row(i), ps.q.row(i), ps.gs->eb[i] * ps.lambda(i, ps.read_level(i, l)), dk);
    gemm<R>(Y, Qe, false, *H, false, R(1), R(1));  // [R,dk] x [dk,dv]
  }
}

// H_out = rekey(eB H_in) + key_J^T diag(er) val_J into slot tl for the tokens J of each slot
// (flat: eB H_in + key^T diag(er) val); exactly lv.slots(e) slots; tmp: work space.
template <class R>
HILA_CPU_CLONES Canon<R> prim_seg_state(const PrimSeg<R>& ps, const Canon<R>* Hin, Vec<R>& tmp) {
  const int64_t nr = ps.q.r, dk = ps.key.c, dv = ps.val.c;
  const MRef<R> Y = scratch(tmp, nr, dv);  // diag(er) val
  for (int64_t j = 0; j < nr; ++j) scaled(Y.row(j), ps.val.row(j), ps.gs->er()[j], dv);
  Canon<R> H;
  H.resize(ps.lv.slots(ps.e));
  for (const TokenRange& t : token_ranges(ps)) {
    const MRef<const R> kJ = ps.key.rows(t.j0, t.j1), yJ = Y.rows(t.j0, t.j1);
    Mat<R>& Ht = H.slot[t.tl];
    if (Ht.empty()) {
      Ht = matmul<R>(kJ, true, yJ, false);  // [dk,J] x [J,dv]
    } else {
      gemm<R>(Ht, kJ, true, yJ, false, R(1), R(1));
    }
  }
  if (Hin) rekey_add<R>(H, *Hin, ps.lv, ps.s, ps.e, ps.gs->eB, nullptr, dk, dv);
  return H;
}

// Work space of prim_seg_backward for segments of up to R rows and widths up to d, one block for
// every call of a backward.
template <class R>
struct BwdScratch {
  Vec<R> buf;
  int64_t R_ = 0, d_ = 0;
  BwdScratch(int64_t rows, int64_t d)
      : buf(static_cast<size_t>(rows * (4 * d + 2 * rows + 2))), R_(rows), d_(d) {}
  // view t of the [nr, cols] temporaries (cols <= d for t < 4, cols <= R for t = 4, 5)
  MRef<R> mat(int t, int64_t nr, int64_t cols) {
    R* base = buf.data() + (t < 4 ? t * R_ * d_ : 4 * R_ * d_ + (t - 4) * R_ * R_);
    return {base, nr, cols, cols};
  }
  R* vec(int t) { return buf.data() + 4 * R_ * d_ + 2 * R_ * R_ + t * R_; }  // t = 0, 1
};

// Reverse of prim_seg_out and prim_seg_state (docs/math/HLA.md §7.1; docs/math/LOGLINEAR.md §5.2
// for the Fenwick levels): from dY [nr, dv] and the cotangent dH of H_out (no slot set: zero),
// adds to dq, dkey [nr, dk], dval [nr, dv] and (Fenwick) dlam [nr, nL], writes dg [nr] (the
// gradient of the segment's log-gates); dH becomes the cotangent of H_in (no slot where H_in is
// null).
template <class R>
HILA_CPU_CLONES void prim_seg_backward(const PrimSeg<R>& ps, const Canon<R>* Hin, MRef<const R> dY,
                                       Canon<R>& dH, MRef<R> dq, MRef<R> dkey, MRef<R> dval,
                                       MRef<R> dlam, R* dg, BwdScratch<R>& ws) {
  const int64_t nr = ps.q.r, dk = ps.q.c, dv = ps.val.c;
  const GateSeg<R>& G = *ps.gs;
  const bool fen = ps.lv.fenwick;
  R* db = ws.vec(0);  // d/d b_i, b_i = sum_{r<=i} g_r
  zero_fill(db, nr);
  R dB = 0;  // d/d B, B = b_{nr-1}
  // state: H_out[tl] += key_J^T diag(er) val_J,  H_out[read_level(e, s, l)] += eB H_in[l]
  const bool dout = any_slot(dH);
  if (dout) {
    const MRef<R> kD = ws.mat(0, nr, dv), Y = ws.mat(1, nr, dv);  // key dH[tl], diag(er) val
    const R* er = G.er();
    for (const TokenRange& t : token_ranges(ps)) {
      const Mat<R>* D = dH.get(t.tl);
      if (!D) continue;
      const int64_t j0 = t.j0, j1 = t.j1;
      gemm<R>(kD.rows(j0, j1), ps.key.rows(j0, j1), false, *D, false);  // [J,dk] x [dk,dv]
      for (int64_t j = j0; j < j1; ++j) {
        const R w = er[j];
        scaled(Y.row(j), ps.val.row(j), w, dv);
        R* dvj = dval.row(j);
        const R* kdj = kD.row(j);
        for (int64_t c = 0; c < dv; ++c) dvj[c] += w * kdj[c];
        const R dwm = w * dot(kdj, ps.val.row(j), dv);  // d/d(B - b_j)
        dB += dwm;
        db[j] -= dwm;
      }
      gemm<R>(dkey.rows(j0, j1), Y.rows(j0, j1), false, *D, true, R(1), R(1));  // [J,dv] x [dv,dk]
    }
  }
  // transitions and reads of the incoming state: Y += diag(lam eb) q H_in[l]
  Canon<R> dHin;
  if (Hin) {
    dHin.resize(static_cast<int64_t>(Hin->slot.size()));
    const MRef<R> Yr = ws.mat(2, nr, dk), cdY = ws.mat(3, nr, dv);  // dY H_in^T, diag(lam eb) dY
    for (int l = 0; l < static_cast<int>(Hin->slot.size()); ++l) {
      const Mat<R>* H = ps.slot_in(*Hin, l);
      if (!H) continue;
      const int to = ps.lv.read_level(ps.e, ps.s, l);
      const Mat<R>* D = dout ? dH.get(to) : nullptr;
      if (D) dB += G.eB * dot<R>(*D, *H);
      gemm<R>(Yr, dY, false, *H, true);  // [R,dv] x [dv,dk]
      for (int64_t i = 0; i < nr; ++i) {
        const int lvl = ps.read_level(i, l);
        const R eb = G.eb[i], coef = eb * ps.lambda(i, lvl);
        const R* yi = Yr.row(i);
        R* dqi = dq.row(i);
        for (int64_t c = 0; c < dk; ++c) dqi[c] += coef * yi[c];
        const R qY = dot(ps.q.row(i), yi, dk);
        db[i] += coef * qY;
        if (fen) dlam(i, lvl) += eb * qY;
        scaled(cdY.row(i), dY.row(i), coef, dv);
      }
      Mat<R>& dX = dHin.slot[l];
      if (D) {
        if (fen) {  // several incoming slots may re-key into one outgoing slot
          dX = Mat<R>(dk, dv, Uninit{});
          scaled(dX.row(0), D->row(0), G.eB, dk * dv);
        } else {  // one slot: dH's own storage
          dX = std::move(dH.slot[to]);
          scale<R>(dX, G.eB);
        }
        gemm<R>(dX, ps.q, true, cdY, false, R(1), R(1));  // [dk,R] x [R,dv]
      } else {
        dX = matmul<R>(ps.q, true, cdY, false);
      }
    }
  }
  dH = std::move(dHin);
  // intra-segment: Y = (X o M) val
  gemm<R>(dval, *ps.PM, true, dY, false, R(1), R(1), kAUpper);  // [R,R] x [R,dv]
  const MRef<R> dP = ws.mat(4, nr, nr), dX = ws.mat(5, nr, nr);
  gemm<R>(dP, dY, false, ps.val, true, R(1), R(0), kCLower | kCUnset);  // [R,dv] x [dv,R]
  // dX = dP o M (exact zeros above the diagonal); dG = dP o X o M = d/d(b_i - b_j);
  // Fenwick: d/d lam_i^l = sum over the columns of level l of dP o X o E
  R* dGcol = ws.vec(1);
  zero_fill(dGcol, nr);
  for (int64_t i = 0; i < nr; ++i) {
    const R *dPi = dP.row(i), *Xi = ps.X->row(i);
    db[i] += mask_row_backward(dPi, Xi, ps.M->row(i), dX.row(i), dGcol, i + 1);
    zero_fill(dX.row(i) + i + 1, nr - i - 1);
    if (fen) {
      const R* Ei = G.E.row(i);
      level_ranges(ps.lv, ps.s, i, [&](int l, int64_t j0, int64_t j1) {
        R acc = 0;
        for (int64_t j = j0; j < j1; ++j) acc += dPi[j] * Xi[j] * Ei[j];
        dlam(i, l) += acc;
      });
    }
  }
  for (int64_t j = 0; j < nr; ++j) db[j] -= dGcol[j];
  gemm<R>(dq, dX, false, ps.key, false, R(1), R(1), kALower);  // [R,R] x [R,dk]
  gemm<R>(dkey, dX, true, ps.q, false, R(1), R(1), kAUpper);   // [R,R] x [R,dk]
  // g_r enters every b_i with i >= r: dg_r = sum_{i>=r} db_i (+ dB)
  db[nr - 1] += dB;
  R acc = 0;
  for (int64_t i = nr - 1; i >= 0; --i) dg[i] = (acc += db[i]);
  // a reset token (a = 0) has dg = 0, as in the serial form (dg_t = a_t <Hbar_t, H_{t-1}>)
  for (int64_t i = 0; i < nr; ++i)
    if (G.ea[i] == R(0)) dg[i] = 0;
}

enum Which { kS = 0, kP = 1, kO = 2 };

// Everything one segment's three primitives share, formed once.
template <class R>
struct SegCtx {
  int64_t i0 = 0, i1 = 0;
  GateSeg<R> gates[3];  // distinct gate columns (ng of them)
  int ng = 0;
  Mat<R> X1, X2, Mo, PMs[3];  // tril(q k^T), tril(q U^T); the outer Fenwick mask; masked products
  PrimSeg<R> prim[3];         // S, P, outer
};

// The sweep over one head's segments (forward: rows of U, Hh and O'; backward: the same, keeping
// every segment's shared quantities and incoming states, then the reverse sweep).
template <class R>
struct HlaChunk {
  const OpPlan& p;
  const HeadView<R>& x;
  int64_t n, dk, dvp;
  Mat<R> U, Hh;
  Vec<R> tmp;  // work space of the segment products
  std::vector<SegCtx<R>> segs;
  std::vector<Canon<R>> Sin, Pin, Hin;  // states entering each segment (no slot set: zero)

  HlaChunk(const OpPlan& p_, int64_t C, const HeadView<R>& x_)
      : p(p_), x(x_), n(x_.n()), dk(x_.k.c), dvp(x_.v.c) {
    const int64_t rows = detail::cpu_segment_rows(C, dk, dvp, false);
    for (auto [s, e] : segments(x.n0, n, rows)) {
      segs.emplace_back();
      segs.back().i0 = s - x.n0;
      segs.back().i1 = e - x.n0;
    }
    if (p.has_S) U = Mat<R>(n, dk, Uninit{});
    if (p.has_P) Hh = Mat<R>(n, dvp, Uninit{});
  }

  // Forms segment c's shared quantities and its inner outputs (rows of U and Hh).
  void prepare(SegCtx<R>& sc, const Canon<R>* S, const Canon<R>* P) {
    const int64_t i0 = sc.i0, i1 = sc.i1, nr = i1 - i0;
    const MRef<const R> q = x.q.rows(i0, i1), k = x.k.rows(i0, i1), v = x.v.rows(i0, i1);
    auto gate = [&](int col) -> const GateSeg<R>* {
      const R* gp = x.g[col] ? x.g[col] + i0 : nullptr;
      for (int t = 0; t < sc.ng; ++t)
        if (sc.gates[t].same(gp, nr)) return &sc.gates[t];
      make_gates(sc.gates[sc.ng], gp, nr);
      return &sc.gates[sc.ng++];
    };
    // masked product X o M, shared between primitives with the same scores and mask
    const Mat<R>* pmX[3] = {nullptr, nullptr, nullptr};
    const Mat<R>* pmM[3] = {nullptr, nullptr, nullptr};
    int npm = 0;
    auto masked_of = [&](const Mat<R>* X, const Mat<R>* M) -> const Mat<R>* {
      for (int t = 0; t < npm; ++t)
        if (pmX[t] == X && pmM[t] == M) return &sc.PMs[t];
      masked(sc.PMs[npm], *X, *M);
      pmX[npm] = X;
      pmM[npm] = M;
      return &sc.PMs[npm++];
    };
    if (p.has_S || p.has_P) lower_scores<R>(sc.X1, q, k);
    auto setup = [&](Which w, int col, MRef<const R> key, MRef<const R> val, const Mat<R>* X) {
      PrimSeg<R>& ps = sc.prim[w];
      ps.q = q;
      ps.key = key;
      ps.val = val;
      ps.gs = gate(col);
      ps.X = X;
      ps.s = x.n0 + i0;
      ps.e = x.n0 + i1;
      ps.lv.fenwick = w == kO && p.fenwick;
      ps.M = &ps.gs->E;
      if (ps.lv.fenwick) {
        ps.lam = x.lam.rows(i0, i1);
        level_mask(sc.Mo, ps, ps.gs->E);
        ps.M = &sc.Mo;
      }
      ps.PM = masked_of(X, ps.M);
    };
    MRef<const R> key = k, val = v;
    if (p.has_S) {
      setup(kS, p.gS, k, k, &sc.X1);
      MRef<R> Ur = U.rows(i0, i1);
      prim_seg_out(sc.prim[kS], S, Ur, tmp);
      if (p.ridge != 0) axpy<R>(Ur, q, R(p.ridge));  // u_j = (S_j + ridge I) q_j
      key = U.rows(i0, i1);
    }
    if (p.has_P) {
      setup(kP, p.gP, k, v, &sc.X1);
      prim_seg_out(sc.prim[kP], P, Hh.rows(i0, i1), tmp);
      val = Hh.rows(i0, i1);
    }
    if (p.has_S) lower_scores<R>(sc.X2, q, key);
    setup(kO, p.gO, key, val, p.has_S ? &sc.X2 : &sc.X1);
  }

  static const Canon<R>* ptr(const Canon<R>& c) { return any_slot(c) ? &c : nullptr; }

  // Forward sweep. Oraw: rows of O' (null: not formed); keep: keep every segment's context and
  // incoming states (for the backward); want_state: form the states after the last segment.
  OpState<R> forward(const OpState<R>& init, MRef<R>* Oraw, bool keep, bool want_state) {
    Canon<R> S = init.S, P = init.P, H = init.H;
    const size_t ns = segs.size();
    if (keep) {
      Sin.resize(ns);
      Pin.resize(ns);
      Hin.resize(ns);
    }
    SegCtx<R> scratch;
    for (size_t c = 0; c < ns; ++c) {
      SegCtx<R>& sc = keep ? segs[c] : scratch;
      if (!keep) {  // the scratch context keeps its storage from segment to segment
        sc.ng = 0;
        sc.i0 = segs[c].i0;
        sc.i1 = segs[c].i1;
      }
      prepare(sc, ptr(S), ptr(P));
      if (Oraw) prim_seg_out(sc.prim[kO], ptr(H), Oraw->rows(sc.i0, sc.i1), tmp);
      if (keep) {
        Sin[c] = std::move(S);
        Pin[c] = std::move(P);
        Hin[c] = std::move(H);
      }
      if (c + 1 == ns && !want_state) break;
      const Canon<R>&S0 = keep ? Sin[c] : S, &P0 = keep ? Pin[c] : P, &H0 = keep ? Hin[c] : H;
      if (p.has_S) S = prim_seg_state(sc.prim[kS], ptr(S0), tmp);
      if (p.has_P) P = prim_seg_state(sc.prim[kP], ptr(P0), tmp);
      H = prim_seg_state(sc.prim[kO], ptr(H0), tmp);
    }
    OpState<R> out;
    if (!want_state) return out;
    if (p.has_S) out.S = std::move(S);
    if (p.has_P) out.P = std::move(P);
    out.H = std::move(H);
    return out;
  }
};

}  // namespace

template <class R>
bool hla_chunk_applies(const OpPlan& p, PForm form, const HeadView<R>& x) {
  return form == PForm::chunk && !p.delta && (p.has_S || p.has_P) && x.n() > 0;
}

template <class R>
OpState<R> hla_chunk_forward(const OpPlan& p, int64_t C, const HeadView<R>& x,
                             const OpState<R>& init, MRef<R> Oraw, bool want_state) {
  HlaChunk<R> hc(p, C, x);
  return hc.forward(init, &Oraw, false, want_state);
}

template <class R>
OpGrads<R> hla_chunk_backward(const OpPlan& p, int64_t C, const HeadView<R>& x,
                              const OpState<R>& init, MRef<const R> dO, const OpState<R>& dfinal) {
  const int64_t n = x.n(), dk = x.k.c, dvp = x.v.c, dv = p.normalize ? dvp - 1 : dvp;
  HlaChunk<R> hc(p, C, x);
  Mat<R> Oraw;
  MRef<R> Or;
  if (p.normalize) {
    Oraw = Mat<R>(n, dvp, Uninit{});
    Or = Oraw.ref();
  }
  hc.forward(init, p.normalize ? &Or : nullptr, true, false);
  Mat<R> dOraw;  // normalize: the cotangent of O' = [N | D]
  MRef<const R> dOr = dO;
  if (p.normalize) {
    dOraw = normalize_cotangent<R>(Oraw, dO, R(p.eps));
    dOr = dOraw;
  }
  OpGrads<R> G;
  G.dq = Mat<R>(n, dk);
  G.dk = Mat<R>(n, dk);
  Mat<R> dvfull(n, dvp);
  Mat<R> dU = p.has_S ? Mat<R>(n, dk) : Mat<R>();  // cotangent of U (the outer key)
  Mat<R> dHh = p.has_P ? Mat<R>(n, dvp) : Mat<R>();  // cotangent of Hh (the outer value)
  if (p.fenwick) G.dlam = Mat<R>(n, x.lam.c);
  for (int w = 0; w < 3; ++w) {
    const int col = w == kS ? p.gS : w == kP ? p.gP : p.gO;
    if (col >= 0) G.dg[col].assign(static_cast<size_t>(n), R(0));
  }
  Levels flat, lvO;
  lvO.fenwick = p.fenwick;
  Canon<R> dS = trimmed(dfinal.S, flat, x.n0 + n), dP = trimmed(dfinal.P, flat, x.n0 + n),
           dH = trimmed(dfinal.H, lvO, x.n0 + n);
  auto ptr = [](const Canon<R>& c) { return any_slot(c) ? &c : nullptr; };
  int64_t rmax = 0;
  for (const SegCtx<R>& sc : hc.segs) rmax = std::max(rmax, sc.i1 - sc.i0);
  BwdScratch<R> ws(rmax, std::max(dk, dvp));
  for (size_t c = hc.segs.size(); c-- > 0;) {
    const SegCtx<R>& sc = hc.segs[c];
    const int64_t i0 = sc.i0, i1 = sc.i1;
    MRef<R> dq = G.dq.rows(i0, i1), dk_ = G.dk.rows(i0, i1), dv_ = dvfull.rows(i0, i1);
    // outer: O' = prim_gO(Q, key, val)
    MRef<R> dkey = p.has_S ? dU.rows(i0, i1) : dk_;
    MRef<R> dval = p.has_P ? dHh.rows(i0, i1) : dv_;
    prim_seg_backward(sc.prim[kO], ptr(hc.Hin[c]), dOr.rows(i0, i1), dH, dq, dkey, dval,
                      p.fenwick ? G.dlam.rows(i0, i1) : MRef<R>(), G.dg[p.gO].data() + i0, ws);
    if (p.has_P)  // Hh = GLA_gP(Q, K, V'): its cotangent is the outer value gradient
      prim_seg_backward(sc.prim[kP], ptr(hc.Pin[c]), MRef<const R>(dval), dP, dq, dk_, dv_,
                        MRef<R>(), G.dg[p.gP].data() + i0, ws);
    if (p.has_S) {  // U = GLA_gS(Q, K, K) + ridge Q: its cotangent is the outer key gradient
      if (p.ridge != 0) axpy<R>(dq, MRef<const R>(dkey), R(p.ridge));
      prim_seg_backward(sc.prim[kS], ptr(hc.Sin[c]), MRef<const R>(dkey), dS, dq, dk_, dk_,
                        MRef<R>(), G.dg[p.gS].data() + i0, ws);
    }
  }
  G.dinit.H = trimmed(dH, lvO, x.n0);
  if (p.has_S) G.dinit.S = trimmed(dS, flat, x.n0);
  if (p.has_P) G.dinit.P = trimmed(dP, flat, x.n0);
  if (p.normalize) {  // drop the ones column
    G.dv = Mat<R>(n, dv, Uninit{});
    for (int64_t i = 0; i < n; ++i) std::copy(dvfull.row(i), dvfull.row(i) + dv, G.dv.row(i));
  } else {
    G.dv = std::move(dvfull);
  }
  return G;
}

#define HILA_INSTANTIATE(R)                                                                     \
  template bool hla_chunk_applies<R>(const OpPlan&, PForm, const HeadView<R>&);                 \
  template OpState<R> hla_chunk_forward<R>(const OpPlan&, int64_t, const HeadView<R>&,          \
                                           const OpState<R>&, MRef<R>, bool);                   \
  template OpGrads<R> hla_chunk_backward<R>(const OpPlan&, int64_t, const HeadView<R>&,         \
                                            const OpState<R>&, MRef<const R>, const OpState<R>&);
HILA_INSTANTIATE(float)
HILA_INSTANTIATE(double)
#undef HILA_INSTANTIATE

}  // namespace hila::cpu
