// SPDX-License-Identifier: Apache-2.0
// prim_backward given the segment states that prim_forward kept (seg_in) computes exactly what it
// computes when it re-forms them itself: every primitive kind (mamba / delta, flat / Fenwick), the
// chunk and naive forms, from position 0 and from a later position with an initial state, with a
// final-state cotangent. The forms themselves are checked against the float64 naive form by the
// form tests; this checks the road on which a composition hands its inner forward's states over.
// WorkSpaceReuse: the chunk form keeps its segment work space per thread across calls; a call's
// results must not depend on the calls of other shapes the thread made before it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "cpu/levels.h"
#include "cpu/primitive.h"

namespace hila::cpu {
namespace {

struct Case {
  bool delta, fenwick;
  PForm form;
  int64_t n, n0, chunk;
};

Mat<double> randn(std::mt19937_64& rng, int64_t r, int64_t c, double scale) {
  std::normal_distribution<double> d(0.0, scale);
  Mat<double> m(r, c);
  for (auto& x : m.a) x = d(rng);
  return m;
}

// Rows scaled to unit norm: keys of a contracting delta rule (with beta in [0, 1]).
void unit_rows(Mat<double>& k) {
  for (int64_t i = 0; i < k.r; ++i) {
    double s = 0;
    for (int64_t j = 0; j < k.c; ++j) s += k(i, j) * k(i, j);
    for (int64_t j = 0; j < k.c; ++j) k(i, j) /= std::sqrt(s);
  }
}

void expect_same(const Mat<double>& a, const Mat<double>& b, const char* what) {
  ASSERT_EQ(a.a.size(), b.a.size()) << what;
  for (size_t i = 0; i < a.a.size(); ++i) ASSERT_EQ(a.a[i], b.a[i]) << what << " at " << i;
}

class PrimSegStates : public ::testing::TestWithParam<Case> {};

TEST_P(PrimSegStates, KeptStatesGiveTheSameGradients) {
  const Case c = GetParam();
  const int64_t dk = 16, dv = 12, n = c.n;
  std::mt19937_64 rng(7 + n + c.n0);
  const Mat<double> q = randn(rng, n, dk, 0.25), k0 = randn(rng, n, dk, 0.25), v = randn(rng, n, dv, 1.0);
  Mat<double> k = k0;
  if (c.delta) unit_rows(k);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> g(n), beta(n);
  for (int64_t i = 0; i < n; ++i) g[i] = -0.05 * u(rng), beta[i] = u(rng);
  PrimArgs<double> a;
  a.q = {q.a.data(), n, dk, dk}, a.k = {k.a.data(), n, dk, dk}, a.v = {v.a.data(), n, dv, dv};
  a.g = g.data();
  a.n0 = c.n0;
  a.lv.fenwick = c.fenwick;
  a.delta = c.delta;
  Mat<double> lam;
  if (c.fenwick) {
    lam = randn(rng, n, 64, 0.3);
    for (auto& x : lam.a) x = 1.0 + x;
    a.lam = {lam.a.data(), n, 64, 64};
  }
  if (c.delta) a.beta = beta.data();
  Canon<double> init;
  if (c.n0 > 0) {
    init.resize(a.lv.slots(c.n0));
    for (int l = 0; l < int(init.slot.size()); ++l)
      if (a.lv.live(c.n0, l)) init.slot[l] = randn(rng, dk, dv, 0.5);
  }
  Mat<double> O(n, dv);
  std::vector<Canon<double>> seg;
  const Canon<double> fin = prim_forward(c.form, c.chunk, a, init, O.ref(), true, &seg);
  ASSERT_FALSE(seg.empty());
  const Mat<double> dO = randn(rng, n, dv, 1.0);
  Canon<double> dfin;
  dfin.resize(fin.slot.size());
  for (size_t l = 0; l < fin.slot.size(); ++l)
    if (!fin.slot[l].empty()) dfin.slot[l] = randn(rng, dk, dv, 1.0);
  const MRef<const double> dOr{dO.a.data(), n, dv, dv};
  const PrimGrads<double> own = prim_backward<double>(c.form, c.chunk, a, init, dOr, dfin, nullptr);
  const PrimGrads<double> kept = prim_backward(c.form, c.chunk, a, init, dOr, dfin, &seg);
  expect_same(own.dq, kept.dq, "dq");
  expect_same(own.dk, kept.dk, "dk");
  expect_same(own.dv, kept.dv, "dv");
  EXPECT_EQ(own.dg, kept.dg);
  EXPECT_EQ(own.dbeta, kept.dbeta);
  if (c.fenwick) expect_same(own.dlam, kept.dlam, "dlam");
  ASSERT_EQ(own.dinit.slot.size(), kept.dinit.slot.size());
  for (size_t l = 0; l < own.dinit.slot.size(); ++l) expect_same(own.dinit.slot[l], kept.dinit.slot[l], "dinit");
  for (double x : own.dq.a) ASSERT_TRUE(std::isfinite(x));
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (bool delta : {false, true})
    for (bool fenwick : {false, true})
      for (PForm form : {PForm::chunk, PForm::naive})
        for (auto [n, n0] : {std::pair<int64_t, int64_t>{1, 0}, {65, 0}, {130, 0}, {77, 40}})
          out.push_back({delta, fenwick, form, n, n0, 16});
  return out;
}

INSTANTIATE_TEST_SUITE_P(All, PrimSegStates, ::testing::ValuesIn(cases()), [](const auto& info) {
  const Case& c = info.param;
  return std::string(c.delta ? "delta" : "mamba") + (c.fenwick ? "_fenwick" : "_flat") +
         (c.form == PForm::chunk ? "_chunk" : "_naive") + "_n" + std::to_string(c.n) + "_at" +
         std::to_string(c.n0);
});

// One chunk-form forward + backward of a fixed problem (seeded by its shape), with a reset token.
struct Shape {
  int64_t dk, dv, n, n0, chunk;
};
struct Result {
  Mat<double> O;
  Canon<double> fin;
  PrimGrads<double> G;
};

Result run_shape(bool delta, bool fenwick, const Shape& sh) {
  const int64_t dk = sh.dk, dv = sh.dv, n = sh.n;
  std::mt19937_64 rng(11 + 3 * dk + 5 * dv + n);
  const Mat<double> q = randn(rng, n, dk, 0.25), v = randn(rng, n, dv, 1.0);
  Mat<double> k = randn(rng, n, dk, 0.25);
  unit_rows(k);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> g(n), beta(n);
  for (int64_t i = 0; i < n; ++i) g[i] = -0.05 * u(rng), beta[i] = u(rng);
  g[n / 2] = -std::numeric_limits<double>::infinity();  // a reset
  PrimArgs<double> a;
  a.q = {q.a.data(), n, dk, dk}, a.k = {k.a.data(), n, dk, dk}, a.v = {v.a.data(), n, dv, dv};
  a.g = g.data();
  a.n0 = sh.n0;
  a.lv.fenwick = fenwick;
  a.delta = delta;
  Mat<double> lam;
  if (fenwick) {
    lam = randn(rng, n, 64, 0.3);
    for (auto& x : lam.a) x = 1.0 + x;
    a.lam = {lam.a.data(), n, 64, 64};
  }
  if (delta) a.beta = beta.data();
  Canon<double> init;
  if (sh.n0 > 0) {
    init.resize(a.lv.slots(sh.n0));
    for (int l = 0; l < int(init.slot.size()); ++l)
      if (a.lv.live(sh.n0, l)) init.slot[l] = randn(rng, dk, dv, 0.5);
  }
  Result r;
  r.O = Mat<double>(n, dv);
  r.fin = prim_forward(PForm::chunk, sh.chunk, a, init, r.O.ref(), true);
  const Mat<double> dO = randn(rng, n, dv, 1.0);
  Canon<double> dfin;
  dfin.resize(r.fin.slot.size());
  for (size_t l = 0; l < r.fin.slot.size(); ++l)
    if (!r.fin.slot[l].empty()) dfin.slot[l] = randn(rng, dk, dv, 1.0);
  r.G = prim_backward<double>(PForm::chunk, sh.chunk, a, init, {dO.a.data(), n, dv, dv}, dfin, nullptr);
  return r;
}

void expect_same(const Result& x, const Result& y, bool fenwick) {
  expect_same(x.O, y.O, "O");
  ASSERT_EQ(x.fin.slot.size(), y.fin.slot.size());
  for (size_t l = 0; l < x.fin.slot.size(); ++l) expect_same(x.fin.slot[l], y.fin.slot[l], "state");
  expect_same(x.G.dq, y.G.dq, "dq");
  expect_same(x.G.dk, y.G.dk, "dk");
  expect_same(x.G.dv, y.G.dv, "dv");
  EXPECT_EQ(x.G.dg, y.G.dg);
  EXPECT_EQ(x.G.dbeta, y.G.dbeta);
  if (fenwick) expect_same(x.G.dlam, y.G.dlam, "dlam");
  ASSERT_EQ(x.G.dinit.slot.size(), y.G.dinit.slot.size());
  for (size_t l = 0; l < x.G.dinit.slot.size(); ++l)
    expect_same(x.G.dinit.slot[l], y.G.dinit.slot[l], "dinit");
  for (double v : x.G.dq.a) ASSERT_TRUE(std::isfinite(v));
}

TEST(PrimWorkSpace, ReuseAcrossShapesGivesTheSameResults) {
  // shapes that change every work-space dimension (segment rows, key and value widths, slots);
  // each cut into segments of one size, so a call after one of the same shape reuses every buffer
  // as the previous call left it
  // (long: more segments than a thread keeps after a call)
  const Shape big{20, 9, 96, 0, 32}, small{16, 12, 48, 16, 16}, lng{16, 12, 160, 0, 16};
  for (bool delta : {false, true})
    for (bool fenwick : {false, true}) {
      SCOPED_TRACE(std::string(delta ? "delta" : "mamba") + (fenwick ? "_fenwick" : "_flat"));
      // reference results, each from a fresh thread (a fresh work space)
      Result big0, small0, lng0;
      std::thread([&] { big0 = run_shape(delta, fenwick, big); }).join();
      std::thread([&] { small0 = run_shape(delta, fenwick, small); }).join();
      std::thread([&] { lng0 = run_shape(delta, fenwick, lng); }).join();
      // one thread: big, small, big, big, small, long, small, long (after a call of another shape
      // and of the same)
      Result big1, small1, big2, big3, small2, lng1, small3, lng2;
      std::thread([&] {
        big1 = run_shape(delta, fenwick, big);
        small1 = run_shape(delta, fenwick, small);
        big2 = run_shape(delta, fenwick, big);
        big3 = run_shape(delta, fenwick, big);
        small2 = run_shape(delta, fenwick, small);
        lng1 = run_shape(delta, fenwick, lng);
        small3 = run_shape(delta, fenwick, small);
        lng2 = run_shape(delta, fenwick, lng);
      }).join();
      expect_same(big0, big1, fenwick);
      expect_same(small0, small1, fenwick);
      expect_same(big0, big2, fenwick);
      expect_same(big0, big3, fenwick);
      expect_same(small0, small2, fenwick);
      expect_same(lng0, lng1, fenwick);
      expect_same(small0, small3, fenwick);
      expect_same(lng0, lng2, fenwick);
    }
}

}  // namespace
}  // namespace hila::cpu
