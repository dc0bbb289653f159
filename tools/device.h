// SPDX-License-Identifier: Apache-2.0
// Running hila calls on a CUDA device from the CLI, whose tensors live in host memory: inputs are
// copied to the device, outputs get device buffers (poisoned: all bits set) and are copied back into
// the host memory of the views they mirror. Without a CUDA backend in this build every function
// that would touch a device throws hila::Error("device").
#pragma once
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "hila/hila.h"
#include "problem.h"

namespace hila::tools {

// Whether this build has the CUDA backend and the machine has a CUDA device.
bool cuda_device_present();

// "cpu", "cuda", "cuda:N", or "auto" (the first CUDA device when there is one, else the CPU).
Device parse_device_name(const std::string& name);

class DeviceMirror {
 public:
  explicit DeviceMirror(Device dev);
  ~DeviceMirror();
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;
  // A device copy of a contiguous host view (absent -> absent).
  TensorView input(const TensorView& host);
  StateView input(const StateView& host);
  // A poisoned device buffer for a contiguous host view, copied back to it by finish().
  TensorView output(const TensorView& host);
  StateView output(const StateView& host);
  // A poisoned device buffer of `bytes` (a workspace), freed with the mirror.
  void* scratch(size_t bytes);
  // Waits for the device, copies every output back to its host view. Idempotent.
  void finish();

 private:
  struct Block;
  Device dev_;
  std::vector<std::unique_ptr<Block>> blocks_;
};

// Thrown by a Temporaries::graph / graph_pool call where stream capture is not available.
struct GraphCaptureUnsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Waits for all work on `dev` (nothing for the CPU).
void device_synchronize(Device dev);

// Host copy of a contiguous device state (e.g. DecodeState::view() of a CUDA state).
StateBuffers fetch_state(const StateView& dev);

// hila::forward / hila::backward with host-memory params run on `dev` (the CPU: called as they are),
// their temporaries from `tmp` (problem.h).
void forward_on(const ForwardParams& p, Device dev, Temporaries tmp = Temporaries::pool);
void backward_on(const BackwardParams& p, Device dev, Temporaries tmp = Temporaries::pool);

// The view of token t of a [1, T, ...] view (any device): the T axis dropped.
TensorView token_of(const TensorView& full, int64_t t);

}  // namespace hila::tools
