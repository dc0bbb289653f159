// SPDX-License-Identifier: Apache-2.0
// The CUDA kernels' gates (docs/OPERATORS.md, "Gates"; docs/math/HLA.md §7.1, §8.3):
//  * CudaResets: state resets (g = -inf, -1e30, -1e6: exp(g) = 0) are exact on every kernel path
//    of every operator, forward and backward: the CUDA chunk form against the CPU serial form in
//    float64 on the same rounded inputs (the naive form where the serial backward does not
//    exist), within 1e-6 in float32, 1e-12 in float64 and the usual 1e-2 in 16 bits; the gradient
//    of a reset gate is exactly 0. One varlen call puts a reset at every position of a chunk:
//    sequence i resets at position i * stride of its first full chunk and at the mirrored
//    position of the next chunk (a chunk boundary, different gate values, several resets per
//    chunk once the chunk is shorter than 64), with initial states at chunk-aligned or unaligned
//    positions, a sequence without resets and an empty one.
//  * CudaGateGradients: with slowly decaying gates (logsigmoid(randn) / 16, or g = -1e-3) the gate
//    gradient of every gated operator in bf16 is as accurate as its other gradients up to T = 64K:
//    err(dg) <= 1.5 max(err(dq), err(dk), err(dv)), against the CPU chunk form in float64 on the
//    same rounded inputs (whose own dg is chunk-local, so it keeps float64 accuracy at any T).
// Without a GPU every test is skipped with a printed reason, so CI still compiles this file; on the
// host emulator (tools/cuda_emu) the *_s8 reset cases and the T256 gate cases run in seconds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda_support.h"
#include "problem.h"

namespace hila::tools {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The knobs a case sets for its calls (nullptr: left unset): HILA_GLA_SM90, HILA_GLA_FUSED,
// HILA_GDN_TC, HILA_LOGLINEAR_TREE_SWEEP.
struct Knobs {
  const char *sm90 = nullptr, *fused = nullptr, *gdn_tc = nullptr, *tree_sweep = nullptr;
};
template <class F>
std::string with_knobs(const Knobs& k, F f) {
  return with_env("HILA_GLA_SM90", k.sm90, [&] {
    const std::string a = with_env("HILA_GLA_FUSED", k.fused, [&] {
      const std::string b = with_env("HILA_GDN_TC", k.gdn_tc, [&] {
        const std::string c = with_env("HILA_LOGLINEAR_TREE_SWEEP", k.tree_sweep, f);
        if (!c.empty()) throw std::runtime_error(c);
      });
      if (!b.empty()) throw std::runtime_error(b);
    });
    if (!a.empty()) throw std::runtime_error(a);
  });
}

std::string tag_of(DType dt) {
  switch (dt) {
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::f32: return "f32";
    default: return "f64";
  }
}

// ---- resets ---------------------------------------------------------------------------------------

struct ResetCase {
  Op op;
  DType dtype;
  int stride;           // sequence i resets at position i * stride of a chunk: C / stride sequences
  int64_t chunk = 64;
  int init = 1;         // 0: no initial state; 1: at chunk-aligned positions; 2: at unaligned ones
  Knobs knobs;
  std::string name;
};

bool is16(DType dt) { return dt == DType::bf16 || dt == DType::f16; }

double reset_tol(DType dt) { return dt == DType::f64 ? 1e-12 : dt == DType::f32 ? 1e-6 : 1e-2; }

// The case's problem, and the rows (into the packed T axis) of its reset tokens.
Problem reset_problem(const ResetCase& c, std::vector<int64_t>& reset_rows) {
  const int64_t C = c.chunk, n = C / c.stride;
  ProblemSpec s;
  s.cfg.op = c.op;
  s.B = 1, s.G = 1, s.H = 2;
  s.dk = s.dv = is16(c.dtype) ? 64 : 32;
  s.gated = true;
  s.dtype = DType::f64;
  s.seed = 31;
  s.init_state = c.init != 0;
  // sequence i: the rows up to its first full chunk, two chunks and two more rows; then one
  // sequence without resets and an empty one
  for (int64_t i = 0; i < n + 2; ++i) {
    const int64_t n0 = c.init == 0 ? 0 : c.init == 1 ? 64 * (i % 3) : 13 + 29 * i;
    const int64_t lead = (C - n0 % C) % C;
    s.seqlens.push_back(i == n + 1 ? 0 : lead + 2 * C + 2);
    s.init_pos.push_back(n0);
  }
  if (!s.init_state) s.init_pos.clear();
  Problem p = make_problem(s);
  const double gvals[3] = {-kInf, -1e30, -1e6};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row0 = int64_t(p.cu_seqlens.get(i)), n0 = p.start_pos(i), lead = (C - n0 % C) % C;
    const int64_t pos = i * c.stride;
    for (int64_t t : {lead + pos, lead + C + (C - 1 - pos)}) {
      reset_rows.push_back(row0 + t);
      for (int64_t h = 0; h < s.H; ++h) p.g.set((row0 + t) * s.H + h, gvals[i % 3]);
    }
  }
  return p;
}

