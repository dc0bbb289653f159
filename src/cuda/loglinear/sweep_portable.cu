// SPDX-License-Identifier: Apache-2.0
// The log-linear primitive's segment sweep, portable tier (every dtype; shared-memory tile GEMMs,
// WMMA for bf16 / fp16): the segment tables and the kernels of the forward and backward sweeps and
// of the chunk-parallel outputs and gradients. loglinear.cuh has the math, the layouts and the grid
// mapping.
#include "cuda/dispatch/heuristics.h"
#include "cuda/loglinear/loglinear.cuh"
#include "cuda/prims/resets.cuh"
#include "cuda/runtime/config.h"

namespace hila::cuda {

namespace {

constexpr int kVT = 64;       // value columns per block in the sweeps (state tiles [dk, kVT])

// ---- levels (§2.1, §2.2) on absolute int64 positions (n >= 0) ------------------------------------
__host__ __device__ __forceinline__ int bitlen64(int64_t x) {
#ifdef __CUDA_ARCH__
  return x ? 64 - __clzll(x) : 0;
#else
  return x ? 64 - __builtin_clzll(uint64_t(x)) : 0;
#endif
}
__host__ __device__ __forceinline__ bool is_live(int64_t n, int l) { return l >= 1 && l <= 63 && ((n >> (l - 1)) & 1); }
// sigma_l(n) = (n >> l) << l: start of bucket l of position n
__host__ __device__ __forceinline__ int64_t bucket_start(int64_t n, int l) { return l >= 63 ? 0 : (n >> l) << l; }
// level at which query t >= n reads bucket l of the state at n (nesting lemma, §2.4)
__device__ __forceinline__ int read_level(int64_t t, int64_t n, int l) { return bitlen64(t ^ bucket_start(n, l)); }
// index of live level l among the live levels of n (the compact order of hst: increasing level)
__device__ __forceinline__ int live_rank(int64_t n, int l) { return __popcll(n & ((int64_t(1) << (l - 1)) - 1)); }
// in-chunk level LUT[i, j] = bitlen(i xor j) for chunk offsets i, j < kChunk
__device__ __forceinline__ int chunk_level(int i, int j) { return 32 - __clz(i ^ j); }

// A segment [s, e) of a sequence: the rows of one aligned chunk (§3.3).
struct Seg {
  int64_t s, e, row;  // absolute positions; packed row of position s
  int nr, off;        // rows; offset of s inside its chunk
};
__device__ __forceinline__ int64_t num_segments(int64_t n0, int64_t len) {
  return len == 0 ? 0 : (n0 + len - 1) / kChunk - n0 / kChunk + 1;
}
__device__ __forceinline__ Seg segment(int64_t n0, int64_t len, int64_t row0, int64_t j) {
  Seg g;
  const int64_t c0 = n0 / kChunk;
  g.s = j == 0 ? n0 : (c0 + j) * kChunk;
  g.e = min((c0 + j + 1) * kChunk, n0 + len);
  g.row = row0 + (g.s - n0);
  g.nr = int(g.e - g.s);
  g.off = int(g.s % kChunk);
  return g;
}
// Rows [lo, hi) of the segment [s, e) whose tokens land in level L of the state at e (L live at
// e): bucket B_L(e) = [sigma_L(e), sigma_L(e) + 2^{L-1}) intersected with [s, e). Non-empty?
__host__ __device__ __forceinline__ bool bucket_rows(int64_t s, int64_t e, int L, int& lo, int& hi) {
  const int64_t b0 = bucket_start(e, L), b1 = b0 + (int64_t(1) << (L - 1));
  const int64_t l64 = (b0 > s ? b0 : s) - s, h64 = (b1 < e ? b1 : e) - s;  // h64 may be << -2^31
  lo = h64 > l64 ? int(l64) : 0;
  hi = h64 > l64 ? int(h64) : 0;
  return lo < hi;
}
__device__ __forceinline__ bool group_rows(const Seg& g, int L, int& lo, int& hi) {
  return is_live(g.e, L) && bucket_rows(g.s, g.e, L, lo, hi);
}

// Element loop over columns [v0, v0+bv) of a [rows, dv] global matrix: f(offset). Every
// elementwise pass over state tiles uses this same thread mapping.
template <class F>
__device__ __forceinline__ void each_tile(int rows, int bv, int dv, int v0, F f) {
  for (int e = threadIdx.x; e < rows * bv; e += blockDim.x) f(int64_t(e / bv) * dv + v0 + e % bv);
}

// G += X^T Y on columns [v0, v0+bv) of a level's [dk, dv] state tile G in global memory (fp32 /
// fp64), staged through Hf [dk, ldvr]: X [C, dk], Y [C, bv] (16-bit or the compute type) in shared
// memory.                                                                [dk,C]x[C,bv]
template <class T, class R>
__device__ void add_level_product(R* G, int dv, int v0, R* Hf, int ldvr, const T* X, int ldx, const T* Y, int ldy,
                                  int dk, int bv) {
  for (int e = threadIdx.x; e < dk * bv; e += blockDim.x) Hf[(e / bv) * ldvr + e % bv] = G[int64_t(e / bv) * dv + v0 + e % bv];
  __syncthreads();
  smem_gemm<T, true, false>(Hf, ldvr, X, ldx, Y, ldy, dk, bv, kChunk, true);
  for (int e = threadIdx.x; e < dk * bv; e += blockDim.x) G[int64_t(e / bv) * dv + v0 + e % bv] = Hf[(e / bv) * ldvr + e % bv];
  __syncthreads();
}

// ---- forward sweep ---------------------------------------------------------------------------

template <class T>
// Tiles of a segment's forward over `cols` value columns: kVT in the sweep (which also keeps the
// state update tile Hf), all dv in the chunk-parallel output kernel.
struct FwdSmem {
  using R = Acc<T>;
  T *Q, *Qs, *K, *V, *Hs, *P;  // P doubles as the weighted values of the state update
  R *A, *O, *Hf, *b;
  ChunkResets<R> z;  // the segment's resets (prims/resets.cuh)
  int ldk, ldv, ldc, ldcr, ldvr;
  __host__ __device__ FwdSmem(char* base, int dk, int cols, bool with_state, size_t* bytes = nullptr) {
    ldk = ld_of<T>(dk), ldv = ld_of<T>(cols), ldc = ld_of<T>(kChunk);
    ldcr = ld_of<R>(kChunk), ldvr = ld_of<R>(cols);
    Carve c{base};
    Q = c.take<T>(kChunk * ldk);
    Qs = c.take<T>(kChunk * ldk);
    K = c.take<T>(kChunk * ldk);
    V = c.take<T>(kChunk * ldv);
    Hs = c.take<T>(dk * ldv);
    P = c.take<T>(kChunk * ldc);
    A = c.take<R>(kChunk * ldcr);
    O = c.take<R>(kChunk * ldvr);
    Hf = with_state ? c.take<R>(dk * ldvr) : nullptr;
    b = c.take<R>(kChunk);
    z.bs = c.take<R>(kChunk);
    z.last = c.take<int>(kChunk);
    z.any = c.take<int>(1);
    if (bytes) *bytes = c.used;
  }
};
static_assert(kVT <= kChunk, "FwdSmem::P holds [C, C] scores and [C, kVT] weighted values");

// Output rows of one segment, value columns [v0, v0+bv), with s.Q, s.K, s.V (columns [v0, v0+bv)
// at 0), s.b and s.z loaded:
//   O = (Lam o Gamma_c o Q^ K^T) V + sum_{l live at s} diag(lam^{l(s+i, sigma_l(s))} e^{b_i}) Q^ H[l]
// Gamma_c from dec (prims/resets.cuh: exact across the segment's resets; e^{b_i} is exact before
// its first reset and 0 from it on). level(l, m) points at element (0, v0) of live level l (the
// m-th live level of s) as a fp32 matrix with row stride p.dv.
template <class T, class Dec, class Level>
__device__ void segment_output(const LoglinearArgs<T>& a, FwdSmem<T>& s, const Dec& dec, const Seg& sg, int h, int v0,
                               int bv, Level level) {
  using R = Acc<T>;
  const GlaArgs<T>& p = a.p;
  const R* lam = a.lam + int64_t(h) * p.Ttot * a.nL;
  smem_gemm<T, false, true>(s.A, s.ldcr, s.Q, s.ldk, s.K, s.ldk, kChunk, kChunk, p.dk, false);  // [C,dk]x[dk,C]
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int i = e / kChunk, jj = e % kChunk;
    R x = 0;
    if (jj <= i && i < sg.nr)
      x = s.A[i * s.ldcr + jj] * p.scale * dec.gamma(i, jj) *
          lam[(sg.row + i) * a.nL + chunk_level(sg.off + i, sg.off + jj)];
    s.P[i * s.ldc + jj] = to<T>(x);
  }
  __syncthreads();
  smem_gemm<T, false, false>(s.O, s.ldvr, s.P, s.ldc, s.V, s.ldv, kChunk, bv, kChunk, false);  // [C,C]x[C,bv]
  for (int l = 1, m = 0, top = bitlen64(sg.s); l <= top; ++l) {
    if (!is_live(sg.s, l)) continue;
    const R* Hl = level(l, m++);
    for (int e = threadIdx.x; e < kChunk * p.dk; e += blockDim.x) {
      const int i = e / p.dk, c = e % p.dk;
      R x = 0;
      if (i < sg.nr)
        x = from<R>(s.Q[i * s.ldk + c]) * p.scale * exp(s.b[i]) *
            lam[(sg.row + i) * a.nL + read_level(sg.s + i, sg.s, l)];
      s.Qs[i * s.ldk + c] = to<T>(x);
    }
    for (int e = threadIdx.x; e < p.dk * bv; e += blockDim.x)
      s.Hs[(e / bv) * s.ldv + e % bv] = to<T>(Hl[int64_t(e / bv) * p.dv + e % bv]);
    __syncthreads();
    smem_gemm<T, false, false>(s.O, s.ldvr, s.Qs, s.ldk, s.Hs, s.ldv, kChunk, bv, p.dk, true);  // [C,dk]x[dk,bv]
  }
  store_rows(p.o + int64_t(h) * p.Ttot * p.dv, p.dv, sg.row, v0, s.O, s.ldvr, sg.nr, bv);
}

// grid (dv / 64, N * H): one [dk, 64] column tile of every level state per block, kept in p.ht.
template <class T>
__global__ void __launch_bounds__(256) loglinear_fwd_kernel(LoglinearArgs<T> a) {
  using R = Acc<T>;
  extern __shared__ __align__(128) char smem[];
  const GlaArgs<T>& p = a.p;
  FwdSmem<T> s(smem, p.dk, kVT, true);
  const int v0 = blockIdx.x * kVT, bv = min(kVT, p.dv - v0);
  const int seq = blockIdx.y / p.H, h = blockIdx.y % p.H;
  const int64_t len = p.len[seq], row0 = p.row0[seq], n0 = a.n0[seq];
  const T* q = p.q + int64_t(h / p.q_div) * p.Ttot * p.dk;
  const T* k = p.k + int64_t(h / p.k_div) * p.Ttot * p.dk;
  const T* v = p.v + int64_t(h / p.v_div) * p.Ttot * p.dv;
  const R* g = p.g ? p.g + int64_t(h) * p.Ttot : nullptr;
  const int64_t tile = int64_t(p.dk) * p.dv;
  R* H = p.ht + (int64_t(seq) * p.H + h) * a.Ls * tile;  // slot l at H + l * tile
  const R* H0 = p.h0 ? p.h0 + (int64_t(seq) * p.H + h) * a.Ls * tile : nullptr;
  for (int l = 0; l < a.Ls; ++l) {
    const bool use = H0 && is_live(n0, l);
    each_tile(p.dk, bv, p.dv, v0, [&](int64_t x) { H[l * tile + x] = use ? H0[l * tile + x] : R(0); });
  }
  __syncthreads();
  const int64_t nseg = num_segments(n0, len);
  for (int64_t j = 0; j < nseg; ++j) {
    const Seg sg = segment(n0, len, row0, j);
    const int top = bitlen64(sg.s), etop = bitlen64(sg.e);
    load_rows(s.Q, s.ldk, q, p.dk, sg.row, sg.nr, 0, p.dk);
    load_rows(s.K, s.ldk, k, p.dk, sg.row, sg.nr, 0, p.dk);
    load_rows(s.V, s.ldv, v, p.dv, sg.row, sg.nr, v0, bv);
    chunk_cumsum_resets(s.b, s.z, g, sg.row, sg.nr);  // includes a barrier
    with_chunk_decay(s.b, s.z, [&](const auto& dec) {  // Gamma_c and w (exact across resets)
      if (p.o) segment_output(a, s, dec, sg, h, v0, bv, [&](int l, int) { return H + l * tile + v0; });
      // decay and re-key H[l] -> H'[l(e, sigma_l(s))], in place from the top level down: a target
      // is >= its source, and every source above the current one has already moved out (so H[l]
      // still holds the level entering the segment, which hst keeps for the outputs / backward).
      // e^B is exactly 0 when the segment holds a reset.
      const R eB = exp(s.b[kChunk - 1]);
      for (int l = top; l >= 1; --l) {
        if (!is_live(sg.s, l)) continue;
        const int L = read_level(sg.e, sg.s, l);
        R* kept = a.hst ? a.hst + ((a.hoff[a.seg0[seq] + j] + live_rank(sg.s, l)) * p.H + h) * tile : nullptr;
        each_tile(p.dk, bv, p.dv, v0, [&](int64_t x) {
          const R hx = H[l * tile + x], y = hx * eB;
          if (kept) kept[x] = hx;
          if (L == l) {
            H[l * tile + x] = y;
          } else {
            H[L * tile + x] += y;
            H[l * tile + x] = 0;
          }
        });
        __syncthreads();
      }
      // new tokens: H'[L] += K^T diag(w 1_L) V       [dk,C]x[C,64]   (w_i = e^{B-b_i}, dec.weight)
      for (int L = 1; L <= etop; ++L) {
        int lo, hi;
        if (!group_rows(sg, L, lo, hi)) continue;
        for (int e = threadIdx.x; e < kChunk * bv; e += blockDim.x) {
          const int i = e / bv, c = e % bv;
          const R x = (i >= lo && i < hi) ? from<R>(s.V[i * s.ldv + c]) * dec.weight(i) : R(0);
          s.P[i * s.ldc + c] = to<T>(x);
        }
        add_level_product(H + L * tile, p.dv, v0, s.Hf, s.ldvr, s.K, s.ldk, s.P, s.ldc, p.dk, bv);
      }
    });
  }
}

// Chunk-parallel outputs from the stored live levels (hst): grid (nseg, H), all dv columns.
template <class T>
__global__ void __launch_bounds__(256) loglinear_out_kernel(LoglinearArgs<T> a) {
  using R = Acc<T>;
  extern __shared__ __align__(128) char smem[];
  const GlaArgs<T>& p = a.p;
  FwdSmem<T> s(smem, p.dk, p.dv, false);
  const int64_t gi = blockIdx.x;
  const int h = blockIdx.y, seq = a.seg_seq[gi];
  const Seg sg = segment(a.n0[seq], p.len[seq], p.row0[seq], gi - a.seg0[seq]);
  load_rows(s.Q, s.ldk, p.q + int64_t(h / p.q_div) * p.Ttot * p.dk, p.dk, sg.row, sg.nr, 0, p.dk);
  load_rows(s.K, s.ldk, p.k + int64_t(h / p.k_div) * p.Ttot * p.dk, p.dk, sg.row, sg.nr, 0, p.dk);
  load_rows(s.V, s.ldv, p.v + int64_t(h / p.v_div) * p.Ttot * p.dv, p.dv, sg.row, sg.nr, 0, p.dv);
  chunk_cumsum_resets(s.b, s.z, p.g ? p.g + int64_t(h) * p.Ttot : nullptr, sg.row, sg.nr);
  const int64_t tile = int64_t(p.dk) * p.dv;
  with_chunk_decay(s.b, s.z, [&](const auto& dec) {
    segment_output(a, s, dec, sg, h, 0, p.dv,
                   [&](int, int m) -> const R* { return a.hst + ((a.hoff[gi] + m) * p.H + h) * tile; });
  });
}

// ---- reverse sweep of the level adjoints (§5.2) -----------------------------------------------

template <class T>
struct RevSmem {
  using R = Acc<T>;
  T *Q, *D, *Ds;  // Q [C, dk]; dO tile [C, 64] and its per-level weighted copy
  R *Hf, *b, *red;
  ChunkResets<R> z;  // the segment's resets (prims/resets.cuh)
  int ldk, ldv, ldvr;
  __host__ __device__ RevSmem(char* base, int dk, size_t* bytes = nullptr) {
    ldk = ld_of<T>(dk), ldv = ld_of<T>(kVT), ldvr = ld_of<R>(kVT);
    Carve c{base};
    Q = c.take<T>(kChunk * ldk);
    D = c.take<T>(kChunk * ldv);
    Ds = c.take<T>(kChunk * ldv);
    Hf = c.take<R>(dk * ldvr);
    b = c.take<R>(kChunk);
    red = c.take<R>(256);
    z.bs = c.take<R>(kChunk);
    z.last = c.take<int>(kChunk);
    z.any = c.take<int>(1);
    if (bytes) *bytes = c.used;
  }
};

// grid (dv / 64, N * H). Working adjoint in p.dh0 (canonical: non-zero only at live levels).
// Per segment, from the last: store dH'[L] of its new-token levels L to dst; this tile's part of
// sum_l <dH'[l(e, sigma_l(s))], H[l]> (the gate gradient of the re-key) to dBpart;
// dH[l] = e^B dH'[l(e, sigma_l(s))] (un-merge = copy); dH[l] += Q^^T diag(lam e^b) dO (reads).
template <class T>
__global__ void __launch_bounds__(256) loglinear_bwd_dh_kernel(LoglinearArgs<T> a) {
  using R = Acc<T>;
  extern __shared__ __align__(128) char smem[];
  const GlaArgs<T>& p = a.p;
  RevSmem<T> s(smem, p.dk);
  const int v0 = blockIdx.x * kVT, bv = min(kVT, p.dv - v0);
  const int seq = blockIdx.y / p.H, h = blockIdx.y % p.H;
  const int64_t len = p.len[seq], row0 = p.row0[seq], n0 = a.n0[seq], nend = n0 + len;
  const T* q = p.q + int64_t(h / p.q_div) * p.Ttot * p.dk;
  const T* dO = p.dO + int64_t(h) * p.Ttot * p.dv;
  const R* g = p.g ? p.g + int64_t(h) * p.Ttot : nullptr;
  const R* lam = a.lam + int64_t(h) * p.Ttot * a.nL;
  const int64_t tile = int64_t(p.dk) * p.dv;
  R* dH = p.dh0 + (int64_t(seq) * p.H + h) * a.Ls * tile;
  const R* dHT = p.dht ? p.dht + (int64_t(seq) * p.H + h) * a.Ls * tile : nullptr;
  for (int l = 0; l < a.Ls; ++l) {
    const bool use = dHT && is_live(nend, l);
    each_tile(p.dk, bv, p.dv, v0, [&](int64_t x) { dH[l * tile + x] = use ? dHT[l * tile + x] : R(0); });
  }
  __syncthreads();
  for (int64_t j = num_segments(n0, len) - 1; j >= 0; --j) {
    const Seg sg = segment(n0, len, row0, j);
    const int top = bitlen64(sg.s), etop = bitlen64(sg.e);
    {
      const int64_t gi = a.seg0[seq] + j;
      int m = 0;
      for (int L = 1; L <= etop; ++L) {
        int lo, hi;
        if (!group_rows(sg, L, lo, hi)) continue;
        R* dst = a.dst + ((a.goff[gi] + m++) * p.H + h) * tile;
        each_tile(p.dk, bv, p.dv, v0, [&](int64_t x) { dst[x] = dH[L * tile + x]; });
      }
    }
    load_rows(s.Q, s.ldk, q, p.dk, sg.row, sg.nr, 0, p.dk);
    load_rows(s.D, s.ldv, dO, p.dv, sg.row, sg.nr, v0, bv);
    // e^b exact before the segment's first reset and 0 from it on, e^B = 0 with a reset: the
    // reverse sweep needs no other decay
    chunk_cumsum_resets(s.b, s.z, g, sg.row, sg.nr);
    const R eB = exp(s.b[kChunk - 1]);
    // adjoint of the re-key, in place from the lowest level up (a source reads its target >= it,
    // which no lower source has written), with this tile's part of sum_l <dH'[L(l)], H[l]>
    R part = 0;
    for (int l = 1, m = 0; l <= top; ++l) {
      if (!is_live(sg.s, l)) continue;
      const int L = read_level(sg.e, sg.s, l);
      const R* Hl = a.hst + ((a.hoff[a.seg0[seq] + j] + m++) * p.H + h) * tile;
      each_tile(p.dk, bv, p.dv, v0, [&](int64_t x) {
        const R d = dH[L * tile + x];
        part += d * Hl[x];
        dH[l * tile + x] = eB * d;
      });
      __syncthreads();
    }
    part = block_sum(part, s.red);  // includes barriers
    if (threadIdx.x == 0) a.dBpart[((a.seg0[seq] + j) * p.H + h) * gridDim.x + blockIdx.x] = part;
    for (int L = 1; L <= etop; ++L) {  // levels live at e only: no adjoint before the segment
      if (!is_live(sg.e, L) || is_live(sg.s, L)) continue;
      each_tile(p.dk, bv, p.dv, v0, [&](int64_t x) { dH[L * tile + x] = 0; });
    }
    __syncthreads();
    // reads: dH[l] += Q^^T diag(lam^{lv} e^b) dO          [dk,C]x[C,64]
    for (int l = 1; l <= top; ++l) {
      if (!is_live(sg.s, l)) continue;
      for (int e = threadIdx.x; e < kChunk * bv; e += blockDim.x) {
        const int i = e / bv, c = e % bv;
        R x = 0;
        if (i < sg.nr)
          x = from<R>(s.D[i * s.ldv + c]) * p.scale * exp(s.b[i]) *
              lam[(sg.row + i) * a.nL + read_level(sg.s + i, sg.s, l)];
        s.Ds[i * s.ldv + c] = to<T>(x);
      }
      add_level_product(dH + l * tile, p.dv, v0, s.Hf, s.ldvr, s.Q, s.ldk, s.Ds, s.ldv, p.dk, bv);
    }
  }
}

// ---- per-segment gradients -------------------------------------------------------------------

template <class T>
struct GradSmem {
  using R = Acc<T>;
  T *Q, *K, *V, *dO, *Hs, *P, *dA;
  R *A, *dP, *X, *b, *db, *dbc, *dBr, *cf;
  ChunkResets<R> z;  // the segment's resets (prims/resets.cuh)
  int ldk, ldv, ldc, ldcr, ldx;
  __host__ __device__ GradSmem(char* base, int dk, int dv, size_t* bytes = nullptr) {
    ldk = ld_of<T>(dk), ldv = ld_of<T>(dv), ldc = ld_of<T>(kChunk);
    ldcr = ld_of<R>(kChunk), ldx = ld_of<R>(dk > dv ? dk : dv);
    Carve c{base};
    Q = c.take<T>(kChunk * ldk);
    K = c.take<T>(kChunk * ldk);
    V = c.take<T>(kChunk * ldv);
    dO = c.take<T>(kChunk * ldv);
    Hs = c.take<T>(dk * ldv);
    P = c.take<T>(kChunk * ldc);
    dA = c.take<T>(kChunk * ldc);
    A = c.take<R>(kChunk * ldcr);
    // [C] each, in A from when A is dead (after the intra block's sums)
    dbc = A, cf = A + kChunk, dBr = A + 2 * kChunk;
    dP = X = c.take<R>(kChunk * (ldcr > ldx ? ldcr : ldx));  // dP is dead before X is first written
    b = c.take<R>(kChunk);
    db = c.take<R>(kChunk);
    z.bs = c.take<R>(kChunk);
    z.last = c.take<int>(kChunk);
    z.any = c.take<int>(1);
    if (bytes) *bytes = c.used;
  }
};

// grid (nseg, H), 256 threads. The block owns the rows of its segment in dq, dk, dv, dg, dlam.
template <class T>
__global__ void __launch_bounds__(256) loglinear_bwd_chunk_kernel(LoglinearArgs<T> a) {
  using R = Acc<T>;
  extern __shared__ __align__(128) char smem[];
  const GlaArgs<T>& p = a.p;
  const int dk = p.dk, dv = p.dv;
  GradSmem<T> s(smem, dk, dv);
  const int64_t gi = blockIdx.x;
  const int h = blockIdx.y, seq = a.seg_seq[gi];
  const Seg sg = segment(a.n0[seq], p.len[seq], p.row0[seq], gi - a.seg0[seq]);
  const int nr = sg.nr, top = bitlen64(sg.s), etop = bitlen64(sg.e);
  const R* lam = a.lam + int64_t(h) * p.Ttot * a.nL;
  R* dlam = a.dlam + int64_t(h) * p.Ttot * a.nL;
  const int64_t rb = int64_t(h) * p.Ttot + sg.row;  // per-head packed row of segment row 0
  const int64_t tile = int64_t(dk) * dv;
  load_rows(s.Q, s.ldk, p.q + int64_t(h / p.q_div) * p.Ttot * dk, dk, sg.row, nr, 0, dk);
  load_rows(s.K, s.ldk, p.k + int64_t(h / p.k_div) * p.Ttot * dk, dk, sg.row, nr, 0, dk);
  load_rows(s.V, s.ldv, p.v + int64_t(h / p.v_div) * p.Ttot * dv, dv, sg.row, nr, 0, dv);
  load_rows(s.dO, s.ldv, p.dO + int64_t(h) * p.Ttot * dv, dv, sg.row, nr, 0, dv);
  if (threadIdx.x < kChunk) s.db[threadIdx.x] = 0;
  chunk_cumsum_resets(s.b, s.z, p.g ? p.g + int64_t(h) * p.Ttot : nullptr, sg.row, nr);  // includes a barrier
  const R eB = exp(s.b[kChunk - 1]);  // 0 when the segment holds a reset
  // Gamma_c and w from dec (prims/resets.cuh): with a reset in the segment they are formed from the
  // segment-relative sums bs, and db, dB below are the partials in bs_i and bs_{C-1}
  with_chunk_decay(s.b, s.z, [&](const auto& dec) {
    constexpr bool kReset = std::decay_t<decltype(dec)>::kReset;
    // ---- intra block. With G = Gamma_c, Lam the LUT-gathered lam, A^ = Q^K^T:
    //   P = Lam o G o A^;  dA^ = dP o Lam o G;  d lam_i^{LUT[i,j]} += dP_ij (G o A^)_ij;
    //   d(b_i - b_j) += dP_ij P_ij.   Afterwards s.A holds dP o P and s.dP holds dP o G o A^.
    smem_gemm<T, false, true>(s.A, s.ldcr, s.Q, s.ldk, s.K, s.ldk, kChunk, kChunk, dk, false);   // [C,dk]x[dk,C]
    smem_gemm<T, false, true>(s.dP, s.ldcr, s.dO, s.ldv, s.V, s.ldv, kChunk, kChunk, dv, false);  // [C,dv]x[dv,C]
    for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
      const int i = e / kChunk, j = e % kChunk;
      R pij = 0, da = 0, dpp = 0, t = 0;
      if (j <= i && i < nr) {
        const R gam = dec.gamma(i, j);
        const R lm = lam[(sg.row + i) * a.nL + chunk_level(sg.off + i, sg.off + j)];
        const R ag = s.A[i * s.ldcr + j] * p.scale * gam;
        const R dp = s.dP[i * s.ldcr + j];
        pij = lm * ag;
        da = dp * lm * gam;
        dpp = dp * pij;
        t = dp * ag;
      }
      s.A[i * s.ldcr + j] = dpp;
      s.dP[i * s.ldcr + j] = t;
      s.P[i * s.ldc + j] = to<T>(pij);
      s.dA[i * s.ldc + j] = to<T>(da);
    }
    __syncthreads();
    R colsum = 0;  // thread kChunk + j: column j's sum, stored to dbc[j] (in A) after the next barrier
    if (threadIdx.x < kChunk) {  // rows: + sum_j dP_ij P_ij
      const int i = threadIdx.x;
      R acc = 0;
      for (int j = 0; j <= i; ++j) acc += s.A[i * s.ldcr + j];
      s.db[i] += acc;
    } else if (threadIdx.x < 2 * kChunk) {  // columns: - sum_i dP_ij P_ij
      const int j = threadIdx.x - kChunk;
      for (int i = j; i < kChunk; ++i) colsum += s.A[i * s.ldcr + j];
    }
    // dlam at the in-chunk levels 0..p: one (row, level) pair per task
    for (int e = threadIdx.x; e < kChunk * (kLogChunk + 1); e += blockDim.x) {
      const int i = e / (kLogChunk + 1), lv = e % (kLogChunk + 1);
      if (i >= nr) continue;
      R acc = 0;
      bool any = false;
      for (int j = 0; j <= i; ++j)
        if (chunk_level(sg.off + i, sg.off + j) == lv) acc += s.dP[i * s.ldcr + j], any = true;
      if (any) dlam[(sg.row + i) * a.nL + lv] += acc;  // any => lv <= bitlen(t) < nL (validated)
    }
    __syncthreads();  // A is dead from here
    if (threadIdx.x < kChunk) s.dBr[threadIdx.x] = 0;
    else if (threadIdx.x < 2 * kChunk) s.dbc[threadIdx.x - kChunk] = colsum;
    // dQ^ = dA^ K; dK = dA^^T Q^; dV = P^T dO
    smem_gemm<T, false, false>(s.X, s.ldx, s.dA, s.ldc, s.K, s.ldk, kChunk, dk, kChunk, false);  // [C,C]x[C,dk]
    for (int e = threadIdx.x; e < nr * dk; e += blockDim.x) p.dq[(rb + e / dk) * dk + e % dk] = s.X[(e / dk) * s.ldx + e % dk];
    __syncthreads();
    smem_gemm<T, true, false>(s.X, s.ldx, s.dA, s.ldc, s.Q, s.ldk, kChunk, dk, kChunk, false);   // [C,C]^T x [C,dk]
    for (int e = threadIdx.x; e < nr * dk; e += blockDim.x)
      p.dk_[(rb + e / dk) * dk + e % dk] = p.scale * s.X[(e / dk) * s.ldx + e % dk];
    __syncthreads();
    smem_gemm<T, true, false>(s.X, s.ldx, s.P, s.ldc, s.dO, s.ldv, kChunk, dv, kChunk, false);   // [C,C]^T x [C,dv]
    for (int e = threadIdx.x; e < nr * dv; e += blockDim.x) p.dv_[(rb + e / dv) * dv + e % dv] = s.X[(e / dv) * s.ldx + e % dv];
    __syncthreads();

    // ---- reads of the incoming live levels: Y = dO H[l]^T, coef_i = lam_i^{lv_i} e^{b_i}
    //   dQ^ += diag(coef) Y;  dlam[i, lv_i] += e^{b_i} q^_i.Y_i;  db_i += coef_i q^_i.Y_i
    //   and the transition: dB += e^B <dH'[l(e, sigma_l(s))], H[l]> (summed over the reverse
    //   sweep's column tiles in dBpart)
    R dB = 0;  // meaningful in thread 0
    if (threadIdx.x == 0)
      for (int t = 0, nt = (dv + kVT - 1) / kVT; t < nt; ++t) dB += eB * a.dBpart[(gi * p.H + h) * nt + t];
    {
      int m = 0;
      for (int l = 1; l <= top; ++l) {
        if (!is_live(sg.s, l)) continue;
        const R* Hl = a.hst + ((a.hoff[gi] + m++) * p.H + h) * tile;
        for (int e = threadIdx.x; e < dk * dv; e += blockDim.x) s.Hs[(e / dv) * s.ldv + e % dv] = to<T>(Hl[e]);
        __syncthreads();
        smem_gemm<T, false, true>(s.X, s.ldx, s.dO, s.ldv, s.Hs, s.ldv, kChunk, dk, dv, false);   // [C,dv]x[dv,dk]
        if (threadIdx.x < nr) {
          const int i = threadIdx.x;
          const int lv = read_level(sg.s + i, sg.s, l);
          const R eb = exp(s.b[i]), coef = lam[(sg.row + i) * a.nL + lv] * eb;
          R qy = 0;
          for (int c = 0; c < dk; ++c) qy += from<R>(s.Q[i * s.ldk + c]) * s.X[i * s.ldx + c];
          qy *= p.scale;
          dlam[(sg.row + i) * a.nL + lv] += eb * qy;
          s.db[i] += coef * qy;
          s.cf[i] = coef;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < nr * dk; e += blockDim.x)
          p.dq[(rb + e / dk) * dk + e % dk] += s.cf[e / dk] * s.X[(e / dk) * s.ldx + e % dk];
        __syncthreads();
      }
    }
    // ---- new tokens of level L: Z_L = K^T diag(w 1_L) V, w = e^{B-b}
    //   dV += diag(w 1_L) K dH'[L];  dK += diag(w 1_L) V dH'[L]^T;  d(B - b_j) += w_j (K dH'[L])_j.v_j
    for (int L = 1, m = 0; L <= etop; ++L) {
      int lo, hi;
      if (!group_rows(sg, L, lo, hi)) continue;
      const R* dHo = a.dst + ((a.goff[gi] + m++) * p.H + h) * tile;
      for (int e = threadIdx.x; e < dk * dv; e += blockDim.x) s.Hs[(e / dv) * s.ldv + e % dv] = to<T>(dHo[e]);
      __syncthreads();
      smem_gemm<T, false, false>(s.X, s.ldx, s.K, s.ldk, s.Hs, s.ldv, kChunk, dv, dk, false);  // [C,dk]x[dk,dv]
      if (threadIdx.x >= lo && threadIdx.x < hi) {
        const int i = threadIdx.x;
        const R w = dec.weight(i);
        R ty = 0;
        for (int c = 0; c < dv; ++c) ty += s.X[i * s.ldx + c] * from<R>(s.V[i * s.ldv + c]);
        s.dBr[i] += w * ty;
        s.db[i] -= w * ty;
        s.cf[i] = w;
      }
      __syncthreads();
      for (int e = threadIdx.x; e < (hi - lo) * dv; e += blockDim.x) {
        const int i = lo + e / dv, c = e % dv;
        p.dv_[(rb + i) * dv + c] += s.cf[i] * s.X[i * s.ldx + c];
      }
      __syncthreads();
      smem_gemm<T, false, true>(s.X, s.ldx, s.V, s.ldv, s.Hs, s.ldv, kChunk, dk, dv, false);  // [C,dv]x[dv,dk]
      for (int e = threadIdx.x; e < (hi - lo) * dk; e += blockDim.x) {
        const int i = lo + e / dk, c = e % dk;
        p.dk_[(rb + i) * dk + c] += s.cf[i] * s.X[i * s.ldx + c];
      }
      __syncthreads();
    }
    // ---- dg = reverse cumsum over the segment of db (db_{R-1} += dB), stopped at the resets
    if (threadIdx.x == 0 && nr > 0) {
      for (int i = 0; i < nr; ++i) dB += s.dBr[i];
      chunk_dg_serial<kReset>(p.dg + rb, [&](int i) { return s.db[i] - s.dbc[i]; }, dB, nr, s.z);
    }
  });
}

