// SPDX-License-Identifier: Apache-2.0
// GLA kernels on Hopper (sm_90a): TMA loads and wgmma (sm90.cuh), in place of gla_tc.cu's
// portable ones where they apply: the state sweeps (sweep_sm90_kernel, below) and the backward
// chunk kernel. The latter has the math of gla_tc.cu's bwd_chunk_kernel (gla.cuh, HLA_SPEC §7.1),
// one warpgroup per (chunk, head):
//   P  = scale (Gamma o Q K^T)            dA = Gamma o (dO V^T)            [C,dk]x[dk,C], [C,dv]x[dv,C]
//   dQ^ = diag(e^b) dO Hp^T + dA K                                          [C,dv]x[dv,dk] + [C,C]x[C,dk]
//   dK = diag(w) V dH^T + scale dA^T Q^                                     [C,dv]x[dv,dk] + [C,C]x[C,dk]
//   dV = diag(w) K dH + P^T dO                                              [C,dk]x[dk,dv] + [C,C]x[C,dv]
//   dc = scale q^.dq^ - k.dk per row, w = e^{B-b}
// Every product is one m64nN wgmma chain (C = 64 rows = the warpgroup's M), operands in shared
// memory: the swizzled tiles serve K-major and, through the transpose flags, MN-major reads, so
// no tile is stored twice. Hp and dH share one buffer (dH lands once dQ has read Hp), which keeps
// the block at 112 KB for dk = dv = 128: two blocks per SM, one's loads under the other's math.
#include <cstdlib>
#include <cstring>

#include "cuda/gla/gla.cuh"
#include "cuda/loglinear/tree.cuh"
#include "cuda/prims/mma.cuh"
#include "cuda/runtime/runtime.cuh"
#include "cuda/prims/sm90.cuh"

