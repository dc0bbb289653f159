// SPDX-License-Identifier: Apache-2.0
// The delta rule's state sweeps on the sm90 tier (sm_90a: TMA + wgmma; sweep_sm90.cuh), the same
// math as delta_sweep_kernel / delta_rsweep_kernel of gdn_sm80.cu (docs/math/LOGLINEAR.md §6.4).
// One warpgroup per (sequence x head, 64 value columns) walks the chunks of C = 64 rows with its
// [dk, 64] fp32 state (dk = 64 or 128: one or two m64 slabs) in wgmma accumulators. Per chunk,
// with b the chunk-local cumsum of the log-gates, B = b[nr-1], w = e^{B-b}:
//   forward (S: the state entering the chunk)
//     (1) S -> 16-bit st16 [dk][64] (swizzled), stored from there to hbuf by TMA
//     (2) Vn = U - W st16                   [C,dk]x[dk,64]  W K-major, st16 MN-major; Vn to global
//     (3) S = e^B S + K^T (diag(w) Vn)      [dk,C]x[C,64]   per slab: K MN-major, diag(w) Vn (16-bit,
//                                                          in the tile vt) MN-major
//   reverse (chunks last first; dS: the cotangent of the state at the chunk's end)
//     (1) dS -> 16-bit st16 (stored from there to dhbuf by TMA)
//     (2) dVn = dvi + diag(w) K st16        [C,dk]x[dk,64]
//     (3) dS = e^B dS + Q^T (diag(scale e^b) dO) + W^T (-dVn)   [dk,C]x[C,64], twice per slab
//         (dO scaled in place in its stage, -dVn 16-bit in the tile vt)
// vt is a [C][64] tile of its own beside st16, so that nothing waits for the TMA store of st16
// until the next chunk's (1) overwrites it, a chunk later, and the epilogue of (2) needs no barrier
// between the products' reads of st16 and its writes.
// W, K, U (and Q, K, W, dO) arrive by TMA (128-byte swizzle) into a ring of S stages, chunk c+S-1
// issued as chunk c starts; the gates are read from
// global memory into registers a chunk ahead, their loads in flight over (3) and the next chunk's
// (1) and (2). Rows past the
// sequence (the next one's, or TMA's zeros) enter the products only against the zero rows of
// diag(w) Vn, diag(scale e^b) dO and -dVn. A block may hold two warpgroups, each its own 64 value
// columns, the chunk's [C, dk] tiles shared: the reverse sweep's where that halves the waves (at
// dk = 128 one block fits an SM; heuristics::delta_sm90_rsweep_warpgroups), the forward sweep's
// where one-warpgroup blocks would share SMs (heuristics::delta_sm90_sweep_warpgroups).
#include <cstdint>
#include <type_traits>

#include "cuda/delta/sm90.cuh"
#include "cuda/delta/sweep_sm90.cuh"
#include "cuda/dispatch/heuristics.h"
#include "cuda/dispatch/static_switch.h"
#include "cuda/gla/sm90.cuh"

