// SPDX-License-Identifier: Apache-2.0
// Decode step of every hila operator on the GPU: one fused kernel per step for all sequences and
// heads, states updated in place in the StateView layout (include/hila/ops.h), fp32 (fp64 for
// fp64 inputs). The CPU reference is cpu::op_step / cpu::prim_step.
//
// Per (sequence n, value head h, column tile) one block of kThreads threads runs the composition
// (HLA_SPEC §3.2 / §5.2 / §6.2, LOGLINEAR_SPEC §3.2, §6.3, §7), with q already scaled:
//   inner S (hla2, hla3):  S <- a_S S + k k^T          u = S q (+ ridge q)      [dk, dk] packed
//   inner P (ahla, hla3):  P <- a_P P + k v'^T         h = P^T q                [dk, dv']
//   outer, key = u or k, val = h or v', beta = 1 (mamba) or beta_t (delta):
//     every live slot l:   H_l <- a H_l                (mamba)
//                          H_l <- a (H_l - beta key (key^T H_l))   (delta: rank-1 erase, O(dk dv'))
//     o' = lam_0 beta (q.key) val + sum_live lam_l H_l^T q
//     merge (flat):        H_0 <- H_0 + beta key val^T
//     merge (Fenwick):     H_{r+1} <- sum_{l=1..r} H_l + beta key val^T, H_1..H_r <- 0,
//                          r = ctz(t+1): levels 1..r are the trailing ones of t (LOGLINEAR_SPEC §2.5)
//   normalize (HLA_SPEC §4): o = o'[:dv] / (o'[dv] + eps).
// The position t of each sequence is read from the state's pos on the device (sequences may be at
// different positions), so a step needs no host round trip.
//
// Grid: x = sequence * tiles + tile, y = head. Columns of P and H are independent in every update
// above, so blocks split dv' into tiles of kCols columns. Two things need more than a tile:
//  - u = S q needs all of S. Every tile reads S; a per-(n, h) counter elects the last block to
//    finish reading, which writes S back. Without counters (the functional step on a caller's
//    state, which has nowhere to keep them) S ops run one tile of all dv' columns per block.
//  - normalize divides by column dv of o': one tile of all dv' columns per block.
// pos advances once every block of a sequence is done: a per-sequence counter elects the last
// block, or (without counters) a second tiny kernel follows in stream order.
// Thread layout inside a column chunk: warp w = row group, lane = column, so each warp reads 32
// consecutive floats of one state row; rows r = w, w + kWarps, ... are held in registers
// (kRows = rows per thread >= dk / kWarps, a template parameter).
// State tiles stream through a ring in shared memory: the block's [dk, kCols] tiles of P (one per
// column chunk) and of H (per column chunk, every live slot) form one sequence of items; cp.async
// issues the first `stages` of them as soon as t is known, before the inputs are read and S is
// swept, and item i + stages while item i is processed. So the state loads, which are the bytes
// of a step, are in flight during the block's whole prologue and between its dependent phases.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "core/plan.h"
#include "cuda/prims/mma.cuh"
#include "cuda/runtime/runtime.cuh"
#include "cuda/prims/tile.cuh"
#include "cuda/step.h"
#include "hila/error.h"

namespace hila::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 2;       // consecutive columns per lane (one 8-byte fp32 / 16-byte fp64 access)
constexpr int kCols = 32 * kVec;  // columns per tile
constexpr int kMaxLevels = 64;
constexpr int kMaxDk = 512;   // kRows <= 64 registers per thread per array
constexpr int kMaxStages = 3;         // ring depth (state tiles in flight per block)
// Ring budget per block: one [128, 64] fp32 stage. More stages measured slower at dk = 128
// (fewer resident blocks per SM), except that every block takes at least one.
constexpr int kRingBytes = 32 * 1024;

// Kernel parameters (by value). Element offsets, strides in elements; innermost stride 1.
template <class T>
struct StepArgs {
  using R = Acc<T>;
  const T *q, *k, *v;          // [N, G, dk], [N, G, dk], [N, H, dv]
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;
  T* o;                        // [N, H, dv]
  int64_t os0, os1;
  Strided g{TensorView{}}, lam{TensorView{}}, beta{TensorView{}};  // [N,H(,P)], [N,H,L], [N,H]
  bool has_g;
  int gcol[3];                 // gate column of S, P, outer (all 0 with tied gates)
  R* S;                        // [N, H, dk(dk+1)/2] packed upper triangle
  int64_t Ss0, Ss1;
  R* P;                        // [N, H, dk, dv']
  int64_t Ps0, Ps1;
  int Ps2;                     // row stride inside one head's matrix (dk * stride < 2^31)
  R* Hs;                       // [N, H, dk, dv'] or [N, H, Ls, dk, dv']
  int64_t Hs0, Hs1, Hsl;       // Hsl: slot stride (0 for flat)
  int Hs2;                     // row stride (dk * stride < 2^31)
  int64_t* pos;                // [N]
  int64_t poss;
  unsigned* seq_count;         // [N] blocks done per sequence (null: a second kernel advances pos)
  unsigned* s_count;           // [N, H] blocks done reading S (tiles > 1 only)
  int N, H, rep, dk, dv, dvp, tiles, stages;
  bool s_smem;                 // S copied to shared memory (cp.async, first group) before its sweep
  bool has_S, has_P, fenwick, delta, normalize, l2;
  R scale, ridge, eps;
};

