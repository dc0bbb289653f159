// SPDX-License-Identifier: Apache-2.0
// loglinear_gdn's level sweeps: their arguments, shared by the sm80 kernels (loglinear_gdn_sm80.cu,
// whose comments give the math) and the sm90 ones (TMA + wgmma, loglinear_gdn_sm90.cu), which run in
// their place where heuristics::loglinear_gdn_sm90_sweep chooses them.
#pragma once
#include "cuda/gla/gla.cuh"

namespace hila::cuda::gdn {

// The forward level sweep of level m (the chunk-level state of level p + m).
template <class T>
struct LoglinearSweepArgs {
  const T* W = nullptr;       // [H][Ttot][dk]
  const T* U = nullptr;       // [H][Ttot][dv] (16-bit)
  const T* qeff = nullptr;    // [H][Ttot][dk]
  const float* lam = nullptr; // [H][Ttot][nL]
  int nL = 0;
  float* E = nullptr;         // [nchunks + 1][H][dk][dv]
  float* o = nullptr;         // [H][Ttot][dv], the intra part already in; nullptr: no reads (the backward's recompute)
  float* fin = nullptr;       // [N][H][Ls][dk][dv] or nullptr
  int Ls = 0;
  T* hl = nullptr;            // backward: [top][nchunks][H][dk][dv] the level-m state entering each chunk that reads it
};

// The reverse level sweep of level m.
template <class T>
struct LoglinearRsweepArgs {
  const T* W = nullptr;        // [H][Ttot][dk]
  const T* qeff = nullptr;     // [H][Ttot][dk]
  const float* lam = nullptr;  // [H][Ttot][nL]
  int nL = 0;
  float* dmid = nullptr;       // [nchunks + 1][H][dk][dv]
  T* dmid16 = nullptr;         // the same in 16 bits (loglinear_grad_kernel's GEMM operand)
  T* dhl = nullptr;            // [top][nchunks][H][dk][dv]: dT at the chunks that read level m
};

// The forward level sweeps m = 1 .. top on the sm90 tier, level m's grid (N x H, (reach >> m) + 1,
// dv / 64): the same outputs as loglinear_level_sweep_kernel's launches. False, before any launch,
// where this device does not run the build's sm_90a code, TMA cannot describe the operands or the
// shared memory does not hold two ring stages (the caller then runs the sm80 sweeps).
template <class T>
bool loglinear_level_sweeps_sm90(const GlaArgs<T>& a, const LoglinearSweepArgs<T>& x, int top, int64_t reach,
                                 cudaStream_t s);

// The reverse level sweeps m = top .. 1 on the sm90 tier (as loglinear_level_rsweep_kernel's
// launches; grid as above). False as above.
template <class T>
bool loglinear_level_rsweeps_sm90(const GlaArgs<T>& a, const LoglinearRsweepArgs<T>& x, int top, int64_t reach,
                                  cudaStream_t s);

}  // namespace hila::cuda::gdn
