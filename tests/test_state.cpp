// SPDX-License-Identifier: Apache-2.0
// States and heads: GQA equals explicit repetition of q/k, initial/final state round trips
// (forward and backward), state shapes and level counts (docs/math/LOGLINEAR.md §2.3, §2.5, §8), positions
// beyond 2^17 for the log-linear operators, and decode-state sizes.
#include <string>
#include <vector>

#include "support_hila.h"

namespace hila_test {
namespace {

const double kTf = fwd_tol(DType::f64), kTb = bwd_tol(DType::f64);

// ---------------------------------------------------------------------------------------------
// GQA: head h reads group h / (H / G).

// [B, T, G, d] -> [B, T, H, d], head h = group h / (H / G).
Buffer expand_groups(const Buffer& b, int64_t H) {
  const int64_t B = b.shape[0], T = b.shape[1], G = b.shape[2], d = b.shape[3];
  Buffer out(b.dtype, {B, T, H, d});
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < d; ++i)
        out.set((bt * H + h) * d + i, b.get((bt * G + h / (H / G)) * d + i));
  return out;
}

// [B, T, H, d] -> [B, T, G, d], summing the heads of each group.
Buffer reduce_groups(const Buffer& b, int64_t G) {
  const int64_t B = b.shape[0], T = b.shape[1], H = b.shape[2], d = b.shape[3];
  Buffer out(b.dtype, {B, T, G, d});
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < d; ++i) {
        const int64_t o = (bt * G + h / (H / G)) * d + i;
        out.set(o, out.get(o) + b.get((bt * H + h) * d + i));
      }
  return out;
}

struct OpForm {
  Op op;
  Form form;
  int64_t chunk;
  bool bwd;
};

std::string of_name(const OpForm& c) {
  return op_tag(c.op) + "_" + form_tag(c.form, c.chunk) + (c.bwd ? "_bwd" : "_fwd");
}

std::vector<OpForm> op_forms() {
  std::vector<OpForm> out;
  const std::pair<Form, int64_t> forms[] = {
      {Form::naive, 64}, {Form::serial, 64}, {Form::chunk, 16}, {Form::scan, 16}};
  for (Op op : hila::all_ops())
    for (const auto& [form, chunk] : forms) {
      out.push_back({op, form, chunk, false});
      if (hila::supports(op, form, true)) out.push_back({op, form, chunk, true});
    }
  return out;
}

std::string of_param_name(const ::testing::TestParamInfo<OpForm>& i) { return of_name(i.param); }

void PrintTo(const OpForm& c, std::ostream* os) { *os << of_name(c); }

class Gqa : public ::testing::TestWithParam<OpForm> {};

TEST_P(Gqa, EqualsRepeatedHeads) {
  const OpForm& c = GetParam();
  ProblemSpec s = spec_for(c.op, 70, seed_of(of_name(c)));
  s.B = 2;
  s.G = 2;
  s.H = 6;
  s.dk = 5;
  s.dv = 3;
  s.init_state = true;
  s.init_pos = {11, 64};
  const Problem p = hila::tools::make_problem(s);
  Problem e = p;
  e.spec.G = s.H;
  e.q = expand_groups(p.q, s.H);
  e.k = expand_groups(p.k, s.H);
  const Result got = c.bwd ? hila::tools::run_backward(p, c.form, c.chunk)
                           : hila::tools::run_forward(p, c.form, c.chunk);
  Result want = c.bwd ? hila::tools::run_backward(e, c.form, c.chunk)
                      : hila::tools::run_forward(e, c.form, c.chunk);
  if (c.bwd) {
    want.dq = reduce_groups(want.dq, s.G);
    want.dk = reduce_groups(want.dk, s.G);
  }
  expect_results_close(got, want, kTf, kTb, of_name(c) + " G=2,H=6 vs G=H=6");
}

