// SPDX-License-Identifier: Apache-2.0
// The CUDA host path without host reads: decode steps with the caller's position bound
// (StepParams::max_position) and on state pools (StepParams::state_indices), captured in a CUDA
// graph and replayed for 32 tokens for every operator, equal to eager steps bit for bit; pooled
// steps equal to steps of the rows alone, with padding rows, rows outside the pool and positions
// past the bound; steps given step counters (StepParams::counters) equal to DecodeState steps bit
// for bit, plain and pooled, the counters zero after each; pooled forwards
// (ForwardParams::state_indices) equal to the call on the gathered
// rows; forwards and backwards from host copies of cu_seqlens and the initial positions, which
// read nothing back (hila::detail::device_reads() counts every device read of the host); memory
// errors; output checks on the device. Outputs are poisoned first. Without a GPU every test is
// skipped with a printed reason; the host emulator (no stream capture) skips the graph parts.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "../support_hila.h"
#include "core/host_mirror.h"
#include "cuda_support.h"
#include "device.h"

namespace hila_test {
namespace {

using hila::detail::device_reads;
using hila::tools::DevState;
using hila::tools::DevTensor;
using hila::tools::fetch_state;
using hila::tools::have_gpu;

constexpr const char* kNoGpu = "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";

Buffer int32s(const std::vector<int32_t>& v) {
  Buffer b(DType::i32, {int64_t(v.size())});
  for (size_t i = 0; i < v.size(); ++i) b.set(int64_t(i), v[i]);
  return b;
}

// A decode workload: a pool of P rows at random positions below `max_pos` - steps (canonical
// states, Fenwick room for max_pos + 1), and `steps` tokens of inputs for N sequences, λ levels for
// max_pos. bf16 inputs, fp32 states.
struct Decode {
  static constexpr int64_t kH = 2, kDk = 32;
  Op op;
  int64_t P, N, steps, max_pos, dv;
  Problem rows, toks;
  StateBuffers pool;  // fp32
  Decode(Op op_, int64_t P_, int64_t N_, int64_t steps_, int64_t max_pos_, int64_t dv_ = 32)
      : op(op_), P(P_), N(N_), steps(steps_), max_pos(max_pos_), dv(dv_) {
    const uint64_t seed = seed_of(op_tag(op) + "decode_graph");
    ProblemSpec s = spec_for(op, 1, seed);
    s.B = P, s.H = kH, s.dk = kDk, s.dv = dv;
    s.cfg.qk_l2norm = traits(op).delta;
    s.init_state = true;
    for (int64_t r = 0; r < P; ++r) s.init_pos.push_back((r * 37 + 11) % (max_pos - steps));
    const int64_t top = *std::max_element(s.init_pos.begin(), s.init_pos.end());
    s.init_extra_slots = int64_t(std::bit_width(uint64_t(max_pos + 1))) - int64_t(std::bit_width(uint64_t(top))) + 1;
    rows = make_problem(s);
    pool = rows.init.cast(DType::f32);
    ProblemSpec t = s;
    t.B = N, t.T = steps, t.init_state = false, t.init_pos = {}, t.init_extra_slots = 0, t.seed = seed + 1;
    t.extra_levels = traits(op).loglinear ? int64_t(std::bit_width(uint64_t(max_pos))) + 1 : 0;
    toks = cast_problem(make_problem(t), DType::bf16);
  }
  // token j of every sequence: [N, ...]
  std::vector<Buffer> token(int64_t j) const {
    const std::vector<int64_t> t(size_t(N), j);
    return {gather_tokens(toks.q, t), gather_tokens(toks.k, t), gather_tokens(toks.v, t),
            gather_tokens(toks.g, t), gather_tokens(toks.lam, t), gather_tokens(toks.beta, t)};
  }
};

// Step inputs in device buffers that keep their addresses (what a graph reads), refilled per token.
struct StaticInputs {
  std::deque<DevTensor> in;  // q, k, v, g, lam, beta
  DevTensor o;
  explicit StaticInputs(const std::vector<Buffer>& tok) : o(tok[2], true) {
    for (const Buffer& b : tok) in.emplace_back(b);
  }
  void load(const std::vector<Buffer>& tok, cudaStream_t s) {
    for (size_t i = 0; i < tok.size(); ++i)
      if (!tok[i].empty())
        DevTensor::check(cudaMemcpyAsync(in[i].p, tok[i].bytes.data(), tok[i].bytes.size(), cudaMemcpyHostToDevice, s),
                         "cudaMemcpyAsync");
  }
  hila::StepParams params(const OpConfig& cfg) const {
    hila::StepParams p;
    p.cfg = cfg;
    p.q = in[0].view(), p.k = in[1].view(), p.v = in[2].view(), p.g = in[3].view(), p.lam = in[4].view();
    p.beta = in[5].view(), p.o = o.view();
    return p;
  }
  Buffer fetch_o(cudaStream_t s) const {
    DevTensor::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return o.fetch();
  }
};

class CudaDecodeGraph : public ::testing::TestWithParam<Op> {};

// 32 tokens on a pool (rows at different positions, a padding row), eagerly and as replays of one
// captured step: every o and the final pool equal to the bit, and nothing read back to the host.
TEST_P(CudaDecodeGraph, CapturedStepsReplayToTheEagerSteps) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
#if defined(HILA_CUDA_EMU)
  GTEST_SKIP() << "the host emulator has no stream capture (CudaServing.* check the step's host path there)";
#else
  const Op op = GetParam();
  for (const bool pooled : {false, true}) {
    const std::string ctx = op_tag(op) + (pooled ? " pool" : " plain");
    constexpr int64_t kSteps = 32;
    const int64_t P = pooled ? 9 : 5, N = 5;
    const Decode d(op, P, N, kSteps, 255);
    const std::vector<int32_t> idx = {7, -1, 2, 8, 0};
    const DevTensor didx(int32s(idx));
    OpConfig cfg = d.rows.spec.cfg;
    cfg.check_values = false;
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    StaticInputs x(d.token(0));
    hila::StepParams p = x.params(cfg);
    p.stream = s;
    p.max_position = d.max_pos;
    if (pooled) p.state_indices = didx.view();
    // eager
    DevState eager(d.pool);
    std::vector<Buffer> want;
    for (int64_t j = 0; j < kSteps; ++j) {
      x.load(d.token(j), s);
      hila::step(p, eager.view());
      want.push_back(x.fetch_o(s));
    }
    // captured (after one eager warm-up step on a copy: the first step of a process sets up what a
    // capture must not)
    {
      DevState warm(d.pool);
      hila::step(p, warm.view());
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    }
    DevState graphed(d.pool);
    cudaGraph_t g = nullptr;
    cudaGraphExec_t gx = nullptr;
    const int64_t reads = device_reads();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    std::string err;
    try {
      hila::step(p, graphed.view());
    } catch (const std::exception& e) {
      err = e.what();
    }
    const cudaError_t end = cudaStreamEndCapture(s, &g);
    ASSERT_EQ(err, "") << ctx << ": the step under capture threw";
    ASSERT_EQ(end, cudaSuccess) << ctx << ": " << cudaGetErrorString(end);
    EXPECT_EQ(device_reads(), reads) << ctx << ": the step read device memory back to the host";
    size_t nodes = 0;
    ASSERT_EQ(cudaGraphGetNodes(g, nullptr, &nodes), cudaSuccess);
    std::vector<cudaGraphNode_t> list(nodes);
    ASSERT_EQ(cudaGraphGetNodes(g, list.data(), &nodes), cudaSuccess);
    for (cudaGraphNode_t n : list) {
      cudaGraphNodeType type;
      ASSERT_EQ(cudaGraphNodeGetType(n, &type), cudaSuccess);
      EXPECT_EQ(type, cudaGraphNodeTypeKernel) << ctx << ": the captured step has a node other than a kernel";
    }
    ASSERT_EQ(cudaGraphInstantiate(&gx, g, 0), cudaSuccess);
    for (int64_t j = 0; j < kSteps; ++j) {
      x.load(d.token(j), s);
      ASSERT_EQ(cudaGraphLaunch(gx, s), cudaSuccess);
      const Buffer o = x.fetch_o(s);
      EXPECT_TRUE(same_bytes(o, want[size_t(j)])) << ctx << ": o of token " << j;
      if (pooled)
        for (int64_t e = o.numel() / N; e < 2 * o.numel() / N; ++e) ASSERT_EQ(o.get(e), 0.0) << ctx << ": padding o";
    }
    EXPECT_TRUE(same_state(graphed.fetch(), eager.fetch())) << ctx << ": the state after " << kSteps << " tokens";
    cudaGraphExecDestroy(gx);
    cudaGraphDestroy(g);
    cudaStreamDestroy(s);
    std::printf("  %-28s %zu kernel nodes, %lld tokens replayed bit for bit\n", ctx.c_str(), nodes,
                static_cast<long long>(kSteps));
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(AllOps, CudaDecodeGraph, ::testing::ValuesIn(hila::all_ops()),
                         [](const auto& i) { return std::string(op_tag(i.param)); });

class CudaServing : public ::testing::TestWithParam<Op> {};

// A pooled step with the bound reads nothing back; it equals steps of the rows alone; padding rows
// give 0; a row outside the pool and a position past the bound give NaN and change nothing.
TEST_P(CudaServing, PooledStepReadsNothingAndEqualsStepsOfTheRows) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
  const Op op = GetParam();
  const std::string ctx = op_tag(op);
  const Decode d(op, 8, 6, 1, 127);
  StateBuffers pool = d.pool;
  pool.pos.set(5, 200);  // past the bound: this row does not step
  const std::vector<int32_t> idx = {6, -1, 1, 9, 5, 3};  // 9: outside the pool
  const DevTensor didx(int32s(idx));
  OpConfig cfg = d.rows.spec.cfg;
  cfg.check_values = false;
  const std::vector<Buffer> tok = d.token(0);
  StaticInputs x(tok);
  hila::StepParams p = x.params(cfg);
  p.max_position = d.max_pos;
  p.state_indices = didx.view();
  DevState dev(pool);
  const int64_t reads = device_reads();
  hila::step(p, dev.view());
  EXPECT_EQ(device_reads(), reads) << ctx << ": the step read device memory back to the host";
  const Buffer o = x.fetch_o(nullptr);
  const StateBuffers after = dev.fetch();
  const int64_t row = o.numel() / d.N;
  for (size_t i = 0; i < idx.size(); ++i) {
    const int32_t r = idx[i];
    const Buffer oi = slice_rows(o, int64_t(i), 1);
    if (r < 0 || r >= d.P || r == 5) {
      for (int64_t e = 0; e < row; ++e) {
        const double v = oi.get(e);
        if (r == -1) ASSERT_EQ(v, 0.0) << ctx << ": padding sequence " << i;
        else ASSERT_TRUE(std::isnan(v)) << ctx << ": sequence " << i << " (row " << r << ") must give NaN";
      }
      continue;
    }
    // the row alone, unpooled, with check_values on (its positions read on the host)
    std::vector<Buffer> one;
    for (const Buffer& b : tok) one.push_back(slice_rows(b, int64_t(i), 1));
    StaticInputs y(one);
    hila::StepParams q = y.params(d.rows.spec.cfg);
    DevState alone(state_row(pool, r));
    hila::step(q, alone.view());
    EXPECT_TRUE(same_bytes(oi, y.fetch_o(nullptr))) << ctx << ": o of sequence " << i;
    EXPECT_TRUE(same_state(state_row(after, r), alone.fetch())) << ctx << ": pool row " << r;
  }
  for (int64_t r : {0, 2, 4, 5, 7})
    EXPECT_TRUE(same_state(state_row(after, r), state_row(pool, r))) << ctx << ": row " << r << " must not change";
  // with value checks the indices and positions are read and checked on the host
  hila::StepParams c = p;
  c.cfg.check_values = true;
  try {
    hila::step(c, dev.view());
    ADD_FAILURE() << ctx << ": expected hila::Error for state_indices";
  } catch (const hila::Error& e) {
    EXPECT_EQ(e.argument(), "state_indices") << e.what();
  }
}

// A pooled forward (in place) equals the call on the gathered rows bit for bit; padding sequences
// give 0, untouched rows stay; with host copies of cu_seqlens and the positions, and value checks
// off, nothing is read back.
TEST_P(CudaServing, PooledForwardEqualsTheCallOnTheRows) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
  const Op op = GetParam();
  const std::string ctx = op_tag(op);
  ProblemSpec s = spec_for(op, 0, seed_of(ctx + "pool_forward_cuda"));
  s.seqlens = {70, 0, 9, 33};
  s.H = 2, s.dk = 32, s.dv = 32;
  s.cfg.qk_l2norm = traits(op).delta;
  s.cfg.check_values = false;
  s.init_state = true;
  s.init_pos = {64, 3, 0, 128};
  s.init_extra_slots = 1;
  const Problem f = cast_problem(make_problem(s), DType::bf16);
  const std::vector<int32_t> idx = {3, 0, -1, 5};
  // the pool: the sequences' states at their rows, other rows random
  ProblemSpec ps = s;
  ps.seqlens = {1, 1, 1, 1, 1, 1};
  ps.init_pos = {1, 2, 200, 7, 3, 5};  // the bit length of 128: the same Fenwick capacity
  ps.seed += 3;
  StateBuffers pool = cast_problem(make_problem(ps), DType::bf16).init;
  if (traits(op).loglinear) ASSERT_EQ(pool.H.shape[2], f.init.H.shape[2]);
  for (size_t i = 0; i < idx.size(); ++i)
    if (idx[i] >= 0) put_row(pool, idx[i], state_row(f.init, int64_t(i)));
  // the gathered call: padding sequence 2 from a zero state at position 0
  Problem g = f;
  StateBuffers zero = state_row(f.init, 2);
  for (Buffer* b : {&zero.pos, &zero.S, &zero.P, &zero.H})
    if (!b->empty()) b->fill(0);
  put_row(g.init, 2, zero);
  hila::tools::DeviceMirror m(hila::tools::cuda0());
  Buffer o_ref(f.v.dtype, f.v.shape), o(f.v.dtype, f.v.shape);
  StateBuffers fin_ref = hila::tools::make_state(s.cfg, 4, 2, 32, 32, 0, DType::f32);
  if (traits(op).loglinear) fin_ref = with_slots(fin_ref, pool.H.shape[2]);  // the pool's capacity
  {
    hila::ForwardParams p = g.forward_params(Form::chunk, 64);
    p.q = m.input(p.q), p.k = m.input(p.k), p.v = m.input(p.v), p.g = m.input(p.g), p.lam = m.input(p.lam);
    p.beta = m.input(p.beta), p.cu_seqlens = m.input(p.cu_seqlens), p.init = m.input(p.init);
    p.o = m.output(o_ref.view());
    p.final_state = m.output(fin_ref.view());
    hila::forward(p);
  }
  const DevTensor didx(int32s(idx));
  DevState dpool(pool);
  Buffer pos_host(DType::i64, {4});
  for (int64_t i = 0; i < 4; ++i) pos_host.set(i, idx[size_t(i)] < 0 ? 0 : f.init.pos.get(i));
  int64_t reads = 0;
  {
    hila::ForwardParams p = f.forward_params(Form::chunk, 64);
    p.q = m.input(p.q), p.k = m.input(p.k), p.v = m.input(p.v), p.g = m.input(p.g), p.lam = m.input(p.lam);
    p.beta = m.input(p.beta);
    p.cu_seqlens_host = f.cu_seqlens.view();
    p.cu_seqlens = m.input(p.cu_seqlens);
    p.init = dpool.view(), p.final_state = dpool.view();
    p.init_pos_host = pos_host.view();
    p.state_indices = didx.view();
    p.o = m.output(o.view());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    reads = device_reads();
    hila::forward(p);
    reads = device_reads() - reads;
  }
  m.finish();
  EXPECT_EQ(reads, 0) << ctx << ": the pooled forward read device memory back to the host";
  const StateBuffers after = dpool.fetch();
  int64_t row0 = 0;
  for (size_t i = 0; i < idx.size(); ++i) {
    const int64_t n = s.seqlens[i];
    const Buffer got = hila::tools::slice_time(o, row0, n), want = hila::tools::slice_time(o_ref, row0, n);
    row0 += n;
    if (idx[i] < 0) {
      for (int64_t e = 0; e < got.numel(); ++e) ASSERT_EQ(got.get(e), 0.0) << ctx << ": padding sequence " << i;
      continue;
    }
    EXPECT_TRUE(same_bytes(got, want)) << ctx << ": o of sequence " << i;
    EXPECT_TRUE(same_state(state_row(after, idx[i]), state_row(fin_ref, int64_t(i)))) << ctx << ": row " << idx[i];
  }
  for (int64_t r : {1, 2, 4})
    EXPECT_TRUE(same_state(state_row(after, r), state_row(pool, r))) << ctx << ": row " << r << " must not change";
}

// StepParams::counters: zeros of step_counters_size(N, H) elements on the device.
Buffer zero_counters(int64_t N, int64_t H) {
  Buffer b(DType::i32, {hila::step_counters_size(N, H)});
  b.fill(0);
  return b;
}

bool all_zero(const Buffer& b) {
  for (int64_t i = 0; i < b.numel(); ++i)
    if (b.get(i) != 0) return false;
  return true;
}

// A StateView step given counters is a DecodeState's step (same tiling, same launch): o and the
// state equal to the bit over several tokens, on a plain state and on a pool (a padding row, a row
// outside the pool, a row past the bound: o 0 or NaN, rows unchanged); the counters are zero after
// every step. dv = 96: dv' spans two column tiles, so the S operators split their columns and
// elect S's writer through the counters. Bad counters are a hila::Error naming `counters`.
TEST_P(CudaServing, StepWithCountersIsTheDecodeStateStep) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
  const Op op = GetParam();
  constexpr int64_t kSteps = 3, kDv = 96;
  for (const bool pooled : {false, true}) {
    const std::string ctx = op_tag(op) + (pooled ? " pool" : " plain");
    const int64_t P = pooled ? 8 : 4, N = pooled ? 5 : 4;
    const Decode d(op, P, N, kSteps, 127, kDv);
    StateBuffers pool = d.pool;
    if (pooled) pool.pos.set(5, 200);  // past the bound: this row does not step
    const std::vector<int32_t> idx = pooled ? std::vector<int32_t>{6, -1, 5, 9, 1} : std::vector<int32_t>{0, 1, 2, 3};
    OpConfig cfg = d.rows.spec.cfg;
    cfg.check_values = false;
    const DevTensor didx(int32s(idx));
    const DevTensor counters(zero_counters(N, Decode::kH));
    DevState dev(pool);
    // the DecodeStates: the whole state (plain), or each stepping row alone (pool: the tiling of a
    // step depends on its dv' and, past 4 (sequence, head) blocks per SM, on N H, not on its rows)
    std::vector<int64_t> real;  // sequences of the call that step, one DecodeState each (pool)
    for (int64_t i = 0; i < N; ++i)
      if (!pooled || (idx[size_t(i)] >= 0 && idx[size_t(i)] < P && idx[size_t(i)] != 5)) real.push_back(i);
    std::deque<hila::DecodeState> ds;
    for (int64_t i : pooled ? real : std::vector<int64_t>{0}) {
      const int64_t rows = pooled ? 1 : N;
      ds.emplace_back(cfg, rows, Decode::kH, Decode::kDk, kDv, DType::f32, hila::tools::cuda0());
      const DevState init(pooled ? state_row(pool, idx[size_t(i)]) : pool);
      ds.back().load(init.view());
    }
    for (int64_t j = 0; j < kSteps; ++j) {
      const std::vector<Buffer> tok = d.token(j);
      StaticInputs x(tok);
      hila::StepParams p = x.params(cfg);
      p.max_position = d.max_pos;
      if (pooled) p.state_indices = didx.view();
      p.counters = counters.view();
      hila::step(p, dev.view());
      const Buffer o = x.fetch_o(nullptr);
      ASSERT_TRUE(all_zero(counters.fetch())) << ctx << ": counters left non-zero by token " << j;
      for (size_t k = 0; k < ds.size(); ++k) {
        const int64_t i = pooled ? real[k] : 0, n = pooled ? 1 : N;
        std::vector<Buffer> one;
        for (const Buffer& b : tok) one.push_back(b.empty() ? b : slice_rows(b, i, n));
        StaticInputs y(one);
        hila::StepParams q = y.params(cfg);
        q.max_position = d.max_pos;
        hila::step(q, ds[k]);
        EXPECT_TRUE(same_bytes(slice_rows(o, i, n), y.fetch_o(nullptr))) << ctx << ": o of token " << j;
      }
      if (pooled) {
        const int64_t row = o.numel() / N;
        for (int64_t e = row; e < 2 * row; ++e) ASSERT_EQ(o.get(e), 0.0) << ctx << ": padding o";
        for (int64_t i : {2, 3})
          for (int64_t e = i * row; e < (i + 1) * row; ++e) ASSERT_TRUE(std::isnan(o.get(e))) << ctx << ": o of " << i;
      }
    }
    const StateBuffers after = dev.fetch();
    for (size_t k = 0; k < ds.size(); ++k) {
      const StateBuffers want = hila::tools::fetch_state(ds[k].view());
      const StateBuffers got = pooled ? state_row(after, idx[size_t(real[k])]) : after;
      EXPECT_TRUE(same_state(got, want)) << ctx << ": the state after " << kSteps << " tokens";
    }
    if (pooled)
      for (int64_t r : {0, 2, 3, 4, 5, 7})
        EXPECT_TRUE(same_state(state_row(after, r), state_row(pool, r))) << ctx << ": row " << r << " must not change";
    // bad counters: named, before anything is written
    const std::vector<Buffer> tok = d.token(0);
    StaticInputs x(tok);
    hila::StepParams p = x.params(cfg);
    p.max_position = d.max_pos;
    if (pooled) p.state_indices = didx.view();
    const StateBuffers before = dev.fetch();
    Buffer c64(DType::i64, {hila::step_counters_size(N, Decode::kH)});
    c64.fill(0);
    const DevTensor wide(c64), small(zero_counters(N - 1, Decode::kH));
    const Buffer host = zero_counters(N, Decode::kH);
    hila::TensorView two_d = counters.view();
    two_d.ndim = 2, two_d.shape[0] = 1, two_d.shape[1] = host.numel(), two_d.stride[0] = host.numel(), two_d.stride[1] = 1;
    hila::TensorView on_o = x.o.view();
    on_o.dtype = DType::i32, on_o.ndim = 1, on_o.shape[0] = hila::step_counters_size(N, Decode::kH), on_o.stride[0] = 1;
    const std::pair<const char*, hila::TensorView> bad[] = {
        {"int64", wide.view()}, {"too small", small.view()}, {"host memory", host.view()},
        {"two dimensions", two_d}, {"aliasing o", on_o}};
    for (const auto& [what, c] : bad) {
      p.counters = c;
      try {
        hila::step(p, dev.view());
        ADD_FAILURE() << ctx << ": expected hila::Error('counters') for counters " << what;
      } catch (const hila::Error& e) {
        EXPECT_EQ(e.argument(), "counters") << ctx << ", counters " << what << ": " << e.what();
      }
    }
    EXPECT_TRUE(same_state(dev.fetch(), before)) << ctx << ": a rejected step changed the state";
    if (!pooled) {  // a DecodeState owns its counters
      p.counters = counters.view();
      try {
        hila::step(p, ds.front());
        ADD_FAILURE() << ctx << ": expected hila::Error('counters') for a DecodeState step";
      } catch (const hila::Error& e) {
        EXPECT_EQ(e.argument(), "counters") << e.what();
      }
    }
    std::printf("  %-16s %lld tokens equal to the DecodeState's, counters zero after each\n", ctx.c_str(),
                static_cast<long long>(kSteps));
  }
}

