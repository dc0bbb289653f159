// SPDX-License-Identifier: Apache-2.0
// Times hila's CPU backend (hila::forward / hila::backward on host float32 tensors, chunk form,
// check_values off unless --check) and prints CSV rows:
//   op,B,T,H,d,direction,reps,wall_us,cpu_us,thread_us,checksum
// wall_us, cpu_us (process CPU time: every OpenMP thread) and thread_us (the calling thread's CPU
// time) are medians over `reps` calls after warm-up. "fwd" is one forward writing o; "bwd" is one
// backward as the PyTorch autograd path calls it (no o, no final state; dq, dk, dv and dg, dlam,
// dbeta where the op has them). checksum is sum |output| of the last call (a quick before/after
// comparison; the tests hold the precision).
//
//   cpu_bench [--ops gla,hla2,loglinear,gdn] [--shapes tiny,medium,large | BxTxHxd,...]
//             [--dirs fwd,bwd] [--reps N] [--seconds S] [--chunk C] [--form chunk] [--check]
// Shapes: tiny 1x64x2x16, medium 2x1024x4x64, large 1x8192x8x128 (B x T x H x d, dk = dv = d).
// A row stops at --reps calls or after --seconds of timed calls (default 2000 calls, 2 s), with at
// least 3 calls. --check turns the value checks on (inputs and outputs scanned, as the default
// hila.torch call does). Build: cmake -DHILA_BUILD_CPU_BENCH=ON, target cpu_bench.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <hila/hila.h>

#include "bench_args.h"
#include "problem.h"

namespace {

using hila::tools::Buffer;

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) out.push_back(x);
  return out;
}

struct Shape {
  int64_t B, T, H, d;
};

Shape parse_shape(const std::string& s) {
  if (s == "tiny") return {1, 64, 2, 16};
  if (s == "medium") return {2, 1024, 4, 64};
  if (s == "large") return {1, 8192, 8, 128};
  Shape x{};
  if (std::sscanf(s.c_str(), "%ldx%ldx%ldx%ld", &x.B, &x.T, &x.H, &x.d) != 4) {
    std::fprintf(stderr, "bad shape %s (tiny, medium, large or BxTxHxd)\n", s.c_str());
    std::exit(2);
  }
  return x;
}

double now_us(clockid_t c) {
  timespec ts;
  clock_gettime(c, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double abs_sum(const Buffer& b) {
  double s = 0;
  for (int64_t i = 0; i < b.numel(); ++i) s += std::fabs(b.get(i));
  return s;
}

Buffer like(const Buffer& b) { return b.empty() ? Buffer() : Buffer(b.dtype, b.shape); }

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> ops = {"gla", "hla2", "loglinear", "gdn"};
  std::vector<std::string> shapes = {"tiny", "medium", "large"};
  std::vector<std::string> dirs = {"fwd", "bwd"};
  int64_t reps = 2000, chunk = 64;
  double seconds = 2.0;
  std::string form = "chunk";
  bool check = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return hila::bench::flag_value(argc, argv, i); };
    if (a == "--ops") ops = split(next());
    else if (a == "--shapes") shapes = split(next());
    else if (a == "--dirs") dirs = split(next());
    else if (a == "--reps") reps = std::atoll(next().c_str());
    else if (a == "--seconds") seconds = std::atof(next().c_str());
    else if (a == "--chunk") chunk = std::atoll(next().c_str());
    else if (a == "--form") form = next();
    else if (a == "--check") check = true;
    else {
      std::fprintf(stderr, "unknown argument %s (see the header of bench/cpu_bench.cpp)\n", a.c_str());
      return 2;
    }
  }
  std::printf("op,B,T,H,d,direction,reps,wall_us,cpu_us,thread_us,checksum\n");
  for (const std::string& shp : shapes) {
    const Shape S = parse_shape(shp);
    for (const std::string& opn : ops) {
      hila::tools::ProblemSpec ps;
      ps.cfg.op = hila::parse_op(opn);
      ps.cfg.check_values = check;
      ps.B = S.B, ps.T = S.T, ps.G = S.H, ps.H = S.H, ps.dk = S.d, ps.dv = S.d;
      ps.dtype = hila::DType::f32;
      ps.seed = 1;
      const hila::tools::Problem p = hila::tools::make_problem(ps);
      const hila::Form f = hila::parse_form(form);
      for (const std::string& dir : dirs) {
        Buffer o = like(p.v), dq = like(p.q), dk = like(p.k), dv = like(p.v), dg = like(p.g),
               dlam = like(p.lam), dbeta = like(p.beta);
        hila::BackwardParams bp;
        static_cast<hila::ForwardParams&>(bp) = p.forward_params(f, chunk);
        const bool bwd = dir == "bwd";
        if (!bwd && dir != "fwd") {
          std::fprintf(stderr, "bad direction %s (fwd, bwd)\n", dir.c_str());
          return 2;
        }
        if (bwd) {
          bp.d_o = p.d_o.view();
          bp.dq = dq.view(), bp.dk = dk.view(), bp.dv = dv.view(), bp.dg = dg.view();
          bp.dlam = dlam.view(), bp.dbeta = dbeta.view();
        } else {
          bp.o = o.view();
        }
        auto call = [&] {
          if (bwd) hila::backward(bp);
          else hila::forward(static_cast<const hila::ForwardParams&>(bp));
        };
        call();  // warm-up (and first-touch of every buffer)
        std::vector<double> wall, cpu, thr;
        const auto t_end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
        for (int64_t r = 0; r < reps; ++r) {
          const double c0 = now_us(CLOCK_PROCESS_CPUTIME_ID), h0 = now_us(CLOCK_THREAD_CPUTIME_ID);
          const auto w0 = std::chrono::steady_clock::now();
          call();
          const auto w1 = std::chrono::steady_clock::now();
          thr.push_back(now_us(CLOCK_THREAD_CPUTIME_ID) - h0);
          cpu.push_back(now_us(CLOCK_PROCESS_CPUTIME_ID) - c0);
          wall.push_back(std::chrono::duration<double, std::micro>(w1 - w0).count());
          if (r >= 2 && w1 > t_end) break;
        }
        double ck = 0;
        for (const Buffer* b : {&o, &dq, &dk, &dv, &dg, &dlam, &dbeta})
          if (!b->empty() && (bwd ? b != &o : b == &o)) ck += abs_sum(*b);
        std::printf("%s,%ld,%ld,%ld,%ld,%s,%zu,%.2f,%.2f,%.2f,%.9g\n", opn.c_str(), S.B, S.T, S.H,
                    S.d, dir.c_str(), wall.size(), median(wall), median(cpu), median(thr), ck);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
