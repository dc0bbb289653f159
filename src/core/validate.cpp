// SPDX-License-Identifier: Apache-2.0
// Input validation for every entry point. Each failure names the argument, what was expected and
// what was given (docs/math/LOGLINEAR.md §11). Nothing is launched before all checks pass.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <omp.h>

#include "core/access.h"
#include "core/host_mirror.h"
#include "core/problem.h"
#include "cpu/backend.h"
#include "hila/error.h"

namespace hila {

namespace {
std::atomic<int64_t> g_memory_limit{0};  // set_memory_limit(); 0: not set

// The machine's physical memory, lowered to the cgroup (v2 or v1) limit of this process if any.
int64_t machine_memory() {
  static const int64_t bytes = [] {
    int64_t m = int64_t(sysconf(_SC_PHYS_PAGES)) * int64_t(sysconf(_SC_PAGESIZE));
    if (m <= 0) m = std::numeric_limits<int64_t>::max();
    for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
      if (FILE* f = std::fopen(path, "r")) {
        long long v = 0;
        if (std::fscanf(f, "%lld", &v) == 1 && v > 0) m = std::min<int64_t>(m, v);
        std::fclose(f);
      }
    }
    return m;
  }();
  return bytes;
}
}  // namespace

int64_t parse_memory_size(const std::string& text, const std::string& arg) {
  const std::string bad = "expected a size in bytes, optionally with a K, M, G or T suffix (powers of 1024), "
                          "e.g. 512M or 16G, got '" + text + "'";
  size_t used = 0;
  double x = 0;
  try {
    x = std::stod(text, &used);
  } catch (const std::exception&) {
    throw Error(arg, bad);
  }
  std::string unit = text.substr(used);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  if (!unit.empty() && (unit.back() == 'i')) unit.pop_back();
  double mult = 1;
  if (unit.size() == 1) {
    const char* units = "KMGT";
    const char* u = std::strchr(units, std::toupper(static_cast<unsigned char>(unit[0])));
    if (!u || !*u) throw Error(arg, bad);
    mult = std::ldexp(1.0, 10 * int(u - units + 1));
  } else if (!unit.empty()) {
    throw Error(arg, bad);
  }
  const double bytes = x * mult;
  if (!std::isfinite(bytes) || bytes < 1 || bytes >= 9.2e18) throw Error(arg, bad + " (between 1 byte and 8 EiB)");
  return static_cast<int64_t>(bytes);
}

int64_t memory_limit() {
  int64_t m = machine_memory();
  if (const char* env = std::getenv("HILA_MAX_MEMORY"); env && *env)
    m = std::min(m, parse_memory_size(env, "HILA_MAX_MEMORY"));
  if (const int64_t set = g_memory_limit.load(); set > 0) m = std::min(m, set);
  return m;
}

void set_memory_limit(int64_t bytes) {
  if (bytes < 0) throw Error("max_memory", "expected a size in bytes >= 0 (0: the default), got " + std::to_string(bytes));
  g_memory_limit.store(bytes);
}

}  // namespace hila

namespace hila::detail {

int64_t checked_product(std::initializer_list<int64_t> sizes) {
  int64_t n = 1;
  for (int64_t s : sizes)
    if (s < 0 || !mul_ok(n, s, &n)) return -1;
  return n;
}

void check_extent(const char* name, const TensorView& t) {
  if (!t.defined()) return;
  int64_t n = dtype_size(t.dtype);
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) throw Error(name, "expected non-negative sizes, got " + t.shape_str());
    if (!mul_ok(n, std::max<int64_t>(t.shape[i], 1), &n))
      throw Error(name, "expected a shape whose non-zero sizes multiply to at most 2^63 bytes (an array "
                        "numpy or torch could hold), got " + t.shape_str() + " of " + dtype_name(t.dtype));
  }
}

int64_t host_memory_limit() { return memory_limit(); }

int64_t configured_memory_limit() {
  int64_t m = 0;
  if (const char* env = std::getenv("HILA_MAX_MEMORY"); env && *env) m = parse_memory_size(env, "HILA_MAX_MEMORY");
  if (const int64_t set = g_memory_limit.load(); set > 0) m = m > 0 ? std::min(m, set) : set;
  return m;
}

std::string bytes_str(double b) {
  char buf[64];
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  double x = b;
  while (x >= 1024 && u < 6) x /= 1024, ++u;
  if (b >= 1e21) std::snprintf(buf, sizeof buf, "%.3g bytes", b);
  else std::snprintf(buf, sizeof buf, "%.0f bytes (%.1f %s)", b, x, units[u]);
  return buf;
}

void check_host_bytes(const std::string& arg, double bytes, const std::string& what) {
  const int64_t limit = host_memory_limit();
  if (bytes > double(limit))
    throw Error(arg, "needs " + bytes_str(bytes) + " of host memory for " + what + ", more than the " +
                         bytes_str(double(limit)) + " hila may take (the machine's memory, HILA_MAX_MEMORY or "
                         "hila::set_memory_limit)");
}

void fail_allocation(const std::string& arg, const std::string& what, const char* why) {
  throw Error(arg, "could not allocate host memory for " + what + " (" + why + "; limit " +
                       bytes_str(double(host_memory_limit())) + ")");
}

namespace {

int bitlen(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

// Validation runs on every call (a decode step included), so its success path builds no strings
// and allocates nothing beyond the sequence table: argument names are literals, messages are
// built only in the branch that throws. Error text uses std::string only (no iostreams): it runs
// inside host processes of every kind, Python extensions included.
[[noreturn]] void fail(const char* arg, const std::string& what) { throw Error(arg, what); }

// A shape to compare with, up to kMaxDims sizes, without a heap allocation.
struct Shape {
  int n = 0;
  int64_t d[kMaxDims] = {};
  Shape(std::initializer_list<int64_t> s) {
    for (int64_t x : s) d[n++] = x;
  }
  std::string str() const {
    std::string r = "[";
    for (int i = 0; i < n; ++i) r += (i ? ", " : "") + std::to_string(d[i]);
    return r + "]";
  }
};

void require(const char* name, const TensorView& t, const char* why) {
  if (!t.defined()) fail(name, std::string("is required ") + why + ", got nothing");
}

// note: a const char* or a callable returning the note (called on failure only)
template <class Note>
void expect_shape(const char* name, const TensorView& t, const Shape& s, Note&& note) {
  bool ok = t.ndim == s.n;
  for (int i = 0; ok && i < t.ndim; ++i) ok = t.shape[i] == s.d[i];
  if (!ok) {
    const std::string n = describe(note);
    fail(name, "expected shape " + s.str() + (n.empty() ? "" : " (" + n + ")") + ", got " + t.shape_str());
  }
}

void expect_ndim(const char* name, const TensorView& t, int nd, const char* layout) {
  if (t.ndim != nd)
    fail(name, "expected " + std::to_string(nd) + " dimensions " + layout + ", got " + std::to_string(t.ndim) +
                   " dimensions " + t.shape_str());
  for (int i = 0; i < nd; ++i)
    if (t.shape[i] < 0) fail(name, "expected non-negative sizes, got " + t.shape_str());
}

void expect_float(const char* name, const TensorView& t) {
  if (!is_float(t.dtype))
    fail(name, std::string("expected a floating dtype (float64, float32, bfloat16, float16), got ") +
                   dtype_name(t.dtype));
}

void expect_dtype(const char* name, const TensorView& t, DType d, const char* why) {
  if (t.dtype != d)
    fail(name, std::string("expected dtype ") + dtype_name(d) + " (" + why + "), got " + dtype_name(t.dtype));
}

void expect_state_dtype(const char* name, const TensorView& t) {
  if (t.dtype != DType::f32 && t.dtype != DType::f64)
    fail(name, std::string("expected float32 or float64 (states are kept in fp32 or fp64), got ") +
                   dtype_name(t.dtype));
}

void expect_device(const char* name, const TensorView& t, Device d, const char* whose = "that of q") {
  if (!(t.device == d))
    fail(name, "expected device " + device_name(d) + " (" + whose + "), got " + device_name(t.device));
}

void expect_host(const char* name, const TensorView& t, const char* what) {
  if (t.device.type != DeviceType::cpu)
    fail(name, std::string("expected a CPU tensor (") + what + "), got one on " + device_name(t.device));
}

// Innermost dimension contiguous, no negative strides, data present. A tensor with no elements
// addresses no memory: any strides (numpy 2 gives zero-size arrays all-zero strides) and any
// pointer are accepted.
void expect_strides(const char* name, const TensorView& t) {
  check_extent(name, t);
  if (t.numel() == 0) return;
  if (t.data == nullptr) fail(name, "expected data, got a null pointer");
  if (t.ndim > 0 && t.shape[t.ndim - 1] > 1 && t.stride[t.ndim - 1] != 1)
    fail(name, "expected the innermost dimension to be contiguous (stride 1), got stride " +
                   std::to_string(t.stride[t.ndim - 1]));
  for (int i = 0; i < t.ndim; ++i)
    if (t.stride[i] < 0 && t.shape[i] > 1)
      fail(name, "expected non-negative strides, got stride " + std::to_string(t.stride[i]) + " in dimension " +
                     std::to_string(i));
}

// Visit every element of a (strided) tensor.
template <class F>
void for_each(const TensorView& t, F f) {
  if (!t.defined() || t.numel() == 0) return;
  std::array<int64_t, kMaxDims> idx{};
  const int64_t total = t.numel();
  for (int64_t n = 0; n < total; ++n) {
    int64_t off = 0;
    for (int i = 0; i < t.ndim; ++i) off += idx[i] * t.stride[i];
    f(off, idx);
    for (int i = t.ndim - 1; i >= 0; --i) {
      if (++idx[i] < t.shape[i]) break;
      idx[i] = 0;
    }
  }
}

// The value test of one element: log-gates must be <= 0 or -inf (NaN and x > 0 fail), everything
// else finite (NaN and +-inf fail).
template <bool Gates, class T>
inline bool bad_value(T x) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
    return Gates ? !(x <= T(0)) : !(std::fabs(x) <= std::numeric_limits<T>::max());
  else
    return bad_value<Gates>(static_cast<double>(x));
}

template <class T>
inline auto element(const T* x, int64_t i) {
  if constexpr (std::is_same_v<T, uint16_t>) return bf16_to_float(x[i]);
  else return x[i];
}

// First failing element among x[0], x[inner], ..., x[(n-1) inner] (-1: none). Contiguous runs
// (inner == 1) are tested in blocks by a branch-free OR over the block (vectorisable); only a
// failing block is searched element by element.
template <bool Gates, class T>
int64_t scan_run(const T* x, int64_t n, int64_t inner) {
  if (inner == 1) {
    constexpr int64_t kBlock = 2048;
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t e = std::min(n, b + kBlock);
      unsigned any = 0;
      for (int64_t c = b; c < e; ++c) any |= static_cast<unsigned>(bad_value<Gates>(element(x, c)));
      if (!any) continue;
      for (int64_t c = b; c < e; ++c)
        if (bad_value<Gates>(element(x, c))) return c;
    }
    return -1;
  }
  for (int64_t c = 0; c < n; ++c)
    if (bad_value<Gates>(element(x, c * inner))) return c;
  return -1;
}

