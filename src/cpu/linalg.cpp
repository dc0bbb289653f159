// SPDX-License-Identifier: Apache-2.0
// The inner product loops of gemm (linalg.h). On x86-64 ELF builds they are compiled twice, for
// the x86-64 baseline and for x86-64-v3 (AVX2 + FMA), and the loader picks the one the CPU runs.
#include "cpu/linalg.h"

#include <cstring>

#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__) && !defined(__clang__)
#define HILA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define HILA_CPU_CLONES
#endif

namespace hila::cpu {

namespace {

// Rows [i, i + NR) of C, columns [j, j + W): NR x 2 vectors of 32 bytes of accumulators held in
// registers across the sum over k (independent chains; each C(i, j) summed over k in order).
// k where op(A) is zero in all NR rows (e.g. the upper triangle of a causal mask) is skipped.
template <int NR, class R>
__attribute__((always_inline)) inline void tile(R* c, int64_t ldc, const R* ai, int64_t sa_row,
                                                int64_t sa_k, const R* B, int64_t ldb, int64_t kb,
                                                int64_t ke, R alpha) {
  typedef R V __attribute__((vector_size(32)));
  constexpr int64_t L = 32 / sizeof(R);
  V acc[NR][2];
  for (int r = 0; r < NR; ++r) {
    std::memcpy(&acc[r][0], c + r * ldc, sizeof(V));
    std::memcpy(&acc[r][1], c + r * ldc + L, sizeof(V));
  }
  for (int64_t k = kb; k < ke; ++k) {
    R a[NR];
    bool any = false;
    for (int r = 0; r < NR; ++r) {
      a[r] = alpha * ai[r * sa_row + k * sa_k];
      any |= a[r] != R(0);
    }
    if (!any) continue;
    const R* b = B + k * ldb;
    V b0, b1;
    std::memcpy(&b0, b, sizeof(V));
    std::memcpy(&b1, b + L, sizeof(V));
    for (int r = 0; r < NR; ++r) {
      acc[r][0] += a[r] * b0;
      acc[r][1] += a[r] * b1;
    }
  }
  for (int r = 0; r < NR; ++r) {
    std::memcpy(c + r * ldc, &acc[r][0], sizeof(V));
    std::memcpy(c + r * ldc + L, &acc[r][1], sizeof(V));
  }
}

// Rows [i, i + nr) need k in [kb, ke) and columns below je (the structure flags of linalg.h).
struct Range {
  int64_t kb, ke, je;
};
inline Range range(int tri, int64_t i, int64_t nr, int64_t kk, int64_t n) {
  Range r{0, kk, n};
  if (tri & kAUpper) r.kb = std::min(i, kk);
  if (tri & kALower) r.ke = std::min(i + nr, kk);
  if (tri & kCLower) r.je = std::min(i + nr, n);
  return r;
}

template <class R>
__attribute__((always_inline)) inline void rows_impl(R* C, int64_t ldc, const R* A, int64_t sa_row,
                                                     int64_t sa_k, const R* B, int64_t ldb, int64_t m,
                                                     int64_t n, int64_t kk, R alpha, int tri) {
  constexpr int64_t W = 2 * 32 / sizeof(R), NR = 4;
  const int64_t nt = n / W * W;  // columns covered by full tiles
  int64_t i = 0;
  for (; i + NR <= m; i += NR) {
    const Range g = range(tri, i, NR, kk, n);
    for (int64_t j = 0; j < nt && j < g.je; j += W)
      tile<NR>(C + i * ldc + j, ldc, A + i * sa_row, sa_row, sa_k, B + j, ldb, g.kb, g.ke, alpha);
  }
  for (; i < m; ++i) {
    const Range g = range(tri, i, 1, kk, n);
    for (int64_t j = 0; j < nt && j < g.je; j += W)
      tile<1>(C + i * ldc + j, ldc, A + i * sa_row, sa_row, sa_k, B + j, ldb, g.kb, g.ke, alpha);
  }
  if (nt == n) return;
  for (i = 0; i < m; ++i) {  // the last n - nt columns
    R* c = C + i * ldc;
    const R* ai = A + i * sa_row;
    const Range g = range(tri, i, 1, kk, n);
    for (int64_t k = g.kb; k < g.ke; ++k) {
      const R a = alpha * ai[k * sa_k];
      if (a == R(0)) continue;
      const R* __restrict b = B + k * ldb;
      for (int64_t t = nt; t < g.je; ++t) c[t] += a * b[t];
    }
  }
}

}  // namespace

HILA_CPU_CLONES void gemm_rows(float* C, int64_t ldc, const float* A, int64_t sa_row, int64_t sa_k,
                               const float* B, int64_t ldb, int64_t m, int64_t n, int64_t kk,
                               float alpha, int tri) {
  rows_impl(C, ldc, A, sa_row, sa_k, B, ldb, m, n, kk, alpha, tri);
}

HILA_CPU_CLONES void gemm_rows(double* C, int64_t ldc, const double* A, int64_t sa_row,
                               int64_t sa_k, const double* B, int64_t ldb, int64_t m, int64_t n,
                               int64_t kk, double alpha, int tri) {
  rows_impl(C, ldc, A, sa_row, sa_k, B, ldb, m, n, kk, alpha, tri);
}

}  // namespace hila::cpu
