// SPDX-License-Identifier: Apache-2.0
// Times hila's CUDA operators with CUDA events (warm-up, then the median of --reps runs, timed as
// the anchors are: see bench_ms) and prints CSV rows: impl,op,dtype,B,T,H,d,direction,ms,dk,G,sync_ms
// (d = dv; --dk, --dv, --G: head dims and q/k groups, defaults d, d, H; --chunk C, default 64;
// --dtype bf16 (default) or f32: the operand dtype of q, k, v, lam, beta and their gradients in the
// fwd / fwdbwd rows, f32 timing the portable float32 kernels).
// Inputs are random (never zeros); each input tensor of the benchmark shapes exceeds the L2 cache,
// so no rotation is needed.
// "fwdbwd" is one forward() plus one backward() (which recomputes the chunk states), i.e. what a
// training step pays.
// --prefill: also times, per op and shape, a forward that writes the final state (direction
// "prefill", from position 0) and a forward from a (zero) initial state at position T to 2T with
// the final state (direction "continue"; lam with the levels 2T needs): what serving a prompt and
// a chunked prefill pay.
// --l2norm: the delta-rule ops (gdn, loglinear_gdn) with qk_l2norm on, as fla's
// chunk_gated_delta_rule anchor runs (use_qk_l2norm_in_kernel=True).
// --decode: one hila::step on a CUDA DecodeState (bf16 inputs, fp32 state) per timed run, for each
// op at batch N (--batches, default 1,16,256) and, for log-linear ops, start positions --positions
// (default 4096,65536,1048576; the state is a loaded zero state at that position). Prints
// op,N,pos,us_per_step,state_bytes,GB_per_s: us_per_step is the median of --reps steps after
// warm-up; state_bytes is the state read + written by one step (mean over the timed steps, whose
// positions advance by one each); GB_per_s = (state_bytes + input/output bytes) / mean step time,
// to be compared with the device's copy bandwidth (printed to stderr first); host_us is the median
// host time of the step() call itself (validation, planning, the launch), which the event-timed
// us_per_step includes when the GPU waits for it (small N).
// --decode-view: the same, but each step runs on the DecodeState's memory as a caller-owned
// StateView with StepParams::max_position (the step a CUDA graph captures: no host read of the
// positions, no counters), so host_us is that path's host time.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
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

