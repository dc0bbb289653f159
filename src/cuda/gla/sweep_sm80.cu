// SPDX-License-Identifier: Apache-2.0
// Tensor-core fast path of the GLA primitive for bf16/fp16 operands (fp32 accumulation and fp32
// state carries), split the way the work parallelises (HLA_SPEC §1, §7.1):
//   sweep:  one block per (sequence x head, dk tile, dv tile) walks the chunks in order with its
//           [64, 64] fp32 state tile in mma accumulators (registers), prefetching the next chunk's
//           operands with cp.async. Forward: stores the state entering each chunk (as a 16-bit GEMM
//           operand) and updates  H <- e^B H + (K o w)^T V,  w_i = e^{B - b_i}.
//           Reverse (backward): stores the cotangent at each chunk end and updates
//           dH <- e^B dH + (Q o w)^T dO,  w_i = scale e^{b_i}.
//   output: one block per (chunk, dv tile, head), fully parallel:
//           O = diag(scale e^b) Q H_c + (scale Gamma o Q K^T) V       [C,dk]x[dk,64], [C,C]x[C,64]
//           with the causal score block kept in registers and fed back as the A operand.
//   fused forward: the sweep and the output in one kernel when there are enough (sequence x
//           head x value tile) blocks (fused_forward_kernel below; no per-chunk states in memory).
// b is the chunk-local inclusive cumsum of the log-gates, precomputed once per call.
// On sm_90a, tc_sweep and tc_bwd_chunk hand over to the TMA + wgmma kernels of gla_sm90.cu where
// those apply.
#include <cstdlib>
#include <cstring>

#include "cuda/gla/gla.cuh"
#include "cuda/loglinear/tree.cuh"
#include "cuda/prims/mma.cuh"
#include "cuda/runtime/runtime.cuh"
#include "cuda/prims/tile.cuh"

namespace hila::cuda {

namespace {

constexpr int kTile = 64;              // dk and dv tile of the sweep, dv tile of the output kernel
constexpr int kLdTile = kTile + 8;     // padded smem row (16-bit elements): 144 bytes, ldmatrix conflict-free
constexpr int kThreads = 128;          // 4 warps; warp w owns rows [16w, 16w+16) of its tile

// b[h][row] = chunk-local inclusive cumsum of g; grid (nchunks, H), one warp.
template <class T>
__global__ void __launch_bounds__(32) cumsum_kernel(GlaArgs<T> a, Acc<T>* b) {
  using R = Acc<T>;
  const int64_t cg = blockIdx.x;
  const int h = blockIdx.y, seq = a.chunk_seq[cg];
  const int64_t c = cg - a.chunk0[seq], r0 = a.row0[seq] + c * a.C;
  const int nr = rows_in(a.len[seq], c, a.C);
  const R* g = a.g + int64_t(h) * a.Ttot;
  const int i0 = 2 * threadIdx.x, i1 = i0 + 1;
  R x0 = i0 < nr ? g[r0 + i0] : R(0), x1 = i1 < nr ? g[r0 + i1] : R(0);
  warp_pair_cumsum(x0, x1);
  R* out = b + int64_t(h) * a.Ttot + r0;
  if (i0 < nr) out[i0] = x0;
  if (i1 < nr) out[i1] = x1;
}

// The first kS - 1 chunks of a kS-stage cp.async pipeline (an empty group for each missing chunk).
template <int kS, class F>
__device__ __forceinline__ void pipeline_prologue(int nch, F&& issue) {
  for (int i = 0; i < kS - 1; ++i) {
    if (i < nch) issue(i);
    else tc::cp_async_commit();
  }
}

// The sequential sweep; kRev selects the backward cotangent sweep (see the file comment).
// kTree: the log-linear tree (ll_tree.cuh) instead of a carried state: per chunk c the register
// tile is Z_c = K^T diag(e^{B-b}) V; while its node index i (from c, level m = 1) is odd it closes
// its parent, acc <- e^{beta_m[i]} stk[m] + acc (i >>= 1, m += 1); a node with even i is one the
// chunks read (16-bit copy to ta.node16) and waits on stk[m] for its sibling. stk holds the
// thread's own accumulator elements per level in fp32 (`stack`, lstk levels per block), so it
// needs no barriers. Only full chunks enter the tree (a partial last chunk is read by no chunk);
// with ta.pend the pending nodes at the end go there (the final state's levels above the chunk).
// Pipeline depth of the sweep: chunk i+2's operands (and gates) are in flight while chunk i is used.
constexpr int kStages = 3;
struct SweepStage {
  static constexpr size_t kTileBytes = size_t(kChunk) * kLdTile * 2;  // one 16-bit [C, 64] tile
  static constexpr size_t kBytes = 2 * kTileBytes + kChunk * sizeof(float);
};

// vtile: value columns per block (64, or 32 to double the blocks when there are few sequences x heads).
template <class T, bool kRev, bool kTree = false>
__global__ void __launch_bounds__(kThreads) sweep_kernel(GlaArgs<T> a, int vtile, TreeArgs ta, float* stack, int lstk) {
  using R = Acc<T>;
  static_assert(std::is_same_v<R, float>, "the tensor-core sweep carries fp32 states");
  extern __shared__ __align__(128) char smem[];
  auto Ks = [&](int st) { return reinterpret_cast<T*>(smem + st * SweepStage::kBytes); };
  auto Vs = [&](int st) { return reinterpret_cast<T*>(smem + st * SweepStage::kBytes + SweepStage::kTileBytes); };
  auto bs = [&](int st) { return reinterpret_cast<float*>(smem + st * SweepStage::kBytes + 2 * SweepStage::kTileBytes); };
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int k0 = blockIdx.y * kTile, v0 = blockIdx.z * vtile;
  const int bk = min(kTile, a.dk - k0), bv = min(vtile, a.dv - v0), nt = bv / 8;
  const bool active = 16 * w < bk;
  const int64_t len = a.len[seq], row0 = a.row0[seq];
  // key [rows, dk] and value [rows, dv] of this head: (K, V) forward, (Q, dO) reverse
  const T* key = kRev ? a.q + (h / a.q_div) * head_stride(a.q_hs, a.Ttot, a.dk)
                      : a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk);
  const T* val = kRev ? a.dO + h * head_stride(a.dO_hs, a.Ttot, a.dv)
                      : a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, a.dv);
  const int64_t key_ld = kRev ? row_ld(a.q_ld, a.dk) : row_ld(a.k_ld, a.dk);
  const int64_t val_ld = kRev ? row_ld(a.dO_ld, a.dv) : row_ld(a.v_ld, a.dv);
  const R* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const int64_t sidx = (int64_t(seq) * a.H + h) * a.dk * a.dv;  // [N][H][dk][dv]
  const R* init = kTree ? nullptr : kRev ? a.dht : a.h0;  // kTree: a.h0 is Fenwick (ta.h0 seeds the tree)
  R* fin = kRev ? a.dh0 : a.ht;
  StateOperand<T>* store = kRev ? a.dhbuf : a.hbuf;

