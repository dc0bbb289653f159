// SPDX-License-Identifier: Apache-2.0
// The portable tier of the delta-rule primitive (delta.cuh; docs/math/LOGLINEAR.md §6), every dtype: Gated
// DeltaNet and log-linear Gated DeltaNet in one implementation, plain GDN being the flat level
// structure (one state slot, lambda = 1). It reproduces the CPU segment routines of
// src/cpu/primitive.cpp (seg_forward / seg_backward) segment by segment.
//
// Segments are the maximal row ranges [s, e) inside one chunk of 64 aligned to absolute positions
// (§3.3); per segment, with R = e - s rows, chunk-local cumsum b of the gates and B = b[R-1]:
//   Tm = (I + tril_-1(diag(beta) K K^T))^-1   [R,R] unit lower triangular, forward substitution
//   W  = Tm diag(beta) K;  X = tril(Q^ K^T);  D = X Tm;  Q~ = Q^ - D diag(beta) K
//   O  = (D o M) diag(beta) V + sum_{l live at s} diag(lam^{l(s+i, sigma_l(s))} e^b) Q~ H[l]
//   H'[l(e, sigma_l(s))] += e^B (H[l] - K^T (W H[l]))        (the erase acts on every live level)
//   H'[l'] += K^T Tm diag(beta e^{B-b} 1[l(e, s+j) = l']) V  (new tokens, by target level)
// A segment holding a reset (a floored gate) takes M's decays and the new-token weights from sums
// restarted at each reset, and its dg stops there (prims/resets.cuh; docs/math/LOGLINEAR.md §6.4).
// Phases: (1) per (segment, head), in parallel: Tm, W, Q~, K~ = Tm^T K and the intra output;
// (2) per (sequence, head), sequentially over its segments: the level states and the reads
// (storing the live levels entering every segment for the backward: popcount(s) matrices, or one
// flat); backward (§6.5): (3) the reverse sweep of one adjoint per level, storing the adjoints at
// every segment end; (4) per (segment, head), in parallel: every gradient of the segment's rows.
//
// Layouts: q, k packed [G][Ttot][dk] (T), v, dO [H][Ttot][dv] (T), g, beta [H][Ttot], lam
// [H][Ttot][nL] (compute type R = Acc<T>); level workspace [N*H][Ls][dk][dv] (R).
// Grid: blocks of kThreads take items (segment x head for phases 1 and 4, sequence x head for the
// sweeps 2 and 3) grid-stride. Per-segment matrices live in a per-block fp32 (fp64 for fp64
// inputs) scratch area in global memory (L1/L2 resident); every GEMM is a shared-memory tiled FMA
// block GEMM: correctness first, every product in the compute type (no bf16 rounding of Tm, W or
// the states). Each device routine below mirrors the CPU routine of the same role in src/cpu/primitive.cpp
// (Seg, seg_forward, seg_backward) so the two can be read side by side.
#include <algorithm>
#include <string>
#include <vector>

#include "core/plan.h"
#include "cuda/delta/delta.cuh"
#include "cuda/dispatch/heuristics.h"
#include "cuda/prims/levels.cuh"
#include "cuda/prims/pack.cuh"
#include "cuda/prims/resets.cuh"
#include "cuda/prims/tile.cuh"

namespace hila::cuda {

namespace {

template <class T>
struct DeltaArgs {
  using R = Acc<T>;
  const T *q = nullptr, *k = nullptr, *v = nullptr;  // [G][Ttot][dk], [G][Ttot][dk], [H][Ttot][dv]
  int rep = 1;                                      // q/k group of head h: h / rep
  const R* g = nullptr;                             // [H][Ttot], nullptr = ungated
  const R* beta = nullptr;                          // [H][Ttot]
  const R* lam = nullptr;                           // [H][Ttot][nL] (Fenwick only)
  int nL = 0;
  LvlGrid grid;
  bool l2norm = false;                              // q, k -> x / sqrt(|x|^2 + 1e-6) before scale
  R scale = 1;
  int H = 1, N = 1, dk = 1, dv = 1, Ls = 1;
  int64_t Ttot = 0;
  // segment tables (device): sequence -> [seg0, seg0 + nseg); segment -> packed row, position,
  // rows, offsets of its stored levels at s and at e (in matrices per head)
  int64_t nseg = 0;
  const int64_t *seq_seg0 = nullptr, *seq_nseg = nullptr;
  const int64_t *seg_row = nullptr, *seg_pos = nullptr, *seg_nr = nullptr, *seg_hoff = nullptr, *seg_dhoff = nullptr;
  R* ws = nullptr;       // forward: initial state in, final state out; backward: d_final in, d_init out
  R* scratch = nullptr;  // per resident block
  int64_t scratch_elems = 0;
  // per-segment matrices of phase 1, rows of [H][Ttot][d]: W, Q~, K~ = Tm^T K, K (normalised);
  // Oi = (D o M) diag(beta) V, the intra-segment output (only when o is wanted)
  R *Wb = nullptr, *Qtb = nullptr, *Ktb = nullptr, *Kb = nullptr, *Oi = nullptr;
  // forward
  T* o = nullptr;        // [H][Ttot][dv], nullptr: states only
  R* hbuf = nullptr;     // [sum_seg nlive(s)][H][dk][dv]: live levels entering each segment
  // backward (hbuf from a forward with hbuf set)
  R* dhbuf = nullptr;    // [sum_seg nlive(e)][H][dk][dv]: adjoints of the live levels at each end
  const T* dO = nullptr;                             // [H][Ttot][dv]
  R *dq = nullptr, *dk_ = nullptr, *dv_ = nullptr;   // [H][Ttot][dk | dk | dv], w.r.t. q^ and k
  R *dg = nullptr, *dbeta = nullptr, *dlam = nullptr;  // [H][Ttot], [H][Ttot], [H][Ttot][nL]
};


constexpr int kThreads = 256;
constexpr int kSeg = kChunk;  // rows per segment at most: the chunk (a power of two, §2.6)

// Per-block scratch matrices (row-major, leading dimension = column count). Rows <= kSeg.
template <class R>
struct Scratch {
  R *Q, *K, *bK, *W, *Qt, *dQt, *dW, *dq, *dk, *Yr;                          // [64][dk]
  R *V, *bV, *O, *T1, *Y, *U, *dY, *dY2, *E, *dE, *cdO, *dO, *dv, *dbv;      // [64][dv]
  R *KK, *Tm, *X, *D, *P, *dTm, *dD, *dP, *dG, *t1, *t2, *dA, *dXm;          // [64][64]
  R *Hn, *dX;                                                                // [dk][dv]
  R *beta, *b, *db, *dbeta, *coef, *rowtmp;                                  // [64]
  __host__ __device__ Scratch(R* base, int ncol_k, int ncol_v, int64_t* elems = nullptr) {
    int64_t used = 0;
    auto take = [&](int64_t n) {
      R* p = base ? base + used : nullptr;
      used += (n + 31) / 32 * 32;
      return p;
    };
    for (R** m : {&Q, &K, &bK, &W, &Qt, &dQt, &dW, &dq, &dk, &Yr}) *m = take(int64_t(kSeg) * ncol_k);
    for (R** m : {&V, &bV, &O, &T1, &Y, &U, &dY, &dY2, &E, &dE, &cdO, &dO, &dv, &dbv}) *m = take(int64_t(kSeg) * ncol_v);
    for (R** m : {&KK, &Tm, &X, &D, &P, &dTm, &dD, &dP, &dG, &t1, &t2, &dA, &dXm}) *m = take(kSeg * kSeg);
    for (R** m : {&Hn, &dX}) *m = take(int64_t(ncol_k) * ncol_v);
    for (R** m : {&beta, &b, &db, &dbeta, &coef, &rowtmp}) *m = take(kSeg);
    if (elems) *elems = used;
  }
};

// C [M, N] (ldc) = alpha op(A) op(B) + beta C  (beta = 0: C is not read). A: [M, K] (lda) or,
// with ta, stored [K, M]; B: [K, N] (ldb) or, with tb, stored [N, K]; C never aliases A or B.
// Every thread of the block calls it; ends with a barrier. FMA in the compute type: 64 x 64 tiles
// of C, K in slabs of 16 staged in shared memory, 4 x 4 outputs per thread (kThreads = 256); any
// other block size (the host emulation) takes the plain loop. Both sum k in increasing order.
constexpr int kTile = 64, kSlab = 16;
template <class R>
__device__ void bgemm(R* C, int ldc, const R* A, int lda, bool ta, const R* B, int ldb, bool tb, int M, int N,
                      int K, R alpha, R beta) {
  if (blockDim.x != kThreads) {
    for (int e = threadIdx.x; e < M * N; e += blockDim.x) {
      const int i = e / N, j = e % N;
      R s = 0;
      for (int k = 0; k < K; ++k) s += (ta ? A[k * lda + i] : A[i * lda + k]) * (tb ? B[j * ldb + k] : B[k * ldb + j]);
      C[i * ldc + j] = alpha * s + (beta == R(0) ? R(0) : beta * C[i * ldc + j]);
    }
    __syncthreads();
    return;
  }
  static_assert(kThreads == 256, "16 x 16 threads, 4 x 4 outputs each, cover a 64 x 64 tile");
  __shared__ R sA[kSlab][kTile + 1], sB[kSlab][kTile + 1];  // [k][m], [k][n]
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  for (int i0 = 0; i0 < M; i0 += kTile)
    for (int j0 = 0; j0 < N; j0 += kTile) {
      R acc[4][4];
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] = 0;
      for (int k0 = 0; k0 < K; k0 += kSlab) {
        // stage op(A)[i0.., k0..] and op(B)[k0.., j0..], reading along the stored rows
        for (int e = threadIdx.x; e < kTile * kSlab; e += kThreads) {
          const int ai = ta ? e % kTile : e / kSlab, ak = ta ? e / kTile : e % kSlab;
          const int i = i0 + ai, ka = k0 + ak;
          sA[ak][ai] = (i < M && ka < K) ? (ta ? A[ka * lda + i] : A[i * lda + ka]) : R(0);
          const int bj = tb ? e / kSlab : e % kTile, bk = tb ? e % kSlab : e / kTile;
          const int j = j0 + bj, kb = k0 + bk;
          sB[bk][bj] = (j < N && kb < K) ? (tb ? B[j * ldb + kb] : B[kb * ldb + j]) : R(0);
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kSlab; ++kk) {
          R a[4], b[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) a[r] = sA[kk][ty + 16 * r], b[r] = sB[kk][tx + 16 * r];
#pragma unroll
          for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][c] += a[r] * b[c];
        }
        __syncthreads();
      }
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int i = i0 + ty + 16 * r, j = j0 + tx + 16 * c;
          if (i < M && j < N) C[i * ldc + j] = alpha * acc[r][c] + (beta == R(0) ? R(0) : beta * C[i * ldc + j]);
        }
    }
  __syncthreads();
}

