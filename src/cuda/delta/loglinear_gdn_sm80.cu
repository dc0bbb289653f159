// SPDX-License-Identifier: Apache-2.0
// loglinear_gdn on the sm80 tier (tensor cores, delta.cuh; docs/math/LOGLINEAR.md §6.4, §6.5) for calls
// whose sequences start at position 0 without an initial state, in the gated WY form of
// gdn_sm80.cu with the chunk levels carried by one launch of level sweeps per level. Per chunk
// (wy_kernel with LoglinearWy, wy_sm80.cu):
//   M = (tril(Q^ K^T) o Gam) Tg diag(beta)   Qeff = diag(e^b) Q^ - M diag(e^b) K   O = (M o Lam) V
// and chunk N reads, for every set bit m-1 of N, the level-(p + m) state S_N^m through Qeff:
//   O_N += diag(lam^{p+m}) Qeff S_N^m.
// Every level's state sees the same erase as plain GDN, S <- e^B S + K^T diag(e^{B-b}) (-W S), so
// each level is a GDN-like sweep over the second half of its aligned blocks (loglinear_level_sweep_kernel),
// started from the sum of the lower levels at the block's middle (E) plus the chunk before it. The
// backward (section comment above loglinear_level_rsweep_kernel) reverses the level sweeps, then forms the level
// terms (loglinear_grad_kernel), the chunk's own terms (loglinear_intra_bwd_kernel) and the WY backward.
// Both level sweeps run as the sm90 kernels of loglinear_gdn_sm90.cu instead where
// heuristics::loglinear_gdn_sm90_sweep chooses them (on Hopper, unless HILA_DELTA_SM90=0).
// Per-level states and cotangents are stored in 16 bits as GEMM operands; carries, E, dMid, the
// output accumulator and every accumulation are fp32.
#include <optional>

#include "cuda/delta/delta.cuh"
#include "cuda/delta/gdn_call_sm80.cuh"
#include "cuda/delta/loglinear_gdn_sm90.cuh"
#include "cuda/delta/sm80.cuh"
#include "cuda/dispatch/heuristics.h"
#include "cuda/loglinear/tree.cuh"
#include "cuda/prims/levels.cuh"
#include "cuda/prims/pack.cuh"
#include "cuda/runtime/config.h"

namespace hila::cuda {

using namespace gdn;

namespace {

// loglinear_gdn's level sweeps (docs/math/LOGLINEAR.md §6.4 by chunk levels). With C = 2^p, chunk N of a
// sequence (from position 0) reads the chunk-level state of level p + m for every set bit m-1 of
// N; that state holds the tokens of the first half [st, mid) of N's aligned block of 2^m chunks
// (st = (N >> m) << m, mid = st + 2^{m-1}), carried through the chunks in between by the same
// erase as plain GDN. The first half's sum at mid is the sum of the lower levels' states at mid
// plus chunk mid-1's own tokens:
//   S_mid = E[mid] + K^T diag(e^{B-b}) U          (chunk mid-1; E[mid]: the states of levels
//                                                  1 .. ctz(mid) carried to mid, fp32)
// and for N in [mid, st + 2^m):  Vn = -W S,  o_N += diag(lam^{p+m}) Qeff S,  S <- e^B S + K^T diag(e^{B-b}) Vn.
// At the block's end S is the level-m part of E[st + 2^m] (level 1 stores, higher levels add:
// the levels run as consecutive launches, m = 1, 2, ..., so each E is complete when it is read).
// With a final state (length F C + r) the block whose second half holds F leaves its S in
// fin[p + m]. Grid (N x H, ceil((chunks + 1) / 2^m), dv tiles of 64), 8 warps; the state in
// registers as in delta_sweep_kernel; per chunk W, K, b double-buffered, Qeff and lam in one buffer.
// (LoglinearSweepArgs: loglinear_gdn_sm90.cuh)

template <class T>
__global__ void __launch_bounds__(kThreads, 2) loglinear_level_sweep_kernel(GlaArgs<T> a, LoglinearSweepArgs<T> x, int m) {
  extern __shared__ __align__(128) char smem[];
  SweepTiles<T> s(smem, a.dk, true);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const SweepItem it(a);
  const int seq = it.seq, h = it.h, v0 = it.v0, bv = it.bv, nt = it.nt, nch = it.nch;
  const bool active = it.active;
  const int64_t len = it.len, row0 = it.row0;
  const int half = 1 << (m - 1);
  const int64_t st0 = int64_t(blockIdx.y) << m, mid = st0 + half, end = st0 + 2 * half;
  const int64_t F = len / kChunk;
  const bool fin_here = x.fin && mid <= F && F < end;  // this block holds level p + m of the final state
  if (mid > nch || (mid == nch && !fin_here)) return;  // no chunk reads it
  const int64_t stop = end < nch ? end : nch;
  const T* Wh = x.W + int64_t(h) * a.Ttot * a.dk;
  const T* Uh = x.U + int64_t(h) * a.Ttot * a.dv;
  const T* Qh = x.qeff + int64_t(h) * a.Ttot * a.dk;
  const T* Kh = a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk);
  const int64_t kld = row_ld(a.k_ld, a.dk);
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const int64_t mat = int64_t(a.dk) * a.dv, c0 = a.chunk0[seq];
  auto issue = [&](int64_t c) { s.issue(c, Wh, Kh, kld, b, row0, len, a.dk); };  // W, K, b of chunk c
  auto issue_q = [&](int64_t c) {  // Qeff of chunk c and lam^{p+m} of its rows (when o is wanted)
    if (!x.o) return;
    const int64_t r0 = row0 + c * kChunk;
    const int nr = rows_in(len, c);
    mma::async_rows(s.Qe(), s.ldk, Qh, a.dk, r0, nr, 0, a.dk, kChunk);
    if (threadIdx.x < kChunk) {
      const bool in = int(threadIdx.x) < nr;
      mma::cp_async4(s.lam + threadIdx.x,
                    in ? static_cast<const void*>(x.lam + (int64_t(h) * a.Ttot + r0 + threadIdx.x) * x.nL + kLogChunk + m)
                       : Wh,
                    in ? 4 : 0);
    }
    mma::cp_async_commit();
  };
  float acc[8][4];  // rows 16w + g (+8), columns v0 + 8j + 2t (+1)
  mma::zero(acc);
  {  // S = K^T diag(e^{B-b}) U over chunk mid - 1 (U [C, bv] into Vns), then + E[mid]
    const int64_t c = mid - 1;
    const int nr = rows_in(len, c);
    issue(c);
    mma::async_rows(s.Vns, kLd, Uh, a.dv, row0 + c * kChunk, nr, v0, bv, kChunk);
    mma::cp_async_commit();
    mma::cp_async_wait<0>();
    __syncthreads();
    if (mid < stop) issue(mid);
    erase_add(acc, active, s.K(int(c % kSweepStages)), s.ldk, s.Vns, nt, s.b(int(c % kSweepStages)), nr);
    if (m > 1) {
      const float* src = x.E + ((c0 + mid) * a.H + h) * mat;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (active && j < nt) acc[j][e] += src[fr.off_of<int64_t>(16 * w, e, a.dv, v0, j)];
    }
    __syncthreads();  // Vns is read
    if (mid < stop) issue_q(mid);
  }
  for (int64_t c = mid; c < stop; ++c) {
    mma::cp_async_wait<0>();
    __syncthreads();  // chunk c has landed; chunk c-1's reads of Ss, Vns and the other stage are done
    if (c + 1 < stop) issue(c + 1);
    const int sg = int(c % kSweepStages), nr = rows_in(len, c);
    const int64_t r0 = row0 + c * kChunk;
    stash_state(acc, active, s.Ss, x.hl ? x.hl + (((m - 1) * a.nchunks + c0 + c) * a.H + h) * mat : nullptr, a.dk, a.dv,
                v0, bv);  // (1) S -> 16-bit Ss (and hl)
    __syncthreads();
    {  // (2) Vn = -W Ss -> Vns;  o += diag(lam^{p+m}) Qeff Ss   [C,dk]x[dk,64] each
      const int m0 = 16 * (w & 3), n0 = 32 * (w >> 2);
      float y[4][4], z[4][4];
      mma::zero(y), mma::zero(z);
      mma::warp_gemm<T, 4, false, true>(y, s.W(sg), s.ldk, m0, s.Ss, kLd, n0, 4, 0, a.dk);
      if (x.o) mma::warp_gemm<T, 4, false, true>(z, s.Qe(), s.ldk, m0, s.Ss, kLd, n0, 4, 0, a.dk);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = fr.row(m0, hf), col = fr.col(n0, j);
          *reinterpret_cast<uint32_t*>(s.Vns + i * kLd + col) = mma::pack2<T>(-y[j][2 * hf], -y[j][2 * hf + 1]);
          if (x.o && i < nr && col < bv) {
            float2* o = reinterpret_cast<float2*>(x.o + (int64_t(h) * a.Ttot + r0 + i) * a.dv + v0 + col);
            const float lm = s.lam[i];
            float2 v = *o;
            v.x += lm * z[j][2 * hf], v.y += lm * z[j][2 * hf + 1];
            *o = v;
          }
        }
    }
    __syncthreads();  // Qeff, lam and Ss are read
    if (c + 1 < stop) issue_q(c + 1);
    erase_add(acc, active, s.K(sg), s.ldk, s.Vns, nt, s.b(sg), nr);  // (3) S = e^B S + K^T diag(e^{B-b}) Vn
  }
  // E[end] (level 1 stores, higher levels add), when some chunk or the final state reads it
  if (end < nch || (end == nch && x.fin && len % kChunk == 0 && F == end)) {
    float* dst = x.E + ((c0 + end) * a.H + h) * mat;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (active && j < nt) {
          float* d = fr.at_of<int64_t>(dst, 16 * w, e, a.dv, v0, j);
          *d = m == 1 ? acc[j][e] : *d + acc[j][e];
        }
  }
  if (fin_here) store_state(x.fin + ((int64_t(seq) * a.H + h) * x.Ls + kLogChunk + m) * mat, acc, active, a.dv, v0, bv);
}


