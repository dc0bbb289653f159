// SPDX-License-Identifier: Apache-2.0
// loglinear_gdn's level sweeps on the sm90 tier (sm_90a: TMA + wgmma; delta/sm90.cuh), the same math
// as loglinear_level_sweep_kernel / loglinear_level_rsweep_kernel of loglinear_gdn_sm80.cu (docs/math/
// LOGLINEAR.md §6.4, §6.5), with the state tile, ring and 16-bit stash of the plain gdn sweeps
// (sweep_sm90.cu). One warpgroup per (sequence x head, aligned level block of 2^m chunks, 64 value
// columns) walks the second half [mid, stop) of its block with its [dk, 64] fp32 state in wgmma
// accumulators. With b the chunk-local cumsum of the log-gates, B = b[nr-1], w = e^{B-b} and lam
// the rows' level-(p + m) weights:
//   forward (S: the level state entering the chunk)
//     (0) S = E[mid] + K^T (diag(w) U)       chunk mid-1, [dk,C]x[C,64] (E: 0 at m = 1)
//     (1) S -> 16-bit st16 [dk][64] (and hl)
//     (2) Vn = -W st16, Z = Qeff st16        [C,dk]x[dk,64] each, W and Qeff K-major
//         o += diag(lam) Z                   (fp32, rows of the sequence)
//     (3) S = e^B S + K^T (diag(w) Vn)       diag(w) Vn 16-bit in st16's place
//     end: E[end] = S (m = 1) or += S (m > 1) where a chunk or the final state reads it; fin
//   reverse (chunks last first; dS: the cotangent after the chunk's erase, from dmid[end])
//     (1) dS -> 16-bit st16 (and dhl)
//     (2) dVn = diag(w) K st16               [C,dk]x[dk,64]
//     (3) dS = e^B dS + Qeff^T (diag(lam) dO) + W^T (-dVn)   [dk,C]x[C,64], twice per slab
//         (dO scaled in place in its stage, -dVn 16-bit in st16's place)
//     end: dmid[mid] = dS (fp32 and 16-bit)
// W, K, Qeff (and dO) arrive by TMA into a ring of S stages (chunk i+S-1 issued as chunk i starts);
// the gates, lam and the chunk mid-1's U are read into registers a chunk ahead. Rows past the
// sequence (the next one's, or TMA's zeros) enter the products only against the zero rows of
// diag(w) U, diag(w) Vn, diag(lam) dO and -dVn; their o rows are not written.
#include "cuda/delta/loglinear_gdn_sm90.cuh"
#include "cuda/delta/sm90.cuh"
#include "cuda/dispatch/heuristics.h"
#include "cuda/dispatch/static_switch.h"
#include "cuda/gla/sm90.cuh"

