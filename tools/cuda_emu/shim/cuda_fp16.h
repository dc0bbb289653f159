// SPDX-License-Identifier: Apache-2.0
#pragma once
#include <cstdint>
#include <cstring>
struct __half {
  _Float16 x;
  operator float() const { return float(x); }
};
inline __half __float2half_rn(float f) { return __half{_Float16(f)}; }
inline float __half2float(__half h) { return float(h.x); }
