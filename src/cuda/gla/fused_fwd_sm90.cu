// SPDX-License-Identifier: Apache-2.0
// GLA forward in one kernel, sm90 tier (sm_90a: TMA + wgmma; gla/sm90.cuh), in place of the sm80 one
// where it applies (gla.cu). The same math and grid as fused_fwd_sm80.cu's fused_forward_kernel
// (docs/math/HLA.md §1): one warpgroup per (sequence x head, 64 value columns) walks the chunks with the
// [dk, 64] fp32 state H in wgmma accumulators (dk / 64 slabs of m64). Per chunk i:
//   S  = Q K^T                                   SS, [C,dk]x[dk,C]
//   Oq = Q H_i                                   SS, [C,dk]x[dk,64]; H_i's 16-bit copy in smem (MN-major)
//   H  <- e^B H + (K o w)^T V,  w = e^{B-b}      RS per slab, [64,C]x[C,64]
//   P  = scale Gamma o S  (registers: the accumulator fragment is the A fragment of the next wgmma)
//   O  = diag(scale e^b) Oq + P V                RS, [C,C]x[C,64]
// Q, K, V tiles by TMA, two stages (chunk i+1 lands while chunk i computes), the gates by
// cp.async; the 16-bit copy of the state entering chunk i+1 goes to the other of two buffers.
// When the caller asks for the per-chunk states (a.hbuf), one TMA store per chunk copies the
// buffer there (tensor map mh, as the backward chunk kernel's) once the loop head's barrier has
// seen it written; the head of the next chunk waits for that store to have read it.
// Shared memory at dk = 128: 2 x 40 KB stages + 2 x 16 KB state copies = 112.5 KB, 2 blocks per SM.
#include "cuda/dispatch/static_switch.h"
#include "cuda/gla/sm90.cuh"