// One segment of one (sequence, head): rows [row, row + nr) of the packed buffers, absolute
// positions [s, e); hoff / dhoff: offsets (in matrices per head) of its stored levels at s / e.
struct SegCtx {
  int64_t row, s, e, hoff, dhoff;
  int nr, h;
};

template <class T>
__device__ SegCtx segment(const DeltaArgs<T>& a, int64_t sg, int h) {
  SegCtx c;
  c.row = a.seg_row[sg];
  c.s = a.seg_pos[sg];
  c.nr = int(a.seg_nr[sg]);
  c.e = c.s + c.nr;
  c.hoff = a.seg_hoff[sg];
  c.dhoff = a.seg_dhoff[sg];
  c.h = h;
  return c;
}

template <class T>
struct Ctx {
  using R = Acc<T>;
  const DeltaArgs<T>& a;
  Scratch<R>& S;
  const SegCtx& c;
  // the segment's resets (prims/resets.cuh), in shared memory; formed by seg_load where z.bs is set
  // (the kernels that decay within the segment)
  ChunkResets<R> z{};
  R B = 0;
  __device__ int64_t mat() const { return int64_t(a.dk) * a.dv; }
  // offset of the segment's row 0 in a per-head [H][Ttot][d] buffer
  __device__ int64_t rows(int d) const { return (int64_t(c.h) * a.Ttot + c.row) * d; }
  __device__ R lam(int i, int l) const { return a.grid.fenwick ? a.lam[rows(a.nL) + int64_t(i) * a.nL + l] : R(1); }
  // mixing mask M[i,j] = lam_i^{l(s+i, s+j)} Gamma_{i,j}, j <= i (docs/math/LOGLINEAR.md §3.1, §6.4),
  // Gamma from dec: e^{b_i - b_j}, or exact across the segment's resets (prims/resets.cuh)
  template <class Dec>
  __device__ R mask(const Dec& dec, int i, int j) const { return lam(i, a.grid.level(c.s + i, c.s + j)) * dec.gamma(i, j); }
  // read coefficient of stored level l at row i: lam_i^{l(s+i, sigma_l(s))} e^{b_i}
  __device__ R read_coef(int i, int l) const { return lam(i, a.grid.read_level(c.s + i, c.s, l)) * exp(S.b[i]); }
  // live level l of the state entering the segment, and the adjoint of level l of the state at e
  // (compact stores: the live levels of a position in increasing order)
  __device__ R* state_in(int l) const { return a.hbuf + ((c.hoff + a.grid.rank(c.s, l)) * a.H + c.h) * mat(); }
  __device__ R* adj_out(int l) const { return a.dhbuf + ((c.dhoff + a.grid.rank(c.e, l)) * a.H + c.h) * mat(); }
  // levels l(e, s+j) of the segment's tokens in the state at e, as a bit set (< 64 levels)
  __device__ uint64_t token_levels(uint64_t* s_mask) const {
    if (threadIdx.x == 0) {
      uint64_t m = 0;
      for (int j = 0; j < c.nr; ++j) m |= 1ull << a.grid.level(c.e, c.s + j);
      *s_mask = m;
    }
    __syncthreads();
    const uint64_t m = *s_mask;
    __syncthreads();
    return m;
  }
};