// Elements of a packed symmetric [dk, dk] matrix (upper triangle, row-major).
__host__ __device__ constexpr int sym_size(int dk) { return dk * (dk + 1) / 2; }

// Shared memory carve-up (in R elements), the same on host and device.
struct Smem {
  int ring, S, q, k, key, vin, hh, oraw, lam, red, colred, colpart, total;
  __host__ __device__ Smem(int dk, int dvp, bool has_S, int stages, bool s_smem) {
    int o = 0;
    ring = o, o += stages * dk * kCols;  // [stages][dk][kCols], first: 16-byte aligned
    S = o, o += s_smem ? (sym_size(dk) + 3) / 4 * 4 : 0;  // packed S, 16-byte aligned
    q = o, o += dk;
    k = o, o += dk;
    key = o, o += dk;
    vin = o, o += dvp;
    hh = o, o += dvp;
    oraw = o, o += dvp;
    lam = o, o += kMaxLevels;
    red = o, o += kWarps;
    colred = o, o += kWarps * kCols;
    colpart = o, o += has_S ? (kWarps * dk > kThreads ? kWarps * dk : kThreads) : 0;
    total = o;
  }
};

template <class R>
__device__ __forceinline__ R rexp(R x) {
  if constexpr (std::is_same_v<R, double>) return ::exp(x);
  else return ::expf(x);
}
template <class R>
__device__ __forceinline__ R rsqrt_eps(R s, R eps) {
  if constexpr (std::is_same_v<R, double>) return 1.0 / ::sqrt(s + eps);
  else return 1.0f / ::sqrtf(s + eps);
}

template <class R>
__device__ __forceinline__ R warp_sum(R x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Sum over the block; every thread gets the result. `red` is [kWarps] shared.
template <class R>
__device__ R block_sum(R x, R* red) {
  x = warp_sum(x);
  __syncthreads();  // earlier readers of red are done
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  R s = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[w];
  return s;
}

// Column sums over the kWarps row groups: each lane holds partials of its kVec columns
// (kVec lane + i of the tile); every warp gets the sums back in x. `colred` is [kWarps, kCols].
template <class R>
__device__ void column_sum(R (&x)[kVec], R* colred) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kVec; ++i) colred[warp * kCols + kVec * lane + i] = x[i];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    R s = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += colred[w * kCols + kVec * lane + i];
    x[i] = s;
  }
}

// Offset of row i of the packed upper triangle, shifted so that row[j] = S_ij for j >= i.
__device__ __forceinline__ int64_t sym_row(int i, int dk) {
  return int64_t(i) * dk - int64_t(i) * (i - 1) / 2 - i;
}

// One sweep over the packed S (row-major upper triangle) of x_ij = a S_ij + k_i k_j: `store`
// writes x back; `accumulate` adds u = x q in two parts: row i's sum_{j>=i} x_ij q_j (a warp sum,
// to s_row[i]) and, by symmetry, x_ij q_i for j > i to the lane's column accumulators
// colacc[m] (j = lane + 32 m), which the caller sums over warps. Warp w takes rows w, w + kWarps,
// ..., kB rows at a time with all their loads issued first.
template <class R, int kM>
__device__ void sym_sweep(R* S, int dk, R aS, const R* s_k, const R* s_q, bool accumulate, bool store,
                          R* s_row, R (&colacc)[kM]) {
  constexpr int kB = kM >= 8 ? 2 : 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  for (int i0 = warp; i0 < dk; i0 += kWarps * kB) {
    R x[kB][kM];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int i = i0 + kWarps * b;
      const R* row = S + sym_row(i, dk);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const int j = lane + 32 * m;
        x[b][m] = (i < dk && j >= i && j < dk) ? row[j] : R(0);
      }
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int i = i0 + kWarps * b;
      if (i >= dk) break;  // uniform over the warp
      R* row = S + sym_row(i, dk);
      const R ki = s_k[i], qi = s_q[i];
      R ra = 0;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const int j = lane + 32 * m;
        if (j >= i && j < dk) {
          const R y = aS * x[b][m] + ki * s_k[j];
          if (store) row[j] = y;
          ra += y * s_q[j];
          if (j > i) colacc[m] += y * qi;
        }
      }
      if (accumulate) {
        ra = warp_sum(ra);
        if (lane == 0) s_row[i] = ra;
      }
    }
  }
}