namespace hila::cuda::gdn {

namespace {

using namespace gla_sm90;

// The forward level sweep of level lv; grid (N x H, level blocks, dv / 64), one warpgroup.
template <class T, int DK, int S>
__global__ void __launch_bounds__(kSm90Threads, 2)
    loglinear_level_sweep_sm90_kernel(const __grid_constant__ CUtensorMap mw, const __grid_constant__ CUtensorMap mk,
                                      const __grid_constant__ CUtensorMap mq, unsigned order, GlaArgs<T> a,
                                      LoglinearSweepArgs<T> x, int lv) {
  static_assert(S >= 2, "a stage in the products and one in flight");
#if HILA_SM90A
  constexpr int M = DK / 64;
  using L = Ring<DK, 3>;  // W, K, Qeff
  using namespace sm90;
  extern __shared__ __align__(1024) char smem[];
  const RingAt<L, S> ra(smem, 0);  // st16 (and vt), the stages' mbarriers
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H, v0 = blockIdx.z * 64;
  const int64_t len = a.len[seq], row0 = a.row0[seq];
  const int nch = int((len + kChunk - 1) / kChunk), kx = h / a.k_div;
  const int64_t st0 = int64_t(blockIdx.y) << lv, mid = st0 + (int64_t(1) << (lv - 1)), end = st0 + (int64_t(1) << lv);
  const int64_t F = len / kChunk;
  const bool fin_here = x.fin && mid <= F && F < end;  // this block holds level p + lv of the final state
  if (mid > nch || (mid == nch && !fin_here)) return;  // no chunk reads it
  const int64_t stop = end < nch ? end : nch;
  const int n = int(stop - mid) + 1;  // chunks mid-1 .. stop-1 through the ring
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const float* lam = x.lam + int64_t(h) * a.Ttot * x.nL + kLogChunk + lv;  // row r: lam[r * nL]
  const int64_t mat = int64_t(a.dk) * a.dv, c0 = a.chunk0[seq];
  const int rl = 16 * w + g;  // rows rl, rl + 8 of each slab and of the chunk's tiles
  float acc[M][32];
  load_state_slabs<M>(acc, lv > 1 ? x.E + ((c0 + mid) * a.H + h) * mat : nullptr, a.dv, rl, v0, t);
  init_ring(ra.full, S, tid);
  // thread 0: W, K (and Qeff where o is wanted) of chunk mid-1+i into stage st = i % S
  auto issue = [&](int i, int st) {
    if (i >= n) return;
    const int64_t r0 = row0 + (mid - 1 + i) * kChunk;
    char* base = smem + st * L::kStage;
    fence_async_smem();
    mbar_expect_tx(&ra.full[st], x.o ? L::kStage : 2 * L::kTile);
#pragma unroll
    for (int cb = 0; cb < M; ++cb) {
      load_rows(base + cb * kSweepTile, &mw, &ra.full[st], order & 1, 64 * cb, r0, h);
      load_rows(base + L::kTile + cb * kSweepTile, &mk, &ra.full[st], (order >> 1) & 1, 64 * cb, r0, kx);
      if (x.o) load_rows(base + 2 * L::kTile + cb * kSweepTile, &mq, &ra.full[st], (order >> 2) & 1, 64 * cb, r0, h);
    }
  };
  if (tid == 0)
    for (int i = 0; i < S - 1; ++i) issue(i, i);
  // this thread's gates and lam of its rows rl, rl + 8 of chunk c (rows >= nr: 0), a chunk ahead
  float bi[2], lm[2], B = 0.f;
  auto load_g = [&](int64_t c) {
    const int nr = rows_in(len, c);
    const int64_t r0 = row0 + c * kChunk;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = rl + 8 * hf;
      bi[hf] = b && i < nr ? b[r0 + i] : 0.f;
      lm[hf] = i < nr ? lam[(r0 + i) * x.nL] : 0.f;
    }
    B = b ? b[r0 + nr - 1] : 0.f;
  };
  load_g(mid - 1);
  int st = 0;  // i % S and the parity of its use, kept by counting
  uint32_t par = 0;
  for (int i = 0; i < n; ++i, st = st + 1 == S ? (par ^= 1, 0) : st + 1) {
    const int64_t c = mid - 1 + i, r0 = row0 + c * kChunk;
    const int nr = rows_in(len, c);
    const uint32_t base = ra.s0 + st * L::kStage;
    __syncthreads();  // chunk c-1's products are complete: its stage and st16 are free
    if (tid == 0) issue(i + S - 1, st == 0 ? S - 1 : st - 1);  // into chunk c-1's stage
    float decay = 1.f;
    if (i == 0) {
      // (0) diag(w) U of chunk mid-1 into st16 [C][64]
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = rl + 8 * hf;
        const float wi = r < nr ? mma::fexp(B - bi[hf]) : 0.f;
        const T* Ur = x.U + (int64_t(h) * a.Ttot + r0 + r) * a.dv + v0 + 2 * t;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float2 u = r < nr ? mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(Ur + 8 * j)) : make_float2(0.f, 0.f);
          *reinterpret_cast<uint32_t*>(ra.st16 + swz(kChunk, r, 8 * j + 2 * t)) = mma::pack2<T>(wi * u.x, wi * u.y);
        }
      }
      mbar_wait(&ra.full[st], par);
    } else {
      // (1) the state entering the chunk, 16-bit
      stash16<T, M>(acc, ra.st16, x.hl ? x.hl + (((lv - 1) * a.nchunks + c0 + c) * a.H + h) * mat + v0 + 2 * t : nullptr,
                    a.dv);
      fence_async_smem();
      __syncthreads();
      mbar_wait(&ra.full[st], par);
      // (2) Vn = -W S, Z = Qeff S
      float y[32], z[32];
      wg_fence();
      wgmma_chain<T, 64, 0, 1>(y, base, kChunk, ra.a16, DK, DK / 16);
      if (x.o) wgmma_chain<T, 64, 0, 1>(z, base + 2 * L::kTile, kChunk, ra.a16, DK, DK / 16);
      wg_commit();
      wg_wait<0>();
      fence_regs(y);
      if (x.o) fence_regs(z);
      __syncthreads();  // every warp's products have read st16
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = rl + 8 * hf;
        const bool in = r < nr;
        const float wi = -mma::fexp(B - bi[hf]);  // diag(w) Vn = -diag(w) W S
#pragma unroll
        for (int j = 0; j < 8; ++j)
          *reinterpret_cast<uint32_t*>(ra.st16 + swz(kChunk, r, 8 * j + 2 * t)) =
              mma::pack2<T>(in ? wi * y[4 * j + 2 * hf] : 0.f, in ? wi * y[4 * j + 2 * hf + 1] : 0.f);
        if (x.o && in) {
          float* orow = x.o + (int64_t(h) * a.Ttot + r0 + r) * a.dv + v0 + 2 * t;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            float2* p = reinterpret_cast<float2*>(orow + 8 * j);
            float2 v = *p;
            v.x += lm[hf] * z[4 * j + 2 * hf], v.y += lm[hf] * z[4 * j + 2 * hf + 1];
            *p = v;
          }
        }
      }
      decay = mma::fexp(B);
    }
    if (c + 1 < stop) load_g(c + 1);
    fence_async_smem();
    __syncthreads();
    // (3) S = e^B S + K^T st16 (at chunk mid-1: S = E[mid] + K^T diag(w) U)
    decay_then_accumulate(acc, decay, [&](float(&slab)[32], int m) {
      wgmma_chain<T, 64, 1, 1>(slab, base + L::kTile + m * kSweepTile, kChunk, ra.a16, kChunk, kChunk / 16, true);
    });
  }
  // E[end] (level 1 stores, higher levels add), when some chunk or the final state reads it
  if (end < nch || (end == nch && x.fin && len % kChunk == 0 && F == end))
    store_state_slabs<M>(acc, x.E + ((c0 + end) * a.H + h) * mat, a.dv, rl, v0, t, lv > 1);
  if (fin_here) store_state_slabs<M>(acc, x.fin + ((int64_t(seq) * a.H + h) * x.Ls + kLogChunk + lv) * mat, a.dv, rl, v0, t);
