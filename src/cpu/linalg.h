// SPDX-License-Identifier: Apache-2.0
// Small dense row-major matrices and the GEMM loops the CPU forms are written in.
// Deliberately plain: the CPU backend is the reference and the oracle, not the fast path.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

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

template <class R>
struct Mat {
  int64_t r = 0, c = 0;
  std::vector<R> a;
  Mat() = default;
  Mat(int64_t rows, int64_t cols) : r(rows), c(cols), a(static_cast<size_t>(rows * cols), R(0)) {}
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

// C = alpha * op(A) op(B) + beta * C, op = transpose when the flag is set.
template <class R>
void gemm(MRef<R> C, MRef<const R> A, bool tA, MRef<const R> B, bool tB, R alpha = R(1),
          R beta = R(0)) {
  const int64_t m = C.r, n = C.c, kk = tA ? A.r : A.c;
  if (beta == R(0)) {
    for (int64_t i = 0; i < m; ++i) std::fill(C.row(i), C.row(i) + n, R(0));
  } else if (beta != R(1)) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) C(i, j) *= beta;
  }
  if (!tA && !tB) {  // rows of C accumulate rows of B: unit-stride inner loop
    for (int64_t i = 0; i < m; ++i) {
      R* c = C.row(i);
      for (int64_t k = 0; k < kk; ++k) {
        const R a = alpha * A(i, k);
        if (a == R(0)) continue;
        const R* b = B.row(k);
        for (int64_t j = 0; j < n; ++j) c[j] += a * b[j];
      }
    }
  } else if (!tA && tB) {  // dot products of rows
    for (int64_t i = 0; i < m; ++i) {
      const R* a = A.row(i);
      for (int64_t j = 0; j < n; ++j) {
        const R* b = B.row(j);
        R s = 0;
        for (int64_t k = 0; k < kk; ++k) s += a[k] * b[k];
        C(i, j) += alpha * s;
      }
    }
  } else if (tA && !tB) {  // outer-product accumulation over k
    for (int64_t k = 0; k < kk; ++k) {
      const R* a = A.row(k);
      const R* b = B.row(k);
      for (int64_t i = 0; i < m; ++i) {
        const R ai = alpha * a[i];
        if (ai == R(0)) continue;
        R* c = C.row(i);
        for (int64_t j = 0; j < n; ++j) c[j] += ai * b[j];
      }
    }
  } else {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        R s = 0;
        for (int64_t k = 0; k < kk; ++k) s += A(k, i) * B(j, k);
        C(i, j) += alpha * s;
      }
  }
}

template <class R>
Mat<R> matmul(MRef<const R> A, bool tA, MRef<const R> B, bool tB) {
  Mat<R> C(tA ? A.c : A.r, tB ? B.r : B.c);
  gemm<R>(C, A, tA, B, tB);
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

template <class R>
R dot(const R* a, const R* b, int64_t n) {
  R s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// (I + N)^-1 for strictly lower-triangular N [n, n], by forward substitution row by row:
// T[i, :i] = -sum_{k<i} N[i,k] T[k, :i]  (unit lower result, unit-stride inner loop).
template <class R>
Mat<R> unit_lower_inverse(const Mat<R>& N) {
  const int64_t n = N.r;
  Mat<R> T(n, n);
  for (int64_t i = 0; i < n; ++i) {
    R* ti = T.row(i);
    for (int64_t k = 0; k < i; ++k) {
      const R a = N(i, k);
      if (a == R(0)) continue;
      const R* tk = T.row(k);
      for (int64_t j = 0; j <= k; ++j) ti[j] -= a * tk[j];
    }
    ti[i] = 1;
  }
  return T;
}

}  // namespace hila::cpu
