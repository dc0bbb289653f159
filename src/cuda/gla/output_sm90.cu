// SPDX-License-Identifier: Apache-2.0
// GLA output, sm90 tier (sm_90a: TMA + wgmma; gla/sm90.cuh), in place of output_sm80.cu's kernel where
// heuristics::gla_sm90_output chooses it. The same math (docs/math/HLA.md §1, §7.1): one warpgroup per
// (chunk, 64 value columns, head), fully parallel, from the states entering each chunk (hbuf):
//   S = Q K^T                                 SS, [C,dk]x[dk,C]
//   P = scale Gamma o S                       registers: the accumulator fragment is the A fragment of P V
//   O = P V + diag(scale e^b) Q H_c           RS [C,C]x[C,64], SS [C,dk]x[dk,64] (H_c MN-major)
// The log-linear tree form (loglinear/tree.cuh) has P carry lam_i^{bitlen(i xor j)} and, in place of
// the state term, the levels the chunk reads:  O += diag(scale lam^{p+m} e^{b + gap}) Q node_m  for
// each set bit m-1 of the chunk's absolute index, the 16-bit nodes in turn through the state buffer
// (loads on one mbarrier, parity = the load's index & 1; the next level's load is issued once every
// warp has read the buffer, and lands while the level's product is scaled into O).
// Shared memory at dk = 128: Q, K 16 KB each, V 8 KB, the state buffer 16 KB: 56 KB, 4 blocks per SM.
#include "cuda/dispatch/static_switch.h"
#include "cuda/gla/sm90.cuh"

namespace hila::cuda {

namespace {

using namespace gla_sm90;

template <int DK>
struct OutSm90Layout {
  static constexpr uint32_t kQ = 0, kK = kChunk * DK * 2, kV = 2 * kChunk * DK * 2, kH = kV + kChunk * 64 * 2,
                            kB = kH + DK * 64 * 2, kBar = kB + kChunk * 4, kBytes = kBar + 2 * 8;
};

template <class T, int DK, bool kTree>
__global__ void __launch_bounds__(kSm90Threads)
    output_sm90_kernel(const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                       const __grid_constant__ CUtensorMap mv, const __grid_constant__ CUtensorMap mh, unsigned order,
                       GlaArgs<T> a, TreeArgs ta) {
  using L = OutSm90Layout<DK>;
  static_assert(L::kQ == 0 && L::kK % 1024 == 0 && L::kV % 1024 == 0 && L::kH % 1024 == 0, "1024-aligned swizzled tiles");
#if HILA_SM90A
  using namespace sm90;
  extern __shared__ __align__(1024) char smem[];
  const uint32_t s0 = smem_u32(smem);
  if (s0 & 1023) __trap();  // the swizzle needs 1024-byte aligned tiles
  float* bs = reinterpret_cast<float*>(smem + L::kB);            // [C] the chunk's gate cumsum
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + L::kBar);  // [0]: Q, K, V; [1]: the state buffer
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const GridChunk gc(a, blockIdx.x);
  if (!gc.valid) return;  // past this sequence's chunks (a piece)
  const int seq = gc.seq, v0 = int(blockIdx.y) * 64, h = int(blockIdx.z);
  const int64_t r0 = a.row0[seq] + gc.c * a.C;
  const int nr = rows_in(a.len[seq], gc.c, a.C);
  // kTree: the chunk's absolute index n reads the nodes of the set bits of n, in ascending level
  const SeqNodes sn = kTree ? seq_nodes(ta, a.chunk0, seq, (a.len[seq] + a.C - 1) / a.C) : SeqNodes{};
  const int64_t n = sn.a0 + gc.c;
  auto load_state = [&](int64_t slot) {  // rows of state `slot` (hbuf: the chunk; the tree: a node slot), thread 0
    mbar_expect_tx(&bar[1], DK * 64 * 2);
    tma_load_2d(smem + L::kH, &mh, &bar[1], v0, int((slot * a.H + h) * DK));
  };
  if (tid == 0) {
    mbar_init(&bar[0], 1), mbar_init(&bar[1], 1);
    fence_barrier_init();
  }
  __syncthreads();
  if (tid == 0) {
    mbar_expect_tx(&bar[0], L::kH);  // Q, K, V
    for (int cb = 0; cb < DK / 64; ++cb) {
      load_rows(smem + L::kQ + cb * kSweepTile, &mq, &bar[0], order & 1, 64 * cb, r0, h / a.q_div);
      load_rows(smem + L::kK + cb * kSweepTile, &mk, &bar[0], (order >> 1) & 1, 64 * cb, r0, h / a.k_div);
    }
    load_rows(smem + L::kV, &mv, &bar[0], (order >> 2) & 1, v0, r0, h / a.v_div);
    if (!kTree) load_state(gc.cg);
    else if (n > 0) load_state(first_read_slot(sn, n));
  }
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  if (tid < kChunk) bs[tid] = gate_at(b, r0, tid, nr);
  mbar_wait(&bar[0], 0);
  if (nr < kChunk) zero_rows_from(smem + L::kV, 1, nr, tid);  // value rows past the sequence
  __syncthreads();  // bs, the zeroed rows
  const float sc = float(a.scale);
  const int i0 = 16 * w + g, i1 = i0 + 8;  // rows of this thread
  const float bi0 = bs[i0], bi1 = bs[i1];
  const float* lam0 = kTree ? ta.lam + (int64_t(h) * a.Ttot + r0 + min(i0, nr - 1)) * ta.nL : nullptr;
  const float* lam1 = kTree ? ta.lam + (int64_t(h) * a.Ttot + r0 + min(i1, nr - 1)) * ta.nL : nullptr;
  float o[32];  // rows i0, i1; columns v0 + 8j + 2t (+1): o[4j + 2hf + e]
  {
    float s[32];
    wg_fence();
    wgmma_chain<T, 64, 0, 0>(s, s0 + L::kQ, kChunk, s0 + L::kK, kChunk, DK / 16);  // S = Q K^T
    wg_commit();
    wg_wait<0>();
    fence_regs(s);
    uint32_t pa[4][4];  // P as the A fragments of P V
    pack_scores<T, kTree>(pa, s, i0, nr, sc, bs, lam0, lam1);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<T, 64, 1>(o, pa[kk], desc_mn(s0 + L::kV, kChunk, kk), kk > 0);  // P V
    wg_commit();
    wg_wait<0>();
    fence_regs(o);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) fence_regs(pa[kk]);
  }
  // O += diag(f) Q X, f = scale e^{b} (X = H_c) or scale lam^{p+m} e^{b+gap} (X = node_m)
  uint32_t loads = 0;  // completed loads into the state buffer
  auto add_state = [&](float f0, float f1) {
    float y[32];
    mbar_wait(&bar[1], loads & 1);
    ++loads;
    wg_fence();
    wgmma_chain<T, 64, 0, 1>(y, s0 + L::kQ, kChunk, s0 + L::kH, DK, DK / 16);  // [C,dk]x[dk,64], X MN-major
    wg_commit();
    wg_wait<0>();
    fence_regs(y);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      o[4 * j] += f0 * y[4 * j], o[4 * j + 1] += f0 * y[4 * j + 1], o[4 * j + 2] += f1 * y[4 * j + 2],
          o[4 * j + 3] += f1 * y[4 * j + 3];
  };
  if constexpr (kTree) {
    for_each_read(ta, sn, n, h, a.H, [&](int m, int64_t, float gap) {
      const float f0 = sc * lam0[kLogChunk + m] * mma::fexp(bi0 + gap), f1 = sc * lam1[kLogChunk + m] * mma::fexp(bi1 + gap);
      add_state(f0, f1);
      __syncthreads();  // node_m read by every warp: the next level's may overwrite it
      if (tid == 0)
        if (const uint64_t above = uint64_t(n) >> m) {  // the next level read: the next set bit of n
          const int m2 = m + 1 + ctz64u(above);
          load_state(sn.slot(m2, (n >> (m2 - 1)) - 1));
        }
    });
  } else {
    add_state(sc * mma::fexp(bi0), sc * mma::fexp(bi1));
  }
  T* out = a.o + h * head_stride(a.o_hs, a.Ttot, a.dv) + v0 + 2 * t;
  const int64_t ldo = row_ld(a.o_ld, a.dv);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = hf ? i1 : i0;
      if (r < nr)
        *reinterpret_cast<uint32_t*>(out + (r0 + r) * ldo + 8 * j) = mma::pack2<T>(o[4 * j + 2 * hf], o[4 * j + 2 * hf + 1]);
    }