namespace hila::cuda {

namespace {

constexpr int kSm90Threads = 128;  // one warpgroup

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
#endif

// Which sm_90a kernels may run: HILA_GLA_SM90 unset = all, where they are expected to be faster;
// 1 = all, wherever they apply; 0 = none (the portable kernels); a comma-separated list of
// "bwd", "sweep", "fwd" = only those (for measurements and tests).
bool sm90_enabled(const char* which) {
  const char* env = std::getenv("HILA_GLA_SM90");
  if (!env || std::strcmp(env, "1") == 0) return true;
  const size_t n = std::strlen(which);
  for (const char* p = env; *p;) {  // a comma-separated list of kernels
    const char* e = std::strchr(p, ',');
    const size_t len = e ? size_t(e - p) : std::strlen(p);
    if (len == n && std::strncmp(p, which, n) == 0) return true;
    if (!e) break;
    p = e + 1;
  }
  return false;
}
bool sm90_forced() {
  const char* env = std::getenv("HILA_GLA_SM90");
  return env && std::strcmp(env, "1") == 0;
}

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

// Shared memory: 16-bit swizzled tiles (sm90.cuh), then the gates and the two mbarriers.
template <int DK, int DV>
struct BwdSm90Layout {
  static constexpr uint32_t kQ = 0, kK = kQ + kChunk * DK * 2, kV = kK + kChunk * DK * 2, kdO = kV + kChunk * DV * 2,
                            kS = kdO + kChunk * DV * 2,  // Hp, then dH: [DK][DV]
      kP = kS + DK * DV * 2, kdA = kP + kChunk * kChunk * 2, kB = kdA + kChunk * kChunk * 2,
                            kBar = kB + kChunk * 4, kBytes = kBar + 16;
};

template <class T, int DK, int DV, bool kFold = false>
__global__ void __launch_bounds__(kSm90Threads, 2)
    bwd_chunk_sm90_kernel(const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                          const __grid_constant__ CUtensorMap mv, const __grid_constant__ CUtensorMap mdo,
                          const __grid_constant__ CUtensorMap mh, const __grid_constant__ CUtensorMap mdh,
                          unsigned order, GlaArgs<T> a) {
#if HILA_SM90A
  using L = BwdSm90Layout<DK, DV>;
  using namespace sm90;
  extern __shared__ __align__(1024) char smem[];
  const uint32_t s0 = smem_u32(smem);
  if (s0 & 1023) __trap();  // the swizzle needs 1024-byte aligned tiles
  float* bs = reinterpret_cast<float*>(smem + L::kB);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + L::kBar);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int64_t cg = blockIdx.x;
  const int h = blockIdx.y, seq = a.chunk_seq[cg];
  const int64_t c = cg - a.chunk0[seq], r0 = a.row0[seq] + c * a.C;
  const int nr = rows_in(a.len[seq], c, a.C);
  const int srow = int((cg * a.H + h) * DK);  // row of this chunk's state in hbuf / dhbuf [.., DV]
  if (tid == 0) {
    mbar_init(&bar[0], 1), mbar_init(&bar[1], 1);
    fence_barrier_init();
  }
  __syncthreads();
  if (tid == 0) {
    mbar_expect_tx(&bar[0], kChunk * (2 * DK + 2 * DV) * 2 + DK * DV * 2);  // Q, K, V, dO, Hp
    // bit i of `order`: input map i is swapped (input_map)
    auto in = [&](uint32_t off, const CUtensorMap* map, int i, int cb, int x) {
      load_rows(smem + off + cb * kChunk * 128, map, &bar[0], (order >> i) & 1, 64 * cb, r0, x);
    };
    for (int cb = 0; cb < DK / 64; ++cb) in(L::kQ, &mq, 0, cb, h / a.q_div), in(L::kK, &mk, 1, cb, h / a.k_div);
    for (int cb = 0; cb < DV / 64; ++cb) {
      in(L::kV, &mv, 2, cb, h / a.v_div), in(L::kdO, &mdo, 3, cb, h);
      tma_load_2d(smem + L::kS + cb * DK * 128, &mh, &bar[0], 64 * cb, srow);
    }
    // the fp32 rows the epilogue adds (GradOut::add: the earlier primitives' dq, dk of a
    // composition), into L2 now rather than one dependent load per element at the end; dv's add
    // written by this block's own dk is not ready yet
    const int64_t prow = int64_t(h) * a.Ttot + r0;
    if (a.dq_out.add) prefetch_l2(a.dq_out.add + prow * DK, uint32_t(nr * DK * 4));
    if (a.dk_out.add) prefetch_l2(a.dk_out.add + prow * DK, uint32_t(nr * DK * 4));
  }
  const float* bg = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  if (tid < kChunk) bs[tid] = gate_at(bg, r0, tid, nr);
  __syncthreads();
  mbar_wait(&bar[0], 0);
  if (nr < kChunk) {  // rows past the sequence hold the next one's tokens (or TMA's zeros): zero them
    for (int e = tid; e < (kChunk - nr) * 8; e += kSm90Threads) {
      const int r = nr + e / 8, q = e % 8;
      const uint4 z = make_uint4(0, 0, 0, 0);
      for (int cb = 0; cb < DK / 64; ++cb) {
        *reinterpret_cast<uint4*>(smem + L::kQ + cb * kChunk * 128 + r * 128 + q * 16) = z;
        *reinterpret_cast<uint4*>(smem + L::kK + cb * kChunk * 128 + r * 128 + q * 16) = z;
      }
      for (int cb = 0; cb < DV / 64; ++cb) {
        *reinterpret_cast<uint4*>(smem + L::kV + cb * kChunk * 128 + r * 128 + q * 16) = z;
        *reinterpret_cast<uint4*>(smem + L::kdO + cb * kChunk * 128 + r * 128 + q * 16) = z;
      }
    }
    fence_async_smem();
    __syncthreads();
  }
  const float sc = float(a.scale), B = bs[kChunk - 1];
  const int i0 = 16 * w + g, i1 = i0 + 8;
  const float bi0 = bs[i0], bi1 = bs[i1];
  // P and dA: [C,dk]x[dk,C] and [C,dv]x[dv,C], masked and gated, to shared memory (16-bit)
  {
    float x[32], y[32];
    wg_fence();
    wgmma_chain<T, 64, 0, 0>(x, s0 + L::kQ, kChunk, s0 + L::kK, kChunk, DK / 16);
    wgmma_chain<T, 64, 0, 0>(y, s0 + L::kdO, kChunk, s0 + L::kV, kChunk, DV / 16);
    wg_commit();
    wg_wait<0>();
    fence_regs(x), fence_regs(y);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0, col = 8 * j + 2 * t;
        const float bi = hf ? bi1 : bi0;
        const bool in = i < nr;
        const float g0 = in && col <= i ? tc::fexp(bi - bs[col]) : 0.f;
        const float g1 = in && col + 1 <= i ? tc::fexp(bi - bs[col + 1]) : 0.f;
        const uint32_t off = swz(kChunk, i, col);
        *reinterpret_cast<uint32_t*>(smem + L::kP + off) =
            tc::pack2<T>(x[4 * j + 2 * hf] * sc * g0, x[4 * j + 2 * hf + 1] * sc * g1);
        *reinterpret_cast<uint32_t*>(smem + L::kdA + off) =
            tc::pack2<T>(y[4 * j + 2 * hf] * g0, y[4 * j + 2 * hf + 1] * g1);
      }
    fence_async_smem();
    __syncthreads();
  }
  const int64_t rowbase = int64_t(h) * a.Ttot + r0;
  // acc (N columns, the wgmma fragment) of rows < nr to the fp32 per-head buffer out [H][Ttot][N]
  // or the caller's tensor (GradOut; store_grad2)
  auto store = [&](float* out, const GradOut<T>& gt, const auto& acc) {
    constexpr int N = int(sizeof(acc) / sizeof(float)) * 2;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0;
        if (i < nr)
          store_grad2(out, N, gt, h, r0 + i, rowbase + i, 8 * j + 2 * t, acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
      }
  };
  // sum over this thread's columns of acc o X for rows i0 (d0) and i1 (d1); X a swizzled [C][N] tile
  auto dot_rows = [&](const auto& acc, uint32_t X, float& d0, float& d1) {
    constexpr int N = int(sizeof(acc) / sizeof(float)) * 2;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      const float2 x0 = tc::unpack2<T>(*reinterpret_cast<const uint32_t*>(smem + X + swz(kChunk, i0, 8 * j + 2 * t)));
      const float2 x1 = tc::unpack2<T>(*reinterpret_cast<const uint32_t*>(smem + X + swz(kChunk, i1, 8 * j + 2 * t)));
      d0 += acc[4 * j] * x0.x + acc[4 * j + 1] * x0.y;
      d1 += acc[4 * j + 2] * x1.x + acc[4 * j + 3] * x1.y;
    }
  };
  // acc <- diag(f_row) acc + s acc2 (rows i0, i1)
  auto combine = [&](auto& acc, const auto& acc2, float f0, float f1, float s) {
    constexpr int N = int(sizeof(acc) / sizeof(float)) * 2;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      acc[4 * j] = acc[4 * j] * f0 + s * acc2[4 * j], acc[4 * j + 1] = acc[4 * j + 1] * f0 + s * acc2[4 * j + 1];
      acc[4 * j + 2] = acc[4 * j + 2] * f1 + s * acc2[4 * j + 2];
      acc[4 * j + 3] = acc[4 * j + 3] * f1 + s * acc2[4 * j + 3];
    }
  };
  float dc0 = 0.f, dc1 = 0.f;  // this thread's partial dc of rows i0, i1
  {  // dQ^ = diag(e^b) dO Hp^T + dA K: B = Hp K-major [dk][dv], K read MN-major
    float acc[DK / 2], acc2[DK / 2];
    wgmma_pair<T, DK, 0, 0, 0, 1>(acc, s0 + L::kdO, kChunk, s0 + L::kS, DK, DV / 16, acc2, s0 + L::kdA, s0 + L::kK);
    __syncthreads();  // Hp read by every warp: dH may overwrite it
    if (tid == 0) {
      mbar_expect_tx(&bar[1], DK * DV * 2);  // dH
      for (int cb = 0; cb < DV / 64; ++cb) tma_load_2d(smem + L::kS + cb * DK * 128, &mdh, &bar[1], 64 * cb, srow);
    }
    combine(acc, acc2, tc::fexp(bi0), tc::fexp(bi1), 1.f);
    store(a.dq, a.dq_out, acc);
    float d0 = 0.f, d1 = 0.f;
    dot_rows(acc, L::kQ, d0, d1);
    dc0 += sc * d0, dc1 += sc * d1;
  }
  const float w0 = tc::fexp(B - bi0), w1 = tc::fexp(B - bi1);
  constexpr bool fold = kFold;  // the value is the key (a.value_is_key): dk gains dv, no dv written
  static_assert(!kFold || DK == DV, "the value is the key only when dk = dv");
  mbar_wait(&bar[1], 0);
  {  // dK = diag(w) V dH^T + scale dA^T Q^: dH K-major [dk][dv]; dA and Q read MN-major
    float acc[DK / 2], acc2[DK / 2];
    wgmma_pair<T, DK, 0, 0, 1, 1>(acc, s0 + L::kV, kChunk, s0 + L::kS, DK, DV / 16, acc2, s0 + L::kdA, s0 + L::kQ);
    combine(acc, acc2, w0, w1, sc);
    float d0 = 0.f, d1 = 0.f;
    dot_rows(acc, L::kK, d0, d1);  // dc reads the key-role gradient alone
    dc0 -= d0, dc1 -= d1;
    if constexpr (fold) {  // dK + dV, dV = diag(w) K dH + P^T dO: P^T dO added into acc in place
      wg_fence();
      wgmma_chain<T, DK, 0, 1>(acc2, s0 + L::kK, kChunk, s0 + L::kS, DK, DK / 16);
      wgmma_chain<T, DK, 1, 1>(acc, s0 + L::kP, kChunk, s0 + L::kdO, kChunk, kChunk / 16, true);
      wg_commit();
      wg_wait<0>();
      fence_regs(acc), fence_regs(acc2);
      combine(acc2, acc, w0, w1, 1.f);
      store(a.dk_, a.dk_out, acc2);
    } else {
      store(a.dk_, a.dk_out, acc);
    }
  }
  if constexpr (!fold) {  // dV = diag(w) K dH + P^T dO: dH read MN-major ([dk][dv], dv contiguous); P and dO MN-major
    float acc[DV / 2], acc2[DV / 2];
    wgmma_pair<T, DV, 0, 1, 1, 1>(acc, s0 + L::kK, kChunk, s0 + L::kS, DK, DK / 16, acc2, s0 + L::kP, s0 + L::kdO);
    combine(acc, acc2, w0, w1, 1.f);
    store(a.dv_, a.dv_out, acc);
  }
  dc0 += __shfl_xor_sync(0xffffffffu, dc0, 1), dc0 += __shfl_xor_sync(0xffffffffu, dc0, 2);
  dc1 += __shfl_xor_sync(0xffffffffu, dc1, 1), dc1 += __shfl_xor_sync(0xffffffffu, dc1, 2);
  if (t == 0) {
    if (i0 < nr) a.dg[rowbase + i0] = dc0;
    if (i1 < nr) a.dg[rowbase + i1] = dc1;
  }
