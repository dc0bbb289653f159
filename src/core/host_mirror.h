// SPDX-License-Identifier: Apache-2.0
// Host copies of (possibly device-resident) tensors, for the few places validation must read
// values: cu_seqlens, state positions, and the value checks. A device backend registers its copy
// function; CPU tensors are viewed in place.
#pragma once
#include <cstddef>
#include <vector>

#include "hila/tensor.h"

namespace hila::detail {

// Copies run on the stream of the call being validated (see StreamScope), after the work already
// queued there, so that inputs produced on that stream are read when they are ready.
using DeviceToHostFn = void (*)(void* dst, const void* src, size_t bytes, int device, void* stream);
void register_device_to_host(DeviceToHostFn fn);

// Device-side value scan: the row-major index of the first element of t that is non-finite (or,
// with gates, > 0), or -1. Lets value checks of device tensors read 8 bytes back instead of the
// whole tensor. Registered by the device backend.
using DeviceScanFn = int64_t (*)(const TensorView& t, bool gates, void* stream);
void register_device_scan(DeviceScanFn fn);
// -2 when no scan is registered for t's device (the caller falls back to a HostMirror).
int64_t device_scan(const TensorView& t, bool gates);

// Reads of device memory by the host so far in this process (device copies of HostMirror and
// device scans; each one synchronizes with the device). Tests use it to check that a call reads
// nothing back (a CUDA graph can capture no such read).
int64_t device_reads();

// The stream of the call being validated on this thread, for the duration of a scope.
class StreamScope {
 public:
  explicit StreamScope(void* stream);
  ~StreamScope();

 private:
  void* prev_;
};

class HostMirror {
 public:
  explicit HostMirror(const TensorView& t);
  const TensorView& view() const { return view_; }

 private:
  std::vector<unsigned char> buf_;
  TensorView view_;
};

}  // namespace hila::detail
