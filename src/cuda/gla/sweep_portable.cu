// SPDX-License-Identifier: Apache-2.0
// Kernels of the GLA primitive; see gla.cuh for the math and the grid mapping.
#include <cub/block/block_scan.cuh>
#include <optional>

#include "cuda/gla/gla.cuh"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

namespace {

template <class T>
struct FwdSmem {
  using R = Acc<T>;
  T *Q, *K, *V, *Hs, *P;
  R *A, *O, *Hf, *b;
  int ldk, ldv, ldc, ldkr, ldvr, ldcr;
  __host__ __device__ FwdSmem(char* base, int dk, size_t* bytes = nullptr) {
    ldk = ld_of<T>(dk), ldv = ld_of<T>(kBV), ldc = ld_of<T>(kChunk);
    ldvr = ld_of<R>(kBV), ldcr = ld_of<R>(kChunk);
    Carve c{base};
    Q = c.take<T>(kChunk * ldk);
    K = c.take<T>(kChunk * ldk);
    V = c.take<T>(kChunk * ldv);
    Hs = c.take<T>(dk * ldv);
    P = c.take<T>(kChunk * ldc);
    A = c.take<R>(kChunk * ldcr);
    O = c.take<R>(kChunk * ldvr);
    Hf = c.take<R>(dk * ldvr);
    b = c.take<R>(kChunk);
    if (bytes) *bytes = c.used;
  }
};

// Forward sweep: grid (dv / 64, N * H), one [dk, 64] state tile per block.
template <class T>
__global__ void __launch_bounds__(256) gla_fwd_kernel(GlaArgs<T> a) {
  using R = Acc<T>;
  extern __shared__ __align__(128) char smem[];
  FwdSmem<T> s(smem, a.dk);
  const int v0 = blockIdx.x * kBV, bv = min(kBV, a.dv - v0);
  const int seq = blockIdx.y / a.H, h = blockIdx.y % a.H;
  const int64_t len = a.len[seq], row0 = a.row0[seq];
  const T* q = a.q + int64_t(h / a.q_div) * a.Ttot * a.dk;
  const T* k = a.k + int64_t(h / a.k_div) * a.Ttot * a.dk;
  const T* v = a.v + int64_t(h / a.v_div) * a.Ttot * a.dv;
  const R* g = a.g ? a.g + int64_t(h) * a.Ttot : nullptr;
  const int64_t sidx = (int64_t(seq) * a.H + h) * a.dk * a.dv;  // [N][H][dk][dv] offset
  tile_load(s.Hf, s.ldvr, a.h0 ? a.h0 + sidx : nullptr, a.dv, v0, a.dk, bv);
  __syncthreads();
  const int nch = int((len + a.C - 1) / a.C);
  for (int c = 0; c < nch; ++c) {
    const int64_t r0 = row0 + int64_t(c) * a.C;
    const int nr = rows_in(len, c, a.C);
    if (a.hbuf)
      tile_store(a.hbuf + ((a.chunk0[seq] + c) * a.H + h) * int64_t(a.dk) * a.dv, a.dv, v0, s.Hf, s.ldvr, a.dk, bv);
    load_rows(s.Q, s.ldk, q, a.dk, r0, nr, 0, a.dk);
    load_rows(s.K, s.ldk, k, a.dk, r0, nr, 0, a.dk);
    load_rows(s.V, s.ldv, v, a.dv, r0, nr, v0, bv);
    chunk_cumsum(s.b, g, r0, nr);  // includes a barrier
    if (a.o) {
      for (int e = threadIdx.x; e < a.dk * bv; e += blockDim.x)
        s.Hs[(e / bv) * s.ldv + e % bv] = to<T>(s.Hf[(e / bv) * s.ldvr + e % bv]);
      smem_gemm<T, false, true>(s.A, s.ldcr, s.Q, s.ldk, s.K, s.ldk, kChunk, kChunk, a.dk, false);
      for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
        const int i = e / kChunk, j = e % kChunk;
        const R x = (j <= i && i < nr) ? s.A[i * s.ldcr + j] * a.scale * exp(s.b[i] - s.b[j]) : R(0);
        s.P[i * s.ldc + j] = to<T>(x);
      }
      for (int e = threadIdx.x; e < kChunk * a.dk; e += blockDim.x) {  // Q <- diag(scale e^b) Q
        const int i = e / a.dk, j = e % a.dk;
        s.Q[i * s.ldk + j] = to<T>(from<R>(s.Q[i * s.ldk + j]) * a.scale * exp(s.b[i]));
      }
      __syncthreads();
      smem_gemm<T, false, false>(s.O, s.ldvr, s.P, s.ldc, s.V, s.ldv, kChunk, bv, kChunk, false);
      smem_gemm<T, false, false>(s.O, s.ldvr, s.Q, s.ldk, s.Hs, s.ldv, kChunk, bv, a.dk, true);
      store_rows(a.o + int64_t(h) * a.Ttot * a.dv, a.dv, r0, v0, s.O, s.ldvr, nr, bv);
    }
    // H <- e^B H + K^T diag(e^{B-b}) V
    const R B = s.b[kChunk - 1];
    for (int e = threadIdx.x; e < kChunk * bv; e += blockDim.x) {
      const int i = e / bv, j = e % bv;
      s.V[i * s.ldv + j] = to<T>(from<R>(s.V[i * s.ldv + j]) * exp(B - s.b[i]));
    }
    tile_scale(s.Hf, s.ldvr, a.dk, bv, R(exp(B)));
    __syncthreads();
    smem_gemm<T, true, false>(s.Hf, s.ldvr, s.K, s.ldk, s.V, s.ldv, a.dk, bv, kChunk, true);
  }
  if (a.ht) tile_store(a.ht + sidx, a.dv, v0, s.Hf, s.ldvr, a.dk, bv);
}

