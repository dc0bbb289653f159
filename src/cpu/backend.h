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

// Rows per segment of the CPU chunk form: the chunk C, or a smaller power of two where the
// arithmetic is smaller. A segment of R rows is a sequence of [R, R] masked products (about R d
// multiply-adds per row each; the delta rule also forms its [R, R] triangular inverse and products
// with it, about R^2 per row) next to state reads and writes of about dk dv per row per segment
// boundary crossed by a read. Per row: R d (+ R^2 for delta) against d^2 / R... minimised near
// R = d (mamba) and R = d / 2 (delta); below 32 (mamba) or 16 (delta) rows the per-segment setup
// costs more than it saves. Cutting a chunk into segments that never cross a multiple of R (which
// divides C) is the same operator (docs/math/LOGLINEAR.md §3.3), so this is a tiling choice: the
// results differ from a cut at C by rounding only. For dk, dv >= 64 (mamba) or 128 (delta) the
// segment is the chunk.
constexpr int64_t cpu_segment_rows(int64_t chunk, int64_t dk, int64_t dv, bool delta) {
  int64_t d = 1;
  while (d < dk || d < dv) d *= 2;  // max(dk, dv) rounded up to a power of two
  const int64_t R = delta ? (d / 2 > 16 ? d / 2 : 16) : (d > 32 ? d : 32);
  return chunk < R ? chunk : R;
}

}  // namespace hila::detail
