// SPDX-License-Identifier: Apache-2.0
// GLA state sweep, sm80 tier (bf16 / fp16 on mma.sync; docs/math/HLA.md §1, §7.1): one block per (sequence
// x head, dk tile, dv tile) walks the chunks in order with its [64, 64] fp32 state tile in mma
// accumulators (registers), prefetching the next chunks' operands with cp.async.
//   Forward: stores the state entering each chunk (as a 16-bit GEMM operand, hbuf) and updates
//            H <- e^B H + (K o w)^T V,  w_i = e^{B - b_i}.
//   Reverse (backward): stores the cotangent at each chunk end (dhbuf) and updates
//            dH <- e^B dH + (Q o w)^T dO,  w_i = scale e^{b_i}.
//   Tree (log-linear): builds the tree's nodes instead (loglinear/tree.cuh).
// b is the chunk-local inclusive cumsum of the log-gates (gates.cu), precomputed once per call.
#include "cuda/dispatch/heuristics.h"
#include "cuda/dispatch/static_switch.h"
#include "cuda/gla/sm80.cuh"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

namespace {

using namespace gla_sm80;

constexpr int kThreads = 128;          // 4 warps; warp w owns rows [16w, 16w+16) of its tile

// The sequential sweep; kRev selects the backward cotangent sweep (see the file comment).
// kTree: the log-linear tree (loglinear/tree.cuh) instead of a carried state: per chunk c the register
// tile is Z_c = K^T diag(e^{B-b}) V; while its node index i (from c, level m = 1) is odd it closes
// its parent, acc <- e^{beta_m[i]} stk[m] + acc (i >>= 1, m += 1); a node with even i is one the
// chunks read (16-bit copy to ta.node16) and waits on stk[m] for its sibling. stk holds the
// thread's own accumulator elements per level in fp32 (`stack`, lstk levels per block), so it
// needs no barriers. Only full chunks enter the tree (a partial last chunk is read by no chunk);
// with ta.pend the pending nodes at the end go there (the final state's levels above the chunk).
// With ta.seg > 0 one block per segment of 2^seg chunks (grid x: segment major, then sequence x
// head), whose climb stops at the segment's root (tree_close).
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
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const int sh = int(blockIdx.x % unsigned(a.N * a.H)), seq = sh / a.H, h = sh % a.H;
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
      const int r = fr.row_of(k0 + 16 * w, e), col = fr.col_of(v0, j, e);
      acc[j][e] = (init && active && j < nt) ? float(init[sidx + int64_t(r) * a.dv + col]) : 0.f;
    }
  const SweepChunks span = sweep_chunks<kTree>(ta, len, a.C, blockIdx.x / unsigned(a.N * a.H));
  if (span.skip) return;
  const int nch = span.nch;
  const int64_t cbeg = span.cbeg;
  [[maybe_unused]] const int64_t nfull = span.nfull;  // kTree
  auto chunk_of = [&](int i) { return kRev ? nch - 1 - i : int(cbeg) + i; };
  const mma::TileStream<T, kThreads, kChunk> key_rows(key, key_ld, k0, bk, kLdTile), val_rows(val, val_ld, v0, bv, kLdTile);
  // chunk i -> stage i % kStages: K / V tiles and the gates (rows >= nr zero-filled)
  auto issue = [&](int i) {
    const int c = chunk_of(i), st = i % kStages;
    const int64_t r0 = row0 + int64_t(c) * a.C;
    const int nr = rows_in(len, c, a.C);
    key_rows.issue(Ks(st), r0, nr, kLdTile);
    val_rows.issue(Vs(st), r0, nr, kLdTile);
    mma::async_gates<kChunk>(bs(st), b, r0, nr, key);
    mma::cp_async_commit();
  };
  pipeline_prologue<kStages>(nch, issue);
  // acc += Kt^T diag(wt) Vt  [64 (dk), C] x [C, vtile]; full tiles (all of dk's 64 rows, 64 or 32
  // columns) pass a literal column count, so that the fragment loads carry no guards
  const bool full = bk == kTile && nt == 8, half = bk == kTile && nt == 4;
  auto update = [&](float(&x)[8][4], const T* Kt, const T* Vt, auto wt) {
    if (full) mma::warp_gemm_tn_weighted<T, 8>(x, Kt, kLdTile, 16 * w, Vt, kLdTile, 8, kChunk, wt);
    else if (half) mma::warp_gemm_tn_weighted<T, 8>(x, Kt, kLdTile, 16 * w, Vt, kLdTile, 4, kChunk, wt);
    else if (active) mma::warp_gemm_tn_weighted<T, 8>(x, Kt, kLdTile, 16 * w, Vt, kLdTile, nt, kChunk, wt);
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
      *reinterpret_cast<uint32_t*>(dst + 8 * j) = mma::pack2<T>(acc[j][0], acc[j][1]);
      *reinterpret_cast<uint32_t*>(dst + 8 * a.dv + 8 * j) = mma::pack2<T>(acc[j][2], acc[j][3]);
    }
  };
  [[maybe_unused]] SeqNodes sn;  // kTree: node layout, chunks a0 + i
  // this thread's tile elements in loglinear/tree.cuh's layout (rows r_lo (+8), columns c_lo + 8j (+1))
  auto at = [&](int j, int e) -> float& { return acc[j][e]; };
  const int r_lo = k0 + 16 * w + g, c_lo = v0 + 2 * t;
  const TreeStack<kThreads> stk(stack, lstk);  // kTree only (lstk = 0 otherwise)
  if constexpr (kTree) {
    sn = seq_nodes(ta, a.chunk0, seq, (len + a.C - 1) / a.C);
    if (sn.nc > 0) tree_seed<T>(ta, sn, stk, lstk, seq, h, a.H, a.dk, a.dv, r_lo, c_lo, active, nt, at);
  }
  float* const root = kTree && ta.seg > 0 ? ta.roots + root_row(chunk0, seq, ta.seg, h, a.H, int64_t(a.dk) * a.dv)
                                          : nullptr;
  for (int i = 0; i < nch; ++i) {
    // chunk i has landed; the barrier also retires iteration i-1's reads of the stage refilled next
    mma::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (i + kStages - 1 < nch) issue(i + kStages - 1);
    else mma::cp_async_commit();
    const int c = chunk_of(i), st = i % kStages;
    const T* Kt = Ks(st);
    const T* Vt = Vs(st);
    const float* bt = bs(st);
    if constexpr (kTree) {  // Z_c, then the nodes it closes
      const float B = bt[rows_in(len, c, a.C) - 1];
      mma::zero(acc);
      update(acc, Kt, Vt, [&](int k) { return mma::fexp(B - bt[k]); });
      tree_close<T>(ta, sn, stk, c, h, a.H, a.dk, a.dv, r_lo, c_lo, active, nt, at, root);
      continue;
    }
    if (store && active) {  // state entering chunk c (forward) / cotangent at its end (reverse)
      if (full) store_full(store_base + c * store_cstride);
      else mma::store_tile16(store + ((chunk0 + c) * a.H + h) * int64_t(a.dk) * a.dv, a.dv, r_lo, c_lo, nt, at);
    }
    const float B = bt[rows_in(len, c, a.C) - 1];
    const float decay = mma::fexp(B);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] *= decay;
    auto wt = [&](int k) { return kRev ? sc * mma::fexp(bt[k]) : mma::fexp(B - bt[k]); };
    // forward S <- e^B S + K^T diag(e^{B-b}) V; reverse dS <- e^B dS + scale Q^T diag(e^b) dO (§7.1)
    update(acc, Kt, Vt, wt);
  }
  if constexpr (kTree) {
    if (ta.pend && active && (ta.seg == 0 || cbeg == (nfull >> ta.seg) << ta.seg))  // in segments: see sweep_sm90.cu
      tree_pending(ta, sn, stk, lstk, nfull, seq, h, a.H, a.dk, a.dv, r_lo, c_lo, nt);
  }
  if (!kTree && fin && active) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = fr.row_of(k0 + 16 * w, e), col = fr.col_of(v0, j, e);
          fin[sidx + int64_t(r) * a.dv + col] = R(acc[j][e]);
        }
  }
}

}  // namespace

