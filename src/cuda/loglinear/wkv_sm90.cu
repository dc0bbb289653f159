// SPDX-License-Identifier: Apache-2.0
// The tree backward's read cotangents on the sm90 tier (sm_90a: TMA + wgmma; gla/sm90.cuh), in place
// of loglinear_wkv_kernel's kRead and kPart (tree_sm80.cu) where heuristics::loglinear_wkv_sm90
// chooses it. One warpgroup per (item, head, 64-row dk tile, NV value columns) forms
//   out[slot] = sum over the chunks N of its range of (Q_N o w_N)^T dO_N      [64, C] x [C, NV] per chunk
// with w_i = scale lam_i^{p+m} e^{b_i + gap} (loglinear/wkv.cuh has the items and their ranges),
// in the state sweep's pipeline (gla/sweep_sm90.cu) without the decay: Q and dO tiles arrive by TMA
// into a ring of S stages, each chunk's weights are written by the block when its loads are
// issued, (Q o w)^T is formed as register A fragments (ldmatrix.trans of the swizzled Q tile,
// scaled) while the previous chunk's wgmmas run, and dO is read MN-major by wgmma. NV = 128 where dv
// allows, so that each Q tile is read once for the whole value width.
#include "cuda/dispatch/heuristics.h"
#include "cuda/dispatch/static_switch.h"
#include "cuda/gla/sm90.cuh"
#include "cuda/loglinear/wkv.cuh"
#include "cuda/runtime/config.h"

namespace hila::cuda {

namespace {

using namespace gla_sm90;

constexpr int kWkvStages = 4;  // a stage in the wgmma, one being formed, two in flight
// a stage: the Q block and NV/64 dO blocks; the stages' weights [S][C] fp32 and mbarriers follow
constexpr uint32_t wkv_stage(int nv) { return (1 + nv / 64) * kSweepTile; }
constexpr uint32_t wkv_bytes(int nv) { return kWkvStages * (wkv_stage(nv) + kChunk * 4 + 8); }

template <class T, WkvMode kMode, int NV>
__global__ void __launch_bounds__(kSm90Threads)
    wkv_sm90_kernel(const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mdo, unsigned order,
                    GlaArgs<T> a, TreeArgs ta, float* out, int split) {
  static_assert(kMode == kRead || kMode == kPart, "the backward's sums");
  static_assert(NV == 64 || NV == 128, "value tile of 64 or 128 columns");
#if HILA_SM90A
  using namespace sm90;
  constexpr int S = kWkvStages;
  constexpr uint32_t kStage = wkv_stage(NV);
  extern __shared__ __align__(1024) char smem[];
  const uint32_t s0 = smem_u32(smem);
  if (s0 & 1023) __trap();  // the swizzle needs 1024-byte aligned tiles
  float* wts = reinterpret_cast<float*>(smem + S * kStage);                       // [S][C]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S * (kStage + kChunk * 4));  // [S]
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int h = blockIdx.y, nvt = a.dv / NV;
  const int k0 = int(blockIdx.z / unsigned(nvt)) * 64, v0 = int(blockIdx.z % unsigned(nvt)) * NV;
  const WkvItem it = wkv_item<kMode>(a, ta, blockIdx.x, split);
  if (it.skip) return;
  const int n = int(it.c_end > it.c_begin ? it.c_end - it.c_begin : 0);
  const int64_t len = a.len[it.seq], row0 = a.row0[it.seq];
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const float* lam = ta.lam + int64_t(h) * a.Ttot * ta.nL + kLogChunk + it.m;  // level p + m of row r: lam[r nL]
  const float sc = float(a.scale);
  init_ring(full, S, tid);
  float gap = 0.f;  // every thread: log-decay from the node's end to the start of the chunk being issued
  // chunk i of the range -> stage i % S: Q and dO blocks by TMA, the weights (rows >= nr: 0) by the block
  auto issue = [&](int i) {
    if (i >= n) return;
    const int st = i % S;
    const int64_t r0 = row0 + (it.c_begin + i) * kChunk;
    const int nr = rows_in(len, it.c_begin + i);
    char* base = smem + st * kStage;
    if (tid == 0) {
      fence_async_smem();  // this stage's earlier generic accesses before the async-proxy refill
      mbar_expect_tx(&full[st], kStage);
      load_rows(base, &mq, &full[st], order & 1, k0, r0, h / a.q_div);
      for (int cb = 0; cb < NV / 64; ++cb)
        load_rows(base + (1 + cb) * kSweepTile, &mdo, &full[st], (order >> 1) & 1, v0 + 64 * cb, r0, h);
    }
    if (tid < kChunk)
      wts[st * kChunk + tid] = tid < nr ? sc * lam[(r0 + tid) * ta.nL] * mma::fexp((b ? b[r0 + tid] : 0.f) + gap) : 0.f;
    gap += b ? b[r0 + nr - 1] : 0.f;
  };
  for (int i = 0; i < S - 2; ++i) issue(i);
  // chunk i's tiles have landed: refill the stage of chunk i-2 (its wgmmas are complete) with chunk
  // i+S-2, then form the (Q o w)^T fragments
  auto prep = [&](int i, uint32_t(&fa)[4][4]) {
    const int st = i % S, nr = rows_in(len, it.c_begin + i);
    mbar_wait(&full[st], (i / S) & 1);
    __syncthreads();  // every thread's weights of chunk i; chunk i-2's stage is free
    issue(i + S - 2);
    char* base = smem + st * kStage;
    if (nr < kChunk) {  // dO rows past the sequence
      zero_rows_from(base + kSweepTile, NV / 64, nr, tid);
      __syncthreads();
    }
    const float* wt = wts + st * kChunk;
    scaled_key_frags<T>(fa, base, w, lane, nr, [&](int k) { return wt[k]; });
  };
  float acc[NV / 2];
#pragma unroll
  for (int e = 0; e < NV / 2; ++e) acc[e] = 0.f;
  // chunk i with fragments fa; forms chunk i+1's into fb meanwhile
  auto step = [&](int i, uint32_t(&fa)[4][4], uint32_t(&fb)[4][4]) {
    wg_fence();
    const uint32_t vt = s0 + (i % S) * kStage + kSweepTile;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<T, NV, 1>(acc, fa[kk], desc_mn(vt, kChunk, kk), true);
    wg_commit();
    if (i + 1 < n) prep(i + 1, fb);
    wg_wait<0>();
    fence_regs(acc);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) fence_regs(fa[kk]);  // the wgmmas read fa until here
  };
  uint32_t fa0[4][4], fa1[4][4];
  if (n > 0) prep(0, fa0);
  for (int i = 0; i < n; i += 2) {
    step(i, fa0, fa1);
    if (i + 1 < n) step(i + 1, fa1, fa0);
  }
  // rows k0 + 16w + g (+8), columns v0 + 8j + 2t (+1) of the item's [dk][dv] slot
  store_state_frag<NV>(acc, out + (it.slot * a.H + h) * int64_t(a.dk) * a.dv, a.dv, k0 + 16 * w + g, v0, t);
#else
  __trap();  // launched only where runs_sm90a() holds
#endif
}

}  // namespace

