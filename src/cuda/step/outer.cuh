// SPDX-License-Identifier: Apache-2.0
// The decode step's outer primitive (block.cuh; step.cu has the math), this block's columns, key
// s_key and value v' or h, beta = 1 (mamba) or beta_t (delta):
//   every live slot l:  H_l <- a H_l  (mamba),  H_l <- a (H_l - beta key (key^T H_l))  (delta)
//   o' = lam_0 beta (q.key) val + sum_live lam_l H_l^T q  into s_oraw
//   merge (flat):       H_0 <- H_0 + beta key val^T
//   merge (Fenwick):    H_{r+1} <- sum_{l=1..r} H_l + beta key val^T, H_1..H_r <- 0, r = ctz(t+1)
#pragma once
#include "cuda/step/block.cuh"

namespace hila::cuda::decode {

template <class T, int kRows, bool kFenwick>
__device__ __forceinline__ void StepBlock<T, kRows, kFenwick>::outer() {
  const int srow = kWarps * kCols;  // stage elements between a thread's consecutive rows
  const R* s_val = a.has_P ? s_hh : s_vin;
  const R aO = gate(2);
  R qkey = 0;
  for (int c = tid; c < dk; c += kThreads) qkey += s_q[c] * s_key[c];
  qkey = block_sum(qkey, s_red);
  const R diag = s_lam[0] * beta * qkey;  // lam_0 beta (q . key)
  const int rr = kFenwick ? __ffsll(static_cast<unsigned long long>(t + 1)) - 1 : 0;  // ctz(t+1)
  const int target = kFenwick ? rr + 1 : 0;
  for (int c0 = cbeg; c0 < cend; c0 += kCols) {
    // Fenwick: the merged levels' sum, which goes to the target slot with the token
    R merged[kFenwick ? kRows : 1][kVec];
#pragma unroll
    for (int j = 0; j < (kFenwick ? kRows : 1); ++j) merged[j][0] = merged[j][1] = 0;
    R opart[kVec] = {};
    R* Ht = Hh + target * a.Hsl;
    const LaneCols<R> lc(c0, cend, Ht, a.Hs2);
    // + beta key val^T into the target (flat: slot 0 itself, in the slot loop)
    const R bv0 = lc.has(0) ? beta * s_val[lc.c] : R(0), bv1 = lc.has(1) ? beta * s_val[lc.c + 1] : R(0);
    for (int s = 0; s < items.nlive; ++s) {  // live slots in increasing level; dead ones are never read
      const int l = items.slot(s);
      R* Hl = Hh + l * a.Hsl;
      const LaneCols<R> ls(c0, cend, Hl, a.Hs2);
      const R* sx = ring_wait(s_ring, a.stages, dk, item) + warp * kCols + kVec * (tid & 31);
      R kh[kVec] = {};
      if (a.delta) {  // kh = key^T H_l (this lane's columns), then H_l <- a (H_l - beta key kh)
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          const int r = warp + kWarps * j;
          if (r >= dk) break;
          R x[kVec];
          lds2(sx + j * srow, x);
          kh[0] += s_key[r] * x[0], kh[1] += s_key[r] * x[1];
        }
        column_sum(kh, s_colred);
        kh[0] *= beta, kh[1] *= beta;
      }
      const R lw = s_lam[l];
      const bool merge = l <= rr;  // Fenwick: level l is summed into the target and cleared
      R* gx = Hl + int64_t(warp) * a.Hs2 + ls.c;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int r = warp + kWarps * j;
        if (r >= dk) break;
        R x[kVec];
        lds2(sx + j * srow, x);
        const R kr = s_key[r], lq = lw * s_q[r];
        const R y0 = aO * (x[0] - kr * kh[0]), y1 = aO * (x[1] - kr * kh[1]);
        opart[0] += lq * y0, opart[1] += lq * y1;
        if constexpr (kFenwick) {
          if (merge) merged[j][0] += y0, merged[j][1] += y1;
          ls.store(gx, merge ? R(0) : y0, merge ? R(0) : y1);
        } else {
          ls.store(gx, y0 + kr * bv0, y1 + kr * bv1);
        }
        gx += kWarps * a.Hs2;
      }
      ring_release(s_ring, a.stages, dk, items, item++);
    }
    if constexpr (kFenwick) {
      R* gx = Ht + int64_t(warp) * a.Hs2 + lc.c;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int r = warp + kWarps * j;
        if (r >= dk) break;
        const R kr = s_key[r];
        lc.store(gx, merged[j][0] + kr * bv0, merged[j][1] + kr * bv1);
        gx += kWarps * a.Hs2;
      }
    }
    column_sum(opart, s_colred);
    if (warp == 0) {
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        if (lc.has(i)) s_oraw[lc.c + i] = opart[i] + diag * s_val[lc.c + i];
    }
  }
  __syncthreads();
}

}  // namespace hila::cuda::decode