// S in shared memory (packed, as in the state): u = S q (before the update; the caller adds the
// rank-1 and ridge terms). Thread (i, part) sums S_ij q_j over its part of j, with S_ij read at
// packed[sym_row(min(i, j)) + max(i, j)]; the loop is the same length in every lane of a warp.
// s_part: [kThreads] partials; u: [dk].
template <class R>
__device__ void sym_matvec(const R* sS, int dk, const R* s_q, R* s_part, R* u) {
  const int nsplit = max(1, kThreads / dk);
  const int t = threadIdx.x;
  if (t < nsplit * dk) {
    const int i = t % dk, part = t / dk;
    const int j0 = part * dk / nsplit, j1 = (part + 1) * dk / nsplit;
    const int ro = int(sym_row(i, dk));      // row i: S_ij = sS[ro + j], j >= i
    int co = int(sym_row(j0, dk)) + i;       // column i: S_ji = sS[sym_row(j) + i], j < i
    R acc = 0;
    for (int j = j0; j < j1; ++j) {
      acc += sS[j < i ? co : ro + j] * s_q[j];
      co += dk - j - 1;  // sym_row(j + 1) - sym_row(j)
    }
    s_part[t] = acc;
  }
  __syncthreads();
  for (int i = t; i < dk; i += kThreads) {
    R x = 0;
    for (int p = 0; p < nsplit; ++p) x += s_part[p * dk + i];
    u[i] = x;
  }
}

// S <- a S + k k^T from the copy in shared memory to the state, a warp per row, lanes along it.
template <class R>
__device__ void sym_update(const R* sS, R* S, int dk, R aS, const R* s_k) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  for (int i = warp; i < dk; i += kWarps) {
    const int64_t o = sym_row(i, dk);
    const R ki = s_k[i];
    for (int j = i + lane; j < dk; j += 32) S[o + j] = aS * sS[o + j] + ki * s_k[j];
  }
}

// The block's state items in ring order (see the file comment): P's column chunks, then for each
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
    for (int e = threadIdx.x * kE; e < cnt; e += kThreads * kE) tc::cp_async16(dst + e, src + e, 16);
  } else {
    const int words = cnt * int(sizeof(R)) / 4;
    for (int w = threadIdx.x; w < words; w += kThreads)
      tc::cp_async4(reinterpret_cast<char*>(dst) + 4 * w, reinterpret_cast<const char*>(src) + 4 * w, 4);
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
        tc::cp_async16(dst + r * kCols + j, M + int64_t(r) * rs + c0 + j, 16);
      }
    } else {
      constexpr int kWords = kCols * int(sizeof(R)) / 4;
      const int nw = nc * int(sizeof(R)) / 4;
      for (int e = threadIdx.x; e < dk * kWords; e += kThreads) {
        const int r = e / kWords, w = e % kWords;
        const bool in = w < nw;
        const char* src = reinterpret_cast<const char*>(M + int64_t(r) * rs + c0) + 4 * w;
        tc::cp_async4(reinterpret_cast<char*>(dst + r * kCols) + 4 * w, in ? src : static_cast<const void*>(M),
                      in ? 4 : 0);
      }
    }
  }
  tc::cp_async_commit();
}