std::vector<ResetCase> reset_cases() {
  std::vector<ResetCase> cs;
  auto add = [&](Op op, DType dt, int64_t chunk, int init, Knobs k, const std::string& tag) {
    for (int stride : {1, 8}) {
      if (chunk / stride < 2) continue;
      cs.push_back({op, dt, stride, chunk, init, k,
                    std::string(op_name(op)) + "_" + tag_of(dt) + tag + (stride == 1 ? "_all" : "_s8")});
    }
  };
  for (Op op : all_ops()) {
    const OpTraits tr = op_traits(op);
    for (DType dt : {DType::f32, DType::f64}) add(op, dt, 64, tr.loglinear ? 2 : 1, {}, "");
    if (tr.delta) {  // the tensor-core WY kernels (gdn: any call; loglinear_gdn: from 0, no state) and the segment kernels
      add(op, DType::bf16, 64, op == Op::gdn ? 1 : 0, {}, "_tc");
      add(op, DType::bf16, 64, 1, {nullptr, nullptr, "0"}, "_portable");
    } else if (tr.loglinear) {  // the tree form (aligned starts; its build in the sweep) and the segment sweep
      add(op, DType::bf16, 64, 1, {}, "_tree");
      add(op, DType::bf16, 64, 0, {nullptr, nullptr, nullptr, "1"}, "_tree_sweep");
      add(op, DType::bf16, 64, 2, {}, "_sweep");
    } else {  // the GLA kernels: sm80, the fused forward, sm90 (on Hopper, or HILA_EMU_SM90), chunks below 64
      add(op, DType::bf16, 64, 1, {"0", "0"}, "_sm80");
      add(op, DType::bf16, 64, 1, {"0", "1"}, "_fused");
      add(op, DType::bf16, 64, 1, {"1", "0"}, "_sm90");
      add(op, DType::bf16, 64, 0, {"1", "1"}, "_sm90_fused");
      add(op, DType::bf16, 16, 1, {}, "_chunk16");
    }
  }
  return cs;
}

class CudaResets : public ::testing::TestWithParam<ResetCase> {};

TEST_P(CudaResets, EveryPositionMatchesSerialForwardAndBackward) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const ResetCase c = GetParam();
  std::vector<int64_t> rows;
  const Problem low = cast_problem(reset_problem(c, rows), c.dtype);
  const Problem ref_in = cast_problem(low, DType::f64);
  const Form oracle = supports(c.op, Form::serial, true) ? Form::serial : Form::naive;
  const Result ref = run_backward(ref_in, oracle, c.chunk);
  Result got;
  ASSERT_EQ(with_knobs(c.knobs, [&] { got = run_backward(low, Form::chunk, c.chunk, cuda0()); }), "") << "backward threw";
  const double tol = reset_tol(c.dtype);
  const bool low16 = is16(c.dtype);
  // gradients: against the largest reference gradient times 1e-4 (a zero gradient's rounding), dg
  // in 16 bits against its largest per-row q.dq, k.dk terms (dg_floor)
  double gmax = 0;
  for (const Buffer* b : {&ref.dq, &ref.dk, &ref.dv, &ref.dg})
    for (int64_t i = 0; i < b->numel(); ++i) gmax = std::max(gmax, std::fabs(b->get(i)));
  const double dgf = low16 ? dg_floor(ref_in.q, ref.dq, ref_in.k, ref.dk, ref_in.spec.dk) : 1e-4 * gmax;
  auto check = [&](const char* name, double e) {
    std::printf("  %-40s %-8s rel err %.2e\n", c.name.c_str(), name, e);
    EXPECT_LE(e, tol) << name;
  };
  check("o", rel_err(got.o, ref.o));
  check("final", rel_err(got.final_state, ref.final_state));
  check("dq", rel_err(got.dq, ref.dq, low16 ? 0 : 1e-4 * gmax));
  check("dk", rel_err(got.dk, ref.dk, low16 ? 0 : 1e-4 * gmax));
  check("dv", rel_err(got.dv, ref.dv, low16 ? 0 : 1e-4 * gmax));
  check("dg", rel_err(got.dg, ref.dg, dgf));
  if (!ref.dlam.empty()) check("dlam", rel_err(got.dlam, ref.dlam, low16 ? 0 : 1e-4 * gmax));
  if (!ref.dbeta.empty()) check("dbeta", rel_err(got.dbeta, ref.dbeta, low16 ? 0 : 1e-4 * gmax));
  if (!ref.d_init.empty()) check("d_init", rel_err(got.d_init, ref.d_init));
  const int64_t H = low.spec.H;
  for (int64_t r : rows)
    for (int64_t h = 0; h < H; ++h) {
      EXPECT_EQ(ref.dg.get(r * H + h), 0.0) << "reference dg of the reset gate at row " << r;
      EXPECT_EQ(got.dg.get(r * H + h), 0.0) << "dg of the reset gate at row " << r << " must be 0";
    }
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaResets, ::testing::ValuesIn(reset_cases()),
                         [](const auto& info) { return info.param.name; });

