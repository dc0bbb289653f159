// SPDX-License-Identifier: Apache-2.0
#pragma once
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 {
  uint16_t x;
  operator float() const { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{uint16_t(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
