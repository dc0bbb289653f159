// SPDX-License-Identifier: Apache-2.0
// The safetensors file format (https://github.com/huggingface/safetensors): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
// {string: string}}, then the raw little-endian tensor bytes (offsets relative to their start).
#pragma once
#include <map>
#include <stdexcept>
#include <string>

#include "problem.h"

namespace hila::tools {

// Malformed or unreadable files. The message names the file and, where there is one, the tensor.
class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Safetensors {
  std::map<std::string, Buffer> tensors;
  std::map<std::string, std::string> metadata;
};

// "F64", "F32", "BF16", "F16", "I32", "I64" <-> hila dtypes; other names throw.
const char* safetensors_dtype(DType dt);
DType parse_safetensors_dtype(const std::string& name);

// Reads and validates: header inside the file, known dtypes, shapes of non-negative integers of
// rank 1..6, data_offsets inside the data section, sizes equal to numel x dtype size, no overlap.
Safetensors read_safetensors(const std::string& path);
// Writes tensors in name order, contiguously; the header is space-padded to a multiple of 8 bytes
// so that every tensor starts 8-byte aligned. Absent (empty) buffers are skipped.
void write_safetensors(const std::string& path, const Safetensors& file);

}  // namespace hila::tools
