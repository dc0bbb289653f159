// SPDX-License-Identifier: Apache-2.0
#include "core/host_mirror.h"

#include "hila/error.h"

namespace hila::detail {

namespace {
DeviceToHostFn g_copy = nullptr;
}

void register_device_to_host(DeviceToHostFn fn) { g_copy = fn; }

HostMirror::HostMirror(const TensorView& t) : view_(t) {
  if (!t.defined() || t.device.type == DeviceType::cpu || t.numel() == 0) return;
  if (!g_copy)
    throw Error("device", "expected a device this build supports, got " + device_name(t.device));
  int64_t span = 1;  // elements from the first to one past the last addressed element
  for (int i = 0; i < t.ndim; ++i) span += (t.shape[i] - 1) * t.stride[i];
  buf_.resize(static_cast<size_t>(span * dtype_size(t.dtype)));
  g_copy(buf_.data(), t.data, buf_.size(), t.device.index);
  view_.data = buf_.data();
  view_.device = Device{};
}

}  // namespace hila::detail
