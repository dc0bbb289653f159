// SPDX-License-Identifier: Apache-2.0
// A forward on a state pool (ForwardParams::state_indices) on the GPU (pool.cu): the rows the call
// reads are gathered into a state of the call's N sequences, the composition runs on it as on any
// initial state, and the final states go back to their rows. No host read: the indices stay on
// the device, and the kernels guard their range.
#pragma once
#include <deque>

#include "core/problem.h"
#include "cuda/common.cuh"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

class PoolCall {
 public:
  // Gathers init's rows state_indices[i] into init() (N rows, contiguous, the pool's dtypes and
  // Fenwick slots): a padding row (-1) as a zero state at position 0, a row outside [-1, P) as
  // NaN (its outputs come out NaN) at position 0. final() gets N rows shaped like final_state's.
  PoolCall(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s);
  const StateView& init() const { return init_; }
  const StateView& final() const { return final_; }
  // final() rows to final_state's rows state_indices[i] (real, in-range rows only); o of padding
  // sequences to 0 and of out-of-range ones to NaN.
  void finish(const ForwardParams& p) const;

 private:
  StateView alloc_like(const StateView& pool);
  const detail::Resolved& r_;
  cudaStream_t s_;
  int64_t N_ = 0, P_ = 0;
  std::deque<DevBuf<char>> bufs_;
  StateView init_, final_;
};

}  // namespace hila::cuda
