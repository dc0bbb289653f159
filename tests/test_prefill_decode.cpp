// SPDX-License-Identifier: Apache-2.0
// Prefill with the chunk form (C = 64), then decode with DecodeState::load + hila::step, equals one
// full chunk forward (docs/math/LOGLINEAR.md §3.5, §6.3, §7; docs/math/HLA.md §3.2, §5.2, §6.2).
// Covers every prefill length n in 0..130 and n = 64·2^k, 64·2^k ± 1 up to 512 (where fla loses the
// top Fenwick bucket, docs/math/LOGLINEAR.md §12 (E1)), and the decode state after each step.
#include <set>
#include <string>
#include <vector>

#include "support_hila.h"

namespace hila_test {
namespace {

constexpr int64_t kSteps = 10;
constexpr double kTol = 1e-10;

std::vector<int64_t> prefill_lengths() {
  std::vector<int64_t> ns;
  for (int64_t n = 0; n <= 130; ++n) ns.push_back(n);
  for (int64_t n : {255, 256, 257, 511, 512, 513}) ns.push_back(n);
  return ns;
}

// Lengths at which the decode state is compared with the full forward's final state after every
// step.
const std::set<int64_t> kStateChecked = {0, 1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512};

struct DecodeCase {
  Op op;
  bool extras;  // untied gates + normalize (HLA family), qk_l2norm (delta ops)
};

std::string case_name(const DecodeCase& c) {
  return op_tag(c.op) + (c.extras ? "_extras" : "_plain");
}

ProblemSpec spec_of(const DecodeCase& c, int64_t T) {
  ProblemSpec s = spec_for(c.op, T, seed_of(case_name(c)));
  s.dk = 4;
  s.dv = 4;
  if (c.extras) {
    const hila::OpTraits t = traits(c.op);
    if (t.hla_family) {
      s.cfg.gates = Gates::untied;
      s.cfg.normalize = true;
      s.nonneg = true;
    }
    if (t.delta) s.cfg.qk_l2norm = true;
  }
  return s;
}

hila::StepParams step_params(const Problem& p, const std::vector<int64_t>& t, Buffer& q,
                             Buffer& k, Buffer& v, Buffer& g, Buffer& lam, Buffer& beta,
                             Buffer& o) {
  q = gather_tokens(p.q, t);
  k = gather_tokens(p.k, t);
  v = gather_tokens(p.v, t);
  g = gather_tokens(p.g, t);
  lam = gather_tokens(p.lam, t);
  beta = gather_tokens(p.beta, t);
  o = Buffer(p.spec.dtype, {int64_t(t.size()), p.spec.H, p.spec.dv});
  o.poison();
  hila::StepParams sp = hila_test::step_params(p.spec.cfg, q, k, v, g, lam, beta, o);
  return sp;
}

// One decode step of a B == 1 problem at token t; returns o [1, H, dv].
Buffer decode_token(const Problem& p, int64_t t, hila::DecodeState& ds) {
  Buffer q, k, v, g, lam, beta, o;
  const hila::StepParams sp = step_params(p, {t}, q, k, v, g, lam, beta, o);
  hila::step(sp, ds);
  return o;
}

void PrintTo(const DecodeCase& c, std::ostream* os) { *os << case_name(c); }

class PrefillDecode : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(PrefillDecode, EveryPrefillLengthMatchesFullForward) {
  const DecodeCase& c = GetParam();
  const std::vector<int64_t> ns = prefill_lengths();
  const int64_t Tmax = ns.back() + kSteps;
  const Problem full = hila::tools::make_problem(spec_of(c, Tmax));
  const Result ref = hila::tools::run_forward(full, Form::chunk, 64);
  ASSERT_TRUE(all_finite(ref.o));
  const ProblemSpec& s = full.spec;