  // state tile in registers: rows k0 + 16w + g (+8), columns v0 + 8j + 2t (+1)
  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = k0 + 16 * w + g + (e >> 1) * 8, col = v0 + 8 * j + 2 * t + (e & 1);
      acc[j][e] = (init && active && j < nt) ? float(init[sidx + int64_t(r) * a.dv + col]) : 0.f;
    }
  const int nch = int(kTree ? len / a.C : (len + a.C - 1) / a.C);
  auto chunk_of = [&](int i) { return kRev ? nch - 1 - i : i; };
  const tc::TileStream<T, kThreads, kChunk> key_rows(key, key_ld, k0, bk, kLdTile), val_rows(val, val_ld, v0, bv, kLdTile);
  // chunk i -> stage i % kStages: K / V tiles and the gates (rows >= nr zero-filled)
  auto issue = [&](int i) {
    const int c = chunk_of(i), st = i % kStages;
    const int64_t r0 = row0 + int64_t(c) * a.C;
    const int nr = rows_in(len, c, a.C);
    key_rows.issue(Ks(st), r0, nr, kLdTile);
    val_rows.issue(Vs(st), r0, nr, kLdTile);
    tc::async_gates<kChunk>(bs(st), b, r0, nr, key);
    tc::cp_async_commit();
  };
  pipeline_prologue<kStages>(nch, issue);
  // acc += Kt^T diag(wt) Vt  [64 (dk), C] x [C, vtile]; full tiles (all of dk's 64 rows, 64 or 32
  // columns) pass a literal column count, so that the fragment loads carry no guards
  const bool full = bk == kTile && nt == 8, half = bk == kTile && nt == 4;
  auto update = [&](float(&x)[8][4], const T* Kt, const T* Vt, auto wt) {
    if (full) tc::warp_gemm_tn_weighted<T, 8>(x, Kt, kLdTile, 16 * w, Vt, kLdTile, 8, kChunk, wt);
    else if (half) tc::warp_gemm_tn_weighted<T, 8>(x, Kt, kLdTile, 16 * w, Vt, kLdTile, 4, kChunk, wt);
    else if (active) tc::warp_gemm_tn_weighted<T, 8>(x, Kt, kLdTile, 16 * w, Vt, kLdTile, nt, kChunk, wt);
  };
  // the state-tile store for a full tile, from a precomputed row pointer
  const float sc = float(a.scale);
  const int64_t chunk0 = a.chunk0[seq], store_cstride = int64_t(a.H) * a.dk * a.dv;
  T* const store_base = store ? store + (chunk0 * a.H + h) * int64_t(a.dk) * a.dv + int64_t(k0 + 16 * w + g) * a.dv +
                                    v0 + 2 * t
                              : nullptr;
  auto store_full = [&](T* dst) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      *reinterpret_cast<uint32_t*>(dst + 8 * j) = tc::pack2<T>(acc[j][0], acc[j][1]);
      *reinterpret_cast<uint32_t*>(dst + 8 * a.dv + 8 * j) = tc::pack2<T>(acc[j][2], acc[j][3]);
    }
  };
  [[maybe_unused]] SeqNodes sn;  // kTree: node layout, chunks a0 + i
  // this thread's tile elements in ll_tree.cuh's layout (rows r_lo (+8), columns c_lo + 8j (+1))
  auto at = [&](int j, int e) -> float& { return acc[j][e]; };
  const int r_lo = k0 + 16 * w + g, c_lo = v0 + 2 * t;
  const TreeStack<kThreads> stk(stack, lstk);  // kTree only (lstk = 0 otherwise)
  if constexpr (kTree) {
    sn = seq_nodes(ta, a.chunk0, seq, (len + a.C - 1) / a.C);
    if (sn.nc > 0) tree_seed<T>(ta, sn, stk, lstk, seq, h, a.H, a.dk, a.dv, r_lo, c_lo, active, nt, at);
  }
  for (int i = 0; i < nch; ++i) {
    // chunk i has landed; the barrier also retires iteration i-1's reads of the stage refilled next
    tc::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (i + kStages - 1 < nch) issue(i + kStages - 1);
    else tc::cp_async_commit();
    const int c = chunk_of(i), st = i % kStages;
    const T* Kt = Ks(st);
    const T* Vt = Vs(st);
    const float* bt = bs(st);
    if constexpr (kTree) {  // Z_c, then the nodes it closes
      const float B = bt[rows_in(len, c, a.C) - 1];
      tc::zero(acc);
      update(acc, Kt, Vt, [&](int k) { return tc::fexp(B - bt[k]); });
      tree_close<T>(ta, sn, stk, c, h, a.H, a.dk, a.dv, r_lo, c_lo, active, nt, at);
      continue;
    }
    if (store && active) {  // state entering chunk c (forward) / cotangent at its end (reverse)
      if (full) store_full(store_base + c * store_cstride);
      else tc::store_tile16(store + ((chunk0 + c) * a.H + h) * int64_t(a.dk) * a.dv, a.dv, r_lo, c_lo, nt, at);
    }
    const float B = bt[rows_in(len, c, a.C) - 1];
    const float decay = tc::fexp(B);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] *= decay;
    auto wt = [&](int k) { return kRev ? sc * tc::fexp(bt[k]) : tc::fexp(B - bt[k]); };
    // forward S <- e^B S + K^T diag(e^{B-b}) V; reverse dS <- e^B dS + scale Q^T diag(e^b) dO (§7.1)
    update(acc, Kt, Vt, wt);
  }
  if constexpr (kTree) {
    if (ta.pend && active) tree_pending(ta, sn, stk, lstk, nch, seq, h, a.H, a.dk, a.dv, r_lo, c_lo, nt);
  }
  if (!kTree && fin && active) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = k0 + 16 * w + g + (e >> 1) * 8, col = v0 + 8 * j + 2 * t + (e & 1);
          fin[sidx + int64_t(r) * a.dv + col] = R(acc[j][e]);
        }
  }
}

