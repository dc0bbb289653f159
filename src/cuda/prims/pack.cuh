// SPDX-License-Identifier: Apache-2.0
// Pack / unpack kernels between the caller's strided, sequence-first tensors and the head-major
// buffers padded to multiples of 16 columns that the primitive kernels read.
#pragma once
#include <type_traits>

#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

// [B, T, X, d] (strided) -> packed [X][B*T][dp], zero beyond d; appends a ones column at `ones`.
template <class P>
__global__ void pack_rows(P* out, Strided in, int64_t T, int64_t X, int64_t Ttot, int d, int dp,
                          int ones) {
  const int64_t n = X * Ttot * dp;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(e % dp);
    const int64_t r = (e / dp) % Ttot, x = e / (dp * Ttot);
    const int64_t b = r / T, t = r % T;
    P v = to<P>(0.0f);
    if (c < d) v = to<P>(ld<Acc<P>>(in, b * in.s[0] + t * in.s[1] + x * in.s[2] + c * in.s[3]));
    else if (c == ones) v = to<P>(1.0f);
    out[e] = v;
  }
}

// The same for a 16-bit tensor of the packed dtype with unit column stride, (B, T) merged into rows
// of stride ld (head stride hs), 16-byte aligned rows and d = dp, d % 8 == 0: 16 bytes per thread.
template <class P>
__global__ void pack_rows8(P* out, const P* in, int64_t ld, int64_t hs, int64_t X, int64_t Ttot, int d) {
  const int d8 = d / 8;
  const int64_t n = X * Ttot * d8;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(e % d8) * 8;
    const int64_t r = (e / d8) % Ttot, x = e / (int64_t(d8) * Ttot);
    *reinterpret_cast<uint4*>(out + (x * Ttot + r) * d + c) = *reinterpret_cast<const uint4*>(in + x * hs + r * ld + c);
  }
}

// packed [X*rep][Ttot][dp] (P) -> [B, T, X, d] (strided): out = mult * sum over rep heads.
template <class P>
__global__ void unpack_rows(Strided out, const P* in, int64_t T, int64_t X, int rep, int64_t Ttot,
                            int d, int dp, Acc<P> mult) {
  using R = Acc<P>;
  const int64_t n = X * Ttot * d;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(e % d);
    const int64_t r = (e / d) % Ttot, x = e / (d * Ttot);
    R acc = 0;
    for (int j = 0; j < rep; ++j) acc += from<R>(in[((x * rep + j) * Ttot + r) * dp + c]);
    const int64_t b = r / T, t = r % T;
    st<R>(out, b * out.s[0] + t * out.s[1] + x * out.s[2] + c * out.s[3], mult * acc);
  }
}

// The same for the common layout: out [B, T, X, d] with unit column stride and (B, T) merged into
// rows of stride ld (head stride hs), d % 4 == 0; four columns per thread, no per-element dtype switch.
template <class P, class O>
__global__ void unpack_rows4(O* out, int64_t ld, int64_t hs, const P* in, int64_t X, int rep, int64_t Ttot, int d,
                             int dp, Acc<P> mult) {
  using R = Acc<P>;
  const int d4 = d / 4;
  const int64_t n = X * Ttot * d4;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(e % d4) * 4;
    const int64_t r = (e / d4) % Ttot, x = e / (int64_t(d4) * Ttot);
    R acc[4] = {0, 0, 0, 0};
    for (int j = 0; j < rep; ++j) {
      const P* src = in + ((x * rep + j) * Ttot + r) * dp + c;
#pragma unroll
      for (int u = 0; u < 4; ++u) acc[u] += from<R>(src[u]);
    }
    O* dst = out + x * hs + r * ld + c;
#pragma unroll
    for (int u = 0; u < 4; ++u) dst[u] = to<O>(mult * acc[u]);
  }
}

