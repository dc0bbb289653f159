// SPDX-License-Identifier: Apache-2.0
// CUDA log-linear Mamba-2 and the log-linear HLA family (docs/math/LOGLINEAR.md §3-5, §7) against the CPU
// float64 naive form (the oracle) on the same rounded inputs: o, final state, dq, dk, dv, dg, dlam,
// d_init. Initial states sit at unaligned positions (n0 % 64 != 0, and past 2^17), sequences are
// packed with empty ones, the caller's Fenwick capacity may exceed what a position needs.
// Without a GPU every test is skipped with a printed reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cuda_support.h"
#include "problem.h"

namespace hila::tools {
namespace {

struct LlCase {
  Op op;
  DType dtype;
  int64_t B, T, G, H, dk, dv;
  std::vector<int64_t> seqlens;   // varlen when non-empty
  std::vector<int64_t> init_pos;  // no initial state when empty; else one position or one per sequence
  double tol;
  std::string name;
  bool normalize = false, untied = false;
  double ridge = 0;
  bool extra = false;  // lam with extra levels, init / final states with extra Fenwick capacity
  // no final state asked for and no final-state cotangent, as a training step calls it: with 16-bit
  // operands (and no initial state) this is the chunk-parallel tree form (src/cuda/loglinear/tree.cuh)
  bool stateless = false;
  // HILA_LOGLINEAR_TREE_SWEEP for the call: "1" builds the tree with the sweep kernel, "0"
  // chunk-parallel (the default picks by the number of blocks: the small cases here take "0")
  const char* tree_sweep = nullptr;
  // with stateless: the final state is asked for (a prefill), still no final-state cotangent
  bool final_state = false;
  bool d_init = true;  // with init_pos: d_init is asked for
  // HILA_GLA_SM90 for the call: "1" builds the tree with the sm_90a sweep on Hopper at any block
  // count (with tree_sweep "1"); a list without "wkv" keeps the backward's sums on the sm80 kernel
  const char* sm90 = nullptr;
  // HILA_LOGLINEAR_TREE_SEGMENT for the call: the tree's up pass and push-down in segments of 2^s
  // chunks; other than "0", the results are also compared bit for bit with one pass ("0")
  const char* segment = nullptr;
  // lam and dlam as views into a [B, T + 3, H, L + 2] buffer (NaN in the padding): (B, T) do not
  // merge into rows of one stride, so the packing takes its general index path
  bool strided_lam = false;
};

constexpr int64_t kFar = (int64_t(1) << 17) + 5;  // past 2^17: levels up to 18, unaligned
// 2^33 + 2^32 - 5: the first segment ends at 2^33 + 2^32, whose level-34 bucket starts 2^32 - 5
// positions before it (distances past 2^31 in the segment arithmetic)
constexpr int64_t kHuge = (int64_t(1) << 33) + (int64_t(1) << 32) - 5;

std::vector<LlCase> cases() {
  std::vector<LlCase> cs;
  const Op ll = Op::loglinear;
  auto name = [](Op op, const std::string& rest) { return std::string(op_name(op)) + "_" + rest; };
  for (int64_t T : {1, 63, 64, 65, 1000})
    cs.push_back({ll, DType::bf16, 2, T, 1, 4, 64, 64, {}, {}, 1e-2, name(ll, "bf16_d64_T" + std::to_string(T))});
  cs.push_back({ll, DType::bf16, 1, 4096, 1, 2, 64, 64, {}, {}, 1e-2, name(ll, "bf16_d64_T4096")});
  cs.push_back({ll, DType::bf16, 1, 300, 1, 2, 128, 128, {}, {200}, 1e-2, name(ll, "bf16_d128_init200")});
  cs.push_back({ll, DType::bf16, 1, 0, 1, 4, 64, 64, {0, 100, 0, 64, 1, 257}, {13, 64, 200, kFar, 0, 63}, 1e-2,
                name(ll, "bf16_varlen_init_mixed_pos")});
  cs.push_back({ll, DType::bf16, 2, 300, 1, 4, 64, 40, {}, {13}, 1e-2, name(ll, "bf16_init13_gqa4_dv40"), false,
                false, 0, true});
  cs.push_back({ll, DType::f16, 2, 130, 1, 2, 64, 64, {}, {64}, 1e-2, name(ll, "f16_init64")});
  // 16-bit from chunk-aligned states with a final-state cotangent: the tree form end to end (empty
  // sequences: dH0 = dHT)
  cs.push_back({ll, DType::bf16, 1, 0, 1, 4, 64, 40, {0, 100, 0, 64, 1, 257, 63}, {64, 0, 128, kFar + 187, 192, 448, 320},
                1e-2, name(ll, "bf16_varlen_init_aligned_dv40")});
  cs.push_back({ll, DType::bf16, 2, 130, 1, 2, 64, 64, {}, {192}, 1e-2, name(ll, "bf16_T130_init192")});
  cs.push_back({Op::loglinear_hla2, DType::bf16, 2, 130, 1, 2, 64, 64, {}, {128}, 1e-2,
                name(Op::loglinear_hla2, "bf16_T130_init128")});
  cs.push_back({ll, DType::bf16, 1, 0, 1, 2, 64, 64, {70, 0, 130}, {kHuge, 3, kHuge + 64}, 1e-2,
                name(ll, "bf16_varlen_init_past_2e33")});
  for (int64_t T : {1, 63, 64, 65, 1000})
    cs.push_back({ll, DType::f32, 2, T, 1, 2, 64, 64, {}, {}, 1e-4, name(ll, "f32_d64_T" + std::to_string(T))});
  cs.push_back({ll, DType::f32, 1, 4096, 1, 1, 32, 32, {}, {}, 1e-4, name(ll, "f32_d32_T4096")});
  cs.push_back({ll, DType::f32, 2, 300, 1, 4, 32, 32, {}, {kFar}, 1e-4, name(ll, "f32_init_far_gqa4"), false, false,
                0, true});
  cs.push_back({ll, DType::f32, 1, 0, 1, 2, 32, 48, {0, 100, 0, 64, 1, 257}, {13, 64, 200, kFar, 0, 63}, 1e-4,
                name(ll, "f32_varlen_init_mixed_pos")});
  for (int64_t T : {1, 63, 64, 65})
    cs.push_back({ll, DType::f64, 1, T, 1, 2, 16, 16, {}, {}, 1e-10, name(ll, "f64_d16_T" + std::to_string(T))});
  cs.push_back({ll, DType::f64, 1, 200, 1, 2, 32, 32, {}, {13}, 1e-10, name(ll, "f64_init13")});
  cs.push_back({ll, DType::f64, 1, 150, 1, 1, 16, 16, {}, {kHuge}, 1e-10, name(ll, "f64_init_past_2e33")});
  cs.push_back({ll, DType::f64, 1, 0, 1, 2, 16, 16, {0, 70, 0, 64, 1, 140}, {13, 64, 200, kFar, 0, 63}, 1e-10,
                name(ll, "f64_varlen_init_mixed_pos"), false, false, 0, true});
  // the tree form: T around chunk multiples and powers of two, varlen with empty sequences, GQA, dv 40
  auto tree = [&](Op op, DType dt, int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, std::vector<int64_t> lens,
                  const std::string& tag, const char* sweep = nullptr, bool fin = false, std::vector<int64_t> init = {},
                  bool d_init = true) {
    LlCase x{op, dt, B, T, 1, H, dk, dv, std::move(lens), std::move(init), 1e-2,
             name(op, tag + (sweep ? "_tree_sweep" : "_tree") + (fin ? "_final" : ""))};
    x.stateless = true;
    x.tree_sweep = sweep;
    x.final_state = fin;
    x.d_init = d_init;
    cs.push_back(x);
  };
  for (int64_t T : {1, 63, 64, 65, 130, 1000})
    tree(ll, DType::bf16, 2, T, 4, 64, 64, {}, "bf16_d64_T" + std::to_string(T));
  tree(ll, DType::bf16, 1, 4096, 2, 64, 64, {}, "bf16_d64_T4096");
  // long reading ranges summed in parts (levels >= 6): 130 chunks, and long sequences in a varlen batch
  tree(ll, DType::bf16, 1, 8257, 1, 64, 64, {}, "bf16_d64_T8257");
  tree(ll, DType::bf16, 1, 0, 2, 64, 64, {0, 3100, 1, 4500}, "bf16_varlen_long");
  tree(ll, DType::bf16, 1, 300, 2, 128, 128, {}, "bf16_d128_T300");
  tree(ll, DType::bf16, 1, 0, 4, 64, 40, {0, 100, 0, 64, 1, 257, 513}, "bf16_varlen_gqa4_dv40");
  tree(ll, DType::f16, 2, 200, 2, 64, 64, {}, "f16_T200");
  tree(ll, DType::bf16, 2, 1000, 4, 64, 64, {}, "bf16_d64_T1000", "1");
  tree(ll, DType::bf16, 1, 0, 4, 64, 40, {0, 100, 0, 64, 1, 257, 513}, "bf16_varlen_gqa4_dv40", "1");
  tree(ll, DType::bf16, 1, 300, 2, 128, 128, {}, "bf16_d128_T300", "1");
  // prefill: the final state from the tree (levels above the chunk from the pending nodes, the
  // partial chunk's levels by bucket), both tree builds
  for (int64_t T : {1, 63, 64, 65, 130, 1000})
    tree(ll, DType::bf16, 2, T, 4, 64, 64, {}, "bf16_d64_T" + std::to_string(T), nullptr, true);
  tree(ll, DType::bf16, 1, 0, 4, 64, 40, {0, 100, 0, 64, 1, 257, 513}, "bf16_varlen_gqa4_dv40", nullptr, true);
  tree(ll, DType::bf16, 2, 1000, 4, 64, 64, {}, "bf16_d64_T1000", "1", true);
  tree(ll, DType::bf16, 1, 0, 4, 64, 40, {0, 100, 0, 64, 1, 257, 513}, "bf16_varlen_gqa4_dv40", "1", true);
  tree(ll, DType::bf16, 1, 0, 2, 64, 64, {0, 3100, 1, 4500}, "bf16_varlen_long", nullptr, true);
  tree(Op::loglinear_hla2, DType::bf16, 2, 300, 4, 64, 64, {}, "bf16_d64_T300", nullptr, true);
  for (Op op : {Op::loglinear_hla2, Op::loglinear_ahla, Op::loglinear_hla3})
    tree(op, DType::bf16, 2, 300, 4, 64, 64, {}, "bf16_d64_T300");
  // training from a state at chunk-aligned positions (the initial levels seed the tree; dH0 from
  // the push-down), with and without d_init, both tree builds
  const int64_t far64 = (int64_t(1) << 17) + 3 * 64;
  for (int64_t n0 : {64, 192, 4096 + 320})
    tree(ll, DType::bf16, 2, 300, 4, 64, 64, {}, "bf16_d64_T300_init" + std::to_string(n0), nullptr, false, {n0});
  tree(ll, DType::bf16, 2, 300, 4, 64, 64, {}, "bf16_d64_T300_init192_no_dinit", nullptr, false, {192}, false);
  tree(ll, DType::bf16, 2, 300, 4, 64, 64, {}, "bf16_d64_T300_init192", nullptr, true, {192});
  tree(ll, DType::bf16, 2, 1000, 2, 64, 64, {}, "bf16_d64_T1000_init1984", "1", false, {1984});
  tree(ll, DType::bf16, 1, 0, 4, 64, 40, {0, 100, 0, 64, 1, 257, 513}, "bf16_varlen_gqa4_dv40_init",
       nullptr, false, {64, 0, 384, far64, 192, 448, 0});
  tree(ll, DType::bf16, 1, 0, 4, 64, 40, {0, 100, 0, 64, 1, 257, 513}, "bf16_varlen_gqa4_dv40_init", "1",
       false, {64, 0, 384, far64, 192, 448, 0});
  tree(Op::loglinear_hla2, DType::bf16, 2, 300, 4, 64, 64, {}, "bf16_d64_T300_init128", nullptr, false, {128});
  // the tree build on the sm_90a sweep, forced on at these block counts: training, a prefill (the
  // pending nodes) and from an initial state (the seeded levels)
  for (const char* tag : {"bf16_d64_T1000_tree_sweep", "bf16_d64_T1000_tree_sweep_final",
                          "bf16_d64_T1000_init1984_tree_sweep", "bf16_d128_T300_tree_sweep"}) {
    const std::string n = name(ll, tag);
    const auto it = std::find_if(cs.begin(), cs.end(), [&](const LlCase& x) { return x.name == n; });
    if (it == cs.end()) throw std::logic_error("no case " + n);
    LlCase x = *it;
    x.sm90 = "1";
    x.name += "_sm90";
    cs.push_back(x);
  }
  // the backward's node-cotangent sums on the sm80 kernel where the sm90 one runs by default
  // (HILA_GLA_SM90 without "wkv"): reading ranges whole and in parts (varlen_long)
  for (const char* tag : {"bf16_d64_T1000_tree", "bf16_varlen_long_tree"}) {
    const std::string n = name(ll, tag);
    const auto it = std::find_if(cs.begin(), cs.end(), [&](const LlCase& x) { return x.name == n; });
    if (it == cs.end()) throw std::logic_error("no case " + n);
    LlCase x = *it;
    x.sm90 = "sweep,bwd,fwd";
    x.name += "_sm80wkv";
    cs.push_back(x);
  }
  // the tree in segments of 2^s chunks (every sequence from 0): the build in the sweep per segment
  // (the default at these block counts; "1" forces it too) and the up pass above the roots, or
  // chunk-parallel ("0": the up pass in segments too), and the push-down in segments: segments of 2,
  // 4 and 8 chunks, partial last segments, a prefill's pending nodes, varlen with empty and short
  // sequences, reading ranges in parts (130 chunks), the sm_90a sweep
  struct Seg {
    const char *tag, *seg, *sweep;
  };
  const std::vector<Seg> segs = {
      {"bf16_d64_T1000_tree", "1", nullptr},  {"bf16_d64_T1000_tree", "2", nullptr},
      {"bf16_d64_T1000_tree", "3", nullptr},  {"bf16_d64_T1000_tree_final", "2", nullptr},
      {"bf16_d64_T130_tree_final", "1", nullptr}, {"bf16_varlen_gqa4_dv40_tree", "1", nullptr},
      {"bf16_varlen_gqa4_dv40_tree_final", "2", nullptr}, {"bf16_d64_T8257_tree", "3", nullptr},
      {"bf16_d64_T8257_tree", "0", nullptr},  {"bf16_varlen_long_tree_final", "2", nullptr},
      {"bf16_d64_T1000_tree_sweep", "2", nullptr}, {"bf16_d128_T300_tree", "1", nullptr},
      {"bf16_d64_T1000_tree_sweep_final_sm90", "2", nullptr}, {"bf16_d64_T1000_tree_sweep_sm90", "3", nullptr},
      {"bf16_d128_T300_tree_sweep_sm90", "1", nullptr},
      {"bf16_d64_T1000_tree", "2", "0"},      {"bf16_d64_T130_tree_final", "1", "0"},
      {"bf16_varlen_gqa4_dv40_tree_final", "2", "0"}, {"bf16_d64_T8257_tree", "3", "0"}};
  for (const Seg& sg : segs) {
    const std::string n = name(ll, sg.tag);
    const auto it = std::find_if(cs.begin(), cs.end(), [&](const LlCase& x) { return x.name == n; });
    if (it == cs.end()) throw std::logic_error("no case " + n);
    LlCase x = *it;
    x.segment = sg.seg;
    if (sg.sweep) x.tree_sweep = sg.sweep;
    x.name += std::string("_seg") + sg.seg + (sg.sweep ? std::string("_chunks") : std::string());
    cs.push_back(x);
  }
  // from a state at position 0 (no shift: segments) with a final-state cotangent
  {
    LlCase x{ll, DType::bf16, 2, 1000, 1, 4, 64, 64, {}, {0}, 1e-2, name(ll, "bf16_d64_T1000_init0_seg2")};
    x.segment = "2";
    cs.push_back(x);
  }
  // log-linear HLA family: GLA inner primitives, log-linear outer primitive (§7)
  for (Op op : {Op::loglinear_hla2, Op::loglinear_ahla, Op::loglinear_hla3}) {
    const double ridge = op == Op::loglinear_hla2 ? 0.3 : 0.0;
    for (int64_t T : {1, 65, 1000})
      cs.push_back({op, DType::bf16, 2, T, 1, 4, 64, 64, {}, {}, 1e-2, name(op, "bf16_d64_T" + std::to_string(T))});
    cs.push_back({op, DType::bf16, 1, 0, 1, 4, 64, 64, {0, 100, 0, 64, 1, 257}, {13, 64, 200, kFar, 0, 63}, 1e-2,
                  name(op, "bf16_varlen_init")});
    cs.push_back({op, DType::f32, 2, 300, 1, 4, 32, 32, {}, {13}, 1e-4, name(op, "f32_init13_gqa4_untied"), false,
                  true});
    cs.push_back({op, DType::f32, 2, 130, 2, 4, 32, 24, {}, {kFar}, 1e-4, name(op, "f32_normalize_init_far"), true,
                  false, ridge, true});
    cs.push_back({op, DType::f64, 1, 130, 1, 2, 16, 16, {}, {200}, 1e-10, name(op, "f64_untied_normalize_init200"),
                  true, true, ridge});
    // 16-bit with normalize and untied gates: the tree form from an aligned state, and the head split.
    // 2e-2: the normalized output divides by a denominator built from the bf16-rounded inner
    // outputs, and its gradients (dq, dlam, dS0) come out at 1.3-1.5e-2 on the segment sweep too
    cs.push_back({op, DType::bf16, 2, 130, 1, 2, 64, 64, {}, {64}, 2e-2, name(op, "bf16_untied_normalize_init64"), true,
                  true, ridge});
    cs.push_back({op, DType::bf16, 1, 0, 1, 2, 64, 48, {0, 70, 1, 130}, {5, 77, 128, 0}, 2e-2,
                  name(op, "bf16_normalize_varlen_init_unaligned"), true, false, ridge});
  }
  // lam and dlam strided: the tree form (16-bit, training) and the chunk form from a state (f32)
  for (auto [dt, T, init, tag] : {std::tuple{DType::bf16, int64_t(1000), false, "bf16_d64_T1000_strided_lam"},
                                  std::tuple{DType::f32, int64_t(65), true, "f32_d64_T65_init13_strided_lam"}}) {
    LlCase x{ll, dt, 2, T, 1, 2, 64, 64, {}, {}, dt == DType::f32 ? 1e-4 : 1e-2, name(ll, tag)};
    if (init) x.init_pos = {13};
    x.stateless = !init;
    x.strided_lam = true;
    cs.push_back(x);
  }
  return cs;
}

class CudaLogLinear : public ::testing::TestWithParam<LlCase> {};

TEST_P(CudaLogLinear, ForwardBackwardMatchNaiveFloat64) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped (run them on a machine with a CUDA GPU)";
  const LlCase c = GetParam();
  const bool init = !c.init_pos.empty();
  ProblemSpec s;
  s.cfg.op = c.op;
  s.cfg.normalize = c.normalize;
  s.cfg.gates = c.untied ? Gates::untied : Gates::tied;
  s.cfg.ridge = c.ridge;
  s.nonneg = c.normalize;  // keeps the denominators away from zero (docs/math/HLA.md §4)
  s.B = c.B, s.T = c.T, s.G = c.G, s.H = c.H, s.dk = c.dk, s.dv = c.dv;
  s.seqlens = c.seqlens;
  s.gated = true;
  s.init_state = init;
  s.init_pos = c.init_pos;
  s.init_extra_slots = c.extra ? 2 : 0;
  s.extra_levels = c.extra ? 2 : 0;
  if (c.name.find("gqa4") != std::string::npos) s.G = s.H / 4;
  s.dtype = DType::f64;
  s.seed = 23;
  Problem low = cast_problem(make_problem(s), c.dtype);
  if (c.stateless) {  // a zero final-state cotangent for the reference (the call gets none)
    low.d_final = make_state(s.cfg, low.num_seqs(), s.H, s.dk, s.dv, low.max_final_pos(), low.state_dtype());
    low.d_final.pos = Buffer{};
  }
  const Problem ref_in = cast_problem(low, DType::f64);
  const Result ref = run_backward(ref_in, Form::naive);