template <class T>
void gla_sweep_sm80(const GlaArgs<T>& a, bool reverse, cudaStream_t stream) {
  const int64_t ktiles = (a.dk + kTile - 1) / kTile;
  const int vtile = heuristics::gla_sm80_sweep_vtile(int64_t(a.N) * a.H, a.dk, a.dv, sm_count());
  const dim3 grid(unsigned(a.N * a.H), unsigned(ktiles), unsigned((a.dv + vtile - 1) / vtile));
  const size_t bytes = kStages * SweepStage::kBytes;
  HILA_BOOL_SWITCH(reverse, kRev, [&] {
    auto kernel = sweep_kernel<T, kRev>;
    set_smem(kernel, bytes);
    if (dry_run()) return;  // dry run: workspace_size
    kernel<<<grid, kThreads, bytes, stream>>>(a, vtile, TreeArgs{}, nullptr, 0);
    HILA_CUDA_CHECK_LAUNCH();
  });
}

template <class T>
int64_t gla_sweep_blocks(const GlaArgs<T>& a) {
  return int64_t(a.N) * a.H * ((a.dk + kTile - 1) / kTile) * ((a.dv + kTile - 1) / kTile);
}

template <class T>
size_t gla_tree_sweep_stack(const GlaArgs<T>& a, int lstk, unsigned nseg) {
  return size_t(gla_sweep_blocks(a)) * nseg * lstk * 8 * kThreads * 4;  // floats
}

template <class T>
void gla_tree_sweep_sm80(const GlaArgs<T>& a, const TreeArgs& ta, float* stack, int lstk, unsigned nseg,
                         cudaStream_t stream) {
  const dim3 grid(unsigned(a.N * a.H) * nseg, unsigned((a.dk + kTile - 1) / kTile), unsigned((a.dv + kTile - 1) / kTile));
  const size_t bytes = kStages * SweepStage::kBytes;
  set_smem(sweep_kernel<T, false, true>, bytes);
  if (dry_run()) return;  // dry run: workspace_size
  sweep_kernel<T, false, true><<<grid, kThreads, bytes, stream>>>(a, kTile, ta, stack, lstk);
  HILA_CUDA_CHECK_LAUNCH();
}

#define HILA_INSTANTIATE(T)                                                                           \
  template void gla_sweep_sm80<T>(const GlaArgs<T>&, bool, cudaStream_t);                             \
  template int64_t gla_sweep_blocks<T>(const GlaArgs<T>&);                                            \
  template size_t gla_tree_sweep_stack<T>(const GlaArgs<T>&, int, unsigned);                          \
  template void gla_tree_sweep_sm80<T>(const GlaArgs<T>&, const TreeArgs&, float*, int, unsigned, cudaStream_t);
HILA_INSTANTIATE(__nv_bfloat16)
HILA_INSTANTIATE(__half)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