// gates [B, T, H(, P)] column p -> [H][Ttot]; and back for dg.
template <class R>
__global__ void pack_gates(R* out, Strided in, int64_t T, int64_t H, int64_t Ttot, int p) {
  const int64_t n = H * Ttot;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e % Ttot, h = e / Ttot, b = r / T, t = r % T;
    out[e] = ld<R>(in, b * in.s[0] + t * in.s[1] + h * in.s[2] + p * in.s[3]);
  }
}
template <class R>
__global__ void unpack_gates(Strided out, const R* in, int64_t T, int64_t H, int64_t Ttot, int p) {
  const int64_t n = H * Ttot;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e % Ttot, h = e / Ttot, b = r / T, t = r % T;
    st<R>(out, b * out.s[0] + t * out.s[1] + h * out.s[2] + p * out.s[3], in[e]);
  }
}

// Log-gates for the kernels (docs/OPERATORS.md "Resets"): a gate at or below kGateFloor<R> is
// packed as kGateFloor<R>. exp of the floor, and of the floor plus any sum of gates (<= 0), is
// exactly 0 in R (float32 underflows below about -104, float64 below about -745), so the kernels
// see the same reset as the serial form, while their chunk-local sums stay finite (a -inf gate would
// give -inf - (-inf) = NaN in b_i - b_j, a -1e30 one would cancel every gate after it).
template <class R>
inline constexpr R kGateFloor = std::is_same_v<R, double> ? R(-1024) : R(-128);
template <class R>
__global__ void pack_log_gates(R* out, Strided in, int64_t T, int64_t H, int64_t Ttot, int p) {
  const int64_t n = H * Ttot;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e % Ttot, h = e / Ttot, b = r / T, t = r % T;
    const R x = ld<R>(in, b * in.s[0] + t * in.s[1] + h * in.s[2] + p * in.s[3]);
    out[e] = x < kGateFloor<R> ? kGateFloor<R> : x;  // -inf and every gate below the floor; NaN stays NaN
  }
}
// dg back to the caller (as unpack_gates), 0 where the packed gate g is at the floor: the gradient
// of a reset gate is 0 (e^g = 0 multiplies it), where the kernels' sums would leave rounding.
template <class R>
__global__ void unpack_log_gate_grads(Strided out, const R* in, const R* g, int64_t T, int64_t H, int64_t Ttot,
                                      int p) {
  const int64_t n = H * Ttot;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e % Ttot, h = e / Ttot, b = r / T, t = r % T;
    st<R>(out, b * out.s[0] + t * out.s[1] + h * out.s[2] + p * out.s[3], g[e] <= kGateFloor<R> ? R(0) : in[e]);
  }
}

// state [N, H, dk, dv] (strided) <-> packed [N][H][dkp][dvp]
template <class R>
__global__ void pack_state(R* out, Strided in, int64_t NH, int64_t H, int dk, int dv, int dkp, int dvp) {
  const int64_t n = NH * dkp * dvp;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(e % dvp), i = int((e / dvp) % dkp);
    const int64_t nh = e / (int64_t(dkp) * dvp);
    out[e] = (i < dk && j < dv) ? ld<R>(in, (nh / H) * in.s[0] + (nh % H) * in.s[1] + i * in.s[2] + j * in.s[3]) : R(0);
  }
}
template <class R>
__global__ void unpack_state(Strided out, const R* in, int64_t NH, int64_t H, int dk, int dv, int dkp, int dvp) {
  const int64_t n = NH * dk * dv;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(e % dv), i = int((e / dv) % dk);
    const int64_t nh = e / (int64_t(dk) * dv);
    st<R>(out, (nh / H) * out.s[0] + (nh % H) * out.s[1] + i * out.s[2] + j * out.s[3],
          in[(nh * dkp + i) * dvp + j]);
  }
}