#else
  __trap();  // launched only where runs_sm90a() holds
#endif
}


// The state sweep on Hopper (same math as gla_tc.cu's sweep_kernel, HLA_SPEC §7.1): one
// warpgroup per (sequence x head, 64-row dk tile, 64-column dv tile) walks the chunks with its
// [64, 64] fp32 state in wgmma accumulators. Per chunk (forward: key K, value V, w = e^{B-b};
// reverse: key Q, value dO, w = scale e^b, chunks in reverse order):
//   store the state (16-bit, hbuf / dhbuf), then  S <- e^B S + (key o w)^T value   [64,C]x[C,64]
// with (key o w)^T as register A fragments (ldmatrix.trans of the swizzled key tile, scaled by
// w) and the value tile read MN-major by wgmma. Key and value tiles arrive by TMA, the gates by
// cp.async, into a ring of S stages: while chunk i's wgmmas run, chunk i+1's fragments are
// formed (two fragment sets) and chunks up to i+S-1 are in flight. The stored states after the
// first leave by TMA (map mst, box {64, 64}): once chunk i's wgmmas are done its stage is free
// until chunk i+S refills it (issued one step later), so the 16-bit state entering chunk i+1 is
// written there (swizzled), and one thread stores it after a barrier; the refill waits for that
// store to have read the stage.
constexpr uint32_t kSweepTile = kChunk * 64 * 2;  // one swizzled [C, 64] 16-bit block

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
// a stage: the key block and NV/64 value blocks; the stages' gates [S][C] fp32 and mbarriers follow
constexpr uint32_t sweep_stage(int nv) { return (1 + nv / 64) * kSweepTile; }
constexpr uint32_t sweep_bytes(int stages, int nv) { return stages * (sweep_stage(nv) + kChunk * 4 + 8); }

