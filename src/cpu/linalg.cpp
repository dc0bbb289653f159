// SPDX-License-Identifier: Apache-2.0
// The inner product loops of gemm, the transpose and the unit lower inverse (linalg.h). On x86-64
// ELF builds (GCC) they are compiled for the x86-64 baseline and for x86-64-v3 (AVX2 + FMA)
// (HILA_CPU_CLONES, linalg.h), the product loops also for x86-64-v4 (AVX-512), and the loader
// picks the version the CPU runs.
#include "cpu/linalg.h"

#include <algorithm>

namespace hila::cpu {

namespace {

// Rows [i, i + NR) of C, columns [j, j + W), W = 64 bytes of R: NR x 64 / VB vectors of VB bytes
// of accumulators held in registers across the sum over k (independent chains; each C(i, j)
// summed over k in order). Every k in [kb, ke) is summed, zero A entries included: for finite B a
// zero adds an exact zero, and a test per k (NR scalar loads into integer registers, an OR and a
// branch) costs more than the multiply-adds it would spare. The ranges of the structure flags skip the zeros of a
// causal factor outside the diagonal tile.
template <int NR, int VB, bool kOne, bool kZero, class R>
__attribute__((always_inline)) inline void tile(R* c, int64_t ldc, const R* ai, int64_t sa_row,
                                                int64_t sa_k, const R* B, int64_t ldb, int64_t kb,
                                                int64_t ke, R alpha) {
  typedef R V __attribute__((vector_size(VB)));
  // the same vector at element alignment: direct unaligned loads and stores of C and B rows
  typedef R VU __attribute__((vector_size(VB), aligned(sizeof(R)), may_alias));
  constexpr int64_t L = VB / sizeof(R);  // entries of a vector
  constexpr int NV = 64 / VB;            // vectors of a tile row (64 bytes)
  V acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NV; ++u)
      acc[r][u] = kZero ? V{} : *reinterpret_cast<const VU*>(c + r * ldc + u * L);  // kZero: C not read
  for (int64_t k = kb; k < ke; ++k) {
    R a[NR];
    for (int r = 0; r < NR; ++r) a[r] = kOne ? ai[r * sa_row + k * sa_k] : alpha * ai[r * sa_row + k * sa_k];
    const R* b = B + k * ldb;
    V bv[NV];
    for (int u = 0; u < NV; ++u) bv[u] = *reinterpret_cast<const VU*>(b + u * L);
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < NV; ++u) acc[r][u] += a[r] * bv[u];
  }
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NV; ++u) *reinterpret_cast<VU*>(c + r * ldc + u * L) = acc[r][u];
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

template <int VB, bool kOne, bool kZero, class R>
__attribute__((always_inline)) inline void rows_impl(R* C, int64_t ldc, const R* A, int64_t sa_row,
                                                     int64_t sa_k, const R* B, int64_t ldb, int64_t m,
                                                     int64_t n, int64_t kk, R alpha, int tri) {
  // a tile: NR rows of 64 bytes, NR x 64 / VB independent chains (8: enough to cover the latency
  // of a multiply-add)
  constexpr int64_t W = 64 / sizeof(R), NR = VB == 64 ? 8 : 4;
  const int64_t nt = n / W * W;  // columns covered by full tiles
  int64_t i = 0;
  for (; i + NR <= m; i += NR) {
    const Range g = range(tri, i, NR, kk, n);
    for (int64_t j = 0; j < nt && j < g.je; j += W)
      tile<NR, VB, kOne, kZero>(C + i * ldc + j, ldc, A + i * sa_row, sa_row, sa_k, B + j, ldb, g.kb, g.ke, alpha);
  }
  for (; i < m; ++i) {
    const Range g = range(tri, i, 1, kk, n);
    for (int64_t j = 0; j < nt && j < g.je; j += W)
      tile<1, VB, kOne, kZero>(C + i * ldc + j, ldc, A + i * sa_row, sa_row, sa_k, B + j, ldb, g.kb, g.ke, alpha);
  }
  if (nt == n) return;
  for (i = 0; i < m; ++i) {  // the last n - nt columns
    R* c = C + i * ldc;
    const R* ai = A + i * sa_row;
    const Range g = range(tri, i, 1, kk, n);
    if (kZero) std::fill(c + nt, c + std::max(nt, g.je), R(0));
    for (int64_t k = g.kb; k < g.ke; ++k) {
      const R a = alpha * ai[k * sa_k];
      if (a == R(0)) continue;
      const R* __restrict b = B + k * ldb;
      for (int64_t t = nt; t < g.je; ++t) c[t] += a * b[t];
    }
  }
}

