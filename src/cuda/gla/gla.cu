// SPDX-License-Identifier: Apache-2.0
// The GLA primitive (gla.cuh): its forward and backward as a chain of stages, and for each stage
// the kernel tier that runs it. This file is where a kernel is chosen; heuristics.h holds the
// policies, and a tier's launcher answers false only where the device or the call's layout cannot
// run it (no sm_90a code on this device, a layout TMA cannot describe).
//   fp32 / fp64:  the portable tier (sweep_portable.cu, bwd_chunk_portable.cu).
//   bf16 / fp16:  per stage, sm90 (TMA + wgmma) where heuristics.h chooses it, else sm80
//                 (mma.sync): sweep, output, fused forward, chunk gradients.
#include <algorithm>
#include <optional>

#include "cuda/dispatch/heuristics.h"
#include "cuda/gla/gla.cuh"
#include "cuda/loglinear/tree.cuh"
#include "cuda/runtime/config.h"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

template <class T>
size_t gla_smem_need(int dk, int dv) {
  if constexpr (kTensorCore<T>) return std::max(gla_output_smem(dk, dv, sizeof(T)), gla_bwd_chunk_smem(dk, dv));
  else return std::max(gla_sweep_portable_smem<T>(dk), gla_bwd_chunk_portable_smem<T>(dk, dv));
}

// ---- stages of the tensor-core tiers -----------------------------------------------------------

template <class T>
void gla_sweep(const GlaArgs<T>& a, bool reverse, cudaStream_t stream) {
  if (heuristics::gla_sm90_sweep(a.dk, a.dv, a.Ttot, a.nchunks, a.H, int64_t(a.N) * a.H, device_info(),
                                 config().gla_sm90) &&
      gla_sweep_sm90(a, reverse, stream))
    return;
  gla_sweep_sm80(a, reverse, stream);
}

template <class T>
void gla_tree_sweep(const GlaArgs<T>& a, const TreeArgs& ta, float* stack, int lstk, unsigned nseg, cudaStream_t stream) {
  if (heuristics::gla_sm90_sweep(a.dk, a.dv, a.Ttot, a.nchunks, a.H, int64_t(a.N) * a.H * nseg, device_info(),
                                 config().gla_sm90) &&
      gla_tree_sweep_sm90(a, ta, stack, lstk, nseg, stream))
    return;
  gla_tree_sweep_sm80(a, ta, stack, lstk, nseg, stream);
}

template <class T>
void gla_output(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree) {
  // the states: hbuf per chunk, or the tree's node slots (TreeArgs::slots)
  const bool states = tree ? tree->node16 != nullptr : a.hbuf != nullptr;
  const int64_t state_count = tree ? tree->slots : a.nchunks;
  if (heuristics::gla_sm90_output(a.dk, a.dv, tree != nullptr, states, a.Ttot, state_count, a.H, config().gla_sm90) &&
      gla_output_sm90(a, stream, tree))
    return;
  gla_output_sm80(a, stream, tree);
}

template <class T>
void gla_fused_forward(const GlaArgs<T>& a, cudaStream_t stream) {
  if (heuristics::gla_sm90_fused_forward(a.dk, a.dv, a.o != nullptr, a.hbuf != nullptr, a.Ttot, a.nchunks, a.H,
                                         config().gla_sm90) &&
      gla_fused_forward_sm90(a, stream))
    return;
  gla_fused_forward_sm80(a, stream);
}

template <class T>
bool gla_bwd_chunk(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree) {
  if (a.nchunks == 0) return true;
  // the tree form's state rows: its node slots (TreeArgs::slots) as well as dZ's nchunks
  const bool states = tree ? tree->node16 && tree->dz16 : a.hbuf && a.dhbuf;
  const int64_t state_count = tree ? std::max(a.nchunks, tree->slots) : a.nchunks;
  if (heuristics::gla_sm90_bwd_chunk(a.dk, a.dv, states, a.Ttot, state_count, a.H, config().gla_sm90) &&
      gla_bwd_chunk_sm90(a, stream, tree))
    return true;
  if (!a.dq_out.rstd) {
    gla_bwd_chunk_sm80(a, stream, tree);
    return true;
  }
  GlaArgs<T> b = a;  // the l2norm chain rule of dq is the sm90 kernel's: dq to the fp32 buffer here
  b.dq_out = GradOut<T>{};
  gla_bwd_chunk_sm80(b, stream, tree);
  return false;
}

