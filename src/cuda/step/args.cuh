// SPDX-License-Identifier: Apache-2.0
// The decode step's kernel parameters and shared-memory carve-up, the same on the host (step.cu)
// and in the kernel (kernel.cu, block.cuh). step.cu has the math of the step and the grid.
#pragma once
#include "cuda/dispatch/heuristics.h"
#include "cuda/prims/mma.cuh"
#include "cuda/prims/tile.cuh"
#include "cuda/runtime/runtime.cuh"
#include "cuda/step/step.cuh"

namespace hila::cuda::decode {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 2;       // consecutive columns per lane (one 8-byte fp32 / 16-byte fp64 access)
constexpr int kCols = 32 * kVec;  // columns per tile
constexpr int kMaxDk = kStepMaxDk;  // kRows <= 64 registers per thread per array
constexpr int kMaxStages = heuristics::kStepMaxStages;  // ring depth (state tiles in flight per block)

// Kernel parameters (by value). Element offsets, strides in elements; innermost stride 1.
template <class T>
struct StepArgs {
  using R = Acc<T>;
  const T *q, *k, *v;          // [N, G, dk], [N, G, dk], [N, H, dv]
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;
  T* o;                        // [N, H, dv]
  int64_t os0, os1;
  Strided g{TensorView{}}, lam{TensorView{}}, beta{TensorView{}};  // [N,H(,P)], [N,H,L], [N,H]
  bool has_g;
  int gcol[3];                 // gate column of S, P, outer (all 0 with tied gates)
  R* S;                        // [N, H, dk(dk+1)/2] packed upper triangle
  int64_t Ss0, Ss1;
  R* P;                        // [N, H, dk, dv']
  int64_t Ps0, Ps1;
  int Ps2;                     // row stride inside one head's matrix (dk * stride < 2^31)
  R* Hs;                       // [N, H, dk, dv'] or [N, H, Ls, dk, dv']
  int64_t Hs0, Hs1, Hsl;       // Hsl: slot stride (0 for flat)
  int Hs2;                     // row stride (dk * stride < 2^31)
  int64_t* pos;                // [P] positions of the state's rows
  int64_t poss;
  const int* idx;              // [N] state row of each sequence (pool; -1: padding), nullptr: row n
  int64_t idxs;
  int64_t rows;                // P: rows of the state (N without a pool)
  int64_t max_pos;             // >= 0: a position outside [0, max_pos] gives NaN o, nothing written
  unsigned* seq_count;         // [N] blocks done per sequence (null: no counters, a second kernel advances pos)
  unsigned* s_count;           // [N, H] blocks done reading S (S ops with tiles > 1 only)
  int N, H, rep, dk, dv, dvp, tiles, stages;
  bool s_smem;                 // S copied to shared memory (cp.async, first group) before its sweep
  bool has_S, has_P, fenwick, delta, normalize, l2;
  R scale, ridge, eps;
};

// Elements of a packed symmetric [dk, dk] matrix (upper triangle, row-major).
__host__ __device__ constexpr int sym_size(int dk) { return dk * (dk + 1) / 2; }

// Shared memory carve-up (in R elements), the same on host and device.
struct Smem {
  int ring, S, q, k, key, vin, hh, oraw, lam, red, colred, colpart, total;
  __host__ __device__ Smem(int dk, int dvp, bool has_S, int stages, bool s_smem) {
    int o = 0;
    ring = o, o += stages * dk * kCols;  // [stages][dk][kCols], first: 16-byte aligned
    S = o, o += s_smem ? (sym_size(dk) + 3) / 4 * 4 : 0;  // packed S, 16-byte aligned
    q = o, o += dk;
    k = o, o += dk;
    key = o, o += dk;
    vin = o, o += dvp;
    hh = o, o += dvp;
    oraw = o, o += dvp;
    lam = o, o += kMaxLevels;
    red = o, o += kWarps;
    colred = o, o += kWarps * kCols;
    colpart = o, o += has_S ? (kWarps * dk > kThreads ? kWarps * dk : kThreads) : 0;
    total = o;
  }
};

// Resident blocks per SM the register budget is sized for: the step is memory bound, so more
// blocks (and their ring stages) in flight beat the few spills this may cost.
// Flat states hold no merged tile in registers (kFenwick = false), so they fit one more block.
template <class T, int kRows, bool kFenwick>
constexpr int kMinBlocks = std::is_same_v<T, double> ? (kRows <= 8 ? 4 : kRows <= 16 ? 2 : 1)
                                                     : (kRows <= 16 ? (kFenwick ? 4 : 5) : kRows <= 32 ? 2 : 1);

// The kernel's launch (kernel.cu): rows per thread for the head dim (heuristics::step_rows) and
// flat or Fenwick states as template arguments.
template <class T>
void launch_step(const StepArgs<T>& a, dim3 grid, size_t smem, cudaStream_t s);
// After every head of every sequence has stepped: pos <- pos + 1 at each sequence's row (a step
// without counters to elect a last block); rows the step skipped (padding,
// out of range, a position past max_pos) are left alone.
template <class T>
void launch_advance_positions(const StepArgs<T>& a, cudaStream_t s);

}  // namespace hila::cuda::decode
