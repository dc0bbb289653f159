// SPDX-License-Identifier: Apache-2.0
// GLA chunk gradients, portable tier (fp32 / fp64 operands; docs/math/HLA.md §7.1, see gla.cuh): one block
// per (chunk, head) forms dq^, dk, dv and the chunk's gate gradient (dc per row, its reverse cumsum
// in the chunk plus <dH, H_end>) from the states entering the chunk (hbuf) and the cotangent at its
// end (dhbuf), every product a shared-memory tile GEMM (smem_gemm).
#include "cuda/gla/gla.cuh"
#include "cuda/prims/resets.cuh"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

namespace {

template <class T>
struct BwdSmem {
  using R = Acc<T>;
  T *Q, *K, *V, *dO, *Hp, *dH, *P, *dA;
  R *A, *X, *b, *dc, *red;
  ChunkResets<R> z;  // the chunk's resets (prims/resets.cuh)
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
    red = c.take<R>(8);  // per-warp parts of <dH, H_end>
    z.bs = c.take<R>(kChunk);
    z.last = c.take<int>(kChunk);
    z.any = c.take<int>(1);
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
  chunk_cumsum_resets(s.b, s.z, a.g ? a.g + int64_t(h) * a.Ttot : nullptr, r0, nr);
  const R B = s.b[kChunk - 1];
  with_chunk_decay(s.b, s.z, [&](const auto& dec) {  // Gamma and w (exact across resets)
    constexpr bool kReset = std::decay_t<decltype(dec)>::kReset;
    // P = scale Gamma o (Q K^T);  dA = Gamma o (dO V^T)
    smem_gemm<T, false, true>(s.A, s.ldcr, s.Q, s.ldk, s.K, s.ldk, kChunk, kChunk, dk, false);
    for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
      const int i = e / kChunk, j = e % kChunk;
      const R x = (j <= i && i < nr) ? s.A[i * s.ldcr + j] * a.scale * dec.gamma(i, j) : R(0);
      s.P[i * s.ldc + j] = to<T>(x);
    }
    __syncthreads();
    smem_gemm<T, false, true>(s.A, s.ldcr, s.dO, s.ldv, s.V, s.ldv, kChunk, kChunk, dv, false);
    for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
      const int i = e / kChunk, j = e % kChunk;
      const R x = (j <= i && i < nr) ? s.A[i * s.ldcr + j] * dec.gamma(i, j) : R(0);
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
    for (int e = threadIdx.x; e < kChunk * dk; e += blockDim.x) s.X[(e / dk) * s.ldx + e % dk] *= dec.weight(e / dk);
    __syncthreads();
    {  // <dH, H_end> = e^B <dH, Hp> + sum_j k_j . (w_j V dH^T)_j  (rows >= nr: K is zero)
      R part = 0;
      if (threadIdx.x < kChunk)
        for (int j = 0; j < dk; ++j) part += from<R>(s.K[threadIdx.x * s.ldk + j]) * s.X[threadIdx.x * s.ldx + j];
      R hd = 0;
      for (int e = threadIdx.x; e < dk * dv; e += blockDim.x) {
        const int i = e / dv, j = e % dv;
        hd += from<R>(s.Hp[i * s.ldv + j]) * from<R>(s.dH[i * s.ldv + j]);
      }
      part = warp_sum(part + R(exp(B)) * hd);
      if ((threadIdx.x & 31) == 0) s.red[threadIdx.x >> 5] = part;
      __syncthreads();  // X is read: the GEMM below accumulates into it
    }
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
    for (int e = threadIdx.x; e < kChunk * dv; e += blockDim.x) s.X[(e / dv) * s.ldx + e % dv] *= dec.weight(e / dv);
    __syncthreads();
    smem_gemm<T, true, false>(s.X, s.ldx, s.P, s.ldc, s.dO, s.ldv, kChunk, dv, kChunk, true);
    store(a.dv_, a.dv_out.add, dv);
    if (a.dg_rows) {  // the rows' dc, the last row's with <dH, H_end>
      R D = 0;
      for (int w = 0; w < int(blockDim.x) / 32; ++w) D += s.red[w];
      for (int i = threadIdx.x; i < nr; i += blockDim.x) a.dg[rowbase + r0 + i] = s.dc[i] + (i == nr - 1 ? D : R(0));
    } else if (threadIdx.x < 32) {  // dc and red were written before the GEMMs' barriers
      R D = 0;
      for (int w = 0; w < int(blockDim.x) / 32; ++w) D += s.red[w];
      const int i0 = 2 * int(threadIdx.x), i1 = i0 + 1;
      const R x0 = i0 < nr ? s.dc[i0] : R(0), x1 = i1 < nr ? s.dc[i1] : R(0);
      if constexpr (kReset) chunk_dg_resets(a.dg + rowbase + r0, x0, x1, D, nr, s.z);
      else chunk_dg(a.dg + rowbase + r0, x0, x1, D, nr);
    }
  });
}

}  // namespace

template <class T>
size_t gla_bwd_chunk_portable_smem(int dk, int dv) {
  return layout_bytes<BwdSmem<T>>(dk, dv);
}

template <class T>
void gla_bwd_chunk_portable(const GlaArgs<T>& a, cudaStream_t stream) {
  const size_t bytes = gla_bwd_chunk_portable_smem<T>(a.dk, a.dv);
  set_smem(gla_bwd_chunk_kernel<T>, bytes);
  if (a.nchunks == 0 || dry_run()) return;  // dry run: workspace_size
  gla_bwd_chunk_kernel<T><<<dim3(unsigned(a.nchunks), a.H), 256, bytes, stream>>>(a);
  HILA_CUDA_CHECK_LAUNCH();
}

#define HILA_INSTANTIATE(T)                                                       \
  template size_t gla_bwd_chunk_portable_smem<T>(int, int);                       \
  template void gla_bwd_chunk_portable<T>(const GlaArgs<T>&, cudaStream_t);
HILA_INSTANTIATE(float)
HILA_INSTANTIATE(double)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
