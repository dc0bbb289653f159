// SPDX-License-Identifier: Apache-2.0
// Host-side test problems for hila: owning buffers of any dtype, random operator inputs, and one
// call per form and direction. Shared by the `hila` CLI (verify, demo, run) and the GoogleTest suite.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "hila/error.h"
#include "hila/ops.h"
#include "hila/tensor.h"

namespace hila::tools {

// Owning host buffer of any hila dtype, row-major contiguous.
struct Buffer {
  DType dtype = DType::f64;
  std::vector<int64_t> shape;          // empty: absent tensor
  std::vector<unsigned char> bytes;    // numel() * dtype_size(dtype)

  Buffer() = default;
  Buffer(DType dt, std::vector<int64_t> shape);  // zero-filled

  int64_t numel() const;  // 0 when absent
  bool empty() const { return shape.empty(); }
  // Contiguous CPU view; absent -> TensorView{} (ndim -1). A const Buffer still hands out a
  // mutable pointer because hila's params structs hold inputs as plain TensorViews; the library
  // never writes through an input.
  TensorView view() const;

  // Element access with conversion: bf16/f16 round to nearest even, ints round to nearest.
  double get(int64_t i) const;
  void set(int64_t i, double x);
  std::vector<double> to_double() const;
  void fill(double x);
  void poison();  // NaN for floats, the type's max value for ints
  Buffer cast(DType dt) const;

  template <class T>
  T* data() { return reinterpret_cast<T*>(bytes.data()); }
  template <class T>
  const T* data() const { return reinterpret_cast<const T*>(bytes.data()); }
};

std::string shape_str(const std::vector<int64_t>& shape);

// bf16 / f16 bit patterns <-> double (correctly rounded from double, no double rounding).
uint16_t to_bf16(double x);
uint16_t to_f16(double x);
double from_bf16(uint16_t b);
double from_f16(uint16_t b);

// State dtype that hila uses for inputs of dtype dt: f64 for f64, f32 otherwise.
DType state_dtype(DType dt);

// Absent parts stay empty. d_final and d_init leave pos empty (the library ignores it there).
struct StateBuffers {
  Buffer pos, S, P, H;
  StateView view() const;
  bool empty() const { return pos.empty() && S.empty() && P.empty() && H.empty(); }
  void poison();
  StateBuffers cast(DType dt) const;  // float parts only; pos stays int64
};

// Zero final-state buffers for an op (hila::state_shape): pos int64 [N], float parts of dtype dt.
StateBuffers make_state(const OpConfig& cfg, int64_t N, int64_t H, int64_t dk, int64_t dv,
                        int64_t max_pos, DType dt);

struct ProblemSpec {
  OpConfig cfg;                   // op, scale, normalize, eps, ridge, gates, qk_l2norm
  int64_t B = 1, T = 16, G = 1, H = 1, dk = 8, dv = 8;
  std::vector<int64_t> seqlens;   // non-empty => varlen: B must be 1, T = sum(seqlens), cu_seqlens int64
  bool gated = true;              // g present; log-gates uniform in [log 0.75, 0]
  bool init_state = false;        // random canonical initial state per sequence
  std::vector<int64_t> init_pos;  // positions of the initial state, one per sequence or one for all;
                                  // default 0; ignored without init_state
  int64_t init_extra_slots = 0;   // log-linear init state: Fenwick capacity beyond what pos needs
  int64_t extra_levels = 0;       // lam gets levels_needed + extra_levels columns
  DType dtype = DType::f64;       // q, k, v, lam, beta, do; g is f64 for f64 inputs, else f32
  // Nonnegative q, k, initial states and lam in [0.25, 1.5]: keeps normalized-HLA denominators
  // positive (docs/math/HLA.md §4), so low-precision comparisons are meaningful.
  bool nonneg = false;
  uint64_t seed = 0;
};

struct Problem {
  ProblemSpec spec;  // spec.T is sum(seqlens) for varlen
  Buffer q, k, v, g, lam, beta, cu_seqlens, d_o;  // absent ones empty
  StateBuffers init;     // absent unless spec.init_state
  StateBuffers d_final;  // random cotangent of the final state (canonical, pos empty)

  int64_t num_seqs() const;
  int64_t seq_len(int64_t i) const;
  int64_t start_pos(int64_t i) const;  // position of sequence i's initial state (0 without one)
  int64_t max_final_pos() const;
  DType state_dtype() const { return tools::state_dtype(spec.dtype); }

