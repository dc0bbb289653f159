// SPDX-License-Identifier: Apache-2.0
// Exact state resets inside a chunk (docs/OPERATORS.md "Resets"). A reset row is one whose packed
// log-gate is at the floor kGateFloor (prims/pack.cuh). The chunk-local cumsum b is used as e^{b_i}
// (the state entering the chunk, seen by row i) and e^B: a sum holding the floor has an exponential
// of exactly 0, and the rows before the first reset take their b from the segmented scan below (the
// plain pair scan rounds b[2l] with the floor when row 2l+1 is a reset). b is not exact as a
// difference b_i - b_j of two sums that both hold a floor: each carries the rounding of a sum of size
// |floor|. So a chunk with a reset decays with the gates after its last reset alone:
//   last[i] = the last reset row <= i in the chunk (-1: none)
//   bs[i]   = sum_{last[i] < r <= i} g_r                      (segment-relative cumsum; 0 at a reset row)
//   Gamma_{i,j} = j < last[i] ? 0 : exp(bs[i] - bs[j])        (j <= i; a reset in (j, i] gives 0)
//   w_j = e^{r_j} = j < last[C-1] ? 0 : exp(bs[C-1] - bs[j])  (the state update's row weights)
// and the chunk's gate gradient stops at the next reset (chunk_dg_resets, chunk_dg_serial). A chunk
// without a reset (the vote in chunk_cumsum_resets or chunk_resets_serial) takes the plain forms
// (differences of b) and pays one vote per chunk. Users: the portable GLA kernels
// (gla/sweep_portable.cu, gla/bwd_chunk_portable.cu), the log-linear segment sweep
// (loglinear/sweep_portable.cu) and the portable delta-rule kernels (delta/segment_portable.cu),
// where a segment (the rows of one aligned chunk in the call) is the chunk here.
#pragma once
#include <type_traits>

#include "cuda/prims/pack.cuh"
#include "cuda/prims/tile.cuh"

namespace hila::cuda {

// Shared-memory arrays of one chunk's reset structure: bs, last [kChunk], any [1] (a reset in the
// chunk; bs and last are written only then).
template <class R>
struct ChunkResets {
  R* bs;
  int* last;
  int* any;
};

// chunk_cumsum (b) plus the chunk's reset structure z (above). One warp; ends with a barrier.
template <class R>
__device__ void chunk_cumsum_resets(R* b, const ChunkResets<R>& z, const R* g, int64_t r0, int nr) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, i0 = 2 * lane, i1 = i0 + 1;
    const R g0 = (g && i0 < nr) ? g[r0 + i0] : R(0);
    const R g1 = (g && i1 < nr) ? g[r0 + i1] : R(0);
    R x0 = g0, x1 = g1;
    warp_pair_cumsum(x0, x1);
    b[i0] = x0;
    b[i1] = x1;
    const bool f0 = g0 <= kGateFloor<R>, f1 = g1 <= kGateFloor<R>;
    const bool any = __any_sync(0xffffffffu, f0 || f1);
    if (lane == 0) *z.any = any;
    if (any) {  // warp-uniform
      // Segmented inclusive scan over the lane pairs. A piece is (l, s): the last reset row in it
      // (-1: none) and the sum of its gates after that reset; (l1, s1) then (l2, s2) is
      // (max(l1, l2), l2 >= 0 ? s2 : s1 + s2).
      int l = f1 ? i1 : f0 ? i0 : -1;
      R s = f1 ? R(0) : f0 ? g1 : g0 + g1;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int yl = __shfl_up_sync(0xffffffffu, l, off);
        const R ys = __shfl_up_sync(0xffffffffu, s, off);
        if (lane >= off) {
          if (l < 0) s = ys + s;
          l = yl > l ? yl : l;
        }
      }
      int el = __shfl_up_sync(0xffffffffu, l, 1);  // the pieces before this lane's pair
      R es = __shfl_up_sync(0xffffffffu, s, 1);
      if (lane == 0) el = -1, es = R(0);
      const int l0 = f0 ? i0 : el, l1 = f1 ? i1 : l0;
      const R s0 = f0 ? R(0) : es + g0, s1 = f1 ? R(0) : s0 + g1;
      z.last[i0] = l0;
      z.last[i1] = l1;
      z.bs[i0] = s0;
      z.bs[i1] = s1;
      // b before the first reset is bs (warp_pair_cumsum forms b[2l] as b[2l+1] - g[2l+1] + g[2l],
      // which cancels when g[2l+1] is the floor); from the first reset on e^b = 0 either way.
      if (l0 < 0) b[i0] = s0;
      if (l1 < 0) b[i1] = s1;
    }
  }
  __syncthreads();
}

