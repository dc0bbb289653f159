// SPDX-License-Identifier: Apache-2.0
// Caller workspaces (ForwardParams::workspace): hila::workspace_size reports the bytes a call takes,
// a call given exactly that many (poisoned) bytes takes nothing from the stream-ordered pool and
// gives the pool path's results, and a workspace that is too small or not device memory is a clear
// error before any work. Without a GPU every test is skipped with a printed reason.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda_support.h"
#include "device.h"
#include "problem.h"

namespace hila::tools {
namespace {

struct WsCase {
  Op op;
  DType dtype;
  int64_t B, T, G, H, dk, dv;
  std::vector<int64_t> seqlens;
  bool init, normalize;
  std::string name;
  std::vector<int64_t> init_pos = {};  // empty: the problem's default
  const char* pieces = nullptr;         // HILA_DELTA_PIECES for the calls (gdn's WY and sweeps in pieces)
  const char* segment = nullptr;        // HILA_LOGLINEAR_TREE_SEGMENT (the tree passes in segments, a temporary of roots)
};

std::vector<WsCase> ws_cases() {
  const std::vector<int64_t> varlen = {0, 100, 0, 64, 1, 257};
  return {
      {Op::gla, DType::bf16, 2, 300, 4, 4, 64, 64, {}, true, false, "gla_bf16_in_place"},
      {Op::gla, DType::f32, 1, 0, 1, 4, 32, 32, varlen, true, false, "gla_f32_varlen"},
      {Op::hla2, DType::bf16, 1, 0, 1, 4, 64, 64, varlen, true, true, "hla2_bf16_varlen_normalize"},
      {Op::ahla, DType::bf16, 2, 130, 1, 4, 64, 64, {}, true, false, "ahla_bf16_gqa4"},
      {Op::hla3, DType::f32, 2, 200, 2, 4, 32, 24, {}, true, false, "hla3_f32"},
      {Op::loglinear, DType::bf16, 2, 1000, 1, 4, 64, 64, {}, true, false, "loglinear_bf16"},
      // the tree backward from states: aligned (seeded), and unaligned (head rows swept first)
      {Op::loglinear, DType::bf16, 1, 0, 1, 2, 64, 64, varlen, true, false, "loglinear_bf16_varlen_at128", {128}},
      {Op::loglinear, DType::bf16, 2, 300, 1, 2, 64, 64, {}, true, false, "loglinear_bf16_at77", {77}},
      // the tree passes in segments of 4 chunks
      {Op::loglinear, DType::bf16, 1, 0, 1, 2, 64, 64, varlen, false, false, "loglinear_bf16_varlen_segments", {}, nullptr,
       "2"},
      {Op::loglinear_hla2, DType::f32, 1, 0, 1, 2, 32, 32, varlen, true, false, "loglinear_hla2_f32_varlen"},
      {Op::gdn, DType::f32, 2, 300, 2, 2, 32, 32, {}, true, false, "gdn_f32"},
      {Op::gdn, DType::bf16, 1, 0, 2, 4, 64, 64, varlen, true, false, "gdn_bf16_varlen_tc"},
      // in pieces: the backward's cotangent carry is a temporary of its own
      {Op::gdn, DType::bf16, 2, 300, 2, 2, 64, 64, {}, false, false, "gdn_bf16_pieces3", {}, "3"},
      {Op::loglinear_gdn, DType::bf16, 2, 200, 2, 2, 64, 64, {}, true, false, "loglinear_gdn_bf16"},
  };
}

Problem ws_problem(const WsCase& c) {
  ProblemSpec s;
  s.cfg.op = c.op;
  s.cfg.normalize = c.normalize;
  s.cfg.check_values = false;  // the value scans take 8 bytes of the pool (outside the workspace)
  s.nonneg = c.normalize;
  s.B = c.B, s.T = c.T, s.G = c.G, s.H = c.H, s.dk = c.dk, s.dv = c.dv;
  s.seqlens = c.seqlens;
  s.init_state = c.init;
  s.init_pos = c.init_pos;
  s.dtype = DType::f64;
  s.seed = 29;
  return cast_problem(make_problem(s), c.dtype);
}

// run(tmp) on the pool, then with a workspace of exactly workspace_size bytes: the second takes
// no pool memory and gives the same results.
template <class Run>
void expect_exact_workspace(const WsCase& c, Run run) {
  const Result pooled = run(Temporaries::pool);
  cudaMemPool_t pool;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  uint64_t before = 0, zero = 0, high = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &before), cudaSuccess);
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero), cudaSuccess);
  Result ws;
  try {
    ws = run(Temporaries::workspace);
  } catch (const std::exception& e) {
    FAIL() << c.name << ": the call with a workspace threw: " << e.what();
  }
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high), cudaSuccess);
  EXPECT_LE(high, before) << c.name << ": the call took pool memory besides its workspace";

  for (const auto& [name, e] : compare(ws, pooled)) {
    std::printf("  %-28s %-10s rel err (workspace vs pool) %.2e\n", c.name.c_str(), name.c_str(), e);
    EXPECT_LE(e, 1e-5) << c.name << " " << name;
  }
}

