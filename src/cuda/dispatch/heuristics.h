// SPDX-License-Identifier: Apache-2.0
// Every launch policy of the CUDA backend: which kernel tier runs a stage, tile widths, ring
// depths, block counts. Pure host functions of the call's shape, the device's limits and the knobs
// (runtime/config.h), each with the measurement or the reason behind its constants. Plain C++ (no
// CUDA): tests/test_heuristics.cpp checks them on the CPU. What a kernel can run at all (head dims
// its tiles hold, shared memory it needs, layouts TMA can describe) stays with the kernel; what is
// chosen among the kernels that can run is decided here.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/runtime/config.h"

namespace hila::cuda::heuristics {

// What a policy needs to know of the device (runtime/runtime.cuh queries it once per device).
struct Device {
  int64_t sms = 0;        // multiprocessors
  size_t smem_optin = 0;  // dynamic shared memory one block may opt into (bytes)
};

// ---- grid-stride elementwise kernels (HILA_LAUNCH) ---------------------------------------------

// Blocks of 256 threads for n elements: one element per thread, at most 4 x 65535 blocks (more
// than any GPU keeps resident; the kernels stride over the rest).
constexpr unsigned grid_stride_blocks(int64_t n) {
  return unsigned(std::clamp<int64_t>((n + 255) / 256, 1, 65535 * 4));
}

// ---- GLA (gla/) -----------------------------------------------------------------------------------

// TMA tile coordinates are 32-bit: the rows of the packed inputs (Ttot plus a chunk of reach past
// the end) and, where the per-chunk states are read or written by TMA, their rows
// (nchunks x H x dk plus one state) must stay below 2^31.
constexpr bool tma_rows_fit(int64_t Ttot, int64_t chunk) { return Ttot + chunk < (int64_t(1) << 31); }
constexpr bool tma_state_rows_fit(int64_t nchunks, int64_t H, int64_t dk) {
  return (nchunks * H + 1) * dk < (int64_t(1) << 31);
}

// sm80 state sweep: value columns per block. One block sweeps each (sequence x head, 64 x 64
// state tile); with fewer such tiles than SMs the value tile is halved to 32 columns, so that at
// least about one block per SM sweeps.
constexpr int gla_sm80_sweep_vtile(int64_t seq_heads, int dk, int dv, int64_t sms) {
  const int64_t ktiles = (dk + 63) / 64, vtiles = (dv + 63) / 64;
  return seq_heads * ktiles * vtiles < sms && dv % 32 == 0 ? 32 : 64;
}

// Forward in one kernel (the state sweep and the output fused: one block per (sequence x head,
// 64-column value tile) walks all of its chunks) or in two (the sweep, then the chunk-parallel
// output kernel). The fused kernel holds dk <= 128 and dv a multiple of 64 in `smem` bytes of
// shared memory (175 KB at dk = 128: past the opt-in of sm_80, 163 KB, and of consumer parts).
// Among the calls it can run: fused while its blocks fill about the GPU (H200, H = 16, dv = 128:
// 0.82x the two-kernel time at 128 blocks on 132 SMs, 1.45x at 64 blocks), the two kernels for few
// long sequences. HILA_GLA_FUSED=0|1 forces the choice among the calls it can run.
constexpr bool gla_fused_forward(bool has_output, int dk, int dv, int64_t seq_heads, size_t smem, const Device& d,
                                 Force knob) {
  if (!has_output || dk > 128 || dv % 64 != 0 || smem > d.smem_optin) return false;
  if (knob != Force::automatic) return knob == Force::on;
  return 4 * seq_heads * (dv / 64) >= 3 * d.sms;
}

// sm90 state sweep (TMA + wgmma, 64 x 64 state tiles) in place of the sm80 one, for dk and dv
// multiples of 64. Value tiles of 64 columns: 128 (the key tile read once for both halves, 2
// blocks per SM) was slower on the H200 at B = 8, T = 4K (forward / reverse sweep 282 / 287 us
// against 258 / 254). With few blocks the sm80 sweep wins, as it halves its value tile to double
// them (B = 1, T = 64K, 64 blocks: gla forward 1.37 ms here against 1.31; at 128 blocks this one
// wins, 0.52 against 0.63 ms at B = 2, T = 16K): this one from 3/4 of the SMs up.
// HILA_GLA_SM90=1 takes it at any block count (tests), =0 or a list without "sweep" never.
constexpr bool gla_sm90_sweep(int dk, int dv, int64_t Ttot, int64_t nchunks, int64_t H, int64_t seq_heads,
                              const Device& d, const Sm90Kernels& k) {
  if (!k.sweep || dk % 64 || dv % 64 || !tma_rows_fit(Ttot, 64) || !tma_state_rows_fit(nchunks, H, dk)) return false;
  const int64_t blocks = seq_heads * (dk / 64) * (dv / 64);
  return !(4 * blocks < 3 * d.sms && !k.forced);
}

// Ring depth of the sm90 sweep (stages of `stage_bytes`, each chunk's key and value tiles, gates
// and mbarrier): the deepest of 8, 6, 4 that still fits every block of the grid in one wave
// (1 KB of each block's shared memory left for alignment), at least 3 (a stage in the wgmma, one
// being formed and the refill target).
constexpr int gla_sm90_sweep_stages(int64_t blocks, const Device& d, size_t stage_bytes) {
  const int64_t per_sm = (blocks + d.sms - 1) / d.sms;
  const int64_t fit = (int64_t(d.smem_optin) / per_sm - 1024) / int64_t(stage_bytes);
  return fit >= 8 ? 8 : fit >= 6 ? 6 : fit >= 4 ? 4 : 3;
}

// sm90 backward chunk kernel (one warpgroup per (chunk, head), dk and dv of 64 or 128, the
// per-chunk states by TMA; for the log-linear tree form the nodes and dZ, nchunks then the larger
// of the chunks and the node slots) in place of the sm80 one wherever it applies: faster at every
// measured shape. HILA_GLA_SM90=0, or a list without "bwd", keeps the sm80 kernel.
constexpr bool gla_sm90_bwd_chunk(int dk, int dv, bool has_states, int64_t Ttot, int64_t nchunks, int64_t H,
                                  const Sm90Kernels& k) {
  if (!k.bwd) return false;
  if ((dk != 64 && dk != 128) || (dv != 64 && dv != 128) || !has_states) return false;
  return tma_rows_fit(Ttot, 64) && tma_state_rows_fit(nchunks, H, dk);
}

// sm90 chunk-parallel output kernel (one warpgroup per (chunk, 64 value columns, head), dk of 64 or
// 128, dv a multiple of 64, the per-chunk states or, for the log-linear tree form, the nodes by TMA;
// state rows: nchunks or the node slots) in place of the sm80 one for the tree form, whose levels it
// reads through one TMA buffer (H100, d = 128, H = 16: loglinear forward 2.79 against 2.96 ms at
// B = 1, T = 64K). For one state per chunk (GLA, the delta rule's pieces) the sm80 kernel stays: this
// one was slower there (gla forward 1.67 against 1.38 ms at B = 1, T = 64K; 0.65 against 0.55 at
// B = 2, T = 16K). HILA_GLA_SM90=1 takes it for every form (tests); =0, or a list without "out",
// keeps the sm80 kernel.
constexpr bool gla_sm90_output(int dk, int dv, bool tree, bool has_states, int64_t Ttot, int64_t states, int64_t H,
                               const Sm90Kernels& k) {
  if (!k.out || (dk != 64 && dk != 128) || dv % 64 || !has_states || !(tree || k.forced)) return false;
  return tma_rows_fit(Ttot, 64) && tma_state_rows_fit(states, H, dk);
}

// sm90 one-kernel forward (dk of 64 or 128, dv a multiple of 64) in place of the sm80 one wherever
// it applies, once gla_fused_forward has chosen the one-kernel form. HILA_GLA_SM90=0, or a list
// without "fwd", keeps the sm80 kernel.
constexpr bool gla_sm90_fused_forward(int dk, int dv, bool has_output, bool stores_states, int64_t Ttot,
                                      int64_t nchunks, int64_t H, const Sm90Kernels& k) {
  if (!k.fwd || (dk != 64 && dk != 128) || dv % 64 || !has_output) return false;
  return tma_rows_fit(Ttot, 64) && (!stores_states || tma_state_rows_fit(nchunks, H, dk));
}

// ---- log-linear (loglinear/) -----------------------------------------------------------------------

// The chunk-parallel tree form (16-bit operands; loglinear/tree_sm80.cu) for calls its kernels
// hold: one dQ pass per warp that every warp takes part in (32 <= dk <= 128), dv tiles of the
// output kernel (dv <= 128); the caller checks their shared memory. HILA_LOGLINEAR_TREE=0 keeps
// the segment sweep.
constexpr bool loglinear_tree(bool tensor_core, int dk, int dv, bool knob) {
  return tensor_core && knob && dk >= 32 && dk <= 128 && dv <= 128;
}

// How the tree's nodes are built: in the state sweep, one block per (sequence x head, 64 x 64 tile),
// `sweep_blocks` of them, along whole sequences (sweep) or along segments of 2^seg chunks, the
// levels above by the up pass from the segments' roots (sweep_segments; seg > 0, from
// loglinear_tree_segment); or chunk-parallel (Z per chunk, then the up pass: chunks). The whole
// sweep once its blocks fill at least half the SMs (tree_sweep_chunk_ab_h200_2026-12-02.csv), else
// the sweep in segments where there are segments. HILA_LOGLINEAR_TREE_SWEEP=0 forces chunks, =1 the
// sweep (in segments where seg > 0).
enum class TreeBuild { chunks, sweep, sweep_segments };
constexpr TreeBuild loglinear_tree_build(int64_t sweep_blocks, int64_t sms, int seg, Force knob) {
  if (knob == Force::off) return TreeBuild::chunks;
  if (knob == Force::on) return seg > 0 ? TreeBuild::sweep_segments : TreeBuild::sweep;
  if (2 * sweep_blocks >= sms) return TreeBuild::sweep;
  return seg > 0 ? TreeBuild::sweep_segments : TreeBuild::chunks;
}

// The tree's up pass and push-down (elementwise, one thread per four state elements per (sequence,
// head), along the chunks in series) in segments of 2^s chunks: the levels inside each segment in
// parallel over the segments, then the levels above over the segment roots (loglinear/tree_sm80.cu,
// TreePass). s = 5 when every sequence starts at position 0, the longest has at least 128 chunks
// and one pass has fewer `threads` than the SMs hold twice (2048 each); 0 (one pass) otherwise.
// HILA_LOGLINEAR_TREE_SEGMENT=s forces s (0: one pass) where every sequence starts at 0.
constexpr int loglinear_tree_segment(bool shifted, int64_t max_chunks, int64_t threads, int64_t sms, int knob) {
  if (shifted) return 0;
  if (knob >= 0) return knob;
  return max_chunks >= 128 && threads < 2 * 2048 * sms ? 5 : 0;
}

// The tree backward sums long reading ranges in parts (one per aligned block of 16 chunks, levels
// m >= 6): (top - 5) ceil(nc / 16) <= nc slots per sequence while every sequence starts at 0 and
// has at most 2^20 chunks; otherwise the ranges are summed whole (from n0 > 0 a range within the
// call has at most nc chunks, the length of the tree sweep).
constexpr bool loglinear_tree_parts(bool shifted, int64_t Ttot, int64_t N, int64_t chunk) {
  return !shifted && Ttot / chunk + N <= (int64_t(1) << 20);
}

// sm90 tier of the log-linear tree backward's read sums (loglinear/wkv_sm90.cu: TMA + wgmma, value
// tiles of 128 columns where dv allows) in place of the sm80 kernel, for dk and dv multiples of 64.
// HILA_GLA_SM90=0, or a list without "wkv", keeps the sm80 kernel.
constexpr bool loglinear_wkv_sm90(int dk, int dv, int64_t Ttot, const Sm90Kernels& k) {
  return k.wkv && dk % 64 == 0 && dv % 64 == 0 && tma_rows_fit(Ttot, 64);
}

// Bytes of stored live levels a forward-only segment-sweep call may allocate to run its outputs
// chunk-parallel: a quarter of the free device memory; with a caller's workspace (and in its size
// query) a quarter of the total, since the choice, hence the size, must not depend on what is free
// at the moment (the workspace itself takes memory between the two). HILA_LOGLINEAR_STORE_BUDGET
// (bytes; 0 keeps the outputs in the sweep, which the tests use to cover both paths) replaces it.
constexpr size_t loglinear_store_budget(size_t free_bytes, size_t total_bytes, bool workspace) {
  return (workspace ? total_bytes : free_bytes) / 4;
}

// Segment sweep forward: the outputs inside the sweep (one block per (value tile, sequence x head)
// walks the segments) or chunk-parallel after a states-only sweep (one block per (segment, head),
// reading the live levels the sweep stored): chunk-parallel whenever it can run, i.e. with an
// output, segments, its kernel's shared memory (`out_smem`) within the opt-in and the stored levels
// given or within budget() (called only when it decides: it queries the free memory).
template <class Budget>
constexpr bool loglinear_outputs_chunk_parallel(bool has_output, int64_t nseg, size_t out_smem, const Device& d,
                                                bool levels_given, size_t level_bytes, Budget budget) {
  return has_output && nseg > 0 && out_smem <= d.smem_optin && (levels_given || level_bytes <= budget());
}

// ---- delta rule (delta/) ------------------------------------------------------------------------------

// gdn / loglinear_gdn on tensor cores (the sm80 tier: WY chunks, state sweeps, the GLA output and
// chunk-gradient kernels) for bf16 / fp16 calls its kernels hold: padded dk <= 128 (one 16-row
// state slice per warp), dv <= 256; the caller checks their shared memory. The portable segment
// kernels otherwise. HILA_GDN_TC=0 keeps the portable kernels.
constexpr bool delta_sm80(int dk, int dv, bool knob) { return knob && dk <= 128 && dv <= 256; }

// The sm90 state sweeps (TMA + wgmma, delta/sweep_sm90.cu) in place of the sm80 ones, for padded
// dk of 64 or 128 (one or two m64 state slabs per warpgroup) and dv a multiple of 64: the default
// (an interleaved A/B at the benchmark shapes, docs/PERFORMANCE.md: gdn forward+backward 0.79-0.94x
// the sm80 sweeps' time, loglinear_gdn 0.84-0.95x); HILA_DELTA_SM90=0 keeps the sm80 sweeps. The
// sm80 sweeps also run where the device does not run sm_90a code.
constexpr bool delta_sm90_sweep(int dk, int dv, int64_t Ttot, bool knob) {
  return knob && (dk == 64 || dk == 128) && dv % 64 == 0 && tma_rows_fit(Ttot, 64);
}

// loglinear_gdn's level sweeps on the sm90 tier (delta/loglinear_gdn_sm90.cu: the plain sweeps'
// state tiles, ring and stash; one warpgroup per level block and 64 value columns) in place of the
// sm80 ones, for the shapes of the plain sm90 sweeps: padded dk of 64 or 128, dv a multiple of 64, rows
// TMA can address. The same knob (HILA_DELTA_SM90=0: the sm80 sweeps); the sm80 sweeps also where
// the device does not run sm_90a code or two ring stages do not fit.
constexpr bool loglinear_gdn_sm90_sweep(int dk, int dv, int64_t Ttot, bool knob) {
  return delta_sm90_sweep(dk, dv, Ttot, knob);
}

// Ring depth of a delta sm90 sweep (stages of `stage_bytes` besides `fixed_bytes` per block): the
// deepest of 4, 3, 2 that fits the grid's blocks per SM (1 KB per block left for alignment), taken
// for the fewest waves: two blocks per SM where two stages fit (the forward at dk = 128: three
// stages of W, K, 98 KB, and the 16 KB state tile; one warpgroup each, so two blocks hide each
// other's dependent chains), else one; at most `max_per_sm` (1 for two-warpgroup blocks, whose
// registers fill the SM). 0: not even two stages fit one block.
constexpr int delta_sm90_sweep_stages(int64_t blocks, const Device& d, size_t stage_bytes, size_t fixed_bytes,
                                      int64_t max_per_sm = 2) {
  const int64_t want = std::clamp<int64_t>((blocks + d.sms - 1) / std::max<int64_t>(d.sms, 1), 1, max_per_sm);
  for (int64_t per = want; per >= 1; --per) {
    const int64_t room = int64_t(d.smem_optin) / per - 1024 - int64_t(fixed_bytes);
    const int64_t fit = room > 0 ? room / int64_t(stage_bytes) : 0;
    if (fit >= 2) return int(std::min<int64_t>(fit, 4));
  }
  return 0;
}

// Warpgroups per block of the delta sm90 forward sweep: two (each its own 64 value columns, the W,
// K tiles shared, one block per SM; dv a multiple of 128) where one-warpgroup blocks would need more
// than one per SM (more (sequence x head, 64-column) tiles than SMs), so that an SM's warpgroups read
// each chunk's W and K once instead of once each; else one, every tile on an SM of its own.
constexpr int delta_sm90_sweep_warpgroups(int64_t tiles, bool pairs, const Device& d) {
  return pairs && tiles > d.sms ? 2 : 1;
}

// Pieces of a gdn call whose WY kernel runs beside its state sweeps (gdn_sm80.cu): the WY kernel of
// piece k (chunks [k span, (k + 1) span) of every sequence) on the caller's stream, each sweep's
// walk over piece k on a side stream once that WY is done, so that the chunk-parallel WY kernel
// fills the SMs the latency-bound sweeps leave idle (few long sequences: B = 1, H = 16, dv = 128
// walks 32 sweep blocks on 132 SMs) instead of running before them. sweep_blocks: the sweep blocks
// running at once (the forward's sweep, or the backward's two); max_chunks: the longest sequence's.
// One piece where those blocks take more than half the SMs or the longest sequence has fewer than
// 2 kDeltaPieceChunks chunks; else pieces of at least kDeltaPieceChunks chunks, at most 8. knob
// (HILA_DELTA_PIECES) > 0: that many, at most max_chunks.
inline constexpr int64_t kDeltaPieceChunks = 64;
constexpr int delta_sweep_pieces(int64_t sweep_blocks, int64_t max_chunks, const Device& d, int knob) {
  if (max_chunks <= 1) return 1;
  if (knob > 0) return int(std::min<int64_t>(knob, max_chunks));
  if (2 * sweep_blocks > d.sms) return 1;
  return int(std::clamp<int64_t>(max_chunks / kDeltaPieceChunks, 1, 8));
}

// Warpgroups per block of the delta sm90 reverse sweep: two (each its own 64 value columns, the Q,
// K, W tiles shared; dv a multiple of 128) where that takes fewer waves than one per block, for
// `tiles` (sequence x head, 64-column) tiles and each layout's stage / fixed bytes. An SM holds up
// to two one-warpgroup blocks as their shared memory allows, and one two-warpgroup block (256
// threads of up to 255 registers fill its register file). At dk = 128 one-warpgroup blocks fit
// one per SM (three stages of Q, K, W, dO: 188 KB), so B = 8, H = 16, dv = 128 (256 tiles) takes
// two waves of 64-chunk chains on 132 SMs, two-warpgroup blocks one; at dk = 64 two one-warpgroup
// blocks fit an SM and the two layouts take as many waves (one warpgroup then).
constexpr int delta_sm90_rsweep_warpgroups(int64_t tiles, bool pairs, const Device& d, size_t stage1, size_t fixed1,
                                           size_t stage2, size_t fixed2) {
  auto waves = [&](int64_t blocks, size_t stage, size_t fixed, int64_t max_per) -> int64_t {
    for (int64_t per = max_per; per >= 1; --per) {
      const int64_t room = int64_t(d.smem_optin) / per - 1024 - int64_t(fixed);
      if (room > 0 && room / int64_t(stage) >= 2) {
        const int64_t slots = std::max<int64_t>(d.sms, 1) * per;
        return (blocks + slots - 1) / slots;
      }
    }
    return int64_t(1) << 62;  // does not fit
  };
  return pairs && waves(tiles / 2, stage2, fixed2, 1) < waves(tiles, stage1, fixed1, 2) ? 2 : 1;
}

// Resident blocks of the portable delta kernels, each with its own scratch in global memory: up to
// 4 per SM, over the larger of the item counts (sweep items, segment x head items).
constexpr int delta_portable_blocks(int64_t items, int64_t sms) {
  return int(std::clamp<int64_t>(items, 1, 4 * sms));
}

// ---- decode step (step/) -------------------------------------------------------------------------------

// Ring of state tiles in flight per step block: at most 3 stages (the kernel's wait switch has a
// case per count), within 32 KB (one [128, 64] fp32 stage: more stages measured slower at
// dk = 128, fewer resident blocks per SM), but at least one.
inline constexpr int kStepMaxStages = 3;
inline constexpr int kStepRingBytes = 32 * 1024;

// Column tiles of a step: all of dv' in one block for normalize (the denominator column) and for S
// without step counters (a DecodeState's or StepParams::counters), or when there are enough
// (sequence, head) blocks to fill the device (then each S is read once, not once per tile); else
// tiles of `cols` columns.
constexpr int step_tiles(bool normalize, bool has_S, bool counters, int64_t seq_heads, int dvp, int cols,
                         int64_t sms) {
  const bool one_tile = normalize || (has_S && (!counters || seq_heads >= 4 * sms));
  return one_tile ? 1 : (dvp + cols - 1) / cols;
}

// S in shared memory (one copy, then u = S q and the update from it) when the block's threads
// cover its rows (dk <= threads) and it is at most 40 KB; else the register sweep over global S.
constexpr bool step_s_in_smem(bool has_S, int dk, int threads, size_t sym_bytes) {
  return has_S && dk <= threads && sym_bytes <= 40 * 1024;
}

// Ring depth: no more stages than the block has items (P's column chunks, then H's live slots per
// column chunk: at most kStepMaxStages of them for Fenwick states), within kStepRingBytes (at least
// one stage), and then as many as fit the device's shared memory (smem_of(stages) bytes).
template <class SmemOf>
constexpr int step_ring_stages(int64_t max_items, int item_bytes, size_t optin, SmemOf smem_of) {
  int stages = int(std::max<int64_t>(1, std::min<int64_t>({kStepMaxStages, max_items, kStepRingBytes / item_bytes})));
  while (stages > 1 && smem_of(stages) > optin) --stages;
  return stages;
}

// State rows each thread holds in registers (the kernel's kRows template, rows r = warp + warps j):
// the smallest of 4, 8, 16, 32, 64 that covers dk over the warps.
constexpr int step_rows(int dk, int warps) {
  const int rows = (dk + warps - 1) / warps;
  return rows <= 4 ? 4 : rows <= 8 ? 8 : rows <= 16 ? 16 : rows <= 32 ? 32 : 64;
}

}  // namespace hila::cuda::heuristics
