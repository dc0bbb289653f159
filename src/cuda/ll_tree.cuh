// SPDX-License-Identifier: Apache-2.0
// Chunk-parallel tree form of log-linear Mamba-2 (LOGLINEAR_SPEC §3.3 "tree", §5.3), the
// tensor-core path for calls whose sequences start at chunk-aligned positions n0 = a0 C (a
// backward too). With C = 2^p and chunks numbered by absolute position,
// chunk N reads, for every set bit m-1 of N, the tree node
//   node_m[j],  j = (N >> (m-1)) - 1:  the tokens of chunks [j 2^{m-1}, (j+1) 2^{m-1}) decayed to
//   the end of that block, at level p + m, with the decay of the chunks in between as
//   gap_m(N) = sum_{m' < m, bit m'-1 of N} beta_{m'}[(N >> (m'-1)) - 1]   (sums of chunk totals).
// Nodes: node_1[j] = Z_j = K_j^T diag(e^{B_j - b}) V_j;  node_{m+1}[j] = e^{beta_m[2j+1]} node_m[2j] + node_m[2j+1];
//        beta_1[j] = B_j (chunk total log-gate),  beta_{m+1}[j] = beta_m[2j] + beta_m[2j+1].
// Initial state H0 at n0 = a0 C (canonical, decayed to n0 - 1; §2.5): the chunks before a0 are
// empty (Z = 0, beta = 0) except that the pure-prefix node node_m[(a0 >> (m-1)) - 1] is H0[p + m]
// for every set bit m-1 of a0 (the bucket B_{p+m}(n0), §2.2); the up pass starts from these as its
// pending left children, so a node that straddles n0 is e^{beta of its new chunks} H0[..] + its new
// part, which is the re-key of §2.4 done by the tree.
// Forward: O_N = (Lam o Gamma_c o Q^K^T) V + sum_m diag(lam^{p+m} e^{b + gap_m}) Q^ node_m[j_m].
// Backward: dnode_m[j] = sum over the reading chunks N of Q^_N^T diag(lam^{p+m} e^{b + gap_m(N)}) dO_N
//   (one long-K GEMM per node), pushed down the tree (dnode_m[2j] += e^{beta_m[2j+1]} dnode_{m+1}[j],
//   dnode_m[2j+1] += dnode_{m+1}[j]); then dZ_N = dnode_1[N] plays the part of the GLA chunk-end
//   cotangent, and per chunk  dQ^ = dA K + sum_m diag(lam^{p+m} e^{b+gap}) dO node_m^T,
//   dlam[i, p+m] = e^{b_i+gap} q^_i.(dO node_m^T)_i, dlam[i, LUT] from the intra block, dc = q^.dq^ - k.dk
//   (the initial levels' reads enter q^.dq^ like any other, so dg needs no extra term), and
//   dH0[p+m] = dnode_m[(a0 >> (m-1)) - 1] after the push-down (the initial nodes, §2.4 re-key adjoint).
//   A final-state cotangent dHT (final state as in ll_final_kernel) adds e^{gap_m + B_r} dHT[p+m] to
//   the pending node of level m before the push-down, w_s dHT[l_s] v_s and w_s dHT[l_s]^T k_s to dk,
//   dv of the last partial chunk's rows (level l_s, w_s = e^{B_r - b_s}), and <dHT, HT> to dg at the
//   last row (the GLA identity dg = revcumsum(q.dq - k.dk) + <dHT, HT>).
//   The parts of long reading ranges (ll_wkv_kernel kPart) need a0 = 0.
// All nodes, their cotangents and beta are fp32.
//
// Layout (SeqNodes): level m of a sequence holds the nodes j in [lo_m, hi_m), lo_m = max(0,
// (a0 >> (m-1)) - 1), hi_m = (a0 + Nc) >> (m-1) (Nc chunks, the last maybe partial), at slots
// base + off_m + j - lo_m of a [slots][H][dk][dv] buffer. With a0 = 0 for every sequence base =
// 2 chunk0 and the sequence takes [2 chunk0, 2 chunk0 + 2 Nc); otherwise base comes from a per-call
// table (TreeArgs::nbase) and a sequence takes at most 2 Nc + 2 bitlen(a0 + Nc) slots.
#pragma once
#include "cuda/mma.cuh"
#include "cuda/tile.cuh"