// The causal score block P = scale Gamma o Q K^T of one warp from x = Q K^T (rows [16 rb, 16 rb + 16),
// key columns [n0, n0 + 32): x[j] columns n0 + 8j + 2t (+1), rows g / g + 8), 16-bit into Ps [C][kLdTile],
// zeros above the diagonal and in rows >= nr; bs [C] the chunk-local gate cumsum.
// kTree: times lam_i^{bitlen(i xor j)} (aligned chunks, LOGLINEAR_SPEC §2.6), lam rows lam0 / lam1.
template <class T, bool kTree>
__device__ __forceinline__ void score_store(T* Ps, const float (&x)[4][4], const float* bs, int rb, int n0, int nr,
                                            float sc, const float* lam0, const float* lam1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int i0 = 16 * rb + g, i1 = i0 + 8;
  const float bi0 = bs[i0], bi1 = bs[i1];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = hf ? i1 : i0, col = n0 + 8 * j + 2 * t;
      const float bi = hf ? bi1 : bi0;
      const bool in0 = col <= i && i < nr, in1 = col + 1 <= i && i < nr;
      float p0 = in0 ? x[j][2 * hf] * sc * tc::fexp(bi - bs[col]) : 0.f;
      float p1 = in1 ? x[j][2 * hf + 1] * sc * tc::fexp(bi - bs[col + 1]) : 0.f;
      if constexpr (kTree) {
        const float* lr = hf ? lam1 : lam0;
        if (in0) p0 *= lr[32 - __clz(i ^ col)];
        if (in1) p1 *= lr[32 - __clz(i ^ (col + 1))];
      }
      *reinterpret_cast<uint32_t*>(Ps + i * kLdTile + col) = tc::pack2<T>(p0, p1);
    }
}

// Output of every chunk; grid (nchunks, dv tiles of kOutV, H), 8 warps. Warp w = (rb, ch):
//   phase 1: P = scale Gamma o Q K^T for rows [16 rb, 16 rb + 16), key columns of half ch (causal
//            part only), to smem as the 16-bit A operand;
//   phase 2: O = diag(scale e^b) Q H_c + P V for the same rows, value columns [64 ch, 64 ch + 64).
// Q and K are read once per chunk for up to kOutV value columns. Dynamic smem: Q, K [C, dk+8],
// V [C, vt+8], H [dk, vt+8], P [C, C+8] (16-bit), b [C].
constexpr int kOutV = 128;
constexpr int kOutThreads = 256;

// kTree (log-linear tree form, ll_tree.cuh): P also carries lam^{LUT[i,j]}, and the state term
// is the sum over the levels the chunk reads, their 16-bit node copies loaded into H in turn (the
// first one with Q, K, V).
template <class T, bool kTree>
__global__ void __launch_bounds__(kOutThreads) output_kernel(GlaArgs<T> a, TreeArgs ta) {
  extern __shared__ __align__(128) char smem[];
  const int vt = min(kOutV, a.dv), ldq = a.dk + 8, ldv = vt + 8;
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = Qs + kChunk * ldq;
  T* Vs = Ks + kChunk * ldq;
  T* Hs = Vs + kChunk * ldv;
  T* Ps = Hs + a.dk * ldv;
  float* bs = reinterpret_cast<float*>(Ps + kChunk * kLdTile);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int rb = w & 3, ch = w >> 2;
  const int64_t cg = blockIdx.x;
  const int v0 = blockIdx.y * kOutV, h = blockIdx.z;
  const int seq = a.chunk_seq[cg];
  const int64_t c = cg - a.chunk0[seq], r0 = a.row0[seq] + c * a.C;
  const int nr = rows_in(a.len[seq], c, a.C);
  const int bv = min(vt, a.dv - v0);
  tc::async_rows(Qs, ldq, a.q + (h / a.q_div) * head_stride(a.q_hs, a.Ttot, a.dk), row_ld(a.q_ld, a.dk), r0, nr, 0,
                 a.dk, kChunk);
  tc::async_rows(Ks, ldq, a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk), row_ld(a.k_ld, a.dk), r0, nr, 0,
                 a.dk, kChunk);
  tc::cp_async_commit();  // group A: Q, K (phase 1); group B: V, H (phase 2), landing during phase 1
  tc::async_rows(Vs, ldv, a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, a.dv), row_ld(a.v_ld, a.dv), r0, nr, v0,
                 bv, kChunk);
  // kTree: the chunk's absolute index n reads the nodes of the set bits of n
  const SeqNodes sn = kTree ? seq_nodes(ta, a.chunk0, seq, (a.len[seq] + a.C - 1) / a.C) : SeqNodes{};
  const int64_t n = sn.a0 + c;
  if constexpr (!kTree) tc::async_rows(Hs, ldv, a.hbuf + (cg * a.H + h) * int64_t(a.dk) * a.dv, a.dv, 0, a.dk, v0, bv, a.dk);
  else if (n > 0) async_node(Hs, ldv, ta, first_read_slot(sn, n), h, a.H, a.dk, a.dv, v0, bv);
  tc::cp_async_commit();
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  if (threadIdx.x < kChunk) bs[threadIdx.x] = gate_at(b, r0, threadIdx.x, nr);
  tc::cp_async_wait<1>();
  __syncthreads();
  const float sc = float(a.scale);
  const int i0 = 16 * rb + g, i1 = i0 + 8;  // rows of this thread
  const float bi0 = bs[i0], bi1 = bs[i1];
  const float* lam0 = kTree ? ta.lam + (int64_t(h) * a.Ttot + r0 + min(i0, nr - 1)) * ta.nL : nullptr;
  const float* lam1 = kTree ? ta.lam + (int64_t(h) * a.Ttot + r0 + min(i1, nr - 1)) * ta.nL : nullptr;
  {  // phase 1: P for rows 16 rb.., key columns 32 ch.. (the causal part)     [16, dk] x [dk, 32]
    float x[4][4];
    tc::zero(x);
    if (32 * ch <= 16 * rb + 15) tc::warp_gemm<T, 4, false, false>(x, Qs, ldq, 16 * rb, Ks, ldq, 32 * ch, 4, 0, a.dk);
    score_store<T, kTree>(Ps, x, bs, rb, 32 * ch, nr, sc, lam0, lam1);
  }
  tc::cp_async_wait<0>();
  __syncthreads();
  // phase 2
  const int c0 = 64 * ch, nt = max(0, min(64, bv - c0)) / 8;
  float o[8][4];
  tc::zero(o);
  if constexpr (kTree) {  // sum_m diag(scale lam^{p+m} e^{b+gap}) Q node_m      [C,dk]x[dk,64] per level
    bool first = true;
    for_each_read(ta, sn, n, h, a.H, [&](int m, int64_t slot, float gap) {
      if (!first) {
        __syncthreads();  // the previous level's H is consumed
        async_node(Hs, ldv, ta, slot, h, a.H, a.dk, a.dv, v0, bv);
        tc::cp_async_commit();
        tc::cp_async_wait<0>();
        __syncthreads();
      }
      first = false;
      if (nt == 0) return;
      float y[8][4];
      tc::zero(y);
      tc::warp_gemm<T, 8, false, true>(y, Qs, ldq, 16 * rb, Hs, ldv, c0, nt, 0, a.dk);
      const float e0 = sc * lam0[kLogChunk + m] * tc::fexp(bi0 + gap), e1 = sc * lam1[kLogChunk + m] * tc::fexp(bi1 + gap);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j][0] += e0 * y[j][0], o[j][1] += e0 * y[j][1], o[j][2] += e1 * y[j][2], o[j][3] += e1 * y[j][3];
    });
    if (nt == 0) return;
  } else {
    if (nt == 0) return;
    tc::warp_gemm<T, 8, false, true>(o, Qs, ldq, 16 * rb, Hs, ldv, c0, nt, 0, a.dk);
    const float e0 = sc * tc::fexp(bi0), e1 = sc * tc::fexp(bi1);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j][0] *= e0, o[j][1] *= e0, o[j][2] *= e1, o[j][3] *= e1;
  }
  tc::warp_gemm<T, 8, false, true>(o, Ps, kLdTile, 16 * rb, Vs, ldv, c0, nt, 0, 16 * rb + 16);
  T* out = a.o + h * head_stride(a.o_hs, a.Ttot, a.dv);
  const int64_t ldo = row_ld(a.o_ld, a.dv);
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0;
        if (i < nr)
          *reinterpret_cast<uint32_t*>(out + (r0 + i) * ldo + v0 + c0 + 8 * j + 2 * t) =
              tc::pack2<T>(o[j][2 * hf], o[j][2 * hf + 1]);
      }
}

