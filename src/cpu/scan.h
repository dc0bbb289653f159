// SPDX-License-Identifier: Apache-2.0
// Segment summaries of hla2 / ahla / hla3 (docs/math/HLA.md §3.4, §5.3, §6.3), exposed for tests of
// associativity, identity and the action property, and for context parallelism.
#pragma once
#include "cpu/blelloch.h"
#include "cpu/compose.h"

namespace hila::cpu {

// One struct for the three operators; unused members stay empty.
//   hla2: S, Y, X1 = Z                   (lS, lO = log rho^S, log rho^Y)
//   ahla: P, Y = E, X1 = R               (lP, lO = log rho^P, log rho^E)
//   hla3: S, P, Y = X, X1 = Phi, X2 = Psi, X3 = Omega   (lS, lP, lO)
template <class R>
struct HlaSummary {
  bool identity = true;
  int64_t a = 0, b = 0;
  R lS = 0, lP = 0, lO = 0;
  Mat<R> S, P, Y, X1, X2, X3;
};

// Summary of the rows of x (positions x.n0 .. x.n0 + n), computed with the chunk form.
template <class R>
HlaSummary<R> hla_summarize(const OpPlan& p, int64_t C, const HeadView<R>& x);
template <class R>
HlaSummary<R> hla_compose(const OpPlan& p, const HlaSummary<R>& A, const HlaSummary<R>& B);
template <class R>
OpState<R> hla_apply(const OpPlan& p, const HlaSummary<R>& X, const OpState<R>& st, int64_t dk,
                     int64_t dvp);

}  // namespace hila::cpu
