// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's launch policies (src/cuda/dispatch/heuristics.h) and the parsing of its
// environment knobs (src/cuda/runtime/config.h): pure host functions, checked on the CPU with the
// limits of an H200 (132 SMs, 227 KB of opt-in shared memory per block) and of an A100. Last, the
// CPU backend's launch policies (src/cpu/backend.h: when a call runs in parallel, and the rows of
// a chunk-form segment).
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>

#include "cpu/backend.h"
#include "cuda/dispatch/heuristics.h"
#include "cuda/runtime/config.h"

namespace hila::cuda {
namespace {

namespace h = heuristics;

constexpr h::Device kH200{132, 232448};
constexpr h::Device kA100{108, 166912};

// ---- environment knobs -------------------------------------------------------------------------

std::map<std::string, std::string> g_env;
const char* fake_env(const char* name) {
  const auto it = g_env.find(name);
  return it == g_env.end() ? nullptr : it->second.c_str();
}
Config parse(std::map<std::string, std::string> env) {
  g_env = std::move(env);
  return Config::parse(&fake_env);
}

TEST(Config, DefaultsWithoutKnobs) {
  const Config c = parse({});
  EXPECT_FALSE(c.upload_kernel);
  EXPECT_TRUE(c.side_stream);
  EXPECT_FALSE(c.poison_scratch);
  EXPECT_TRUE(c.fold_s);
  EXPECT_TRUE(c.gla_sm90.sweep && c.gla_sm90.bwd && c.gla_sm90.fwd);
  EXPECT_FALSE(c.gla_sm90.forced);
  EXPECT_EQ(c.gla_fused, Force::automatic);
  EXPECT_TRUE(c.gdn_tc);
  EXPECT_TRUE(c.delta_sm90);
  EXPECT_TRUE(c.loglinear_tree);
  EXPECT_EQ(c.loglinear_tree_sweep, Force::automatic);
  EXPECT_FALSE(c.loglinear_store_budget.has_value());
  EXPECT_FALSE(c.emu_sm90);
  EXPECT_EQ(c.delta_pieces, 0);
  EXPECT_EQ(c.loglinear_tree_segment, -1);
}

TEST(Config, DeltaPiecesTakesACount) {
  EXPECT_EQ(parse({{"HILA_DELTA_PIECES", "3"}}).delta_pieces, 3);
  EXPECT_EQ(parse({{"HILA_DELTA_PIECES", "1"}}).delta_pieces, 1);
  EXPECT_EQ(parse({{"HILA_DELTA_PIECES", "0"}}).delta_pieces, 0);
  EXPECT_EQ(parse({{"HILA_DELTA_PIECES", "-2"}}).delta_pieces, 0);
  EXPECT_EQ(parse({{"HILA_DELTA_PIECES", "x"}}).delta_pieces, 0);
}

TEST(Config, SwitchesTakeTheirValues) {
  const Config c = parse({{"HILA_UPLOAD_KERNEL", "1"}, {"HILA_SIDE_STREAM", "0"}, {"HILA_FOLD_S", "0"},
                          {"HILA_GDN_TC", "0"}, {"HILA_LOGLINEAR_TREE", "0"}, {"HILA_EMU_SM90", "1"},
                          {"HILA_DELTA_SM90", "0"}});
  EXPECT_TRUE(c.upload_kernel);
  EXPECT_FALSE(c.side_stream);
  EXPECT_FALSE(c.fold_s);
  EXPECT_FALSE(c.gdn_tc);
  EXPECT_FALSE(c.delta_sm90);
  EXPECT_FALSE(c.loglinear_tree);
  EXPECT_TRUE(c.emu_sm90);
  // only the exact value switches: "2" is not "1", "no" is not "0"
  const Config d = parse({{"HILA_UPLOAD_KERNEL", "2"}, {"HILA_SIDE_STREAM", "no"}, {"HILA_EMU_SM90", "yes"}});
  EXPECT_FALSE(d.upload_kernel);
  EXPECT_TRUE(d.side_stream);
  EXPECT_FALSE(d.emu_sm90);
}

TEST(Config, PoisonScratchIsOnForAnySetValueButEmptyAndZero) {
  EXPECT_TRUE(parse({{"HILA_POISON_SCRATCH", "1"}}).poison_scratch);
  EXPECT_TRUE(parse({{"HILA_POISON_SCRATCH", "yes"}}).poison_scratch);
  EXPECT_FALSE(parse({{"HILA_POISON_SCRATCH", "0"}}).poison_scratch);
  EXPECT_FALSE(parse({{"HILA_POISON_SCRATCH", ""}}).poison_scratch);
}

TEST(Config, Sm90KernelList) {
  const Config one = parse({{"HILA_GLA_SM90", "1"}});
  EXPECT_TRUE(one.gla_sm90.sweep && one.gla_sm90.bwd && one.gla_sm90.fwd && one.gla_sm90.wkv && one.gla_sm90.forced);
  const Config none = parse({{"HILA_GLA_SM90", "0"}});
  EXPECT_FALSE(none.gla_sm90.sweep || none.gla_sm90.bwd || none.gla_sm90.fwd || none.gla_sm90.wkv ||
               none.gla_sm90.forced);
  const Config empty = parse({{"HILA_GLA_SM90", ""}});
  EXPECT_FALSE(empty.gla_sm90.sweep || empty.gla_sm90.bwd || empty.gla_sm90.fwd);
  const Config list = parse({{"HILA_GLA_SM90", "bwd,fwd"}});
  EXPECT_FALSE(list.gla_sm90.sweep || list.gla_sm90.wkv);
  EXPECT_TRUE(list.gla_sm90.bwd && list.gla_sm90.fwd);
  EXPECT_TRUE(parse({{"HILA_GLA_SM90", "sweep,wkv"}}).gla_sm90.wkv);
  EXPECT_FALSE(list.gla_sm90.out);
  EXPECT_TRUE(parse({{"HILA_GLA_SM90", "out"}}).gla_sm90.out);
  EXPECT_TRUE(one.gla_sm90.out);
  EXPECT_FALSE(list.gla_sm90.forced);
  const Config prefix = parse({{"HILA_GLA_SM90", "sweeps,bw"}});  // whole words only
  EXPECT_FALSE(prefix.gla_sm90.sweep || prefix.gla_sm90.bwd || prefix.gla_sm90.fwd);
}

TEST(Config, ForcedChoicesAndBudget) {
  EXPECT_EQ(parse({{"HILA_GLA_FUSED", "0"}}).gla_fused, Force::off);
  EXPECT_EQ(parse({{"HILA_GLA_FUSED", "1"}}).gla_fused, Force::on);
  EXPECT_EQ(parse({{"HILA_GLA_FUSED", ""}}).gla_fused, Force::on);  // set, and not 0
  EXPECT_EQ(parse({{"HILA_LOGLINEAR_TREE_SWEEP", "0"}}).loglinear_tree_sweep, Force::off);
  EXPECT_EQ(parse({{"HILA_LOGLINEAR_TREE_SWEEP", "1"}}).loglinear_tree_sweep, Force::on);
  EXPECT_EQ(parse({{"HILA_LOGLINEAR_TREE_SEGMENT", "3"}}).loglinear_tree_segment, 3);
  EXPECT_EQ(parse({{"HILA_LOGLINEAR_TREE_SEGMENT", "0"}}).loglinear_tree_segment, 0);
  EXPECT_EQ(parse({{"HILA_LOGLINEAR_TREE_SEGMENT", "99"}}).loglinear_tree_segment, 40);
  EXPECT_EQ(parse({{"HILA_LOGLINEAR_TREE_SEGMENT", "-4"}}).loglinear_tree_segment, 0);
  EXPECT_EQ(parse({{"HILA_LOGLINEAR_TREE_SEGMENT", ""}}).loglinear_tree_segment, -1);
  const Config b = parse({{"HILA_LOGLINEAR_STORE_BUDGET", "4096"}});
  ASSERT_TRUE(b.loglinear_store_budget.has_value());
  EXPECT_EQ(*b.loglinear_store_budget, 4096u);
  EXPECT_EQ(*parse({{"HILA_LOGLINEAR_STORE_BUDGET", "0"}}).loglinear_store_budget, 0u);
}

// ---- launch policies -----------------------------------------------------------------------------

TEST(Heuristics, GridStrideBlocks) {
  EXPECT_EQ(h::grid_stride_blocks(0), 1u);
  EXPECT_EQ(h::grid_stride_blocks(256), 1u);
  EXPECT_EQ(h::grid_stride_blocks(257), 2u);
  EXPECT_EQ(h::grid_stride_blocks(int64_t(1) << 40), 65535u * 4);
}

TEST(Heuristics, Sm80SweepHalvesItsValueTileWhenTilesAreFewerThanSms) {
  // 4 sequence x heads, 128 x 128 states: 16 tiles < 132 SMs
  EXPECT_EQ(h::gla_sm80_sweep_vtile(4, 128, 128, kH200.sms), 32);
  EXPECT_EQ(h::gla_sm80_sweep_vtile(132, 64, 64, kH200.sms), 64);
  EXPECT_EQ(h::gla_sm80_sweep_vtile(131, 64, 64, kH200.sms), 32);
  EXPECT_EQ(h::gla_sm80_sweep_vtile(4, 64, 48, kH200.sms), 64);  // 48 columns: no 32-column tiles
}

TEST(Heuristics, FusedForwardFromThreeQuartersOfTheSms) {
  const size_t smem = 100000;
  // dv = 128: two 64-column tiles per sequence x head; 4 x blocks >= 3 x 132 from 99 blocks
  EXPECT_FALSE(h::gla_fused_forward(true, 128, 128, 49, smem, kH200, Force::automatic));
  EXPECT_TRUE(h::gla_fused_forward(true, 128, 128, 50, smem, kH200, Force::automatic));
  EXPECT_TRUE(h::gla_fused_forward(true, 64, 64, 99, smem, kH200, Force::automatic));
  EXPECT_FALSE(h::gla_fused_forward(true, 64, 64, 98, smem, kH200, Force::automatic));
  // forced either way among the calls it can run
  EXPECT_TRUE(h::gla_fused_forward(true, 128, 128, 1, smem, kH200, Force::on));
  EXPECT_FALSE(h::gla_fused_forward(true, 128, 128, 1000, smem, kH200, Force::off));
  // calls it cannot run, forced or not
  EXPECT_FALSE(h::gla_fused_forward(false, 128, 128, 1000, smem, kH200, Force::on));
  EXPECT_FALSE(h::gla_fused_forward(true, 256, 128, 1000, smem, kH200, Force::on));
  EXPECT_FALSE(h::gla_fused_forward(true, 128, 96, 1000, smem, kH200, Force::on));
  EXPECT_FALSE(h::gla_fused_forward(true, 128, 128, 1000, 175000, kA100, Force::on));  // past sm_80's opt-in
  EXPECT_TRUE(h::gla_fused_forward(true, 128, 128, 1000, 175000, kH200, Force::automatic));
}

TEST(Heuristics, Sm90SweepFromThreeQuartersOfTheSms) {
  const Sm90Kernels all, forced{true, true, true, true}, no_sweep{false, true, true, false};
  // 64 x 64 tiles: 99 blocks of 132 SMs
  EXPECT_TRUE(h::gla_sm90_sweep(64, 64, 1 << 20, 1 << 14, 16, 99, kH200, all));
  EXPECT_FALSE(h::gla_sm90_sweep(64, 64, 1 << 20, 1 << 14, 16, 98, kH200, all));
  EXPECT_TRUE(h::gla_sm90_sweep(128, 128, 1 << 20, 1 << 14, 16, 25, kH200, all));  // 100 blocks
  EXPECT_TRUE(h::gla_sm90_sweep(64, 64, 1 << 20, 1 << 14, 16, 1, kH200, forced));
  EXPECT_FALSE(h::gla_sm90_sweep(64, 64, 1 << 20, 1 << 14, 16, 1000, kH200, no_sweep));
  EXPECT_FALSE(h::gla_sm90_sweep(96, 64, 1 << 20, 1 << 14, 16, 1000, kH200, forced));  // dk not a multiple of 64
  // TMA coordinates are 32-bit: the rows of the inputs, and of the per-chunk states
  EXPECT_FALSE(h::gla_sm90_sweep(64, 64, (int64_t(1) << 31) - 64, 1, 1, 1000, kH200, forced));
  EXPECT_TRUE(h::gla_sm90_sweep(64, 64, (int64_t(1) << 31) - 65, 1, 1, 1000, kH200, forced));
  EXPECT_FALSE(h::gla_sm90_sweep(128, 128, 1 << 20, int64_t(1) << 21, 8, 1000, kH200, forced));
}

TEST(Heuristics, Sm90SweepRingFitsOneWave) {
  const size_t stage = 2 * 8192 + 64 * 4 + 8;  // a 64-column key and value block, gates, mbarrier
  EXPECT_EQ(h::gla_sm90_sweep_stages(132, kH200, stage), 8);  // one block per SM
  EXPECT_EQ(h::gla_sm90_sweep_stages(264, kH200, stage), 6);  // two
  EXPECT_EQ(h::gla_sm90_sweep_stages(396, kH200, stage), 4);  // three
  EXPECT_EQ(h::gla_sm90_sweep_stages(528, kH200, stage), 3);  // four: at least 3
  EXPECT_EQ(h::gla_sm90_sweep_stages(100000, kH200, stage), 3);
}

TEST(Heuristics, Sm90ChunkKernels) {
  const Sm90Kernels all, only_sweep{true, false, false, false};
  EXPECT_TRUE(h::gla_sm90_bwd_chunk(64, 128, true, 1 << 20, 1 << 14, 16, all));
  EXPECT_FALSE(h::gla_sm90_bwd_chunk(64, 128, true, 1 << 20, 1 << 14, 16, only_sweep));
  EXPECT_FALSE(h::gla_sm90_bwd_chunk(192, 128, true, 1 << 20, 1 << 14, 16, all));
  EXPECT_FALSE(h::gla_sm90_bwd_chunk(64, 64, false, 1 << 20, 1 << 14, 16, all));  // no per-chunk states
  EXPECT_TRUE(h::gla_sm90_fused_forward(128, 192, true, false, 1 << 20, 1 << 14, 16, all));
  EXPECT_FALSE(h::gla_sm90_fused_forward(96, 128, true, false, 1 << 20, 1 << 14, 16, all));
  EXPECT_FALSE(h::gla_sm90_fused_forward(128, 128, false, false, 1 << 20, 1 << 14, 16, all));
  EXPECT_FALSE(h::gla_sm90_fused_forward(64, 64, true, false, 1 << 20, 1 << 14, 16, only_sweep));
  // the output kernel: the tree form's levels; one state per chunk only when forced ("1")
  Sm90Kernels forced_all;
  forced_all.forced = true;
  Sm90Kernels no_out;
  no_out.out = false;
  EXPECT_TRUE(h::gla_sm90_output(128, 128, true, true, 1 << 20, 1 << 14, 16, all));
  EXPECT_FALSE(h::gla_sm90_output(128, 128, false, true, 1 << 20, 1 << 14, 16, all));
  EXPECT_TRUE(h::gla_sm90_output(128, 128, false, true, 1 << 20, 1 << 14, 16, forced_all));
  EXPECT_FALSE(h::gla_sm90_output(128, 128, true, true, 1 << 20, 1 << 14, 16, no_out));
  EXPECT_FALSE(h::gla_sm90_output(96, 128, true, true, 1 << 20, 1 << 14, 16, forced_all));
  EXPECT_FALSE(h::gla_sm90_output(64, 96, true, true, 1 << 20, 1 << 14, 16, forced_all));
  EXPECT_FALSE(h::gla_sm90_output(64, 64, true, false, 1 << 20, 1 << 14, 16, forced_all));
  EXPECT_FALSE(h::gla_sm90_output(128, 128, true, true, 1 << 20, int64_t(1) << 21, 8, forced_all));
  // the per-chunk states' rows count only where they are stored
  EXPECT_TRUE(h::gla_sm90_fused_forward(128, 128, true, false, 1 << 20, int64_t(1) << 21, 8, all));
  EXPECT_FALSE(h::gla_sm90_fused_forward(128, 128, true, true, 1 << 20, int64_t(1) << 21, 8, all));
}

TEST(Heuristics, LogLinear) {
  EXPECT_TRUE(h::loglinear_tree(true, 64, 128, true));
  EXPECT_FALSE(h::loglinear_tree(false, 64, 128, true));  // 16-bit operands only
  EXPECT_FALSE(h::loglinear_tree(true, 16, 64, true));    // every warp takes part in dQ: dk >= 32
  EXPECT_FALSE(h::loglinear_tree(true, 144, 64, true));
  EXPECT_FALSE(h::loglinear_tree(true, 64, 144, true));
  EXPECT_FALSE(h::loglinear_tree(true, 64, 64, false));  // HILA_LOGLINEAR_TREE=0
  // the tree build in the sweep from half the SMs
  using h::TreeBuild;
  EXPECT_EQ(h::loglinear_tree_build(66, 132, 5, Force::automatic), TreeBuild::sweep);
  EXPECT_EQ(h::loglinear_tree_build(65, 132, 5, Force::automatic), TreeBuild::sweep_segments);
  EXPECT_EQ(h::loglinear_tree_build(65, 132, 0, Force::automatic), TreeBuild::chunks);
  EXPECT_EQ(h::loglinear_tree_build(1, 132, 0, Force::on), TreeBuild::sweep);
  EXPECT_EQ(h::loglinear_tree_build(1, 132, 2, Force::on), TreeBuild::sweep_segments);
  EXPECT_EQ(h::loglinear_tree_build(1000, 132, 5, Force::off), TreeBuild::chunks);
  // the tree passes in segments of 32 chunks: sequences from 0, at least 128 chunks, fewer threads
  // in one pass than twice the SMs hold
  EXPECT_EQ(h::loglinear_tree_segment(false, 1024, 65536, 132, -1), 5);    // 1 x 64K, H = 16, 128 x 128
  EXPECT_EQ(h::loglinear_tree_segment(false, 127, 65536, 132, -1), 0);
  EXPECT_EQ(h::loglinear_tree_segment(false, 1024, 2 * 2048 * 132, 132, -1), 0);
  EXPECT_EQ(h::loglinear_tree_segment(true, 1024, 65536, 132, -1), 0);     // a sequence from n0 > 0
  EXPECT_EQ(h::loglinear_tree_segment(false, 4, 65536, 132, 1), 1);        // HILA_LOGLINEAR_TREE_SEGMENT
  EXPECT_EQ(h::loglinear_tree_segment(false, 1024, 65536, 132, 0), 0);
  EXPECT_EQ(h::loglinear_tree_segment(true, 1024, 65536, 132, 3), 0);
  // parts of long reading ranges: sequences from 0, up to 2^20 chunks
  EXPECT_TRUE(h::loglinear_tree_parts(false, 64 * ((int64_t(1) << 20) - 8), 8, 64));
  EXPECT_FALSE(h::loglinear_tree_parts(false, 64 * ((int64_t(1) << 20) - 8), 9, 64));
  EXPECT_FALSE(h::loglinear_tree_parts(true, 4096, 1, 64));
  // a quarter of the free memory, of the total with a workspace
  EXPECT_EQ(h::loglinear_store_budget(400, 1000, false), 100u);
  EXPECT_EQ(h::loglinear_store_budget(400, 1000, true), 250u);
}

TEST(Heuristics, LogLinearOutputsChunkParallelAskTheBudgetLast) {
  int asked = 0;
  auto budget = [&] {
    ++asked;
    return size_t(1000);
  };
  EXPECT_TRUE(h::loglinear_outputs_chunk_parallel(true, 4, 1000, kH200, false, 1000, budget));
  EXPECT_FALSE(h::loglinear_outputs_chunk_parallel(true, 4, 1000, kH200, false, 1001, budget));
  EXPECT_EQ(asked, 2);
  EXPECT_TRUE(h::loglinear_outputs_chunk_parallel(true, 4, 1000, kH200, true, 1 << 30, budget));  // levels given
  EXPECT_FALSE(h::loglinear_outputs_chunk_parallel(false, 4, 1000, kH200, false, 0, budget));    // no output
  EXPECT_FALSE(h::loglinear_outputs_chunk_parallel(true, 0, 1000, kH200, false, 0, budget));     // no segment
  EXPECT_FALSE(h::loglinear_outputs_chunk_parallel(true, 4, 300000, kH200, false, 0, budget));   // smem
  EXPECT_EQ(asked, 2);  // the free memory is queried only when it decides
}

TEST(Heuristics, DeltaRule) {
  EXPECT_TRUE(h::delta_sm80(128, 256, true));
  EXPECT_FALSE(h::delta_sm80(144, 64, true));
  EXPECT_FALSE(h::delta_sm80(64, 272, true));
  EXPECT_FALSE(h::delta_sm80(64, 64, false));  // HILA_GDN_TC=0
  EXPECT_EQ(h::delta_portable_blocks(0, 132), 1);
  EXPECT_EQ(h::delta_portable_blocks(100, 132), 100);
  EXPECT_EQ(h::delta_portable_blocks(100000, 132), 528);
}

TEST(Heuristics, DeltaSm90Sweeps) {
  EXPECT_TRUE(h::delta_sm90_sweep(128, 128, 1 << 20, true));
  EXPECT_TRUE(h::delta_sm90_sweep(64, 256, 1 << 20, true));
  EXPECT_FALSE(h::delta_sm90_sweep(128, 128, 1 << 20, false));  // HILA_DELTA_SM90=0
  EXPECT_FALSE(h::delta_sm90_sweep(96, 128, 1 << 20, true));    // one or two m64 state slabs
  EXPECT_FALSE(h::delta_sm90_sweep(48, 64, 1 << 20, true));
  EXPECT_FALSE(h::delta_sm90_sweep(128, 80, 1 << 20, true));    // 64-column value tiles
  EXPECT_FALSE(h::delta_sm90_sweep(128, 128, (int64_t(1) << 31) - 64, true));  // 32-bit TMA rows
  // dk = 128: forward stages W, K (32 KB), reverse Q, K, W, dO (56 KB); the 16 KB state tile
  const size_t fwd = 4 * 8192 + 8, rev = 7 * 8192 + 8, fixed = 128 * 128 + 16;
  EXPECT_EQ(h::delta_sm90_sweep_stages(256, kH200, fwd, fixed), 3);     // B = 8, H = 16, dv = 128: two per SM
  EXPECT_EQ(h::delta_sm90_sweep_stages(100000, kH200, fwd, fixed), 3);
  EXPECT_EQ(h::delta_sm90_sweep_stages(32, kH200, fwd, fixed), 4);      // one per SM: the deepest ring
  EXPECT_EQ(h::delta_sm90_sweep_stages(256, kH200, rev, fixed), 3);     // two per SM do not fit: one
  EXPECT_EQ(h::delta_sm90_sweep_stages(32, kH200, rev, fixed), 3);
  EXPECT_EQ(h::delta_sm90_sweep_stages(256, kH200, 120000, fixed), 0);  // not two stages
  // what the forward takes at two blocks per SM fits them: 2 x (3 stages + state tile + 1 KB)
  EXPECT_LE(2 * (3 * fwd + fixed + 1024), size_t(233472));
  // the reverse sweep's warpgroups per block: two (Q, K, W shared, two dO blocks and state tiles)
  // where one-warpgroup blocks (one per SM at dk = 128) would take more waves
  const size_t rev2 = 8 * 8192 + 8, fixed2 = 2 * fixed;
  EXPECT_EQ(h::delta_sm90_rsweep_warpgroups(256, true, kH200, rev, fixed, rev2, fixed2), 2);   // B = 8, T = 4K
  EXPECT_EQ(h::delta_sm90_rsweep_warpgroups(1024, true, kH200, rev, fixed, rev2, fixed2), 2);  // B = 32, T = 1K
  EXPECT_EQ(h::delta_sm90_rsweep_warpgroups(32, true, kH200, rev, fixed, rev2, fixed2), 1);    // B = 1, T = 64K: one wave
  EXPECT_EQ(h::delta_sm90_rsweep_warpgroups(132, true, kH200, rev, fixed, rev2, fixed2), 1);
  EXPECT_EQ(h::delta_sm90_rsweep_warpgroups(136, true, kH200, rev, fixed, rev2, fixed2), 2);
  EXPECT_EQ(h::delta_sm90_rsweep_warpgroups(256, false, kH200, rev, fixed, rev2, fixed2), 1);  // dv not a multiple of 128
  EXPECT_EQ(h::delta_sm90_sweep_stages(128, kH200, rev2, fixed2, 1), 3);
  EXPECT_EQ(h::delta_sm90_sweep_stages(512, kH200, rev2, fixed2, 1), 3);  // one per SM whatever the count
  // dk = 64: one-warpgroup blocks fit two per SM, two-warpgroup ones one: as many waves, one warpgroup
  const size_t rev64 = 4 * 8192 + 8, fixed64 = 64 * 128 + 16;
  EXPECT_EQ(h::delta_sm90_rsweep_warpgroups(256, true, kH200, rev64, fixed64, 5 * 8192 + 8, 2 * fixed64), 1);
  EXPECT_EQ(h::delta_sm90_rsweep_warpgroups(272, true, kH200, rev64, fixed64, 5 * 8192 + 8, 2 * fixed64), 1);
  EXPECT_EQ(h::delta_sm90_sweep_stages(272, kH200, rev64, fixed64), 3);
  // the forward sweep's warpgroups per block: two (W, K shared) where one-warpgroup blocks would
  // share SMs, one where each tile has an SM of its own or dv is not a multiple of 128
  EXPECT_EQ(h::delta_sm90_sweep_warpgroups(256, true, kH200), 2);   // B = 8, T = 4K
  EXPECT_EQ(h::delta_sm90_sweep_warpgroups(1024, true, kH200), 2);  // B = 32, T = 1K
  EXPECT_EQ(h::delta_sm90_sweep_warpgroups(132, true, kH200), 1);
  EXPECT_EQ(h::delta_sm90_sweep_warpgroups(64, true, kH200), 1);    // B = 2, T = 16K
  EXPECT_EQ(h::delta_sm90_sweep_warpgroups(256, false, kH200), 1);
  // dk = 128, two warpgroups: stages of W, K and two U blocks (48 KB), two state and vt tiles (48 KB)
  EXPECT_EQ(h::delta_sm90_sweep_stages(128, kH200, 6 * 8192 + 8, 2 * 3 * 8192, 1), 3);
}

TEST(Heuristics, DeltaSweepPieces) {
  // B = 1, T = 64K, H = 16, dv = 128: 32 sweep blocks (64 in the backward) on 132 SMs, 1024 chunks:
  // eight pieces; B = 2, T = 16K: the forward's 64 blocks in four pieces, the backward's 128 in one
  EXPECT_EQ(h::delta_sweep_pieces(32, 1024, kH200, 0), 8);
  EXPECT_EQ(h::delta_sweep_pieces(64, 1024, kH200, 0), 8);
  EXPECT_EQ(h::delta_sweep_pieces(64, 256, kH200, 0), 4);
  EXPECT_EQ(h::delta_sweep_pieces(128, 256, kH200, 0), 1);
  // B = 8, T = 4K (256 blocks) and short sequences: one
  EXPECT_EQ(h::delta_sweep_pieces(256, 64, kH200, 0), 1);
  EXPECT_EQ(h::delta_sweep_pieces(4, 127, kH200, 0), 1);
  EXPECT_EQ(h::delta_sweep_pieces(4, 128, kH200, 0), 2);
  // the knob: that many, at most one per chunk, and one for a single chunk
  EXPECT_EQ(h::delta_sweep_pieces(512, 16, kH200, 3), 3);
  EXPECT_EQ(h::delta_sweep_pieces(4, 5, kH200, 8), 5);
  EXPECT_EQ(h::delta_sweep_pieces(4, 1, kH200, 4), 1);
  EXPECT_EQ(h::delta_sweep_pieces(4, 0, kH200, 0), 1);
}

TEST(Heuristics, DecodeStep) {
  // one tile: normalize, or S ops without counters or with enough (sequence, head) blocks
  EXPECT_EQ(h::step_tiles(true, false, true, 4, 129, 64, 132), 1);
  EXPECT_EQ(h::step_tiles(false, true, false, 4, 129, 64, 132), 1);
  EXPECT_EQ(h::step_tiles(false, true, true, 528, 129, 64, 132), 1);
  EXPECT_EQ(h::step_tiles(false, true, true, 527, 129, 64, 132), 3);
  EXPECT_EQ(h::step_tiles(false, false, false, 4, 128, 64, 132), 2);
  EXPECT_TRUE(h::step_s_in_smem(true, 128, 256, 128 * 129 / 2 * 4));
  EXPECT_FALSE(h::step_s_in_smem(true, 160, 256, 160 * 161 / 2 * 4 * 2));  // past 40 KB
  EXPECT_FALSE(h::step_s_in_smem(true, 320, 256, 1000));                   // more rows than threads
  EXPECT_FALSE(h::step_s_in_smem(false, 64, 256, 1000));
  auto smem = [](int stages) { return size_t(stages) * 40000; };
  EXPECT_EQ(h::step_ring_stages(8, 128 * 64 * 4, 232448, smem), 1);      // one 32 KB stage
  EXPECT_EQ(h::step_ring_stages(8, 64 * 64 * 4, 232448, smem), 2);       // two 16 KB stages
  EXPECT_EQ(h::step_ring_stages(8, 32 * 64 * 4, 232448, smem), 3);       // at most 3
  EXPECT_EQ(h::step_ring_stages(2, 32 * 64 * 4, 232448, smem), 2);       // no more than the items
  EXPECT_EQ(h::step_ring_stages(8, 32 * 64 * 4, 90000, smem), 2);        // within the opt-in
  EXPECT_EQ(h::step_ring_stages(8, 1024 * 64 * 4, 232448, smem), 1);     // at least one
  EXPECT_EQ(h::step_rows(32, 8), 4);
  EXPECT_EQ(h::step_rows(33, 8), 8);
  EXPECT_EQ(h::step_rows(128, 8), 16);
  EXPECT_EQ(h::step_rows(256, 8), 32);
  EXPECT_EQ(h::step_rows(512, 8), 64);
}

// ---- CPU backend ---------------------------------------------------------------------------------

TEST(Heuristics, CpuParallelOnlyForSeveralItemsAndEnoughWork) {
  using hila::detail::cpu_parallel;
  using hila::detail::kCpuParallelWork;
  // work per (sequence, head) as backend.cpp counts it: dk (dk + 3 dv) T, 4x for Fenwick ops
  const int64_t d16 = 16 * (16 + 3 * 16);
  EXPECT_TRUE(cpu_parallel(2, d16 * 64));      // a tiny training call: 2 heads, T = 64, d = 16
  EXPECT_TRUE(cpu_parallel(2, 4 * d16 * 64));  // the same for a log-linear op
  EXPECT_FALSE(cpu_parallel(2, d16 * 16));     // T = 16: a few microseconds in all, serial
  EXPECT_FALSE(cpu_parallel(32, d16));         // a decode-sized call (T = 1) over 32 heads
  EXPECT_FALSE(cpu_parallel(1, kCpuParallelWork * 8));  // one item: nothing to share
  EXPECT_FALSE(cpu_parallel(4, kCpuParallelWork / 4 - 1));
  EXPECT_TRUE(cpu_parallel(4, kCpuParallelWork / 4));
  EXPECT_TRUE(cpu_parallel(8 * 4, 8192 * 128 * (128 + 3 * 128)));  // 8 x 8192 x 4 heads of d = 128
  EXPECT_FALSE(cpu_parallel(0, 1 << 30));
  EXPECT_FALSE(cpu_parallel(16, 0));
}

TEST(Heuristics, CpuSegmentRowsDivideTheChunk) {
  using hila::detail::cpu_segment_rows;
  // small heads: 32 rows (mamba), 16 (delta); d = 64: the chunk (mamba), 32 (delta)
  EXPECT_EQ(cpu_segment_rows(64, 16, 16, false), 32);
  EXPECT_EQ(cpu_segment_rows(64, 16, 16, true), 16);
  EXPECT_EQ(cpu_segment_rows(64, 16, 17, false), 32);  // dv' = 17 (normalize): d = 32
  EXPECT_EQ(cpu_segment_rows(64, 64, 64, false), 64);
  EXPECT_EQ(cpu_segment_rows(64, 64, 64, true), 32);
  EXPECT_EQ(cpu_segment_rows(64, 128, 128, true), 64);
  EXPECT_EQ(cpu_segment_rows(64, 8, 256, false), 64);  // the wider of dk and dv
  EXPECT_EQ(cpu_segment_rows(8, 16, 16, false), 8);    // never more than the chunk
  EXPECT_EQ(cpu_segment_rows(1, 128, 128, true), 1);
  // the Fenwick delta rule: at least 32 rows, d / 2 above that
  EXPECT_EQ(cpu_segment_rows(64, 16, 16, true, true), 32);
  EXPECT_EQ(cpu_segment_rows(64, 32, 32, true, true), 32);
  EXPECT_EQ(cpu_segment_rows(64, 128, 128, true, true), 64);
  EXPECT_EQ(cpu_segment_rows(16, 16, 16, true, true), 16);
  // a power of two dividing every power-of-two chunk it does not exceed
  for (int64_t C = 1; C <= 1024; C *= 2)
    for (int64_t d : {1, 3, 8, 16, 33, 64, 100, 128, 512})
      for (bool delta : {false, true}) {
        const int64_t R = cpu_segment_rows(C, d, d, delta);
        EXPECT_TRUE(R >= 1 && R <= C && C % R == 0 && (R & (R - 1)) == 0) << C << " " << d << " " << delta;
      }
}

}  // namespace
}  // namespace hila::cuda