// cp.async.wait_group with a runtime count n in [0, kMaxStages]: at most n groups pending.
__device__ __forceinline__ void cp_async_wait_upto(int n) {
  static_assert(kMaxStages == 3, "one case per count");
  if (n >= 3) tc::cp_async_wait<3>();
  else if (n == 2) tc::cp_async_wait<2>();
  else if (n == 1) tc::cp_async_wait<1>();
  else tc::cp_async_wait<0>();
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

// Resident blocks per SM the register budget is sized for: the step is memory bound, so more
// blocks (and their ring stages) in flight beat the few spills this may cost.
// Flat states hold no merged tile in registers (kFenwick = false), so they fit one more block.
template <class T, int kRows, bool kFenwick>
constexpr int kMinBlocks = std::is_same_v<T, double> ? (kRows <= 8 ? 4 : kRows <= 16 ? 2 : 1)
                                                     : (kRows <= 16 ? (kFenwick ? 4 : 5) : kRows <= 32 ? 2 : 1);

template <class T, int kRows, bool kFenwick>
__global__ void __launch_bounds__(kThreads, (kMinBlocks<T, kRows, kFenwick>)) step_kernel(const StepArgs<T> a) {
  using R = Acc<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  R* sm = reinterpret_cast<R*>(smem_raw);
  const Smem L(a.dk, a.dvp, a.has_S, a.stages, a.s_smem);
  R *s_ring = sm + L.ring, *s_S = sm + L.S, *s_q = sm + L.q, *s_k = sm + L.k, *s_key = sm + L.key, *s_vin = sm + L.vin,
    *s_hh = sm + L.hh, *s_oraw = sm + L.oraw, *s_lam = sm + L.lam, *s_red = sm + L.red,
    *s_colred = sm + L.colred, *s_colpart = sm + L.colpart;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const int n = blockIdx.x / a.tiles, tile = blockIdx.x % a.tiles, h = blockIdx.y;
  const int grp = h / a.rep, dk = a.dk, dvp = a.dvp;
  // this block's columns of P, H and o'
  const int cbeg = a.tiles == 1 ? 0 : tile * kCols;
  const int cend = a.tiles == 1 ? dvp : min(dvp, cbeg + kCols);
  const int64_t t = a.pos[n * a.poss];
  const int nlev = kFenwick ? 64 - __clzll(t) : 0;  // live levels are <= bitlen(t)

  // ---- the state tiles start streaming in (ring, see the file comment)
  R* Hh = a.Hs + n * a.Hs0 + h * a.Hs1;
  R* P = a.has_P ? a.P + n * a.Ps0 + h * a.Ps1 : nullptr;
  Items<R> items{};
  items.P = P, items.Ps2 = a.Ps2, items.H = Hh, items.Hsl = a.Hsl, items.Hs2 = a.Hs2, items.t = t;
  items.fenwick = kFenwick, items.cbeg = cbeg, items.cend = cend;
  const int nchunk = (cend - cbeg + kCols - 1) / kCols;
  items.nP = a.has_P ? nchunk : 0;
  items.nlive = kFenwick ? __popcll(static_cast<unsigned long long>(t)) : 1;
  items.total = items.nP + nchunk * items.nlive;
  if (a.s_smem) {  // S first: it is needed first
    copy_async(s_S, a.S + n * a.Ss0 + h * a.Ss1, sym_size(dk));
    tc::cp_async_commit();
  }
  for (int i = 0; i < a.stages; ++i) ring_issue(s_ring, a.stages, dk, items, i);
  int item = 0;  // next item to take

  // ---- inputs: q (scaled), k (l2-normalised for qk_l2norm), v' = [v | 1], gates, lam
  for (int c = tid; c < dk; c += kThreads) {
    s_q[c] = from<R>(a.q[n * a.qs0 + grp * a.qs1 + c]);
    s_k[c] = from<R>(a.k[n * a.ks0 + grp * a.ks1 + c]);
  }
  for (int c = tid; c < dvp; c += kThreads) s_vin[c] = c < a.dv ? from<R>(a.v[n * a.vs0 + h * a.vs1 + c]) : R(1);
  for (int l = tid; l <= nlev; l += kThreads)
    s_lam[l] = kFenwick ? ld<R>(a.lam, n * a.lam.s[0] + h * a.lam.s[1] + l * a.lam.s[2]) : R(1);
  __syncthreads();
  R qs = a.scale, ks = 1;
  if (a.l2) {  // LOGLINEAR_SPEC §6.1: x / sqrt(|x|^2 + 1e-6)
    R sq = 0, sk = 0;
    for (int c = tid; c < dk; c += kThreads) sq += s_q[c] * s_q[c], sk += s_k[c] * s_k[c];
    sq = block_sum(sq, s_red);
    sk = block_sum(sk, s_red);
    qs *= rsqrt_eps(sq, R(1e-6));
    ks = rsqrt_eps(sk, R(1e-6));
  }
  __syncthreads();
  for (int c = tid; c < dk; c += kThreads) s_q[c] *= qs, s_k[c] *= ks;
  __syncthreads();
  auto gate = [&](int prim) -> R {
    if (!a.has_g) return R(1);
    return rexp(ld<R>(a.g, n * a.g.s[0] + h * a.g.s[1] + a.gcol[prim] * a.g.s[2]));
  };
  const R beta = a.delta ? ld<R>(a.beta, n * a.beta.s[0] + h * a.beta.s[1]) : R(1);

  // ---- inner S (packed symmetric): S <- a S + k k^T, u = S q + ridge q.
  if (a.has_S) {
    const R aS = gate(0);
    R* S = a.S + n * a.Ss0 + h * a.Ss1;
    constexpr int kM = kRows * kWarps / 32;  // >= dk / 32
    R colacc[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) colacc[m] = 0;
    // With several column tiles every block of (n, h) needs all of S: each reads it, and the last
    // block to finish reading (a counter per (n, h)) writes the update.
    const bool shared_S = a.tiles > 1;
    if (a.s_smem) {
      // u = aS (S q) + k (k.q) + ridge q from the copy (the oldest cp.async group: at most the
      // `stages` ring groups are still pending); the update is written from the same copy.
      cp_async_wait_upto(a.stages);
      __syncthreads();
      R kq = 0;
      for (int c = tid; c < dk; c += kThreads) kq += s_k[c] * s_q[c];
      kq = block_sum(kq, s_red);
      sym_matvec(s_S, dk, s_q, s_colpart, s_key);
      __syncthreads();
      for (int j = tid; j < dk; j += kThreads) s_key[j] = aS * s_key[j] + kq * s_k[j] + a.ridge * s_q[j];
    } else {
      sym_sweep<R, kM>(S, dk, aS, s_k, s_q, true, !shared_S, s_key, colacc);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const int j = lane + 32 * m;
        if (j < dk) s_colpart[warp * dk + j] = colacc[m];
      }
      __syncthreads();
      for (int j = tid; j < dk; j += kThreads) {
        R u = s_key[j];
        for (int w = 0; w < kWarps; ++w) u += s_colpart[w * dk + j];
        s_key[j] = u + a.ridge * s_q[j];
      }
    }
    bool last = true;  // this block writes the update
    if (shared_S) {
      __shared__ int s_last;
      if (tid == 0) {
        unsigned* cnt = a.s_count + int64_t(n) * a.H + h;
        __threadfence();
        s_last = atomicAdd(cnt, 1u) == unsigned(a.tiles - 1);
        if (s_last) *cnt = 0;  // ready for the next step (stream order)
      }
      __syncthreads();
      last = s_last;
    }
    if (last && a.s_smem) sym_update(s_S, S, dk, aS, s_k);
    else if (last && shared_S) sym_sweep<R, kM>(S, dk, aS, s_k, s_q, false, true, s_key, colacc);
  } else {
    for (int c = tid; c < dk; c += kThreads) s_key[c] = s_k[c];
  }
  __syncthreads();

  // Tile loops: this thread's rows are r = warp + kWarps j (the bound is uniform over the warp),
  // its columns LaneCols; sx / gx step through the stage and the global matrix row by row.
  const int srow = kWarps * kCols;  // stage elements between a thread's consecutive rows

  // ---- inner P: P <- a P + k v'^T, h = P^T q (this block's columns)
  if (a.has_P) {
    const R aP = gate(1);
    for (int c0 = cbeg; c0 < cend; c0 += kCols) {
      const LaneCols<R> lc(c0, cend, P, a.Ps2);
      const R* sx = ring_wait(s_ring, a.stages, dk, item) + warp * kCols + kVec * (tid & 31);
      R* gx = P + int64_t(warp) * a.Ps2 + lc.c;
      const R v0 = lc.has(0) ? s_vin[lc.c] : R(0), v1 = lc.has(1) ? s_vin[lc.c + 1] : R(0);
      R part[kVec] = {};
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int r = warp + kWarps * j;
        if (r >= dk) break;
        R x[kVec];
        lds2(sx + j * srow, x);
        const R kr = s_k[r], qr = s_q[r];
        const R y0 = aP * x[0] + kr * v0, y1 = aP * x[1] + kr * v1;
        lc.store(gx, y0, y1);
        gx += kWarps * a.Ps2;
        part[0] += qr * y0, part[1] += qr * y1;
      }
      ring_release(s_ring, a.stages, dk, items, item++);
      column_sum(part, s_colred);
      if (warp == 0) {
#pragma unroll
        for (int i = 0; i < kVec; ++i)
          if (lc.has(i)) s_hh[lc.c + i] = part[i];
      }
    }
    __syncthreads();
  }
  const R* s_val = a.has_P ? s_hh : s_vin;

  // ---- outer primitive (flat or Fenwick; mamba or delta)
  const R aO = gate(2);
  R qkey = 0;
  for (int c = tid; c < dk; c += kThreads) qkey += s_q[c] * s_key[c];
  qkey = block_sum(qkey, s_red);
  const R diag = s_lam[0] * beta * qkey;  // lam_0 beta (q . key)
  const int rr = kFenwick ? __ffsll(static_cast<unsigned long long>(t + 1)) - 1 : 0;  // ctz(t+1)
  const int target = kFenwick ? rr + 1 : 0;
  for (int c0 = cbeg; c0 < cend; c0 += kCols) {
    // Fenwick: the merged levels' sum, which goes to the target slot with the token
    R merged[kFenwick ? kRows : 1][kVec];
#pragma unroll
    for (int j = 0; j < (kFenwick ? kRows : 1); ++j) merged[j][0] = merged[j][1] = 0;
    R opart[kVec] = {};
    R* Ht = Hh + target * a.Hsl;
    const LaneCols<R> lc(c0, cend, Ht, a.Hs2);
    // + beta key val^T into the target (flat: slot 0 itself, in the slot loop)
    const R bv0 = lc.has(0) ? beta * s_val[lc.c] : R(0), bv1 = lc.has(1) ? beta * s_val[lc.c + 1] : R(0);
    for (int s = 0; s < items.nlive; ++s) {  // live slots in increasing level; dead ones are never read
      const int l = items.slot(s);
      R* Hl = Hh + l * a.Hsl;
      const LaneCols<R> ls(c0, cend, Hl, a.Hs2);
      const R* sx = ring_wait(s_ring, a.stages, dk, item) + warp * kCols + kVec * (tid & 31);
      R kh[kVec] = {};
      if (a.delta) {  // kh = key^T H_l (this lane's columns), then H_l <- a (H_l - beta key kh)
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          const int r = warp + kWarps * j;
          if (r >= dk) break;
          R x[kVec];
          lds2(sx + j * srow, x);
          kh[0] += s_key[r] * x[0], kh[1] += s_key[r] * x[1];
        }
        column_sum(kh, s_colred);
        kh[0] *= beta, kh[1] *= beta;
      }
      const R lw = s_lam[l];
      const bool merge = l <= rr;  // Fenwick: level l is summed into the target and cleared
      R* gx = Hl + int64_t(warp) * a.Hs2 + ls.c;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int r = warp + kWarps * j;
        if (r >= dk) break;
        R x[kVec];
        lds2(sx + j * srow, x);
        const R kr = s_key[r], lq = lw * s_q[r];
        const R y0 = aO * (x[0] - kr * kh[0]), y1 = aO * (x[1] - kr * kh[1]);
        opart[0] += lq * y0, opart[1] += lq * y1;
        if constexpr (kFenwick) {
          if (merge) merged[j][0] += y0, merged[j][1] += y1;
          ls.store(gx, merge ? R(0) : y0, merge ? R(0) : y1);
        } else {
          ls.store(gx, y0 + kr * bv0, y1 + kr * bv1);
        }
        gx += kWarps * a.Hs2;
      }
      ring_release(s_ring, a.stages, dk, items, item++);
    }
    if constexpr (kFenwick) {
      R* gx = Ht + int64_t(warp) * a.Hs2 + lc.c;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int r = warp + kWarps * j;
        if (r >= dk) break;
        const R kr = s_key[r];
        lc.store(gx, merged[j][0] + kr * bv0, merged[j][1] + kr * bv1);
        gx += kWarps * a.Hs2;
      }
    }
    column_sum(opart, s_colred);
    if (warp == 0) {
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        if (lc.has(i)) s_oraw[lc.c + i] = opart[i] + diag * s_val[lc.c + i];
    }
  }
  __syncthreads();

  // ---- output in v's dtype (normalize: the denominator column dv is in this block, tiles == 1)
  T* o = a.o + n * a.os0 + h * a.os1;
  const int oend = min(cend, a.dv);
  if (a.normalize) {
    const R den = s_oraw[a.dv] + a.eps;
    for (int c = cbeg + tid; c < oend; c += kThreads) o[c] = to<T>(s_oraw[c] / den);
  } else {
    for (int c = cbeg + tid; c < oend; c += kThreads) o[c] = to<T>(s_oraw[c]);
  }
  // the last block of sequence n (every thread of every block has read t by now) advances pos
  if (a.seq_count && tid == 0) {
    unsigned* cnt = a.seq_count + n;
    if (atomicAdd(cnt, 1u) == unsigned(a.H * a.tiles - 1)) {
      *cnt = 0;
      a.pos[n * a.poss] = t + 1;
    }
  }
}

