// SPDX-License-Identifier: Apache-2.0
// The CUDA kernels' gate gradient (docs/math/HLA.md §7.1, "the gate gradient per chunk"):
//  * CudaGateGradients: with slowly decaying gates (logsigmoid(randn) / 16, or g = -1e-3) the gate
//    gradient of every gated operator in bf16 is as accurate as its other gradients up to T = 64K:
//    err(dg) <= 1.5 max(err(dq), err(dk), err(dv)), against the CPU chunk form in float64 on the
//    same rounded inputs (its dg is chunk-local too, so it keeps float64 accuracy at any T). A dg
//    formed as a reverse cumsum over the whole sequence fails this from T = 4K on: its bf16 error
//    grows like sqrt(T).
//  * CudaResetGates: log-gates of -inf or -1e30 (state resets, docs/OPERATORS.md "Resets") at the
//    start, middle and end of chunks, on chunk boundaries and back to back, with value checks off
//    and on: every operator family gives finite outputs and gradients within the documented bound
//    of the CPU serial form in float64 on the same rounded inputs (the naive form where the serial
//    backward does not exist), and dg = 0 at every reset gate. The kernels see a reset gate as the
//    floor kGateFloor (prims/pack.cuh): the decays across it are exactly 0; the decays after it in
//    the same chunk are exact in the kernels with float32 / float64 compute (prims/resets.cuh), and
//    carry the rounding of a sum of size |floor| in the tensor-core tiers (bf16 / fp16 operands:
//    about 1e-5 per reset in the chunk, far below their bf16 bound). The cases cover every tier.
//  * CudaExactResets: every operator in float32 / float64 with a reset at every row of a chunk
//    matches the serial form to 1e-6 / 1e-13 (below).
// Without a GPU every test is skipped with a printed reason, so CI still compiles this file; on the
// host emulator (tools/cuda_emu) the T256 cases run in about a minute each.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_support.h"
#include "hila/ops.h"
#include "problem.h"

