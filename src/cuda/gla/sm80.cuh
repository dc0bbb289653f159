// SPDX-License-Identifier: Apache-2.0
// Pieces shared by the GLA kernels of the sm80 tier (bf16 / fp16 on mma.sync, ldmatrix and
// cp.async; sm_80 and later): the tile geometry, the cp.async pipeline prologue and the causal
// score block that the output and fused-forward kernels store as the A operand of P V.
#pragma once
#include "cuda/gla/gla.cuh"
#include "cuda/loglinear/tree.cuh"
#include "cuda/prims/mma.cuh"
#include "cuda/prims/tile.cuh"

namespace hila::cuda::gla_sm80 {

constexpr int kTile = 64;              // dk and dv tile of the sweep, dv tile of the output kernel
constexpr int kLdTile = kTile + 8;     // padded smem row (16-bit elements): 144 bytes, ldmatrix conflict-free

// The first kS - 1 chunks of a kS-stage cp.async pipeline (an empty group for each missing chunk).
template <int kS, class F>
__device__ __forceinline__ void pipeline_prologue(int nch, F&& issue) {
  for (int i = 0; i < kS - 1; ++i) {
    if (i < nch) issue(i);
    else mma::cp_async_commit();
  }
}
// The causal score block P = scale Gamma o Q K^T of one warp from x = Q K^T (rows [16 rb, 16 rb + 16),
// key columns [n0, n0 + 32): x[j] columns n0 + 8j + 2t (+1), rows g / g + 8), 16-bit into Ps [C][kLdTile],
// zeros above the diagonal and in rows >= nr; bs [C] the chunk-local gate cumsum.
// kTree: times lam_i^{bitlen(i xor j)} (aligned chunks, docs/math/LOGLINEAR.md §2.6), lam rows lam0 / lam1.
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
      const float* lr = hf ? lam1 : lam0;
      const float p0 = score_elem<kTree>(x[j][2 * hf], i, col, nr, sc, bi, bs[col], lr);
      const float p1 = score_elem<kTree>(x[j][2 * hf + 1], i, col + 1, nr, sc, bi, bs[col + 1], lr);
      *reinterpret_cast<uint32_t*>(Ps + i * kLdTile + col) = mma::pack2<T>(p0, p1);
    }
}

}  // namespace hila::cuda::gla_sm80