// ---- loglinear_gdn backward (docs/math/LOGLINEAR.md §6.5 in the level form of loglinear_level_sweep_kernel) ----
// With S_N^m the level-m state entering chunk N (m in R(N): the set bits m-1 of N) and dT_N^m the
// cotangent of that state after chunk N's erase, dNew_N the cotangent of chunk N's own tokens
// K^T diag(w) U (= dMid[N+1], the cotangent of the state at the start of the level whose first
// chunk is N+1), w = e^{B-b}:
//   reverse level sweeps:  dS_N^m = e^B dT_N^m - W^T diag(w) K dT_N^m + Qeff^T diag(lam^{p+m}) dO_N
//   loglinear_grad_kernel:        G = sum_m dT^m S^m^T  [dk,dk];  dQeff = sum_m diag(lam^{p+m}) dO S^m^T;
//                          dlam_i^{p+m} = dO_i . (Qeff S^m)_i;  dU = diag(w) K dNew;  dW = -diag(w) K G;
//                          dK = diag(w) (U dNew^T - W G^T);  dw_i = (K dNew)_i . U_i - (K G)_i . W_i,
//                          db_i = -w_i dw_i, and at the last row dB = sum_i w_i dw_i + e^B tr(G)
//   loglinear_intra_bwd_kernel:   through O = (M o Lam) V, Qeff = diag(e^b) Q^ - M diag(e^b) K, M = P TgU,
//                          P = tril(Q^ K^T) o Gam: dM, dLam (-> dlam by the level table), dV, dQ^,
//                          dK, db and dTgU = P^T dM for the WY backward
//   wy_bwd_kernel:         dTg from dU, dW and dTgU; dk, dv, dbeta, and dg = the chunk's reverse cumsum of db.

// The reverse level sweep of level m: grid (N x H, level-m blocks, dv tiles of 64), 8 warps; the
// cotangent in registers as in delta_rsweep_kernel; per chunk (last first) Qeff, K, W [C, dk],
// dO [C, 64] and lam^{p+m}, b double-buffered (RsweepTiles::lam).
// (LoglinearRsweepArgs: loglinear_gdn_sm90.cuh)

