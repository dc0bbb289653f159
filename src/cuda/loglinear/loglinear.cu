// SPDX-License-Identifier: Apache-2.0
// The log-linear primitive's entry (loglinear.cuh): the form each call runs. The caller (compose.cu)
// sets LoglinearArgs::tree where the chunk-parallel tree form applies (every sequence from a
// chunk-aligned position, loglinear_tree_usable); the segment sweep runs the rest.
#include "cuda/loglinear/loglinear.cuh"

namespace hila::cuda {

template <class T>
void loglinear_forward(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t stream) {
  if (a.p.N == 0 || a.p.H == 0) return;
  if (a.tree) return loglinear_tree_forward(a, t, stream);
  loglinear_sweep_forward(a, t, stream);
}

template <class T>
void loglinear_backward(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t stream) {
  if (a.p.N == 0 || a.p.H == 0) return;
  if (a.tree) return loglinear_tree_backward(a, t, stream);
  loglinear_sweep_backward(a, t, stream);
}

#define HILA_INSTANTIATE(T)                                                                          \
  template void loglinear_forward<T>(const LoglinearArgs<T>&, const LoglinearTables&, cudaStream_t); \
  template void loglinear_backward<T>(const LoglinearArgs<T>&, const LoglinearTables&, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