// rows_impl with alpha = 1 (most products) compiled without the multiply per A entry, and C = 0
// (kCZero) without reading C.
template <int VB, class R>
__attribute__((always_inline)) inline void rows(R* C, int64_t ldc, const R* A, int64_t sa_row, int64_t sa_k,
                                                const R* B, int64_t ldb, int64_t m, int64_t n, int64_t kk, R alpha,
                                                int tri) {
  const bool one = alpha == R(1), zero = tri & kCZero;
  if (one && zero) rows_impl<VB, true, true>(C, ldc, A, sa_row, sa_k, B, ldb, m, n, kk, alpha, tri);
  else if (zero) rows_impl<VB, false, true>(C, ldc, A, sa_row, sa_k, B, ldb, m, n, kk, alpha, tri);
  else if (one) rows_impl<VB, true, false>(C, ldc, A, sa_row, sa_k, B, ldb, m, n, kk, alpha, tri);
  else rows_impl<VB, false, false>(C, ldc, A, sa_row, sa_k, B, ldb, m, n, kk, alpha, tri);
}

// Per-thread cache of freed blocks, one list per size class 2^c bytes, c in [kMinClass,
// kMaxClass]; a class keeps at most kKeepBytes of blocks (and at least 4), so a thread holds at
// most about 12 x 256 KiB.
constexpr int kMinClass = 6, kMaxClass = 17;
constexpr size_t kKeepBytes = size_t(256) << 10;
constexpr int kClasses = kMaxClass - kMinClass + 1;

struct BlockCache {
  std::vector<void*> free[kClasses];
  bool alive = true;
  BlockCache() {
    for (int c = 0; c < kClasses; ++c) free[c].reserve(cap(c));
  }
  ~BlockCache() {
    alive = false;
    for (auto& f : free)
      for (void* p : f) ::operator delete(p);
  }
  static size_t cap(int c) { return std::max<size_t>(4, std::min<size_t>(256, kKeepBytes >> (c + kMinClass))); }
};
thread_local BlockCache t_cache;

// Size class of a block of `bytes` (0 < bytes <= 2^kMaxClass): the smallest c with 2^c >= bytes.
inline int size_class(size_t bytes) {
  int c = kMinClass;
  while ((size_t(1) << c) < bytes) ++c;
  return c - kMinClass;
}

}  // namespace

void* block_alloc(size_t bytes) {
  if (bytes == 0 || bytes > (size_t(1) << kMaxClass)) return ::operator new(bytes);
  const int c = size_class(bytes);
  std::vector<void*>& f = t_cache.free[c];
  if (!f.empty()) {
    void* p = f.back();
    f.pop_back();
    return p;
  }
  return ::operator new(size_t(1) << (c + kMinClass));
}

void block_free(void* p, size_t bytes) noexcept {
  if (!p) return;
  if (bytes == 0 || bytes > (size_t(1) << kMaxClass)) return ::operator delete(p);
  const int c = size_class(bytes);
  BlockCache& cache = t_cache;
  if (cache.alive && cache.free[c].size() < BlockCache::cap(c)) {
    cache.free[c].push_back(p);  // within the reserved capacity: no allocation, no throw
    return;
  }
  ::operator delete(p);
}

// bt [kk, n] = B [n, kk]^T (rows of B ldb apart). float: 8 x 8 blocks as eight 32-byte rows
// transposed in registers (three rounds of two-vector shuffles: pairs of rows, pairs of pairs,
// halves), the edges element by element.
namespace {
template <class R>
inline void transpose_edges(R* bt, const R* B, int64_t ldb, int64_t n, int64_t kk, int64_t n8,
                            int64_t k8) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t k = j < n8 ? k8 : 0; k < kk; ++k) bt[k * n + j] = B[j * ldb + k];
}
}  // namespace

