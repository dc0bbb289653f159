// SPDX-License-Identifier: Apache-2.0
#include "hila/tensor.h"

#include <limits>
#include <string>

namespace hila {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f64: return "float64";
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
  }
  return "?";
}

int dtype_size(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::bf16: case DType::f16: return 2;
  }
  return 0;
}

bool is_float(DType t) { return t == DType::f64 || t == DType::f32 || t == DType::bf16 || t == DType::f16; }

std::string device_name(Device d) {
  return d.type == DeviceType::cpu ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

// Saturates at INT64_MAX instead of wrapping (validation rejects such shapes by name).
int64_t TensorView::numel() const {
  for (int i = 0; i < ndim; ++i)
    if (shape[i] == 0) return 0;
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i)
    if (__builtin_mul_overflow(n, shape[i], &n)) return std::numeric_limits<int64_t>::max();
  return n;
}

bool TensorView::contiguous() const {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != s) return false;
    s *= shape[i];
  }
  return true;
}

std::string TensorView::shape_str() const {
  if (!defined()) return "(absent)";
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

TensorView TensorView::contiguous_view(void* data, DType dtype, const int64_t* shape, int ndim,
                                       Device device) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = ndim;
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.stride[i] = s;
    s *= shape[i];
  }
  return t;
}

TensorView TensorView::contiguous_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                       Device device) {
  return contiguous_view(data, dtype, shape.begin(), static_cast<int>(shape.size()), device);
}

}  // namespace hila
