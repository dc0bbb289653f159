// SPDX-License-Identifier: Apache-2.0
// The Gated DeltaNet tensor-core pieces shared by plain gdn (gdn_tc.cu) and loglinear_gdn
// (ll_gdn_tc.cu): the WY chunk kernel (Tg, W, U; with LlWy also Qeff, the lambda-masked intra
// output and the final state's in-chunk levels), the sweep tiles and the state-tile helpers of the
// sequential sweeps, the WY backward (wy_bwd_kernel) and GdnTc, one call's packed operands. The math
// is in the two .cu files' comments (LOGLINEAR_SPEC §6.4, §6.5).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "cuda/delta/delta.cuh"
#include "cuda/gla/gla.cuh"
#include "cuda/loglinear/tree.cuh"
#include "cuda/prims/mma.cuh"
#include "cuda/prims/pack.cuh"
#include "cuda/prims/levels.cuh"
#include "cuda/runtime/runtime.cuh"
#include "cuda/prims/tile.cuh"

namespace hila::cuda::gdn {

constexpr int kThreads = 256;      // 8 warps
constexpr int kMaxD = 128;         // dk (padded) held by one block: one 16-row state slice per warp
constexpr int kVT = 64;            // value columns per sweep block
constexpr int kLd = kVT + 8;       // padded smem row of a 64-column 16-bit tile
constexpr int kLdA = kChunk + 1;   // fp32 [C][C] rows
constexpr int kLdU = kVT + 4;      // fp32 [C][64] rows (16-byte aligned)
constexpr int kLamLd = 8;          // per-row lambda of the in-chunk levels 0..p (p = 6) in smem

// Padded smem row (16-bit elements) of a [rows][d] tile: 16-byte rows, staggered banks.
__host__ __device__ constexpr int ld_of(int d) { return d + 8; }

// Tg, W and U of one chunk; grid (nchunks, H), 8 warps. With `bwd` (the backward's recompute)
// also Tg in 16 bits to tg [nchunks][H][C][C] and the intra part of dVn, A^T dO, to dvi (fp32
// [H][Ttot][dv]); that takes Q, dO and P = A (16-bit) in smem too. With `ll` (loglinear_gdn, LlWy
// below) Q and P and the level table of the rows; Q's tile, sized for [C, max(dk, dv)], is then
// reused for the final state's [C, dv] tile Y.
template <class T>
struct WyTiles {
  T *K, *V, *TgW, *TgU, *Q = nullptr, *dO = nullptr, *P = nullptr, *Y = nullptr;
  float *A, *beta, *b, *lam = nullptr;
  int ldk, ldv;
  __host__ __device__ WyTiles(char* base, int dk, int dv, bool bwd, bool ll, size_t* bytes = nullptr)
      : ldk(ld_of(dk)), ldv(ld_of(dv)) {
    Carve c{base};
    K = c.take<T>(size_t(kChunk) * ldk);
    V = c.take<T>(size_t(kChunk) * ldv);
    TgW = c.take<T>(size_t(kChunk) * kLd);
    TgU = c.take<T>(size_t(kChunk) * kLd);
    A = c.take<float>(size_t(kChunk) * kLdA);
    beta = c.take<float>(kChunk);
    b = c.take<float>(kChunk);
    if (bwd || ll) {
      Q = Y = c.take<T>(size_t(kChunk) * (ll ? std::max(ldk, ldv) : ldk));
      P = c.take<T>(size_t(kChunk) * kLd);
    }
    if (bwd) dO = c.take<T>(size_t(kChunk) * ldv);
    if (ll) lam = c.take<float>(size_t(kChunk) * kLamLd);
    if (bytes) *bytes = c.used;
  }
};

// loglinear_gdn's part of wy_kernel (qeff set): with M = P TgU = (tril(Q^ K^T) o Gam) Tg diag(beta)
// [C,C]x[C,C], the chunk's effective queries and intra output (LOGLINEAR_SPEC §6.4 in the gated form,
// which needs M explicitly because Lam does not factor through Tg):
//   Qeff = diag(e^b) Q^ - (M diag(e^b)) K      [C,C]x[C,dk]   (a level's read is Qeff S)
//   O    = (M o Lam) V                          [C,C]x[C,dv]   Lam_ij = lam_i^{bitlen(i xor j)}
// and, in the last chunk of a sequence whose length T = F C + r has r > 0, the final state's
// in-chunk levels l <= p (bit l-1 of r set, bucket rows [sigma, sigma + 2^{l-1}), sigma = (r >> l) << l):
//   fin[l] = K^T diag(e^{B-b}) (TgU 1_bucket) V    [dk,C]x([C,C]x[C,dv])
template <class T>
struct LlWy {
  const float* lam = nullptr;  // [H][Ttot][nL]
  int nL = 0;
  T* qeff = nullptr;           // [H][Ttot][dk] out
  T* u16 = nullptr;            // [H][Ttot][dv] out: U in 16 bits (the level sweeps use it only as a GEMM operand)
  float* o = nullptr;          // [H][Ttot][dv] out (nullptr: no output wanted, the product is skipped)
  float* fin = nullptr;        // [N][H][Ls][dk][dv] (zeroed) or nullptr: no final state
  int Ls = 0;
};

template <class T>
__global__ void __launch_bounds__(kThreads) wy_kernel(GlaArgs<T> a, const float* beta, T* W, float* U, T* tg,
                                                      float* dvi, LlWy<T> ll) {
  extern __shared__ __align__(128) char smem[];
  const bool bwd = dvi != nullptr, lg = ll.qeff != nullptr, qp = bwd || lg;
  WyTiles<T> s(smem, a.dk, a.dv, bwd, lg);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t cg = blockIdx.x;
  const int h = blockIdx.y, seq = a.chunk_seq[cg];
  const int64_t c = cg - a.chunk0[seq], r0 = a.row0[seq] + c * kChunk;
  const int nr = rows_in(a.len[seq], c);
  tc::async_rows(s.K, s.ldk, a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk), row_ld(a.k_ld, a.dk), r0, nr, 0,
                 a.dk, kChunk);
  tc::async_rows(s.V, s.ldv, a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, a.dv), row_ld(a.v_ld, a.dv), r0, nr, 0,
                 a.dv, kChunk);
  if (qp)
    tc::async_rows(s.Q, s.ldk, a.q + (h / a.q_div) * head_stride(a.q_hs, a.Ttot, a.dk), row_ld(a.q_ld, a.dk), r0, nr,
                   0, a.dk, kChunk);
  if (bwd)
    tc::async_rows(s.dO, s.ldv, a.dO + h * head_stride(a.dO_hs, a.Ttot, a.dv), row_ld(a.dO_ld, a.dv), r0, nr, 0, a.dv,
                   kChunk);
  tc::cp_async_commit();
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    s.beta[i] = i < nr ? beta[int64_t(h) * a.Ttot + r0 + i] : 0.f;
    s.b[i] = gate_at(a.b ? a.b + int64_t(h) * a.Ttot : nullptr, r0, i, nr);
  }
  if (lg)
    for (int e = threadIdx.x; e < kChunk * kLamLd; e += blockDim.x) {
      const int i = e / kLamLd, l = e % kLamLd;
      s.lam[e] = i < nr && l < ll.nL ? ll.lam[(int64_t(h) * a.Ttot + r0 + i) * ll.nL + l] : 0.f;
    }
  tc::cp_async_wait<0>();
  __syncthreads();
  {  // warp w: rows 16 (w % 4), columns 32 (w / 4) of
    //   A = tril_-1(diag(beta) (Gam o K K^T)) (fp32) and, with bwd or ll, P = scale tril(Q K^T) o Gam (16-bit)
    const int m0 = 16 * (w & 3), n0 = 32 * (w >> 2);
    float x[4][4], y[4][4];
    tc::zero(x), tc::zero(y);
    if (n0 <= m0 + 15) {
      tc::warp_gemm<T, 4, false, false>(x, s.K, s.ldk, m0, s.K, s.ldk, n0, 4, 0, a.dk);
      if (qp) tc::warp_gemm<T, 4, false, false>(y, s.Q, s.ldk, m0, s.K, s.ldk, n0, 4, 0, a.dk);
    }
    const float sc = float(a.scale);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = m0 + g + 8 * hf, col = n0 + 8 * j + 2 * t;
        float gm[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          gm[e] = col + e <= i ? __expf(s.b[i] - s.b[col + e]) : 0.f;
          s.A[i * kLdA + col + e] = col + e < i ? s.beta[i] * gm[e] * x[j][2 * hf + e] : 0.f;
        }
        if (qp)
          *reinterpret_cast<uint32_t*>(s.P + i * kLd + col) =
              tc::pack2<T>(sc * gm[0] * y[j][2 * hf], sc * gm[1] * y[j][2 * hf + 1]);
      }
  }
  __syncthreads();
  // Tg = (I + A)^-1 in 16 x 16 blocks, in place over A (fp32): A strictly lower triangular, so
  // the diagonal blocks invert by forward substitution, Tg_II = (I + A_II)^-1 (warp I, lanes 2j + p
  // sum the m = p mod 2 terms of column j: Tg[i][j] = -sum_{j<=m<i} A[i][m] Tg[m][j]), and block row
  // I = 1..3 follows from the rows above it: Tg_IJ = -Tg_II sum_{J<=K<I} A_IK Tg_KJ (J < I).
  static_assert(kChunk == 64 && kThreads == 256, "4 x 4 blocks of 16; 256 threads per block row stage");
  if (w < 4) {
    const int base = 16 * w, jl = lane >> 1, part = lane & 1;
    for (int il = 1; il < 16; ++il) {
      float x = 0.f;
      if (jl < il)
        for (int m = jl + part; m < il; m += 2)
          x -= s.A[(base + il) * kLdA + base + m] * (m == jl ? 1.f : s.A[(base + m) * kLdA + base + jl]);
      x += __shfl_xor_sync(0xffffffffu, x, 1);
      __syncwarp();  // row il of the block is read
      if (part == 0 && jl < il) s.A[(base + il) * kLdA + base + jl] = x;
      __syncwarp();
    }
  }
  __syncthreads();
  for (int I = 1; I < 4; ++I) {  // block row I: thread e of 256 * I elements (J = e / 256, r, c)
    float x[3];
#pragma unroll
    for (int q = 0; q < 3; ++q) {  // X_J = sum_{J<=K<I} A_IK Tg_KJ   (Tg_KK's unit diagonal is implicit)
      x[q] = 0.f;
      if (q >= I) continue;
      const int J = q, r = threadIdx.x >> 4, cc = threadIdx.x & 15, i = 16 * I + r, j = 16 * J + cc;
      for (int m = j; m < 16 * I; ++m)  // Tg[m][j] = 0 for m < j
        x[q] += s.A[i * kLdA + m] * (m == j ? 1.f : s.A[m * kLdA + j]);
    }
    __syncthreads();  // A_IJ is read
#pragma unroll
    for (int q = 0; q < 3; ++q)
      if (q < I) s.A[(16 * I + (threadIdx.x >> 4)) * kLdA + 16 * q + (threadIdx.x & 15)] = x[q];
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 3; ++q) {  // Tg_IJ = -Tg_II X_J
      if (q >= I) continue;
      const int r = threadIdx.x >> 4, cc = threadIdx.x & 15, i = 16 * I + r;
      float y = -s.A[i * kLdA + 16 * q + cc];
      for (int m = 0; m < r; ++m) y -= s.A[i * kLdA + 16 * I + m] * s.A[(16 * I + m) * kLdA + 16 * q + cc];
      x[q] = y;
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 3; ++q)
      if (q < I) s.A[(16 * I + (threadIdx.x >> 4)) * kLdA + 16 * q + (threadIdx.x & 15)] = x[q];
    __syncthreads();
  }
  // 16-bit operands, two columns per thread: W = Tg diag(beta e^b) K and U = Tg diag(beta) V take
  // Tg with its columns scaled (TgW, TgU); the backward stores Tg itself (tg [nchunks][H][C][C]).
  T* tgo = tg ? tg + (cg * a.H + h) * kChunk * kChunk : nullptr;
  for (int e = threadIdx.x; e < kChunk * kChunk / 2; e += blockDim.x) {
    const int i = e / (kChunk / 2), j = 2 * (e % (kChunk / 2));
    float v[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) v[q] = j + q < i ? s.A[i * kLdA + j + q] : (j + q == i ? 1.f : 0.f);
    const float f0 = s.beta[j], f1 = s.beta[j + 1];
    *reinterpret_cast<uint32_t*>(s.TgU + i * kLd + j) = tc::pack2<T>(v[0] * f0, v[1] * f1);
    *reinterpret_cast<uint32_t*>(s.TgW + i * kLd + j) =
        tc::pack2<T>(v[0] * f0 * __expf(s.b[j]), v[1] * f1 * __expf(s.b[j + 1]));
    if (tgo) *reinterpret_cast<uint32_t*>(tgo + i * kChunk + j) = tc::pack2<T>(v[0], v[1]);
  }
  __syncthreads();
  // W = TgW K  [C,C]x[C,dk],  U = TgU V  [C,C]x[C,dv],  dvi = P^T dO  [C,C]x[C,dv]:
  // warp w rows 16 (w % 4), column blocks of 64 from 64 (w / 4) in steps of 128
  const int m0 = 16 * (w & 3);
  // `fix(i, col, x0, x1)` adjusts the two results of row i, columns col, col + 1 before the store
  auto keep = [](int, int, float&, float&) {};
  auto product = [&](const T* A16, const T* X, int ldx, int d, auto* out, bool trans, auto fix) {
    for (int c0 = 64 * (w >> 2); c0 < d; c0 += 128) {
      const int nt = min(8, (d - c0) / 8);
      float acc[8][4];
      tc::zero(acc);
      if (trans) tc::warp_gemm<T, 8, true, true>(acc, s.P, kLd, m0, X, ldx, c0, nt, m0, kChunk);  // P^T: rows j >= i
      else tc::warp_gemm<T, 8, false, true>(acc, A16, kLd, m0, X, ldx, c0, nt, 0, m0 + 16);      // Tg: columns <= i
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < nt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int i = m0 + g + 8 * hf, col = c0 + 8 * j + 2 * t;
            if (i >= nr) continue;
            fix(i, col, acc[j][2 * hf], acc[j][2 * hf + 1]);
            auto* o = out + (int64_t(h) * a.Ttot + r0 + i) * d + col;
            if constexpr (std::is_same_v<std::remove_pointer_t<decltype(out)>, float>)
              *reinterpret_cast<float2*>(o) = make_float2(acc[j][2 * hf], acc[j][2 * hf + 1]);
            else
              *reinterpret_cast<uint32_t*>(o) = tc::pack2<T>(acc[j][2 * hf], acc[j][2 * hf + 1]);
          }
    }
  };
  product(s.TgW, s.K, s.ldk, a.dk, W, false, keep);
  if (lg) product(s.TgU, s.V, s.ldv, a.dv, ll.u16, false, keep);
  else product(s.TgU, s.V, s.ldv, a.dv, U, false, keep);
  if (bwd) product(s.P, s.dO, s.ldv, a.dv, dvi, true, keep);
  if (!lg) return;
  // loglinear_gdn (LlWy): M = P TgU [C,C]x[C,C], warp w rows 16 (w % 4), columns 32 (w / 4); P is
  // lower triangular with its diagonal and TgU too, so k runs over [n0, m0 + 16)
  {
    const int n0 = 32 * (w >> 2);
    float mm[4][4];
    tc::zero(mm);
    if (n0 <= m0 + 15) tc::warp_gemm<T, 4, false, true>(mm, s.P, kLd, m0, s.TgU, kLd, n0, 4, n0, m0 + 16);
    __syncthreads();  // P, TgU and TgW are read
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = m0 + g + 8 * hf, col = n0 + 8 * j + 2 * t;
        float mb[2], pl[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int cc = col + e;
          const bool in = cc <= i;
          mb[e] = in ? mm[j][2 * hf + e] * __expf(s.b[cc]) : 0.f;                           // M diag(e^b)
          pl[e] = in ? mm[j][2 * hf + e] * s.lam[i * kLamLd + bitlen64u(uint64_t(i ^ cc))] : 0.f;  // M o Lam
        }
        *reinterpret_cast<uint32_t*>(s.TgW + i * kLd + col) = tc::pack2<T>(mb[0], mb[1]);
        *reinterpret_cast<uint32_t*>(s.P + i * kLd + col) = tc::pack2<T>(pl[0], pl[1]);
      }
  }
  __syncthreads();
  const float sc = float(a.scale);
  product(s.TgW, s.K, s.ldk, a.dk, ll.qeff, false, [&](int i, int col, float& x0, float& x1) {
    const float e = sc * __expf(s.b[i]);  // Qeff = e^b Q^ - (M diag(e^b)) K
    const float2 q = tc::unpack2<T>(*reinterpret_cast<const uint32_t*>(s.Q + i * s.ldk + col));
    x0 = e * q.x - x0, x1 = e * q.y - x1;
  });
  if (ll.o) product(s.P, s.V, s.ldv, a.dv, ll.o, false, keep);
  // the final state's in-chunk levels (last chunk, partial): bucket columns of TgU into TgW, Y = (TgU
  // 1_bucket) V [C,C]x[C,dv] (16-bit), fin[l] = K^T diag(e^{B-b}) Y [dk,C]x[C,dv]: warp w rows 16w
  if (!ll.fin || c + 1 != (a.len[seq] + kChunk - 1) / kChunk || nr == kChunk) return;
  const float B = s.b[nr - 1];
  for (int l = 1; l <= kLogChunk; ++l) {
    if (!((nr >> (l - 1)) & 1)) continue;
    const int lo = (nr >> l) << l, hi = lo + (1 << (l - 1));
    __syncthreads();  // the last reads of TgW and Y are done
    for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
      const int i = e / kChunk, j = e % kChunk;
      s.TgW[i * kLd + j] = j >= lo && j < hi ? s.TgU[i * kLd + j] : to<T>(0.f);
    }
    __syncthreads();
    for (int c0 = 64 * (w >> 2); c0 < a.dv; c0 += 128) {
      const int nt = min(8, (a.dv - c0) / 8);
      float acc[8][4];
      tc::zero(acc);
      tc::warp_gemm<T, 8, false, true>(acc, s.TgW, kLd, m0, s.V, s.ldv, c0, nt, 0, m0 + 16);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < nt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
            *reinterpret_cast<uint32_t*>(s.Y + (m0 + g + 8 * hf) * s.ldv + c0 + 8 * j + 2 * t) =
                tc::pack2<T>(acc[j][2 * hf], acc[j][2 * hf + 1]);
    }
    __syncthreads();
    if (16 * w >= a.dk) continue;
    float* dst = ll.fin + ((int64_t(seq) * a.H + h) * ll.Ls + l) * a.dk * a.dv;
    for (int c0 = 0; c0 < a.dv; c0 += 64) {
      const int nt = min(8, (a.dv - c0) / 8);
      float acc[8][4];
      tc::zero(acc);
      tc::warp_gemm_tn_weighted<T, 8>(acc, s.K, s.ldk, 16 * w, s.Y + c0, s.ldv, nt, kChunk,
                                      [&](int k) { return __expf(B - s.b[k]); });
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            dst[int64_t(16 * w + g + (e >> 1) * 8) * a.dv + c0 + 8 * j + 2 * t + (e & 1)] = acc[j][e];
    }
  }
}


