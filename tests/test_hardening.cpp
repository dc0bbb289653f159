// SPDX-License-Identifier: Apache-2.0
// Hostile and careless input: sizes that overflow or exceed memory fail up front naming the
// tensor, decode states are safe to share between threads and their views outlive growth,
// positions keep the bound of forward, non-finite outputs from finite inputs are errors naming the
// likely cause, and outputs may not alias inputs.
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support_hila.h"

namespace hila_test {
namespace {

using hila::TensorView;

// Runs f; expects hila::Error naming `arg` with every needle in its message.
template <class F>
void expect_error(const std::string& ctx, F&& f, const std::string& arg, const std::vector<std::string>& needles = {}) {
  try {
    f();
    ADD_FAILURE() << ctx << ": expected hila::Error('" << arg << "'), got no error";
  } catch (const hila::Error& e) {
    EXPECT_EQ(e.argument(), arg) << ctx << ": " << e.what();
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << ctx << ": '" << n << "' not in: " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << ctx << ": expected hila::Error, got " << e.what();
  }
}

// Restores the default memory limit when a test ends.
struct MemoryLimit {
  explicit MemoryLimit(int64_t bytes) { hila::set_memory_limit(bytes); }
  ~MemoryLimit() { hila::set_memory_limit(0); }
};

// A zero-size tensor view: a dummy pointer, any strides.
TensorView empty_view(DType dt, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  static double dummy[8];
  TensorView t = TensorView::contiguous_view(dummy, dt, shape.data(), int(shape.size()));
  for (size_t i = 0; i < strides.size(); ++i) t.stride[i] = strides[i];
  return t;
}

// ---- sizes -----------------------------------------------------------------------------------

TEST(Sizes, StateShapeOverflowIsAnError) {
  OpConfig cfg;
  cfg.op = Op::gla;
  expect_error("gla dk 2^32 H 2^16", [&] { hila::state_shape(cfg, 1, 1 << 16, int64_t(1) << 32, 1 << 16, 0); },
               "state", {"int64"});
  cfg.op = Op::hla2;
  expect_error("hla2 dk 2^32", [&] { hila::state_shape(cfg, 1, 1, int64_t(1) << 32, 4, 0); }, "state");
  EXPECT_EQ(TensorView::contiguous_view(nullptr, DType::f32, {int64_t(1) << 40, int64_t(1) << 40}).numel(),
            std::numeric_limits<int64_t>::max())
      << "numel saturates instead of wrapping";
}

// q [1, 0, 1, 2^32], v [1, 0, 2^16, 2^16]: the final state would need 2^64 elements; the packed S
// of hla2 overflows too. Validation names the argument before anything is allocated or written.
TEST(Sizes, HugeStateAtTZeroIsRejectedByName) {
  for (Op op : {Op::gla, Op::hla2, Op::loglinear}) {
    hila::ForwardParams p;
    p.cfg.op = op;
    p.q = p.k = empty_view(DType::f32, {1, 0, 1, int64_t(1) << 32}, {0, 0, 0, 0});
    p.v = p.o = empty_view(DType::f32, {1, 0, 1 << 16, 1 << 16}, {0, 0, 0, 0});
    if (hila::op_traits(op).loglinear) p.lam = empty_view(DType::f32, {1, 0, 1 << 16, 1}, {0, 0, 0, 0});
    double pos = 0;
    // a final state whose shape cannot even be stated: the packed S of hla2 or dk x dv x H
    p.final_state.pos = TensorView::contiguous_view(&pos, DType::i64, {1});
    p.final_state.H = empty_view(DType::f32, {1, 1 << 16, int64_t(1) << 32, 1 << 16}, {0, 0, 0, 0});
    try {
      hila::forward(p);
      ADD_FAILURE() << op_tag(op) << ": expected an error";
    } catch (const hila::Error& e) {
      SUCCEED() << e.what();
    }
  }
}

// Shapes whose non-zero sizes multiply past 2^63 bytes hold no element but cannot be created by
// numpy: rejected, naming the tensor.
TEST(Sizes, ExtentBeyondInt64IsRejected) {
  hila::ForwardParams p;
  p.q = p.k = empty_view(DType::f32, {0, int64_t(1) << 40, 1, int64_t(1) << 30}, {0, 0, 0, 0});
  p.v = p.o = empty_view(DType::f32, {0, int64_t(1) << 40, 1, 4}, {0, 0, 0, 0});
  expect_error("q extent", [&] { hila::forward(p); }, "q", {"2^63"});
}

// The naive form's [T, T] matrices at T = 8192 need about 6 x 0.5 GiB: a 1 GiB limit rejects the
// call up front naming the form, and the chunk form of the same call runs.
TEST(Sizes, NaiveFormBeyondTheMemoryLimitFailsUpFront) {
  ProblemSpec s = spec_for(Op::gla, 8192, 5);
  s.dk = 2, s.dv = 2;
  const Problem p = hila::tools::make_problem(s);
  const MemoryLimit lim(int64_t(1) << 30);
  expect_error("naive T 8192", [&] { hila::tools::run_forward(p, Form::naive); }, "form", {"naive", "bytes"});
  EXPECT_NO_THROW(hila::tools::run_forward(p, Form::chunk));
}

// The sequence table of B = 2^40 sequences (T = 0) is refused before it is built (it used to loop
// B times).
TEST(Sizes, HugeBatchAtTZeroFailsUpFront) {
  hila::ForwardParams p;
  p.q = p.k = p.v = p.o = empty_view(DType::f32, {int64_t(1) << 40, 0, 1, 4}, {0, 0, 0, 0});
  expect_error("B 2^40", [&] { hila::forward(p); }, "q", {"sequences"});
}

TEST(Sizes, DecodeStateBeyondMemoryIsRejected) {
  OpConfig cfg;
  cfg.op = Op::hla2;
  expect_error("hla2 dk 2^31", [&] { hila::DecodeState(cfg, 1, 1, int64_t(1) << 31, 4); }, "N/H/dk/dv", {"bytes"});
  cfg.op = Op::gla;
  expect_error("gla 4 TiB", [&] { hila::DecodeState(cfg, 1, 1, 1 << 20, 1 << 20); }, "N/H/dk/dv", {"bytes"});
}

TEST(Sizes, MemorySizesParse) {
  EXPECT_EQ(hila::parse_memory_size("512M"), int64_t(512) << 20);
  EXPECT_EQ(hila::parse_memory_size("2G"), int64_t(2) << 30);
  EXPECT_EQ(hila::parse_memory_size("1000"), 1000);
  expect_error("bad size", [] { hila::parse_memory_size("lots"); }, "max_memory");
  expect_error("negative limit", [] { hila::set_memory_limit(-1); }, "max_memory");
}

// numpy 2 gives zero-size arrays all-zero strides: a T = 0 call with such views works.
TEST(Sizes, ZeroSizeTensorsTakeAnyStrides) {
  hila::ForwardParams p;
  p.cfg.op = Op::gla;
  p.q = p.k = p.v = p.o = empty_view(DType::f32, {1, 0, 1, 4}, {0, 0, 0, 0});
  EXPECT_NO_THROW(hila::forward(p));
}

// ---- decode states ---------------------------------------------------------------------------

struct StepInputs {
  Buffer q, k, v, g, lam, beta, o;
  StepInputs(Op op, int64_t H, int64_t dk, int64_t dv, DType dt = DType::f32) {
    q = Buffer(dt, {1, 1, dk});
    k = Buffer(dt, {1, 1, dk});
    v = Buffer(dt, {1, H, dv});
    q.fill(0.3), k.fill(0.2), v.fill(1.0);
    g = Buffer(dt, {1, H});
    g.fill(-0.01);
    if (traits(op).loglinear) {
      lam = Buffer(dt, {1, H, 40});
      lam.fill(1.0);
    }
    if (traits(op).delta) {
      beta = Buffer(dt, {1, H});
      beta.fill(0.5);
    }
    o = Buffer(dt, {1, H, dv});
  }
};

// Eight threads stepping one state: every step lands (positions = total steps) and nothing
// crashes, for a flat and a log-linear state (whose slots grow while other threads wait).
TEST(DecodeStateSharing, ThreadsSteppingOneStateLoseNothing) {
  for (Op op : {Op::gla, Op::loglinear, Op::loglinear_gdn}) {
    OpConfig cfg;
    cfg.op = op;
    hila::DecodeState st(cfg, 1, 2, 4, 4);
    std::atomic<int> errors{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < 8; ++t)
      ts.emplace_back([&] {
        StepInputs in(op, 2, 4, 4);  // each thread its own inputs and output
        for (int i = 0; i < 100; ++i) {
          try {
            hila::step(step_params(cfg, in.q, in.k, in.v, in.g, in.lam, in.beta, in.o), st);
          } catch (...) {
            ++errors;
          }
        }
      });
    for (auto& t : ts) t.join();
    EXPECT_EQ(errors.load(), 0) << op_tag(op);
    EXPECT_EQ(st.position(0), 800) << op_tag(op) << ": steps were lost";
  }
}

// A view taken with its owner stays readable after the state grows into new memory.
TEST(DecodeStateSharing, ViewOwnerKeepsMemoryAcrossGrowth) {
  OpConfig cfg;
  cfg.op = Op::loglinear;
  hila::DecodeState st(cfg, 1, 1, 4, 4);
  StepInputs in(Op::loglinear, 1, 4, 4);
  hila::step(step_params(cfg, in.q, in.k, in.v, in.g, in.lam, in.beta, in.o), st);
  std::shared_ptr<const void> owner;
  const hila::StateView v = st.view(owner);
  const int64_t slots = st.slots();
  const Buffer before = hila::tools::copy_view(v.H);
  for (int i = 0; i < 40; ++i) hila::step(step_params(cfg, in.q, in.k, in.v, in.g, in.lam, in.beta, in.o), st);
  ASSERT_GT(st.slots(), slots) << "the test needs a growth";
  const Buffer after = hila::tools::copy_view(v.H);  // old memory, still alive
  EXPECT_EQ(before.bytes, after.bytes);
  static_cast<float*>(v.H.data)[0] = 7.0f;  // writes go to the old block, harmlessly
}

TEST(DecodeStateSharing, PositionsKeepTheBoundOfForward) {
  OpConfig cfg;
  cfg.op = Op::gla;
  hila::DecodeState st(cfg, 1, 1, 4, 4);
  StateBuffers s = hila::tools::make_state(cfg, 1, 1, 4, 4, 0, DType::f32);
  for (int64_t bad : {(int64_t(1) << 62) + 1, std::numeric_limits<int64_t>::max()}) {
    s.pos.data<int64_t>()[0] = bad;
    expect_error("load " + std::to_string(bad), [&] { st.load(s.view()); }, "state.pos", {"2^62"});
  }
  s.pos.data<int64_t>()[0] = int64_t(1) << 62;  // a final state of forward may sit there
  st.load(s.view());
  StepInputs in(Op::gla, 1, 4, 4);
  expect_error("step past 2^62", [&] { hila::step(step_params(cfg, in.q, in.k, in.v, in.g, in.lam, in.beta, in.o), st); },
               "state.pos", {"2^62"});
  EXPECT_EQ(st.position(0), int64_t(1) << 62) << "a rejected step must not advance";
  expect_error("reserve(-1)", [&] { st.reserve(-1); }, "max_pos");
}

TEST(DecodeStateSharing, Float32StateRejectsFloat64Inputs) {
  OpConfig cfg;
  cfg.op = Op::gla;
  hila::DecodeState st(cfg, 1, 1, 4, 4, DType::f32);
  StepInputs in(Op::gla, 1, 4, 4, DType::f64);
  expect_error("f64 into f32", [&] { hila::step(step_params(cfg, in.q, in.k, in.v, in.g, in.lam, in.beta, in.o), st); },
               "state", {"float64"});
}

// ---- non-finite outputs ------------------------------------------------------------------------

ProblemSpec small(Op op, int64_t T = 16, DType dt = DType::f32) {
  ProblemSpec s = spec_for(op, T, 11);
  s.dk = 4, s.dv = 4, s.dtype = dt;
  return s;
}

TEST(NonFiniteOutputs, AreErrorsNamingTheCause) {
  {
    ProblemSpec s = small(Op::gla);
    s.cfg.scale = 1e308;
    const Problem p = hila::tools::make_problem(s);
    expect_error("scale 1e308", [&] { hila::tools::run_forward(p, Form::chunk); }, "o", {"scale"});
  }
  {
    Problem p = hila::tools::make_problem(small(Op::hla2));
    p.q.fill(1e20), p.k.fill(1e20);
    expect_error("q = k = 1e20 f32", [&] { hila::tools::run_forward(p, Form::chunk); }, "o", {"float32"});
  }
  {
    Problem p = hila::tools::make_problem(small(Op::gdn));
    p.beta.fill(1e30);
    expect_error("gdn beta 1e30", [&] { hila::tools::run_forward(p, Form::chunk); }, "o", {"delta rule"});
  }
  {
    // |k| = 3, beta = 1: the erase I - k k^T has eigenvalue -8 along k; T = 512 overflows float32
    ProblemSpec s = small(Op::gdn, 512);
    s.gated = false;
    Problem p = hila::tools::make_problem(s);
    for (int64_t t = 0; t < s.T; ++t) {
      double n = 0;
      for (int64_t c = 0; c < s.dk; ++c) n += p.k.get(t * s.dk + c) * p.k.get(t * s.dk + c);
      for (int64_t c = 0; c < s.dk; ++c) p.k.set(t * s.dk + c, 3 * p.k.get(t * s.dk + c) / std::sqrt(n));
    }
    p.beta.fill(1.0);
    expect_error("divergent gdn", [&] { hila::tools::run_forward(p, Form::chunk); }, "o", {"delta rule"});
    p.spec.cfg.check_values = false;  // unchecked: computed as written, no error
    EXPECT_NO_THROW(hila::tools::run_forward(p, Form::chunk));
  }
  {
    ProblemSpec s = small(Op::hla2);
    s.cfg.normalize = true;
    s.cfg.eps = 0;
    Problem p = hila::tools::make_problem(s);
    p.q.fill(0);
    expect_error("normalize eps 0", [&] { hila::tools::run_forward(p, Form::chunk); }, "eps", {"eps > 0"});
  }
}

// A step whose o is finite (q = 0) but whose state update overflows float32 (k v^T = 1e60): the
// check covers the state it wrote, for a DecodeState and for a caller's StateView.
TEST(NonFiniteOutputs, StepThatOverflowsTheStateIsAnError) {
  for (Op op : {Op::gla, Op::hla2, Op::loglinear, Op::gdn}) {
    OpConfig cfg;
    cfg.op = op;
    StepInputs in(op, 1, 4, 4);
    in.q.fill(0), in.k.fill(1e30), in.v.fill(1e30);
    hila::DecodeState st(cfg, 1, 1, 4, 4);
    expect_error(op_tag(op) + " DecodeState",
                 [&] { hila::step(step_params(cfg, in.q, in.k, in.v, in.g, in.lam, in.beta, in.o), st); },
                 std::string(traits(op).has_S ? "state.S" : "state.H"), {"not finite"});
    StateBuffers s = hila::tools::make_state(cfg, 1, 1, 4, 4, 8, DType::f32);  // slots up to position 8
    expect_error(op_tag(op) + " StateView",
                 [&] { hila::step(step_params(cfg, in.q, in.k, in.v, in.g, in.lam, in.beta, in.o), s.view()); },
                 std::string(traits(op).has_S ? "state.S" : "state.H"), {"not finite"});
    cfg.check_values = false;  // unchecked: computed as written, no error
    EXPECT_NO_THROW(hila::step(step_params(cfg, in.q, in.k, in.v, in.g, in.lam, in.beta, in.o), s.view()));
  }
}

// ---- aliasing ----------------------------------------------------------------------------------

TEST(Aliasing, OutputsMayNotAliasInputs) {
  ProblemSpec s = small(Op::gla);
  s.init_state = true;
  Problem p = hila::tools::make_problem(s);
  hila::ForwardParams fp = p.forward_params(Form::chunk, 8);
  Buffer o(s.dtype, {s.B, s.T, s.H, s.dv});
  fp.o = o.view();
  // the final state written over the initial state
  StateBuffers fin = hila::tools::make_state(s.cfg, 1, s.H, s.dk, s.dv, p.max_final_pos(), p.state_dtype());
  fp.final_state = fin.view();
  fp.final_state.H = p.init.H.view();
  expect_error("final_state.H = init.H", [&] { hila::forward(fp); }, "final_state.H", {"init.H"});
  // o written over v (same shape here)
  fp.final_state = fin.view();
  fp.o = p.v.view();
  expect_error("o = v", [&] { hila::forward(fp); }, "o", {"'v'"});
  // q, k, v as disjoint slices of one fused buffer, o another slice of it: no false alarm
  Buffer fused(s.dtype, {s.B, s.T, 4, s.dk});
  auto slice = [&](int j) {
    TensorView t = fused.view();
    t.data = static_cast<float*>(t.data) + j * s.dk;
    t.shape[2] = 1;
    return t;
  };
  fp.q = slice(0), fp.k = slice(1), fp.v = slice(2), fp.o = slice(3);
  fp.init = {};
  fp.final_state = {};
  EXPECT_NO_THROW(hila::forward(fp));
  fp.o = slice(2);
  expect_error("o = the v slice", [&] { hila::forward(fp); }, "o", {"'v'"});
}

}  // namespace
}  // namespace hila_test