// lam [B, T, H, L] (strided) -> [H][Ttot][L]; and back for dlam. Element e of the packed buffer is
// (h, r, l) with r = b T + t. Where (B, T) merge into rows of stride s[1] (s[0] = T s[1], or B = 1) and the
// buffer has fewer than 2^31 elements, the index splits in 32-bit arithmetic: 64-bit divisions
// bound these kernels (B = 1, T = 64K, H = 16, L = 17 on an H100: 0.168 ms a launch in 64-bit
// arithmetic, 0.110 in 32-bit).
struct LamIndex {
  int64_t T, H, Ttot;
  int L;
  bool fast;
  LamIndex(const Strided& x, int64_t T_, int64_t H_, int64_t Ttot_, int L_)
      : T(T_), H(H_), Ttot(Ttot_), L(L_), fast((Ttot_ <= T_ || x.s[0] == T_ * x.s[1]) && H_ * Ttot_ * L_ <= INT32_MAX) {}
  __host__ __device__ int64_t size() const { return H * Ttot * L; }
  // the strided offset of packed element e
  __device__ int64_t offset(const Strided& x, int64_t e) const {
    if (fast) {
      const uint32_t u = uint32_t(e), hr = u / uint32_t(L), l = u - hr * uint32_t(L);
      const uint32_t h = hr / uint32_t(Ttot), r = hr - h * uint32_t(Ttot);
      return int64_t(r) * x.s[1] + int64_t(h) * x.s[2] + int64_t(l) * x.s[3];
    }
    const int l = int(e % L);
    const int64_t r = (e / L) % Ttot, h = e / (int64_t(L) * Ttot), b = r / T, t = r % T;
    return b * x.s[0] + t * x.s[1] + h * x.s[2] + l * x.s[3];
  }
};
template <class R>
__global__ void pack_lam(R* out, Strided in, LamIndex ix) {
  const int64_t n = ix.size();
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
    out[e] = ld<R>(in, ix.offset(in, e));
}
template <class R>
__global__ void unpack_lam(Strided out, const R* in, LamIndex ix) {
  const int64_t n = ix.size();
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
    st<R>(out, ix.offset(out, e), in[e]);
}

// Fenwick state [N, H, Ls_in, dk, dv] (strided) -> packed [N][H][Ls][dkp][dvp] holding only the
// slots live at pos[n] (the canonical slots, docs/math/LOGLINEAR.md §2.5; every other slot is zero).
template <class R>
__global__ void pack_levels(R* out, Strided in, const int64_t* pos, int64_t NH, int64_t H, int Ls_in, int Ls,
                            int dk, int dv, int dkp, int dvp) {
  const int64_t n = NH * Ls * dkp * dvp;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(e % dvp), i = int((e / dvp) % dkp), l = int((e / (int64_t(dkp) * dvp)) % Ls);
    const int64_t nh = e / (int64_t(Ls) * dkp * dvp), x = pos[nh / H];
    const bool live = l >= 1 && l <= 63 && ((x >> (l - 1)) & 1);
    out[e] = (live && l < Ls_in && i < dk && j < dv)
                 ? ld<R>(in, (nh / H) * in.s[0] + (nh % H) * in.s[1] + l * in.s[2] + i * in.s[3] + j * in.s[4])
                 : R(0);
  }
}
// packed [N][H][Ls][dkp][dvp] -> [N, H, Ls_out, dk, dv] (strided); slots from Ls on are zero.
template <class R>
__global__ void unpack_levels(Strided out, const R* in, int64_t NH, int64_t H, int Ls_out, int Ls, int dk, int dv,
                              int dkp, int dvp) {
  const int64_t n = NH * Ls_out * dk * dv;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(e % dv), i = int((e / dv) % dk), l = int((e / (int64_t(dk) * dv)) % Ls_out);
    const int64_t nh = e / (int64_t(Ls_out) * dk * dv);
    const R x = l < Ls ? in[((nh * Ls + l) * dkp + i) * dvp + j] : R(0);
    st<R>(out, (nh / H) * out.s[0] + (nh % H) * out.s[1] + l * out.s[2] + i * out.s[3] + j * out.s[4], x);
  }
}