  DevTensor q(low.q), k(low.k), v(low.v), g(low.g), lam(low.lam), cu(low.cu_seqlens), dO(low.d_o);
  DevTensor pos(low.init.pos), S0(low.init.S), P0(low.init.P), h0(low.init.H);
  DevTensor dSt(low.d_final.S), dPt(low.d_final.P), dht(low.d_final.H);
  BackwardParams p;
  static_cast<ForwardParams&>(p) = low.forward_params(Form::chunk, 64);
  p.q = q.view(), p.k = k.view(), p.v = v.view(), p.g = g.view(), p.lam = lam.view(), p.cu_seqlens = cu.view();
  p.init = {};
  if (init) p.init.pos = pos.view(), p.init.S = S0.view(), p.init.P = P0.view(), p.init.H = h0.view();
  p.d_o = dO.view();
  p.d_final.S = dSt.view(), p.d_final.P = dPt.view(), p.d_final.H = dht.view();
  const int64_t N = low.num_seqs();
  // the final state, with 3 more Fenwick slots than needed when `extra` (they must come back zero)
  const int64_t cap = c.extra ? 8 * low.max_final_pos() + 8 : low.max_final_pos();
  const StateBuffers fin_host = make_state(s.cfg, N, s.H, s.dk, s.dv, cap, low.state_dtype());
  DevTensor o(ref.o.cast(c.dtype), true), fpos(fin_host.pos, true), fS(fin_host.S, true), fP(fin_host.P, true),
      fH(fin_host.H, true);
  DevTensor dq(low.q, true), dk(low.k, true), dv(low.v, true), dg(low.g, true), dlam(low.lam, true);
  DevTensor dS0(low.init.S, true), dP0(low.init.P, true), dh0(low.init.H, true);
  p.o = o.view();
  p.final_state.pos = fpos.view(), p.final_state.S = fS.view(), p.final_state.P = fP.view(), p.final_state.H = fH.view();
  if (c.stateless) p.d_final = {};
  if (c.stateless && !c.final_state) p.final_state = {};
  p.dq = dq.view(), p.dk = dk.view(), p.dv = dv.view(), p.dg = dg.view(), p.dlam = dlam.view();
  p.d_init = {};
  if (init && c.d_init) p.d_init.S = dS0.view(), p.d_init.P = dP0.view(), p.d_init.H = dh0.view();
  // strided lam / dlam: [B, T, H, L] inside [B, Tb, H, Lp]
  const int64_t L = low.lam.shape[3], Tb = low.lam.shape[1] + 3, Lp = L + 2, B = low.lam.shape[0], Hl = low.lam.shape[2];
  auto wide_index = [&](int64_t e) {  // element e of [B, T, H, L] -> its place in [B, Tb, H, Lp]
    const int64_t l = e % L, h = (e / L) % Hl, t = (e / (L * Hl)) % (Tb - 3), b = e / (L * Hl * (Tb - 3));
    return ((b * Tb + t) * Hl + h) * Lp + l;
  };
  Buffer wide(low.lam.dtype, {B, Tb, Hl, Lp});
  for (int64_t e = 0; e < wide.numel(); ++e) wide.set(e, std::nan(""));
  for (int64_t e = 0; e < low.lam.numel(); ++e) wide.set(wide_index(e), low.lam.get(e));
  DevTensor lam_w(c.strided_lam ? wide : Buffer{}), dlam_w(c.strided_lam ? wide : Buffer{}, true);
  auto strided = [&](const DevTensor& t) {
    TensorView v = TensorView::contiguous_view(t.p, t.host.dtype, {B, Tb - 3, Hl, L}, cuda0());
    v.stride[0] = Tb * Hl * Lp, v.stride[1] = Hl * Lp, v.stride[2] = Lp, v.stride[3] = 1;
    return v;
  };
  if (c.strided_lam) p.lam = strided(lam_w), p.dlam = strided(dlam_w);
  p.cfg.check_values = true;
  auto run = [&](const char* segment, const char* tree_sweep) {
    ScopedEnv se("HILA_LOGLINEAR_TREE_SEGMENT", segment);
    return with_env("HILA_GLA_SM90", c.sm90, [&] {
      const std::string e = with_env("HILA_LOGLINEAR_TREE_SWEEP", tree_sweep, [&] { backward(p); });
      if (!e.empty()) throw std::runtime_error(e);
    });
  };
  ASSERT_EQ(run(c.segment, c.tree_sweep), "") << "backward threw";
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const double floor_g = dg_floor(ref_in.q, ref.dq, ref_in.k, ref.dk, s.dk);  // see dg_floor
  auto check = [&](const char* what, const Buffer& got, const Buffer& want, double fl = 0) {
    const double e = rel_err(got, want, fl);
    std::printf("  %-44s %-6s rel err %.2e\n", c.name.c_str(), what, e);
    EXPECT_LE(e, c.tol) << what;
  };
  check("o", o.fetch(), ref.o);
  const bool fin = !c.stateless || c.final_state;
  if (fin && !ref.final_state.S.empty()) check("S_T", fS.fetch(), ref.final_state.S);
  if (fin && !ref.final_state.P.empty()) check("P_T", fP.fetch(), ref.final_state.P);
  if (fin) check("H_T", fH.fetch(), with_slots(ref.final_state, fin_host.H.shape[2]).H);
  check("dq", dq.fetch(), ref.dq);
  check("dk", dk.fetch(), ref.dk);
  check("dv", dv.fetch(), ref.dv);
  check("dg", dg.fetch(), ref.dg, floor_g);
  if (c.strided_lam) {
    const Buffer got_w = dlam_w.fetch();
    Buffer got = low.lam;
    for (int64_t e = 0; e < got.numel(); ++e) got.set(e, got_w.get(wide_index(e)));
    check("dlam", got, ref.dlam);
    int64_t written = 0;  // the padding keeps the poison
    for (int64_t e = 0; e < got_w.numel(); ++e) written += std::isfinite(got_w.get(e));
    EXPECT_EQ(written, got.numel()) << "dlam: elements written outside the view";
  } else {
    check("dlam", dlam.fetch(), ref.dlam);
  }
  if (init && c.d_init) {
    if (!ref.d_init.S.empty()) check("dS0", dS0.fetch(), ref.d_init.S);
    if (!ref.d_init.P.empty()) check("dP0", dP0.fetch(), ref.d_init.P);
    check("dH0", dh0.fetch(), ref.d_init.H);
  }
  if (c.segment && std::string(c.segment) != "0") {  // the same sums in the same order as one pass
    std::vector<std::pair<const char*, DevTensor*>> outs = {{"o", &o}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv},
                                                            {"dg", &dg}, {"dlam", &dlam}};
    if (fin) outs.push_back({"H_T", &fH});
    if (init && c.d_init) outs.push_back({"dH0", &dh0});
    std::vector<Buffer> seg;
    for (const auto& x : outs) seg.push_back(x.second->fetch());
    // one pass of the same build: the sweep (whole sequences) unless the case forces chunk-parallel
    ASSERT_EQ(run("0", c.tree_sweep ? c.tree_sweep : "1"), "") << "backward in one pass threw";
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < outs.size(); ++i)
      EXPECT_TRUE(seg[i].bytes == outs[i].second->fetch().bytes) << outs[i].first << ": segments against one pass";
  }
  if (!fin) return;
  const Buffer fp = fpos.fetch();
  for (int64_t i = 0; i < N; ++i) EXPECT_EQ(fp.get(i), ref.final_state.pos.get(i));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLogLinear, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// Forward alone, with the outputs chunk-parallel from stored levels (the default when they fit)
