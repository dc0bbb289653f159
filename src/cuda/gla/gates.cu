// SPDX-License-Identifier: Apache-2.0
// The GLA primitive's gate stages, every dtype: the chunk-local inclusive cumsum b of the log-gates
// (before the sweeps and the chunk kernels) and dg, the reverse cumsum of the chunk kernels' per-row
// dc (plus <dH_T, H_T> at the last token).
#include <cub/block/block_scan.cuh>

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

// dg: add <dH_T, H_T> at the last token, then reverse cumsum per (sequence, head).
template <class T>
__global__ void __launch_bounds__(256) gla_dg_kernel(GlaArgs<T> a) {
  using R = Acc<T>;
  using Scan = cub::BlockScan<R, 256>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ R red[256];
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int64_t len = a.len[seq], row0 = a.row0[seq];
  if (len == 0) return;
  R* dg = a.dg + int64_t(h) * a.Ttot + row0;
  R extra = 0;
  if (a.dht) {
    const int64_t sidx = (int64_t(seq) * a.H + h) * a.dk * a.dv;
    for (int64_t e = threadIdx.x; e < int64_t(a.dk) * a.dv; e += blockDim.x) extra += a.dht[sidx + e] * a.ht[sidx + e];
  }
  red[threadIdx.x] = extra;
  __syncthreads();
  for (int s = 128; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  R carry = 0;
  for (int64_t base = len; base > 0; base -= 256) {  // tiles from the end, reversed
    const int64_t i = base - 1 - threadIdx.x;
    R x = i >= 0 ? dg[i] : R(0);
    if (i == len - 1) x += red[0];
    R incl;
    R total;
    Scan(tmp).InclusiveSum(x, incl, total);
    if (i >= 0) dg[i] = incl + carry;
    carry += total;
    __syncthreads();
  }
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

template <class T>
void gla_dg(const GlaArgs<T>& a, cudaStream_t stream) {
  if (a.N == 0 || a.H == 0 || dry_run()) return;  // dry run: workspace_size
  gla_dg_kernel<T><<<a.N * a.H, 256, 0, stream>>>(a);
  HILA_CUDA_CHECK_LAUNCH();
}

#define HILA_INSTANTIATE(T)                                                             \
  template void gla_chunk_cumsum<T>(const GlaArgs<T>&, Acc<T>*, cudaStream_t); \
  template void gla_dg<T>(const GlaArgs<T>&, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
