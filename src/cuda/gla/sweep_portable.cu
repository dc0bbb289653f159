// SPDX-License-Identifier: Apache-2.0
// GLA state sweeps, portable tier (fp32 / fp64 operands, the exactness path; docs/math/HLA.md §1, §7.1, see
// gla.cuh): one block per (value tile of 64 columns, sequence x head) walks the chunks of its
// sequence with its [dk, 64] state tile in fp32 (fp64) shared memory, every product a shared-memory
// tile GEMM (smem_gemm). The forward sweep writes the outputs too (it is the tier's whole forward);
// the reverse sweep stores the state cotangent at every chunk end.
#include "cuda/dispatch/static_switch.h"
#include "cuda/gla/gla.cuh"
#include "cuda/prims/resets.cuh"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

namespace {

template <class T>
struct FwdSmem {
  using R = Acc<T>;
  T *Q, *K, *V, *Hs, *P;
  R *A, *O, *Hf, *b;
  ChunkResets<R> z;  // the chunk's resets (prims/resets.cuh)
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
    z.bs = c.take<R>(kChunk);
    z.last = c.take<int>(kChunk);
    z.any = c.take<int>(1);
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
    chunk_cumsum_resets(s.b, s.z, g, r0, nr);  // includes a barrier
    with_chunk_decay(s.b, s.z, [&](const auto& dec) {  // Gamma and w (exact across resets)
      if (a.o) {
        for (int e = threadIdx.x; e < a.dk * bv; e += blockDim.x)
          s.Hs[(e / bv) * s.ldv + e % bv] = to<T>(s.Hf[(e / bv) * s.ldvr + e % bv]);
        smem_gemm<T, false, true>(s.A, s.ldcr, s.Q, s.ldk, s.K, s.ldk, kChunk, kChunk, a.dk, false);
        for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
          const int i = e / kChunk, j = e % kChunk;
          const R x = (j <= i && i < nr) ? s.A[i * s.ldcr + j] * a.scale * dec.gamma(i, j) : R(0);
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
      // H <- e^B H + K^T diag(w) V   (w_i = e^{B - b_i})
      const R B = s.b[kChunk - 1];
      for (int e = threadIdx.x; e < kChunk * bv; e += blockDim.x) {
        const int i = e / bv, j = e % bv;
        s.V[i * s.ldv + j] = to<T>(from<R>(s.V[i * s.ldv + j]) * dec.weight(i));
      }
      tile_scale(s.Hf, s.ldvr, a.dk, bv, R(exp(B)));
    });
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
    chunk_cumsum_resets(s.b, s.z, g, r0, nr);  // e^b is exact before the chunk's first reset, 0 from it on
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

}  // namespace

template <class T>
size_t gla_sweep_portable_smem(int dk) {
  return layout_bytes<FwdSmem<T>>(dk);
}

template <class T>
void gla_sweep_portable(const GlaArgs<T>& a, bool reverse, cudaStream_t stream) {
  const size_t bytes = gla_sweep_portable_smem<T>(a.dk);
  dim3 grid((a.dv + kBV - 1) / kBV, a.N * a.H);
  HILA_BOOL_SWITCH(reverse, kRev, [&] {
    auto kernel = kRev ? gla_bwd_dh_kernel<T> : gla_fwd_kernel<T>;
    set_smem(kernel, bytes);
    if (dry_run()) return;  // dry run: workspace_size
    kernel<<<grid, 256, bytes, stream>>>(a);
    HILA_CUDA_CHECK_LAUNCH();
  });
}

#define HILA_INSTANTIATE(T)                                                       \
  template size_t gla_sweep_portable_smem<T>(int);                                \
  template void gla_sweep_portable<T>(const GlaArgs<T>&, bool, cudaStream_t);
HILA_INSTANTIATE(float)
HILA_INSTANTIATE(double)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