// kTree: the log-linear tree build (ll_tree.cuh, as gla_tc.cu's sweep_kernel<kTree>): per full
// chunk c the accumulators hold Z_c = (K o w)^T V (zeroed instead of decayed), and tree_close merges
// them into the nodes with the per-thread fp32 level stack (lstk levels per block).
template <class T, bool kRev, int S, int NV, bool kTree = false>
__global__ void __launch_bounds__(kSm90Threads)
    sweep_sm90_kernel(const __grid_constant__ CUtensorMap mkey, const __grid_constant__ CUtensorMap mval,
                      const __grid_constant__ CUtensorMap mst, unsigned order, GlaArgs<T> a, TreeArgs ta,
                      float* stack, int lstk) {
  static_assert(S >= 3, "a stage in the wgmma, one being formed and the refill target");
  static_assert(NV == 64 || NV == 128, "value tile of 64 or 128 columns");
  static_assert(!kTree || (!kRev && NV == 64), "the tree build: forward, one 64 x 64 tile per block");
  constexpr uint32_t kStage = sweep_stage(NV);
#if HILA_SM90A
  using namespace sm90;
  extern __shared__ __align__(1024) char smem[];
  const uint32_t s0 = smem_u32(smem);
  if (s0 & 1023) __trap();  // the swizzle needs 1024-byte aligned tiles
  float* gates = reinterpret_cast<float*>(smem + S * kStage);                      // [S][C]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S * (kStage + kChunk * 4));  // [S]
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int k0 = blockIdx.y * 64, v0 = blockIdx.z * NV;
  const int64_t len = a.len[seq], row0 = a.row0[seq];
  const int kx = kRev ? h / a.q_div : h / a.k_div, vx = kRev ? h : h / a.v_div;  // source heads
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const int64_t sidx = (int64_t(seq) * a.H + h) * a.dk * a.dv;  // [N][H][dk][dv]
  const float* init = kTree ? nullptr : kRev ? a.dht : a.h0;  // kTree: a.h0 is Fenwick (ta.h0 seeds the tree)
  float* fin = kTree ? nullptr : kRev ? a.dh0 : a.ht;
  T* store = kTree ? nullptr : kRev ? a.dhbuf : a.hbuf;
  const int r_lo = k0 + 16 * w + g;  // state rows r_lo, r_lo + 8; columns v0 + 8j + 2t (+1): acc[4j + 2hf + e]
  float acc[NV / 2];
#pragma unroll
  for (int j = 0; j < NV / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc[4 * j + e] = init ? init[sidx + int64_t(r_lo + 8 * (e >> 1)) * a.dv + v0 + 8 * j + 2 * t + (e & 1)] : 0.f;
  const int nch = int(kTree ? len / a.C : (len + a.C - 1) / a.C);  // kTree: full chunks only
  auto chunk_of = [&](int i) { return kRev ? nch - 1 - i : i; };
  // kTree: the thread's elements (j, e) of ll_tree.cuh's layout are acc[4j + e]
  auto at = [&](int j, int e) -> float& { return acc[4 * j + e]; };
  const TreeStack<kSm90Threads> stk(stack, lstk);  // kTree only (lstk = 0 otherwise)
  [[maybe_unused]] SeqNodes sn;
  if constexpr (kTree) {
    sn = seq_nodes(ta, a.chunk0, seq, (len + a.C - 1) / a.C);
    if (sn.nc > 0) tree_seed<T>(ta, sn, stk, lstk, seq, h, a.H, a.dk, a.dv, r_lo, v0 + 2 * t, true, 8, at);
  }
  init_ring(full, S, tid);
  // chunk i -> stage i % S (every thread commits one cp.async group per call)
  auto issue = [&](int i) {
    if (i >= nch) return tc::cp_async_commit();
    const int c = chunk_of(i), st = i % S;
    const int64_t r0 = row0 + int64_t(c) * a.C;
    char* base = smem + st * kStage;
    if (tid == 0) {
      if (store) bulk_wait_read<0>();  // a state stored from this stage (below) has been read
      fence_async_smem();  // this stage's earlier generic accesses before the async-proxy refill
      mbar_expect_tx(&full[st], kStage);
      load_rows(base, &mkey, &full[st], order & 1, k0, r0, kx);
      for (int cb = 0; cb < NV / 64; ++cb)
        load_rows(base + (1 + cb) * kSweepTile, &mval, &full[st], (order >> 1) & 1, v0 + 64 * cb, r0, vx);
    }
    tc::async_gates<kChunk>(gates + st * kChunk, b, r0, rows_in(len, c, a.C), a.row0);
    tc::cp_async_commit();
  };
  for (int i = 0; i < S - 2; ++i) issue(i);
  const float sc = float(a.scale);
  // chunk i's operands have landed: refill the stage of chunk i-2 (its wgmmas are complete) with
  // chunk i+S-2, then form (key o w)^T fragments fa (rows 16w.. of the tile's 64 key columns,
  // tokens 16kk..) and the decay e^B
  auto prep = [&](int i, uint32_t(&fa)[4][4], float& decay) {
    const int c = chunk_of(i), st = i % S, nr = rows_in(len, c, a.C);
    tc::cp_async_wait<S - 3>();
    mbar_wait(&full[st], (i / S) & 1);
    __syncthreads();  // every thread's gates of chunk i; chunk i-2's stage is free
    issue(i + S - 2);
    char* base = smem + st * kStage;
    const float* bt = gates + st * kChunk;
    if (nr < kChunk) {  // value rows past the sequence (the next one's, or TMA's zeros): zero
      for (int e = tid; e < (kChunk - nr) * 8; e += kSm90Threads)
#pragma unroll
        for (int cb = 0; cb < NV / 64; ++cb)
          *reinterpret_cast<uint4*>(base + (1 + cb) * kSweepTile + (nr + e / 8) * 128 + (e % 8) * 16) =
              make_uint4(0, 0, 0, 0);
      fence_async_smem();
      __syncthreads();
    }
    const float B = bt[nr - 1];
    decay = tc::fexp(B);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int row = 16 * kk + (lane & 7) + ((lane >> 4) << 3), col = 16 * w + (((lane >> 3) & 1) << 3);
      tc::ldsm_x4_t(fa[kk], base + swz(kChunk, row, col));
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int k = 16 * kk + 2 * t + 8 * hf;
        const float w0 = kRev ? sc * tc::fexp(bt[k]) : tc::fexp(B - bt[k]);
        const float w1 = kRev ? sc * tc::fexp(bt[k + 1]) : tc::fexp(B - bt[k + 1]);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const float2 x = tc::unpack2<T>(fa[kk][2 * hf + m]);
          fa[kk][2 * hf + m] = tc::pack2<T>(k < nr ? x.x * w0 : 0.f, k + 1 < nr ? x.y * w1 : 0.f);
        }
      }
    }
  };
  const int64_t cstride = int64_t(a.H) * a.dk * a.dv;
  T* const store_base = store ? store + (a.chunk0[seq] * a.H + h) * int64_t(a.dk) * a.dv + int64_t(r_lo) * a.dv + v0 + 2 * t
                              : nullptr;
  // chunk i with fragments fa / decay; forms chunk i+1's into fb / db meanwhile
  auto step = [&](int i, uint32_t(&fa)[4][4], float decay, uint32_t(&fb)[4][4], float& db) {
    if (store_base && i == 0) {  // state entering chunk c (forward) / cotangent at its end (reverse)
      T* dst = store_base + chunk_of(i) * cstride;
#pragma unroll
      for (int j = 0; j < NV / 8; ++j) {
        *reinterpret_cast<uint32_t*>(dst + 8 * j) = tc::pack2<T>(acc[4 * j], acc[4 * j + 1]);
        *reinterpret_cast<uint32_t*>(dst + 8 * a.dv + 8 * j) = tc::pack2<T>(acc[4 * j + 2], acc[4 * j + 3]);
      }
    }
#pragma unroll
    for (int e = 0; e < NV / 2; ++e) acc[e] = kTree ? 0.f : acc[e] * decay;
    wg_fence();
    const uint32_t vt = s0 + (i % S) * kStage + kSweepTile;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<T, NV, 1>(acc, fa[kk], desc_mn(vt, kChunk, kk), true);
    wg_commit();
    if (i + 1 < nch) prep(i + 1, fb, db);
    wg_wait<0>();
    fence_regs(acc);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) fence_regs(fa[kk]);  // the wgmmas read fa until here
    if constexpr (kTree) tree_close<T>(ta, sn, stk, chunk_of(i), h, a.H, a.dk, a.dv, r_lo, v0 + 2 * t, true, 8, at);
    if (store && i + 1 < nch) {  // the state of chunk i+1 by TMA from chunk i's stage (see above)
      char* stg = smem + (i % S) * kStage;  // [64 rows][NV] swizzled: the key tile, then value tiles
#pragma unroll
      for (int j = 0; j < NV / 8; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          *reinterpret_cast<uint32_t*>(stg + swz(64, 16 * w + g + 8 * hf, 8 * j + 2 * t)) =
              tc::pack2<T>(acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
      fence_async_smem();
      __syncthreads();
      if (tid == 0) {
        const int row = int(((a.chunk0[seq] + chunk_of(i + 1)) * a.H + h) * a.dk + k0);
        for (int cb = 0; cb < NV / 64; ++cb) tma_store_2d(&mst, stg + cb * kSweepTile, v0 + 64 * cb, row);
        bulk_commit();
      }
    }
  };
  uint32_t fa0[4][4], fa1[4][4];
  float d0 = 1.f, d1 = 1.f;
  if (nch > 0) prep(0, fa0, d0);
  for (int i = 0; i < nch; i += 2) {
    step(i, fa0, d0, fa1, d1);
    if (i + 1 < nch) step(i + 1, fa1, d1, fa0, d0);
  }
  if (fin) store_state_frag<NV>(acc, fin + sidx, a.dv, r_lo, v0, t);
  if constexpr (kTree)
    if (ta.pend) tree_pending(ta, sn, stk, lstk, nch, seq, h, a.H, a.dk, a.dv, r_lo, v0 + 2 * t, 8);
  if (store && tid == 0) bulk_wait<0>();  // the state stores complete before the block exits
#else
  __trap();  // launched only where runs_sm90a() holds
#endif
}


