// SPDX-License-Identifier: Apache-2.0
// GLA chunk gradients, sm80 tier (bf16 / fp16 on mma.sync; docs/math/HLA.md §7.1): one block per (chunk,
// head), from the states entering each chunk (hbuf) and the cotangents at their ends (dhbuf); the
// log-linear tree form reads the tree's nodes and its dZ instead (loglinear/tree.cuh).
#include "cuda/dispatch/static_switch.h"
#include "cuda/gla/sm80.cuh"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

namespace {

using namespace gla_sm80;

// Per-chunk gradients (docs/math/HLA.md §7.1); grid (nchunks, H), 8 warps. Warp w owns rows
// [16 rb, 16 rb + 16) (rb = w % 4) and the column half ch = w / 4 of every [C, d] output.
//   P  = scale Gamma o Q K^T,  dA = Gamma o dO V^T          (causal [C, C], 16-bit in smem)
//   dQ^ = diag(e^b) dO Hp^T + dA K                           [C,dv]x[dv,dk], [C,C]x[C,dk]
//   dK  = diag(w) V dH^T + scale dA^T Q                      w = e^{B - b}
//   dV  = diag(w) K dH + P^T dO
//   dc  = q^ . dq^ - k . dk,  dg = its reverse cumsum in the chunk + <dH, H_end>   (gla.cuh)
//   <dH, H_end> = e^B <dH, Hp> + sum_j w_j k_j . (V dH^T)_j
// (the tree form and a.dg_rows: dc per row instead; a.dg_rows adds <dH, H_end> to the last row's,
// the tree form writes the second term, plus sum_j k_j . fin_dk_j on a last partial chunk, to
// ta.rho: loglinear/tree.cuh).
// Dynamic smem: Q, K [C, dk+8], V, dO [C, dv+8], Hp, dH [dk, dv+8], P, dA [C, C+8], b, dc (+ the
// per-warp parts of <dH, H_end>).
constexpr int kBwdThreads = 256;

template <class T>
struct BwdTiles {
  T *Q, *K, *V, *dO, *Hp, *dH, *P, *dA;
  T* Hp2 = nullptr;                              // tree only: second node buffer (the next level in flight)
  float *b, *dc, *Tl = nullptr, *red = nullptr;  // tree only: dP o (scale Gamma o Q K^T) [C, C+4]; [2][C] row sums
  int ldk, ldv;
  static constexpr int kLdT = kChunk + 4;
  __host__ __device__ BwdTiles(char* base, int dk, int dv, bool tree, size_t* bytes = nullptr) {
    ldk = dk + 8, ldv = dv + 8;
    Carve c{base};
    Q = c.take<T>(kChunk * ldk);
    K = c.take<T>(kChunk * ldk);
    V = c.take<T>(kChunk * ldv);
    dO = c.take<T>(kChunk * ldv);
    Hp = c.take<T>(dk * ldv);
    dH = c.take<T>(dk * ldv);
    P = c.take<T>(kChunk * kLdTile);
    dA = c.take<T>(kChunk * kLdTile);
    b = c.take<float>(kChunk);
    dc = c.take<float>(2 * kChunk + 8);
    if (tree) Tl = c.take<float>(kChunk * kLdT), red = c.take<float>(2 * kChunk), Hp2 = c.take<T>(dk * ldv);
    if (bytes) *bytes = c.used;
  }
};

// kTree (log-linear tree form, loglinear/tree.cuh): P and dA carry lam^{LUT[i,j]} (dlam of the in-chunk
// levels from Tl), the state-read term sums over the levels the chunk reads (dlam of those levels),
// and dH is the chunk's dZ = dnode_1[N] (16-bit copies; the first level read comes with the inputs).
template <class T, bool kTree>
__global__ void __launch_bounds__(kBwdThreads) bwd_chunk_kernel(GlaArgs<T> a, TreeArgs ta) {
  extern __shared__ __align__(128) char smem[];
  BwdTiles<T> s(smem, a.dk, a.dv, kTree);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int rb = w & 3, ch = w >> 2;
  const int64_t cg = blockIdx.x;
  const int h = blockIdx.y, seq = a.chunk_seq[cg];
  const int64_t c = cg - a.chunk0[seq], r0 = a.row0[seq] + c * a.C;
  const int nr = rows_in(a.len[seq], c, a.C);
  const int dk = a.dk, dv = a.dv;
  const int64_t hidx = (cg * a.H + h) * int64_t(dk) * dv;
  mma::async_rows(s.Q, s.ldk, a.q + (h / a.q_div) * head_stride(a.q_hs, a.Ttot, dk), row_ld(a.q_ld, dk), r0, nr, 0, dk,
                 kChunk);
  mma::async_rows(s.K, s.ldk, a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, dk), row_ld(a.k_ld, dk), r0, nr, 0, dk,
                 kChunk);
  mma::async_rows(s.V, s.ldv, a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, dv), row_ld(a.v_ld, dv), r0, nr, 0, dv,
                 kChunk);
  mma::async_rows(s.dO, s.ldv, a.dO + h * head_stride(a.dO_hs, a.Ttot, dv), row_ld(a.dO_ld, dv), r0, nr, 0, dv, kChunk);
  mma::cp_async_commit();  // group A: Q, K, V, dO (P and dA); B: Hp (dQ^); C: dH (dK, dV); B, C land meanwhile
  // kTree: the chunk's absolute index n reads the nodes of the set bits of n
  const SeqNodes sn = kTree ? seq_nodes(ta, a.chunk0, seq, (a.len[seq] + a.C - 1) / a.C) : SeqNodes{};
  const int64_t n = sn.a0 + c;
  if constexpr (kTree) {
    if (n > 0) async_node(s.Hp, s.ldv, ta, first_read_slot(sn, n), h, a.H, dk, dv, 0, dv);
    mma::cp_async_commit();
    mma::async_rows(s.dH, s.ldv, static_cast<const T*>(ta.dz16) + hidx, dv, 0, dk, 0, dv, dk);
  } else {
    mma::async_rows(s.Hp, s.ldv, a.hbuf + hidx, dv, 0, dk, 0, dv, dk);
    mma::cp_async_commit();
    mma::async_rows(s.dH, s.ldv, a.dhbuf + hidx, dv, 0, dk, 0, dv, dk);
  }
  mma::cp_async_commit();
  const float* bg = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  if (threadIdx.x < kChunk) s.b[threadIdx.x] = gate_at(bg, r0, threadIdx.x, nr);
  mma::cp_async_wait<2>();
  __syncthreads();
  const float sc = float(a.scale), B = s.b[kChunk - 1];
  const int i0 = 16 * rb + g, i1 = i0 + 8;
  const float bi0 = s.b[i0], bi1 = s.b[i1];
  const int64_t lrow = int64_t(h) * a.Ttot + r0;  // lam / dlam row of chunk row 0 (times nL)
  const float* lam0 = kTree ? ta.lam + (lrow + min(i0, nr - 1)) * ta.nL : nullptr;
  const float* lam1 = kTree ? ta.lam + (lrow + min(i1, nr - 1)) * ta.nL : nullptr;
  // P and dA: this warp's rows, column tiles of half ch (32 columns) that reach the diagonal
  {
    const int n0 = 32 * ch;
    if (n0 <= 16 * rb + 15) {
      float x[4][4], y[4][4];
      mma::zero(x), mma::zero(y);
      mma::warp_gemm<T, 4, false, false>(x, s.Q, s.ldk, 16 * rb, s.K, s.ldk, n0, 4, 0, dk);
      mma::warp_gemm<T, 4, false, false>(y, s.dO, s.ldv, 16 * rb, s.V, s.ldv, n0, 4, 0, dv);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0, col = n0 + 8 * j + 2 * t;
          const float bi = hf ? bi1 : bi0;
          // causal and inside the chunk's rows: rows >= nr read no lam (their level may exceed nL)
          const bool in0 = col <= i && i < nr, in1 = col + 1 <= i && i < nr;
          const float g0 = in0 ? mma::fexp(bi - s.b[col]) : 0.f, g1 = in1 ? mma::fexp(bi - s.b[col + 1]) : 0.f;
          float l0 = 1.f, l1 = 1.f;
          if constexpr (kTree) {  // lam_i^{bitlen(i xor j)}; Tl = dP o (scale Gamma o Q K^T) for dlam
            const float* lr = hf ? lam1 : lam0;
            l0 = in0 ? lr[32 - __clz(i ^ col)] : 0.f;
            l1 = in1 ? lr[32 - __clz(i ^ (col + 1))] : 0.f;
            *reinterpret_cast<float2*>(s.Tl + i * s.kLdT + col) =
                make_float2(y[j][2 * hf] * x[j][2 * hf] * sc * g0, y[j][2 * hf + 1] * x[j][2 * hf + 1] * sc * g1);
          }
          *reinterpret_cast<uint32_t*>(s.P + i * kLdTile + col) =
              mma::pack2<T>(x[j][2 * hf] * sc * g0 * l0, x[j][2 * hf + 1] * sc * g1 * l1);
          *reinterpret_cast<uint32_t*>(s.dA + i * kLdTile + col) = mma::pack2<T>(y[j][2 * hf] * g0 * l0, y[j][2 * hf + 1] * g1 * l1);
        }
    } else {  // above the diagonal: zeros
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0, col = n0 + 8 * j + 2 * t;
          *reinterpret_cast<uint32_t*>(s.P + i * kLdTile + col) = 0u;
          *reinterpret_cast<uint32_t*>(s.dA + i * kLdTile + col) = 0u;
          if constexpr (kTree) *reinterpret_cast<float2*>(s.Tl + i * s.kLdT + col) = make_float2(0.f, 0.f);
        }
    }
  }
  // Hp landed (kTree: the tree loop below commits further groups and waits with wait<1>, so dH
  // must be complete too)
  if constexpr (kTree) mma::cp_async_wait<0>();
  else mma::cp_async_wait<1>();
  __syncthreads();
  if constexpr (kTree) {  // dlam of the in-chunk levels: row i, level l sums Tl over its bucket (§2.2)
    for (int e = threadIdx.x; e < nr * (kLogChunk + 1); e += blockDim.x) {
      const int i = e / (kLogChunk + 1), l = e % (kLogChunk + 1);
      if (l > 0 && !((i >> (l - 1)) & 1)) continue;  // empty bucket: never read, stays 0
      const int j0 = l == 0 ? i : (i >> l) << l, j1 = l == 0 ? i + 1 : j0 + (1 << (l - 1));
      float acc = 0.f;
      for (int j = j0; j < j1; ++j) acc += s.Tl[i * s.kLdT + j];
      ta.dlam[(lrow + i) * ta.nL + l] = acc;
    }
  }
  const int64_t rowbase = int64_t(h) * a.Ttot + r0;
  float dcp0 = 0.f, dcp1 = 0.f;  // this thread's partial dc of rows i0, i1
  // writes acc (columns c0 + 8j + 2t) of rows < nr to out [H][Ttot][ld] (fp32) or the caller's
  // tensor (GradOut; store_grad2)
  auto store = [&](float* out, int ld, const GradOut<T>& gt, const float(&acc)[8][4], int c0, int nt) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0;
          if (i < nr) store_grad2(out, ld, gt, h, r0 + i, rowbase + i, c0 + 8 * j + 2 * t, acc[j][2 * hf], acc[j][2 * hf + 1]);
        }
  };
  auto dot_rows = [&](const float(&acc)[8][4], const T* X, int ld, int c0, int nt, float& d0, float& d1) {
    mma::dot_rows<T, 8>(acc, X, ld, i0, i1, c0, nt, d0, d1);
  };
  // column halves of dk / dv owned by this warp (multiples of 16 wide)
  int ck0, nkt, cv0, nvt;
  mma::col_half(dk, ch, ck0, nkt);
  mma::col_half(dv, ch, cv0, nvt);
  const float e0 = mma::fexp(bi0), e1 = mma::fexp(bi1), w0 = mma::fexp(B - bi0), w1 = mma::fexp(B - bi1);
  for (int cc = ck0; cc < ck0 + nkt * 8; cc += 64) {  // dQ^, 64 columns at a time (one pass for kTree: dk <= 128)
    const int nt = min(8, (ck0 + nkt * 8 - cc) / 8);
    float acc[8][4];
    mma::zero(acc);
    if constexpr (kTree) {  // sum_m diag(lam^{p+m} e^{b+gap}) Y_m, Y_m = dO node_m^T   [C,dv]x[dv,dk] per level
      // level k in Hp / Hp2 (k even / odd), level k + 1 loading into the other one meanwhile
      int k = 0;
      for_each_read(ta, sn, n, h, a.H, [&](int m, int64_t, float gap) {
        T* cur = (k & 1) ? s.Hp2 : s.Hp;
        if (const uint64_t above = uint64_t(n) >> m) {  // the next level read: the next set bit of n
          const int m2 = m + 1 + ctz64u(above);
          async_node((k & 1) ? s.Hp : s.Hp2, s.ldv, ta, sn.slot(m2, (n >> (m2 - 1)) - 1), h, a.H, dk, dv, 0, dv);
        }
        mma::cp_async_commit();
        mma::cp_async_wait<1>();
        __syncthreads();  // level k has landed; the previous level's red is consumed
        ++k;
        float y[8][4];
        mma::zero(y);
        mma::warp_gemm<T, 8, false, false>(y, s.dO, s.ldv, 16 * rb, cur, s.ldv, cc, nt, 0, dv);
        const float f0 = mma::fexp(bi0 + gap), f1 = mma::fexp(bi1 + gap);
        const float c0 = lam0[kLogChunk + m] * f0, c1 = lam1[kLogChunk + m] * f1;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          acc[j][0] += c0 * y[j][0], acc[j][1] += c0 * y[j][1], acc[j][2] += c1 * y[j][2], acc[j][3] += c1 * y[j][3];
        float d0 = 0.f, d1 = 0.f;  // q^_i . Y_i over this warp's columns
        dot_rows(y, s.Q, s.ldk, cc, nt, d0, d1);
        d0 += __shfl_xor_sync(0xffffffffu, d0, 1), d0 += __shfl_xor_sync(0xffffffffu, d0, 2);
        d1 += __shfl_xor_sync(0xffffffffu, d1, 1), d1 += __shfl_xor_sync(0xffffffffu, d1, 2);
        if (t == 0) s.red[ch * kChunk + i0] = sc * f0 * d0, s.red[ch * kChunk + i1] = sc * f1 * d1;
        __syncthreads();
        if (threadIdx.x < nr)
          ta.dlam[(lrow + threadIdx.x) * ta.nL + kLogChunk + m] = s.red[threadIdx.x] + s.red[kChunk + threadIdx.x];
      });
    } else {
      mma::warp_gemm<T, 8, false, false>(acc, s.dO, s.ldv, 16 * rb, s.Hp, s.ldv, cc, nt, 0, dv);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j][0] *= e0, acc[j][1] *= e0, acc[j][2] *= e1, acc[j][3] *= e1;
    }
    mma::warp_gemm<T, 8, false, true>(acc, s.dA, kLdTile, 16 * rb, s.K, s.ldk, cc, nt, 0, 16 * rb + 16);
    store(a.dq, dk, a.dq_out, acc, cc, nt);
    float d0 = 0.f, d1 = 0.f;
    dot_rows(acc, s.Q, s.ldk, cc, nt, d0, d1);
    dcp0 += sc * d0, dcp1 += sc * d1;
  }
  // dK, dV rows: acc <- diag(e^{B-b}) acc + f acc2, the inter-chunk part (through dH, from the
  // chunk end) plus the intra-chunk part (f = scale for dK, 1 for dV); rows i0 (w0) and i1 (w1)
  auto combine = [&](float(&acc)[8][4], const float(&acc2)[8][4], float f) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      acc[j][0] = acc[j][0] * w0 + f * acc2[j][0], acc[j][1] = acc[j][1] * w0 + f * acc2[j][1];
      acc[j][2] = acc[j][2] * w1 + f * acc2[j][2], acc[j][3] = acc[j][3] * w1 + f * acc2[j][3];
    }
  };
  // kTree with a final-state cotangent: the last partial chunk's rows gain fin [C][d] (fp32, per
  // (sequence, head); loglinear_final_bwd_kernel): its levels <= p of the final state
  const bool fin_rows = kTree && ta.fin_dk && nr < kChunk;
  // (with kdot: kdot += k . fin over these columns, for ta.rho)
  auto add_fin = [&](float(&acc)[8][4], const float* fin, int d, int c0, int nt, float* kdot) {
    const float* base = fin + (int64_t(seq) * a.H + h) * kChunk * d;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0, col = c0 + 8 * j + 2 * t;
          if (i < nr) {
            const float2 x = *reinterpret_cast<const float2*>(base + int64_t(i) * d + col);
            acc[j][2 * hf] += x.x, acc[j][2 * hf + 1] += x.y;
            if (kdot) {
              const float2 k = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(s.K + i * s.ldk + col));
              *kdot += k.x * x.x + k.y * x.y;
            }
          }
        }
  };
  // this thread's part of <dH, H_end> (gla) or of ta.rho (the tree form: its state-write term alone)
  float dpart = 0.f;
  const bool part = !kTree || ta.rho;
  if constexpr (!kTree) {  // dH landed
    mma::cp_async_wait<0>();
    __syncthreads();
    {  // e^B <dH, Hp>, pairs of columns
      const int half = dv / 2;
      for (int e = threadIdx.x; e < dk * half; e += kBwdThreads) {
        const int r = e / half, col = 2 * (e % half);
        const float2 x = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(s.Hp + r * s.ldv + col));
        const float2 y = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(s.dH + r * s.ldv + col));
        dpart += x.x * y.x + x.y * y.y;
      }
      dpart *= mma::fexp(B);
    }
  }
  const bool fold = !kTree && a.value_is_key && dk == dv;  // the value is the key: dk gains dv
  for (int cc = ck0; cc < ck0 + nkt * 8; cc += 64) {  // dK
    const int nt = min(8, (ck0 + nkt * 8 - cc) / 8);
    float acc[8][4], acc2[8][4];
    mma::zero(acc), mma::zero(acc2);
    mma::warp_gemm<T, 8, false, false>(acc, s.V, s.ldv, 16 * rb, s.dH, s.ldv, cc, nt, 0, dv);
    mma::warp_gemm<T, 8, true, true>(acc2, s.dA, kLdTile, 16 * rb, s.Q, s.ldk, cc, nt, 16 * rb, kChunk);
    if (part) {  // sum_j w_j k_j . (V dH^T)_j, the state write's part of <dH, H_end>
      float d0 = 0.f, d1 = 0.f;
      dot_rows(acc, s.K, s.ldk, cc, nt, d0, d1);
      dpart += w0 * d0 + w1 * d1;
    }
    combine(acc, acc2, sc);
    if (fin_rows) add_fin(acc, ta.fin_dk, dk, cc, nt, part ? &dpart : nullptr);
    float d0 = 0.f, d1 = 0.f;
    dot_rows(acc, s.K, s.ldk, cc, nt, d0, d1);  // dc reads the key-role gradient alone
    dcp0 -= d0, dcp1 -= d1;
    if (fold) {  // the value is the key: dK + dV, dV = diag(w) K dH + P^T dO, on the same columns
      mma::zero(acc2);
      mma::warp_gemm<T, 8, false, true>(acc2, s.K, s.ldk, 16 * rb, s.dH, s.ldv, cc, nt, 0, dk);
      mma::warp_gemm<T, 8, true, true>(acc, s.P, kLdTile, 16 * rb, s.dO, s.ldv, cc, nt, 16 * rb, kChunk);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        acc[j][0] += w0 * acc2[j][0], acc[j][1] += w0 * acc2[j][1], acc[j][2] += w1 * acc2[j][2],
            acc[j][3] += w1 * acc2[j][3];
    }
    store(a.dk_, dk, a.dk_out, acc, cc, nt);
  }
  for (int cc = cv0; !fold && cc < cv0 + nvt * 8; cc += 64) {  // dV
    const int nt = min(8, (cv0 + nvt * 8 - cc) / 8);
    float acc[8][4], acc2[8][4];
    mma::zero(acc), mma::zero(acc2);
    mma::warp_gemm<T, 8, false, true>(acc, s.K, s.ldk, 16 * rb, s.dH, s.ldv, cc, nt, 0, dk);
    mma::warp_gemm<T, 8, true, true>(acc2, s.P, kLdTile, 16 * rb, s.dO, s.ldv, cc, nt, 16 * rb, kChunk);
    combine(acc, acc2, 1.f);
    if (fin_rows) add_fin(acc, ta.fin_dv, dv, cc, nt, nullptr);
    store(a.dv_, dv, a.dv_out, acc, cc, nt);
  }
  // dc: reduce over the 4 lanes of a row, then over the two column halves
  dcp0 += __shfl_xor_sync(0xffffffffu, dcp0, 1), dcp0 += __shfl_xor_sync(0xffffffffu, dcp0, 2);
  dcp1 += __shfl_xor_sync(0xffffffffu, dcp1, 1), dcp1 += __shfl_xor_sync(0xffffffffu, dcp1, 2);
  if (t == 0) s.dc[ch * kChunk + i0] = dcp0, s.dc[ch * kChunk + i1] = dcp1;
  const bool rows_only = kTree || a.dg_rows;
  if (part) {
    dpart = warp_sum(dpart);
    if (lane == 0) s.dc[2 * kChunk + w] = dpart;
  }
  __syncthreads();
  float D = 0.f;  // the chunk's <dH, H_end> (gla) or rho (tree)
  if (part && (w == 0 || (rows_only && int(threadIdx.x) == nr - 1))) {
#pragma unroll
    for (int x = 0; x < kBwdThreads / 32; ++x) D += s.dc[2 * kChunk + x];
  }
  if (rows_only) {  // a.dg_rows: the last row also carries <dH, H_end>
    if (threadIdx.x < nr)
      a.dg[rowbase + threadIdx.x] =
          s.dc[threadIdx.x] + s.dc[kChunk + threadIdx.x] + (!kTree && int(threadIdx.x) == nr - 1 ? D : 0.f);
    if (kTree && part && threadIdx.x == 0) ta.rho[cg * a.H + h] = D;
  } else if (w == 0) {  // dg = the reverse cumsum of dc in the chunk + <dH, H_end>
    const int j0 = 2 * lane, j1 = j0 + 1;
    chunk_dg(a.dg + rowbase, j0 < nr ? s.dc[j0] + s.dc[kChunk + j0] : 0.f,
             j1 < nr ? s.dc[j1] + s.dc[kChunk + j1] : 0.f, D, nr);
  }
}

}  // namespace

size_t gla_bwd_chunk_smem(int dk, int dv, bool tree) {
  size_t bytes = 0;
  BwdTiles<__nv_bfloat16>(nullptr, dk, dv, tree, &bytes);
  return bytes;
}

template <class T>
void gla_bwd_chunk_sm80(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree) {
  const size_t bytes = gla_bwd_chunk_smem(a.dk, a.dv, tree != nullptr);
  HILA_BOOL_SWITCH(tree != nullptr, kTree, [&] {
    auto kernel = bwd_chunk_kernel<T, kTree>;
    set_smem(kernel, bytes);
    if (dry_run()) return;  // dry run: workspace_size
    kernel<<<dim3(unsigned(a.nchunks), a.H), kBwdThreads, bytes, stream>>>(a, tree ? *tree : TreeArgs{});
    HILA_CUDA_CHECK_LAUNCH();
  });
}

template void gla_bwd_chunk_sm80<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, cudaStream_t, const TreeArgs*);
template void gla_bwd_chunk_sm80<__half>(const GlaArgs<__half>&, cudaStream_t, const TreeArgs*);

}  // namespace hila::cuda