constexpr int kSweepStages = 2;

// The (sequence, head, 64 value columns) a sweep block takes: grid (N x H, 1, dv tiles of 64).
struct SweepItem {
  int seq, h, v0, bv, nt, nch;
  int64_t len, row0;
  bool active;  // this warp's 16 state rows are < dk
  template <class A>
  __device__ explicit SweepItem(const A& a) {
    seq = blockIdx.x / a.H, h = blockIdx.x % a.H;
    v0 = blockIdx.z * kVT, bv = min(kVT, a.dv - v0), nt = bv / 8;
    active = 16 * int(threadIdx.x >> 5) < a.dk;
    len = a.len[seq], row0 = a.row0[seq];
    nch = int((len + kChunk - 1) / kChunk);
  }
};

// A sweep's fp32 state tile in registers (warp w: rows 16w + g (+8), columns 8j + 2t (+1), j < bv/8)
// as a 16-bit GEMM operand: to Ss [dk][kLd] and, when out is set, to columns [v0, v0+bv) of out
// [dk][dv]. Columns bv..63 of Ss are zeroed, so that products over the tile read no stale values.
template <class T>
__device__ void stash_state(const float (&acc)[8][4], bool active, T* Ss, T* out, int dk, int dv, int v0, int bv) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (active && j < bv / 8)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = 16 * w + g + 8 * hf, col = 8 * j + 2 * t;
        const uint32_t x = tc::pack2<T>(acc[j][2 * hf], acc[j][2 * hf + 1]);
        *reinterpret_cast<uint32_t*>(Ss + r * kLd + col) = x;
        if (out) *reinterpret_cast<uint32_t*>(out + int64_t(r) * dv + v0 + col) = x;
      }
  if (bv < kVT)
    for (int e = threadIdx.x; e < dk * (kVT - bv); e += blockDim.x)
      Ss[(e / (kVT - bv)) * kLd + bv + e % (kVT - bv)] = to<T>(0.f);
}

