// SPDX-License-Identifier: Apache-2.0
// The delta rule's sm90 tier (sm_90a: TMA + wgmma): the pieces shared by the state sweeps of plain
// gdn (sweep_sm90.cu) and the level sweeps of loglinear_gdn (loglinear_gdn_sm90.cu). A sweep
// warpgroup holds its [dk, 64] fp32 state (dk = 64 or 128: M = dk / 64 m64 slabs) as wgmma
// accumulators acc[M][32]: thread (warp w, lane 4g + t) holds rows 64m + 16w + g (+8), columns
// 8j + 2t (+1) of slab m at acc[m][4j + 2hf + e]. Its chunks' 16-bit tiles arrive by TMA
// (128-byte swizzle) in a ring of S stages; st16 (dk * 128 bytes per warpgroup) holds the 16-bit
// state [dk][64] as the B operand of the chunk's products, then (or in a [C][64] tile of its own
// after it, vt) the chunk's [C][64] operand of the state update.
#pragma once
#include "cuda/dispatch/heuristics.h"
#include "cuda/gla/sm90.cuh"

namespace hila::cuda::gdn {

// Shared memory of a sweep block of NW warpgroups (each its own 64 value columns): S ring stages of
// kTiles [C][dk] 16-bit tiles (each dk / 64 swizzled [C][64] blocks) and kBlocks [C][64] blocks per
// warpgroup (dO, U, dvi: NW of each, one after the other); then per warpgroup st16 and, with kVt,
// the [C][64] tile vt (the update's operand in a tile of its own: the epilogue that writes it need
// not wait for the chunk's products and the state's TMA store to finish reading st16), and the
// stages' mbarriers (8 bytes each).
template <int DK, int kTiles, int kBlocks = 0, int NW = 1, bool kVt = false>
struct Ring {
  static constexpr uint32_t kTile = (DK / 64) * gla_sm90::kSweepTile;
  static constexpr uint32_t kStage = kTiles * kTile + kBlocks * NW * gla_sm90::kSweepTile;
  static constexpr uint32_t kState = DK * 128;  // st16 [DK][64] 16-bit, then vt
  static constexpr uint32_t kOwn = kState + (kVt ? gla_sm90::kSweepTile : 0);  // one warpgroup's
  static constexpr uint32_t kFixed = NW * kOwn;
  static constexpr size_t bytes(int stages) { return size_t(stages) * (kStage + 8) + kFixed; }
  // byte offsets in the block's shared memory with `stages` stages: warpgroup wg's st16 (its vt at
  // + kState) and the stages' mbarriers
  static constexpr uint32_t state_at(int stages, int wg = 0) { return stages * kStage + wg * kOwn; }
  static constexpr uint32_t barriers_at(int stages) { return stages * kStage + kFixed; }
};

// Ring stages for `blocks` sweep blocks of layout L, at most `max_per_sm` blocks per SM
// (heuristics::delta_sm90_sweep_stages; 0: two stages do not fit).
template <class L>
int ring_stages(int64_t blocks, int64_t max_per_sm) {
  return heuristics::delta_sm90_sweep_stages(blocks, device_info(), L::kStage + 8, L::kFixed, max_per_sm);
}

#if HILA_SM90A
// A sweep block's ring of layout L and S stages in its dynamic shared memory (1024-byte aligned
// for the swizzle, else it traps): warpgroup wg's st16 and vt, as pointers and as shared-space
// addresses (the wgmma descriptors'), and the stages' mbarriers.
template <class L, int S>
struct RingAt {
  uint32_t s0, a16, avt;
  char *st16, *vt;
  uint64_t* full;  // [S]
  __device__ RingAt(char* smem, int wg) : s0(sm90::smem_u32(smem)) {
    if (s0 & 1023) __trap();
    st16 = smem + L::state_at(S, wg), vt = st16 + L::kState;
    a16 = s0 + L::state_at(S, wg), avt = a16 + L::kState;
    full = reinterpret_cast<uint64_t*>(smem + L::barriers_at(S));
  }
};

// This thread's 16-bit state entries (slab m rows 64m + 16w + g (+8), columns 8j + 2t (+1):
// acc[m][4j + 2hf + e]) into the swizzled [DK][64] tile at st16 and, when out is set, to the
// [dk][dv] matrix out (row 0, column v0 + 2t of it).
template <class T, int M>
__device__ __forceinline__ void stash16(const float (&acc)[M][32], char* st16, T* out, int64_t dv) {
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;  // w: warp in the warpgroup
  const mma::Frag fr{lane >> 2, lane & 3};
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = fr.row(64 * m + 16 * w, hf);
        const uint32_t x = mma::pack2<T>(acc[m][4 * j + 2 * hf], acc[m][4 * j + 2 * hf + 1]);
        *reinterpret_cast<uint32_t*>(st16 + sm90::swz(64 * M, r, fr.col(0, j))) = x;
        if (out) *reinterpret_cast<uint32_t*>(out + int64_t(r) * dv + 8 * j) = x;
      }
}
#endif