namespace hila::cuda::gdn {

namespace {

using namespace gla_sm90;

// The forward sweep; grid (N x H, 1, dv / (64 NW)), NW warpgroups sharing the W, K tiles, each
// with its own 64 value columns (file comment).
template <class T, int DK, int S, int NW>
__global__ void __launch_bounds__(kSm90Threads * NW, NW == 1 ? 2 : 1)
    delta_sweep_sm90_kernel(const __grid_constant__ CUtensorMap mw, const __grid_constant__ CUtensorMap mk,
                            const __grid_constant__ CUtensorMap mu, const __grid_constant__ CUtensorMap mh,
                            unsigned order, GlaArgs<T> a, T* Vn) {
  static_assert(S >= 2, "a stage in the products and one in flight");
  static_assert(NW == 1 || NW == 2, "one or two warpgroups");
#if HILA_SM90A
  constexpr int M = DK / 64;
  using L = Ring<DK, 2, 1, NW, true>;  // W, K tiles; per warpgroup U's [C][64] block; st16, vt
  using namespace sm90;
  extern __shared__ __align__(1024) char smem[];
  const int tid = threadIdx.x, wg = NW == 1 ? 0 : tid / kSm90Threads, wt = tid % kSm90Threads;  // warpgroup, its thread
  const int lane = tid & 31, w = wt >> 5, g = lane >> 2, t = lane & 3;            // w: warp in the warpgroup
  const RingAt<L, S> ra(smem, wg);  // this warpgroup's st16, vt and the stages' mbarriers
  // vb: the block's first value column (uniform), v0: this warpgroup's
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H, vb = 64 * NW * blockIdx.z, v0 = vb + 64 * wg;
  const int64_t len = a.len[seq], row0 = a.row0[seq];
  const int nch = int((len + kChunk - 1) / kChunk), kx = h / a.k_div;
  const int lo = min(a.c_lo, nch), hi = min(a.c_hi, nch);  // this launch's chunks (GlaArgs::c_lo)
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  T* Vnh = Vn + int64_t(h) * a.Ttot * a.dv + v0 + 2 * t;
  const int64_t sidx = (int64_t(seq) * a.H + h) * a.dk * a.dv;  // [N][H][dk][dv]
  const int rl = 16 * w + g;  // rows rl, rl + 8 of each slab and of the chunk's tiles
  float acc[M][32];
  load_state_slabs<M>(acc, a.h0 ? a.h0 + sidx : nullptr, a.dv, rl, v0, t);
  init_ring(ra.full, S, tid);
  auto issue = [&](int c, int st) {  // thread 0: W, K, U (NW blocks) of chunk c into stage st = (c - lo) % S
    if (c >= hi) return;
    const int64_t r0 = row0 + int64_t(c) * kChunk;
    char* base = smem + st * L::kStage;
    fence_async_smem();
    mbar_expect_tx(&ra.full[st], L::kStage);
#pragma unroll
    for (int cb = 0; cb < M; ++cb) {
      load_rows(base + cb * kSweepTile, &mw, &ra.full[st], order & 1, 64 * cb, r0, h);
      load_rows(base + L::kTile + cb * kSweepTile, &mk, &ra.full[st], (order >> 1) & 1, 64 * cb, r0, kx);
    }
#pragma unroll
    for (int x = 0; x < NW; ++x)
      load_rows(base + 2 * L::kTile + x * kSweepTile, &mu, &ra.full[st], (order >> 2) & 1, vb + 64 * x, r0, h);
  };
  if (tid == 0)
    for (int c = 0; c < S - 1; ++c) issue(lo + c, c);
  // the gates of this thread's rows rl, rl + 8 of chunk c (0 past nr or without b) and B: loaded a
  // chunk ahead, once chunk c-1's have been used
  float bi[2], B = 0.f;
  auto load_gates = [&](int c) {
    const int nr = rows_in(len, c);
    const int64_t r0 = row0 + int64_t(c) * kChunk;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) bi[hf] = b && rl + 8 * hf < nr ? b[r0 + rl + 8 * hf] : 0.f;
    B = b ? b[r0 + nr - 1] : 0.f;
  };
  if (lo < hi) load_gates(lo);
  // the stage of chunk c ((c - lo) % S) and the parity of its use, kept by counting (S = 3: no division)
  int st = 0;
  uint32_t par = 0;
  for (int c = lo; c < hi; ++c, st = st + 1 == S ? (par ^= 1, 0) : st + 1) {
    const int nr = rows_in(len, c);
    const int64_t r0 = row0 + int64_t(c) * kChunk;
    if (wt == 0 && a.hbuf) bulk_wait_read<0>();  // chunk c-1's state store has read st16
    __syncthreads();  // chunk c-1's products are complete: its stage, st16 and vt are free
    if (tid == 0) issue(c + S - 1, st == 0 ? S - 1 : st - 1);  // into chunk c-1's stage
    // (1) the state entering the chunk, 16-bit
    stash16<T, M>(acc, ra.st16, nullptr, a.dv);
    fence_async_smem();
    __syncthreads();
    if (wt == 0 && a.hbuf) {  // this warpgroup's st16 to hbuf by TMA (map mh, box {64, 64}: a slab a store)
      const int row = int(((a.chunk0[seq] + c) * a.H + h) * DK);
#pragma unroll
      for (int m = 0; m < M; ++m) tma_store_2d(&mh, ra.st16 + m * kSweepTile, v0, row + 64 * m);
      bulk_commit();
    }
    mbar_wait(&ra.full[st], par);
    // (2) Vn = U - W S  (U: rows past nr are other rows', masked below)
    const uint32_t base = ra.s0 + st * L::kStage;
    const char* Ut = smem + st * L::kStage + 2 * L::kTile + wg * kSweepTile;  // this warpgroup's U
    float x[32];
    wg_fence();
    wgmma_chain<T, 64, 0, 1>(x, base, kChunk, ra.a16, DK, DK / 16);
    wg_commit();
    wg_wait<0>();
    fence_regs(x);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = rl + 8 * hf;
      const bool in = i < nr;
      const float wi = mma::fexp(B - bi[hf]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 uv = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(Ut + swz(kChunk, i, 8 * j + 2 * t)));
        const float y0 = in ? uv.x - x[4 * j + 2 * hf] : 0.f, y1 = in ? uv.y - x[4 * j + 2 * hf + 1] : 0.f;
        if (in) *reinterpret_cast<uint32_t*>(Vnh + (r0 + i) * a.dv + 8 * j) = mma::pack2<T>(y0, y1);
        *reinterpret_cast<uint32_t*>(ra.vt + swz(kChunk, i, 8 * j + 2 * t)) = mma::pack2<T>(wi * y0, wi * y1);
      }
    }
    const float decay = mma::fexp(B);
    if (c + 1 < hi) load_gates(c + 1);
    fence_async_smem();
    __syncthreads();
    // (3) S = e^B S + K^T diag(w) Vn
    decay_then_accumulate(acc, decay, [&](float(&slab)[32], int m) {
      wgmma_chain<T, 64, 1, 1>(slab, base + L::kTile + m * kSweepTile, kChunk, ra.avt, kChunk, kChunk / 16, true);
    });
  }
  store_state_slabs<M>(acc, a.ht ? a.ht + sidx : nullptr, a.dv, rl, v0, t);
  if (wt == 0 && a.hbuf) bulk_wait<0>();  // the state stores complete before the block exits