// ---- the primitive ------------------------------------------------------------------------------

template <class T>
void gla_forward(const GlaArgs<T>& a, cudaStream_t stream) {
  using R = Acc<T>;
  if (a.N == 0 || a.H == 0) return;
  if constexpr (kTensorCore<T>) {
    GlaArgs<T> x = a;
    DevBuf<R> b;
    if (x.g && !x.b) {
      b = DevBuf<R>(size_t(x.H * x.Ttot), stream);
      gla_chunk_cumsum(x, b.get(), stream);
      x.b = b.get();
    }
    if (heuristics::gla_fused_forward(x.o != nullptr, x.dk, x.dv, int64_t(x.N) * x.H, gla_fused_forward_smem(x.dk),
                                      device_info(), config().gla_fused))
      return gla_fused_forward(x, stream);
    DevBuf<T> hbuf;
    if (x.o && !x.hbuf) {
      hbuf = DevBuf<T>(size_t(x.nchunks * x.H * x.dk * x.dv), stream);
      x.hbuf = hbuf.get();
    }
    gla_sweep(x, false, stream);
    if (x.o) gla_output(x, stream);
  } else {
    gla_sweep_portable(a, false, stream);  // the forward sweep writes o too
  }
}

template <class T>
void gla_backward(const GlaArgs<T>& a, cudaStream_t stream, const GlaArgs<T>* recompute) {
  if (a.N == 0 || a.H == 0) return;
  GlaArgs<T> x = a;
  DevBuf<Acc<T>> b;
  if (kTensorCore<T> && x.g && !x.b) {
    b = DevBuf<Acc<T>>(size_t(x.H * x.Ttot), stream);
    gla_chunk_cumsum(x, b.get(), stream);
    x.b = b.get();
  }
  // the recomputed forward (hbuf) beside the reverse sweep (dhbuf), which reads none of its
  // outputs: few long sequences leave both latency-bound sweeps far from filling the GPU
  // (work on the side stream must not allocate: the caller gives the recompute its gate cumsum
  // and hbuf, and NoAllocScope enforces it)
  std::optional<SideStream> side;
  if (recompute) side.emplace(stream).run([&](cudaStream_t st) { gla_forward(*recompute, st); });
  if constexpr (kTensorCore<T>) {
    gla_sweep(x, true, stream);
    if (side) side->join();
    gla_bwd_chunk(x, stream);
  } else {
    gla_sweep_portable(a, true, stream);
    if (side) side->join();
    gla_bwd_chunk_portable(a, stream);
  }
}

#define HILA_INSTANTIATE(T)                                                              \
  template void gla_forward<T>(const GlaArgs<T>&, cudaStream_t);                         \
  template void gla_backward<T>(const GlaArgs<T>&, cudaStream_t, const GlaArgs<T>*);     \
  template size_t gla_smem_need<T>(int, int);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE
#define HILA_INSTANTIATE(T)                                                                             \
  template void gla_sweep<T>(const GlaArgs<T>&, bool, cudaStream_t);                                    \
  template void gla_tree_sweep<T>(const GlaArgs<T>&, const TreeArgs&, float*, int, unsigned, cudaStream_t); \
  template void gla_output<T>(const GlaArgs<T>&, cudaStream_t, const TreeArgs*);                         \
  template void gla_fused_forward<T>(const GlaArgs<T>&, cudaStream_t);                                  \
  template bool gla_bwd_chunk<T>(const GlaArgs<T>&, cudaStream_t, const TreeArgs*);
HILA_INSTANTIATE(__nv_bfloat16)
HILA_INSTANTIATE(__half)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
