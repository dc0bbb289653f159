// SPDX-License-Identifier: Apache-2.0
// Device copies of host test buffers for the GPU tests (shared by the test_cuda_*.cpp files).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>

#include "problem.h"

namespace hila::tools {

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// A device copy of a host buffer; poisoned (all bits set: NaN for every float dtype) on request.
struct DevTensor {
  void* p = nullptr;
  Buffer host;
  DevTensor() = default;
  explicit DevTensor(const Buffer& b, bool poison = false) : host(b) {
    if (b.empty()) return;
    cudaMalloc(&p, std::max<size_t>(1, b.bytes.size()));
    if (poison) cudaMemset(p, 0xff, b.bytes.size());
    else cudaMemcpy(p, b.bytes.data(), b.bytes.size(), cudaMemcpyHostToDevice);
  }
  ~DevTensor() { if (p) cudaFree(p); }
  DevTensor(const DevTensor&) = delete;
  TensorView view() const {
    if (host.empty()) return {};
    TensorView v = host.view();
    v.data = p;
    v.device = Device{DeviceType::cuda, 0};
    return v;
  }
  Buffer fetch() const {
    Buffer b = host;
    if (!b.empty()) cudaMemcpy(b.bytes.data(), p, b.bytes.size(), cudaMemcpyDeviceToHost);
    return b;
  }
};

}  // namespace hila::tools
