// SPDX-License-Identifier: Apache-2.0
// How an operator is composed of primitives (docs/math/HLA.md §2, §11; docs/math/LOGLINEAR.md §7).
// Shared by the backends so that the composition is decided in one place:
//   inner S = GLA_gS(Q, K, K) -> U (+ ridge Q);  inner P = GLA_gP(Q, K, V') -> Hh;
//   outer   = prim_gO(Q, has_S ? U : K, has_P ? Hh : V')   (flat or Fenwick, mamba or delta)
#pragma once
#include "hila/ops.h"

namespace hila::detail {

// qk_l2norm (gdn, loglinear_gdn): q, k -> x / sqrt(|x|^2 + kL2NormEps) before the scale
// (docs/math/LOGLINEAR.md §6.1); the same constant on every backend.
inline constexpr double kL2NormEps = 1e-6;

struct OpPlan {
  Op op = Op::gla;
  bool has_S = false, has_P = false, fenwick = false, delta = false, normalize = false;
  int gS = -1, gP = -1, gO = 0;  // gate column of each primitive (untied gates, inner first)
  double ridge = 0, eps = 0;
  bool op_level_scan = false;    // hla2/ahla/hla3: their own segment operators
                                 // (docs/math/HLA.md §3.4, §5.3, §6.3)

  static OpPlan make(const OpConfig& cfg) {
    const OpTraits t = op_traits(cfg.op);
    OpPlan p;
    p.op = cfg.op;
    p.has_S = t.has_S;
    p.has_P = t.has_P;
    p.fenwick = t.loglinear;
    p.delta = t.delta;
    p.normalize = cfg.normalize;
    p.eps = cfg.eps;
    p.ridge = cfg.ridge;
    int col = 0;
    if (p.has_S) p.gS = col++;
    if (p.has_P) p.gP = col++;
    p.gO = col;
    p.op_level_scan = !t.loglinear && t.hla_family;
    return p;
  }
};

}  // namespace hila::detail