// The fp32 state tile from / to columns [v0, v0+bv) of a [dk][dv] fp32 matrix (nullptr on load: 0).
__device__ inline void load_state(float (&acc)[8][4], bool active, const float* src, int dv, int v0, int bv) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 16 * w + g + (e >> 1) * 8, col = v0 + 8 * j + 2 * t + (e & 1);
      acc[j][e] = (src && active && j < bv / 8) ? src[int64_t(r) * dv + col] : 0.f;
    }
}
__device__ inline void store_state(float* dst, const float (&acc)[8][4], bool active, int dv, int v0, int bv) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  if (!dst || !active) return;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < bv / 8)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * w + g + (e >> 1) * 8, col = v0 + 8 * j + 2 * t + (e & 1);
        dst[int64_t(r) * dv + col] = acc[j][e];
      }
}
// The erase-and-add of a sweep's state tile over one chunk of nr rows (LOGLINEAR_SPEC §6.4):
//   S <- e^B S + K^T diag(e^{B-b}) Y      [dk,C]x[C,64]  (bt: the chunk's gates b in smem, B = bt[nr-1])
template <class T>
__device__ __forceinline__ void erase_add(float (&acc)[8][4], bool active, const T* K, int ldk, const T* Y, int nt,
                                          const float* bt, int nr) {
  const float B = bt[nr - 1], decay = __expf(B);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] *= decay;
  if (active)
    tc::warp_gemm_tn_weighted<T, 8>(acc, K, ldk, 16 * int(threadIdx.x >> 5), Y, kLd, nt, kChunk,
                                    [&](int k) { return __expf(B - bt[k]); });
}