// Reverse sweep of the state cotangent: dH_end(c) is stored, then dH <- e^B dH + Q^^T diag(e^b) dO.
template <class T>
__global__ void __launch_bounds__(256) gla_bwd_dh_kernel(GlaArgs<T> a) {
  using R = Acc<T>;
  extern __shared__ __align__(128) char smem[];
  FwdSmem<T> s(smem, a.dk);  // Q, V (as dO), Hf (as dH), b
  const int v0 = blockIdx.x * kBV, bv = min(kBV, a.dv - v0);
  const int seq = blockIdx.y / a.H, h = blockIdx.y % a.H;
  const int64_t len = a.len[seq], row0 = a.row0[seq];
  const T* q = a.q + int64_t(h / a.q_div) * a.Ttot * a.dk;
  const T* dO = a.dO + int64_t(h) * a.Ttot * a.dv;
  const R* g = a.g ? a.g + int64_t(h) * a.Ttot : nullptr;
  const int64_t sidx = (int64_t(seq) * a.H + h) * a.dk * a.dv;
  tile_load(s.Hf, s.ldvr, a.dht ? a.dht + sidx : nullptr, a.dv, v0, a.dk, bv);
  __syncthreads();
  const int nch = int((len + a.C - 1) / a.C);
  for (int c = nch - 1; c >= 0; --c) {
    const int64_t r0 = row0 + int64_t(c) * a.C;
    const int nr = rows_in(len, c, a.C);
    tile_store(a.dhbuf + ((a.chunk0[seq] + c) * a.H + h) * int64_t(a.dk) * a.dv, a.dv, v0, s.Hf, s.ldvr, a.dk, bv);
    load_rows(s.Q, s.ldk, q, a.dk, r0, nr, 0, a.dk);
    load_rows(s.V, s.ldv, dO, a.dv, r0, nr, v0, bv);
    chunk_cumsum(s.b, g, r0, nr);
    const R B = s.b[kChunk - 1];
    for (int e = threadIdx.x; e < kChunk * bv; e += blockDim.x) {
      const int i = e / bv, j = e % bv;
      s.V[i * s.ldv + j] = to<T>(from<R>(s.V[i * s.ldv + j]) * a.scale * exp(s.b[i]));
    }
    tile_scale(s.Hf, s.ldvr, a.dk, bv, R(exp(B)));
    __syncthreads();
    smem_gemm<T, true, false>(s.Hf, s.ldvr, s.Q, s.ldk, s.V, s.ldv, a.dk, bv, kChunk, true);
  }
  if (a.dh0) tile_store(a.dh0 + sidx, a.dv, v0, s.Hf, s.ldvr, a.dk, bv);
}

