// SPDX-License-Identifier: Apache-2.0
// Strided element access with dtype conversion (host memory). bf16/f16 are converted with
// round-to-nearest-even on store.
#pragma once
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "hila/tensor.h"

namespace hila::detail {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline int64_t offset(const TensorView& t, std::initializer_list<int64_t> idx) {
  int64_t o = 0;
  int i = 0;
  for (int64_t x : idx) o += x * t.stride[i++];
  return o;
}

inline double load(const TensorView& t, int64_t off) {
  const char* p = static_cast<const char*>(t.data);
  switch (t.dtype) {
    case DType::f64: return reinterpret_cast<const double*>(p)[off];
    case DType::f32: return reinterpret_cast<const float*>(p)[off];
    case DType::bf16: return bf16_to_float(reinterpret_cast<const uint16_t*>(p)[off]);
    case DType::f16: return static_cast<double>(reinterpret_cast<const _Float16*>(p)[off]);
    case DType::i32: return reinterpret_cast<const int32_t*>(p)[off];
    case DType::i64: return static_cast<double>(reinterpret_cast<const int64_t*>(p)[off]);
  }
  return 0;
}

inline int64_t load_int(const TensorView& t, int64_t off) {
  const char* p = static_cast<const char*>(t.data);
  if (t.dtype == DType::i64) return reinterpret_cast<const int64_t*>(p)[off];
  if (t.dtype == DType::i32) return reinterpret_cast<const int32_t*>(p)[off];
  return static_cast<int64_t>(load(t, off));
}

inline void store(const TensorView& t, int64_t off, double x) {
  char* p = static_cast<char*>(t.data);
  switch (t.dtype) {
    case DType::f64: reinterpret_cast<double*>(p)[off] = x; break;
    case DType::f32: reinterpret_cast<float*>(p)[off] = static_cast<float>(x); break;
    case DType::bf16: reinterpret_cast<uint16_t*>(p)[off] = float_to_bf16(static_cast<float>(x)); break;
    case DType::f16: reinterpret_cast<_Float16*>(p)[off] = static_cast<_Float16>(x); break;
    case DType::i32: reinterpret_cast<int32_t*>(p)[off] = static_cast<int32_t>(x); break;
    case DType::i64: reinterpret_cast<int64_t*>(p)[off] = static_cast<int64_t>(x); break;
  }
}

inline void store_int(const TensorView& t, int64_t off, int64_t x) {
  char* p = static_cast<char*>(t.data);
  if (t.dtype == DType::i64) reinterpret_cast<int64_t*>(p)[off] = x;
  else if (t.dtype == DType::i32) reinterpret_cast<int32_t*>(p)[off] = static_cast<int32_t>(x);
  else store(t, off, static_cast<double>(x));
}

// n bytes from src to dst in 32-byte pieces (fixed-size copies the compiler inlines as register
// moves: a short row costs no library call).
inline void copy_bytes(void* dst, const void* src, size_t n) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  for (; n >= 32; n -= 32, d += 32, s += 32) std::memcpy(d, s, 32);
  for (; n >= 4; n -= 4, d += 4, s += 4) std::memcpy(d, s, 4);
  for (; n > 0; --n) *d++ = *s++;
}

// Rows of n elements at `off` (innermost stride 1, as validation guarantees), converted to R.
template <class R>
inline void load_row(const TensorView& t, int64_t off, R* dst, int64_t n) {
  if (n <= 0) return;  // an empty row may have no data pointer
  if (t.dtype == DType::f32 && sizeof(R) == 4) {
    copy_bytes(dst, static_cast<const float*>(t.data) + off, n * sizeof(R));
  } else if (t.dtype == DType::f64 && sizeof(R) == 8) {
    copy_bytes(dst, static_cast<const double*>(t.data) + off, n * sizeof(R));
  } else {
    for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<R>(load(t, off + c));
  }
}

template <class R>
inline void store_row(const TensorView& t, int64_t off, const R* src, int64_t n) {
  if (n <= 0) return;
  if (t.dtype == DType::f32 && sizeof(R) == 4) {
    copy_bytes(static_cast<float*>(t.data) + off, src, n * sizeof(R));
  } else if (t.dtype == DType::f64 && sizeof(R) == 8) {
    copy_bytes(static_cast<double*>(t.data) + off, src, n * sizeof(R));
  } else {
    for (int64_t c = 0; c < n; ++c) store(t, off + c, static_cast<double>(src[c]));
  }
}

}  // namespace hila::detail
