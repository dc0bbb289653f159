// SPDX-License-Identifier: Apache-2.0
// Block-level sums of the decode step (kWarps warps of 32 lanes; args.cuh) and its fp32 / fp64 math.
#pragma once
#include "cuda/step/args.cuh"

namespace hila::cuda::decode {

template <class R>
__device__ __forceinline__ R rexp(R x) {
  if constexpr (std::is_same_v<R, double>) return ::exp(x);
  else return ::expf(x);
}
template <class R>
__device__ __forceinline__ R rsqrt_eps(R s, R eps) {
  if constexpr (std::is_same_v<R, double>) return 1.0 / ::sqrt(s + eps);
  else return 1.0f / ::sqrtf(s + eps);
}

// warp_sum: cuda/prims/tile.cuh (through args.cuh).

// Sum over the block; every thread gets the result. `red` is [kWarps] shared.
template <class R>
__device__ R block_sum(R x, R* red) {
  x = warp_sum(x);
  __syncthreads();  // earlier readers of red are done
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  R s = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[w];
  return s;
}

// Column sums over the kWarps row groups: each lane holds partials of its kVec columns
// (kVec lane + i of the tile); every warp gets the sums back in x. `colred` is [kWarps, kCols].
template <class R>
__device__ void column_sum(R (&x)[kVec], R* colred) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kVec; ++i) colred[warp * kCols + kVec * lane + i] = x[i];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    R s = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += colred[w * kCols + kVec * lane + i];
    x[i] = s;
  }
}

}  // namespace hila::cuda::decode