// and inside the sequential sweep (store budget 0), for the tensor-core and the FMA paths.
struct FwdCase {
  DType dtype;
  int64_t dv;  // 128 in bf16: two value tiles in the sweep
  double tol;
  const char* budget;  // HILA_LOGLINEAR_STORE_BUDGET, nullptr: unset
  std::string name;
};
class CudaLogLinearForward : public ::testing::TestWithParam<FwdCase> {};

TEST_P(CudaLogLinearForward, ForwardOnlyMatchesNaive) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped";
  const FwdCase c = GetParam();
  ProblemSpec s;
  s.cfg.op = Op::loglinear;
  s.B = 2, s.T = 777, s.H = 2, s.dk = 64, s.dv = c.dv;
  s.init_state = true;
  s.init_pos = {kFar};
  s.dtype = DType::f64;
  s.seed = 5;
  const Problem low = cast_problem(make_problem(s), c.dtype);
  const Result ref = run_forward(cast_problem(low, DType::f64), Form::naive);
  DevTensor q(low.q), k(low.k), v(low.v), g(low.g), lam(low.lam), pos(low.init.pos), h0(low.init.H);
  ForwardParams p = low.forward_params(Form::chunk, 64);
  p.q = q.view(), p.k = k.view(), p.v = v.view(), p.g = g.view(), p.lam = lam.view();
  p.init = {};
  p.init.pos = pos.view(), p.init.H = h0.view();
  const StateBuffers fin_host = make_state(s.cfg, 2, s.H, s.dk, s.dv, low.max_final_pos(), low.state_dtype());
  DevTensor o(ref.o.cast(c.dtype), true), fpos(fin_host.pos, true), fH(fin_host.H, true);
  p.o = o.view();
  p.final_state.pos = fpos.view(), p.final_state.H = fH.view();
  if (c.budget) setenv("HILA_LOGLINEAR_STORE_BUDGET", c.budget, 1);
  else unsetenv("HILA_LOGLINEAR_STORE_BUDGET");
  hila::cuda::reload_config();  // the library reads its knobs once (src/cuda/runtime/config.h)
  forward(p);
  unsetenv("HILA_LOGLINEAR_STORE_BUDGET");
  hila::cuda::reload_config();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const double eo = rel_err(o.fetch(), ref.o), eh = rel_err(fH.fetch(), ref.final_state.H);
  std::printf("  %-32s o rel err %.2e, H_T rel err %.2e\n", c.name.c_str(), eo, eh);
  EXPECT_LE(eo, c.tol);
  EXPECT_LE(eh, c.tol);
}
INSTANTIATE_TEST_SUITE_P(Paths, CudaLogLinearForward,
                         ::testing::Values(FwdCase{DType::bf16, 128, 1e-2, nullptr, "bf16_chunk_outputs"},
                                           FwdCase{DType::bf16, 128, 1e-2, "0", "bf16_sweep_outputs"},
                                           FwdCase{DType::f32, 64, 1e-4, nullptr, "f32_chunk_outputs"},
                                           FwdCase{DType::f32, 64, 1e-4, "0", "f32_sweep_outputs"}),
                         [](const auto& info) { return info.param.name; });