INSTANTIATE_TEST_SUITE_P(AllOps, CudaServing, ::testing::ValuesIn(hila::all_ops()),
                         [](const auto& i) { return std::string(op_tag(i.param)); });

// Forward and backward with cu_seqlens_host and init_pos_host, value checks off: nothing read
// back, the results of the call that reads them, bit for bit; also through the kernel uploads
// (HILA_UPLOAD_KERNEL=1, the route a capture takes).
TEST(CudaHostCopies, ForwardBackwardReadNothing) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
  for (const Op op : {Op::hla2, Op::loglinear, Op::gdn}) {
    ProblemSpec s = spec_for(op, 0, seed_of(op_tag(op) + "host_copies_cuda"));
    s.seqlens = {40, 0, 77};
    s.H = 2, s.dk = 32, s.dv = 32;
    s.cfg.qk_l2norm = traits(op).delta;
    s.cfg.check_values = false;
    s.init_state = true;
    s.init_pos = {5, 0, 64};
    const Problem f = cast_problem(make_problem(s), DType::bf16);
    auto run = [&](bool host, int64_t& reads) {
      hila::tools::DeviceMirror m(hila::tools::cuda0());
      Result r;
      r.o = Buffer(f.v.dtype, f.v.shape);
      r.dq = Buffer(f.q.dtype, f.q.shape), r.dk = Buffer(f.k.dtype, f.k.shape), r.dv = Buffer(f.v.dtype, f.v.shape);
      hila::BackwardParams p;
      static_cast<hila::ForwardParams&>(p) = f.forward_params(Form::chunk, 64);
      p.q = m.input(p.q), p.k = m.input(p.k), p.v = m.input(p.v), p.g = m.input(p.g), p.lam = m.input(p.lam);
      p.beta = m.input(p.beta), p.cu_seqlens = m.input(p.cu_seqlens), p.init = m.input(p.init);
      if (host) p.cu_seqlens_host = f.cu_seqlens.view(), p.init_pos_host = f.init.pos.view();
      p.o = m.output(r.o.view());
      p.d_o = m.input(f.d_o.view());
      p.dq = m.output(r.dq.view()), p.dk = m.output(r.dk.view()), p.dv = m.output(r.dv.view());
      DevTensor::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      reads = device_reads();
      hila::backward(p);
      reads = device_reads() - reads;
      m.finish();
      return r;
    };
    for (const char* upload : {static_cast<const char*>(nullptr), "1"}) {
      const std::string ctx = op_tag(op) + (upload ? " kernel uploads" : "");
      Result with, without;
      int64_t r_with = 0, r_without = 0;
      const std::string err = hila::tools::with_env("HILA_UPLOAD_KERNEL", upload, [&] {
        without = run(false, r_without);
        with = run(true, r_with);
      });
      ASSERT_EQ(err, "") << ctx;
      EXPECT_EQ(r_with, 0) << ctx << ": host copies given, yet device memory was read back";
      EXPECT_GT(r_without, 0) << ctx << ": without host copies cu_seqlens and init.pos are read";
      for (const auto& [name, e] : hila::tools::compare(with, without)) EXPECT_EQ(e, 0.0) << ctx << ": " << name;
    }
  }
}

