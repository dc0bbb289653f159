// SPDX-License-Identifier: Apache-2.0
// The decode step on the GPU (step.cu), as backend.cu calls it.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/problem.h"
#include "cuda/common.cuh"

namespace hila::cuda {

// Largest head dim of a step: kRows <= 64 state rows per thread per array (args.cuh).
inline constexpr int kStepMaxDk = 512;

// Bytes of a step's counters (a DecodeState's, or StepParams::counters): blocks done per sequence
// [N], then blocks done reading S [N, H] (hila::step_counters_size elements).
inline size_t step_counter_bytes(int64_t N, int64_t H) { return size_t(step_counters_size(N, H)) * sizeof(unsigned); }

// One decode step of a validated call on `state` (backend.h, cuda_step), enqueued on `stream`.
template <class T>
void decode_step(const detail::Resolved& r, const StepParams& p, const StateView& state, void* counters,
                 cudaStream_t stream);

}  // namespace hila::cuda
