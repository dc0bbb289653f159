// SPDX-License-Identifier: Apache-2.0
// qk_l2norm's rows and the dq / dk chain rule through it (delta.cuh), for every delta-rule
// implementation (docs/math/LOGLINEAR.md §6.1: x -> x / sqrt(|x|^2 + eps)).
#include <algorithm>

#include "core/plan.h"
#include "cuda/delta/delta.cuh"
#include "cuda/prims/mma.cuh"
#include "cuda/prims/pack.cuh"

namespace hila::cuda {

namespace {

// dq or dk per group: mult * sum over the group's heads of the per-head gradient (dx, plus dx2 when
// given), then through the l2 normalisation: dx = (dy - y (y.dy)) / sqrt(|x|^2 + eps)
// (docs/math/LOGLINEAR.md §6.1). One warp per (group, row), lanes over the columns; x is the caller's
// raw input [B, T, G, dk]. dx rows have dkp >= dk columns; the first dk are read and written.
template <class T>
__global__ void delta_unpack_qk(Strided out, const Acc<T>* dx, const Acc<T>* dx2, Strided x, int64_t T_, int64_t G, int rep,
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
    const int64_t xr = b * x.s[0] + t * x.s[1] + g * x.s[2];
    auto xv_at = [&](int cc) { return ld<R>(x, xr + cc * x.s[3]); };
    auto put = [&](int cc, R d) { st<R>(out, b * out.s[0] + t * out.s[1] + g * out.s[2] + cc * out.s[3], d); };
    R inv = 1, ydy = 0;
    if (l2) {
      R ss = 0, xdy = 0;
      for (int cc = lane; cc < dk; cc += 32) {
        const R xv = xv_at(cc);
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
    for (int cc = lane; cc < dk; cc += 32) put(cc, l2 ? (dy(cc) - xv_at(cc) * inv * ydy) * inv : dy(cc));
  }
}
// 4 consecutive 16-bit values <-> fp32 (8 bytes)
template <class T>
__device__ __forceinline__ float4 load4(const T* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = mma::unpack2<T>(u.x), b = mma::unpack2<T>(u.y);
  return make_float4(a.x, a.y, b.x, b.y);
}
template <class T>
__device__ __forceinline__ void store4(T* p, float4 v) {
  *reinterpret_cast<uint2*>(p) = make_uint2(mma::pack2<T>(v.x, v.y), mma::pack2<T>(v.z, v.w));
}

// The offset of row r (of the B x T merged rows) of group g in a [B, T, G, d] view, without 64-bit
// divisions where (B, T) merge into rows of one stride (B == 1 or s0 == T s1).
struct RowAddr {
  int64_t s0, s1, s2, T;
  bool merged;
  explicit RowAddr(const TensorView& t, int64_t B, int64_t T_)
      : s0(t.stride[0]), s1(t.stride[1]), s2(t.stride[2]), T(T_), merged(B == 1 || t.stride[0] == T_ * t.stride[1]) {}
  __device__ int64_t operator()(int64_t r, int64_t g) const {
    return merged ? r * s1 + g * s2 : (r / T) * s0 + (r % T) * s1 + g * s2;
  }
};

// Rows per warp of delta_unpack_qk4: a warp issues the loads of its rows before its first reduction.
constexpr int kRows = 4;

// The columns [4 (lane + 32 v), +4) of the warp's rows r0 + q W (q < R) of group g of the
// caller's [B, T, G, d] x, as fp32 (0 past d and for rows >= Ttot): 8-byte loads where the layout
// allows (vx), else element by element.
template <class T, int V, int R>
__device__ __forceinline__ void load_rows4(float4 (&xv)[R][V], const Strided& x, const RowAddr& xa, int64_t g,
                                           int64_t r0, int64_t W, int64_t Ttot, int d, bool vx) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int q = 0; q < R; ++q) {
    const int64_t r = r0 + q * W;
    const int64_t xr = r < Ttot ? xa(r, g) : 0;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const int c0 = 4 * (lane + 32 * v);
      xv[q][v] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (r >= Ttot || c0 >= d) continue;
      if (vx) xv[q][v] = load4(static_cast<const T*>(x.p) + xr + c0);
      else {
        float* xs = &xv[q][v].x;
        for (int u = 0; u < 4 && c0 + u < d; ++u) xs[u] = ld<float>(x, xr + (c0 + u) * x.s[3]);
      }
    }
  }
}

