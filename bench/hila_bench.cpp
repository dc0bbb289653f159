// SPDX-License-Identifier: Apache-2.0
// Times hila's CUDA operators with CUDA events (warm-up, then the median of --reps runs) and
// prints CSV rows: impl,op,dtype,B,T,H,d,direction,ms. Inputs are random (never zeros); each
// input tensor of the benchmark shapes exceeds the L2 cache, so no rotation is needed.
// "fwdbwd" is one forward() plus one backward() (which recomputes the chunk states), i.e. what a
// training step pays.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <hila/hila.h>

namespace {

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

uint16_t bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t b) : bytes(b) { CK(cudaMalloc(&p, b)); }
  ~Dev() { cudaFree(p); }
};

void fill_bf16(Dev& d, std::mt19937& rng, float sd) {
  std::normal_distribution<float> n(0.f, sd);
  std::vector<uint16_t> h(d.bytes / 2);
  for (auto& x : h) x = bf16(n(rng));
  CK(cudaMemcpy(d.p, h.data(), d.bytes, cudaMemcpyHostToDevice));
}
void fill_bf16_uniform(Dev& d, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<uint16_t> h(d.bytes / 2);
  for (auto& x : h) x = bf16(u(rng));
  CK(cudaMemcpy(d.p, h.data(), d.bytes, cudaMemcpyHostToDevice));
}
void fill_gates(Dev& d, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(std::log(0.9f), 0.f);
  std::vector<float> h(d.bytes / 4);
  for (auto& x : h) x = u(rng);
  CK(cudaMemcpy(d.p, h.data(), d.bytes, cudaMemcpyHostToDevice));
}

