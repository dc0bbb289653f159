// SPDX-License-Identifier: Apache-2.0
// Where one call's temporaries come from (runtime.cuh): the bump arena over a caller's workspace
// (or a measuring one for workspace_size), the scopes that install it and forbid allocation on the
// side stream, scratch poisoning, and the caching of the stream-ordered pool.
#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cuda/runtime/config.h"
#include "cuda/runtime/runtime.cuh"
#include "hila/error.h"

namespace hila::cuda {

void keep_pool_cached() {
  static std::once_flag done[64];
  int dev = 0;
  HILA_CUDA_CHECK(cudaGetDevice(&dev));
  std::call_once(done[dev & 63], [dev] {
    cudaMemPool_t pool;
    HILA_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    uint64_t keep = UINT64_MAX;
    HILA_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  });
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
