// SPDX-License-Identifier: Apache-2.0
// The decode step's inner S stage (hla2, hla3; block.cuh) on the packed symmetric [dk, dk] state
// (upper triangle, row-major):  S <- a_S S + k k^T,  u = S q + ridge q, into s_key (the outer
// primitive's key; k itself for the other ops).
#pragma once
#include "cuda/step/block.cuh"

namespace hila::cuda::decode {


// Offset of row i of the packed upper triangle, shifted so that row[j] = S_ij for j >= i.
__device__ __forceinline__ int64_t sym_row(int i, int dk) {
  return int64_t(i) * dk - int64_t(i) * (i - 1) / 2 - i;
}

// One sweep over the packed S (row-major upper triangle) of x_ij = a S_ij + k_i k_j: `store`
// writes x back; `accumulate` adds u = x q in two parts: row i's sum_{j>=i} x_ij q_j (a warp sum,
// to s_row[i]) and, by symmetry, x_ij q_i for j > i to the lane's column accumulators
// colacc[m] (j = lane + 32 m), which the caller sums over warps. Warp w takes rows w, w + kWarps,
// ..., kB rows at a time with all their loads issued first.
template <class R, int kM>
__device__ void sym_sweep(R* S, int dk, R aS, const R* s_k, const R* s_q, bool accumulate, bool store,
                          R* s_row, R (&colacc)[kM]) {
  constexpr int kB = kM >= 8 ? 2 : 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  for (int i0 = warp; i0 < dk; i0 += kWarps * kB) {
    R x[kB][kM];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int i = i0 + kWarps * b;
      const R* row = S + sym_row(i, dk);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const int j = lane + 32 * m;
        x[b][m] = (i < dk && j >= i && j < dk) ? row[j] : R(0);
      }
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int i = i0 + kWarps * b;
      if (i >= dk) break;  // uniform over the warp
      R* row = S + sym_row(i, dk);
      const R ki = s_k[i], qi = s_q[i];
      R ra = 0;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const int j = lane + 32 * m;
        if (j >= i && j < dk) {
          const R y = aS * x[b][m] + ki * s_k[j];
          if (store) row[j] = y;
          ra += y * s_q[j];
          if (j > i) colacc[m] += y * qi;
        }
      }
      if (accumulate) {
        ra = warp_sum(ra);
        if (lane == 0) s_row[i] = ra;
      }
    }
  }
}

// S in shared memory (packed, as in the state): u = S q (before the update; the caller adds the
// rank-1 and ridge terms). Thread (i, part) sums S_ij q_j over its part of j, with S_ij read at
// packed[sym_row(min(i, j)) + max(i, j)]; the loop is the same length in every lane of a warp.
// s_part: [kThreads] partials; u: [dk].
template <class R>
__device__ void sym_matvec(const R* sS, int dk, const R* s_q, R* s_part, R* u) {
  const int nsplit = max(1, kThreads / dk);
  const int t = threadIdx.x;
  if (t < nsplit * dk) {
    const int i = t % dk, part = t / dk;
    const int j0 = part * dk / nsplit, j1 = (part + 1) * dk / nsplit;
    const int ro = int(sym_row(i, dk));      // row i: S_ij = sS[ro + j], j >= i
    int co = int(sym_row(j0, dk)) + i;       // column i: S_ji = sS[sym_row(j) + i], j < i
    R acc = 0;
    for (int j = j0; j < j1; ++j) {
      acc += sS[j < i ? co : ro + j] * s_q[j];
      co += dk - j - 1;  // sym_row(j + 1) - sym_row(j)
    }
    s_part[t] = acc;
  }
  __syncthreads();
  for (int i = t; i < dk; i += kThreads) {
    R x = 0;
    for (int p = 0; p < nsplit; ++p) x += s_part[p * dk + i];
    u[i] = x;
  }
}

// S <- a S + k k^T from the copy in shared memory to the state, a warp per row, lanes along it.
template <class R>
__device__ void sym_update(const R* sS, R* S, int dk, R aS, const R* s_k) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  for (int i = warp; i < dk; i += kWarps) {
    const int64_t o = sym_row(i, dk);
    const R ki = s_k[i];
    for (int j = i + lane; j < dk; j += 32) S[o + j] = aS * sS[o + j] + ki * s_k[j];
  }
}


template <class T, int kRows, bool kFenwick>
__device__ __forceinline__ void StepBlock<T, kRows, kFenwick>::inner_S() {
  if (a.has_S) {
    const R aS = gate(0);
    R* S = a.S + row * a.Ss0 + h * a.Ss1;
    constexpr int kM = kRows * kWarps / 32;  // >= dk / 32
    R colacc[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) colacc[m] = 0;
    // With several column tiles every block of (n, h) needs all of S: each reads it, and the last
    // block to finish reading (a counter per (n, h)) writes the update.
    const bool shared_S = a.tiles > 1;
    if (a.s_smem) {
      // u = aS (S q) + k (k.q) + ridge q from the copy (the oldest cp.async group: at most the
      // `stages` ring groups are still pending); the update is written from the same copy.
      cp_async_wait_upto(a.stages);
      __syncthreads();
      R kq = 0;
      for (int c = tid; c < dk; c += kThreads) kq += s_k[c] * s_q[c];
      kq = block_sum(kq, s_red);
      sym_matvec(s_S, dk, s_q, s_colpart, s_key);
      __syncthreads();
      for (int j = tid; j < dk; j += kThreads) s_key[j] = aS * s_key[j] + kq * s_k[j] + a.ridge * s_q[j];
    } else {
      sym_sweep<R, kM>(S, dk, aS, s_k, s_q, true, !shared_S, s_key, colacc);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const int j = lane + 32 * m;
        if (j < dk) s_colpart[warp * dk + j] = colacc[m];
      }
      __syncthreads();
      for (int j = tid; j < dk; j += kThreads) {
        R u = s_key[j];
        for (int w = 0; w < kWarps; ++w) u += s_colpart[w * dk + j];
        s_key[j] = u + a.ridge * s_q[j];
      }
    }
    bool last = true;  // this block writes the update
    if (shared_S) {
      __shared__ int s_last;
      if (tid == 0) {
        __threadfence();
        s_last = arrive(a.s_count + int64_t(n) * a.H + h, unsigned(a.tiles));
      }
      __syncthreads();
      last = s_last;
    }
    if (last && a.s_smem) sym_update(s_S, S, dk, aS, s_k);
    else if (last && shared_S) sym_sweep<R, kM>(S, dk, aS, s_k, s_q, false, true, s_key, colacc);
  } else {
    for (int c = tid; c < dk; c += kThreads) s_key[c] = s_k[c];
  }
  __syncthreads();
  __syncthreads();
}

}  // namespace hila::cuda::decode