// The (chunk, head) of a chunk-parallel block: grid (nchunks, H).
struct ChunkItem {
  int64_t cg, c, r0, rowbase;  // global chunk, chunk in its sequence, first row, row of [H][Ttot]
  int h, seq, nr;
  template <class A>
  __device__ explicit ChunkItem(const A& a) {
    cg = blockIdx.x, h = blockIdx.y, seq = a.chunk_seq[cg];
    c = cg - a.chunk0[seq], r0 = a.row0[seq] + c * kChunk, rowbase = int64_t(h) * a.Ttot + r0;
    nr = rows_in(a.len[seq], c);
  }
};

template <class T>
struct SweepTiles {
  T *Ss, *Vns;
  float* U;
  float* lam = nullptr;  // loglinear_gdn's level sweep: lambda of the read level per row [C]
  int ldk;
  size_t stage_bytes;
  char* base;
  __host__ __device__ SweepTiles(char* base_, int dk, bool ll = false, size_t* bytes = nullptr)
      : ldk(ld_of(dk)), base(base_) {
    stage_bytes = size_t(2) * kChunk * ldk * sizeof(T) + kChunk * sizeof(float);
    stage_bytes = (stage_bytes + 127) / 128 * 128;
    char* p = base ? base + kSweepStages * stage_bytes : nullptr;
    const size_t ub = size_t(kChunk) * kLdU * sizeof(float), sb = size_t(dk) * kLd * sizeof(T);
    U = reinterpret_cast<float*>(p);
    Ss = reinterpret_cast<T*>(p ? p + ub : nullptr);
    Vns = reinterpret_cast<T*>(p ? p + ub + sb : nullptr);
    size_t used = kSweepStages * stage_bytes + ub + sb + size_t(kChunk) * kLd * sizeof(T);
    if (ll) {
      lam = reinterpret_cast<float*>(p ? base + used : nullptr);
      used += kChunk * sizeof(float);
    }
    if (bytes) *bytes = used;
  }
  __device__ T* W(int st) const { return reinterpret_cast<T*>(base + st * stage_bytes); }
  __device__ T* K(int st) const { return W(st) + kChunk * ldk; }
  __device__ float* b(int st) const { return reinterpret_cast<float*>(K(st) + kChunk * ldk); }
  // W, K [C, dk] and the gates b of chunk c (rows [row0 + c C, ..), len rows in the sequence) into
  // stage c % kSweepStages by cp.async, one commit group; Wh, Kh, b: the head's rows (b may be nullptr)
  __device__ void issue(int64_t c, const T* Wh, const T* Kh, int64_t kld, const float* b, int64_t row0, int64_t len,
                        int dk) const {
    const int st = int(c % kSweepStages);
    const int64_t r0 = row0 + c * kChunk;
    const int nr = rows_in(len, c);
    tc::async_rows(W(st), ldk, Wh, dk, r0, nr, 0, dk, kChunk);
    tc::async_rows(K(st), ldk, Kh, kld, r0, nr, 0, dk, kChunk);
    if (threadIdx.x < kChunk) {
      const bool in = b && int(threadIdx.x) < nr;
      tc::cp_async4(this->b(st) + threadIdx.x, in ? static_cast<const void*>(b + r0 + threadIdx.x) : Wh, in ? 4 : 0);
    }
    tc::cp_async_commit();
  }
  // the level sweep's Qeff [C, dk] (16-bit), in U's place (C kLdU floats >= C ldk 16-bit elements)
  __device__ T* Qe() const { return reinterpret_cast<T*>(U); }
};
static_assert(kChunk * kLdU * sizeof(float) >= kChunk * (kMaxD + 8) * 2, "Qeff fits in U's buffer");