// The GLA forward in one kernel on Hopper (same math and grid as gla_tc.cu's fused_forward_kernel,
// HLA_SPEC §1): one warpgroup per (sequence x head, 64 value columns) walks the chunks with the
// [dk, 64] fp32 state H in wgmma accumulators (dk / 64 slabs of m64). Per chunk i:
//   S  = Q K^T                                   SS, [C,dk]x[dk,C]
//   Oq = Q H_i                                   SS, [C,dk]x[dk,64]; H_i's 16-bit copy in smem (MN-major)
//   H  <- e^B H + (K o w)^T V,  w = e^{B-b}      RS per slab, [64,C]x[C,64]
//   P  = scale Gamma o S  (registers: the accumulator fragment is the A fragment of the next wgmma)
//   O  = diag(scale e^b) Oq + P V                RS, [C,C]x[C,64]
// Q, K, V tiles by TMA, two stages (chunk i+1 lands while chunk i computes), the gates by
// cp.async; the 16-bit copy of the state entering chunk i+1 goes to the other of two buffers.
// When the caller asks for the per-chunk states (a.hbuf), one TMA store per chunk copies the
// buffer there (tensor map mh, as the backward chunk kernel's) once the loop head's barrier has
// seen it written; the head of the next chunk waits for that store to have read it.
// Shared memory at dk = 128: 2 x 40 KB stages + 2 x 16 KB state copies = 112.5 KB, 2 blocks per SM.
constexpr int kFwdStages = 2;
template <int DK>
struct FwdSm90Layout {
  static constexpr uint32_t kQ = 0, kK = kChunk * DK * 2, kV = 2 * kChunk * DK * 2, kStage = kV + kChunk * 64 * 2,
                            kH = kFwdStages * kStage,                                     // [2][DK][64]
      kB = kH + 2 * DK * 64 * 2, kBar = kB + kFwdStages * kChunk * 4, kBytes = kBar + 8 * kFwdStages;
};