// First element of a host tensor failing the value check (bad_value), as a row-major index (-1:
// none). The trailing dimensions that lie contiguously in memory (size-1 dimensions skipped) are
// scanned as one run; the leading ones are walked run by run.
template <bool Gates, class T>
int64_t host_scan_typed(const TensorView& t) {
  const T* base = static_cast<const T*>(t.data);
  const int nd = t.ndim;
  int outer = nd;  // dimensions [outer, nd) form one run of n elements with stride `inner`
  int64_t n = 1, inner = 1;
  if (nd > 0 && t.shape[nd - 1] > 1 && t.stride[nd - 1] != 1) {  // a strided innermost dimension
    outer = nd - 1;
    n = t.shape[nd - 1];
    inner = t.stride[nd - 1];
  } else {
    for (int64_t expect = 1; outer > 0; --outer) {
      const int i = outer - 1;
      if (t.shape[i] == 1) continue;
      if (t.stride[i] != expect) break;
      expect *= t.shape[i];
      n *= t.shape[i];
    }
  }
  const int64_t runs = t.numel() / n;
  std::array<int64_t, kMaxDims> idx{};
  for (int64_t r = 0; r < runs; ++r) {
    int64_t off = 0;
    for (int i = 0; i < outer; ++i) off += idx[i] * t.stride[i];
    const int64_t c = scan_run<Gates>(base + off, n, inner);
    if (c >= 0) return r * n + c;
    for (int i = outer - 1; i >= 0; --i) {
      if (++idx[i] < t.shape[i]) break;
      idx[i] = 0;
    }
  }
  return -1;
}

template <bool Gates>
int64_t host_scan_as(const TensorView& t) {
  switch (t.dtype) {
    case DType::f32: return host_scan_typed<Gates, float>(t);
    case DType::f64: return host_scan_typed<Gates, double>(t);
    case DType::bf16: return host_scan_typed<Gates, uint16_t>(t);
    case DType::f16: return host_scan_typed<Gates, _Float16>(t);
    default: return -1;  // integer tensors hold no non-finite values
  }
}

int64_t host_scan(const TensorView& t, bool gates) {
  if (!t.defined() || t.numel() == 0) return -1;
  return gates ? host_scan_as<true>(t) : host_scan_as<false>(t);
}

// device_scan for device tensors, host_scan for host ones: -1 when every element passes, else
// the row-major index of the first that fails.
int64_t scan(const TensorView& t, bool gates) {
  return t.device.type == DeviceType::cpu ? host_scan(t, gates) : device_scan(t, gates);
}

std::string idx_str(const std::array<int64_t, kMaxDims>& idx, int nd) {
  std::string r = "[";
  for (int i = 0; i < nd; ++i) r += (i ? ", " : "") + std::to_string(idx[i]);
  return r + "]";
}

// Value check of one tensor: every element finite (and, for log-gates, <= 0). Device tensors are
// scanned on the device; only the first offending element is read back for the message.
// Log-gates may be -inf: a state reset (docs/OPERATORS.md, "Resets").
void check_elements(const char* name, const TensorView& dev_t, bool gates) {
  const char* what = gates ? "expected log-gates <= 0, finite or -inf (a reset) (value checks are on), got "
                           : "expected finite values (value checks are on), got ";
  auto bad = [&](double x) { return gates ? (std::isnan(x) || x > 0) : !std::isfinite(x); };
  const int64_t first = scan(dev_t, gates);
  if (first == -1) return;
  if (first >= 0) {  // element `first` in row-major order: read just that one
    std::array<int64_t, kMaxDims> idx{};
    TensorView one = dev_t;
    int64_t rem = first, off = 0;
    for (int i = dev_t.ndim - 1; i >= 0; --i) {
      idx[i] = rem % dev_t.shape[i];
      rem /= dev_t.shape[i];
      off += idx[i] * dev_t.stride[i];
    }
    one.data = static_cast<char*>(dev_t.data) + off * dtype_size(dev_t.dtype);
    for (int i = 0; i < one.ndim; ++i) one.shape[i] = 1;
    const HostMirror m(one);
    const double x = load(m.view(), 0);
    fail(name, what + std::to_string(x) + " at " + idx_str(idx, dev_t.ndim));
  }
  const HostMirror m(dev_t);
  const TensorView& t = m.view();
  for_each(t, [&](int64_t off, const auto& idx) {
    const double x = load(t, off);
    if (bad(x)) fail(name, what + std::to_string(x) + " at " + idx_str(idx, t.ndim));
  });
}

void check_finite(const char* name, const TensorView& t) { check_elements(name, t, false); }
void check_gates(const char* name, const TensorView& t) { check_elements(name, t, true); }

// Options that only some operators take.
void check_config(const OpConfig& c) {
  const int id = static_cast<int>(c.op);
  if (id < 0 || id > 9) fail("op", "expected a valid hila::Op, got id " + std::to_string(id));
  const OpTraits t = op_traits(c.op);
  auto on = [&] { return std::string(" for operator ") + op_name(c.op); };
  if (c.normalize && !t.hla_family) fail("normalize", "expected false" + on() + " (only the HLA family normalizes), got true");
  if (c.gates == Gates::untied && !t.hla_family)
    fail("gates", "expected tied" + on() + " (a single primitive has one gate), got untied");
  if (c.ridge != 0 && !t.has_S)
    fail("ridge", "expected 0" + on() + " (the ridge applies to the metric S of hla2), got " + std::to_string(c.ridge));
  if (c.ridge != 0 && (c.op == Op::hla3 || c.op == Op::loglinear_hla3))
    fail("ridge", "expected 0" + on() + " (the ridge is defined for hla2), got " + std::to_string(c.ridge));
  if (c.qk_l2norm && !t.delta)
    fail("qk_l2norm", "expected false" + on() + " (only gdn and loglinear_gdn take it), got true");
  if (!std::isfinite(c.scale)) fail("scale", "expected a finite value, got " + std::to_string(c.scale));
  if (!std::isfinite(c.eps) || c.eps < 0) fail("eps", "expected a finite value >= 0, got " + std::to_string(c.eps));
  if (c.normalize && !(c.eps > 0))
    fail("eps", "expected eps > 0 with normalize (o = num / (den + eps); den is 0 where q or the state is 0), "
                "got " + std::to_string(c.eps));
  if (!std::isfinite(c.ridge)) fail("ridge", "expected a finite value, got " + std::to_string(c.ridge));
}

void check_chunk(int64_t C) {
  if (C < 1 || (C & (C - 1)) != 0)
    fail("chunk", "expected a power of two >= 1 (chunks must align with Fenwick levels), got " + std::to_string(C));
}

// ---- state names: "init.pos", ... as literals (a state part's name is built once, not per call)

struct PartNames {
  const char *pos, *S, *P, *H;
};
PartNames part_names(const char* base) {
  static const struct {
    const char* base;
    PartNames n;
  } kNames[] = {{"init", {"init.pos", "init.S", "init.P", "init.H"}},
                {"final_state", {"final_state.pos", "final_state.S", "final_state.P", "final_state.H"}},
                {"d_final", {"d_final.pos", "d_final.S", "d_final.P", "d_final.H"}},
                {"d_init", {"d_init.pos", "d_init.S", "d_init.P", "d_init.H"}},
                {"state", {"state.pos", "state.S", "state.P", "state.H"}}};
  for (const auto& e : kNames)
    if (std::strcmp(e.base, base) == 0) return e.n;
  // another name (not used inside hila): built once per name, kept for the process
  static std::mutex mu;
  static std::map<std::string, std::array<std::string, 4>> store;
  std::lock_guard<std::mutex> lock(mu);
  auto& e = store[base];
  if (e[0].empty()) e = {std::string(base) + ".pos", std::string(base) + ".S", std::string(base) + ".P", std::string(base) + ".H"};
  return {e[0].c_str(), e[1].c_str(), e[2].c_str(), e[3].c_str()};
}

// ---- int tensors read on the host

std::vector<int64_t> read_ints(const TensorView& dev_t) {
  const HostMirror m(dev_t);
  const TensorView& t = m.view();
  std::vector<int64_t> out(static_cast<size_t>(t.shape[0]));
  for (int64_t i = 0; i < t.shape[0]; ++i) out[size_t(i)] = load_int(t, i * t.stride[0]);
  return out;
}