// The forward in one pass (the sweep and the output kernel fused; HLA_SPEC §1, §7.1): one block per
// (sequence x head, value tile of 64 columns), 8 warps, walking the chunks in order with the
// [dk, 64] fp32 state H in registers (warp w: rows [16w, 16w + 16)) and its 16-bit copy in smem,
// the operand of Q H (double-buffered: the copy entering chunk i + 1 is written while chunk i reads
// the one entering i). Per chunk:
//   P  = scale Gamma o Q K^T             warp (rb, ch): rows 16 rb.., keys 32 ch..   [16,dk]x[dk,32]
//   H' = e^B H + K^T diag(e^{B-b}) V     warp w: state rows 16 w..                    [16,C]x[C,64]
//   O  = diag(scale e^b) Q H + P V       warp (rb, ch): rows 16 rb.., values 32 ch..  [16,dk]x[dk,32], [16,C]x[C,32]
// with chunks i + 1 and i + 2 loading meanwhile (cp.async, kFusedStages deep). The per-chunk states
// never go through global memory, except into a.hbuf when the caller asks for them (a backward's
// recompute). Q and K are read once per value tile: worth it while there are enough (sequence x
// head x value tile) blocks to fill the GPU (tc_fused_forward_wanted).
// Dynamic smem: kFusedStages x {Q, K [C, dk+8], V [C, 72] (16-bit), b [C]}, H [2][dk, 72], P [C, 72].
constexpr int kFusedV = 64, kFusedThreads = 256, kFusedStages = 3, kFusedLdv = kFusedV + 8;

__host__ __device__ inline size_t fused_stage_bytes(int dk) {
  return (size_t(2) * kChunk * (dk + 8) + size_t(kChunk) * kFusedLdv) * 2 + kChunk * sizeof(float);
}
size_t fused_smem(int dk) {
  return kFusedStages * fused_stage_bytes(dk) + (size_t(2) * dk * kFusedLdv + size_t(kChunk) * kLdTile) * 2;
}