template <class T, int DK>
__global__ void __launch_bounds__(kSm90Threads, 2)
    fused_forward_sm90_kernel(const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                              const __grid_constant__ CUtensorMap mv, const __grid_constant__ CUtensorMap mh,
                              unsigned order, GlaArgs<T> a) {
  using L = FwdSm90Layout<DK>;
  static_assert(L::kQ == 0 && L::kK % 1024 == 0 && L::kStage % 1024 == 0, "1024-aligned swizzled tiles");
#if HILA_SM90A
  using namespace sm90;
  constexpr int kSlabs = DK / 64;
  extern __shared__ __align__(1024) char smem[];
  const uint32_t s0 = smem_u32(smem);
  if (s0 & 1023) __trap();  // the swizzle needs 1024-byte aligned tiles
  float* gates = reinterpret_cast<float*>(smem + L::kB);     // [stages][C]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBar);  // [stages]
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H, v0 = blockIdx.y * 64;
  const int64_t len = a.len[seq], row0 = a.row0[seq], chunk0 = a.chunk0[seq];
  const int nch = int((len + a.C - 1) / a.C);
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const int64_t sidx = (int64_t(seq) * a.H + h) * DK * a.dv;  // [N][H][dk][dv]
  // state: slab m, rows 64m + 16w + g (+8), columns v0 + 8j + 2t (+1): acc[m][4j + 2hf + e]
  float acc[kSlabs][32];
#pragma unroll
  for (int m = 0; m < kSlabs; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[m][4 * j + e] =
            a.h0 ? a.h0[sidx + int64_t(64 * m + 16 * w + g + 8 * (e >> 1)) * a.dv + v0 + 8 * j + 2 * t + (e & 1)] : 0.f;
  init_ring(full, kFwdStages, tid);
  // chunk i -> stage i % 2 (every thread commits one cp.async group per call)
  auto issue = [&](int i) {
    if (i >= nch) return tc::cp_async_commit();
    const int st = i % kFwdStages;
    const int64_t r0 = row0 + int64_t(i) * a.C;
    char* base = smem + st * L::kStage;
    if (tid == 0) {
      fence_async_smem();  // this stage's earlier generic accesses before the async-proxy refill
      mbar_expect_tx(&full[st], L::kStage);
      for (int cb = 0; cb < kSlabs; ++cb) {
        load_rows(base + L::kQ + cb * kSweepTile, &mq, &full[st], order & 1, 64 * cb, r0, h / a.q_div);
        load_rows(base + L::kK + cb * kSweepTile, &mk, &full[st], (order >> 1) & 1, 64 * cb, r0, h / a.k_div);
      }
      load_rows(base + L::kV, &mv, &full[st], (order >> 2) & 1, v0, r0, h / a.v_div);
    }
    tc::async_gates<kChunk>(gates + st * kChunk, b, r0, rows_in(len, i, a.C), a.row0);
    tc::cp_async_commit();
  };
  // the state entering chunk i, 16-bit: into buffer i % 2 ([DK][64], swizzled)
  auto put_state = [&](int i) {
    char* dst = smem + L::kH + (i & 1) * DK * 128;
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = 64 * m + 16 * w + g + 8 * hf, col = 8 * j + 2 * t;
          *reinterpret_cast<uint32_t*>(dst + swz(DK, r, col)) =
              tc::pack2<T>(acc[m][4 * j + 2 * hf], acc[m][4 * j + 2 * hf + 1]);
        }
    fence_async_smem();  // read by the next chunk's wgmma after the loop-head barrier
  };
  if (nch > 0) {
    issue(0);
    put_state(0);
  }
  const float sc = float(a.scale);
  const int i0 = 16 * w + g, i1 = i0 + 8;  // output rows of this thread
  T* out = a.o + h * head_stride(a.o_hs, a.Ttot, a.dv) + v0 + 2 * t;
  const int64_t ldo = row_ld(a.o_ld, a.dv);
  for (int i = 0; i < nch; ++i) {
    const int st = i % kFwdStages, nr = rows_in(len, i, a.C);
    tc::cp_async_wait<0>();
    mbar_wait(&full[st], (i / kFwdStages) & 1);
    if (a.hbuf && tid == 0) bulk_wait_read<0>();  // H copy i-1 stored: its buffer is copy i+1's
    __syncthreads();  // chunk i's gates; chunk i-1 is done with the stage refilled next; H copy i written
    if (a.hbuf && tid == 0) {  // H copy i -> a.hbuf (rows of chunk i, head h: [DK] x columns v0..)
      tma_store_2d(&mh, smem + L::kH + (i & 1) * DK * 128, v0, int(((chunk0 + i) * a.H + h) * DK));
      bulk_commit();
    }
    issue(i + 1);
    const uint32_t base = s0 + st * L::kStage;
    const float* bt = gates + st * kChunk;
    if (nr < kChunk) {  // value rows past the sequence (the next one's, or TMA's zeros): zero
      for (int e = tid; e < (kChunk - nr) * 8; e += kSm90Threads)
        *reinterpret_cast<uint4*>(smem + st * L::kStage + L::kV + (nr + e / 8) * 128 + (e % 8) * 16) =
            make_uint4(0, 0, 0, 0);
      fence_async_smem();
      __syncthreads();
    }
    // H <- e^B H first: the state's registers are read before any wgmma of this chunk is in flight
    // (read with S and Q H in flight, ptxas injected a warpgroup.wait there: C7517)
    const float B = bt[nr - 1], decay = tc::fexp(B);
#pragma unroll
    for (int m = 0; m < kSlabs; ++m) {
#pragma unroll
      for (int e = 0; e < 32; ++e) acc[m][e] *= decay;
    }
    float sacc[32], oq[32], opv[32];
    wg_fence();
    wgmma_chain<T, 64, 0, 0>(sacc, base + L::kQ, kChunk, base + L::kK, kChunk, DK / 16);  // S = Q K^T
    wg_commit();
    wgmma_chain<T, 64, 0, 1>(oq, base + L::kQ, kChunk, s0 + L::kH + (i & 1) * DK * 128, DK, DK / 16);  // Q H_i
    wg_commit();
    // H += (K o w)^T V: slab m = key columns 64m.., (K o w)^T fragments by ldmatrix.trans
    uint32_t fa[kSlabs][4][4];
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const int row = 16 * kk + (lane & 7) + ((lane >> 4) << 3), col = 16 * w + (((lane >> 3) & 1) << 3);
        tc::ldsm_x4_t(fa[m][kk], smem + st * L::kStage + L::kK + m * kSweepTile + swz(kChunk, row, col));
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int k = 16 * kk + 2 * t + 8 * hf;
          const float w0 = tc::fexp(B - bt[k]), w1 = tc::fexp(B - bt[k + 1]);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float2 x = tc::unpack2<T>(fa[m][kk][2 * hf + e]);
            fa[m][kk][2 * hf + e] = tc::pack2<T>(k < nr ? x.x * w0 : 0.f, k + 1 < nr ? x.y * w1 : 0.f);
          }
        }
      }
    wg_fence();
#pragma unroll
    for (int m = 0; m < kSlabs; ++m)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs<T, 64, 1>(acc[m], fa[m][kk], desc_mn(base + L::kV, kChunk, kk), true);
    wg_commit();
    wg_wait<2>();  // S
    fence_regs(sacc);
    // P = scale Gamma o S (rows i0, i1; columns 8j + 2t) packed as the A fragments of P V
    uint32_t pa[4][4];
    const float bi0 = bt[i0], bi1 = bt[i1];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0, col = 8 * j + 2 * t;
        const float bi = hf ? bi1 : bi0;
        const float p0 = col <= i && i < nr ? sacc[4 * j + 2 * hf] * sc * tc::fexp(bi - bt[col]) : 0.f;
        const float p1 = col + 1 <= i && i < nr ? sacc[4 * j + 2 * hf + 1] * sc * tc::fexp(bi - bt[col + 1]) : 0.f;
        pa[j >> 1][2 * (j & 1) + hf] = tc::pack2<T>(p0, p1);  // k step j/2: a0/a1 (k 2t..), a2/a3 (k 2t+8..)
      }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<T, 64, 1>(opv, pa[kk], desc_mn(base + L::kV, kChunk, kk), kk > 0);
    wg_commit();
    wg_wait<0>();
    fence_regs(oq), fence_regs(opv);
