// SPDX-License-Identifier: Apache-2.0
// Device helpers shared by the chunked kernels of every primitive: shared-memory carving, 16-byte
// row loads/stores of packed head-major buffers, the chunk-local gate cumsum and fp32 state tiles.
// Packed buffers are [heads][Ttot][ld] with ld a multiple of 16 elements; a chunk is kChunk rows.
#pragma once
#include <cmath>

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

// ---- Gates and resets (docs/OPERATORS.md "Resets", docs/math/HLA.md §8.3) ----------------------------
// A reset row: exp(g) == 0 in the compute precision R (g = -inf, or below the underflow point:
// about -103.97 in float32, -745.13 in float64). It multiplies the state before the row by 0.
template <class R>
__host__ __device__ __forceinline__ bool is_reset_gate(R g) {
#ifdef __CUDA_ARCH__
  return !(exp(g) > R(0));
#else
  return !(std::exp(g) > R(0));
#endif
}
// The chunk-local cumsum of the kernels is segmented at the resets: row i holds
//   b_i = sum of g_r over the rows r <= i after the last reset row <= i (all rows r <= i without one),
// so that every decay inside a chunk is a difference of two sums over the same segment and no sum
// ever holds a reset gate. A reset row holds its empty sum as -0.0, the marker from which the kernels
// rebuild the chunk's reset rows (chunk_resets); every other row holds +0.0 for a zero sum.
template <class R>
__host__ __device__ __forceinline__ bool is_reset_mark(R b) {
#ifdef __CUDA_ARCH__
  return b == R(0) && signbit(b);
#else
  return b == R(0) && std::signbit(b);
#endif
}

// Inclusive prefix sums of a 64-element chunk held two per lane by one warp (lane l holds elements
// 2l and 2l+1), restarting after the elements with r0 / r1 set (a reset row: its own value is the
// marker -0.0 and the rows after it sum from 0). Returns them in x0, x1.
template <class R>
__device__ __forceinline__ void warp_pair_cumsum(R& x0, R& x1, bool r0 = false, bool r1 = false) {
  const int lane = threadIdx.x & 31;
  // the pair's segmented sum (value, whether a reset lies in it): (f, v) then (f', v') gives (f | f', f' ? v' : v + v')
  bool f = r0 || r1;
  R v = r1 ? R(0) : (r0 ? R(0) : x0) + x1;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const R y = __shfl_up_sync(0xffffffffu, v, off);
    const bool fy = __shfl_up_sync(0xffffffffu, int(f), off) != 0;
    if (lane >= off) {
      if (!f) v += y;
      f = f || fy;
    }
  }
  R before = __shfl_up_sync(0xffffffffu, v, 1);  // the sum up to the previous pair (segmented)
  if (lane == 0) before = R(0);
  x0 = r0 ? -R(0) : (before + x0) + R(0);  // + 0: a zero sum is +0.0, never the marker
  x1 = r1 ? -R(0) : ((r0 ? R(0) : x0) + x1) + R(0);
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

// Chunk-local segmented cumsum of the gates (above): b[i] for i < nr (b[i] = b[nr-1] beyond, a marker
// included), summed in B (the portable kernels: double, so that a decay exp(b_i - b_j) rounds once,
// in its exponent, instead of carrying the rounding of two sums of magnitude |b|); the resets are
// those of the gates' own type R. One warp, two gates per lane; ends with a barrier.
template <class B, class R>
__device__ void chunk_cumsum(B* b, const R* g, int64_t r0, int nr) {
  if (threadIdx.x < 32) {
    const int i0 = 2 * threadIdx.x, i1 = i0 + 1;
    const R y0 = (g && i0 < nr) ? g[r0 + i0] : R(0), y1 = (g && i1 < nr) ? g[r0 + i1] : R(0);
    B x0 = B(y0), x1 = B(y1);
    warp_pair_cumsum(x0, x1, i0 < nr && is_reset_gate(y0), i1 < nr && is_reset_gate(y1));
    b[i0] = x0;
    b[i1] = x1;
  }
  __syncthreads();
}

