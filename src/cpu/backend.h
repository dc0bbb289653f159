// SPDX-License-Identifier: Apache-2.0
#pragma once
#include "core/problem.h"

namespace hila::detail {

void cpu_forward(const Resolved& r, const ForwardParams& p);
void cpu_backward(const Resolved& r, const BackwardParams& p);
// One decode step; `state` views hold capacity for slots(pos + 1) already.
void cpu_step(const Resolved& r, const StepParams& p, const StateView& state);

}  // namespace hila::detail
