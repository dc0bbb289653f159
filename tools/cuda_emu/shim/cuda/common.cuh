// SPDX-License-Identifier: Apache-2.0
// Host emulation of src/cuda/common.cuh (see tools/cuda_emu/run.sh): CUDA qualifiers vanish, the
// thread and block indices are thread-locals, __syncthreads is a std::barrier over the block's 256
// std::threads, and smem_gemm always takes the FMA path (bf16/f16 operands keep their rounding).
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__
#define __align__(n)
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
namespace emu {
inline thread_local dim3 tid, bid;
inline dim3 bdim{256, 1, 1}, gdim;
inline std::barrier<>* bar = nullptr;
inline std::barrier<>* warpbar[8] = {};
inline double shbuf[8][32];
}  // namespace emu
#define threadIdx (emu::tid)
#define blockIdx (emu::bid)
#define blockDim (emu::bdim)
#define gridDim (emu::gdim)
inline void __syncthreads() { emu::bar->arrive_and_wait(); }
template <class X>
X __shfl_up_sync(unsigned, X v, int off) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  emu::shbuf[w][lane] = double(v);
  emu::warpbar[w]->arrive_and_wait();
  const X r = lane >= off ? X(emu::shbuf[w][lane - off]) : v;
  emu::warpbar[w]->arrive_and_wait();
  return r;
}
inline int __clz(int x) { return x ? __builtin_clz(unsigned(x)) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
using std::exp;
using std::max;
using std::min;

namespace hila::cuda {
template <class T> inline auto float_or(T x) { if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) return float(x); else return x; }
[[noreturn]] void fail(cudaError_t e, const char* expr, const char* file, int line);
#define HILA_CUDA_CHECK(expr) (void)(expr)
#define HILA_CUDA_CHECK_LAUNCH() (void)0
template <class T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <class T>
constexpr bool kTensorCore = false;
template <class T>
inline T to(double x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(float(x));
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(float(x));
  else return static_cast<T>(x);
}
template <class A, class T>
inline A from(T x) { return static_cast<A>(float_or(x)); }
template <class T>
constexpr int ld_of(int cols) { return cols + (sizeof(T) == 2 ? 8 : (std::is_same_v<T, double> ? 2 : 4)); }
template <class T, bool TA, bool TB>
void smem_gemm(Acc<T>* C, int ldc, const T* A, int lda, const T* B, int ldb, int M, int N, int K, bool acc) {
  using R = Acc<T>;
  for (int e = threadIdx.x; e < M * N; e += blockDim.x) {
    const int i = e / N, j = e % N;
    R s = acc ? C[i * ldc + j] : R(0);
    for (int k = 0; k < K; ++k) {
      const R a = R(float_or(TA ? A[k * lda + i] : A[i * lda + k]));
      const R b = R(float_or(TB ? B[j * ldb + k] : B[k * ldb + j]));
      s += a * b;
    }
    C[i * ldc + j] = s;
  }
  __syncthreads();
}
}  // namespace hila::cuda

namespace emu {
template <class K, class... A>
void launch_seq(K kernel, dim3 grid, const A&... args) {
  gdim = grid;
  for (unsigned bx = 0; bx < grid.x; ++bx)
    for (unsigned t = 0; t < 256; ++t) {
      tid = dim3(t, 0, 0);
      bid = dim3(bx, 0, 0);
      kernel(args...);
    }
}
template <class K, class A>
void launch(K kernel, dim3 grid, const A& args) {
  gdim = grid;
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      std::barrier<> b(256);
      std::vector<std::unique_ptr<std::barrier<>>> wb;
      for (int w = 0; w < 8; ++w) wb.push_back(std::make_unique<std::barrier<>>(32)), warpbar[w] = wb.back().get();
      bar = &b;
      std::vector<std::thread> th;
      for (unsigned t = 0; t < 256; ++t)
        th.emplace_back([&, t] {
          tid = dim3(t, 0, 0);
          bid = dim3(bx, by, 0);
          kernel(args);
        });
      for (auto& x : th) x.join();
    }
}
}  // namespace emu
