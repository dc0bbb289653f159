// SPDX-License-Identifier: Apache-2.0
// Host stand-in for src/cuda/common.cuh (see run.sh): the CUDA keywords the portable delta-rule
// kernels use, one OS thread per CUDA thread with a std::barrier for __syncthreads (or one thread
// per block), blocks in sequence. float / double only: the 16-bit types are plain floats here, so
// that the pack kernels of other dtypes compile (they do not run).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <stdexcept>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
struct Dim3Emu { unsigned x = 0, y = 0, z = 0; };
#include <barrier>
#include <thread>
#include <vector>
inline thread_local Dim3Emu threadIdx;
inline Dim3Emu blockIdx, blockDim{1, 1, 1}, gridDim{1, 1, 1};
inline std::barrier<>* emu_bar = nullptr;
inline void __syncthreads() { if (emu_bar) emu_bar->arrive_and_wait(); }
// Warp operations: declared for the shared headers' warp-level helpers (prims/tile.cuh,
// prims/resets.cuh); the delta kernels call none of them, so reaching one is an error.
[[noreturn]] inline void emu_no_warp_ops() { throw std::logic_error("warp operations are not emulated here (tools/cuda_emu)"); }
template <class V> V __shfl_up_sync(unsigned, V, int) { emu_no_warp_ops(); }
template <class V> V __shfl_down_sync(unsigned, V, int) { emu_no_warp_ops(); }
template <class V> V __shfl_xor_sync(unsigned, V, int) { emu_no_warp_ops(); }
inline bool __any_sync(unsigned, bool) { emu_no_warp_ops(); }
typedef void* cudaStream_t;
typedef int cudaError_t;
constexpr int cudaSuccess = 0;
#define HILA_CUDA_CHECK(expr) (void)(expr)
#define HILA_CUDA_CHECK_LAUNCH() do {} while (0)
#include <algorithm>
using std::min;
using std::max;
struct __nv_bfloat16 {
  float v = 0;
  __nv_bfloat16() = default;
  __nv_bfloat16(float x) : v(x) {}
  operator float() const { return v; }
};
struct __half {
  float v = 0;
  __half() = default;
  __half(float x) : v(x) {}
  operator float() const { return v; }
};
struct uint4 { unsigned x = 0, y = 0, z = 0, w = 0; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
#define HILA_FOR_EACH_DTYPE(M) M(float) M(double)
namespace hila::cuda {
template <class T> constexpr bool kTensorCore = false;
template <class T> using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <class T> inline T to(float x) { return static_cast<T>(x); }
template <class T> inline T to(double x) { return static_cast<T>(x); }
template <class A, class T> inline A from(T x) { return static_cast<A>(x); }
}