template <class T>
__global__ void __launch_bounds__(kThreads) loglinear_level_rsweep_kernel(GlaArgs<T> a, LoglinearRsweepArgs<T> x, int m) {
  extern __shared__ __align__(128) char smem[];
  RsweepTiles<T> s(smem, a.dk);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const SweepItem it(a);
  const int seq = it.seq, h = it.h, v0 = it.v0, bv = it.bv, nt = it.nt, nch = it.nch;
  const bool active = it.active;
  const int64_t len = it.len, row0 = it.row0;
  const int half = 1 << (m - 1);
  const int64_t st0 = int64_t(blockIdx.y) << m, mid = st0 + half, end = st0 + 2 * half;
  if (mid >= nch) return;
  const int64_t stop = end < nch ? end : nch, mat = int64_t(a.dk) * a.dv, c0 = a.chunk0[seq];
  const T* Qh = x.qeff + int64_t(h) * a.Ttot * a.dk;
  const T* Kh = a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk);
  const int64_t kld = row_ld(a.k_ld, a.dk);
  const T* Wh = x.W + int64_t(h) * a.Ttot * a.dk;
  const T* dOh = a.dO + h * head_stride(a.dO_hs, a.Ttot, a.dv);
  const int64_t dold = row_ld(a.dO_ld, a.dv);
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  float acc[8][4];
  load_state(acc, active, end < nch ? x.dmid + ((c0 + end) * a.H + h) * mat : nullptr, a.dv, v0, bv);
  auto issue = [&](int64_t c) {
    const int sg = int(c & 1);
    const int64_t r0 = row0 + c * kChunk;
    const int nr = rows_in(len, c);
    mma::async_rows(s.Q(sg), s.ldk, Qh, a.dk, r0, nr, 0, a.dk, kChunk);
    mma::async_rows(s.K(sg), s.ldk, Kh, kld, r0, nr, 0, a.dk, kChunk);
    mma::async_rows(s.W(sg), s.ldk, Wh, a.dk, r0, nr, 0, a.dk, kChunk);
    mma::async_rows(s.dO(sg), kLd, dOh, dold, r0, nr, v0, bv, kChunk);
    if (threadIdx.x < kChunk) {
      const bool in = int(threadIdx.x) < nr;
      mma::cp_async4(s.lam(sg) + threadIdx.x,
                    in ? static_cast<const void*>(x.lam + (int64_t(h) * a.Ttot + r0 + threadIdx.x) * x.nL + kLogChunk + m)
                       : Wh,
                    in ? 4 : 0);
      const bool inb = b && in;
      mma::cp_async4(s.b(sg) + threadIdx.x, inb ? static_cast<const void*>(b + r0 + threadIdx.x) : Wh, inb ? 4 : 0);
    }
    mma::cp_async_commit();
  };
  issue(stop - 1);
  for (int64_t c = stop - 1; c >= mid; --c) {
    mma::cp_async_wait<0>();
    __syncthreads();  // chunk c has landed; chunk c+1's reads of dSs, dVns and the other stage are done
    if (c > mid) issue(c - 1);
    const int sg = int(c & 1), nr = rows_in(len, c);
    // (1) dT -> 16-bit dSs and dhl
    stash_state(acc, active, s.dSs, x.dhl + (((m - 1) * a.nchunks + c0 + c) * a.H + h) * mat, a.dk, a.dv, v0, bv);
    __syncthreads();
    const float* bt = s.b(sg);
    const float B = bt[nr - 1];
    {  // (2) dVn = diag(e^{B-b}) K dSs
      const int m0 = 16 * (w & 3), n0 = 32 * (w >> 2);
      float y[4][4];
      mma::zero(y);
      mma::warp_gemm<T, 4, false, true>(y, s.K(sg), s.ldk, m0, s.dSs, kLd, n0, 4, 0, a.dk);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = fr.row(m0, hf), col = fr.col(n0, j);
          const float wi = __expf(B - bt[i]);
          *reinterpret_cast<uint32_t*>(s.dVns + i * kLd + col) = mma::pack2<T>(wi * y[j][2 * hf], wi * y[j][2 * hf + 1]);
        }
    }
    __syncthreads();
    // (3) dS = e^B dT - W^T dVn + Qeff^T diag(lam^{p+m}) dO
    const float decay = __expf(B);
    const float* lm = s.lam(sg);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] *= decay;
    if (active) {
      mma::warp_gemm_tn_weighted<T, 8>(acc, s.W(sg), s.ldk, 16 * w, s.dVns, kLd, nt, kChunk, [](int) { return -1.f; });
      mma::warp_gemm_tn_weighted<T, 8>(acc, s.Q(sg), s.ldk, 16 * w, s.dO(sg), kLd, nt, kChunk,
                                      [&](int k) { return lm[k]; });
    }
  }
  store_state(x.dmid + ((c0 + mid) * a.H + h) * mat, acc, active, a.dv, v0, bv);
  stash_state(acc, active, s.dSs, x.dmid16 + ((c0 + mid) * a.H + h) * mat, a.dk, a.dv, v0, bv);
}

// loglinear_grad_kernel: the level terms of one chunk (the section comment); grid (nchunks, H), 8 warps.
// Warp w: rows 16w of G [dk, dk]; rows 16 (w % 4) and the column half w / 4 of every [C, d] product.
// Smem (16-bit): K, W, Qeff [C, dk+8]; dO, U [C, dv+8]; two buffers of S [dk, max(dk,dv)+8] and dT
// [dk, dv+8] (the next level's arrive while this one is used; after the levels G goes over S and
// dNew over dT); fp32 per-row sums.
template <class T>
struct LoglinearGradArgs {
  const T* W = nullptr;        // [H][Ttot][dk]
  const T* U = nullptr;        // [H][Ttot][dv]
  const T* qeff = nullptr;     // [H][Ttot][dk]
  const float* lam = nullptr;  // [H][Ttot][nL]
  int nL = 0;
  const T *hl = nullptr, *dhl = nullptr;  // [top][nchunks][H][dk][dv]
  const T* dmid = nullptr;                // [nchunks + 1][H][dk][dv] (16-bit)
  float* dqeff = nullptr;                 // [H][Ttot][dk] out
  T* dqeff16 = nullptr;                   // the same in 16 bits (loglinear_intra_bwd_kernel's GEMM operand)
  T *dw = nullptr, *du = nullptr;         // [H][Ttot][dk], [H][Ttot][dv] out (16-bit, for wy_bwd_kernel)
  float* dk = nullptr;                    // [H][Ttot][dk] out
  float* db = nullptr;                    // [H][Ttot] out
  float* dlam = nullptr;                  // [H][Ttot][nL] out: levels p+1 ..
};

template <class T>
struct LoglinearGradTiles {
  T *K, *W, *Qe, *dO, *U, *S[2], *dT[2];
  float *red, *w;
  int ldk, ldv, lds;
  __host__ __device__ LoglinearGradTiles(char* base, int dk, int dv, size_t* bytes = nullptr)
      : ldk(ld_of(dk)), ldv(ld_of(dv)), lds(ld_of(dk > dv ? dk : dv)) {
    Carve c{base};
    K = c.take<T>(size_t(kChunk) * ldk);
    W = c.take<T>(size_t(kChunk) * ldk);
    Qe = c.take<T>(size_t(kChunk) * ldk);
    dO = c.take<T>(size_t(kChunk) * ldv);
    U = c.take<T>(size_t(kChunk) * ldv);
    for (int b = 0; b < 2; ++b) {
      S[b] = c.take<T>(size_t(dk) * lds);
      dT[b] = c.take<T>(size_t(dk) * ldv);
    }
    red = c.take<float>(size_t(kChunk) * 4);
    w = c.take<float>(kChunk + 8);
    if (bytes) *bytes = c.used;
  }
};

