// SPDX-License-Identifier: Apache-2.0
// CUDA decode steps (src/cuda/step/) against the CPU float64 naive forward on the same rounded
// inputs: a prefill state of n tokens (CPU naive, float64, then rounded to the state dtype) is
// loaded into a CUDA DecodeState, m tokens are decoded on the GPU, and every decoded o and the
// final state are compared with one full forward over n + m tokens. Covers every operator (HLA
// family with normalize / untied gates / ridge / GQA, delta ops with qk_l2norm), bf16 / f32 / f64,
// prefill lengths around the Fenwick powers of two, positions past 2^17, sequences at different
// positions, the functional in-place step, and bad input. Outputs are poisoned (0xff) first.
// Without a GPU every test is skipped with a printed reason.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "../support_hila.h"
#include "cuda_support.h"

namespace hila_test {
namespace {

using hila::tools::cast_problem;
using hila::tools::DevState;
using hila::tools::DevTensor;
using hila::tools::fetch_state;
using hila::tools::have_gpu;
using hila::tools::make_problem;
using hila::tools::rel_err;

constexpr const char* kNoGpu = "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";

struct StepCase {
  std::string name;
  Op op;
  DType dtype;
  int64_t N, G, H, dk, dv;
  std::vector<int64_t> prefill;  // prefill lengths n (all sequences at n)
  int64_t m;                     // decoded tokens
  bool normalize = false, untied = false, l2 = false;
  double ridge = 0;
  std::vector<int64_t> init_pos;  // non-empty: start from a random state at these positions
};

void PrintTo(const StepCase& c, std::ostream* os) { *os << c.name; }

ProblemSpec spec_of(const StepCase& c, int64_t T) {
  ProblemSpec s;
  s.cfg.op = c.op;
  s.cfg.normalize = c.normalize;
  s.cfg.gates = c.untied ? Gates::untied : Gates::tied;
  s.cfg.ridge = c.ridge;
  s.cfg.qk_l2norm = c.l2;
  s.nonneg = c.normalize;  // keeps the denominators away from zero (docs/math/HLA.md §4)
  s.B = c.N, s.T = T, s.G = c.G, s.H = c.H, s.dk = c.dk, s.dv = c.dv;
  s.init_state = !c.init_pos.empty();
  s.init_pos = c.init_pos;
  s.dtype = DType::f64;
  s.seed = seed_of(c.name);
  return s;
}

// One decode step on the device for tokens t[i] of the (low-precision) problem; returns o.
Buffer device_step(const Problem& low, const std::vector<int64_t>& t, hila::DecodeState* ds,
                   const hila::StateView* sv) {
  const Buffer q = gather_tokens(low.q, t), k = gather_tokens(low.k, t), v = gather_tokens(low.v, t);
  const Buffer g = gather_tokens(low.g, t), lam = gather_tokens(low.lam, t), beta = gather_tokens(low.beta, t);
  DevTensor dq(q), dk(k), dv(v), dg(g), dlam(lam), dbeta(beta), o(v, true);
  hila::StepParams sp;
  sp.cfg = low.spec.cfg;
  sp.cfg.check_values = true;
  sp.q = dq.view(), sp.k = dk.view(), sp.v = dv.view(), sp.g = dg.view(), sp.lam = dlam.view();
  sp.beta = dbeta.view(), sp.o = o.view();
  if (ds) hila::step(sp, *ds);
  else hila::step(sp, *sv);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return o.fetch();
}

double tol_of(DType dt) { return fwd_tol(dt); }

// Prints and checks every state part; returns the worst.
void expect_state_close(const StateBuffers& got, const StateBuffers& want, double tol, const std::string& ctx) {
  const auto part = [&](const char* name, const Buffer& a, const Buffer& b) {
    if (a.empty() && b.empty()) return;
    StateBuffers x, y;
    x.H = a, y.H = b;
    const double e = state_err(x, y);
    std::printf("  %-44s %-6s rel err %.2e\n", ctx.c_str(), name, e);
    EXPECT_LE(e, tol) << ctx << ": state part " << name;
  };
  part("S", got.S, want.S);
  part("P", got.P, want.P);
  part("H", got.H, want.H);
  ASSERT_EQ(got.pos.numel(), want.pos.numel()) << ctx;
  for (int64_t i = 0; i < got.pos.numel(); ++i)
    EXPECT_EQ(got.pos.get(i), want.pos.get(i)) << ctx << ": pos of sequence " << i;
}

class CudaStep : public ::testing::TestWithParam<StepCase> {};

// Prefill (CPU) -> load into a CUDA DecodeState -> m GPU steps == one naive forward over n + m.
TEST_P(CudaStep, PrefillThenDecodeMatchesNaiveFloat64) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
  const StepCase& c = GetParam();
  const double tol = tol_of(c.dtype);
  const DType sdt = hila::tools::state_dtype(c.dtype);
  const bool from_init = !c.init_pos.empty();
  const std::vector<int64_t> ns = from_init ? std::vector<int64_t>{0} : c.prefill;
  int64_t nmax = 0;
  for (int64_t n : ns) nmax = std::max(nmax, n);
  const Problem low = cast_problem(make_problem(spec_of(c, nmax + c.m)), c.dtype);
  const Problem ref_in = cast_problem(low, DType::f64);
  const Result ref = hila::tools::run_forward(ref_in, Form::naive);
  ASSERT_TRUE(all_finite(ref.o)) << c.name;

