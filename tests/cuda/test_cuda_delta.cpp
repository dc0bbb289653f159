// SPDX-License-Identifier: Apache-2.0
// CUDA gdn / loglinear_gdn (docs/math/LOGLINEAR.md §6) against the CPU float64 oracle on the same rounded
// inputs: forward output and final state, and every gradient (dq, dk, dv, dg, dbeta, dlam, d_init).
// The oracle is the naive masked-matrix form (O(T^3) for the delta rule) up to T = 300 and the
// float64 chunk form beyond (itself checked against the naive form by hila_tests). Plain gdn in
// bf16/fp16 runs the tensor-core path (src/cuda/delta/gdn_sm80.cu) in both directions;
// loglinear_gdn in bf16/fp16 from position 0 without an initial state runs its tensor-core forward
// (src/cuda/delta/loglinear_gdn_sm80.cu), and its tensor-core backward without a final-state
// cotangent (the *_train_tc cases); the other cases run the FMA segment sweep
// (src/cuda/delta/segment_portable.cu). Without a GPU every test is skipped with a printed reason,
// so CI still compiles this file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>

#include "cuda_support.h"
#include "problem.h"

namespace hila::tools {
namespace {

struct DeltaCase {
  Op op;
  DType dtype;
  int64_t B, T, G, H, dk, dv;
  std::vector<int64_t> seqlens;
  bool gated, init;
  std::vector<int64_t> init_pos;  // one per sequence or one for all (init only)
  bool l2;
  double tol;
  std::string name;
  int64_t extra_slots = 0;        // log-linear init state capacity beyond its position
  bool d_final = true;            // a final-state cotangent (false: the training call)
  // HILA_DELTA_SM90 for the calls (nullptr: "0", the sm80 sweeps): "1" (the default) takes the sm_90a state
  // sweeps of plain gdn (src/cuda/delta/sweep_sm90.cu) and loglinear_gdn's level sweeps
  // (src/cuda/delta/loglinear_gdn_sm90.cu) where they apply (on Hopper, or on the emulator with
  // HILA_EMU_SM90=1), the sm80 sweeps elsewhere
  const char* delta_sm90 = nullptr;
  bool bwd_o = true;  // the backward call asks for o too (false: it does not; the forward entry point checks o)
  // HILA_DELTA_PIECES for the calls (nullptr: unset, heuristics::delta_sweep_pieces, one piece at
  // these lengths): plain gdn's WY kernel and sweeps pipelined in that many pieces
  const char* pieces = nullptr;
};

std::vector<DeltaCase> cases() {
  std::vector<DeltaCase> cs;
  const std::vector<int64_t> varlen = {0, 100, 0, 64, 1, 257};
  for (Op op : {Op::gdn, Op::loglinear_gdn}) {
    const std::string n = op_name(op);
    const bool ll = op == Op::loglinear_gdn;
    // unaligned starts for the log-linear level grid (§2.6): 13, 200, 2^17 + 5 (and 0, 7, 64)
    const std::vector<int64_t> pos = {13, 200, 0, (int64_t(1) << 17) + 5, 7, 64};
    for (int64_t T : {1, 63, 64, 65, 1000})
      cs.push_back({op, DType::bf16, 2, T, 2, 2, 128, 128, {}, true, false, {}, false, 1e-2,
                    n + "_bf16_d128_T" + std::to_string(T)});
    cs.push_back({op, DType::bf16, 1, 0, 1, 4, 64, 64, varlen, true, true, pos, false, 1e-2, n + "_bf16_varlen_init"});
    cs.push_back({op, DType::bf16, 2, 300, 1, 4, 64, 64, {}, true, true, {ll ? 13 : 0}, true, 1e-2,
                  n + "_bf16_gqa4_init_l2norm", ll ? 2 : 0});
    cs.push_back({op, DType::bf16, 1, 200, 2, 4, 40, 72, {}, false, true, {200}, false, 1e-2,
                  n + "_bf16_dk40_dv72_ungated_gqa2_init200"});
    cs.push_back({op, DType::f16, 2, 130, 1, 2, 64, 64, {}, true, true, {13}, true, 1e-2, n + "_f16_init13_l2norm"});
    // qk_l2norm with dk % 4 != 0: q, k and dq, dk element by element in the packing and the chain
    // rule (qk.cu), the padded columns of the per-head gradients masked
    cs.push_back({op, DType::bf16, 1, 150, 2, 4, 42, 40, {}, true, !ll, {0}, true, 1e-2,
                  n + "_bf16_dk42_dv40_gqa2_l2norm" + (ll ? "_train" : "_init"), 0, !ll});
    for (int64_t T : {65, 1000})
      cs.push_back({op, DType::f32, 2, T, 2, 2, 64, 64, {}, true, false, {}, false, 1e-4,
                    n + "_f32_d64_T" + std::to_string(T)});
    cs.push_back({op, DType::f32, 1, 0, 1, 4, 64, 64, varlen, true, true, pos, true, 1e-4, n + "_f32_varlen_init_l2norm"});
    cs.push_back({op, DType::f32, 1, 130, 1, 4, 32, 48, {}, true, true, {(int64_t(1) << 17) + 5}, false, 1e-4,
                  n + "_f32_gqa4_init_2p17p5"});
    for (int64_t T : {1, 65, 130})
      cs.push_back({op, DType::f64, 2, T, 1, 2, 32, 32, {}, true, true, {13}, T != 65, 1e-10,
                    n + "_f64_d32_init13_T" + std::to_string(T)});
    cs.push_back({op, DType::f64, 1, 0, 1, 2, 16, 24, {0, 37, 0, 64, 65, 1, 130, 0}, true, true,
                  {5, 64, 13, 200, 0, 127, 9, 3}, true, 1e-10, n + "_f64_varlen_init_l2norm"});
  }
  // plain gdn in 16 bits at a longer length: the tensor-core forward and backward (delta/gdn_sm80.cu)
  cs.push_back({Op::gdn, DType::bf16, 1, 4096, 1, 2, 128, 128, {}, true, true, {0}, true, 1e-2,
                "gdn_bf16_T4096_init_l2norm"});
  // qk_l2norm with one head per group: the WY backward writes the final dk through the l2norm chain
  // rule into the caller's tensor (wy_bwd_kernel's dk16), both sweeps and loglinear_gdn's training call
  for (const char* sm : {"0", "1"})
    cs.push_back({Op::gdn, DType::bf16, 2, 300, 2, 2, 128, 128, {}, true, true, {0}, true, 1e-2,
                  std::string("gdn_bf16_d128_T300_init_l2norm") + (sm[0] == '1' ? "_sm90" : ""), 0, true, sm});
  cs.push_back({Op::loglinear_gdn, DType::bf16, 2, 300, 2, 2, 128, 128, {}, true, false, {}, true, 1e-2,
                "loglinear_gdn_bf16_d128_T300_l2norm_train_tc", 0, false});
  // dv = 256 (four value tiles per sweep; the backward's kernels fit shared memory with dk <= 64)
  cs.push_back({Op::gdn, DType::bf16, 1, 130, 1, 2, 64, 256, {}, true, true, {0}, false, 1e-2,
                "gdn_bf16_dk64_dv256_T130_init"});
  // loglinear_gdn in 16 bits from position 0 without an initial state: the tensor-core forward
  // (wy_kernel with Qeff, the level sweeps; the final state from both), checked by the forward
  // entry point below (the backward runs the segment sweep). Lengths around chunk-level edges.
  const Op lg = Op::loglinear_gdn;
  cs.push_back({lg, DType::bf16, 1, 0, 1, 4, 64, 64, {0, 100, 0, 64, 1, 257, 128, 192, 129}, true, false, {}, false,
                1e-2, "loglinear_gdn_bf16_varlen_tc"});
  cs.push_back({lg, DType::bf16, 2, 300, 1, 4, 64, 64, {}, true, false, {}, true, 1e-2, "loglinear_gdn_bf16_gqa4_l2norm_tc"});
  cs.push_back({lg, DType::bf16, 1, 200, 2, 4, 40, 72, {}, false, false, {}, false, 1e-2,
                "loglinear_gdn_bf16_dk40_dv72_ungated_gqa2_tc"});
  cs.push_back({lg, DType::f16, 2, 130, 1, 2, 64, 64, {}, true, false, {}, true, 1e-2, "loglinear_gdn_f16_l2norm_tc"});
  cs.push_back({lg, DType::bf16, 1, 256, 1, 2, 64, 256, {}, true, false, {}, false, 1e-2, "loglinear_gdn_bf16_dv256_T256_tc"});
  // ... and without a final-state cotangent: the tensor-core backward too (level sweeps reversed,
  // ll_grad_kernel, ll_intra_bwd_kernel, the WY backward)
  for (int64_t T : {1, 63, 64, 65, 129, 300, 1000})
    cs.push_back({lg, DType::bf16, 2, T, 2, 2, 128, 128, {}, true, false, {}, false, 1e-2,
                  "loglinear_gdn_bf16_d128_T" + std::to_string(T) + "_train_tc", 0, false});
  cs.push_back({lg, DType::bf16, 1, 0, 1, 4, 64, 64, {0, 100, 0, 64, 1, 257, 128, 192, 129}, true, false, {}, false,
                1e-2, "loglinear_gdn_bf16_varlen_train_tc", 0, false});
  cs.push_back({lg, DType::bf16, 2, 300, 1, 4, 64, 64, {}, true, false, {}, true, 1e-2,
                "loglinear_gdn_bf16_gqa4_l2norm_train_tc", 0, false});
  cs.push_back({lg, DType::bf16, 1, 200, 2, 4, 40, 72, {}, false, false, {}, false, 1e-2,
                "loglinear_gdn_bf16_dk40_dv72_ungated_gqa2_train_tc", 0, false});
  cs.push_back({lg, DType::f16, 2, 130, 1, 2, 64, 64, {}, true, false, {}, true, 1e-2, "loglinear_gdn_f16_l2norm_train_tc",
                0, false});
  // the sm_90a state sweeps of plain gdn forced on: chunk edges (T = 1, 63, 64, 65, 200, 256) at
  // dk = dv = 128 (two state slabs), dk = 64 with varlen and empty sequences, GQA, l2norm, initial
  // and final states, mixed head dims (one and four value tiles), ungated, without a final-state
  // cotangent, and head dims they do not take (dk = 40: the sm80 sweeps)
  const std::string s9 = "_sm90";
  for (int64_t T : {1, 63, 64, 65, 200, 256})
    cs.push_back({Op::gdn, DType::bf16, 2, T, 2, 2, 128, 128, {}, true, T == 65 || T == 200, {0}, false, 1e-2,
                  "gdn_bf16_d128_T" + std::to_string(T) + s9, 0, true, "1"});
  cs.push_back({Op::gdn, DType::f16, 1, 0, 1, 4, 64, 64, varlen, true, true, {0}, false, 1e-2, "gdn_f16_d64_varlen_init" + s9,
                0, true, "1"});
  cs.push_back({Op::gdn, DType::bf16, 2, 300, 1, 4, 64, 64, {}, true, true, {0}, true, 1e-2, "gdn_bf16_gqa4_init_l2norm" + s9,
                0, true, "1"});
  cs.push_back({Op::gdn, DType::bf16, 1, 200, 2, 4, 128, 64, {}, true, true, {0}, false, 1e-2,
                "gdn_bf16_dk128_dv64_gqa2_init" + s9, 0, true, "1"});
  cs.push_back({Op::gdn, DType::bf16, 1, 130, 1, 2, 64, 256, {}, true, true, {0}, false, 1e-2,
                "gdn_bf16_dk64_dv256_T130_init" + s9, 0, true, "1"});
  cs.push_back({Op::gdn, DType::bf16, 2, 130, 1, 2, 64, 128, {}, false, true, {0}, false, 1e-2,
                "gdn_bf16_dk64_dv128_ungated_init" + s9, 0, true, "1"});
  cs.push_back({Op::gdn, DType::bf16, 2, 129, 1, 2, 128, 128, {}, true, true, {0}, false, 1e-2,
                "gdn_bf16_d128_T129_init_train" + s9, 0, false, "1"});
  cs.push_back({Op::gdn, DType::bf16, 1, 200, 2, 4, 40, 72, {}, true, true, {0}, false, 1e-2,
                "gdn_bf16_dk40_dv72_gqa2_init" + s9, 0, true, "1"});
  // more sweep blocks than SMs (136 on the 132 of an H200 or the emulator): the forward two per SM,
  // the reverse two warpgroups per block, rings shallower than above, five chunks wrapping them
  cs.push_back({Op::gdn, DType::bf16, 1, 260, 68, 68, 128, 128, {}, true, true, {0}, false, 1e-2,
                "gdn_bf16_d128_H68_T260_init_wide" + s9, 0, true, "1"});
  // dk = 64 with more tiles than two blocks per SM hold (272): one warpgroup per block, two blocks
  // per SM, three chunks
  cs.push_back({Op::gdn, DType::bf16, 1, 130, 136, 136, 64, 128, {}, true, true, {0}, false, 1e-2,
                "gdn_bf16_dk64_dv128_H136_T130_init_wide" + s9, 0, true, "1"});
  // plain gdn's WY kernel and state sweeps in pieces (GlaArgs::c_lo; the sweeps carry the state and
  // its cotangent from piece to piece): pieces of 6, 6 and 4 chunks with both states (sm90 sweeps),
  // varlen with empty sequences and sequences that end before the last piece (sm90), the sm80
  // sweeps in pieces of 2, 2 and 1 chunks, and the training call (no states) with GQA and l2norm
  cs.push_back({Op::gdn, DType::bf16, 2, 1000, 2, 2, 128, 128, {}, true, true, {0}, false, 1e-2,
                "gdn_bf16_d128_T1000_init_pieces3" + s9, 0, true, "1", true, "3"});
  cs.push_back({Op::gdn, DType::f16, 1, 0, 1, 4, 64, 64, varlen, true, true, {0}, false, 1e-2,
                "gdn_f16_d64_varlen_init_pieces2" + s9, 0, true, "1", true, "2"});
  cs.push_back({Op::gdn, DType::bf16, 2, 300, 2, 2, 128, 128, {}, true, true, {0}, false, 1e-2,
                "gdn_bf16_d128_T300_init_pieces4", 0, true, nullptr, true, "4"});
  cs.push_back({Op::gdn, DType::bf16, 2, 260, 1, 2, 64, 64, {}, true, false, {}, true, 1e-2,
                "gdn_bf16_gqa2_l2norm_T260_train_pieces5" + s9, 0, false, "1", true, "5"});
  // loglinear_gdn's level sweeps on the sm90 tier forced on (src/cuda/delta/loglinear_gdn_sm90.cu):
  // without a final-state cotangent (both sweeps; the forward entry point the forward sweep alone),
  // lengths across several Fenwick levels (T = 1, 63, 64, 65, 130, 256, 300) at dk = dv = 128, dk =
  // 64 with varlen and empty sequences (f16), GQA with l2norm, ungated (without decay the level-3 state
  // read at chunk 4 carries both lower levels' parts of E, which the gated cases decay away), four
  // value tiles (the forward
  // sweep; the tensor-core backward takes dv <= 128: the segment backward), a final-state cotangent
  // (the forward sweep; the segment backward), an initial state (the segment sweep: the level sweeps
  // start at position 0) and a head dim they do not take (dk = 40: the sm80 sweeps)
  const std::string l9 = "_train_sm90";
  for (int64_t T : {1, 63, 64, 65, 130, 256, 300})
    cs.push_back({lg, DType::bf16, 2, T, 2, 2, 128, 128, {}, true, false, {}, false, 1e-2,
                  "loglinear_gdn_bf16_d128_T" + std::to_string(T) + l9, 0, false, "1"});
  cs.push_back({lg, DType::f16, 1, 0, 1, 4, 64, 64, {0, 100, 0, 64, 1, 257, 128, 192, 129}, true, false, {}, false,
                1e-2, "loglinear_gdn_f16_d64_varlen" + l9, 0, false, "1"});
  cs.push_back({lg, DType::bf16, 2, 300, 1, 4, 64, 64, {}, true, false, {}, true, 1e-2,
                "loglinear_gdn_bf16_gqa4_l2norm" + l9, 0, false, "1"});
  cs.push_back({lg, DType::bf16, 2, 300, 1, 2, 64, 128, {}, false, false, {}, false, 1e-2,
                "loglinear_gdn_bf16_dk64_dv128_ungated_T300" + l9, 0, false, "1"});
  cs.push_back({lg, DType::bf16, 1, 300, 1, 2, 128, 128, {}, false, false, {}, false, 1e-2,
                "loglinear_gdn_bf16_d128_ungated_T300" + l9, 0, false, "1"});
  // a backward that does not ask for o: its forward recompute has no output to add to (the level
  // sweeps skip Qeff and their output product)
  cs.push_back({lg, DType::bf16, 1, 300, 1, 2, 128, 128, {}, false, false, {}, false, 1e-2,
                "loglinear_gdn_bf16_d128_ungated_T300_no_o" + l9, 0, false, "1", false});
  cs.push_back({lg, DType::bf16, 1, 0, 1, 4, 64, 64, {0, 100, 0, 64, 1, 257, 128, 192, 129}, true, false, {}, false,
                1e-2, "loglinear_gdn_bf16_d64_varlen_no_o" + l9, 0, false, "1", false});
  cs.push_back({lg, DType::bf16, 1, 256, 1, 2, 64, 256, {}, true, false, {}, false, 1e-2,
                "loglinear_gdn_bf16_dk64_dv256_T256" + l9, 0, false, "1"});
  cs.push_back({lg, DType::bf16, 1, 300, 2, 4, 128, 64, {}, true, false, {}, false, 1e-2,
                "loglinear_gdn_bf16_dk128_dv64_gqa2_sm90", 0, true, "1"});
  cs.push_back({lg, DType::bf16, 2, 300, 1, 4, 64, 64, {}, true, true, {13}, true, 1e-2,
                "loglinear_gdn_bf16_gqa4_init_l2norm_sm90", 2, true, "1"});
  cs.push_back({lg, DType::bf16, 1, 200, 2, 4, 40, 72, {}, true, false, {}, false, 1e-2,
                "loglinear_gdn_bf16_dk40_dv72_gqa2" + l9, 0, false, "1"});
  // more level blocks than SMs (level 1: 24 x 3 x 2 = 144 on the 132 of an H200 or the emulator):
  // the forward's ring two stages deep, wrapped by level 2's three chunks
  cs.push_back({lg, DType::bf16, 1, 260, 24, 24, 128, 128, {}, true, false, {}, false, 1e-2,
                "loglinear_gdn_bf16_d128_H24_T260_wide" + l9, 0, false, "1"});
  // levels 1 .. 4 at dk = 64: level 4's eight chunks wrap both rings (four stages)
  cs.push_back({lg, DType::bf16, 1, 1000, 1, 2, 64, 64, {}, true, false, {}, false, 1e-2,
                "loglinear_gdn_bf16_dk64_T1000" + l9, 0, false, "1"});
  return cs;
}

class CudaDelta : public ::testing::TestWithParam<DeltaCase> {};

TEST_P(CudaDelta, ForwardBackwardMatchFloat64Oracle) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const DeltaCase c = GetParam();
  ProblemSpec s;
  s.cfg.op = c.op;
  s.cfg.qk_l2norm = c.l2;
  s.B = c.B, s.T = c.T, s.G = c.G, s.H = c.H, s.dk = c.dk, s.dv = c.dv;
  s.seqlens = c.seqlens;
  s.gated = c.gated;
  s.init_state = c.init;
  s.init_pos = c.init_pos;
  s.init_extra_slots = c.extra_slots;
  s.dtype = DType::f64;
  s.seed = 23;
  // the reference: float64 on the inputs rounded to the tested dtype
  Problem low = cast_problem(make_problem(s), c.dtype);
  if (!c.d_final) low.d_final = {};
  const Problem ref_in = cast_problem(low, DType::f64);
  int64_t longest = 0;
  for (int64_t i = 0; i < low.num_seqs(); ++i) longest = std::max(longest, low.seq_len(i));
  const Form oracle = longest <= 300 ? Form::naive : Form::chunk;
  const Result ref = run_backward(ref_in, oracle);

