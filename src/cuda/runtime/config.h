// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's environment knobs, read in one place (config.cpp) into one object. Plain C++:
// the unit tests of tests/test_heuristics.cpp parse it without CUDA. docs/DEVELOPING.md has the
// table of every knob (name, values, default, purpose).
//
// The environment is read once, at the first call that needs a knob. A process that changes a
// knob between calls (the GPU tests run one case with HILA_GLA_SM90=0 and the next with it unset)
// calls reload_config() after setenv / unsetenv.
#pragma once
#include <cstddef>
#include <optional>

namespace hila::cuda {

// A choice the backend makes by itself unless a knob forces it.
enum class Force { automatic, off, on };

// Which sm_90a GLA kernels may run (HILA_GLA_SM90).
struct Sm90Kernels {
  bool sweep = true, bwd = true, fwd = true;
  bool forced = false;  // "1": wherever they apply (past the sweep's block-count threshold; the output kernel for every form)
  bool out = true;      // the chunk-parallel output kernel (gla/output_sm90.cu)
  bool wkv = true;      // the log-linear tree backward's read sums (loglinear/wkv_sm90.cu)
};

struct Config {
  bool upload_kernel = false;   // HILA_UPLOAD_KERNEL=1: per-call tables always go up through kernel parameters
  bool side_stream = true;      // HILA_SIDE_STREAM=0: everything on the caller's stream
  bool poison_scratch = false;  // HILA_POISON_SCRATCH (set, not 0): temporaries and a guard tail filled with NaN
  bool fold_s = true;           // HILA_FOLD_S=0: the inner S primitive's dv as a second dk contribution
  Sm90Kernels gla_sm90;         // HILA_GLA_SM90: unset / 1 / 0 / a list of sweep,bwd,fwd
  Force gla_fused = Force::automatic;              // HILA_GLA_FUSED=0|1: the one-kernel GLA forward
  bool gdn_tc = true;                              // HILA_GDN_TC=0: the delta rule's portable kernels only
  bool delta_sm90 = true;                          // HILA_DELTA_SM90=0: the delta rule's sm80 state sweeps on Hopper too
  int delta_pieces = 0;  // HILA_DELTA_PIECES=n: gdn's WY kernel and state sweeps pipelined in n pieces (1: none); 0: heuristics::delta_sweep_pieces
  bool loglinear_tree = true;                      // HILA_LOGLINEAR_TREE=0: the log-linear segment sweep only
  Force loglinear_tree_sweep = Force::automatic;   // HILA_LOGLINEAR_TREE_SWEEP=0|1: the tree build in the sweep
  int loglinear_tree_segment = -1;  // HILA_LOGLINEAR_TREE_SEGMENT=s (0..40): the tree passes in segments of 2^s chunks (0: one pass); -1: heuristics::loglinear_tree_segment
  std::optional<size_t> loglinear_store_budget;    // HILA_LOGLINEAR_STORE_BUDGET: bytes of stored levels
  bool emu_sm90 = false;                           // HILA_EMU_SM90=1: the host emulator runs the sm_90a kernels

  // The knobs as `env` (a getenv) reports them.
  static Config parse(const char* (*env)(const char*));
};

// The process's knobs, read from the environment at the first call.
const Config& config();
// Re-reads the environment (tests that set a knob between calls). References that config()
// returned before stay valid (and keep the values they had).
void reload_config();

}  // namespace hila::cuda
