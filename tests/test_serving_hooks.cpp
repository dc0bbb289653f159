// SPDX-License-Identifier: Apache-2.0
// The serving and host-path parameters on the CPU backend, for every operator:
//  - StepParams::state_indices: a step on rows of a state pool equals unpooled steps of those rows
//    bit for bit; padding rows (-1) give o = 0 and touch nothing; bad indices are errors;
//  - ForwardParams::state_indices: a forward from pool rows, final states written back to them (in
//    place, or into another pool), equals the unpooled forward bit for bit;
//  - StepParams::max_position: the same step; positions, Fenwick slots and λ levels checked
//    against the bound;
//  - ForwardParams::cu_seqlens_host / init_pos_host: the same call; with value checks the host
//    copies are compared with the tensors, without them they are what the call plans from.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "support_hila.h"

namespace hila_test {
namespace {

// [N, 1, ...] -> [N, ...]: a problem's single token as decode-step inputs
Buffer step_input(const Buffer& b) { return gather_tokens(b, std::vector<int64_t>(b.empty() ? 0 : size_t(b.shape[0]), 0)); }

template <class F>
void expect_error(const std::string& ctx, F&& f, const std::string& arg, const std::string& needle = "") {
  try {
    f();
    ADD_FAILURE() << ctx << ": expected hila::Error('" << arg << "'), got no error";
  } catch (const hila::Error& e) {
    EXPECT_EQ(e.argument(), arg) << ctx << ": " << e.what();
    if (!needle.empty()) EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << ctx << ": " << e.what();
  }
}

// A pool of P rows at the given positions (random canonical states with room for `max_pos` + 1),
// and N single-token inputs with λ levels for max_pos.
struct StepPool {
  Problem rows;    // B = P, its init is the pool
  Problem tokens;  // B = N, T = 1
  StepPool(Op op, const std::vector<int64_t>& pos, int64_t N, int64_t max_pos, uint64_t seed) {
    ProblemSpec s = spec_for(op, 1, seed);
    s.B = int64_t(pos.size()), s.H = 2, s.dk = 8, s.dv = 4;
    s.init_state = true;
    s.init_pos = pos;
    s.init_extra_slots = 2;
    s.cfg.qk_l2norm = traits(op).delta;
    rows = make_problem(s);
    ProblemSpec t = s;
    t.B = N, t.init_state = false, t.init_pos = {}, t.seed = seed + 1;
    t.extra_levels = traits(op).loglinear ? int64_t(std::bit_width(uint64_t(max_pos))) + 1 : 0;
    tokens = make_problem(t);
  }
};

struct StepInputs {
  Buffer q, k, v, g, lam, beta;
  explicit StepInputs(const Problem& p)
      : q(step_input(p.q)), k(step_input(p.k)), v(step_input(p.v)), g(step_input(p.g)), lam(step_input(p.lam)),
        beta(step_input(p.beta)) {}
  StepInputs row(int64_t i) const {
    StepInputs r = *this;
    for (Buffer* b : {&r.q, &r.k, &r.v, &r.g, &r.lam, &r.beta}) *b = slice_rows(*b, i, 1);
    return r;
  }
  hila::StepParams params(const OpConfig& cfg, Buffer& o) const {
    o = Buffer(v.dtype, v.shape);
    o.poison();
    return step_params(cfg, q, k, v, g, lam, beta, o);
  }
};

class ServingHooks : public ::testing::TestWithParam<Op> {};

TEST_P(ServingHooks, PooledStepEqualsStepsOfTheRows) {
  const Op op = GetParam();
  const std::vector<int64_t> pos = {0, 5, 64, 3, 127, 9};  // pool rows at these positions
  const int64_t max_pos = 127;
  const std::vector<int32_t> idx = {3, -1, 0, 5, 4};       // sequence -> row (row 1, 2 untouched)
  const StepPool sp(op, pos, int64_t(idx.size()), max_pos, seed_of(op_tag(op) + "pool_step"));
  const StepInputs in(sp.tokens);
  const OpConfig cfg = sp.rows.spec.cfg;
  for (const int64_t bound : {int64_t(-1), max_pos}) {
    const std::string ctx = op_tag(op) + (bound < 0 ? "" : " max_position");
    StateBuffers pool = copy_state(sp.rows.init.view());
    Buffer ibuf(DType::i32, {int64_t(idx.size())});
    for (size_t i = 0; i < idx.size(); ++i) ibuf.set(int64_t(i), idx[i]);
    Buffer o;
    hila::StepParams p = in.params(cfg, o);
    p.state_indices = ibuf.view();
    p.max_position = bound;
    hila::step(p, pool.view());
    for (size_t i = 0; i < idx.size(); ++i) {
      const Buffer oi = slice_rows(o, int64_t(i), 1);
      if (idx[i] < 0) {
        for (int64_t e = 0; e < oi.numel(); ++e) ASSERT_EQ(oi.get(e), 0.0) << ctx << ": padding row " << i;
        continue;
      }
      StateBuffers one = state_row(sp.rows.init, idx[i]);
      Buffer o1;
      const StepInputs row = in.row(int64_t(i));
      hila::StepParams p1 = row.params(cfg, o1);
      hila::step(p1, one.view());
      EXPECT_TRUE(same_bytes(oi, o1)) << ctx << ": o of sequence " << i;
      EXPECT_TRUE(same_state(state_row(pool, idx[i]), one)) << ctx << ": pool row " << idx[i];
    }
    for (int64_t r : {1, 2})
      EXPECT_TRUE(same_state(state_row(pool, r), state_row(sp.rows.init, r))) << ctx << ": untouched row " << r;
  }
}

TEST_P(ServingHooks, PooledForwardEqualsTheUnpooledCall) {
  const Op op = GetParam();
  const std::vector<int64_t> lens = {5, 0, 7, 3};
  const std::vector<int32_t> idx = {4, 1, -1, 0};  // sequence 2 is padding; pool rows 2, 3 untouched
  ProblemSpec s = spec_for(op, 0, seed_of(op_tag(op) + "pool_forward"));
  s.seqlens = lens;
  s.H = 2, s.dk = 8, s.dv = 4;
  s.init_state = true;
  s.init_pos = {3, 70, 0, 12};
  s.init_extra_slots = 2;
  s.cfg.qk_l2norm = traits(op).delta;
  const Problem f = make_problem(s);
  // the pool: random rows, with the sequences' initial states at their rows
  ProblemSpec ps = s;
  ps.seqlens = {1, 1, 1, 1, 1};
  ps.init_pos = {9, 2, 65, 1, 6};  // the same bit length as 70: the same Fenwick capacity
  ps.seed += 7;
  const Problem filler = make_problem(ps);
  StateBuffers pool0 = copy_state(filler.init.view());
  ASSERT_EQ(pool0.H.shape[2], f.init.H.shape[2]);
  for (size_t i = 0; i < idx.size(); ++i)
    if (idx[i] >= 0) put_row(pool0, idx[i], state_row(f.init, int64_t(i)));
  Buffer ibuf(DType::i32, {int64_t(idx.size())});
  for (size_t i = 0; i < idx.size(); ++i) ibuf.set(int64_t(i), idx[i]);
  // the reference: the same call from f.init, final states of N rows
  const Result ref = hila::tools::run_forward(f, Form::chunk, 16);
  for (const bool in_place : {true, false}) {
    const std::string ctx = op_tag(op) + (in_place ? " in place" : " into another pool");
    StateBuffers pool = pool0, out = pool0;
    Buffer o(f.v.dtype, f.v.shape);
    o.poison();
    hila::ForwardParams p = f.forward_params(Form::chunk, 16);
    p.init = pool.view();
    p.final_state = in_place ? pool.view() : out.view();
    p.state_indices = ibuf.view();
    p.o = o.view();
    hila::forward(p);
    const StateBuffers& fin = in_place ? pool : out;
    int64_t row0 = 0;
    for (size_t i = 0; i < idx.size(); ++i) {
      const int64_t n = lens[i];
      const Buffer got = hila::tools::slice_time(o, row0, n), want_o = hila::tools::slice_time(ref.o, row0, n);
      row0 += n;
      if (idx[i] < 0) {
        for (int64_t e = 0; e < got.numel(); ++e) ASSERT_EQ(got.get(e), 0.0) << ctx << ": padding sequence " << i;
        continue;
      }
      EXPECT_TRUE(same_bytes(got, want_o)) << ctx << ": o of sequence " << i;
      const StateBuffers want = traits(op).loglinear ? with_slots(state_row(ref.final_state, int64_t(i)), pool0.H.shape[2])
                                                     : state_row(ref.final_state, int64_t(i));
      EXPECT_TRUE(same_state(state_row(fin, idx[i]), want)) << ctx << ": final state at pool row " << idx[i];
    }
    for (int64_t r : {2, 3})
      EXPECT_TRUE(same_state(state_row(fin, r), state_row(pool0, r))) << ctx << ": untouched row " << r;
  }
}

std::string op_name_of(const ::testing::TestParamInfo<Op>& i) { return op_tag(i.param); }
INSTANTIATE_TEST_SUITE_P(AllOps, ServingHooks, ::testing::ValuesIn(hila::all_ops()), op_name_of);

TEST(ServingHookErrors, StateIndices) {
  const StepPool sp(Op::loglinear, {0, 5, 9}, 2, 15, 11);
  const StepInputs in(sp.tokens);
  const OpConfig cfg = sp.rows.spec.cfg;
  StateBuffers pool = copy_state(sp.rows.init.view());
  const StateBuffers before = pool;
  auto run = [&](std::vector<int64_t> idx, DType dt) {
    Buffer ibuf(dt, {int64_t(idx.size())});
    for (size_t i = 0; i < idx.size(); ++i) ibuf.set(int64_t(i), double(idx[i]));
    Buffer o;
    hila::StepParams p = in.params(cfg, o);
    p.state_indices = ibuf.view();
    hila::step(p, pool.view());
  };
  expect_error("row past the pool", [&] { run({0, 3}, DType::i32); }, "state_indices", "[0, 3)");
  expect_error("below -1", [&] { run({-2, 0}, DType::i32); }, "state_indices", "-2");
  expect_error("duplicate", [&] { run({1, 1}, DType::i32); }, "state_indices", "distinct");
  expect_error("int64", [&] { run({0, 1}, DType::i64); }, "state_indices", "int32");
  expect_error("one per sequence", [&] { run({0, 1, 2}, DType::i32); }, "state_indices", "[2]");
  EXPECT_TRUE(same_state(pool, before)) << "a rejected step must not touch the pool";
  {  // a DecodeState steps its own sequences
    hila::DecodeState ds(cfg, 2, 2, 8, 4, DType::f64);
    Buffer ibuf(DType::i32, {2}), o;
    hila::StepParams p = in.params(cfg, o);
    p.state_indices = ibuf.view();
    expect_error("DecodeState", [&] { hila::step(p, ds); }, "state_indices");
  }
  {  // forward: a pool needs an initial state, and backward takes none
    ProblemSpec s = spec_for(Op::gla, 4, 3);
    s.B = 2;
    const Problem f = make_problem(s);
    Buffer ibuf(DType::i32, {2}), o(f.v.dtype, f.v.shape);
    hila::ForwardParams p = f.forward_params(Form::chunk, 64);
    p.state_indices = ibuf.view();
    p.o = o.view();
    expect_error("forward without init", [&] { hila::forward(p); }, "state_indices", "initial state");
    hila::BackwardParams b;
    static_cast<hila::ForwardParams&>(b) = p;
    b.d_o = f.d_o.view();
    expect_error("backward", [&] { hila::backward(b); }, "state_indices", "backward");
  }
}

TEST(ServingHookErrors, MaxPosition) {
  const StepPool sp(Op::loglinear_hla2, {7, 20}, 2, 20, 5);
  const StepInputs in(sp.tokens);
  const OpConfig cfg = sp.rows.spec.cfg;
  auto run = [&](const StateBuffers& st, int64_t bound, const StepInputs& x) {
    StateBuffers s = st;
    Buffer o;
    hila::StepParams p = x.params(cfg, o);
    p.max_position = bound;
    hila::step(p, s.view());
  };
  const StateBuffers st = copy_state(sp.rows.init.view());
  EXPECT_NO_THROW(run(st, 20, in));
  expect_error("a position past the bound", [&] { run(st, 19, in); }, "state.pos", "max_position = 19");
  expect_error("below -1", [&] { run(st, -2, in); }, "max_position");
  expect_error("2^62", [&] { run(st, int64_t(1) << 62, in); }, "max_position", "2^62");
  // the bound needs bitlen(max_position + 1) + 1 slots and bitlen(max_position) + 1 levels
  const int64_t big = (int64_t(1) << 10) - 1;
  expect_error("slots for the bound", [&] { run(st, big, in); }, "state.H", "max_position");
  StateBuffers wide = st;
  wide.H = resize_slots(st.H, hila::state_slots(big + 1));
  expect_error("levels for the bound", [&] { run(wide, big, in); }, "lam", "max_position");
  {  // a DecodeState checks its host positions against the bound
    hila::DecodeState ds(cfg, 2, 2, 8, 4, DType::f64);
    ds.reserve(40);
    Buffer o;
    hila::StepParams p = in.params(cfg, o);
    p.max_position = 0;
    EXPECT_NO_THROW(hila::step(p, ds));
    expect_error("DecodeState past the bound", [&] { hila::step(p, ds); }, "state.pos", "max_position = 0");
  }
}

// cu_seqlens_host and init_pos_host: the same results; compared with the tensors when values are
// checked; trusted (the plan follows them) when not.
TEST(HostCopies, SameCallAndChecks) {
  for (const Op op : {Op::gla, Op::loglinear, Op::gdn}) {
    ProblemSpec s = spec_for(op, 0, seed_of(op_tag(op) + "host_copies"));
    s.seqlens = {3, 0, 6};
    s.H = 2;
    s.init_state = true;
    s.init_pos = {4, 1, 9};
    s.cfg.qk_l2norm = traits(op).delta;
    const Problem f = make_problem(s);
    const std::string ctx = op_tag(op);
    const Result ref = hila::tools::run_backward(f, Form::chunk, 64);
    Buffer cu_host = f.cu_seqlens, pos_host = f.init.pos;
    auto run = [&](bool check, const Buffer& cu_h, const Buffer& pos_h) {
      Problem g = f;
      g.spec.cfg.check_values = check;
      Result r;
      r.o = Buffer(f.v.dtype, f.v.shape);
      r.final_state = hila::tools::make_state(g.spec.cfg, 3, 2, f.spec.dk, f.spec.dv, g.max_final_pos() + 8,
                                              f.state_dtype());
      hila::BackwardParams p;
      static_cast<hila::ForwardParams&>(p) = g.forward_params(Form::chunk, 64);
      p.cu_seqlens_host = cu_h.view();
      p.init_pos_host = pos_h.view();
      p.o = r.o.view();
      p.final_state = r.final_state.view();
      hila::forward(p);
      r.dq = Buffer(f.q.dtype, f.q.shape);
      p.o = {}, p.final_state = {};
      p.d_o = f.d_o.view(), p.dq = r.dq.view();
      hila::backward(p);
      return r;
    };
    for (const bool check : {true, false}) {
      const Result r = run(check, cu_host, pos_host);
      EXPECT_TRUE(same_bytes(r.o, ref.o)) << ctx << ": o";
      EXPECT_TRUE(same_bytes(r.dq, ref.dq)) << ctx << ": dq";
      EXPECT_TRUE(same_bytes(r.final_state.pos, ref.final_state.pos)) << ctx << ": final positions";
    }
    // host copies that differ from the tensors
    Buffer cu_bad = cu_host, pos_bad = pos_host;
    cu_bad.set(1, 4), cu_bad.set(2, 4);  // lengths 4, 0, 5
    pos_bad.set(1, 2);
    expect_error(ctx + " cu_seqlens_host checked", [&] { run(true, cu_bad, pos_host); }, "cu_seqlens_host",
                 "where cu_seqlens holds 3");
    expect_error(ctx + " init_pos_host checked", [&] { run(true, cu_host, pos_bad); }, "init_pos_host",
                 "where init.pos holds 1");
    {  // unchecked: the call plans from the host copies (final positions: init_pos_host + lengths)
      const Result r = run(false, cu_bad, pos_bad);
      EXPECT_EQ(r.final_state.pos.get(0), 4 + 4) << ctx;
      EXPECT_EQ(r.final_state.pos.get(1), 2 + 0) << ctx;
      EXPECT_EQ(r.final_state.pos.get(2), 9 + 5) << ctx;
    }
    // not host copies of the right kind
    Buffer cu32 = cu_host.cast(DType::i32), short_cu = slice_rows(cu_host, 0, 3), pos32 = pos_host.cast(DType::i32);
    expect_error(ctx + " dtype", [&] { run(false, cu32, pos_host); }, "cu_seqlens_host", "int64");
    expect_error(ctx + " shape", [&] { run(false, short_cu, pos_host); }, "cu_seqlens_host", "[4]");
    expect_error(ctx + " pos dtype", [&] { run(false, cu_host, pos32); }, "init_pos_host", "int64");
    {
      hila::ForwardParams p = f.forward_params(Form::chunk, 64);
      Buffer o(f.v.dtype, f.v.shape);
      p.o = o.view();
      p.cu_seqlens_host = cu_host.view();
      p.cu_seqlens_host.device = hila::Device{hila::DeviceType::cuda, 0};
      expect_error(ctx + " a device tensor", [&] { hila::forward(p); }, "cu_seqlens_host", "CPU");
      p.cu_seqlens_host = {};
      p.init = {};
      p.init_pos_host = pos_host.view();
      expect_error(ctx + " without init", [&] { hila::forward(p); }, "init_pos_host", "no initial state");
    }
  }
}

}  // namespace
}  // namespace hila_test
