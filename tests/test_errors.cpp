// SPDX-License-Identifier: Apache-2.0
// Bad input (docs/math/LOGLINEAR.md §2.3, §4, §11): every entry point throws hila::Error naming the
// offending argument, with the expected and the given value in the message, before writing any
// output. Never a crash, never another exception type.
#include <cctype>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "support_hila.h"

namespace hila_test {
namespace {

using hila::tools::make_problem;
using hila::tools::shape_str;

const double kNaN = std::numeric_limits<double>::quiet_NaN();

bool is_number(const std::string& s) {
  size_t i = s[0] == '-' ? 1 : 0;
  if (i >= s.size()) return false;
  for (; i < s.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return false;
  return true;
}

// Substring search; an integer needle must stand alone (not inside a longer number).
bool contains(const std::string& msg, const std::string& needle) {
  if (!is_number(needle)) return msg.find(needle) != std::string::npos;
  for (size_t p = msg.find(needle); p != std::string::npos; p = msg.find(needle, p + 1)) {
    const bool left = p == 0 || !(std::isdigit(static_cast<unsigned char>(msg[p - 1])) || msg[p - 1] == '-');
    const size_t e = p + needle.size();
    const bool right = e >= msg.size() || !std::isdigit(static_cast<unsigned char>(msg[e]));
    if (left && right) return true;
  }
  return false;
}

// Runs f; expects hila::Error with argument() == arg and every needle in the message.
template <class F>
void expect_error(const std::string& ctx, F&& f, const std::string& arg,
                  const std::vector<std::string>& needles = {}) {
  try {
    f();
    ADD_FAILURE() << ctx << ": expected hila::Error for argument '" << arg << "', got no error";
  } catch (const hila::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.argument(), arg) << ctx << ": message was: " << msg;
    for (const std::string& n : needles)
      EXPECT_TRUE(contains(msg, n)) << ctx << ": message should contain '" << n << "', was: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << ctx << ": expected hila::Error, got another exception: " << e.what();
  } catch (...) {
    ADD_FAILURE() << ctx << ": expected hila::Error, got a non-std exception";
  }
}

template <class F>
void expect_ok(const std::string& ctx, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    ADD_FAILURE() << ctx << ": expected success, got: " << e.what();
  }
}

ProblemSpec base_spec(Op op, bool init = false) {
  ProblemSpec s = spec_for(op, 16, 3);
  s.B = 2;
  s.H = 2;
  s.G = 1;
  s.dk = 4;
  s.dv = 3;
  if (init) {
    s.init_state = true;
    s.init_pos = {100, 5};
  }
  return s;
}

// One valid forward call (chunk form, C = 16) with owned buffers; tests break one thing.
struct Call {
  Problem p;
  Buffer o;
  StateBuffers fin;
  hila::ForwardParams fp;

