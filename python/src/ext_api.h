// SPDX-License-Identifier: Apache-2.0
// What hila._C shares with the package's other extension module, hila._torch_ops (the libtorch ops of
// python/src/torch_ops.cpp):
//
// * `Api`, a table of the C++ calls hila._C lends, published as the PyCapsule `hila._C._api`.
//   hila._torch_ops calls the library through it instead of linking its own copy: one copy of
//   libhila per process (one set of CUDA pools, caches and knobs), and a CUDA build does not ship
//   the kernels twice. Both modules are compiled by one CMake build from the same headers;
//   `version` and the struct sizes catch a table from another build.
// * the DLPack dtype / device codes as hila's types, with the errors both modules give for them
//   (hila._C reads DLPack arrays, hila._torch_ops reads at::Tensor through at::getDLDataType).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "hila/hila.h"

namespace hila_ext {

inline constexpr const char* kApiCapsule = "hila._C._api";
inline constexpr uint32_t kApiVersion = 2;

// A failed call: the hila::Error's message and argument (argument empty for other exceptions).
struct CallError {
  std::string what, argument;
};

// Every call returns false and fills *err instead of throwing across the modules' boundary.
// Device arrays reach the library only in a CUDA build: the calls reject them by name otherwise,
// as hila._C's own entry points do.
struct Api {
  uint32_t version;
  uint32_t forward_params_size;   // sizeof(hila::ForwardParams) in hila._C
  uint32_t backward_params_size;  // sizeof(hila::BackwardParams) in hila._C
  uint32_t cuda;                  // 1: hila._C has the CUDA backend (HILA_WITH_CUDA)
  bool (*forward)(const hila::ForwardParams& p, CallError* err) noexcept;
  bool (*backward)(const hila::BackwardParams& p, CallError* err) noexcept;
  bool (*forward_workspace)(const hila::ForwardParams& p, size_t* bytes, CallError* err) noexcept;
  bool (*backward_workspace)(const hila::BackwardParams& p, size_t* bytes, CallError* err) noexcept;
  // op and form by name; bwd_form: the form a backward of (op, form) runs (chunk where form has
  // no backward, as hila.torch differentiates scan and the serial forms without one)
  bool (*resolve)(const char* op, const char* form, hila::Op* op_out, hila::Form* form_out,
                  hila::Form* bwd_form_out, CallError* err) noexcept;
  uint32_t step_params_size;  // sizeof(hila::StepParams) in hila._C
  // hila::step on a caller-owned state (pos, S, P, H) under that state's lock, the one
  // hila._C's in-place steps take (keyed by the address of pos): two threads stepping one state
  // never lose an update. Errors as hila._C's step_inplace names them (state.pos, ...).
  bool (*step)(const hila::StepParams& p, const hila::StateView& state, CallError* err) noexcept;
};

// DLPack codes (dlpack.h): data type codes and device types hila takes.
enum : int { kDLInt = 0, kDLFloat = 2, kDLBfloat = 4 };
enum : int { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3 };

// The argument's name comes as a C string: a step reads a dozen tensors, and only an error needs a
// std::string of it.
inline hila::DType dtype_from_dlpack(const char* name, int code, int bits, int lanes) {
  if (lanes == 1) {
    if (code == kDLFloat && bits == 64) return hila::DType::f64;
    if (code == kDLFloat && bits == 32) return hila::DType::f32;
    if (code == kDLFloat && bits == 16) return hila::DType::f16;
    if (code == kDLBfloat && bits == 16) return hila::DType::bf16;
    if (code == kDLInt && bits == 32) return hila::DType::i32;
    if (code == kDLInt && bits == 64) return hila::DType::i64;
  }
  throw hila::Error(name, "expected dtype float64, float32, bfloat16, float16, int32 or int64, got DLPack "
                          "type code " + std::to_string(code) + " with " + std::to_string(bits) +
                          " bits x " + std::to_string(lanes) + " lanes");
}

inline hila::Device device_from_dlpack(const char* name, int type, int id) {
  if (type == kDLCPU || type == kDLCUDAHost) return {};
  if (type == kDLCUDA) return {hila::DeviceType::cuda, id};
  throw hila::Error(name, "expected an array in host or CUDA memory, got DLPack device type " +
                              std::to_string(type));
}

inline void check_ndim(const char* name, int64_t ndim) {
  if (ndim > hila::kMaxDims)
    throw hila::Error(name, "expected at most " + std::to_string(hila::kMaxDims) + " dimensions, got " +
                                std::to_string(ndim));
}

}  // namespace hila_ext
