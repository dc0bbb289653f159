// SPDX-License-Identifier: Apache-2.0
// Host time per call of the code every backend runs before its kernels: validation (src/core:
// resolve_forward / resolve_backward / resolve_step) and the dispatch around it (src/api), measured
// on the CPU backend with calls so small that their arithmetic is negligible (one token or a few,
// one head of 8 columns). A microbenchmark, not a test: it prints CSV rows
//   what,op,check_values,ns_per_call
// with the median over --reps batches of --iters calls each (defaults 15 and 2000):
//   resolve_forward / resolve_backward / resolve_step   validation alone (B = 1, T = 4 / N = 1)
//   forward / backward / step                           the whole CPU call (the same shapes)
//   step_max_position                                   the same step with StepParams::max_position
// Run: build/bench/hila_host_bench [--reps N] [--iters N] [--ops gla,loglinear,...]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <hila/hila.h>

#include "bench_args.h"
#include "core/problem.h"

namespace {

using hila::DType;
using hila::Op;
using hila::TensorView;

struct Buf {
  std::vector<float> f;
  std::vector<int64_t> i;
  TensorView view(DType dt, std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    if (dt == DType::i64) {
      i.assign(size_t(n), 0);
      return TensorView::contiguous_view(i.data(), dt, shape);
    }
    f.assign(size_t(n), 0.f);
    for (size_t k = 0; k < f.size(); ++k) f[k] = 0.01f * float((k * 7919) % 13) - 0.06f;
    return TensorView::contiguous_view(f.data(), dt, shape);
  }
};

// A tiny call of `op`: B = 1, T tokens, G = H = 1, dk = dv = 8; gates -0.1, lam 0.5, beta 0.3.
struct Tiny {
  static constexpr int64_t T = 4, D = 8, L = 8;
  Buf q, k, v, g, lam, beta, o, dq, dk, dv, dg, dlam, dbeta, d_o;
  Buf sq, sk, sv, sg, slam, sbeta, so;  // one decode token
  Buf pos, S, P, H;                     // a caller-owned decode state
  hila::ForwardParams fp;
  hila::BackwardParams bp;
  hila::StepParams sp;
  hila::StateView st;

  Tiny(Op op, bool check) {
    const hila::OpTraits t = hila::op_traits(op);
    hila::OpConfig cfg;
    cfg.op = op;
    cfg.check_values = check;
    cfg.qk_l2norm = t.delta;
    fp.cfg = cfg;
    fp.q = q.view(DType::f32, {1, T, 1, D});
    fp.k = k.view(DType::f32, {1, T, 1, D});
    fp.v = v.view(DType::f32, {1, T, 1, D});
    fp.g = g.view(DType::f32, {1, T, 1});
    for (float& x : g.f) x = -0.1f;
    if (t.loglinear) {
      fp.lam = lam.view(DType::f32, {1, T, 1, L});
      for (float& x : lam.f) x = 0.5f;
    }
    if (t.delta) {
      fp.beta = beta.view(DType::f32, {1, T, 1});
      for (float& x : beta.f) x = 0.3f;
    }
    fp.o = o.view(DType::f32, {1, T, 1, D});
    static_cast<hila::ForwardParams&>(bp) = fp;
    bp.o = {};
    bp.d_o = d_o.view(DType::f32, {1, T, 1, D});
    bp.dq = dq.view(DType::f32, {1, T, 1, D});
    bp.dk = dk.view(DType::f32, {1, T, 1, D});
    bp.dv = dv.view(DType::f32, {1, T, 1, D});
    bp.dg = dg.view(DType::f32, {1, T, 1});
    if (t.loglinear) bp.dlam = dlam.view(DType::f32, {1, T, 1, L});
    if (t.delta) bp.dbeta = dbeta.view(DType::f32, {1, T, 1});

    sp.cfg = cfg;
    sp.q = sq.view(DType::f32, {1, 1, D});
    sp.k = sk.view(DType::f32, {1, 1, D});
    sp.v = sv.view(DType::f32, {1, 1, D});
    sp.g = sg.view(DType::f32, {1, 1});
    for (float& x : sg.f) x = -0.1f;
    if (t.loglinear) {
      sp.lam = slam.view(DType::f32, {1, 1, L});
      for (float& x : slam.f) x = 0.5f;
    }
    if (t.delta) {
      sp.beta = sbeta.view(DType::f32, {1, 1});
      for (float& x : sbeta.f) x = 0.3f;
    }
    sp.o = so.view(DType::f32, {1, 1, D});
    const hila::StateShape sh = hila::state_shape(cfg, 1, 1, D, D, (int64_t(1) << (L - 1)) - 1);
    st.pos = pos.view(DType::i64, {1});
    auto part = [](Buf& b, const std::vector<int64_t>& s) {
      int64_t n = 1;
      for (int64_t x : s) n *= x;
      b.f.assign(size_t(n), 0.f);
      return TensorView::contiguous_view(b.f.data(), DType::f32, s.data(), int(s.size()));
    };
    if (sh.S) st.S = part(S, sh.S_shape);
    if (sh.P) st.P = part(P, sh.P_shape);
    st.H = part(H, sh.H_shape);
  }
  // Steps from position 0 again (the state's values stay bounded: gates < 0).
  void rewind() { pos.i[0] = 0; }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ns per call: the median over `reps` batches of `iters` calls.
double time_ns(int reps, int iters, const std::function<void()>& f) {
  for (int i = 0; i < iters / 4 + 1; ++i) f();  // warm-up
  std::vector<double> per;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) f();
    per.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / iters);
  }
  return median(per);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 15, iters = 2000;
  std::vector<Op> ops = {Op::gla, Op::hla2, Op::loglinear, Op::gdn};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return hila::bench::flag_value(argc, argv, i); };
    if (a == "--reps") reps = std::max(1, std::atoi(next().c_str()));
    else if (a == "--iters") iters = std::max(1, std::atoi(next().c_str()));
    else if (a == "--ops") {
      ops.clear();
      const std::string list = next();
      size_t b = 0;
      while (b <= list.size()) {
        const size_t e = std::min(list.find(',', b), list.size());
        ops.push_back(hila::parse_op(list.substr(b, e - b)));
        b = e + 1;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--reps N] [--iters N] [--ops gla,loglinear,...]\n", argv[0]);
      return 2;
    }
  }
  std::printf("what,op,check_values,ns_per_call\n");
  for (Op op : ops) {
    for (bool check : {false, true}) {
      Tiny c(op, check);
      auto row = [&](const char* what, const std::function<void()>& f) {
        std::printf("%s,%s,%d,%.0f\n", what, hila::op_name(op), int(check), time_ns(reps, iters, f));
        std::fflush(stdout);
      };
      row("resolve_forward", [&] { (void)hila::detail::resolve_forward(c.fp); });
      row("resolve_backward", [&] { (void)hila::detail::resolve_backward(c.bp); });
      row("resolve_step", [&] {
        c.rewind();
        (void)hila::detail::resolve_step(c.sp, c.st);
      });
      row("forward", [&] { hila::forward(c.fp); });
      row("backward", [&] { hila::backward(c.bp); });
      row("step", [&] {
        c.rewind();
        hila::step(c.sp, c.st);
      });
      hila::StepParams bounded = c.sp;
      bounded.max_position = 100;  // within the state's 8 slots and lam's 8 levels
      row("step_max_position", [&] {
        c.rewind();
        hila::step(bounded, c.st);
      });
    }
  }
  return 0;
}
