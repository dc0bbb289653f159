// SPDX-License-Identifier: Apache-2.0
// Small dense row-major matrices and the GEMM loops the CPU forms are written in.
// Plain loops (the CPU backend is the reference and the oracle), except the inner product loops
// of gemm (linalg.cpp), which are tiled for registers.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

// A function compiled twice on x86-64 ELF builds (GCC), for the x86-64 baseline and for
// x86-64-v3 (AVX2 + FMA); the loader picks the one the CPU runs.
#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__) && !defined(__clang__)
#define HILA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define HILA_CPU_CLONES
#endif

namespace hila::cpu {

// Non-owning row-major view with a leading dimension (rows of a bigger matrix).
template <class R>
struct MRef {
  R* p = nullptr;
  int64_t r = 0, c = 0, ld = 0;
  R& operator()(int64_t i, int64_t j) const { return p[i * ld + j]; }
  R* row(int64_t i) const { return p + i * ld; }
  MRef rows(int64_t i0, int64_t i1) const { return {p + i0 * ld, i1 - i0, c, ld}; }
  operator MRef<const R>() const { return {p, r, c, ld}; }
};

// Storage of the CPU forms' temporaries (linalg.cpp): blocks of up to 128 KiB come from a
// per-thread cache of freed blocks (power-of-two size classes, a few hundred KiB kept per class at
// most), so the many small matrices of a segment cost no trip through malloc; larger blocks and an
// empty cache go to operator new. A block may be freed on another thread than the one that
// allocated it (it then joins that thread's cache).
void* block_alloc(size_t bytes);
void block_free(void* p, size_t bytes) noexcept;

// Allocator whose value-less construct default-initialises (no zero fill): vector(n) of it leaves
// arithmetic elements unset; vector(n, x) still sets them. Storage from block_alloc.
template <class T>
struct NoInitAlloc : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = NoInitAlloc<U>;
  };
  NoInitAlloc() = default;
  template <class U>
  NoInitAlloc(const NoInitAlloc<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(block_alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { block_free(p, n * sizeof(T)); }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
};

struct Uninit {};  // tag: a Mat whose entries the caller writes before reading

template <class R>
struct Mat {
  int64_t r = 0, c = 0;
  std::vector<R, NoInitAlloc<R>> a;
  Mat() = default;
  Mat(int64_t rows, int64_t cols) : r(rows), c(cols), a(static_cast<size_t>(rows * cols), R(0)) {}
  Mat(int64_t rows, int64_t cols, Uninit) : r(rows), c(cols), a(static_cast<size_t>(rows * cols)) {}
  R& operator()(int64_t i, int64_t j) { return a[i * c + j]; }
  const R& operator()(int64_t i, int64_t j) const { return a[i * c + j]; }
  R* row(int64_t i) { return a.data() + i * c; }
  const R* row(int64_t i) const { return a.data() + i * c; }
  bool empty() const { return a.empty(); }
  void zero() { std::fill(a.begin(), a.end(), R(0)); }
  MRef<R> ref() { return {a.data(), r, c, c}; }
  MRef<const R> ref() const { return {a.data(), r, c, c}; }
  MRef<R> rows(int64_t i0, int64_t i1) { return ref().rows(i0, i1); }
  MRef<const R> rows(int64_t i0, int64_t i1) const { return ref().rows(i0, i1); }
  operator MRef<R>() { return ref(); }
  operator MRef<const R>() const { return ref(); }
};

// Triangular structure a product may exploit (bit flags, combinable):
//   kALower: op(A)(i, k) = 0 for k > i (a causal mask), so the sum for row i stops at k = i;
//   kAUpper: op(A)(i, k) = 0 for k < i (a transposed causal mask), so it starts at k = i;
//   kCLower: only C(i, j), j <= i, is wanted; entries above the diagonal are left unspecified
//            (partly computed) and must not be read;
//   kCUnset: with kCLower in matmul or a gemm with beta = 0: the entries above the diagonal may
//            even be left unset (uninitialised memory: never read them, not even as zeros);
//   kCZero:  (gemm_rows) C is not read: each written entry starts from 0 (C = alpha op(A) B).
// In a product without kCLower (or with kCUnset) and beta = 0, every entry gemm must define is
// written from 0 in the tile loop, without a pass that zero-fills C first.
// A k where op(A) is zero adds an exact zero to a sum (B finite), so skipping it leaves the
// rounding of the lower triangle that of the full product.
enum : int { kTriNone = 0, kALower = 1, kAUpper = 2, kCLower = 4, kCUnset = 8, kCZero = 16 };

// C [m, n] += alpha op(A) [m, kk] x B [kk, n], B row-major, op(A)(i, k) = A[i sa_row + k sa_k],
// with the structure `tri` (linalg.cpp; on x86-64 also compiled for AVX2 + FMA and for AVX-512,
// the version picked at load time).
void gemm_rows(float* C, int64_t ldc, const float* A, int64_t sa_row, int64_t sa_k, const float* B,
               int64_t ldb, int64_t m, int64_t n, int64_t kk, float alpha, int tri);
void gemm_rows(double* C, int64_t ldc, const double* A, int64_t sa_row, int64_t sa_k,
               const double* B, int64_t ldb, int64_t m, int64_t n, int64_t kk, double alpha,
               int tri);

// bt [kk, n] = B [n, kk]^T, B's rows ldb apart (linalg.cpp; float in 8 x 8 register blocks).
void transpose(float* bt, const float* B, int64_t ldb, int64_t n, int64_t kk);
void transpose(double* bt, const double* B, int64_t ldb, int64_t n, int64_t kk);

// C = alpha * op(A) op(B) + beta * C, op = transpose when the flag is set. Every case runs as
// row updates c_i += a * b_k with a unit-stride inner loop (what the compiler vectorises): a
// transposed B is first copied to B^T [kk, n] (kk n copies against m n kk multiply-adds).
// Rounding: each C(i, j) is summed over k in order, as the plain triple loop does.
// `tri`: the structure flags above (kTriNone: a dense product).
template <class R>
void gemm(MRef<R> C, MRef<const R> A, bool tA, MRef<const R> B, bool tB, R alpha = R(1),
          R beta = R(0), int tri = kTriNone) {
  const int64_t m = C.r, n = C.c, kk = tA ? A.r : A.c;
  tri &= ~kCZero;
  if (beta == R(0)) {
    if ((tri & kCLower) && !(tri & kCUnset)) {
      for (int64_t i = 0; i < m; ++i) std::fill(C.row(i), C.row(i) + n, R(0));
    } else if (m == 0 || n == 0 || kk == 0) {  // C = 0 (no product to write it)
      for (int64_t i = 0; i < m; ++i) std::fill(C.row(i), C.row(i) + n, R(0));
      return;
    } else {
      tri |= kCZero;
    }
  } else if (beta != R(1)) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) C(i, j) *= beta;
  }
  if (m == 0 || n == 0 || kk == 0) return;
  constexpr int64_t kStack = 4096;  // B^T of up to 4096 elements lives on the stack
  R st[kStack];
  std::vector<R> heap;
  if (tB) {  // B [n, kk] -> B^T [kk, n]
    R* bt = st;
    if (kk * n > kStack) {
      heap.resize(static_cast<size_t>(kk * n));
      bt = heap.data();
    }
    transpose(bt, B.p, B.ld, n, kk);
    B = MRef<const R>{bt, kk, n, n};
  }
  const int64_t sa_row = tA ? 1 : A.ld, sa_k = tA ? A.ld : 1;  // op(A)(i, k) = A.p[i sa_row + k sa_k]
  gemm_rows(C.p, C.ld, A.p, sa_row, sa_k, B.p, B.ld, m, n, kk, alpha, tri);
}