namespace hila::tools {
namespace {

// The knobs a case sets for its calls (nullptr: left unset): HILA_GLA_SM90, HILA_LOGLINEAR_TREE,
// HILA_LOGLINEAR_TREE_SWEEP, HILA_GDN_TC; HILA_DELTA_SM90 (nullptr: "0", the delta rule's sm80 sweeps;
// "1", the default, in the cases tagged _delta_sm90).
struct Knobs {
  const char *sm90 = nullptr, *tree = nullptr, *tree_sweep = nullptr, *gdn_tc = nullptr, *delta_sm90 = nullptr;
};
template <class F>
std::string with_knobs(const Knobs& k, F f) {
  const auto rethrow = [](const std::string& e) {
    if (!e.empty()) throw std::runtime_error(e);
  };
  const auto knobs = [&] {
    return with_env("HILA_GLA_SM90", k.sm90, [&] {
      rethrow(with_env("HILA_LOGLINEAR_TREE", k.tree, [&] {
        rethrow(with_env("HILA_LOGLINEAR_TREE_SWEEP", k.tree_sweep, [&] { rethrow(with_env("HILA_GDN_TC", k.gdn_tc, f)); }));
      }));
    });
  };
  return with_env("HILA_DELTA_SM90", k.delta_sm90 ? k.delta_sm90 : "0", [&] { rethrow(knobs()); });
}

enum class SlowGates { logsigmoid16, near_zero };

struct DgCase {
  Op op;
  int64_t T, d;
  SlowGates gates;
  Knobs knobs;
  std::string name;
  bool train = false;              // no final-state cotangent (loglinear_gdn: its tensor-core backward;
                                   // loglinear_hla2, above)
  bool keys_u = false;             // keys U = GLA(Q, K, K) per head (G = H), the HLA family's inner
                                   // output: large, correlated along the sequence
};

std::vector<DgCase> dg_cases() {
  std::vector<DgCase> cs;
  auto add = [&](Op op, int64_t T, int64_t d, SlowGates sg, Knobs k, const std::string& tag) {
    const std::string name = std::string(op_name(op)) + (d != 64 ? "_d" + std::to_string(d) : "") + "_T" +
                             std::to_string(T) + (sg == SlowGates::logsigmoid16 ? "_logsig16" : "_g1em3") + tag;
    cs.push_back({op, T, d, sg, k, name});
    // loglinear_hla2 without a final-state cotangent (the training setting): with a random one, the
    // composition's inner backward reads the large outer key gradient dU as a 16-bit operand, which
    // puts hla2 and loglinear_hla2 at about 1.7-1.8x on some draws (docs/PERFORMANCE.md,
    // "Gate-gradient accuracy"); the log-linear primitive itself, with such keys and a final-state
    // cotangent, is covered by the _keysU cases below
    if (op == Op::loglinear_hla2) cs.back().train = true;
  };
  const Op ops[] = {Op::gla, Op::hla2, Op::ahla, Op::hla3, Op::loglinear, Op::loglinear_hla2, Op::gdn, Op::loglinear_gdn};
  // T = 65536 (each case's float64 reference takes about 10 s of one CPU core): gla with both gate
  // kinds and one slow-gate case of each kernel family (composition, delta rule, log-linear tree and
  // sweep)
  const auto long_case = [](Op op, SlowGates sg) {
    return op == Op::gla ||
           (sg == SlowGates::logsigmoid16 && (op == Op::hla2 || op == Op::loglinear || op == Op::loglinear_gdn));
  };
  for (Op op : ops)
    for (int64_t T : {256, 1024, 4096, 16384, 65536})
      for (SlowGates sg : {SlowGates::logsigmoid16, SlowGates::near_zero}) {
        if (T == 256 && sg == SlowGates::near_zero) continue;
        if (T == 65536 && !long_case(op, sg)) continue;
        add(op, T, 64, sg, {}, "");
      }
  // the log-linear segment sweep (chunk-local dg)
  for (Op op : {Op::loglinear, Op::loglinear_hla2})
    for (int64_t T : {256, 4096}) add(op, T, 64, SlowGates::logsigmoid16, {nullptr, "0"}, "_sweep");
  add(Op::loglinear, 65536, 64, SlowGates::logsigmoid16, {nullptr, "0"}, "_sweep");
  // the log-linear primitive with keys U = GLA(Q, K, K) and a final-state cotangent: the terms of
  // dg that read the cotangent cancel only when formed from the same 16-bit dZ as the rows' k.dk
  for (int64_t T : {256, 4096}) {
    add(Op::loglinear, T, 64, SlowGates::logsigmoid16, {}, "_keysU");
    cs.back().keys_u = true;
  }
  add(Op::loglinear, 256, 64, SlowGates::logsigmoid16, {nullptr, "0"}, "_keysU_sweep");
  cs.back().keys_u = true;
  // d = 128; the sm80 chunk kernels where the sm90 ones would run (Hopper), and sm90 forced
  for (int64_t T : {4096, 65536}) {
    add(Op::gla, T, 128, SlowGates::logsigmoid16, {}, "");
    add(Op::gla, T, 128, SlowGates::logsigmoid16, {"0"}, "_sm80");
  }
  add(Op::gla, 256, 64, SlowGates::logsigmoid16, {"0"}, "_sm80");
  add(Op::gla, 256, 128, SlowGates::logsigmoid16, {"1"}, "_sm90");
  add(Op::hla2, 256, 64, SlowGates::logsigmoid16, {"1"}, "_sm90");
  add(Op::loglinear, 4096, 64, SlowGates::logsigmoid16, {nullptr, nullptr, "1"}, "_tree_sweep");
  // plain gdn on the sm_90a state sweeps (src/cuda/delta/sweep_sm90.cu), the default where they apply
  const Knobs delta_sm90{nullptr, nullptr, nullptr, nullptr, "1"};
  for (int64_t d : {64, 128}) add(Op::gdn, 256, d, SlowGates::logsigmoid16, delta_sm90, "_delta_sm90");
  for (int64_t T : {4096, 16384})
    for (SlowGates sg : {SlowGates::logsigmoid16, SlowGates::near_zero}) add(Op::gdn, T, 64, sg, delta_sm90, "_delta_sm90");
  add(Op::loglinear_gdn, 65536, 64, SlowGates::logsigmoid16, delta_sm90, "_delta_sm90");
  add(Op::gdn, 4096, 128, SlowGates::near_zero, delta_sm90, "_delta_sm90");
  // the same inputs on the sm80 sweeps, beside it
  add(Op::gdn, 4096, 128, SlowGates::near_zero, {nullptr, nullptr, nullptr, nullptr, "0"}, "_delta_sm80");
  // loglinear_gdn with its sm_90a level sweeps forced on (src/cuda/delta/loglinear_gdn_sm90.cu), both
  // directions: without a final-state cotangent
  add(Op::loglinear_gdn, 256, 128, SlowGates::logsigmoid16, delta_sm90, "_train_delta_sm90");
  cs.back().train = true;
  return cs;
}

class CudaGateGradients : public ::testing::TestWithParam<DgCase> {};

TEST_P(CudaGateGradients, SlowGatesDgAsAccurateAsTheOtherGradients) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const DgCase c = GetParam();
  ProblemSpec s;
  s.cfg.op = c.op;
  s.B = 1, s.T = c.T, s.G = c.keys_u ? 2 : 1, s.H = 2, s.dk = s.dv = c.d;
  s.gated = true;
  s.dtype = DType::f64;
  s.seed = 41;
  Problem pr = make_problem(s);
  std::mt19937_64 rng(uint64_t(c.T) * 977 + uint64_t(c.op));
  std::normal_distribution<double> normal;
  for (int64_t i = 0; i < pr.g.numel(); ++i) {
    const double x = normal(rng);  // logsigmoid(x) = -log(1 + e^{-x})
    pr.g.set(i, c.gates == SlowGates::near_zero ? -1e-3 : -std::log1p(std::exp(-x)) / 16);
  }
  Problem low = cast_problem(pr, DType::bf16);
  if (c.train) low.d_final = {};
  if (c.keys_u) {  // U = GLA(Q, K, K) in float64 on the rounded inputs, rounded to bf16
    Problem pu = cast_problem(low, DType::f64);
    pu.spec.cfg.op = Op::gla;
    pu.v = pu.k, pu.lam = {}, pu.init = {}, pu.d_final = {};
    low.k = run_forward(pu, Form::chunk).o.cast(DType::bf16);
  }
  const Result ref = run_backward(cast_problem(low, DType::f64), Form::chunk);
  Result got;
  ASSERT_EQ(with_knobs(c.knobs, [&] { got = run_backward(low, Form::chunk, 64, cuda0()); }), "") << "backward threw";
  const double eq = rel_err(got.dq, ref.dq), ek = rel_err(got.dk, ref.dk), ev = rel_err(got.dv, ref.dv);
  const double eg = rel_err(got.dg, ref.dg), eo = rel_err(got.o, ref.o);
  const double others = std::max({eq, ek, ev});
  std::printf("  %-34s o %.2e  dq %.2e  dk %.2e  dv %.2e  dg %.2e  (dg / max %.2f)\n", c.name.c_str(), eo, eq, ek, ev,
              eg, eg / others);
  // where the dg error sits: the chunks' last rows carry <dS, S_out> (plus one row's db), the
  // differences of consecutive rows inside a chunk carry the per-row db alone (B = 1: dg is [T][H])
  double ref_max = 1e-300, e_end = 0, e_row = 0;
  for (int64_t i = 0; i < ref.dg.numel(); ++i) ref_max = std::max(ref_max, std::fabs(ref.dg.get(i)));
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t i = t * s.H + h;
      if (t % 64 == 63 || t + 1 == c.T) e_end = std::max(e_end, std::fabs(got.dg.get(i) - ref.dg.get(i)));
      else
        e_row = std::max(e_row, std::fabs((got.dg.get(i) - got.dg.get(i + s.H)) - (ref.dg.get(i) - ref.dg.get(i + s.H))));
    }
  std::printf("  %-34s dg error at the chunks' last rows %.2e, of a row's db %.2e\n", "", e_end / ref_max, e_row / ref_max);
  EXPECT_LE(eo, 1e-2);
  EXPECT_LE(others, 1e-2);
  EXPECT_LE(eg, 1.5 * others) << "dg error " << eg << " against dq, dk, dv errors " << eq << ", " << ek << ", " << ev;
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaGateGradients, ::testing::ValuesIn(dg_cases()),
                         [](const auto& info) { return info.param.name; });