#else
  __trap();  // launched only where runs_sm90a() holds
#endif
}

// The reverse sweep; grid (N x H, 1, dv / (64 NW)), NW warpgroups sharing the Q, K, W tiles, each
// with its own 64 value columns (file comment).
template <class T, int DK, int S, int NW>
__global__ void __launch_bounds__(kSm90Threads * NW)
    delta_rsweep_sm90_kernel(const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                             const __grid_constant__ CUtensorMap mw, const __grid_constant__ CUtensorMap mdo,
                             const __grid_constant__ CUtensorMap mdh, const __grid_constant__ CUtensorMap mdvi,
                             unsigned order, GlaArgs<T> a) {
  static_assert(S >= 2, "a stage in the products and one in flight");
  static_assert(NW == 1 || NW == 2, "one or two warpgroups");
#if HILA_SM90A
  constexpr int M = DK / 64;
  using L = Ring<DK, 3, 2, NW, true>;  // Q, K, W tiles; per warpgroup dO, then dvi [C][64]; st16, vt
  using namespace sm90;
  extern __shared__ __align__(1024) char smem[];
  const int tid = threadIdx.x, wg = NW == 1 ? 0 : tid / kSm90Threads, wt = tid % kSm90Threads;  // warpgroup, its thread
  const int lane = tid & 31, w = wt >> 5, g = lane >> 2, t = lane & 3;            // w: warp in the warpgroup
  const RingAt<L, S> ra(smem, wg);  // this warpgroup's st16, vt and the stages' mbarriers
  // vb: the block's first value column (uniform)
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H, vb = 64 * NW * blockIdx.z;
  const int64_t len = a.len[seq], row0 = a.row0[seq];
  const int nch = int((len + kChunk - 1) / kChunk), qx = h / a.q_div, kx = h / a.k_div;
  const int lo = min(a.c_lo, nch), hi = min(a.c_hi, nch);  // this launch's chunks (GlaArgs::c_lo), last first
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const int64_t sidx = (int64_t(seq) * a.H + h) * a.dk * a.dv;  // [N][H][dk][dv]
  const float sc = float(a.scale);
  const int rl = 16 * w + g;
  float acc[M][32];
  load_state_slabs<M>(acc, a.dht ? a.dht + sidx : nullptr, a.dv, rl, vb + 64 * wg, t);
  init_ring(ra.full, S, tid);
  auto issue = [&](int i, int st) {  // thread 0: Q, K, W, dO, dvi (NW blocks each) of the i-th chunk from hi down into stage st = i % S
    if (i >= hi - lo) return;
    const int64_t r0 = row0 + int64_t(hi - 1 - i) * kChunk;
    char* base = smem + st * L::kStage;
    fence_async_smem();  // the stage's dO was scaled in place (generic writes) before this refill
    mbar_expect_tx(&ra.full[st], L::kStage);
#pragma unroll
    for (int cb = 0; cb < M; ++cb) {
      load_rows(base + cb * kSweepTile, &mq, &ra.full[st], order & 1, 64 * cb, r0, qx);
      load_rows(base + L::kTile + cb * kSweepTile, &mk, &ra.full[st], (order >> 1) & 1, 64 * cb, r0, kx);
      load_rows(base + 2 * L::kTile + cb * kSweepTile, &mw, &ra.full[st], (order >> 2) & 1, 64 * cb, r0, h);
    }
#pragma unroll
    for (int x = 0; x < NW; ++x)
      load_rows(base + 3 * L::kTile + x * kSweepTile, &mdo, &ra.full[st], (order >> 3) & 1, 64 * blockIdx.z * NW + 64 * x,
                r0, h);
#pragma unroll
    for (int x = 0; x < NW; ++x)
      load_rows(base + 3 * L::kTile + (NW + x) * kSweepTile, &mdvi, &ra.full[st], (order >> 4) & 1,
                64 * blockIdx.z * NW + 64 * x, r0, h);
  };
  if (tid == 0)
    for (int i = 0; i < S - 1; ++i) issue(i, i);
  // the gates of this thread's rows rl, rl + 8 and of the dO rows it scales (wt / 8 + 16q), loaded a
  // chunk ahead
  float bi[2], bo[4], B = 0.f;
  auto load_u = [&](int c) {
    const int nr = rows_in(len, c);
    const int64_t r0 = row0 + int64_t(c) * kChunk;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) bi[hf] = b && rl + 8 * hf < nr ? b[r0 + rl + 8 * hf] : 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = wt / 8 + 16 * q;
      bo[q] = b && r < nr ? b[r0 + r] : 0.f;
    }
    B = b ? b[r0 + nr - 1] : 0.f;
  };
  if (lo < hi) load_u(hi - 1);
  int st = 0;  // i % S and the parity of its use, kept by counting
  uint32_t par = 0;
  for (int i = 0; i < hi - lo; ++i, st = st + 1 == S ? (par ^= 1, 0) : st + 1) {
    const int c = hi - 1 - i, nr = rows_in(len, c);
    const int64_t cg = a.chunk0[seq] + c;
    if (wt == 0) bulk_wait_read<0>();  // chunk c+1's cotangent store has read st16
    __syncthreads();  // chunk c+1's products are complete: its stage, st16 and vt are free
    if (tid == 0) issue(i + S - 1, st == 0 ? S - 1 : st - 1);  // into chunk c+1's stage
    // (1) the cotangent at the chunk's end, 16-bit
    stash16<T, M>(acc, ra.st16, nullptr, a.dv);
    mbar_wait(&ra.full[st], par);
    char* dOt = smem + st * L::kStage + 3 * L::kTile + wg * kSweepTile;  // this warpgroup's dO block
    scale_do_rows<T>(dOt, wt, nr, [&](int q) { return sc * mma::fexp(bo[q]); });  // dO row r *= scale e^{b_r}
    fence_async_smem();
    __syncthreads();
    if (wt == 0) {  // this warpgroup's st16 to dhbuf by TMA (map mdh, box {64, 64}: one slab a store)
      const int row = int((cg * a.H + h) * DK);
#pragma unroll
      for (int m = 0; m < M; ++m) tma_store_2d(&mdh, ra.st16 + m * kSweepTile, vb + 64 * wg, row + 64 * m);
      bulk_commit();
    }
    // (2) dVn = dvi + diag(e^{B-b}) K dS  (dvi: rows past nr are other rows', masked below)
    const uint32_t base = ra.s0 + st * L::kStage;
    const char* Dt = smem + st * L::kStage + 3 * L::kTile + (NW + wg) * kSweepTile;  // this warpgroup's dvi
    float x[32];
    wg_fence();
    // st16's and vt's addresses, opaque here: their descriptors are formed per chunk, not held
    uint32_t a16v = ra.a16, avtv = ra.avt;
    asm volatile("" : "+r"(a16v), "+r"(avtv));
    wgmma_chain<T, 64, 0, 1>(x, base + L::kTile, kChunk, a16v, DK, DK / 16);
    wg_commit();
    wg_wait<0>();
    fence_regs(x);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = rl + 8 * hf;
      const bool in = r < nr;
      const float wi = mma::fexp(B - bi[hf]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // -dVn
        const float2 uv = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(Dt + swz(kChunk, r, 8 * j + 2 * t)));
        const float y0 = in ? -(uv.x + wi * x[4 * j + 2 * hf]) : 0.f;
        const float y1 = in ? -(uv.y + wi * x[4 * j + 2 * hf + 1]) : 0.f;
        *reinterpret_cast<uint32_t*>(ra.vt + swz(kChunk, r, 8 * j + 2 * t)) = mma::pack2<T>(y0, y1);
      }
    }
    const float decay = mma::fexp(B);
    if (c > lo) load_u(c - 1);
    fence_async_smem();
    __syncthreads();
    // (3) dS = e^B dS + Q^T diag(scale e^b) dO - W^T dVn
    decay_then_accumulate(acc, decay, [&](float(&slab)[32], int m) {
      wgmma_chain<T, 64, 1, 1>(slab, base + m * kSweepTile, kChunk, base + 3 * L::kTile + wg * kSweepTile, kChunk,
                               kChunk / 16, true);
      wgmma_chain<T, 64, 1, 1>(slab, base + 2 * L::kTile + m * kSweepTile, kChunk, avtv, kChunk, kChunk / 16, true);
    });
  }
  store_state_slabs<M>(acc, a.dh0 ? a.dh0 + sidx : nullptr, a.dv, rl, vb + 64 * wg, t);
  if (wt == 0) bulk_wait<0>();  // the cotangent stores complete before the block exits
