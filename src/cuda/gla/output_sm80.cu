// SPDX-License-Identifier: Apache-2.0
// GLA output, sm80 tier (bf16 / fp16 on mma.sync; docs/math/HLA.md §1, §7.1): one block per (chunk, dv
// tile, head), fully parallel, from the states entering each chunk (hbuf, the forward sweep's):
//   O = diag(scale e^b) Q H_c + (scale Gamma o Q K^T) V       [C,dk]x[dk,64], [C,C]x[C,64]
// with the causal score block kept in registers and fed back as the A operand. The log-linear tree
// form (loglinear/tree.cuh) reads the tree's nodes instead of hbuf.
#include "cuda/dispatch/static_switch.h"
#include "cuda/gla/sm80.cuh"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

namespace {

using namespace gla_sm80;

// Output of every chunk; grid (nchunks, dv tiles of kOutV, H), 8 warps. Warp w = (rb, ch):
//   phase 1: P = scale Gamma o Q K^T for rows [16 rb, 16 rb + 16), key columns of half ch (causal
//            part only), to smem as the 16-bit A operand;
//   phase 2: O = diag(scale e^b) Q H_c + P V for the same rows, value columns [64 ch, 64 ch + 64).
// Q and K are read once per chunk for up to kOutV value columns. Dynamic smem: Q, K [C, dk+8],
// V [C, vt+8], H [dk, vt+8], P [C, C+8] (16-bit), b [C].
constexpr int kOutV = 128;
constexpr int kOutThreads = 256;

// kTree (log-linear tree form, loglinear/tree.cuh): P also carries lam^{LUT[i,j]}, and the state term
// is the sum over the levels the chunk reads, their 16-bit node copies loaded into H in turn (the
// first one with Q, K, V).
template <class T, bool kTree>
__global__ void __launch_bounds__(kOutThreads) output_kernel(GlaArgs<T> a, TreeArgs ta) {
  extern __shared__ __align__(128) char smem[];
  const int vt = min(kOutV, a.dv), ldq = a.dk + 8, ldv = vt + 8;
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = Qs + kChunk * ldq;
  T* Vs = Ks + kChunk * ldq;
  T* Hs = Vs + kChunk * ldv;
  T* Ps = Hs + a.dk * ldv;
  float* bs = reinterpret_cast<float*>(Ps + kChunk * kLdTile);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int rb = w & 3, ch = w >> 2;
  const GridChunk gc(a, blockIdx.x);
  if (!gc.valid) return;  // past this sequence's chunks (a piece)
  const int64_t cg = gc.cg, c = gc.c;
  const int v0 = blockIdx.y * kOutV, h = blockIdx.z, seq = gc.seq;
  const int64_t r0 = a.row0[seq] + c * a.C;
  const int nr = rows_in(a.len[seq], c, a.C);
  const int bv = min(vt, a.dv - v0);
  mma::async_rows(Qs, ldq, a.q + (h / a.q_div) * head_stride(a.q_hs, a.Ttot, a.dk), row_ld(a.q_ld, a.dk), r0, nr, 0,
                 a.dk, kChunk);
  mma::async_rows(Ks, ldq, a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk), row_ld(a.k_ld, a.dk), r0, nr, 0,
                 a.dk, kChunk);
  mma::cp_async_commit();  // group A: Q, K (phase 1); group B: V, H (phase 2), landing during phase 1
  mma::async_rows(Vs, ldv, a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, a.dv), row_ld(a.v_ld, a.dv), r0, nr, v0,
                 bv, kChunk);
  // kTree: the chunk's absolute index n reads the nodes of the set bits of n
  const SeqNodes sn = kTree ? seq_nodes(ta, a.chunk0, seq, (a.len[seq] + a.C - 1) / a.C) : SeqNodes{};
  const int64_t n = sn.a0 + c;
  if constexpr (!kTree) mma::async_rows(Hs, ldv, a.hbuf + (cg * a.H + h) * int64_t(a.dk) * a.dv, a.dv, 0, a.dk, v0, bv, a.dk);
  else if (n > 0) async_node(Hs, ldv, ta, first_read_slot(sn, n), h, a.H, a.dk, a.dv, v0, bv);
  mma::cp_async_commit();
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  if (threadIdx.x < kChunk) bs[threadIdx.x] = gate_at(b, r0, threadIdx.x, nr);
  mma::cp_async_wait<1>();
  __syncthreads();
  const float sc = float(a.scale);
  const int i0 = 16 * rb + g, i1 = i0 + 8;  // rows of this thread
  const float bi0 = bs[i0], bi1 = bs[i1];
  const float* lam0 = kTree ? ta.lam + (int64_t(h) * a.Ttot + r0 + min(i0, nr - 1)) * ta.nL : nullptr;
  const float* lam1 = kTree ? ta.lam + (int64_t(h) * a.Ttot + r0 + min(i1, nr - 1)) * ta.nL : nullptr;
  {  // phase 1: P for rows 16 rb.., key columns 32 ch.. (the causal part)     [16, dk] x [dk, 32]
    float x[4][4];
    mma::zero(x);
    if (32 * ch <= 16 * rb + 15) mma::warp_gemm<T, 4, false, false>(x, Qs, ldq, 16 * rb, Ks, ldq, 32 * ch, 4, 0, a.dk);
    score_store<T, kTree>(Ps, x, bs, rb, 32 * ch, nr, sc, lam0, lam1);
  }
  mma::cp_async_wait<0>();
  __syncthreads();
  // phase 2
  const int c0 = 64 * ch, nt = max(0, min(64, bv - c0)) / 8;
  float o[8][4];
  mma::zero(o);
  if constexpr (kTree) {  // sum_m diag(scale lam^{p+m} e^{b+gap}) Q node_m      [C,dk]x[dk,64] per level
    bool first = true;
    for_each_read(ta, sn, n, h, a.H, [&](int m, int64_t slot, float gap) {
      if (!first) {
        __syncthreads();  // the previous level's H is consumed
        async_node(Hs, ldv, ta, slot, h, a.H, a.dk, a.dv, v0, bv);
        mma::cp_async_commit();
        mma::cp_async_wait<0>();
        __syncthreads();
      }
      first = false;
      if (nt == 0) return;
      float y[8][4];
      mma::zero(y);
      mma::warp_gemm<T, 8, false, true>(y, Qs, ldq, 16 * rb, Hs, ldv, c0, nt, 0, a.dk);
      const float e0 = sc * lam0[kLogChunk + m] * mma::fexp(bi0 + gap), e1 = sc * lam1[kLogChunk + m] * mma::fexp(bi1 + gap);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j][0] += e0 * y[j][0], o[j][1] += e0 * y[j][1], o[j][2] += e1 * y[j][2], o[j][3] += e1 * y[j][3];
    });
    if (nt == 0) return;
  } else {
    if (nt == 0) return;
    mma::warp_gemm<T, 8, false, true>(o, Qs, ldq, 16 * rb, Hs, ldv, c0, nt, 0, a.dk);
    const float e0 = sc * mma::fexp(bi0), e1 = sc * mma::fexp(bi1);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j][0] *= e0, o[j][1] *= e0, o[j][2] *= e1, o[j][3] *= e1;
  }
  mma::warp_gemm<T, 8, false, true>(o, Ps, kLdTile, 16 * rb, Vs, ldv, c0, nt, 0, 16 * rb + 16);
  T* out = a.o + h * head_stride(a.o_hs, a.Ttot, a.dv);
  const int64_t ldo = row_ld(a.o_ld, a.dv);
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0;
        if (i < nr)
          *reinterpret_cast<uint32_t*>(out + (r0 + i) * ldo + v0 + c0 + 8 * j + 2 * t) =
              mma::pack2<T>(o[j][2 * hf], o[j][2 * hf + 1]);
      }
}

}  // namespace

size_t gla_output_smem(int dk, int dv, size_t esize) {
  const size_t vt = size_t(std::min(kOutV, dv));
  return (size_t(2) * kChunk * (dk + 8) + (size_t(kChunk) + dk) * (vt + 8) + size_t(kChunk) * kLdTile) * esize +
         kChunk * sizeof(float);
}

template <class T>
void gla_output_sm80(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree) {
  if (grid_chunks(a) <= 0) return;
  const size_t bytes = gla_output_smem(a.dk, a.dv, sizeof(T));
  HILA_BOOL_SWITCH(tree != nullptr, kTree, [&] {
    auto kernel = output_kernel<T, kTree>;
    set_smem(kernel, bytes);
    if (dry_run()) return;  // dry run: workspace_size
    kernel<<<dim3(unsigned(grid_chunks(a)), (a.dv + kOutV - 1) / kOutV, a.H), kOutThreads, bytes, stream>>>(
        a, tree ? *tree : TreeArgs{});
    HILA_CUDA_CHECK_LAUNCH();
  });
}

template void gla_output_sm80<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, cudaStream_t, const TreeArgs*);
template void gla_output_sm80<__half>(const GlaArgs<__half>&, cudaStream_t, const TreeArgs*);

}  // namespace hila::cuda
