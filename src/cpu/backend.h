// SPDX-License-Identifier: Apache-2.0
#pragma once
#include "core/problem.h"

namespace hila::detail {

void cpu_forward(const Resolved& r, const ForwardParams& p);
void cpu_backward(const Resolved& r, const BackwardParams& p);
// One decode step; `state` views hold capacity for slots(pos + 1) already.
void cpu_step(const Resolved& r, const StepParams& p, const StateView& state);

// Launch policy: whether `items` (sequence, head) pairs of `work` multiply-adds each (a rough
// count) run in an OpenMP parallel region. A region costs thread wake-up and a barrier (tens of
// microseconds when the cores are busy with other work), so a call runs serially unless there
// are several items and about a millisecond of work in all: 2^22 multiply-adds.
constexpr int64_t kCpuParallelWork = int64_t(1) << 22;
constexpr bool cpu_parallel(int64_t items, int64_t work) {
  return items > 1 && work > 0 && items * work >= kCpuParallelWork;
}

}  // namespace hila::detail