// After every head of every sequence has stepped: pos <- pos + 1.
__global__ void advance_positions(int64_t* pos, int64_t stride, int N) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) pos[i * stride] += 1;
}

// The runtime -> template switch: rows per thread for the head dim.
template <class T>
void launch_step(const StepArgs<T>& a, dim3 grid, size_t smem, cudaStream_t s) {
  auto go = [&](auto kernel) {
    if (smem > 48 * 1024) set_smem(kernel, smem);
    kernel<<<grid, kThreads, smem, s>>>(a);
    HILA_CUDA_CHECK_LAUNCH();
  };
  const int rows = (a.dk + kWarps - 1) / kWarps;
  auto pick = [&](auto fenwick) {
    constexpr bool F = decltype(fenwick)::value;
    if (rows <= 4) go(step_kernel<T, 4, F>);
    else if (rows <= 8) go(step_kernel<T, 8, F>);
    else if (rows <= 16) go(step_kernel<T, 16, F>);
    else if (rows <= 32) go(step_kernel<T, 32, F>);
    else go(step_kernel<T, 64, F>);
  };
  if (a.fenwick) pick(std::true_type{});
  else pick(std::false_type{});
}

// SM count and opt-in shared memory per block of the current device, queried once per device
// (a step is on the decode hot path).
struct DeviceLimits {
  int sms;
  size_t optin;
};
DeviceLimits device_limits() {
  int dev = 0;
  HILA_CUDA_CHECK(cudaGetDevice(&dev));
  static std::mutex mu;
  static std::map<int, DeviceLimits> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it != cache.end()) return it->second;
  DeviceLimits lim{0, smem_optin()};
  HILA_CUDA_CHECK(cudaDeviceGetAttribute(&lim.sms, cudaDevAttrMultiProcessorCount, dev));
  return cache.emplace(dev, lim).first->second;
}

