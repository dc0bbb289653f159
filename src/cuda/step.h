// SPDX-License-Identifier: Apache-2.0
// Host interface of the CUDA decode step (step.cu) and of the device storage of a DecodeState.
// Plain C++: core/decode.cpp includes it without nvcc. Streams are cudaStream_t passed as void*.
#pragma once
#include <cstddef>

#include "core/problem.h"

namespace hila::detail {

// One decode step of a validated call on the state `state` (same device as q): one fused kernel
// for all sequences and heads, then pos += 1 on the device. Enqueued on p.stream; no allocation.
void cuda_step(const Resolved& r, const StepParams& p, const StateView& state);

// Device storage of a DecodeState (allocation happens at construction, reserve, grow and load only).
void* cuda_alloc_zeroed(size_t bytes, int device);
void cuda_free(void* p, int device) noexcept;
void cuda_upload(void* dst, const void* src, size_t bytes, int device);  // host -> device, blocking
// dst (contiguous, f32/f64) <- src (strided, any float dtype, same rank, shape <= dst's in every
// dim), converting; the rest of dst is zero. Enqueued on `stream`.
void cuda_copy_state_part(const TensorView& dst, const TensorView& src, void* stream);
void cuda_synchronize(void* stream, int device);

}  // namespace hila::detail