  for (int64_t n : ns) {
    const std::string ctx = c.name + " n=" + std::to_string(n);
    hila::DecodeState ds(low.spec.cfg, c.N, c.H, c.dk, c.dv, sdt, hila::tools::cuda0());
    std::vector<int64_t> start(size_t(c.N), n);
    if (from_init) {  // a random canonical state at init_pos (beyond 2^17, different per sequence)
      const DevState init(low.init);
      ds.load(init.view());
      for (int64_t i = 0; i < c.N; ++i) start[size_t(i)] = low.start_pos(i);
    } else if (n > 0) {
      const Result pre = hila::tools::run_forward(hila::tools::prefix(ref_in, n), Form::naive);
      const DevState init(pre.final_state.cast(sdt));
      ds.load(init.view());
    }
    for (int64_t i = 0; i < c.N; ++i) ASSERT_EQ(ds.position(i), start[size_t(i)]) << ctx;
    double worst = 0;
    int64_t worst_j = -1;
    for (int64_t j = 0; j < c.m; ++j) {
      std::vector<int64_t> t(size_t(c.N), n + j);  // token index along T (not the position)
      const Buffer o = device_step(low, t, &ds, nullptr);
      const double e = rel_err(o, gather_tokens(ref.o, t));
      if (!(e <= worst)) worst = e, worst_j = j;
    }
    std::printf("  %-44s %-6s rel err %.2e (worst at step %lld of %lld)\n", ctx.c_str(), "o", worst,
                static_cast<long long>(worst_j), static_cast<long long>(c.m));
    EXPECT_LE(worst, tol) << ctx << ": decoded o, worst at step " << worst_j;
    for (int64_t i = 0; i < c.N; ++i) EXPECT_EQ(ds.position(i), start[size_t(i)] + c.m) << ctx;
    // final state vs the naive forward over the first n + m tokens
    const Result want = n + c.m == nmax + c.m ? ref
                                              : hila::tools::run_forward(hila::tools::prefix(ref_in, n + c.m), Form::naive);
    expect_state_close(fetch_state(ds.view()), want.final_state, tol, ctx);
  }
}

// The functional form on a caller-owned device state with room for the last step.
TEST_P(CudaStep, FunctionalStepInPlace) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
  const StepCase& c = GetParam();
  if (!c.init_pos.empty()) GTEST_SKIP() << "covered by the prefill cases";
  const double tol = tol_of(c.dtype);
  const DType sdt = hila::tools::state_dtype(c.dtype);
  const int64_t n = c.prefill.back();
  const Problem low = cast_problem(make_problem(spec_of(c, n + c.m)), c.dtype);
  const Problem ref_in = cast_problem(low, DType::f64);
  const Result ref = hila::tools::run_forward(ref_in, Form::naive);
  StateBuffers st = hila::tools::make_state(low.spec.cfg, c.N, c.H, c.dk, c.dv, n + c.m, sdt);
  if (n > 0) {
    const Result pre = hila::tools::run_forward(hila::tools::prefix(ref_in, n), Form::naive);
    StateBuffers s0 = pre.final_state.cast(sdt);
    if (!st.H.empty() && st.H.shape.size() == 5) s0 = with_slots(s0, st.H.shape[2]);
    st = s0;
  }
  const DevState dst(st);
  const hila::StateView sv = dst.view();
  double worst = 0;
  for (int64_t j = 0; j < c.m; ++j) {
    std::vector<int64_t> t(size_t(c.N), n + j);
    worst = std::max(worst, rel_err(device_step(low, t, nullptr, &sv), gather_tokens(ref.o, t)));
  }
  const std::string ctx = c.name + " functional n=" + std::to_string(n);
  std::printf("  %-44s %-6s rel err %.2e\n", ctx.c_str(), "o", worst);
  EXPECT_LE(worst, tol) << ctx;
  expect_state_close(dst.fetch(), ref.final_state, tol, ctx);
}

