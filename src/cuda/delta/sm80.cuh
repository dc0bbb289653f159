// SPDX-License-Identifier: Apache-2.0
// The delta rule's sm80 tier (bf16 / fp16 on tensor cores): the tile constants and the pieces of
// the sequential state sweeps shared by plain gdn (gdn_sm80.cu) and loglinear_gdn
// (loglinear_gdn_sm80.cu): the sweep items, the state-tile helpers (a [dk, 64] fp32 tile in
// registers, warp w rows 16w + g (+8)) and the sweeps' shared-memory tiles. The WY chunks are in
// wy_sm80.cu, one call's packed operands in gdn_call_sm80.cu. The math is in the .cu files'
// comments (docs/math/LOGLINEAR.md §6.4, §6.5).
#pragma once
#include <algorithm>

#include "cuda/prims/mma.cuh"
#include "cuda/prims/tile.cuh"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda::gdn {

constexpr int kThreads = 256;      // 8 warps
constexpr int kMaxD = 128;         // dk (padded) held by one block: one 16-row state slice per warp
constexpr int kVT = 64;            // value columns per sweep block
constexpr int kLd = kVT + 8;       // padded smem row of a 64-column 16-bit tile
constexpr int kLdA = kChunk + 1;   // fp32 [C][C] rows
constexpr int kLamLd = 8;          // per-row lambda of the in-chunk levels 0..p (p = 6) in smem

// Padded smem row (16-bit elements) of a [rows][d] tile: 16-byte rows, staggered banks.
__host__ __device__ constexpr int ld_of(int d) { return d + 8; }

constexpr int kSweepStages = 2;

// The (sequence, head, 64 value columns) a sweep block takes: grid (N x H, 1, dv tiles of 64).
struct SweepItem {
  int seq, h, v0, bv, nt, nch;
  int64_t len, row0;
  bool active;  // this warp's 16 state rows are < dk
  template <class A>
  __device__ explicit SweepItem(const A& a) {
    seq = blockIdx.x / a.H, h = blockIdx.x % a.H;
    v0 = blockIdx.z * kVT, bv = min(kVT, a.dv - v0), nt = bv / 8;
    active = 16 * int(threadIdx.x >> 5) < a.dk;
    len = a.len[seq], row0 = a.row0[seq];
    nch = int((len + kChunk - 1) / kChunk);
  }
};

// A sweep's fp32 state tile in registers (warp w: rows 16w + g (+8), columns 8j + 2t (+1), j < bv/8)
// as a 16-bit GEMM operand: to Ss [dk][kLd] and, when out is set, to columns [v0, v0+bv) of out
// [dk][dv]. Columns bv..63 of Ss are zeroed, so that products over the tile read no stale values.
template <class T>
__device__ void stash_state(const float (&acc)[8][4], bool active, T* Ss, T* out, int dk, int dv, int v0, int bv) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (active && j < bv / 8)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = fr.row(16 * w, hf), col = fr.col(0, j);
        const uint32_t x = mma::pack2<T>(acc[j][2 * hf], acc[j][2 * hf + 1]);
        *reinterpret_cast<uint32_t*>(Ss + r * kLd + col) = x;
        if (out) *reinterpret_cast<uint32_t*>(out + int64_t(r) * dv + v0 + col) = x;
      }
  if (bv < kVT)
    for (int e = threadIdx.x; e < dk * (kVT - bv); e += blockDim.x)
      Ss[(e / (kVT - bv)) * kLd + bv + e % (kVT - bv)] = to<T>(0.f);
}

// The fp32 state tile from / to columns [v0, v0+bv) of a [dk][dv] fp32 matrix (nullptr on load: 0).
__device__ inline void load_state(float (&acc)[8][4], bool active, const float* src, int dv, int v0, int bv) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = fr.row_of(16 * w, e), col = fr.col_of(v0, j, e);
      acc[j][e] = (src && active && j < bv / 8) ? src[int64_t(r) * dv + col] : 0.f;
    }
}
__device__ inline void store_state(float* dst, const float (&acc)[8][4], bool active, int dv, int v0, int bv) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  if (!dst || !active) return;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < bv / 8)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = fr.row_of(16 * w, e), col = fr.col_of(v0, j, e);
        dst[int64_t(r) * dv + col] = acc[j][e];
      }
}
// The erase-and-add of a sweep's state tile over one chunk of nr rows (docs/math/LOGLINEAR.md §6.4):
//   S <- e^B S + K^T diag(e^{B-b}) Y      [dk,C]x[C,64]  (bt: the chunk's gates b in smem, B = bt[nr-1])
template <class T>
__device__ __forceinline__ void erase_add(float (&acc)[8][4], bool active, const T* K, int ldk, const T* Y, int nt,
                                          const float* bt, int nr) {
  const float B = bt[nr - 1], decay = __expf(B);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] *= decay;
  if (active)
    mma::warp_gemm_tn_weighted<T, 8>(acc, K, ldk, 16 * int(threadIdx.x >> 5), Y, kLd, nt, kChunk,
                                    [&](int k) { return __expf(B - bt[k]); });
}