// ---- reset gates --------------------------------------------------------------------------------

struct ResetCase {
  Op op;
  DType dtype;
  Knobs knobs;
  std::string name;
  bool init = true, d_final = true;  // an initial state; a final-state cotangent (neither: loglinear_gdn's
                                     // tensor-core paths)
};

std::string tag_of(DType dt) {
  return dt == DType::bf16 ? "bf16" : dt == DType::f16 ? "f16" : dt == DType::f32 ? "f32" : "f64";
}
// The bound against the float64 serial form (the header above): 16 bits as the other CUDA tests
// (the tensor-core tiers keep the differences of sums after a reset, whose 1e-5 is below it); float32
// and float64, whose kernels are exact across resets, their plain rounding (measured up to
// 1.5e-6 / 2.9e-15 on the host emulator; the differences of sums gave 3e-5 / 5e-13).
double reset_tol(DType dt) { return dt == DType::f64 ? 1e-13 : dt == DType::f32 ? 5e-6 : 1e-2; }

// Every operator in float32, float64 and bf16 with the default tiers, and the 16-bit tiers the
// defaults leave out (here, or on an sm_90 device): the log-linear segment sweep and the tree form's
// level sweep, the GLA sm80 and sm90 kernels (the sm90 cases run them on an sm_90 device, or on the
// host emulator with HILA_EMU_SM90=1), fp16 operands, the delta rule's portable kernels and
// loglinear_gdn's tensor-core kernels (no initial state and no final-state cotangent).
std::vector<ResetCase> reset_cases() {
  std::vector<ResetCase> cs;
  for (Op op : all_ops())
    for (DType dt : {DType::f32, DType::f64, DType::bf16})
      cs.push_back({op, dt, {}, std::string(op_name(op)) + "_" + tag_of(dt)});
  cs.push_back({Op::loglinear, DType::bf16, {nullptr, "0"}, "loglinear_bf16_sweep"});
  cs.push_back({Op::loglinear, DType::bf16, {nullptr, nullptr, "1"}, "loglinear_bf16_tree_sweep"});
  cs.push_back({Op::gla, DType::bf16, {"0"}, "gla_bf16_sm80"});
  cs.push_back({Op::gla, DType::bf16, {"1"}, "gla_bf16_sm90"});
  cs.push_back({Op::gdn, DType::bf16, {nullptr, nullptr, nullptr, nullptr, "1"}, "gdn_bf16_delta_sm90"});
  cs.push_back({Op::hla2, DType::bf16, {"1"}, "hla2_bf16_sm90"});
  cs.push_back({Op::gla, DType::f16, {}, "gla_f16"});
  cs.push_back({Op::gdn, DType::bf16, {nullptr, nullptr, nullptr, "0"}, "gdn_bf16_portable"});
  cs.push_back({Op::loglinear_gdn, DType::bf16, {}, "loglinear_gdn_bf16_tc", false, false});
  // loglinear_gdn's sm_90a level sweeps (both directions: no initial state, no final-state cotangent)
  cs.push_back({Op::loglinear_gdn, DType::bf16, {nullptr, nullptr, nullptr, nullptr, "1"},
                "loglinear_gdn_bf16_train_delta_sm90", false, false});
  return cs;
}