#else
  __trap();  // launched only where runs_sm90a() holds
#endif
}

// The reverse level sweep of level lv; grid (N x H, level blocks, dv / 64), one warpgroup.
template <class T, int DK, int S>
__global__ void __launch_bounds__(kSm90Threads)
    loglinear_level_rsweep_sm90_kernel(const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                                       const __grid_constant__ CUtensorMap mw, const __grid_constant__ CUtensorMap mdo,
                                       unsigned order, GlaArgs<T> a, LoglinearRsweepArgs<T> x, int lv) {
  static_assert(S >= 2, "a stage in the products and one in flight");
#if HILA_SM90A
  constexpr int M = DK / 64;
  using L = Ring<DK, 3, 1, 1, true>;  // Qeff, K, W, dO; st16, vt (-dVn: no barrier between (2)'s reads and its writes)
  using namespace sm90;
  extern __shared__ __align__(1024) char smem[];
  const RingAt<L, S> ra(smem, 0);  // st16 (and vt), the stages' mbarriers
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H, v0 = blockIdx.z * 64;
  const int64_t len = a.len[seq], row0 = a.row0[seq];
  const int nch = int((len + kChunk - 1) / kChunk), kx = h / a.k_div;
  const int64_t st0 = int64_t(blockIdx.y) << lv, mid = st0 + (int64_t(1) << (lv - 1)), end = st0 + (int64_t(1) << lv);
  if (mid >= nch) return;
  const int64_t stop = end < nch ? end : nch;
  const int n = int(stop - mid);  // chunks stop-1 .. mid
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const float* lam = x.lam + int64_t(h) * a.Ttot * x.nL + kLogChunk + lv;  // row r: lam[r * nL]
  const int64_t mat = int64_t(a.dk) * a.dv, c0 = a.chunk0[seq];
  const int rl = 16 * w + g;
  float acc[M][32];
  load_state_slabs<M>(acc, end < nch ? x.dmid + ((c0 + end) * a.H + h) * mat : nullptr, a.dv, rl, v0, t);
  init_ring(ra.full, S, tid);
  auto issue = [&](int i, int st) {  // thread 0: Qeff, K, W, dO of chunk stop-1-i into stage st = i % S
    if (i >= n) return;
    const int64_t r0 = row0 + (stop - 1 - i) * kChunk;
    char* base = smem + st * L::kStage;
    fence_async_smem();  // the stage's dO was scaled in place (generic writes) before this refill
    mbar_expect_tx(&ra.full[st], L::kStage);
#pragma unroll
    for (int cb = 0; cb < M; ++cb) {
      load_rows(base + cb * kSweepTile, &mq, &ra.full[st], order & 1, 64 * cb, r0, h);
      load_rows(base + L::kTile + cb * kSweepTile, &mk, &ra.full[st], (order >> 1) & 1, 64 * cb, r0, kx);
      load_rows(base + 2 * L::kTile + cb * kSweepTile, &mw, &ra.full[st], (order >> 2) & 1, 64 * cb, r0, h);
    }
    load_rows(base + 3 * L::kTile, &mdo, &ra.full[st], (order >> 3) & 1, v0, r0, h);
  };
  if (tid == 0)
    for (int i = 0; i < S - 1; ++i) issue(i, i);
  // this thread's gates of its rows rl, rl + 8 and lam of the dO rows it scales (tid / 8 + 16q) of
  // chunk c (rows >= nr: 0), a chunk ahead
  float bi[2], lo[4], B = 0.f;
  auto load_g = [&](int64_t c) {
    const int nr = rows_in(len, c);
    const int64_t r0 = row0 + c * kChunk;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = rl + 8 * hf;
      bi[hf] = b && r < nr ? b[r0 + r] : 0.f;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = tid / 8 + 16 * q;
      lo[q] = r < nr ? lam[(r0 + r) * x.nL] : 0.f;
    }
    B = b ? b[r0 + nr - 1] : 0.f;
  };
  load_g(stop - 1);
  int st = 0;  // i % S and the parity of its use, kept by counting
  uint32_t par = 0;
  for (int i = 0; i < n; ++i, st = st + 1 == S ? (par ^= 1, 0) : st + 1) {
    const int64_t c = stop - 1 - i;
    const int nr = rows_in(len, c);
    __syncthreads();  // chunk c+1's products are complete: its stage, st16 and vt are free
    if (tid == 0) issue(i + S - 1, st == 0 ? S - 1 : st - 1);  // into chunk c+1's stage
    // (1) the cotangent after the chunk's erase, 16-bit, and to dhl
    stash16<T, M>(acc, ra.st16, x.dhl + (((lv - 1) * a.nchunks + c0 + c) * a.H + h) * mat + v0 + 2 * t, a.dv);
    mbar_wait(&ra.full[st], par);
    char* dOt = smem + st * L::kStage + 3 * L::kTile;
    scale_do_rows<T>(dOt, tid, nr, [&](int q) { return lo[q]; });  // dO row r *= lam_r
    fence_async_smem();
    __syncthreads();
    // (2) dVn = diag(w) K dS
    const uint32_t base = ra.s0 + st * L::kStage;
    float y[32];
    wg_fence();
    wgmma_chain<T, 64, 0, 1>(y, base + L::kTile, kChunk, ra.a16, DK, DK / 16);
    wg_commit();
    wg_wait<0>();
    fence_regs(y);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = rl + 8 * hf;
      const bool in = r < nr;
      const float wi = -mma::fexp(B - bi[hf]);  // -dVn
#pragma unroll
      for (int j = 0; j < 8; ++j)
        *reinterpret_cast<uint32_t*>(ra.vt + swz(kChunk, r, 8 * j + 2 * t)) =
            mma::pack2<T>(in ? wi * y[4 * j + 2 * hf] : 0.f, in ? wi * y[4 * j + 2 * hf + 1] : 0.f);
    }
    const float decay = mma::fexp(B);
    if (c > mid) load_g(c - 1);
    fence_async_smem();
    __syncthreads();
    // (3) dS = e^B dS + Qeff^T diag(lam) dO - W^T dVn
    decay_then_accumulate(acc, decay, [&](float(&slab)[32], int m) {
      wgmma_chain<T, 64, 1, 1>(slab, base + m * kSweepTile, kChunk, base + 3 * L::kTile, kChunk, kChunk / 16, true);
      wgmma_chain<T, 64, 1, 1>(slab, base + 2 * L::kTile + m * kSweepTile, kChunk, ra.avt, kChunk, kChunk / 16, true);
    });
  }
  // dMid[mid]: fp32 and 16-bit
  const int64_t dst = ((c0 + mid) * a.H + h) * mat;
  store_state_slabs<M>(acc, x.dmid + dst, a.dv, rl, v0, t);
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        *reinterpret_cast<uint32_t*>(x.dmid16 + dst + int64_t(64 * m + rl + 8 * hf) * a.dv + v0 + 8 * j + 2 * t) =
            mma::pack2<T>(acc[m][4 * j + 2 * hf], acc[m][4 * j + 2 * hf + 1]);
