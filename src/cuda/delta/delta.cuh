// SPDX-License-Identifier: Apache-2.0
// Gated DeltaNet and log-linear Gated DeltaNet on the GPU (LOGLINEAR_SPEC §6): one implementation,
// plain GDN being the flat level structure (one state slot, lambda = 1). It reproduces the CPU
// segment routines of src/cpu/primitive.cpp (seg_forward / seg_backward) segment by segment.
//
// Segments are the maximal row ranges [s, e) inside one chunk of 64 aligned to absolute positions
// (§3.3); per segment, with R = e - s rows, chunk-local cumsum b of the gates and B = b[R-1]:
//   Tm = (I + tril_-1(diag(beta) K K^T))^-1   [R,R] unit lower triangular, forward substitution
//   W  = Tm diag(beta) K;  X = tril(Q^ K^T);  D = X Tm;  Q~ = Q^ - D diag(beta) K
//   O  = (D o M) diag(beta) V + sum_{l live at s} diag(lam^{l(s+i, sigma_l(s))} e^b) Q~ H[l]
//   H'[l(e, sigma_l(s))] += e^B (H[l] - K^T (W H[l]))        (the erase acts on every live level)
//   H'[l'] += K^T Tm diag(beta e^{B-b} 1[l(e, s+j) = l']) V  (new tokens, by target level)
// Phases: (1) per (segment, head), in parallel: Tm, W, Q~, K~ = Tm^T K and the intra output;
// (2) per (sequence, head), sequentially over its segments: the level states and the reads
// (storing the live levels entering every segment for the backward: popcount(s) matrices, or one
// flat); backward (§6.5): (3) the reverse sweep of one adjoint per level, storing the adjoints at
// every segment end; (4) per (segment, head), in parallel: every gradient of the segment's rows.
//
// Layouts: q, k packed [G][Ttot][dk] (T), v, dO [H][Ttot][dv] (T), g, beta [H][Ttot], lam
// [H][Ttot][nL] (compute type R = Acc<T>); level workspace [N*H][Ls][dk][dv] (R).
// Grid: blocks of kThreads take items (segment x head for phases 1 and 4, sequence x head for the
// sweeps 2 and 3) grid-stride. Per-segment matrices live in a per-block fp32 (fp64 for fp64
// inputs) scratch area in global memory (L1/L2 resident); every GEMM is a shared-memory tiled FMA
// block GEMM: correctness first, every product in the compute type (no bf16 rounding of Tm, W or
// the states).
#pragma once
#include "core/problem.h"
#include "cuda/prims/pack.cuh"
#include "cuda/prims/levels.cuh"

