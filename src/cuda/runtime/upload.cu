// SPDX-License-Identifier: Apache-2.0
// upload_async (runtime.cuh): small per-call tables to the device without a stream
// synchronization, through a pinned ring buffer, or through kernel parameters under CUDA graph
// capture.
#include <algorithm>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/runtime/config.h"
#include "cuda/runtime/runtime.cuh"
#include "hila/error.h"

namespace hila::cuda {

namespace {

// The bytes of an upload are copied into the ring, then from there by cudaMemcpyAsync; an event
// recorded after that copy tells when its slot may be written again. Events are created once and
// reused (a completed upload's event goes back to `free_`).
class PinnedRing {
 public:
  static constexpr size_t kBytes = size_t(4) << 20;
  void upload(void* dst, const void* src, size_t bytes, cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!base_) {
      const cudaError_t e = cudaMallocHost(reinterpret_cast<void**>(&base_), kBytes);
      if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        base_ = nullptr;
        throw Error("memory", "could not allocate the " + std::to_string(kBytes) +
                                  " bytes of pinned host memory that per-call tables go up through");
      }
      HILA_CUDA_CHECK(e);
    }
    const size_t need = (bytes + 255) & ~size_t(255);
    if (need > kBytes) {  // larger than the ring: a plain (synchronizing) copy
      HILA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
      HILA_CUDA_CHECK(cudaStreamSynchronize(s));
      return;
    }
    if (head_ + need > kBytes) head_ = 0;
    // wait for earlier uploads whose bytes overlap [head_, head_ + need)
    while (!pending_.empty()) {
      const Pending& p = pending_.front();
      const bool overlap = p.off < head_ + need && head_ < p.off + p.len;
      if (!overlap && pending_.size() < 256) break;
      HILA_CUDA_CHECK(cudaEventSynchronize(p.done));
      free_.push_back(p.done);
      pending_.pop_front();
    }
    std::memcpy(base_ + head_, src, bytes);
    HILA_CUDA_CHECK(cudaMemcpyAsync(dst, base_ + head_, bytes, cudaMemcpyHostToDevice, s));
    cudaEvent_t e;
    if (free_.empty()) {
      HILA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    } else {
      e = free_.back();
      free_.pop_back();
    }
    const cudaError_t rec = cudaEventRecord(e, s);
    if (rec != cudaSuccess) {
      free_.push_back(e);
      HILA_CUDA_CHECK(rec);
    }
    pending_.push_back({head_, need, e});
    head_ += need;
  }

 private:
  struct Pending {
    size_t off, len;
    cudaEvent_t done;
  };
  std::mutex mu_;
  char* base_ = nullptr;
  size_t head_ = 0;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_;
};

// An upload inside CUDA graph capture: the bytes ride in the parameters of kernels (kept by value
// in the graph's kernel nodes), 2 KB per launch. A copy from the pinned ring would be captured as
// a copy node that reads the ring slot at every replay, after later calls may have reused it.
struct UploadPiece {
  unsigned char b[2048];
};
__global__ void upload_piece_kernel(unsigned char* dst, const UploadPiece p, unsigned n) {
  for (unsigned i = threadIdx.x; i < n; i += blockDim.x) dst[i] = p.b[i];
}
// HILA_UPLOAD_KERNEL=1 (tests): kernel uploads always, in pieces of 16 bytes
bool upload_forced() { return config().upload_kernel; }
// kernel uploads while s is being captured (asked once per call: CallScope)
bool capturing(cudaStream_t s) {
  if (CallScope* c = CallScope::current(); c && c->stream() == s) return c->capturing();
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  HILA_CUDA_CHECK(cudaStreamIsCapturing(s, &st));
  return st != cudaStreamCaptureStatusNone;
}
}  // namespace

void upload_async(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (dry_run()) return;
  if (upload_forced() || capturing(s)) {
    const size_t piece = upload_forced() ? 16 : sizeof(UploadPiece);
    for (size_t off = 0; off < bytes; off += piece) {
      UploadPiece p;
      const size_t n = std::min(bytes - off, piece);
      std::memcpy(p.b, static_cast<const unsigned char*>(src) + off, n);
      upload_piece_kernel<<<1, 256, 0, s>>>(static_cast<unsigned char*>(dst) + off, p, unsigned(n));
      HILA_CUDA_CHECK_LAUNCH();
    }
    return;
  }
  static PinnedRing rings[64];  // per device ordinal
  rings[current_device() & 63].upload(dst, src, bytes, s);
}

}  // namespace hila::cuda