template <class T>
__global__ void __launch_bounds__(kFusedThreads, 1) fused_forward_kernel(GlaArgs<T> a) {
  extern __shared__ __align__(128) char smem[];
  const int dk = a.dk, ldq = dk + 8, ldv = kFusedLdv;
  const size_t stage_bytes = fused_stage_bytes(dk);
  auto Qs = [&](int st) { return reinterpret_cast<T*>(smem + st * stage_bytes); };
  auto Ks = [&](int st) { return Qs(st) + kChunk * ldq; };
  auto Vs = [&](int st) { return Ks(st) + kChunk * ldq; };
  auto bs = [&](int st) { return reinterpret_cast<float*>(Vs(st) + kChunk * ldv); };
  T* const Hs = reinterpret_cast<T*>(smem + kFusedStages * stage_bytes);  // [2][dk][ldv]
  T* const Ps = Hs + 2 * dk * ldv;                                         // [C][kLdTile]
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int rb = w & 3, ch = w >> 2;
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H, v0 = blockIdx.y * kFusedV;
  const bool active = 16 * w < dk;  // this warp owns state rows
  const int64_t len = a.len[seq], row0 = a.row0[seq], chunk0 = a.chunk0[seq];
  const int nch = int((len + a.C - 1) / a.C);
  const T* q = a.q + (h / a.q_div) * head_stride(a.q_hs, a.Ttot, dk);
  const T* k = a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, dk);
  const T* v = a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, a.dv);
  const int64_t q_ld = row_ld(a.q_ld, dk), k_ld = row_ld(a.k_ld, dk), v_ld = row_ld(a.v_ld, a.dv);
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  // chunk i -> stage i % kFusedStages: Q, K, V tiles and the gates (rows >= nr zero-filled)
  auto issue = [&](int i) {
    const int st = i % kFusedStages, nr = rows_in(len, i, a.C);
    const int64_t r0 = row0 + int64_t(i) * a.C;
    tc::async_rows(Qs(st), ldq, q, q_ld, r0, nr, 0, dk, kChunk);
    tc::async_rows(Ks(st), ldq, k, k_ld, r0, nr, 0, dk, kChunk);
    tc::async_rows(Vs(st), ldv, v, v_ld, r0, nr, v0, kFusedV, kChunk);
    tc::async_gates<kChunk>(bs(st), b, r0, nr, k);
    tc::cp_async_commit();
  };
  pipeline_prologue<kFusedStages>(nch, issue);
  // state tile: rows 16w + g (+8), columns v0 + 8j + 2t (+1)
  const int64_t sidx = (int64_t(seq) * a.H + h) * dk * a.dv;
  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 16 * w + g + (e >> 1) * 8, col = v0 + 8 * j + 2 * t + (e & 1);
      acc[j][e] = (a.h0 && active) ? a.h0[sidx + int64_t(r) * a.dv + col] : 0.f;
    }
  // the state entering chunk i as a 16-bit operand: into smem buffer i % 2 (and a.hbuf if set)
  auto put_state = [&](int i) {
    if (!active) return;
    T* dst = Hs + (i & 1) * dk * ldv;
    T* hb = a.hbuf ? a.hbuf + ((chunk0 + i) * a.H + h) * int64_t(dk) * a.dv + v0 : nullptr;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = 16 * w + g + 8 * hf, col = 8 * j + 2 * t;
        const uint32_t x = tc::pack2<T>(acc[j][2 * hf], acc[j][2 * hf + 1]);
        *reinterpret_cast<uint32_t*>(dst + r * ldv + col) = x;
        if (hb) *reinterpret_cast<uint32_t*>(hb + int64_t(r) * a.dv + col) = x;
      }
  };
  if (nch > 0) put_state(0);
  const float sc = float(a.scale);
  const int i0 = 16 * rb + g, i1 = i0 + 8;  // output rows of this thread
  T* out = a.o + h * head_stride(a.o_hs, a.Ttot, a.dv) + v0 + 32 * ch + 2 * t;
  const int64_t ldo = row_ld(a.o_ld, a.dv);
  for (int i = 0; i < nch; ++i) {
    // chunk i has landed; the barrier also retires chunk i-1's reads of P, of H buffer (i+1) % 2
    // and of the stage refilled next
    tc::cp_async_wait<kFusedStages - 2>();
    __syncthreads();
    if (i + kFusedStages - 1 < nch) issue(i + kFusedStages - 1);
    else tc::cp_async_commit();
    const int st = i % kFusedStages, nr = rows_in(len, i, a.C);
    const T* Qt = Qs(st);
    const T* Kt = Ks(st);
    const T* Vt = Vs(st);
    const float* bt = bs(st);
    {  // P: keys 32 ch.. (the causal part)                                   [16, dk] x [dk, 32]
      float x[4][4];
      tc::zero(x);
      if (32 * ch <= 16 * rb + 15) tc::warp_gemm<T, 4, false, false>(x, Qt, ldq, 16 * rb, Kt, ldq, 32 * ch, 4, 0, dk);
      score_store<T, false>(Ps, x, bt, rb, 32 * ch, nr, sc, nullptr, nullptr);
    }
    if (active) {  // H <- e^B H + K^T diag(e^{B-b}) V      [16 (dk), C] x [C, 64]
      const float B = bt[nr - 1], decay = tc::fexp(B);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] *= decay;
      tc::warp_gemm_tn_weighted<T, 8>(acc, Kt, ldq, 16 * w, Vt, ldv, 8, kChunk, [&](int kk) { return tc::fexp(B - bt[kk]); });
    }
    if (i + 1 < nch) put_state(i + 1);
    __syncthreads();  // P complete
    // O = diag(scale e^b) Q H + P V: values 32 ch..                 [16, dk] x [dk, 32], [16, C] x [C, 32]
    float o[4][4];
    tc::zero(o);
    tc::warp_gemm<T, 4, false, true>(o, Qt, ldq, 16 * rb, Hs + (i & 1) * dk * ldv, ldv, 32 * ch, 4, 0, dk);
    const float e0 = sc * tc::fexp(bt[i0]), e1 = sc * tc::fexp(bt[i1]);
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j][0] *= e0, o[j][1] *= e0, o[j][2] *= e1, o[j][3] *= e1;
    tc::warp_gemm<T, 4, false, true>(o, Ps, kLdTile, 16 * rb, Vt, ldv, 32 * ch, 4, 0, 16 * rb + 16);
    const int64_t r0 = row0 + int64_t(i) * a.C;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = hf ? i1 : i0;
        if (r < nr) *reinterpret_cast<uint32_t*>(out + (r0 + r) * ldo + 8 * j) = tc::pack2<T>(o[j][2 * hf], o[j][2 * hf + 1]);
      }
  }
  tc::cp_async_wait<0>();
  if (a.ht && active) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * w + g + (e >> 1) * 8, col = v0 + 8 * j + 2 * t + (e & 1);
        a.ht[sidx + int64_t(r) * a.dv + col] = acc[j][e];
      }
  }
}

// Per-chunk gradients (HLA_SPEC §7.1); grid (nchunks, H), 8 warps. Warp w owns rows
// [16 rb, 16 rb + 16) (rb = w % 4) and the column half ch = w / 4 of every [C, d] output.
//   P  = scale Gamma o Q K^T,  dA = Gamma o dO V^T          (causal [C, C], 16-bit in smem)
//   dQ^ = diag(e^b) dO Hp^T + dA K                           [C,dv]x[dv,dk], [C,C]x[C,dk]
//   dK  = diag(w) V dH^T + scale dA^T Q                      w = e^{B - b}
//   dV  = diag(w) K dH + P^T dO
//   dc  = q^ . dq^ - k . dk   (dg is its reverse cumsum, gla_dg_kernel)
// Dynamic smem: Q, K [C, dk+8], V, dO [C, dv+8], Hp, dH [dk, dv+8], P, dA [C, C+8], b, dc.
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
    dc = c.take<float>(2 * kChunk);
    if (tree) Tl = c.take<float>(kChunk * kLdT), red = c.take<float>(2 * kChunk), Hp2 = c.take<T>(dk * ldv);
    if (bytes) *bytes = c.used;
  }
};