  explicit Call(const ProblemSpec& s) : p(make_problem(s)) { rebuild(); }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  // Views from the current buffers of p (after a test replaced one).
  void rebuild() {
    const ProblemSpec& s = p.spec;
    o = Buffer(s.dtype, {s.B, s.T, s.H, s.dv});
    o.poison();
    fin = hila::tools::make_state(s.cfg, p.num_seqs(), s.H, s.dk, s.dv, p.max_final_pos(),
                                  p.state_dtype());
    fp = p.forward_params(Form::chunk, 16);
    fp.o = o.view();
    fp.final_state = fin.view();
  }
  void run() const { hila::forward(fp); }
  bool o_untouched() const {
    for (int64_t i = 0; i < o.numel(); ++i)
      if (!std::isnan(o.get(i))) return false;
    return true;
  }
};

std::string shp(std::vector<int64_t> s) { return shape_str(s); }

// The valid call of spec s with cu_seqlens = `bounds` (int64): it fails naming `arg`, with every
// needle in the message.
void expect_cu_seqlens_fails(const std::string& ctx, const ProblemSpec& s, const std::vector<int64_t>& bounds,
                             const std::string& arg, const std::vector<std::string>& needles) {
  Call c(s);
  Buffer cu(DType::i64, {static_cast<int64_t>(bounds.size())});
  for (size_t i = 0; i < bounds.size(); ++i) cu.set(static_cast<int64_t>(i), static_cast<double>(bounds[i]));
  c.fp.cu_seqlens = cu.view();
  expect_error(ctx, [&] { c.run(); }, arg, needles);
}

// The valid call of base_spec(op) with tensor `field` replaced by a `dt` tensor of `shape`: it
// fails naming `arg`, with every needle in the message.
void expect_replaced_fails(const std::string& ctx, Op op, hila::TensorView hila::ForwardParams::*field,
                           DType dt, std::vector<int64_t> shape, const std::string& arg,
                           const std::vector<std::string>& needles) {
  Call c(base_spec(op));
  Buffer x(dt, std::move(shape));
  c.fp.*field = x.view();
  expect_error(ctx, [&] { c.run(); }, arg, needles);
}

// A view with the innermost dimension strided by 2 over a buffer twice as wide.
struct Strided {
  Buffer b;
  hila::TensorView v;
  explicit Strided(const Buffer& src) {
    std::vector<int64_t> shape = src.shape;
    shape.back() *= 2;
    b = Buffer(src.dtype, shape);
    const int64_t inner = src.shape.back();
    for (int64_t i = 0; i < src.numel(); ++i) b.set((i / inner) * 2 * inner + (i % inner) * 2, src.get(i));
    v = src.view();
    v.data = b.bytes.data();
    for (int d = 0; d < v.ndim; ++d) v.stride[d] *= 2;
  }
};

// ---------------------------------------------------------------------------------------------

TEST(Errors, ShapeMismatches) {
  for (Op op : hila::all_ops()) {
    const std::string on = op_tag(op);
    const hila::OpTraits t = traits(op);
    {
      Call c(base_spec(op));
      Buffer k(DType::f64, {2, 15, 1, 4});
      c.fp.k = k.view();
      expect_error(on + " k rows", [&] { c.run(); }, "k", {shp({2, 16, 1, 4}), shp({2, 15, 1, 4})});
      EXPECT_TRUE(c.o_untouched()) << on << ": o written before validation failed";
    }
    expect_replaced_fails(on + " k dk", op, &hila::ForwardParams::k, DType::f64, {2, 16, 1, 5}, "k",
                          {shp({2, 16, 1, 4}), shp({2, 16, 1, 5})});
    expect_replaced_fails(on + " v rows", op, &hila::ForwardParams::v, DType::f64, {2, 17, 2, 3}, "v",
                          {shp({2, 16, 2, 3}), shp({2, 17, 2, 3})});
    expect_replaced_fails(on + " g heads", op, &hila::ForwardParams::g, DType::f64, {2, 16, 3}, "g",
                          {shp({2, 16, 2}), shp({2, 16, 3})});
    if (t.loglinear) {
      Call c(base_spec(op));
      const int64_t L = c.p.lam.shape[3];
      Buffer lam(DType::f64, {2, 15, 2, L});
      c.fp.lam = lam.view();
      expect_error(on + " lam rows", [&] { c.run(); }, "lam", {shp({2, 15, 2, L})});
    }
    if (t.delta)
      expect_replaced_fails(on + " beta", op, &hila::ForwardParams::beta, DType::f64, {2, 16, 2, 1}, "beta",
                            {shp({2, 16, 2}), shp({2, 16, 2, 1})});
    expect_replaced_fails(on + " o", op, &hila::ForwardParams::o, DType::f64, {2, 16, 2, 4}, "o",
                          {shp({2, 16, 2, 3}), shp({2, 16, 2, 4})});
    expect_replaced_fails(on + " o dtype", op, &hila::ForwardParams::o, DType::f32, {2, 16, 2, 3}, "o",
                          {"float64", "float32"});
    {
      // Initial-state H with the wrong dk / dv.
      Call c(base_spec(op, true));
      std::vector<int64_t> hs = c.p.init.H.shape;
      hs[hs.size() - 2] += 1;
      Buffer h(DType::f64, hs);
      c.fp.init.H = h.view();
      expect_error(on + " init.H dk", [&] { c.run(); }, "init.H", {shp(hs)});
      hs[hs.size() - 2] -= 1;
      hs.back() += 1;
      Buffer h2(DType::f64, hs);
      c.fp.init.H = h2.view();
      expect_error(on + " init.H dv", [&] { c.run(); }, "init.H", {shp(hs)});
    }
    if (t.has_S) {
      Call c(base_spec(op, true));
      Buffer s(DType::f64, {2, 2, 16});
      c.fp.init.S = s.view();
      expect_error(on + " init.S", [&] { c.run(); }, "init.S", {shp({2, 2, 10}), shp({2, 2, 16})});
    }
    if (t.has_P) {
      Call c(base_spec(op, true));
      Buffer pp(DType::f64, {2, 2, 4, 4});
      c.fp.init.P = pp.view();
      expect_error(on + " init.P", [&] { c.run(); }, "init.P", {shp({2, 2, 4, 3}), shp({2, 2, 4, 4})});
    }
    {
      // Final-state buffer of the wrong dv.
      Call c(base_spec(op));
      std::vector<int64_t> hs = c.fin.H.shape;
      hs.back() = 7;
      Buffer h(DType::f64, hs);
      c.fp.final_state.H = h.view();
      expect_error(on + " final_state.H", [&] { c.run(); }, "final_state.H", {shp(hs)});
    }
    {
      // Untied gates need one column per primitive.
      ProblemSpec s = base_spec(op);
      if (!t.hla_family) continue;
      s.cfg.gates = Gates::untied;
      Call c(s);
      Buffer g(DType::f64, {2, 16, 2, t.num_primitives + 1});
      c.fp.g = g.view();
      expect_error(on + " untied g", [&] { c.run(); }, "g",
                   {shp({2, 16, 2, t.num_primitives}), shp({2, 16, 2, t.num_primitives + 1})});
    }
  }
}

TEST(Errors, MissingOrForbiddenInputs) {
  for (Op op : hila::all_ops()) {
    const std::string on = op_tag(op);
    const hila::OpTraits t = traits(op);
    {
      Call c(base_spec(op));
      c.fp.q = hila::TensorView{};
      expect_error(on + " no q", [&] { c.run(); }, "q");
    }
    {
      Call c(base_spec(op));
      c.fp.o = hila::TensorView{};
      expect_error(on + " no o", [&] { c.run(); }, "o");
    }
    if (t.loglinear) {
      Call c(base_spec(op));
      c.fp.lam = hila::TensorView{};
      expect_error(on + " lam missing", [&] { c.run(); }, "lam", {on});
    } else {
      expect_replaced_fails(on + " lam given", op, &hila::ForwardParams::lam, DType::f64, {2, 16, 2, 5}, "lam",
                            {on, shp({2, 16, 2, 5})});
    }
    if (t.delta) {
      Call c(base_spec(op));
      c.fp.beta = hila::TensorView{};
      expect_error(on + " beta missing", [&] { c.run(); }, "beta", {on});
    } else {
      expect_replaced_fails(on + " beta given", op, &hila::ForwardParams::beta, DType::f64, {2, 16, 2}, "beta",
                            {on});
    }
    // State parts the operator does not have, and parts it needs.
    {
      Call c(base_spec(op, true));
      Buffer extra(DType::f64, {2, 2, 4, 3});
      if (!t.has_P) {
        c.fp.init.P = extra.view();
        expect_error(on + " init.P given", [&] { c.run(); }, "init.P", {on});
      } else {
        c.fp.init.P = hila::TensorView{};
        expect_error(on + " init.P missing", [&] { c.run(); }, "init.P");
      }
    }
    if (t.has_S) {
      Call c(base_spec(op, true));
      c.fp.init.S = hila::TensorView{};
      expect_error(on + " init.S missing", [&] { c.run(); }, "init.S");
    }
    {
      Call c(base_spec(op, true));
      c.fp.init.pos = hila::TensorView{};
      expect_error(on + " init.pos missing", [&] { c.run(); }, "init.pos");
    }
  }
}

TEST(Errors, OptionsOnOperatorsThatDoNotTakeThem) {
  for (Op op : hila::all_ops()) {
    const std::string on = op_tag(op);
    const hila::OpTraits t = traits(op);
    if (!t.hla_family) {
      ProblemSpec s = base_spec(op);
      Call c(s);
      c.fp.cfg.normalize = true;
      expect_error(on + " normalize", [&] { c.run(); }, "normalize", {on, "true"});
      Call c2(s);
      c2.fp.cfg.gates = Gates::untied;
      expect_error(on + " untied", [&] { c2.run(); }, "gates", {on, "untied"});
    }
    if (!takes_ridge(op)) {
      Call c(base_spec(op));
      c.fp.cfg.ridge = 0.5;
      expect_error(on + " ridge", [&] { c.run(); }, "ridge", {on, "0.5"});
    }
    if (!t.delta) {
      Call c(base_spec(op));
      c.fp.cfg.qk_l2norm = true;
      expect_error(on + " qk_l2norm", [&] { c.run(); }, "qk_l2norm", {on});
    }
  }
  // Out-of-range enums.
  Call c(base_spec(Op::gla));
  c.fp.cfg.op = static_cast<Op>(42);
  expect_error("op id 42", [&] { c.run(); }, "op", {"42"});
  Call c2(base_spec(Op::gla));
  c2.fp.form = static_cast<Form>(9);
  expect_error("form id 9", [&] { c2.run(); }, "form", {"9"});
}

TEST(Errors, Dtypes) {
  {
    Call c(base_spec(Op::gla));
    Buffer q = c.p.q.cast(DType::i32), k = c.p.k.cast(DType::i32), v = c.p.v.cast(DType::i32);
    c.fp.q = q.view();
    c.fp.k = k.view();
    c.fp.v = v.view();
    expect_error("int32 q", [&] { c.run(); }, "q", {"int32"});
  }
  {
    Call c(base_spec(Op::gla));
    Buffer k = c.p.k.cast(DType::f32);
    c.fp.k = k.view();
    expect_error("k f32 with q f64", [&] { c.run(); }, "k", {"float64", "float32"});
  }
  {
    Call c(base_spec(Op::hla2));
    Buffer v = c.p.v.cast(DType::bf16);
    c.fp.v = v.view();
    expect_error("v bf16 with q f64", [&] { c.run(); }, "v", {"float64", "bfloat16"});
  }
  {
    Call c(base_spec(Op::gla));
    Buffer g = c.p.g.cast(DType::i64);
    c.fp.g = g.view();
    expect_error("int64 g", [&] { c.run(); }, "g", {"int64"});
  }
  {
    Call c(base_spec(Op::loglinear));
    Buffer lam = c.p.lam.cast(DType::i32);
    c.fp.lam = lam.view();
    expect_error("int32 lam", [&] { c.run(); }, "lam", {"int32"});
  }
  {
    Call c(base_spec(Op::gdn));
    Buffer beta = c.p.beta.cast(DType::i32);
    c.fp.beta = beta.view();
    expect_error("int32 beta", [&] { c.run(); }, "beta", {"int32"});
  }
  {
    // States are fp32 or fp64, never bf16 (docs/math/HLA.md §8.2).
    Call c(base_spec(Op::gla, true));
    Buffer h = c.p.init.H.cast(DType::bf16);
    c.fp.init.H = h.view();
    expect_error("bf16 init.H", [&] { c.run(); }, "init.H", {"bfloat16"});
  }
  {
    Call c(base_spec(Op::gla, true));
    Buffer pos = c.p.init.pos.cast(DType::i32);
    c.fp.init.pos = pos.view();
    expect_error("int32 init.pos", [&] { c.run(); }, "init.pos", {"int64", "int32"});
  }
  {
    hila::OpConfig cfg;
    expect_error("bf16 decode state", [&] { hila::DecodeState ds(cfg, 1, 1, 4, 4, DType::bf16); },
                 "dtype", {"bfloat16"});
  }
}

TEST(Errors, Strides) {
  for (const char* which : {"q", "k", "v", "o"}) {
    Call c(base_spec(Op::hla2));
    const Buffer& src = std::string(which) == "q"   ? c.p.q
                        : std::string(which) == "k" ? c.p.k
                        : std::string(which) == "v" ? c.p.v
                                                    : c.o;
    Strided s(src);
    hila::TensorView& slot = std::string(which) == "q"   ? c.fp.q
                             : std::string(which) == "k" ? c.fp.k
                             : std::string(which) == "v" ? c.fp.v
                                                         : c.fp.o;
    slot = s.v;
    expect_error(std::string("strided ") + which, [&] { c.run(); }, which, {"stride 1", "stride 2"});
  }
  {
    Call c(base_spec(Op::loglinear));
    Strided s(c.p.lam);
    c.fp.lam = s.v;
    expect_error("strided lam", [&] { c.run(); }, "lam", {"stride 1", "stride 2"});
  }
}

// Strided outer dimensions (innermost contiguous) are valid input and give the same result.
TEST(Errors, OuterStridesAccepted) {
  for (Op op : hila::all_ops()) {
    Call c(base_spec(op, true));
    const Result want = hila::tools::run_forward(c.p, Form::chunk, 16);
    // q, k as every other group of a [B, T, 2G, dk] buffer.
    auto widen = [](const Buffer& src) {
      std::vector<int64_t> shape = src.shape;
      shape[2] *= 2;
      Buffer b(src.dtype, shape);
      const int64_t inner = src.shape[3];
      for (int64_t i = 0; i < src.numel(); ++i) {
        const int64_t row = i / inner, col = i % inner;
        b.set(row * 2 * inner + col, src.get(i));
        b.set(row * 2 * inner + inner + col, kNaN);  // never read
      }
      hila::TensorView v = src.view();
      v.data = b.bytes.data();
      for (int d = 0; d < 3; ++d) v.stride[d] *= 2;
      return std::make_pair(std::move(b), v);
    };
    auto [qb, qv] = widen(c.p.q);
    auto [kb, kv] = widen(c.p.k);
    qv.data = qb.bytes.data();
    kv.data = kb.bytes.data();
    c.fp.q = qv;
    c.fp.k = kv;
    expect_ok(op_tag(op) + " outer strides", [&] { c.run(); });
    expect_buffer_close(c.o, want.o, 1e-12, op_tag(op) + " strided q/k");
    EXPECT_LE(hila::tools::rel_err(c.fin, want.final_state), 1e-12) << op_tag(op);
  }
}

TEST(Errors, TooFewLevels) {
  for (Op op : {Op::loglinear, Op::loglinear_hla2, Op::loglinear_ahla, Op::loglinear_hla3,
                Op::loglinear_gdn}) {
    const std::string on = op_tag(op);
    {
      // T = 16 needs bitlen(15)+1 = 5 levels.
      Call c(base_spec(op));
      ASSERT_EQ(c.p.lam.shape[3], 5);
      Buffer lam = hila::tools::slice_time(c.p.lam, 0, 16);
      Buffer cut(DType::f64, {2, 16, 2, 4});
      for (int64_t i = 0; i < cut.numel(); ++i) cut.set(i, lam.get((i / 4) * 5 + i % 4));
      c.fp.lam = cut.view();
      expect_error(on + " 4 < 5 levels", [&] { c.run(); }, "lam", {"4", "5"});
      EXPECT_TRUE(c.o_untouched());
    }
    {
      // With an initial state at 100 and T = 16: positions up to 115 need 8 levels.
      Call c(base_spec(op, true));
      ASSERT_EQ(c.p.lam.shape[3], 8);
      Buffer cut(DType::f64, {2, 16, 2, 7});
      c.fp.lam = cut.view();
      expect_error(on + " 7 < 8 levels with init", [&] { c.run(); }, "lam", {"7", "8", "100"});
    }
    {
      // Varlen: the longest sequence decides.
      ProblemSpec s = base_spec(op);
      s.B = 1;
      s.seqlens = {3, 40, 0};
      Call c(s);
      ASSERT_EQ(c.p.lam.shape[3], 7);
      Buffer cut(DType::f64, {1, 43, 2, 6});
      c.fp.lam = cut.view();
      expect_error(on + " varlen 6 < 7 levels", [&] { c.run(); }, "lam", {"6", "7"});
    }
    {
      // Decode step at position 64 needs bitlen(64)+1 = 8 levels.
      ProblemSpec s = base_spec(op, true);
      s.B = 1;
      s.init_pos = {64};
      const Problem p = make_problem(s);
      hila::DecodeState ds(s.cfg, 1, s.H, s.dk, s.dv, DType::f64);
      ds.load(p.init.view());
      Buffer q = gather_tokens(p.q, {0}), k = gather_tokens(p.k, {0}), v = gather_tokens(p.v, {0}),
             g = gather_tokens(p.g, {0}), beta = gather_tokens(p.beta, {0});
      Buffer lam(DType::f64, {1, s.H, 7}), o(DType::f64, {1, s.H, s.dv});
      hila::StepParams sp = step_params(s.cfg, q, k, v, g, lam, beta, o);
      expect_error(on + " decode 7 < 8 levels", [&] { hila::step(sp, ds); }, "lam", {"7", "8", "64"});
      EXPECT_EQ(ds.position(0), 64) << on << ": a rejected step must not advance the state";
      Buffer lam8(DType::f64, {1, s.H, 8});
      sp.lam = lam8.view();
      expect_ok(on + " decode with 8 levels", [&] { hila::step(sp, ds); });
      EXPECT_EQ(ds.position(0), 65);
    }
    {
      // Extra levels are allowed.
      ProblemSpec s = base_spec(op);
      s.extra_levels = 3;
      Call c(s);
      expect_ok(on + " extra levels", [&] { c.run(); });
    }
  }
}

TEST(Errors, GroupsMustDivideHeads) {
  for (Op op : hila::all_ops()) {
    ProblemSpec s = base_spec(op);
    s.G = 2;
    s.H = 4;
    Call c(s);
    Buffer v(DType::f64, {2, 16, 3, 3});
    c.fp.v = v.view();
    expect_error(op_tag(op) + " H=3 G=2", [&] { c.run(); }, "v", {"G = 2", "H = 3"});
  }
}

TEST(Errors, CuSeqlens) {
  auto varlen = [](Op op) {
    ProblemSpec s = base_spec(op);
    s.B = 1;
    s.seqlens = {10, 6};
    return s;
  };
  for (Op op : {Op::gla, Op::loglinear_hla2}) {
    const std::string on = op_tag(op);
    expect_cu_seqlens_fails(on + " decreasing", varlen(op), {0, 10, 5, 16}, "cu_seqlens", {"5", "10"});
    expect_cu_seqlens_fails(on + " last != T", varlen(op), {0, 8, 15}, "cu_seqlens", {"16", "15"});
    expect_cu_seqlens_fails(on + " first != 0", varlen(op), {2, 10, 16}, "cu_seqlens", {"0", "2"});
    {
      Call c(varlen(op));
      Buffer cu = c.p.cu_seqlens.cast(DType::f32);
      c.fp.cu_seqlens = cu.view();
      expect_error(on + " float cu_seqlens", [&] { c.run(); }, "cu_seqlens", {"float32"});
    }
    {
      Call c(varlen(op));
      Buffer cu = c.p.cu_seqlens.cast(DType::i32);
      c.fp.cu_seqlens = cu.view();
      expect_ok(on + " int32 cu_seqlens", [&] { c.run(); });
    }
    expect_cu_seqlens_fails(on + " B = 2", base_spec(op), {0, 10, 16}, "cu_seqlens", {"B = 2"});
    {
      // The initial state needs one row per sequence, not per batch row.
      ProblemSpec s = varlen(op);
      s.init_state = true;
      s.init_pos = {3, 9};
      expect_cu_seqlens_fails(on + " 3 sequences, 2 state rows", s, {0, 4, 10, 16}, "init.pos",
                              {"[3]", "[2]"});
    }
  }
}

TEST(Errors, Chunk) {
  for (int64_t C : {0, -4, 3, 48, 100}) {
    Call c(base_spec(Op::loglinear));
    c.fp.chunk = C;
    expect_error("chunk " + std::to_string(C), [&] { c.run(); }, "chunk", {std::to_string(C)});
  }
  for (int64_t C : {1, 2, 4, 128, 1024}) {
    Call c(base_spec(Op::loglinear));
    c.fp.chunk = C;
    expect_ok("chunk " + std::to_string(C), [&] { c.run(); });
  }
}

// workspace and workspace_bytes come together; on the CPU the size is 0 and a workspace is ignored.
TEST(Errors, Workspace) {
  {
    Call c(base_spec(Op::hla2));
    c.fp.workspace_bytes = 1024;
    expect_error("bytes without a pointer", [&] { c.run(); }, "workspace", {"1024", "nullptr"});
    EXPECT_TRUE(c.o_untouched());
  }
  {
    Call c(base_spec(Op::hla2));
    char ws[64];
    c.fp.workspace = ws;
    expect_error("pointer without bytes", [&] { c.run(); }, "workspace_bytes", {"0"});
  }
  for (Op op : {Op::gla, Op::hla3, Op::loglinear, Op::loglinear_gdn}) {
    Call c(base_spec(op, true));
    EXPECT_EQ(hila::workspace_size(c.fp), 0u) << hila::op_name(op);
    hila::BackwardParams b;
    static_cast<hila::ForwardParams&>(b) = c.fp;
    b.d_o = c.p.d_o.view();
    EXPECT_EQ(hila::workspace_size(b), 0u) << hila::op_name(op);
    char ws[64];
    c.fp.workspace = ws, c.fp.workspace_bytes = sizeof(ws);
    expect_ok(std::string("cpu ignores the workspace: ") + hila::op_name(op), [&] { c.run(); });
  }
  {  // the size query validates like the call
    Call c(base_spec(Op::gla));
    c.fp.chunk = 3;
    expect_error("size query", [&] { (void)hila::workspace_size(c.fp); }, "chunk", {"3"});
  }
}

TEST(Errors, ValueChecks) {
  for (Op op : hila::all_ops()) {
    const std::string on = op_tag(op);
    const hila::OpTraits t = traits(op);
    {
      Call c(base_spec(op));
      c.p.g.set(37, 0.5);  // b = 1, t = 2, h = 1
      expect_error(on + " g > 0", [&] { c.run(); }, "g", {"0.5", "<= 0", "[1, 2, 1]"});
      EXPECT_TRUE(c.o_untouched());
    }
    {
      // Checks off: g > 0 is evaluated as written (docs/math/LOGLINEAR.md §11), chunk == naive.
      ProblemSpec s = base_spec(op);
      s.cfg.check_values = false;
      Problem p = make_problem(s);
      p.g.set(37, 0.3);
      p.g.set(5, 0.1);
      Result got, want;
      expect_ok(on + " g > 0 unchecked", [&] {
        got = hila::tools::run_forward(p, Form::chunk, 4);
        want = hila::tools::run_forward(p, Form::naive);
      });
      expect_results_close(got, want, 1e-10, 1e-9, on + " g > 0 unchecked chunk vs naive");
    }
    struct Bad {
      Buffer Problem::*m;
      const char* name;
      double x;
      const char* text;
    };
    std::vector<Bad> bads = {{&Problem::q, "q", kNaN, "nan"},
                             {&Problem::k, "k", std::numeric_limits<double>::infinity(), "inf"},
                             {&Problem::v, "v", kNaN, "nan"},
                             {&Problem::g, "g", kNaN, "nan"},
                             {&Problem::g, "g", std::numeric_limits<double>::infinity(), "inf"}};  // -inf: a reset
    if (t.loglinear) bads.push_back({&Problem::lam, "lam", kNaN, "nan"});
    if (t.delta) bads.push_back({&Problem::beta, "beta", std::numeric_limits<double>::infinity(), "inf"});
    for (const Bad& b : bads) {
      Call c(base_spec(op));
      (c.p.*(b.m)).set(7, b.x);
      expect_error(on + " non-finite " + b.name, [&] { c.run(); }, b.name, {b.text});
    }
    for (Buffer StateBuffers::*part : {&StateBuffers::S, &StateBuffers::P, &StateBuffers::H}) {
      Call c(base_spec(op, true));
      Buffer& buf = c.p.init.*part;
      if (buf.empty()) continue;
      // A live entry (sequence 0 at position 100 = 0b1100100: slot 3 is live).
      const int64_t idx = buf.shape.size() == 5 ? 3 * buf.shape[3] * buf.shape[4] : 0;
      buf.set(idx, kNaN);
      const std::string name = std::string("init.") +
                               (part == &StateBuffers::S ? "S" : part == &StateBuffers::P ? "P" : "H");
      expect_error(on + " NaN " + name, [&] { c.run(); }, name, {"nan"});
    }
    {
      // Backward: NaN in d_o.
      Problem p = make_problem(base_spec(op));
      p.d_o.set(3, kNaN);
      expect_error(on + " NaN d_o", [&] { hila::tools::run_backward(p, Form::chunk, 16); }, "d_o",
                   {"nan"});
    }
  }
}

// The value checks name the first failing element in row-major order, in every float dtype, for
// tensors longer than one scan block, with size-1 dimensions of any stride, and with outer strides
// (elements outside the view, even non-finite ones, are never read).
TEST(Errors, ValueChecksNameTheFirstBadElement) {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
    ProblemSpec s = base_spec(Op::gla);
    s.T = 1024;  // v [2, 1024, 2, 3]: 12288 elements
    s.dtype = dt;
    const std::string on = std::string(hila::dtype_name(dt)) + " ";
    auto at = [](const Buffer& b, std::initializer_list<int64_t> idx) {  // row-major offset
      int64_t off = 0, i = 0;
      for (int64_t x : idx) off = off * b.shape[size_t(i++)] + x;
      return off;
    };
    {
      Call c(s);
      c.p.v.set(at(c.p.v, {1, 900, 0, 0}), inf);
      c.p.v.set(at(c.p.v, {1, 700, 1, 2}), kNaN);
      c.p.v.set(at(c.p.v, {1, 1023, 1, 2}), kNaN);
      expect_error(on + "first non-finite v", [&] { c.run(); }, "v", {"nan at [1, 700, 1, 2]"});
    }
    {
      Call c(s);
      c.p.g.set(at(c.p.g, {0, 3, 0}), -inf);  // a reset: valid
      c.p.g.set(at(c.p.g, {1, 0, 0}), kNaN);
      c.p.g.set(at(c.p.g, {0, 513, 1}), 0.25);
      expect_error(on + "first bad gate", [&] { c.run(); }, "g", {"got 0.250000 at [0, 513, 1]"});
    }
    {
      Call c(s);  // q [2, 1024, 1, 4]: its size-1 dimension may have any stride
      c.fp.q.stride[2] = 12345;
      expect_ok(on + "size-1 dimension with any stride", [&] { c.run(); });
      c.p.q.set(at(c.p.q, {1, 1000, 0, 3}), -inf);
      expect_error(on + "q with a size-1 dimension", [&] { c.run(); }, "q", {"-inf at [1, 1000, 0, 3]"});
    }
    {
      // k as every other group of a [B, T, 2G, dk] buffer whose other groups are NaN
      Call c(s);
      const Buffer& k = c.p.k;
      Buffer wide(dt, {k.shape[0], k.shape[1], 2 * k.shape[2], k.shape[3]});
      const int64_t inner = k.shape[3];
      for (int64_t i = 0; i < k.numel(); ++i) {
        const int64_t row = i / inner, col = i % inner;
        wide.set(row * 2 * inner + col, k.get(i));
        wide.set(row * 2 * inner + inner + col, kNaN);  // never read
      }
      c.fp.k.data = wide.bytes.data();
      for (int d = 0; d < 3; ++d) c.fp.k.stride[d] *= 2;
      expect_ok(on + "outer strides", [&] { c.run(); });
      const int64_t i = at(k, {0, 600, 0, 1});
      wide.set(i / inner * 2 * inner + i % inner, inf);
      expect_error(on + "k with outer strides", [&] { c.run(); }, "k", {"inf at [0, 600, 0, 1]"});
    }
  }
}

