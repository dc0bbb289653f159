// SPDX-License-Identifier: Apache-2.0
// The WY chunks of the delta rule's sm80 tier (wy_sm80.cuh; docs/math/LOGLINEAR.md §6.4, §6.5), per chunk of
// C = 64 rows with the chunk-local cumsum b of the log-gates, B = b[C-1]:
//   Tg = (I + tril_-1(diag(beta) (Gam o K K^T)))^-1     [C,C], Gam_ij = e^{b_i - b_j}
//   W  = Tg diag(beta e^b) K     [C,C]x[C,dk]          U = Tg diag(beta) V     [C,C]x[C,dv]  (16-bit)
// and the backward through W, U and Tg, with dW = -dVn S^T (or loglinear_gdn's dW), dU = dVn:
//   tU = Tg^T dU, tW = Tg^T dW, dTg = dU (beta V)^T + dW (beta e^b K)^T, dN = -tril_-1(Tg^T dTg Tg^T),
//   dv = diag(beta) tU, dk += diag(beta e^b) tW + (dAkk + dAkk^T) K with dAkk = diag(beta) dN o Gam,
//   dbeta = rowsum(tU o V) + e^b rowsum(tW o K) + rowsum(dN o Gam o K K^T),
//   db = dc + beta e^b rowsum(tW o K) + rowsum(L) - colsum(L), L = dAkk o K K^T, plus <dS, S_out> at
//   the chunk's last row; dg is its reverse cumsum inside the chunk.
#include <algorithm>
#include <type_traits>

#include "cuda/delta/wy_sm80.cuh"
#include "cuda/loglinear/tree.cuh"

