// SPDX-License-Identifier: Apache-2.0
// Helpers of the GPU tests: device detection and device copies of host buffers.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>

#include "cuda/runtime/config.h"
#include "problem.h"

namespace hila::tools {

// Runs f with the environment variable `name` set to `value` (left unset when nullptr), unsetting
// it afterwards; returns what f threw, or "". The library reads its knobs once (src/cuda/runtime/
// config.h): they are re-read after each change.
template <class F>
std::string with_env(const char* name, const char* value, F f) {
  if (value) setenv(name, value, 1);
  hila::cuda::reload_config();
  std::string err;
  try {
    f();
  } catch (const std::exception& e) {
    err = e.what();
  }
  unsetenv(name);
  hila::cuda::reload_config();
  return err;
}

// `name` set to `value` for the scope's life (nothing when value is nullptr), the knobs re-read on
// entry and exit.
struct ScopedEnv {
  ScopedEnv(const char* n, const char* value) : name(value ? n : nullptr) {
    if (name) setenv(name, value, 1), hila::cuda::reload_config();
  }
  ~ScopedEnv() {
    if (name) unsetenv(name), hila::cuda::reload_config();
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  const char* name;
};

// Every GPU test process poisons the library's temporaries (runtime/runtime.cuh, poison_scratch):
// set before main, read with the other knobs at the first call.
inline const bool kPoisonScratch = setenv("HILA_POISON_SCRATCH", "1", 0) == 0;

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

inline Device cuda0() { return Device{DeviceType::cuda, 0}; }

// A device copy of a host buffer; poisoned (all bits set: NaN for every float dtype) on request.
// kGuard bytes past the end are always poisoned, so that a kernel reading a little past a tensor
// (inside the allocation, where compute-sanitizer cannot see it) gets NaN and fails its test.
struct DevTensor {
  static constexpr size_t kGuard = 1024;
  void* p = nullptr;
  Buffer host;
  DevTensor() = default;
  explicit DevTensor(const Buffer& b, bool poison = false) : host(b) {
    if (b.empty()) return;
    const size_t n = b.bytes.size(), kept = poison ? 0 : n;
    check(cudaMalloc(&p, n + kGuard), "cudaMalloc");
    if (kept) check(cudaMemcpy(p, b.bytes.data(), kept, cudaMemcpyHostToDevice), "cudaMemcpy");
    check(cudaMemset(static_cast<char*>(p) + kept, 0xff, n + kGuard - kept), "cudaMemset");
    // Both may still be in flight on the legacy stream (a pageable cudaMemcpy returns once staged,
    // cudaMemset is asynchronous), which a non-blocking stream does not wait for: finish them here.
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  ~DevTensor() { if (p) cudaFree(p); }
  DevTensor(const DevTensor&) = delete;
  DevTensor& operator=(const DevTensor&) = delete;
  TensorView view() const {
    if (host.empty()) return {};
    TensorView v = host.view();
    v.data = p;
    v.device = cuda0();
    return v;
  }
  // a [B, T, X, d] view of this buffer from element `at` on (of its dtype), with the batch and row
  // strides s0, s1 (the heads and columns contiguous): q, k or v inside a fused qkv buffer
  TensorView rows_view(int64_t at, int64_t B, int64_t T, int64_t X, int64_t d, int64_t s0, int64_t s1) const {
    TensorView v = TensorView::contiguous_view(static_cast<char*>(p) + at * dtype_size(host.dtype), host.dtype,
                                               {B, T, X, d}, cuda0());
    v.stride[0] = s0, v.stride[1] = s1;
    return v;
  }
  Buffer fetch() const {
    Buffer b = host;
    if (!b.empty()) check(cudaMemcpy(b.bytes.data(), p, b.bytes.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return b;
  }
  // a failed CUDA call in a test's setup: an exception naming it (the test fails, it does not crash)
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
};

// Error floor for dg: dg_t = sum_{s>=t} (q^.dq^ - k.dk)_s cancels (it is exactly 0 at T = 1 without
// an initial state), so it is judged against the largest per-row |q|.|dq| and |k|.|dk| terms of the
// float64 reference instead of its own size.
inline double dg_floor(const Buffer& q, const Buffer& dq, const Buffer& k, const Buffer& dk, int64_t d) {
  double fl = 0;
  for (int64_t r = 0; r < q.numel() / d; ++r) {
    double t = 0, u = 0;
    for (int64_t j = 0; j < d; ++j) {
      t += std::abs(q.get(r * d + j) * dq.get(r * d + j));
      u += std::abs(k.get(r * d + j) * dk.get(r * d + j));
    }
    fl = std::max({fl, t, u});
  }
  return fl;
}

// A device copy of a state (each part a DevTensor).
struct DevState {
  DevTensor pos, S, P, H;
  explicit DevState(const StateBuffers& s, bool poison = false)
      : pos(s.pos, poison), S(s.S, poison), P(s.P, poison), H(s.H, poison) {}
  StateView view() const { return StateView{pos.view(), S.view(), P.view(), H.view()}; }
  StateBuffers fetch() const { return StateBuffers{pos.fetch(), S.fetch(), P.fetch(), H.fetch()}; }
};

// Host copy of a (contiguous) device tensor.
inline Buffer fetch_view(const TensorView& v) {
  if (!v.defined()) return {};
  Buffer b(v.dtype, std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.ndim));
  if (!b.bytes.empty()) DevTensor::check(cudaMemcpy(b.bytes.data(), v.data, b.bytes.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return b;
}
inline StateBuffers fetch_state(const StateView& s) {
  return StateBuffers{fetch_view(s.pos), fetch_view(s.S), fetch_view(s.P), fetch_view(s.H)};
}

}  // namespace hila::tools
