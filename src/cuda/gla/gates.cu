// SPDX-License-Identifier: Apache-2.0
// The GLA primitive's gate stage, every dtype: the chunk-local inclusive cumsum b of the log-gates
// (before the sweeps and the chunk kernels).
#include "cuda/gla/gla.cuh"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

namespace {

// b[h][row] = chunk-local inclusive cumsum of g; grid (nchunks, H), one warp.
template <class T>
__global__ void __launch_bounds__(32) cumsum_kernel(GlaArgs<T> a, Acc<T>* b) {
  using R = Acc<T>;
  const int64_t cg = blockIdx.x;
  const int h = blockIdx.y, seq = a.chunk_seq[cg];
  const int64_t c = cg - a.chunk0[seq], r0 = a.row0[seq] + c * a.C;
  const int nr = rows_in(a.len[seq], c, a.C);
  const R* g = a.g + int64_t(h) * a.Ttot;
  const int i0 = 2 * threadIdx.x, i1 = i0 + 1;
  R x0 = i0 < nr ? g[r0 + i0] : R(0), x1 = i1 < nr ? g[r0 + i1] : R(0);
  warp_pair_cumsum(x0, x1);
  R* out = b + int64_t(h) * a.Ttot + r0;
  if (i0 < nr) out[i0] = x0;
  if (i1 < nr) out[i1] = x1;
}

}  // namespace

template <class T>
void gla_chunk_cumsum(const GlaArgs<T>& a, Acc<T>* b, cudaStream_t stream) {
  if (!a.g || a.nchunks == 0 || a.H == 0) return;
  if (!dry_run()) {  // dry run: workspace_size
    cumsum_kernel<T><<<dim3(unsigned(a.nchunks), a.H), 32, 0, stream>>>(a, b);
    HILA_CUDA_CHECK_LAUNCH();
  }
}

#define HILA_INSTANTIATE(T)                                                             \
  template void gla_chunk_cumsum<T>(const GlaArgs<T>&, Acc<T>*, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