template <class T>
__global__ void __launch_bounds__(kThreads) loglinear_grad_kernel(GlaArgs<T> a, LoglinearGradArgs<T> x) {
  extern __shared__ __align__(128) char smem[];
  const int dk = a.dk, dv = a.dv;
  LoglinearGradTiles<T> s(smem, dk, dv);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const int rb = w & 3, ch = w >> 2, i0 = 16 * rb + g, i1 = i0 + 8;
  const ChunkItem it(a);
  const int64_t cg = it.cg, c = it.c, r0 = it.r0, rowbase = it.rowbase;
  const int h = it.h, seq = it.seq, nr = it.nr;
  const int64_t nch = (a.len[seq] + kChunk - 1) / kChunk, mat = int64_t(dk) * dv;
  int ck0, nkt, cv0, nvt;
  mma::col_half(dk, ch, ck0, nkt);
  mma::col_half(dv, ch, cv0, nvt);
  mma::async_rows(s.K, s.ldk, a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, dk), row_ld(a.k_ld, dk), r0, nr, 0, dk,
                 kChunk);
  mma::async_rows(s.W, s.ldk, x.W + int64_t(h) * a.Ttot * dk, dk, r0, nr, 0, dk, kChunk);
  mma::async_rows(s.Qe, s.ldk, x.qeff + int64_t(h) * a.Ttot * dk, dk, r0, nr, 0, dk, kChunk);
  mma::async_rows(s.dO, s.ldv, a.dO + h * head_stride(a.dO_hs, a.Ttot, dv), row_ld(a.dO_ld, dv), r0, nr, 0, dv, kChunk);
  mma::async_rows(s.U, s.ldv, x.U + int64_t(h) * a.Ttot * dv, dv, r0, nr, 0, dv, kChunk);
  // the levels read by chunk c: its set bits m - 1, ascending (level after m: m + 1 + ctz(c >> m))
  auto next_level = [&](int m) { return (c >> m) ? m + 1 + ctz64u(uint64_t(c >> m)) : 0; };
  auto issue_level = [&](int m, int buf) {
    const int64_t lv = (((m - 1) * a.nchunks + cg) * a.H + h) * mat;
    mma::async_rows(s.S[buf], s.lds, x.hl + lv, dv, 0, dk, 0, dv, dk);
    mma::async_rows(s.dT[buf], s.ldv, x.dhl + lv, dv, 0, dk, 0, dv, dk);
  };
  const int first = next_level(0);
  if (first) issue_level(first, 0);
  mma::cp_async_commit();
  const float* bh = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const float B = gate_at(bh, r0, nr - 1, nr);
  if (threadIdx.x < kChunk) s.w[threadIdx.x] = int(threadIdx.x) < nr ? __expf(B - gate_at(bh, r0, threadIdx.x, nr)) : 0.f;
  float G[16][4], dq[8][4];
  mma::zero(G), mma::zero(dq);
  const bool grow = 16 * w < dk;
  for (int m = first, buf = 0; m; m = next_level(m), buf ^= 1) {
    mma::cp_async_wait<0>();
    __syncthreads();  // level m is in (the first time: K, W, Qeff, dO, U too); the other buffer is free
    if (const int n = next_level(m)) {
      issue_level(n, buf ^ 1);
      mma::cp_async_commit();
    }
    const T *S = s.S[buf], *dT = s.dT[buf];
    if (grow) mma::warp_gemm<T, 16, false, false>(G, dT, s.ldv, 16 * w, S, s.lds, 0, dk / 8, 0, dv);  // dT S^T
    const float l0 = i0 < nr ? x.lam[(rowbase + i0) * x.nL + kLogChunk + m] : 0.f;
    const float l1 = i1 < nr ? x.lam[(rowbase + i1) * x.nL + kLogChunk + m] : 0.f;
    {  // dQeff += diag(lam) dO S^T   [C,dv]x[dv,dk]
      float y[8][4];
      mma::zero(y);
      mma::warp_gemm<T, 8, false, false>(y, s.dO, s.ldv, 16 * rb, S, s.lds, ck0, nkt, 0, dv);
#pragma unroll
      for (int j = 0; j < 8; ++j) dq[j][0] += l0 * y[j][0], dq[j][1] += l0 * y[j][1], dq[j][2] += l1 * y[j][2], dq[j][3] += l1 * y[j][3];
    }
    {  // dlam^{p+m} = rowsum(dO o Qeff S)   [C,dk]x[dk,dv]
      float z[8][4];
      mma::zero(z);
      mma::warp_gemm<T, 8, false, true>(z, s.Qe, s.ldk, 16 * rb, S, s.lds, cv0, nvt, 0, dk);
      float d0 = 0.f, d1 = 0.f;
      mma::dot_rows<T, 8>(z, s.dO, s.ldv, i0, i1, cv0, nvt, d0, d1);
      d0 += __shfl_xor_sync(0xffffffffu, d0, 1), d0 += __shfl_xor_sync(0xffffffffu, d0, 2);
      d1 += __shfl_xor_sync(0xffffffffu, d1, 1), d1 += __shfl_xor_sync(0xffffffffu, d1, 2);
      if (t == 0) s.red[i0 * 4 + ch] = d0, s.red[i1 * 4 + ch] = d1;
    }
    __syncthreads();  // this level's S, dT are read; the row sums are in
    if (threadIdx.x < nr)
      x.dlam[(rowbase + threadIdx.x) * x.nL + kLogChunk + m] = s.red[threadIdx.x * 4] + s.red[threadIdx.x * 4 + 1];
  }
  // dNew (16-bit) into dT[0]; G -> 16-bit over S[0]; tr(G)
  mma::async_rows(s.dT[0], s.ldv, x.dmid + ((cg + 1) * a.H + h) * mat, dv, 0, c + 1 < nch ? dk : 0, 0, dv, dk);
  mma::cp_async_commit();
  float tr = 0.f;
  T* const Gs = s.S[0];
  T* const dN = s.dT[0];
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = fr.row(16 * w, hf), col = fr.col(0, j);
      if (grow && col < dk) {
        *reinterpret_cast<uint32_t*>(Gs + r * s.lds + col) = mma::pack2<T>(G[j][2 * hf], G[j][2 * hf + 1]);
        tr += (r == col ? G[j][2 * hf] : 0.f) + (r == col + 1 ? G[j][2 * hf + 1] : 0.f);
      }
    }
  for (int o = 16; o > 0; o >>= 1) tr += __shfl_xor_sync(0xffffffffu, tr, o);
  if (lane == 0) s.w[kChunk + w] = tr;
  mma::cp_async_wait<0>();
  __syncthreads();  // G, dNew, the traces (and, without levels, K, W, Qeff, dO, U) are in
  const float w0 = s.w[i0], w1 = s.w[i1];
  float dw0 = 0.f, dw1 = 0.f;  // this thread's parts of dw_i
  {  // dW = -diag(w) K G  [C,dk]x[dk,dk]; (K G)_i . W_i
    float y[8][4];
    mma::zero(y);
    mma::warp_gemm<T, 8, false, true>(y, s.K, s.ldk, 16 * rb, Gs, s.lds, ck0, nkt, 0, dk);
    float d0 = 0.f, d1 = 0.f;
    mma::dot_rows<T, 8>(y, s.W, s.ldk, i0, i1, ck0, nkt, d0, d1);
    dw0 -= d0, dw1 -= d1;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nkt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0;
          const float wi = hf ? w1 : w0;
          if (i < nr)
            *reinterpret_cast<uint32_t*>(x.dw + (rowbase + i) * dk + ck0 + 8 * j + 2 * t) =
                mma::pack2<T>(-wi * y[j][2 * hf], -wi * y[j][2 * hf + 1]);
        }
  }
  {  // dU = diag(w) K dNew  [C,dk]x[dk,dv]; (K dNew)_i . U_i
    float y[8][4];
    mma::zero(y);
    mma::warp_gemm<T, 8, false, true>(y, s.K, s.ldk, 16 * rb, dN, s.ldv, cv0, nvt, 0, dk);
    float d0 = 0.f, d1 = 0.f;
    mma::dot_rows<T, 8>(y, s.U, s.ldv, i0, i1, cv0, nvt, d0, d1);
    dw0 += d0, dw1 += d1;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nvt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0;
          const float wi = hf ? w1 : w0;
          if (i < nr)
            *reinterpret_cast<uint32_t*>(x.du + (rowbase + i) * dv + cv0 + 8 * j + 2 * t) =
                mma::pack2<T>(wi * y[j][2 * hf], wi * y[j][2 * hf + 1]);
        }
  }
  {  // dK = diag(w) (U dNew^T - W G^T)   [C,dv]x[dv,dk], [C,dk]x[dk,dk]
    float y[8][4], z[8][4];
    mma::zero(y), mma::zero(z);
    mma::warp_gemm<T, 8, false, false>(y, s.U, s.ldv, 16 * rb, dN, s.ldv, ck0, nkt, 0, dv);
    mma::warp_gemm<T, 8, false, false>(z, s.W, s.ldk, 16 * rb, Gs, s.lds, ck0, nkt, 0, dk);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nkt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0;
          const float wi = hf ? w1 : w0;
          if (i < nr) {
            *reinterpret_cast<float2*>(x.dk + (rowbase + i) * dk + ck0 + 8 * j + 2 * t) =
                make_float2(wi * (y[j][2 * hf] - z[j][2 * hf]), wi * (y[j][2 * hf + 1] - z[j][2 * hf + 1]));
            *reinterpret_cast<float2*>(x.dqeff + (rowbase + i) * dk + ck0 + 8 * j + 2 * t) =
                make_float2(dq[j][2 * hf], dq[j][2 * hf + 1]);
            *reinterpret_cast<uint32_t*>(x.dqeff16 + (rowbase + i) * dk + ck0 + 8 * j + 2 * t) =
                mma::pack2<T>(dq[j][2 * hf], dq[j][2 * hf + 1]);
          }
        }
  }
  // db_i = -w_i dw_i; dB = sum_i w_i dw_i + e^B tr(G) at the last row
  dw0 += __shfl_xor_sync(0xffffffffu, dw0, 1), dw0 += __shfl_xor_sync(0xffffffffu, dw0, 2);
  dw1 += __shfl_xor_sync(0xffffffffu, dw1, 1), dw1 += __shfl_xor_sync(0xffffffffu, dw1, 2);
  if (t == 0) s.red[i0 * 4 + 2 + ch] = dw0, s.red[i1 * 4 + 2 + ch] = dw1;
  __syncthreads();
  if (w == 0) {
    float dB = 0.f;
    for (int i = lane; i < nr; i += 32) {
      const float dwi = s.red[i * 4 + 2] + s.red[i * 4 + 3];
      dB += s.w[i] * dwi;
      s.red[i * 4] = -s.w[i] * dwi;
    }
    for (int o = 16; o > 0; o >>= 1) dB += __shfl_xor_sync(0xffffffffu, dB, o);
    float trG = 0.f;
    for (int k = 0; k < kThreads / 32; ++k) trG += s.w[kChunk + k];
    __syncwarp();
    for (int i = lane; i < nr; i += 32)
      x.db[rowbase + i] = s.red[i * 4] + (i == nr - 1 ? dB + __expf(B) * trG : 0.f);
  }
}