// state_indices: int32 [N] on `dev` (its values are not read here).
void check_index_tensor(const TensorView& idx, int64_t N, Device dev) {
  expect_dtype("state_indices", idx, DType::i32, "pool rows, -1 for padding");
  expect_shape("state_indices", idx, {N}, "one pool row per sequence of the call");
  expect_device("state_indices", idx, dev, "that of the state");
  expect_strides("state_indices", idx);
}

// StepParams::counters: int32, one contiguous dimension of at least step_counters_size(N, H)
// elements, on `dev`.
void check_counters(const TensorView& c, int64_t N, int64_t H, Device dev) {
  const int64_t need = step_counters_size(N, H);
  const char* what = "the step counters: one dimension of step_counters_size(N, H) = N + N * H or more elements";
  expect_dtype("counters", c, DType::i32, "step counters, zero-filled once by their owner");
  expect_ndim("counters", c, 1, what);
  expect_device("counters", c, dev, "that of the state");
  expect_strides("counters", c);
  if (c.shape[0] < need)
    fail("counters", "expected at least " + std::to_string(need) + " elements (step_counters_size(N = " +
                         std::to_string(N) + ", H = " + std::to_string(H) + ") = N + N * H), got " + c.shape_str());
}

// Real rows in [0, P) and distinct, padding -1.
void check_index_values(const std::vector<int64_t>& idx, int64_t P) {
  std::vector<int64_t> seen;
  for (size_t i = 0; i < idx.size(); ++i) {
    const int64_t x = idx[i];
    if (x < -1 || x >= P)
      fail("state_indices", "expected distinct pool rows in [0, " + std::to_string(P) + ") or -1 (padding), got " +
                                std::to_string(x) + " for sequence " + std::to_string(i));
    if (x >= 0) seen.push_back(x);
  }
  std::sort(seen.begin(), seen.end());
  for (size_t i = 1; i < seen.size(); ++i)
    if (seen[i] == seen[i - 1])
      fail("state_indices", "expected distinct pool rows (two sequences cannot share a state), got row " +
                                std::to_string(seen[i]) + " twice");
}

// The pool rows a state holds: its pos length (or the first size of H).
int64_t state_rows(const StateView& s) {
  if (s.pos.defined() && s.pos.ndim >= 1) return s.pos.shape[0];
  if (s.H.defined() && s.H.ndim >= 1) return s.H.shape[0];
  return 0;
}

// The sequence table: B sequences of T rows, or varlen from cu_seqlens (B == 1), read from the
// host copy cu_host when there is one (compared with the device's when values are checked).
std::vector<SeqInfo> make_seqs(const TensorView& cu_dev, const TensorView& cu_host, int64_t B, int64_t T,
                               Device dev, bool values) {
  std::vector<SeqInfo> seqs;
  if (!cu_dev.defined()) {
    if (cu_host.defined())
      fail("cu_seqlens_host", "expected no tensor (a host copy of cu_seqlens, which is not given), got " +
                                  cu_host.shape_str());
    check_host_bytes_lazy("q", double(B) * sizeof(SeqInfo),
                          [&] { return "the table of B = " + std::to_string(B) + " sequences"; });
    with_memory_errors("q", "the table of sequences", [&] { seqs.reserve(static_cast<size_t>(B)); });
    for (int64_t b = 0; b < B; ++b) seqs.push_back({b, 0, T, 0});
    return seqs;
  }
  const TensorView& cu = cu_dev;
  if (cu.dtype != DType::i32 && cu.dtype != DType::i64)
    fail("cu_seqlens", std::string("expected dtype int32 or int64, got ") + dtype_name(cu.dtype));
  if (cu.ndim != 1 || cu.shape[0] < 2) fail("cu_seqlens", "expected shape [N+1] with N >= 1, got " + cu.shape_str());
  expect_device("cu_seqlens", cu, dev);
  expect_strides("cu_seqlens", cu);
  if (B != 1) fail("cu_seqlens", "expected batch size B = 1 with varlen, got B = " + std::to_string(B));
  const int64_t n = cu.shape[0];
  const char* src = "cu_seqlens";
  if (cu_host.defined()) {
    src = "cu_seqlens_host";
    expect_host(src, cu_host, "a host copy of cu_seqlens");
    expect_dtype(src, cu_host, cu.dtype, "that of cu_seqlens");
    expect_shape(src, cu_host, {n}, "that of cu_seqlens");
    expect_strides(src, cu_host);
  }
  check_host_bytes_lazy("cu_seqlens", double(n) * sizeof(SeqInfo),
                        [&] { return "the table of " + std::to_string(n - 1) + " sequences"; });
  with_memory_errors("cu_seqlens", "the table of sequences", [&] { seqs.reserve(static_cast<size_t>(n - 1)); });
  const HostMirror mirror(cu_host.defined() ? TensorView{} : cu_dev);
  const TensorView& h = cu_host.defined() ? cu_host : mirror.view();
  int64_t prev = load_int(h, 0);
  if (prev != 0) fail(src, "expected cu_seqlens[0] = 0, got " + std::to_string(prev));
  for (int64_t i = 1; i < n; ++i) {
    const int64_t x = load_int(h, i * h.stride[0]);
    if (x < prev)
      fail(src, "expected non-decreasing offsets, got cu_seqlens[" + std::to_string(i) + "] = " + std::to_string(x) +
                    " < cu_seqlens[" + std::to_string(i - 1) + "] = " + std::to_string(prev));
    seqs.push_back({0, prev, x - prev, 0});
    prev = x;
  }
  if (prev != T)
    fail(src, "expected the last offset to equal T = " + std::to_string(T) + ", got " + std::to_string(prev));
  if (cu_host.defined() && values) {  // the host copy against the device's (value checks are on)
    const HostMirror d(cu_dev);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t a = load_int(h, i * h.stride[0]), b = load_int(d.view(), i * d.view().stride[0]);
      if (a != b)
        fail("cu_seqlens_host", "expected the values of cu_seqlens (value checks are on), got " + std::to_string(a) +
                                    " at index " + std::to_string(i) + " where cu_seqlens holds " + std::to_string(b));
    }
  }
  return seqs;
}

struct Dims {
  int64_t B, T, G, H, dk, dv, dvp;
  Device dev;
  DType dtype;
};

// q, k [B,T,G,dk], v [B,T,H,dv] (or the step layout without T).
Dims check_qkv(const TensorView& q, const TensorView& k, const TensorView& v, bool with_t, const OpConfig& cfg) {
  const int nd = with_t ? 4 : 3;
  const char* lq = with_t ? "[B, T, G, dk]" : "[N, G, dk]";
  const char* lv = with_t ? "[B, T, H, dv]" : "[N, H, dv]";
  require("q", q, with_t ? "(queries [B, T, G, dk])" : "(queries [N, G, dk])");
  require("k", k, with_t ? "(keys [B, T, G, dk])" : "(keys [N, G, dk])");
  require("v", v, with_t ? "(values [B, T, H, dv])" : "(values [N, H, dv])");
  expect_ndim("q", q, nd, lq);
  expect_float("q", q);
  expect_strides("q", q);
  Dims d{};
  d.dev = q.device;
  d.dtype = q.dtype;
  d.B = q.shape[0];
  d.T = with_t ? q.shape[1] : 1;
  d.G = q.shape[nd - 2];
  d.dk = q.shape[nd - 1];
  if (d.G < 1) fail("q", "expected at least one group (G >= 1), got " + q.shape_str());
  if (d.dk < 1) fail("q", "expected head dim dk >= 1, got " + q.shape_str());
  const Shape qs = with_t ? Shape{d.B, d.T, d.G, d.dk} : Shape{d.B, d.G, d.dk};
  expect_shape("k", k, qs, "same as q");
  expect_dtype("k", k, q.dtype, "same as q");
  expect_device("k", k, d.dev);
  expect_strides("k", k);
  expect_ndim("v", v, nd, lv);
  expect_dtype("v", v, q.dtype, "same as q");
  expect_device("v", v, d.dev);
  expect_strides("v", v);
  d.H = v.shape[nd - 2];
  d.dv = v.shape[nd - 1];
  if (d.dv < 1) fail("v", "expected value dim dv >= 1, got " + v.shape_str());
  if (d.H < 1 || d.H % d.G != 0)
    fail("v", "expected the number of value heads H to be a multiple of the q/k groups G = " + std::to_string(d.G) +
                  ", got H = " + std::to_string(d.H));
  expect_shape("v", v, with_t ? Shape{d.B, d.T, d.H, d.dv} : Shape{d.B, d.H, d.dv},
               with_t ? "batch and T as q" : "batch as q");
  d.dvp = d.dv + (cfg.normalize ? 1 : 0);
  return d;
}

// The dtype, device and strides of a side input (g, lam, beta), after its shape.
void expect_side_input(const char* name, const TensorView& x, Device dev) {
  expect_float(name, x);
  expect_device(name, x, dev);
  expect_strides(name, x);
}

// An input that operator `op` takes exactly when `needed` (lam: Fenwick levels, beta: the delta
// rule): a missing one fails with "is required by operator <op> (<what>)", an unwanted one with
// "expected no tensor (operator <op> has no <lacks>)". Returns `needed` (then x is present).
bool expect_if_needed(const char* name, const TensorView& x, bool needed, Op op, const char* what,
                      const char* lacks) {
  if (needed && !x.defined())
    fail(name, std::string("is required by operator ") + op_name(op) + " (" + what + "), got nothing");
  if (!needed && x.defined())
    fail(name, std::string("expected no tensor (operator ") + op_name(op) + " has no " + lacks + "), got " +
                   x.shape_str());
  return needed;
}