std::vector<StepCase> step_cases() {
  std::vector<StepCase> cs;
  const std::vector<int64_t> fenwick_ns = {0, 1, 63, 64, 65, 127, 128, 129, 255, 256};
  const int64_t k2_17 = int64_t(1) << 17;
  for (Op op : hila::all_ops()) {
    const hila::OpTraits t = traits(op);
    const std::string on = op_tag(op);
    const std::vector<int64_t> ns = t.loglinear ? fenwick_ns : std::vector<int64_t>{0, 1, 65};
    // bf16, GQA (2 groups of 2 heads), dk = dv = 64
    cs.push_back({on + "_bf16_d64_gqa", op, DType::bf16, 2, 2, 4, 64, 64, ns, 3});
    // f32, dv not a multiple of 32 (a partial column tile)
    cs.push_back({on + "_f32_dk32_dv24", op, DType::f32, 2, 1, 2, 32, 24, ns, 3});
    // the benchmark shape dk = dv = 128, and a wide dv
    cs.push_back({on + "_bf16_d128", op, DType::bf16, 2, 1, 2, 128, 128, {65}, 2});
    cs.push_back({on + "_f32_dk256_dv200", op, DType::f32, 1, 1, 2, 256, 200, {33}, 2});
    cs.push_back({on + "_f16_d64", op, DType::f16, 1, 1, 2, 64, 64, {65}, 2});
    // a wide grid: 64 sequences
    if (t.loglinear) cs.push_back({on + "_bf16_wide_grid", op, DType::bf16, 64, 1, 4, 64, 128, {65}, 2});
    // extras: normalize + untied gates (+ ridge for hla2) for the HLA family, qk_l2norm for delta
    if (t.hla_family) {
      const double ridge = t.has_S && !t.has_P ? 0.3 : 0.0;
      StepCase e{on + "_f32_normalize_untied", op, DType::f32, 2, 1, 2, 32, 24, {0, 64, 129}, 3};
      e.normalize = true, e.untied = true, e.ridge = ridge;
      cs.push_back(e);
      StepCase b{on + "_bf16_normalize_d128", op, DType::bf16, 2, 2, 4, 128, 128, {65}, 2};
      b.normalize = true, b.ridge = ridge;
      cs.push_back(b);
      StepCase u{on + "_bf16_untied_gqa", op, DType::bf16, 2, 1, 4, 64, 64, {63}, 3};
      u.untied = true;
      cs.push_back(u);
      StepCase d{on + "_f64_normalize_untied", op, DType::f64, 1, 1, 2, 16, 16, {t.loglinear ? 63 : 5}, 3};
      d.normalize = true, d.untied = true, d.ridge = ridge;
      cs.push_back(d);
    } else {
      StepCase d{on + "_f64", op, DType::f64, 1, 1, 2, 16, 16, {t.loglinear ? 63 : 5}, 3};
      d.l2 = t.delta;
      cs.push_back(d);
    }
    if (t.delta) {
      StepCase l{on + "_bf16_l2norm", op, DType::bf16, 2, 1, 2, 64, 64, {65}, 3};
      l.l2 = true;
      cs.push_back(l);
    }
    // start past 2^17, three sequences at different positions, crossing 2^17 while decoding
    StepCase far{on + "_f32_far", op, DType::f32, 3, 1, 2, 32, 32, {}, 6};
    far.init_pos = {5, k2_17 - 3, k2_17 + 64};
    cs.push_back(far);
  }
  return cs;
}

INSTANTIATE_TEST_SUITE_P(AllOps, CudaStep, ::testing::ValuesIn(step_cases()),
                         [](const ::testing::TestParamInfo<StepCase>& i) { return i.param.name; });

// ---- bad input ----------------------------------------------------------------------------------

template <class F>
void expect_error(const std::string& ctx, F&& f, const std::string& arg, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << ctx << ": expected hila::Error for argument '" << arg << "', got no error";
  } catch (const hila::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.argument(), arg) << ctx << ": " << msg;
    for (const auto& s : needles) EXPECT_NE(msg.find(s), std::string::npos) << ctx << ": '" << s << "' not in: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << ctx << ": expected hila::Error, got " << e.what();
  }
}