__device__ __forceinline__ int64_t packed_index(int i, int j, int d) { return int64_t(i) * d - int64_t(i) * (i - 1) / 2 + (j - i); }

// packed symmetric S [N, H, dk(dk+1)/2] -> dense [N][H][dkp][dkp]; as a cotangent only the upper
// triangle is set (<p, dp> = sum_{i<=j} S_ij dp_ij).
template <class R>
__global__ void pack_sym(R* out, Strided in, int64_t NH, int64_t H, int dk, int dkp, bool cotangent) {
  const int64_t n = NH * dkp * dkp;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(e % dkp), i = int((e / dkp) % dkp);
    const int64_t nh = e / (int64_t(dkp) * dkp);
    R x = 0;
    if (i < dk && j < dk && (i <= j || !cotangent)) {
      const int a = i < j ? i : j, b = i < j ? j : i;
      x = ld<R>(in, (nh / H) * in.s[0] + (nh % H) * in.s[1] + packed_index(a, b, dk) * in.s[2]);
    }
    out[e] = x;
  }
}
// dense -> packed; as a gradient the off-diagonal entry is dS_ij + dS_ji.
template <class R>
__global__ void unpack_sym(Strided out, const R* in, int64_t NH, int64_t H, int dk, int dkp, bool gradient) {
  const int64_t m = int64_t(dk) * (dk + 1) / 2, n = NH * m;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t nh = e / m;
    int64_t r = e % m;
    int i = 0;
    while (r >= dk - i) r -= dk - i, ++i;  // row of the packed upper triangle
    const int j = i + int(r);
    const R* S = in + nh * dkp * dkp;
    const R x = gradient && i != j ? S[i * dkp + j] + S[j * dkp + i] : S[i * dkp + j];
    st<R>(out, (nh / H) * out.s[0] + (nh % H) * out.s[1] + packed_index(i, j, dk) * out.s[2], x);
  }
}

// y (+)= a * x over n elements, with conversion (packed buffers of different types).
template <class Y, class X>
__global__ void axpy_k(Y* y, const X* x, int64_t n, Acc<Y> a, bool accumulate) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const Acc<Y> v = a * from<Acc<Y>>(x[e]);
    y[e] = to<Y>(accumulate ? from<Acc<Y>>(y[e]) + v : v);
  }
}

// U [H][Ttot][dkp] += c * q (u_j = (S_j + ridge I) q^_j, c = ridge * scale); q's head x = h / rep
// at q + x*hs + row*ld.
template <class T>
__global__ void add_ridge(T* U, const T* q, int64_t ld, int64_t hs, int64_t H, int rep, int64_t Ttot, int dkp, Acc<T> c) {
  const int64_t n = H * Ttot * dkp;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int col = int(e % dkp);
    const int64_t row = (e / dkp) % Ttot, h = e / (int64_t(dkp) * Ttot);
    U[e] = to<T>(from<Acc<T>>(U[e]) + c * from<Acc<T>>(q[(h / rep) * hs + row * ld + col]));
  }
}

// normalize (docs/math/HLA.md §4): o = num / (den + eps) from O' [H][Ttot][dvp] (den in column dv)
template <class T>
__global__ void unpack_normalized(Strided out, const T* in, int64_t T_, int64_t H, int64_t Ttot, int dv, int dvp,
                                  Acc<T> eps) {
  using R = Acc<T>;
  const int64_t n = H * Ttot * dv;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(e % dv);
    const int64_t r = (e / dv) % Ttot, h = e / (int64_t(dv) * Ttot);
    const T* row = in + (h * Ttot + r) * dvp;
    const int64_t b = r / T_, t = r % T_;
    st<R>(out, b * out.s[0] + t * out.s[1] + h * out.s[2] + c * out.s[3], from<R>(row[c]) / (from<R>(row[dv]) + eps));
  }
}
// dO' = [dO / (den + eps) | -sum(dO o num) / (den + eps)^2] per row; dO is packed [H][Ttot][dvp].
template <class T>
__global__ void normalized_cotangent(T* dOp, const T* Op, int64_t rows, int dv, int dvp, Acc<T> eps) {
  using R = Acc<T>;
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    T* d = dOp + r * dvp;
    const T* o = Op + r * dvp;
    const R den = from<R>(o[dv]) + eps;
    R s = 0;
    for (int c = 0; c < dv; ++c) {
      const R g = from<R>(d[c]);
      s += g * from<R>(o[c]);
      d[c] = to<T>(g / den);
    }
    d[dv] = to<T>(-s / (den * den));
  }
}

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return DType::bf16;
  else if constexpr (std::is_same_v<T, __half>) return DType::f16;
  else if constexpr (std::is_same_v<T, float>) return DType::f32;
  else return DType::f64;
}

