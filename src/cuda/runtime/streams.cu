// SPDX-License-Identifier: Apache-2.0
// SideStream (runtime.cuh): work enqueued beside the caller's stream, forked and joined by events.
#include <vector>

#include "cuda/runtime/config.h"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

namespace {
// an event that has captured `from`'s work so far, waited for by `to`
cudaError_t link(cudaStream_t from, cudaStream_t to) {
  cudaEvent_t e;
  cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  if (err != cudaSuccess) return err;
  err = cudaEventRecord(e, from);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(to, e, 0);
  const cudaError_t d = cudaEventDestroy(e);  // released once the wait is satisfied
  return err != cudaSuccess ? err : d;
}
}  // namespace

SideStream::SideStream(cudaStream_t main) : main_(main), side_(main) {
  if (!config().side_stream || dry_run()) return;
  // one non-blocking stream per (host thread, device), kept for the thread's lifetime
  thread_local std::vector<cudaStream_t> streams;
  int dev = 0;
  HILA_CUDA_CHECK(cudaGetDevice(&dev));
  if (streams.size() <= size_t(dev)) streams.resize(size_t(dev) + 1, nullptr);
  if (!streams[size_t(dev)]) HILA_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[size_t(dev)], cudaStreamNonBlocking));
  side_ = streams[size_t(dev)];
  HILA_CUDA_CHECK(link(main_, side_));
}

void SideStream::join() {
  if (joined_ || side_ == main_) return;
  joined_ = true;
  HILA_CUDA_CHECK(link(side_, main_));
}

// an exception between fork and join: still order main after the side's work (no throw here)
SideStream::~SideStream() {
  if (!joined_ && side_ != main_) link(side_, main_);
}

}  // namespace hila::cuda