#else
  __trap();  // launched only where runs_sm90a() holds
#endif
}

}  // namespace

// Once gla.cu has chosen this tier (heuristics::gla_sm90_output: dk of 64 or 128, dv a multiple of 64,
// the states or nodes given); false where this device does not run the build's sm_90a code or TMA
// cannot describe the operands.
template <class T>
bool gla_output_sm90(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree) {
  if (grid_chunks(a) <= 0) return true;
  auto run = [&](auto kernel, size_t bytes) -> bool {
    if (!ready_sm90(kernel, bytes)) return false;
    if (dry_run()) return true;  // dry run: workspace_size (no workspace either way)
    CUtensorMap m[4] = {};  // q, k, v; the states (hbuf, or the tree's 16-bit nodes), box {64, dk}
    unsigned order = 0;
    const T* st = tree ? static_cast<const T*>(tree->node16) : a.hbuf;
    if (!qkv_maps(a, m, order) || !state_map(&m[3], a, st, a.dk, tree ? tree->slots : a.nchunks)) return false;
    kernel<<<dim3(unsigned(grid_chunks(a)), unsigned(a.dv / 64), unsigned(a.H)), kSm90Threads, bytes, stream>>>(
        m[0], m[1], m[2], m[3], order, a, tree ? *tree : TreeArgs{});
    HILA_CUDA_CHECK_LAUNCH();
    return true;
  };
  return HILA_BOOL_SWITCH(tree != nullptr, kTree, [&] {
    return HILA_HEADDIM_SWITCH(a.dk, DK, [&] { return run(output_sm90_kernel<T, DK, kTree>, OutSm90Layout<DK>::kBytes); });
  });
}

template bool gla_output_sm90<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, cudaStream_t, const TreeArgs*);
template bool gla_output_sm90<__half>(const GlaArgs<__half>&, cudaStream_t, const TreeArgs*);

}  // namespace hila::cuda
