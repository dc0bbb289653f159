// SPDX-License-Identifier: Apache-2.0
// The single place that turns a validated call into a backend call: hila::forward, backward,
// workspace_size and step (include/hila/ops.h) validate with src/core and run on the backend of
// q's device (src/cpu or src/cuda).
#include <string>

#include "api/dispatch.h"
#include "core/host_mirror.h"
#include "core/problem.h"
#include "cpu/backend.h"
#include "hila/error.h"
#ifdef HILA_WITH_CUDA
#include "cuda/backend.h"
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


// workspace and workspace_bytes come together.
void check_workspace(const ForwardParams& p) {
  if (p.workspace_bytes > 0 && !p.workspace)
    throw Error("workspace", "expected a device pointer with workspace_bytes = " + std::to_string(p.workspace_bytes) +
                                 ", got nullptr");
  if (p.workspace && p.workspace_bytes == 0)
    throw Error("workspace_bytes", "expected the size of workspace in bytes (hila::workspace_size), got 0");
}
}  // namespace

// The output checks (check_values) run here for every backend: on the CPU over host memory, on a
// device through the device scan, on the call's stream.
void forward(const ForwardParams& p) {
  check_workspace(p);
  const detail::Resolved r = detail::resolve_forward(p);
  if (on_cuda(p.q.device)) {
#ifdef HILA_WITH_CUDA
    detail::cuda_forward(r, p);
#endif
  } else {
    detail::cpu_forward(r, p);
  }
  if (!r.cfg.check_values) return;
  const detail::StreamScope scope(p.stream);
  detail::check_forward_outputs(r, p);
}

void backward(const BackwardParams& p) {
  check_workspace(p);
  const detail::Resolved r = detail::resolve_backward(p);
  if (on_cuda(p.q.device)) {
#ifdef HILA_WITH_CUDA
    detail::cuda_backward(r, p);
#endif
  } else {
    detail::cpu_backward(r, p);
  }
  if (!r.cfg.check_values) return;
  const detail::StreamScope scope(p.stream);
  detail::check_backward_outputs(r, p);
}

// The size query validates like the call (without the value scans) and dry-runs the backend.
template <class P>
size_t measure(const P& p, detail::Resolved (*resolve)(const P&)) {
  P q = p;
  q.cfg.check_values = false;
  q.workspace = nullptr, q.workspace_bytes = 0;
  const detail::Resolved r = resolve(q);
  if (!on_cuda(q.q.device)) return 0;
#ifdef HILA_WITH_CUDA
  return detail::cuda_workspace_size(r, q);
#else
  return 0;
#endif
}

size_t workspace_size(const ForwardParams& p) { return measure(p, &detail::resolve_forward); }
size_t workspace_size(const BackwardParams& p) { return measure(p, &detail::resolve_backward); }

namespace detail {
void run_step(const Resolved& r, const StepParams& p, const StateView& state, void* counters) {
  if (on_cuda(p.q.device)) {
#ifdef HILA_WITH_CUDA
    cuda_step(r, p, state, counters);
#endif
  } else {
    cpu_step(r, p, state);
  }
  if (!r.cfg.check_values) return;
  const StreamScope scope(p.stream);
  check_step_outputs(r, p, state);
}
}  // namespace detail

int64_t step_counters_size(int64_t N, int64_t H) { return N + N * H; }

// The caller's counters (validated by resolve_step) reach the CUDA backend; the CPU ignores them.
void step(const StepParams& p, const StateView& state) {
  detail::run_step(detail::resolve_step(p, state), p, state, p.counters.defined() ? p.counters.data : nullptr);
}

}  // namespace hila
