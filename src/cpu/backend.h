// SPDX-License-Identifier: Apache-2.0
#pragma once
#include "core/problem.h"

namespace hila::detail {

void cpu_forward(const Resolved& r, const ForwardParams& p);
void cpu_backward(const Resolved& r, const BackwardParams& p);
// One decode step; `state` views hold capacity for slots(pos + 1) already.
void cpu_step(const Resolved& r, const StepParams& p, const StateView& state);

// Launch policy: whether `items` (sequence, head) pairs of `work` multiply-adds each (a rough
// count) run in an OpenMP parallel region. A region costs a few microseconds while the pool's
// threads are awake (libgomp's threads spin for a while after each region; where torch's wheel
// bundles libgomp under the soname libgomp.so.1, as torch 2.15's does, torch's intra-op regions
// and hila's share that one pool), more when they must be woken.
// 2^16 multiply-adds in all (about 5 to 10 us of serial work: B = 1, T = 64, H = 2, d = 16 for
// gla is 2^17) pays for one at two threads; a region is about as fine-grained as torch's own
// at::parallel_for, whose grain is 32768 elements. One item runs serially.
constexpr int64_t kCpuParallelWork = int64_t(1) << 16;
constexpr bool cpu_parallel(int64_t items, int64_t work) {
  return items > 1 && work > 0 && items * work >= kCpuParallelWork;
}

// Rows per segment of the CPU chunk form: the chunk C, or a smaller power of two R where that is
// faster. Per row, a segment of R rows costs about R d multiply-adds in each of its [R, R] masked
// products (q k^T, P V, dO V^T, ...) and, for the delta rule, about R^2 more in its [R, R]
// triangular inverse and the products with it; its state reads and writes cost about dk dv per
// row whatever R; and each segment adds a fixed cost (its setup, the calls of its products, which
// run at lower efficiency below 16 columns). With d = max(dk, dv) rounded up to a power of two,
// cpu_bench (docs/PERFORMANCE.md) finds the fastest segment near R = max(32, d) for mamba and
// R = max(16, d / 2) for the flat delta rule, whose R^2 term grows faster, and R = max(32, d / 2)
// for the Fenwick delta rule (loglinear_gdn), whose per-segment work over the incoming levels and
// the token groups of the state update is larger. Segments that never cross a
// multiple of R (a divisor of C) give the same operator (docs/math/LOGLINEAR.md §3.3), so this is
// a tiling choice: the results differ from segments of C by rounding only. For d >= 64 (mamba)
// or 128 (delta) the segment is the chunk (C = 64).
constexpr int64_t cpu_segment_rows(int64_t chunk, int64_t dk, int64_t dv, bool delta,
                                   bool fenwick = false) {
  int64_t d = 1;
  while (d < dk || d < dv) d *= 2;  // max(dk, dv) rounded up to a power of two
  const int64_t lo = fenwick ? 32 : 16;  // the delta rule's fewest rows
  const int64_t R = delta ? (d / 2 > lo ? d / 2 : lo) : (d > 32 ? d : 32);
  return chunk < R ? chunk : R;
}

}  // namespace hila::detail