namespace hila::cuda {

constexpr double kL2Eps = 1e-6;  // qk_l2norm: x / sqrt(|x|^2 + eps) (LOGLINEAR_SPEC §6.1)

template <class T>
struct DeltaArgs {
  using R = Acc<T>;
  const T *q = nullptr, *k = nullptr, *v = nullptr;  // [G][Ttot][dk], [G][Ttot][dk], [H][Ttot][dv]
  int rep = 1;                                      // q/k group of head h: h / rep
  const R* g = nullptr;                             // [H][Ttot], nullptr = ungated
  const R* beta = nullptr;                          // [H][Ttot]
  const R* lam = nullptr;                           // [H][Ttot][nL] (Fenwick only)
  int nL = 0;
  LvlGrid grid;
  bool l2norm = false;                              // q, k -> x / sqrt(|x|^2 + 1e-6) before scale
  R scale = 1;
  int H = 1, N = 1, dk = 1, dv = 1, Ls = 1;
  int64_t Ttot = 0;
  // segment tables (device): sequence -> [seg0, seg0 + nseg); segment -> packed row, position,
  // rows, offsets of its stored levels at s and at e (in matrices per head)
  int64_t nseg = 0;
  const int64_t *seq_seg0 = nullptr, *seq_nseg = nullptr;
  const int64_t *seg_row = nullptr, *seg_pos = nullptr, *seg_nr = nullptr, *seg_hoff = nullptr, *seg_dhoff = nullptr;
  R* ws = nullptr;       // forward: initial state in, final state out; backward: d_final in, d_init out
  R* scratch = nullptr;  // per resident block
  int64_t scratch_elems = 0;
  // per-segment matrices of phase 1, rows of [H][Ttot][d]: W, Q~, K~ = Tm^T K, K (normalised);
  // Oi = (D o M) diag(beta) V, the intra-segment output (only when o is wanted)
  R *Wb = nullptr, *Qtb = nullptr, *Ktb = nullptr, *Kb = nullptr, *Oi = nullptr;
  // forward
  T* o = nullptr;        // [H][Ttot][dv], nullptr: states only
  R* hbuf = nullptr;     // [sum_seg nlive(s)][H][dk][dv]: live levels entering each segment
  // backward (hbuf from a forward with hbuf set)
  R* dhbuf = nullptr;    // [sum_seg nlive(e)][H][dk][dv]: adjoints of the live levels at each end
  const T* dO = nullptr;                             // [H][Ttot][dv]
  R *dq = nullptr, *dk_ = nullptr, *dv_ = nullptr;   // [H][Ttot][dk | dk | dv], w.r.t. q^ and k
  R *dg = nullptr, *dbeta = nullptr, *dlam = nullptr;  // [H][Ttot], [H][Ttot], [H][Ttot][nL]
};

// dq or dk per group: mult * sum over the group's heads of the per-head gradient (dx, plus dx2 when
// given), then through the l2 normalisation: dx = (dy - y (y.dy)) / sqrt(|x|^2 + eps)
// (LOGLINEAR_SPEC §6.1). One warp per (group, row), lanes over the columns; x is the packed raw
// input. dx and x rows have dkp >= dk columns (the padding of x is zero); the first dk are written.
template <class T>
__global__ void delta_unpack_qk(Strided out, const Acc<T>* dx, const Acc<T>* dx2, const T* x, int64_t T_, int64_t G, int rep,
                                int64_t Ttot, int dk, int dkp, Acc<T> mult, bool l2) {
  using R = Acc<T>;
  const int lane = threadIdx.x & 31;
  for (int64_t e = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; e < G * Ttot;
       e += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t g = e / Ttot, r = e % Ttot, b = r / T_, t = r % T_;
    auto dy = [&](int cc) {
      R s = 0;
      for (int j = 0; j < rep; ++j) {
        const int64_t o = ((g * rep + j) * Ttot + r) * dkp + cc;
        s += dx2 ? dx[o] + dx2[o] : dx[o];
      }
      return mult * s;
    };
    const T* xr = x + (g * Ttot + r) * dkp;
    auto put = [&](int cc, R d) { st<R>(out, b * out.s[0] + t * out.s[1] + g * out.s[2] + cc * out.s[3], d); };
    R inv = 1, ydy = 0;
    if (l2) {
      R ss = 0, xdy = 0;
      for (int cc = lane; cc < dk; cc += 32) {
        const R xv = from<R>(xr[cc]);
        ss += xv * xv;
        xdy += xv * dy(cc);
      }
      for (int o = 16; o > 0; o >>= 1) {
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
        xdy += __shfl_xor_sync(0xffffffffu, xdy, o);
      }
      inv = R(1) / sqrt(ss + R(kL2Eps));
      ydy = xdy * inv;
    }
    for (int cc = lane; cc < dk; cc += 32) put(cc, l2 ? (dy(cc) - from<R>(xr[cc]) * inv * ydy) * inv : dy(cc));
  }
}
// Launches delta_unpack_qk over the rows of a call (delta.cu).
template <class T>
void launch_unpack_qk(const TensorView& out, const Acc<T>* dx, const Acc<T>* dx2, const T* x, const detail::Resolved& r, int dk, int dkp,
                      Acc<T> mult, cudaStream_t s);

// Plain gdn on tensor cores (gdn_tc.cu: the fla-form WY chunks, state sweeps and the GLA output
// and chunk-gradient kernels), taken by delta_forward / delta_backward for bf16/fp16 with dk <= 128
// and dv <= 256 (the backward: while its kernels' shared memory fits) unless HILA_GDN_TC=0.
template <class T>
bool gdn_tc_usable(const detail::Resolved& r, bool backward);
template <class T>
void gdn_tc_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t stream);
template <class T>
void gdn_tc_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t stream);
// loglinear_gdn's forward on tensor cores (gdn_tc.cu: the WY chunks with Qeff and the lambda-masked
// intra block, then one launch of level sweeps per chunk level), for bf16/fp16 calls whose
// sequences all start at position 0 without an initial state (a final state may be asked for),
// dk <= 128, dv <= 256, unless HILA_GDN_TC=0.
// The backward also needs no final-state cotangent and dv <= 128 (shared memory).
template <class T>
bool ll_gdn_tc_usable(const detail::Resolved& r, bool backward);
template <class T>
void ll_gdn_tc_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t stream);
template <class T>
void ll_gdn_tc_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t stream);

// Host entry points used by backend.cu for gdn / loglinear_gdn: pack the caller's tensors, run the
// sweeps on `stream` and write outputs, states and gradients.
template <class T>
void delta_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t stream);
template <class T>
void delta_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t stream);

}  // namespace hila::cuda