namespace hila::cuda {

constexpr int kLogChunk = 6;  // p = log2(kChunk): in-chunk levels 0..p (§2.6)
static_assert((1 << kLogChunk) == kChunk, "kLogChunk must match kChunk");

__host__ __device__ __forceinline__ int bitlen64u(uint64_t x) {
#ifdef __CUDA_ARCH__
  return x ? 64 - __clzll(int64_t(x)) : 0;
#else
  return x ? 64 - __builtin_clzll(x) : 0;
#endif
}

__host__ __device__ __forceinline__ int ctz64u(uint64_t x) {  // x > 0
#ifdef __CUDA_ARCH__
  return __ffsll(int64_t(x)) - 1;
#else
  return __builtin_ctzll(x);
#endif
}

// Node layout of one sequence (above): chunks a0 .. a0 + nc - 1, slots from base.
struct SeqNodes {
  int64_t base = 0, a0 = 0, nc = 0;
  __host__ __device__ int64_t lo(int m) const {
    const int64_t x = (a0 >> (m - 1)) - 1;
    return x > 0 ? x : 0;
  }
  __host__ __device__ int64_t hi(int m) const { return (a0 + nc) >> (m - 1); }
  __host__ __device__ int64_t count(int m) const {
    const int64_t x = hi(m) - lo(m);
    return x > 0 ? x : 0;
  }
  __host__ __device__ int top() const { return bitlen64u(uint64_t(a0 + nc)); }  // levels 1..top may hold nodes
  __host__ __device__ int64_t off(int m) const {  // slots of levels 1 .. m-1
    int64_t o = 0;
    for (int x = 1; x < m; ++x) o += count(x);
    return o;
  }
  __host__ __device__ int64_t total() const { return off(top() + 1); }
  __host__ __device__ int64_t slot(int m, int64_t j) const { return base + off(m) + j - lo(m); }
};

// Tree operands of the chunk kernels (unused by plain GLA).
struct TreeArgs {
  const float* lam = nullptr;  // [H][Ttot][nL]
  float* dlam = nullptr;       // [H][Ttot][nL] (backward)
  int nL = 1;
  const void* node16 = nullptr;  // [slots][H][dk][dv] 16-bit GEMM-operand copies of the nodes
  const void* dz16 = nullptr;    // [nchunks][H][dk][dv] 16-bit dZ = dnode_1 after the push-down (backward)
  const float* beta = nullptr;   // [slots][H]
  // sequences from chunk-aligned n0 > 0: a0 = n0 / C and the node bases per
  // sequence (device, [N]); nullptr: a0 = 0 and base = 2 chunk0. h0: the initial Fenwick state
  // [N][H][Ls][dk][dv] fp32 (nullptr: none)
  const int64_t* a0 = nullptr;
  const int64_t* nbase = nullptr;
  const int* slot_seq = nullptr;  // [slots]: the sequence of each node slot (nullptr: chunk_seq[slot / 2])
  const float* h0 = nullptr;
  float* dh0 = nullptr;           // backward: the initial state's adjoint, same layout (nullptr: not wanted)
  int Ls = 0;  // Fenwick slots of h0, dh0 and dht (LlArgs::Ls)
  // forward with a final state: the nodes pending after the full chunks of each sequence (the
  // set bits m-1 of a0 + len / C), fp32 [N][H][lpend][dk][dv] at level m, written by the tree build
  float* pend = nullptr;
  int lpend = 0;
  // backward with a final-state cotangent dht (Fenwick [N][H][Ls][dk][dv] fp32): the pending node
  // at level m gains fcoef[seq][h][m] dht[p + m] in the push-down ([N][H][lpend]); the last partial
  // chunk's rows gain fin_dk [N][H][C][dk], fin_dv [N][H][C][dv] in dk, dv (ll_final_bwd_kernel)
  const float* dht = nullptr;
  const float *fcoef = nullptr, *fin_dk = nullptr, *fin_dv = nullptr;
};

__device__ __forceinline__ SeqNodes seq_nodes(const TreeArgs& ta, const int64_t* chunk0, int seq, int64_t nc) {
  SeqNodes sn;
  sn.a0 = ta.a0 ? ta.a0[seq] : 0;
  sn.base = ta.nbase ? ta.nbase[seq] : 2 * chunk0[seq];
  sn.nc = nc;
  return sn;
}

// Slot of the first (lowest) level read by chunk n > 0 (absolute): m = ctz(n) + 1, j = (n >> (m-1)) - 1.
__host__ __device__ __forceinline__ int64_t first_read_slot(const SeqNodes& sn, int64_t n) {
  int m = 1;
  while (!((n >> (m - 1)) & 1)) ++m;
  return sn.slot(m, (n >> (m - 1)) - 1);
}

// Calls `f(m, slot, gap)` for every level read by chunk n (absolute) of its sequence (ascending
// m), where slot is the node's global slot and gap the log-decay from the node's end to the chunk start.
template <class F>
__device__ __forceinline__ void for_each_read(const TreeArgs& ta, const SeqNodes& sn, int64_t n, int h, int H, F f) {
  float gap = 0.f;
  int64_t off = sn.base;
  for (int m = 1, top = bitlen64u(uint64_t(n)); m <= top; ++m) {
    if ((n >> (m - 1)) & 1) {
      const int64_t slot = off + (n >> (m - 1)) - 1 - sn.lo(m);
      f(m, slot, gap);
      gap += ta.beta[slot * H + h];
    }
    off += sn.count(m);
  }
}

// Columns [v0, v0+bv) of the 16-bit node copy in `slot` ([dk][dv] per (slot, head)) into smem
// [dk][ld] with cp.async (the caller commits and waits).
template <class T>
__device__ __forceinline__ void async_node(T* s, int ld, const TreeArgs& ta, int64_t slot, int h, int H, int dk, int dv,
                                           int v0, int bv) {
  tc::async_rows(s, ld, static_cast<const T*>(ta.node16) + (slot * H + h) * int64_t(dk) * dv, dv, 0, dk, v0, bv, dk);
}

}  // namespace hila::cuda
