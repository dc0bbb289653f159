// SPDX-License-Identifier: Apache-2.0
// The CPU chunk form of hla2, ahla, hla3 and their log-linear versions (one sweep over segments
// for all primitives of the composition, src/cpu/hla_chunk.cpp; log-linear: a Fenwick outer
// primitive with its level-weighted mask and multi-slot state) against the float64 naive form at
// the edges of its segments:
// d = 16 cuts chunk 64 into segments of R = 32 rows (cpu_segment_rows), chunk 16 into R = 16; T
// around one and two segments, with and without gates, GQA, initial states at a position inside a
// segment, untied gates with normalize (and ridge for hla2), resets (g = -inf) on segment
// boundaries, and dk = 40 != dv = 24 (R = 64). Forward (o, final states) and backward (every
// gradient, initial-state gradients; log-linear: dlam and every slot of the canonical states).
#include <string>
#include <vector>

#include "support_hila.h"

namespace hila_test {
namespace {

enum class Var { plain, nogate, init_gqa, untied_normalize, resets, wide };

const char* var_tag(Var v) {
  switch (v) {
    case Var::plain: return "plain";
    case Var::nogate: return "nogate";
    case Var::init_gqa: return "init_gqa";
    case Var::untied_normalize: return "untied_normalize";
    case Var::resets: return "resets";
    case Var::wide: return "wide";
  }
  return "?";
}

struct Case {
  Op op;
  DType dt;
  int64_t chunk, T;
  Var var;
};

std::string case_name(const Case& c) {
  return op_tag(c.op) + "_" + dtype_tag(c.dt) + "_chunk" + std::to_string(c.chunk) + "_T" +
         std::to_string(c.T) + "_" + var_tag(c.var);
}

bool loglinear(Op op) {
  return op == Op::loglinear_hla2 || op == Op::loglinear_ahla || op == Op::loglinear_hla3;
}

Problem make(const Case& c) {
  ProblemSpec s = spec_for(c.op, c.T, seed_of(case_name(c)));
  s.B = 2;
  s.H = 2;
  s.G = 2;
  s.dk = 16;
  s.dv = 16;
  s.dtype = c.dt;
  switch (c.var) {
    case Var::plain:
    case Var::resets: break;
    case Var::nogate: s.gated = false; break;
    case Var::init_gqa:
      s.H = 4;
      s.init_state = true;
      s.init_pos = {5, 40};  // the first segment is partial (rows up to the next multiple of R)
      if (loglinear(c.op)) s.init_extra_slots = 2;  // slots beyond those live at the position
      break;
    case Var::untied_normalize:
      s.cfg.gates = Gates::untied;
      s.cfg.normalize = true;
      s.nonneg = true;  // positive denominators (docs/math/HLA.md §4)
      if (takes_ridge(c.op)) s.cfg.ridge = 0.3;
      if (loglinear(c.op)) s.extra_levels = 1;  // a lam column no pair reads
      break;
    case Var::wide:  // dk != dv, wider than a register tile; R = 64 at chunk 64
      s.dk = 40;
      s.dv = 24;
      s.init_state = true;
      s.init_pos = {70, 3};
      s.cfg.gates = Gates::untied;
      break;
  }
  Problem p = hila::tools::make_problem(s);
  if (c.var == Var::resets) {  // g = -inf at the first and last rows of the segments of 16 and 32
    for (int64_t t : {0, 15, 16, 31, 32, 33, 63, 64})
      if (t < c.T)
        for (int64_t b = 0; b < s.B; ++b)
          for (int64_t h = 0; h < s.H; ++h) p.g.set((b * c.T + t) * s.H + h, -kInf);
  }
  return p;
}

class HlaChunk : public ::testing::TestWithParam<Case> {};

TEST_P(HlaChunk, ForwardMatchesNaiveFloat64) {
  const Case& c = GetParam();
  const Problem p = make(c);
  const Problem ref = c.dt == DType::f64 ? p : hila::tools::cast_problem(p, DType::f64);
  const Result got = hila::tools::run_forward(p, Form::chunk, c.chunk);
  const Result want = hila::tools::run_forward(ref, Form::naive);
  ASSERT_TRUE(all_finite(got.o)) << case_name(c);
  expect_results_close(got, want, fwd_tol(c.dt), bwd_tol(c.dt), case_name(c), grad_floor(c.dt));
}

TEST_P(HlaChunk, BackwardMatchesNaiveFloat64) {
  const Case& c = GetParam();
  const Problem p = make(c);
  const Problem ref = c.dt == DType::f64 ? p : hila::tools::cast_problem(p, DType::f64);
  const Result got = hila::tools::run_backward(p, Form::chunk, c.chunk);
  const Result want = hila::tools::run_backward(ref, Form::naive);
  expect_results_close(got, want, fwd_tol(c.dt), bwd_tol(c.dt), case_name(c), grad_floor(c.dt));
  if (c.var == Var::resets)  // the gradient of a reset gate is exactly 0
    for (int64_t t : {0, 15, 16, 31, 32, 33, 63, 64})
      if (t < c.T)
        for (int64_t i = 0; i < p.spec.B * p.spec.H; ++i)
          EXPECT_EQ(got.dg.get(((i / p.spec.H) * c.T + t) * p.spec.H + i % p.spec.H), 0.0)
              << case_name(c) << ": dg of the reset at " << t;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Op op : {Op::hla2, Op::ahla, Op::hla3, Op::loglinear_hla2, Op::loglinear_ahla,
                Op::loglinear_hla3})
    for (DType dt : {DType::f64, DType::f32})
      for (Var v : {Var::plain, Var::nogate, Var::init_gqa, Var::untied_normalize, Var::resets}) {
        for (int64_t T : {1, 31, 32, 33, 64, 65}) out.push_back({op, dt, 64, T, v});
        for (int64_t T : {15, 16, 17}) out.push_back({op, dt, 16, T, v});
      }
  for (Op op : {Op::hla2, Op::ahla, Op::hla3, Op::loglinear_hla2, Op::loglinear_ahla,
                Op::loglinear_hla3})
    for (DType dt : {DType::f64, DType::f32})
      for (int64_t T : {63, 130}) out.push_back({op, dt, 64, T, Var::wide});
  return out;
}

INSTANTIATE_TEST_SUITE_P(EdgeT, HlaChunk, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return case_name(info.param); });

}  // namespace
}  // namespace hila_test