// loglinear_intra_bwd_kernel: the chunk's own terms (the section comment); grid (nchunks, H), 8 warps,
// after loglinear_grad_kernel (it adds to that kernel's dk and db and writes the in-chunk levels of dlam).
// Warp w: rows 16 (w % 4); columns 32 (w / 4) of the [C, C] products, the column half w / 4 of the
// [C, d] ones. Smem (16-bit): Q, K, dQeff [C, dk+8]; V, dO [C, dv+8]; TgU, P, Mb, M o Lam, dM, dP o Gam
// [C, 72]; fp32 per row: b, beta, lam and dlam of levels 0..p, db.
template <class T>
struct LoglinearIntraArgs {
  const float* beta = nullptr;   // [H][Ttot]
  const float* lam = nullptr;    // [H][Ttot][nL]
  int nL = 0;
  const T* tg = nullptr;         // [nchunks][H][C][C]
  const float* dqeff = nullptr;  // [H][Ttot][dk]
  const T* dqeff16 = nullptr;    // the same in 16 bits
  float* dq = nullptr;           // [H][Ttot][dk] out: dQ^
  float* dk = nullptr;           // [H][Ttot][dk] in/out (added to)
  float* dv = nullptr;           // [H][Ttot][dv] out
  float* db = nullptr;           // [H][Ttot] in/out (added to)
  float* dlam = nullptr;         // [H][Ttot][nL] out: levels 0..p
  float* dtgu = nullptr;         // [nchunks][H][C][C] out: P^T dM
};

template <class T>
struct LoglinearIntraTiles {
  T *Q, *K, *dQe, *V, *dO, *TgU, *P, *Mb, *Pl, *dM, *dPg;
  float *b, *beta, *lam, *dlam, *db;
  int ldk, ldv;
  __host__ __device__ LoglinearIntraTiles(char* base, int dk, int dv, size_t* bytes = nullptr) : ldk(ld_of(dk)), ldv(ld_of(dv)) {
    Carve c{base};
    for (T** x : {&Q, &K, &dQe}) *x = c.take<T>(size_t(kChunk) * ldk);
    for (T** x : {&V, &dO}) *x = c.take<T>(size_t(kChunk) * ldv);
    for (T** x : {&TgU, &P, &Mb, &Pl, &dM, &dPg}) *x = c.take<T>(size_t(kChunk) * kLd);
    b = c.take<float>(kChunk);
    beta = c.take<float>(kChunk);
    lam = c.take<float>(size_t(kChunk) * kLamLd);
    dlam = c.take<float>(size_t(kChunk) * kLamLd);
    db = c.take<float>(kChunk);
    if (bytes) *bytes = c.used;
  }
};

