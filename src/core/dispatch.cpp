// SPDX-License-Identifier: Apache-2.0
// The single place that turns a validated call into a backend call.
#include "core/problem.h"
#include "cpu/backend.h"
#include "hila/error.h"
#ifdef HILA_WITH_CUDA
#include "cuda/backend.h"
#include "cuda/step.h"
#endif

namespace hila {

namespace {
bool on_cuda(Device d) {
  if (d.type == DeviceType::cpu) return false;
#ifdef HILA_WITH_CUDA
  return true;
#else
  throw Error("device", "expected cpu (this build of hila has no CUDA backend), got " + device_name(d));
#endif
}
}  // namespace

void forward(const ForwardParams& p) {
  const detail::Resolved r = detail::resolve_forward(p);
  if (on_cuda(p.q.device)) {
#ifdef HILA_WITH_CUDA
    detail::cuda_forward(r, p);
#endif
    return;
  }
  detail::cpu_forward(r, p);
}

void backward(const BackwardParams& p) {
  const detail::Resolved r = detail::resolve_backward(p);
  if (on_cuda(p.q.device)) {
#ifdef HILA_WITH_CUDA
    detail::cuda_backward(r, p);
#endif
    return;
  }
  detail::cpu_backward(r, p);
}

namespace detail {
void run_step(const Resolved& r, const StepParams& p, const StateView& state, void* counters) {
  if (on_cuda(p.q.device)) {
#ifdef HILA_WITH_CUDA
    cuda_step(r, p, state, counters);
#endif
    return;
  }
  cpu_step(r, p, state);
}
}  // namespace detail

void step(const StepParams& p, const StateView& state) {
  detail::run_step(detail::resolve_step(p, state), p, state);
}

}  // namespace hila