template <class T>
struct RsweepTiles {
  T *dSs, *dVns;
  int ldk;
  size_t stage_bytes;
  char* base;
  __host__ __device__ RsweepTiles(char* base_, int dk, size_t* bytes = nullptr) : ldk(ld_of(dk)), base(base_) {
    stage_bytes = (size_t(3) * kChunk * ldk + size_t(kChunk) * kLd) * sizeof(T) +
                  (size_t(kChunk) * kLdU + kChunk) * sizeof(float);
    stage_bytes = (stage_bytes + 127) / 128 * 128;
    char* p = base ? base + kSweepStages * stage_bytes : nullptr;
    dSs = reinterpret_cast<T*>(p);
    dVns = reinterpret_cast<T*>(p ? p + size_t(dk) * kLd * sizeof(T) : nullptr);
    red = reinterpret_cast<float*>(p ? p + (size_t(dk) + kChunk) * kLd * sizeof(T) : nullptr);
    if (bytes) *bytes = kSweepStages * stage_bytes + (size_t(dk) + kChunk) * kLd * sizeof(T) + kThreads / 32 * sizeof(float);
  }
  float* red;  // [8] per-warp parts of <dS, S_out>
  __device__ T* Q(int st) const { return reinterpret_cast<T*>(base + st * stage_bytes); }
  __device__ T* K(int st) const { return Q(st) + kChunk * ldk; }
  __device__ T* W(int st) const { return K(st) + kChunk * ldk; }
  __device__ T* dO(int st) const { return W(st) + kChunk * ldk; }
  __device__ float* dvi(int st) const { return reinterpret_cast<float*>(dO(st) + kChunk * kLd); }
  __device__ float* b(int st) const { return dvi(st) + kChunk * kLdU; }
};


// wy_bwd_kernel's inputs and outputs besides GlaArgs (k, v, b, chunk tables, hbuf).
template <class T>
struct WyBwdArgs {
  const float* beta = nullptr;  // [H][Ttot]
  const T* tg = nullptr;        // [nchunks][H][C][C]: Tg (wy_kernel)
  const T* dvn = nullptr;       // [H][Ttot][dv]: dVn (GLA's dv with Vn for v, 16-bit)
  const float* sdot = nullptr;  // [nchunks][H][nvt]: parts of <dS, S_out> (delta_rsweep_kernel); nullptr: none
  int nvt = 1;
  // loglinear_gdn (ll_grad_kernel, ll_intra_bwd_kernel): dW given [H][Ttot][dk] (16-bit) instead of
  // -dVn Hp^T, an extra cotangent of TgU = Tg diag(beta) [nchunks][H][C][C] (fp32), and dv added to
  const T* dw = nullptr;
  const float* dtgu = nullptr;
  bool dv_add = false;
  float* dk = nullptr;          // [H][Ttot][dk] out: the WY part of dk
  float* dv = nullptr;          // [H][Ttot][dv] out
  float* dg = nullptr;          // [H][Ttot]: GLA's dc in, dg out
  float* dbeta = nullptr;       // [H][Ttot] out
};

// The WY backward of one chunk (the file comment's dW ... dg lines); grid (nchunks, H), 8 warps.
// Warp w owns rows [16 rb, 16 rb + 16) (rb = w % 4) and the column half ch = w / 4 of every [C, d]
// product; of every [C, C] product, the columns [32 ch, 32 ch + 32). dk <= 128: one pass of at
// most 64 dk columns per warp, its accumulator kept from tW to the end. Phases, between barriers:
//   1  dW = -dVn Hp^T (registers)                  2  dW -> smem (over Hp)
//   3  dTg, tU (dv, dbeta), tW (the dk accumulator) 4  M = Tg^T dTg (over V), K K^T (over dVn)
//   5  dN, dAkk (over dW), the db / dbeta sums      6  dk += (dAkk + dAkk^T) K; dg, dbeta
// Dynamic smem (16-bit unless noted): K [C, dk+8]; V [C, dv+8], later M [C, 72]; dVn [C, dv+8],
// later K K^T [C, C+1] fp32; Hp [dk, dv+8], later dW [C, dk+8] then dAkk [C, 72], with dTg [C, 72]
// after them; Tg [C, 72]; per-row beta, b, db, dbeta (fp32). Under half an SM at dk = dv = 128.
template <class T>
struct WyBwdTiles {
  T *K, *V, *M, *dVn, *Hp, *dW, *dAkk, *dTg, *Tg;
  float *Akk, *beta, *b, *db, *dbeta;
  int ldk, ldv;
  __host__ __device__ WyBwdTiles(char* base, int dk, int dv, size_t* bytes = nullptr)
      : ldk(ld_of(dk)), ldv(ld_of(dv)) {
    Carve c{base};
    const size_t tile = size_t(kChunk) * kLd;  // a [C, C] 16-bit tile
    K = c.take<T>(size_t(kChunk) * ldk);
    V = M = c.take<T>(std::max(size_t(kChunk) * ldv, tile));
    char* d = c.take<char>(std::max(size_t(kChunk) * ldv * sizeof(T), size_t(kChunk) * kLdA * sizeof(float)));
    dVn = reinterpret_cast<T*>(d), Akk = reinterpret_cast<float*>(d);
    const size_t lead = std::max(size_t(kChunk) * ldk, tile);  // dW, later dAkk
    Hp = dW = dAkk = c.take<T>(std::max(size_t(dk) * ldv, lead + tile));
    dTg = Hp + lead;
    Tg = c.take<T>(tile);
    beta = c.take<float>(kChunk);
    b = c.take<float>(kChunk);
    db = c.take<float>(kChunk);
    dbeta = c.take<float>(kChunk);
    if (bytes) *bytes = c.used;
  }
};

