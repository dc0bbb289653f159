// SPDX-License-Identifier: Apache-2.0
// The public operator API of hila: one params struct per op direction, one entry point each.
//
// Layout (sequence-first, as in fla / FlashAttention):
//   q, k  [B, T, G, dk]     G query/key groups
//   v     [B, T, H, dv]     H value heads, H % G == 0; head h reads group h / (H / G)
//   g     [B, T, H]         log-gates <= 0 (tied), or [B, T, H, P] with untied gates: one column
//                           per primitive, inner first (hla2: gS,gY; ahla: gP,gE; hla3: gS,gP,gX)
//   lam   [B, T, H, L]      Fenwick level weights (log-linear operators only)
//   beta  [B, T, H]         delta-rule step sizes (gdn, loglinear_gdn only)
//   cu_seqlens [N+1]        varlen: B == 1, sequences packed along T
//   o     [B, T, H, dv]
// States: see StateView and docs/STATES.md.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hila/tensor.h"

namespace hila {

enum class Op : int {
  gla,
  hla2,
  ahla,
  hla3,
  loglinear,
  loglinear_hla2,
  loglinear_ahla,
  loglinear_hla3,
  gdn,
  loglinear_gdn,
};
enum class Form : int { naive, serial, chunk, scan };
enum class Gates : int { tied, untied };

const char* op_name(Op op);
const char* form_name(Form f);
Op parse_op(const std::string& name);      // throws hila::Error("op", ...) on unknown names
Form parse_form(const std::string& name);  // throws hila::Error("form", ...)
const std::vector<Op>& all_ops();
const std::vector<Form>& all_forms();

// What an operator is made of (docs/math/HLA.md §2, §11; docs/math/LOGLINEAR.md §7).
struct OpTraits {
  bool loglinear;      // outer primitive uses Fenwick levels and takes lam
  bool delta;          // delta rule (takes beta)
  bool has_S;          // inner metric S = GLA(Q,K,K) (hla2, hla3 and their log-linear versions)
  bool has_P;          // inner first-order state P = GLA(Q,K,V) (ahla, hla3, ...)
  int num_primitives;  // gate columns with untied gates
  bool hla_family;     // accepts normalize / untied gates
};
OpTraits op_traits(Op op);

// Whether `form` is available for `op` in the given direction. Forward: every form. Backward:
// naive and chunk for every operator; serial for the GLA family (gla, hla2, ahla, hla3), with the
// reverse-time adjoint of docs/math/HLA.md §7.3; scan has no backward.
bool supports(Op op, Form form, bool backward);

struct OpConfig {
  Op op = Op::gla;
  double scale = 0.0;        // 0: default dk^-1/2. Applied to q in every role it plays.
  bool normalize = false;    // HLA family: o = num / (den + eps), docs/math/HLA.md §4
  double eps = 1e-6;
  double ridge = 0.0;        // hla2 / loglinear_hla2 only: S_j -> S_j + ridge * I (docs/math/HLA.md §3.2)
  Gates gates = Gates::tied;
  bool qk_l2norm = false;    // gdn / loglinear_gdn only (docs/math/LOGLINEAR.md §6.1), eps 1e-6
  bool check_values = true;  // reject g > 0 and non-finite inputs (docs/math/LOGLINEAR.md §11)
};

// One state format for prefill output, decode state, initial state and context-parallel carry.
//   pos  int64 [N]                      absolute position (tokens consumed) per sequence
//   S    [N, H, dk(dk+1)/2]             packed symmetric metric (row-major upper triangle)
//   P    [N, H, dk, dv']                inner first-order state
//   H    [N, H, dk, dv']                outer state: GLA/GDN H, HLA2 Y, AHLA E, HLA3 X
//        [N, H, Ls, dk, dv']            log-linear operators: Fenwick slots, slot = level
// dv' = dv + 1 with normalize (the last column carries the denominator). Only the parts an
// operator uses are defined. dtype: float64 for float64 inputs, float32 otherwise.
struct StateView {
  TensorView pos, S, P, H;
  bool defined() const { return pos.defined() || S.defined() || P.defined() || H.defined(); }
};

struct StateShape {
  bool S = false, P = false, H = false, levels = false;
  std::vector<int64_t> S_shape, P_shape, H_shape;  // pos is [N]
};
// Shapes of the state parts for N sequences whose largest position is max_pos.
StateShape state_shape(const OpConfig& cfg, int64_t N, int64_t H, int64_t dk, int64_t dv,
                       int64_t max_pos);
// Fenwick slots needed at position n: bitlen(n) + 1 (docs/math/LOGLINEAR.md §2.5).
int64_t state_slots(int64_t n);
// lam levels needed by a call over positions n0 .. n0+T-1: bitlen(n0+T-1) + 1 (§2.3).
int64_t levels_needed(int64_t n0, int64_t T);

struct ForwardParams {
  OpConfig cfg;
  Form form = Form::chunk;
  int64_t chunk = 64;  // power of two; on CUDA at most 64 (gla, HLA family) or exactly 64 (log-linear, delta)
  TensorView q, k, v, g, lam, beta, cu_seqlens;
  StateView init;      // optional initial state
  TensorView o;        // output [B, T, H, dv], dtype of v
  StateView final_state;  // optional output
  // Host copies that spare the reads of device values (each one a device synchronization on CUDA):
  //   cu_seqlens_host  a CPU tensor with the shape, dtype and values of cu_seqlens;
  //   init_pos_host    CPU int64 [N]: the positions the N sequences start from (init.pos, or with
  //                    state_indices init.pos[state_indices[i]], 0 for padding rows).
  // Validated as tensors (CPU, shape, dtype). With check_values off their values are trusted (the
  // call plans from them); with check_values on they are compared with the device copies.
  TensorView cu_seqlens_host, init_pos_host;
  // Serving pools (inference; forward only): int32 [N] on q's device. `init` is then a pool of P
  // rows ([P] positions, [P, H, ...] parts): sequence i starts from row state_indices[i], and its
  // final state goes to that row of `final_state` (a pool of P rows too; usually the same tensors
  // as init, updated in place). Index -1 marks a padding sequence: it reads no row (it starts from
  // a zero state at position 0), writes none, and its rows of o are 0. Real indices must be
  // distinct and < P: checked on the CPU, and on CUDA when the indices are read anyway
  // (check_values on, or no init_pos_host); otherwise a row outside [-1, P) gives NaN in o for its
  // sequence and writes nothing.
  TensorView state_indices;
  void* stream = nullptr;  // cudaStream_t for CUDA tensors (nullptr: the default stream)
  // Optional device memory for the call's temporaries (CUDA): workspace_size(p) bytes or more, on
  // the device of q, any alignment, not used by other work until the call's kernels are done (it
  // is stream-ordered like the call). Without it temporaries come from the device's
  // stream-ordered pool (cudaMallocAsync). Ignored on the CPU.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Backward also runs the forward: when `o` or `final_state` are given they are written too.
struct BackwardParams : ForwardParams {
  TensorView d_o;        // cotangent of o
  StateView d_final;     // optional cotangent of the final state (pos ignored)
  // Outputs; each optional. Same shape and dtype as the corresponding input.
  TensorView dq, dk, dv, dg, dlam, dbeta;
  StateView d_init;      // gradient w.r.t. the initial state (pos ignored)
};

void forward(const ForwardParams& p);
void backward(const BackwardParams& p);

// Device bytes forward(p) / backward(p) take from p.workspace: exact for these params (shapes,
// options, dtypes, cu_seqlens, initial positions and which optional outputs are asked for; the
// data itself does not matter). 0 on the CPU. A host-side dry run of the call: no kernel runs.
size_t workspace_size(const ForwardParams& p);
size_t workspace_size(const BackwardParams& p);

// Host memory: a call whose CPU computation (or a DecodeState whose memory) would need more than
// memory_limit() bytes fails up front with hila::Error naming the tensor and the bytes it needs,
// and an allocation failure anywhere in hila becomes hila::Error("memory", ...). The limit is the
// smallest of set_memory_limit() (when set), the environment variable HILA_MAX_MEMORY (bytes, or a
// number with a K/M/G/T suffix, powers of 1024), the machine's physical memory and its cgroup
// limit. Device memory is the device's own (a failed CUDA allocation is a hila::Error too).
int64_t memory_limit();
void set_memory_limit(int64_t bytes);  // 0: back to the default; < 0 is an error
// "123", "64K", "1.5G", "2T" -> bytes; throws hila::Error(arg) on anything else.
int64_t parse_memory_size(const std::string& text, const std::string& arg = "max_memory");

// ---------------------------------------------------------------------------------------------
// Decode: an owning state for N sequences x H heads, stepped one token at a time (serial form).
struct StepParams {
  OpConfig cfg;
  TensorView q, k;  // [N, G, dk]
  TensorView v;     // [N, H, dv]
  TensorView g;     // [N, H] or [N, H, P] (untied); optional
  TensorView lam;   // [N, H, L], L >= bitlen(pos)+1 for every sequence; log-linear ops only
  TensorView beta;  // [N, H]; delta ops only
  TensorView o;     // output [N, H, dv]
  void* stream = nullptr;  // cudaStream_t for CUDA tensors
  // The caller's bound on the positions the step starts from (-1: none). With it a step on a CUDA
  // StateView reads nothing back to the host (no synchronization, no allocation: CUDA graphs can
  // capture it) for every operator: the Fenwick slots and λ levels are checked against it
  // (state.H has >= state_slots(max_position + 1) slots, lam >= bitlen(max_position) + 1 levels),
  // and the kernel checks each sequence's position: one outside [0, max_position] gets NaN in its
  // rows of o and its state (pos included) is left unchanged. On the CPU, and on CUDA with
  // check_values on, the positions are read and such a position is a hila::Error("state.pos").
  int64_t max_position = -1;
  // Serving pools (StateView steps): int32 [N] on the state's device. The state is then a pool of
  // P rows (pos [P], S, P, H [P, ...]); sequence i reads and advances row state_indices[i]. Index
  // -1 marks a padding row: nothing of the pool is read or written, and o is 0 for that sequence.
  // Real indices must be distinct and < P: checked on the CPU, and on CUDA when the indices are
  // read anyway (check_values on, or a log-linear step without max_position); otherwise the
  // kernel gives a row outside [-1, P) NaN in o and writes nothing (duplicates are the caller's
  // to avoid). Not for DecodeState steps.
  TensorView state_indices;
  // Step counters of a caller-owned state (StateView steps; optional): int32, one dimension,
  // contiguous, on the state's device, with at least step_counters_size(N, H) elements (N the
  // call's sequences, H its value heads). Zero-filled by their owner once; every step leaves them
  // zero again (whatever it skips: padding rows, invalid rows, positions past max_position). With
  // them a CUDA step is exactly a DecodeState's step: the kernel's last block of each sequence
  // advances pos (no second kernel), and the metric-S operators split dv' into column tiles (a
  // per-(sequence, head) counter elects the block that writes S). Without them the step is the
  // same function with one tile per head (S ops) and a second tiny kernel advancing pos. Steps
  // sharing counters must be stream-ordered (as steps of one state must be anyway). The CPU
  // backend validates them and does not use them. Not for DecodeState steps (it owns its own).
  TensorView counters;
};

// Elements of StepParams::counters for a step of N sequences and H value heads: blocks done per
// sequence [N], then blocks done reading S per (sequence, head) [N, H].
int64_t step_counters_size(int64_t N, int64_t H);

// Thread safety: every member function takes the state's own lock, so one DecodeState may be
// stepped, loaded, reserved and viewed from several threads; steps serialize (each one advances
// every position by one; none is lost). A moved-from DecodeState may only be destroyed or
// assigned to.
class DecodeState {
 public:
  // A zero state at position 0. dtype: f64 or f32 (the compute type of the inputs to come; on a
  // CUDA device f64 exactly for f64 inputs). device: cpu or cuda (memory allocated here).
  DecodeState(const OpConfig& cfg, int64_t N, int64_t H, int64_t dk, int64_t dv,
              DType dtype = DType::f32, Device device = {});
  ~DecodeState();
  DecodeState(DecodeState&&) noexcept;
  DecodeState& operator=(DecodeState&&) noexcept;

