// SPDX-License-Identifier: Apache-2.0
// The scan form's segment operators on arbitrary random summaries: associativity, identity and
// the action property (docs/math/HLA.md §3.4, §5.3, §6.3; docs/math/LOGLINEAR.md §10). Equality of
// the scan form with the serial form is covered by the form tests.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "cpu/levels.h"
#include "cpu/primitive.h"
#include "cpu/scan.h"

namespace hila::cpu {
namespace {

using Rng = std::mt19937_64;

Mat<double> rand_mat(Rng& rng, int64_t r, int64_t c) {
  std::normal_distribution<double> n(0.0, 1.0);
  Mat<double> m(r, c);
  for (auto& x : m.a) x = n(rng);
  return m;
}

double max_rel(const Mat<double>& a, const Mat<double>& b) {
  double num = 0, den = 1e-300;
  EXPECT_EQ(a.r, b.r);
  EXPECT_EQ(a.c, b.c);
  for (size_t i = 0; i < a.a.size(); ++i) {
    if (!std::isfinite(a.a[i]) || !std::isfinite(b.a[i])) return INFINITY;
    num = std::max(num, std::abs(a.a[i] - b.a[i]));
    den = std::max(den, std::abs(b.a[i]));
  }
  return num / den;
}

double canon_rel(const Canon<double>& a, const Canon<double>& b, int64_t r, int64_t c) {
  double e = 0;
  const size_t n = std::max(a.slot.size(), b.slot.size());
  for (size_t l = 0; l < n; ++l) {
    const Mat<double> z(r, c);
    const Mat<double>* x = a.get(static_cast<int>(l));
    const Mat<double>* y = b.get(static_cast<int>(l));
    e = std::max(e, max_rel(x ? *x : z, y ? *y : z));
  }
  return e;
}

// ---- HLA summaries ------------------------------------------------------------------------

constexpr int64_t kD = 5, kDv = 4;

HlaSummary<double> rand_hla(Rng& rng, const OpPlan& p) {
  std::uniform_real_distribution<double> u(-0.7, 0.0);
  HlaSummary<double> s;
  s.identity = false;
  s.lS = p.has_S ? u(rng) : 0;
  s.lP = p.has_P ? u(rng) : 0;
  s.lO = u(rng);
  if (p.has_S) s.S = rand_mat(rng, kD, kD);
  if (p.has_P) s.P = rand_mat(rng, kD, kDv);
  s.Y = rand_mat(rng, kD, kDv);
  switch (p.op) {
    case Op::hla2: s.X1 = rand_mat(rng, kD, kDv); break;
    case Op::ahla: s.X1 = rand_mat(rng, kD, kD); break;
    default:
      s.X1 = rand_mat(rng, kD, kDv);
      s.X2 = rand_mat(rng, kD, kD);
      s.X3 = rand_mat(rng, kD, kD);
  }
  return s;
}

double hla_rel(const OpPlan& p, const HlaSummary<double>& a, const HlaSummary<double>& b) {
  double e = std::abs(a.lS - b.lS) + std::abs(a.lP - b.lP) + std::abs(a.lO - b.lO);
  auto m = [&](const Mat<double>& x, const Mat<double>& y) {
    if (x.empty() && y.empty()) return;
    e = std::max(e, max_rel(x, y));
  };
  m(a.S, b.S), m(a.P, b.P), m(a.Y, b.Y), m(a.X1, b.X1), m(a.X2, b.X2), m(a.X3, b.X3);
  return e;
}

OpState<double> rand_state(Rng& rng, const OpPlan& p) {
  OpState<double> st;
  if (p.has_S) st.S.slot.push_back(rand_mat(rng, kD, kD));
  if (p.has_P) st.P.slot.push_back(rand_mat(rng, kD, kDv));
  st.H.slot.push_back(rand_mat(rng, kD, kDv));
  return st;
}

class HlaSummaryTest : public ::testing::TestWithParam<Op> {};

TEST_P(HlaSummaryTest, AssociativeWithIdentityAndActs) {
  OpConfig cfg;
  cfg.op = GetParam();
  const OpPlan p = OpPlan::make(cfg);
  Rng rng(1234 + static_cast<int>(cfg.op));
  for (int trial = 0; trial < 5; ++trial) {
    const auto A = rand_hla(rng, p), B = rand_hla(rng, p), C = rand_hla(rng, p);
    const auto left = hla_compose(p, hla_compose(p, A, B), C);
    const auto right = hla_compose(p, A, hla_compose(p, B, C));
    EXPECT_LE(hla_rel(p, left, right), 1e-12) << "associativity, trial " << trial;
    const HlaSummary<double> I;
    EXPECT_LE(hla_rel(p, hla_compose(p, I, A), A), 0.0);
    EXPECT_LE(hla_rel(p, hla_compose(p, A, I), A), 0.0);
    // action: F_{A.B} = F_B o F_A
    const OpState<double> st = rand_state(rng, p);
    const auto x = hla_apply(p, hla_compose(p, A, B), st, kD, kDv);
    const auto y = hla_apply(p, B, hla_apply(p, A, st, kD, kDv), kD, kDv);
    EXPECT_LE(canon_rel(x.H, y.H, kD, kDv), 1e-12) << "action on the outer state";
    if (p.has_S) EXPECT_LE(canon_rel(x.S, y.S, kD, kD), 1e-12);
    if (p.has_P) EXPECT_LE(canon_rel(x.P, y.P, kD, kDv), 1e-12);
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, HlaSummaryTest, ::testing::Values(Op::hla2, Op::ahla, Op::hla3),
                         [](const auto& info) { return std::string(op_name(info.param)); });

// ---- primitive summaries (log-linear re-keying, GDN transitions) ----------------------------

struct PrimCase {
  bool fenwick, delta;
};

PrimSummary<double> rand_prim(Rng& rng, const PrimCase& pc, int64_t a, int64_t b) {
  std::uniform_real_distribution<double> u(-0.7, 0.0);
  const Levels lv{pc.fenwick};
  PrimSummary<double> s;
  s.identity = false;
  s.a = a;
  s.b = b;
  if (pc.delta) s.M = rand_mat(rng, kD, kD);
  else s.logm = u(rng);
  s.P.resize(lv.slots(b));
  for (int l = 0; l < static_cast<int>(lv.slots(b)); ++l)
    if (lv.live(b, l)) s.P.slot[l] = rand_mat(rng, kD, kDv);
  return s;
}

double prim_rel(const PrimSummary<double>& x, const PrimSummary<double>& y) {
  double e = std::abs(x.logm - y.logm) + (x.a != y.a) + (x.b != y.b);
  if (!x.M.empty()) e = std::max(e, max_rel(x.M, y.M));
  return std::max(e, canon_rel(x.P, y.P, kD, kDv));
}

class PrimSummaryTest : public ::testing::TestWithParam<PrimCase> {};

TEST_P(PrimSummaryTest, AssociativeWithIdentityAndActs) {
  const PrimCase pc = GetParam();
  const Levels lv{pc.fenwick};
  Rng rng(99 + 2 * pc.fenwick + pc.delta);
  // segment boundaries around powers of two, like context-parallel ranks
  const int64_t cuts[][4] = {{0, 37, 130, 200}, {5, 64, 128, 261}, {0, 1, 2, 255}, {63, 64, 65, 1024}};
  for (const auto& c : cuts) {
    const auto A = rand_prim(rng, pc, c[0], c[1]);
    const auto B = rand_prim(rng, pc, c[1], c[2]);
    const auto C = rand_prim(rng, pc, c[2], c[3]);
    auto comb = [&](const PrimSummary<double>& x, const PrimSummary<double>& y) {
      return prim_compose(x, y, lv, pc.delta, kD, kDv);
    };
    EXPECT_LE(prim_rel(comb(comb(A, B), C), comb(A, comb(B, C))), 1e-12) << "cuts " << c[1];
    const PrimSummary<double> I;
    EXPECT_LE(prim_rel(comb(I, A), A), 0.0);
    EXPECT_LE(prim_rel(comb(A, I), A), 0.0);
    // action on a random canonical state at c[0]
    Canon<double> H;
    H.resize(lv.slots(c[0]));
    for (int l = 0; l < static_cast<int>(lv.slots(c[0])); ++l)
      if (lv.live(c[0], l)) H.slot[l] = rand_mat(rng, kD, kDv);
    const auto x = prim_apply(comb(A, B), H, lv, pc.delta, kD, kDv);
    const auto y = prim_apply(B, prim_apply(A, H, lv, pc.delta, kD, kDv), lv, pc.delta, kD, kDv);
    EXPECT_LE(canon_rel(x, y, kD, kDv), 1e-12);
    // the composed state stays canonical: only live slots of its end position are non-zero
    for (int l = 0; l < static_cast<int>(x.slot.size()); ++l)
      if (x.get(l)) {
        bool zero = true;
        for (double v : x.slot[l].a) zero = zero && v == 0;
        EXPECT_TRUE(lv.live(c[2], l) || zero) << "slot " << l << " at " << c[2];
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, PrimSummaryTest,
                         ::testing::Values(PrimCase{false, false}, PrimCase{true, false},
                                           PrimCase{false, true}, PrimCase{true, true}),
                         [](const auto& info) {
                           return std::string(info.param.fenwick ? "loglinear_" : "flat_") +
                                  (info.param.delta ? "delta" : "mamba");
                         });

// Blelloch over many random segmentations equals a left fold.
TEST(Blelloch, MatchesLeftFold) {
  OpConfig cfg;
  cfg.op = Op::hla3;
  const OpPlan p = OpPlan::make(cfg);
  Rng rng(7);
  for (int n : {1, 2, 3, 5, 8, 13}) {
    std::vector<HlaSummary<double>> xs;
    for (int i = 0; i < n; ++i) xs.push_back(rand_hla(rng, p));
    auto comb = [&](const HlaSummary<double>& A, const HlaSummary<double>& B) {
      return hla_compose(p, A, B);
    };
    HlaSummary<double> total;
    const auto pre = blelloch_exclusive(xs, HlaSummary<double>{}, comb, &total);
    HlaSummary<double> fold;
    for (int i = 0; i < n; ++i) {
      EXPECT_LE(hla_rel(p, pre[i], fold), 1e-11) << "prefix " << i << " of " << n;
      fold = comb(fold, xs[i]);
    }
    EXPECT_LE(hla_rel(p, total, fold), 1e-11);
  }
}

}  // namespace
}  // namespace hila::cpu
