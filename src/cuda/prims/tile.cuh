// SPDX-License-Identifier: Apache-2.0
// Device helpers shared by the chunked kernels of every primitive: shared-memory carving, 16-byte
// row loads/stores of packed head-major buffers, the chunk-local gate cumsum and fp32 state tiles.
// Packed buffers are [heads][Ttot][ld] with ld a multiple of 16 elements; a chunk is kChunk rows.
#pragma once
#include "cuda/common.cuh"

namespace hila::cuda {

constexpr int kChunk = 64;  // tokens per chunk (a power of two; 64 fits the tile GEMMs)
static_assert(kChunk == 64, "chunk_cumsum scans two gates per lane of one warp");
constexpr int kLogChunk = 6;  // p = log2(kChunk): the levels inside a chunk are 0..p (docs/math/LOGLINEAR.md §2.6)
static_assert((1 << kLogChunk) == kChunk, "kLogChunk must match kChunk");
constexpr int kMaxLevels = 64;  // levels of an int64 position: bitlen(n) <= 64

// Shared-memory carve-out: bump allocator over the dynamic buffer, 128-byte aligned pieces.
struct Carve {
  char* p;
  size_t used = 0;
  template <class X>
  __host__ __device__ X* take(size_t n) {
    used = (used + 127) & ~size_t(127);
    X* r = reinterpret_cast<X*>(p + used);
    used += n * sizeof(X);
    return r;
  }
};

// Rows [r0, r0+nr) of a packed [heads][Ttot][ldg] buffer into smem [64][lds] (zero beyond nr),
// columns [c0, c0+nc), in 16-byte vectors (all widths and offsets are multiples of 16 bytes).
template <class T>
__device__ void load_rows(T* s, int lds, const T* g, int64_t ldg, int64_t r0, int nr, int c0, int nc) {
  constexpr int V = 16 / sizeof(T);
  const int nv = nc / V;
  for (int e = threadIdx.x; e < kChunk * nv; e += blockDim.x) {
    const int i = e / nv, j = (e % nv) * V;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (i < nr) x = *reinterpret_cast<const uint4*>(g + (r0 + i) * ldg + c0 + j);
    *reinterpret_cast<uint4*>(s + i * lds + j) = x;
  }
}

// Rows [0, nr) of an accumulator tile [64][ldr] to global rows r0.. of [..][ldg] as T, columns
// [c0, c0+nc), 16-byte stores.
template <class T, class R>
__device__ void store_rows(T* g, int64_t ldg, int64_t r0, int c0, const R* s, int ldr, int nr, int nc) {
  constexpr int V = 16 / sizeof(T);
  const int nv = nc / V;
  for (int e = threadIdx.x; e < nr * nv; e += blockDim.x) {
    const int i = e / nv, j = (e % nv) * V;
    union {
      uint4 u;
      T t[V];
    } x;
#pragma unroll
    for (int v = 0; v < V; ++v) x.t[v] = to<T>(s[i * ldr + j + v]);
    *reinterpret_cast<uint4*>(g + (r0 + i) * ldg + c0 + j) = x.u;
  }
}

// Valid rows of chunk c of a sequence of `len` tokens, chunks of C rows.
__device__ __forceinline__ int rows_in(int64_t len, int64_t c, int C = kChunk) {
  const int64_t r = len - c * C;
  return r < C ? int(r) : C;
}

// Chunk-local cumsum b at row i of the chunk starting at row r0 with nr valid rows (rows past the
// end repeat the last; no gates: 0).
template <class R>
__device__ __forceinline__ R gate_at(const R* b, int64_t r0, int i, int nr) {
  return b ? b[r0 + (i < nr ? i : nr - 1)] : R(0);
}

// Inclusive prefix sums of a 64-element chunk held two per lane by one warp (lane l holds elements
// 2l and 2l+1): returns them in x0, x1 (shuffle scan over the lane pairs).
template <class R>
__device__ __forceinline__ void warp_pair_cumsum(R& x0, R& x1) {
  const int lane = threadIdx.x & 31;
  const R pair = x0 + x1;
  R incl = pair;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const R y = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += y;
  }
  x0 = incl - pair + x0;
  x1 = incl;
}