// Whether the tensor-core kernels can read / write a caller's [B, T, X, d] tensor in place: same
// dtype, d a multiple of 16 (no padding), unit column stride, 16-byte aligned rows, positive row and
// head strides (broadcast views go through the pack path), and (B, T) merging into one row index.
template <class T>
bool in_place_ok(const TensorView& t, int64_t B, int64_t T_) {
  if (!kTensorCore<T> || !t.defined() || t.dtype != dtype_of<T>() || t.ndim != 4) return false;
  const int64_t d = t.shape[3];
  return d % 16 == 0 && t.stride[3] == 1 && t.stride[1] > 0 && t.stride[2] > 0 && t.stride[1] % 8 == 0 &&
         t.stride[2] % 8 == 0 &&
         (B == 1 || t.stride[0] == T_ * t.stride[1]) && reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
}

// [B, T, X, d] -> packed [X][Ttot][dp] (a ones column at `ones`, or -1); 16 bytes per thread when
// the caller's layout is one the tensor-core kernels could read in place.
template <class T>
void pack_to(T* out, const TensorView& t, const detail::Resolved& r, int64_t X, int d, int dp, int ones,
             cudaStream_t s) {
  const int64_t Ttot = r.B * r.T;
  if (ones < 0 && d == dp && in_place_ok<T>(t, r.B, r.T))
    HILA_LAUNCH(pack_rows8<T>, X * Ttot * dp / 8, s, out, static_cast<const T*>(t.data), t.stride[1], t.stride[2], X,
                Ttot, d);
  else
    HILA_LAUNCH(pack_rows<T>, X * Ttot * dp, s, out, Strided(t), r.T, X, Ttot, d, dp, ones);
}

// packed [X*rep][Ttot][dp] -> the caller's [B, T, X, d]: mult * the sum over rep heads; four
// columns per thread for a row layout with unit column stride.
template <class P>
void unpack_to(const TensorView& out, const P* in, const detail::Resolved& r, int64_t X, int rep, int d, int dp,
               Acc<P> mult, cudaStream_t s) {
  const int64_t Ttot = r.B * r.T;
  const bool rows = out.ndim == 4 && d % 4 == 0 && out.stride[3] == 1 && (r.B == 1 || out.stride[0] == r.T * out.stride[1]) &&
                    reinterpret_cast<uintptr_t>(out.data) % 8 == 0;
  const int64_t n4 = X * Ttot * (d / 4);
  auto vec = [&](auto* o) {
    HILA_LAUNCH((unpack_rows4<P, std::remove_pointer_t<decltype(o)>>), n4, s, o, out.stride[1], out.stride[2], in, X, rep, Ttot,
                d, dp, mult);
  };
  if (rows && out.dtype == DType::bf16) vec(static_cast<__nv_bfloat16*>(out.data));
  else if (rows && out.dtype == DType::f16) vec(static_cast<__half*>(out.data));
  else if (rows && out.dtype == DType::f32) vec(static_cast<float*>(out.data));
  else HILA_LAUNCH(unpack_rows<P>, X * Ttot * d, s, Strided(out), in, r.T, X, rep, Ttot, d, dp, mult);
}

}  // namespace hila::cuda
