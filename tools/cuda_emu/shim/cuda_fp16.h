// SPDX-License-Identifier: Apache-2.0
#pragma once
#include <cstdint>
#include <cstring>
#include <cuda_runtime.h>
struct __half {
  _Float16 x;
  operator float() const { return float(x); }
};
struct __half2 { __half x, y; };
inline __half __float2half_rn(float f) { return __half{_Float16(f)}; }
inline float __half2float(__half h) { return float(h.x); }
inline __half2 __floats2half2_rn(float lo, float hi) { return {__float2half_rn(lo), __float2half_rn(hi)}; }
inline float2 __half22float2(__half2 v) { return {float(v.x), float(v.y)}; }