namespace hila::cuda::gdn {

namespace {

// Tg, W and U of one chunk; grid (nchunks, H), or (N x (c_hi - c_lo), H) for a piece [c_lo, c_hi)
// of every sequence (GlaArgs::c_lo), 8 warps. With `bwd` (the backward's recompute)
// also Tg in 16 bits to tg [nchunks][H][C][C] and the intra part of dVn, A^T dO, to dvi (16-bit
// [H][Ttot][dv]); that takes Q, dO and P = A (16-bit) in smem too. With `ll` (loglinear_gdn, LoglinearWy
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

// Registers bounded for the blocks per SM that shared memory allows at dk = dv = 128: kPlain, the
// plain gdn forward (no dvi, no LoglinearWy; 70 KB, launched with the max-shared carveout), three;
// the backward's recompute and loglinear_gdn, two.
template <class T, bool kPlain>
__global__ void __launch_bounds__(kThreads, kPlain ? 3 : 2) wy_kernel(GlaArgs<T> a, const float* beta, T* W, T* U,
                                                                       T* tg, T* dvi, LoglinearWy<T> ll) {
  extern __shared__ __align__(128) char smem[];
  const bool bwd = !kPlain && dvi != nullptr, lg = !kPlain && ll.qeff != nullptr, qp = bwd || lg;
  WyTiles<T> s(smem, a.dk, a.dv, bwd, lg);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const GridChunk gc(a, blockIdx.x);
  if (!gc.valid) return;  // past this sequence's chunks (a piece)
  const int64_t cg = gc.cg, c = gc.c, r0 = a.row0[gc.seq] + c * kChunk;
  const int h = blockIdx.y, seq = gc.seq, nr = rows_in(a.len[seq], c);
  // two cp.async groups: K and Q (the K K^T and Q K^T products), then V and dO, which land during the
  // triangular solve
  mma::async_rows(s.K, s.ldk, a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk), row_ld(a.k_ld, a.dk), r0, nr, 0,
                 a.dk, kChunk);
  if (qp)
    mma::async_rows(s.Q, s.ldk, a.q + (h / a.q_div) * head_stride(a.q_hs, a.Ttot, a.dk), row_ld(a.q_ld, a.dk), r0, nr,
                   0, a.dk, kChunk);
  mma::cp_async_commit();
  mma::async_rows(s.V, s.ldv, a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, a.dv), row_ld(a.v_ld, a.dv), r0, nr, 0,
                 a.dv, kChunk);
  if (bwd)
    mma::async_rows(s.dO, s.ldv, a.dO + h * head_stride(a.dO_hs, a.Ttot, a.dv), row_ld(a.dO_ld, a.dv), r0, nr, 0, a.dv,
                   kChunk);
  mma::cp_async_commit();
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
  mma::cp_async_wait<1>();  // K, Q
  __syncthreads();
  {  // warp w: rows 16 (w % 4), columns 32 (w / 4) of
    //   A = tril_-1(diag(beta) (Gam o K K^T)) (fp32) and, with bwd or ll, P = scale tril(Q K^T) o Gam (16-bit)
    const int m0 = 16 * (w & 3), n0 = 32 * (w >> 2);
    float x[4][4], y[4][4];
    mma::zero(x), mma::zero(y);
    if (n0 <= m0 + 15) {
      mma::warp_gemm<T, 4, false, false>(x, s.K, s.ldk, m0, s.K, s.ldk, n0, 4, 0, a.dk);
      if (qp) mma::warp_gemm<T, 4, false, false>(y, s.Q, s.ldk, m0, s.K, s.ldk, n0, 4, 0, a.dk);
    }
    const float sc = float(a.scale);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = fr.row(m0, hf), col = fr.col(n0, j);
        float gm[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          gm[e] = col + e <= i ? __expf(s.b[i] - s.b[col + e]) : 0.f;
          s.A[i * kLdA + col + e] = col + e < i ? s.beta[i] * gm[e] * x[j][2 * hf + e] : 0.f;
        }
        if (qp)
          *reinterpret_cast<uint32_t*>(s.P + i * kLd + col) =
              mma::pack2<T>(sc * gm[0] * y[j][2 * hf], sc * gm[1] * y[j][2 * hf + 1]);
      }
  }
  __syncthreads();
  // Tg = (I + A)^-1 in place over A (fp32; A strictly lower triangular with zeros above), by
  // doubling: the 16 x 16 diagonal blocks invert by forward substitution, then each 2 x 2 split of
  // n x n blocks (n = 16: two pairs, n = 32: one) takes
  //   Tg_21 = -Tg_22 (A_21 Tg_11)     [n,n]x([n,n]x[n,n])
  // from its inverted diagonal blocks. The diagonal holds 1 and the upper triangle 0 from the first
  // step on, so the products read the blocks as they stand.
  static_assert(kChunk == 64 && kThreads == 256, "4 diagonal blocks of 16; 256 threads per merge");
  if (w < 4) {  // warp I: Tg_II[i][j] = -sum_{m<i} A_II[i][m] Tg_II[m][j] (i > j), lane j's column in registers
    const int base = 16 * w, j = lane & 15;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) acc -= s.A[(base + i) * kLdA + base + m] * x[m];
      x[i] = i == j ? 1.f : acc;  // x[m] = 0 for m < j, so acc = 0 for i < j
    }
    __syncwarp();  // block I of A is read
    if (lane < 16)
