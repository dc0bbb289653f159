// SPDX-License-Identifier: Apache-2.0
// A validated call: what the backends receive after src/core/validate.cpp has checked it.
#pragma once
#include <cstdint>
#include <vector>

#include "hila/ops.h"

namespace hila::detail {

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

}  // namespace hila::detail