template <class R>
Mat<R> matmul(MRef<const R> A, bool tA, MRef<const R> B, bool tB, int tri = kTriNone) {
  const int64_t m = tA ? A.c : A.r, n = tB ? B.r : B.c;
  if ((tri & kCLower) && !(tri & kCUnset)) {  // zero-filled: accumulate into it (beta = 1)
    Mat<R> C(m, n);
    gemm<R>(C, A, tA, B, tB, R(1), R(1), tri);
    return C;
  }
  Mat<R> C(m, n, Uninit{});  // every entry read is written by gemm (beta = 0)
  gemm<R>(C, A, tA, B, tB, R(1), R(0), tri);
  return C;
}

// Y += alpha * X (same shape)
template <class R>
void axpy(MRef<R> Y, MRef<const R> X, R alpha = R(1)) {
  for (int64_t i = 0; i < Y.r; ++i) {
    R* y = Y.row(i);
    const R* x = X.row(i);
    for (int64_t j = 0; j < Y.c; ++j) y[j] += alpha * x[j];
  }
}

template <class R>
void scale(MRef<R> Y, R alpha) {
  for (int64_t i = 0; i < Y.r; ++i)
    for (int64_t j = 0; j < Y.c; ++j) Y(i, j) *= alpha;
}

template <class R>
R dot(MRef<const R> A, MRef<const R> B) {  // Frobenius inner product
  R s = 0;
  for (int64_t i = 0; i < A.r; ++i)
    for (int64_t j = 0; j < A.c; ++j) s += A(i, j) * B(i, j);
  return s;
}