template <class T>
void step_impl(const detail::Resolved& r, const StepParams& p, const StateView& sv, void* counters,
               cudaStream_t s) {
  using R = Acc<T>;
  const detail::OpPlan plan = detail::OpPlan::make(r.cfg);
  StepArgs<T> a{};
  a.q = static_cast<const T*>(p.q.data), a.k = static_cast<const T*>(p.k.data), a.v = static_cast<const T*>(p.v.data);
  a.qs0 = p.q.stride[0], a.qs1 = p.q.stride[1], a.ks0 = p.k.stride[0], a.ks1 = p.k.stride[1];
  a.vs0 = p.v.stride[0], a.vs1 = p.v.stride[1];
  a.o = static_cast<T*>(p.o.data), a.os0 = p.o.stride[0], a.os1 = p.o.stride[1];
  a.g = Strided(p.g), a.lam = Strided(p.lam), a.beta = Strided(p.beta);
  a.has_g = r.gate_cols > 0;
  a.gcol[0] = r.gate_cols > 1 ? plan.gS : 0;
  a.gcol[1] = r.gate_cols > 1 ? plan.gP : 0;
  a.gcol[2] = r.gate_cols > 1 ? plan.gO : 0;
  if (plan.has_S) a.S = static_cast<R*>(sv.S.data), a.Ss0 = sv.S.stride[0], a.Ss1 = sv.S.stride[1];
  if (plan.has_P)
    a.P = static_cast<R*>(sv.P.data), a.Ps0 = sv.P.stride[0], a.Ps1 = sv.P.stride[1], a.Ps2 = int(sv.P.stride[2]);
  a.Hs = static_cast<R*>(sv.H.data), a.Hs0 = sv.H.stride[0], a.Hs1 = sv.H.stride[1];
  const int64_t hrow = plan.fenwick ? sv.H.stride[3] : sv.H.stride[2];
  a.Hsl = plan.fenwick ? sv.H.stride[2] : 0;
  a.Hs2 = int(hrow);
  for (const auto& [name, stride] : {std::pair<const char*, int64_t>{"state.H", hrow},
                                     {"state.P", plan.has_P ? sv.P.stride[2] : 0}})
    if (stride * r.dk >= (int64_t(1) << 31))
      throw Error(name, "expected a row stride below 2^31 / dk for the CUDA decode step, got " +
                            std::to_string(stride));
  a.pos = static_cast<int64_t*>(sv.pos.data), a.poss = sv.pos.stride[0];
  a.N = int(r.B), a.H = int(r.H), a.rep = int(r.H / r.G), a.dk = int(r.dk), a.dv = int(r.dv), a.dvp = int(r.dvp);
  a.has_S = plan.has_S, a.has_P = plan.has_P, a.fenwick = plan.fenwick, a.delta = plan.delta;
  a.normalize = plan.normalize, a.l2 = r.cfg.qk_l2norm;
  a.scale = R(r.scale), a.ridge = R(plan.ridge), a.eps = R(plan.eps);
  // Column tiles: all of dv' in one block for normalize (the denominator column) and for S
  // without the counters a DecodeState owns (see the kernel), or when there are enough
  // (sequence, head) blocks to fill the device (then each S is read once, not once per tile);
  // else kCols columns per block.
  const DeviceLimits lim = device_limits();
  const bool one_tile = plan.normalize || (plan.has_S && (counters == nullptr || int64_t(a.N) * a.H >= 4 * int64_t(lim.sms)));
  a.tiles = one_tile ? 1 : (a.dvp + kCols - 1) / kCols;
  if (counters) {
    a.seq_count = static_cast<unsigned*>(counters);
    a.s_count = a.seq_count + a.N;
  }
  // S in shared memory when it is small: one copy, then u = S q and the update from it (else the
  // register sweep over global S). Ring depth: no more stages than the block has items (flat ops without P: one per
  // column chunk), within kRingBytes (at least one stage), and within the device's shared memory.
  a.s_smem = plan.has_S && a.dk <= kThreads && size_t(sym_size(a.dk)) * sizeof(R) <= 40 * 1024;
  const int nchunk = a.tiles == 1 ? (a.dvp + kCols - 1) / kCols : 1;
  const int64_t max_items = (plan.has_P ? nchunk : 0) + int64_t(nchunk) * (plan.fenwick ? kMaxStages : 1);
  const int item_bytes = a.dk * kCols * int(sizeof(R));
  a.stages = int(std::max<int64_t>(1, std::min<int64_t>({kMaxStages, max_items, kRingBytes / item_bytes})));
  const size_t optin = lim.optin;
  auto smem_of = [&](int stages) {
    return size_t(Smem(a.dk, a.dvp, a.has_S, stages, a.s_smem).total) * sizeof(R);
  };
  while (a.stages > 1 && smem_of(a.stages) > optin) --a.stages;
  const size_t smem = smem_of(a.stages);
  if (smem > optin)
    throw Error("q", "expected a head dim whose decode step fits this device's shared memory (" +
                         std::to_string(optin) + " bytes per block), got dk = " + std::to_string(r.dk) +
                         ", which needs " + std::to_string(smem));
  if (r.B > 0) {
    launch_step<T>(a, dim3(unsigned(int64_t(a.N) * a.tiles), unsigned(a.H)), smem, s);
    if (!counters) {
      advance_positions<<<unsigned((a.N + 255) / 256), 256, 0, s>>>(a.pos, a.poss, a.N);
      HILA_CUDA_CHECK_LAUNCH();
    }
  }
}