template <class T>
struct BwdSmem {
  using R = Acc<T>;
  T *Q, *K, *V, *dO, *Hp, *dH, *P, *dA;
  R *A, *X, *b, *dc;
  int ldk, ldv, ldc, ldcr, ldx;
  __host__ __device__ BwdSmem(char* base, int dk, int dv, size_t* bytes = nullptr) {
    ldk = ld_of<T>(dk), ldv = ld_of<T>(dv), ldc = ld_of<T>(kChunk);
    ldcr = ld_of<R>(kChunk), ldx = ld_of<R>(dk > dv ? dk : dv);
    Carve c{base};
    Q = c.take<T>(kChunk * ldk);
    K = c.take<T>(kChunk * ldk);
    V = c.take<T>(kChunk * ldv);
    dO = c.take<T>(kChunk * ldv);
    Hp = c.take<T>(dk * ldv);
    dH = c.take<T>(dk * ldv);
    P = c.take<T>(kChunk * ldc);
    dA = c.take<T>(kChunk * ldc);
    A = c.take<R>(kChunk * ldcr);
    X = c.take<R>(kChunk * ldx);
    b = c.take<R>(kChunk);
    dc = c.take<R>(kChunk);
    if (bytes) *bytes = c.used;
  }
};

// Per-chunk gradients: grid (nchunks, H).
template <class T>
__global__ void __launch_bounds__(256) gla_bwd_chunk_kernel(GlaArgs<T> a) {
  using R = Acc<T>;
  extern __shared__ __align__(128) char smem[];
  BwdSmem<T> s(smem, a.dk, a.dv);
  const int64_t cg = blockIdx.x;
  const int h = blockIdx.y, seq = a.chunk_seq[cg];
  const int64_t c = cg - a.chunk0[seq];
  const int64_t r0 = a.row0[seq] + c * a.C;
  const int nr = rows_in(a.len[seq], c, a.C);
  const int dk = a.dk, dv = a.dv;
  load_rows(s.Q, s.ldk, a.q + int64_t(h / a.q_div) * a.Ttot * dk, dk, r0, nr, 0, dk);
  load_rows(s.K, s.ldk, a.k + int64_t(h / a.k_div) * a.Ttot * dk, dk, r0, nr, 0, dk);
  load_rows(s.V, s.ldv, a.v + int64_t(h / a.v_div) * a.Ttot * dv, dv, r0, nr, 0, dv);
  load_rows(s.dO, s.ldv, a.dO + int64_t(h) * a.Ttot * dv, dv, r0, nr, 0, dv);
  const int64_t hidx = (cg * a.H + h) * int64_t(dk) * dv;
  for (int e = threadIdx.x; e < dk * dv; e += blockDim.x) {
    const int i = e / dv, j = e % dv;
    s.Hp[i * s.ldv + j] = to<T>(from<R>(a.hbuf[hidx + e]));
    s.dH[i * s.ldv + j] = to<T>(from<R>(a.dhbuf[hidx + e]));
  }
  chunk_cumsum(s.b, a.g ? a.g + int64_t(h) * a.Ttot : nullptr, r0, nr);
  const R B = s.b[kChunk - 1];
  // P = scale Gamma o (Q K^T);  dA = Gamma o (dO V^T)
  smem_gemm<T, false, true>(s.A, s.ldcr, s.Q, s.ldk, s.K, s.ldk, kChunk, kChunk, dk, false);
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int i = e / kChunk, j = e % kChunk;
    const R x = (j <= i && i < nr) ? s.A[i * s.ldcr + j] * a.scale * exp(s.b[i] - s.b[j]) : R(0);
    s.P[i * s.ldc + j] = to<T>(x);
  }
  __syncthreads();
  smem_gemm<T, false, true>(s.A, s.ldcr, s.dO, s.ldv, s.V, s.ldv, kChunk, kChunk, dv, false);
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int i = e / kChunk, j = e % kChunk;
    const R x = (j <= i && i < nr) ? s.A[i * s.ldcr + j] * exp(s.b[i] - s.b[j]) : R(0);
    s.dA[i * s.ldc + j] = to<T>(x);
  }
  for (int e = threadIdx.x; e < kChunk * dk; e += blockDim.x) {  // Q <- Q^ = scale Q
    const int i = e / dk, j = e % dk;
    s.Q[i * s.ldk + j] = to<T>(from<R>(s.Q[i * s.ldk + j]) * a.scale);
  }
  __syncthreads();
  const int64_t rowbase = int64_t(h) * a.Ttot;
  // X's rows < nr ([C, d]) to out [H][Ttot][d], plus add there when set (GradOut::add)
  auto store = [&](R* out, const R* add, int d) {
    for (int e = threadIdx.x; e < nr * d; e += blockDim.x) {
      const int64_t idx = (rowbase + r0 + e / d) * d + e % d;
      out[idx] = s.X[(e / d) * s.ldx + e % d] + (add ? add[idx] : R(0));
    }
  };
  // dQ^ = diag(e^b) dO Hp^T + dA K
  smem_gemm<T, false, true>(s.X, s.ldx, s.dO, s.ldv, s.Hp, s.ldv, kChunk, dk, dv, false);
  for (int e = threadIdx.x; e < kChunk * dk; e += blockDim.x) s.X[(e / dk) * s.ldx + e % dk] *= exp(s.b[e / dk]);
  __syncthreads();
  smem_gemm<T, false, false>(s.X, s.ldx, s.dA, s.ldc, s.K, s.ldk, kChunk, dk, kChunk, true);
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    R acc = 0;
    for (int j = 0; j < dk; ++j) acc += from<R>(s.Q[i * s.ldk + j]) * s.X[i * s.ldx + j];
    s.dc[i] = acc;
  }
  store(a.dq, a.dq_out.add, dk);
  __syncthreads();
  // dK = diag(w) V dH^T + dA^T Q^
  smem_gemm<T, false, true>(s.X, s.ldx, s.V, s.ldv, s.dH, s.ldv, kChunk, dk, dv, false);
  for (int e = threadIdx.x; e < kChunk * dk; e += blockDim.x) s.X[(e / dk) * s.ldx + e % dk] *= exp(B - s.b[e / dk]);
  __syncthreads();
  smem_gemm<T, true, false>(s.X, s.ldx, s.dA, s.ldc, s.Q, s.ldk, kChunk, dk, kChunk, true);
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    R acc = 0;
    for (int j = 0; j < dk; ++j) acc += from<R>(s.K[i * s.ldk + j]) * s.X[i * s.ldx + j];
    s.dc[i] -= acc;
  }
  store(a.dk_, a.dk_out.add, dk);
  __syncthreads();
  // dV = diag(w) K dH + P^T dO
  smem_gemm<T, false, false>(s.X, s.ldx, s.K, s.ldk, s.dH, s.ldv, kChunk, dv, dk, false);
  for (int e = threadIdx.x; e < kChunk * dv; e += blockDim.x) s.X[(e / dv) * s.ldx + e % dv] *= exp(B - s.b[e / dv]);
  __syncthreads();
  smem_gemm<T, true, false>(s.X, s.ldx, s.P, s.ldc, s.dO, s.ldv, kChunk, dv, kChunk, true);
  store(a.dv_, a.dv_out.add, dv);
  for (int i = threadIdx.x; i < nr; i += blockDim.x) a.dg[rowbase + r0 + i] = s.dc[i];
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

