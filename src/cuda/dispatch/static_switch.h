// SPDX-License-Identifier: Apache-2.0
// Runtime values to compile-time constants, one idiom for all of them (as Mamba's static_switch.h):
//
//   HILA_BOOL_SWITCH(a.fenwick, kFenwick, [&] { launch<kFenwick>(a); });
//
// The last argument is a lambda; it is called with NAME declared constexpr (or, for the dtype, as a
// type alias) in its enclosing scope, once per case, and the switch returns what it returns. Every
// case is instantiated, so the lambda must compile for each.
#pragma once
#include <string>

#include "hila/error.h"
#include "hila/tensor.h"

// cond ? NAME = true : NAME = false
#define HILA_BOOL_SWITCH(COND, NAME, ...) \
  [&] {                                   \
    if (COND) {                           \
      constexpr bool NAME = true;         \
      return __VA_ARGS__();               \
    } else {                              \
      constexpr bool NAME = false;        \
      return __VA_ARGS__();               \
    }                                     \
  }()

// The operand type T of a floating DType (bf16, f16, f32, f64); any other dtype is an error naming q.
#define HILA_DTYPE_SWITCH(DT, T, ...)                                                                         \
  [&] {                                                                                                       \
    switch (DT) {                                                                                             \
      case ::hila::DType::bf16: {                                                                             \
        using T = __nv_bfloat16;                                                                              \
        return __VA_ARGS__();                                                                                 \
      }                                                                                                       \
      case ::hila::DType::f16: {                                                                              \
        using T = __half;                                                                                     \
        return __VA_ARGS__();                                                                                 \
      }                                                                                                       \
      case ::hila::DType::f32: {                                                                              \
        using T = float;                                                                                      \
        return __VA_ARGS__();                                                                                 \
      }                                                                                                       \
      case ::hila::DType::f64: {                                                                              \
        using T = double;                                                                                     \
        return __VA_ARGS__();                                                                                 \
      }                                                                                                       \
      default:                                                                                                \
        throw ::hila::Error("q", std::string("expected a floating dtype, got ") + ::hila::dtype_name(DT)); \
    }                                                                                                         \
  }()

// A head dim of the sm90 kernels: 128, or 64 for any other value (callers check it is 64 or 128).
#define HILA_HEADDIM_SWITCH(D, NAME, ...) \
  [&] {                                   \
    if ((D) == 128) {                     \
      constexpr int NAME = 128;           \
      return __VA_ARGS__();               \
    } else {                              \
      constexpr int NAME = 64;            \
      return __VA_ARGS__();               \
    }                                     \
  }()

// Ring stages of the sm90 sweep (heuristics::gla_sm90_sweep_stages): 3, 4, 6, or 8 for any other value.
#define HILA_SM90_STAGES_SWITCH(S, NAME, ...) \
  [&] {                                       \
    if ((S) == 3) {                           \
      constexpr int NAME = 3;                 \
      return __VA_ARGS__();                   \
    } else if ((S) == 4) {                    \
      constexpr int NAME = 4;                 \
      return __VA_ARGS__();                   \
    } else if ((S) == 6) {                    \
      constexpr int NAME = 6;                 \
      return __VA_ARGS__();                   \
    } else {                                  \
      constexpr int NAME = 8;                 \
      return __VA_ARGS__();                   \
    }                                         \
  }()

// State rows per thread of the decode step (heuristics::step_rows): 4, 8, 16, 32, or 64 for any
// other value.
#define HILA_STEP_ROWS_SWITCH(ROWS, NAME, ...) \
  [&] {                                        \
    if ((ROWS) == 4) {                         \
      constexpr int NAME = 4;                  \
      return __VA_ARGS__();                    \
    } else if ((ROWS) == 8) {                  \
      constexpr int NAME = 8;                  \
      return __VA_ARGS__();                    \
    } else if ((ROWS) == 16) {                 \
      constexpr int NAME = 16;                 \
      return __VA_ARGS__();                    \
    } else if ((ROWS) == 32) {                 \
      constexpr int NAME = 32;                 \
      return __VA_ARGS__();                    \
    } else {                                   \
      constexpr int NAME = 64;                 \
      return __VA_ARGS__();                    \
    }                                          \
  }()

// Ring stages of the delta rule's sm90 sweeps (heuristics::delta_sm90_sweep_stages): 2, 3, or 4 for any other value.
#define HILA_DELTA_STAGES_SWITCH(S, NAME, ...) \
  [&] {                                        \
    if ((S) == 2) {                            \
      constexpr int NAME = 2;                  \
      return __VA_ARGS__();                    \
    } else if ((S) == 3) {                     \
      constexpr int NAME = 3;                  \
      return __VA_ARGS__();                    \
    } else {                                   \
      constexpr int NAME = 4;                  \
      return __VA_ARGS__();                    \
    }                                          \
  }()
