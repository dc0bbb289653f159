// SPDX-License-Identifier: Apache-2.0
// Shared CUDA pieces: error checking, compute types, and the shared-memory tile GEMM that every
// kernel is written in (tensor cores through WMMA for bf16/fp16 operands with fp32 accumulation;
// plain FMA for fp32/fp64 operands, which exist for exactness checks).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace hila::cuda {

[[noreturn]] void fail(cudaError_t e, const char* expr, const char* file, int line);

#define HILA_CUDA_CHECK(expr)                                                   \
  do {                                                                          \
    cudaError_t hila_e_ = (expr);                                               \
    if (hila_e_ != cudaSuccess) ::hila::cuda::fail(hila_e_, #expr, __FILE__, __LINE__); \
  } while (0)
#define HILA_CUDA_CHECK_LAUNCH() HILA_CUDA_CHECK(cudaGetLastError())

// Instantiates M(T) for every operand dtype the backend computes in.
#define HILA_FOR_EACH_DTYPE(M) M(__nv_bfloat16) M(__half) M(float) M(double)

// Accumulator / state type: fp64 for fp64 operands, fp32 otherwise (states never in bf16).
template <class T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
constexpr bool kTensorCore = std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

template <class T>
__device__ __forceinline__ T to(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(x);
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(x);
  else return static_cast<T>(x);
}
template <class T>
__device__ __forceinline__ T to(double x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(static_cast<float>(x));
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(static_cast<float>(x));
  else return static_cast<T>(x);
}
template <class A, class T>
__device__ __forceinline__ A from(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return static_cast<A>(__bfloat162float(x));
  else if constexpr (std::is_same_v<T, __half>) return static_cast<A>(__half2float(x));
  else return static_cast<A>(x);
}

// Padded leading dimensions: 16-byte row pad keeps WMMA's alignment rules and breaks bank conflicts.
template <class T>
__host__ __device__ constexpr int ld_of(int cols) {
  return cols + (kTensorCore<T> ? 8 : (std::is_same_v<T, double> ? 2 : 4));
}

// C [M, N] (Acc, ldc) = (acc ? C : 0) + op(A) op(B), all in shared memory.
//   A: [M, K] (lda) or, with TA, stored [K, M] and used transposed.
//   B: [K, N] (ldb) or, with TB, stored [N, K] and used transposed.
// 16-bit T (WMMA): M, N, K multiples of 16. fp32 / fp64: any sizes; with 256 threads, 64 x 64 tiles
// of C, 4 x 4 outputs per thread (rows ty + 16 r, columns tx + 16 c: a warp reads 16 consecutive
// columns of B and broadcasts A), 8 shared loads per 16 FMAs; other block sizes one output per
// thread. Both sum k in increasing order from C (or 0), one FMA per term, so they round alike.
// Every thread of the block must call it; ends with a barrier.
template <class T, bool TA, bool TB>
__device__ void smem_gemm(Acc<T>* C, int ldc, const T* A, int lda, const T* B, int ldb, int M,
                          int N, int K, bool acc) {
  using namespace nvcuda;
  if constexpr (kTensorCore<T>) {
    using LA = std::conditional_t<TA, wmma::col_major, wmma::row_major>;
    using LB = std::conditional_t<TB, wmma::col_major, wmma::row_major>;
    const int warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    const int mt = M / 16, nt = N / 16;
    for (int t = warp; t < mt * nt; t += nwarps) {
      const int i = (t / nt) * 16, j = (t % nt) * 16;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      if (acc) wmma::load_matrix_sync(c, C + i * ldc + j, ldc, wmma::mem_row_major);
      else wmma::fill_fragment(c, 0.0f);
      for (int k = 0; k < K; k += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LA> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LB> b;
        wmma::load_matrix_sync(a, TA ? A + k * lda + i : A + i * lda + k, lda);
        wmma::load_matrix_sync(b, TB ? B + j * ldb + k : B + k * ldb + j, ldb);
        wmma::mma_sync(c, a, b, c);
      }
      wmma::store_matrix_sync(C + i * ldc + j, c, ldc, wmma::mem_row_major);
    }
  } else if (blockDim.x == 256) {
    using R = Acc<T>;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    for (int i0 = 0; i0 < M; i0 += 64)
      for (int j0 = 0; j0 < N; j0 += 64) {
        int ri[4], cj[4];  // this thread's rows and columns, clamped into C (the extra ones are not stored)
#pragma unroll
        for (int r = 0; r < 4; ++r) ri[r] = min(i0 + ty + 16 * r, M - 1);
#pragma unroll
        for (int c = 0; c < 4; ++c) cj[c] = min(j0 + tx + 16 * c, N - 1);
        R s[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c)  // (C's rows and columns past M, N are another thread's: not read)
            s[r][c] = acc && i0 + ty + 16 * r < M && j0 + tx + 16 * c < N ? C[ri[r] * ldc + cj[c]] : R(0);
        for (int k = 0; k < K; ++k) {
          R x[4], y[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) x[r] = TA ? A[k * lda + ri[r]] : A[ri[r] * lda + k];
#pragma unroll
          for (int c = 0; c < 4; ++c) y[c] = TB ? B[cj[c] * ldb + k] : B[k * ldb + cj[c]];
#pragma unroll
          for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[r][c] += x[r] * y[c];
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            if (i0 + ty + 16 * r < M && j0 + tx + 16 * c < N) C[ri[r] * ldc + cj[c]] = s[r][c];
      }
  } else {
    using R = Acc<T>;
    for (int e = threadIdx.x; e < M * N; e += blockDim.x) {
      const int i = e / N, j = e % N;
      R s = acc ? C[i * ldc + j] : R(0);
      for (int k = 0; k < K; ++k) {
        const R a = TA ? A[k * lda + i] : A[i * lda + k];
        const R b = TB ? B[j * ldb + k] : B[k * ldb + j];
        s += a * b;
      }
      C[i * ldc + j] = s;
    }
  }
  __syncthreads();
}

}  // namespace hila::cuda