template <class T>
__global__ void __launch_bounds__(kThreads, 2) wy_bwd_kernel(GlaArgs<T> a, WyBwdArgs<T> x) {
  extern __shared__ __align__(128) char smem[];
  WyBwdTiles<T> s(smem, a.dk, a.dv);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int rb = w & 3, ch = w >> 2;
  const ChunkItem it(a);
  const int64_t cg = it.cg, r0 = it.r0, rowbase = it.rowbase;
  const int h = it.h, nr = it.nr;
  const int dk = a.dk, dv = a.dv;
  const int64_t mat = int64_t(dk) * dv;
  tc::async_rows(s.K, s.ldk, a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, dk), row_ld(a.k_ld, dk), r0, nr, 0, dk,
                 kChunk);
  tc::async_rows(s.V, s.ldv, a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, dv), row_ld(a.v_ld, dv), r0, nr, 0, dv,
                 kChunk);
  tc::async_rows(s.dVn, s.ldv, x.dvn + int64_t(h) * a.Ttot * dv, dv, r0, nr, 0, dv, kChunk);
  if (x.dw) tc::async_rows(s.dW, s.ldk, x.dw + int64_t(h) * a.Ttot * dk, dk, r0, nr, 0, dk, kChunk);
  else tc::async_rows(s.Hp, s.ldv, a.hbuf + (cg * a.H + h) * mat, dv, 0, dk, 0, dv, dk);
  tc::async_rows(s.Tg, kLd, x.tg + (cg * a.H + h) * kChunk * kChunk, kChunk, 0, kChunk, 0, kChunk, kChunk);
  tc::cp_async_commit();
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    s.beta[i] = i < nr ? x.beta[rowbase + i] : 0.f;
    s.b[i] = gate_at(a.b ? a.b + int64_t(h) * a.Ttot : nullptr, r0, i, nr);
    s.db[i] = i < nr ? x.dg[rowbase + i] : 0.f;  // GLA's dc = q^.dq^ - k.dk
    s.dbeta[i] = 0.f;
  }
  tc::cp_async_wait<0>();
  __syncthreads();
  const int i0 = 16 * rb + g, i1 = i0 + 8;
  // column halves of the [C, dk] / [C, dv] products owned by this warp (nkt <= 8: dk <= 128)
  int ck0, nkt, cv0, nvt;
  tc::col_half(dk, ch, ck0, nkt);
  tc::col_half(dv, ch, cv0, nvt);
  auto dot_rows = [&](const float(&acc)[8][4], const T* X, int ld, int c0, int nt, float& d0, float& d1) {
    tc::dot_rows<T, 8>(acc, X, ld, i0, i1, c0, nt, d0, d1);
  };
  if (!x.dw) {  // 1, 2: dW = -dVn Hp^T   [C,dv]x[dv,dk] (16-bit, over Hp once every warp has read it)
    float acc[8][4];
    tc::zero(acc);
    tc::warp_gemm<T, 8, false, false>(acc, s.dVn, s.ldv, 16 * rb, s.Hp, s.ldv, ck0, nkt, 0, dv);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nkt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          *reinterpret_cast<uint32_t*>(s.dW + (hf ? i1 : i0) * s.ldk + ck0 + 8 * j + 2 * t) =
              tc::pack2<T>(-acc[j][2 * hf], -acc[j][2 * hf + 1]);
  }
  __syncthreads();
  const int n0 = 32 * ch;                 // this warp's columns of the [C, C] products
  const bool lower = n0 <= 16 * rb + 15;  // they reach the diagonal
  const float eb0 = __expf(s.b[i0]), eb1 = __expf(s.b[i1]);
  {  // 3: dTg = tril_-1 of beta_j [(dVn V^T)_ij + e^{b_j} (dW K^T)_ij]   [C,dv]x[dv,C], [C,dk]x[dk,C]
    float x1[4][4], y1[4][4];
    tc::zero(x1), tc::zero(y1);
    if (lower) {
      tc::warp_gemm<T, 4, false, false>(x1, s.dVn, s.ldv, 16 * rb, s.V, s.ldv, n0, 4, 0, dv);
      tc::warp_gemm<T, 4, false, false>(y1, s.dW, s.ldk, 16 * rb, s.K, s.ldk, n0, 4, 0, dk);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0, col = n0 + 8 * j + 2 * t;
        float v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int cc = col + e;
          v[e] = cc < i ? s.beta[cc] * (x1[j][2 * hf + e] + __expf(s.b[cc]) * y1[j][2 * hf + e]) : 0.f;
        }
        if (x.dtgu) {  // dTg += dTgU diag(beta) (strictly lower); dbeta_j += sum_{i >= j} dTgU_ij Tg_ij
          const float2 u = *reinterpret_cast<const float2*>(x.dtgu + ((cg * a.H + h) * kChunk + i) * kChunk + col);
          const float2 tg = tc::unpack2<T>(*reinterpret_cast<const uint32_t*>(s.Tg + i * kLd + col));
          if (col < i) v[0] += s.beta[col] * u.x;
          if (col + 1 < i) v[1] += s.beta[col + 1] * u.y;
          if (col <= i && i < nr) atomicAdd(&s.dbeta[col], u.x * tg.x);
          if (col + 1 <= i && i < nr) atomicAdd(&s.dbeta[col + 1], u.y * tg.y);
        }
        *reinterpret_cast<uint32_t*>(s.dTg + i * kLd + col) = tc::pack2<T>(v[0], v[1]);
      }
  }
  float db0 = 0.f, db1 = 0.f, dbt0 = 0.f, dbt1 = 0.f;  // this thread's parts of db, dbeta of rows i0, i1
  for (int cc = cv0; cc < cv0 + nvt * 8; cc += 64) {  // tU = Tg^T dVn: dv = diag(beta) tU, dbeta += rowsum(tU o V)
    const int nt = min(8, (cv0 + nvt * 8 - cc) / 8);
    float acc[8][4];
    tc::zero(acc);
    tc::warp_gemm<T, 8, true, true>(acc, s.Tg, kLd, 16 * rb, s.dVn, s.ldv, cc, nt, 16 * rb, kChunk);
    dot_rows(acc, s.V, s.ldv, cc, nt, dbt0, dbt1);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0;
          if (i < nr) {
            float2* o = reinterpret_cast<float2*>(x.dv + (rowbase + i) * dv + cc + 8 * j + 2 * t);
            float2 y = make_float2(s.beta[i] * acc[j][2 * hf], s.beta[i] * acc[j][2 * hf + 1]);
            if (x.dv_add) y.x += o->x, y.y += o->y;
            *o = y;
          }
        }
  }
  // tW = Tg^T dW; its rows scaled by beta e^b are the first part of this warp's dk columns
  float dka[8][4];
  tc::zero(dka);
  tc::warp_gemm<T, 8, true, true>(dka, s.Tg, kLd, 16 * rb, s.dW, s.ldk, ck0, nkt, 16 * rb, kChunk);
  {
    float k0 = 0.f, k1 = 0.f;  // rowsum(tW o K)
    dot_rows(dka, s.K, s.ldk, ck0, nkt, k0, k1);
    dbt0 += eb0 * k0, dbt1 += eb1 * k1;
    db0 += s.beta[i0] * eb0 * k0, db1 += s.beta[i1] * eb1 * k1;
    const float f0 = s.beta[i0] * eb0, f1 = s.beta[i1] * eb1;
#pragma unroll
    for (int j = 0; j < 8; ++j) dka[j][0] *= f0, dka[j][1] *= f0, dka[j][2] *= f1, dka[j][3] *= f1;
  }
  __syncthreads();  // dTg complete; V, dVn and dW are read
  {  // 4: M = Tg^T dTg   [C,C]x[C,C] (over V);  K K^T, strictly lower, fp32 (over dVn)
    float m[4][4], y[4][4];
    tc::zero(m), tc::zero(y);
    tc::warp_gemm<T, 4, true, true>(m, s.Tg, kLd, 16 * rb, s.dTg, kLd, n0, 4, 16 * rb, kChunk);
    if (lower) tc::warp_gemm<T, 4, false, false>(y, s.K, s.ldk, 16 * rb, s.K, s.ldk, n0, 4, 0, dk);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0, col = n0 + 8 * j + 2 * t;
        *reinterpret_cast<uint32_t*>(s.M + i * kLd + col) = tc::pack2<T>(m[j][2 * hf], m[j][2 * hf + 1]);
        s.Akk[i * kLdA + col] = col < i ? y[j][2 * hf] : 0.f;
        s.Akk[i * kLdA + col + 1] = col + 1 < i ? y[j][2 * hf + 1] : 0.f;
      }
  }
  __syncthreads();
  {  // 5: dN = -tril_-1(M Tg^T)  (Tg^T: columns l <= j); dAkk = diag(beta) dN o Gam; L = dAkk o K K^T
    float m[4][4];
    tc::zero(m);
    if (lower) tc::warp_gemm<T, 4, false, false>(m, s.M, kLd, 16 * rb, s.Tg, kLd, n0, 4, 0, n0 + 32);
    float colp[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      colp[j][0] = colp[j][1] = 0.f;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0, col = n0 + 8 * j + 2 * t;
        float v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int cc = col + e;
          v[e] = 0.f;
          if (cc < i) {
            const float dN = -m[j][2 * hf + e], gm = __expf(s.b[i] - s.b[cc]), kk = s.Akk[i * kLdA + cc];
            v[e] = s.beta[i] * dN * gm;
            const float L = v[e] * kk;
            (hf ? dbt1 : dbt0) += dN * gm * kk;
            (hf ? db1 : db0) += L;
            colp[j][e] += L;
          }
        }
        *reinterpret_cast<uint32_t*>(s.dAkk + i * kLd + col) = tc::pack2<T>(v[0], v[1]);
      }
    }
    // column sums of L: over the 8 row groups g of the warp, then one shared atomic per column
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float y = colp[j][e];
        y += __shfl_xor_sync(0xffffffffu, y, 4);
        y += __shfl_xor_sync(0xffffffffu, y, 8);
        y += __shfl_xor_sync(0xffffffffu, y, 16);
        if (g == 0 && lower) atomicAdd(&s.db[n0 + 8 * j + 2 * t + e], -y);
      }
  }
  __syncthreads();  // dAkk complete
  // 6: the WY part of dk: diag(beta e^b) tW + (dAkk + dAkk^T) K   (dAkk strictly lower triangular)
  tc::warp_gemm<T, 8, false, true>(dka, s.dAkk, kLd, 16 * rb, s.K, s.ldk, ck0, nkt, 0, 16 * rb + 16);
  tc::warp_gemm<T, 8, true, true>(dka, s.dAkk, kLd, 16 * rb, s.K, s.ldk, ck0, nkt, 16 * rb, kChunk);
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < nkt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0;
        if (i < nr)
          *reinterpret_cast<float2*>(x.dk + (rowbase + i) * dk + ck0 + 8 * j + 2 * t) =
              make_float2(dka[j][2 * hf], dka[j][2 * hf + 1]);
      }
  // row sums over the 4 lanes of a row, then the two column halves (shared atomics)
  for (float* v : {&db0, &db1, &dbt0, &dbt1}) {
    *v += __shfl_xor_sync(0xffffffffu, *v, 1);
    *v += __shfl_xor_sync(0xffffffffu, *v, 2);
  }
  if (t == 0) {
    atomicAdd(&s.db[i0], db0), atomicAdd(&s.db[i1], db1);
    atomicAdd(&s.dbeta[i0], dbt0), atomicAdd(&s.dbeta[i1], dbt1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // dg: reverse cumsum of db inside the chunk, dB's <dS, S_out> at the last row
    float acc = 0.f;
    for (int k = 0; x.sdot && k < x.nvt; ++k) acc += x.sdot[(cg * a.H + h) * x.nvt + k];
    for (int i = nr - 1; i >= 0; --i) x.dg[rowbase + i] = (acc += s.db[i]);
  }
  if (threadIdx.x < nr) x.dbeta[rowbase + threadIdx.x] = s.dbeta[threadIdx.x];
}


