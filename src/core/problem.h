// SPDX-License-Identifier: Apache-2.0
// A validated call: what the backends receive after src/core/validate.cpp has checked it.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "hila/error.h"

#include "hila/ops.h"

namespace hila::detail {

// Positions are at most 2^62: a call over n0 .. n0+T-1 needs n0 + T <= kMaxPosition, a state at
// position n can be stepped while n < kMaxPosition (same bound for forward, load and step).
constexpr int64_t kMaxPosition = int64_t(1) << 62;

// Overflow-checked sizes. mul/add return false on overflow (result unspecified then).
inline bool mul_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
inline bool add_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }
// Product of sizes (all >= 0) or -1 when it does not fit in int64.
int64_t checked_product(std::initializer_list<int64_t> sizes);
// Entries dk(dk+1)/2 of a packed symmetric [dk, dk] matrix, or -1 when that overflows int64.
inline int64_t packed_size(int64_t dk) {
  int64_t n;
  if (dk < 0 || !mul_ok(dk, dk + 1, &n)) return -1;
  return n / 2;
}
// Bytes a tensor of these sizes addresses, as numpy counts them: the product of max(size, 1) times
// the element size must fit in int64 even when some size is 0 (else the tensor cannot be created
// or loaded by numpy). Throws hila::Error(name) when it does not.
void check_extent(const std::string& name, const TensorView& t);

// Host memory hila may take for one call (bytes): see hila::memory_limit().
int64_t host_memory_limit();
// Throws hila::Error(arg, ...) when `bytes` (a double: estimates saturate instead of wrapping)
// exceed host_memory_limit(). `what` names the memory ("the [T, T] matrices of the naive form").
void check_host_bytes(const std::string& arg, double bytes, const std::string& what);
// Runs f, turning an allocation failure (std::bad_alloc, std::length_error) into hila::Error(arg).
template <class F>
auto with_memory_errors(const std::string& arg, const std::string& what, F&& f) -> decltype(f());

struct SeqInfo {
  int64_t b = 0, row0 = 0, len = 0;  // batch index, first row along T, number of rows
  int64_t n0 = 0;                    // absolute position of the first row (initial state pos)
};

struct Resolved {
  OpConfig cfg;
  OpTraits traits{};
  Form form = Form::chunk;
  int64_t chunk = 64;
  int64_t B = 0, T = 0, G = 0, H = 0, dk = 0, dv = 0, dvp = 0, nL = 0;
  int gate_cols = 0;        // 0: no g; 1: tied [B,T,H]; P: untied [B,T,H,P]
  double scale = 1.0;
  bool f64 = false;         // compute in float64 (float64 inputs, or the naive form)
  std::vector<SeqInfo> seqs;
  bool has_init = false;
};

Resolved resolve_forward(const ForwardParams& p);
Resolved resolve_backward(const BackwardParams& p);
Resolved resolve_step(const StepParams& p, const DecodeState& st);
// The functional step on a caller-owned state: also checks the state (shapes, dtypes, device,
// Fenwick slots for pos + 1).
Resolved resolve_step(const StepParams& p, const StateView& state);
// Validate a state against an op's layout for N sequences (name: "init", "d_final", ...).
// want_pos: check pos; canonical: check dead Fenwick slots are zero (value checks on).
void check_state(const char* name, const StateView& s, const OpConfig& cfg, int64_t N, int64_t H,
                 int64_t dk, int64_t dv, const std::vector<int64_t>* positions, bool want_pos,
                 bool values, Device dev);
std::vector<int64_t> read_positions(const TensorView& pos);
// With check_values on: every output finite, else hila::Error naming the output and the likely
// cause (a divergent delta rule, magnitudes or scale beyond the compute precision, a normalize
// denominator at zero). Host tensors; the CPU backend runs them after each call.
void check_forward_outputs(const Resolved& r, const ForwardParams& p);
void check_backward_outputs(const Resolved& r, const BackwardParams& p);
void check_step_outputs(const Resolved& r, const StepParams& p);

[[noreturn]] void fail_allocation(const std::string& arg, const std::string& what, const char* why);

template <class F>
auto with_memory_errors(const std::string& arg, const std::string& what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::bad_alloc& e) {
    fail_allocation(arg, what, e.what());
  } catch (const std::length_error& e) {
    fail_allocation(arg, what, e.what());
  }
}

}  // namespace hila::detail