#pragma unroll
    for (int m = 0; m < kSlabs; ++m) {
      fence_regs(acc[m]);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) fence_regs(fa[m][kk]);
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) fence_regs(pa[kk]);
    // O = diag(scale e^b) Q H + P V, rows < nr
    const int64_t r0 = row0 + int64_t(i) * a.C;
    const float e0 = sc * tc::fexp(bi0), e1 = sc * tc::fexp(bi1);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = hf ? i1 : i0;
        const float f = hf ? e1 : e0;
        if (r < nr)
          *reinterpret_cast<uint32_t*>(out + (r0 + r) * ldo + 8 * j) =
              tc::pack2<T>(f * oq[4 * j + 2 * hf] + opv[4 * j + 2 * hf], f * oq[4 * j + 2 * hf + 1] + opv[4 * j + 2 * hf + 1]);
      }
    if (i + 1 < nch) put_state(i + 1);
  }
  if (a.hbuf && tid == 0) bulk_wait<0>();  // the state stores complete before the block exits
  if (a.ht)
#pragma unroll
    for (int m = 0; m < kSlabs; ++m) store_state_frag<64>(acc[m], a.ht + sidx, a.dv, 64 * m + 16 * w + g, v0, t);
#else
  __trap();  // launched only where runs_sm90a() holds
#endif
}

// An sm_90a kernel readied for launch with `bytes` of shared memory and the max-shared carveout;
// false where this device does not run the build's sm_90a code.
template <class K>
bool ready_sm90(K kernel, size_t bytes) {
  if (!sm90::runs_sm90a(reinterpret_cast<const void*>(kernel))) return false;
  set_smem(kernel, bytes);
  HILA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                       int(cudaSharedmemCarveoutMaxShared)));
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

// Per-chunk 16-bit states (hbuf, dhbuf: [nchunks][H][dk][dv]) as a 2-d tensor map [nchunks*H*dk][dv],
// box {64 columns, rows}: rows = dk, one chunk's and head's rows, or 64, a slab of them.
template <class T>
bool state_map(CUtensorMap* map, const GlaArgs<T>& a, const T* p, int rows) {
  const uint64_t dims[2] = {uint64_t(a.dv), uint64_t(a.nchunks * a.H * a.dk)}, strides[1] = {uint64_t(a.dv)};
  const uint32_t box[2] = {64, uint32_t(rows)};
  return sm90::encode_tile_map(map, std::is_same_v<T, __half>, p, 2, dims, strides, box);
}

}  // namespace

template <class T>
bool tc_bwd_chunk_sm90(const GlaArgs<T>& a, cudaStream_t stream) {
  if (!sm90_enabled("bwd")) return false;
  const int dk = a.dk, dv = a.dv;
  if ((dk != 64 && dk != 128) || (dv != 64 && dv != 128) || !a.hbuf || !a.dhbuf) return false;
  // TMA coordinates are 32-bit
  if (a.Ttot + kChunk >= (int64_t(1) << 31) || (a.nchunks * a.H + 1) * dk >= (int64_t(1) << 31)) return false;
  auto pick = [&](auto kernel, size_t bytes) -> bool {
    if (!ready_sm90(kernel, bytes)) return false;
    if (dry_run()) return true;  // dry run: workspace_size (no workspace either way)
    // q, k, v, dO: input_map; hbuf, dhbuf: state_map
    CUtensorMap m[6];
    unsigned order = 0;
    bool sw_do = false;
    if (!qkv_maps(a, m, order) || !input_map(&m[3], sw_do, a.dO, a.dO_ld, a.dO_hs, dv, a.H, a.Ttot) ||
        !state_map(&m[4], a, a.hbuf, dk) || !state_map(&m[5], a, a.dhbuf, dk))
      return false;
    order |= unsigned(sw_do) << 3;
    kernel<<<dim3(unsigned(a.nchunks), unsigned(a.H)), kSm90Threads, bytes, stream>>>(m[0], m[1], m[2], m[3], m[4],
                                                                                       m[5], order, a);
    HILA_CUDA_CHECK_LAUNCH();
    return true;
  };
  if (a.value_is_key)  // dk = dv
    return dk == 128 ? pick(bwd_chunk_sm90_kernel<T, 128, 128, true>, BwdSm90Layout<128, 128>::kBytes)
                     : pick(bwd_chunk_sm90_kernel<T, 64, 64, true>, BwdSm90Layout<64, 64>::kBytes);
  if (dk == 128 && dv == 128) return pick(bwd_chunk_sm90_kernel<T, 128, 128>, BwdSm90Layout<128, 128>::kBytes);
  if (dk == 128) return pick(bwd_chunk_sm90_kernel<T, 128, 64>, BwdSm90Layout<128, 64>::kBytes);
  if (dv == 128) return pick(bwd_chunk_sm90_kernel<T, 64, 128>, BwdSm90Layout<64, 128>::kBytes);
  return pick(bwd_chunk_sm90_kernel<T, 64, 64>, BwdSm90Layout<64, 64>::kBytes);
}

template bool tc_bwd_chunk_sm90<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, cudaStream_t);
template bool tc_bwd_chunk_sm90<__half>(const GlaArgs<__half>&, cudaStream_t);