// Rows of the segment into scratch: beta and the gate cumsum b always (b[i] = b[R-1] for i >= R, as
// chunk_cumsum), the reset structure x.z where x.z.bs is set; q^ (l2-normalised, scaled) and k
// (l2-normalised) with `qk`; v with `v`; dO with `dO`.
template <class T>
__device__ void seg_load(Ctx<T>& x, bool qk, bool v, bool dO) {
  using R = Acc<T>;
  const DeltaArgs<T>& a = x.a;
  Scratch<R>& S = x.S;
  const SegCtx& c = x.c;
  const int nr = c.nr, dk = a.dk, dv = a.dv;
  const int64_t hq = c.h / a.rep;
  if (qk) {
    const T* q = a.q + (hq * a.Ttot + c.row) * dk;
    const T* k = a.k + (hq * a.Ttot + c.row) * dk;
    for (int e = threadIdx.x; e < nr * dk; e += blockDim.x) {
      S.Q[e] = from<R>(q[e]);
      S.K[e] = from<R>(k[e]);
    }
  }
  if (v) {
    const T* vp = a.v + x.rows(dv);
    for (int e = threadIdx.x; e < nr * dv; e += blockDim.x) S.V[e] = from<R>(vp[e]);
  }
  if (dO) {
    const T* dp = a.dO + x.rows(dv);
    for (int e = threadIdx.x; e < nr * dv; e += blockDim.x) S.dO[e] = from<R>(dp[e]);
  }
  for (int i = threadIdx.x; i < nr; i += blockDim.x) S.beta[i] = a.beta[x.rows(1) + i];
  if (threadIdx.x == 0) {  // serial: exact before the segment's first reset
    R acc = 0;
    for (int i = 0; i < kSeg; ++i) S.b[i] = (acc += (a.g && i < nr) ? a.g[x.rows(1) + i] : R(0));
    if (x.z.bs) chunk_resets_serial(x.z, a.g ? a.g + int64_t(c.h) * a.Ttot : nullptr, c.row, nr);
  }
  __syncthreads();
  x.B = S.b[nr - 1];
  if (!qk) return;
  for (int i = threadIdx.x; i < 2 * nr; i += blockDim.x) {  // row scaling: l2norm, then scale on q
    R* m = i < nr ? S.Q + i * dk : S.K + (i - nr) * dk;
    R f = i < nr ? a.scale : R(1);
    if (a.l2norm) {
      R ss = 0;
      for (int cc = 0; cc < dk; ++cc) ss += m[cc] * m[cc];
      f /= sqrt(ss + R(detail::kL2NormEps));
    }
    if (f != R(1))
      for (int cc = 0; cc < dk; ++cc) m[cc] *= f;
  }
  __syncthreads();
}

// The WY quantities of Seg<R> on the CPU: bK = diag(beta) K, KK = K K^T, Tm, W = Tm bK.
template <class T>
__device__ void seg_wy(Ctx<T>& x) {
  using R = Acc<T>;
  Scratch<R>& S = x.S;
  const int nr = x.c.nr, dk = x.a.dk;
  for (int e = threadIdx.x; e < nr * dk; e += blockDim.x) S.bK[e] = S.beta[e / dk] * S.K[e];
  bgemm<R>(S.KK, kSeg, S.K, dk, false, S.K, dk, true, nr, nr, dk, R(1), R(0));  // [R,dk] x [dk,R]
  // Tm = (I + N)^-1, N = tril_-1(diag(beta) KK): Tm[i,j] = delta_ij - sum_{j<=m<i} N[i,m] Tm[m,j],
  // right-looking: once row m is final, every later row takes its term m (same order as the CPU)
  for (int e = threadIdx.x; e < nr * kSeg; e += blockDim.x) S.Tm[e] = (e / kSeg == e % kSeg) ? R(1) : R(0);
  __syncthreads();
  for (int m = 0; m + 1 < nr; ++m) {
    for (int e = threadIdx.x; e < (nr - 1 - m) * (m + 1); e += blockDim.x) {
      const int i = m + 1 + e / (m + 1), j = e % (m + 1);
      const R n = S.beta[i] * S.KK[i * kSeg + m];
      S.Tm[i * kSeg + j] -= n * S.Tm[m * kSeg + j];
    }
    __syncthreads();
  }
  bgemm<R>(S.W, dk, S.Tm, kSeg, false, S.bK, dk, false, nr, dk, nr, R(1), R(0));  // [R,R] x [R,dk]
}

// X = tril(Q^ K^T), D = X Tm, Q~ = Q^ - D bK, and P = D o M, bV = diag(beta) V. Tm, D, Q~ hold no
// gate: the decays enter only as the scalars of M, the read coefficients e^{b_i}, e^B and the
// new-token weights (docs/math/LOGLINEAR.md §6.4), which dec forms exactly across resets.
template <class T, class Dec>
__device__ void seg_scores(Ctx<T>& x, const Dec& dec) {
  using R = Acc<T>;
  const DeltaArgs<T>& a = x.a;
  Scratch<R>& S = x.S;
  const int nr = x.c.nr, dk = a.dk, dv = a.dv;
  bgemm<R>(S.X, kSeg, S.Q, dk, false, S.K, dk, true, nr, nr, dk, R(1), R(0));  // [R,dk] x [dk,R]
  for (int e = threadIdx.x; e < nr * nr; e += blockDim.x)
    if (e % nr > e / nr) S.X[(e / nr) * kSeg + e % nr] = 0;
  __syncthreads();
  bgemm<R>(S.D, kSeg, S.X, kSeg, false, S.Tm, kSeg, false, nr, nr, nr, R(1), R(0));  // [R,R] x [R,R]
  for (int e = threadIdx.x; e < nr * nr; e += blockDim.x) {
    const int i = e / nr, j = e % nr;
    S.P[i * kSeg + j] = j <= i ? x.mask(dec, i, j) * S.D[i * kSeg + j] : R(0);
  }
  for (int e = threadIdx.x; e < nr * dv; e += blockDim.x) S.bV[e] = S.beta[e / dv] * S.V[e];
  for (int e = threadIdx.x; e < nr * dk; e += blockDim.x) S.Qt[e] = S.Q[e];
  __syncthreads();
  bgemm<R>(S.Qt, dk, S.D, kSeg, false, S.bK, dk, false, nr, dk, nr, R(-1), R(1));  // [R,R] x [R,dk]
}

template <class R>
__device__ void copy(R* dst, const R* src, int64_t n) {
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) dst[e] = src[e];
}

// Phase 1, parallel over (segment, head): the segment's state-independent matrices, for the
// sequential sweeps: W, Q~, K~ = Tm^T K, K (normalised), and the intra output (D o M) bV.
template <class T>
__global__ void __launch_bounds__(kThreads) delta_prep_kernel(DeltaArgs<T> a) {
  using R = Acc<T>;
  __shared__ R z_bs[kSeg];
  __shared__ int z_last[kSeg], z_any;
  Scratch<R> S(a.scratch + blockIdx.x * a.scratch_elems, a.dk, a.dv);
  const int dk = a.dk, dv = a.dv;
  for (int64_t item = blockIdx.x; item < a.nseg * a.H; item += gridDim.x) {
    const SegCtx c = segment(a, item / a.H, int(item % a.H));
    Ctx<T> x{a, S, c, {z_bs, z_last, &z_any}};
    const int nr = c.nr;
    seg_load(x, true, true, false);
    seg_wy(x);
    with_chunk_decay(S.b, x.z, [&](const auto& dec) { seg_scores(x, dec); });
    bgemm<R>(S.Yr, dk, S.Tm, kSeg, true, S.K, dk, false, nr, dk, nr, R(1), R(0));  // K~  [R,R] x [R,dk]
    if (a.Oi) bgemm<R>(S.O, dv, S.P, kSeg, false, S.bV, dv, false, nr, dv, nr, R(1), R(0));  // [R,R] x [R,dv]
    copy(a.Wb + x.rows(dk), S.W, int64_t(nr) * dk);
    copy(a.Qtb + x.rows(dk), S.Qt, int64_t(nr) * dk);
    copy(a.Ktb + x.rows(dk), S.Yr, int64_t(nr) * dk);
    copy(a.Kb + x.rows(dk), S.K, int64_t(nr) * dk);
    if (a.Oi) copy(a.Oi + x.rows(dv), S.O, int64_t(nr) * dv);
    __syncthreads();
  }
}