// Memory: a call (or a decode state) past the configured limit is hila::Error naming the bytes and
// the device, before anything runs; a non-finite output from finite inputs is named on the device.
TEST(CudaMemory, ConfiguredLimitAndOutputChecks) {
  if (!have_gpu()) GTEST_SKIP() << kNoGpu;
  ProblemSpec s = spec_for(Op::hla2, 256, 3);
  s.B = 2, s.H = 2, s.dk = 32, s.dv = 32;
  const Problem f = cast_problem(make_problem(s), DType::f32);
  struct Limit {  // the configured limit for this scope only
    explicit Limit(int64_t b) { hila::set_memory_limit(b); }
    ~Limit() { hila::set_memory_limit(0); }
  };
  {
    hila::tools::DeviceMirror m(hila::tools::cuda0());
    Buffer o(f.v.dtype, f.v.shape);
    hila::ForwardParams p = f.forward_params(Form::chunk, 64);
    p.q = m.input(p.q), p.k = m.input(p.k), p.v = m.input(p.v), p.g = m.input(p.g);
    p.o = m.output(o.view());
    const Limit limit(int64_t(64) << 10);  // 64 KiB: less than o alone
    try {
      hila::forward(p);
      ADD_FAILURE() << "expected hila::Error('memory') past the configured limit";
    } catch (const hila::Error& e) {
      EXPECT_EQ(e.argument(), "memory") << e.what();
      EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
      std::printf("  %s\n", e.what());
    }
    try {
      hila::OpConfig cfg;
      cfg.op = Op::gla;
      hila::DecodeState ds(cfg, 64, 8, 64, 64, DType::f32, hila::tools::cuda0());
      ADD_FAILURE() << "expected hila::Error for a decode state past the configured limit";
    } catch (const hila::Error& e) {
      EXPECT_EQ(e.argument(), "N/H/dk/dv") << e.what();
      EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
    }
  }
  // scale far past float32: the scores overflow, o is not finite; the check runs on the device
  Problem big = f;
  big.spec.cfg.scale = 1e30;
  big.spec.cfg.check_values = true;
  try {
    hila::tools::run_forward(big, Form::chunk, 64, hila::tools::cuda0());
    ADD_FAILURE() << "expected hila::Error('o') for a non-finite output";
  } catch (const hila::Error& e) {
    EXPECT_EQ(e.argument(), "o") << e.what();
    EXPECT_NE(std::string(e.what()).find("scale"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace hila_test
