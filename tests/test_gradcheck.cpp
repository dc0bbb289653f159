// SPDX-License-Identifier: Apache-2.0
// Backward against central finite differences of the float64 naive forward (docs/math/HLA.md §7,
// docs/math/LOGLINEAR.md §5, §6.5): loss = <o, do> + <final_state, d_final>, every input perturbed
// through Buffer::set. Checks dq, dk, dv, dg, dlam, dbeta and d_init for the naive, chunk and
// (where it exists) serial backward.
#include <string>
#include <vector>

#include "support_hila.h"

namespace hila_test {
namespace {

constexpr double kStep = 1e-6;
constexpr double kTol = 1e-7;  // max |fd - analytic| relative to max |gradient| of the tensor

double dot(const Buffer& a, const Buffer& b) {
  if (a.empty() || b.empty()) return 0;
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.get(i) * b.get(i);
  return s;
}

double loss(const Problem& p) {
  const Result r = hila::tools::run_forward(p, Form::naive);
  return dot(r.o, p.d_o) + dot(r.final_state.S, p.d_final.S) + dot(r.final_state.P, p.d_final.P) +
         dot(r.final_state.H, p.d_final.H);
}

enum class Var { noinit, init5, init13, extras };

const char* var_tag(Var v) {
  switch (v) {
    case Var::noinit: return "noinit";
    case Var::init5: return "init5";
    case Var::init13: return "init13";
    case Var::extras: return "extras";
  }
  return "?";
}

struct GradCase {
  Op op;
  Var var;
};

std::string case_name(const GradCase& c) { return op_tag(c.op) + "_" + var_tag(c.var); }

ProblemSpec spec_of(const GradCase& c) {
  ProblemSpec s = spec_for(c.op, 9, seed_of(case_name(c)));
  s.B = 1;
  s.H = 2;
  s.G = 1;
  s.dk = 3;
  s.dv = 3;
  s.cfg.check_values = false;  // gates near 0 may be perturbed slightly above 0
  switch (c.var) {
    case Var::noinit: break;
    case Var::init5:
      s.init_state = true;
      s.init_pos = {5};
      break;
    case Var::init13:
      s.T = 6;
      s.init_state = true;
      s.init_pos = {13};  // crosses 16: the state grows a slot
      break;
    case Var::extras: {
      const hila::OpTraits t = traits(c.op);
      s.init_state = true;
      s.init_pos = {6};
      if (t.hla_family) {
        s.cfg.gates = Gates::untied;
        s.cfg.normalize = true;
        s.nonneg = true;
      }
      if (takes_ridge(c.op)) s.cfg.ridge = 0.4;
      if (t.delta) s.cfg.qk_l2norm = true;
      s.cfg.scale = 0.8;
      break;
    }
  }
  return s;
}

// Entries of a log-linear initial H that must stay zero (dead slots of the position).
bool dead_slot_entry(const Problem& p, int64_t i) {
  const Buffer& h = p.init.H;
  if (h.shape.size() != 5) return false;
  const int64_t mat = h.shape[3] * h.shape[4], Ls = h.shape[2];
  const int64_t l = (i / mat) % Ls, n = i / (mat * Ls * h.shape[1]);
  const int64_t pos = int64_t(p.init.pos.get(n));
  return !(l >= 1 && ((pos >> (l - 1)) & 1));
}

struct Grad {
  std::string name;
  Buffer Problem::*input = nullptr;  // top-level input, or
  Buffer StateBuffers::*part = nullptr;  // part of the initial state
  Buffer Result::*out = nullptr;
  Buffer StateBuffers::*dpart = nullptr;
};

void PrintTo(const GradCase& c, std::ostream* os) { *os << case_name(c); }

class GradCheck : public ::testing::TestWithParam<GradCase> {};

TEST_P(GradCheck, BackwardMatchesFiniteDifferences) {
  const GradCase& c = GetParam();
  Problem p = hila::tools::make_problem(spec_of(c));
  ASSERT_EQ(p.spec.dtype, DType::f64);

  const std::vector<Grad> grads = {
      {"dq", &Problem::q, nullptr, &Result::dq, nullptr},
      {"dk", &Problem::k, nullptr, &Result::dk, nullptr},
      {"dv", &Problem::v, nullptr, &Result::dv, nullptr},
      {"dg", &Problem::g, nullptr, &Result::dg, nullptr},
      {"dlam", &Problem::lam, nullptr, &Result::dlam, nullptr},
      {"dbeta", &Problem::beta, nullptr, &Result::dbeta, nullptr},
      {"d_init.S", nullptr, &StateBuffers::S, nullptr, &StateBuffers::S},
      {"d_init.P", nullptr, &StateBuffers::P, nullptr, &StateBuffers::P},
      {"d_init.H", nullptr, &StateBuffers::H, nullptr, &StateBuffers::H},
  };

  // Finite differences, once per problem.
  std::vector<std::vector<double>> fd(grads.size());
  int checked = 0;
  for (size_t gi = 0; gi < grads.size(); ++gi) {
    const Grad& gr = grads[gi];
    Buffer& x = gr.input ? p.*(gr.input) : p.init.*(gr.part);
    if (x.empty()) continue;
    ++checked;
    fd[gi].assign(size_t(x.numel()), 0.0);
    const bool state_h = gr.part == &StateBuffers::H;
    for (int64_t i = 0; i < x.numel(); ++i) {
      if (state_h && dead_slot_entry(p, i)) continue;
      const double x0 = x.get(i);
      x.set(i, x0 + kStep);
      const double lp = loss(p);
      x.set(i, x0 - kStep);
      const double lm = loss(p);
      x.set(i, x0);
      fd[gi][size_t(i)] = (lp - lm) / (2 * kStep);
    }
  }
  const hila::OpTraits t = traits(c.op);
  EXPECT_EQ(checked, 4 + t.loglinear + t.delta +
                         (p.spec.init_state ? 1 + t.has_S + t.has_P : 0))
      << "inputs present in the problem";

  std::vector<std::pair<Form, int64_t>> forms = {
      {Form::naive, 64}, {Form::chunk, 2}, {Form::chunk, 4}, {Form::chunk, 64}};
  if (hila::supports(c.op, Form::serial, true)) forms.push_back({Form::serial, 64});
  for (const auto& [form, chunk] : forms) {
    const std::string ctx = case_name(c) + " " + hila::form_name(form) + std::to_string(chunk);
    const Result r = hila::tools::run_backward(p, form, chunk);
    for (size_t gi = 0; gi < grads.size(); ++gi) {
      const Grad& gr = grads[gi];
      if (fd[gi].empty()) continue;
      const Buffer& an = gr.out ? r.*(gr.out) : r.d_init.*(gr.dpart);
      ASSERT_EQ(int64_t(fd[gi].size()), an.numel()) << ctx << ": " << gr.name << " shape";
      const bool state_h = gr.dpart == &StateBuffers::H;
      double diff = 0, scale = 0;
      int64_t worst = -1;
      bool finite = true;
      for (int64_t i = 0; i < an.numel(); ++i) {
        const double a = an.get(i);
        if (!std::isfinite(a)) finite = false;
        if (state_h && dead_slot_entry(p, i)) continue;  // not a free parameter
        const double d = std::fabs(a - fd[gi][size_t(i)]);
        if (!(d <= diff)) {
          diff = d;
          worst = i;
        }
        scale = std::max({scale, std::fabs(a), std::fabs(fd[gi][size_t(i)])});
      }
      EXPECT_TRUE(finite) << ctx << ": " << gr.name << " has non-finite entries";
      const double rel = diff / std::max(scale, 1e-300);
      EXPECT_LE(rel, kTol) << ctx << ": " << gr.name << " vs finite differences, worst index "
                           << worst << " analytic " << (worst >= 0 ? an.get(worst) : 0.0)
                           << " fd " << (worst >= 0 ? fd[gi][size_t(worst)] : 0.0)
                           << " (max |grad| " << scale << ")";
    }
  }
}

std::vector<GradCase> grad_cases() {
  std::vector<GradCase> out;
  for (Op op : hila::all_ops())
    for (Var v : {Var::noinit, Var::init5, Var::init13, Var::extras}) out.push_back({op, v});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllOps, GradCheck, ::testing::ValuesIn(grad_cases()),
                         [](const ::testing::TestParamInfo<GradCase>& i) {
                           return case_name(i.param);
                         });

}  // namespace
}  // namespace hila_test