// The sweeps are column-separable in v: a block takes one tile of kVTile state columns [v0, v0+bv)
// of a (sequence, head) item; scratch and state matrices keep their full leading dimension dv.
constexpr int kVTile = 64;
template <class F>
__device__ void for_cols(int rows, int v0, int bv, F f) {  // f(row, column) over [rows] x [v0, v0+bv)
  for (int e = threadIdx.x; e < rows * bv; e += blockDim.x) f(e / bv, v0 + e % bv);
}

// seg_forward of the CPU (phase 2, sequential), in place on the level workspace ws [Ls][dk][dv],
// columns [v0, v0+bv): O rows (if a.o) and the state at e. Re-key targets of moved levels are never
// live at s and the new-token targets are added after the moves, so the in-place order is exact
// (§2.4).
template <class T, class Dec>
__device__ void seg_forward(Ctx<T>& x, const Dec& dec, Acc<T>* ws, uint64_t* s_mask, int v0, int bv) {
  using R = Acc<T>;
  const DeltaArgs<T>& a = x.a;
  Scratch<R>& S = x.S;
  const SegCtx& c = x.c;
  const int nr = c.nr, dk = a.dk, dv = a.dv;
  const int64_t mat = x.mat();
  const R *W = a.Wb + x.rows(dk), *K = a.Kb + x.rows(dk), *Kt = a.Ktb + x.rows(dk), *Qt = a.Qtb + x.rows(dk);
  if (a.o) {  // O = (D o M) bV + sum_live diag(lam e^b) Q~ H[l]
    const R* Oi = a.Oi + x.rows(dv);
    for_cols(nr, v0, bv, [&](int i, int cc) { S.O[i * dv + cc] = Oi[i * dv + cc]; });
    for (int l = 0; l < a.Ls; ++l) {
      if (!a.grid.live(c.s, l)) continue;
      bgemm<R>(S.T1 + v0, dv, Qt, dk, false, ws + l * mat + v0, dv, false, nr, bv, dk, R(1), R(0));  // [R,dk] x [dk,bv]
      for_cols(nr, v0, bv, [&](int i, int cc) { S.O[i * dv + cc] += x.read_coef(i, l) * S.T1[i * dv + cc]; });
      __syncthreads();
    }
    T* o = a.o + x.rows(dv);
    for_cols(nr, v0, bv, [&](int i, int cc) { o[i * dv + cc] = to<T>(S.O[i * dv + cc]); });
  }
  const R eB = exp(x.B);  // 0 when the segment holds a reset
  for (int l = 0; l < a.Ls; ++l) {  // e^B (H - K^T (W H)) re-keyed to l(e, sigma_l(s))
    if (!a.grid.live(c.s, l)) continue;
    R* Hl = ws + l * mat;
    bgemm<R>(S.E + v0, dv, W, dk, false, Hl + v0, dv, false, nr, bv, dk, R(1), R(0));  // [R,dk] x [dk,bv]
    for_cols(dk, v0, bv, [&](int i, int cc) { S.Hn[i * dv + cc] = Hl[i * dv + cc]; });
    __syncthreads();
    bgemm<R>(S.Hn + v0, dv, K, dk, true, S.E + v0, dv, false, dk, bv, nr, R(-1), R(1));  // [dk,R] x [R,bv]
    const int tl = a.grid.read_level(c.e, c.s, l);
    R* Ht = ws + tl * mat;
    for_cols(dk, v0, bv, [&](int i, int cc) {
      const int64_t e = int64_t(i) * dv + cc;
      if (tl == l) {
        Hl[e] = eB * S.Hn[e];
      } else {
        Ht[e] += eB * S.Hn[e];
        Hl[e] = 0;
      }
    });
    __syncthreads();
  }
  const uint64_t groups = x.token_levels(s_mask);
  for (int tl = 0; tl < 64; ++tl) {  // new tokens: K^T Tm diag(beta w 1_tl) V = K~^T (..) V, w_j = e^{B-b_j}
    if (!((groups >> tl) & 1)) continue;
    for_cols(nr, v0, bv, [&](int j, int cc) {
      const bool in = a.grid.level(c.e, c.s + j) == tl;
      S.Y[j * dv + cc] = in ? S.beta[j] * dec.weight(j) * S.V[j * dv + cc] : R(0);
    });
    __syncthreads();
    bgemm<R>(ws + tl * mat + v0, dv, Kt, dk, true, S.Y + v0, dv, false, dk, bv, nr, R(1), R(1));  // [dk,R] x [R,bv]
  }
}

// Copy columns [v0, v0+bv) of a [dk][dv] level matrix.
template <class R>
__device__ void copy_cols(R* dst, const R* src, int dk, int dv, int v0, int bv) {
  for_cols(dk, v0, bv, [&](int i, int cc) { dst[int64_t(i) * dv + cc] = src[int64_t(i) * dv + cc]; });
}

// Phase 2: forward sweep over the segments of each (sequence, head, value tile) item; ws holds the
// item's levels.
template <class T>
__global__ void __launch_bounds__(kThreads) delta_fwd_kernel(DeltaArgs<T> a) {
  using R = Acc<T>;
  __shared__ uint64_t s_mask;
  __shared__ R z_bs[kSeg];
  __shared__ int z_last[kSeg], z_any;
  Scratch<R> S(a.scratch + blockIdx.x * a.scratch_elems, a.dk, a.dv);
  const int64_t mat = int64_t(a.dk) * a.dv;
  const int nvt = (a.dv + kVTile - 1) / kVTile;
  for (int64_t item = blockIdx.x; item < int64_t(a.N) * a.H * nvt; item += gridDim.x) {
    const int64_t sh = item / nvt;
    const int seq = int(sh / a.H), h = int(sh % a.H), v0 = int(item % nvt) * kVTile, bv = min(kVTile, a.dv - v0);
    R* ws = a.ws + sh * a.Ls * mat;
    for (int64_t sg = a.seq_seg0[seq], end = sg + a.seq_nseg[seq]; sg < end; ++sg) {
      const SegCtx c = segment(a, sg, h);
      Ctx<T> x{a, S, c, {z_bs, z_last, &z_any}};
      if (a.hbuf)
        for (int l = 0; l < a.Ls; ++l)
          if (a.grid.live(c.s, l)) copy_cols(x.state_in(l), ws + l * mat, a.dk, a.dv, v0, bv);
      seg_load(x, false, true, false);
      with_chunk_decay(S.b, x.z, [&](const auto& dec) { seg_forward(x, dec, ws, &s_mask, v0, bv); });
    }
  }
}