// The fp32 state of slabs m < M from / to the [dk][dv] matrix st (rows 64m + 16w + g (+8),
// columns v0 + 8j + 2t (+1); rl = 16w + g); nullptr on load: 0. With add, the store adds to st.
template <int M>
__device__ __forceinline__ void load_state_slabs(float (&acc)[M][32], const float* st, int64_t dv, int rl, int v0,
                                                 int t) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[m][4 * j + e] = st ? st[int64_t(64 * m + rl + 8 * (e >> 1)) * dv + v0 + 8 * j + 2 * t + (e & 1)] : 0.f;
}
template <int M>
__device__ __forceinline__ void store_state_slabs(const float (&acc)[M][32], float* st, int64_t dv, int rl, int v0,
                                                  int t, bool add = false) {
  if (!st) return;
  if (!add) {
#pragma unroll
    for (int m = 0; m < M; ++m) gla_sm90::store_state_frag<64>(acc[m], st, dv, 64 * m + rl, v0, t);
    return;
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float2* p = reinterpret_cast<float2*>(st + int64_t(64 * m + rl + 8 * hf) * dv + v0 + 8 * j + 2 * t);
        float2 v = *p;
        v.x += acc[m][4 * j + 2 * hf], v.y += acc[m][4 * j + 2 * hf + 1];
        *p = v;
      }
}

#if HILA_SM90A
// A sweep step's state update, S = decay S + (the products that products(acc[m], m) issues on slab
// m: [dk, C] x [C, 64] wgmma chains accumulating into acc[m]), complete when it returns.
template <int M, class F>
__device__ __forceinline__ void decay_then_accumulate(float (&acc)[M][32], float decay, F&& products) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[m][e] *= decay;
  sm90::wg_fence();
#pragma unroll
  for (int m = 0; m < M; ++m) products(acc[m], m);
  sm90::wg_commit();
  sm90::wg_wait<0>();
#pragma unroll
  for (int m = 0; m < M; ++m) sm90::fence_regs(acc[m]);
}

// The reverse sweeps' dO block [C][64] of a ring stage (swizzled 16-byte pieces, four per thread
// of the warpgroup's wt): row r *= s(q, r) in place, q = 0..3 the piece's index (r = wt / 8 + 16q),
// rows >= nr zeroed. s(q, r) is the row's weight (scale e^{b_r}, or lambda_r).
template <class T, class Fs>
__device__ __forceinline__ void scale_do_rows(char* dOt, int wt, int nr, Fs s) {
  static_assert(kChunk * 8 == 4 * gla_sm90::kSm90Threads, "the dO tile's 16-byte pieces: four per thread");
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // the swizzle permutes 16-byte pieces within a row
    const int e = wt + gla_sm90::kSm90Threads * q, r = e / 8;
    const float sr = r < nr ? s(q) : 0.f;
    uint4* p = reinterpret_cast<uint4*>(dOt + e * 16);
    uint4 v = *p;
    uint32_t* x = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = mma::unpack2<T>(x[k]);
      x[k] = mma::pack2<T>(sr * f.x, sr * f.y);
    }
    *p = v;
  }
}
#endif

}  // namespace hila::cuda::gdn
