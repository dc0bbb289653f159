// SPDX-License-Identifier: Apache-2.0
#include "problem.h"

#include "device.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>

namespace hila::tools {

namespace {

// Correctly rounded double -> small binary float (round to nearest even, subnormals, overflow to
// inf). Going through float first would round twice and can be one ulp off for bf16 / f16.
uint16_t encode_small(double x, int man_bits, int exp_bits) {
  const uint16_t sign = std::signbit(x) ? uint16_t(1u << (man_bits + exp_bits)) : 0;
  const uint16_t exp_all = uint16_t(((1u << exp_bits) - 1) << man_bits);
  if (std::isnan(x)) return uint16_t(exp_all | (1u << (man_bits - 1)));  // quiet NaN
  const double a = std::fabs(x);
  if (std::isinf(a)) return sign | exp_all;
  if (a == 0) return sign;
  const int bias = (1 << (exp_bits - 1)) - 1;
  const int emin = 1 - bias;
  int e2;
  std::frexp(a, &e2);  // a = f * 2^e2, f in [0.5, 1)
  int e = e2 - 1;      // a = 1.m * 2^e
  if (e < emin) {
    // Subnormal: a multiple of 2^(emin - man). A carry into 2^man is the smallest normal, whose
    // bit pattern is exactly that integer.
    const double m = std::nearbyint(std::ldexp(a, man_bits - emin));
    return sign | uint16_t(m);
  }
  double m = std::nearbyint(std::ldexp(a, man_bits - e));  // in [2^man, 2^(man+1)]
  if (m >= std::ldexp(1.0, man_bits + 1)) {
    m = std::ldexp(m, -1);
    ++e;
  }
  if (e > bias) return sign | exp_all;
  return sign | uint16_t((e + bias) << man_bits) | uint16_t(uint32_t(m) - (1u << man_bits));
}

double decode_small(uint16_t b, int man_bits, int exp_bits) {
  const bool neg = b >> (man_bits + exp_bits);
  const int ef = (b >> man_bits) & ((1 << exp_bits) - 1);
  const uint32_t mf = b & ((1u << man_bits) - 1);
  const int bias = (1 << (exp_bits - 1)) - 1;
  double a;
  if (ef == (1 << exp_bits) - 1)
    a = mf ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (ef == 0)
    a = std::ldexp(double(mf), 1 - bias - man_bits);
  else
    a = std::ldexp(double(mf | (1u << man_bits)), ef - bias - man_bits);
  return neg ? -a : a;
}

template <class T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
void store(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

template <class I>
I to_int(double x) {
  if (std::isnan(x)) return 0;
  const double r = std::nearbyint(x);
  if (r >= double(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
  if (r <= double(std::numeric_limits<I>::min())) return std::numeric_limits<I>::min();
  return I(r);
}

int64_t product(const std::vector<int64_t>& shape) {
  if (shape.empty()) return 0;
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// Bytes of a buffer of this shape, or -1 when numel x element size does not fit in int64.
int64_t checked_bytes(const std::vector<int64_t>& shape, DType dt) {
  int64_t n = dtype_size(dt);
  for (int64_t s : shape)
    if (s < 0 || __builtin_mul_overflow(n, s, &n)) return -1;
  return shape.empty() ? 0 : n;
}

// Random draws in double, stored with rounding: the same seed gives the same problem in every
// dtype up to rounding, so an f32 run can be compared with an f64 run of the same inputs.
struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) {}
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(gen); }
};

void fill_normal(Buffer& b, Rng& r, double sd, bool nonneg) {
  for (int64_t i = 0; i < b.numel(); ++i) {
    const double x = r.normal() * sd;
    b.set(i, nonneg ? std::fabs(x) : x);
  }
}

void fill_uniform(Buffer& b, Rng& r, double lo, double hi) {
  for (int64_t i = 0; i < b.numel(); ++i) b.set(i, r.uniform(lo, hi));
}

// Random canonical state: S, P dense random; log-linear H random only at the live levels of each
// sequence's position (bit l-1 of pos set), since the library rejects non-canonical states.
void fill_state(StateBuffers& s, const std::vector<int64_t>& pos, bool levels, Rng& r, double sd,
                bool nonneg) {
  fill_normal(s.S, r, sd, nonneg);
  fill_normal(s.P, r, sd, nonneg);
  if (s.H.empty()) return;
  if (!levels) {
    fill_normal(s.H, r, sd, nonneg);
    return;
  }
  // H: [N, H, Ls, dk, dv']
  const auto& sh = s.H.shape;
  const int64_t N = sh[0], Hh = sh[1], Ls = sh[2], mat = sh[3] * sh[4];
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < Hh; ++h)
      for (int64_t l = 1; l < Ls; ++l) {
        if (l - 1 >= 63 || !((pos[n] >> (l - 1)) & 1)) continue;
        const int64_t base = ((n * Hh + h) * Ls + l) * mat;
        for (int64_t i = 0; i < mat; ++i) {
          const double x = r.normal() * sd;
          s.H.set(base + i, nonneg ? std::fabs(x) : x);
        }
      }
}

StateBuffers grad_like(const StateBuffers& s) {
  StateBuffers d;
  const std::pair<const Buffer*, Buffer*> parts[] = {{&s.S, &d.S}, {&s.P, &d.P}, {&s.H, &d.H}};
  for (auto [src, dst] : parts)
    if (!src->empty()) *dst = Buffer(src->dtype, src->shape);
  return d;
}

Buffer alloc_like(const Buffer& b) { return b.empty() ? Buffer{} : Buffer(b.dtype, b.shape); }

}  // namespace

uint16_t to_bf16(double x) { return encode_small(x, 7, 8); }
uint16_t to_f16(double x) { return encode_small(x, 10, 5); }
double from_bf16(uint16_t b) { return decode_small(b, 7, 8); }
double from_f16(uint16_t b) { return decode_small(b, 10, 5); }

DType state_dtype(DType dt) { return dt == DType::f64 ? DType::f64 : DType::f32; }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

// ----------------------------------------------------------------------------------------------
// Buffer

Buffer::Buffer(DType dt, std::vector<int64_t> shp) : dtype(dt), shape(std::move(shp)) {
  for (int64_t s : shape)
    if (s < 0) throw std::invalid_argument("Buffer: negative dimension in " + shape_str(shape));
  const int64_t n = checked_bytes(shape, dt);
  if (n < 0) throw Error("shape", "a buffer of shape " + shape_str(shape) + " has more bytes than int64 can count");
  check_memory("shape", n, "a buffer of shape " + shape_str(shape));
  bytes.assign(size_t(n), 0);
}

int64_t Buffer::numel() const { return product(shape); }

TensorView Buffer::view() const {
  if (empty()) return TensorView{};
  // A zero-element tensor still gets a non-null pointer: a null data pointer reads as "absent"
  // in some checks, and nothing is ever accessed through it.
  alignas(64) static unsigned char dummy[64];
  void* p = bytes.empty() ? static_cast<void*>(dummy)
                          : static_cast<void*>(const_cast<unsigned char*>(bytes.data()));
  return TensorView::contiguous_view(p, dtype, shape.data(), int(shape.size()));
}

double Buffer::get(int64_t i) const {
  const unsigned char* p = bytes.data() + size_t(i) * size_t(dtype_size(dtype));
  switch (dtype) {
    case DType::f64: return load<double>(p);
    case DType::f32: return load<float>(p);
    case DType::bf16: return from_bf16(load<uint16_t>(p));
    case DType::f16: return from_f16(load<uint16_t>(p));
    case DType::i32: return load<int32_t>(p);
    case DType::i64: return double(load<int64_t>(p));
  }
  return 0;
}

void Buffer::set(int64_t i, double x) {
  unsigned char* p = bytes.data() + size_t(i) * size_t(dtype_size(dtype));
  switch (dtype) {
    case DType::f64: store<double>(p, x); break;
    case DType::f32: store<float>(p, float(x)); break;
    case DType::bf16: store<uint16_t>(p, to_bf16(x)); break;
    case DType::f16: store<uint16_t>(p, to_f16(x)); break;
    case DType::i32: store<int32_t>(p, to_int<int32_t>(x)); break;
    case DType::i64: store<int64_t>(p, to_int<int64_t>(x)); break;
  }
}

std::vector<double> Buffer::to_double() const {
  std::vector<double> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[size_t(i)] = get(i);
  return out;
}

void Buffer::fill(double x) {
  for (int64_t i = 0; i < numel(); ++i) set(i, x);
}

void Buffer::poison() {
  switch (dtype) {
    case DType::i32: fill(double(std::numeric_limits<int32_t>::max())); break;
    case DType::i64:
      for (int64_t i = 0; i < numel(); ++i)
        store<int64_t>(bytes.data() + 8 * i, std::numeric_limits<int64_t>::max());
      break;
    default: fill(std::numeric_limits<double>::quiet_NaN());
  }
}

Buffer Buffer::cast(DType dt) const {
  if (empty()) return Buffer{};
  if (dt == dtype) return *this;
  Buffer out(dt, shape);
  if (dtype == DType::i64 && dt == DType::i32) {  // exact, no trip through double
    for (int64_t i = 0; i < numel(); ++i)
      store<int32_t>(out.bytes.data() + 4 * i, int32_t(load<int64_t>(bytes.data() + 8 * i)));
    return out;
  }
  if (dt == DType::i64 && dtype == DType::i32) {
    for (int64_t i = 0; i < numel(); ++i)
      store<int64_t>(out.bytes.data() + 8 * i, load<int32_t>(bytes.data() + 4 * i));
    return out;
  }
  for (int64_t i = 0; i < numel(); ++i) out.set(i, get(i));
  return out;
}

// ----------------------------------------------------------------------------------------------
// States

StateView StateBuffers::view() const { return StateView{pos.view(), S.view(), P.view(), H.view()}; }

void StateBuffers::poison() {
  for (Buffer* b : {&pos, &S, &P, &H}) b->poison();
}

StateBuffers StateBuffers::cast(DType dt) const {
  return StateBuffers{pos, S.cast(dt), P.cast(dt), H.cast(dt)};
}

StateBuffers make_state(const OpConfig& cfg, int64_t N, int64_t H, int64_t dk, int64_t dv,
                        int64_t max_pos, DType dt) {
  const StateShape sh = state_shape(cfg, N, H, dk, dv, max_pos);
  StateBuffers s;
  s.pos = Buffer(DType::i64, {N});
  if (sh.S) s.S = Buffer(dt, sh.S_shape);
  if (sh.P) s.P = Buffer(dt, sh.P_shape);
  if (sh.H) s.H = Buffer(dt, sh.H_shape);
  return s;
}

// ----------------------------------------------------------------------------------------------
// Problem

int64_t Problem::num_seqs() const {
  return spec.seqlens.empty() ? spec.B : int64_t(spec.seqlens.size());
}

int64_t Problem::seq_len(int64_t i) const {
  return spec.seqlens.empty() ? spec.T : spec.seqlens[size_t(i)];
}

int64_t Problem::start_pos(int64_t i) const {
  if (!spec.init_state || spec.init_pos.empty()) return 0;
  return spec.init_pos.size() == 1 ? spec.init_pos[0] : spec.init_pos[size_t(i)];
}

int64_t Problem::max_final_pos() const {
  auto end_of = [](int64_t n0, int64_t len) {
    int64_t end;  // saturate: hila rejects overflowing positions with a clear message
    return __builtin_add_overflow(n0, len, &end) ? std::numeric_limits<int64_t>::max() : end;
  };
  if (num_seqs() <= 0) return 0;
  if (spec.seqlens.empty()) {  // B sequences of T tokens: O(1) in B (B may be 2^61 with T = 0)
    int64_t n0 = 0;
    if (spec.init_state)
      for (int64_t x : spec.init_pos) n0 = std::max(n0, x);
    return end_of(n0, spec.T);
  }
  int64_t m = 0;
  for (int64_t i = 0; i < num_seqs(); ++i) m = std::max(m, end_of(start_pos(i), seq_len(i)));
  return m;
}

ForwardParams Problem::forward_params(Form form, int64_t chunk) const {
  ForwardParams fp;
  fp.cfg = spec.cfg;
  fp.form = form;
  fp.chunk = chunk;
  fp.q = q.view();
  fp.k = k.view();
  fp.v = v.view();
  fp.g = g.view();
  fp.lam = lam.view();
  fp.beta = beta.view();
  fp.cu_seqlens = cu_seqlens.view();
  fp.init = init.view();
  return fp;
}

Problem make_problem(const ProblemSpec& s) {
  Problem p;
  p.spec = s;
  ProblemSpec& sp = p.spec;
  const OpTraits tr = op_traits(sp.cfg.op);
  const bool varlen = !sp.seqlens.empty();
  if (varlen) {
    if (sp.B != 1) throw Error("spec", "varlen problems need B == 1, got " + std::to_string(sp.B));
    sp.T = 0;
    for (int64_t n : sp.seqlens) sp.T += n;
  }
  const int64_t N = p.num_seqs();
  if (sp.init_state && !(sp.init_pos.empty() || sp.init_pos.size() == 1 ||
                         int64_t(sp.init_pos.size()) == N))
    throw Error("spec", "init_pos needs 1 or " + std::to_string(N) + " entries, got " +
                            std::to_string(sp.init_pos.size()));

  const DType dt = sp.dtype, gdt = dt == DType::f64 ? DType::f64 : DType::f32;
  const DType sdt = p.state_dtype();
  const int64_t B = sp.B, T = sp.T, G = sp.G, Hh = sp.H, dk = sp.dk, dv = sp.dv;
  Rng r(sp.seed);
  const double qk_sd = 1.0 / std::sqrt(double(std::max<int64_t>(dk, 1)));

  p.q = Buffer(dt, {B, T, G, dk});
  p.k = Buffer(dt, {B, T, G, dk});
  p.v = Buffer(dt, {B, T, Hh, dv});
  fill_normal(p.q, r, qk_sd, sp.nonneg);
  fill_normal(p.k, r, qk_sd, sp.nonneg);
  fill_normal(p.v, r, 1.0, false);
  if (sp.gated) {
    if (sp.cfg.gates == Gates::untied)
      p.g = Buffer(gdt, {B, T, Hh, int64_t(tr.num_primitives)});
    else
      p.g = Buffer(gdt, {B, T, Hh});
    fill_uniform(p.g, r, std::log(0.75), 0.0);
  }
  if (tr.loglinear) {
    int64_t L = 0;
    for (int64_t i = 0; i < N; ++i)
      if (p.seq_len(i) > 0) L = std::max(L, levels_needed(p.start_pos(i), p.seq_len(i)));
    p.lam = Buffer(dt, {B, T, Hh, L + sp.extra_levels});
    if (sp.nonneg)
      fill_uniform(p.lam, r, 0.25, 1.5);
    else
      fill_uniform(p.lam, r, -0.5, 1.5);
  }
  if (tr.delta) {
    p.beta = Buffer(dt, {B, T, Hh});
    fill_uniform(p.beta, r, 0.0, 1.0);
  }
  if (varlen) {
    p.cu_seqlens = Buffer(DType::i64, {N + 1});
    int64_t acc = 0;
    p.cu_seqlens.set(0, 0);
    for (int64_t i = 0; i < N; ++i) p.cu_seqlens.set(i + 1, double(acc += sp.seqlens[size_t(i)]));
  }

  if (sp.init_state) {
    std::vector<int64_t> pos(static_cast<size_t>(N));
    int64_t max_pos = 0;
    for (int64_t i = 0; i < N; ++i) max_pos = std::max(max_pos, pos[size_t(i)] = p.start_pos(i));
    // state_shape at position n gives bitlen(n) + 1 slots; for extra capacity ask for the shape
    // at a position whose bit length is larger by init_extra_slots.
    int64_t cap_pos = max_pos;
    if (tr.loglinear && sp.init_extra_slots > 0) {
      const int bits = int(std::bit_width(uint64_t(max_pos)) + sp.init_extra_slots);
      cap_pos = std::max<int64_t>(max_pos, int64_t(1) << (bits - 1));
    }
    p.init = make_state(sp.cfg, N, Hh, dk, dv, cap_pos, sdt);
    for (int64_t i = 0; i < N; ++i) p.init.pos.set(i, double(pos[size_t(i)]));
    fill_state(p.init, pos, tr.loglinear, r, 0.5, sp.nonneg);
  }

  p.d_o = Buffer(dt, {B, T, Hh, dv});
  fill_normal(p.d_o, r, 1.0, false);

  {
    std::vector<int64_t> pos(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) pos[size_t(i)] = p.start_pos(i) + p.seq_len(i);
    p.d_final = make_state(sp.cfg, N, Hh, dk, dv, p.max_final_pos(), sdt);
    p.d_final.pos = Buffer{};
    fill_state(p.d_final, pos, tr.loglinear, r, 1.0, false);
  }
  return p;
}

Problem cast_problem(const Problem& p, DType dt) {
  Problem c = p;
  c.spec.dtype = dt;
  const DType gdt = dt == DType::f64 ? DType::f64 : DType::f32, sdt = state_dtype(dt);
  for (Buffer* b : {&c.q, &c.k, &c.v, &c.lam, &c.beta, &c.d_o}) *b = b->cast(dt);
  c.g = c.g.cast(gdt);
  c.init = c.init.cast(sdt);
  c.d_final = c.d_final.cast(sdt);
  return c;
}

namespace {
int64_t row_elems(const Buffer& b) {  // elements per token: product of the dims after [B, T]
  int64_t n = 1;
  for (size_t i = 2; i < b.shape.size(); ++i) n *= b.shape[i];
  return n;
}
void check_time_range(const Buffer& b, int64_t t0, int64_t len, const char* who) {
  if (b.shape.size() < 2 || t0 < 0 || len < 0 || t0 + len > b.shape[1])
    throw std::out_of_range(std::string(who) + ": tokens [" + std::to_string(t0) + ", " +
                            std::to_string(t0 + len) + ") outside a buffer of shape " + shape_str(b.shape));
}
}  // namespace

Buffer slice_time(const Buffer& b, int64_t t0, int64_t len) {
  if (b.empty()) return Buffer{};
  check_time_range(b, t0, len, "slice_time");
  std::vector<int64_t> shape = b.shape;
  shape[1] = len;
  Buffer out(b.dtype, shape);
  const size_t row = size_t(row_elems(b)) * size_t(dtype_size(b.dtype));
  for (int64_t i = 0; i < b.shape[0]; ++i)
    if (len > 0)
      std::memcpy(out.bytes.data() + size_t(i * len) * row,
                  b.bytes.data() + size_t(i * b.shape[1] + t0) * row, size_t(len) * row);
  return out;
}

TensorView time_view(const Buffer& b, int64_t t0, int64_t len) {
  if (b.empty()) return TensorView{};
  check_time_range(b, t0, len, "time_view");
  if (b.shape[0] != 1) throw std::invalid_argument("time_view: needs B == 1, got " + shape_str(b.shape));
  std::vector<int64_t> shape = b.shape;
  shape[1] = len;
  auto* p = const_cast<unsigned char*>(b.bytes.data()) + size_t(t0 * row_elems(b)) * size_t(dtype_size(b.dtype));
  return TensorView::contiguous_view(p, b.dtype, shape.data(), int(shape.size()));
}

TensorView token_view(const Buffer& b, int64_t t) {
  if (b.empty()) return TensorView{};
  check_time_range(b, t, 1, "token_view");
  if (b.shape[0] != 1) throw std::invalid_argument("token_view: needs B == 1, got " + shape_str(b.shape));
  std::vector<int64_t> shape = b.shape;
  shape.erase(shape.begin() + 1);
  auto* p = const_cast<unsigned char*>(b.bytes.data()) + size_t(t * row_elems(b)) * size_t(dtype_size(b.dtype));
  return TensorView::contiguous_view(p, b.dtype, shape.data(), int(shape.size()));
}

Problem prefix(const Problem& p, int64_t T) {
  if (!p.spec.seqlens.empty()) throw std::invalid_argument("prefix: varlen problems are not supported");
  Problem c;
  c.spec = p.spec;
  c.spec.T = T;
  c.q = slice_time(p.q, 0, T);
  c.k = slice_time(p.k, 0, T);
  c.v = slice_time(p.v, 0, T);
  c.g = slice_time(p.g, 0, T);
  c.lam = slice_time(p.lam, 0, T);
  c.beta = slice_time(p.beta, 0, T);
  c.d_o = slice_time(p.d_o, 0, T);
  c.init = p.init;
  const ProblemSpec& s = c.spec;
  c.d_final = make_state(s.cfg, c.num_seqs(), s.H, s.dk, s.dv, c.max_final_pos(), c.state_dtype());
  c.d_final.pos = Buffer{};
  return c;
}

Buffer copy_view(const TensorView& v) {
  if (!v.defined()) return Buffer{};
  if (v.device.type != DeviceType::cpu) throw std::invalid_argument("copy_view: not a host tensor");
  Buffer out(v.dtype, std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.ndim));
  const int64_t n = out.numel(), es = dtype_size(v.dtype);
  std::array<int64_t, kMaxDims> idx{};
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < v.ndim; ++d) off += idx[size_t(d)] * v.stride[size_t(d)];
    std::memcpy(out.bytes.data() + i * es, static_cast<const unsigned char*>(v.data) + off * es, size_t(es));
    for (int d = v.ndim - 1; d >= 0; --d) {  // row-major odometer
      if (++idx[size_t(d)] < v.shape[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
  return out;
}

StateBuffers copy_state(const StateView& s) {
  return StateBuffers{copy_view(s.pos), copy_view(s.S), copy_view(s.P), copy_view(s.H)};
}

StateBuffers with_slots(const StateBuffers& s, int64_t Ls) {
  StateBuffers out = s;
  if (s.H.shape.size() != 5 || s.H.shape[2] == Ls) return out;
  const auto& sh = s.H.shape;
  out.H = Buffer(s.H.dtype, {sh[0], sh[1], Ls, sh[3], sh[4]});
  const size_t mat = size_t(sh[3] * sh[4]) * size_t(dtype_size(s.H.dtype));
  const int64_t keep = std::min(Ls, sh[2]);
  for (int64_t nh = 0; nh < sh[0] * sh[1]; ++nh)
    std::memcpy(out.H.bytes.data() + size_t(nh * Ls) * mat, s.H.bytes.data() + size_t(nh * sh[2]) * mat,
                size_t(keep) * mat);
  return out;
}

int64_t state_bytes(const OpConfig& cfg, int64_t H, int64_t dk, int64_t dv, int64_t max_pos, DType dt) {
  const StateShape sh = state_shape(cfg, 1, H, dk, dv, max_pos);
  int64_t elems = 0;
  for (const auto* part : {&sh.S_shape, &sh.P_shape, &sh.H_shape})
    if (!part->empty()) elems += product(*part);
  return elems * dtype_size(dt) + int64_t(sizeof(int64_t));
}

// ----------------------------------------------------------------------------------------------
// Memory

void check_memory(const std::string& name, int64_t bytes, const std::string& what) {
  const int64_t limit = hila::memory_limit();
  if (bytes > limit)
    throw Error(name, "needs " + std::to_string(bytes) + " bytes of host memory for " + what + ", more than the " +
                          std::to_string(limit) + " bytes hila may take (the machine's memory, --max-memory, "
                          "HILA_MAX_MEMORY or hila::set_memory_limit)");
}

void check_output_memory(const Problem& p, bool backward) {
  struct Item {
    std::string name;
    std::vector<int64_t> shape;
    DType dt;
  };
  const ProblemSpec& s = p.spec;
  const int64_t N = p.num_seqs();
  std::vector<Item> items = {{"o", {s.B, s.T, s.H, s.dv}, s.dtype}, {"final_state.pos", {N}, DType::i64}};
  const StateShape sh = state_shape(s.cfg, N, s.H, s.dk, s.dv, p.max_final_pos());
  const DType sdt = p.state_dtype();
  if (sh.S) items.push_back({"final_state.S", sh.S_shape, sdt});
  if (sh.P) items.push_back({"final_state.P", sh.P_shape, sdt});
  if (sh.H) items.push_back({"final_state.H", sh.H_shape, sdt});
  if (backward) {
    const std::pair<const char*, const Buffer*> like[] = {
        {"dq", &p.q},   {"dk", &p.k},         {"dv", &p.v},         {"dg", &p.g},        {"dlam", &p.lam},
        {"dbeta", &p.beta}, {"d_init.S", &p.init.S}, {"d_init.P", &p.init.P}, {"d_init.H", &p.init.H}};
    for (const auto& [name, b] : like)
      if (!b->empty()) items.push_back({name, b->shape, b->dtype});
  }
  int64_t total = 0;  // what the call holds: its inputs, then the outputs to allocate
  for (const Buffer* b : {&p.q, &p.k, &p.v, &p.g, &p.lam, &p.beta, &p.cu_seqlens, &p.d_o, &p.init.pos, &p.init.S,
                          &p.init.P, &p.init.H, &p.d_final.S, &p.d_final.P, &p.d_final.H})
    total += int64_t(b->bytes.size());
  const Item* largest = nullptr;
  int64_t largest_bytes = -1;
  for (const Item& it : items) {
    const int64_t b = checked_bytes(it.shape, it.dt);
    if (b < 0 || __builtin_add_overflow(total, b, &total))
      throw Error(it.name, "an output of shape " + shape_str(it.shape) + " of " + dtype_name(it.dt) +
                               " has more bytes than int64 can count");
    if (b > largest_bytes) largest = &it, largest_bytes = b;
  }
  if (largest)
    check_memory(largest->name, total,
                 "the call's inputs and outputs (the largest output: " + largest->name + " " +
                     shape_str(largest->shape) + " of " + dtype_name(largest->dt) + ", " +
                     std::to_string(largest_bytes) + " bytes)");
}

// ----------------------------------------------------------------------------------------------
// Calls

namespace {

Result alloc_forward(const Problem& p) {
  check_output_memory(p, false);
  Result r;
  const ProblemSpec& s = p.spec;
  r.o = Buffer(s.dtype, {s.B, s.T, s.H, s.dv});
  r.o.poison();
  r.final_state = make_state(s.cfg, p.num_seqs(), s.H, s.dk, s.dv, p.max_final_pos(), p.state_dtype());
  r.final_state.poison();
  return r;
}

}  // namespace

Result run_forward(const Problem& p, Form form, int64_t chunk, Device dev, Temporaries tmp) {
  Result r = alloc_forward(p);
  ForwardParams fp = p.forward_params(form, chunk);
  fp.o = r.o.view();
  fp.final_state = r.final_state.view();
  forward_on(fp, dev, tmp);
  return r;
}

Result run_backward(const Problem& p, Form form, int64_t chunk, Device dev, Temporaries tmp) {
  check_output_memory(p, true);
  Result r = run_forward(p, form, chunk, dev, tmp);
  BackwardParams bp;
  static_cast<ForwardParams&>(bp) = p.forward_params(form, chunk);
  bp.o = r.o.view();
  bp.final_state = r.final_state.view();
  bp.d_o = p.d_o.view();
  bp.d_final = p.d_final.view();
  r.dq = alloc_like(p.q);
  r.dk = alloc_like(p.k);
  r.dv = alloc_like(p.v);
  r.dg = alloc_like(p.g);
  r.dlam = alloc_like(p.lam);
  r.dbeta = alloc_like(p.beta);
  r.d_init = grad_like(p.init);
  for (Buffer* b : {&r.dq, &r.dk, &r.dv, &r.dg, &r.dlam, &r.dbeta}) b->poison();
  r.d_init.poison();
  bp.dq = r.dq.view();
  bp.dk = r.dk.view();
  bp.dv = r.dv.view();
  bp.dg = r.dg.view();
  bp.dlam = r.dlam.view();
  bp.dbeta = r.dbeta.view();
  bp.d_init = r.d_init.view();
  backward_on(bp, dev, tmp);
  return r;
}

// ----------------------------------------------------------------------------------------------
// Comparison

double rel_err(const Buffer& a, const Buffer& b, double floor) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  if (a.empty() && b.empty()) return 0;
  if (a.shape != b.shape) return inf;
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.get(i), y = b.get(i);
    if (!std::isfinite(x) || !std::isfinite(y)) return inf;
    diff = std::max(diff, std::fabs(x - y));
    ref = std::max(ref, std::fabs(y));
  }
  return diff / std::max({ref, floor, 1e-300});
}