// Phase 3, sequential: the reverse sweep of the level adjoints (the dH lines of seg_backward on
// the CPU), per (sequence, head, value tile). Stores the adjoint of the state at e, then moves dws
// [Ls][dk][dv] in place to s:
//   dH[l] = e^B (dH'[t] - W^T (K dH'[t])) + Q~^T diag(lam e^b) dO,   t = l(e, sigma_l(s)).
// Slot l is never the source of another level's move, so it is written as soon as it is formed.
template <class T>
__global__ void __launch_bounds__(kThreads) delta_adj_kernel(DeltaArgs<T> a) {
  using R = Acc<T>;
  Scratch<R> S(a.scratch + blockIdx.x * a.scratch_elems, a.dk, a.dv);
  const int dk = a.dk, dv = a.dv;
  const int64_t mat = int64_t(dk) * dv;
  const int nvt = (dv + kVTile - 1) / kVTile;
  for (int64_t item = blockIdx.x; item < int64_t(a.N) * a.H * nvt; item += gridDim.x) {
    const int64_t sh = item / nvt;
    const int seq = int(sh / a.H), h = int(sh % a.H), v0 = int(item % nvt) * kVTile, bv = min(kVTile, dv - v0);
    R* dws = a.ws + sh * a.Ls * mat;
    for (int64_t sg = a.seq_seg0[seq] + a.seq_nseg[seq] - 1; sg >= a.seq_seg0[seq]; --sg) {
      const SegCtx c = segment(a, sg, h);
      Ctx<T> x{a, S, c};
      const int nr = c.nr;
      for (int l = 0; l < a.Ls; ++l)
        if (a.grid.live(c.e, l)) copy_cols(x.adj_out(l), dws + l * mat, dk, dv, v0, bv);
      seg_load(x, false, false, true);
      const R *W = a.Wb + x.rows(dk), *K = a.Kb + x.rows(dk), *Qt = a.Qtb + x.rows(dk);
      // e^B (0 with a reset in the segment) and e^{b_i} (exact before its first reset, 0 from it
      // on): no decay between two rows, so no reset structure
      const R eB = exp(x.B);
      for (int l = 0; l < a.Ls; ++l) {
        if (!a.grid.live(c.s, l)) continue;
        const R* Dout = dws + a.grid.read_level(c.e, c.s, l) * mat;
        for_cols(dk, v0, bv, [&](int i, int cc) { S.dX[i * dv + cc] = eB * Dout[int64_t(i) * dv + cc]; });
        for_cols(nr, v0, bv, [&](int i, int cc) { S.cdO[i * dv + cc] = x.read_coef(i, l) * S.dO[i * dv + cc]; });
        bgemm<R>(S.dE + v0, dv, K, dk, false, Dout + v0, dv, false, nr, bv, dk, R(1), R(0));     // [R,dk] x [dk,bv]
        bgemm<R>(S.dX + v0, dv, W, dk, true, S.dE + v0, dv, false, dk, bv, nr, -eB, R(1));       // [dk,R] x [R,bv]
        bgemm<R>(S.dX + v0, dv, Qt, dk, true, S.cdO + v0, dv, false, dk, bv, nr, R(1), R(1));    // [dk,R] x [R,bv]
        copy_cols(dws + l * mat, S.dX, dk, dv, v0, bv);
        __syncthreads();
      }
      for (int l = 0; l < a.Ls; ++l)  // adjoints of slots that exist at e only are consumed
        if (a.grid.live(c.e, l) && !a.grid.live(c.s, l))
          for_cols(dk, v0, bv, [&](int i, int cc) { dws[l * mat + int64_t(i) * dv + cc] = 0; });
      __syncthreads();
    }
  }
}