class CudaResetGates : public ::testing::TestWithParam<ResetCase> {};

TEST_P(CudaResetGates, FiniteAndCloseToSerialWithChecksOffAndOn) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const ResetCase c = GetParam();
  ProblemSpec s;
  s.cfg.op = c.op;
  s.B = 2, s.T = 200, s.G = 1, s.H = 2;
  s.dk = s.dv = c.dtype == DType::bf16 || c.dtype == DType::f16 ? 64 : 32;
  s.init_state = c.init;
  s.dtype = DType::f64;
  s.seed = 31;
  Problem pr = make_problem(s);
  // (batch, position, gate): chunk starts, middles and ends, a chunk boundary, two in a row
  const struct {
    int64_t b, t;
    double g;
  } resets[] = {{0, 0, -INFINITY}, {0, 5, -1e30}, {0, 63, -INFINITY}, {0, 64, -1e30}, {0, 100, -INFINITY},
                {0, 101, -1e30},   {1, 30, -1e30}, {1, 127, -INFINITY}, {1, 128, -INFINITY}, {1, 199, -1e30}};
  const int64_t gc = pr.g.numel() / (s.B * s.T * s.H);  // gate columns
  for (const auto& x : resets)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t j = 0; j < gc; ++j) pr.g.set(((x.b * s.T + x.t) * s.H + h) * gc + j, x.g);
  Problem low = cast_problem(pr, c.dtype);
  if (!c.d_final) low.d_final = {};
  const Form oracle = supports(c.op, Form::serial, true) ? Form::serial : Form::naive;
  const Result ref = run_backward(cast_problem(low, DType::f64), oracle);
  const double tol = reset_tol(c.dtype);
  for (const char* checks : {"off", "on"}) {
    Problem run = low;
    run.spec.cfg.check_values = std::string(checks) == "on";
    Result got;
    const std::string err = with_knobs(c.knobs, [&] { got = run_backward(run, Form::chunk, 64, cuda0()); });
    ASSERT_EQ(err, "") << c.name << " checks " << checks;
    for (const auto& [name, e] : compare(got, ref, 1e-4)) {
      std::printf("  %-24s checks %-3s %-10s rel err %.2e\n", c.name.c_str(), checks, name.c_str(), e);
      EXPECT_LE(e, tol) << c.name << " checks " << checks << ": " << name;  // NaN / Inf give +inf
    }
    for (const auto& x : resets)
      for (int64_t h = 0; h < s.H; ++h)
        for (int64_t j = 0; j < gc; ++j) {
          const int64_t i = ((x.b * s.T + x.t) * s.H + h) * gc + j;
          EXPECT_EQ(got.dg.get(i), 0.0) << c.name << ": dg of the reset gate at b " << x.b << ", t " << x.t;
        }
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaResetGates, ::testing::ValuesIn(reset_cases()),
                         [](const auto& info) { return info.param.name; });