// q^ or k rows of [X][Ttot][dp] (first d columns) -> x / sqrt(|x|^2 + kL2Eps) (LOGLINEAR_SPEC §6.1),
// from src to dst (which may be the same buffer).
template <class T>
__global__ void l2norm_rows(const T* src, T* dst, int64_t rows, int d, int dp) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows;
       r += int64_t(gridDim.x) * blockDim.x / 32) {
    const T* row = src + r * dp;
    float ss = 0.f;
    for (int j = lane; j < d; j += 32) ss += float(row[j]) * float(row[j]);
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = 1.f / sqrtf(ss + float(kL2Eps));
    for (int j = lane; j < d; j += 32) dst[r * dp + j] = to<T>(float(row[j]) * inv);
  }
}

inline size_t wy_smem(int dk, int dv, bool bwd, bool ll = false) {
  return layout_bytes<WyTiles<__nv_bfloat16>>(dk, dv, bwd, ll);
}
inline size_t sweep_smem(int dk, bool ll = false) { return layout_bytes<SweepTiles<__nv_bfloat16>>(dk, ll); }
inline size_t rsweep_smem(int dk) { return layout_bytes<RsweepTiles<__nv_bfloat16>>(dk); }
inline size_t wy_bwd_smem(int dk, int dv) { return layout_bytes<WyBwdTiles<__nv_bfloat16>>(dk, dv); }

// One call's packed operands and the forward pass shared by the forward and the backward: q, k
// [G][Ttot][dk] (l2-normalised when asked; the raw copies are kept in q_raw, k_raw for the
// backward's chain rule), v [H][Ttot][dv], the gates' chunk cumsum b and beta [H][Ttot], the
// initial and final states [N][H][dk][dv] (fp32), W, U, Vn and the states entering each chunk.
template <class T>
struct GdnTc {
  using R = Acc<T>;
  const detail::Resolved& r;
  cudaStream_t s;
  SeqTables seqs;
  int dk, dv, rep;
  int64_t Ttot, N, NH;
  DevBuf<T> q, k, q_raw, k_raw, v, W, Vn, hbuf;
  DevBuf<R> g, beta, bsum, h0, ht;
  DevBuf<float> U;
  GlaArgs<T> a;