TEST(Errors, InitialStateMustFit) {
  for (Op op : {Op::loglinear, Op::loglinear_hla3, Op::loglinear_gdn}) {
    const std::string on = op_tag(op);
    {
      // Position 100 needs bitlen(100)+1 = 8 slots.
      Call c(base_spec(op, true));
      ASSERT_EQ(c.p.init.H.shape[2], 8);
      Buffer h = resize_slots(c.p.init.H, 7);
      c.fp.init.H = h.view();
      expect_error(on + " 7 < 8 slots", [&] { c.run(); }, "init.H", {"7", "8", "100"});
    }
    {
      // Dead slot (slot 1: bit 0 of 100 is clear) must be zero.
      Call c(base_spec(op, true));
      const int64_t mat = c.p.init.H.shape[3] * c.p.init.H.shape[4];
      c.p.init.H.set(1 * mat + 2, 0.25);
      expect_error(on + " non-canonical", [&] { c.run(); }, "init.H", {"slot 1", "100"});
    }
    {
      Call c(base_spec(op, true));
      const int64_t mat = c.p.init.H.shape[3] * c.p.init.H.shape[4];
      c.p.init.H.set(0 * mat, 1.0);  // slot 0 is always dead in a state
      expect_error(on + " slot 0", [&] { c.run(); }, "init.H", {"slot 0"});
    }
    {
      // DecodeState::load validates like an initial state.
      ProblemSpec s = base_spec(op, true);
      const Problem p = make_problem(s);
      StateBuffers st = p.init;
      const int64_t mat = st.H.shape[3] * st.H.shape[4];
      st.H.set(1 * mat, 0.5);
      hila::DecodeState ds(s.cfg, 2, s.H, s.dk, s.dv, DType::f64);
      expect_error(on + " load non-canonical", [&] { ds.load(st.view()); }, "state.H", {"slot 1"});
      StateBuffers st2 = p.init;
      st2.H = resize_slots(st2.H, 6);
      expect_error(on + " load too few slots", [&] { ds.load(st2.view()); }, "state.H", {"6", "8"});
    }
  }
  for (Op op : hila::all_ops()) {
    const std::string on = op_tag(op);
    {
      Call c(base_spec(op, true));
      c.p.init.pos.set(1, -3);
      expect_error(on + " negative pos", [&] { c.run(); }, "init.pos", {"-3"});
    }
    {
      Call c(base_spec(op, true));
      const int64_t big = std::numeric_limits<int64_t>::max() - 5;
      int64_t* pos = c.p.init.pos.data<int64_t>();
      pos[0] = big;  // exact (Buffer::set goes through double)
      expect_error(on + " overflowing pos", [&] { c.run(); }, "init.pos", {std::to_string(big)});
    }
    {
      // Initial state for the wrong number of sequences.
      Call c(base_spec(op, true));
      StateBuffers one = state_row(c.p.init, 0);
      c.fp.init = one.view();
      expect_error(on + " one state row for B = 2", [&] { c.run(); }, "init.pos", {"[2]", "[1]"});
    }
  }
}