template <class T>
__global__ void __launch_bounds__(kThreads) loglinear_intra_bwd_kernel(GlaArgs<T> a, LoglinearIntraArgs<T> x) {
  extern __shared__ __align__(128) char smem[];
  const int dk = a.dk, dv = a.dv;
  LoglinearIntraTiles<T> s(smem, dk, dv);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const int rb = w & 3, ch = w >> 2, m0 = 16 * rb, n0 = 32 * ch, i0 = m0 + g, i1 = i0 + 8;
  const ChunkItem it(a);
  const int64_t cg = it.cg, r0 = it.r0, rowbase = it.rowbase;
  const int h = it.h, nr = it.nr;
  int ck0, nkt, cv0, nvt;
  mma::col_half(dk, ch, ck0, nkt);
  mma::col_half(dv, ch, cv0, nvt);
  const bool lower = n0 <= m0 + 15;
  mma::async_rows(s.Q, s.ldk, a.q + (h / a.q_div) * head_stride(a.q_hs, a.Ttot, dk), row_ld(a.q_ld, dk), r0, nr, 0, dk,
                 kChunk);
  mma::async_rows(s.K, s.ldk, a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, dk), row_ld(a.k_ld, dk), r0, nr, 0, dk,
                 kChunk);
  mma::async_rows(s.V, s.ldv, a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, dv), row_ld(a.v_ld, dv), r0, nr, 0, dv,
                 kChunk);
  mma::async_rows(s.dO, s.ldv, a.dO + h * head_stride(a.dO_hs, a.Ttot, dv), row_ld(a.dO_ld, dv), r0, nr, 0, dv, kChunk);
  mma::async_rows(s.TgU, kLd, x.tg + (cg * a.H + h) * kChunk * kChunk, kChunk, 0, kChunk, 0, kChunk, kChunk);
  mma::async_rows(s.dQe, s.ldk, x.dqeff16 + int64_t(h) * a.Ttot * dk, dk, r0, nr, 0, dk, kChunk);
  mma::cp_async_commit();
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    s.beta[i] = i < nr ? x.beta[rowbase + i] : 0.f;
    s.b[i] = gate_at(a.b ? a.b + int64_t(h) * a.Ttot : nullptr, r0, i, nr);
    s.db[i] = 0.f;
  }
  for (int e = threadIdx.x; e < kChunk * kLamLd; e += blockDim.x) {
    const int i = e / kLamLd, l = e % kLamLd;
    s.lam[e] = i < nr && l < x.nL ? x.lam[(rowbase + i) * x.nL + l] : 0.f;
    s.dlam[e] = 0.f;
  }
  mma::cp_async_wait<0>();
  __syncthreads();
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {  // TgU = Tg diag(beta), in place
    const int i = e / kChunk, j = e % kChunk;
    s.TgU[i * kLd + j] = to<T>(float(s.TgU[i * kLd + j]) * s.beta[j]);
  }
  const float sc = float(a.scale);
  // P = scale tril(Q K^T) o Gam (kept in registers), dPl = tril(dO V^T)
  float pp[4][4], dp[4][4];
  mma::zero(pp), mma::zero(dp);
  if (lower) {
    mma::warp_gemm<T, 4, false, false>(pp, s.Q, s.ldk, m0, s.K, s.ldk, n0, 4, 0, dk);
    mma::warp_gemm<T, 4, false, false>(dp, s.dO, s.ldv, m0, s.V, s.ldv, n0, 4, 0, dv);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = fr.row_of(m0, e), col = fr.col_of(n0, j, e);
      const bool in = col <= i;
      pp[j][e] = in ? sc * __expf(s.b[i] - s.b[col]) * pp[j][e] : 0.f;
      dp[j][e] = in ? dp[j][e] : 0.f;
    }
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      *reinterpret_cast<uint32_t*>(fr.at<int>(s.P, m0, hf, kLd, n0, j)) =
          mma::pack2<T>(pp[j][2 * hf], pp[j][2 * hf + 1]);
  __syncthreads();  // TgU and P are complete
  {  // M = P TgU; dLam = dPl o M (to dlam by level); dM = dPl o Lam - (dQeff K^T) o e^{b_j}; Mb, M o Lam
    float mm[4][4], dmb[4][4];
    mma::zero(mm), mma::zero(dmb);
    if (lower) {
      mma::warp_gemm<T, 4, false, true>(mm, s.P, kLd, m0, s.TgU, kLd, n0, 4, n0, m0 + 16);
      mma::warp_gemm<T, 4, false, false>(dmb, s.dQe, s.ldk, m0, s.K, s.ldk, n0, 4, 0, dk);
    }
    float colb[4][2] = {};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = fr.row(m0, hf), col = fr.col(n0, j);
        float mb[2], pl[2], dm[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int cc = col + e, q = 2 * hf + e;
          mb[e] = pl[e] = dm[e] = 0.f;
          if (cc <= i) {
            const int l = bitlen64u(uint64_t(i ^ cc));
            const float lv = s.lam[i * kLamLd + l], eb = __expf(s.b[cc]);
            atomicAdd(&s.dlam[i * kLamLd + l], dp[j][q] * mm[j][q]);
            mb[e] = mm[j][q] * eb;
            pl[e] = mm[j][q] * lv;
            dm[e] = dp[j][q] * lv - dmb[j][q] * eb;  // Qeff = e^b Q^ - Mb K: dMb = -dQeff K^T
            colb[j][e] -= dmb[j][q] * mb[e];         // db_j from Mb = M diag(e^b)
          }
        }
        *reinterpret_cast<uint32_t*>(s.Mb + i * kLd + col) = mma::pack2<T>(mb[0], mb[1]);
        *reinterpret_cast<uint32_t*>(s.Pl + i * kLd + col) = mma::pack2<T>(pl[0], pl[1]);
        *reinterpret_cast<uint32_t*>(s.dM + i * kLd + col) = mma::pack2<T>(dm[0], dm[1]);
      }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float y = colb[j][e];
        y += __shfl_xor_sync(0xffffffffu, y, 4);
        y += __shfl_xor_sync(0xffffffffu, y, 8);
        y += __shfl_xor_sync(0xffffffffu, y, 16);
        if (g == 0 && lower) atomicAdd(&s.db[n0 + 8 * j + 2 * t + e], y);
      }
  }
  __syncthreads();  // Mb, M o Lam, dM complete
  // dV = (M o Lam)^T dO  [C,C]x[C,dv]
  {
    float y[8][4];
    mma::zero(y);
    mma::warp_gemm<T, 8, true, true>(y, s.Pl, kLd, m0, s.dO, s.ldv, cv0, nvt, m0, kChunk);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nvt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0;
          if (i < nr)
            *reinterpret_cast<float2*>(x.dv + (rowbase + i) * dv + cv0 + 8 * j + 2 * t) =
                make_float2(y[j][2 * hf], y[j][2 * hf + 1]);
        }
  }
  {  // dP = dM TgU^T (lower with its diagonal); db from P's Gam; dP o Gam; dTgU = P^T dM
    float y[4][4], u[4][4];
    mma::zero(y), mma::zero(u);
    if (lower) mma::warp_gemm<T, 4, false, false>(y, s.dM, kLd, m0, s.TgU, kLd, n0, 4, 0, m0 + 16);
    mma::warp_gemm<T, 4, true, true>(u, s.P, kLd, m0, s.dM, kLd, n0, 4, m0, kChunk);
    float row[2] = {0.f, 0.f}, colp[4][2] = {};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = fr.row(m0, hf), col = fr.col(n0, j);
        float v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int cc = col + e, q = 2 * hf + e;
          v[e] = 0.f;
          if (cc <= i) {
            const float d = y[j][q] * pp[j][q];  // P_ij = scale q_i.k_j e^{b_i - b_j}
            row[hf] += d, colp[j][e] -= d;
            v[e] = y[j][q] * __expf(s.b[i] - s.b[cc]);
          }
        }
        *reinterpret_cast<uint32_t*>(s.dPg + i * kLd + col) = mma::pack2<T>(v[0], v[1]);
        *reinterpret_cast<float2*>(x.dtgu + ((cg * a.H + h) * kChunk + i) * kChunk + col) =
            make_float2(u[j][2 * hf], u[j][2 * hf + 1]);
      }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float r = row[hf];
      r += __shfl_xor_sync(0xffffffffu, r, 1);
      r += __shfl_xor_sync(0xffffffffu, r, 2);
      if (t == 0 && lower) atomicAdd(&s.db[m0 + g + 8 * hf], r);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float z = colp[j][e];
        z += __shfl_xor_sync(0xffffffffu, z, 4);
        z += __shfl_xor_sync(0xffffffffu, z, 8);
        z += __shfl_xor_sync(0xffffffffu, z, 16);
        if (g == 0 && lower) atomicAdd(&s.db[n0 + 8 * j + 2 * t + e], z);
      }
  }
  __syncthreads();  // dP o Gam complete
  {  // dQ^ = (dP o Gam) K + diag(e^b) dQeff; db_i += e^{b_i} q^_i . dQeff_i
    float y[8][4];
    mma::zero(y);
    mma::warp_gemm<T, 8, false, true>(y, s.dPg, kLd, m0, s.K, s.ldk, ck0, nkt, 0, m0 + 16);
    float d[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nkt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0, col = ck0 + 8 * j + 2 * t;
          if (i >= nr) continue;
          const float eb = __expf(s.b[i]);
          const float2 dqe = *reinterpret_cast<const float2*>(x.dqeff + (rowbase + i) * dk + col);
          const float2 q = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(s.Q + i * s.ldk + col));
          d[hf] += sc * eb * (q.x * dqe.x + q.y * dqe.y);
          *reinterpret_cast<float2*>(x.dq + (rowbase + i) * dk + col) =
              make_float2(y[j][2 * hf] + eb * dqe.x, y[j][2 * hf + 1] + eb * dqe.y);
        }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float r = d[hf];
      r += __shfl_xor_sync(0xffffffffu, r, 1);
      r += __shfl_xor_sync(0xffffffffu, r, 2);
      if (t == 0) atomicAdd(&s.db[m0 + g + 8 * hf], r);
    }
  }
  {  // dk += scale (dP o Gam)^T Q - Mb^T dQeff   [C,C]x[C,dk] twice
    float y[8][4], z[8][4];
    mma::zero(y), mma::zero(z);
    mma::warp_gemm<T, 8, true, true>(y, s.dPg, kLd, m0, s.Q, s.ldk, ck0, nkt, m0, kChunk);
    mma::warp_gemm<T, 8, true, true>(z, s.Mb, kLd, m0, s.dQe, s.ldk, ck0, nkt, m0, kChunk);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nkt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0;
          if (i >= nr) continue;
          float2* o = reinterpret_cast<float2*>(x.dk + (rowbase + i) * dk + ck0 + 8 * j + 2 * t);
          float2 v = *o;
          v.x += sc * y[j][2 * hf] - z[j][2 * hf], v.y += sc * y[j][2 * hf + 1] - z[j][2 * hf + 1];
          *o = v;
        }
  }
  __syncthreads();  // the shared sums are in
  if (threadIdx.x < nr) x.db[rowbase + threadIdx.x] += s.db[threadIdx.x];
  for (int e = threadIdx.x; e < nr * kLamLd; e += blockDim.x) {
    const int i = e / kLamLd, l = e % kLamLd;
    if (l <= kLogChunk && l < x.nL) x.dlam[(rowbase + i) * x.nL + l] = s.dlam[e];
  }
}