// g, lam, beta for a call over the leading dims [B, T] (with_t) or [N].
int check_side_inputs(const OpConfig& cfg, const TensorView& g, const TensorView& lam, const TensorView& beta,
                      bool with_t, const Dims& d) {
  const OpTraits t = op_traits(cfg.op);
  auto lead = [&](std::initializer_list<int64_t> tail) {
    Shape s = with_t ? Shape{d.B, d.T} : Shape{d.B};
    for (int64_t x : tail) s.d[s.n++] = x;
    return s;
  };
  int gate_cols = 0;
  if (g.defined()) {
    const bool untied = cfg.gates == Gates::untied;
    expect_shape("g", g, untied ? lead({d.H, t.num_primitives}) : lead({d.H}), [&] {
      return untied ? "untied gates: one column per primitive of " + std::string(op_name(cfg.op))
                    : std::string("one log-gate per token and value head");
    });
    expect_side_input("g", g, d.dev);
    gate_cols = untied ? t.num_primitives : 1;
  }
  if (expect_if_needed("lam", lam, t.loglinear, cfg.op, "Fenwick level weights", "Fenwick levels")) {
    expect_ndim("lam", lam, with_t ? 4 : 3, "[..., H, L]");
    expect_shape("lam", lam, lead({d.H, lam.shape[lam.ndim - 1]}), "leading dims as v, then L levels");
    expect_side_input("lam", lam, d.dev);
  }
  if (expect_if_needed("beta", beta, t.delta, cfg.op, "delta-rule step sizes", "delta rule")) {
    expect_shape("beta", beta, lead({d.H}), "one step size per token and value head");
    expect_side_input("beta", beta, d.dev);
  }
  return gate_cols;
}

void check_values(const OpConfig& cfg, const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& g, const TensorView& lam, const TensorView& beta) {
  if (!cfg.check_values) return;
  check_finite("q", q);
  check_finite("k", k);
  check_finite("v", v);
  if (g.defined()) check_gates("g", g);
  if (lam.defined()) check_finite("lam", lam);
  if (beta.defined()) check_finite("beta", beta);
}

void check_levels(const Resolved& r) {
  if (!r.traits.loglinear) return;
  for (size_t i = 0; i < r.seqs.size(); ++i) {
    const SeqInfo& s = r.seqs[i];
    const int64_t need = levels_needed(s.n0, s.len);
    if (r.nL < need)
      fail("lam", "has " + std::to_string(r.nL) + " levels, but sequence " + std::to_string(i) + " covering positions " +
                      std::to_string(s.n0) + ".." + std::to_string(s.n0 + s.len - 1) + " needs " + std::to_string(need) +
                      " (bitlen(n0+T-1)+1); missing levels are never treated as zero");
  }
}

void check_output(const char* name, const TensorView& t, const Shape& shape, DType dt, Device dev, const char* what) {
  if (!t.defined()) fail(name, std::string("is required (") + what + "), got nothing");
  expect_shape(name, t, shape, what);
  expect_dtype(name, t, dt, "same as the input");
  expect_device(name, t, dev);
  expect_strides(name, t);
}

void check_optional_output(const char* name, const TensorView& t, const TensorView& like, const char* input) {
  if (!t.defined()) return;
  if (!like.defined())
    fail(name, std::string("expected no tensor (input '") + input + "' was not given), got " + t.shape_str());
  bool ok = t.ndim == like.ndim;
  for (int i = 0; ok && i < t.ndim; ++i) ok = t.shape[i] == like.shape[i];
  if (!ok) fail(name, "expected shape " + like.shape_str() + " (shape of " + input + "), got " + t.shape_str());
  expect_dtype(name, t, like.dtype, "same as the input");
  expect_device(name, t, like.device);
  expect_strides(name, t);
}

// ---- memory overlap of outputs with inputs and other outputs

// Bytes [lo, hi) that a (non-empty) view addresses.
bool byte_span(const TensorView& t, intptr_t& lo, intptr_t& hi) {
  if (!t.defined() || t.numel() == 0 || !t.data) return false;
  const intptr_t es = dtype_size(t.dtype), base = reinterpret_cast<intptr_t>(t.data);
  intptr_t a = 0, b = 0;
  for (int i = 0; i < t.ndim; ++i) {
    const intptr_t ext = intptr_t(t.shape[i] - 1) * intptr_t(t.stride[i]) * es;
    (ext < 0 ? a : b) += ext;
  }
  lo = base + a;
  hi = base + b + es;
  return true;
}

struct OverlapDim {
  int64_t stride, na, nb;
};

// b.data - a.data = sum_k e_k stride_k + r with e_k = i_k - j_k in [-(nb_k - 1), na_k - 1] and
// |r| < es; nesting leaves two candidates for e_k at each level, largest stride first.
bool overlap_hit(const OverlapDim* dims, int k, int64_t rem, int64_t es) {
  if (k < 0) return rem > -es && rem < es;
  const OverlapDim& d = dims[k];
  const int64_t q = rem >= 0 ? rem / d.stride : -((-rem) / d.stride);
  for (int64_t e : {q - 1, q, q + 1})
    if (e >= -(d.nb - 1) && e <= d.na - 1 && overlap_hit(dims, k - 1, rem - e * d.stride, es)) return true;
  return false;
}

// Whether some element of `a` shares a byte with some element of `b`. Exact for views with the same
// element size and strides whose dimensions nest (each stride at least the extent of the smaller
// ones: any slices of one row-major buffer, such as q, k, v of a fused projection); otherwise any
// overlap of the byte ranges counts.
bool overlaps(const TensorView& a, const TensorView& b) {
  intptr_t alo, ahi, blo, bhi;
  if (!(a.device == b.device) || !byte_span(a, alo, ahi) || !byte_span(b, blo, bhi)) return false;
  if (ahi <= blo || bhi <= alo) return false;
  const int64_t es = dtype_size(a.dtype);
  if (a.ndim != b.ndim || dtype_size(b.dtype) != es) return true;
  OverlapDim dims[kMaxDims];
  int nd = 0;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.shape[i] == 1 && b.shape[i] == 1) continue;
    if (a.stride[i] != b.stride[i] || a.stride[i] <= 0) return true;
    dims[nd++] = {a.stride[i] * es, a.shape[i], b.shape[i]};
  }
  for (int i = 1; i < nd; ++i)  // by stride (insertion sort of at most kMaxDims)
    for (int j = i; j > 0 && dims[j].stride < dims[j - 1].stride; --j) std::swap(dims[j], dims[j - 1]);
  int64_t extent = es;  // bytes spanned by the smaller dimensions
  for (int i = 0; i < nd; ++i) {
    if (dims[i].stride < extent) return true;  // not nested: be conservative
    extent += (std::max(dims[i].na, dims[i].nb) - 1) * dims[i].stride;
  }
  return overlap_hit(dims, nd - 1, int64_t(reinterpret_cast<intptr_t>(b.data) - reinterpret_cast<intptr_t>(a.data)), es);
}

// Named tensors of a call, in a fixed array (no allocation).
struct Named {
  const char* name;
  const TensorView* t;
};
struct NamedList {
  Named v[24];
  int n = 0;
  void add(const char* name, const TensorView& t) {
    if (!t.defined()) return;
    if (n == int(sizeof v / sizeof v[0])) throw std::logic_error("hila: NamedList is full; please report this");
    v[n++] = {name, &t};
  }
  void add_state(const PartNames& nm, const StateView& s, bool pos = true) {
    if (pos) add(nm.pos, s.pos);
    add(nm.S, s.S);
    add(nm.P, s.P);
    add(nm.H, s.H);
  }
};

// Outputs must not share memory with inputs (they would be read after being overwritten) nor with
// each other.
void check_no_aliasing(const NamedList& outputs, const NamedList& inputs) {
  for (int i = 0; i < outputs.n; ++i) {
    const Named& o = outputs.v[i];
    for (int j = 0; j < inputs.n; ++j)
      if (overlaps(*o.t, *inputs.v[j].t))
        fail(o.name, std::string("shares memory with the input '") + inputs.v[j].name +
                         "': an output must not alias an input");
    for (int j = 0; j < i; ++j)
      if (overlaps(*o.t, *outputs.v[j].t))
        fail(o.name, std::string("shares memory with the output '") + outputs.v[j].name +
                         "': outputs must not alias each other");
  }
}

// Whether two views are the same tensor (a pool read and written in place).
bool same_view(const TensorView& a, const TensorView& b) {
  if (!a.defined() || !b.defined() || a.data != b.data || a.ndim != b.ndim || a.dtype != b.dtype ||
      !(a.device == b.device))
    return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.stride[i] != b.stride[i])) return false;
  return true;
}

// The inputs of a forward; with a pool updated in place (state_indices, final_state parts equal to
// init's) the init parts that are also outputs are left out (checked as outputs).
NamedList forward_inputs(const ForwardParams& p) {
  NamedList in;
  in.add("q", p.q), in.add("k", p.k), in.add("v", p.v), in.add("g", p.g), in.add("lam", p.lam);
  in.add("beta", p.beta), in.add("cu_seqlens", p.cu_seqlens), in.add("state_indices", p.state_indices);
  const PartNames nm = part_names("init");
  const bool pool = p.state_indices.defined();
  auto add = [&](const char* name, const TensorView& t, const TensorView& fin) {
    if (!(pool && same_view(t, fin))) in.add(name, t);
  };
  add(nm.pos, p.init.pos, p.final_state.pos);
  add(nm.S, p.init.S, p.final_state.S);
  add(nm.P, p.init.P, p.final_state.P);
  add(nm.H, p.init.H, p.final_state.H);
  return in;
}