// Prefill continuation: a forward from an initial Fenwick state, asking for the final state. With
// 16-bit operands this is the tree form seeded with the initial levels (loglinear/tree.cuh), after the
// segment sweep over the rows before the first multiple of 64 when a position is unaligned.
struct ContCase {
  Op op;
  DType dtype;
  int64_t B, T, H, dk, dv;
  std::vector<int64_t> seqlens, init_pos;
  bool gqa4 = false;
  const char* tree_sweep = nullptr;  // HILA_LOGLINEAR_TREE_SWEEP
  std::string name;
};
void PrintTo(const ContCase& c, std::ostream* os) { *os << c.name; }

std::vector<ContCase> cont_cases() {
  const Op ll = Op::loglinear;
  const int64_t far = (int64_t(1) << 17) + 3 * 64;  // past 2^17, aligned
  std::vector<ContCase> cs;
  for (int64_t n0 : {64, 128, 192, 448, 4096 + 320})
    cs.push_back({ll, DType::bf16, 2, 300, 2, 64, 64, {}, {n0}, false, nullptr, "bf16_T300_at" + std::to_string(n0)});
  cs.push_back({ll, DType::bf16, 1, 300, 2, 64, 64, {}, {far}, false, nullptr, "bf16_T300_far"});
  cs.push_back({ll, DType::bf16, 2, 1, 2, 64, 64, {}, {192}, false, nullptr, "bf16_T1_at192"});
  cs.push_back({ll, DType::bf16, 2, 63, 2, 64, 64, {}, {320}, false, nullptr, "bf16_T63_at320"});
  cs.push_back({ll, DType::bf16, 2, 64, 2, 64, 64, {}, {448}, false, nullptr, "bf16_T64_at448"});
  cs.push_back({ll, DType::bf16, 2, 1000, 2, 64, 64, {}, {1984}, false, nullptr, "bf16_T1000_at1984"});
  cs.push_back({ll, DType::bf16, 2, 1000, 2, 64, 64, {}, {1984}, false, "1", "bf16_T1000_at1984_sweep"});
  cs.push_back({ll, DType::bf16, 1, 0, 4, 64, 40, {0, 100, 0, 64, 1, 257, 513}, {64, 0, 384, far, 192, 448, 0}, true,
                nullptr, "bf16_varlen_gqa4_dv40"});
  cs.push_back({ll, DType::bf16, 1, 0, 4, 64, 40, {0, 100, 0, 64, 1, 257, 513}, {64, 0, 384, far, 192, 448, 0}, true,
                "1", "bf16_varlen_gqa4_dv40_sweep"});
  cs.push_back({ll, DType::bf16, 1, 300, 2, 128, 128, {}, {640}, false, nullptr, "bf16_d128_T300_at640"});
  cs.push_back({ll, DType::f16, 2, 200, 2, 64, 64, {}, {256}, false, nullptr, "f16_T200_at256"});
  // unaligned positions (a prefill after decode steps): each sequence's rows up to its next multiple
  // of 64 take the segment sweep into a state there, the rest the tree form from it
  for (int64_t n0 : {13, 63, 100, 4096 + 65})
    cs.push_back({ll, DType::bf16, 2, 300, 2, 64, 64, {}, {n0}, false, nullptr, "bf16_T300_at" + std::to_string(n0)});
  cs.push_back({ll, DType::bf16, 2, 10, 2, 64, 64, {}, {13}, false, nullptr, "bf16_T10_at13"});  // the head only
  cs.push_back({ll, DType::bf16, 1, 0, 2, 64, 64, {100, 70}, {64, 13}, false, nullptr, "bf16_varlen_unaligned"});
  cs.push_back({ll, DType::bf16, 1, 0, 4, 64, 40, {0, 100, 0, 64, 1, 257, 513, 20}, {5, 0, 384, far + 7, 191, 449, 1, 40},
                true, nullptr, "bf16_varlen_unaligned_gqa4_dv40"});
  cs.push_back({ll, DType::bf16, 1, 0, 4, 64, 40, {0, 100, 0, 64, 1, 257, 513, 20}, {5, 0, 384, far + 7, 191, 449, 1, 40},
                true, "1", "bf16_varlen_unaligned_gqa4_dv40_sweep"});
  cs.push_back({ll, DType::f16, 2, 200, 2, 64, 64, {}, {250}, false, nullptr, "f16_T200_at250"});
  for (Op op : {Op::loglinear_hla2, Op::loglinear_ahla, Op::loglinear_hla3}) {
    cs.push_back({op, DType::bf16, 2, 300, 2, 64, 64, {}, {192}, false, nullptr, "bf16_T300_at192"});
    cs.push_back({op, DType::bf16, 2, 300, 2, 64, 64, {}, {77}, false, nullptr, "bf16_T300_at77"});
  }
  for (auto& c : cs) c.name = std::string(op_name(c.op)) + "_" + c.name;
  return cs;
}