// Prefill(n) on the GPU (chunk form, final state written on the device), then decode(m) on the GPU
// from that state, equals one full forward, for every n in 0..300 (n = 64 * 2^k and 64 * 2^k +- 1
// included; docs/math/LOGLINEAR.md §3.5). One naive float64 reference per case. `chunk`: the prefill's C.
void prefill_then_decode(const StepCase& c, int64_t chunk = 64) {
  constexpr int64_t kMaxN = 300;
  const Problem low = cast_problem(make_problem(spec_of(c, kMaxN + c.m)), c.dtype);
  const Problem ref_in = cast_problem(low, DType::f64);
  const Result ref = hila::tools::run_forward(ref_in, Form::naive);
  const DType sdt = hila::tools::state_dtype(c.dtype);
  double worst = 0;
  int64_t worst_n = -1;
  for (int64_t n = 0; n <= kMaxN; ++n) {
    hila::DecodeState ds(low.spec.cfg, c.N, c.H, c.dk, c.dv, sdt, hila::tools::cuda0());
    if (n > 0) {  // GPU prefill of the first n tokens
      const Problem pre = hila::tools::prefix(low, n);
      DevTensor q(pre.q), k(pre.k), v(pre.v), g(pre.g), lam(pre.lam), beta(pre.beta), o(pre.v, true);
      const DevState fin(hila::tools::make_state(low.spec.cfg, c.N, c.H, c.dk, c.dv, n, sdt), true);
      hila::ForwardParams f = pre.forward_params(Form::chunk, chunk);
      f.q = q.view(), f.k = k.view(), f.v = v.view(), f.g = g.view(), f.lam = lam.view(), f.beta = beta.view();
      f.o = o.view();
      f.final_state = fin.view();
      hila::forward(f);
      ds.load(fin.view());
    }
    for (int64_t j = 0; j < c.m; ++j) {
      const std::vector<int64_t> t(size_t(c.N), n + j);
      const double e = rel_err(device_step(low, t, &ds, nullptr), gather_tokens(ref.o, t));
      if (!(e <= worst)) worst = e, worst_n = n;
    }
    for (int64_t i = 0; i < c.N; ++i) ASSERT_EQ(ds.position(i), n + c.m) << c.name << " n=" << n;
  }
  std::printf("  %-44s %-6s rel err %.2e (worst at n = %lld)\n", c.name.c_str(), "o", worst,
              static_cast<long long>(worst_n));
  EXPECT_LE(worst, tol_of(c.dtype)) << c.name << ": worst at prefill n = " << worst_n;
}

// float32, small heads: the generic chunk paths of every operator.
class CudaPrefillDecode : public ::testing::TestWithParam<Op> {};

TEST_P(CudaPrefillDecode, EveryPrefillLengthUpTo300) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
  const Op op = GetParam();
  prefill_then_decode({std::string(op_tag(op)) + "_prefill_sweep", op, DType::f32, 2, 1, 2, 16, 16, {0}, 3});
}

INSTANTIATE_TEST_SUITE_P(AllOps, CudaPrefillDecode, ::testing::ValuesIn(hila::all_ops()),
                         [](const auto& info) { return std::string(op_tag(info.param)); });

// bf16, dk = dv = 32: the log-linear prefill runs the chunk-parallel tree form, whose final state
// comes from the pending tree nodes and the last partial chunk (docs/API.md).
class CudaPrefillDecodeTree : public ::testing::TestWithParam<Op> {};

TEST_P(CudaPrefillDecodeTree, EveryPrefillLengthUpTo300) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
  const Op op = GetParam();
  prefill_then_decode({std::string(op_tag(op)) + "_prefill_tree", op, DType::bf16, 2, 1, 2, 32, 32, {0}, 2});
}

INSTANTIATE_TEST_SUITE_P(LogLinear, CudaPrefillDecodeTree, ::testing::Values(Op::loglinear, Op::loglinear_hla2),
                         [](const auto& info) { return std::string(op_tag(info.param)); });

// bf16, dk = dv = 32, prefills in chunks of 16 (the GLA family takes chunk sizes below 64 on CUDA):
// the final state after a partial chunk of a short chunk, on the tensor-core paths.
class CudaPrefillDecodeChunk16 : public ::testing::TestWithParam<Op> {};

TEST_P(CudaPrefillDecodeChunk16, EveryPrefillLengthUpTo300) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
  const Op op = GetParam();
  prefill_then_decode({std::string(op_tag(op)) + "_prefill_chunk16", op, DType::bf16, 2, 1, 2, 32, 32, {0}, 2}, 16);
}

