// SPDX-License-Identifier: Apache-2.0
// The delta-rule primitive on the GPU: Gated DeltaNet and log-linear Gated DeltaNet
// (docs/math/LOGLINEAR.md §6), the outer (and only) primitive of gdn and loglinear_gdn (compose.cu). delta.cu chooses, per
// call, one of its implementations:
//   sm80 tier (bf16 / fp16 on tensor cores, the fla form of §6.4):  gdn_sm80.cu for gdn,
//     loglinear_gdn_sm80.cu for loglinear_gdn from position 0; both on wy_sm80.cu's WY chunks and
//     sm80.cuh's sweep tiles, with gla/'s output and chunk-gradient kernels;
//   portable tier (every dtype, every call):  segment_portable.cu, the segment routines of
//     src/cpu/primitive.cpp on the GPU, plain GDN being the flat level structure.
// q and k are l2-normalised when asked (qk.cu); every implementation packs the caller's tensors
// itself (compose.cu says why they do not go through its packing).
#pragma once
#include "core/problem.h"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

// The primitive's entry (delta.cu): outputs, states and gradients into the caller's tensors.
template <class T>
void delta_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t stream);
template <class T>
void delta_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t stream);

// sm80 tier, plain gdn (gdn_sm80.cu): whether its kernels hold this call (padded dk <= 128,
// dv <= 256, their shared memory; heuristics::delta_sm80), and the call.
template <class T>
bool gdn_sm80_usable(const detail::Resolved& r, bool backward);
template <class T>
void gdn_sm80_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t stream);
template <class T>
void gdn_sm80_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t stream);
// sm80 tier, loglinear_gdn (loglinear_gdn_sm80.cu): the WY chunks with Qeff and the lambda-masked
// intra block, then one launch of level sweeps per chunk level, for calls whose sequences all start
// at position 0 without an initial state (a final state may be asked for), dk <= 128, dv <= 256;
// the backward also needs no final-state cotangent and dv <= 128 (its gradient kernels' tiles).
template <class T>
bool loglinear_gdn_sm80_usable(const detail::Resolved& r, bool backward);
template <class T>
void loglinear_gdn_sm80_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t stream);
template <class T>
void loglinear_gdn_sm80_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t stream);
// Portable tier (segment_portable.cu): any call.
template <class T>
void delta_portable_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t stream);
template <class T>
void delta_portable_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t stream);

// q, k and their gradients under qk_l2norm (qk.cu), over the G x Ttot rows of a call:
// dq or dk per group into `out` (the caller's [B, T, G, dk]): mult * the sum over the group's heads
// of the per-head gradient (dx, plus dx2 when given; packed [H][Ttot][dkp]), then through the l2
// normalisation of x (the caller's raw input [B, T, G, dk]) when the call asks for it.
template <class T>
void launch_unpack_qk(const TensorView& out, const Acc<T>* dx, const Acc<T>* dx2, const TensorView& x,
                      const detail::Resolved& r, int dk, int dkp, Acc<T> mult, cudaStream_t s);
// the caller's q or k [B, T, G, d] -> packed [G][Ttot][dp] (dp % 8 == 0, dp <= 256), each row
// x / sqrt(|x|^2 + kL2NormEps), the padding columns zero (16-bit T); rstd [G][Ttot] (or nullptr):
// 1 / sqrt(|x|^2 + kL2NormEps) of each row.
template <class T>
void launch_l2norm_pack(T* dst, float* rstd, const TensorView& x, const detail::Resolved& r, int d, int dp,
                        cudaStream_t s);

}  // namespace hila::cuda