namespace hila::cuda {

namespace {

using namespace gla_sm90;

constexpr int kFwdStages = 2;
template <int DK>
struct FwdSm90Layout {
  static constexpr uint32_t kQ = 0, kK = kChunk * DK * 2, kV = 2 * kChunk * DK * 2, kStage = kV + kChunk * 64 * 2,
                            kH = kFwdStages * kStage,                                     // [2][DK][64]
      kB = kH + 2 * DK * 64 * 2, kBar = kB + kFwdStages * kChunk * 4, kBytes = kBar + 8 * kFwdStages;
};

template <class T, int DK>
__global__ void __launch_bounds__(kSm90Threads, 2)
    fused_forward_sm90_kernel(const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                              const __grid_constant__ CUtensorMap mv, const __grid_constant__ CUtensorMap mh,
                              unsigned order, GlaArgs<T> a) {
  using L = FwdSm90Layout<DK>;
  static_assert(L::kQ == 0 && L::kK % 1024 == 0 && L::kStage % 1024 == 0, "1024-aligned swizzled tiles");
#if HILA_SM90A
  using namespace sm90;
  constexpr int kSlabs = DK / 64;
  extern __shared__ __align__(1024) char smem[];
  const uint32_t s0 = smem_u32(smem);
  if (s0 & 1023) __trap();  // the swizzle needs 1024-byte aligned tiles
  float* gates = reinterpret_cast<float*>(smem + L::kB);     // [stages][C]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBar);  // [stages]
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H, v0 = blockIdx.y * 64;
  const int64_t len = a.len[seq], row0 = a.row0[seq], chunk0 = a.chunk0[seq];
  const int nch = int((len + a.C - 1) / a.C);
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const int64_t sidx = (int64_t(seq) * a.H + h) * DK * a.dv;  // [N][H][dk][dv]
  // state: slab m, rows 64m + 16w + g (+8), columns v0 + 8j + 2t (+1): acc[m][4j + 2hf + e]
  float acc[kSlabs][32];
#pragma unroll
  for (int m = 0; m < kSlabs; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[m][4 * j + e] =
            a.h0 ? a.h0[fr.at_of<int64_t>(sidx, 64 * m + 16 * w, e, a.dv, v0, j)] : 0.f;
  init_ring(full, kFwdStages, tid);
  // chunk i -> stage i % 2 (every thread commits one cp.async group per call)
  auto issue = [&](int i) {
    if (i >= nch) return mma::cp_async_commit();
    const int st = i % kFwdStages;
    const int64_t r0 = row0 + int64_t(i) * a.C;
    char* base = smem + st * L::kStage;
    if (tid == 0) {
      fence_async_smem();  // this stage's earlier generic accesses before the async-proxy refill
      mbar_expect_tx(&full[st], L::kStage);
      for (int cb = 0; cb < kSlabs; ++cb) {
        load_rows(base + L::kQ + cb * kSweepTile, &mq, &full[st], order & 1, 64 * cb, r0, h / a.q_div);
        load_rows(base + L::kK + cb * kSweepTile, &mk, &full[st], (order >> 1) & 1, 64 * cb, r0, h / a.k_div);
      }
      load_rows(base + L::kV, &mv, &full[st], (order >> 2) & 1, v0, r0, h / a.v_div);
    }
    mma::async_gates<kChunk>(gates + st * kChunk, b, r0, rows_in(len, i, a.C), a.row0);
    mma::cp_async_commit();
  };
  // the state entering chunk i, 16-bit: into buffer i % 2 ([DK][64], swizzled)
  auto put_state = [&](int i) {
    char* dst = smem + L::kH + (i & 1) * DK * 128;
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = fr.row(64 * m + 16 * w, hf), col = fr.col(0, j);
          *reinterpret_cast<uint32_t*>(dst + swz(DK, r, col)) =
              mma::pack2<T>(acc[m][4 * j + 2 * hf], acc[m][4 * j + 2 * hf + 1]);
        }
    fence_async_smem();  // read by the next chunk's wgmma after the loop-head barrier
  };
  if (nch > 0) {
    issue(0);
    put_state(0);
  }
  const float sc = float(a.scale);
  const int i0 = 16 * w + g, i1 = i0 + 8;  // output rows of this thread
  T* out = a.o + h * head_stride(a.o_hs, a.Ttot, a.dv) + v0 + 2 * t;
  const int64_t ldo = row_ld(a.o_ld, a.dv);
  for (int i = 0; i < nch; ++i) {
    const int st = i % kFwdStages, nr = rows_in(len, i, a.C);
    mma::cp_async_wait<0>();
    mbar_wait(&full[st], (i / kFwdStages) & 1);
    if (a.hbuf && tid == 0) bulk_wait_read<0>();  // H copy i-1 stored: its buffer is copy i+1's
    __syncthreads();  // chunk i's gates; chunk i-1 is done with the stage refilled next; H copy i written
    if (a.hbuf && tid == 0) {  // H copy i -> a.hbuf (rows of chunk i, head h: [DK] x columns v0..)
      tma_store_2d(&mh, smem + L::kH + (i & 1) * DK * 128, v0, int(((chunk0 + i) * a.H + h) * DK));
      bulk_commit();
    }
    issue(i + 1);
    const uint32_t base = s0 + st * L::kStage;
    const float* bt = gates + st * kChunk;
    if (nr < kChunk) {  // value rows past the sequence
      zero_rows_from(smem + st * L::kStage + L::kV, 1, nr, tid);
      __syncthreads();
    }
    // H <- e^B H first: the state's registers are read before any wgmma of this chunk is in flight
    // (read with S and Q H in flight, ptxas injected a warpgroup.wait there: C7517)
    const float B = bt[nr - 1], decay = mma::fexp(B);
#pragma unroll
    for (int m = 0; m < kSlabs; ++m) {
#pragma unroll
      for (int e = 0; e < 32; ++e) acc[m][e] *= decay;
    }
    float sacc[32], oq[32], opv[32];
    wg_fence();
    wgmma_chain<T, 64, 0, 0>(sacc, base + L::kQ, kChunk, base + L::kK, kChunk, DK / 16);  // S = Q K^T
    wg_commit();
    wgmma_chain<T, 64, 0, 1>(oq, base + L::kQ, kChunk, s0 + L::kH + (i & 1) * DK * 128, DK, DK / 16);  // Q H_i
    wg_commit();
    // H += (K o w)^T V: slab m = key columns 64m.., (K o w)^T fragments by ldmatrix.trans
    uint32_t fa[kSlabs][4][4];
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const int row = 16 * kk + (lane & 7) + ((lane >> 4) << 3), col = 16 * w + (((lane >> 3) & 1) << 3);
        mma::ldsm_x4_t(fa[m][kk], smem + st * L::kStage + L::kK + m * kSweepTile + swz(kChunk, row, col));
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int k = 16 * kk + 2 * t + 8 * hf;
          const float w0 = mma::fexp(B - bt[k]), w1 = mma::fexp(B - bt[k + 1]);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float2 x = mma::unpack2<T>(fa[m][kk][2 * hf + e]);
            fa[m][kk][2 * hf + e] = mma::pack2<T>(k < nr ? x.x * w0 : 0.f, k + 1 < nr ? x.y * w1 : 0.f);
          }
        }
      }
    wg_fence();
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<T, 64, 1>(acc[m], fa[m][kk], desc_mn(base + L::kV, kChunk, kk), true);
    wg_commit();
    wg_wait<2>();  // S
    fence_regs(sacc);
    // P = scale Gamma o S (rows i0, i1; columns 8j + 2t) packed as the A fragments of P V
    uint32_t pa[4][4];
    const float bi0 = bt[i0], bi1 = bt[i1];
    pack_scores<T, false>(pa, sacc, i0, nr, sc, bt, nullptr, nullptr);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<T, 64, 1>(opv, pa[kk], desc_mn(base + L::kV, kChunk, kk), kk > 0);
    wg_commit();
    wg_wait<0>();
    fence_regs(oq), fence_regs(opv);
#pragma unroll
    for (int m = 0; m < kSlabs; ++m) {
      fence_regs(acc[m]);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) fence_regs(fa[m][kk]);
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) fence_regs(pa[kk]);
    // O = diag(scale e^b) Q H + P V, rows < nr
    const int64_t r0 = row0 + int64_t(i) * a.C;
    const float e0 = sc * mma::fexp(bi0), e1 = sc * mma::fexp(bi1);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = hf ? i1 : i0;
        const float f = hf ? e1 : e0;
        if (r < nr)
          *reinterpret_cast<uint32_t*>(out + (r0 + r) * ldo + 8 * j) =
              mma::pack2<T>(f * oq[4 * j + 2 * hf] + opv[4 * j + 2 * hf], f * oq[4 * j + 2 * hf + 1] + opv[4 * j + 2 * hf + 1]);
      }
    if (i + 1 < nch) put_state(i + 1);
  }
  if (a.hbuf && tid == 0) bulk_wait<0>();  // the state stores complete before the block exits
  if (a.ht)
