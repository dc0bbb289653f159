// SPDX-License-Identifier: Apache-2.0
// Host stand-in for src/cuda/runtime/runtime.cuh (see run.sh): host buffers (poisoned with NaN like
// fresh device memory), strided loads/stores of float / double, sequential launches, host uploads.
#pragma once
#include <algorithm>
#include <vector>
#include "core/problem.h"
#include "cuda/common.cuh"
#include "hila/tensor.h"
enum { cudaMemcpyHostToDevice = 1, cudaDevAttrMultiProcessorCount = 2 };
inline int cudaMemcpyAsync(void* d, const void* s, size_t n, int, void*) { std::memcpy(d, s, n); return 0; }
inline int cudaMemsetAsync(void* d, int v, size_t n, void*) { std::memset(d, v, n); return 0; }
inline int cudaStreamSynchronize(void*) { return 0; }
inline int cudaGetDevice(int* d) { *d = 0; return 0; }
inline int cudaDeviceGetAttribute(int* v, int, int) { *v = 2; return 0; }
namespace hila::cuda {
template <class X>
class DevBuf {
 public:
  DevBuf() = default;
  DevBuf(size_t n, cudaStream_t, bool zero = false) : v_(n) {
    if (!zero) for (auto& x : v_) std::memset(&x, 0xff, sizeof(X));  // poison like fresh device memory
  }
  X* get() const { return v_.empty() ? nullptr : const_cast<X*>(v_.data()); }
 private:
  std::vector<X> v_;
};
struct Strided {
  void* p = nullptr;
  DType dt = DType::f32;
  int64_t s[5] = {0, 0, 0, 0, 0};
  explicit Strided(const TensorView& t) {
    p = t.data;
    dt = t.dtype;
    for (int i = 0; i < t.ndim && i < 5; ++i) s[i] = t.stride[i];
  }
};
template <class R> R ld(const Strided& t, int64_t off) {
  switch (t.dt) {
    case DType::f64: return R(static_cast<const double*>(t.p)[off]);
    case DType::f32: return R(static_cast<const float*>(t.p)[off]);
    default: throw std::runtime_error("emu: dtype");
  }
}
template <class R> void st(const Strided& t, int64_t off, R x) {
  switch (t.dt) {
    case DType::f64: static_cast<double*>(t.p)[off] = double(x); break;
    case DType::f32: static_cast<float*>(t.p)[off] = float(x); break;
    default: throw std::runtime_error("emu: dtype");
  }
}
inline unsigned grid_for(int64_t) { return 1; }
inline bool dry_run() { return false; }
inline void upload_async(void* d, const void* s, size_t n, cudaStream_t) { std::memcpy(d, s, n); }
inline void upload_final_positions(const TensorView& pos, const detail::Resolved& r, cudaStream_t) {
  if (!pos.defined()) return;
  int64_t* p = static_cast<int64_t*>(pos.data);
  for (const auto& x : r.seqs) *p++ = x.n0 + x.len;
}
inline int pad16(int64_t d) { return int((d + 15) / 16 * 16); }
#define HILA_LAUNCH(kernel, n, s, ...) do { blockIdx.x = 0; gridDim.x = 1; blockDim.x = 1; threadIdx.x = 0; kernel(__VA_ARGS__); } while (0)
struct SeqTables {
  template <class X>
  static DevBuf<X> upload(const std::vector<X>& v, cudaStream_t s) {
    DevBuf<X> b(v.size(), s);
    if (!v.empty()) std::memcpy(b.get(), v.data(), v.size() * sizeof(X));
    return b;
  }
};
#ifndef EMU_THREADS
#define EMU_THREADS 1
#endif
template <class F> void emu_grid(int blocks, F f) {
  gridDim.x = blocks;
  blockDim.x = EMU_THREADS;
  for (int b = 0; b < blocks; ++b) {
    blockIdx.x = b;
    if (EMU_THREADS == 1) { threadIdx.x = 0; f(); continue; }
    std::barrier<> bar(EMU_THREADS);
    emu_bar = &bar;
    std::vector<std::thread> ts;
    for (int t = 0; t < EMU_THREADS; ++t) ts.emplace_back([&, t] { threadIdx.x = t; f(); });
    for (auto& x : ts) x.join();
    emu_bar = nullptr;
  }
}
}
