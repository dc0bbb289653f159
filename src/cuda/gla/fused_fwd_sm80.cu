// SPDX-License-Identifier: Apache-2.0
// GLA forward in one kernel, sm80 tier (bf16 / fp16 on mma.sync): the state sweep and the output
// fused, chosen over the two kernels when its blocks fill the GPU (heuristics::gla_fused_forward).
#include "cuda/gla/sm80.cuh"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

namespace {

using namespace gla_sm80;

// The forward in one pass (the sweep and the output kernel fused; docs/math/HLA.md §1, §7.1): one block per
// (sequence x head, value tile of 64 columns), 8 warps, walking the chunks in order with the
// [dk, 64] fp32 state H in registers (warp w: rows [16w, 16w + 16)) and its 16-bit copy in smem,
// the operand of Q H (double-buffered: the copy entering chunk i + 1 is written while chunk i reads
// the one entering i). Per chunk:
//   P  = scale Gamma o Q K^T             warp (rb, ch): rows 16 rb.., keys 32 ch..   [16,dk]x[dk,32]
//   H' = e^B H + K^T diag(e^{B-b}) V     warp w: state rows 16 w..                    [16,C]x[C,64]
//   O  = diag(scale e^b) Q H + P V       warp (rb, ch): rows 16 rb.., values 32 ch..  [16,dk]x[dk,32], [16,C]x[C,32]
// with chunks i + 1 and i + 2 loading meanwhile (cp.async, kFusedStages deep). The per-chunk states
// never go through global memory, except into a.hbuf when the caller asks for them (a backward's
// recompute). Q and K are read once per value tile: worth it while there are enough (sequence x
// head x value tile) blocks to fill the GPU (heuristics::gla_fused_forward).
// Dynamic smem: kFusedStages x {Q, K [C, dk+8], V [C, 72] (16-bit), b [C]}, H [2][dk, 72], P [C, 72].
constexpr int kFusedV = 64, kFusedThreads = 256, kFusedStages = 3, kFusedLdv = kFusedV + 8;
static_assert(kFusedV == 64, "heuristics::gla_fused_forward counts 64-column value tiles");

__host__ __device__ inline size_t fused_stage_bytes(int dk) {
  return (size_t(2) * kChunk * (dk + 8) + size_t(kChunk) * kFusedLdv) * 2 + kChunk * sizeof(float);
}
size_t fused_smem(int dk) {
  return kFusedStages * fused_stage_bytes(dk) + (size_t(2) * dk * kFusedLdv + size_t(kChunk) * kLdTile) * 2;
}

template <class T>
__global__ void __launch_bounds__(kFusedThreads, 1) fused_forward_kernel(GlaArgs<T> a) {
  extern __shared__ __align__(128) char smem[];
  const int dk = a.dk, ldq = dk + 8, ldv = kFusedLdv;
  const size_t stage_bytes = fused_stage_bytes(dk);
  auto Qs = [&](int st) { return reinterpret_cast<T*>(smem + st * stage_bytes); };
  auto Ks = [&](int st) { return Qs(st) + kChunk * ldq; };
  auto Vs = [&](int st) { return Ks(st) + kChunk * ldq; };
  auto bs = [&](int st) { return reinterpret_cast<float*>(Vs(st) + kChunk * ldv); };
  T* const Hs = reinterpret_cast<T*>(smem + kFusedStages * stage_bytes);  // [2][dk][ldv]
  T* const Ps = Hs + 2 * dk * ldv;                                         // [C][kLdTile]
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const int rb = w & 3, ch = w >> 2;
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H, v0 = blockIdx.y * kFusedV;
  const bool active = 16 * w < dk;  // this warp owns state rows
  const int64_t len = a.len[seq], row0 = a.row0[seq], chunk0 = a.chunk0[seq];
  const int nch = int((len + a.C - 1) / a.C);
  const T* q = a.q + (h / a.q_div) * head_stride(a.q_hs, a.Ttot, dk);
  const T* k = a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, dk);
  const T* v = a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, a.dv);
  const int64_t q_ld = row_ld(a.q_ld, dk), k_ld = row_ld(a.k_ld, dk), v_ld = row_ld(a.v_ld, a.dv);
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  // chunk i -> stage i % kFusedStages: Q, K, V tiles and the gates (rows >= nr zero-filled)
  auto issue = [&](int i) {
    const int st = i % kFusedStages, nr = rows_in(len, i, a.C);
    const int64_t r0 = row0 + int64_t(i) * a.C;
    mma::async_rows(Qs(st), ldq, q, q_ld, r0, nr, 0, dk, kChunk);
    mma::async_rows(Ks(st), ldq, k, k_ld, r0, nr, 0, dk, kChunk);
    mma::async_rows(Vs(st), ldv, v, v_ld, r0, nr, v0, kFusedV, kChunk);
    mma::async_gates<kChunk>(bs(st), b, r0, nr, k);
    mma::cp_async_commit();
  };
  pipeline_prologue<kFusedStages>(nch, issue);
  // state tile: rows 16w + g (+8), columns v0 + 8j + 2t (+1)
  const int64_t sidx = (int64_t(seq) * a.H + h) * dk * a.dv;
  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = fr.row_of(16 * w, e), col = fr.col_of(v0, j, e);
      acc[j][e] = (a.h0 && active) ? a.h0[sidx + int64_t(r) * a.dv + col] : 0.f;
    }
  // the state entering chunk i as a 16-bit operand: into smem buffer i % 2 (and a.hbuf if set)
  auto put_state = [&](int i) {
    if (!active) return;
    T* dst = Hs + (i & 1) * dk * ldv;
    T* hb = a.hbuf ? a.hbuf + ((chunk0 + i) * a.H + h) * int64_t(dk) * a.dv + v0 : nullptr;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = fr.row(16 * w, hf), col = fr.col(0, j);
        const uint32_t x = mma::pack2<T>(acc[j][2 * hf], acc[j][2 * hf + 1]);
        *reinterpret_cast<uint32_t*>(dst + r * ldv + col) = x;
        if (hb) *reinterpret_cast<uint32_t*>(hb + int64_t(r) * a.dv + col) = x;
      }
  };
  if (nch > 0) put_state(0);
  const float sc = float(a.scale);
  const int i0 = 16 * rb + g, i1 = i0 + 8;  // output rows of this thread
  T* out = a.o + h * head_stride(a.o_hs, a.Ttot, a.dv) + v0 + 32 * ch + 2 * t;
  const int64_t ldo = row_ld(a.o_ld, a.dv);
  for (int i = 0; i < nch; ++i) {
    // chunk i has landed; the barrier also retires chunk i-1's reads of P, of H buffer (i+1) % 2
    // and of the stage refilled next
    mma::cp_async_wait<kFusedStages - 2>();
    __syncthreads();
    if (i + kFusedStages - 1 < nch) issue(i + kFusedStages - 1);
    else mma::cp_async_commit();
    const int st = i % kFusedStages, nr = rows_in(len, i, a.C);
    const T* Qt = Qs(st);
    const T* Kt = Ks(st);
    const T* Vt = Vs(st);
    const float* bt = bs(st);
    {  // P: keys 32 ch.. (the causal part)                                   [16, dk] x [dk, 32]
      float x[4][4];
      mma::zero(x);
      if (32 * ch <= 16 * rb + 15) mma::warp_gemm<T, 4, false, false>(x, Qt, ldq, 16 * rb, Kt, ldq, 32 * ch, 4, 0, dk);
      score_store<T, false>(Ps, x, bt, rb, 32 * ch, nr, sc, nullptr, nullptr);
    }
    if (active) {  // H <- e^B H + K^T diag(e^{B-b}) V      [16 (dk), C] x [C, 64]
      const float B = bt[nr - 1], decay = mma::fexp(B);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] *= decay;
      mma::warp_gemm_tn_weighted<T, 8>(acc, Kt, ldq, 16 * w, Vt, ldv, 8, kChunk, [&](int kk) { return mma::fexp(B - bt[kk]); });
    }
    if (i + 1 < nch) put_state(i + 1);
    __syncthreads();  // P complete
    // O = diag(scale e^b) Q H + P V: values 32 ch..                 [16, dk] x [dk, 32], [16, C] x [C, 32]
    float o[4][4];
    mma::zero(o);
    mma::warp_gemm<T, 4, false, true>(o, Qt, ldq, 16 * rb, Hs + (i & 1) * dk * ldv, ldv, 32 * ch, 4, 0, dk);
    const float e0 = sc * mma::fexp(bt[i0]), e1 = sc * mma::fexp(bt[i1]);
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j][0] *= e0, o[j][1] *= e0, o[j][2] *= e1, o[j][3] *= e1;
    mma::warp_gemm<T, 4, false, true>(o, Ps, kLdTile, 16 * rb, Vt, ldv, 32 * ch, 4, 0, 16 * rb + 16);
    const int64_t r0 = row0 + int64_t(i) * a.C;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = hf ? i1 : i0;
        if (r < nr) *reinterpret_cast<uint32_t*>(out + (r0 + r) * ldo + 8 * j) = mma::pack2<T>(o[j][2 * hf], o[j][2 * hf + 1]);
      }
  }
  mma::cp_async_wait<0>();
  if (a.ht && active) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = fr.row_of(16 * w, e), col = fr.col_of(v0, j, e);
        a.ht[sidx + int64_t(r) * a.dv + col] = acc[j][e];
      }
  }
}

}  // namespace

size_t gla_fused_forward_smem(int dk) { return fused_smem(dk); }

template <class T>
void gla_fused_forward_sm80(const GlaArgs<T>& a, cudaStream_t stream) {
  const size_t bytes = fused_smem(a.dk);
  set_smem(fused_forward_kernel<T>, bytes);
  if (dry_run()) return;  // dry run: workspace_size
  fused_forward_kernel<T><<<dim3(unsigned(a.N * a.H), unsigned(a.dv / kFusedV)), kFusedThreads, bytes, stream>>>(a);
  HILA_CUDA_CHECK_LAUNCH();
}

template void gla_fused_forward_sm80<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, cudaStream_t);
template void gla_fused_forward_sm80<__half>(const GlaArgs<__half>&, cudaStream_t);

}  // namespace hila::cuda