INSTANTIATE_TEST_SUITE_P(GlaFamily, CudaPrefillDecodeChunk16, ::testing::Values(Op::gla, Op::hla2, Op::ahla, Op::hla3),
                         [](const auto& info) { return std::string(op_tag(info.param)); });

TEST(CudaStepErrors, BadStatesAreClearErrors) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
  StepCase c{"errors", Op::loglinear_hla2, DType::f32, 1, 1, 2, 16, 16, {63}, 1};
  const Problem low = cast_problem(make_problem(spec_of(c, 64)), c.dtype);
  const int64_t n = 63;  // the step 63 -> 64 needs bitlen(64) + 1 = 8 slots
  const std::vector<int64_t> t = {n};
  const Buffer q = gather_tokens(low.q, t), k = gather_tokens(low.k, t), v = gather_tokens(low.v, t);
  const Buffer g = gather_tokens(low.g, t), lam = gather_tokens(low.lam, t);
  DevTensor dq(q), dk(k), dv(v), dg(g), dlam(lam), o(v, true);
  hila::StepParams sp;
  sp.cfg = low.spec.cfg;
  sp.q = dq.view(), sp.k = dk.view(), sp.v = dv.view(), sp.g = dg.view(), sp.lam = dlam.view(), sp.o = o.view();
  // a state of the right layout at position 63 with only bitlen(63) + 1 = 7 slots
  StateBuffers few = hila::tools::make_state(low.spec.cfg, 1, 2, 16, 16, n, DType::f32);
  few.pos.set(0, double(n));
  ASSERT_EQ(few.H.shape[2], 7);
  {
    const DevState s(few);
    expect_error("too few slots", [&] { hila::step(sp, s.view()); }, "state.H", {"needs 8", "7"});
  }
  {  // the same state in host memory with device inputs
    expect_error("host state", [&] { hila::step(sp, few.view()); }, "state.pos", {"cuda"});
  }
  {  // float64 state with float32 inputs on the device
    StateBuffers s64 = with_slots(few, 8).cast(DType::f64);
    const DevState s(s64);
    expect_error("f64 state, f32 inputs", [&] { hila::step(sp, s.view()); }, "state", {"float32", "float64"});
  }
  {  // bf16 state parts
    StateBuffers sb = with_slots(few, 8);
    sb.H = sb.H.cast(DType::bf16);
    const DevState s(sb);
    expect_error("bf16 state", [&] { hila::step(sp, s.view()); }, "state.H", {"bfloat16"});
  }
  {  // DecodeState: float64 on the device with float32 inputs
    hila::DecodeState ds(low.spec.cfg, 1, 2, 16, 16, DType::f64, hila::tools::cuda0());
    expect_error("f64 DecodeState", [&] { hila::step(sp, ds); }, "state", {"float32"});
    EXPECT_EQ(ds.position(0), 0);
  }
  {  // DecodeState on the device, inputs on the host
    hila::DecodeState ds(low.spec.cfg, 1, 2, 16, 16, DType::f32, hila::tools::cuda0());
    Buffer oh = v;
    hila::StepParams hp = step_params(low.spec.cfg, q, k, v, g, lam, Buffer{}, oh);
    expect_error("host inputs", [&] { hila::step(hp, ds); }, "q", {"cuda"});
  }
  {  // load of a host state into a device DecodeState
    hila::DecodeState ds(low.spec.cfg, 1, 2, 16, 16, DType::f32, hila::tools::cuda0());
    expect_error("host load", [&] { ds.load(few.view()); }, "state.pos", {"cuda"});
  }
}

// reserve() grows the Fenwick capacity; load + steps keep matching after a reallocation.
TEST(CudaStepErrors, ReserveAndBytes) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
  hila::OpConfig cfg;
  cfg.op = Op::loglinear;
  hila::DecodeState ds(cfg, 2, 4, 64, 64, DType::f32, hila::tools::cuda0());
  EXPECT_EQ(ds.slots(), 2);
  const int64_t b0 = ds.bytes_per_sequence();
  ds.reserve(int64_t(1) << 20);
  EXPECT_EQ(ds.slots(), hila::state_slots(int64_t(1) << 20));
  EXPECT_EQ(ds.bytes_per_sequence(), (b0 - 8) / 2 * ds.slots() + 8);
  const hila::StateView v = ds.view();
  EXPECT_EQ(v.H.device.type, hila::DeviceType::cuda);
  EXPECT_EQ(v.H.shape[2], ds.slots());
}

}  // namespace
}  // namespace hila_test
