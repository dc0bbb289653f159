// SPDX-License-Identifier: Apache-2.0
// The delta rule's state sweeps on the sm90 tier (sm_90a: TMA + wgmma; sweep_sm90.cu), in place of
// the sm80 sweeps of gdn_sm80.cu where heuristics::delta_sm90_sweep chooses them. Same inputs and
// outputs as the sm80 kernels (the math is in gdn_sm80.cu's header comment).
#pragma once
#include "cuda/gla/gla.cuh"

namespace hila::cuda::gdn {

// The forward sweep: Vn [H][Ttot][dv] (16-bit), the states entering each chunk (a.hbuf) and the
// final states (a.ht) from W [H][Ttot][dk] (16-bit), U [H][Ttot][dv] (16-bit), a.k, a.b, a.h0.
// False where this device does not run the build's sm_90a code, TMA cannot describe the operands or
// the shared memory does not hold two ring stages (the caller then runs the sm80 sweep).
template <class T>
bool delta_sweep_sm90(const GlaArgs<T>& a, const T* W, const T* U, T* Vn, cudaStream_t s);

// The reverse sweep: the cotangents at the chunk ends (a.dhbuf, 16-bit) and of the initial state
// (a.dh0) from a.dht, a.q, a.k, a.dO, W, dvi = A^T dO [H][Ttot][dv] (16-bit). False as above.
template <class T>
bool delta_rsweep_sm90(const GlaArgs<T>& a, const T* W, const T* dvi, cudaStream_t s);

}  // namespace hila::cuda::gdn