// kTree (log-linear tree form, ll_tree.cuh): P and dA carry lam^{LUT[i,j]} (dlam of the in-chunk
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
  tc::async_rows(s.Q, s.ldk, a.q + (h / a.q_div) * head_stride(a.q_hs, a.Ttot, dk), row_ld(a.q_ld, dk), r0, nr, 0, dk,
                 kChunk);
  tc::async_rows(s.K, s.ldk, a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, dk), row_ld(a.k_ld, dk), r0, nr, 0, dk,
                 kChunk);
  tc::async_rows(s.V, s.ldv, a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, dv), row_ld(a.v_ld, dv), r0, nr, 0, dv,
                 kChunk);
  tc::async_rows(s.dO, s.ldv, a.dO + h * head_stride(a.dO_hs, a.Ttot, dv), row_ld(a.dO_ld, dv), r0, nr, 0, dv, kChunk);
  tc::cp_async_commit();  // group A: Q, K, V, dO (P and dA); B: Hp (dQ^); C: dH (dK, dV); B, C land meanwhile
  // kTree: the chunk's absolute index n reads the nodes of the set bits of n
  const SeqNodes sn = kTree ? seq_nodes(ta, a.chunk0, seq, (a.len[seq] + a.C - 1) / a.C) : SeqNodes{};
  const int64_t n = sn.a0 + c;
  if constexpr (kTree) {
    if (n > 0) async_node(s.Hp, s.ldv, ta, first_read_slot(sn, n), h, a.H, dk, dv, 0, dv);
    tc::cp_async_commit();
    tc::async_rows(s.dH, s.ldv, static_cast<const T*>(ta.dz16) + hidx, dv, 0, dk, 0, dv, dk);
  } else {
    tc::async_rows(s.Hp, s.ldv, a.hbuf + hidx, dv, 0, dk, 0, dv, dk);
    tc::cp_async_commit();
    tc::async_rows(s.dH, s.ldv, a.dhbuf + hidx, dv, 0, dk, 0, dv, dk);
  }
  tc::cp_async_commit();
  const float* bg = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  if (threadIdx.x < kChunk) s.b[threadIdx.x] = gate_at(bg, r0, threadIdx.x, nr);
  tc::cp_async_wait<2>();
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
      tc::zero(x), tc::zero(y);
      tc::warp_gemm<T, 4, false, false>(x, s.Q, s.ldk, 16 * rb, s.K, s.ldk, n0, 4, 0, dk);
      tc::warp_gemm<T, 4, false, false>(y, s.dO, s.ldv, 16 * rb, s.V, s.ldv, n0, 4, 0, dv);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0, col = n0 + 8 * j + 2 * t;
          const float bi = hf ? bi1 : bi0;
          // causal and inside the chunk's rows: rows >= nr read no lam (their level may exceed nL)
          const bool in0 = col <= i && i < nr, in1 = col + 1 <= i && i < nr;
          const float g0 = in0 ? tc::fexp(bi - s.b[col]) : 0.f, g1 = in1 ? tc::fexp(bi - s.b[col + 1]) : 0.f;
          float l0 = 1.f, l1 = 1.f;
          if constexpr (kTree) {  // lam_i^{bitlen(i xor j)}; Tl = dP o (scale Gamma o Q K^T) for dlam
            const float* lr = hf ? lam1 : lam0;
            l0 = in0 ? lr[32 - __clz(i ^ col)] : 0.f;
            l1 = in1 ? lr[32 - __clz(i ^ (col + 1))] : 0.f;
            *reinterpret_cast<float2*>(s.Tl + i * s.kLdT + col) =
                make_float2(y[j][2 * hf] * x[j][2 * hf] * sc * g0, y[j][2 * hf + 1] * x[j][2 * hf + 1] * sc * g1);
          }
          *reinterpret_cast<uint32_t*>(s.P + i * kLdTile + col) =
              tc::pack2<T>(x[j][2 * hf] * sc * g0 * l0, x[j][2 * hf + 1] * sc * g1 * l1);
          *reinterpret_cast<uint32_t*>(s.dA + i * kLdTile + col) = tc::pack2<T>(y[j][2 * hf] * g0 * l0, y[j][2 * hf + 1] * g1 * l1);
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
  if constexpr (kTree) tc::cp_async_wait<0>();
  else tc::cp_async_wait<1>();
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
    tc::dot_rows<T, 8>(acc, X, ld, i0, i1, c0, nt, d0, d1);
  };
  // column halves of dk / dv owned by this warp (multiples of 16 wide)
  int ck0, nkt, cv0, nvt;
  tc::col_half(dk, ch, ck0, nkt);
  tc::col_half(dv, ch, cv0, nvt);
  const float e0 = tc::fexp(bi0), e1 = tc::fexp(bi1), w0 = tc::fexp(B - bi0), w1 = tc::fexp(B - bi1);
  for (int cc = ck0; cc < ck0 + nkt * 8; cc += 64) {  // dQ^, 64 columns at a time (one pass for kTree: dk <= 128)
    const int nt = min(8, (ck0 + nkt * 8 - cc) / 8);
    float acc[8][4];
    tc::zero(acc);
    if constexpr (kTree) {  // sum_m diag(lam^{p+m} e^{b+gap}) Y_m, Y_m = dO node_m^T   [C,dv]x[dv,dk] per level
      // level k in Hp / Hp2 (k even / odd), level k + 1 loading into the other one meanwhile
      int k = 0;
      for_each_read(ta, sn, n, h, a.H, [&](int m, int64_t, float gap) {
        T* cur = (k & 1) ? s.Hp2 : s.Hp;
        if (const uint64_t above = uint64_t(n) >> m) {  // the next level read: the next set bit of n
          const int m2 = m + 1 + ctz64u(above);
          async_node((k & 1) ? s.Hp : s.Hp2, s.ldv, ta, sn.slot(m2, (n >> (m2 - 1)) - 1), h, a.H, dk, dv, 0, dv);
        }
        tc::cp_async_commit();
        tc::cp_async_wait<1>();
        __syncthreads();  // level k has landed; the previous level's red is consumed
        ++k;
        float y[8][4];
        tc::zero(y);
        tc::warp_gemm<T, 8, false, false>(y, s.dO, s.ldv, 16 * rb, cur, s.ldv, cc, nt, 0, dv);
        const float f0 = tc::fexp(bi0 + gap), f1 = tc::fexp(bi1 + gap);
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
      tc::warp_gemm<T, 8, false, false>(acc, s.dO, s.ldv, 16 * rb, s.Hp, s.ldv, cc, nt, 0, dv);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j][0] *= e0, acc[j][1] *= e0, acc[j][2] *= e1, acc[j][3] *= e1;
    }
    tc::warp_gemm<T, 8, false, true>(acc, s.dA, kLdTile, 16 * rb, s.K, s.ldk, cc, nt, 0, 16 * rb + 16);
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
  // (sequence, head); ll_final_bwd_kernel): its levels <= p of the final state
  const bool fin_rows = kTree && ta.fin_dk && nr < kChunk;
  auto add_fin = [&](float(&acc)[8][4], const float* fin, int d, int c0, int nt) {
    const float* base = fin + (int64_t(seq) * a.H + h) * kChunk * d;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = hf ? i1 : i0;
          if (i < nr) {
            const float2 x = *reinterpret_cast<const float2*>(base + int64_t(i) * d + c0 + 8 * j + 2 * t);
            acc[j][2 * hf] += x.x, acc[j][2 * hf + 1] += x.y;
          }
        }
  };
  if constexpr (!kTree) {  // dH landed
    tc::cp_async_wait<0>();
    __syncthreads();
  }
  const bool fold = !kTree && a.value_is_key && dk == dv;  // the value is the key: dk gains dv
  for (int cc = ck0; cc < ck0 + nkt * 8; cc += 64) {  // dK
    const int nt = min(8, (ck0 + nkt * 8 - cc) / 8);
    float acc[8][4], acc2[8][4];
    tc::zero(acc), tc::zero(acc2);
    tc::warp_gemm<T, 8, false, false>(acc, s.V, s.ldv, 16 * rb, s.dH, s.ldv, cc, nt, 0, dv);
    tc::warp_gemm<T, 8, true, true>(acc2, s.dA, kLdTile, 16 * rb, s.Q, s.ldk, cc, nt, 16 * rb, kChunk);
    combine(acc, acc2, sc);
    if (fin_rows) add_fin(acc, ta.fin_dk, dk, cc, nt);
    float d0 = 0.f, d1 = 0.f;
    dot_rows(acc, s.K, s.ldk, cc, nt, d0, d1);  // dc reads the key-role gradient alone
    dcp0 -= d0, dcp1 -= d1;
    if (fold) {  // the value is the key: dK + dV, dV = diag(w) K dH + P^T dO, on the same columns
      tc::zero(acc2);
      tc::warp_gemm<T, 8, false, true>(acc2, s.K, s.ldk, 16 * rb, s.dH, s.ldv, cc, nt, 0, dk);
      tc::warp_gemm<T, 8, true, true>(acc, s.P, kLdTile, 16 * rb, s.dO, s.ldv, cc, nt, 16 * rb, kChunk);
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
    tc::zero(acc), tc::zero(acc2);
    tc::warp_gemm<T, 8, false, true>(acc, s.K, s.ldk, 16 * rb, s.dH, s.ldv, cc, nt, 0, dk);
    tc::warp_gemm<T, 8, true, true>(acc2, s.P, kLdTile, 16 * rb, s.dO, s.ldv, cc, nt, 16 * rb, kChunk);
    combine(acc, acc2, 1.f);
    if (fin_rows) add_fin(acc, ta.fin_dv, dv, cc, nt);
    store(a.dv_, dv, a.dv_out, acc, cc, nt);
  }
  // dc: reduce over the 4 lanes of a row, then over the two column halves
  dcp0 += __shfl_xor_sync(0xffffffffu, dcp0, 1), dcp0 += __shfl_xor_sync(0xffffffffu, dcp0, 2);
  dcp1 += __shfl_xor_sync(0xffffffffu, dcp1, 1), dcp1 += __shfl_xor_sync(0xffffffffu, dcp1, 2);
  if (t == 0) s.dc[ch * kChunk + i0] = dcp0, s.dc[ch * kChunk + i1] = dcp1;
  __syncthreads();
  if (threadIdx.x < nr) a.dg[rowbase + threadIdx.x] = s.dc[threadIdx.x] + s.dc[kChunk + threadIdx.x];
}

size_t bwd_smem(int dk, int dv, size_t esize, bool tree = false) {
  size_t bytes = 0;
  if (esize == 2) BwdTiles<__nv_bfloat16>(nullptr, dk, dv, tree, &bytes);
  return bytes;
}

size_t output_smem(int dk, int dv, size_t esize) {
  const size_t vt = size_t(std::min(kOutV, dv));
  return (size_t(2) * kChunk * (dk + 8) + (size_t(kChunk) + dk) * (vt + 8) + size_t(kChunk) * kLdTile) * esize +
         kChunk * sizeof(float);
}

}  // namespace