template <class T>
size_t fwd_bytes(int dk) {
  return layout_bytes<FwdSmem<T>>(dk, kVT, true);
}
template <class T>
size_t out_bytes(int dk, int dv) {
  return layout_bytes<FwdSmem<T>>(dk, dv, false);
}
template <class T>
size_t rev_bytes(int dk) {
  return layout_bytes<RevSmem<T>>(dk);
}
template <class T>
size_t grad_bytes(int dk, int dv) {
  return layout_bytes<GradSmem<T>>(dk, dv);
}

template <class T>
void launch_sweep_fwd(const LoglinearArgs<T>& a, cudaStream_t stream) {
  const size_t bytes = fwd_bytes<T>(a.p.dk);
  set_smem(loglinear_fwd_kernel<T>, bytes);
  if (!dry_run()) {  // dry run: workspace_size
    loglinear_fwd_kernel<T><<<dim3((a.p.dv + kVT - 1) / kVT, a.p.N * a.p.H), 256, bytes, stream>>>(a);
    HILA_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

LoglinearTables::LoglinearTables(const detail::Resolved& r, cudaStream_t s) {
  std::vector<int> seg_seq;
  hoff.push_back(0);
  goff.push_back(0);
  int64_t maxn = 0;
  for (size_t i = 0; i < r.seqs.size(); ++i) {
    const int64_t a = r.seqs[i].n0, n = a + r.seqs[i].len;
    n0.push_back(a);
    nend.push_back(n);
    seg0.push_back(nseg);
    maxn = std::max(maxn, n);
    for (int64_t c = a / kChunk; r.seqs[i].len > 0 && c * kChunk < n; ++c) {  // segments of §3.3
      const int64_t st = std::max(c * kChunk, a), en = std::min((c + 1) * kChunk, n);
      hoff.push_back(hoff.back() + __builtin_popcountll(uint64_t(st)));
      int groups = 0, lo, hi;
      for (int L = 1; L <= bitlen64(en); ++L) groups += is_live(en, L) && bucket_rows(st, en, L, lo, hi);
      goff.push_back(goff.back() + groups);
      seg_seq.push_back(int(i));
      ++nseg;
    }
  }
  seg0.push_back(nseg);
  Ls = (maxn ? 64 - __builtin_clzll(uint64_t(maxn)) : 0) + 1;
  d_n0 = SeqTables::upload(n0, s);
  d_nend = SeqTables::upload(nend, s);
  d_seg0 = SeqTables::upload(seg0, s);
  d_hoff = SeqTables::upload(hoff, s);
  d_goff = SeqTables::upload(goff, s);
  d_seg_seq = SeqTables::upload(seg_seq, s);
}

template <class T>
size_t loglinear_smem_need(int dk, int dv) {
  return std::max({fwd_bytes<T>(dk), rev_bytes<T>(dk), grad_bytes<T>(dk, dv)});
}

// Bytes of stored live levels (hst) a forward-only call may allocate to run its outputs
// chunk-parallel (heuristics::loglinear_store_budget; HILA_LOGLINEAR_STORE_BUDGET replaces it).
size_t hst_budget() {
  if (const auto& knob = config().loglinear_store_budget) return *knob;
  size_t free = 0, total = 0;
  HILA_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return heuristics::loglinear_store_budget(free, total, current_arena() != nullptr);
}

template <class T>
void loglinear_sweep_forward(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t stream) {
  using R = Acc<T>;
  // The sweep is parallel over (value tile, sequence x head) only. When the live levels entering
  // each segment are (or may be) stored, it carries the states alone and the outputs run in one
  // block per (segment, head).
  const size_t optin = smem_optin();
  const size_t ob = out_bytes<T>(a.p.dk, a.p.dv);
  const size_t hst_bytes = size_t(t.stored_levels()) * a.p.H * a.p.dk * a.p.dv * sizeof(R);
  const heuristics::Device d{0, optin};
  if (!heuristics::loglinear_outputs_chunk_parallel(a.p.o != nullptr, t.nseg, ob, d, a.hst != nullptr, hst_bytes,
                                                    hst_budget)) {
    launch_sweep_fwd(a, stream);
    return;
  }
  DevBuf<R> hst;
  LoglinearArgs<T> b = a;
  if (!b.hst && hst_bytes > 0) b.hst = (hst = DevBuf<R>(hst_bytes / sizeof(R), stream)).get();
  b.p.o = nullptr;
  launch_sweep_fwd(b, stream);
  b.p.o = a.p.o;
  set_smem(loglinear_out_kernel<T>, ob);
  if (!dry_run()) {  // dry run: workspace_size
    loglinear_out_kernel<T><<<dim3(unsigned(t.nseg), a.p.H), 256, ob, stream>>>(b);
    HILA_CUDA_CHECK_LAUNCH();
  }
}

template <class T>
void loglinear_sweep_backward(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t stream) {
  using R = Acc<T>;
  const int64_t tile = int64_t(a.p.dk) * a.p.dv;
  const int ntiles = (a.p.dv + kVT - 1) / kVT;
  DevBuf<R> ht, hst, dst(size_t(t.goff.back() * a.p.H * tile), stream), dBpart(size_t(t.nseg * a.p.H * ntiles), stream);
  LoglinearArgs<T> b = a;
  b.dst = dst.get(), b.dBpart = dBpart.get();
  if (!a.hst && t.hoff.back() > 0) {  // states only, storing the live levels entering every segment
    ht = DevBuf<R>(size_t(int64_t(a.p.N) * a.p.H * a.Ls * tile), stream);
    hst = DevBuf<R>(size_t(t.hoff.back() * a.p.H * tile), stream);
    b.p.o = nullptr, b.p.ht = ht.get(), b.hst = hst.get();
    launch_sweep_fwd(b, stream);
  }
  const size_t rb = rev_bytes<T>(a.p.dk);
  set_smem(loglinear_bwd_dh_kernel<T>, rb);
  if (!dry_run()) {  // dry run: workspace_size
    loglinear_bwd_dh_kernel<T><<<dim3(ntiles, a.p.N * a.p.H), 256, rb, stream>>>(b);
    HILA_CUDA_CHECK_LAUNCH();
  }
  if (!dry_run()) HILA_CUDA_CHECK(cudaMemsetAsync(a.dlam, 0, size_t(a.p.H) * a.p.Ttot * a.nL * sizeof(R), stream));
  if (t.nseg > 0) {
    const size_t gb = grad_bytes<T>(a.p.dk, a.p.dv);
    set_smem(loglinear_bwd_chunk_kernel<T>, gb);
    if (!dry_run()) {  // dry run: workspace_size
      loglinear_bwd_chunk_kernel<T><<<dim3(unsigned(t.nseg), a.p.H), 256, gb, stream>>>(b);
      HILA_CUDA_CHECK_LAUNCH();
    }
  }
}

#define HILA_INSTANTIATE(T)                                                      \
  template void loglinear_sweep_forward<T>(const LoglinearArgs<T>&, const LoglinearTables&, cudaStream_t);  \
  template void loglinear_sweep_backward<T>(const LoglinearArgs<T>&, const LoglinearTables&, cudaStream_t); \
  template size_t loglinear_smem_need<T>(int, int);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