// The intra-chunk decays Gamma_{i,j} (j <= i) and the state update's row weights w_j = e^{B - b_j}
// of one chunk: kReset = false the plain differences of b, kReset = true the segment-relative forms.
template <class R, bool kR>
struct ChunkDecay {
  static constexpr bool kReset = kR;
  const R* b;
  ChunkResets<R> z;
  R B;     // b[C-1] (kReset: bs[C-1])
  int L;   // kReset: last[C-1], the chunk's last reset
  __device__ __forceinline__ R gamma(int i, int j) const {
    if constexpr (kReset) return j < z.last[i] ? R(0) : R(exp(z.bs[i] - z.bs[j]));
    else return R(exp(b[i] - b[j]));
  }
  __device__ __forceinline__ R weight(int j) const {
    if constexpr (kReset) return j < L ? R(0) : R(exp(B - z.bs[j]));
    else return R(exp(B - b[j]));
  }
};

// f(ChunkDecay<R, kReset>) with kReset = whether the chunk has a reset (after chunk_cumsum_resets'
// barrier): two instantiations of f, the one without resets the plain code.
template <class R, class F>
__device__ __forceinline__ void with_chunk_decay(const R* b, const ChunkResets<R>& z, F&& f) {
  if (*z.any) f(ChunkDecay<R, true>{b, z, z.bs[kChunk - 1], z.last[kChunk - 1]});
  else f(ChunkDecay<R, false>{b, z, b[kChunk - 1], -1});
}

// chunk_dg for a chunk with resets: the gate gradient of row s sums the rows' dc up to the next
// reset (exclusive), and D only where no reset follows s in the chunk,
//   dg_s = dc_s + [s+1 is not a reset] dg_{s+1},   dg_{C-1} = dc_{C-1} + D,
// since the part from a reset L on is the gradient of the reset gate, a_L (...) = 0 (it would only
// add the rounding of its cancelling sum). The reset rows' own dg is replaced by 0 when unpacked.
// Lane l holds rows 2l, 2l+1 in x0, x1; one warp, every lane.
template <class R>
__device__ __forceinline__ void chunk_dg_resets(R* out, R x0, R x1, R D, int nr, const ChunkResets<R>& z) {
  const int lane = threadIdx.x & 31, i0 = 2 * lane, i1 = i0 + 1;
  const bool f1 = z.last[i1] == i1;
  const int fn = __shfl_down_sync(0xffffffffu, int(z.last[i0] == i0), 1);  // row i1 + 1 a reset
  const bool c0 = f1, c1 = lane < 31 && fn;  // the cut after row i0, after row i1
  // The pair as y -> A + P y (y: dg of the row after it); the suffix scan composes them.
  R A = x0 + (c0 ? R(0) : x1);
  bool P = !c0 && !c1;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const R yA = __shfl_down_sync(0xffffffffu, A, off);
    const int yP = __shfl_down_sync(0xffffffffu, int(P), off);
    if (lane + off < 32) {
      if (P) A += yA;
      P = P && yP;
    }
  }
  R nA = __shfl_down_sync(0xffffffffu, A, 1);  // the pairs after this one, applied to D
  const int nP = __shfl_down_sync(0xffffffffu, int(P), 1);
  const R y = lane == 31 ? D : nA + (nP ? D : R(0));
  const R d1 = x1 + (c1 ? R(0) : y);
  const R d0 = x0 + (c0 ? R(0) : d1);
  if (i0 < nr) out[i0] = d0;
  if (i1 < nr) out[i1] = d1;
}

// The reset structure z of the chunk of rows [r0, r0 + nr) of g (nullptr: no gates), serially by
// the calling thread, for the kernels that form b as a serial cumsum (exact before the chunk's
// first reset); the barrier is the caller's.
template <class R>
__device__ void chunk_resets_serial(const ChunkResets<R>& z, const R* g, int64_t r0, int nr) {
  int last = -1;
  R bs = 0;
  for (int i = 0; i < kChunk; ++i) {
    const R gi = (g && i < nr) ? g[r0 + i] : R(0);
    if (gi <= kGateFloor<R>) last = i, bs = R(0);
    else bs += gi;
    z.last[i] = last;
    z.bs[i] = bs;
  }
  *z.any = last >= 0;
}

// The gate gradient of a chunk's nr rows, serially (one thread), from the partials dc(i) of the
// loss in the sum b'_i that row i's decays were formed from and D in b'_{nr-1} as the state
// update's B' (the sum over the chunk):
//   kReset = false (b' = b):   dg_i = D + sum_{i <= r < nr} dc(r)                 (reverse cumsum)
//   kReset = true  (b' = bs):  dg_i = dc(i) + [row i+1 is not a reset] dg_{i+1},  dg_{nr-1} = dc(nr-1) + D
// since bs_r holds g_i iff i <= r and no reset lies in [i, r] (a reset row's own dg is replaced by
// 0 when unpacked). out: [nr].
template <bool kReset, class R, class F>
__device__ __forceinline__ void chunk_dg_serial(R* out, F&& dc, R D, int nr, const ChunkResets<R>& z) {
  R acc = D;
  for (int i = nr - 1; i >= 0; --i) {
    if constexpr (kReset) {
      if (i + 1 < nr && z.last[i + 1] == i + 1) acc = R(0);
    }
    out[i] = (acc += dc(i));
  }
}

}  // namespace hila::cuda
