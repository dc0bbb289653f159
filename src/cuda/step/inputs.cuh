// SPDX-License-Identifier: Apache-2.0
// The decode step's first stages (block.cuh): the block's context, the state tiles streaming in,
// and the inputs: q (scaled; l2-normalised for qk_l2norm), k, v' = [v | 1], lam and the gates.
#pragma once
#include "core/plan.h"
#include "cuda/step/block.cuh"

namespace hila::cuda::decode {

template <class T, int kRows, bool kFenwick>
__device__ __forceinline__ StepBlock<T, kRows, kFenwick>::StepBlock(const StepArgs<T>& a_, unsigned char* smem_raw)
    : a(a_) {
  R* sm = reinterpret_cast<R*>(smem_raw);
  const Smem L(a.dk, a.dvp, a.has_S, a.stages, a.s_smem);
  s_ring = sm + L.ring, s_S = sm + L.S, s_q = sm + L.q, s_k = sm + L.k, s_key = sm + L.key, s_vin = sm + L.vin,
  s_hh = sm + L.hh, s_oraw = sm + L.oraw, s_lam = sm + L.lam, s_red = sm + L.red, s_colred = sm + L.colred,
  s_colpart = sm + L.colpart;
  tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  n = blockIdx.x / a.tiles, tile = blockIdx.x % a.tiles, h = blockIdx.y;
  grp = h / a.rep, dk = a.dk, dvp = a.dvp;
  cbeg = a.tiles == 1 ? 0 : tile * kCols;
  cend = a.tiles == 1 ? dvp : min(dvp, cbeg + kCols);
  // The state row: a pool's row state_indices[n] (-1: padding; outside [0, P): invalid), and its
  // position, which must lie in [0, max_pos] when the caller bounds it (the host checked the
  // capacity of state and lam for that bound, not for the position itself).
  row = a.idx ? int64_t(a.idx[n * a.idxs]) : n;
  skip = 0;
  t = 0;
  if (a.idx && row == -1) skip = kPadding;
  else if (row < 0 || row >= a.rows) skip = kInvalid;
  else t = a.pos[row * a.poss];
  if (!skip && a.max_pos >= 0 && (t < 0 || t > a.max_pos)) skip = kInvalid;
  nlev = kFenwick && !skip ? 64 - __clzll(t) : 0;
}

// The state tiles start streaming in: S first (it is needed first) when it is copied to shared
// memory, then the first `stages` ring items (ring.cuh).
template <class T, int kRows, bool kFenwick>
__device__ __forceinline__ void StepBlock<T, kRows, kFenwick>::start_ring() {
  Hh = a.Hs + row * a.Hs0 + h * a.Hs1;
  P = a.has_P ? a.P + row * a.Ps0 + h * a.Ps1 : nullptr;
  items = Items<R>{};
  items.P = P, items.Ps2 = a.Ps2, items.H = Hh, items.Hsl = a.Hsl, items.Hs2 = a.Hs2, items.t = t;
  items.fenwick = kFenwick, items.cbeg = cbeg, items.cend = cend;
  const int nchunk = (cend - cbeg + kCols - 1) / kCols;
  items.nP = a.has_P ? nchunk : 0;
  items.nlive = kFenwick ? __popcll(static_cast<unsigned long long>(t)) : 1;
  items.total = items.nP + nchunk * items.nlive;
  if (a.s_smem) {  // S first: it is needed first
    copy_async(s_S, a.S + row * a.Ss0 + h * a.Ss1, sym_size(dk));
    mma::cp_async_commit();
  }
  for (int i = 0; i < a.stages; ++i) ring_issue(s_ring, a.stages, dk, items, i);
  item = 0;
}

// q (scaled), k (l2-normalised for qk_l2norm), v' = [v | 1], lam; beta of the delta rule.
template <class T, int kRows, bool kFenwick>
__device__ __forceinline__ void StepBlock<T, kRows, kFenwick>::inputs() {
  for (int c = tid; c < dk; c += kThreads) {
    s_q[c] = from<R>(a.q[n * a.qs0 + grp * a.qs1 + c]);
    s_k[c] = from<R>(a.k[n * a.ks0 + grp * a.ks1 + c]);
  }
  for (int c = tid; c < dvp; c += kThreads) s_vin[c] = c < a.dv ? from<R>(a.v[n * a.vs0 + h * a.vs1 + c]) : R(1);
  for (int l = tid; l <= nlev; l += kThreads)
    s_lam[l] = kFenwick ? ld<R>(a.lam, n * a.lam.s[0] + h * a.lam.s[1] + l * a.lam.s[2]) : R(1);
  __syncthreads();
  R qs = a.scale, ks = 1;
  if (a.l2) {  // docs/math/LOGLINEAR.md §6.1: x / sqrt(|x|^2 + eps)
    R sq = 0, sk = 0;
    for (int c = tid; c < dk; c += kThreads) sq += s_q[c] * s_q[c], sk += s_k[c] * s_k[c];
    sq = block_sum(sq, s_red);
    sk = block_sum(sk, s_red);
    qs *= rsqrt_eps(sq, R(detail::kL2NormEps));
    ks = rsqrt_eps(sk, R(detail::kL2NormEps));
  }
  __syncthreads();
  for (int c = tid; c < dk; c += kThreads) s_q[c] *= qs, s_k[c] *= ks;
  __syncthreads();
  beta = a.delta ? ld<R>(a.beta, n * a.beta.s[0] + h * a.beta.s[1]) : R(1);
}

// e^{g} of primitive prim's gate column (inner S, inner P, outer), 1 without gates.
template <class T, int kRows, bool kFenwick>
__device__ __forceinline__ Acc<T> StepBlock<T, kRows, kFenwick>::gate(int prim) const {
  if (!a.has_g) return R(1);
  return rexp(ld<R>(a.g, n * a.g.s[0] + h * a.g.s[1] + a.gcol[prim] * a.g.s[2]));
}

}  // namespace hila::cuda::decode