HILA_CPU_CLONES void transpose(float* bt, const float* B, int64_t ldb, int64_t n, int64_t kk) {
  typedef float V __attribute__((vector_size(32)));
  typedef float VU __attribute__((vector_size(32), aligned(4), may_alias));
  const int64_t n8 = n / 8 * 8, k8 = kk / 8 * 8;
  for (int64_t j = 0; j < n8; j += 8)
    for (int64_t k = 0; k < k8; k += 8) {
      V r[8];
      for (int u = 0; u < 8; ++u) r[u] = *reinterpret_cast<const VU*>(B + (j + u) * ldb + k);
      V t[8], s[8];
      for (int u = 0; u < 8; u += 2) {  // t[u] = (r_u0 r_{u+1}0 r_u1 r_{u+1}1 | the same for 4, 5)
        t[u] = __builtin_shufflevector(r[u], r[u + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[u + 1] = __builtin_shufflevector(r[u], r[u + 1], 2, 10, 3, 11, 6, 14, 7, 15);
      }
      for (int h = 0; h < 8; h += 4) {  // s: four rows' entries of columns c and c + 4
        s[h] = __builtin_shufflevector(t[h], t[h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        s[h + 1] = __builtin_shufflevector(t[h], t[h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        s[h + 2] = __builtin_shufflevector(t[h + 1], t[h + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        s[h + 3] = __builtin_shufflevector(t[h + 1], t[h + 3], 2, 3, 10, 11, 6, 7, 14, 15);
      }
      for (int c = 0; c < 4; ++c) {  // column c of the block, then column c + 4
        *reinterpret_cast<VU*>(bt + (k + c) * n + j) =
            __builtin_shufflevector(s[c], s[c + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        *reinterpret_cast<VU*>(bt + (k + c + 4) * n + j) =
            __builtin_shufflevector(s[c], s[c + 4], 4, 5, 6, 7, 12, 13, 14, 15);
      }
    }
  transpose_edges(bt, B, ldb, n, kk, n8, k8);
}

void transpose(double* bt, const double* B, int64_t ldb, int64_t n, int64_t kk) {
  transpose_edges(bt, B, ldb, n, kk, 0, 0);
}

namespace {
// 2 W entries, 1 at W alone (W = 64 bytes of R): unit<R>() + W - p + t is 1 at t = p, p < W.
template <class R>
struct UnitRow {
  static constexpr int W = 64 / sizeof(R);
  alignas(64) R v[2 * W] = {};
  UnitRow() { v[W] = 1; }
};
template <class R>
const R* unit() {
  static const UnitRow<R> e;
  return e.v;
}

// Rows [i0, i0 + NB) of T: in each column block [j, j + W) (two 32-byte vectors) the rows first
// sum, side by side, the rows k < i0 above them (NB independent chains held in registers), then
// finish one after the other over the rows of the block before them; each T(i, j) is summed
// over k in order. T[k, j:] = 0 for k < j, so column block j needs only k >= j.
template <int NB, class R>
__attribute__((always_inline)) inline void ul_rows(R* T, int64_t ldt, const R* A, int64_t lda,
                                                   const R* s, int64_t n, int64_t i0) {
  typedef R V __attribute__((vector_size(32)));
  typedef R VU __attribute__((vector_size(32), aligned(sizeof(R)), may_alias));
  constexpr int64_t L = 32 / sizeof(R), W = 2 * L;
  const int64_t nw = n / W * W;  // columns in whole blocks
  const R* e1 = unit<R>();
  R si[NB];
  const R* ar[NB];
  for (int r = 0; r < NB; ++r) {
    si[r] = s ? s[i0 + r] : R(1);
    ar[r] = A + (i0 + r) * lda;
  }
  for (int64_t j = 0; j < nw; j += W) {
    if (j >= i0 + NB) {  // above the diagonal for every row of the block
      for (int r = 0; r < NB; ++r) {
        *reinterpret_cast<VU*>(T + (i0 + r) * ldt + j) = V{};
        *reinterpret_cast<VU*>(T + (i0 + r) * ldt + j + L) = V{};
      }
      continue;
    }
    V c[NB][2];
    for (int r = 0; r < NB; ++r) c[r][0] = c[r][1] = V{};
    for (int64_t k = j; k < i0; ++k) {  // rows above the block
      const R* tk = T + k * ldt + j;
      const V b0 = *reinterpret_cast<const VU*>(tk), b1 = *reinterpret_cast<const VU*>(tk + L);
      for (int r = 0; r < NB; ++r) {
        const R f = si[r] * ar[r][k];
        if (f == R(0)) continue;
        c[r][0] -= f * b0;
        c[r][1] -= f * b1;
      }
    }
    // rows of the block, in order (j <= i0: every k of the block is >= j), each read from the
    // registers of the rows before it once its diagonal 1 is in (that entry's sum is an exact 0)
#pragma GCC unroll 4
    for (int r = 0; r < NB; ++r) {
      const int64_t i = i0 + r;
#pragma GCC unroll 4
      for (int r2 = 0; r2 < r; ++r2) {
        const R f = si[r] * ar[r][i0 + r2];
        if (f == R(0)) continue;
        c[r][0] -= f * c[r2][0];
        c[r][1] -= f * c[r2][1];
      }
      if (i < j + W) {  // + e_{i - j}
        const R* e = e1 + W - (i - j);
        c[r][0] += *reinterpret_cast<const VU*>(e);
        c[r][1] += *reinterpret_cast<const VU*>(e + L);
      }
      R* ti = T + i * ldt;
      *reinterpret_cast<VU*>(ti + j) = c[r][0];
      *reinterpret_cast<VU*>(ti + j + L) = c[r][1];
    }
  }
  for (int r = 0; r < NB; ++r) {  // the last n - nw columns
    const int64_t i = i0 + r;
    R* ti = T + i * ldt;
    for (int64_t j = nw; j < n; ++j) {
      R c = 0;
      for (int64_t k = j; k < i; ++k) {
        const R f = si[r] * ar[r][k];
        if (f != R(0)) c -= f * T[k * ldt + j];
      }
      ti[j] = j == i ? R(1) : c;
    }
  }
}

template <class R>
__attribute__((always_inline)) inline void ul_inverse(R* T, int64_t ldt, const R* A, int64_t lda,
                                                      const R* s, int64_t n) {
  int64_t i0 = 0;
  for (; i0 + 4 <= n; i0 += 4) ul_rows<4>(T, ldt, A, lda, s, n, i0);
  for (; i0 < n; ++i0) ul_rows<1>(T, ldt, A, lda, s, n, i0);
}
}  // namespace

HILA_CPU_CLONES void unit_lower_inverse(float* T, int64_t ldt, const float* A, int64_t lda,
                                        const float* s, int64_t n) {
  ul_inverse(T, ldt, A, lda, s, n);
}

HILA_CPU_CLONES void unit_lower_inverse(double* T, int64_t ldt, const double* A, int64_t lda,
                                        const double* s, int64_t n) {
  ul_inverse(T, ldt, A, lda, s, n);
}

// gemm_rows in three versions, one picked at load time (an ifunc on x86-64 ELF builds with GCC):
// the x86-64 baseline and x86-64-v3 (AVX2 + FMA) hold a tile row in two 32-byte vectors,
// x86-64-v4 (AVX-512) in one 64-byte vector (half the multiply-add instructions). Each C(i, j)
// is summed over k in the same order in all three (v3 and v4 with one fused multiply-add per k:
// the same results).
#define HILA_GEMM_ROWS(name, R, VB)                                                              \
  void name(R* C, int64_t ldc, const R* A, int64_t sa_row, int64_t sa_k, const R* B, int64_t ldb, \
            int64_t m, int64_t n, int64_t kk, R alpha, int tri) {                                 \
    rows<VB>(C, ldc, A, sa_row, sa_k, B, ldb, m, n, kk, alpha, tri);                             \
  }
#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__) && !defined(__clang__)
namespace {
HILA_GEMM_ROWS(gemm_rows_base, float, 32)
HILA_GEMM_ROWS(gemm_rows_base, double, 32)
__attribute__((target("arch=x86-64-v3"))) HILA_GEMM_ROWS(gemm_rows_v3, float, 32)
__attribute__((target("arch=x86-64-v3"))) HILA_GEMM_ROWS(gemm_rows_v3, double, 32)
__attribute__((target("arch=x86-64-v4"))) HILA_GEMM_ROWS(gemm_rows_v4, float, 64)
__attribute__((target("arch=x86-64-v4"))) HILA_GEMM_ROWS(gemm_rows_v4, double, 64)
template <class R>
using GemmRows = void (*)(R*, int64_t, const R*, int64_t, int64_t, const R*, int64_t, int64_t,
                          int64_t, int64_t, R, int);
template <class R>
GemmRows<R> pick_gemm_rows() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return gemm_rows_v4;
  if (__builtin_cpu_supports("x86-64-v3")) return gemm_rows_v3;
  return gemm_rows_base;
}
}  // namespace
extern "C" {
static GemmRows<float> hila_cpu_resolve_gemm_rows_f32() { return pick_gemm_rows<float>(); }
static GemmRows<double> hila_cpu_resolve_gemm_rows_f64() { return pick_gemm_rows<double>(); }
}
void gemm_rows(float* C, int64_t ldc, const float* A, int64_t sa_row, int64_t sa_k, const float* B,
               int64_t ldb, int64_t m, int64_t n, int64_t kk, float alpha, int tri)
    __attribute__((ifunc("hila_cpu_resolve_gemm_rows_f32")));
void gemm_rows(double* C, int64_t ldc, const double* A, int64_t sa_row, int64_t sa_k,
               const double* B, int64_t ldb, int64_t m, int64_t n, int64_t kk, double alpha,
               int tri) __attribute__((ifunc("hila_cpu_resolve_gemm_rows_f64")));
#else
HILA_GEMM_ROWS(gemm_rows, float, 32)
HILA_GEMM_ROWS(gemm_rows, double, 32)
#endif
#undef HILA_GEMM_ROWS

}  // namespace hila::cpu