// ---- exact resets inside a chunk ------------------------------------------------------------------
// Every operator in float32 / float64 (the portable GLA kernels, the log-linear segment sweep and the
// portable delta-rule kernels; hla2, ahla, hla3 and the log-linear compositions through them) with
// two resets in every chunk of 64, at rows p and 63 - p for a p that differs per (sequence, head,
// chunk), so the resets of the call cover every row of a chunk (first and last rows together,
// p = 0; adjacent rows, p = 31), then a partial chunk without one. The GLA family also runs chunks of
// 16 (the pairs fall in different chunks and a chunk holds one reset or none); the log-linear and
// delta-rule operators (chunks of 64 only) also start at position 40, so their segments (the rows of
// one aligned chunk) are cut 24 rows into each block of 64 rows and the first one is partial. The
// kernels decay from the last reset on (prims/resets.cuh), so every output and gradient matches the
// float64 serial form (the naive form where the serial backward does not exist) to 1e-6 (float32) /
// 1e-13 (float64); on the host emulator the worst were 9.3e-7 (loglinear_hla3 final.H) / 2.5e-15,
// where the differences of chunk-local sums holding the floor gave up to 2.3e-5 / 4.2e-13.

struct ExactCase {
  Op op;
  DType dtype;
  int64_t chunk, pos;  // chunk size; position of the initial state
};

