// SPDX-License-Identifier: Apache-2.0
// qk_l2norm's rows and the dq / dk chain rule through it (delta.cuh), for every delta-rule
// implementation (docs/math/LOGLINEAR.md §6.1: x -> x / sqrt(|x|^2 + eps)).
#include "core/plan.h"
#include "cuda/delta/delta.cuh"

namespace hila::cuda {

namespace {

// dq or dk per group: mult * sum over the group's heads of the per-head gradient (dx, plus dx2 when
// given), then through the l2 normalisation: dx = (dy - y (y.dy)) / sqrt(|x|^2 + eps)
// (docs/math/LOGLINEAR.md §6.1). One warp per (group, row), lanes over the columns; x is the packed raw
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
      inv = R(1) / sqrt(ss + R(detail::kL2NormEps));
      ydy = xdy * inv;
    }
    for (int cc = lane; cc < dk; cc += 32) put(cc, l2 ? (dy(cc) - from<R>(xr[cc]) * inv * ydy) * inv : dy(cc));
  }
}
// q^ or k rows of [X][Ttot][dp] (first d columns) -> x / sqrt(|x|^2 + eps), from src to dst
// (which may be the same buffer). One warp per row.
template <class T>
__global__ void l2norm_rows(const T* src, T* dst, int64_t rows, int d, int dp) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows;
       r += int64_t(gridDim.x) * blockDim.x / 32) {
    const T* row = src + r * dp;
    float ss = 0.f;
    for (int j = lane; j < d; j += 32) ss += float(row[j]) * float(row[j]);
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = 1.f / sqrtf(ss + float(detail::kL2NormEps));
    for (int j = lane; j < d; j += 32) dst[r * dp + j] = to<T>(float(row[j]) * inv);
  }
}

}  // namespace

template <class T>
void launch_unpack_qk(const TensorView& out, const Acc<T>* dx, const Acc<T>* dx2, const T* x, const detail::Resolved& r, int dk, int dkp,
                      Acc<T> mult, cudaStream_t s) {
  const int64_t rows = r.G * r.B * r.T;
  if (rows == 0 || dry_run()) return;  // dry run: workspace_size
  delta_unpack_qk<T><<<grid_for(rows * 32), 256, 0, s>>>(Strided(out), dx, dx2, x, r.T, r.G, int(r.H / r.G), r.B * r.T,
                                                         dk, dkp, mult, r.cfg.qk_l2norm);
  HILA_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_l2norm_rows(const T* src, T* dst, int64_t rows, int d, int dp, cudaStream_t s) {
  if (dry_run()) return;  // dry run: workspace_size
  l2norm_rows<T><<<grid_for(rows * 32), 256, 0, s>>>(src, dst, rows, d, dp);
  HILA_CUDA_CHECK_LAUNCH();
}

#define HILA_INSTANTIATE(T)                                                                                         \
  template void launch_unpack_qk<T>(const TensorView&, const Acc<T>*, const Acc<T>*, const T*, const detail::Resolved&, \
                                    int, int, Acc<T>, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE
// l2-normalised copies are taken by the sm80 tier only
template void launch_l2norm_rows<__nv_bfloat16>(const __nv_bfloat16*, __nv_bfloat16*, int64_t, int, int, cudaStream_t);
template void launch_l2norm_rows<__half>(const __half*, __half*, int64_t, int, int, cudaStream_t);

}  // namespace hila::cuda