#pragma unroll
      for (int i = 0; i < 16; ++i)
        if (i >= j) s.A[(base + i) * kLdA + base + j] = x[i];
  }
  __syncthreads();
  static_assert(32 * 33 * sizeof(float) <= kChunk * kLd * 2, "the merges' scratch fits in TgW");
  float* xs = reinterpret_cast<float*>(s.TgW);  // X = A_21 Tg_11 of each pair, [n][n+1] fp32 (TgW is free until the pack)
  auto merge = [&](auto n_) {  // thread: rows r, r + 1 and columns c .. c + n/16 - 1 of one pair's [n, n] blocks
    constexpr int n = decltype(n_)::value, nc = n / 16, per = kThreads * 2 * n / kChunk;  // per: threads of a pair
    const int p = threadIdx.x / per, e = threadIdx.x % per, r = 2 * (e / (n / nc)), c = nc * (e % (n / nc));
    const int b1 = 2 * n * p, b2 = b1 + n;  // first row of the pair's blocks 1 and 2
    float* x = xs + p * n * (n + 1);
    float acc[2][nc] = {};
#pragma unroll
    for (int m = 0; m < n; ++m) {  // X = A_21 Tg_11
      const float a0 = s.A[(b2 + r) * kLdA + b1 + m], a1 = s.A[(b2 + r + 1) * kLdA + b1 + m];
#pragma unroll
      for (int q = 0; q < nc; ++q) {
        const float t = s.A[(b1 + m) * kLdA + b1 + c + q];
        acc[0][q] += a0 * t, acc[1][q] += a1 * t;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < nc; ++q) x[(r + h) * (n + 1) + c + q] = acc[h][q], acc[h][q] = 0.f;
    __syncthreads();
#pragma unroll
    for (int m = 0; m < n; ++m) {  // Tg_21 = -Tg_22 X
      const float a0 = s.A[(b2 + r) * kLdA + b2 + m], a1 = s.A[(b2 + r + 1) * kLdA + b2 + m];
#pragma unroll
      for (int q = 0; q < nc; ++q) {
        const float t = x[m * (n + 1) + c + q];
        acc[0][q] += a0 * t, acc[1][q] += a1 * t;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < nc; ++q) s.A[(b2 + r + h) * kLdA + b1 + c + q] = -acc[h][q];
    __syncthreads();
  };
  merge(std::integral_constant<int, 16>{});
  merge(std::integral_constant<int, 32>{});
  // 16-bit operands, two columns per thread: W = Tg diag(beta e^b) K and U = Tg diag(beta) V take
  // Tg with its columns scaled (TgW, TgU); the backward stores Tg itself (tg [nchunks][H][C][C]).
  T* tgo = tg ? tg + (cg * a.H + h) * kChunk * kChunk : nullptr;
  for (int e = threadIdx.x; e < kChunk * kChunk / 2; e += blockDim.x) {
    const int i = e / (kChunk / 2), j = 2 * (e % (kChunk / 2));
    float v[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) v[q] = j + q < i ? s.A[i * kLdA + j + q] : (j + q == i ? 1.f : 0.f);
    const float f0 = s.beta[j], f1 = s.beta[j + 1];
    *reinterpret_cast<uint32_t*>(s.TgU + i * kLd + j) = mma::pack2<T>(v[0] * f0, v[1] * f1);
    *reinterpret_cast<uint32_t*>(s.TgW + i * kLd + j) =
        mma::pack2<T>(v[0] * f0 * __expf(s.b[j]), v[1] * f1 * __expf(s.b[j + 1]));
    if (tgo) *reinterpret_cast<uint32_t*>(tgo + i * kChunk + j) = mma::pack2<T>(v[0], v[1]);
  }
  mma::cp_async_wait<0>();  // V, dO
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
      mma::zero(acc);
      if (trans) mma::warp_gemm<T, 8, true, true>(acc, s.P, kLd, m0, X, ldx, c0, nt, m0, kChunk);  // P^T: rows j >= i
      else mma::warp_gemm<T, 8, false, true>(acc, A16, kLd, m0, X, ldx, c0, nt, 0, m0 + 16);      // Tg: columns <= i
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < nt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int i = fr.row(m0, hf), col = fr.col(c0, j);
            if (i >= nr) continue;
            fix(i, col, acc[j][2 * hf], acc[j][2 * hf + 1]);
            auto* o = out + (int64_t(h) * a.Ttot + r0 + i) * d + col;
            if constexpr (std::is_same_v<std::remove_pointer_t<decltype(out)>, float>)
              *reinterpret_cast<float2*>(o) = make_float2(acc[j][2 * hf], acc[j][2 * hf + 1]);
            else
              *reinterpret_cast<uint32_t*>(o) = mma::pack2<T>(acc[j][2 * hf], acc[j][2 * hf + 1]);
          }
    }
  };
  product(s.TgW, s.K, s.ldk, a.dk, W, false, keep);
  if (lg) product(s.TgU, s.V, s.ldv, a.dv, ll.u16, false, keep);
  else product(s.TgU, s.V, s.ldv, a.dv, U, false, keep);
  if (bwd) product(s.P, s.dO, s.ldv, a.dv, dvi, true, keep);
  if (!lg) return;
  // loglinear_gdn (LoglinearWy): M = P TgU [C,C]x[C,C], warp w rows 16 (w % 4), columns 32 (w / 4); P is
  // lower triangular with its diagonal and TgU too, so k runs over [n0, m0 + 16)
  {
    const int n0 = 32 * (w >> 2);
    float mm[4][4];
    mma::zero(mm);
    if (n0 <= m0 + 15) mma::warp_gemm<T, 4, false, true>(mm, s.P, kLd, m0, s.TgU, kLd, n0, 4, n0, m0 + 16);
    __syncthreads();  // P, TgU and TgW are read
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = fr.row(m0, hf), col = fr.col(n0, j);
        float mb[2], pl[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int cc = col + e;
          const bool in = cc <= i;
          mb[e] = in ? mm[j][2 * hf + e] * __expf(s.b[cc]) : 0.f;                           // M diag(e^b)
          pl[e] = in ? mm[j][2 * hf + e] * s.lam[i * kLamLd + bitlen64u(uint64_t(i ^ cc))] : 0.f;  // M o Lam
        }
        *reinterpret_cast<uint32_t*>(s.TgW + i * kLd + col) = mma::pack2<T>(mb[0], mb[1]);
        *reinterpret_cast<uint32_t*>(s.P + i * kLd + col) = mma::pack2<T>(pl[0], pl[1]);
      }
  }
  __syncthreads();
  const float sc = float(a.scale);
  product(s.TgW, s.K, s.ldk, a.dk, ll.qeff, false, [&](int i, int col, float& x0, float& x1) {
    const float e = sc * __expf(s.b[i]);  // Qeff = e^b Q^ - (M diag(e^b)) K
    const float2 q = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(s.Q + i * s.ldk + col));
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
      mma::zero(acc);
      mma::warp_gemm<T, 8, false, true>(acc, s.TgW, kLd, m0, s.V, s.ldv, c0, nt, 0, m0 + 16);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < nt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
            *reinterpret_cast<uint32_t*>(fr.at<int>(s.Y, m0, hf, s.ldv, c0, j)) =
                mma::pack2<T>(acc[j][2 * hf], acc[j][2 * hf + 1]);
    }
    __syncthreads();
    if (16 * w >= a.dk) continue;
    float* dst = ll.fin + ((int64_t(seq) * a.H + h) * ll.Ls + l) * a.dk * a.dv;
    for (int c0 = 0; c0 < a.dv; c0 += 64) {
      const int nt = min(8, (a.dv - c0) / 8);
      float acc[8][4];
      mma::zero(acc);
      mma::warp_gemm_tn_weighted<T, 8>(acc, s.K, s.ldk, 16 * w, s.Y + c0, s.ldv, nt, kChunk,
                                      [&](int k) { return __expf(B - s.b[k]); });
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            dst[fr.off_of<int64_t>(16 * w, e, a.dv, c0, j)] = acc[j][e];
    }
  }
}


