// SPDX-License-Identifier: Apache-2.0
// Pieces shared by the GLA kernels of the sm90 tier (sm_90a: TMA loads and stores into 128-byte
// swizzled shared memory, wgmma; prims/sm90.cuh): one warpgroup per block, the TMA row loads, the
// paired wgmma chains, the state fragments, and on the host the tensor maps of the inputs and of the
// per-chunk states, and the check that this device runs the build's sm_90a code.
#pragma once
#include "cuda/gla/gla.cuh"
#include "cuda/loglinear/tree.cuh"
#include "cuda/prims/mma.cuh"
#include "cuda/prims/sm90.cuh"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda::gla_sm90 {

constexpr int kSm90Threads = 128;  // one warpgroup
constexpr uint32_t kSweepTile = kChunk * 64 * 2;  // one swizzled [C, 64] 16-bit block

#if HILA_SM90A
// A chunk's rows r0.. of head x, columns c0..c0+63, of an input tensor map (see input_map): one
// swizzled [C][64] block at dst.
__device__ __forceinline__ void load_rows(char* dst, const CUtensorMap* map, uint64_t* bar, bool swapped, int c0,
                                          int64_t r0, int x) {
  if (swapped) sm90::tma_load_3d(dst, map, bar, c0, x, int(r0));
  else sm90::tma_load_3d(dst, map, bar, c0, int(r0), x);
}

// acc = A1 B1 over k1 steps of 16 and acc2 = A2 B2 over the chunk (C / 16 steps), issued together
// and waited for. Operands are 16-bit swizzled tiles at shared addresses (rows: the tile's rows),
// read K-major or, with TA / TB = 1, MN-major (sm90.cuh).
template <class T, int N, int TA1, int TB1, int TA2, int TB2>
__device__ __forceinline__ void wgmma_pair(float (&acc)[N / 2], uint32_t a1, int ra1, uint32_t b1, int rb1, int k1,
                                           float (&acc2)[N / 2], uint32_t a2, uint32_t b2) {
  using namespace sm90;
  wg_fence();
  wgmma_chain<T, N, TA1, TB1>(acc, a1, ra1, b1, rb1, k1);
  wgmma_chain<T, N, TA2, TB2>(acc2, a2, kChunk, b2, kChunk, kChunk / 16);
  wg_commit();
  wg_wait<0>();
  fence_regs(acc), fence_regs(acc2);
}

// (key o w)^T as register A fragments of wgmma_rs: fa[kk] holds warp w's rows (key columns 16w..,
// of the swizzled [C][64] key block at `tile`, read transposed by ldmatrix) and tokens 16kk..,
// token k scaled by wt(k); tokens k >= nr are zero.
template <class T, class W>
__device__ __forceinline__ void scaled_key_frags(uint32_t (&fa)[4][4], const char* tile, int w, int lane, int nr,
                                                 W&& wt) {
  const int t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int row = 16 * kk + (lane & 7) + ((lane >> 4) << 3), col = 16 * w + (((lane >> 3) & 1) << 3);
    mma::ldsm_x4_t(fa[kk], tile + sm90::swz(kChunk, row, col));
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int k = 16 * kk + 2 * t + 8 * hf;
      const float w0 = wt(k), w1 = wt(k + 1);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const float2 x = mma::unpack2<T>(fa[kk][2 * hf + m]);
        fa[kk][2 * hf + m] = mma::pack2<T>(k < nr ? x.x * w0 : 0.f, k + 1 < nr ? x.y * w1 : 0.f);
      }
    }
  }
}

// Rows nr.. of `blocks` swizzled [C][64] 16-bit blocks at `tile` (kSweepTile apart) set to zero by
// the block's threads and fenced for the async proxy (wgmma); the caller's barrier follows. Rows
// past a sequence hold the next one's values or TMA's zeros: a zero weight times a value that is
// not finite would not be zero.
__device__ __forceinline__ void zero_rows_from(char* tile, int blocks, int nr, int tid) {
  for (int e = tid; e < (kChunk - nr) * 8; e += kSm90Threads)
    for (int cb = 0; cb < blocks; ++cb)
      *reinterpret_cast<uint4*>(tile + cb * kSweepTile + (nr + e / 8) * 128 + (e % 8) * 16) = make_uint4(0, 0, 0, 0);
  sm90::fence_async_smem();
}

// P = score_elem(S) of this thread's rows i0, i1 = i0 + 8 (S the m64n64 accumulator: columns
// 8j + 2t (+1) at s[4j + 2hf + e]) packed as the register A fragments of P V: k step j / 2, a0 / a1
// columns 2t.., a2 / a3 columns 2t + 8.. (bs: the chunk's gate cumsum; lam rows lr0, lr1: kTree).
template <class T, bool kTree>
__device__ __forceinline__ void pack_scores(uint32_t (&pa)[4][4], const float (&s)[32], int i0, int nr, float sc,
                                            const float* bs, const float* lr0, const float* lr1) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = i0 + 8 * hf, col = 8 * j + 2 * t;
      const float bi = bs[i];
      const float* lr = hf ? lr1 : lr0;
      pa[j >> 1][2 * (j & 1) + hf] = mma::pack2<T>(score_elem<kTree>(s[4 * j + 2 * hf], i, col, nr, sc, bi, bs[col], lr),
                                                   score_elem<kTree>(s[4 * j + 2 * hf + 1], i, col + 1, nr, sc, bi, bs[col + 1], lr));
    }
}
#endif