template <class T>
bool loglinear_wkv_sm90(const GlaArgs<T>& a, const TreeArgs& ta, WkvMode mode, float* out, int split, int64_t items,
                        cudaStream_t stream) {
  const int nv = a.dv % 128 == 0 ? 128 : 64;
  auto run = [&](auto kernel, int NV) -> bool {
    if (!ready_sm90(kernel, wkv_bytes(NV))) return false;
    if (dry_run()) return true;  // dry run: workspace_size (no workspace either way)
    CUtensorMap mq, mdo;
    bool sq = false, sdo = false;
    if (!input_map(&mq, sq, a.q, a.q_ld, a.q_hs, a.dk, src_heads(a, a.q_div), a.Ttot) ||
        !input_map(&mdo, sdo, a.dO, a.dO_ld, a.dO_hs, a.dv, a.H, a.Ttot))
      return false;
    const dim3 grid(unsigned(items), unsigned(a.H), unsigned((a.dk / 64) * (a.dv / NV)));
    kernel<<<grid, kSm90Threads, wkv_bytes(NV), stream>>>(mq, mdo, unsigned(sq) | unsigned(sdo) << 1, a, ta, out, split);
    HILA_CUDA_CHECK_LAUNCH();
    return true;
  };
  return HILA_BOOL_SWITCH(mode == kPart, kIsPart, [&] {
    constexpr WkvMode kM = kIsPart ? kPart : kRead;
    return nv == 128 ? run(wkv_sm90_kernel<T, kM, 128>, 128) : run(wkv_sm90_kernel<T, kM, 64>, 64);
  });
}

template bool loglinear_wkv_sm90<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, const TreeArgs&, WkvMode, float*, int,
                                                int64_t, cudaStream_t);
template bool loglinear_wkv_sm90<__half>(const GlaArgs<__half>&, const TreeArgs&, WkvMode, float*, int, int64_t,
                                         cudaStream_t);

}  // namespace hila::cuda