  for (int64_t n : ns) {
    const std::string ctx = case_name(c) + " prefill n=" + std::to_string(n);
    const Problem pre = hila::tools::prefix(full, n);
    const Result r = hila::tools::run_forward(pre, Form::chunk, 64);
    expect_buffer_close(r.o, hila::tools::slice_time(ref.o, 0, n), kTol, ctx + " prefill o");
    ASSERT_EQ(int64_t(r.final_state.pos.get(0)), n) << ctx;

    hila::DecodeState ds(s.cfg, 1, s.H, s.dk, s.dv, DType::f64);
    ds.load(r.final_state.view());
    ASSERT_EQ(ds.position(0), n) << ctx;
    double worst = 0;
    int64_t worst_t = -1;
    for (int64_t j = 0; j < kSteps; ++j) {
      const int64_t t = n + j;
      const Buffer o = decode_token(full, t, ds);
      const double e = hila::tools::rel_err(o, gather_tokens(ref.o, {t}));
      if (!(e <= worst)) worst = e, worst_t = t;
      EXPECT_EQ(ds.position(0), t + 1) << ctx;
      if (kStateChecked.count(n)) {
        const Result want = hila::tools::run_forward(hila::tools::prefix(full, t + 1), Form::chunk, 64);
        const double se = state_err(copy_state(ds.view()), want.final_state);
        EXPECT_LE(se, kTol) << ctx << ": decode state after token " << t
                            << " vs the final state of a chunk forward over " << t + 1 << " tokens";
      }
    }
    EXPECT_LE(worst, kTol) << ctx << ": decoded o, worst at token " << worst_t;
  }
}

// A fresh DecodeState (position 0, no load) stepped through 140 tokens: growth across 64 and 128.
TEST_P(PrefillDecode, FreshStateMatchesFullForward) {
  const DecodeCase& c = GetParam();
  const Problem full = hila::tools::make_problem(spec_of(c, 140));
  const Result ref = hila::tools::run_forward(full, Form::chunk, 64);
  const ProblemSpec& s = full.spec;
  hila::DecodeState ds(s.cfg, 1, s.H, s.dk, s.dv, DType::f64);
  EXPECT_EQ(ds.position(0), 0);
  for (int64_t t = 0; t < 140; ++t) {
    const Buffer o = decode_token(full, t, ds);
    ASSERT_LE(hila::tools::rel_err(o, gather_tokens(ref.o, {t})), kTol)
        << case_name(c) << " token " << t;
  }
  EXPECT_LE(state_err(copy_state(ds.view()), ref.final_state), kTol) << case_name(c);
  if (traits(c.op).loglinear) {
    EXPECT_GE(ds.slots(), hila::state_slots(140));
  }
}

// N = 2 sequences at different positions stepped together: loaded from a varlen prefill with
// lengths {37, 64}, each sequence continues with its own tokens.
TEST_P(PrefillDecode, BatchAtDifferentPositions) {
  const DecodeCase& c = GetParam();
  ProblemSpec s = spec_of(c, 90);
  s.B = 2;
  s.H = 2;
  s.dv = 3;
  const Problem full = hila::tools::make_problem(s);
  const Result ref = hila::tools::run_forward(full, Form::chunk, 64);
  const std::vector<int64_t> lens = {37, 64};

  // The varlen prefill of row 0's first 37 tokens and row 1's first 64 tokens.
  Problem pre = full;
  pre.spec.B = 1;
  pre.spec.seqlens = lens;
  pre.spec.T = lens[0] + lens[1];
  auto pack = [&](const Buffer& b) {
    if (b.empty()) return Buffer{};
    return concat_time({hila::tools::slice_time(slice_rows(b, 0, 1), 0, lens[0]),
                        hila::tools::slice_time(slice_rows(b, 1, 1), 0, lens[1])});
  };
  for (Buffer Problem::*m : {&Problem::q, &Problem::k, &Problem::v, &Problem::g, &Problem::lam,
                             &Problem::beta, &Problem::d_o})
    pre.*m = pack(full.*m);
  pre.cu_seqlens = Buffer(DType::i64, {3});
  pre.cu_seqlens.set(1, double(lens[0]));
  pre.cu_seqlens.set(2, double(lens[0] + lens[1]));
  const Result r = hila::tools::run_forward(pre, Form::chunk, 64);

  hila::DecodeState ds(s.cfg, 2, s.H, s.dk, s.dv, DType::f64);
  ds.load(r.final_state.view());
  ASSERT_EQ(ds.position(0), 37);
  ASSERT_EQ(ds.position(1), 64);
  for (int64_t j = 0; j < 20; ++j) {
    const std::vector<int64_t> t = {lens[0] + j, lens[1] + j};
    Buffer q, k, v, g, lam, beta, o;
    const hila::StepParams sp = step_params(full, t, q, k, v, g, lam, beta, o);
    hila::step(sp, ds);
    EXPECT_LE(hila::tools::rel_err(o, gather_tokens(ref.o, t)), kTol)
        << case_name(c) << " step " << j;
  }
}

// The functional step on a caller-owned state (hila::step(p, StateView)) equals stepping a
// DecodeState: same outputs, same state, pos advanced in place, across the crossing of 64.
TEST_P(PrefillDecode, FunctionalStepMatchesDecodeState) {
  const DecodeCase& c = GetParam();
  constexpr int64_t n = 37, m = 30;
  const Problem full = hila::tools::make_problem(spec_of(c, n + m));
  const Result ref = hila::tools::run_forward(full, Form::chunk, 64);
  const ProblemSpec& s = full.spec;
  const Result pre = hila::tools::run_forward(hila::tools::prefix(full, n), Form::chunk, 64);
  hila::DecodeState ds(s.cfg, 1, s.H, s.dk, s.dv, DType::f64);
  ds.load(pre.final_state.view());
  StateBuffers own = pre.final_state;  // room for every step to come
  if (traits(c.op).loglinear) own = with_slots(own, hila::state_slots(n + m));
  for (int64_t t = n; t < n + m; ++t) {
    Buffer q, k, v, g, lam, beta, o;
    const hila::StepParams sp = step_params(full, {t}, q, k, v, g, lam, beta, o);
    hila::step(sp, own.view());
    EXPECT_LE(hila::tools::rel_err(o, gather_tokens(ref.o, {t})), kTol) << case_name(c) << " token " << t;
    EXPECT_EQ(hila::tools::rel_err(o, decode_token(full, t, ds)), 0) << case_name(c) << " token " << t;
    EXPECT_EQ(int64_t(own.pos.get(0)), t + 1);
  }
  EXPECT_LE(state_err(own, ref.final_state), kTol) << case_name(c);
  EXPECT_EQ(state_err(own, copy_state(ds.view())), 0) << case_name(c);
}

std::vector<DecodeCase> decode_cases() {
  std::vector<DecodeCase> out;
  for (Op op : hila::all_ops()) {
    out.push_back({op, false});
    const hila::OpTraits t = traits(op);
    if (t.hla_family || t.delta) out.push_back({op, true});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllOps, PrefillDecode, ::testing::ValuesIn(decode_cases()),
                         [](const ::testing::TestParamInfo<DecodeCase>& i) {
                           return case_name(i.param);
                         });

}  // namespace
}  // namespace hila_test