size_t loglinear_grad_smem(int dk, int dv) { return layout_bytes<LoglinearGradTiles<__nv_bfloat16>>(dk, dv); }
size_t loglinear_intra_smem(int dk, int dv) { return layout_bytes<LoglinearIntraTiles<__nv_bfloat16>>(dk, dv); }

}  // namespace

template <class T>
bool loglinear_gdn_sm80_usable(const detail::Resolved& r, bool backward) {
  if constexpr (!kTensorCore<T>) {
    return false;
  } else {
    if (r.cfg.op != Op::loglinear_gdn || r.has_init) return false;
    if (!config().gdn_tc) return false;
    for (const auto& q : r.seqs)
      if (q.n0 != 0) return false;
    const int dk = pad16(r.dk), dv = pad16(r.dv);
    if (!heuristics::delta_sm80(dk, dv, true)) return false;
    const size_t optin = smem_optin();
    size_t need = std::max(wy_smem(dk, dv, false, true), sweep_smem(dk, true));
    // the backward's gradient kernels hold a half of dv per warp column (mma::col_half, 8 tiles of 8):
    // dv <= 128, whatever shared memory would allow
    if (backward && dv > 128) return false;
    if (backward)
      need = std::max({need, rsweep_smem(dk), loglinear_grad_smem(dk, dv), loglinear_intra_smem(dk, dv), wy_bwd_smem(dk, dv)});
    return need <= optin;
  }
}

// loglinear_gdn's forward pass on tensor cores (LoglinearWy, loglinear_level_sweep_kernel), shared
// by the forward
// and the backward: the WY chunks write W, U, Qeff, the intra output (fp32) and the final state's
// in-chunk levels; then the level sweeps m = 1 .. top, each adding its reads to the output,
// carrying E and leaving its final-state level (and, for the backward, the states in hl).
template <class T>
struct LoglinearGdnCall {
  GdnCall<T> x;
  const detail::Resolved& r;
  cudaStream_t s;
  int64_t H, Ttot, dk, dv, nch;
  int nL, Ls = 1, top = 0;
  int64_t reach = 0;  // the largest chunk index a level block must cover
  bool fin;
  DevBuf<float> lam, fws, O, E;
  DevBuf<T> qeff, u16, hl;

  LoglinearGdnCall(const detail::Resolved& r_, const ForwardParams& p, cudaStream_t s_, bool backward)
      : x(r_, p, s_, backward), r(r_), s(s_), H(r_.H), Ttot(x.Ttot), dk(x.dk), dv(x.dv), nch(x.seqs.nchunks),
        nL(int(r_.nL)), fin(p.final_state.H.defined()) {
    for (const auto& q : r.seqs) {
      Ls = std::max(Ls, bitlen64u(uint64_t(q.len)) + 1);
      const int64_t nc = (q.len + kChunk - 1) / kChunk, F = q.len / kChunk;
      const int64_t last = fin ? F : nc - 1;  // levels 1 .. bitlen(last) are read (or held at the end)
      if (last > 0) top = std::max(top, bitlen64u(uint64_t(last))), reach = std::max(reach, last);
    }
    lam = DevBuf<float>(size_t(H * Ttot * nL), s);
    if (Ttot > 0) HILA_LAUNCH(pack_rows<float>, H * Ttot * nL, s, lam.get(), Strided(p.lam), r.T, H, Ttot, nL, nL, -1);
  }
  dim3 grid(int m) const { return dim3(unsigned(x.NH), unsigned((reach >> m) + 1), unsigned((dv + kVT - 1) / kVT)); }

  // The forward in three steps: prepare (its buffers and the WY chunks; tg: the backward's 16-bit
  // Tg), sweeps (the level sweeps on stream st, allocating nothing) and finish (o, the final state).
  void forward(const TensorView& o, const StateView& f) {
    prepare(o, nullptr);
    sweeps(s);
    finish(o, f);
  }
  void prepare(const TensorView& o, T* tg) {
    fws = DevBuf<float>(fin ? size_t(x.NH * Ls * dk * dv) : 0, s, true);
    qeff = DevBuf<T>(size_t(H * Ttot * dk), s);
    u16 = DevBuf<T>(size_t(H * Ttot * dv), s);
    O = DevBuf<float>(o.defined() ? size_t(H * Ttot * dv) : 0, s);
    LoglinearWy<T> lw;
    lw.lam = lam.get(), lw.nL = nL, lw.qeff = qeff.get(), lw.u16 = u16.get(), lw.o = O.get(), lw.fin = fws.get();
    lw.Ls = Ls;
    x.wy(tg, nullptr, lw);
    E = DevBuf<float>(top > 0 ? size_t((nch + 1) * H * dk * dv) : 0, s);
    if (tg) hl = DevBuf<T>(size_t(top * nch * H * dk * dv), s);
  }
  void sweeps(cudaStream_t st) const {
    LoglinearSweepArgs<T> la;
    la.W = x.W.get(), la.U = u16.get(), la.qeff = qeff.get(), la.lam = lam.get(), la.nL = nL;
    la.E = E.get(), la.o = O.get(), la.fin = fws.get(), la.Ls = Ls, la.hl = hl.get();
    if (!(heuristics::loglinear_gdn_sm90_sweep(int(dk), int(dv), Ttot, config().delta_sm90) &&
          loglinear_level_sweeps_sm90(x.a, la, top, reach, st))) {
      const size_t bytes = sweep_smem(int(dk), true);
      set_smem(loglinear_level_sweep_kernel<T>, bytes);
      for (int m = 1; m <= top && !dry_run(); ++m) {
        loglinear_level_sweep_kernel<T><<<grid(m), kThreads, bytes, st>>>(x.a, la, m);
        HILA_CUDA_CHECK_LAUNCH();
      }
    }
  }
  void finish(const TensorView& o, const StateView& f) {
    if (Ttot > 0 && o.defined()) unpack_to<float>(o, O.get(), r, H, 1, int(r.dv), int(dv), 1.f, s);
    if (fin) {
      LvlGrid lg;
      lg.fenwick = true;
      HILA_LAUNCH(lvl_unpack_state<float>, x.NH * f.H.shape[2] * r.dk * r.dv, s, Strided(f.H), fws.get(), x.NH, H, Ls,
                  f.H.shape[2], int(r.dk), int(r.dv), int(dk), int(dv), lg);
    }
    upload_final_positions(f.pos, r, s);  // n0 = 0
  }
};