// The WY backward of one chunk (the file comment's dW ... dg lines); grid (nchunks, H), 8 warps.
// Warp w owns rows [16 rb, 16 rb + 16) (rb = w % 4) and the column half ch = w / 4 of every [C, d]
// product; of every [C, C] product, the columns [32 ch, 32 ch + 32). dk <= 128: one pass of at
// most 64 dk columns per warp, its accumulator kept from tW to the end. Phases, between barriers:
//   1  dW = -dVn Hp^T (registers)                  2  dW -> smem (over Hp)
//   3  dTg, tU (dv, dbeta), tW (the dk accumulator) 4  M = Tg^T dTg (over V), K K^T (over dVn)
//   5  dN, dAkk (over dW), the db / dbeta sums      6  dk += (dAkk + dAkk^T) K; dg, dbeta
// Dynamic smem (16-bit unless noted): K [C, dk+8]; V [C, dv+8], later M [C, 72]; dVn [C, dv+8],
// later K K^T [C, C+1] fp32; Hp [dk, dv+8], later dW [C, dk+8] then dAkk [C, 72], with dTg [C, 72]
// after them; Tg [C, 72]; per-row beta, b, db, dbeta, ydy (fp32). Under half an SM at dk = dv = 128.
template <class T>
struct WyBwdTiles {
  T *K, *V, *M, *dVn, *Hp, *dW, *dAkk, *dTg, *Tg;
  float *Akk, *beta, *b, *db, *dbeta, *ydy;
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
    ydy = c.take<float>(kChunk);
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
  mma::async_rows(s.K, s.ldk, a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, dk), row_ld(a.k_ld, dk), r0, nr, 0, dk,
                 kChunk);
  mma::async_rows(s.V, s.ldv, a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, dv), row_ld(a.v_ld, dv), r0, nr, 0, dv,
                 kChunk);
  mma::async_rows(s.dVn, s.ldv, x.dvn + int64_t(h) * a.Ttot * dv, dv, r0, nr, 0, dv, kChunk);
  if (x.dw) mma::async_rows(s.dW, s.ldk, x.dw + int64_t(h) * a.Ttot * dk, dk, r0, nr, 0, dk, kChunk);
  else mma::async_rows(s.Hp, s.ldv, a.hbuf + (cg * a.H + h) * mat, dv, 0, dk, 0, dv, dk);
  mma::async_rows(s.Tg, kLd, x.tg + (cg * a.H + h) * kChunk * kChunk, kChunk, 0, kChunk, 0, kChunk, kChunk);
  mma::cp_async_commit();
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    s.beta[i] = i < nr ? x.beta[rowbase + i] : 0.f;
    s.b[i] = gate_at(a.b ? a.b + int64_t(h) * a.Ttot : nullptr, r0, i, nr);
    s.db[i] = i < nr ? x.dg[rowbase + i] : 0.f;  // GLA's dc = q^.dq^ - k.dk, the last row's + <dS, S_out>
    s.dbeta[i] = s.ydy[i] = 0.f;
  }
  mma::cp_async_wait<0>();
  __syncthreads();
  const int i0 = 16 * rb + g, i1 = i0 + 8;
  // column halves of the [C, dk] / [C, dv] products owned by this warp (nkt <= 8: dk <= 128)
  int ck0, nkt, cv0, nvt;
  mma::col_half(dk, ch, ck0, nkt);
  mma::col_half(dv, ch, cv0, nvt);
  auto dot_rows = [&](const float(&acc)[8][4], const T* X, int ld, int c0, int nt, float& d0, float& d1) {
    mma::dot_rows<T, 8>(acc, X, ld, i0, i1, c0, nt, d0, d1);
  };
  if (!x.dw) {  // 1, 2: dW = -dVn Hp^T   [C,dv]x[dv,dk] (16-bit, over Hp once every warp has read it)
    float acc[8][4];
    mma::zero(acc);
    mma::warp_gemm<T, 8, false, false>(acc, s.dVn, s.ldv, 16 * rb, s.Hp, s.ldv, ck0, nkt, 0, dv);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nkt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          *reinterpret_cast<uint32_t*>(s.dW + (hf ? i1 : i0) * s.ldk + ck0 + 8 * j + 2 * t) =
              mma::pack2<T>(-acc[j][2 * hf], -acc[j][2 * hf + 1]);
  }
  __syncthreads();
  const int n0 = 32 * ch;                 // this warp's columns of the [C, C] products
  const bool lower = n0 <= 16 * rb + 15;  // they reach the diagonal
  const float eb0 = __expf(s.b[i0]), eb1 = __expf(s.b[i1]);
  {  // 3: dTg = tril_-1 of beta_j [(dVn V^T)_ij + e^{b_j} (dW K^T)_ij]   [C,dv]x[dv,C], [C,dk]x[dk,C]
    float x1[4][4], y1[4][4];
    mma::zero(x1), mma::zero(y1);
    if (lower) {
      mma::warp_gemm<T, 4, false, false>(x1, s.dVn, s.ldv, 16 * rb, s.V, s.ldv, n0, 4, 0, dv);
      mma::warp_gemm<T, 4, false, false>(y1, s.dW, s.ldk, 16 * rb, s.K, s.ldk, n0, 4, 0, dk);
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
          const float2 tg = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(s.Tg + i * kLd + col));
          if (col < i) v[0] += s.beta[col] * u.x;
          if (col + 1 < i) v[1] += s.beta[col + 1] * u.y;
          if (col <= i && i < nr) atomicAdd(&s.dbeta[col], u.x * tg.x);
          if (col + 1 <= i && i < nr) atomicAdd(&s.dbeta[col + 1], u.y * tg.y);
        }
        *reinterpret_cast<uint32_t*>(s.dTg + i * kLd + col) = mma::pack2<T>(v[0], v[1]);
      }
  }
  float db0 = 0.f, db1 = 0.f, dbt0 = 0.f, dbt1 = 0.f;  // this thread's parts of db, dbeta of rows i0, i1
  for (int cc = cv0; cc < cv0 + nvt * 8; cc += 64) {  // tU = Tg^T dVn: dv = diag(beta) tU, dbeta += rowsum(tU o V)
    const int nt = min(8, (cv0 + nvt * 8 - cc) / 8);
    float acc[8][4];
    mma::zero(acc);
    mma::warp_gemm<T, 8, true, true>(acc, s.Tg, kLd, 16 * rb, s.dVn, s.ldv, cc, nt, 16 * rb, kChunk);
    dot_rows(acc, s.V, s.ldv, cc, nt, dbt0, dbt1);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0;
          if (i < nr) {
            const int col = cc + 8 * j + 2 * t;
            float2 y = make_float2(s.beta[i] * acc[j][2 * hf], s.beta[i] * acc[j][2 * hf + 1]);
            if (x.dv16) {
              *reinterpret_cast<uint32_t*>(x.dv16 + h * x.dv16_hs + (r0 + i) * x.dv16_ld + col) = mma::pack2<T>(y.x, y.y);
              continue;
            }
            float2* o = reinterpret_cast<float2*>(x.dv + (rowbase + i) * dv + col);
            if (x.dv_add) y.x += o->x, y.y += o->y;
            *o = y;
          }
        }
  }
  // tW = Tg^T dW; its rows scaled by beta e^b are the first part of this warp's dk columns
  float dka[8][4];
  mma::zero(dka);
  mma::warp_gemm<T, 8, true, true>(dka, s.Tg, kLd, 16 * rb, s.dW, s.ldk, ck0, nkt, 16 * rb, kChunk);
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
    mma::zero(m), mma::zero(y);
    mma::warp_gemm<T, 4, true, true>(m, s.Tg, kLd, 16 * rb, s.dTg, kLd, n0, 4, 16 * rb, kChunk);
    if (lower) mma::warp_gemm<T, 4, false, false>(y, s.K, s.ldk, 16 * rb, s.K, s.ldk, n0, 4, 0, dk);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0, col = n0 + 8 * j + 2 * t;
        *reinterpret_cast<uint32_t*>(s.M + i * kLd + col) = mma::pack2<T>(m[j][2 * hf], m[j][2 * hf + 1]);
        s.Akk[i * kLdA + col] = col < i ? y[j][2 * hf] : 0.f;
        s.Akk[i * kLdA + col + 1] = col + 1 < i ? y[j][2 * hf + 1] : 0.f;
      }
  }
  __syncthreads();
  {  // 5: dN = -tril_-1(M Tg^T)  (Tg^T: columns l <= j); dAkk = diag(beta) dN o Gam; L = dAkk o K K^T
    float m[4][4];
    mma::zero(m);
    if (lower) mma::warp_gemm<T, 4, false, false>(m, s.M, kLd, 16 * rb, s.Tg, kLd, n0, 4, 0, n0 + 32);
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
        *reinterpret_cast<uint32_t*>(s.dAkk + i * kLd + col) = mma::pack2<T>(v[0], v[1]);
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
  mma::warp_gemm<T, 8, false, true>(dka, s.dAkk, kLd, 16 * rb, s.K, s.ldk, ck0, nkt, 0, 16 * rb + 16);
  mma::warp_gemm<T, 8, true, true>(dka, s.dAkk, kLd, 16 * rb, s.K, s.ldk, ck0, nkt, 16 * rb, kChunk);
  // the WY part of dk to x.dk, or (dk16) dy = x.dk + the WY part held for the caller's tensor, with
  // y.dy's row sums (the l2norm chain: y = a.k's normalised rows, in s.K)
  float ydy0 = 0.f, ydy1 = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < nkt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0, col = ck0 + 8 * j + 2 * t;
        if (i < nr) {
          float2* o = reinterpret_cast<float2*>(x.dk + (rowbase + i) * dk + col);
          float2 y = make_float2(dka[j][2 * hf], dka[j][2 * hf + 1]);
          if (x.dk16) {
            const float2 other = *o;
            y.x += other.x, y.y += other.y;
            dka[j][2 * hf] = y.x, dka[j][2 * hf + 1] = y.y;
            const float2 kv = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(s.K + i * s.ldk + col));
            (hf ? ydy1 : ydy0) += kv.x * y.x + kv.y * y.y;
          } else {
            *o = y;
          }
        }
      }
  // row sums over the 4 lanes of a row, then the two column halves (shared atomics)
  for (float* v : {&db0, &db1, &dbt0, &dbt1, &ydy0, &ydy1}) {
    *v += __shfl_xor_sync(0xffffffffu, *v, 1);
    *v += __shfl_xor_sync(0xffffffffu, *v, 2);
  }
  if (t == 0) {
    atomicAdd(&s.db[i0], db0), atomicAdd(&s.db[i1], db1);
    atomicAdd(&s.dbeta[i0], dbt0), atomicAdd(&s.dbeta[i1], dbt1);
    if (x.dk16 && x.k_rstd) atomicAdd(&s.ydy[i0], ydy0), atomicAdd(&s.ydy[i1], ydy1);
  }
  __syncthreads();
  if (x.dk16) {  // (dy - y (y.dy)) rstd, or dy without the l2norm, in 16 bits into the caller's dk
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = hf ? i1 : i0;
      if (i >= nr) continue;
      const float yd = s.ydy[i], rs = x.k_rstd ? x.k_rstd[rowbase + i] : 1.f;
      T* o = x.dk16 + h * x.dk16_hs + (r0 + i) * x.dk16_ld;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < nkt) {
          const int col = ck0 + 8 * j + 2 * t;
          const float2 kv = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(s.K + i * s.ldk + col));
          *reinterpret_cast<uint32_t*>(o + col) =
              mma::pack2<T>((dka[j][2 * hf] - kv.x * yd) * rs, (dka[j][2 * hf + 1] - kv.y * yd) * rs);
        }
    }
  }
  if (threadIdx.x == 0) {  // dg: reverse cumsum of db inside the chunk (dB's <dS, S_out>: in the last row's dc)
    float acc = 0.f;
    for (int i = nr - 1; i >= 0; --i) x.dg[rowbase + i] = (acc += s.db[i]);
  }
  if (threadIdx.x < nr) x.dbeta[rowbase + threadIdx.x] = s.dbeta[threadIdx.x];
}


}  // namespace

