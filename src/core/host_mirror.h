// SPDX-License-Identifier: Apache-2.0
// Host copies of (possibly device-resident) tensors, for the few places validation must read
// values: cu_seqlens, state positions, and the value checks. A device backend registers its copy
// function; CPU tensors are viewed in place.
#pragma once
#include <cstddef>
#include <vector>

#include "hila/tensor.h"

namespace hila::detail {

using DeviceToHostFn = void (*)(void* dst, const void* src, size_t bytes, int device);
void register_device_to_host(DeviceToHostFn fn);

class HostMirror {
 public:
  explicit HostMirror(const TensorView& t);
  const TensorView& view() const { return view_; }

 private:
  std::vector<unsigned char> buf_;
  TensorView view_;
};

}  // namespace hila::detail
