// SPDX-License-Identifier: Apache-2.0
// `hila demo`: per operator, a float32 chunk-form prefill of a prompt, then token-by-token decode
// through hila::DecodeState + hila::step, both checked against the naive form in float64, with
// timings and the state memory per sequence next to a softmax KV cache of the same length.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <memory>

#include "commands.h"
#include "hila/error.h"
#include "device.h"
#include "problem.h"

namespace hila::tools {

namespace {

// float32 against float64 over a few thousand tokens: docs/math/HLA.md §8.2 measures ~1e-6; anything
// near 1e-3 means a real defect, not rounding.
constexpr double kTol = 1e-3;

struct DemoOptions {
  int64_t T = 2048, decode = 64, H = 4, dk = 64, dv = 64, chunk = 64;
  int reps = 3;
  std::vector<std::string> ops;
  std::string device = "auto";
  bool check = true;
  uint64_t seed = 0;
};

struct DemoRow {
  Op op;
  double prefill_ms = 0, decode_us = 0, prefill_err = -1, decode_err = -1;
  int64_t state_bytes = 0, state_bytes_1m = 0;
};

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
  return buf;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Host wall time of `f`, waiting for the device (if any) at the end.
template <class F>
double timed(Device dev, F f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  device_synchronize(dev);
  return seconds_since(t0);
}

DemoRow demo_op(Op op, const DemoOptions& o, Device dev, Progress& progress, int done, int total) {
  const std::string name = op_name(op);
  ProblemSpec s;
  s.cfg.op = op;
  s.cfg.qk_l2norm = op_traits(op).delta;  // as Gated DeltaNet models use it
  s.B = 1, s.T = o.T + o.decode, s.G = o.H, s.H = o.H, s.dk = o.dk, s.dv = o.dv;
  s.dtype = DType::f32;
  s.seed = o.seed;
  const Problem full = make_problem(s);
  const Problem prompt = prefix(full, o.T);
  DemoRow row{op};

  progress.update(name + ": prefill", done, total);
  Result pre;
  row.prefill_ms = 1e300;
  for (int r = 0; r < std::max(o.reps, 1); ++r) {  // on a GPU this includes the host <-> device copies
    const auto t0 = std::chrono::steady_clock::now();
    pre = run_forward(prompt, Form::chunk, o.chunk, dev);
    row.prefill_ms = std::min(row.prefill_ms, 1e3 * seconds_since(t0));
  }

  progress.update(name + ": decode", done, total);
  DecodeState ds(s.cfg, 1, s.H, s.dk, s.dv, DType::f32, dev);
  Buffer o_dec(DType::f32, {1, o.decode, s.H, s.dv});
  o_dec.poison();
  // the decode inputs and outputs where the state lives: token t is a view into them
  std::unique_ptr<DeviceMirror> mirror;
  TensorView q = full.q.view(), k = full.k.view(), v = full.v.view(), g = full.g.view(), lam = full.lam.view(),
             beta = full.beta.view(), out = o_dec.view();
  if (dev.type == DeviceType::cuda) {
    mirror = std::make_unique<DeviceMirror>(dev);
    q = mirror->input(q), k = mirror->input(k), v = mirror->input(v), g = mirror->input(g);
    lam = mirror->input(lam), beta = mirror->input(beta), out = mirror->output(out);
    ds.load(mirror->input(pre.final_state.view()));
  } else {
    ds.load(pre.final_state.view());
  }
  ds.reserve(o.T + o.decode);  // no reallocation inside the timed loop
  const double secs = timed(dev, [&] {
    for (int64_t m = 0; m < o.decode; ++m) {
      const int64_t t = o.T + m;
      StepParams sp;
      sp.cfg = s.cfg;
      sp.cfg.check_values = dev.type == DeviceType::cpu;  // on a GPU a per-token check would sync
      sp.q = token_of(q, t), sp.k = token_of(k, t), sp.v = token_of(v, t), sp.g = token_of(g, t);
      sp.lam = token_of(lam, t), sp.beta = token_of(beta, t);
      sp.o = token_of(out, m);
      step(sp, ds);
    }
  });
  if (mirror) mirror->finish();
  row.decode_us = o.decode ? 1e6 * secs / double(o.decode) : 0;
  row.state_bytes = ds.bytes_per_sequence();
  row.state_bytes_1m = state_bytes(s.cfg, s.H, s.dk, s.dv, int64_t(1) << 20, DType::f32);

  if (o.check) {
    progress.update(name + ": naive float64 reference", done, total);
    const Result ref = run_forward(cast_problem(full, DType::f64), Form::naive);
    row.prefill_err = rel_err(pre.o, slice_time(ref.o, 0, o.T));
    const StateBuffers dec_state = fetch_state(ds.view());
    const int64_t slots = ref.final_state.H.shape.size() == 5 ? ref.final_state.H.shape[2] : 0;
    row.decode_err = std::max(rel_err(o_dec, slice_time(ref.o, o.T, o.decode)),
                              rel_err(with_slots(dec_state, slots), ref.final_state));
  }
  return row;
}

int demo(const DemoOptions& o) {
  const Device dev = parse_device(o.device);
  if (o.T < 1 || o.decode < 0) throw Error("T", "the prompt needs T >= 1 and --decode >= 0");
  if (o.decode > std::numeric_limits<int64_t>::max() - o.T)  // T + decode tokens are generated
    throw Error("decode", "the prompt and the decoded tokens, --T + --decode, exceed int64, got " +
                              std::to_string(o.T) + " + " + std::to_string(o.decode));
  std::vector<Op> ops;
  for (const std::string& n : o.ops) ops.push_back(parse_op(n));
  if (ops.empty()) ops = all_ops();

  const int64_t n_tok = o.T + o.decode;
  std::printf("hila demo on %s: 1 sequence, H=%lld heads, dk=%lld, dv=%lld, prompt %lld tokens + %lld decoded\n",
              device_name(dev).c_str(), (long long)o.H, (long long)o.dk, (long long)o.dv, (long long)o.T,
              (long long)o.decode);
  std::printf("prefill: chunk form (C=%lld), float32, best of %d; decode: DecodeState + step, float32;\n",
              (long long)o.chunk, std::max(o.reps, 1));
  std::printf("errors: max relative error against the naive form in float64 (decode: outputs and final state)\n\n");
  std::printf("%-15s %10s %10s %10s %10s %12s %12s\n", "op", "prefill", "decode", "prefill", "decode", "state/seq",
              "state/seq");
  std::printf("%-15s %10s %10s %10s %10s %12s %12s\n", "", "ms", "us/token", "rel err", "rel err",
              ("@" + std::to_string(n_tok)).c_str(), "@1M tokens");

  bool ok = true;
  Progress progress("demo");
  for (size_t i = 0; i < ops.size(); ++i) {
    const DemoRow r = demo_op(ops[i], o, dev, progress, int(i), int(ops.size()));
    progress.finish();
    char pe[16] = "-", de[16] = "-";
    if (o.check) {
      std::snprintf(pe, sizeof pe, "%.1e", r.prefill_err);
      std::snprintf(de, sizeof de, "%.1e", r.decode_err);
    }
    const bool row_ok = !o.check || (r.prefill_err <= kTol && r.decode_err <= kTol);  // NaN fails
    ok = ok && row_ok;
    std::printf("%-15s %10.1f %10.1f %10s %10s %12s %12s%s\n", op_name(r.op), r.prefill_ms, r.decode_us, pe, de,
                human_bytes(double(r.state_bytes)).c_str(), human_bytes(double(r.state_bytes_1m)).c_str(),
                row_ok ? "" : "  <- error above 1e-3");
    std::fflush(stdout);
  }
  // A softmax layer caches K and V for every token: 2 * tokens * H * d entries, counted in bf16.
  const auto kv = [&](int64_t tokens) { return double(tokens) * double(o.H) * double(o.dk + o.dv) * 2.0; };
  std::printf("%-15s %10s %10s %10s %10s %12s %12s\n", "softmax KV", "", "", "", "", human_bytes(kv(n_tok)).c_str(),
              human_bytes(kv(int64_t(1) << 20)).c_str());
  std::printf("\nsoftmax KV: K and V caches of one layer with the same H, dk, dv, stored in bf16 (2 bytes each);\n"
              "hila states are float32 (docs/math/HLA.md §8: bf16 states lose accuracy). HLA and GDN states are constant in\n"
              "the sequence length; log-linear states add one dk x dv' matrix per head per Fenwick level (O(log T)).\n");
  return ok ? kExitOk : kExitCheckFailed;
}

}  // namespace

Command add_demo_command(CLI::App& app) {
  auto o = std::make_shared<DemoOptions>();
  CLI::App* sub = app.add_subcommand("demo", "prefill + decode every operator, with timings, errors and state sizes");
  sub->add_option("--T", o->T, "prompt length")->capture_default_str();
  sub->add_option("--decode", o->decode, "tokens decoded one by one after the prompt")->capture_default_str();
  sub->add_option("--heads", o->H, "heads")->capture_default_str();
  sub->add_option("--dk", o->dk, "key head dimension")->capture_default_str();
  sub->add_option("--dv", o->dv, "value head dimension")->capture_default_str();
  sub->add_option("--chunk", o->chunk, "chunk size of the prefill")->capture_default_str();
  sub->add_option("--reps", o->reps, "prefill repetitions (the best is reported)")->capture_default_str();
  sub->add_option("--op", o->ops, "only these operators (repeatable; default: all)");
  sub->add_option("--seed", o->seed, "seed of the random inputs")->capture_default_str();
  sub->add_flag("!--no-check", o->check, "skip the float64 naive reference (fast, timings only)");
  add_device_option(sub, o->device);
  return {sub, [o] { return demo(*o); }};
}

}  // namespace hila::tools