// delta_unpack_qk for the tensor-core tier's 16-bit T (fp32 dx), dkp % 4 == 0, dkp <= 128 V: lane l
// holds the columns [4 (l + 32 v), +4) of its rows in registers, every load of the warp's kRows rows
// (rows r, r + W, .., W the warps of the grid) issued before the reductions: dx (and dx2) as
// float4, x and out as four 16-bit values (8 bytes) where their layout allows (vx, vo: unit column
// stride, dk % 4 == 0, 8-byte aligned rows, T's dtype), else element by element.
// Registers bounded for three blocks per SM at V = 1 (80, no spills; the loads of four rows held).
template <class T, int V>
__global__ void __launch_bounds__(256, V == 1 ? 3 : 1)
    delta_unpack_qk4(Strided out, RowAddr oa, const float* dx, const float* dx2, Strided x, RowAddr xa, int64_t G,
                     int rep, int64_t Ttot, int dk, int dkp, float mult, bool l2, bool vx, bool vo) {
  const int lane = threadIdx.x & 31;
  const int64_t W = int64_t(gridDim.x) * blockDim.x / 32;  // warps of the grid's x axis
  for (int64_t g = blockIdx.y; g < G; g += gridDim.y)      // grid (row blocks, groups)
    for (int64_t r0 = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; r0 < Ttot; r0 += kRows * W) {
      float4 y[kRows][V], xv[kRows][V] = {};
      if (l2) load_rows4<T, V, kRows>(xv, x, xa, g, r0, W, Ttot, dk, vx);
#pragma unroll
      for (int q = 0; q < kRows; ++q) {
        const int64_t r = r0 + q * W;
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const int c0 = 4 * (lane + 32 * v);
          y[q][v] = make_float4(0.f, 0.f, 0.f, 0.f);
          if (r >= Ttot || c0 >= dk) continue;
          for (int j = 0; j < rep; ++j) {  // the group's heads: [H][Ttot][dkp]
            const int64_t o = ((g * rep + j) * Ttot + r) * dkp + c0;
            const float4 a = *reinterpret_cast<const float4*>(dx + o);
            y[q][v].x += a.x, y[q][v].y += a.y, y[q][v].z += a.z, y[q][v].w += a.w;
            if (dx2) {
              const float4 a2 = *reinterpret_cast<const float4*>(dx2 + o);
              y[q][v].x += a2.x, y[q][v].y += a2.y, y[q][v].z += a2.z, y[q][v].w += a2.w;
            }
          }
          if (c0 + 4 > dk) {  // dk % 4 != 0: the padding columns of dx are not the gradient's
            float* ys = &y[q][v].x;
            for (int u = dk - c0; u < 4; ++u) ys[u] = 0.f;
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kRows; ++q) {
        const int64_t r = r0 + q * W;
        if (r >= Ttot) break;  // uniform over the warp
        float inv = 1.f, ydy = 0.f;
        if (l2) {  // the columns >= dk hold y = 0 (not read) and x = 0
          float ss = 0.f, xdy = 0.f;
#pragma unroll
          for (int v = 0; v < V; ++v) {
            const float4 a = xv[q][v], b = y[q][v];
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
            xdy += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
          }
          for (int o = 16; o > 0; o >>= 1) {
            ss += __shfl_xor_sync(0xffffffffu, ss, o);
            xdy += __shfl_xor_sync(0xffffffffu, xdy, o);
          }
          inv = 1.f / sqrtf(ss + float(detail::kL2NormEps));
          ydy = mult * xdy * inv;
        }
        const int64_t orow = oa(r, g);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const int c0 = 4 * (lane + 32 * v);
          if (c0 >= dk) continue;
          const float4 a = xv[q][v], b = y[q][v];
          float4 d = make_float4(mult * b.x, mult * b.y, mult * b.z, mult * b.w);
          if (l2)  // (dy - y (y.dy)) / |x|, y = x / |x|
            d = make_float4((d.x - a.x * inv * ydy) * inv, (d.y - a.y * inv * ydy) * inv,
                            (d.z - a.z * inv * ydy) * inv, (d.w - a.w * inv * ydy) * inv);
          if (vo) store4(static_cast<T*>(out.p) + orow + c0, d);
          else {
            const float* ds = &d.x;
            for (int u = 0; u < 4 && c0 + u < dk; ++u) st<float>(out, orow + (c0 + u) * out.s[3], ds[u]);
          }
        }
      }
    }
}

