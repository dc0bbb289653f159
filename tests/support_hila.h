// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the GoogleTest suite: tolerances, readable names, result comparison and
// state slicing. Problems, buffers and calls come from tools/problem.h.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "hila/hila.h"
#include "problem.h"

namespace hila_test {

using hila::DType;
using hila::Form;
using hila::Gates;
using hila::Op;
using hila::OpConfig;
using hila::tools::Buffer;
using hila::tools::Problem;
using hila::tools::ProblemSpec;
using hila::tools::Result;
using hila::tools::StateBuffers;
using hila::tools::copy_state;
using hila::tools::with_slots;

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// Relative-error bounds against the float64 naive form (max-norm, relative to max |reference|).
inline double fwd_tol(DType dt) {
  switch (dt) {
    case DType::f64: return 1e-10;
    case DType::f32: return 1e-4;
    case DType::f16: return 3e-3;  // output rounding 2^-11 plus input/fp32 compute noise
    default: return 1e-2;          // bf16
  }
}
// Step params over host buffers (absent buffers give absent views).
inline hila::StepParams step_params(const OpConfig& cfg, const Buffer& q, const Buffer& k, const Buffer& v,
                                    const Buffer& g, const Buffer& lam, const Buffer& beta, const Buffer& o) {
  hila::StepParams sp;
  sp.cfg = cfg;
  sp.q = q.view(), sp.k = k.view(), sp.v = v.view(), sp.g = g.view();
  sp.lam = lam.view(), sp.beta = beta.view(), sp.o = o.view();
  return sp;
}

inline double bwd_tol(DType dt) { return dt == DType::f64 ? 1e-9 : fwd_tol(dt); }
// Floor for gradient comparisons (see expect_results_close): rounding noise of a zero tensor,
// about eps(dt) x largest gradient, stays well inside the bound.
inline double grad_floor(DType dt) { return dt == DType::f64 ? 1e-4 : 1e-2; }

inline std::string dtype_tag(DType dt) {
  switch (dt) {
    case DType::f64: return "f64";
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "dt";
}

inline hila::OpTraits traits(Op op) { return hila::op_traits(op); }
inline bool has_gdn_norm(Op op) { return traits(op).delta; }
inline bool takes_ridge(Op op) { return op == Op::hla2 || op == Op::loglinear_hla2; }

// Every buffer of compare(got, ref) within its bound: forward quantities (o, final.*) within
// tf, gradients (names starting with 'd') within tb. NaN anywhere gives +inf and fails.
// Gradients are measured against max(|reference tensor|, grad_floor x largest reference gradient),
// so a gradient that is exactly zero in exact arithmetic (dg at T = 1) is not judged on its
// rounding noise alone.
inline void expect_results_close(const Result& got, const Result& ref, double tf, double tb,
                                 const std::string& ctx, double grad_floor = 1e-4) {
  for (const auto& [name, err] : hila::tools::compare(got, ref, grad_floor)) {
    const double tol = name[0] == 'd' ? tb : tf;
    EXPECT_LE(err, tol) << ctx << ": " << name << " relative error " << err;
  }
}

inline double max_abs(const Buffer& b) {
  double m = 0;
  for (int64_t i = 0; i < b.numel(); ++i) m = std::max(m, std::fabs(b.get(i)));
  return m;
}

// rel_err(got, ref, floor) within tol; floor as in hila::tools::rel_err.
inline void expect_buffer_close(const Buffer& got, const Buffer& ref, double tol,
                                const std::string& ctx, double floor = 0) {
  const double err = hila::tools::rel_err(got, ref, floor);
  EXPECT_LE(err, tol) << ctx << " relative error " << err << " (shapes "
                      << hila::tools::shape_str(got.shape) << " vs "
                      << hila::tools::shape_str(ref.shape) << ")";
}

// ---------------------------------------------------------------------------------------------
// Buffers along their first dimension (state rows: one per sequence).

inline Buffer slice_rows(const Buffer& b, int64_t r0, int64_t n) {
  if (b.empty()) return Buffer{};
  std::vector<int64_t> shape = b.shape;
  shape[0] = n;
  Buffer out(b.dtype, shape);
  const size_t row = out.numel() == 0 ? 0 : out.bytes.size() / size_t(n);
  if (n > 0) std::memcpy(out.bytes.data(), b.bytes.data() + size_t(r0) * row, size_t(n) * row);
  return out;
}

// A log-linear H [N, H, Ls, dk, dv'] with its slot axis resized to Ls (zero-padded or cut).
// Returns false through `lossless` when a cut slot held a non-zero entry.
inline Buffer resize_slots(const Buffer& h, int64_t Ls, bool* lossless = nullptr) {
  if (h.empty() || h.shape.size() != 5) return h;
  std::vector<int64_t> shape = h.shape;
  const int64_t L0 = shape[2];
  shape[2] = Ls;
  Buffer out(h.dtype, shape);
  const int64_t outer = shape[0] * shape[1], mat = shape[3] * shape[4];
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t l = 0; l < std::max(L0, Ls); ++l)
      for (int64_t i = 0; i < mat; ++i) {
        const double x = l < L0 ? h.get((o * L0 + l) * mat + i) : 0.0;
        if (l < Ls)
          out.set((o * Ls + l) * mat + i, x);
        else if (x != 0 && lossless)
          *lossless = false;
      }
  return out;
}

// Elements per token of a [B, T, ...] buffer.
inline int64_t token_elems(const Buffer& b) {
  int64_t n = 1;
  for (size_t i = 2; i < b.shape.size(); ++i) n *= b.shape[i];
  return n;
}

// Row b of the result = token t[b] of batch row b: [B, T, ...] -> [B, ...] (decode-step layout).
inline Buffer gather_tokens(const Buffer& b, const std::vector<int64_t>& t) {
  if (b.empty()) return Buffer{};
  std::vector<int64_t> shape = b.shape;
  shape.erase(shape.begin() + 1);
  Buffer out(b.dtype, shape);
  const int64_t e = token_elems(b), T = b.shape[1];
  const size_t es = size_t(hila::dtype_size(b.dtype));
  for (int64_t i = 0; i < b.shape[0]; ++i)
    std::memcpy(out.bytes.data() + size_t(i * e) * es,
                b.bytes.data() + size_t((i * T + t[size_t(i)]) * e) * es, size_t(e) * es);
  return out;
}

// Concatenation of B == 1 buffers along T.
inline Buffer concat_time(const std::vector<Buffer>& parts) {
  if (parts.empty() || parts[0].empty()) return Buffer{};
  std::vector<int64_t> shape = parts[0].shape;
  shape[1] = 0;
  for (const Buffer& p : parts) shape[1] += p.shape[1];
  Buffer out(parts[0].dtype, shape);
  size_t off = 0;
  for (const Buffer& p : parts) {
    if (!p.bytes.empty()) std::memcpy(out.bytes.data() + off, p.bytes.data(), p.bytes.size());
    off += p.bytes.size();
  }
  return out;
}

inline StateBuffers state_row(const StateBuffers& s, int64_t i) {
  return StateBuffers{slice_rows(s.pos, i, 1), slice_rows(s.S, i, 1), slice_rows(s.P, i, 1),
                      slice_rows(s.H, i, 1)};
}

// o and every state part equal, byte for byte.
inline bool same_bytes(const Buffer& a, const Buffer& b) { return a.shape == b.shape && a.bytes == b.bytes; }
inline bool same_state(const StateBuffers& a, const StateBuffers& b) {
  return same_bytes(a.pos, b.pos) && same_bytes(a.S, b.S) && same_bytes(a.P, b.P) && same_bytes(a.H, b.H);
}

// row r of `dst` <- row 0 of `src` (same shapes but the first dimension)
inline void put_row(Buffer& dst, int64_t r, const Buffer& src) {
  if (dst.empty()) return;
  const size_t row = dst.bytes.size() / size_t(dst.shape[0]);
  std::memcpy(dst.bytes.data() + size_t(r) * row, src.bytes.data(), row);
}
inline void put_row(StateBuffers& dst, int64_t r, const StateBuffers& src) {
  put_row(dst.pos, r, src.pos), put_row(dst.S, r, src.S), put_row(dst.P, r, src.P), put_row(dst.H, r, src.H);
}

// rel_err of two states whose Fenwick capacities may differ: common slots compared, slots present
// in one only must be zero. pos compared exactly (when present in both).
inline double state_err(const StateBuffers& got, const StateBuffers& ref) {
  StateBuffers a = got, b = ref;
  if (!a.H.empty() && !b.H.empty() && a.H.shape.size() == 5 && b.H.shape.size() == 5 &&
      a.H.shape[2] != b.H.shape[2]) {
    const int64_t L = std::max(a.H.shape[2], b.H.shape[2]);
    a.H = resize_slots(a.H, L);
    b.H = resize_slots(b.H, L);
  }
  if (a.pos.empty() || b.pos.empty()) a.pos = b.pos = Buffer{};
  return hila::tools::rel_err(a, b);
}

// Whether every entry is finite.
inline bool all_finite(const Buffer& b) {
  for (int64_t i = 0; i < b.numel(); ++i)
    if (!std::isfinite(b.get(i))) return false;
  return true;
}

inline std::string op_tag(Op op) { return hila::op_name(op); }

// A form in test names: naive, serial, chunk<C>, scan<C> (the chunk size only where it is used).
inline std::string form_tag(hila::Form form, int64_t chunk) {
  std::string f = hila::form_name(form);
  if (form == hila::Form::chunk || form == hila::Form::scan) f += std::to_string(chunk);
  return f;
}

// Base spec shared by the suites: gated, tied gates, float64, small heads.
inline ProblemSpec spec_for(Op op, int64_t T, uint64_t seed) {
  ProblemSpec s;
  s.cfg.op = op;
  s.T = T;
  s.seed = seed;
  return s;
}

// A stable seed from a test name, so every test has its own inputs.
inline uint64_t seed_of(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ uint64_t(uint8_t(c))) * 1099511628211ull;
  return h;
}

}  // namespace hila_test