class CudaLogLinearContinue : public ::testing::TestWithParam<ContCase> {};

TEST_P(CudaLogLinearContinue, ForwardFromStateMatchesNaive) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped";
  const ContCase c = GetParam();
  ProblemSpec s;
  s.cfg.op = c.op;
  s.B = c.B, s.T = c.T, s.H = c.H, s.G = c.gqa4 ? c.H / 4 : c.H, s.dk = c.dk, s.dv = c.dv;
  s.seqlens = c.seqlens;
  s.gated = true;
  s.init_state = true;
  s.init_pos = c.init_pos;
  s.dtype = DType::f64;
  s.seed = 31;
  const Problem low = cast_problem(make_problem(s), c.dtype);
  const Result ref = run_forward(cast_problem(low, DType::f64), Form::naive);
  DevTensor q(low.q), k(low.k), v(low.v), g(low.g), lam(low.lam), cu(low.cu_seqlens);
  DevTensor pos(low.init.pos), S0(low.init.S), P0(low.init.P), h0(low.init.H);
  ForwardParams p = low.forward_params(Form::chunk, 64);
  p.q = q.view(), p.k = k.view(), p.v = v.view(), p.g = g.view(), p.lam = lam.view(), p.cu_seqlens = cu.view();
  p.init = {};
  p.init.pos = pos.view(), p.init.S = S0.view(), p.init.P = P0.view(), p.init.H = h0.view();
  const int64_t N = low.num_seqs();
  const StateBuffers fin_host = make_state(s.cfg, N, s.H, s.dk, s.dv, low.max_final_pos(), low.state_dtype());
  DevTensor o(ref.o.cast(c.dtype), true), fpos(fin_host.pos, true), fS(fin_host.S, true), fP(fin_host.P, true),
      fH(fin_host.H, true);
  p.o = o.view();
  p.final_state.pos = fpos.view(), p.final_state.S = fS.view(), p.final_state.P = fP.view(), p.final_state.H = fH.view();
  p.cfg.check_values = true;
  const std::string err = with_env("HILA_LOGLINEAR_TREE_SWEEP", c.tree_sweep, [&] { forward(p); });
  ASSERT_EQ(err, "") << "forward threw";
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const double tol = 1e-2;  // 16-bit operands
  auto check = [&](const char* what, const Buffer& got, const Buffer& want) {
    const double e = rel_err(got, want);
    std::printf("  %-44s %-6s rel err %.2e\n", c.name.c_str(), what, e);
    EXPECT_LE(e, tol) << what;
  };
  check("o", o.fetch(), ref.o);
  if (!ref.final_state.S.empty()) check("S_T", fS.fetch(), ref.final_state.S);
  if (!ref.final_state.P.empty()) check("P_T", fP.fetch(), ref.final_state.P);
  check("H_T", fH.fetch(), ref.final_state.H);
  const Buffer fp = fpos.fetch();
  for (int64_t i = 0; i < N; ++i) EXPECT_EQ(fp.get(i), ref.final_state.pos.get(i)) << "final pos of sequence " << i;
}
INSTANTIATE_TEST_SUITE_P(Shapes, CudaLogLinearContinue, ::testing::ValuesIn(cont_cases()),
                         [](const auto& info) { return info.param.name; });

// Too few lam levels is rejected before any launch on the CUDA path too (docs/math/LOGLINEAR.md §2.3).
TEST(CudaLogLinear, TooFewLevelsIsAnError) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU tests are skipped";
  ProblemSpec s;
  s.cfg.op = Op::loglinear;
  s.B = 1, s.T = 100, s.dk = 16, s.dv = 16;
  s.dtype = DType::bf16;
  const Problem pr = make_problem(s);  // lam has levels_needed(0, 100) = 8 columns
  Buffer lam_short = Buffer(pr.lam.dtype, {1, 100, 1, 7});
  DevTensor q(pr.q), k(pr.k), v(pr.v), g(pr.g), lam(lam_short), o(pr.v, true);
  ForwardParams p = pr.forward_params(Form::chunk, 64);
  p.q = q.view(), p.k = k.view(), p.v = v.view(), p.g = g.view(), p.lam = lam.view(), p.o = o.view();
  try {
    forward(p);
    FAIL() << "expected hila::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "lam") << e.what();
  }
}

}  // namespace
}  // namespace hila::tools