#else
  __trap();  // launched only where runs_sm90a() holds
#endif
}

}  // namespace

template <class T>
bool delta_sweep_sm90(const GlaArgs<T>& a, const T* W, const T* U, T* Vn, cudaStream_t s) {
  const int64_t tiles = int64_t(a.N) * a.H * (a.dv / 64);  // (sequence x head, 64 value columns)
  if (int64_t(a.nchunks) * a.H * a.dk > INT32_MAX) return false;  // hbuf's rows as TMA coordinates
  const int nw = heuristics::delta_sm90_sweep_warpgroups(tiles, a.dv % 128 == 0, device_info());
  return HILA_HEADDIM_SWITCH(a.dk, DK, [&] {
    auto run = [&](auto nw_c) -> bool {
      constexpr int NW = decltype(nw_c)::value;
      using L = Ring<DK, 2, 1, NW, true>;
      const int S = ring_stages<L>(tiles / NW, NW == 1 ? 2 : 1);
      if (S < 2) return false;
      return HILA_DELTA_STAGES_SWITCH(S, kS, [&] {
        auto kernel = delta_sweep_sm90_kernel<T, DK, kS, NW>;
        const size_t bytes = L::bytes(kS);
        CUtensorMap mw, mk, mu, mh = {};
        bool sw = false, sk = false, su = false;
        if (!input_map(&mw, sw, W, 0, 0, a.dk, a.H, a.Ttot) ||
            !input_map(&mk, sk, a.k, a.k_ld, a.k_hs, a.dk, src_heads(a, a.k_div), a.Ttot) ||
            !input_map(&mu, su, U, 0, 0, a.dv, a.H, a.Ttot) || (a.hbuf && !state_map(&mh, a, a.hbuf, 64)) ||
            !ready_sm90(kernel, bytes))
          return false;
        if (dry_run()) return true;  // dry run: workspace_size (no workspace of its own)
        kernel<<<dim3(unsigned(a.N * a.H), 1, unsigned(a.dv / (64 * NW))), kSm90Threads * NW, bytes, s>>>(
            mw, mk, mu, mh, unsigned(sw) | unsigned(sk) << 1 | unsigned(su) << 2, a, Vn);
        HILA_CUDA_CHECK_LAUNCH();
        return true;
      });
    };
    return nw == 2 ? run(std::integral_constant<int, 2>{}) : run(std::integral_constant<int, 1>{});
  });
}