// d's elements (bf16, or f32 with f32) drawn from dist
template <class Dist>
void fill_with(Dev& d, std::mt19937& rng, Dist dist, bool f32) {
  if (f32) {
    std::vector<float> h(d.bytes / 4);
    for (auto& x : h) x = dist(rng);
    CK(cudaMemcpy(d.p, h.data(), d.bytes, cudaMemcpyHostToDevice));
  } else {
    std::vector<uint16_t> h(d.bytes / 2);
    for (auto& x : h) x = bf16(dist(rng));
    CK(cudaMemcpy(d.p, h.data(), d.bytes, cudaMemcpyHostToDevice));
  }
}
void fill_normal(Dev& d, std::mt19937& rng, float sd, bool f32 = false) {
  fill_with(d, rng, std::normal_distribution<float>(0.f, sd), f32);
}
void fill_uniform(Dev& d, std::mt19937& rng, float lo, float hi, bool f32 = false) {
  fill_with(d, rng, std::uniform_real_distribution<float>(lo, hi), f32);
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

// The anchors' method (triton.testing.do_bench, bench/anchors.py): per run, a 256 MB memset
// clears the L2 cache, then events around the call; runs are issued back to back without
// synchronization, so the host work of a call overlaps the GPU work before it, as in a training
// loop. `ms` is the median of those; `sync_ms` the median with a synchronization after every call
// (the latency of one isolated call, host overhead included).
struct Timing {
  double ms, sync_ms;
  Timing operator+(const Timing& o) const { return {ms + o.ms, sync_ms + o.sync_ms}; }
};
template <class F>
Timing bench_ms(F f, int warmup, int reps) {
  static Dev flush(size_t(256) << 20);
  for (int i = 0; i < warmup; ++i) f();
  CK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> a(reps), b(reps);
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventCreate(&a[i]));
    CK(cudaEventCreate(&b[i]));
  }
  for (int i = 0; i < reps; ++i) {
    CK(cudaMemsetAsync(flush.p, 0, flush.bytes));
    CK(cudaEventRecord(a[i]));
    f();
    CK(cudaEventRecord(b[i]));
  }
  CK(cudaDeviceSynchronize());
  std::vector<float> t(reps);
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventElapsedTime(&t[i], a[i], b[i]));
    CK(cudaEventDestroy(a[i]));
    CK(cudaEventDestroy(b[i]));
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], median_ms(f, 0, reps)};
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
  std::printf("hila,cuda_context,bf16,1,0,0,0,context,%.4f,0,0\n", wall_ms(t0));
  const int64_t B = 1, T = 256;
  const size_t nq = size_t(B * T * H * d);
  const int64_t L = levels_needed(0, T);
  Dev q(nq * 2), k(nq * 2), v(nq * 2), o(nq * 2), g(size_t(B * T * H) * 4);
  Dev lam(size_t(B * T * H * L) * 2), beta(size_t(B * T * H) * 2);
  fill_normal(q, rng, 1.f / std::sqrt(float(d)));
  fill_normal(k, rng, 1.f / std::sqrt(float(d)));
  fill_normal(v, rng, 1.f);
  fill_gates(g, rng);
  fill_uniform(lam, rng, 0.25f, 1.5f);
  fill_uniform(beta, rng, 0.f, 1.f);
  const Device dev{DeviceType::cuda, 0};
  auto view4 = [&](Dev& x) { return TensorView::contiguous_view(x.p, DType::bf16, {B, T, H, d}, dev); };
  for (Op op : ops) {
    ForwardParams p;
    p.cfg.op = op;
    p.q = view4(q), p.k = view4(k), p.v = view4(v), p.o = view4(o);
    p.g = TensorView::contiguous_view(g.p, DType::f32, {B, T, H}, dev);
    if (op_traits(op).loglinear) p.lam = TensorView::contiguous_view(lam.p, DType::bf16, {B, T, H, L}, dev);
    if (op_traits(op).delta) p.beta = TensorView::contiguous_view(beta.p, DType::bf16, {B, T, H}, dev);
    t0 = std::chrono::steady_clock::now();
    forward(p);
    CK(cudaDeviceSynchronize());
    std::printf("hila,%s,bf16,%lld,%lld,%lld,%lld,first_call,%.4f,%lld,%lld\n", op_name(op), (long long)B, (long long)T,
                (long long)H, (long long)d, wall_ms(t0), (long long)d, (long long)H);
  }
  std::fflush(stdout);
}

std::vector<int64_t> parse_list(const std::string& v) {
  std::vector<int64_t> out;
  for (size_t pos = 0; pos <= v.size();) {
    const size_t c = v.find(',', pos), e = c == std::string::npos ? v.size() : c;
    out.push_back(std::stoll(v.substr(pos, e - pos)));
    pos = e + 1;
  }
  return out;
}

// Bytes of state one step reads and writes per (sequence, head) at position t (see step.cu):
// S and P read + written; flat H read + written; Fenwick: the popcount(t) live slots read and
// written (zeroed when merged) and the merge target written.
double step_state_bytes(const hila::OpConfig& cfg, int64_t dk, int64_t dv, int64_t t) {
  const hila::OpTraits tr = hila::op_traits(cfg.op);
  const double f = 4, slot = double(dk) * dv * f;
  double b = 0;
  if (tr.has_S) b += 2.0 * dk * (dk + 1) / 2 * f;
  if (tr.has_P) b += 2 * slot;
  b += tr.loglinear ? (2.0 * __builtin_popcountll(uint64_t(t)) + 1) * slot : 2 * slot;
  return b;
}

