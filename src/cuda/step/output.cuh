// SPDX-License-Identifier: Apache-2.0
// The decode step's last stage (block.cuh): o in v's dtype from o' (normalize: o'[:dv] / (o'[dv] +
// eps), the denominator column dv being in this block, tiles == 1), and pos += 1 by the last block
// of the sequence to finish (with the DecodeState's counters); o of a sequence that does not step.
#pragma once
#include "cuda/step/block.cuh"

namespace hila::cuda::decode {

template <class T, int kRows, bool kFenwick>
__device__ __forceinline__ void StepBlock<T, kRows, kFenwick>::output() {
  T* o = a.o + n * a.os0 + h * a.os1;
  const int oend = min(cend, a.dv);
  if (a.normalize) {
    const R den = s_oraw[a.dv] + a.eps;
    for (int c = cbeg + tid; c < oend; c += kThreads) o[c] = to<T>(s_oraw[c] / den);
  } else {
    for (int c = cbeg + tid; c < oend; c += kThreads) o[c] = to<T>(s_oraw[c]);
  }
  // the last block of sequence n (every thread of every block has read t by now) advances pos
  if (a.seq_count && tid == 0 && arrive(a.seq_count + n, unsigned(a.H * a.tiles))) a.pos[row * a.poss] = t + 1;
}

// A sequence that does not step: a padding row (o = 0) or an invalid one (o = NaN: a pool row
// outside [-1, P), or a position outside [0, max_pos]); its state is not touched. Its blocks still
// arrive at the counters the stepping blocks use (tid 0: one arrival per counter and block), so
// every counter gets exactly its count of arrivals in every launch and is zero after it, whatever
// the rows and positions hold (even where the blocks of one sequence disagree on skipping, as with
// a pool row given twice, which the caller must avoid: then the state is undefined, the counters
// still zero).
template <class T, int kRows, bool kFenwick>
__device__ __forceinline__ void StepBlock<T, kRows, kFenwick>::skipped() {
  T* o = a.o + n * a.os0 + h * a.os1;
  const int oend = min(cend, a.dv);
  const R x = skip == kPadding ? R(0) : R(NAN);
  for (int c = cbeg + tid; c < oend; c += kThreads) o[c] = to<T>(x);
  if (tid == 0) {
    if (a.s_count && a.has_S && a.tiles > 1) arrive(a.s_count + int64_t(n) * a.H + h, unsigned(a.tiles));  // inner_S's
    if (a.seq_count) arrive(a.seq_count + n, unsigned(a.H * a.tiles));                          // output's
  }
}

}  // namespace hila::cuda::decode