size_t wy_smem(int dk, int dv, bool bwd, bool ll) { return layout_bytes<WyTiles<__nv_bfloat16>>(dk, dv, bwd, ll); }
size_t wy_bwd_smem(int dk, int dv) { return layout_bytes<WyBwdTiles<__nv_bfloat16>>(dk, dv); }

template <class T>
void launch_wy(const GlaArgs<T>& a, const float* beta, T* W, T* U, T* tg, T* dvi, const LoglinearWy<T>& ll,
               cudaStream_t s) {
  const bool plain = dvi == nullptr && ll.qeff == nullptr;
  const size_t bytes = wy_smem(a.dk, a.dv, dvi != nullptr, ll.qeff != nullptr);
  auto kernel = plain ? wy_kernel<T, true> : wy_kernel<T, false>;
  set_smem(kernel, bytes, /*max_carveout=*/plain);
  const int64_t blocks = grid_chunks(a);  // a piece: those past a sequence's chunks return at once
  if (dry_run() || blocks <= 0) return;  // dry run: workspace_size
  kernel<<<dim3(unsigned(blocks), unsigned(a.H)), kThreads, bytes, s>>>(a, beta, W, U, tg, dvi, ll);
  HILA_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_wy_bwd(const GlaArgs<T>& a, const WyBwdArgs<T>& x, cudaStream_t s) {
  const size_t bytes = wy_bwd_smem(a.dk, a.dv);
  set_smem(wy_bwd_kernel<T>, bytes);
  if (dry_run()) return;  // dry run: workspace_size
  wy_bwd_kernel<T><<<dim3(unsigned(a.nchunks), unsigned(a.H)), kThreads, bytes, s>>>(a, x);
  HILA_CUDA_CHECK_LAUNCH();
}

#define HILA_INSTANTIATE(T)                                                                                          \
  template void launch_wy<T>(const GlaArgs<T>&, const float*, T*, T*, T*, T*, const LoglinearWy<T>&, cudaStream_t); \
  template void launch_wy_bwd<T>(const GlaArgs<T>&, const WyBwdArgs<T>&, cudaStream_t);
HILA_INSTANTIATE(__nv_bfloat16)
HILA_INSTANTIATE(__half)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda::gdn