template <class T>
void loglinear_gdn_sm80_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) {
  if constexpr (kTensorCore<T>) {
    LoglinearGdnCall<T> c(r, p, s, false);
    c.forward(p.o, p.final_state);
  }
}

// loglinear_gdn's backward on tensor cores (the section comment above loglinear_level_rsweep_kernel): the forward
// recomputed with Tg and the level states (its level sweeps on a side stream beside the reverse level sweeps
// m = top .. 1, which read none of their outputs: dMid has its own buffer, not E's), loglinear_grad_kernel,
// loglinear_intra_bwd_kernel, then the WY backward.
template <class T>
void loglinear_gdn_sm80_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) {
  if constexpr (kTensorCore<T>) {
    using R = Acc<T>;
    LoglinearGdnCall<T> c(r, p, s, true);
    GdnCall<T>& x = c.x;
    const int64_t H = r.H, Ttot = c.Ttot, dk = c.dk, dv = c.dv, nch = c.nch;
    const int nL = c.nL;
    DevBuf<T> dO, tg(size_t(nch * H * kChunk * kChunk), s);
    x.a.dO = x.operand(p.d_o, H, int(r.dv), int(dv), dO, x.a.dO_ld, x.a.dO_hs);
    c.prepare(p.o, tg.get());
    // the recomputed level sweeps (hl, E, the output) on a side stream beside the reverse level
    // sweeps (dhl, dMid), which read none of their outputs
    DevBuf<T> dhl(size_t(c.top * nch * H * dk * dv), s), dmid16(c.top > 0 ? size_t((nch + 1) * H * dk * dv) : 0, s);
    DevBuf<float> dmid(c.top > 0 ? size_t((nch + 1) * H * dk * dv) : 0, s);
    std::optional<SideStream> side;
    if (x.NH > 0) side.emplace(s).run([&](cudaStream_t st) { c.sweeps(st); });
    {
      LoglinearRsweepArgs<T> ra;
      ra.W = x.W.get(), ra.qeff = c.qeff.get(), ra.lam = c.lam.get(), ra.nL = nL, ra.dmid = dmid.get(),
      ra.dmid16 = dmid16.get(), ra.dhl = dhl.get();
      if (!(heuristics::loglinear_gdn_sm90_sweep(int(dk), int(dv), Ttot, config().delta_sm90) &&
            loglinear_level_rsweeps_sm90(x.a, ra, c.top, c.reach, s))) {
        const size_t bytes = rsweep_smem(int(dk));
        set_smem(loglinear_level_rsweep_kernel<T>, bytes);
        for (int m = c.top; m >= 1 && !dry_run(); --m) {
          loglinear_level_rsweep_kernel<T><<<c.grid(m), kThreads, bytes, s>>>(x.a, ra, m);
          HILA_CUDA_CHECK_LAUNCH();
        }
      }
    }
    if (side) side->join();
    c.finish(p.o, p.final_state);
    DevBuf<T> dqeff16(size_t(H * Ttot * dk), s);
    DevBuf<float> dqeff(size_t(H * Ttot * dk), s), dka(size_t(H * Ttot * dk), s), db(size_t(H * Ttot), s);
    WyBwdArgs<T> wb;  // the WY backward's; dk straight into the caller's tensor where its layout allows
    const bool dk_direct = x.dk_in_wy_bwd(p, wb);
    DevBuf<float> dq(size_t(H * Ttot * dk), s), dvb(size_t(H * Ttot * dv), s);
    DevBuf<float> dkw(dk_direct ? 0 : size_t(H * Ttot * dk), s);  // the WY part of dk, unless direct
    DevBuf<float> dbeta(size_t(H * Ttot), s), dlam(size_t(H * Ttot * nL), s, true);
    DevBuf<float> dtgu(size_t(nch * H * kChunk * kChunk), s);  // db becomes dg in place (wy_bwd_kernel)
    DevBuf<T> dW(size_t(H * Ttot * dk), s), dU(size_t(H * Ttot * dv), s);
    if (nch > 0 && !dry_run()) {
      const dim3 grid{unsigned(nch), unsigned(H)};
      LoglinearGradArgs<T> ga;
      ga.W = x.W.get(), ga.U = c.u16.get(), ga.qeff = c.qeff.get(), ga.lam = c.lam.get(), ga.nL = nL;
      ga.hl = c.hl.get(), ga.dhl = dhl.get(), ga.dmid = dmid16.get();
      ga.dqeff = dqeff.get(), ga.dqeff16 = dqeff16.get(), ga.dw = dW.get(), ga.du = dU.get(), ga.dk = dka.get(), ga.db = db.get(),
      ga.dlam = dlam.get();
      size_t bytes = loglinear_grad_smem(int(dk), int(dv));
      set_smem(loglinear_grad_kernel<T>, bytes);
      loglinear_grad_kernel<T><<<grid, kThreads, bytes, s>>>(x.a, ga);
      HILA_CUDA_CHECK_LAUNCH();
      LoglinearIntraArgs<T> ia;
      ia.beta = x.beta.get(), ia.lam = c.lam.get(), ia.nL = nL, ia.tg = tg.get(), ia.dqeff = dqeff.get();
      ia.dqeff16 = dqeff16.get();
      ia.dq = dq.get(), ia.dk = dka.get(), ia.dv = dvb.get(), ia.db = db.get(), ia.dlam = dlam.get(),
      ia.dtgu = dtgu.get();
      bytes = loglinear_intra_smem(int(dk), int(dv));
      set_smem(loglinear_intra_bwd_kernel<T>, bytes);
      loglinear_intra_bwd_kernel<T><<<grid, kThreads, bytes, s>>>(x.a, ia);
      HILA_CUDA_CHECK_LAUNCH();
      wb.beta = x.beta.get(), wb.tg = tg.get(), wb.dvn = dU.get();
      wb.dk = dk_direct ? dka.get() : dkw.get(), wb.dv = dvb.get(), wb.dg = db.get(), wb.dbeta = dbeta.get();
      wb.dw = dW.get(), wb.dtgu = dtgu.get(), wb.dv_add = true;
      launch_wy_bwd(x.a, wb, s);
    }
    x.write_grads(p, dq.get(), dk_direct ? nullptr : dka.get(), dkw.get(), dvb.get(), db.get(), dbeta.get());
    if (Ttot > 0) {
      if (p.dlam.defined())
        HILA_LAUNCH(unpack_rows<R>, H * Ttot * nL, s, Strided(p.dlam), dlam.get(), r.T, H, 1, Ttot, nL, nL, R(1));
    }
  }
}

#define HILA_INSTANTIATE(T)                                                                                  \
  template bool loglinear_gdn_sm80_usable<T>(const detail::Resolved&, bool);                                 \
  template void loglinear_gdn_sm80_forward<T>(const detail::Resolved&, const ForwardParams&, cudaStream_t);  \
  template void loglinear_gdn_sm80_backward<T>(const detail::Resolved&, const BackwardParams&, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
