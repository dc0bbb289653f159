// SPDX-License-Identifier: Apache-2.0
// A validated call: what the backends receive after src/core/validate.cpp has checked it.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
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
void check_extent(const char* name, const TensorView& t);

// Host memory hila may take for one call (bytes): see hila::memory_limit().
int64_t host_memory_limit();
// The limit a caller configured (hila::set_memory_limit, HILA_MAX_MEMORY), or 0 when none: what
// bounds a call's device memory besides the device's own.
int64_t configured_memory_limit();
// "1234 bytes (1.2 KiB)"
std::string bytes_str(double bytes);
// Throws hila::Error(arg, ...) when `bytes` (a double: estimates saturate instead of wrapping)
// exceed host_memory_limit(). `what` names the memory ("the [T, T] matrices of the naive form");
// `what_fn` builds it only on failure.
void check_host_bytes(const std::string& arg, double bytes, const std::string& what);
template <class W>
inline void check_host_bytes_lazy(const char* arg, double bytes, W&& what_fn) {
  if (bytes > double(host_memory_limit())) check_host_bytes(arg, bytes, what_fn());
}
// Runs f, turning an allocation failure (std::bad_alloc, std::length_error) into hila::Error(arg);
// `what` (a string, or a callable returning one, called only on failure) names the memory.
template <class W, class F>
auto with_memory_errors(const char* arg, W&& what, F&& f) -> decltype(f());

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
  // Serving pools (state_indices): the pool's rows P and, where the host knows them
  // (CPU, or read on a checked call), the row of every sequence (-1: padding); empty otherwise.
  bool pooled = false;
  int64_t pool_rows = 0;
  std::vector<int64_t> rows;
  // Step: whether seqs[i].n0 are the positions (a CUDA step with max_position reads none), and the
  // caller's bound that the kernel enforces then (-1: none).
  bool positions_known = true;
  int64_t max_position = -1;
  // The pool row of sequence i (its own index without a pool); requires rows to be known.
  int64_t row(size_t i) const { return pooled ? rows[i] : int64_t(i); }
};

Resolved resolve_forward(const ForwardParams& p);
Resolved resolve_backward(const BackwardParams& p);
Resolved resolve_step(const StepParams& p, const DecodeState& st);
// The functional step on a caller-owned state: also checks the state (shapes, dtypes, device,
// Fenwick slots for pos + 1).
Resolved resolve_step(const StepParams& p, const StateView& state);
// Validate a state against an op's layout for N sequences (name: "init", "state", ...). Reads
// nothing itself: `positions` (read by the caller, or nullptr) are checked against [0, 2^62] and
// the Fenwick slots they need. want_pos: check pos; values: finite parts whose dead Fenwick slots
// are zero (canonical).
void check_state(const char* name, const StateView& s, const OpConfig& cfg, int64_t N, int64_t H,
                 int64_t dk, int64_t dv, const std::vector<int64_t>* positions, bool want_pos,
                 bool values, Device dev);
std::vector<int64_t> read_positions(const TensorView& pos);
// With check_values on: every output finite, else hila::Error naming the output and the likely
// cause (a divergent delta rule, magnitudes or scale beyond the compute precision, a normalize
// denominator at zero). Host tensors; the CPU backend runs them after each call. A step checks o and
// the state it wrote (all of it, or its rows of a pool).
void check_forward_outputs(const Resolved& r, const ForwardParams& p);
void check_backward_outputs(const Resolved& r, const BackwardParams& p);
void check_step_outputs(const Resolved& r, const StepParams& p, const StateView& state);

[[noreturn]] void fail_allocation(const std::string& arg, const std::string& what, const char* why);

template <class W>
std::string describe(W&& what) {
  if constexpr (std::is_invocable_v<W>) return std::string(what());
  else return std::string(what);
}

template <class W, class F>
auto with_memory_errors(const char* arg, W&& what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::bad_alloc& e) {
    fail_allocation(arg, describe(what), e.what());
  } catch (const std::length_error& e) {
    fail_allocation(arg, describe(what), e.what());
  }
}

}  // namespace hila::detail