// Phase 4, parallel over (segment, head): seg_backward of the CPU without the adjoint moves,
// from the stored state entering the segment (hbuf) and the stored adjoint at its end (dhbuf).
// With a reset in the segment (Dec::kReset) db and dB are the partials in the segment-relative sums
// bs_i and bs_{R-1} of prims/resets.cuh, and dg stops at the resets (chunk_dg_serial).
template <class T, class Dec>
__device__ void seg_grads(Ctx<T>& x, const Dec& dec, uint64_t* s_mask, Acc<T>* red) {
  using R = Acc<T>;
  const DeltaArgs<T>& a = x.a;
  Scratch<R>& S = x.S;
  const SegCtx& c = x.c;
  const int nr = c.nr, dk = a.dk, dv = a.dv, nL = a.nL;
  const int64_t mat = x.mat();
  const bool fen = a.grid.fenwick;
  const int64_t rowbase = int64_t(c.h) * a.Ttot + c.row;
  R* dlam = fen ? a.dlam + x.rows(nL) : nullptr;
  for (int e = threadIdx.x; e < nr * dv; e += blockDim.x) S.dv[e] = 0;
  for (int e = threadIdx.x; e < nr * dk; e += blockDim.x) S.dQt[e] = S.dW[e] = S.dq[e] = S.dk[e] = 0;
  for (int e = threadIdx.x; e < nr * kSeg; e += blockDim.x) S.dTm[e] = 0;
  for (int i = threadIdx.x; i < nr; i += blockDim.x) S.db[i] = S.dbeta[i] = 0;
  if (fen)
    for (int e = threadIdx.x; e < nr * nL; e += blockDim.x) dlam[e] = 0;
  __syncthreads();
  R dB = 0;
  const R eB = exp(x.B);  // 0 when the segment holds a reset

  // new-token groups: Z_tl = K^T Tm diag(beta w 1_tl) V, w_j = e^{B-b_j} (dec.weight)
  const uint64_t groups = x.token_levels(s_mask);
  for (int tl = 0; tl < 64; ++tl) {
    if (!((groups >> tl) & 1)) continue;
    const R* Dz = x.adj_out(tl);
    for (int j = threadIdx.x; j < nr; j += blockDim.x)
      S.coef[j] = a.grid.level(c.e, c.s + j) == tl ? S.beta[j] * dec.weight(j) : R(0);
    __syncthreads();
    for (int e = threadIdx.x; e < nr * dv; e += blockDim.x) S.Y[e] = S.coef[e / dv] * S.V[e];
    __syncthreads();
    bgemm<R>(S.U, dv, S.Tm, kSeg, false, S.Y, dv, false, nr, dv, nr, R(1), R(0));     // [R,R] x [R,dv]
    bgemm<R>(S.dk, dk, S.U, dv, false, Dz, dv, true, nr, dk, dv, R(1), R(1));         // [R,dv] x [dv,dk]
    bgemm<R>(S.dY, dv, S.K, dk, false, Dz, dv, false, nr, dv, dk, R(1), R(0));        // [R,dk] x [dk,dv]
    bgemm<R>(S.dTm, kSeg, S.dY, dv, false, S.Y, dv, true, nr, nr, dv, R(1), R(1));    // [R,dv] x [dv,R]
    bgemm<R>(S.dY2, dv, S.Tm, kSeg, true, S.dY, dv, false, nr, dv, nr, R(1), R(0));   // [R,R] x [R,dv]
    for (int j = threadIdx.x; j < nr; j += blockDim.x) {
      R tY = 0;
      for (int cc = 0; cc < dv; ++cc) {
        tY += S.dY2[j * dv + cc] * S.V[j * dv + cc];
        S.dv[j * dv + cc] += S.coef[j] * S.dY2[j * dv + cc];
      }
      const bool in = a.grid.level(c.e, c.s + j) == tl;
      if (in) S.dbeta[j] += dec.weight(j) * tY;
      const R dwm = S.coef[j] * tY;  // d/d(B - b_j)
      S.db[j] -= dwm;
      S.rowtmp[j] = dwm;
    }
    __syncthreads();
    R part = 0;
    for (int j = threadIdx.x; j < nr; j += blockDim.x) part += S.rowtmp[j];
    dB += block_sum(part, red);
  }

  // transitions (decay, erase, re-key) and reads of the incoming live levels
  for (int l = 0; l < a.Ls; ++l) {
    if (!a.grid.live(c.s, l)) continue;
    const R* H = x.state_in(l);
    const R* Dout = x.adj_out(a.grid.read_level(c.e, c.s, l));
    copy(S.Hn, H, mat);
    bgemm<R>(S.E, dv, S.W, dk, false, H, dv, false, nr, dv, dk, R(1), R(0));          // [R,dk] x [dk,dv]
    bgemm<R>(S.Hn, dv, S.K, dk, true, S.E, dv, false, dk, dv, nr, R(-1), R(1));       // [dk,R] x [R,dv]
    R part = 0;
    for (int64_t e = threadIdx.x; e < mat; e += blockDim.x) part += Dout[e] * S.Hn[e];
    dB += eB * block_sum(part, red);
    bgemm<R>(S.dk, dk, S.E, dv, false, Dout, dv, true, nr, dk, dv, -eB, R(1));        // [R,dv] x [dv,dk]
    bgemm<R>(S.dE, dv, S.K, dk, false, Dout, dv, false, nr, dv, dk, R(1), R(0));      // [R,dk] x [dk,dv]
    bgemm<R>(S.dW, dk, S.dE, dv, false, H, dv, true, nr, dk, dv, -eB, R(1));          // [R,dv] x [dv,dk]
    bgemm<R>(S.Yr, dk, S.dO, dv, false, H, dv, true, nr, dk, dv, R(1), R(0));         // [R,dv] x [dv,dk]
    for (int i = threadIdx.x; i < nr; i += blockDim.x) {
      const int lvl = a.grid.read_level(c.s + i, c.s, l);
      const R eb = exp(S.b[i]);
      const R cf = x.lam(i, lvl) * eb;
      R qY = 0;
      for (int cc = 0; cc < dk; ++cc) {
        qY += S.Qt[i * dk + cc] * S.Yr[i * dk + cc];
        S.dQt[i * dk + cc] += cf * S.Yr[i * dk + cc];
      }
      if (fen) dlam[int64_t(i) * nL + lvl] += eb * qY;
      S.db[i] += cf * qY;
    }
    __syncthreads();
  }

  // intra: O = (D o M) diag(beta) V
  bgemm<R>(S.dP, kSeg, S.dO, dv, false, S.bV, dv, true, nr, nr, dv, R(1), R(0));      // [R,dv] x [dv,R]
  bgemm<R>(S.dbv, dv, S.P, kSeg, true, S.dO, dv, false, nr, dv, nr, R(1), R(0));      // [R,R] x [R,dv]
  for (int i = threadIdx.x; i < nr; i += blockDim.x) {
    R s = 0;
    for (int cc = 0; cc < dv; ++cc) {
      S.dv[i * dv + cc] += S.beta[i] * S.dbv[i * dv + cc];
      s += S.dbv[i * dv + cc] * S.V[i * dv + cc];
    }
    S.dbeta[i] += s;
  }
  for (int e = threadIdx.x; e < nr * nr; e += blockDim.x) {
    const int i = e / nr, j = e % nr;
    R dD = 0, dG = 0;
    if (j <= i) {
      const R M = x.mask(dec, i, j), dPij = S.dP[i * kSeg + j];
      dD = dPij * M;
      dG = dPij * S.D[i * kSeg + j] * M;  // d/d(b_i - b_j)
    }
    S.dD[i * kSeg + j] = dD;
    S.dG[i * kSeg + j] = dG;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nr; i += blockDim.x) {  // rows: dlam through the LUT, db_i
    R s = 0;
    for (int j = 0; j <= i; ++j) {
      s += S.dG[i * kSeg + j];
      if (fen)
        dlam[int64_t(i) * nL + a.grid.level(c.s + i, c.s + j)] +=
            S.dP[i * kSeg + j] * S.D[i * kSeg + j] * dec.gamma(i, j);
    }
    S.db[i] += s;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < nr; j += blockDim.x) {  // columns: db_j
    R s = 0;
    for (int i = j; i < nr; ++i) s += S.dG[i * kSeg + j];
    S.db[j] -= s;
  }
  for (int e = threadIdx.x; e < nr * dk; e += blockDim.x) S.dq[e] += S.dQt[e];
  __syncthreads();
  // Q~ = Q^ - D bK
  bgemm<R>(S.dD, kSeg, S.dQt, dk, false, S.bK, dk, true, nr, nr, dk, R(-1), R(1));    // [R,dk] x [dk,R]
  bgemm<R>(S.Yr, dk, S.D, kSeg, true, S.dQt, dk, false, nr, dk, nr, R(-1), R(0));     // dbK  [R,R] x [R,dk]
  // W = Tm bK
  bgemm<R>(S.dTm, kSeg, S.dW, dk, false, S.bK, dk, true, nr, nr, dk, R(1), R(1));     // [R,dk] x [dk,R]
  bgemm<R>(S.Yr, dk, S.Tm, kSeg, true, S.dW, dk, false, nr, dk, nr, R(1), R(1));      // [R,R] x [R,dk]
  for (int i = threadIdx.x; i < nr; i += blockDim.x) {
    R s = 0;
    for (int cc = 0; cc < dk; ++cc) {
      S.dk[i * dk + cc] += S.beta[i] * S.Yr[i * dk + cc];
      s += S.Yr[i * dk + cc] * S.K[i * dk + cc];
    }
    S.dbeta[i] += s;
  }
  __syncthreads();
  // D = X Tm
  bgemm<R>(S.dXm, kSeg, S.dD, kSeg, false, S.Tm, kSeg, true, nr, nr, nr, R(1), R(0));  // [R,R] x [R,R]
  for (int e = threadIdx.x; e < nr * nr; e += blockDim.x)
    if (e % nr > e / nr) S.dXm[(e / nr) * kSeg + e % nr] = 0;
  __syncthreads();
  bgemm<R>(S.dTm, kSeg, S.X, kSeg, true, S.dD, kSeg, false, nr, nr, nr, R(1), R(1));   // [R,R] x [R,R]
  bgemm<R>(S.dq, dk, S.dXm, kSeg, false, S.K, dk, false, nr, dk, nr, R(1), R(1));      // [R,R] x [R,dk]
  bgemm<R>(S.dk, dk, S.dXm, kSeg, true, S.Q, dk, false, nr, dk, nr, R(1), R(1));       // [R,R] x [R,dk]
  // Tm = (I + N)^-1: dN = tril_-1(-Tm^T dTm Tm^T), N = diag(beta) KK
  bgemm<R>(S.t1, kSeg, S.Tm, kSeg, true, S.dTm, kSeg, false, nr, nr, nr, R(1), R(0));
  bgemm<R>(S.t2, kSeg, S.t1, kSeg, false, S.Tm, kSeg, true, nr, nr, nr, R(1), R(0));
  for (int e = threadIdx.x; e < nr * nr; e += blockDim.x) {
    const int i = e / nr, j = e % nr;
    S.dA[i * kSeg + j] = j < i ? -S.beta[i] * S.t2[i * kSeg + j] : R(0);
  }
  for (int i = threadIdx.x; i < nr; i += blockDim.x) {
    R s = 0;
    for (int j = 0; j < i; ++j) s -= S.t2[i * kSeg + j] * S.KK[i * kSeg + j];
    S.dbeta[i] += s;
  }
  __syncthreads();
  bgemm<R>(S.dk, dk, S.dA, kSeg, false, S.K, dk, false, nr, dk, nr, R(1), R(1));       // (dA + dA^T) K
  bgemm<R>(S.dk, dk, S.dA, kSeg, true, S.K, dk, false, nr, dk, nr, R(1), R(1));
  // dg: reverse cumsum of db within the segment (b is chunk-local), dB at the last row, stopped at
  // the resets
  if (threadIdx.x == 0)
    chunk_dg_serial<Dec::kReset>(a.dg + rowbase, [&](int i) { return S.db[i]; }, dB, nr, x.z);
  for (int e = threadIdx.x; e < nr * dk; e += blockDim.x) {
    a.dq[rowbase * dk + e] = S.dq[e];
    a.dk_[rowbase * dk + e] = S.dk[e];
  }
  for (int e = threadIdx.x; e < nr * dv; e += blockDim.x) a.dv_[rowbase * dv + e] = S.dv[e];
  for (int i = threadIdx.x; i < nr; i += blockDim.x) a.dbeta[rowbase + i] = S.dbeta[i];
  __syncthreads();
}


