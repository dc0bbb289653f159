// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's entry points (backend.cu), called by src/api for calls on a CUDA device, and
// the device memory of a DecodeState (runtime/device.cu). Plain C++: src/api includes it without
// nvcc. Streams are cudaStream_t passed as void*.
#pragma once
#include <cstddef>
#include <string>

#include "core/problem.h"

namespace hila::detail {

// Whether the CUDA backend runs this validated call; otherwise throws hila::Error naming what
// is not available on the device yet.
void cuda_check_supported(const Resolved& r, DType dtype);
void cuda_forward(const Resolved& r, const ForwardParams& p);
void cuda_backward(const Resolved& r, const BackwardParams& p);
// Peak bytes of the call's temporaries (a dry run under a measuring arena), plus alignment slack.
size_t cuda_workspace_size(const Resolved& r, const ForwardParams& p);
size_t cuda_workspace_size(const Resolved& r, const BackwardParams& p);

// One decode step of a validated call on the state `state` (same device as q): one fused kernel
// for all sequences and heads, and pos += 1 on the device. Enqueued on p.stream; no allocation.
// `counters` (zeroed device memory of cuda_step_counter_bytes(N, H), owned by a DecodeState or
// given as StepParams::counters, left zeroed by every step) lets the kernel advance pos itself and split the metric S ops into
// column tiles; without them (nullptr) S ops run one block per head and a second tiny kernel
// advances pos. Steps that share counters must be stream-ordered.
void cuda_step(const Resolved& r, const StepParams& p, const StateView& state, void* counters);
size_t cuda_step_counter_bytes(int64_t N, int64_t H);

// Device storage of a DecodeState (allocation happens at construction, reserve, grow and load only).
// A failed allocation is hila::Error("memory", ...) naming the bytes and the device.
void* cuda_alloc_zeroed(size_t bytes, int device);
// hila::Error("N/H/dk/dv", ...) when `total` bytes exceed the configured limit (hila::set_memory_limit,
// HILA_MAX_MEMORY) or the `fresh` bytes to allocate exceed the device's free memory; `what` names
// the memory.
void cuda_check_memory(double total, double fresh, int device, const std::string& what);
void cuda_free(void* p, int device) noexcept;
void cuda_upload(void* dst, const void* src, size_t bytes, int device);  // host -> device, blocking
// dst (contiguous, f32/f64) <- src (strided, any float dtype, same rank, shape <= dst's in every
// dim), converting; the rest of dst is zero. Enqueued on `stream`.
void cuda_copy_state_part(const TensorView& dst, const TensorView& src, void* stream);
void cuda_synchronize(void* stream, int device);
void cuda_device_synchronize(int device);  // every stream: no step of any stream still in flight

}  // namespace hila::detail