#else
  __trap();  // launched only where runs_sm90a() holds
#endif
}

// Level m's grid: (N x H, level blocks, dv / 64).
template <class T>
dim3 level_grid(const GlaArgs<T>& a, int64_t reach, int m) {
  return dim3(unsigned(a.N * a.H), unsigned((reach >> m) + 1), unsigned(a.dv / 64));
}

}  // namespace

template <class T>
bool loglinear_level_sweeps_sm90(const GlaArgs<T>& a, const LoglinearSweepArgs<T>& x, int top, int64_t reach,
                                 cudaStream_t s) {
  if (top < 1) return true;
  const dim3 g1 = level_grid(a, reach, 1);
  const int64_t blocks = int64_t(g1.x) * g1.y * g1.z;  // level 1's (the most)
  return HILA_HEADDIM_SWITCH(a.dk, DK, [&] {
    const int S = ring_stages<Ring<DK, 3>>(blocks, 2);
    if (S < 2) return false;
    return HILA_DELTA_STAGES_SWITCH(S, kS, [&] {
      auto kernel = loglinear_level_sweep_sm90_kernel<T, DK, kS>;
      const size_t bytes = Ring<DK, 3>::bytes(kS);
      CUtensorMap mw, mk, mq;
      bool sw = false, sk = false, sq = false;
      if (!input_map(&mw, sw, x.W, 0, 0, a.dk, a.H, a.Ttot) ||
          !input_map(&mk, sk, a.k, a.k_ld, a.k_hs, a.dk, src_heads(a, a.k_div), a.Ttot) ||
          !input_map(&mq, sq, x.qeff, 0, 0, a.dk, a.H, a.Ttot) || !ready_sm90(kernel, bytes))
        return false;
      if (dry_run()) return true;  // dry run: workspace_size (no workspace of its own)
      const unsigned order = unsigned(sw) | unsigned(sk) << 1 | unsigned(sq) << 2;
      for (int m = 1; m <= top; ++m) {
        kernel<<<level_grid(a, reach, m), kSm90Threads, bytes, s>>>(mw, mk, mq, order, a, x, m);
        HILA_CUDA_CHECK_LAUNCH();
      }
      return true;
    });
  });
}