template <class T>
void gla_chunk_cumsum(const GlaArgs<T>& a, Acc<T>* b, cudaStream_t stream) {
  if (!a.g || a.nchunks == 0 || a.H == 0) return;
  if (!dry_run()) {  // dry run: workspace_size
    cumsum_kernel<T><<<dim3(unsigned(a.nchunks), a.H), 32, 0, stream>>>(a, b);
    HILA_CUDA_CHECK_LAUNCH();
  }
}

template <class T>
void tc_sweep(const GlaArgs<T>& a, bool reverse, cudaStream_t stream) {
  if (tc_sweep_sm90(a, reverse, stream)) return;
  const int sms = sm_count();
  const int64_t ktiles = (a.dk + kTile - 1) / kTile;
  // few (sequence x head) pairs: halve the value tile so that at least ~one block per SM sweeps
  const int vtile = int64_t(a.N) * a.H * ktiles * ((a.dv + kTile - 1) / kTile) < sms && a.dv % 32 == 0 ? 32 : kTile;
  const dim3 grid(unsigned(a.N * a.H), unsigned(ktiles), unsigned((a.dv + vtile - 1) / vtile));
  const size_t bytes = kStages * SweepStage::kBytes;
  auto launch = [&](auto kernel) {
    set_smem(kernel, bytes);
    if (!dry_run()) {  // dry run: workspace_size
      kernel<<<grid, kThreads, bytes, stream>>>(a, vtile, TreeArgs{}, nullptr, 0);
      HILA_CUDA_CHECK_LAUNCH();
    }
  };
  if (reverse) launch(sweep_kernel<T, true>);
  else launch(sweep_kernel<T, false>);
}

