// SPDX-License-Identifier: Apache-2.0
// The single place that turns a validated call into a backend call.
#include "core/problem.h"
#include "cpu/backend.h"
#include "hila/error.h"

namespace hila {

namespace {
void require_backend(Device d) {
  if (d.type == DeviceType::cpu) return;
  throw Error("device", "expected cpu (this build of hila has no CUDA backend), got " +
                            device_name(d));
}
}  // namespace

void forward(const ForwardParams& p) {
  const detail::Resolved r = detail::resolve_forward(p);
  require_backend(p.q.device);
  detail::cpu_forward(r, p);
}

void backward(const BackwardParams& p) {
  const detail::Resolved r = detail::resolve_backward(p);
  require_backend(p.q.device);
  detail::cpu_backward(r, p);
}

}  // namespace hila