INSTANTIATE_TEST_SUITE_P(AllOps, Gqa, ::testing::ValuesIn(op_forms()), of_param_name);

// ---------------------------------------------------------------------------------------------
// Round trips: T1 tokens, then T2 tokens from the first call's final state == one call of T1 + T2.

struct Split {
  int64_t n0;  // -1: no initial state
  int64_t T1, T2;
};

// Second part of a problem: tokens [T1, T), initial state `init` (a final state of part one).
Problem suffix(const Problem& p, int64_t T1, const StateBuffers& init) {
  Problem s = p;
  const int64_t T2 = p.spec.T - T1;
  s.spec.T = T2;
  s.spec.init_state = true;
  s.spec.init_pos = {int64_t(init.pos.get(0))};
  for (Buffer Problem::*m : {&Problem::q, &Problem::k, &Problem::v, &Problem::g, &Problem::lam,
                             &Problem::beta, &Problem::d_o})
    s.*m = hila::tools::slice_time(p.*m, T1, T2);
  s.init = init;
  return s;
}

Buffer cat(const Buffer& a, const Buffer& b) {
  if (a.empty()) return Buffer{};
  return concat_time({a, b});
}

class RoundTrip : public ::testing::TestWithParam<OpForm> {};

TEST_P(RoundTrip, TwoCallsEqualOne) {
  const OpForm& c = GetParam();
  const Split splits[] = {{-1, 37, 50}, {-1, 64, 65}, {-1, 1, 129}, {-1, 0, 20}, {-1, 20, 0},
                          {13, 51, 64}, {100, 28, 31}};
  for (const Split& sp : splits) {
    const std::string ctx = of_name(c) + " n0=" + std::to_string(sp.n0) + " T1=" +
                            std::to_string(sp.T1) + " T2=" + std::to_string(sp.T2);
    ProblemSpec s = spec_for(c.op, sp.T1 + sp.T2, seed_of(ctx));
    s.H = 2;
    s.dk = 4;
    s.dv = 3;
    if (sp.n0 >= 0) {
      s.init_state = true;
      s.init_pos = {sp.n0};
    }
    const Problem full = hila::tools::make_problem(s);
    // Mixed chunk sizes: the second call uses another C.
    const int64_t c2 = c.chunk == 16 ? 64 : c.chunk;
    const Result one = c.bwd ? hila::tools::run_backward(full, c.form, c.chunk)
                             : hila::tools::run_forward(full, c.form, c.chunk);

    Problem a = hila::tools::prefix(full, sp.T1);
    Result ra = hila::tools::run_forward(a, c.form, c.chunk);
    const Problem b = suffix(full, sp.T1, ra.final_state);
    const Result rb = c.bwd ? hila::tools::run_backward(b, c.form, c2)
                            : hila::tools::run_forward(b, c.form, c2);
    if (c.bwd) {
      a.d_final = rb.d_init;  // chain the state cotangent into the first call
      ra = hila::tools::run_backward(a, c.form, c.chunk);
    }
    expect_buffer_close(cat(ra.o, rb.o), one.o, kTf, ctx + " o");
    EXPECT_LE(state_err(rb.final_state, one.final_state), kTf) << ctx << " final state";
    if (c.bwd) {
      expect_buffer_close(cat(ra.dq, rb.dq), one.dq, kTb, ctx + " dq");
      expect_buffer_close(cat(ra.dk, rb.dk), one.dk, kTb, ctx + " dk");
      expect_buffer_close(cat(ra.dv, rb.dv), one.dv, kTb, ctx + " dv");
      expect_buffer_close(cat(ra.dg, rb.dg), one.dg, kTb, ctx + " dg");
      expect_buffer_close(cat(ra.dlam, rb.dlam), one.dlam, kTb, ctx + " dlam");
      expect_buffer_close(cat(ra.dbeta, rb.dbeta), one.dbeta, kTb, ctx + " dbeta");
      if (sp.n0 >= 0) {
        EXPECT_LE(state_err(ra.d_init, one.d_init), kTb) << ctx << " d_init";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllOps, RoundTrip, ::testing::ValuesIn(op_forms()), of_param_name);

// ---------------------------------------------------------------------------------------------
// Shapes and level counts.

TEST(StateShape, LevelsNeeded) {
  EXPECT_EQ(hila::levels_needed(0, 0), 0);
  EXPECT_EQ(hila::levels_needed(0, 1), 1);
  EXPECT_EQ(hila::levels_needed(0, 2), 2);
  EXPECT_EQ(hila::levels_needed(0, 3), 3);
  EXPECT_EQ(hila::levels_needed(0, 4), 3);
  EXPECT_EQ(hila::levels_needed(0, 5), 4);
  EXPECT_EQ(hila::levels_needed(0, 16384), 15);
  EXPECT_EQ(hila::levels_needed(0, 16385), 16);
  // Offset form: bitlen(n0 + T - 1) + 1.
  EXPECT_EQ(hila::levels_needed(5, 9), 5);        // positions 5..13
  EXPECT_EQ(hila::levels_needed(16383, 1), 15);   // position 16383
  EXPECT_EQ(hila::levels_needed(16383, 2), 16);   // positions 16383..16384
  EXPECT_EQ(hila::levels_needed((1 << 17) - 3, 10), 19);
  // Integer arithmetic where float log2 goes wrong (docs/math/LOGLINEAR.md §2.3).
  EXPECT_EQ(hila::levels_needed(0, (int64_t(1) << 29) + 1), 31);
  EXPECT_EQ(hila::levels_needed(0, (int64_t(1) << 49) + 2), 51);
  EXPECT_EQ(hila::levels_needed(int64_t(1) << 62, 1), 64);
}

TEST(StateShape, StateSlots) {
  EXPECT_EQ(hila::state_slots(0), 1);
  EXPECT_EQ(hila::state_slots(1), 2);
  EXPECT_EQ(hila::state_slots(2), 3);
  EXPECT_EQ(hila::state_slots(3), 3);
  EXPECT_EQ(hila::state_slots(4), 4);
  EXPECT_EQ(hila::state_slots(64), 8);
  EXPECT_EQ(hila::state_slots(16384), 16);
  EXPECT_EQ(hila::state_slots(int64_t(1) << 40), 42);
}

TEST(StateShape, PartsPerOperator) {
  const int64_t N = 3, H = 2, dk = 4, dv = 5;
  for (Op op : hila::all_ops())
    for (bool norm : {false, true}) {
      const hila::OpTraits t = traits(op);
      if (norm && !t.hla_family) continue;
      OpConfig cfg;
      cfg.op = op;
      cfg.normalize = norm;
      const int64_t dvp = dv + norm;
      const std::string ctx = op_tag(op) + (norm ? " normalize" : "");
      for (int64_t max_pos : {0, 1, 37, 64, 1000}) {
        const hila::StateShape sh = hila::state_shape(cfg, N, H, dk, dv, max_pos);
        EXPECT_EQ(sh.S, t.has_S) << ctx;
        EXPECT_EQ(sh.P, t.has_P) << ctx;
        EXPECT_TRUE(sh.H) << ctx;
        EXPECT_EQ(sh.levels, t.loglinear) << ctx;
        if (t.has_S) {
          EXPECT_EQ(sh.S_shape, (std::vector<int64_t>{N, H, dk * (dk + 1) / 2})) << ctx;
        }
        if (t.has_P) {
          EXPECT_EQ(sh.P_shape, (std::vector<int64_t>{N, H, dk, dvp})) << ctx;
        }
        const std::vector<int64_t> h_shape =
            t.loglinear ? std::vector<int64_t>{N, H, hila::state_slots(max_pos), dk, dvp}
                        : std::vector<int64_t>{N, H, dk, dvp};
        EXPECT_EQ(sh.H_shape, h_shape) << ctx << " max_pos " << max_pos;
      }
    }
  // Which operator has which inner state (docs/math/HLA.md §3.2, §5.2, §6.2).
  EXPECT_TRUE(traits(Op::hla2).has_S && !traits(Op::hla2).has_P);
  EXPECT_TRUE(!traits(Op::ahla).has_S && traits(Op::ahla).has_P);
  EXPECT_TRUE(traits(Op::hla3).has_S && traits(Op::hla3).has_P);
  EXPECT_TRUE(!traits(Op::gla).has_S && !traits(Op::gla).has_P);
  EXPECT_TRUE(traits(Op::loglinear_gdn).loglinear && traits(Op::loglinear_gdn).delta);
}

// A canonical final state is non-zero exactly at the live levels of its position (§2.5, §8).
TEST(StateShape, FinalStateIsCanonical) {
  for (Op op : {Op::loglinear, Op::loglinear_hla2, Op::loglinear_ahla, Op::loglinear_hla3,
                Op::loglinear_gdn})
    for (int64_t T : {1, 5, 64, 100}) {
      ProblemSpec s = spec_for(op, T, 5);
      s.dk = 3;
      s.dv = 2;
      const Problem p = hila::tools::make_problem(s);
      const Result r = hila::tools::run_forward(p, Form::chunk, 16);
      const Buffer& h = r.final_state.H;
      ASSERT_EQ(h.shape[2], hila::state_slots(T)) << op_tag(op) << " T=" << T;
      const int64_t mat = h.shape[3] * h.shape[4];
      for (int64_t l = 0; l < h.shape[2]; ++l) {
        const bool live = l >= 1 && ((T >> (l - 1)) & 1);
        double mx = 0;
        for (int64_t i = 0; i < mat; ++i) mx = std::max(mx, std::fabs(h.get(l * mat + i)));
        if (live) {
          EXPECT_GT(mx, 0) << op_tag(op) << " T=" << T << " live slot " << l;
        } else {
          EXPECT_EQ(mx, 0) << op_tag(op) << " T=" << T << " dead slot " << l;
        }
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Positions past 2^17 (and 2^40): chunk and decode across the power of two.

class FarPositions : public ::testing::TestWithParam<Op> {};

TEST_P(FarPositions, ChunkAndDecodeAcrossPowerOfTwo) {
  const Op op = GetParam();
  for (int64_t n0 : {(int64_t(1) << 17) - 3, (int64_t(1) << 40) - 5}) {
    const std::string ctx = op_tag(op) + " n0=" + std::to_string(n0);
    ProblemSpec s = spec_for(op, 20, seed_of(ctx));
    s.H = 2;
    s.dk = 4;
    s.dv = 3;
    s.init_state = true;
    s.init_pos = {n0};
    const Problem p = hila::tools::make_problem(s);
    ASSERT_EQ(p.lam.shape[3], hila::levels_needed(n0, 20)) << ctx;
    const Result want = hila::tools::run_forward(p, Form::naive);
    for (int64_t C : {4, 16, 64})
      expect_results_close(hila::tools::run_forward(p, Form::chunk, C), want, kTf, kTb,
                           ctx + " chunk" + std::to_string(C));
    expect_results_close(hila::tools::run_forward(p, Form::serial), want, kTf, kTb, ctx + " serial");
    expect_results_close(hila::tools::run_backward(p, Form::chunk, 16),
                         hila::tools::run_backward(p, Form::naive), kTf, kTb, ctx + " backward");

    hila::DecodeState ds(s.cfg, 1, s.H, s.dk, s.dv, DType::f64);
    ds.load(p.init.view());
    for (int64_t t = 0; t < 20; ++t) {
      Buffer q = gather_tokens(p.q, {t}), k = gather_tokens(p.k, {t}), v = gather_tokens(p.v, {t}),
             g = gather_tokens(p.g, {t}), lam = gather_tokens(p.lam, {t}),
             beta = gather_tokens(p.beta, {t});
      Buffer o(DType::f64, {1, s.H, s.dv});
      o.poison();
      hila::StepParams sp = step_params(s.cfg, q, k, v, g, lam, beta, o);
      hila::step(sp, ds);
      EXPECT_LE(hila::tools::rel_err(o, gather_tokens(want.o, {t})), kTf) << ctx << " decode " << t;
    }
    EXPECT_EQ(ds.position(0), n0 + 20) << ctx;
    EXPECT_GE(ds.slots(), hila::state_slots(n0 + 20)) << ctx;
    EXPECT_LE(state_err(copy_state(ds.view()), want.final_state), kTf) << ctx << " decode state";
  }
}

INSTANTIATE_TEST_SUITE_P(LogLinear, FarPositions,
                         ::testing::Values(Op::loglinear, Op::loglinear_hla2, Op::loglinear_ahla,
                                           Op::loglinear_hla3, Op::loglinear_gdn),
                         [](const ::testing::TestParamInfo<Op>& i) { return op_tag(i.param); });

// ---------------------------------------------------------------------------------------------
// Decode-state size: grows with log T for log-linear operators, constant otherwise.

TEST(DecodeStateSize, BytesPerSequence) {
  const int64_t N = 2, H = 3, dk = 4, dv = 5;
  for (Op op : hila::all_ops())
    for (DType dt : {DType::f32, DType::f64}) {
      const std::string ctx = op_tag(op) + " " + dtype_tag(dt);
      OpConfig cfg;
      cfg.op = op;
      const hila::OpTraits t = traits(op);
      hila::DecodeState ds(cfg, N, H, dk, dv, dt);
      EXPECT_EQ(ds.batch(), N);
      EXPECT_EQ(ds.heads(), H);
      EXPECT_EQ(ds.dk(), dk);
      EXPECT_EQ(ds.dv(), dv);
      EXPECT_EQ(ds.dtype(), dt);
      const int64_t es = hila::dtype_size(dt);
      // The float payload per sequence: S packed, P, and one H matrix per slot.
      const int64_t fixed = H * ((t.has_S ? dk * (dk + 1) / 2 : 0) + (t.has_P ? dk * dv : 0)) * es;
      const int64_t per_slot = H * dk * dv * es;
      std::vector<int64_t> bytes;
      for (int64_t max_pos : {int64_t(16), int64_t(1024), int64_t(2048), int64_t(1) << 20}) {
        ds.reserve(max_pos);
        const int64_t b = ds.bytes_per_sequence();
        bytes.push_back(b);
        if (t.loglinear) {
          EXPECT_GE(ds.slots(), hila::state_slots(max_pos)) << ctx;
          EXPECT_GE(b, fixed + ds.slots() * per_slot) << ctx << " max_pos " << max_pos;
        } else {
          EXPECT_EQ(ds.slots(), 1) << ctx;
          EXPECT_GE(b, fixed + per_slot) << ctx;
        }
      }
      if (t.loglinear) {
        EXPECT_LT(bytes[0], bytes[1]) << ctx;
        EXPECT_LT(bytes[1], bytes[2]) << ctx;
        EXPECT_LT(bytes[2], bytes[3]) << ctx;
        // Linear in log2(max_pos): 2^10 -> 2^11 adds one slot, 2^11 -> 2^20 adds nine.
        EXPECT_EQ(bytes[3] - bytes[2], 9 * (bytes[2] - bytes[1])) << ctx;
        EXPECT_EQ(bytes[2] - bytes[1], per_slot) << ctx << ": one Fenwick slot of all heads";
      } else {
        EXPECT_EQ(bytes[0], bytes[3]) << ctx << ": constant for non-log-linear operators";
      }
    }
}

}  // namespace
}  // namespace hila_test