namespace {
// The launch behind tc_sweep_sm90 and tc_tree_sweep_sm90 (tree set: the forward tree build).
template <class T>
bool sweep_sm90(const GlaArgs<T>& a, bool reverse, cudaStream_t stream, const TreeArgs* tree, float* stack, int lstk) {
  static_assert(kSm90Threads == 128, "the tree stack is sized for 128 threads per block (tc_tree_sweep_stack)");
  if (!sm90_enabled("sweep") || a.dk % 64 || a.dv % 64 || a.Ttot + kChunk >= (int64_t(1) << 31) ||
      (a.nchunks * a.H + 1) * a.dk >= (int64_t(1) << 31))  // TMA coordinates are 32-bit
    return false;
  // Value tiles of 64 columns: 128 (the key tile read once for both halves, 2 blocks per SM) was
  // slower on the H200 at B=8, T=4K (forward / reverse sweep 282 / 287 us against 258 / 254).
  // Few blocks: the portable sweep, which halves its value tile to double them (B=1, T=64K, 64
  // blocks: gla forward 1.37 ms here against 1.31; at 128 blocks this one wins, 0.52 against
  // 0.63 ms at B=2, T=16K). HILA_GLA_SM90=1 takes this sweep at any block count (tests).
  constexpr int NV = 64;
  const int64_t sms = sm_count(), blocks = int64_t(a.N) * a.H * (a.dk / 64) * (a.dv / NV);
  if (4 * blocks < 3 * sms && !sm90_forced()) return false;
  // ring depth: the deepest that still fits all blocks in one wave, at least 3
  const int64_t per_sm = (blocks + sms - 1) / sms;
  const int64_t fit = (int64_t(smem_optin()) / per_sm - 1024) / sweep_bytes(1, NV);
  const int S = fit >= 8 ? 8 : fit >= 6 ? 6 : fit >= 4 ? 4 : 3;
  auto run = [&](auto kernel) -> bool {
    if (!sm90::runs_sm90a(reinterpret_cast<const void*>(kernel))) return false;
    const size_t bytes = sweep_bytes(S, NV);
    set_smem(kernel, bytes);
    if (dry_run()) return true;  // dry run: workspace_size (no workspace either way)
    CUtensorMap mkey, mval, mst = {};  // mst: the stored states (state_map), when asked for
    bool skey = false, sval = false;
    const bool ok = reverse ? input_map(&mkey, skey, a.q, a.q_ld, a.q_hs, a.dk, src_heads(a, a.q_div), a.Ttot) &&
                                  input_map(&mval, sval, a.dO, a.dO_ld, a.dO_hs, a.dv, a.H, a.Ttot)
                            : input_map(&mkey, skey, a.k, a.k_ld, a.k_hs, a.dk, src_heads(a, a.k_div), a.Ttot) &&
                                  input_map(&mval, sval, a.v, a.v_ld, a.v_hs, a.dv, src_heads(a, a.v_div), a.Ttot);
    const T* st = reverse ? a.dhbuf : a.hbuf;
    if (!ok || (st && !state_map(&mst, a, st, 64))) return false;
    const dim3 grid(unsigned(a.N * a.H), unsigned(a.dk / 64), unsigned(a.dv / NV));
    kernel<<<grid, kSm90Threads, bytes, stream>>>(mkey, mval, mst, unsigned(skey) | unsigned(sval) << 1, a,
                                                  tree ? *tree : TreeArgs{}, stack, lstk);
    HILA_CUDA_CHECK_LAUNCH();
    return true;
  };
  auto by_tile = [&](auto rev, auto nv, auto tr) {
    constexpr bool kRev = decltype(rev)::value, kTree = decltype(tr)::value;
    constexpr int kNV = decltype(nv)::value;
    return S == 3   ? run(sweep_sm90_kernel<T, kRev, 3, kNV, kTree>)
           : S == 4 ? run(sweep_sm90_kernel<T, kRev, 4, kNV, kTree>)
           : S == 6 ? run(sweep_sm90_kernel<T, kRev, 6, kNV, kTree>)
                    : run(sweep_sm90_kernel<T, kRev, 8, kNV, kTree>);
  };
  constexpr std::integral_constant<int, NV> nv;
  if (tree) return by_tile(std::false_type{}, nv, std::true_type{});
  return reverse ? by_tile(std::true_type{}, nv, std::false_type{}) : by_tile(std::false_type{}, nv, std::false_type{});
}
}  // namespace

template <class T>
bool tc_sweep_sm90(const GlaArgs<T>& a, bool reverse, cudaStream_t stream) {
  return sweep_sm90(a, reverse, stream, nullptr, nullptr, 0);
}

template <class T>
bool tc_tree_sweep_sm90(const GlaArgs<T>& a, const TreeArgs& ta, float* stack, int lstk, cudaStream_t stream) {
  return sweep_sm90(a, false, stream, &ta, stack, lstk);
}

template bool tc_sweep_sm90<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, bool, cudaStream_t);
template bool tc_sweep_sm90<__half>(const GlaArgs<__half>&, bool, cudaStream_t);
template bool tc_tree_sweep_sm90<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, const TreeArgs&, float*, int,
                                                 cudaStream_t);
template bool tc_tree_sweep_sm90<__half>(const GlaArgs<__half>&, const TreeArgs&, float*, int, cudaStream_t);

template <class T>
bool tc_fused_forward_sm90(const GlaArgs<T>& a, cudaStream_t stream) {
  if (!sm90_enabled("fwd") || (a.dk != 64 && a.dk != 128) || a.dv % 64 || !a.o ||
      a.Ttot + kChunk >= (int64_t(1) << 31) || (a.hbuf && (a.nchunks * a.H + 1) * a.dk >= (int64_t(1) << 31)))
    return false;  // TMA coordinates are 32-bit
  auto run = [&](auto kernel, size_t bytes) -> bool {
    if (!ready_sm90(kernel, bytes)) return false;
    if (dry_run()) return true;  // dry run: workspace_size (no workspace either way)
    CUtensorMap m[4] = {};  // q, k, v; the chunk states when asked for (state_map)
    unsigned order = 0;
    if (!qkv_maps(a, m, order) || (a.hbuf && !state_map(&m[3], a, a.hbuf, a.dk))) return false;
    kernel<<<dim3(unsigned(a.N * a.H), unsigned(a.dv / 64)), kSm90Threads, bytes, stream>>>(m[0], m[1], m[2], m[3],
                                                                                             order, a);
    HILA_CUDA_CHECK_LAUNCH();
    return true;
  };
  return a.dk == 128 ? run(fused_forward_sm90_kernel<T, 128>, FwdSm90Layout<128>::kBytes)
                     : run(fused_forward_sm90_kernel<T, 64>, FwdSm90Layout<64>::kBytes);
}

template bool tc_fused_forward_sm90<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, cudaStream_t);
template bool tc_fused_forward_sm90<__half>(const GlaArgs<__half>&, cudaStream_t);

}  // namespace hila::cuda