// Host memory of the CPU backend's call (cpu/backend.cpp, cpu/primitive.cpp), estimated from the
// sizes before anything is allocated: per (sequence, head) work item the gathered rows, the
// segment matrices ([R, R] with R = T for the naive form, the chunk for chunk/scan), the states
// (and, in the chunk backward, one incoming state per segment), times the items that run at once;
// the backward also keeps dq and dk of every head until the group reduction. A rough upper
// bound: its purpose is to fail up front, naming what is large, instead of exhausting memory.
void check_cpu_memory(const Resolved& r, bool backward) {
  if (r.seqs.empty()) return;
  const double es = r.f64 ? 8 : 4, dk = double(r.dk), dvp = double(r.dvp), H = double(r.H);
  const double N = double(r.seqs.size());
  double n = 0, last = 0;
  for (const SeqInfo& q : r.seqs) {
    n = std::max(n, double(q.len));
    last = std::max(last, double(q.n0 + q.len));
  }
  const double rows = r.form == Form::naive ? n : r.form == Form::serial ? std::min(n, 64.0)
                                                                          : std::min(double(r.chunk), n);
  // rows per segment of the chunk form (cpu_segment_rows): the fewest of the call's primitives
  // (dims (dk, dk) give at most the rows of (dk, dv') and of an inner (dk, dk) primitive)
  const double seg_rows =
      r.form == Form::chunk ? std::min(rows, double(cpu_segment_rows(r.chunk, r.dk, r.dk, r.traits.delta, r.traits.loglinear)))
                            : rows;
  const double slots = r.traits.loglinear ? double(bitlen(static_cast<uint64_t>(last)) + 1) : 1;
  const double state = (r.traits.has_S ? dk * dk : 0) + (r.traits.has_P ? dk * dvp : 0) + slots * dk * dvp;
  const double gathered = n * (3 * dk + 3 * dvp + double(r.nL) + 4) * (backward ? 3 : 1);
  // [R, R] matrices of a segment, and the delta rule's per-segment matrices (bk, W [R, dk], K K^T,
  // Tm [R, R]) that the backward keeps for every segment
  const double segmats = rows * rows * ((backward ? 12 : 6) + (r.traits.delta ? 6 : 0)) +
                         (backward && r.traits.delta ? n * (2 * seg_rows + 2 * dk) : 0);
  const double segs = seg_rows > 0 ? std::ceil(n / seg_rows) + 1 : 1;
  double states = 4 * state;
  if (backward || r.form == Form::scan) states += segs * state * (r.form == Form::scan ? 3 : 1);
  const double threads = std::min<double>(std::max(1, omp_get_max_threads()), N * H);
  const double per_item = es * (gathered + segmats + states);
  const double kept = backward ? es * 2 * N * H * n * dk : 0;
  const double total = per_item * threads + kept;
  if (total <= double(host_memory_limit())) return;
  // Name what dominates.
  const std::string nthreads = std::to_string(static_cast<int64_t>(threads));
  if (segmats * es * threads >= total / 2) {
    const std::string R = std::to_string(static_cast<int64_t>(rows));
    check_host_bytes(r.form == Form::naive ? "form" : "chunk", total,
                     std::string("the ") + form_name(r.form) + " form's [" + R + ", " + R + "] " +
                         (r.f64 ? "float64" : "float32") + " matrices of each (sequence, head) on " + nthreads +
                         " threads" + (r.form == Form::naive ? " (use the chunk form)" : ""));
  } else if (states * es * threads >= total / 2) {
    check_host_bytes("q", total, "the per-head states (dk = " + std::to_string(r.dk) + ", dv' = " +
                                     std::to_string(r.dvp) + ", " + std::to_string(static_cast<int64_t>(slots)) +
                                     " slots) on " + nthreads + " threads");
  } else {
    check_host_bytes("q", total, "the rows of " + std::to_string(static_cast<int64_t>(N)) + " sequences x " +
                                     std::to_string(r.H) + " heads of up to " +
                                     std::to_string(static_cast<int64_t>(n)) + " tokens");
  }
}

// Row r of a tensor whose first dimension is the pool's (or the batch's).
TensorView row_of(const TensorView& t, int64_t r) {
  TensorView v = t;
  v.data = static_cast<char*>(t.data) + r * t.stride[0] * dtype_size(t.dtype);
  v.shape[0] = 1;
  return v;
}

// A state's layout for `rows` rows (pos [rows] int64, S / P / H per the operator), nothing read.
void state_layout(const PartNames& nm, const StateView& s, const OpConfig& cfg, int64_t rows, int64_t H, int64_t dk,
                  int64_t dv, bool want_pos, Device dev) {
  const OpTraits t = op_traits(cfg.op);
  const int64_t dvp = dv + (cfg.normalize ? 1 : 0);
  if (want_pos) {
    require(nm.pos, s.pos, "(int64 [N] positions of the state)");
    expect_shape(nm.pos, s.pos, {rows}, "one position per sequence");
    expect_dtype(nm.pos, s.pos, DType::i64, "positions are int64");
    expect_device(nm.pos, s.pos, dev);
    expect_strides(nm.pos, s.pos);
  }
  auto part = [&](const char* pn, const char* p, const TensorView& tv, bool has, const Shape& shape,
                  const char* layout, bool levels) {
    if (!has) {
      if (tv.defined())
        fail(pn, std::string("expected no tensor (operator ") + op_name(cfg.op) + " has no state part " + p + "), got " +
                     tv.shape_str());
      return;
    }
    require(pn, tv, layout);
    Shape sh = shape;
    if (levels) {
      expect_ndim(pn, tv, 5, layout);
      sh.d[2] = tv.shape[2];
    }
    expect_shape(pn, tv, sh, layout);
    expect_state_dtype(pn, tv);
    expect_device(pn, tv, dev);
    expect_strides(pn, tv);
  };
  const int64_t packed = packed_size(dk);
  if (t.has_S && packed < 0)
    fail("q", "expected a head dim dk whose packed state S of dk(dk+1)/2 entries fits in int64, got dk = " +
                  std::to_string(dk));
  part(nm.S, "S", s.S, t.has_S, {rows, H, packed}, "([N, H, dk(dk+1)/2] packed symmetric S)", false);
  part(nm.P, "P", s.P, t.has_P, {rows, H, dk, dvp}, "([N, H, dk, dv'])", false);
  if (t.loglinear) part(nm.H, "H", s.H, true, {rows, H, 0, dk, dvp}, "([N, H, Ls, dk, dv'] Fenwick slots)", true);
  else part(nm.H, "H", s.H, true, {rows, H, dk, dvp}, "([N, H, dk, dv'])", false);
}

// A state against its sequences' positions (nullptr: none known): the Fenwick slots they need
// and, with `values`, finite parts whose dead slots are zero (canonical). seq_rows: the state row
// of each sequence (-1: none) for a pool, nullptr when sequence i is row i.
void state_levels(const PartNames& nm, const StateView& s, const OpConfig& cfg, int64_t H, int64_t dk, int64_t dv,
                  const std::vector<int64_t>* positions, const std::vector<int64_t>* seq_rows, bool values) {
  const OpTraits t = op_traits(cfg.op);
  const int64_t dvp = dv + (cfg.normalize ? 1 : 0);
  if (values) {
    if (!seq_rows) {
      if (s.S.defined()) check_finite(nm.S, s.S);
      if (s.P.defined()) check_finite(nm.P, s.P);
      check_finite(nm.H, s.H);
    } else {  // a pool: the rows the call reads
      for (int64_t r : *seq_rows) {
        if (r < 0) continue;
        if (s.S.defined()) check_finite(nm.S, row_of(s.S, r));
        if (s.P.defined()) check_finite(nm.P, row_of(s.P, r));
        check_finite(nm.H, row_of(s.H, r));
      }
    }
  }
  if (!t.loglinear || !positions) return;
  const int64_t Ls = s.H.shape[2];
  const int64_t N = int64_t(positions->size());
  const HostMirror whole(values && !seq_rows ? s.H : TensorView{});
  for (int64_t i = 0; i < N; ++i) {
    const int64_t row = seq_rows ? (*seq_rows)[size_t(i)] : i;
    if (row < 0) continue;
    const int64_t n = (*positions)[size_t(i)];
    const int64_t need = bitlen(static_cast<uint64_t>(n)) + 1;
    if (Ls < need)
      fail(nm.H, "has " + std::to_string(Ls) + " level slots, but position " + std::to_string(n) + " of sequence " +
                     std::to_string(i) + " needs " + std::to_string(need) + " (bitlen(pos)+1)");
    if (!values) continue;
    const HostMirror one(seq_rows ? row_of(s.H, row) : TensorView{});
    const TensorView& hv = seq_rows ? one.view() : whole.view();
    const int64_t hr = seq_rows ? 0 : i;
    for (int64_t l = 0; l < Ls; ++l) {
      const bool live = l >= 1 && l <= 63 && ((n >> (l - 1)) & 1);
      if (live) continue;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < dk; ++r)
          for (int64_t c = 0; c < dvp; ++c)
            if (load(hv, offset(hv, {hr, h, l, r, c})) != 0)
              fail(nm.H, "is not canonical at position " + std::to_string(n) + ": slot " + std::to_string(l) +
                             " of sequence " + std::to_string(i) +
                             (l == 0 ? " must be zero (slot 0 is the diagonal level, never stored)"
                                     : " must be zero (bit " + std::to_string(l - 1) + " of the position is clear)") +
                             ", got a non-zero entry");
    }
  }
}

// Positions of an input state in [0, 2^62] (the bound of forward).
void check_position_range(const char* name, const std::vector<int64_t>& pos, const std::vector<int64_t>* seq_rows) {
  for (size_t i = 0; i < pos.size(); ++i) {
    if (seq_rows && (*seq_rows)[i] < 0) continue;
    if (pos[i] < 0 || pos[i] > kMaxPosition)
      fail(name, "expected positions in [0, 2^62] (the bound of forward), got " + std::to_string(pos[i]) +
                     " for sequence " + std::to_string(i));
  }
}