template <class T>
int64_t tc_sweep_blocks(const GlaArgs<T>& a) {
  return int64_t(a.N) * a.H * ((a.dk + kTile - 1) / kTile) * ((a.dv + kTile - 1) / kTile);
}

template <class T>
size_t tc_tree_sweep_stack(const GlaArgs<T>& a, int lstk) {
  return size_t(tc_sweep_blocks(a)) * lstk * 8 * kThreads * 4;  // floats
}

template <class T>
void tc_tree_sweep(const GlaArgs<T>& a, const TreeArgs& ta, float* stack, int lstk, cudaStream_t stream) {
  if (tc_tree_sweep_sm90(a, ta, stack, lstk, stream)) return;
  const dim3 grid(unsigned(a.N * a.H), unsigned((a.dk + kTile - 1) / kTile), unsigned((a.dv + kTile - 1) / kTile));
  const size_t bytes = kStages * SweepStage::kBytes;
  set_smem(sweep_kernel<T, false, true>, bytes);
  if (dry_run()) return;  // dry run: workspace_size
  sweep_kernel<T, false, true><<<grid, kThreads, bytes, stream>>>(a, kTile, ta, stack, lstk);
  HILA_CUDA_CHECK_LAUNCH();
}

template <class T>
bool tc_fused_forward_wanted(const GlaArgs<T>& a) {
  // 175 KB of shared memory at dk = 128: past the opt-in of sm_80 (163 KB) and of consumer parts
  if (!a.o || a.dk > 128 || a.dv % kFusedV != 0 || fused_smem(a.dk) > smem_optin()) return false;
  if (const char* env = std::getenv("HILA_GLA_FUSED")) return std::strcmp(env, "0") != 0;  // 0 / 1: force (tests)
  // one block per (sequence x head, value tile) walks all of its chunks: fused while the blocks
  // fill about the GPU (H200, H = 16, dv = 128: 0.82x the split form's time at 128 blocks on 132
  // SMs, 1.45x at 64), the sweep + chunk-parallel output kernel otherwise (few long sequences)
  return 4 * int64_t(a.N) * a.H * (a.dv / kFusedV) >= 3 * int64_t(sm_count());
}

template <class T>
void tc_fused_forward(const GlaArgs<T>& a, cudaStream_t stream) {
  if (tc_fused_forward_sm90(a, stream)) return;
  const size_t bytes = fused_smem(a.dk);
  set_smem(fused_forward_kernel<T>, bytes);
  if (dry_run()) return;  // dry run: workspace_size
  fused_forward_kernel<T><<<dim3(unsigned(a.N * a.H), unsigned(a.dv / kFusedV)), kFusedThreads, bytes, stream>>>(a);
  HILA_CUDA_CHECK_LAUNCH();
}

template <class T>
void tc_output(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree) {
  if (a.nchunks == 0) return;
  const size_t bytes = output_smem(a.dk, a.dv, sizeof(T));
  auto launch = [&](auto kernel) {
    set_smem(kernel, bytes);
    if (!dry_run()) {  // dry run: workspace_size
      kernel<<<dim3(unsigned(a.nchunks), (a.dv + kOutV - 1) / kOutV, a.H), kOutThreads, bytes, stream>>>(
          a, tree ? *tree : TreeArgs{});
      HILA_CUDA_CHECK_LAUNCH();
    }
  };
  if (tree) launch(output_kernel<T, true>);
  else launch(output_kernel<T, false>);
}

size_t tc_output_smem(int dk, int dv, size_t esize) { return output_smem(dk, dv, esize); }
size_t tc_bwd_smem(int dk, int dv, bool tree) { return bwd_smem(dk, dv, 2, tree); }

template <class T>
void tc_bwd_chunk(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree) {
  if (a.nchunks == 0) return;
  if (!tree && tc_bwd_chunk_sm90(a, stream)) return;
  const size_t bytes = bwd_smem(a.dk, a.dv, sizeof(T), tree != nullptr);
  auto launch = [&](auto kernel) {
    set_smem(kernel, bytes);
    if (!dry_run()) {  // dry run: workspace_size
      kernel<<<dim3(unsigned(a.nchunks), a.H), kBwdThreads, bytes, stream>>>(a, tree ? *tree : TreeArgs{});
      HILA_CUDA_CHECK_LAUNCH();
    }
  };
  if (tree) launch(bwd_chunk_kernel<T, true>);
  else launch(bwd_chunk_kernel<T, false>);
}

template void gla_chunk_cumsum<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, float*, cudaStream_t);
template void gla_chunk_cumsum<__half>(const GlaArgs<__half>&, float*, cudaStream_t);
template void gla_chunk_cumsum<float>(const GlaArgs<float>&, float*, cudaStream_t);
template void gla_chunk_cumsum<double>(const GlaArgs<double>&, double*, cudaStream_t);
#define HILA_INSTANTIATE(T)                                                         \
  template void tc_sweep<T>(const GlaArgs<T>&, bool, cudaStream_t);                 \
  template void tc_tree_sweep<T>(const GlaArgs<T>&, const TreeArgs&, float*, int, cudaStream_t); \
  template int64_t tc_sweep_blocks<T>(const GlaArgs<T>&);                          \
  template size_t tc_tree_sweep_stack<T>(const GlaArgs<T>&, int);                  \
  template void tc_output<T>(const GlaArgs<T>&, cudaStream_t, const TreeArgs*); \
  template bool tc_fused_forward_wanted<T>(const GlaArgs<T>&);                     \
  template void tc_fused_forward<T>(const GlaArgs<T>&, cudaStream_t);              \
  template void tc_bwd_chunk<T>(const GlaArgs<T>&, cudaStream_t, const TreeArgs*);
HILA_INSTANTIATE(__nv_bfloat16)
HILA_INSTANTIATE(__half)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
