// SPDX-License-Identifier: Apache-2.0
// The delta-rule primitive's entry (delta.cuh): the implementation that runs each call. The sm80
// tier where its kernels hold the call (heuristics::delta_sm80: bf16 / fp16, head dims, shared
// memory; HILA_GDN_TC=0 turns it off), the portable segment kernels otherwise.
#include "cuda/delta/delta.cuh"

namespace hila::cuda {

template <class T>
void delta_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) {
  if (gdn_sm80_usable<T>(r, false)) return gdn_sm80_forward<T>(r, p, s);
  if (loglinear_gdn_sm80_usable<T>(r, false)) return loglinear_gdn_sm80_forward<T>(r, p, s);
  delta_portable_forward<T>(r, p, s);
}

template <class T>
void delta_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) {
  if (gdn_sm80_usable<T>(r, true)) return gdn_sm80_backward<T>(r, p, s);
  // loglinear_gdn's sm80 backward takes no final-state cotangent
  if (!p.d_final.H.defined() && loglinear_gdn_sm80_usable<T>(r, true)) return loglinear_gdn_sm80_backward<T>(r, p, s);
  delta_portable_backward<T>(r, p, s);
}

#define HILA_INSTANTIATE(T)                                                                       \
  template void delta_forward<T>(const detail::Resolved&, const ForwardParams&, cudaStream_t); \
  template void delta_backward<T>(const detail::Resolved&, const BackwardParams&, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