// The positions the N sequences of a forward start from: init_pos_host when given (compared with
// the device's with value checks on), else read from init.pos; with a pool, init.pos at the rows
// state_indices names (0 for padding). The indices are read (and checked) where the positions are
// read, and on the CPU; `idx` gets them then.
std::vector<int64_t> init_positions(const ForwardParams& p, int64_t N, int64_t rows, bool pool, Device dev,
                                    std::vector<int64_t>& idx) {
  const bool host = p.init_pos_host.defined();
  if (host) {
    expect_host("init_pos_host", p.init_pos_host, "a host copy of the initial positions");
    expect_dtype("init_pos_host", p.init_pos_host, DType::i64, "positions are int64");
    expect_shape("init_pos_host", p.init_pos_host, {N}, "one position per sequence");
    expect_strides("init_pos_host", p.init_pos_host);
  }
  const bool read_dev = !host || p.cfg.check_values;
  if (pool && (read_dev || dev.type == DeviceType::cpu)) {
    idx = read_ints(p.state_indices);
    check_index_values(idx, rows);
  }
  std::vector<int64_t> pos = host ? read_ints(p.init_pos_host) : std::vector<int64_t>{};
  if (!read_dev) return pos;
  const std::vector<int64_t> all = read_ints(p.init.pos);
  std::vector<int64_t> seq(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) seq[size_t(i)] = pool ? (idx[size_t(i)] < 0 ? 0 : all[size_t(idx[size_t(i)])]) : all[size_t(i)];
  if (!host) return seq;
  for (int64_t i = 0; i < N; ++i)
    if (pos[size_t(i)] != seq[size_t(i)])
      fail("init_pos_host", "expected the initial positions of init.pos (value checks are on), got " +
                                std::to_string(pos[size_t(i)]) + " for sequence " + std::to_string(i) + " where init.pos" +
                                (pool ? "[state_indices[" + std::to_string(i) + "]]" : std::string()) + " holds " +
                                std::to_string(seq[size_t(i)]));
  return pos;
}

Resolved resolve_common(const ForwardParams& p, bool o_required) {
  check_config(p.cfg);
  const int form = static_cast<int>(p.form);
  if (form < 0 || form > 3) fail("form", "expected naive, serial, chunk or scan, got id " + std::to_string(form));
  check_chunk(p.chunk);
  const Dims d = check_qkv(p.q, p.k, p.v, true, p.cfg);
  Resolved r;
  r.cfg = p.cfg;
  r.traits = op_traits(p.cfg.op);
  r.form = p.form;
  r.chunk = p.chunk;
  r.B = d.B, r.T = d.T, r.G = d.G, r.H = d.H, r.dk = d.dk, r.dv = d.dv, r.dvp = d.dvp;
  r.gate_cols = check_side_inputs(p.cfg, p.g, p.lam, p.beta, true, d);
  r.nL = p.lam.defined() ? p.lam.shape[3] : 0;
  r.scale = p.cfg.scale != 0 ? p.cfg.scale : 1.0 / std::sqrt(static_cast<double>(d.dk));
  r.f64 = d.dtype == DType::f64 || p.form == Form::naive;
  r.seqs = make_seqs(p.cu_seqlens, p.cu_seqlens_host, d.B, d.T, d.dev, p.cfg.check_values);
  const int64_t N = static_cast<int64_t>(r.seqs.size());
  const bool pool = p.state_indices.defined();
  int64_t rows = N;
  if (pool) {
    if (!p.init.defined())
      fail("state_indices", "expected an initial state pool (init) for the indices to address, got no initial state");
    check_index_tensor(p.state_indices, N, d.dev);
    rows = state_rows(p.init);
    r.pooled = true;
    r.pool_rows = rows;
  }
  if (p.init.defined()) {
    const PartNames nm = part_names("init");
    state_layout(nm, p.init, p.cfg, rows, d.H, d.dk, d.dv, true, d.dev);
    const std::vector<int64_t> pos = init_positions(p, N, rows, pool, d.dev, r.rows);
    const std::vector<int64_t>* seq_rows = pool && !r.rows.empty() ? &r.rows : nullptr;
    check_position_range(p.init_pos_host.defined() ? "init_pos_host" : nm.pos, pos, seq_rows);
    for (int64_t i = 0; i < N; ++i) {
      if (pos[size_t(i)] > kMaxPosition - r.seqs[size_t(i)].len)
        fail(p.init_pos_host.defined() ? "init_pos_host" : "init.pos",
             "expected n0 + T <= 2^62 for sequence " + std::to_string(i) + " (T = " +
                 std::to_string(r.seqs[size_t(i)].len) + "), got n0 = " + std::to_string(pos[size_t(i)]));
      r.seqs[size_t(i)].n0 = pos[size_t(i)];
    }
    r.has_init = true;
    // with a pool on CUDA and no indices read (check_values off), the canonical check is off too
    state_levels(nm, p.init, p.cfg, d.H, d.dk, d.dv, &pos, seq_rows, p.cfg.check_values && (!pool || seq_rows));
  } else if (p.init_pos_host.defined()) {
    fail("init_pos_host", "expected no tensor (no initial state was given), got " + p.init_pos_host.shape_str());
  }
  check_levels(r);
  if (o_required || p.o.defined())
    check_output("o", p.o, {d.B, d.T, d.H, d.dv}, d.dtype, d.dev, "[B, T, H, dv] like v");
  if (p.final_state.defined()) {
    std::vector<int64_t> fin(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) fin[size_t(i)] = r.seqs[size_t(i)].n0 + r.seqs[size_t(i)].len;
    const PartNames nm = part_names("final_state");
    state_layout(nm, p.final_state, p.cfg, rows, d.H, d.dk, d.dv, true, d.dev);
    state_levels(nm, p.final_state, p.cfg, d.H, d.dk, d.dv, &fin, nullptr, false);
  }
  check_values(p.cfg, p.q, p.k, p.v, p.g, p.lam, p.beta);
  return r;
}

}  // namespace

std::vector<int64_t> read_positions(const TensorView& dev_pos) { return read_ints(dev_pos); }

void check_state(const char* name, const StateView& s, const OpConfig& cfg, int64_t rows, int64_t H, int64_t dk,
                 int64_t dv, const std::vector<int64_t>* positions, bool want_pos, bool values, Device dev) {
  const PartNames nm = part_names(name);
  state_layout(nm, s, cfg, rows, H, dk, dv, want_pos, dev);
  if (positions) check_position_range(nm.pos, *positions, nullptr);
  state_levels(nm, s, cfg, H, dk, dv, positions, nullptr, values);
}

Resolved resolve_forward(const ForwardParams& p) {
  const StreamScope scope(p.stream);
  Resolved r = resolve_common(p, true);
  {
    NamedList out;
    out.add("o", p.o);
    out.add_state(part_names("final_state"), p.final_state);
    check_no_aliasing(out, forward_inputs(p));
  }
  if (p.q.device.type == DeviceType::cpu) check_cpu_memory(r, false);
  return r;
}

Resolved resolve_backward(const BackwardParams& p) {
  const StreamScope scope(p.stream);
  if (static_cast<int>(p.form) >= 0 && static_cast<int>(p.form) <= 3 && static_cast<int>(p.cfg.op) >= 0 &&
      static_cast<int>(p.cfg.op) <= 9 && !supports(p.cfg.op, p.form, true))
    fail("form", std::string("expected a form with a backward for operator ") + op_name(p.cfg.op) + " (naive or chunk" +
                     (supports(p.cfg.op, Form::serial, true) ? ", or serial" : "") + "), got " + form_name(p.form));
  if (p.state_indices.defined())
    fail("state_indices", "expected no tensor in a backward (state pools are for inference: forward and step), got " +
                              p.state_indices.shape_str());
  Resolved r = resolve_common(p, false);
  const DType dt = p.q.dtype;
  const Device dev = p.q.device;
  check_output("d_o", p.d_o, {r.B, r.T, r.H, r.dv}, dt, dev, "cotangent of o, [B, T, H, dv]");
  if (p.cfg.check_values) check_finite("d_o", p.d_o);
  const int64_t N = static_cast<int64_t>(r.seqs.size());
  if (p.d_final.defined()) {
    std::vector<int64_t> fin(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) fin[size_t(i)] = r.seqs[size_t(i)].n0 + r.seqs[size_t(i)].len;
    const PartNames nm = part_names("d_final");
    state_layout(nm, p.d_final, p.cfg, N, r.H, r.dk, r.dv, false, dev);
    state_levels(nm, p.d_final, p.cfg, r.H, r.dk, r.dv, &fin, nullptr, false);
    if (p.cfg.check_values) {
      if (p.d_final.S.defined()) check_finite("d_final.S", p.d_final.S);
      if (p.d_final.P.defined()) check_finite("d_final.P", p.d_final.P);
      if (p.d_final.H.defined()) check_finite("d_final.H", p.d_final.H);
    }
  }
  check_optional_output("dq", p.dq, p.q, "q");
  check_optional_output("dk", p.dk, p.k, "k");
  check_optional_output("dv", p.dv, p.v, "v");
  check_optional_output("dg", p.dg, p.g, "g");
  check_optional_output("dlam", p.dlam, p.lam, "lam");
  check_optional_output("dbeta", p.dbeta, p.beta, "beta");
  if (p.d_init.defined()) {
    if (!p.init.defined()) fail("d_init", "expected no tensors (no initial state was given), got a state");
    check_optional_output("d_init.S", p.d_init.S, p.init.S, "init.S");
    check_optional_output("d_init.P", p.d_init.P, p.init.P, "init.P");
    check_optional_output("d_init.H", p.d_init.H, p.init.H, "init.H");
  }
  {
    NamedList out;
    out.add("o", p.o);
    out.add_state(part_names("final_state"), p.final_state);
    out.add("dq", p.dq), out.add("dk", p.dk), out.add("dv", p.dv), out.add("dg", p.dg);
    out.add("dlam", p.dlam), out.add("dbeta", p.dbeta);
    out.add_state(part_names("d_init"), p.d_init, false);
    NamedList in = forward_inputs(p);
    in.add("d_o", p.d_o);
    in.add_state(part_names("d_final"), p.d_final, false);
    check_no_aliasing(out, in);
  }
  if (dev.type == DeviceType::cpu) check_cpu_memory(r, true);
  return r;
}