// Chunk-local inclusive cumsum of the gates: b[i] for i < nr (b[i] = b[nr-1] beyond). One warp,
// two gates per lane.
template <class R>
__device__ void chunk_cumsum(R* b, const R* g, int64_t r0, int nr) {
  if (threadIdx.x < 32) {
    const int i0 = 2 * threadIdx.x, i1 = i0 + 1;
    R x0 = (g && i0 < nr) ? g[r0 + i0] : R(0);
    R x1 = (g && i1 < nr) ? g[r0 + i1] : R(0);
    warp_pair_cumsum(x0, x1);
    b[i0] = x0;
    b[i1] = x1;
  }
  __syncthreads();
}

// Suffix sums of a 64-element chunk held two per lane by one warp (lane l holds elements 2l and
// 2l+1): x_i <- sum_{r >= i} x_r.
template <class R>
__device__ __forceinline__ void warp_pair_suffix_sum(R& x0, R& x1) {
  const int lane = threadIdx.x & 31;
  R v = x0 + x1;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const R y = __shfl_down_sync(0xffffffffu, v, off);
    if (lane + off < 32) v += y;
  }
  R after = __shfl_down_sync(0xffffffffu, v, 1);  // the sum of the pairs after this one
  if (lane == 31) after = R(0);
  x1 += after;
  x0 += x1;
}

// Sum over the lanes of a warp (every lane gets it).
template <class R>
__device__ __forceinline__ R warp_sum(R x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Sum over the block (every thread gets it); blockDim.x a power of two, red [blockDim.x] shared.
template <class R>
__device__ R block_sum(R x, R* red) {
  red[threadIdx.x] = x;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  const R r = red[0];
  __syncthreads();
  return r;
}

// The gate gradient of one chunk's rows (docs/math/HLA.md §7.1, "the gate gradient per chunk"):
//   dg_i = D + sum_{i <= r < nr} dc_r
// with dc the per-row q^.dq^ - k.dk (lane l holds rows 2l, 2l+1 in x0, x1; 0 from row nr on) and
// D = <dH, H_end>, the cotangent and the state at the chunk's end; into out[0 .. nr). One warp,
// every lane.
template <class R>
__device__ __forceinline__ void chunk_dg(R* out, R x0, R x1, R D, int nr) {
  const int i0 = 2 * (threadIdx.x & 31), i1 = i0 + 1;
  warp_pair_suffix_sum(x0, x1);
  if (i0 < nr) out[i0] = x0 + D;
  if (i1 < nr) out[i1] = x1 + D;
}

// A [rows, bv] state tile in shared memory (ld) <-> columns [v0, v0+bv) of a [rows, dv] global
// matrix at `g` (nullptr on load: zero).
template <class R>
__device__ void tile_load(R* t, int ld, const R* g, int dv, int v0, int rows, int bv) {
  for (int e = threadIdx.x; e < rows * bv; e += blockDim.x)
    t[(e / bv) * ld + e % bv] = g ? g[int64_t(e / bv) * dv + v0 + e % bv] : R(0);
}
template <class R>
__device__ void tile_store(R* g, int dv, int v0, const R* t, int ld, int rows, int bv) {
  for (int e = threadIdx.x; e < rows * bv; e += blockDim.x) g[int64_t(e / bv) * dv + v0 + e % bv] = t[(e / bv) * ld + e % bv];
}
template <class R>
__device__ void tile_scale(R* t, int ld, int rows, int bv, R f) {
  for (int e = threadIdx.x; e < rows * bv; e += blockDim.x) t[(e / bv) * ld + e % bv] *= f;
}

// Bytes of a shared-memory layout L, built on a null base with its sizes and a byte counter.
template <class L, class... A>
size_t layout_bytes(A... sizes) {
  size_t b = 0;
  L(nullptr, sizes..., &b);
  return b;
}


}  // namespace hila::cuda
