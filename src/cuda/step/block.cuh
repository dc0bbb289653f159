// SPDX-License-Identifier: Apache-2.0
// One block of the decode step's kernel (kernel.cu): its context (its sequence, head, columns and
// shared buffers) and its stages, defined one per file of this folder:
//   inputs.cuh   the state tiles start streaming in (ring.cuh); q (scaled), k, v' = [v | 1], lam
//   inner_s.cuh  inner S (hla2, hla3):  S <- a_S S + k k^T,  u = S q (+ ridge q)
//   inner_p.cuh  inner P (ahla, hla3):  P <- a_P P + k v'^T, h = P^T q
//   outer.cuh    the outer primitive over the live slots (flat or Fenwick, mamba or delta), o'
//   output.cuh   o in v's dtype (normalize), and pos += 1 by the last block of the sequence
#pragma once
#include "cuda/step/args.cuh"
#include "cuda/step/reduce.cuh"
#include "cuda/step/ring.cuh"

namespace hila::cuda::decode {

// One block of the step kernel: grid x = sequence * tiles + tile, y = head; the stages run in the
// order of the members below, each a file of this folder. Thread layout inside a column chunk:
// warp = row group, lane = column (kVec columns each); the thread's state rows r = warp + kWarps j,
// j < kRows, are held in registers.
template <class T, int kRows, bool kFenwick>
struct StepBlock {
  using R = Acc<T>;
  const StepArgs<T>& a;
  // shared memory (Smem)
  R *s_ring, *s_S, *s_q, *s_k, *s_key, *s_vin, *s_hh, *s_oraw, *s_lam, *s_red, *s_colred, *s_colpart;
  int tid, lane, warp;
  int n, tile, h, grp, dk, dvp;
  int64_t row;     // the state row of sequence n (its pool row; n without a pool)
  int skip;        // 0: step; kPadding: o = 0, nothing else; kInvalid: o = NaN, nothing else
  int cbeg, cend;  // this block's columns of P, H and o'
  int64_t t;       // the sequence's position
  int nlev;        // live levels are <= bitlen(t)
  R* Hh;           // this head's H (slot 0)
  R* P;            // this head's P (inner P only)
  Items<R> items;  // the state tiles in ring order
  int item = 0;    // the next item to take
  R beta;          // delta rule: beta_t; 1 otherwise

  __device__ __forceinline__ StepBlock(const StepArgs<T>& a, unsigned char* smem_raw);  // inputs.cuh
  __device__ __forceinline__ void start_ring();  // inputs.cuh
  __device__ __forceinline__ void inputs();      // inputs.cuh
  __device__ __forceinline__ R gate(int prim) const;
  __device__ __forceinline__ void inner_S();     // inner_s.cuh
  __device__ __forceinline__ void inner_P();     // inner_p.cuh
  __device__ __forceinline__ void outer();       // outer.cuh
  __device__ __forceinline__ void output();      // output.cuh
  __device__ __forceinline__ void skipped();     // output.cuh: o of a row that does not step
};

// One arrival of a block (one thread of it) at a step counter that `count` blocks of the launch
// arrive at: true for the last one, which sets the counter back to 0 for the next step (stream
// order). A counter is zero before and after every step.
__device__ __forceinline__ bool arrive(unsigned* cnt, unsigned count) {
  if (atomicAdd(cnt, 1u) != count - 1) return false;
  *cnt = 0;
  return true;
}

// What a block does with its sequence (StepBlock::skip), decided from the row and position alone,
// so every block of the sequence (and every thread) decides the same.
constexpr int kPadding = 1, kInvalid = 2;

}  // namespace hila::cuda::decode