namespace {

// What a step runs against: the state's sizes, dtype, device, and the positions of the sequences
// where they are known on the host (-1 for a padding row), else nullptr.
struct StepTarget {
  int64_t N, H, dk, dv;
  DType dtype;
  Device device;
  const std::vector<int64_t>* pos;
  const StateView* state;
};

void check_max_position(int64_t m) {
  if (m < -1 || m >= kMaxPosition)
    fail("max_position", "expected -1 (none) or the largest position a step starts from, in [0, 2^62), got " +
                             std::to_string(m));
}

// q, k, v must match the state; validation of the step inputs shared by both step forms.
void resolve_step_inputs(const StepParams& p, const Dims& d, const StepTarget& st, Resolved& r) {
  if (d.B != st.N || d.H != st.H || d.dk != st.dk || d.dv != st.dv)
    fail("q", "expected N = " + std::to_string(st.N) + ", H = " + std::to_string(st.H) + ", dk = " +
                  std::to_string(st.dk) + ", dv = " + std::to_string(st.dv) + " (the decode state's), got N = " +
                  std::to_string(d.B) + ", H = " + std::to_string(d.H) + ", dk = " + std::to_string(d.dk) +
                  ", dv = " + std::to_string(d.dv));
  if (!(d.dev == st.device))
    fail("q", "expected device " + device_name(st.device) + " (the decode state's), got " + device_name(d.dev));
  // States are float64 exactly for float64 inputs; the CPU also steps lower-precision inputs on a
  // float64 state (more precise, never less), CUDA does not.
  const DType want = d.dtype == DType::f64 ? DType::f64 : DType::f32;
  if (st.dtype != want && (d.dev.type == DeviceType::cuda || d.dtype == DType::f64))
    fail("state", std::string("expected a ") + dtype_name(want) + " state for " + dtype_name(d.dtype) + " inputs" +
                      (d.dev.type == DeviceType::cuda ? " on a CUDA device" : "") +
                      " (states are float32, float64 for float64 inputs), got " + dtype_name(st.dtype));
  if (st.pos)
    for (int64_t i = 0; i < d.B; ++i) {
      const int64_t x = (*st.pos)[size_t(i)];
      if (x == -1 && r.pooled && r.rows[size_t(i)] < 0) continue;  // a padding row
      if (x < 0 || x >= kMaxPosition)
        fail("state.pos", "expected positions in [0, 2^62) before a step (a step past 2^62 would leave the "
                          "bound of forward), got " + std::to_string(x) + " for sequence " + std::to_string(i));
    }
  r.cfg = p.cfg;
  r.traits = op_traits(p.cfg.op);
  r.form = Form::serial;
  r.B = d.B, r.T = 1, r.G = d.G, r.H = d.H, r.dk = d.dk, r.dv = d.dv, r.dvp = d.dvp;
  r.gate_cols = check_side_inputs(p.cfg, p.g, p.lam, p.beta, false, d);
  r.nL = p.lam.defined() ? p.lam.shape[2] : 0;
  r.scale = p.cfg.scale != 0 ? p.cfg.scale : 1.0 / std::sqrt(static_cast<double>(d.dk));
  r.f64 = st.dtype == DType::f64;
  r.positions_known = st.pos != nullptr;
  r.max_position = p.max_position;
  r.seqs.resize(static_cast<size_t>(d.B));
  for (int64_t i = 0; i < d.B; ++i)
    r.seqs[size_t(i)] = {i, 0, 1, st.pos ? std::max<int64_t>((*st.pos)[size_t(i)], 0) : 0};
  if (r.traits.loglinear) {
    if (st.pos) {
      for (int64_t i = 0; i < d.B; ++i) {
        if ((*st.pos)[size_t(i)] < 0) continue;  // a padding row
        const int64_t need = bitlen(static_cast<uint64_t>(r.seqs[size_t(i)].n0)) + 1;
        if (r.nL < need)
          fail("lam", "has " + std::to_string(r.nL) + " levels, but sequence " + std::to_string(i) +
                          " is at position " + std::to_string(r.seqs[size_t(i)].n0) + " and needs " +
                          std::to_string(need) + " (bitlen(pos)+1)");
      }
    }
    if (p.max_position >= 0) {
      const int64_t need = bitlen(static_cast<uint64_t>(p.max_position)) + 1;
      if (r.nL < need)
        fail("lam", "has " + std::to_string(r.nL) + " levels, but max_position = " + std::to_string(p.max_position) +
                        " needs " + std::to_string(need) + " (bitlen(max_position)+1)");
    }
  }
  check_output("o", p.o, {d.B, d.H, d.dv}, d.dtype, d.dev, "[N, H, dv] like v");
  {
    NamedList in;
    in.add("q", p.q), in.add("k", p.k), in.add("v", p.v), in.add("g", p.g), in.add("lam", p.lam);
    in.add("beta", p.beta);
    const int ninputs = in.n;
    in.add("state_indices", p.state_indices);
    in.add_state(part_names("state"), *st.state);
    NamedList o;
    o.add("o", p.o);
    check_no_aliasing(o, in);
    // the state is written in place: it must not alias the step's inputs either
    NamedList parts, inputs;
    parts.add_state(part_names("state"), *st.state);
    for (int i = 0; i < ninputs; ++i) inputs.v[inputs.n++] = in.v[i];
    inputs.add("state_indices", p.state_indices);
    check_no_aliasing(parts, inputs);
    // the counters are written too: they must alias nothing else of the call
    NamedList counters;
    counters.add("counters", p.counters);
    in.add("o", p.o);
    check_no_aliasing(counters, in);
  }
  check_values(p.cfg, p.q, p.k, p.v, p.g, p.lam, p.beta);
}

}  // namespace

Resolved resolve_step(const StepParams& p, const DecodeState& st) {
  const StreamScope scope(p.stream);
  check_config(p.cfg);
  const OpConfig& sc = st.config();
  if (p.cfg.op != sc.op)
    fail("op", std::string("expected the decode state's operator ") + op_name(sc.op) + ", got " + op_name(p.cfg.op));
  if (p.cfg.normalize != sc.normalize)
    fail("normalize", std::string("expected ") + (sc.normalize ? "true" : "false") +
                          " as when the decode state was created, got " + (p.cfg.normalize ? "true" : "false"));
  if (p.state_indices.defined())
    fail("state_indices", "expected no tensor for a DecodeState step (it steps its own sequences; a state pool is "
                          "stepped as a StateView), got " + p.state_indices.shape_str());
  if (p.counters.defined())
    fail("counters", "expected no tensor for a DecodeState step (it owns its step counters; counters are for a "
                     "StateView step), got " + p.counters.shape_str());
  check_max_position(p.max_position);
  const Dims d = check_qkv(p.q, p.k, p.v, false, p.cfg);
  const StateView view = const_cast<DecodeState&>(st).view();
  std::vector<int64_t> pos(static_cast<size_t>(st.batch()));
  for (int64_t i = 0; i < st.batch(); ++i) {
    pos[size_t(i)] = st.position(i);
    if (p.max_position >= 0 && pos[size_t(i)] > p.max_position)
      fail("state.pos", "expected positions <= max_position = " + std::to_string(p.max_position) +
                            " (the caller's bound), got " + std::to_string(pos[size_t(i)]) + " for sequence " +
                            std::to_string(i));
  }
  const StepTarget t{st.batch(), st.heads(), st.dk(), st.dv(), st.dtype(), st.device(), &pos, &view};
  Resolved r;
  resolve_step_inputs(p, d, t, r);
  return r;
}

