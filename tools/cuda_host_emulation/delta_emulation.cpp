// SPDX-License-Identifier: Apache-2.0
// Host emulation of the delta rule's portable kernels (src/cuda/delta/segment_portable.cu; see
// run.sh): their driver and kernels run on the CPU with the stand-in headers of this folder, against
// the CPU naive float64 oracle, in float64 and float32.
// EMU_QUICK=1 skips the T = 1000 cases; EMU_BIG=1 runs only the multi-tile head dims (dk 80, dv 130);
// EMU_F32_LONG=1 only float32 at T = 1000, d = 64 (chunk-form oracle).
#include "delta_emu.inc"

#include <cmath>

// Host stand-in for src/cuda/delta/qk.cu's launch_unpack_qk (its kernel takes a warp per row): dq or
// dk per group = mult * the sum over the group's heads of dx (+ dx2), then through the l2
// normalisation of the raw input x (docs/math/LOGLINEAR.md §6.1) when the call asks for it.
namespace hila::cuda {
template <class T>
void launch_unpack_qk(const TensorView& out, const Acc<T>* dx, const Acc<T>* dx2, const T* x, const detail::Resolved& r,
                      int dk, int dkp, Acc<T> mult, cudaStream_t) {
  using R = Acc<T>;
  const Strided o(out);
  const int64_t G = r.G, rep = r.H / r.G, Ttot = r.B * r.T;
  std::vector<R> dy(static_cast<size_t>(dk));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t row = 0; row < Ttot; ++row) {
      for (int c = 0; c < dk; ++c) {
        R sum = 0;
        for (int64_t j = 0; j < rep; ++j) {
          const int64_t e = ((g * rep + j) * Ttot + row) * dkp + c;
          sum += dx2 ? dx[e] + dx2[e] : dx[e];
        }
        dy[size_t(c)] = mult * sum;
      }
      const T* xr = x + (g * Ttot + row) * dkp;
      R inv = 1, ydy = 0;
      if (r.cfg.qk_l2norm) {
        R ss = 0, xdy = 0;
        for (int c = 0; c < dk; ++c) ss += R(xr[c]) * R(xr[c]), xdy += R(xr[c]) * dy[size_t(c)];
        inv = R(1) / std::sqrt(ss + R(detail::kL2NormEps));
        ydy = xdy * inv;
      }
      const int64_t b = row / r.T, t = row % r.T;
      for (int c = 0; c < dk; ++c)
        st<R>(o, b * o.s[0] + t * o.s[1] + g * o.s[2] + c * o.s[3],
              r.cfg.qk_l2norm ? (dy[size_t(c)] - R(xr[c]) * inv * ydy) * inv : dy[size_t(c)]);
    }
}
}  // namespace hila::cuda
#include "problem.h"
#include <cstdio>
#include <cstdlib>
#include <limits>
using namespace hila;
using namespace hila::tools;

template <class T>
double run_case(const char* name, ProblemSpec s, DType dt, double tol, Form oracle = Form::naive) {
  const Problem low = cast_problem(make_problem(s), dt);
  const Problem ref_in = cast_problem(low, DType::f64);
  const Result ref = run_backward(ref_in, oracle);
  Result r;
  r.o = Buffer(dt, {s.B, low.spec.T, s.H, s.dv}); r.o.poison();
  r.final_state = make_state(s.cfg, low.num_seqs(), s.H, s.dk, s.dv, low.max_final_pos(), low.state_dtype());
  r.final_state.poison();
  BackwardParams bp;
  static_cast<ForwardParams&>(bp) = low.forward_params(Form::chunk, 64);
  bp.o = r.o.view();
  bp.final_state = r.final_state.view();
  bp.d_o = low.d_o.view();
  bp.d_final = low.d_final.view();
  auto like = [](const Buffer& b) { Buffer x = b; if (!x.empty()) x.poison(); return x; };
  r.dq = like(low.q); r.dk = like(low.k); r.dv = like(low.v); r.dg = like(low.g); r.dlam = like(low.lam);
  r.dbeta = like(low.beta);
  r.d_init = low.init; r.d_init.pos = Buffer{}; r.d_init.poison();
  bp.dq = r.dq.view(); bp.dk = r.dk.view(); bp.dv = r.dv.view(); bp.dg = r.dg.view(); bp.dlam = r.dlam.view();
  bp.dbeta = r.dbeta.view(); bp.d_init = r.d_init.view();
  const detail::Resolved rs = detail::resolve_backward(bp);
  hila::cuda::delta_portable_backward<T>(rs, bp, nullptr);
  // forward entry
  Result f;
  f.o = Buffer(dt, {s.B, low.spec.T, s.H, s.dv}); f.o.poison();
  f.final_state = make_state(s.cfg, low.num_seqs(), s.H, s.dk, s.dv, low.max_final_pos(), low.state_dtype());
  f.final_state.poison();
  ForwardParams fp = low.forward_params(Form::chunk, 64);
  fp.o = f.o.view(); fp.final_state = f.final_state.view();
  const detail::Resolved rf = detail::resolve_forward(fp);
  hila::cuda::delta_portable_forward<T>(rf, fp, nullptr);
  double worst = 0;
  auto cmp = compare(r, ref, 1e-3);
  cmp.push_back({"fwd.o", rel_err(f.o, ref.o)});
  cmp.push_back({"fwd.H", rel_err(f.final_state.H, ref.final_state.H)});
  cmp.push_back({"fwd.pos", rel_err(f.final_state.pos, ref.final_state.pos)});
  std::printf("%-36s", name);
  for (auto& [n, e] : cmp) { std::printf(" %s=%.1e", n.c_str(), e); worst = std::max(worst, e); }
  std::printf("  %s\n", worst <= tol ? "OK" : "FAIL");
  return worst;
}