  GdnTc(const detail::Resolved& r_, const ForwardParams& p, cudaStream_t s_, bool keep_raw)
      : r(r_), s(s_), seqs(r_, s_, kChunk), dk(pad16(r_.dk)), dv(pad16(r_.dv)), rep(int(r_.H / r_.G)),
        Ttot(r_.B * r_.T), N(int64_t(r_.seqs.size())), NH(N * r_.H) {
    const bool l2 = r.cfg.qk_l2norm && Ttot > 0;
    const size_t nqk = size_t(r.G * Ttot * dk);
    q = DevBuf<T>(nqk, s), k = DevBuf<T>(nqk, s);
    T* qp = q.get();
    T* kp = k.get();
    if (l2 && keep_raw) {  // pack into the raw copies, normalise into q, k
      q_raw = DevBuf<T>(nqk, s), k_raw = DevBuf<T>(nqk, s);
      qp = q_raw.get(), kp = k_raw.get();
    }
    pack_to<T>(qp, p.q, r, r.G, int(r.dk), dk, -1, s);
    pack_to<T>(kp, p.k, r, r.G, int(r.dk), dk, -1, s);
    a.v = operand(p.v, r.H, int(r.dv), dv, v, a.v_ld, a.v_hs);
    if (l2 && !dry_run()) {  // one warp per row (dry run: workspace_size)
      l2norm_rows<T><<<grid_for(r.G * Ttot * 32), 256, 0, s>>>(qp, q.get(), r.G * Ttot, int(r.dk), dk);
      HILA_CUDA_CHECK_LAUNCH();
      l2norm_rows<T><<<grid_for(r.G * Ttot * 32), 256, 0, s>>>(kp, k.get(), r.G * Ttot, int(r.dk), dk);
      HILA_CUDA_CHECK_LAUNCH();
    }
    if (r.gate_cols > 0) {
      g = DevBuf<R>(size_t(r.H * Ttot), s);
      HILA_LAUNCH(pack_gates<R>, r.H * Ttot, s, g.get(), Strided(p.g), r.T, r.H, Ttot, 0);
    }
    beta = DevBuf<R>(size_t(r.H * Ttot), s);
    HILA_LAUNCH(pack_gates<R>, r.H * Ttot, s, beta.get(), Strided(p.beta), r.T, r.H, Ttot, 0);
    a.q = q.get(), a.k = k.get(), a.q_div = a.k_div = rep, a.v_div = 1;
    a.g = g.get(), a.H = int(r.H), a.N = int(N), a.Ttot = Ttot, a.dk = dk, a.dv = dv;
    a.row0 = seqs.d_row0.get(), a.len = seqs.d_len.get(), a.chunk0 = seqs.d_chunk0.get();
    a.chunk_seq = seqs.d_chunk_seq.get(), a.nchunks = seqs.nchunks;
    a.scale = R(r.scale);
    if (a.g) {
      bsum = DevBuf<R>(size_t(r.H * Ttot), s);
      gla_chunk_cumsum(a, bsum.get(), s);
      a.b = bsum.get();
    }
    if (p.init.H.defined()) {
      h0 = DevBuf<R>(size_t(NH * dk * dv), s);
      HILA_LAUNCH(pack_state<R>, NH * dk * dv, s, h0.get(), Strided(p.init.H), NH, r.H, int(r.dk), int(r.dv), dk, dv);
    }
    ht = DevBuf<R>(size_t(NH * dk * dv), s);
    a.h0 = h0.get(), a.ht = ht.get();
  }

  // The caller's [B, T, X, d] tensor read in place (ld, hs set), or packed into buf [X][Ttot][dp].
  const T* operand(const TensorView& t, int64_t X, int d, int dp, DevBuf<T>& buf, int64_t& ld, int64_t& hs) const {
    if (d == dp && in_place_ok<T>(t, r.B, r.T)) {
      ld = t.stride[1], hs = t.stride[2];
      return static_cast<const T*>(t.data);
    }
    buf = DevBuf<T>(size_t(X * Ttot * dp), s);
    pack_to<T>(buf.get(), t, r, X, d, dp, -1, s);
    ld = hs = 0;
    return buf.get();
  }
  // W, U (and, for the backward, Tg and dvi = A^T dO from a.dO): wy_kernel.
  // With ll.qeff set, loglinear_gdn's Qeff, intra output and final in-chunk levels too (LlWy).
  void wy(T* tg = nullptr, float* dvi = nullptr, LlWy<T> ll = {}) {
    W = DevBuf<T>(size_t(r.H * Ttot * dk), s);
    if (!ll.qeff) U = DevBuf<float>(size_t(r.H * Ttot * dv), s);
    if (seqs.nchunks == 0) return;
    const size_t bytes = wy_smem(dk, dv, dvi != nullptr, ll.qeff != nullptr);
    set_smem(wy_kernel<T>, bytes);
    if (dry_run()) return;  // dry run: workspace_size
    wy_kernel<T><<<dim3(unsigned(seqs.nchunks), unsigned(r.H)), kThreads, bytes, s>>>(a, beta.get(), W.get(), U.get(),
                                                                                     tg, dvi, ll);
    HILA_CUDA_CHECK_LAUNCH();
  }
  // o = the GLA output with the values Vn (into the caller's tensor in place when its layout allows).
  void output(const TensorView& o) {
    if (seqs.nchunks == 0 || !o.defined()) return;
    const bool direct = int(r.dv) == dv && in_place_ok<T>(o, r.B, r.T);
    DevBuf<T> O(direct ? 0 : size_t(r.H * Ttot * dv), s);
    GlaArgs<T> b = a;
    b.v = Vn.get(), b.v_ld = b.v_hs = 0;
    b.o = direct ? static_cast<T*>(o.data) : O.get();
    if (direct) b.o_ld = o.stride[1], b.o_hs = o.stride[2];
    tc_output(b, s);
    if (!direct) unpack_to<T>(o, O.get(), r, r.H, 1, int(r.dv), dv, R(1), s);
  }
  // The gradients into the caller's tensors: dq (w.r.t. q^, times scale), dk = dk1 + dk2, dv, dg, dbeta
  // (packed [H][Ttot][..] fp32), through the l2norm chain when it is on.
  void write_grads(const BackwardParams& p, const R* dq, const R* dk1, const R* dk2, const R* dvb, const R* dg,
                   const R* dbeta) const {
    if (Ttot == 0) return;
    const T* qx = q_raw.get() ? q_raw.get() : q.get();
    const T* kx = k_raw.get() ? k_raw.get() : k.get();
    if (p.dq.defined()) launch_unpack_qk<T>(p.dq, dq, nullptr, qx, r, int(r.dk), dk, R(r.scale), s);
    if (p.dk.defined()) launch_unpack_qk<T>(p.dk, dk1, dk2, kx, r, int(r.dk), dk, R(1), s);
    if (p.dv.defined()) unpack_to<R>(p.dv, dvb, r, r.H, 1, int(r.dv), dv, R(1), s);
    if (p.dg.defined()) HILA_LAUNCH(unpack_gates<R>, r.H * Ttot, s, Strided(p.dg), dg, r.T, r.H, Ttot, 0);
    if (p.dbeta.defined()) HILA_LAUNCH(unpack_gates<R>, r.H * Ttot, s, Strided(p.dbeta), dbeta, r.T, r.H, Ttot, 0);
  }
  void write_final(const StateView& fin) {
    if (fin.H.defined())
      HILA_LAUNCH(unpack_state<R>, NH * r.dk * r.dv, s, Strided(fin.H), ht.get(), NH, r.H, int(r.dk), int(r.dv), dk, dv);
    if (fin.pos.defined()) {
      std::vector<int64_t> pos;
      for (const auto& x : r.seqs) pos.push_back(x.n0 + x.len);
      upload_async(fin.pos.data, pos.data(), pos.size() * 8, s);
    }
  }
};


}  // namespace hila::cuda::gdn