// out[j] = x[j] * y[j], j < n (restrict parameters: the loop vectorises)
template <class R>
void hadamard(R* __restrict out, const R* __restrict x, const R* __restrict y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = x[j] * y[j];
}

// y[j] *= x[j], j < n
template <class R>
void hadamard_into(R* __restrict y, const R* __restrict x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] *= x[j];
}

// out[j] = a * x[j], j < n
template <class R>
void scaled(R* __restrict out, const R* __restrict x, R a, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = x[j] * a;
}

// sum_i a[i] b[i] in 8 interleaved partial sums (independent chains, vectorisable; the order is
// fixed per n), added pairwise at the end.
template <class R>
R dot(const R* a, const R* b, int64_t n) {
  R p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; ++u) p[u] += a[i + u] * b[i + u];
  R s = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One row of the mask backward over its n entries j <= i: with dG = dP o D o M,
//   dD[j] = dP[j] M[j],  gc[j] += dG[j],  returns sum_j dG[j]
// (the sum in 8 interleaved partial sums: vectorisable, the order fixed per n).
template <class R>
R mask_row_backward(const R* __restrict dP, const R* __restrict D, const R* __restrict M,
                    R* __restrict dD, R* __restrict gc, int64_t n) {
  R p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int u = 0; u < 8; ++u) {
      const R g = dP[j + u] * D[j + u] * M[j + u];
      dD[j + u] = dP[j + u] * M[j + u];
      gc[j + u] += g;
      p[u] += g;
    }
  R s = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
  for (; j < n; ++j) {
    const R g = dP[j] * D[j] * M[j];
    dD[j] = dP[j] * M[j];
    gc[j] += g;
    s += g;
  }
  return s;
}

// T [n, n] = (I + tril_-1(diag(s) A))^-1 for A [n, n] (rows lda apart; only its strict lower
// triangle is read; s [n] or null = ones), unit lower triangular with every entry of T written
// (zeros above the diagonal), by forward substitution:
//   T[i, :i] = -sum_{k<i} s_i A[i,k] T[k, :i]
// each T(i, j) summed over k in order (a k with s_i A[i,k] = 0 skipped). Rows go four at a time
// in column blocks held in registers (linalg.cpp; on x86-64 also compiled for AVX2 + FMA and
// picked at load time).
void unit_lower_inverse(float* T, int64_t ldt, const float* A, int64_t lda, const float* s,
                        int64_t n);
void unit_lower_inverse(double* T, int64_t ldt, const double* A, int64_t lda, const double* s,
                        int64_t n);

}  // namespace hila::cpu