template <class T>
bool loglinear_level_rsweeps_sm90(const GlaArgs<T>& a, const LoglinearRsweepArgs<T>& x, int top, int64_t reach,
                                  cudaStream_t s) {
  if (top < 1) return true;
  const dim3 g1 = level_grid(a, reach, 1);
  const int64_t blocks = int64_t(g1.x) * g1.y * g1.z;
  return HILA_HEADDIM_SWITCH(a.dk, DK, [&] {
    using L = Ring<DK, 3, 1, 1, true>;
    const int S = ring_stages<L>(blocks, 2);
    if (S < 2) return false;
    return HILA_DELTA_STAGES_SWITCH(S, kS, [&] {
      auto kernel = loglinear_level_rsweep_sm90_kernel<T, DK, kS>;
      const size_t bytes = L::bytes(kS);
      CUtensorMap mq, mk, mw, mdo;
      bool sq = false, sk = false, sw = false, sd = false;
      if (!input_map(&mq, sq, x.qeff, 0, 0, a.dk, a.H, a.Ttot) ||
          !input_map(&mk, sk, a.k, a.k_ld, a.k_hs, a.dk, src_heads(a, a.k_div), a.Ttot) ||
          !input_map(&mw, sw, x.W, 0, 0, a.dk, a.H, a.Ttot) ||
          !input_map(&mdo, sd, a.dO, a.dO_ld, a.dO_hs, a.dv, a.H, a.Ttot) || !ready_sm90(kernel, bytes))
        return false;
      if (dry_run()) return true;
      const unsigned order = unsigned(sq) | unsigned(sk) << 1 | unsigned(sw) << 2 | unsigned(sd) << 3;
      for (int m = top; m >= 1; --m) {
        kernel<<<level_grid(a, reach, m), kSm90Threads, bytes, s>>>(mq, mk, mw, mdo, order, a, x, m);
        HILA_CUDA_CHECK_LAUNCH();
      }
      return true;
    });
  });
}

#define HILA_INSTANTIATE(T)                                                                                      \
  template bool loglinear_level_sweeps_sm90<T>(const GlaArgs<T>&, const LoglinearSweepArgs<T>&, int, int64_t,   \
                                               cudaStream_t);                                                   \
  template bool loglinear_level_rsweeps_sm90<T>(const GlaArgs<T>&, const LoglinearRsweepArgs<T>&, int, int64_t, \
                                                cudaStream_t);
HILA_INSTANTIATE(__nv_bfloat16)
HILA_INSTANTIATE(__half)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda::gdn