template <class T>
__global__ void __launch_bounds__(kThreads) delta_grad_kernel(DeltaArgs<T> a) {
  using R = Acc<T>;
  __shared__ uint64_t s_mask;
  __shared__ R red[kThreads];
  __shared__ R z_bs[kSeg];
  __shared__ int z_last[kSeg], z_any;
  Scratch<R> S(a.scratch + blockIdx.x * a.scratch_elems, a.dk, a.dv);
  for (int64_t item = blockIdx.x; item < a.nseg * a.H; item += gridDim.x) {
    const SegCtx c = segment(a, item / a.H, int(item % a.H));
    Ctx<T> x{a, S, c, {z_bs, z_last, &z_any}};
    seg_load(x, true, true, true);
    seg_wy(x);
    with_chunk_decay(S.b, x.z, [&](const auto& dec) {
      seg_scores(x, dec);
      seg_grads(x, dec, &s_mask, red);
    });
  }
}

// ---- host driver ------------------------------------------------------------------------------

// One call's packed inputs and segment tables.
template <class T>
struct DeltaCall {
  using R = Acc<T>;
  const detail::Resolved& r;
  cudaStream_t s;
  LvlGrid grid;
  int dk, dv, Ls = 1, nL;
  int64_t Ttot, N, NH, nseg = 0, nmat = 0, ndmat = 0;
  DevBuf<T> q, k, v;
  DevBuf<R> g, beta, lam;
  DevBuf<int64_t> tab, pos0, posn;
  int64_t off_seg0 = 0, off_nseg = 0, off_row = 0, off_pos = 0, off_nr = 0, off_hoff = 0, off_dhoff = 0;
  int blocks = 1;
  int64_t scratch_elems = 0;

  DeltaCall(const detail::Resolved& r_, const ForwardParams& p, cudaStream_t s_)
      : r(r_), s(s_), dk(int(r_.dk)), dv(int(r_.dv)), nL(int(r_.nL)), Ttot(r_.B * r_.T),
        N(int64_t(r_.seqs.size())), NH(N * r_.H) {
    grid.fenwick = r.traits.loglinear;
    // segments [s, e) never cross a multiple of kSeg in absolute positions (§3.3)
    std::vector<int64_t> seg0, nsg, row, pos, nr, hoff, dhoff, p0, pn;
    for (const auto& q_ : r.seqs) {
      seg0.push_back(int64_t(row.size()));
      for (int64_t a = q_.n0, end = q_.n0 + q_.len; a < end;) {
        const int64_t e = std::min((a / kSeg + 1) * kSeg, end);
        row.push_back(q_.b * r.T + q_.row0 + (a - q_.n0));
        pos.push_back(a);
        nr.push_back(e - a);
        hoff.push_back(nmat);
        nmat += grid.nlive(a);
        dhoff.push_back(ndmat);
        ndmat += grid.nlive(e);
        a = e;
      }
      nsg.push_back(int64_t(row.size()) - seg0.back());
      p0.push_back(q_.n0);
      pn.push_back(q_.n0 + q_.len);
      Ls = std::max(Ls, grid.slots(q_.n0 + q_.len));
    }
    nseg = int64_t(row.size());
    std::vector<int64_t> all;
    auto put = [&](const std::vector<int64_t>& x) {
      const int64_t o = int64_t(all.size());
      all.insert(all.end(), x.begin(), x.end());
      return o;
    };
    off_seg0 = put(seg0), off_nseg = put(nsg), off_row = put(row), off_pos = put(pos), off_nr = put(nr);
    off_hoff = put(hoff), off_dhoff = put(dhoff);
    tab = SeqTables::upload(all, s);
    pos0 = SeqTables::upload(p0, s);
    posn = SeqTables::upload(pn, s);
    // inputs: q, k [G][Ttot][dk]; v [H][Ttot][dv]; g, beta [H][Ttot]; lam [H][Ttot][nL]
    q = DevBuf<T>(size_t(r.G * Ttot * dk), s);
    k = DevBuf<T>(size_t(r.G * Ttot * dk), s);
    v = DevBuf<T>(size_t(r.H * Ttot * dv), s);
    if (Ttot > 0) {
      pack_to<T>(q.get(), p.q, r, r.G, dk, dk, -1, s);
      pack_to<T>(k.get(), p.k, r, r.G, dk, dk, -1, s);
      pack_to<T>(v.get(), p.v, r, r.H, dv, dv, -1, s);
      if (r.gate_cols > 0) {
        g = DevBuf<R>(size_t(r.H * Ttot), s);
        HILA_LAUNCH(pack_log_gates<R>, r.H * Ttot, s, g.get(), Strided(p.g), r.T, r.H, Ttot, 0);
      }
      beta = DevBuf<R>(size_t(r.H * Ttot), s);
      HILA_LAUNCH(pack_gates<R>, r.H * Ttot, s, beta.get(), Strided(p.beta), r.T, r.H, Ttot, 0);
      if (grid.fenwick) {
        lam = DevBuf<R>(size_t(r.H * Ttot * nL), s);
        HILA_LAUNCH(pack_rows<R>, r.H * Ttot * nL, s, lam.get(), Strided(p.lam), r.T, r.H, Ttot, nL, nL, -1);
      }
    }
    int dev = 0, sms = 1;
    HILA_CUDA_CHECK(cudaGetDevice(&dev));
    HILA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    blocks = heuristics::delta_portable_blocks(std::max(sweep_items(), nseg * r.H), sms);
    Scratch<R> probe(nullptr, dk, dv, &scratch_elems);
  }

  DeltaArgs<T> args(R* ws, R* scratch) const {
    DeltaArgs<T> a;
    a.q = q.get(), a.k = k.get(), a.v = v.get();
    a.rep = int(r.H / r.G);
    a.g = g.get(), a.beta = beta.get(), a.lam = lam.get(), a.nL = nL;
    a.grid = grid;
    a.l2norm = r.cfg.qk_l2norm;
    a.scale = R(r.scale);
    a.H = int(r.H), a.N = int(N), a.dk = dk, a.dv = dv, a.Ls = Ls, a.Ttot = Ttot;
    const int64_t* t = tab.get();
    a.seq_seg0 = t + off_seg0, a.seq_nseg = t + off_nseg, a.seg_row = t + off_row, a.seg_pos = t + off_pos;
    a.seg_nr = t + off_nr, a.seg_hoff = t + off_hoff, a.seg_dhoff = t + off_dhoff;
    a.nseg = nseg;
    a.ws = ws;
    a.scratch = scratch;
    a.scratch_elems = scratch_elems;
    return a;
  }
  size_t ws_elems() const { return size_t(NH * Ls * dk * dv); }
  DevBuf<R> scratch() const { return DevBuf<R>(size_t(blocks * scratch_elems), s); }

