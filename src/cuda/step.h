// SPDX-License-Identifier: Apache-2.0
// Host interface of the CUDA decode step (step.cu) and of the device storage of a DecodeState.
// Plain C++: core/decode.cpp includes it without nvcc. Streams are cudaStream_t passed as void*.
#pragma once
#include <cstddef>

#include "core/problem.h"

namespace hila::detail {

// One decode step of a validated call on the state `state` (same device as q): one fused kernel
// for all sequences and heads, and pos += 1 on the device. Enqueued on p.stream; no allocation.
// `counters` (zeroed device memory of cuda_step_counter_bytes(N, H), owned by a DecodeState and
// left zeroed by every step) lets the kernel advance pos itself and split the metric S ops into
// column tiles; without them (nullptr) S ops run one block per head and a second tiny kernel
// advances pos. Steps that share counters must be stream-ordered.
void cuda_step(const Resolved& r, const StepParams& p, const StateView& state, void* counters);
size_t cuda_step_counter_bytes(int64_t N, int64_t H);

// Device storage of a DecodeState (allocation happens at construction, reserve, grow and load only).
void* cuda_alloc_zeroed(size_t bytes, int device);
void cuda_free(void* p, int device) noexcept;
void cuda_upload(void* dst, const void* src, size_t bytes, int device);  // host -> device, blocking
// dst (contiguous, f32/f64) <- src (strided, any float dtype, same rank, shape <= dst's in every
// dim), converting; the rest of dst is zero. Enqueued on `stream`.
void cuda_copy_state_part(const TensorView& dst, const TensorView& src, void* stream);
void cuda_synchronize(void* stream, int device);
void cuda_device_synchronize(int device);  // every stream: no step of any stream still in flight

}  // namespace hila::detail
