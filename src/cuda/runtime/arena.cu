// SPDX-License-Identifier: Apache-2.0
// Where one call's temporaries come from (runtime.cuh): the bump arena over a caller's workspace
// (or a measuring one for workspace_size), the scopes that install it and forbid allocation on the
// side stream, scratch poisoning, and the caching of the stream-ordered pool.
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cuda/runtime/config.h"
#include "cuda/runtime/runtime.cuh"
#include "core/problem.h"
#include "hila/error.h"

namespace hila::cuda {

namespace {
thread_local CallScope* t_call = nullptr;
}  // namespace

CallScope::CallScope(int device, cudaStream_t s) : dev_(device), s_(s), outer_(t_call) {
  HILA_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != dev_) HILA_CUDA_CHECK(cudaSetDevice(dev_));
  t_call = this;
}
CallScope::~CallScope() {
  t_call = outer_;
  if (prev_ != dev_) cudaSetDevice(prev_);
}
bool CallScope::capturing() {
  if (capture_ < 0) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    HILA_CUDA_CHECK(cudaStreamIsCapturing(s_, &st));
    capture_ = st != cudaStreamCaptureStatusNone;
  }
  return capture_ != 0;
}
CallScope* CallScope::current() { return t_call; }

int current_device() {
  if (t_call) return t_call->device();
  int dev = 0;
  HILA_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

void keep_pool_cached() {
  static std::atomic<bool> kept[64];
  const int dev = current_device();
  if (kept[dev & 63].load(std::memory_order_acquire)) return;
  // not while the call's stream is captured (a call that is not stream work may invalidate the
  // capture): the next call outside a capture sets it
  if (CallScope* c = CallScope::current(); c && c->capturing()) return;
  static std::once_flag done[64];
  std::call_once(done[dev & 63], [dev] {
    cudaMemPool_t pool;
    HILA_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    uint64_t keep = UINT64_MAX;
    HILA_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  });
  kept[dev & 63].store(true, std::memory_order_release);
}

void fail_device_memory(size_t bytes, int device, const char* what) {
  (void)cudaGetLastError();  // an allocation failure is not sticky: clear it for the next call
  size_t free_b = 0, total = 0;
  std::string have;
  if (cudaMemGetInfo(&free_b, &total) == cudaSuccess)
    have = "; " + detail::bytes_str(double(free_b)) + " free of " + detail::bytes_str(double(total));
  else
    (void)cudaGetLastError();
  throw Error("memory", "could not allocate " + detail::bytes_str(double(bytes)) + " of device memory on cuda:" +
                            std::to_string(device) + " for " + what + have);
}

// ---- per-device attributes, read once

namespace {
template <class F>
int per_device(std::atomic<long long> (&cache)[64], F read) {
  const int dev = current_device();
  long long v = cache[dev & 63].load(std::memory_order_relaxed);
  if (v == 0) cache[dev & 63].store(v = read(dev), std::memory_order_relaxed);
  return int(v);
}
}  // namespace

int sm_count() {
  static std::atomic<long long> cache[64];
  return per_device(cache, [](int dev) {
    int x = 0;
    HILA_CUDA_CHECK(cudaDeviceGetAttribute(&x, cudaDevAttrMultiProcessorCount, dev));
    return (long long)x;
  });
}

size_t smem_optin() {
  static std::atomic<long long> cache[64];
  return size_t(per_device(cache, [](int dev) {
    int x = 0;
    HILA_CUDA_CHECK(cudaDeviceGetAttribute(&x, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return (long long)x;
  }));
}

size_t device_total_memory() {
  static std::atomic<long long> cache[64];
  const int dev = current_device();
  long long v = cache[dev & 63].load(std::memory_order_relaxed);
  if (v == 0) {
    size_t free_b = 0, total = 0;
    HILA_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
    cache[dev & 63].store(v = (long long)total, std::memory_order_relaxed);
  }
  return size_t(v);
}

// ---- dynamic shared memory attributes set per (kernel, device)

namespace {
std::mutex g_smem_mu;
std::map<std::pair<const void*, int>, size_t> g_smem;
}  // namespace

bool smem_set(const void* kernel, size_t bytes) {
  const int dev = current_device();
  std::lock_guard<std::mutex> lock(g_smem_mu);
  const auto it = g_smem.find({kernel, dev});
  return it != g_smem.end() && it->second >= bytes;
}

void note_smem(const void* kernel, size_t bytes) {
  const int dev = current_device();
  std::lock_guard<std::mutex> lock(g_smem_mu);
  size_t& b = g_smem[{kernel, dev}];
  b = std::max(b, bytes);
}

namespace {
thread_local Arena* t_arena = nullptr;
constexpr size_t kAlign = 256;
}  // namespace

Arena::Arena(void* base, size_t bytes) {
  if (!base) return;  // measuring: stand-in addresses from kAlign up, never dereferenced
  base_ = (reinterpret_cast<uintptr_t>(base) + kAlign - 1) & ~uintptr_t(kAlign - 1);
  const size_t skip = base_ - reinterpret_cast<uintptr_t>(base);
  cap_ = bytes > skip ? bytes - skip : 0;
}

void* Arena::take(size_t bytes) {
  const size_t off = top_, end = off + ((bytes + kAlign - 1) & ~(kAlign - 1));
  if (!measuring() && end > cap_)  // workspace_size() measured this call's peak: only a changed call gets here
    throw Error("workspace_bytes", "the workspace is too small for this call: it needs more than " +
                                       std::to_string(cap_) + " bytes (query hila::workspace_size with the same params)");
  blocks_.push_back({off, end, true});
  top_ = end;
  peak_ = std::max(peak_, top_);
  return reinterpret_cast<void*>((measuring() ? kAlign : base_) + off);
}

void Arena::give(void* p) {
  const size_t off = reinterpret_cast<uintptr_t>(p) - (measuring() ? kAlign : base_);
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it)
    if (it->off == off && it->live) {
      it->live = false;
      break;
    }
  while (!blocks_.empty() && !blocks_.back().live) blocks_.pop_back();
  top_ = blocks_.empty() ? 0 : blocks_.back().end;
}

Arena* current_arena() { return t_arena; }
namespace {
thread_local int t_no_alloc = 0;
}
NoAllocScope::NoAllocScope() { ++t_no_alloc; }
NoAllocScope::~NoAllocScope() { --t_no_alloc; }
void check_alloc_allowed() {
  if (t_no_alloc > 0)
    throw std::logic_error("hila: a temporary was requested for work on hila's side stream, which must not "
                           "allocate (it would race with the caller's stream over the workspace); please report this");
}
bool poison_scratch() { return config().poison_scratch; }
ArenaScope::ArenaScope(Arena* a) : prev_(t_arena) { t_arena = a; }
ArenaScope::~ArenaScope() { t_arena = prev_; }

}  // namespace hila::cuda