int main() {
  int fails = 0;
  if (getenv("EMU_F32_LONG")) {  // the float32 T = 1000 shapes of tests/cuda/test_cuda_delta.cpp
    for (Op op : {Op::gdn, Op::loglinear_gdn}) {
      ProblemSpec s; s.cfg.op = op; s.B = 2; s.T = 1000; s.G = 2; s.H = 2; s.dk = 64; s.dv = 64; s.seed = 23;
      fails += run_case<float>((std::string(op_name(op)) + " f32 d64 T1000").c_str(), s, DType::f32, 1e-4, Form::chunk) > 1e-4;
    }
    std::printf("%d failures\n", fails);
    return fails != 0;
  }
  if (getenv("EMU_BIG")) {
    for (Op op : {Op::gdn, Op::loglinear_gdn}) {
      ProblemSpec s; s.cfg.op = op; s.B = 1; s.T = 0; s.G = 1; s.H = 2; s.dk = 80; s.dv = 130; s.seed = 3;
      s.seqlens = {70, 5}; s.init_state = true; s.init_pos = {13, 64}; s.cfg.qk_l2norm = true;
      fails += run_case<double>((std::string(op_name(op)) + " dk80 dv130").c_str(), s, DType::f64, 1e-10) > 1e-10;
    }
    std::printf("%d failures\n", fails);
    return fails != 0;
  }
  for (Op op : {Op::gdn, Op::loglinear_gdn}) {
    auto base = [&](int64_t T) { ProblemSpec s; s.cfg.op = op; s.B = 1; s.T = T; s.G = 1; s.H = 1; s.dk = 8; s.dv = 12; s.seed = 5; return s; };
    std::string n = op_name(op);
    for (int64_t T : {1, 5, 63, 64, 65, 130, 200}) {
      ProblemSpec s = base(T);
      fails += run_case<double>((n + " T" + std::to_string(T)).c_str(), s, DType::f64, 1e-10) > 1e-10;
    }
    {
      ProblemSpec s = base(0); s.B = 2; s.T = 100; s.G = 1; s.H = 2; s.cfg.qk_l2norm = true; s.init_state = true; s.init_pos = {13};
      fails += run_case<double>((n + " B2 gqa2 l2 init13").c_str(), s, DType::f64, 1e-10) > 1e-10;
    }
    {
      ProblemSpec s = base(0); s.seqlens = {0, 37, 0, 64, 65, 1, 130, 0}; s.init_state = true;
      s.init_pos = {5, 64, 13, 200, 0, 127, 9, 3}; s.H = 2; s.cfg.qk_l2norm = true;
      fails += run_case<double>((n + " varlen init l2").c_str(), s, DType::f64, 1e-10) > 1e-10;
    }
    {
      ProblemSpec s = base(0); s.seqlens = {70, 0, 3}; s.init_state = true; s.init_pos = {(int64_t(1) << 17) + 5, 200, 13};
      s.init_extra_slots = 2; s.gated = false;
      fails += run_case<double>((n + " varlen 2^17+5 extra ungated").c_str(), s, DType::f64, 1e-10) > 1e-10;
    }
    {
      ProblemSpec s = base(150); s.B = 2; s.H = 4; s.G = 1; s.dk = 16; s.dv = 16; s.init_state = true; s.init_pos = {200};
      fails += run_case<float>((n + " f32 gqa4 init200").c_str(), s, DType::f32, 1e-4) > 1e-4;
    }
  }
  if (!getenv("EMU_QUICK"))
  for (Op op : {Op::gdn, Op::loglinear_gdn}) {
    ProblemSpec s; s.cfg.op = op; s.B = 1; s.T = 1000; s.G = 1; s.H = 1; s.dk = 8; s.dv = 8; s.seed = 9;
    s.init_state = true; s.init_pos = {(int64_t(1) << 17) - 300}; s.cfg.qk_l2norm = true;
    fails += run_case<double>((std::string(op_name(op)) + " T1000 across 2^17").c_str(), s, DType::f64, 1e-10) > 1e-10;
  }
  std::printf("%d failures\n", fails);
  return fails != 0;
}