  DevTensor q(low.q), k(low.k), v(low.v), g(low.g), lam(low.lam), beta(low.beta), cu(low.cu_seqlens), dO(low.d_o);
  DevTensor pos(low.init.pos), h0(low.init.H), dht(low.d_final.H);
  BackwardParams p;
  static_cast<ForwardParams&>(p) = low.forward_params(Form::chunk, 64);
  p.q = q.view(), p.k = k.view(), p.v = v.view(), p.g = g.view(), p.lam = lam.view(), p.beta = beta.view();
  p.cu_seqlens = cu.view();
  p.init = {};
  if (c.init) p.init.pos = pos.view(), p.init.H = h0.view();
  p.d_o = dO.view();
  p.d_final = {};
  if (c.d_final) p.d_final.H = dht.view();
  const int64_t N = low.num_seqs();
  const StateBuffers fin_host = make_state(s.cfg, N, s.H, s.dk, s.dv, low.max_final_pos(), low.state_dtype());
  DevTensor o(ref.o.cast(c.dtype), true), fpos(fin_host.pos, true), fH(fin_host.H, true);
  DevTensor dq(low.q, true), dk(low.k, true), dv(low.v, true), dg(low.g, true), dbeta(low.beta, true),
      dlam(low.lam, true), dh0(low.init.H, true);
  p.o = {};
  if (c.bwd_o) p.o = o.view();
  p.final_state = {};
  p.final_state.pos = fpos.view(), p.final_state.H = fH.view();
  p.dq = dq.view(), p.dk = dk.view(), p.dv = dv.view(), p.dg = dg.view(), p.dbeta = dbeta.view();
  p.dlam = dlam.view();
  p.d_init = {};
  if (c.init) p.d_init.H = dh0.view();
  p.cfg.check_values = true;
  // the call under the case's HILA_DELTA_SM90 ("0" where it sets none); the error it threw, else ""
  auto call = [&](auto f) -> std::string {
    return with_env("HILA_DELTA_PIECES", c.pieces, [&] {
      const std::string e = with_env("HILA_DELTA_SM90", c.delta_sm90 ? c.delta_sm90 : "0", f);
      if (!e.empty()) throw std::runtime_error(e);
    });
  };
  {
    const std::string err = call([&] { backward(p); });
    ASSERT_EQ(err, "") << "backward threw";
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cudaGetErrorString(cudaGetLastError());

  const double floor_g = dg_floor(ref_in.q, ref.dq, ref_in.k, ref.dk, s.dk);  // see dg_floor
  auto check = [&](const char* name, const Buffer& got, const Buffer& want, double fl = 0) {
    const double e = rel_err(got, want, fl);
    std::printf("  %-40s %-6s rel err %.2e (oracle %s)\n", c.name.c_str(), name, e, form_name(oracle));
    EXPECT_LE(e, c.tol) << name;
  };
  if (c.bwd_o) check("o", o.fetch(), ref.o);
  check("H_T", fH.fetch(), ref.final_state.H);
  check("dq", dq.fetch(), ref.dq);
  check("dk", dk.fetch(), ref.dk);
  check("dv", dv.fetch(), ref.dv);
  check("dbeta", dbeta.fetch(), ref.dbeta);
  if (c.gated) check("dg", dg.fetch(), ref.dg, floor_g);
  if (c.op == Op::loglinear_gdn) check("dlam", dlam.fetch(), ref.dlam);
  if (c.init) check("dH0", dh0.fetch(), ref.d_init.H);
  const Buffer fp = fpos.fetch();
  for (int64_t i = 0; i < N; ++i) EXPECT_EQ(fp.get(i), ref.final_state.pos.get(i));

  // the forward entry point on its own (outputs poisoned again)
  DevTensor o2(ref.o.cast(c.dtype), true), fH2(fin_host.H, true), fpos2(fin_host.pos, true);
  ForwardParams f = static_cast<const ForwardParams&>(p);
  f.o = o2.view();
  f.final_state = {};
  f.final_state.pos = fpos2.view(), f.final_state.H = fH2.view();
  {
    const std::string err = call([&] { forward(f); });
    ASSERT_EQ(err, "") << "forward threw";
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cudaGetErrorString(cudaGetLastError());
  check("fwd.o", o2.fetch(), ref.o);
  check("fwd.H_T", fH2.fetch(), ref.final_state.H);
  const Buffer fp2 = fpos2.fetch();
  for (int64_t i = 0; i < N; ++i) EXPECT_EQ(fp2.get(i), ref.final_state.pos.get(i));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaDelta, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// q, k, v and dq, dk, dv as strided views with qk_l2norm (the packing, normalisation and chain rule
// of delta/qk.cu read and write the caller's rows): interleaved in one fused [B, Tb, 3, H, d] buffer
// of Tb > T rows, so (B, T) do not merge into rows of one stride, with a row of 3 H d elements (four
// at a time) or of 3 H d + 2 (element by element). gdn (tensor-core tier) and loglinear_gdn (its
// training call) against the float64 naive form.
TEST(CudaDeltaViews, StridedQkvWithL2NormMatchFloat64Oracle) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped";
  for (Op op : {Op::gdn, Op::loglinear_gdn})
    for (int64_t extra : {0, 2}) {
      ProblemSpec s;
      s.cfg.op = op;
      s.cfg.qk_l2norm = true;
      s.B = 2, s.T = 130, s.G = 2, s.H = 2, s.dk = 64, s.dv = 64;
      s.gated = true;
      s.dtype = DType::f64;
      s.seed = 29;
      Problem low = cast_problem(make_problem(s), DType::bf16);
      low.d_final = {};
      const Result ref = run_backward(cast_problem(low, DType::f64), Form::naive);
      const int64_t B = s.B, T = s.T, Tb = T + 3, H = s.H, d = s.dk, row = 3 * H * d + extra;
      Buffer fused(DType::bf16, {B * Tb * row});
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t i = 0; i < H * d; ++i) {
            const int64_t at = (b * Tb + t) * row, from = (b * T + t) * H * d + i;
            fused.set(at + i, low.q.get(from));
            fused.set(at + H * d + i, low.k.get(from));
            fused.set(at + 2 * H * d + i, low.v.get(from));
          }
      DevTensor x(fused), gx(fused, true), g(low.g), beta(low.beta), dO(low.d_o), o(ref.o.cast(DType::bf16), true);
      DevTensor dg(low.g, true), dbeta(low.beta, true), lam(low.lam), dlam(low.lam, true);
      auto part = [&](const DevTensor& t, int which) { return t.rows_view(which * H * d, B, T, H, d, Tb * row, row); };
      BackwardParams p;
      static_cast<ForwardParams&>(p) = low.forward_params(Form::chunk, 64);
      p.q = part(x, 0), p.k = part(x, 1), p.v = part(x, 2), p.g = g.view(), p.beta = beta.view(), p.o = o.view();
      p.lam = lam.view(), p.dlam = dlam.view();
      p.init = {}, p.final_state = {}, p.d_final = {}, p.d_init = {};
      p.d_o = dO.view();
      p.dq = part(gx, 0), p.dk = part(gx, 1), p.dv = part(gx, 2), p.dg = dg.view(), p.dbeta = dbeta.view();
      const std::string name = std::string(op_name(op)) + (extra ? "_row_plus2" : "_fused_qkv");
      try {
        backward(p);
      } catch (const std::exception& e) {
        FAIL() << name << ": backward threw: " << e.what();
      }
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const Buffer got = gx.fetch();
      Buffer gq(DType::bf16, {B, T, H, d}), gk = gq, gv = gq;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t i = 0; i < H * d; ++i) {
            const int64_t at = (b * Tb + t) * row, to = (b * T + t) * H * d + i;
            gq.set(to, got.get(at + i)), gk.set(to, got.get(at + H * d + i)), gv.set(to, got.get(at + 2 * H * d + i));
          }
      for (int64_t b = 0; b < B; ++b)  // the rows past T are the poison DevTensor wrote, untouched
        for (int64_t t = T; t < Tb; ++t)
          for (int64_t i = 0; i < 3 * H * d; ++i)
            ASSERT_FALSE(std::isfinite(got.get((b * Tb + t) * row + i))) << name << ": row " << t << " written";
      for (auto [what, a, want] : {std::tuple{"o", o.fetch(), ref.o}, std::tuple{"dq", gq, ref.dq},
                                   std::tuple{"dk", gk, ref.dk}, std::tuple{"dv", gv, ref.dv},
                                   std::tuple{"dbeta", dbeta.fetch(), ref.dbeta}}) {
        const double e = rel_err(a, want);
        std::printf("  %-30s %-6s rel err %.2e\n", name.c_str(), what, e);
        EXPECT_LE(e, 1e-2) << name << " " << what;
      }
    }
}

// The forward alone at longer lengths: gdn (with an initial state) and loglinear_gdn (from position
// 0, no initial state) in 16 bits run the tensor-core path (delta/gdn_sm80.cu), against the float64 chunk
// oracle; HILA_GDN_TC=0 runs the FMA segment sweep on the same inputs.
struct DeltaFwdCase {
  Op op;
  int64_t B, T, H, dk, dv;
  std::vector<int64_t> seqlens;
  const char* tc;  // HILA_GDN_TC
  std::string name;
};
void PrintTo(const DeltaFwdCase& c, std::ostream* os) { *os << c.name; }
class CudaDeltaForward : public ::testing::TestWithParam<DeltaFwdCase> {};

TEST_P(CudaDeltaForward, GdnForwardMatchesFloat64Oracle) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const DeltaFwdCase c = GetParam();
  ProblemSpec s;
  s.cfg.op = c.op;
  s.cfg.qk_l2norm = true;
  s.B = c.B, s.T = c.T, s.G = c.H, s.H = c.H, s.dk = c.dk, s.dv = c.dv;
  s.seqlens = c.seqlens;
  s.gated = true;
  s.init_state = c.op == Op::gdn;
  s.dtype = DType::f64;
  s.seed = 41;
  const Problem low = cast_problem(make_problem(s), DType::bf16);
  const Result ref = run_forward(cast_problem(low, DType::f64), Form::chunk);
  Result got;
  const std::string err = with_env("HILA_GDN_TC", c.tc, [&] { got = run_forward(low, Form::chunk, 64, cuda0()); });
  ASSERT_EQ(err, "") << "forward threw";
  for (const auto& [name, e] : compare(got, ref)) {
    std::printf("  %-32s %-10s rel err %.2e\n", c.name.c_str(), name.c_str(), e);
    EXPECT_LE(e, 1e-2) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Lengths, CudaDeltaForward,
                         ::testing::Values(DeltaFwdCase{Op::gdn, 1, 4096, 2, 128, 128, {}, "1", "gdn_bf16_T4096_tc"},
                                           DeltaFwdCase{Op::gdn, 1, 4096, 2, 128, 128, {}, "0", "gdn_bf16_T4096_fma"},
                                           DeltaFwdCase{Op::gdn, 1, 0, 2, 64, 64, {0, 2000, 1, 0, 3001, 64}, "1",
                                                        "gdn_bf16_varlen_tc"},
                                           DeltaFwdCase{Op::loglinear_gdn, 1, 4096, 2, 128, 128, {}, "1",
                                                        "loglinear_gdn_bf16_T4096_tc"},
                                           DeltaFwdCase{Op::loglinear_gdn, 1, 4096, 2, 128, 128, {}, "0",
                                                        "loglinear_gdn_bf16_T4096_fma"},
                                           DeltaFwdCase{Op::loglinear_gdn, 1, 0, 2, 64, 64,
                                                        {0, 2000, 1, 0, 3001, 64, 1024, 1025}, "1",
                                                        "loglinear_gdn_bf16_varlen_tc"},
                                           // past 2^17 (18 chunk levels of sweeps; the final state has 19 slots)
                                           DeltaFwdCase{Op::loglinear_gdn, 1, (int64_t(1) << 17) + 65, 1, 64, 64, {}, "1",
                                                        "loglinear_gdn_bf16_T2p17p65_tc"}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace hila::tools