// 8 consecutive 16-bit values <-> fp32 (16 bytes)
template <class T>
__device__ __forceinline__ void load8(float (&v)[8], const T* p) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = mma::unpack2<T>(w[i]);
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
}
template <class T>
__device__ __forceinline__ void store8(T* p, const float (&v)[8], float m) {
  *reinterpret_cast<uint4*>(p) = make_uint4(mma::pack2<T>(m * v[0], m * v[1]), mma::pack2<T>(m * v[2], m * v[3]),
                                            mma::pack2<T>(m * v[4], m * v[5]), mma::pack2<T>(m * v[6], m * v[7]));
}

// The caller's q or k [B, T, G, d] -> packed [G][Ttot][dp], each row x / sqrt(|x|^2 + eps) (the
// padding columns zero), and 1 / sqrt(|x|^2 + eps) to rstd [G][Ttot] when given. L lanes per row,
// each on 8 columns [8 l, 8 l + 8) (dp <= 8 L), so a warp holds 32 / L rows at a time and R such
// sets: its 32 R / L consecutive rows are all loaded (16 bytes a lane where the input's layout
// allows, vx; else element by element) before the first reduction, which keeps enough bytes in
// flight per SM for the pass to run at memory speed.
template <class T, int L, int R>
__global__ void __launch_bounds__(256) l2norm_pack(T* dst, float* rstd, Strided x, RowAddr xa, int64_t G, int64_t Ttot,
                                                   int d, int dp, bool vx) {
  constexpr int P = 32 / L;  // rows per set
  const int lane = threadIdx.x & 31, sub = lane / L, c0 = 8 * (lane % L);
  const int64_t W = int64_t(gridDim.x) * blockDim.x / 32;  // warps of the grid's x axis
  for (int64_t g = blockIdx.y; g < G; g += gridDim.y)      // grid (row blocks, groups)
    for (int64_t rb = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32 * (P * R); rb < Ttot; rb += W * P * R) {
      float v[R][8];
#pragma unroll
      for (int q = 0; q < R; ++q) {
        const int64_t r = rb + q * P + sub;
#pragma unroll
        for (int u = 0; u < 8; ++u) v[q][u] = 0.f;
        if (r >= Ttot || c0 >= d) continue;
        const int64_t xr = xa(r, g);
        if (vx) load8(v[q], static_cast<const T*>(x.p) + xr + c0);
        else
          for (int u = 0; u < 8 && c0 + u < d; ++u) v[q][u] = ld<float>(x, xr + (c0 + u) * x.s[3]);
      }
#pragma unroll
      for (int q = 0; q < R; ++q) {
        const int64_t r = rb + q * P + sub;
        float ss = 0.f;
#pragma unroll
        for (int u = 0; u < 8; ++u) ss += v[q][u] * v[q][u];
#pragma unroll
        for (int o = L / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);  // within the row's L lanes
        if (r >= Ttot) continue;
        const float inv = 1.f / sqrtf(ss + float(detail::kL2NormEps));
        const int64_t e = g * Ttot + r;
        if (rstd && c0 == 0) rstd[e] = inv;
        if (c0 < dp) store8(dst + e * dp + c0, v[q], inv);
      }
    }
}

// Grid of the row passes: 8 warps per block, R rows per warp, the groups on y.
inline dim3 rows_grid(const detail::Resolved& r, int R) {
  return dim3(unsigned(std::min<int64_t>((r.B * r.T + 8 * R - 1) / (8 * R), 1 << 20)),
              unsigned(std::min<int64_t>(r.G, 65535)));
}