class CudaWorkspace : public ::testing::TestWithParam<WsCase> {};

TEST_P(CudaWorkspace, ExactWorkspaceTakesNoPoolMemoryAndMatchesThePool) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const WsCase c = GetParam();
  const ScopedEnv pieces("HILA_DELTA_PIECES", c.pieces);
  const ScopedEnv segment("HILA_LOGLINEAR_TREE_SEGMENT", c.segment);
  const Problem low = ws_problem(c);
  expect_exact_workspace(c, [&](Temporaries tmp) { return run_backward(low, Form::chunk, 64, cuda0(), tmp); });
}

// The sizes: positive on the device, larger for backward than for forward, growing with T, and
// independent of the data.
TEST_P(CudaWorkspace, SizeQuery) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const WsCase c = GetParam();
  const ScopedEnv pieces("HILA_DELTA_PIECES", c.pieces);
  const ScopedEnv segment("HILA_LOGLINEAR_TREE_SEGMENT", c.segment);
  const Problem low = ws_problem(c);
  DeviceMirror m(cuda0());
  Buffer o(low.v.dtype, std::vector<int64_t>(low.v.shape));
  BackwardParams p;
  static_cast<ForwardParams&>(p) = low.forward_params(Form::chunk, 64);
  p.q = m.input(p.q), p.k = m.input(p.k), p.v = m.input(p.v), p.g = m.input(p.g), p.lam = m.input(p.lam);
  p.beta = m.input(p.beta), p.cu_seqlens = m.input(p.cu_seqlens), p.init = m.input(p.init);
  p.o = m.output(o.view());
  const size_t fwd = workspace_size(static_cast<const ForwardParams&>(p));
  p.d_o = m.input(low.d_o.view());
  p.dq = m.input(low.q.view()), p.dk = m.input(low.k.view()), p.dv = m.input(low.v.view());  // sizes only
  const size_t bwd = workspace_size(p);
  std::printf("  %-28s workspace: forward %zu bytes, backward %zu bytes\n", c.name.c_str(), fwd, bwd);
  EXPECT_GT(fwd, 0u);
  EXPECT_GT(bwd, fwd);
  EXPECT_EQ(workspace_size(p), bwd) << "the size query is deterministic";
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaWorkspace, ::testing::ValuesIn(ws_cases()),
                         [](const auto& info) { return info.param.name; });

// Forwards alone: the log-linear tree form from initial states (aligned positions seed the tree;
// unaligned ones first sweep their rows up to the next multiple of 64 into a state in the
// workspace) and the gdn tensor-core forward, with exactly the reported workspace, against the pool.
class CudaWorkspaceForward : public ::testing::TestWithParam<WsCase> {};

