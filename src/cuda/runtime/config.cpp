// SPDX-License-Identifier: Apache-2.0
#include "cuda/runtime/config.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>

namespace hila::cuda {

namespace {

bool is(const char* v, const char* s) { return v && std::strcmp(v, s) == 0; }

// "0" / anything else forces off / on; unset leaves the choice to the backend.
Force force(const char* v) {
  if (!v) return Force::automatic;
  return std::strcmp(v, "0") != 0 ? Force::on : Force::off;
}

// HILA_GLA_SM90: unset or "1" = all (1: wherever they apply); otherwise a comma-separated list of
// the kernels that may run ("0", or any other word, names none).
Sm90Kernels sm90_kernels(const char* v) {
  Sm90Kernels k;
  k.forced = is(v, "1");
  if (!v || k.forced) return k;
  auto listed = [v](const char* which) {
    const size_t n = std::strlen(which);
    for (const char* p = v; *p;) {
      const char* e = std::strchr(p, ',');
      const size_t len = e ? size_t(e - p) : std::strlen(p);
      if (len == n && std::strncmp(p, which, n) == 0) return true;
      if (!e) break;
      p = e + 1;
    }
    return false;
  };
  k.sweep = listed("sweep"), k.bwd = listed("bwd"), k.fwd = listed("fwd"), k.wkv = listed("wkv"), k.out = listed("out");
  return k;
}

const char* process_env(const char* name) { return std::getenv(name); }

// Every Config read so far (the last one current): a reload leaves the earlier ones in place, so
// that a reference taken before it stays valid.
std::mutex g_mu;
std::deque<Config> g_all;
std::atomic<const Config*> g_current{nullptr};

const Config* read_env() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_all.push_back(Config::parse(&process_env));
  const Config* c = &g_all.back();
  g_current.store(c, std::memory_order_release);
  return c;
}

}  // namespace

Config Config::parse(const char* (*env)(const char*)) {
  Config c;
  c.upload_kernel = is(env("HILA_UPLOAD_KERNEL"), "1");
  c.side_stream = !is(env("HILA_SIDE_STREAM"), "0");
  const char* poison = env("HILA_POISON_SCRATCH");
  c.poison_scratch = poison && *poison && std::strcmp(poison, "0") != 0;
  c.fold_s = !is(env("HILA_FOLD_S"), "0");
  c.gla_sm90 = sm90_kernels(env("HILA_GLA_SM90"));
  c.gla_fused = force(env("HILA_GLA_FUSED"));
  c.gdn_tc = !is(env("HILA_GDN_TC"), "0");
  c.delta_sm90 = !is(env("HILA_DELTA_SM90"), "0");
  if (const char* n = env("HILA_DELTA_PIECES")) c.delta_pieces = int(std::clamp(std::strtol(n, nullptr, 10), 0L, 1L << 20));
  c.loglinear_tree = !is(env("HILA_LOGLINEAR_TREE"), "0");
  c.loglinear_tree_sweep = force(env("HILA_LOGLINEAR_TREE_SWEEP"));
  if (const char* n = env("HILA_LOGLINEAR_TREE_SEGMENT"); n && *n)
    c.loglinear_tree_segment = int(std::clamp(std::strtol(n, nullptr, 10), 0L, 40L));
  if (const char* b = env("HILA_LOGLINEAR_STORE_BUDGET")) c.loglinear_store_budget = size_t(std::strtoull(b, nullptr, 10));
  c.emu_sm90 = is(env("HILA_EMU_SM90"), "1");
  return c;
}

const Config& config() {
  static const Config* first = read_env();  // the first call reads the environment
  const Config* c = g_current.load(std::memory_order_acquire);
  return c ? *c : *first;
}

void reload_config() {
  config();  // the first read stays first
  read_env();
}

}  // namespace hila::cuda