// whether a [B, T, X, d] view can be read or written N 16-bit elements of T at a time (unit column
// stride, d and the other strides multiples of N, the data aligned to 2N bytes)
template <class T, int N>
bool rows_vec(const TensorView& t, int d) {
  if (sizeof(T) != 2 || t.dtype != dtype_of<T>() || t.ndim != 4 || d % N != 0 || t.stride[3] != 1) return false;
  for (int i = 0; i < 3; ++i)
    if (t.stride[i] % N != 0) return false;
  return reinterpret_cast<uintptr_t>(t.data) % (2 * N) == 0;
}

}  // namespace

template <class T>
void launch_unpack_qk(const TensorView& out, const Acc<T>* dx, const Acc<T>* dx2, const TensorView& x,
                      const detail::Resolved& r, int dk, int dkp, Acc<T> mult, cudaStream_t s) {
  const int64_t rows = r.G * r.B * r.T;
  if (rows == 0 || dry_run()) return;  // dry run: workspace_size
  const int rep = int(r.H / r.G);
  const bool l2 = r.cfg.qk_l2norm;
  if constexpr (kTensorCore<T>) {
    if (dkp % 4 == 0 && dkp <= 256) {
      auto go = [&](auto kernel) {
        kernel<<<rows_grid(r, kRows), 256, 0, s>>>(Strided(out), RowAddr(out, r.B, r.T), dx, dx2, Strided(x),
                                            RowAddr(x, r.B, r.T), r.G, rep, r.B * r.T, dk, dkp, mult, l2,
                                            rows_vec<T, 4>(x, dk), rows_vec<T, 4>(out, dk));
      };
      if (dkp <= 128) go(delta_unpack_qk4<T, 1>);
      else go(delta_unpack_qk4<T, 2>);
      HILA_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  delta_unpack_qk<T><<<grid_for(rows * 32), 256, 0, s>>>(Strided(out), dx, dx2, Strided(x), r.T, r.G, rep, r.B * r.T,
                                                         dk, dkp, mult, l2);
  HILA_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_l2norm_pack(T* dst, float* rstd, const TensorView& x, const detail::Resolved& r, int d, int dp,
                        cudaStream_t s) {
  const int64_t rows = r.G * r.B * r.T;
  // the tensor-core tier's padded head dims (heuristics::delta_sm80: dk <= 128) are within this
  if (dp % 8 != 0 || dp > 256) throw Error("dk", "l2norm_pack takes padded head dims of at most 256 (multiples of 8)");
  if (rows == 0 || dry_run()) return;  // dry run: workspace_size
  constexpr int R = 2;
  auto go = [&](auto kernel, int L) {
    const int64_t per_block = 8 * R * (32 / L);  // rows of one block of 8 warps
    const dim3 grid(unsigned(std::min<int64_t>((r.B * r.T + per_block - 1) / per_block, 1 << 20)),
                    unsigned(std::min<int64_t>(r.G, 65535)));
    kernel<<<grid, 256, 0, s>>>(dst, rstd, Strided(x), RowAddr(x, r.B, r.T), r.G, r.B * r.T, d, dp, rows_vec<T, 8>(x, d));
  };
  if (dp <= 64) go(l2norm_pack<T, 8, R>, 8);
  else if (dp <= 128) go(l2norm_pack<T, 16, R>, 16);
  else go(l2norm_pack<T, 32, R>, 32);
  HILA_CUDA_CHECK_LAUNCH();
}

#define HILA_INSTANTIATE(T)                                                                                         \
  template void launch_unpack_qk<T>(const TensorView&, const Acc<T>*, const Acc<T>*, const TensorView&,        \
                                    const detail::Resolved&, int, int, Acc<T>, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE
// l2-normalised packed copies are taken by the sm80 tier only
template void launch_l2norm_pack<__nv_bfloat16>(__nv_bfloat16*, float*, const TensorView&, const detail::Resolved&, int,
                                                int, cudaStream_t);
template void launch_l2norm_pack<__half>(__half*, float*, const TensorView&, const detail::Resolved&, int, int,
                                         cudaStream_t);

}  // namespace hila::cuda