// The (chunk, head) of a chunk-parallel block: grid (nchunks, H).
struct ChunkItem {
  int64_t cg, c, r0, rowbase;  // global chunk, chunk in its sequence, first row, row of [H][Ttot]
  int h, seq, nr;
  template <class A>
  __device__ explicit ChunkItem(const A& a) {
    cg = blockIdx.x, h = blockIdx.y, seq = a.chunk_seq[cg];
    c = cg - a.chunk0[seq], r0 = a.row0[seq] + c * kChunk, rowbase = int64_t(h) * a.Ttot + r0;
    nr = rows_in(a.len[seq], c);
  }
};

template <class T>
struct SweepTiles {
  T *Ss, *Vns;
  T* U;  // [C][kLd] 16-bit
  float* lam = nullptr;  // loglinear_gdn's level sweep: lambda of the read level per row [C]
  int ldk;
  size_t stage_bytes;
  char* base;
  __host__ __device__ SweepTiles(char* base_, int dk, bool ll = false, size_t* bytes = nullptr)
      : ldk(ld_of(dk)), base(base_) {
    stage_bytes = size_t(2) * kChunk * ldk * sizeof(T) + kChunk * sizeof(float);
    stage_bytes = (stage_bytes + 127) / 128 * 128;
    char* p = base ? base + kSweepStages * stage_bytes : nullptr;
    // U, or the level sweep's Qeff [C, dk] in its place
    const size_t ub = size_t(kChunk) * (ldk > kLd ? ldk : kLd) * sizeof(T), sb = size_t(dk) * kLd * sizeof(T);
    U = reinterpret_cast<T*>(p);
    Ss = reinterpret_cast<T*>(p ? p + ub : nullptr);
    Vns = reinterpret_cast<T*>(p ? p + ub + sb : nullptr);
    size_t used = kSweepStages * stage_bytes + ub + sb + size_t(kChunk) * kLd * sizeof(T);
    if (ll) {
      lam = reinterpret_cast<float*>(p ? base + used : nullptr);
      used += kChunk * sizeof(float);
    }
    if (bytes) *bytes = used;
  }
  __device__ T* W(int st) const { return reinterpret_cast<T*>(base + st * stage_bytes); }
  __device__ T* K(int st) const { return W(st) + kChunk * ldk; }
  __device__ float* b(int st) const { return reinterpret_cast<float*>(K(st) + kChunk * ldk); }
  // W, K [C, dk] and the gates b of chunk c (rows [row0 + c C, ..), len rows in the sequence) into
  // stage c % kSweepStages by cp.async, one commit group; Wh, Kh, b: the head's rows (b may be nullptr)
  __device__ void issue(int64_t c, const T* Wh, const T* Kh, int64_t kld, const float* b, int64_t row0, int64_t len,
                        int dk) const {
    const int st = int(c % kSweepStages);
    const int64_t r0 = row0 + c * kChunk;
    const int nr = rows_in(len, c);
    mma::async_rows(W(st), ldk, Wh, dk, r0, nr, 0, dk, kChunk);
    mma::async_rows(K(st), ldk, Kh, kld, r0, nr, 0, dk, kChunk);
    if (threadIdx.x < kChunk) {
      const bool in = b && int(threadIdx.x) < nr;
      mma::cp_async4(this->b(st) + threadIdx.x, in ? static_cast<const void*>(b + r0 + threadIdx.x) : Wh, in ? 4 : 0);
    }
    mma::cp_async_commit();
  }
  // the level sweep's Qeff [C, dk] (16-bit), in U's place
  __device__ T* Qe() const { return U; }
};


template <class T>
struct RsweepTiles {
  T *dSs, *dVns;
  int ldk;
  size_t stage_bytes;
  char* base;
  __host__ __device__ RsweepTiles(char* base_, int dk, size_t* bytes = nullptr) : ldk(ld_of(dk)), base(base_) {
    stage_bytes = (size_t(3) * kChunk * ldk + size_t(2) * kChunk * kLd) * sizeof(T) + kChunk * sizeof(float);
    stage_bytes = (stage_bytes + 127) / 128 * 128;
    char* p = base ? base + kSweepStages * stage_bytes : nullptr;
    dSs = reinterpret_cast<T*>(p);
    dVns = reinterpret_cast<T*>(p ? p + size_t(dk) * kLd * sizeof(T) : nullptr);
    if (bytes) *bytes = kSweepStages * stage_bytes + (size_t(dk) + kChunk) * kLd * sizeof(T);
  }
  __device__ T* Q(int st) const { return reinterpret_cast<T*>(base + st * stage_bytes); }
  __device__ T* K(int st) const { return Q(st) + kChunk * ldk; }
  __device__ T* W(int st) const { return K(st) + kChunk * ldk; }
  __device__ T* dO(int st) const { return W(st) + kChunk * ldk; }
  __device__ T* dvi(int st) const { return dO(st) + kChunk * kLd; }  // [C][kLd] 16-bit
  // loglinear_gdn's level rsweep: lambda of the read level per row [C] (fp32), in dvi's place
  __device__ float* lam(int st) const { return reinterpret_cast<float*>(dvi(st)); }
  __device__ float* b(int st) const { return reinterpret_cast<float*>(dvi(st) + kChunk * kLd); }
};


inline size_t sweep_smem(int dk, bool ll = false) { return layout_bytes<SweepTiles<__nv_bfloat16>>(dk, ll); }
inline size_t rsweep_smem(int dk) { return layout_bytes<RsweepTiles<__nv_bfloat16>>(dk); }

}  // namespace hila::cuda::gdn