template <class F>
double median_ms(F f, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) f();
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double wall_ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// First call of each op in this fresh process (B=1, T=256, bf16, forward; host wall time to
// completion): what a user pays before anything is cached. CUDA context creation is timed
// separately (direction "context").
void first_calls(const std::vector<hila::Op>& ops, int64_t H, int64_t d, std::mt19937& rng) {
  using namespace hila;
  auto t0 = std::chrono::steady_clock::now();
  CK(cudaFree(nullptr));
  std::printf("hila,cuda_context,bf16,1,0,0,0,context,%.4f\n", wall_ms(t0));
  const int64_t B = 1, T = 256;
  const size_t nq = size_t(B * T * H * d);
  Dev q(nq * 2), k(nq * 2), v(nq * 2), o(nq * 2), g(size_t(B * T * H) * 4);
  fill_bf16(q, rng, 1.f / std::sqrt(float(d)));
  fill_bf16(k, rng, 1.f / std::sqrt(float(d)));
  fill_bf16(v, rng, 1.f);
  fill_gates(g, rng);
  const Device dev{DeviceType::cuda, 0};
  auto view4 = [&](Dev& x) { return TensorView::contiguous_view(x.p, DType::bf16, {B, T, H, d}, dev); };
  for (Op op : ops) {
    ForwardParams p;
    p.cfg.op = op;
    p.q = view4(q), p.k = view4(k), p.v = view4(v), p.o = view4(o);
    p.g = TensorView::contiguous_view(g.p, DType::f32, {B, T, H}, dev);
    t0 = std::chrono::steady_clock::now();
    forward(p);
    CK(cudaDeviceSynchronize());
    std::printf("hila,%s,bf16,%lld,%lld,%lld,%lld,first_call,%.4f\n", op_name(op), (long long)B, (long long)T,
                (long long)H, (long long)d, wall_ms(t0));
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace hila;
  int reps = 10, warmup = 2;
  std::vector<Op> ops = {Op::gla};
  int64_t H = 16, d = 128;
  std::vector<std::pair<int64_t, int64_t>> shapes = {{32, 1024}, {8, 4096}, {2, 16384}, {1, 65536}};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--reps") reps = std::stoi(v);
    else if (k == "--warmup") warmup = std::stoi(v);
    else if (k == "--H") H = std::stoll(v);
    else if (k == "--ops") {  // "gla,hla2"
      ops.clear();
      for (size_t pos = 0; pos <= v.size();) {
        const size_t c = v.find(',', pos), e = c == std::string::npos ? v.size() : c;
        ops.push_back(parse_op(v.substr(pos, e - pos)));
        pos = e + 1;
      }
    }
    else if (k == "--d") d = std::stoll(v);
    else if (k == "--shapes") {  // "B:T,B:T"
      shapes.clear();
      size_t pos = 0;
      while (pos < v.size()) {
        const size_t c = v.find(',', pos), e = c == std::string::npos ? v.size() : c;
        const std::string item = v.substr(pos, e - pos);
        const size_t colon = item.find(':');
        shapes.push_back({std::stoll(item.substr(0, colon)), std::stoll(item.substr(colon + 1))});
        pos = e + 1;
      }
    }
  }
  std::printf("impl,op,dtype,B,T,H,d,direction,ms\n");
  std::mt19937 rng(0);
  first_calls(ops, H, d, rng);
  for (auto [B, T] : shapes) {
    const size_t nq = size_t(B * T * H * d);
    Dev q(nq * 2), k(nq * 2), v(nq * 2), o(nq * 2), dO(nq * 2), dq(nq * 2), dk(nq * 2), dv(nq * 2);
    Dev g(size_t(B * T * H) * 4), dg(size_t(B * T * H) * 4);
    fill_bf16(q, rng, 1.f / std::sqrt(float(d)));
    fill_bf16(k, rng, 1.f / std::sqrt(float(d)));
    fill_bf16(v, rng, 1.f);
    fill_bf16(dO, rng, 1.f);
    fill_gates(g, rng);
    const Device dev{DeviceType::cuda, 0};
    auto view4 = [&](Dev& x) { return TensorView::contiguous_view(x.p, DType::bf16, {B, T, H, d}, dev); };
    for (Op op : ops) {
    BackwardParams p;
    p.cfg.op = op;
    p.cfg.check_values = false;  // value checks copy inputs to the host
    p.form = Form::chunk;
    p.q = view4(q), p.k = view4(k), p.v = view4(v), p.o = view4(o);
    p.g = TensorView::contiguous_view(g.p, DType::f32, {B, T, H}, dev);
    // delta rule (gdn, loglinear_gdn): beta in [0, 1]; log-linear: lam with the levels T needs
    const OpTraits tr = op_traits(op);
    const int64_t L = levels_needed(0, T);
    Dev beta(tr.delta ? size_t(B * T * H) * 2 : 1), dbeta(tr.delta ? size_t(B * T * H) * 2 : 1);
    Dev lam(tr.loglinear ? size_t(B * T * H * L) * 2 : 1), dlam(tr.loglinear ? size_t(B * T * H * L) * 2 : 1);
    if (tr.delta) {
      fill_bf16_uniform(beta, rng, 0.f, 1.f);
      p.beta = TensorView::contiguous_view(beta.p, DType::bf16, {B, T, H}, dev);
    }
    if (tr.loglinear) {
      fill_bf16_uniform(lam, rng, 0.25f, 1.5f);
      p.lam = TensorView::contiguous_view(lam.p, DType::bf16, {B, T, H, L}, dev);
    }
    const double fwd = median_ms([&] { forward(p); }, warmup, reps);
    BackwardParams b = p;
    if (tr.delta) b.dbeta = TensorView::contiguous_view(dbeta.p, DType::bf16, {B, T, H}, dev);
    if (tr.loglinear) b.dlam = TensorView::contiguous_view(dlam.p, DType::bf16, {B, T, H, L}, dev);
    b.o = {};
    b.d_o = view4(dO);
    b.dq = view4(dq), b.dk = view4(dk), b.dv = view4(dv);
    b.dg = TensorView::contiguous_view(dg.p, DType::f32, {B, T, H}, dev);
    const double bwd = median_ms([&] { backward(b); }, warmup, reps);
    std::printf("hila,%s,bf16,%lld,%lld,%lld,%lld,fwd,%.4f\n", op_name(op), (long long)B, (long long)T,
                (long long)H, (long long)d, fwd);
    std::printf("hila,%s,bf16,%lld,%lld,%lld,%lld,fwdbwd,%.4f\n", op_name(op), (long long)B, (long long)T,
                (long long)H, (long long)d, fwd + bwd);
    std::fflush(stdout);
    }
  }
  return 0;
}