  // Level workspace from a caller state (slots live at `pos`), or zero.
  DevBuf<R> pack_levels(const TensorView& t, const DevBuf<int64_t>& pos) const {
    DevBuf<R> ws(ws_elems(), s, !t.defined());
    if (t.defined())
      HILA_LAUNCH(lvl_pack_state<R>, int64_t(ws_elems()), s, ws.get(), Strided(t), NH, r.H, Ls,
                  grid.fenwick ? t.shape[2] : 1, dk, dv, pos.get(), grid);
    return ws;
  }
  void unpack_levels(const TensorView& t, const R* ws) const {
    if (!t.defined()) return;
    const int64_t Ls_out = grid.fenwick ? t.shape[2] : 1;
    HILA_LAUNCH(lvl_unpack_state<R>, NH * Ls_out * dk * dv, s, Strided(t), ws, NH, r.H, Ls, Ls_out, dk, dv, dk, dv,
                grid);
  }
  int grid_of(int64_t items) const { return int(std::clamp<int64_t>(items, 1, blocks)); }
  // Phase-1 buffers (rows of [H][Ttot][dk], and [H][Ttot][dv] for the intra output) and launch.
  struct Prep {
    DevBuf<R> W, Qt, Kt, K, Oi;
  };
  Prep prepare(DeltaArgs<T>& a, bool want_o) const {
    Prep b;
    const size_t nk = size_t(r.H * Ttot * dk);
    b.W = DevBuf<R>(nk, s), b.Qt = DevBuf<R>(nk, s), b.Kt = DevBuf<R>(nk, s), b.K = DevBuf<R>(nk, s);
    if (want_o) b.Oi = DevBuf<R>(size_t(r.H * Ttot * dv), s);
    a.Wb = b.W.get(), a.Qtb = b.Qt.get(), a.Ktb = b.Kt.get(), a.Kb = b.K.get(), a.Oi = b.Oi.get();
    if (nseg > 0) {
      if (!dry_run()) {  // dry run: workspace_size
        delta_prep_kernel<T><<<grid_of(nseg * r.H), kThreads, 0, s>>>(a);
        HILA_CUDA_CHECK_LAUNCH();
      }
    }
    return b;
  }
  int64_t sweep_items() const { return NH * ((dv + kVTile - 1) / kVTile); }
  void launch_forward(const DeltaArgs<T>& a) const {
    if (NH == 0) return;
    if (!dry_run()) {  // dry run: workspace_size
      delta_fwd_kernel<T><<<grid_of(sweep_items()), kThreads, 0, s>>>(a);
      HILA_CUDA_CHECK_LAUNCH();
    }
  }
  void write_final(const StateView& fin, const R* ws) const {
    unpack_levels(fin.H, ws);
    upload_final_positions(fin.pos, r, s);
  }
};

}  // namespace

template <class T>
void delta_portable_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) {
  using R = Acc<T>;
  const DeltaCall<T> c(r, p, s);
  DevBuf<R> ws = c.pack_levels(p.init.H, c.pos0);
  DevBuf<R> scratch = c.scratch();
  DevBuf<T> O(size_t(r.H * c.Ttot * c.dv), s);
  DeltaArgs<T> a = c.args(ws.get(), scratch.get());
  const auto prep = c.prepare(a, true);
  a.o = O.get();
  c.launch_forward(a);
  if (c.Ttot > 0)
    unpack_to<T>(p.o, O.get(), r, r.H, 1, c.dv, c.dv, R(1), s);
  c.write_final(p.final_state, ws.get());
}

template <class T>
void delta_portable_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) {
  using R = Acc<T>;
  const DeltaCall<T> c(r, p, s);
  const int64_t Ttot = c.Ttot, H = r.H, dk = c.dk, dv = c.dv;
  DevBuf<R> scratch = c.scratch();
  // states-only forward sweep (plus o when asked), storing the levels entering every segment
  DevBuf<R> ws = c.pack_levels(p.init.H, c.pos0);
  DevBuf<R> hbuf(size_t(c.nmat * H * dk * dv), s);
  DevBuf<T> O(p.o.defined() ? size_t(H * Ttot * dv) : 0, s);
  DeltaArgs<T> a = c.args(ws.get(), scratch.get());
  const auto prep = c.prepare(a, p.o.defined());
  a.o = O.get(), a.hbuf = hbuf.get();
  c.launch_forward(a);
  if (p.o.defined() && Ttot > 0)
    unpack_to<T>(p.o, O.get(), r, H, 1, c.dv, c.dv, R(1), s);
  c.write_final(p.final_state, ws.get());
  // reverse sweep from the final-state cotangent
  DevBuf<R> dws = c.pack_levels(p.d_final.H, c.posn);
  DevBuf<T> dO(size_t(H * Ttot * dv), s);
  if (Ttot > 0) pack_to<T>(dO.get(), p.d_o, r, H, c.dv, c.dv, -1, s);
  DevBuf<R> dq(size_t(H * Ttot * dk), s), dkb(size_t(H * Ttot * dk), s), dvb(size_t(H * Ttot * dv), s);
  DevBuf<R> dg(size_t(H * Ttot), s), dbeta(size_t(H * Ttot), s), dlam(size_t(H * Ttot * c.nL), s);
  DevBuf<R> dhbuf(size_t(c.ndmat * H * dk * dv), s);
  DeltaArgs<T> b = a;
  b.ws = dws.get(), b.o = nullptr;
  b.dhbuf = dhbuf.get(), b.dO = dO.get();
  b.dq = dq.get(), b.dk_ = dkb.get(), b.dv_ = dvb.get(), b.dg = dg.get(), b.dbeta = dbeta.get(), b.dlam = dlam.get();
  if (c.NH > 0) {
    if (!dry_run()) {  // dry run: workspace_size
      delta_adj_kernel<T><<<c.grid_of(c.sweep_items()), kThreads, 0, s>>>(b);
      HILA_CUDA_CHECK_LAUNCH();
    }
  }
  if (c.nseg > 0) {
    if (!dry_run()) {  // dry run: workspace_size
      delta_grad_kernel<T><<<c.grid_of(c.nseg * H), kThreads, 0, s>>>(b);
      HILA_CUDA_CHECK_LAUNCH();
    }
  }
  if (Ttot > 0) {
    if (p.dq.defined()) launch_unpack_qk<T>(p.dq, dq.get(), nullptr, p.q, r, c.dk, c.dk, R(r.scale), s);
    if (p.dk.defined()) launch_unpack_qk<T>(p.dk, dkb.get(), nullptr, p.k, r, c.dk, c.dk, R(1), s);
    if (p.dv.defined())
      unpack_to<R>(p.dv, dvb.get(), r, H, 1, c.dv, c.dv, R(1), s);
    if (p.dg.defined())
      HILA_LAUNCH(unpack_log_gate_grads<R>, H * Ttot, s, Strided(p.dg), dg.get(), c.g.get(), r.T, H, Ttot, 0);
    if (p.dbeta.defined()) HILA_LAUNCH(unpack_gates<R>, H * Ttot, s, Strided(p.dbeta), dbeta.get(), r.T, H, Ttot, 0);
    if (p.dlam.defined())
      HILA_LAUNCH(unpack_rows<R>, H * Ttot * c.nL, s, Strided(p.dlam), dlam.get(), r.T, H, 1, Ttot, c.nL, c.nL, R(1));
  }
  c.unpack_levels(p.d_init.H, dws.get());
}

#define HILA_INSTANTIATE(T)                                                                                \
  template void delta_portable_forward<T>(const detail::Resolved&, const ForwardParams&, cudaStream_t); \
  template void delta_portable_backward<T>(const detail::Resolved&, const BackwardParams&, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