template <class T>
size_t fwd_bytes(int dk) {
  return layout_bytes<FwdSmem<T>>(dk);
}
template <class T>
size_t bwd_bytes(int dk, int dv) {
  return layout_bytes<BwdSmem<T>>(dk, dv);
}

}  // namespace

template <class T>
size_t gla_smem_need(int dk, int dv) {
  if constexpr (kTensorCore<T>) return std::max(tc_output_smem(dk, dv, sizeof(T)), tc_bwd_smem(dk, dv));
  else return std::max(fwd_bytes<T>(dk), bwd_bytes<T>(dk, dv));
}

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
    if (tc_fused_forward_wanted(x)) return tc_fused_forward(x, stream);
    DevBuf<T> hbuf;
    if (x.o && !x.hbuf) {
      hbuf = DevBuf<T>(size_t(x.nchunks * x.H * x.dk * x.dv), stream);
      x.hbuf = hbuf.get();
    }
    tc_sweep(x, false, stream);
    if (x.o) tc_output(x, stream);
  } else {
    const size_t bytes = fwd_bytes<T>(a.dk);
    set_smem(gla_fwd_kernel<T>, bytes);
    dim3 grid((a.dv + kBV - 1) / kBV, a.N * a.H);
    if (!dry_run()) {  // dry run: workspace_size
      gla_fwd_kernel<T><<<grid, 256, bytes, stream>>>(a);
      HILA_CUDA_CHECK_LAUNCH();
    }
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
  if (recompute) {
    side.emplace(stream);
    const NoAllocScope no_alloc;
    gla_forward(*recompute, side->side());
  }
  if constexpr (kTensorCore<T>) {
    tc_sweep(x, true, stream);
    if (side) side->join();
    tc_bwd_chunk(x, stream);
  } else {
    const size_t fb = fwd_bytes<T>(a.dk), bb = bwd_bytes<T>(a.dk, a.dv);
    set_smem(gla_bwd_dh_kernel<T>, fb);
    set_smem(gla_bwd_chunk_kernel<T>, bb);
    dim3 grid((a.dv + kBV - 1) / kBV, a.N * a.H);
    if (!dry_run()) {  // dry run: workspace_size
      gla_bwd_dh_kernel<T><<<grid, 256, fb, stream>>>(a);
      HILA_CUDA_CHECK_LAUNCH();
    }
    if (side) side->join();
    if (a.nchunks > 0) {
      if (!dry_run()) {  // dry run: workspace_size
        gla_bwd_chunk_kernel<T><<<dim3(unsigned(a.nchunks), a.H), 256, bb, stream>>>(a);
        HILA_CUDA_CHECK_LAUNCH();
      }
    }
  }
  gla_dg(x, stream);
}

template <class T>
void gla_dg(const GlaArgs<T>& a, cudaStream_t stream) {
  if (a.N == 0 || a.H == 0 || dry_run()) return;  // dry run: workspace_size
  gla_dg_kernel<T><<<a.N * a.H, 256, 0, stream>>>(a);
  HILA_CUDA_CHECK_LAUNCH();
}

#define HILA_INSTANTIATE(T)                                          \
  template void gla_forward<T>(const GlaArgs<T>&, cudaStream_t);     \
  template void gla_backward<T>(const GlaArgs<T>&, cudaStream_t, const GlaArgs<T>*); \
  template void gla_dg<T>(const GlaArgs<T>&, cudaStream_t);          \
  template size_t gla_smem_need<T>(int, int);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
