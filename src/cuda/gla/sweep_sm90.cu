// SPDX-License-Identifier: Apache-2.0
// GLA state sweep, sm90 tier (sm_90a: TMA + wgmma; gla/sm90.cuh), in place of the sm80 sweep where
// it applies (gla.cu, heuristics::gla_sm90_sweep). The same math as sweep_sm80.cu (docs/math/HLA.md §7.1): one
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
#include "cuda/dispatch/heuristics.h"
#include "cuda/dispatch/static_switch.h"
#include "cuda/gla/sm90.cuh"

namespace hila::cuda {

namespace {

using namespace gla_sm90;

// a stage: the key block and NV/64 value blocks; the stages' gates [S][C] fp32 and mbarriers follow
constexpr uint32_t sweep_stage(int nv) { return (1 + nv / 64) * kSweepTile; }
constexpr uint32_t sweep_bytes(int stages, int nv) { return stages * (sweep_stage(nv) + kChunk * 4 + 8); }

// kTree: the log-linear tree build (loglinear/tree.cuh, as sweep_sm80.cu's sweep_kernel<kTree>): per full
// chunk c the accumulators hold Z_c = (K o w)^T V (zeroed instead of decayed), and tree_close merges
// them into the nodes with the per-thread fp32 level stack (lstk levels per block); with ta.seg > 0
// one block per segment of 2^seg chunks (grid x: segment g major, then sequence x head).
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
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const int sh = int(blockIdx.x % unsigned(a.N * a.H)), seq = sh / a.H, h = sh % a.H;
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
  const SweepChunks span = sweep_chunks<kTree>(ta, len, a.C, blockIdx.x / unsigned(a.N * a.H));
  if (span.skip) return;
  const int nch = span.nch;
  const int64_t cbeg = span.cbeg;
  [[maybe_unused]] const int64_t nfull = span.nfull;  // kTree
  auto chunk_of = [&](int i) { return kRev ? nch - 1 - i : int(cbeg) + i; };
  // kTree: the thread's elements (j, e) of loglinear/tree.cuh's layout are acc[4j + e]
  auto at = [&](int j, int e) -> float& { return acc[4 * j + e]; };
  const TreeStack<kSm90Threads> stk(stack, lstk);  // kTree only (lstk = 0 otherwise)
  [[maybe_unused]] SeqNodes sn;
  if constexpr (kTree) {
    sn = seq_nodes(ta, a.chunk0, seq, (len + a.C - 1) / a.C);
    if (sn.nc > 0) tree_seed<T>(ta, sn, stk, lstk, seq, h, a.H, a.dk, a.dv, r_lo, v0 + 2 * t, true, 8, at);
  }
  float* const root = kTree && ta.seg > 0 ? ta.roots + root_row(a.chunk0[seq], seq, ta.seg, h, a.H, int64_t(a.dk) * a.dv)
                                          : nullptr;
  init_ring(full, S, tid);
  // chunk i -> stage i % S (every thread commits one cp.async group per call)
  auto issue = [&](int i) {
    if (i >= nch) return mma::cp_async_commit();
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
    mma::async_gates<kChunk>(gates + st * kChunk, b, r0, rows_in(len, c, a.C), a.row0);
    mma::cp_async_commit();
  };
  for (int i = 0; i < S - 2; ++i) issue(i);
  const float sc = float(a.scale);
  // chunk i's operands have landed: refill the stage of chunk i-2 (its wgmmas are complete) with
  // chunk i+S-2, then form (key o w)^T fragments fa (rows 16w.. of the tile's 64 key columns,
  // tokens 16kk..) and the decay e^B
  auto prep = [&](int i, uint32_t(&fa)[4][4], float& decay) {
    const int c = chunk_of(i), st = i % S, nr = rows_in(len, c, a.C);
    mma::cp_async_wait<S - 3>();
    mbar_wait(&full[st], (i / S) & 1);
    __syncthreads();  // every thread's gates of chunk i; chunk i-2's stage is free
    issue(i + S - 2);
    char* base = smem + st * kStage;
    const float* bt = gates + st * kChunk;
    if (nr < kChunk) {  // value rows past the sequence
      zero_rows_from(base + kSweepTile, NV / 64, nr, tid);
      __syncthreads();
    }
    const float B = bt[nr - 1];
    decay = mma::fexp(B);
    scaled_key_frags<T>(fa, base, w, lane, nr, [&](int k) { return kRev ? sc * mma::fexp(bt[k]) : mma::fexp(B - bt[k]); });
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
        *reinterpret_cast<uint32_t*>(dst + 8 * j) = mma::pack2<T>(acc[4 * j], acc[4 * j + 1]);
        *reinterpret_cast<uint32_t*>(dst + 8 * a.dv + 8 * j) = mma::pack2<T>(acc[4 * j + 2], acc[4 * j + 3]);
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
    if constexpr (kTree) tree_close<T>(ta, sn, stk, chunk_of(i), h, a.H, a.dk, a.dv, r_lo, v0 + 2 * t, true, 8, at, root);
    if (store && i + 1 < nch) {  // the state of chunk i+1 by TMA from chunk i's stage (see above)
      char* stg = smem + (i % S) * kStage;  // [64 rows][NV] swizzled: the key tile, then value tiles
#pragma unroll
      for (int j = 0; j < NV / 8; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          *reinterpret_cast<uint32_t*>(stg + swz(64, fr.row(16 * w, hf), fr.col(0, j))) =
              mma::pack2<T>(acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
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
  if constexpr (kTree)  // in segments: the levels below seg + 1, from the segment where the full chunks end
    if (ta.pend && (ta.seg == 0 || cbeg == (nfull >> ta.seg) << ta.seg))
      tree_pending(ta, sn, stk, lstk, nfull, seq, h, a.H, a.dk, a.dv, r_lo, v0 + 2 * t, 8);
  if (store && tid == 0) bulk_wait<0>();  // the state stores complete before the block exits
#else
  __trap();  // launched only where runs_sm90a() holds
#endif
}

}  // namespace

namespace {
// The launch behind gla_sweep_sm90 and gla_tree_sweep_sm90 (tree set: the forward tree build), once
// gla.cu has chosen this tier (heuristics::gla_sm90_sweep); false where this device does not run the
// build's sm_90a code or TMA cannot describe the operands.
template <class T>
bool sweep_sm90(const GlaArgs<T>& a, bool reverse, cudaStream_t stream, const TreeArgs* tree, float* stack, int lstk,
                unsigned nseg = 1) {
  static_assert(kSm90Threads == 128, "the tree stack is sized for 128 threads per block (gla_tree_sweep_stack)");
  constexpr int NV = 64;  // value tile: heuristics::gla_sm90_sweep says why
  const int64_t blocks = int64_t(a.N) * a.H * nseg * (a.dk / 64) * (a.dv / NV);
  const int S = heuristics::gla_sm90_sweep_stages(blocks, device_info(), sweep_bytes(1, NV));
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
    const dim3 grid(unsigned(a.N * a.H) * nseg, unsigned(a.dk / 64), unsigned(a.dv / NV));
    kernel<<<grid, kSm90Threads, bytes, stream>>>(mkey, mval, mst, unsigned(skey) | unsigned(sval) << 1, a,
                                                  tree ? *tree : TreeArgs{}, stack, lstk);
    HILA_CUDA_CHECK_LAUNCH();
    return true;
  };
  if (tree)  // the tree build: forward only
    return HILA_SM90_STAGES_SWITCH(S, kS, [&] { return run(sweep_sm90_kernel<T, false, kS, NV, true>); });
  return HILA_BOOL_SWITCH(reverse, kRev, [&] {
    return HILA_SM90_STAGES_SWITCH(S, kS, [&] { return run(sweep_sm90_kernel<T, kRev, kS, NV, false>); });
  });
}
}  // namespace

template <class T>
bool gla_sweep_sm90(const GlaArgs<T>& a, bool reverse, cudaStream_t stream) {
  return sweep_sm90(a, reverse, stream, nullptr, nullptr, 0);
}

template <class T>
bool gla_tree_sweep_sm90(const GlaArgs<T>& a, const TreeArgs& ta, float* stack, int lstk, unsigned nseg,
                         cudaStream_t stream) {
  return sweep_sm90(a, false, stream, &ta, stack, lstk, nseg);
}

template bool gla_sweep_sm90<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, bool, cudaStream_t);
template bool gla_sweep_sm90<__half>(const GlaArgs<__half>&, bool, cudaStream_t);
template bool gla_tree_sweep_sm90<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, const TreeArgs&, float*, int, unsigned,
                                                  cudaStream_t);
template bool gla_tree_sweep_sm90<__half>(const GlaArgs<__half>&, const TreeArgs&, float*, int, unsigned, cudaStream_t);

}  // namespace hila::cuda
