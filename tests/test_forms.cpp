// SPDX-License-Identifier: Apache-2.0
// Every operator x form x direction against the float64 naive form (docs/math/HLA.md §1–7,
// docs/math/LOGLINEAR.md §3–7): outputs, final states and all gradients, in float64 (1e-10, backward
// 1e-9), float32 (1e-4) and bf16 / f16 inputs (computed in fp32).
#include <omp.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "support_hila.h"

namespace hila_test {
namespace {

enum class Var { plain, nogate, init, gqa, untied, normalize, ridge, l2norm, scale, all };

const char* var_tag(Var v) {
  switch (v) {
    case Var::plain: return "plain";
    case Var::nogate: return "nogate";
    case Var::init: return "init";
    case Var::gqa: return "gqa";
    case Var::untied: return "untied";
    case Var::normalize: return "normalize";
    case Var::ridge: return "ridge";
    case Var::l2norm: return "l2norm";
    case Var::scale: return "scale";
    case Var::all: return "all";
  }
  return "?";
}

bool applies(Op op, Var v) {
  const hila::OpTraits t = traits(op);
  switch (v) {
    case Var::untied:
    case Var::normalize: return t.hla_family;
    case Var::ridge: return takes_ridge(op);
    case Var::l2norm: return t.delta;
    default: return true;
  }
}

struct FormCase {
  Op op;
  Form form;
  int64_t chunk;
  DType dt;
  int64_t T;
  Var var;
  bool bwd;
};

std::string case_name(const FormCase& c) {
  return op_tag(c.op) + "_" + form_tag(c.form, c.chunk) + "_" + dtype_tag(c.dt) + "_T" +
         std::to_string(c.T) + "_" + var_tag(c.var) + (c.bwd ? "_bwd" : "_fwd");
}

ProblemSpec spec_of(const FormCase& c) {
  ProblemSpec s = spec_for(c.op, c.T, seed_of(case_name(c)));
  s.B = 2;
  s.H = 2;
  s.G = 1;
  s.dk = 8;
  s.dv = 5;
  s.dtype = c.dt;
  const hila::OpTraits t = traits(c.op);
  auto init = [&] {
    s.init_state = true;
    s.init_pos = {37, 100};  // unaligned with every chunk size; different per sequence
  };
  auto gqa = [&] {
    s.G = 2;
    s.H = 4;
  };
  switch (c.var) {
    case Var::plain: break;
    case Var::nogate: s.gated = false; break;
    case Var::init: init(); break;
    case Var::gqa: gqa(); break;
    case Var::untied: s.cfg.gates = Gates::untied; break;
    case Var::normalize:
      s.cfg.normalize = true;
      s.nonneg = true;  // positive denominators (docs/math/HLA.md §4)
      break;
    case Var::ridge: s.cfg.ridge = 0.3; break;
    case Var::l2norm: s.cfg.qk_l2norm = true; break;
    case Var::scale: s.cfg.scale = 0.6; break;
    case Var::all:
      init();
      gqa();
      if (t.hla_family) {
        s.cfg.gates = Gates::untied;
        s.cfg.normalize = true;
        s.nonneg = true;
      }
      if (takes_ridge(c.op)) s.cfg.ridge = 0.3;
      if (t.delta) s.cfg.qk_l2norm = true;
      break;
  }
  return s;
}

struct FormConfig {
  Form form;
  int64_t chunk;
};

std::vector<FormConfig> form_configs(bool with_naive) {
  std::vector<FormConfig> f = {{Form::serial, 64}, {Form::chunk, 16}, {Form::chunk, 64},
                               {Form::scan, 16},   {Form::scan, 64}};
  if (with_naive) f.insert(f.begin(), {Form::naive, 64});
  return f;
}

void add_cases(std::vector<FormCase>& out, Op op, DType dt, int64_t T, Var var, bool with_bwd) {
  for (const FormConfig& fc : form_configs(dt != DType::f64)) {
    out.push_back({op, fc.form, fc.chunk, dt, T, var, false});
    if (with_bwd && hila::supports(op, fc.form, true))
      out.push_back({op, fc.form, fc.chunk, dt, T, var, true});
  }
}

// Plain problems over the T sweep (T = 1, around one chunk of 64, more than two chunks).
std::vector<FormCase> sweep_cases() {
  std::vector<FormCase> out;
  for (Op op : hila::all_ops())
    for (DType dt : {DType::f64, DType::f32})
      for (int64_t T : {1, 63, 64, 65, 130}) add_cases(out, op, dt, T, Var::plain, true);
  return out;
}

// Options and structure: no gates, initial states, GQA, untied gates, normalize, ridge, qk_l2norm,
// explicit scale, and all of them at once.
std::vector<FormCase> variant_cases() {
  std::vector<FormCase> out;
  const Var vars[] = {Var::nogate, Var::init,   Var::gqa,   Var::untied, Var::normalize,
                      Var::ridge,  Var::l2norm, Var::scale, Var::all};
  for (Op op : hila::all_ops())
    for (Var v : vars) {
      if (!applies(op, v)) continue;
      std::vector<int64_t> Ts = {65};
      if (v == Var::init || v == Var::all) Ts = {1, 65, 130};
      for (DType dt : {DType::f64, DType::f32})
        for (int64_t T : Ts) add_cases(out, op, dt, T, v, true);
    }
  return out;
}

// bf16 / f16 inputs are accepted and computed in fp32 (forward).
std::vector<FormCase> lowp_cases() {
  std::vector<FormCase> out;
  for (Op op : hila::all_ops())
    for (DType dt : {DType::bf16, DType::f16}) {
      add_cases(out, op, dt, 65, Var::plain, false);
      add_cases(out, op, dt, 65, Var::init, false);
    }
  return out;
}

void PrintTo(const FormCase& c, std::ostream* os) { *os << case_name(c); }

class Forms : public ::testing::TestWithParam<FormCase> {};

TEST_P(Forms, MatchesNaiveFloat64) {
  const FormCase& c = GetParam();
  const Problem p = hila::tools::make_problem(spec_of(c));
  const Problem ref = c.dt == DType::f64 ? p : hila::tools::cast_problem(p, DType::f64);
  const Result got = c.bwd ? hila::tools::run_backward(p, c.form, c.chunk)
                           : hila::tools::run_forward(p, c.form, c.chunk);
  const Result want = c.bwd ? hila::tools::run_backward(ref, Form::naive)
                            : hila::tools::run_forward(ref, Form::naive);
  ASSERT_EQ(got.o.dtype, c.dt) << "o must have the dtype of v";
  if (!got.final_state.S.empty()) {
    EXPECT_EQ(got.final_state.S.dtype, hila::tools::state_dtype(c.dt));
  }
  if (!got.final_state.H.empty()) {
    EXPECT_EQ(got.final_state.H.dtype, hila::tools::state_dtype(c.dt));
  }
  expect_results_close(got, want, fwd_tol(c.dt), bwd_tol(c.dt), case_name(c), grad_floor(c.dt));
}

std::string param_name(const ::testing::TestParamInfo<FormCase>& info) {
  return case_name(info.param);
}

INSTANTIATE_TEST_SUITE_P(Sweep, Forms, ::testing::ValuesIn(sweep_cases()), param_name);
INSTANTIATE_TEST_SUITE_P(Variants, Forms, ::testing::ValuesIn(variant_cases()), param_name);
INSTANTIATE_TEST_SUITE_P(LowPrecision, Forms, ::testing::ValuesIn(lowp_cases()), param_name);

// The chunk form (chunk 64) of p against the float64 naive form of the same problem, forward or
// backward; returns the chunk form's result.
Result chunk_matches_naive(const Problem& p, DType dt, bool bwd, const std::string& name) {
  const Problem ref = dt == DType::f64 ? p : hila::tools::cast_problem(p, DType::f64);
  Result got = bwd ? hila::tools::run_backward(p, Form::chunk, 64) : hila::tools::run_forward(p, Form::chunk, 64);
  const Result want = bwd ? hila::tools::run_backward(ref, Form::naive) : hila::tools::run_forward(ref, Form::naive);
  expect_results_close(got, want, fwd_tol(dt), bwd_tol(dt), name, grad_floor(dt));
  return got;
}

// The chunk form of the delta rule at head sizes that fill the CPU's register tiles (16 floats,
// 8 doubles a vector row) and overrun them (20), with dk != dv: gdn (its gated-inverse form) and
// loglinear_gdn, one segment (T = 16), one row more (17), whole chunks (64) and a partial one (65),
// gates, initial states (unaligned positions), GQA and qk_l2norm together, forward and backward.
TEST(FormsWideHeads, DeltaChunkMatchesNaiveFloat64) {
  const int64_t dims[][2] = {{16, 16}, {32, 32}, {20, 16}, {16, 20}};
  for (Op op : {Op::gdn, Op::loglinear_gdn})
    for (DType dt : {DType::f64, DType::f32})
      for (const auto& d : dims)
        for (int64_t T : {16, 17, 64, 65})
          for (bool bwd : {false, true}) {
            const FormCase c{op, Form::chunk, 64, dt, T, Var::all, bwd};
            ProblemSpec s = spec_of(c);
            s.dk = d[0];
            s.dv = d[1];
            const std::string name = case_name(c) + "_dk" + std::to_string(d[0]) + "_dv" +
                                     std::to_string(d[1]);
            SCOPED_TRACE(name);
            chunk_matches_naive(hila::tools::make_problem(s), dt, bwd, name);
          }
}

// The chunk form of the delta rule from other starting positions and across resets: sequence 0
// starts from a state at position 40 (Fenwick levels 4 and 6 live, a first segment that ends at
// 64), sequence 1 from a state at position 0 (no live incoming level: a first segment without
// reads or erase); T = 1 (one token), 17, 64 (sequence 0 crosses 64 and 96) and 65; without and
// with resets (g = -inf) at a segment boundary (row 24: absolute 64 for sequence 0) and inside a
// segment (rows 5 and 45). Forward and backward against the float64 naive form.
TEST(FormsWideHeads, DeltaChunkPositionsAndResetsMatchNaiveFloat64) {
  const int64_t dims[][2] = {{16, 16}, {20, 16}};
  for (Op op : {Op::gdn, Op::loglinear_gdn})
    for (DType dt : {DType::f64, DType::f32})
      for (const auto& d : dims)
        for (int64_t T : {1, 17, 64, 65})
          for (bool resets : {false, true})
            for (bool bwd : {false, true}) {
              const FormCase c{op, Form::chunk, 64, dt, T, Var::init, bwd};
              ProblemSpec s = spec_of(c);
              s.dk = d[0];
              s.dv = d[1];
              s.init_pos = {40, 0};
              const std::string name = case_name(c) + "_dk" + std::to_string(d[0]) + "_dv" +
                                       std::to_string(d[1]) + "_pos40_0" + (resets ? "_resets" : "");
              SCOPED_TRACE(name);
              Problem p = hila::tools::make_problem(s);
              if (resets)
                for (int64_t t : {5, 24, 45})
                  if (t < T)
                    for (int64_t b = 0; b < s.B; ++b)
                      for (int64_t h = 0; h < s.H; ++h)
                        p.g.set((b * T + t) * s.H + h, -std::numeric_limits<double>::infinity());
              const Result got = chunk_matches_naive(p, dt, bwd, name);
              if (resets && bwd)
                for (int64_t t : {5, 24, 45})
                  if (t < T)
                    for (int64_t b = 0; b < s.B; ++b)
                      for (int64_t h = 0; h < s.H; ++h)
                        EXPECT_EQ(got.dg.get((b * T + t) * s.H + h), 0.0) << "dg of a reset gate";
            }
}

// The naive form itself against an independent float64 reference: GLA with one head computed
// here from docs/math/HLA.md §1, so a wrong naive form cannot hide behind form agreement.
TEST(FormsOracle, NaiveGlaMatchesDirectSum) {
  ProblemSpec s = spec_for(Op::gla, 23, 11);
  s.dk = 3;
  s.dv = 2;
  s.cfg.scale = 0.7;
  const Problem p = hila::tools::make_problem(s);
  const Result r = hila::tools::run_forward(p, Form::naive);
  const std::vector<double> q = p.q.to_double(), k = p.k.to_double(), v = p.v.to_double(),
                            g = p.g.to_double();
  Buffer want(DType::f64, {1, 23, 1, 2});
  for (int t = 0; t < 23; ++t)
    for (int c = 0; c < 2; ++c) {
      double acc = 0;
      for (int u = 0; u <= t; ++u) {
        double decay = 0;
        for (int r2 = u + 1; r2 <= t; ++r2) decay += g[r2];
        double qk = 0;
        for (int i = 0; i < 3; ++i) qk += 0.7 * q[t * 3 + i] * k[u * 3 + i];
        acc += std::exp(decay) * qk * v[u * 2 + c];
      }
      want.set(t * 2 + c, acc);
    }
  expect_buffer_close(r.o, want, 1e-12, "naive gla vs direct sum");
}

// HLA2 naive against its triple-sum definition (docs/math/HLA.md §3.1, tied gates).
TEST(FormsOracle, NaiveHla2MatchesTripleSum) {
  ProblemSpec s = spec_for(Op::hla2, 17, 12);
  s.dk = 3;
  s.dv = 2;
  const Problem p = hila::tools::make_problem(s);
  const Result r = hila::tools::run_forward(p, Form::naive);
  const double sc = 1.0 / std::sqrt(3.0);
  const std::vector<double> q = p.q.to_double(), k = p.k.to_double(), v = p.v.to_double(),
                            g = p.g.to_double();
  std::vector<double> c(17);
  for (int t = 0; t < 17; ++t) c[t] = (t ? c[t - 1] : 0) + g[t];
  auto dot = [&](const std::vector<double>& a, int i, const std::vector<double>& b, int j) {
    double x = 0;
    for (int d = 0; d < 3; ++d) x += a[i * 3 + d] * b[j * 3 + d];
    return x;
  };
  Buffer want(DType::f64, {1, 17, 1, 2});
  for (int t = 0; t < 17; ++t)
    for (int col = 0; col < 2; ++col) {
      double acc = 0;
      for (int j = 0; j <= t; ++j)
        for (int i = 0; i <= j; ++i)
          acc += std::exp(c[t] - c[i]) * sc * dot(q, t, k, i) * sc * dot(q, j, k, i) *
                 v[j * 2 + col];
      want.set(t * 2 + col, acc);
    }
  expect_buffer_close(r.o, want, 1e-12, "naive hla2 vs triple sum");
}

// Log-linear Mamba-2 naive against its masked definition (docs/math/LOGLINEAR.md §3.1).
TEST(FormsOracle, NaiveLoglinearMatchesMaskedSum) {
  ProblemSpec s = spec_for(Op::loglinear, 21, 13);
  s.dk = 3;
  s.dv = 2;
  const Problem p = hila::tools::make_problem(s);
  const Result r = hila::tools::run_forward(p, Form::naive);
  const double sc = 1.0 / std::sqrt(3.0);
  const int64_t L = p.lam.shape[3];
  const std::vector<double> q = p.q.to_double(), k = p.k.to_double(), v = p.v.to_double(),
                            g = p.g.to_double(), lam = p.lam.to_double();
  auto bitlen = [](uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; };
  Buffer want(DType::f64, {1, 21, 1, 2});
  for (int t = 0; t < 21; ++t)
    for (int col = 0; col < 2; ++col) {
      double acc = 0;
      for (int u = 0; u <= t; ++u) {
        double decay = 0;
        for (int r2 = u + 1; r2 <= t; ++r2) decay += g[r2];
        double qk = 0;
        for (int d = 0; d < 3; ++d) qk += sc * q[t * 3 + d] * k[u * 3 + d];
        acc += lam[t * L + bitlen(uint64_t(t ^ u))] * std::exp(decay) * qk * v[u * 2 + col];
      }
      want.set(t * 2 + col, acc);
    }
  expect_buffer_close(r.o, want, 1e-12, "naive loglinear vs masked sum");
}

// AHLA, HLA3 and Gated DeltaNet naive forms against their serial recurrences written out here
// (docs/math/HLA.md §5.2, §6.2; docs/math/LOGLINEAR.md §6.1 with lam = 1), tied gates, one head.
TEST(FormsOracle, NaiveMatchesSpecRecurrences) {
  constexpr int T = 15, d = 3, dv = 2;
  for (Op op : {Op::ahla, Op::hla3, Op::gdn}) {
    ProblemSpec s = spec_for(op, T, 14);
    s.dk = d;
    s.dv = dv;
    const Problem p = hila::tools::make_problem(s);
    const Result r = hila::tools::run_forward(p, Form::naive);
    const double sc = 1.0 / std::sqrt(double(d));
    const std::vector<double> q = p.q.to_double(), k = p.k.to_double(), v = p.v.to_double(),
                              g = p.g.to_double();
    const std::vector<double> beta = op == Op::gdn ? p.beta.to_double() : std::vector<double>(T, 1.0);
    double S[d][d] = {}, P[d][dv] = {}, X[d][dv] = {};
    Buffer want(DType::f64, {1, T, 1, dv});
    for (int t = 0; t < T; ++t) {
      const double a = std::exp(g[t]);
      const double* kt = &k[t * d];
      const double* vt = &v[t * dv];
      double qh[d];
      for (int i = 0; i < d; ++i) qh[i] = sc * q[t * d + i];
      double o[dv] = {};
      if (op == Op::gdn) {
        // P is the GDN state: P <- a (I - beta k k^T) P + beta k v^T; o = P^T q^
        double kP[dv] = {};
        for (int i = 0; i < d; ++i)
          for (int c = 0; c < dv; ++c) kP[c] += kt[i] * P[i][c];
        for (int i = 0; i < d; ++i)
          for (int c = 0; c < dv; ++c)
            P[i][c] = a * (P[i][c] - beta[t] * kt[i] * kP[c]) + beta[t] * kt[i] * vt[c];
        for (int i = 0; i < d; ++i)
          for (int c = 0; c < dv; ++c) o[c] += P[i][c] * qh[i];
      } else {
        for (int i = 0; i < d; ++i)
          for (int j = 0; j < d; ++j) S[i][j] = a * S[i][j] + kt[i] * kt[j];
        for (int i = 0; i < d; ++i)
          for (int c = 0; c < dv; ++c) P[i][c] = a * P[i][c] + kt[i] * vt[c];
        double h[dv] = {}, u[d] = {};
        for (int i = 0; i < d; ++i)
          for (int c = 0; c < dv; ++c) h[c] += P[i][c] * qh[i];  // h = P^T q^
        for (int i = 0; i < d; ++i)
          for (int j = 0; j < d; ++j) u[i] += S[i][j] * qh[j];   // u = S q^
        // AHLA: E <- a E + k h^T;  HLA3: X <- a X + u h^T;  o = X^T q^
        const double* left = op == Op::ahla ? kt : u;
        for (int i = 0; i < d; ++i)
          for (int c = 0; c < dv; ++c) X[i][c] = a * X[i][c] + left[i] * h[c];
        for (int i = 0; i < d; ++i)
          for (int c = 0; c < dv; ++c) o[c] += X[i][c] * qh[i];
      }
      for (int c = 0; c < dv; ++c) want.set(t * dv + c, o[c]);
    }
    expect_buffer_close(r.o, want, 1e-12, op_tag(op) + " naive vs spec recurrence");
  }
}

// The CPU backend runs a call's (sequence, head) pairs in one OpenMP region when the work pays for
// it (src/cpu/backend.h, cpu_parallel: a 2-sequence x 4-head call of T = 64, d = 16 does). Each pair
// is computed alone, with its thread's own segment work space, so any number of threads gives the
// bits of one thread: forward, final state and every gradient, with states, GQA and resets.
TEST(FormsThreads, ParallelHeadsGiveTheBitsOfOneThread) {
  struct Restore {  // the thread count of the tests that follow, whatever happens here
    int n = omp_get_max_threads();
    ~Restore() { omp_set_num_threads(n); }
  } restore;
  for (Op op : hila::all_ops())
    for (DType dt : {DType::f32, DType::f64}) {
      SCOPED_TRACE(op_tag(op) + " " + dtype_tag(dt));
      ProblemSpec s = spec_for(op, 64, seed_of("FormsThreads" + op_tag(op)));
      s.B = 2, s.G = 2, s.H = 4, s.dk = 16, s.dv = 16;
      s.dtype = dt;
      s.init_state = true;
      Problem p = hila::tools::make_problem(s);
      p.g.set(37, -std::numeric_limits<double>::infinity());  // a reset inside the first chunk
      Result one, many;
      omp_set_num_threads(1);
      one = run_backward(p, Form::chunk, 64);
      omp_set_num_threads(4);
      many = run_backward(p, Form::chunk, 64);
      for (const auto& [name, a, b] :
           {std::tuple<const char*, const Buffer*, const Buffer*>{"o", &one.o, &many.o}, {"dq", &one.dq, &many.dq},
            {"dk", &one.dk, &many.dk}, {"dv", &one.dv, &many.dv}, {"dg", &one.dg, &many.dg},
            {"dlam", &one.dlam, &many.dlam}, {"dbeta", &one.dbeta, &many.dbeta}})
        EXPECT_TRUE(same_bytes(*a, *b)) << name;
      EXPECT_TRUE(same_state(one.final_state, many.final_state)) << "final_state";
      EXPECT_TRUE(same_state(one.d_init, many.d_init)) << "d_init";
      EXPECT_TRUE(all_finite(one.o) && all_finite(one.dq)) << "non-finite results";
    }
}

}  // namespace
}  // namespace hila_test