Resolved resolve_step(const StepParams& p, const StateView& s) {
  const StreamScope scope(p.stream);
  check_config(p.cfg);
  check_max_position(p.max_position);
  const Dims d = check_qkv(p.q, p.k, p.v, false, p.cfg);
  const OpTraits t = op_traits(p.cfg.op);
  const bool pool = p.state_indices.defined();
  const int64_t rows = pool ? state_rows(s) : d.B;
  const PartNames nm = part_names("state");
  state_layout(nm, s, p.cfg, rows, d.H, d.dk, d.dv, true, d.dev);
  const DType dt = s.H.dtype;
  if (s.S.defined() && s.S.dtype != dt)
    fail("state.S", std::string("expected ") + dtype_name(dt) + " like state.H (one state dtype), got " + dtype_name(s.S.dtype));
  if (s.P.defined() && s.P.dtype != dt)
    fail("state.P", std::string("expected ") + dtype_name(dt) + " like state.H (one state dtype), got " + dtype_name(s.P.dtype));
  Resolved r;
  if (pool) {
    check_index_tensor(p.state_indices, d.B, d.dev);
    r.pooled = true;
    r.pool_rows = rows;
  }
  if (p.counters.defined()) check_counters(p.counters, d.B, d.H, d.dev);
  // The host reads the positions (and a pool's indices) on the CPU, for the value checks, and for
  // a log-linear step without the caller's bound (its slot capacity and λ levels depend on them).
  // Otherwise the step kernel reads them on the device (and enforces max_position there), so a
  // CUDA step synchronizes with nothing and can be captured in a CUDA graph.
  const bool read = d.dev.type == DeviceType::cpu || p.cfg.check_values || (t.loglinear && p.max_position < 0);
  std::vector<int64_t> pos;
  if (read) {
    if (pool) {
      r.rows = read_ints(p.state_indices);
      check_index_values(r.rows, rows);
    }
    const std::vector<int64_t> all = read_ints(s.pos);
    pos.resize(static_cast<size_t>(d.B));
    for (int64_t i = 0; i < d.B; ++i) {
      const int64_t row = pool ? r.rows[size_t(i)] : i;
      if (row < 0) {
        pos[size_t(i)] = -1;  // a padding row
        continue;
      }
      const int64_t x = all[size_t(row)];
      pos[size_t(i)] = x;
      if (x < 0) fail("state.pos", "expected positions >= 0, got " + std::to_string(x) + " for sequence " + std::to_string(i));
      if (p.max_position >= 0 && x > p.max_position)
        fail("state.pos", "expected positions <= max_position = " + std::to_string(p.max_position) +
                              " (the caller's bound), got " + std::to_string(x) + " for sequence " + std::to_string(i));
      if (t.loglinear && x < kMaxPosition) {
        const int64_t Ls = s.H.shape[2], need = state_slots(x + 1);
        if (Ls < need)
          fail("state.H", "has " + std::to_string(Ls) + " Fenwick slots, but sequence " + std::to_string(i) +
                              " steps from position " + std::to_string(x) + " to " + std::to_string(x + 1) +
                              " and needs " + std::to_string(need) +
                              " slots (bitlen(pos+1)+1); grow the state, or use a DecodeState");
      }
    }
  }
  if (t.loglinear && p.max_position >= 0) {
    const int64_t Ls = s.H.shape[2], need = state_slots(p.max_position + 1);
    if (Ls < need)
      fail("state.H", "has " + std::to_string(Ls) + " Fenwick slots, but a step from max_position = " +
                          std::to_string(p.max_position) + " needs " + std::to_string(need) +
                          " (bitlen(max_position+1)+1)");
  }
  const StepTarget st{d.B, d.H, d.dk, d.dv, dt, d.dev, read ? &pos : nullptr, &s};
  // The state's values are not checked (a step's own output; checking would copy a device state to
  // the host every step); check_values covers the step inputs as for a DecodeState.
  resolve_step_inputs(p, d, st, r);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Output values (check_values on): a non-finite output is an error naming the output and, where
// the inputs tell, the likely cause. Device tensors are scanned on the device (device_scan) and
// copied to the host only to explain an error, so a backend's dispatcher can run these too.

namespace {

std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", x);
  return buf;
}

// Largest |x| of a host tensor (0 if absent).
double max_abs(const TensorView& t) {
  double m = 0;
  for_each(t, [&](int64_t off, const auto&) { m = std::max(m, std::fabs(load(t, off))); });
  return m;
}

// Why outputs went non-finite, from the inputs: a divergent delta rule, magnitudes beyond the
// compute precision (scale included), a normalize denominator at zero; else a generic overflow.
std::string likely_cause(const Resolved& r, const TensorView& q_dev, const TensorView& k_dev,
                         const TensorView& v_dev, const TensorView& beta_dev, bool with_t) {
  const HostMirror hq(q_dev), hk(k_dev), hv(v_dev), hb(beta_dev);
  const TensorView &q = hq.view(), &k = hk.view(), &v = hv.view(), &beta = hb.view();
  const char* prec = r.f64 ? "float64" : "float32";
  const double big = r.f64 ? 1.7976931348623157e308 : 3.4028234663852886e38;
  if (r.traits.delta && beta.defined()) {
    // transition I - beta k k^T: eigenvalue 1 - beta |k|^2 along k, outside [-1, 1] unless
    // beta |k|^2 in [0, 2]
    const int64_t hpg = r.H / r.G;
    std::string worst;
    double wx = 0;
    for_each(beta, [&](int64_t off, const auto& idx) {
      const int nd = with_t ? 3 : 2;
      const int64_t h = idx[nd - 1], grp = h / hpg;
      double kk = 1;  // qk_l2norm: unit keys
      if (!r.cfg.qk_l2norm) {
        kk = 0;
        const int64_t base = idx[0] * k.stride[0] + (with_t ? idx[1] * k.stride[1] + grp * k.stride[2] : grp * k.stride[1]);
        for (int64_t c = 0; c < r.dk; ++c) {
          const double x = load(k, base + c * k.stride[k.ndim - 1]);
          kk += x * x;
        }
      }
      const double x = load(beta, off) * kk;
      const double dist = x < 0 ? -x : x - 2;
      if (dist > 0 && dist > wx) {
        wx = dist;
        worst = num(x) + " at " + idx_str(idx, nd);
      }
    });
    if (!worst.empty())
      return "a divergent delta rule: beta |k|^2 = " + worst +
             " lies outside [0, 2], so the erase I - beta k k^T expands the state (keep beta |k|^2 in [0, 2], "
             "e.g. beta in [0, 2] with qk_l2norm)";
  }
  const double mq = max_abs(q), sq = std::fabs(r.scale) * mq, mk = max_abs(k), mv = max_abs(v);
  if (!(sq <= big))
    return "scale = " + num(r.scale) + " out of range: scale times max|q| = " + num(mq) + " is beyond " + prec;
  const int order = r.traits.has_S && r.traits.has_P ? 3 : (r.traits.has_S || r.traits.has_P) ? 2 : 1;
  const double logmag = order * (std::log10(std::max(sq, 1e-300)) + std::log10(std::max(mk, 1e-300))) +
                        std::log10(std::max(mv, 1e-300)) +
                        order * std::log10(double(std::max<int64_t>(r.dk, 1)) * double(std::max<int64_t>(r.T, 1)));
  if (logmag > std::log10(big)) {
    const bool scale_big = std::fabs(r.scale) > 1e6;
    return std::string(scale_big ? "scale = " + num(r.scale) + " out of range: " : "") +
           "magnitudes beyond " + prec + ": |scale| max|q| = " + num(sq) + ", max|k| = " +
           num(mk) + ", max|v| = " + num(mv) + " give products up to about 1e" +
           std::to_string(static_cast<int>(logmag)) + " in this order-" + std::to_string(order) +
           " operator (the " + prec + " range ends near 1e" + std::to_string(static_cast<int>(std::log10(big))) +
           ")" + (r.f64 ? "" : "; rescale the inputs or compute in float64");
  }
  if (r.cfg.normalize)
    return "normalize: o = num / (den + eps) with den + eps = 0 or tiny (den is not sign-definite for signed "
           "features; use nonnegative feature maps or a larger eps)";
  return std::string("an overflow of ") + prec + " in the computation (check the magnitudes of q, k, v and scale)";
}

template <class Cause>
void check_output_finite(const char* name, const TensorView& dev_t, const Cause& cause) {
  if (!dev_t.defined() || dev_t.numel() == 0) return;
  const int64_t first = scan(dev_t, false);
  if (first == -1) return;
  const HostMirror m(dev_t);  // a device tensor (found bad on the device) is read back to name the element
  const TensorView& t = m.view();
  for_each(t, [&](int64_t off, const auto& idx) {
    const double x = load(t, off);
    if (!std::isfinite(x))
      fail(name, "is not finite: " + num(x) + " at " + idx_str(idx, t.ndim) +
                     " from finite inputs (value checks are on); likely cause: " + cause());
  });
}

template <class Cause>
void check_state_finite(const char* name, const StateView& s, const Cause& cause) {
  const PartNames nm = part_names(name);
  check_output_finite(nm.S, s.S, cause);
  check_output_finite(nm.P, s.P, cause);
  check_output_finite(nm.H, s.H, cause);
}

// The state a call wrote: all of it, or of a pool (the indices are read when values are checked) the
// rows its sequences own.
template <class Cause>
void check_written_state(const char* name, const Resolved& r, const StateView& s, const Cause& cause) {
  if (!r.pooled) return check_state_finite(name, s, cause);
  const PartNames nm = part_names(name);
  for (size_t i = 0; i < r.rows.size(); ++i) {
    const int64_t row = r.rows[i];
    if (row < 0) continue;
    if (s.S.defined()) check_output_finite(nm.S, row_of(s.S, row), cause);
    if (s.P.defined()) check_output_finite(nm.P, row_of(s.P, row), cause);
    if (s.H.defined()) check_output_finite(nm.H, row_of(s.H, row), cause);
  }
}

}  // namespace

void check_forward_outputs(const Resolved& r, const ForwardParams& p) {
  if (!r.cfg.check_values) return;
  auto cause = [&] { return likely_cause(r, p.q, p.k, p.v, p.beta, true); };
  check_output_finite("o", p.o, cause);
  check_written_state("final_state", r, p.final_state, cause);
}

void check_backward_outputs(const Resolved& r, const BackwardParams& p) {
  if (!r.cfg.check_values) return;
  check_forward_outputs(r, p);
  auto cause = [&] { return likely_cause(r, p.q, p.k, p.v, p.beta, true); };
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"dq", &p.dq}, {"dk", &p.dk}, {"dv", &p.dv},
                                {"dg", &p.dg}, {"dlam", &p.dlam}, {"dbeta", &p.dbeta}})
    check_output_finite(name, *t, cause);
  check_state_finite("d_init", p.d_init, cause);
}

void check_step_outputs(const Resolved& r, const StepParams& p, const StateView& state) {
  if (!r.cfg.check_values) return;
  auto cause = [&] { return likely_cause(r, p.q, p.k, p.v, p.beta, false); };
  check_output_finite("o", p.o, cause);
  check_written_state("state", r, state, cause);  // a finite o can come with an overflowed state
}

}  // namespace hila::detail