TEST(Errors, Names) {
  expect_error("parse_op", [] { hila::parse_op("hla4"); }, "op", {"hla4", "gla", "loglinear_gdn"});
  expect_error("parse_op empty", [] { hila::parse_op(""); }, "op", {"''"});
  expect_error("parse_form", [] { hila::parse_form("blelloch"); }, "form",
               {"blelloch", "naive", "chunk", "scan"});
  for (Op op : hila::all_ops()) EXPECT_EQ(hila::parse_op(hila::op_name(op)), op);
  for (Form f : hila::all_forms()) EXPECT_EQ(hila::parse_form(hila::form_name(f)), f);
  EXPECT_EQ(hila::all_ops().size(), 10u);
  EXPECT_EQ(hila::all_forms().size(), 4u);
}

TEST(Errors, Backward) {
  for (Op op : hila::all_ops()) {
    const std::string on = op_tag(op);
    const Problem p = make_problem(base_spec(op, true));
    for (Form f : hila::all_forms()) {
      if (hila::supports(op, f, true)) {
        expect_ok(on + " backward " + hila::form_name(f),
                  [&] { hila::tools::run_backward(p, f, 16); });
      } else {
        expect_error(on + " backward " + hila::form_name(f),
                     [&] { hila::tools::run_backward(p, f, 16); }, "form", {hila::form_name(f), on});
      }
    }
    EXPECT_FALSE(hila::supports(op, Form::scan, true));
    EXPECT_TRUE(hila::supports(op, Form::naive, true));
    EXPECT_TRUE(hila::supports(op, Form::chunk, true));
    for (Form f : hila::all_forms()) EXPECT_TRUE(hila::supports(op, f, false));

    // Shapes of the backward-only arguments.
    auto bw = [&](auto edit, const std::string& arg, const std::vector<std::string>& needles,
                  const std::string& what) {
      Result r = hila::tools::run_forward(p, Form::chunk, 16);
      hila::BackwardParams bp;
      static_cast<hila::ForwardParams&>(bp) = p.forward_params(Form::chunk, 16);
      bp.o = r.o.view();
      bp.final_state = r.final_state.view();
      bp.d_o = p.d_o.view();
      bp.d_final = p.d_final.view();
      Buffer dq(DType::f64, p.q.shape);
      bp.dq = dq.view();
      edit(bp);
      expect_error(on + " " + what, [&] { hila::backward(bp); }, arg, needles);
    };
    Buffer d_o_bad(DType::f64, {2, 16, 2, 4});
    bw([&](hila::BackwardParams& bp) { bp.d_o = d_o_bad.view(); }, "d_o",
       {shp({2, 16, 2, 3}), shp({2, 16, 2, 4})}, "d_o shape");
    Buffer dq_bad(DType::f64, {2, 16, 1, 5});
    bw([&](hila::BackwardParams& bp) { bp.dq = dq_bad.view(); }, "dq",
       {shp({2, 16, 1, 4}), shp({2, 16, 1, 5})}, "dq shape");
    Buffer dk_f32(DType::f32, p.k.shape);
    bw([&](hila::BackwardParams& bp) { bp.dk = dk_f32.view(); }, "dk", {"float64", "float32"},
       "dk dtype");
    std::vector<int64_t> hs = p.d_final.H.shape;
    hs.back() += 1;
    Buffer dfin_bad(DType::f64, hs);
    bw([&](hila::BackwardParams& bp) { bp.d_final.H = dfin_bad.view(); }, "d_final.H", {shp(hs)},
       "d_final.H shape");
    if (traits(op).delta)  // gdn: no lam at all; loglinear_gdn: the wrong shape
      bw([&](hila::BackwardParams& bp) { bp.dlam = bp.beta; }, "dlam", {}, "dlam like beta");
  }
  {
    // d_init requested without an initial state.
    const Problem p = make_problem(base_spec(Op::gla));
    Result r = hila::tools::run_forward(p, Form::chunk, 16);
    hila::BackwardParams bp;
    static_cast<hila::ForwardParams&>(bp) = p.forward_params(Form::chunk, 16);
    bp.o = r.o.view();
    bp.d_o = p.d_o.view();
    StateBuffers dinit = hila::tools::make_state(p.spec.cfg, 2, 2, 4, 3, 0, DType::f64);
    dinit.pos = Buffer{};
    bp.d_init = dinit.view();
    expect_error("d_init without init", [&] { hila::backward(bp); }, "d_init");
  }
}

