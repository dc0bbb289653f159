// SPDX-License-Identifier: Apache-2.0
// The decode step's ring of state tiles in shared memory (see step.cu): the block's [dk, kCols]
// tiles of P (one per column chunk) and of H (per column chunk, every live slot) form one sequence
// of items; cp.async issues the first `stages` of them as soon as t is known, and item i + stages
// while item i is processed. And the lanes' column pairs (LaneCols) that the stages write.
#pragma once
#include "cuda/step/args.cuh"

namespace hila::cuda::decode {

// The block's state items in ring order: P's column chunks, then for each
// column chunk H's live slots in increasing level. Item i is the [dk, kCols] tile at column c0 of
// a matrix with row stride rs.
template <class R>
struct Items {
  const R* P;
  int Ps2;
  const R* H;
  int64_t Hsl;
  int Hs2;
  int64_t t;
  bool fenwick;
  int cbeg, cend, nP, nlive, total;
  // slot of the s-th live level: Fenwick: level l is live iff bit l - 1 of t is set; flat: slot 0
  __device__ int slot(int s) const {
    if (!fenwick) return 0;
    unsigned long long x = static_cast<unsigned long long>(t);
    for (int i = 0; i < s; ++i) x &= x - 1;
    return __ffsll(x);  // 1-based index of the lowest set bit = its level
  }
  __device__ const R* where(int i, int& rs, int& c0) const {
    if (i < nP) {
      rs = Ps2, c0 = cbeg + i * kCols;
      return P;
    }
    const int j = i - nP;
    rs = Hs2, c0 = cbeg + (j / nlive) * kCols;
    return H + slot(j % nlive) * Hsl;
  }
};

// cp.async of cnt contiguous elements (the caller commits): 16-byte vectors when aligned, else
// 4-byte words.
template <class R>
__device__ void copy_async(R* dst, const R* src, int cnt) {
  constexpr int kE = 16 / sizeof(R);
  if (reinterpret_cast<uintptr_t>(src) % 16 == 0 && cnt % kE == 0) {
    for (int e = threadIdx.x * kE; e < cnt; e += kThreads * kE) mma::cp_async16(dst + e, src + e, 16);
  } else {
    const int words = cnt * int(sizeof(R)) / 4;
    for (int w = threadIdx.x; w < words; w += kThreads)
      mma::cp_async4(reinterpret_cast<char*>(dst) + 4 * w, reinterpret_cast<const char*>(src) + 4 * w, 4);
  }
}

// cp.async of item i into ring stage i % stages as one commit group (an empty group past the last
// item, so that the group count stays i + stages). 16-byte vectors when the tile is whole and
// aligned, else 4-byte words with the columns past cend zero-filled.
template <class R>
__device__ void ring_issue(R* ring, int stages, int dk, const Items<R>& it, int i) {
  if (i < it.total) {
    int rs = 0, c0 = 0;
    const R* M = it.where(i, rs, c0);
    const int nc = min(kCols, it.cend - c0);
    R* dst = ring + (i % stages) * dk * kCols;
    constexpr int kE = 16 / sizeof(R), kV = kCols / kE;  // elements per vector, vectors per row
    if (nc == kCols && rs % kE == 0 && reinterpret_cast<uintptr_t>(M) % 16 == 0) {
      for (int e = threadIdx.x; e < dk * kV; e += kThreads) {
        const int r = e / kV, j = (e % kV) * kE;
        mma::cp_async16(dst + r * kCols + j, M + int64_t(r) * rs + c0 + j, 16);
      }
    } else {
      constexpr int kWords = kCols * int(sizeof(R)) / 4;
      const int nw = nc * int(sizeof(R)) / 4;
      for (int e = threadIdx.x; e < dk * kWords; e += kThreads) {
        const int r = e / kWords, w = e % kWords;
        const bool in = w < nw;
        const char* src = reinterpret_cast<const char*>(M + int64_t(r) * rs + c0) + 4 * w;
        mma::cp_async4(reinterpret_cast<char*>(dst + r * kCols) + 4 * w, in ? src : static_cast<const void*>(M),
                      in ? 4 : 0);
      }
    }
  }
  mma::cp_async_commit();
}

// cp.async.wait_group with a runtime count n in [0, kMaxStages]: at most n groups pending.
__device__ __forceinline__ void cp_async_wait_upto(int n) {
  static_assert(kMaxStages == 3, "one case per count");
  if (n >= 3) mma::cp_async_wait<3>();
  else if (n == 2) mma::cp_async_wait<2>();
  else if (n == 1) mma::cp_async_wait<1>();
  else mma::cp_async_wait<0>();
}

// Waits for item i (issued i + stages - 1 groups ago by every thread) and makes it visible to the
// block; returns its stage.
template <class R>
__device__ const R* ring_wait(const R* ring, int stages, int dk, int i) {
  cp_async_wait_upto(stages - 1);
  __syncthreads();
  return ring + (i % stages) * dk * kCols;
}
// Every thread is done with item i's stage: refill it with item i + stages.
template <class R>
__device__ void ring_release(R* ring, int stages, int dk, const Items<R>& it, int i) {
  __syncthreads();
  ring_issue(ring, stages, dk, it, i + stages);
}

// This lane's kVec columns c, c + 1 of the tile at c0 of a matrix with row stride rs, and how
// they are written: one vector when the whole tile is inside [.., cend) and aligned (uniform over
// the block), else one guarded scalar per column.
template <class R>
struct LaneCols {
  using V = std::conditional_t<std::is_same_v<R, double>, double2, float2>;
  static_assert(kVec == 2, "LaneCols stores pairs");
  int c, cend;
  bool vec;
  __device__ LaneCols(int c0, int cend_, const R* M, int rs)
      : c(c0 + kVec * (threadIdx.x & 31)), cend(cend_),
        vec(c0 + kCols <= cend_ && rs % kVec == 0 && reinterpret_cast<uintptr_t>(M) % sizeof(V) == 0) {}
  __device__ bool has(int i) const { return c + i < cend; }
  __device__ void store(R* p, R y0, R y1) const {
    if (vec) {
      *reinterpret_cast<V*>(p) = V{y0, y1};
    } else {
      if (c < cend) p[0] = y0;
      if (c + 1 < cend) p[1] = y1;
    }
  }
};

template <class R>
__device__ __forceinline__ void lds2(const R* p, R (&x)[kVec]) {
  const auto v = *reinterpret_cast<const typename LaneCols<R>::V*>(p);
  x[0] = v.x, x[1] = v.y;
}

}  // namespace hila::cuda::decode