#pragma unroll
    for (int m = 0; m < kSlabs; ++m) store_state_frag<64>(acc[m], a.ht + sidx, a.dv, 64 * m + 16 * w + g, v0, t);
#else
  __trap();  // launched only where runs_sm90a() holds
#endif
}

}  // namespace

// Once gla.cu has chosen this tier (heuristics::gla_sm90_fused_forward: dk of 64 or 128, dv a
// multiple of 64); false where this device does not run the build's sm_90a code or TMA cannot
// describe the operands.
template <class T>
bool gla_fused_forward_sm90(const GlaArgs<T>& a, cudaStream_t stream) {
  auto run = [&](auto kernel, size_t bytes) -> bool {
    if (!ready_sm90(kernel, bytes)) return false;
    if (dry_run()) return true;  // dry run: workspace_size (no workspace either way)
    CUtensorMap m[4] = {};  // q, k, v; the chunk states when asked for (state_map)
    unsigned order = 0;
    if (!qkv_maps(a, m, order) || (a.hbuf && !state_map(&m[3], a, a.hbuf, a.dk))) return false;
    kernel<<<dim3(unsigned(a.N * a.H), unsigned(a.dv / 64)), kSm90Threads, bytes, stream>>>(m[0], m[1], m[2], m[3],
                                                                                             order, a);
    HILA_CUDA_CHECK_LAUNCH();
    return true;
  };
  return HILA_HEADDIM_SWITCH(a.dk, DK, [&] { return run(fused_forward_sm90_kernel<T, DK>, FwdSm90Layout<DK>::kBytes); });
}

template bool gla_fused_forward_sm90<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, cudaStream_t);
template bool gla_fused_forward_sm90<__half>(const GlaArgs<__half>&, cudaStream_t);

}  // namespace hila::cuda