// The reset rows of a chunk, bit i for row i, rebuilt from its segmented cumsum (marked rows < nr).
// With them every decay of the chunk is exact under resets:
//   Gamma_ij = exp(b_i - b_j) for last(i) <= j <= i, 0 for j < last(i)   (a reset in (j, i])
//   e^{b_i}  (the incoming state read at row i)  = 0 where upto(i), else exp(b_i)
//   e^{B-b_j} (row j's write into the outgoing state) = 0 where after(j), else exp(B - b_j)
//   e^B      (the state carried across the chunk) = 0 where any(), else exp(B)
// with B = b[nr-1]; the gradient of a reset gate is 0.
struct Resets {
  uint64_t m = 0;
  __host__ __device__ __forceinline__ bool any() const { return m != 0; }
  __host__ __device__ __forceinline__ bool at(int i) const { return (m >> i) & 1u; }
  __host__ __device__ __forceinline__ bool upto(int i) const { return (m << (63 - i)) != 0; }  // a reset row <= i
  __host__ __device__ __forceinline__ bool after(int j) const { return (m >> j) > 1u; }        // a reset row > j
  // the last reset row <= i, -1 without one
  __host__ __device__ __forceinline__ int last(int i) const {
    const uint64_t x = m << (63 - i);
    return x ? i - clz64(x) : -1;
  }
  __host__ __device__ static __forceinline__ int clz64(uint64_t x) {
#ifdef __CUDA_ARCH__
    return __clzll(static_cast<long long>(x));
#else
    return __builtin_clzll(x);
#endif
  }
};

// The reset rows of a chunk from its segmented cumsum bs[0 .. nr) (shared memory), in every lane
// of the calling warps (two ballots); every lane of a calling warp must take part.
template <class R>
__device__ __forceinline__ Resets chunk_resets(const R* bs, int nr) {
  const int l = threadIdx.x & 31;
  const unsigned lo = __ballot_sync(0xffffffffu, l < nr && is_reset_mark(bs[l]));
  const unsigned hi = __ballot_sync(0xffffffffu, l + 32 < nr && is_reset_mark(bs[l + 32]));
  return Resets{uint64_t(hi) << 32 | lo};
}

// The total log-gate of a chunk from its segmented cumsum b[0 .. nr) (global or shared memory):
// b[nr-1], or -inf when a row is a reset (the decay across the chunk is exactly 0). One thread.
template <class R>
__device__ __forceinline__ R chunk_total(const R* b, int nr) {
  for (int i = 0; i < nr; ++i)
    if (is_reset_mark(b[i])) return -INFINITY;
  return nr > 0 ? b[nr - 1] : R(0);
}

// The gate gradient of one chunk's rows (docs/math/HLA.md §7.1, "gate gradient per chunk"):
//   dg_i = D + sum_{i <= r < nr} dc_r,   0 at a reset row,
// with dc the per-row q^.dq^ - k.dk (lane l holds rows 2l, 2l+1 in x0, x1; 0 from row nr on) and
// D = <dH, H_end>, the cotangent and the state at the chunk's end; into out[0 .. nr). One warp,
// every lane.
template <class R>
__device__ __forceinline__ void chunk_dg(R* out, R x0, R x1, R D, int nr, const Resets& rs) {
  const int i0 = 2 * (threadIdx.x & 31), i1 = i0 + 1;
  warp_pair_suffix_sum(x0, x1);
  if (i0 < nr) out[i0] = rs.at(i0) ? R(0) : x0 + D;
  if (i1 < nr) out[i1] = rs.at(i1) ? R(0) : x1 + D;
}

// Sum over the lanes of a warp (every lane gets it).
template <class R>
__device__ __forceinline__ R warp_sum(R x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
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