template <class T>
struct Step {
  static void run(const detail::Resolved& r, const StepParams& p, const StateView& sv, void* counters,
                  cudaStream_t s) {
    step_impl<T>(r, p, sv, counters, s);
  }
};

struct Shape5 {
  int64_t d[5];
};

// ---- state copies for DecodeState: dst (contiguous, R) <- src (strided, any float dtype), with
// zero fill where dst is larger (more Fenwick slots) ----------------------------------------------
template <class R>
__global__ void copy_part(R* dst, int nd, Shape5 dshape, Strided src, Shape5 sshape, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = e, off = 0;
    bool inside = true;
    for (int i = nd - 1; i >= 0; --i) {
      const int64_t idx = rest % dshape.d[i];
      rest /= dshape.d[i];
      inside = inside && idx < sshape.d[i];
      off += idx * src.s[i];
    }
    dst[e] = inside ? ld<R>(src, off) : R(0);
  }
}

}  // namespace

}  // namespace hila::cuda

namespace hila::detail {

void cuda_copy_state_part(const TensorView& dst, const TensorView& src, void* stream) {
  using namespace hila::cuda;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  DeviceScope scope(dst.device.index);
  if (dst.ndim > 5 || src.ndim != dst.ndim)
    throw Error("state", "expected state parts of at most 5 matching dimensions, got " + src.shape_str() +
                             " -> " + dst.shape_str());
  Shape5 ds{}, ss{};
  for (int i = 0; i < 5; ++i) ds.d[i] = ss.d[i] = 1;
  for (int i = 0; i < dst.ndim; ++i) ds.d[i] = dst.shape[i], ss.d[i] = src.shape[i];
  const int64_t n = dst.numel();
  if (n == 0) return;
  if (dst.dtype == DType::f64) HILA_LAUNCH(copy_part<double>, n, s, static_cast<double*>(dst.data), dst.ndim, ds, Strided(src), ss, n);
  else HILA_LAUNCH(copy_part<float>, n, s, static_cast<float*>(dst.data), dst.ndim, ds, Strided(src), ss, n);
}

void* cuda_alloc_zeroed(size_t bytes, int device) {
  if (bytes == 0) return nullptr;
  cuda::DeviceScope scope(device);
  void* p = nullptr;
  HILA_CUDA_CHECK(cudaMalloc(&p, bytes));
  HILA_CUDA_CHECK(cudaMemset(p, 0, bytes));
  return p;
}

void cuda_free(void* p, int device) noexcept {
  if (!p) return;
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device);
  cudaFree(p);
  cudaSetDevice(prev);
}

