// SPDX-License-Identifier: Apache-2.0
#pragma once
#include <cstdint>
#include <cstring>
#include <cuda_runtime.h>
// Value conversions as CUDA's: __nv_bfloat16(float) rounds to nearest even (a plain aggregate
// would take the float's integer part as the bit pattern); from_bits builds a raw pattern.
struct __nv_bfloat16 {
  uint16_t x;
  __nv_bfloat16() = default;
  static __nv_bfloat16 from_bits(uint16_t b) { __nv_bfloat16 v; v.x = b; return v; }
  __nv_bfloat16(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { x = uint16_t((u >> 16) | 0x40u); return; }  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    x = uint16_t(u >> 16);
  }
  __nv_bfloat16(double d) : __nv_bfloat16(float(d)) {}
  __nv_bfloat16(int i) : __nv_bfloat16(float(i)) {}
  operator float() const { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) { return {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {float(v.x), float(v.y)}; }
