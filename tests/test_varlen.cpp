// SPDX-License-Identifier: Apache-2.0
// Variable-length packing (docs/math/LOGLINEAR.md §4): a packed call with cu_seqlens equals running each
// sequence alone, including empty sequences, with and without initial states at different
// positions per sequence; outputs, final states and all gradients.
#include <string>
#include <vector>

#include "support_hila.h"

namespace hila_test {
namespace {

const std::vector<int64_t> kLens = {0, 37, 0, 64, 65, 1, 130, 0};
// Initial positions per sequence: unaligned, aligned, large (log-linear: up to 2^20 + 64).
const std::vector<int64_t> kPos = {5, 0, 1000, 64, 37, int64_t(1) << 20, 3, 129};

struct VarlenCase {
  Op op;
  Form form;
  int64_t chunk;
  bool init;
  bool bwd;
};

std::string case_name(const VarlenCase& c) {
  return op_tag(c.op) + "_" + form_tag(c.form, c.chunk) + (c.init ? "_init" : "_noinit") + (c.bwd ? "_bwd" : "_fwd");
}

ProblemSpec spec_of(const VarlenCase& c) {
  ProblemSpec s = spec_for(c.op, 0, seed_of(case_name(c)));
  s.seqlens = kLens;
  s.H = 2;
  s.G = 1;
  s.dk = 4;
  s.dv = 3;
  s.extra_levels = 1;
  if (c.init) {
    s.init_state = true;
    s.init_pos = kPos;
  }
  return s;
}

int64_t slots_at(const Problem& p, int64_t pos) {
  return traits(p.spec.cfg.op).loglinear ? hila::state_slots(pos) : 1;
}

// Sequence i of a packed problem as a problem of its own (B = 1, no cu_seqlens).
Problem sequence(const Problem& p, int64_t i, int64_t t0) {
  Problem s;
  s.spec = p.spec;
  s.spec.seqlens.clear();
  const int64_t len = p.seq_len(i), n0 = p.start_pos(i);
  s.spec.T = len;
  s.spec.init_pos = {n0};
  for (Buffer Problem::*m : {&Problem::q, &Problem::k, &Problem::v, &Problem::g, &Problem::lam,
                             &Problem::beta, &Problem::d_o})
    s.*m = hila::tools::slice_time(p.*m, t0, len);
  if (!p.init.empty()) s.init = with_slots(state_row(p.init, i), slots_at(p, n0));
  s.d_final = with_slots(state_row(p.d_final, i), slots_at(p, n0 + len));
  return s;
}

void PrintTo(const VarlenCase& c, std::ostream* os) { *os << case_name(c); }

class Varlen : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(Varlen, PackedEqualsSeparate) {
  const VarlenCase& c = GetParam();
  const Problem p = hila::tools::make_problem(spec_of(c));
  ASSERT_EQ(p.num_seqs(), int64_t(kLens.size()));
  const Result packed = c.bwd ? hila::tools::run_backward(p, c.form, c.chunk)
                              : hila::tools::run_forward(p, c.form, c.chunk);
  const double tf = fwd_tol(DType::f64), tb = bwd_tol(DType::f64);
  int64_t t0 = 0;
  for (int64_t i = 0; i < p.num_seqs(); ++i) {
    const std::string ctx = case_name(c) + " sequence " + std::to_string(i) + " (length " +
                            std::to_string(p.seq_len(i)) + ", start " +
                            std::to_string(p.start_pos(i)) + ")";
    const Problem s = sequence(p, i, t0);
    const Result alone = c.bwd ? hila::tools::run_backward(s, c.form, c.chunk)
                               : hila::tools::run_forward(s, c.form, c.chunk);
    const int64_t len = p.seq_len(i);
    auto rows = [&](const Buffer& b) { return hila::tools::slice_time(b, t0, len); };
    // A sequence's gradient may be exactly zero (dg of a length-1 sequence without a state).
    auto floor = [](const Buffer& b) { return 1e-4 * max_abs(b); };
    expect_buffer_close(rows(packed.o), alone.o, tf, ctx + " o");
    EXPECT_LE(state_err(state_row(packed.final_state, i), alone.final_state), tf)
        << ctx << " final state";
    if (c.bwd) {
      expect_buffer_close(rows(packed.dq), alone.dq, tb, ctx + " dq", floor(packed.dq));
      expect_buffer_close(rows(packed.dk), alone.dk, tb, ctx + " dk", floor(packed.dk));
      expect_buffer_close(rows(packed.dv), alone.dv, tb, ctx + " dv", floor(packed.dv));
      expect_buffer_close(rows(packed.dg), alone.dg, tb, ctx + " dg", floor(packed.dg));
      expect_buffer_close(rows(packed.dlam), alone.dlam, tb, ctx + " dlam", floor(packed.dlam));
      expect_buffer_close(rows(packed.dbeta), alone.dbeta, tb, ctx + " dbeta", floor(packed.dbeta));
      if (c.init) {
        EXPECT_LE(state_err(state_row(packed.d_init, i), alone.d_init), tb) << ctx << " d_init";
      }
    }
    if (len == 0) {
      // An empty sequence passes its state through: final = initial, d_init = d_final.
      StateBuffers want;
      if (c.init) {
        want = state_row(p.init, i);
      } else {
        want = hila::tools::make_state(p.spec.cfg, 1, p.spec.H, p.spec.dk, p.spec.dv, 0,
                                       DType::f64);
      }
      EXPECT_LE(state_err(state_row(packed.final_state, i), want), tf)
          << ctx << ": final state of an empty sequence must equal its initial state";
      if (c.bwd && c.init) {
        StateBuffers dfin = state_row(p.d_final, i);
        EXPECT_LE(state_err(state_row(packed.d_init, i), dfin), tb)
            << ctx << ": d_init of an empty sequence must equal its d_final";
      }
    }
    t0 += len;
  }
}

std::vector<VarlenCase> varlen_cases() {
  std::vector<VarlenCase> out;
  const std::pair<Form, int64_t> forms[] = {
      {Form::naive, 64}, {Form::serial, 64}, {Form::chunk, 16}, {Form::chunk, 64}, {Form::scan, 16}};
  for (Op op : hila::all_ops())
    for (bool init : {false, true})
      for (const auto& [form, chunk] : forms) {
        out.push_back({op, form, chunk, init, false});
        if (hila::supports(op, form, true)) out.push_back({op, form, chunk, init, true});
      }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllOps, Varlen, ::testing::ValuesIn(varlen_cases()),
                         [](const ::testing::TestParamInfo<VarlenCase>& i) {
                           return case_name(i.param);
                         });

// Varlen through the forms agrees with the naive form (the per-sequence test above compares a
// form with itself).
TEST(VarlenForms, ChunkMatchesNaivePacked) {
  for (Op op : hila::all_ops()) {
    ProblemSpec s = spec_for(op, 0, 99);
    s.seqlens = kLens;
    s.H = 2;
    s.dk = 4;
    s.dv = 3;
    s.init_state = true;
    s.init_pos = kPos;
    const Problem p = hila::tools::make_problem(s);
    const Result want = hila::tools::run_backward(p, Form::naive);
    const Result got = hila::tools::run_backward(p, Form::chunk, 16);
    expect_results_close(got, want, fwd_tol(DType::f64), bwd_tol(DType::f64),
                         op_tag(op) + " varlen chunk16 vs naive");
  }
}

}  // namespace
}  // namespace hila_test
