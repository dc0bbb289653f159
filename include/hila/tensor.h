// SPDX-License-Identifier: Apache-2.0
// Non-owning, device-agnostic tensor views. Strides are in elements, not bytes.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace hila {

enum class DType : int { f64, f32, bf16, f16, i32, i64 };
enum class DeviceType : int { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
};

const char* dtype_name(DType t);
int dtype_size(DType t);
bool is_float(DType t);
std::string device_name(Device d);

constexpr int kMaxDims = 6;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  int ndim = -1;  // -1: absent (optional argument not given)
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};

  bool defined() const { return ndim >= 0; }
  int64_t size(int i) const { return shape[i < 0 ? i + ndim : i]; }
  int64_t numel() const;
  bool contiguous() const;
  std::string shape_str() const;

  // A contiguous (row-major) view over `data`.
  static TensorView contiguous_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                    Device device = {});
  static TensorView contiguous_view(void* data, DType dtype, const int64_t* shape, int ndim,
                                    Device device = {});
};

}  // namespace hila