void run_decode(const std::vector<hila::Op>& ops, int64_t H, int64_t dk, int64_t dv, int reps, int warmup,
                const std::vector<int64_t>& batches, const std::vector<int64_t>& positions, bool as_view) {
  using namespace hila;
  const Device dev{DeviceType::cuda, 0};
  {  // the reference: device-to-device copy bandwidth (read + write), on stderr
    const size_t bytes = size_t(1) << 30;
    Dev a(bytes), b(bytes);
    const double ms = median_ms([&] { CK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice)); }, 2, 10);
    std::fprintf(stderr, "# cudaMemcpy device-to-device: %.1f GB/s (read + write)\n", 2.0 * bytes / (ms * 1e-3) / 1e9);
  }
  std::printf("op,N,pos,us_per_step,state_bytes,GB_per_s,H,dk,dv,host_us\n");
  std::mt19937 rng(0);
  for (Op op : ops) {
    const OpTraits tr = op_traits(op);
    for (int64_t N : batches) {
      for (int64_t T : tr.loglinear ? positions : std::vector<int64_t>{0}) {
        OpConfig cfg;
        cfg.op = op;
        cfg.check_values = false;  // value checks copy inputs to the host
        const int64_t steps = warmup + reps, L = state_slots(T + steps);
        DecodeState ds(cfg, N, H, dk, dv, DType::f32, dev);
        ds.reserve(T + steps);
        if (T > 0) {  // a zero state at position T
          const StateShape sh = state_shape(cfg, N, H, dk, dv, T);
          auto zeros = [&](const std::vector<int64_t>& shape) {
            size_t n = 4;
            for (int64_t x : shape) n *= size_t(x);
            auto z = std::make_unique<Dev>(n);
            CK(cudaMemset(z->p, 0, n));
            return z;
          };
          std::vector<int64_t> pos(size_t(N), T);
          Dev dpos(size_t(N) * 8);
          CK(cudaMemcpy(dpos.p, pos.data(), size_t(N) * 8, cudaMemcpyHostToDevice));
          std::unique_ptr<Dev> zS, zP, zH = zeros(sh.H_shape);
          StateView src;
          src.pos = TensorView::contiguous_view(dpos.p, DType::i64, {N}, dev);
          if (sh.S) zS = zeros(sh.S_shape), src.S = TensorView::contiguous_view(zS->p, DType::f32, sh.S_shape.data(), 3, dev);
          if (sh.P) zP = zeros(sh.P_shape), src.P = TensorView::contiguous_view(zP->p, DType::f32, sh.P_shape.data(), 4, dev);
          src.H = TensorView::contiguous_view(zH->p, DType::f32, sh.H_shape.data(), int(sh.H_shape.size()), dev);
          ds.load(src);
        }
        Dev q(size_t(N * H * dk) * 2), k(size_t(N * H * dk) * 2), v(size_t(N * H * dv) * 2), o(size_t(N * H * dv) * 2);
        Dev g(size_t(N * H) * 4), lam(size_t(N * H * L) * 2), beta(size_t(N * H) * 2);
        fill_normal(q, rng, 1.f / std::sqrt(float(dk)));
        fill_normal(k, rng, 1.f / std::sqrt(float(dk)));
        fill_normal(v, rng, 1.f);
        fill_normal(lam, rng, 0.5f);
        fill_normal(beta, rng, 0.5f);
        fill_gates(g, rng);
        StepParams sp;
        sp.cfg = cfg;
        auto v3 = [&](Dev& x, int64_t d) { return TensorView::contiguous_view(x.p, DType::bf16, {N, H, d}, dev); };
        sp.q = v3(q, dk), sp.k = v3(k, dk), sp.v = v3(v, dv), sp.o = v3(o, dv);
        sp.g = TensorView::contiguous_view(g.p, DType::f32, {N, H}, dev);
        if (tr.loglinear) sp.lam = TensorView::contiguous_view(lam.p, DType::bf16, {N, H, L}, dev);
        if (tr.delta) sp.beta = TensorView::contiguous_view(beta.p, DType::bf16, {N, H}, dev);
        StateView sv;
        if (as_view) sv = ds.view(), sp.max_position = T + steps - 1;  // the slots of reserve(T + steps)
        auto one_step = [&] { as_view ? step(sp, sv) : step(sp, ds); };
        for (int i = 0; i < warmup; ++i) one_step();
        CK(cudaDeviceSynchronize());
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        std::vector<float> ms;
        std::vector<double> host_us;  // the host's part: step() from call to return (the launch enqueued)
        double state_bytes = 0;
        for (int i = 0; i < reps; ++i) {
          state_bytes += double(N * H) * step_state_bytes(cfg, dk, dv, T + (as_view ? warmup + i : ds.position(0) - T));
          CK(cudaEventRecord(a));
          const auto h0 = std::chrono::steady_clock::now();
          one_step();
          host_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count());
          CK(cudaEventRecord(b));
          CK(cudaEventSynchronize(b));
          float t = 0;
          CK(cudaEventElapsedTime(&t, a, b));
          ms.push_back(t);
        }
        CK(cudaEventDestroy(a));
        CK(cudaEventDestroy(b));
        double total_ms = 0;
        for (float t : ms) total_ms += t;
        std::sort(ms.begin(), ms.end());
        state_bytes /= reps;
        // q, k, v, o in bf16, g f32, lam / beta bf16, pos read + written
        const double io = double(N * H) * ((2.0 * dk + 2.0 * dv) * 2 + 4 + (tr.loglinear ? 2.0 * L : 0) + (tr.delta ? 2 : 0)) + 16.0 * N;
        const double gbs = (state_bytes + io) / (total_ms / reps * 1e-3) / 1e9;
        std::sort(host_us.begin(), host_us.end());
        std::printf("%s,%lld,%lld,%.2f,%.0f,%.1f,%lld,%lld,%lld,%.2f\n", op_name(op), (long long)N, (long long)T,
                    ms[ms.size() / 2] * 1e3, state_bytes, gbs, (long long)H, (long long)dk, (long long)dv,
                    host_us[host_us.size() / 2]);
        std::fflush(stdout);
      }
    }
  }
}