  const OpConfig& config() const;
  int64_t batch() const;
  int64_t heads() const;
  int64_t dk() const;
  int64_t dv() const;
  DType dtype() const;
  Device device() const;
  int64_t slots() const;  // Fenwick slot capacity (1 for non-log-linear operators)
  int64_t position(int64_t seq) const;
  // Grow the Fenwick slot capacity so that positions up to max_pos need no reallocation;
  // max_pos in [0, 2^62] (hila::Error("max_pos") otherwise).
  void reserve(int64_t max_pos);
  // Views of the current state, valid until the next step/reserve/load. On a CUDA device the views
  // hold device memory; position() reads a host copy of pos that step/load keep, so write the
  // state through load(), not through view().pos.
  StateView view();
  // The same views plus `owner`, which keeps their memory alive: after a step, reserve or load
  // that grows a log-linear state into new memory, views held with their owner still point to
  // valid (old) memory, showing the state as it was; writes to them are lost.
  StateView view(std::shared_ptr<const void>& owner);
  // Copy a state in (e.g. a prefill's final state); validated like an initial state (positions in
  // [0, 2^62], the bound forward() keeps).
  void load(const StateView& s);
  // Bytes of state per sequence at its current capacity (all heads).
  int64_t bytes_per_sequence() const;

  struct Impl;
  Impl* impl() { return impl_.get(); }

 private:
  std::unique_ptr<Impl> impl_;
};

// One decode step of every sequence: reads q, k, v (and g, lam, beta) at each sequence's position,
// writes o and advances the state (growing its Fenwick slots first when a position crosses a
// power of two; reserve() avoids that reallocation).
void step(const StepParams& p, DecodeState& state);
// The same step on a caller-owned state in the StateView layout, updated in place (pos included).
// Validated: the state's layout (as an initial state's) and device (q's), its float parts all
// float32 or all float64 (on CUDA: float64 exactly for float64 inputs), and log-linear H with
// bitlen(pos + 1) + 1 slots for every sequence (the slot the step merges into; never grown here).
// As for a DecodeState, check_values covers the step inputs, not the state's values. On CUDA with
// check_values off the host reads nothing back (no synchronization, no allocation) except the
// positions of a log-linear step without max_position (its slot capacity and λ levels depend on
// them) and, for such a step on a pool, state_indices. With check_values on, o is scanned too.
void step(const StepParams& p, const StateView& state);

}  // namespace hila