TEST(Errors, Step) {
  for (Op op : hila::all_ops()) {
    const std::string on = op_tag(op);
    ProblemSpec s = base_spec(op);
    s.B = 1;
    const Problem p = make_problem(s);
    hila::DecodeState ds(s.cfg, 1, s.H, s.dk, s.dv, DType::f64);
    Buffer q = gather_tokens(p.q, {0}), k = gather_tokens(p.k, {0}), v = gather_tokens(p.v, {0}),
           g = gather_tokens(p.g, {0}), lam = gather_tokens(p.lam, {0}),
           beta = gather_tokens(p.beta, {0});
    Buffer o(DType::f64, {1, s.H, s.dv});
    auto params = [&] {
      hila::StepParams sp = step_params(s.cfg, q, k, v, g, lam, beta, o);
      return sp;
    };
    {
      hila::StepParams sp = params();
      Buffer q2(DType::f64, {2, 1, s.dk}), k2(DType::f64, {2, 1, s.dk}), v2(DType::f64, {2, s.H, s.dv});
      Buffer g2(DType::f64, {2, s.H}), lam2(DType::f64, {2, s.H, 5}), beta2(DType::f64, {2, s.H});
      sp.q = q2.view();
      sp.k = k2.view();
      sp.v = v2.view();
      if (!g.empty()) sp.g = g2.view();
      if (!lam.empty()) sp.lam = lam2.view();
      if (!beta.empty()) sp.beta = beta2.view();
      expect_error(on + " step N", [&] { hila::step(sp, ds); }, "q", {"N = 1", "N = 2"});
    }
    {
      hila::StepParams sp = params();
      Buffer o2(DType::f64, {1, s.H, s.dv + 1});
      sp.o = o2.view();
      expect_error(on + " step o", [&] { hila::step(sp, ds); }, "o",
                   {shp({1, s.H, s.dv}), shp({1, s.H, s.dv + 1})});
    }
    {
      hila::StepParams sp = params();
      sp.cfg.op = op == Op::gla ? Op::hla2 : Op::gla;
      expect_error(on + " step op", [&] { hila::step(sp, ds); }, "op", {on});
    }
    {
      hila::StepParams sp = params();
      Buffer g2(DType::f64, {1, s.H + 1});
      sp.g = g2.view();
      expect_error(on + " step g", [&] { hila::step(sp, ds); }, "g", {shp({1, s.H}), shp({1, s.H + 1})});
    }
    {
      hila::StepParams sp = params();
      Buffer q3 = q;
      q3.set(1, kNaN);
      sp.q = q3.view();
      expect_error(on + " step NaN q", [&] { hila::step(sp, ds); }, "q", {"nan"});
    }
    {
      hila::StepParams sp = params();
      Buffer g3 = g;
      g3.set(0, 0.5);
      sp.g = g3.view();
      expect_error(on + " step g > 0", [&] { hila::step(sp, ds); }, "g", {"0.5"});
    }
    EXPECT_EQ(ds.position(0), 0) << on << ": rejected steps must not advance";
    hila::StepParams sp = params();
    expect_ok(on + " valid step", [&] { hila::step(sp, ds); });
    EXPECT_EQ(ds.position(0), 1);
  }
  // the functional step on a caller-owned state: validated like an initial state, plus the
  // Fenwick slot the step merges into
  {
    ProblemSpec s = base_spec(Op::loglinear_hla2);
    s.B = 1;
    s.T = 64;
    const Problem p = make_problem(s);
    const std::vector<int64_t> t = {63};
    Buffer q = gather_tokens(p.q, t), k = gather_tokens(p.k, t), v = gather_tokens(p.v, t),
           g = gather_tokens(p.g, t), lam = gather_tokens(p.lam, t);
    Buffer o(DType::f64, {1, s.H, s.dv});
    const hila::StepParams sp = step_params(s.cfg, q, k, v, g, lam, Buffer{}, o);
    StateBuffers st = hila::tools::make_state(s.cfg, 1, s.H, s.dk, s.dv, 63, DType::f64);
    st.pos.set(0, 63);
    ASSERT_EQ(st.H.shape[2], 7);
    expect_error("functional step 7 < 8 slots", [&] { hila::step(sp, st.view()); }, "state.H",
                 {"7", "8", "63", "64"});
    StateBuffers mixed = with_slots(st, 8);
    mixed.S = mixed.S.cast(DType::f32);
    expect_error("functional step mixed dtypes", [&] { hila::step(sp, mixed.view()); }, "state.S",
                 {"float32", "float64"});
    StateBuffers nopos = with_slots(st, 8);
    nopos.pos = Buffer{};
    expect_error("functional step without pos", [&] { hila::step(sp, nopos.view()); }, "state.pos");
    StateBuffers ok = with_slots(st, 8);
    expect_ok("functional step with 8 slots", [&] { hila::step(sp, ok.view()); });
    EXPECT_EQ(int64_t(ok.pos.get(0)), 64);
  }
  try {
    hila::DecodeState ds(hila::OpConfig{}, 0, 1, 4, 4, DType::f64);
    ADD_FAILURE() << "decode state with N = 0 accepted";
  } catch (const hila::Error& e) {
    EXPECT_NE(e.argument().find('N'), std::string::npos) << e.what();
    EXPECT_TRUE(contains(e.what(), "0")) << e.what();
  }
}

}  // namespace
}  // namespace hila_test
