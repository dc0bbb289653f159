// SPDX-License-Identifier: Apache-2.0
// The entry points above core and the backends (dispatch.cpp): what decode.cpp calls to step.
#pragma once
#include "core/problem.h"

namespace hila::detail {

// Runs a validated step on the backend of q's device, then (check_values) checks o. `counters`: a
// CUDA DecodeState's step counters or the caller's StepParams::counters (see cuda/backend.h), or
// nullptr; the CPU backend does not use them.
void run_step(const Resolved& r, const StepParams& p, const StateView& state, void* counters = nullptr);

}  // namespace hila::detail