  // Params for one call over this problem's inputs; outputs are left undefined.
  ForwardParams forward_params(Form form, int64_t chunk) const;
};

// Fresh random inputs (deterministic in spec.seed; values do not depend on spec.dtype beyond
// rounding): q, k ~ N(0,1)/sqrt(dk) (rows of about unit norm), v ~ N(0,1), lam in [-0.5, 1.5],
// beta in [0, 1], do ~ N(0,1). Initial states and d_final are canonical: log-linear H is non-zero
// only at the live levels of its position (slot 0 and clear bits exactly 0); S is packed symmetric.
Problem make_problem(const ProblemSpec& s);
// The same problem with floating inputs converted to dt (g and states follow the dtype rule).
Problem cast_problem(const Problem& p, DType dt);

// Time slices of [B, T, ...] buffers. slice_time copies b[:, t0:t0+len]; time_view is the same
// range as a view (B == 1 only, since other batch rows are not contiguous with it); token_view is
// token t of a B == 1 buffer as one decode-step row, shape [1, ...] with the T axis dropped.
Buffer slice_time(const Buffer& b, int64_t t0, int64_t len);
TensorView time_view(const Buffer& b, int64_t t0, int64_t len);
TensorView token_view(const Buffer& b, int64_t t);
// The first T tokens of a fixed-length problem (not varlen); lam keeps its columns, d_final is zero.
Problem prefix(const Problem& p, int64_t T);

// Owning copy of a host view (any strides); absent -> empty Buffer.
Buffer copy_view(const TensorView& v);
StateBuffers copy_state(const StateView& s);
// The state with its log-linear H resized to Ls Fenwick slots: extra slots dropped, missing ones
// zero. Lets a state held at a larger capacity (DecodeState) be compared with a final state.
StateBuffers with_slots(const StateBuffers& s, int64_t Ls);
// Bytes of one sequence's state (all heads, pos included) at position max_pos, from state_shape.
int64_t state_bytes(const OpConfig& cfg, int64_t H, int64_t dk, int64_t dv, int64_t max_pos, DType dt);

// Fails with hila::Error(name) when `bytes` of host memory exceed hila::memory_limit().
void check_memory(const std::string& name, int64_t bytes, const std::string& what);
// Checked before run_forward / run_backward allocate anything: every output's shape fits in int64
// bytes, and the inputs plus outputs fit in hila::memory_limit() (else hila::Error naming the
// largest output and the bytes needed).
void check_output_memory(const Problem& p, bool backward);

struct Result {
  Buffer o, dq, dk, dv, dg, dlam, dbeta;
  StateBuffers final_state, d_init;
};
// Where a CUDA call's temporaries come from: the device's stream-ordered pool, or a device
// workspace of exactly hila::workspace_size bytes, poisoned (all bits set) before the call.
// graph: the workspace, and the call is captured (global capture mode) on a non-blocking stream
// into a CUDA graph that is then launched twice instead of running directly
// (GraphCaptureUnsupported where the runtime has no graphs: the host emulator). graph_pool: the
// same capture with the temporaries from the pool (as hila.torch's calls run by default).
enum class Temporaries { pool, workspace, graph, graph_pool };

// Outputs are allocated and poisoned, then hila::forward fills them. The problem's tensors live in
// host memory; with a CUDA `dev` the call runs there on device copies (tools/device.h).
Result run_forward(const Problem& p, Form form, int64_t chunk = 64, Device dev = {},
                   Temporaries tmp = Temporaries::pool);
// hila::forward, then hila::backward with p.d_o and p.d_final; fills every gradient of a present
// input (dq, dk, dv; dg if gated; dlam if log-linear; dbeta if delta; d_init if init_state).
Result run_backward(const Problem& p, Form form, int64_t chunk = 64, Device dev = {},
                    Temporaries tmp = Temporaries::pool);

// max |a-b| / max(max|b|, floor, tiny). +inf if a or b holds NaN/Inf or the shapes differ; 0 if
// both absent. floor keeps a tensor that is exactly zero in exact arithmetic (rounding noise only,
// e.g. dg at T = 1) from reading as a 100% error.
double rel_err(const Buffer& a, const Buffer& b, double floor = 0);
// Per part (pos compared exactly: +inf on mismatch); +inf if a part is present in one only.
double rel_err(const StateBuffers& a, const StateBuffers& b);
// rel_err of every buffer present in a or b, named "o", "dq", ..., "final.H", "d_init.S", ...
// Gradients get floor = grad_floor x (largest |entry| over all of b's gradients).
std::vector<std::pair<std::string, double>> compare(const Result& a, const Result& b, double grad_floor = 0);
double rel_err(const Result& a, const Result& b, double grad_floor = 0);  // max over compare()

}  // namespace hila::tools