TEST_P(CudaWorkspaceForward, ExactWorkspaceTakesNoPoolMemoryAndMatchesThePool) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const WsCase c = GetParam();
  const ScopedEnv pieces("HILA_DELTA_PIECES", c.pieces);
  const ScopedEnv segment("HILA_LOGLINEAR_TREE_SEGMENT", c.segment);
  const Problem low = ws_problem(c);
  expect_exact_workspace(c, [&](Temporaries tmp) { return run_forward(low, Form::chunk, 64, cuda0(), tmp); });
}

INSTANTIATE_TEST_SUITE_P(
    LogLinear, CudaWorkspaceForward,
    ::testing::Values(WsCase{Op::loglinear, DType::bf16, 2, 300, 2, 2, 64, 64, {}, false, false, "loglinear_prefill"},
                      WsCase{Op::loglinear, DType::bf16, 2, 300, 2, 2, 64, 64, {}, true, false, "loglinear_at192", {192}},
                      WsCase{Op::loglinear, DType::bf16, 1, 0, 1, 2, 64, 64, {0, 100, 0, 64, 1, 257}, true, false,
                             "loglinear_varlen_unaligned", {77, 0, 5, 128, 63, 1000}},
                      WsCase{Op::loglinear_hla2, DType::bf16, 2, 200, 2, 2, 64, 64, {}, true, false,
                             "loglinear_hla2_at77", {77}},
                      WsCase{Op::loglinear, DType::bf16, 2, 1000, 2, 2, 64, 64, {}, false, false,
                             "loglinear_prefill_segments", {}, nullptr, "2"},
                      WsCase{Op::gdn, DType::bf16, 1, 0, 2, 4, 64, 64, {0, 100, 0, 64, 1, 257}, true, false,
                             "gdn_bf16_varlen"}),
    [](const auto& info) { return info.param.name; });

// CUDA graphs (what torch.compile's "reduce-overhead" mode and hand-written graph code do): the
// forward and the backward captured on a non-blocking stream, with the exact workspace, launched
// twice from the graph, give the results of direct calls on the pool; the outputs stay poisoned
// unless the replays write them. The same captured with the temporaries from the stream-ordered
// pool (hila.torch's default), under a configured memory limit: the call then plans its memory
// as any call of at least 1/512 of the device's memory does, and must not ask the device for its
// free memory inside the capture. The backward of gla and the HLA family runs the recomputed
// forward on hila's side stream (SideStream), which the capture follows through its event fork
// and join. Fixed-length batches without input states: a varlen call reads cu_seqlens, and a
// call with an input state reads its positions, back to the host (validation and planning), which
// stream capture does not allow.
class CudaGraph : public ::testing::TestWithParam<WsCase> {};