namespace {
// Positions are exact: 0 when equal (or both absent), +inf otherwise.
double pos_err(const Buffer& a, const Buffer& b) {
  if (a.empty() && b.empty()) return 0;
  const bool same = a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes;
  return same ? 0 : std::numeric_limits<double>::infinity();
}
}  // namespace

double rel_err(const StateBuffers& a, const StateBuffers& b) {
  return std::max({pos_err(a.pos, b.pos), rel_err(a.S, b.S), rel_err(a.P, b.P), rel_err(a.H, b.H)});
}

namespace {
double max_abs(const Buffer& b) {
  double m = 0;
  for (int64_t i = 0; i < b.numel(); ++i) m = std::max(m, std::fabs(b.get(i)));
  return m;
}
}  // namespace

std::vector<std::pair<std::string, double>> compare(const Result& a, const Result& b, double grad_floor) {
  std::vector<std::pair<std::string, double>> out;
  auto add = [&](const char* name, const Buffer& x, const Buffer& y, double floor = 0) {
    if (!x.empty() || !y.empty()) out.emplace_back(name, rel_err(x, y, floor));
  };
  const Buffer* grads[] = {&b.dq, &b.dk, &b.dv, &b.dg, &b.dlam, &b.dbeta, &b.d_init.S, &b.d_init.P, &b.d_init.H};
  double gmax = 0;
  if (grad_floor > 0)
    for (const Buffer* g : grads) gmax = std::max(gmax, max_abs(*g));
  const double gf = grad_floor * gmax;
  add("o", a.o, b.o);
  add("dq", a.dq, b.dq, gf);
  add("dk", a.dk, b.dk, gf);
  add("dv", a.dv, b.dv, gf);
  add("dg", a.dg, b.dg, gf);
  add("dlam", a.dlam, b.dlam, gf);
  add("dbeta", a.dbeta, b.dbeta, gf);
  if (!a.final_state.empty() || !b.final_state.empty()) {
    // pos first: a wrong position makes the float parts meaningless.
    out.emplace_back("final.pos", pos_err(a.final_state.pos, b.final_state.pos));
    add("final.S", a.final_state.S, b.final_state.S);
    add("final.P", a.final_state.P, b.final_state.P);
    add("final.H", a.final_state.H, b.final_state.H);
  }
  add("d_init.S", a.d_init.S, b.d_init.S, gf);
  add("d_init.P", a.d_init.P, b.d_init.P, gf);
  add("d_init.H", a.d_init.H, b.d_init.H, gf);
  return out;
}

double rel_err(const Result& a, const Result& b, double grad_floor) {
  double m = 0;
  for (const auto& [name, e] : compare(a, b, grad_floor)) m = std::max(m, e);
  return m;
}

}  // namespace hila::tools