std::string exact_name(const ExactCase& c) {
  return std::string(op_name(c.op)) + "_" + tag_of(c.dtype) + "_C" + std::to_string(c.chunk) +
         (c.pos ? "_at" + std::to_string(c.pos) : "");
}

bool gla_family(Op op) { return op == Op::gla || op == Op::hla2 || op == Op::ahla || op == Op::hla3; }

std::vector<ExactCase> exact_cases() {
  std::vector<ExactCase> cs;
  for (Op op : all_ops())
    for (DType dt : {DType::f32, DType::f64}) {
      cs.push_back({op, dt, 64, 0});
      cs.push_back(gla_family(op) ? ExactCase{op, dt, 16, 0} : ExactCase{op, dt, 64, 40});
    }
  return cs;
}

class CudaExactResets : public ::testing::TestWithParam<ExactCase> {};

TEST_P(CudaExactResets, EveryRowOfAChunkMatchesTheSerialForm) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const ExactCase c = GetParam();
  ProblemSpec s;
  s.cfg.op = c.op;
  s.B = 2, s.T = 8 * 64 + 40, s.G = 1, s.H = 2;
  s.dk = s.dv = 32;
  s.init_state = true;
  if (c.pos) s.init_pos = {c.pos};
  s.gated = true;
  s.dtype = DType::f64;
  s.seed = 53;
  Problem pr = make_problem(s);
  const int64_t gc = pr.g.numel() / (s.B * s.T * s.H);  // gate columns
  std::vector<int64_t> reset_rows;                      // indices into g [B, T, H, gc]
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t ch = 0; ch < 8; ++ch) {
        const int64_t p = (b * s.H + h) * 8 + ch;  // 0 .. 31
        for (int64_t t : {ch * 64 + p, ch * 64 + 63 - p})
          for (int64_t j = 0; j < gc; ++j) {
            const int64_t i = ((b * s.T + t) * s.H + h) * gc + j;
            pr.g.set(i, (t & 1) ? -1e30 : -INFINITY);
            reset_rows.push_back(i);
          }
      }
  const Problem low = cast_problem(pr, c.dtype);
  const Form oracle = supports(c.op, Form::serial, true) ? Form::serial : Form::naive;
  const Result ref = run_backward(cast_problem(low, DType::f64), oracle);
  Result got;
  ASSERT_NO_THROW(got = run_backward(low, Form::chunk, c.chunk, cuda0()));
  const double tol = c.dtype == DType::f32 ? 1e-6 : 1e-13;
  const std::string name = exact_name(c);
  for (const auto& [field, e] : compare(got, ref, 1e-4)) {
    std::printf("  %-28s %-10s rel err %.2e\n", name.c_str(), field.c_str(), e);
    EXPECT_LE(e, tol) << field;  // NaN / Inf give +inf
  }
  for (int64_t i : reset_rows) EXPECT_EQ(got.dg.get(i), 0.0) << "dg of the reset gate at index " << i;
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaExactResets, ::testing::ValuesIn(exact_cases()),
                         [](const auto& info) { return exact_name(info.param); });

}  // namespace
}  // namespace hila::tools
