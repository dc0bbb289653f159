// SPDX-License-Identifier: Apache-2.0
// State resets (docs/OPERATORS.md, "Resets"): a log-gate g_t = -inf, or a finite g_t so negative
// that exp(g_t) underflows, multiplies the state before token t by exactly 0. Every form must
// compute that as exactly as the serial recurrence, which applies exp(g_t) = 0 directly: a reset
// token at every position of a chunk, for every operator, forward and backward, float32 and
// float64. (Decays are sums of the gates between two tokens; taken as differences of cumulative
// sums they would cancel the gates after a reset, or give -inf - -inf = NaN.)
#include <string>
#include <vector>

#include "support_hila.h"

namespace hila_test {
namespace {

constexpr int64_t kC = 8;  // chunk size: tokens 0..C-1 of the call form one whole chunk

// Relative error bounds against the serial form (max-norm over each tensor).
double reset_tol(DType dt) { return dt == DType::f64 ? 1e-12 : 1e-6; }

ProblemSpec reset_spec(Op op, DType dt, const std::string& tag) {
  ProblemSpec s = spec_for(op, 2 * kC, seed_of(tag));
  s.B = 1;
  s.H = 2;
  s.G = 1;
  s.dk = 4;
  s.dv = 3;
  s.dtype = dt;
  s.init_state = true;
  s.init_pos = {kC};  // the call starts on a chunk boundary: token p sits at position p of a chunk
  return s;
}

// g[:, t, :] = x on every head (tied gates).
void set_gate(Problem& p, int64_t t, double x) {
  const int64_t T = p.spec.T, H = p.spec.H;
  for (int64_t b = 0; b < p.spec.B; ++b)
    for (int64_t h = 0; h < H; ++h) p.g.set((b * T + t) * H + h, x);
}

std::string gate_tag(double g) {
  if (std::isinf(g)) return "minf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0e", -g);
  return std::string("m") + buf;
}

struct ResetCase {
  Op op;
  DType dt;
};

std::string case_name(const ResetCase& c) { return op_tag(c.op) + "_" + dtype_tag(c.dt); }

class Resets : public ::testing::TestWithParam<ResetCase> {};

// Forward: naive, chunk and scan against serial, a reset (g = -inf and g = -1e30) at each position
// of the first chunk and, in the same call, at the mirrored position of the second chunk.
TEST_P(Resets, ForwardEveryPositionMatchesSerial) {
  const ResetCase c = GetParam();
  const Problem base = hila::tools::make_problem(reset_spec(c.op, c.dt, case_name(c) + "_fwd"));
  for (double gval : {-kInf, -1e30}) {
    for (int64_t p = 0; p < kC; ++p) {
      Problem pr = base;
      set_gate(pr, p, gval);
      set_gate(pr, 2 * kC - 1 - p, gval);
      const Result ref = hila::tools::run_forward(pr, Form::serial, kC);
      ASSERT_TRUE(all_finite(ref.o)) << "serial o not finite";
      for (Form f : {Form::naive, Form::chunk, Form::scan}) {
        const Result got = hila::tools::run_forward(pr, f, kC);
        const std::string ctx = case_name(c) + " " + hila::form_name(f) + " g=" + gate_tag(gval) +
                                " at position " + std::to_string(p);
        expect_results_close(got, ref, reset_tol(c.dt), reset_tol(c.dt), ctx);
      }
    }
  }
}

// Backward: against the serial backward where it exists (gla, hla2, ahla, hla3), else the naive
// form (float64 arithmetic, as exact as the serial recurrence with the direct decay sums); the
// gradient of a reset gate is 0.
TEST_P(Resets, BackwardEveryPositionMatchesReference) {
  const ResetCase c = GetParam();
  const Problem base = hila::tools::make_problem(reset_spec(c.op, c.dt, case_name(c) + "_bwd"));
  const bool serial = hila::supports(c.op, Form::serial, true);
  for (double gval : {-kInf, -1e30}) {
    for (int64_t p = 0; p < kC; ++p) {
      Problem pr = base;
      set_gate(pr, p, gval);
      set_gate(pr, 2 * kC - 1 - p, gval);
      const Result ref = hila::tools::run_backward(pr, serial ? Form::serial : Form::naive, kC);
      for (int64_t t : {p, 2 * kC - 1 - p})
        for (int64_t h = 0; h < pr.spec.H; ++h)
          EXPECT_EQ(ref.dg.get(t * pr.spec.H + h), 0.0) << "dg of a reset gate must be 0";
      std::vector<Form> forms = {Form::chunk};
      if (serial) forms.push_back(Form::naive);
      for (Form f : forms) {
        const Result got = hila::tools::run_backward(pr, f, kC);
        const std::string ctx = case_name(c) + " " + hila::form_name(f) + " bwd g=" + gate_tag(gval) +
                                " at position " + std::to_string(p);
        expect_results_close(got, ref, reset_tol(c.dt), reset_tol(c.dt), ctx);
        for (int64_t t : {p, 2 * kC - 1 - p})
          for (int64_t h = 0; h < pr.spec.H; ++h)
            EXPECT_EQ(got.dg.get(t * pr.spec.H + h), 0.0) << ctx << ": dg of a reset gate must be 0";
      }
    }
  }
}

// Large finite negative gates: a reset wherever exp(g) underflows (float32 below about -104,
// float64 below about -745); every form as exact as the serial form.
TEST_P(Resets, LargeFiniteNegativeGatesMatchSerial) {
  const ResetCase c = GetParam();
  const Problem base = hila::tools::make_problem(reset_spec(c.op, c.dt, case_name(c) + "_finite"));
  for (double gval : {-1e6, -1e9, -1e12, -1e20}) {
    Problem pr = base;
    set_gate(pr, 3, gval);
    set_gate(pr, kC + 5, gval);
    const Result ref = hila::tools::run_forward(pr, Form::serial, kC);
    for (Form f : {Form::naive, Form::chunk, Form::scan}) {
      const Result got = hila::tools::run_forward(pr, f, kC);
      expect_results_close(got, ref, reset_tol(c.dt), reset_tol(c.dt),
                           case_name(c) + " " + hila::form_name(f) + " g=" + gate_tag(gval));
    }
  }
}

// g = -6e36 on every token: every token resets (o_t reads its own token only); the cumulative
// sums of such gates overflow float32, the direct sums do not matter.
TEST_P(Resets, EveryTokenResetStaysFinite) {
  const ResetCase c = GetParam();
  Problem pr = hila::tools::make_problem(reset_spec(c.op, c.dt, case_name(c) + "_all"));
  pr.g.fill(-6e36);
  const Result ref = hila::tools::run_forward(pr, Form::serial, kC);
  ASSERT_TRUE(all_finite(ref.o));
  for (Form f : {Form::naive, Form::chunk, Form::scan}) {
    const Result got = hila::tools::run_forward(pr, f, kC);
    expect_results_close(got, ref, reset_tol(c.dt), reset_tol(c.dt),
                         case_name(c) + " " + hila::form_name(f) + " every token reset");
  }
}

std::vector<ResetCase> reset_cases() {
  std::vector<ResetCase> out;
  for (Op op : hila::all_ops())
    for (DType dt : {DType::f32, DType::f64}) out.push_back({op, dt});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllOps, Resets, ::testing::ValuesIn(reset_cases()),
                         [](const auto& info) { return case_name(info.param); });

}  // namespace
}  // namespace hila_test
