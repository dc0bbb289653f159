// SPDX-License-Identifier: Apache-2.0
// The device services of the CUDA backend besides the operators: CUDA errors as exceptions, the
// device copies and value scans that validation reads (registered with core/host_mirror.h), and
// the device memory of a DecodeState (backend.h).
#include <stdexcept>
#include <string>

#include "core/host_mirror.h"
#include "cuda/backend.h"
#include "cuda/runtime/runtime.cuh"
#include "hila/error.h"

namespace hila::cuda {

[[noreturn]] void fail(cudaError_t e, const char* expr, const char* file, int line) {
  throw std::runtime_error(std::string("hila: CUDA error ") + cudaGetErrorName(e) + " (" +
                           cudaGetErrorString(e) + ") in " + expr + " at " + file + ":" +
                           std::to_string(line));
}

namespace {

void d2h(void* dst, const void* src, size_t bytes, int device, void* stream) {
  DeviceScope scope(device);
  const auto s = static_cast<cudaStream_t>(stream);
  HILA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  HILA_CUDA_CHECK(cudaStreamSynchronize(s));
}

// first[0] = min row-major index of an element that is non-finite (for gates: NaN or > 0; -inf is a
// reset, docs/OPERATORS.md "Resets").
__global__ void scan_kernel(unsigned long long* first, Strided t, int nd, int64_t s0, int64_t s1, int64_t s2,
                            int64_t s3, int64_t s4, int64_t n, bool contiguous, bool gates) {
  const int64_t shape[5] = {s0, s1, s2, s3, s4};
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    int64_t off = e;
    if (!contiguous) {
      off = 0;
      int64_t rem = e;
      for (int i = nd - 1; i >= 0; --i) {
        off += (rem % shape[i]) * t.s[i];
        rem /= shape[i];
      }
    }
    const double x = ld<double>(t, off);
    if (gates ? !(x <= 0) : !isfinite(x)) atomicMin(first, static_cast<unsigned long long>(e));
  }
}

int64_t device_scan(const TensorView& t, bool gates, void* stream) {
  if (t.ndim > 5) return -2;
  DeviceScope scope(t.device.index);
  const auto s = static_cast<cudaStream_t>(stream);
  bool contiguous = true;
  int64_t expect = 1, shape[5] = {1, 1, 1, 1, 1};
  for (int i = t.ndim - 1; i >= 0; --i) {
    shape[i] = t.shape[i];
    if (t.shape[i] != 1 && t.stride[i] != expect) contiguous = false;
    expect *= t.shape[i];
  }
  DevBuf<unsigned long long> first(1, s);
  HILA_CUDA_CHECK(cudaMemsetAsync(first.get(), 0xff, sizeof(unsigned long long), s));
  const int64_t n = t.numel();
  HILA_LAUNCH(scan_kernel, n, s, first.get(), Strided(t), t.ndim, shape[0], shape[1], shape[2], shape[3], shape[4], n,
              contiguous, gates);
  unsigned long long host = 0;
  HILA_CUDA_CHECK(cudaMemcpyAsync(&host, first.get(), sizeof(host), cudaMemcpyDeviceToHost, s));
  HILA_CUDA_CHECK(cudaStreamSynchronize(s));
  return host == ~0ull ? -1 : static_cast<int64_t>(host);
}

const bool g_registered = (detail::register_device_to_host(&d2h), detail::register_device_scan(&device_scan), true);

struct Shape5 {
  int64_t d[5];
};

// ---- state copies for DecodeState: dst (contiguous, R) <- src (strided, any float dtype), with
// zero fill where dst is larger (more Fenwick slots) ----------------------------------------------
template <class R>
__global__ void copy_part(R* dst, int nd, Shape5 dshape, Strided src, Shape5 sshape, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = e, off = 0;
    bool inside = true;
    for (int i = nd - 1; i >= 0; --i) {
      const int64_t idx = rest % dshape.d[i];
      rest /= dshape.d[i];
      inside = inside && idx < sshape.d[i];
      off += idx * src.s[i];
    }
    dst[e] = inside ? ld<R>(src, off) : R(0);
  }
}

}  // namespace

}  // namespace hila::cuda

namespace hila::detail {

void cuda_copy_state_part(const TensorView& dst, const TensorView& src, void* stream) {
  using namespace hila::cuda;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  DeviceScope scope(dst.device.index);
  if (dst.ndim > 5 || src.ndim != dst.ndim)
    throw Error("state", "expected state parts of at most 5 matching dimensions, got " + src.shape_str() +
                             " -> " + dst.shape_str());
  Shape5 ds{}, ss{};
  for (int i = 0; i < 5; ++i) ds.d[i] = ss.d[i] = 1;
  for (int i = 0; i < dst.ndim; ++i) ds.d[i] = dst.shape[i], ss.d[i] = src.shape[i];
  const int64_t n = dst.numel();
  if (n == 0) return;
  if (dst.dtype == DType::f64) HILA_LAUNCH(copy_part<double>, n, s, static_cast<double*>(dst.data), dst.ndim, ds, Strided(src), ss, n);
  else HILA_LAUNCH(copy_part<float>, n, s, static_cast<float*>(dst.data), dst.ndim, ds, Strided(src), ss, n);
}

void* cuda_alloc_zeroed(size_t bytes, int device) {
  if (bytes == 0) return nullptr;
  cuda::DeviceScope scope(device);
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) cuda::fail_device_memory(bytes, device, "a decode state");
  HILA_CUDA_CHECK(e);
  const cudaError_t z = cudaMemset(p, 0, bytes);
  if (z != cudaSuccess) {
    cudaFree(p);
    HILA_CUDA_CHECK(z);
  }
  return p;
}

void cuda_check_memory(double total, double fresh, int device, const std::string& what) {
  const int64_t limit = configured_memory_limit();
  if (limit > 0 && total > double(limit))
    throw Error("N/H/dk/dv", "needs " + bytes_str(total) + " of device memory on cuda:" + std::to_string(device) +
                                 " for " + what + ", more than the " + bytes_str(double(limit)) +
                                 " hila may take (HILA_MAX_MEMORY or hila::set_memory_limit)");
  cuda::DeviceScope scope(device);
  size_t free_b = 0, dev_total = 0;
  HILA_CUDA_CHECK(cudaMemGetInfo(&free_b, &dev_total));
  if (fresh > double(free_b))
    throw Error("N/H/dk/dv", "needs " + bytes_str(fresh) + " of new device memory on cuda:" + std::to_string(device) +
                                 " for " + what + ", more than the " + bytes_str(double(free_b)) + " free (of " +
                                 bytes_str(double(dev_total)) + ")");
}

void cuda_free(void* p, int device) noexcept {
  if (!p) return;
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device);
  cudaFree(p);
  cudaSetDevice(prev);
}

void cuda_upload(void* dst, const void* src, size_t bytes, int device) {
  if (bytes == 0) return;
  cuda::DeviceScope scope(device);
  HILA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void cuda_device_synchronize(int device) {
  cuda::DeviceScope scope(device);
  HILA_CUDA_CHECK(cudaDeviceSynchronize());
}

void cuda_synchronize(void* stream, int device) {
  cuda::DeviceScope scope(device);
  HILA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

}  // namespace hila::detail