// A 16-bit input (q, k, v or dO) as a 3-d tensor map: columns, then rows and heads in increasing
// stride order (a caller's [B, T, H, d] tensor has its heads inside its rows: `swapped`), box
// {64, C rows, 1 head}. False where TMA cannot describe it.
template <class T>
bool input_map(CUtensorMap* m, bool& swapped, const T* p, int64_t ld, int64_t hs, int d, int heads, int64_t Ttot) {
  const uint64_t rs = uint64_t(row_ld(ld, d)), hstr = uint64_t(head_stride(hs, Ttot, d));
  swapped = hstr < rs;
  const uint64_t dims[3] = {uint64_t(d), swapped ? uint64_t(heads) : uint64_t(Ttot),
                            swapped ? uint64_t(Ttot) : uint64_t(heads)};
  const uint64_t strides[2] = {swapped ? hstr : rs, swapped ? rs : hstr};
  const uint32_t box[3] = {64, swapped ? 1u : uint32_t(kChunk), swapped ? uint32_t(kChunk) : 1u};
  return sm90::encode_tile_map(m, std::is_same_v<T, __half>, p, 3, dims, strides, box);
}
template <class T>
int src_heads(const GlaArgs<T>& a, int div) {
  return (a.H + div - 1) / div;
}



// One m64 slab of a [dk][dv] fp32 state as a wgmma accumulator fragment of N columns: this
// thread's rows r, r + 8 (r = slab row 16w + g plus the slab's first row) and columns
// c0 + 8j + 2t (+1), at acc[4j + 2hf + e], stored to the state whose row 0, column 0 is st ([.][ld]).
// (The kernels' loads of a state stay inline: through a helper like this one they compiled to
// different machine code, and this build's GPU runs checked the inline form.)
template <int N>
__device__ __forceinline__ void store_state_frag(const float (&acc)[N / 2], float* st, int64_t ld, int r, int c0, int t) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      *reinterpret_cast<float2*>(st + int64_t(r + 8 * hf) * ld + c0 + 8 * j + 2 * t) =
          make_float2(acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
}
#if HILA_SM90A
// The mbarriers of an n-stage TMA ring, initialised by one thread and visible to the block.
__device__ __forceinline__ void init_ring(uint64_t* full, int n, int tid) {
  if (tid == 0) {
    for (int st = 0; st < n; ++st) sm90::mbar_init(&full[st], 1);
    sm90::fence_barrier_init();
  }
  __syncthreads();
}
#endif

// An sm_90a kernel readied for launch with `bytes` of shared memory and the max-shared carveout;
// false where this device does not run the build's sm_90a code.
template <class K>
bool ready_sm90(K kernel, size_t bytes) {
  if (!sm90::runs_sm90a(reinterpret_cast<const void*>(kernel))) return false;
  set_smem(kernel, bytes, /*max_carveout=*/true);
  return true;
}
// Tensor maps m[0..2] of q, k, v (input_map) and their swapped bits 0..2 in `order`.
template <class T>
bool qkv_maps(const GlaArgs<T>& a, CUtensorMap* m, unsigned& order) {
  bool sw[3];
  if (!input_map(&m[0], sw[0], a.q, a.q_ld, a.q_hs, a.dk, src_heads(a, a.q_div), a.Ttot) ||
      !input_map(&m[1], sw[1], a.k, a.k_ld, a.k_hs, a.dk, src_heads(a, a.k_div), a.Ttot) ||
      !input_map(&m[2], sw[2], a.v, a.v_ld, a.v_hs, a.dv, src_heads(a, a.v_div), a.Ttot))
    return false;
  order = unsigned(sw[0]) | unsigned(sw[1]) << 1 | unsigned(sw[2]) << 2;
  return true;
}

// Per-chunk 16-bit states (hbuf, dhbuf: [nchunks][H][dk][dv]; states = nchunks, or the tree's node
// slots for ta.node16) as a 2-d tensor map [states*H*dk][dv], box {64 columns, rows}: rows = dk, one
// chunk's and head's rows, or 64, a slab of them.
template <class T>
bool state_map(CUtensorMap* map, const GlaArgs<T>& a, const T* p, int rows, int64_t states = -1) {
  if (states < 0) states = a.nchunks;
  const uint64_t dims[2] = {uint64_t(a.dv), uint64_t(states * a.H * a.dk)}, strides[1] = {uint64_t(a.dv)};
  const uint32_t box[2] = {64, uint32_t(rows)};
  return sm90::encode_tile_map(map, std::is_same_v<T, __half>, p, 2, dims, strides, box);
}


}  // namespace hila::cuda::gla_sm90