// --prefill rows (see the top): p is a forward over [B, T] from position 0.
void time_prefill(const hila::ForwardParams& p, int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, int64_t G,
                  int warmup, int reps, std::mt19937& rng) {
  using namespace hila;
  const Device dev{DeviceType::cuda, 0};
  auto state = [&](int64_t pos, std::vector<std::unique_ptr<Dev>>& keep) {  // a zero state of B sequences at pos
    const StateShape sh = state_shape(p.cfg, B, H, dk, dv, pos);
    auto zeros = [&](const std::vector<int64_t>& shape, DType dt) {
      size_t n = dt == DType::i64 ? 8 : 4;
      for (int64_t x : shape) n *= size_t(x);
      keep.push_back(std::make_unique<Dev>(n));
      CK(cudaMemset(keep.back()->p, 0, n));
      return TensorView::contiguous_view(keep.back()->p, dt, shape.data(), int(shape.size()), dev);
    };
    StateView st;
    st.pos = zeros({B}, DType::i64);
    std::vector<int64_t> pos_host(size_t(B), pos);
    CK(cudaMemcpy(keep.back()->p, pos_host.data(), size_t(B) * 8, cudaMemcpyHostToDevice));
    if (sh.S) st.S = zeros(sh.S_shape, DType::f32);
    if (sh.P) st.P = zeros(sh.P_shape, DType::f32);
    if (sh.H) st.H = zeros(sh.H_shape, DType::f32);
    return st;
  };
  auto row = [&](const char* dir, Timing tm) {
    std::printf("hila,%s,bf16,%lld,%lld,%lld,%lld,%s,%.4f,%lld,%lld,%.4f\n", op_name(p.cfg.op), (long long)B,
                (long long)T, (long long)H, (long long)dv, dir, tm.ms, (long long)dk, (long long)G, tm.sync_ms);
  };
  std::vector<std::unique_ptr<Dev>> keep;
  ForwardParams f = p;
  f.final_state = state(T, keep);
  row("prefill", bench_ms([&] { forward(f); }, warmup, reps));
  // continuation from position T: the states at T and 2T, lam with the levels of 2T
  ForwardParams c = p;
  c.init = state(T, keep);
  c.final_state = state(2 * T, keep);
  std::unique_ptr<Dev> lam;
  if (op_traits(p.cfg.op).loglinear) {
    const int64_t L = levels_needed(T, T);
    lam = std::make_unique<Dev>(size_t(B * T * H * L) * 2);
    fill_uniform(*lam, rng, 0.25f, 1.5f);
    c.lam = TensorView::contiguous_view(lam->p, DType::bf16, {B, T, H, L}, dev);
  }
  row("continue", bench_ms([&] { forward(c); }, warmup, reps));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace hila;
  int reps = 10, warmup = 2;
  std::vector<Op> ops = {Op::gla};
  int64_t H = 16, d = 128, dk = 0, dv = 0, G = 0;  // dk, dv default to d; G (q/k groups) to H
  int64_t chunk = 64;                              // --chunk: the chunk size C of the forward / backward calls
  std::vector<std::pair<int64_t, int64_t>> shapes = {{32, 1024}, {8, 4096}, {2, 16384}, {1, 65536}};
  bool decode = false, prefill = false, l2norm = false, decode_view = false;
  bool ops_given = false;
  DType dt = DType::bf16;  // --dtype: operands of the fwd / fwdbwd rows
  std::vector<int64_t> batches = {1, 16, 256}, positions = {4096, 65536, 1048576};
  auto is_flag = [](const std::string& a) {
    return a == "--decode" || a == "--decode-view" || a == "--prefill" || a == "--l2norm";
  };
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--decode") decode = true;
    if (std::string(argv[i]) == "--decode-view") decode = decode_view = true;
    if (std::string(argv[i]) == "--prefill") prefill = true;
    if (std::string(argv[i]) == "--l2norm") l2norm = true;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (is_flag(k)) {
      --i;  // a flag without a value
      continue;
    }
    if (k == "--reps") reps = std::stoi(v);
    else if (k == "--warmup") warmup = std::stoi(v);
    else if (k == "--batches") batches = parse_list(v);
    else if (k == "--positions") positions = parse_list(v);
    else if (k == "--H") H = std::stoll(v);
    else if (k == "--ops") {  // "gla,hla2"
      ops.clear();
      ops_given = true;
      for (size_t pos = 0; pos <= v.size();) {
        const size_t c = v.find(',', pos), e = c == std::string::npos ? v.size() : c;
        ops.push_back(parse_op(v.substr(pos, e - pos)));
        pos = e + 1;
      }
    }
    else if (k == "--d") d = std::stoll(v);
    else if (k == "--dk") dk = std::stoll(v);
    else if (k == "--dv") dv = std::stoll(v);
    else if (k == "--G") G = std::stoll(v);
    else if (k == "--chunk") chunk = std::stoll(v);
    else if (k == "--dtype") {
      if (v != "bf16" && v != "f32") {
        std::fprintf(stderr, "--dtype: expected bf16 or f32, got %s\n", v.c_str());
        return 2;
      }
      dt = v == "f32" ? DType::f32 : DType::bf16;
    }
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
  if (!dk) dk = d;
  if (!dv) dv = d;
  if (!G) G = H;
  if (decode) {
    run_decode(ops_given ? ops : all_ops(), H, dk, dv, std::max(reps, 20), std::max(warmup, 3), batches, positions,
               decode_view);
    return 0;
  }
  const bool f32 = dt == DType::f32;
  if (f32 && prefill) {
    std::fprintf(stderr, "--dtype f32 times the fwd / fwdbwd rows only (not --prefill)\n");
    return 2;
  }
  const size_t es = f32 ? 4 : 2;  // operand bytes
  std::printf("impl,op,dtype,B,T,H,d,direction,ms,dk,G,sync_ms\n");
  std::mt19937 rng(0);
  first_calls(ops, H, dk, rng);
  for (auto [B, T] : shapes) {
    // q, k [B, T, G, dk] (G groups shared by H / G heads), v, o, dO [B, T, H, dv]
    const size_t nk = size_t(B * T * G * dk), nv = size_t(B * T * H * dv);
    Dev q(nk * es), k(nk * es), v(nv * es), o(nv * es), dO(nv * es), dq(nk * es), dk_(nk * es), dv_(nv * es);
    Dev g(size_t(B * T * H) * 4), dg(size_t(B * T * H) * 4);
    fill_normal(q, rng, 1.f / std::sqrt(float(dk)), f32);
    fill_normal(k, rng, 1.f / std::sqrt(float(dk)), f32);
    fill_normal(v, rng, 1.f, f32);
    fill_normal(dO, rng, 1.f, f32);
    fill_gates(g, rng);
    const int64_t L = levels_needed(0, T);  // Fenwick level weights of the log-linear ops
    Dev lam(size_t(B * T * H * L) * es), dlam(size_t(B * T * H * L) * es);
    fill_uniform(lam, rng, 0.25f, 1.5f, f32);
    const Device dev{DeviceType::cuda, 0};
    auto viewK = [&](Dev& x) { return TensorView::contiguous_view(x.p, dt, {B, T, G, dk}, dev); };
    auto viewV = [&](Dev& x) { return TensorView::contiguous_view(x.p, dt, {B, T, H, dv}, dev); };
    auto view_lam = [&](Dev& x) { return TensorView::contiguous_view(x.p, dt, {B, T, H, L}, dev); };
    for (Op op : ops) {
    BackwardParams p;
    p.cfg.op = op;
    p.cfg.check_values = false;  // value checks copy inputs to the host
    p.form = Form::chunk;
    p.chunk = chunk;
    p.q = viewK(q), p.k = viewK(k), p.v = viewV(v), p.o = viewV(o);
    p.g = TensorView::contiguous_view(g.p, DType::f32, {B, T, H}, dev);
    // delta rule (gdn, loglinear_gdn): beta in [0, 1]; log-linear: lam with the levels T needs
    const OpTraits tr = op_traits(op);
    p.cfg.qk_l2norm = l2norm && tr.delta;
    Dev beta(tr.delta ? size_t(B * T * H) * es : 1), dbeta(tr.delta ? size_t(B * T * H) * es : 1);
    if (tr.delta) {
      fill_uniform(beta, rng, 0.f, 1.f, f32);
      p.beta = TensorView::contiguous_view(beta.p, dt, {B, T, H}, dev);
    }
    if (tr.loglinear) p.lam = view_lam(lam);
    const Timing fwd = bench_ms([&] { forward(p); }, warmup, reps);
    if (prefill) time_prefill(p, B, T, H, dk, dv, G, warmup, reps, rng);
    BackwardParams b = p;
    if (tr.delta) b.dbeta = TensorView::contiguous_view(dbeta.p, dt, {B, T, H}, dev);
    b.o = {};
    b.d_o = viewV(dO);
    b.dq = viewK(dq), b.dk = viewK(dk_), b.dv = viewV(dv_);
    b.dg = TensorView::contiguous_view(dg.p, DType::f32, {B, T, H}, dev);
    if (op_traits(op).loglinear) b.dlam = view_lam(dlam);
    const Timing bwd = bench_ms([&] { backward(b); }, warmup, reps);
    for (auto [dir, tm] : {std::pair{"fwd", fwd}, std::pair{"fwdbwd", fwd + bwd}})
      std::printf("hila,%s,%s,%lld,%lld,%lld,%lld,%s,%.4f,%lld,%lld,%.4f\n", op_name(op), f32 ? "f32" : "bf16",
                  (long long)B, (long long)T, (long long)H, (long long)dv, dir, tm.ms, (long long)dk, (long long)G,
                  tm.sync_ms);
    std::fflush(stdout);
    }
  }
  return 0;
}
