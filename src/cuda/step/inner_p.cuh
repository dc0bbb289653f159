// SPDX-License-Identifier: Apache-2.0
// The decode step's inner P stage (ahla, hla3; block.cuh), this block's columns of the [dk, dv']
// state:  P <- a_P P + k v'^T,  h = P^T q into s_hh (the outer primitive's value; v' otherwise).
#pragma once
#include "cuda/step/block.cuh"

namespace hila::cuda::decode {

template <class T, int kRows, bool kFenwick>
__device__ __forceinline__ void StepBlock<T, kRows, kFenwick>::inner_P() {
  // Tile loops: this thread's rows are r = warp + kWarps j (the bound is uniform over the warp),
  // its columns LaneCols; sx / gx step through the stage and the global matrix row by row.
  const int srow = kWarps * kCols;  // stage elements between a thread's consecutive rows
  if (a.has_P) {
    const R aP = gate(1);
    for (int c0 = cbeg; c0 < cend; c0 += kCols) {
      const LaneCols<R> lc(c0, cend, P, a.Ps2);
      const R* sx = ring_wait(s_ring, a.stages, dk, item) + warp * kCols + kVec * (tid & 31);
      R* gx = P + int64_t(warp) * a.Ps2 + lc.c;
      const R v0 = lc.has(0) ? s_vin[lc.c] : R(0), v1 = lc.has(1) ? s_vin[lc.c + 1] : R(0);
      R part[kVec] = {};
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int r = warp + kWarps * j;
        if (r >= dk) break;
        R x[kVec];
        lds2(sx + j * srow, x);
        const R kr = s_k[r], qr = s_q[r];
        const R y0 = aP * x[0] + kr * v0, y1 = aP * x[1] + kr * v1;
        lc.store(gx, y0, y1);
        gx += kWarps * a.Ps2;
        part[0] += qr * y0, part[1] += qr * y1;
      }
      ring_release(s_ring, a.stages, dk, items, item++);
      column_sum(part, s_colred);
      if (warp == 0) {
#pragma unroll
        for (int i = 0; i < kVec; ++i)
          if (lc.has(i)) s_hh[lc.c + i] = part[i];
      }
    }
    __syncthreads();
  }
}

}  // namespace hila::cuda::decode
