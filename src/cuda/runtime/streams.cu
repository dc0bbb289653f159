// SPDX-License-Identifier: Apache-2.0
// SideStream (runtime.cuh): work enqueued beside the caller's stream, forked and joined by events.
#include <stdexcept>
#include <vector>

#include "cuda/runtime/config.h"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

namespace {
// an event that has captured `from`'s work so far, waited for by `to`. cudaStreamWaitEvent waits
// for the event's record at the time of the call, so one event per (host thread, device) serves
// every link: it is created once and re-recorded.
cudaError_t link(cudaStream_t from, cudaStream_t to) {
  thread_local std::vector<cudaEvent_t> events;
  const int dev = current_device();
  if (events.size() <= size_t(dev)) events.resize(size_t(dev) + 1, nullptr);
  cudaEvent_t& e = events[size_t(dev)];
  if (!e) {
    const cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      e = nullptr;
      return err;
    }
  }
  cudaError_t err = cudaEventRecord(e, from);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(to, e, 0);
  return err;
}

// the event of mark i of this host thread's (device, lane), created once and re-recorded
cudaEvent_t mark_event(int lane, int i) {
  thread_local std::vector<std::vector<cudaEvent_t>> marks;
  const size_t at = size_t(current_device()) * kSideLanes + size_t(lane);
  if (marks.size() <= at) marks.resize(at + 1);
  std::vector<cudaEvent_t>& m = marks[at];
  if (m.size() <= size_t(i)) m.resize(size_t(i) + 1, nullptr);
  if (!m[size_t(i)]) HILA_CUDA_CHECK(cudaEventCreateWithFlags(&m[size_t(i)], cudaEventDisableTiming));
  return m[size_t(i)];
}
}  // namespace

SideStream::SideStream(cudaStream_t main, int lane) : main_(main), side_(main), lane_(lane) {
  if (lane < 0 || lane >= kSideLanes) throw std::logic_error("SideStream: lane out of range");
  if (!config().side_stream || dry_run()) return;
  // one non-blocking stream per (host thread, device, lane), kept for the thread's lifetime
  thread_local std::vector<cudaStream_t> streams;
  const size_t at = size_t(current_device()) * kSideLanes + size_t(lane);
  if (streams.size() <= at) streams.resize(at + 1, nullptr);
  if (!streams[at]) {
    int least = 0, greatest = 0;
    if (lane > 0) HILA_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    HILA_CUDA_CHECK(cudaStreamCreateWithPriority(&streams[at], cudaStreamNonBlocking, lane > 0 ? greatest : 0));
  }
  side_ = streams[at];
  HILA_CUDA_CHECK(link(main_, side_));
}

void SideStream::follow() const {
  if (side_ != main_) HILA_CUDA_CHECK(link(main_, side_));
}

void SideStream::mark(int i) const {
  if (side_ != main_) HILA_CUDA_CHECK(cudaEventRecord(mark_event(lane_, i), side_));
}

void SideStream::wait_mark(int i) const {
  if (side_ != main_) HILA_CUDA_CHECK(cudaStreamWaitEvent(main_, mark_event(lane_, i), 0));
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