void cuda_upload(void* dst, const void* src, size_t bytes, int device) {
  if (bytes == 0) return;
  cuda::DeviceScope scope(device);
  HILA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void cuda_device_synchronize(int device) {
  cuda::DeviceScope scope(device);
  HILA_CUDA_CHECK(cudaDeviceSynchronize());
}

void cuda_synchronize(void* stream, int device) {
  cuda::DeviceScope scope(device);
  HILA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

size_t cuda_step_counter_bytes(int64_t N, int64_t H) { return size_t(N + N * H) * sizeof(unsigned); }

void cuda_step(const Resolved& r, const StepParams& p, const StateView& state, void* counters) {
  cuda::DeviceScope scope(p.q.device.index);
  if (r.dk > cuda::kMaxDk)
    throw Error("q", "expected head dim dk <= " + std::to_string(cuda::kMaxDk) +
                         " for a decode step on a CUDA device, got " + std::to_string(r.dk));
  const cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  switch (p.q.dtype) {
    case DType::bf16: cuda::Step<__nv_bfloat16>::run(r, p, state, counters, s); break;
    case DType::f16: cuda::Step<__half>::run(r, p, state, counters, s); break;
    case DType::f32: cuda::Step<float>::run(r, p, state, counters, s); break;
    case DType::f64: cuda::Step<double>::run(r, p, state, counters, s); break;
    default: throw Error("q", std::string("expected a floating dtype, got ") + dtype_name(p.q.dtype));
  }
}

}  // namespace hila::detail
