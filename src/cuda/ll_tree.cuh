// SPDX-License-Identifier: Apache-2.0
// Chunk-parallel tree form of log-linear Mamba-2 (LOGLINEAR_SPEC §3.3 "tree", §5.3), the
// tensor-core path for calls that start every sequence at position 0 with no state in or out.
// With C = 2^p chunks, chunk N of a sequence reads, for every set bit m-1 of N, the tree node
//   node_m[j],  j = (N >> (m-1)) - 1:  the tokens of chunks [j 2^{m-1}, (j+1) 2^{m-1}) decayed to
//   the end of that block, at level p + m, with the decay of the chunks in between as
//   gap_m(N) = sum_{m' < m, bit m'-1 of N} beta_{m'}[(N >> (m'-1)) - 1]   (sums of chunk totals).
// Nodes: node_1[j] = Z_j = K_j^T diag(e^{B_j - b}) V_j;  node_{m+1}[j] = e^{beta_m[2j+1]} node_m[2j] + node_m[2j+1];
//        beta_1[j] = B_j (chunk total log-gate),  beta_{m+1}[j] = beta_m[2j] + beta_m[2j+1].
// Forward: O_N = (Lam o Gamma_c o Q^K^T) V + sum_m diag(lam^{p+m} e^{b + gap_m}) Q^ node_m[j_m].
// Backward: dnode_m[j] = sum over the reading chunks N of Q^_N^T diag(lam^{p+m} e^{b + gap_m(N)}) dO_N
//   (one long-K GEMM per node), pushed down the tree (dnode_m[2j] += e^{beta_m[2j+1]} dnode_{m+1}[j],
//   dnode_m[2j+1] += dnode_{m+1}[j]); then dZ_N = dnode_1[N] plays the part of the GLA chunk-end
//   cotangent, and per chunk  dQ^ = dA K + sum_m diag(lam^{p+m} e^{b+gap}) dO node_m^T,
//   dlam[i, p+m] = e^{b_i+gap} q^_i.(dO node_m^T)_i, dlam[i, LUT] from the intra block, dc = q^.dq^ - k.dk.
// All nodes, their cotangents and beta are fp32.
//
// Layout: the nodes of sequence s (Nc chunks) take slots [2 chunk0[s], 2 chunk0[s] + 2 Nc) of a
// [2 nchunks][H][dk][dv] buffer; level m (Nc >> (m-1) nodes) starts at node_off(Nc, m).
#pragma once
#include "cuda/mma.cuh"
#include "cuda/tile.cuh"

namespace hila::cuda {

constexpr int kLogChunk = 6;  // p = log2(kChunk): in-chunk levels 0..p (§2.6)
static_assert((1 << kLogChunk) == kChunk, "kLogChunk must match kChunk");

__host__ __device__ __forceinline__ int64_t node_off(int64_t nc, int m) {
  int64_t o = 0;
  for (int x = 1; x < m; ++x) o += nc >> (x - 1);
  return o;
}
// global node slot of node (m, j) of the sequence whose first chunk is chunk0 (of nc chunks)
__host__ __device__ __forceinline__ int64_t node_slot(int64_t chunk0, int64_t nc, int m, int64_t j) {
  return 2 * chunk0 + node_off(nc, m) + j;
}
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

// Tree operands of the chunk kernels (unused by plain GLA).
struct TreeArgs {
  const float* lam = nullptr;  // [H][Ttot][nL]
  float* dlam = nullptr;       // [H][Ttot][nL] (backward)
  int nL = 1;
  const void* node16 = nullptr;  // [2 nchunks][H][dk][dv] 16-bit GEMM-operand copies of the nodes
  const void* dz16 = nullptr;    // [nchunks][H][dk][dv] 16-bit dZ = dnode_1 after the push-down (backward)
  const float* beta = nullptr;   // [2 nchunks][H]
};

// Slot of the first (lowest) level read by chunk n > 0: m = ctz(n) + 1, j = (n >> (m-1)) - 1.
__host__ __device__ __forceinline__ int64_t first_read_slot(int64_t chunk0, int64_t nc, int64_t n) {
  int m = 1;
  while (!((n >> (m - 1)) & 1)) ++m;
  return node_slot(chunk0, nc, m, (n >> (m - 1)) - 1);
}

// Calls `f(m, slot, gap)` for every level read by chunk n of its sequence (ascending m), where
// slot is the node's global slot and gap the log-decay from the node's end to the chunk start.
template <class F>
__device__ __forceinline__ void for_each_read(const TreeArgs& ta, int64_t chunk0, int64_t nc, int64_t n, int h, int H,
                                              F f) {
  float gap = 0.f;
  int64_t off = 0;
  for (int m = 1, top = bitlen64u(uint64_t(n)); m <= top; ++m) {
    if ((n >> (m - 1)) & 1) {
      const int64_t slot = 2 * chunk0 + off + (n >> (m - 1)) - 1;
      f(m, slot, gap);
      gap += ta.beta[slot * H + h];
    }
    off += nc >> (m - 1);
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
