// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's entry points (backend.h): what a call may run on the device, the device scope
// and the call's workspace (the caller's, checked, or the pool; a measuring arena for
// workspace_size), and the dtype of the kernels. The work itself is the composition (compose.cu)
// and the decode step (step/).
#include <string>

#include "cuda/backend.h"
#include "cuda/compose.cuh"
#include "cuda/dispatch/static_switch.h"
#include "cuda/prims/tile.cuh"
#include "cuda/runtime/runtime.cuh"
#include "cuda/step/step.cuh"
#include "hila/error.h"

namespace hila::detail {

void cuda_check_supported(const Resolved& r, DType dt) {
  if (r.form != Form::chunk)
    throw Error("form", std::string("expected chunk on a CUDA device (the naive, serial and scan forms "
                                    "run on the CPU backend), got ") + form_name(r.form));
  // The GLA family takes any power of two up to kChunk (its kernels hold a shorter chunk like a
  // partial one); the log-linear and delta kernels index levels and WY blocks by the 64-row chunk.
  const bool fixed = r.traits.loglinear || r.traits.delta;
  if (fixed ? r.chunk != cuda::kChunk : (r.chunk < 1 || r.chunk > cuda::kChunk || (r.chunk & (r.chunk - 1))))
    throw Error("chunk", std::string("expected ") +
                             (fixed ? std::to_string(cuda::kChunk) + " for " + op_name(r.cfg.op)
                                    : "a power of two up to " + std::to_string(cuda::kChunk)) +
                             " on a CUDA device, got " + std::to_string(r.chunk));
  if (r.traits.delta) return;  // the delta sweeps keep their matrices in global scratch (delta/)
  const size_t optin = cuda::smem_optin();
  const size_t need = HILA_DTYPE_SWITCH(dt, T, [&] {
    return cuda::compose_smem_need<T>(cuda::pad16(r.dk), cuda::pad16(r.dvp), r.traits.loglinear);
  });
  if (need > optin)
    throw Error("dk", std::string("expected head dims whose tiles fit in shared memory (") +
                          std::to_string(optin) + " bytes per block on this device), got dk = " +
                          std::to_string(r.dk) + ", dv = " + std::to_string(r.dv) + " in " + dtype_name(dt) +
                          ", which needs " + std::to_string(need) + "; use bfloat16/float16 or smaller head dims");
}

namespace {

// The composition in the operand type T, for p's direction.
template <class T>
void compose(const Resolved& r, const ForwardParams& p, cudaStream_t s) {
  cuda::compose_forward<T>(r, p, s);
}
template <class T>
void compose(const Resolved& r, const BackwardParams& p, cudaStream_t s) {
  cuda::compose_backward<T>(r, p, s);
}
template <class P>
void compose_dtype(const Resolved& r, const P& p, cudaStream_t s) {
  HILA_DTYPE_SWITCH(p.q.dtype, T, [&] { compose<T>(r, p, s); });
}

// Runs the call on the caller's workspace when there is one (after checking its size and device),
// else on the pool.
template <class P>
void run_call(const Resolved& r, const P& p) {
  cuda::DeviceScope scope(p.q.device.index);
  cuda_check_supported(r, p.q.dtype);
  const auto s = static_cast<cudaStream_t>(p.stream);
  if (!p.workspace) return compose_dtype(r, p, s);
  cudaPointerAttributes at{};
  HILA_CUDA_CHECK(cudaPointerGetAttributes(&at, p.workspace));
  if ((at.type != cudaMemoryTypeDevice && at.type != cudaMemoryTypeManaged) || at.device != p.q.device.index)
    throw Error("workspace", "expected device memory on " + device_name(p.q.device) + " (like q), got " +
                                 (at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged
                                      ? "memory of cuda:" + std::to_string(at.device)
                                      : std::string("host memory")));
  const size_t need = cuda_workspace_size(r, p);
  if (p.workspace_bytes < need)
    throw Error("workspace_bytes", "expected at least " + std::to_string(need) +
                                       " bytes for this call (hila::workspace_size), got " + std::to_string(p.workspace_bytes));
  cuda::Arena arena(p.workspace, p.workspace_bytes);
  const cuda::ArenaScope in(&arena);
  compose_dtype(r, p, s);
}

// The call as a dry run under a measuring arena: the peak of its temporaries.
template <class P>
size_t measure(const Resolved& r, const P& p) {
  cuda::DeviceScope scope(p.q.device.index);
  cuda_check_supported(r, p.q.dtype);
  cuda::Arena arena(nullptr, 0);
  {
    const cuda::ArenaScope in(&arena);
    compose_dtype(r, p, static_cast<cudaStream_t>(p.stream));
  }
  return arena.peak() ? arena.peak() + 256 : 0;  // + the slack of aligning the caller's pointer
}

}  // namespace

void cuda_forward(const Resolved& r, const ForwardParams& p) { run_call(r, p); }
void cuda_backward(const Resolved& r, const BackwardParams& p) { run_call(r, p); }
size_t cuda_workspace_size(const Resolved& r, const ForwardParams& p) { return measure(r, p); }
size_t cuda_workspace_size(const Resolved& r, const BackwardParams& p) { return measure(r, p); }

size_t cuda_step_counter_bytes(int64_t N, int64_t H) { return cuda::step_counter_bytes(N, H); }

void cuda_step(const Resolved& r, const StepParams& p, const StateView& state, void* counters) {
  cuda::DeviceScope scope(p.q.device.index);
  if (r.dk > cuda::kStepMaxDk)
    throw Error("q", "expected head dim dk <= " + std::to_string(cuda::kStepMaxDk) +
                         " for a decode step on a CUDA device, got " + std::to_string(r.dk));
  const cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  HILA_DTYPE_SWITCH(p.q.dtype, T, [&] { cuda::decode_step<T>(r, p, state, counters, s); });
}

}  // namespace hila::detail