template <class T>
bool delta_rsweep_sm90(const GlaArgs<T>& a, const T* W, const T* dvi, cudaStream_t s) {
  const int64_t tiles = int64_t(a.N) * a.H * (a.dv / 64);  // (sequence x head, 64 value columns)
  if (int64_t(a.nchunks) * a.H * a.dk > INT32_MAX) return false;  // dhbuf's rows as TMA coordinates
  return HILA_HEADDIM_SWITCH(a.dk, DK, [&] {
    using L1 = Ring<DK, 3, 2, 1, true>;
    using L2 = Ring<DK, 3, 2, 2, true>;
    const int nw = heuristics::delta_sm90_rsweep_warpgroups(tiles, a.dv % 128 == 0, device_info(), L1::kStage + 8,
                                                            L1::kFixed, L2::kStage + 8, L2::kFixed);
    auto run = [&](auto nw_c) -> bool {
      constexpr int NW = decltype(nw_c)::value;
      const int S = ring_stages<Ring<DK, 3, 2, NW, true>>(tiles / NW, NW == 1 ? 2 : 1);
      if (S < 2) return false;
      return HILA_DELTA_STAGES_SWITCH(S, kS, [&] {
        auto kernel = delta_rsweep_sm90_kernel<T, DK, kS, NW>;
        const size_t bytes = Ring<DK, 3, 2, NW, true>::bytes(kS);
        CUtensorMap mq, mk, mw, mdo, mdh, mdvi;
        bool sq = false, sk = false, sw = false, sd = false, su = false;
        if (!input_map(&mq, sq, a.q, a.q_ld, a.q_hs, a.dk, src_heads(a, a.q_div), a.Ttot) ||
            !input_map(&mk, sk, a.k, a.k_ld, a.k_hs, a.dk, src_heads(a, a.k_div), a.Ttot) ||
            !input_map(&mw, sw, W, 0, 0, a.dk, a.H, a.Ttot) ||
            !input_map(&mdo, sd, a.dO, a.dO_ld, a.dO_hs, a.dv, a.H, a.Ttot) || !state_map(&mdh, a, a.dhbuf, 64) ||
            !input_map(&mdvi, su, dvi, 0, 0, a.dv, a.H, a.Ttot) ||
            !ready_sm90(kernel, bytes))
          return false;
        if (dry_run()) return true;  // dry run: workspace_size (no workspace of its own)
        const unsigned order =
            unsigned(sq) | unsigned(sk) << 1 | unsigned(sw) << 2 | unsigned(sd) << 3 | unsigned(su) << 4;
        kernel<<<dim3(unsigned(a.N * a.H), 1, unsigned(a.dv / (64 * NW))), kSm90Threads * NW, bytes, s>>>(
            mq, mk, mw, mdo, mdh, mdvi, order, a);
        HILA_CUDA_CHECK_LAUNCH();
        return true;
      });
    };
    return nw == 2 ? run(std::integral_constant<int, 2>{}) : run(std::integral_constant<int, 1>{});
  });
}

#define HILA_INSTANTIATE(T)                                                                          \
  template bool delta_sweep_sm90<T>(const GlaArgs<T>&, const T*, const T*, T*, cudaStream_t); \
  template bool delta_rsweep_sm90<T>(const GlaArgs<T>&, const T*, const T*, cudaStream_t);
HILA_INSTANTIATE(__nv_bfloat16)
HILA_INSTANTIATE(__half)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda::gdn