// g = -6e36 on every token: every token resets (o_t reads its own token only); the cumulative sums
// of such gates would overflow float32.
TEST(CudaResets, EveryTokenResetMatchesSerial) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  for (Op op : all_ops())
    for (DType dt : {DType::f32, DType::bf16}) {
      ProblemSpec s;
      s.cfg.op = op;
      s.B = 2, s.T = 130, s.H = 2, s.dk = s.dv = 32;
      s.dtype = DType::f64;
      s.init_state = true;
      s.seed = 37;
      Problem pr = make_problem(s);
      pr.g.fill(-6e36);
      const Problem low = cast_problem(pr, dt);
      const Form oracle = supports(op, Form::serial, true) ? Form::serial : Form::naive;
      const Result ref = run_backward(cast_problem(low, DType::f64), oracle);
      Result got;
      try {
        got = run_backward(low, Form::chunk, 64, cuda0());
      } catch (const std::exception& e) {
        ADD_FAILURE() << op_name(op) << ": " << e.what();
        continue;
      }
      const double tol = reset_tol(dt);
      for (const auto& [name, e] : compare(got, ref, 1e-4)) {
        EXPECT_LE(e, tol) << op_name(op) << " " << tag_of(dt) << " every token reset: " << name;
        if (e > tol) std::printf("  %s %s %s rel err %.2e\n", op_name(op), tag_of(dt).c_str(), name.c_str(), e);
      }
      for (int64_t i = 0; i < got.dg.numel(); ++i) ASSERT_EQ(got.dg.get(i), 0.0) << op_name(op) << ": dg of a reset gate";
    }
}

// ---- gate-gradient accuracy with slowly decaying gates -------------------------------------------

enum class SlowGates { logsigmoid16, near_zero };

struct DgCase {
  Op op;
  int64_t T, d;
  SlowGates gates;
  Knobs knobs;
  std::string name;
};

std::vector<DgCase> dg_cases() {
  std::vector<DgCase> cs;
  const Op ops[] = {Op::gla, Op::hla2, Op::ahla, Op::hla3, Op::loglinear, Op::loglinear_hla2, Op::gdn, Op::loglinear_gdn};
  for (Op op : ops)
    for (int64_t T : {256, 1024, 4096, 16384, 65536})
      for (SlowGates sg : {SlowGates::logsigmoid16, SlowGates::near_zero}) {
        if (T == 256 && sg == SlowGates::near_zero) continue;
        cs.push_back({op, T, 64, sg, {},
                      std::string(op_name(op)) + "_T" + std::to_string(T) +
                          (sg == SlowGates::logsigmoid16 ? "_logsig16" : "_g1em3")});
      }
  // d = 128, and the sm80 kernels forced where the sm90 ones would run (Hopper)
  for (int64_t T : {4096, 65536}) {
    cs.push_back({Op::gla, T, 128, SlowGates::logsigmoid16, {}, "gla_d128_T" + std::to_string(T) + "_logsig16"});
    cs.push_back({Op::gla, T, 128, SlowGates::logsigmoid16, {"0"}, "gla_d128_T" + std::to_string(T) + "_logsig16_sm80"});
  }
  cs.push_back({Op::gla, 256, 128, SlowGates::logsigmoid16, {"1"}, "gla_d128_T256_logsig16_sm90"});
  cs.push_back({Op::loglinear, 4096, 64, SlowGates::logsigmoid16, {nullptr, nullptr, nullptr, "1"},
                "loglinear_T4096_logsig16_tree_sweep"});
  return cs;
}

class CudaGateGradients : public ::testing::TestWithParam<DgCase> {};

TEST_P(CudaGateGradients, SlowGatesDgAsAccurateAsTheOtherGradients) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const DgCase c = GetParam();
  ProblemSpec s;
  s.cfg.op = c.op;
  s.B = 1, s.T = c.T, s.G = 1, s.H = 2, s.dk = s.dv = c.d;
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
  const Problem low = cast_problem(pr, DType::bf16);
  const Result ref = run_backward(cast_problem(low, DType::f64), Form::chunk);
  Result got;
  ASSERT_EQ(with_knobs(c.knobs, [&] { got = run_backward(low, Form::chunk, 64, cuda0()); }), "") << "backward threw";
  const double eq = rel_err(got.dq, ref.dq), ek = rel_err(got.dk, ref.dk), ev = rel_err(got.dv, ref.dv);
  const double eg = rel_err(got.dg, ref.dg), eo = rel_err(got.o, ref.o);
  const double others = std::max({eq, ek, ev});
  std::printf("  %-34s o %.2e  dq %.2e  dk %.2e  dv %.2e  dg %.2e  (dg / max %.2f)\n", c.name.c_str(), eo, eq, ek, ev,
              eg, eg / others);
  EXPECT_LE(eo, 1e-2);
  EXPECT_LE(others, 1e-2);
  EXPECT_LE(eg, 1.5 * others) << "dg error " << eg << " against dq, dk, dv errors " << eq << ", " << ek << ", " << ev;
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaGateGradients, ::testing::ValuesIn(dg_cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace hila::tools
