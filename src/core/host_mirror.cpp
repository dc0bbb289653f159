// SPDX-License-Identifier: Apache-2.0
#include "core/host_mirror.h"

#include <atomic>

#include "hila/error.h"

namespace hila::detail {

namespace {
DeviceToHostFn g_copy = nullptr;
DeviceScanFn g_scan = nullptr;
thread_local void* g_stream = nullptr;
std::atomic<int64_t> g_reads{0};
}  // namespace

int64_t device_reads() { return g_reads.load(); }

void register_device_to_host(DeviceToHostFn fn) { g_copy = fn; }
void register_device_scan(DeviceScanFn fn) { g_scan = fn; }

StreamScope::StreamScope(void* stream) : prev_(g_stream) { g_stream = stream; }
StreamScope::~StreamScope() { g_stream = prev_; }

int64_t device_scan(const TensorView& t, bool gates) {
  if (!t.defined() || t.numel() == 0 || t.device.type == DeviceType::cpu || !g_scan) return -2;
  ++g_reads;
  return g_scan(t, gates, g_stream);
}

HostMirror::HostMirror(const TensorView& t) : view_(t) {
  if (!t.defined() || t.device.type == DeviceType::cpu || t.numel() == 0) return;
  if (!g_copy)
    throw Error("device", "expected a device this build supports, got " + device_name(t.device));
  int64_t span = 1;  // elements from the first to one past the last addressed element
  for (int i = 0; i < t.ndim; ++i) span += (t.shape[i] - 1) * t.stride[i];
  buf_.resize(static_cast<size_t>(span * dtype_size(t.dtype)));
  ++g_reads;
  g_copy(buf_.data(), t.data, buf_.size(), t.device.index, g_stream);
  view_.data = buf_.data();
  view_.device = Device{};
}

}  // namespace hila::detail