TEST_P(CudaGraph, CapturedCallsReplayToTheDirectResults) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const WsCase c = GetParam();
  const ScopedEnv pieces("HILA_DELTA_PIECES", c.pieces);
  const ScopedEnv segment("HILA_LOGLINEAR_TREE_SEGMENT", c.segment);
  const Problem low = ws_problem(c);
  struct Limit {  // a configured memory limit (far above these calls) for this scope only
    explicit Limit(bool on) : on_(on) {
      if (on_) hila::set_memory_limit(int64_t(1) << 40);
    }
    ~Limit() {
      if (on_) hila::set_memory_limit(0);
    }
    bool on_;
  };
  for (const bool bwd : {false, true}) {
    auto run = [&](Temporaries tmp) {
      return bwd ? run_backward(low, Form::chunk, 64, cuda0(), tmp) : run_forward(low, Form::chunk, 64, cuda0(), tmp);
    };
    const Result direct = run(Temporaries::pool);  // also creates the side stream outside the capture
    for (const Temporaries tmp : {Temporaries::graph, Temporaries::graph_pool}) {
      const char* how = tmp == Temporaries::graph ? "workspace" : "pool+limit";
      Result graph;
      try {
        const Limit limit(tmp == Temporaries::graph_pool);
        graph = run(tmp);
      } catch (const GraphCaptureUnsupported& e) {
        GTEST_SKIP() << e.what();
      } catch (const std::exception& e) {
        FAIL() << c.name << (bwd ? " backward" : " forward") << " (" << how << ") under stream capture threw: "
               << e.what();
      }
      for (const auto& [name, e] : compare(graph, direct)) {
        std::printf("  %-28s %-3s %-10s %-10s rel err (graph vs direct) %.2e\n", c.name.c_str(), bwd ? "bwd" : "fwd",
                    how, name.c_str(), e);
        EXPECT_LE(e, 1e-5) << c.name << " " << how << " " << name;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ops, CudaGraph,
    ::testing::Values(WsCase{Op::gla, DType::bf16, 2, 300, 4, 4, 64, 64, {}, false, false, "gla_bf16"},
                      WsCase{Op::gla, DType::bf16, 2, 300, 4, 4, 128, 128, {}, false, false, "gla_bf16_d128"},
                      WsCase{Op::hla2, DType::bf16, 2, 200, 4, 4, 64, 64, {}, false, false, "hla2_bf16"},
                      WsCase{Op::hla2, DType::bf16, 2, 130, 1, 4, 64, 64, {}, false, true, "hla2_bf16_normalize"},
                      WsCase{Op::hla3, DType::f32, 2, 200, 2, 4, 32, 24, {}, false, false, "hla3_f32"},
                      WsCase{Op::loglinear, DType::bf16, 2, 300, 1, 2, 64, 64, {}, false, false, "loglinear_bf16"},
                      WsCase{Op::loglinear, DType::bf16, 2, 300, 1, 2, 64, 64, {}, false, false,
                             "loglinear_bf16_segments", {}, nullptr, "1"},
                      WsCase{Op::gdn, DType::bf16, 2, 300, 2, 4, 64, 64, {}, false, false, "gdn_bf16"},
                      // in pieces: two priority side streams, each joined after several forks
                      WsCase{Op::gdn, DType::bf16, 2, 300, 2, 4, 64, 64, {}, false, false, "gdn_bf16_pieces3", {}, "3"},
                      WsCase{Op::loglinear_gdn, DType::bf16, 2, 200, 2, 2, 64, 64, {}, false, false,
                             "loglinear_gdn_bf16"}),
    [](const auto& info) { return info.param.name; });

TEST(CudaWorkspaceErrors, TooSmallOrNotDeviceMemory) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const Problem low = ws_problem(ws_cases()[2]);  // hla2: inner and outer temporaries
  DeviceMirror m(cuda0());
  Buffer o(low.v.dtype, std::vector<int64_t>(low.v.shape));
  o.poison();
  ForwardParams p = low.forward_params(Form::chunk, 64);
  p.q = m.input(p.q), p.k = m.input(p.k), p.v = m.input(p.v), p.g = m.input(p.g), p.cu_seqlens = m.input(p.cu_seqlens);
  p.init = m.input(p.init);
  p.o = m.output(o.view());
  const size_t need = workspace_size(p);
  ASSERT_GT(need, 0u);
  auto expect_error = [&](const char* ctx, const char* arg) {
    try {
      forward(p);
      ADD_FAILURE() << ctx << ": expected hila::Error for '" << arg << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), arg) << ctx << ": " << e.what();
      std::printf("  %s: %s\n", ctx, e.what());
    }
  };
  p.workspace = m.scratch(need);
  p.workspace_bytes = need - 1;
  expect_error("one byte short", "workspace_bytes");
  std::vector<char> host(need);
  p.workspace = host.data(), p.workspace_bytes = need;
  expect_error("host memory", "workspace");
  m.finish();
  for (int64_t i = 0; i < o.numel(); ++i) ASSERT_TRUE(std::isnan(o.get(i))) << "o written before the error at " << i;
  // exactly `need` bytes at an odd offset into a larger block: accepted (the base is aligned inside)
  char* big = static_cast<char*>(m.scratch(need + 512));
  p.workspace = big + 3, p.workspace_bytes = need;
  try {
    forward(p);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "a workspace at an unaligned address threw: " << e.what();
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace hila::tools
