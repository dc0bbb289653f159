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

// Reads and validates, reading only what the header describes: a regular file (directories,
// devices, FIFOs and sockets are errors), a header of at most 100 MiB inside the file, JSON nested
// at most 8 deep without duplicate keys, known dtypes, shapes of integers in [0, 2^63) of rank
// 1..6 whose bytes fit in int64, data_offsets inside the data section with sizes equal to
// numel x dtype size, and a data section that is exactly the tensors: no overlap, no gap, no
// trailing bytes (zero-size tensors take no bytes, at any offset inside the section). The tensor
// bytes are checked against hila::memory_limit() before anything is allocated, then read with
// bounded reads.
Safetensors read_safetensors(const std::string& path);
// Writes tensors in name order, contiguously; the header is space-padded to a multiple of 8 bytes
// so that every tensor starts 8-byte aligned. Absent (empty) buffers are skipped. Atomic: the
// bytes go to a temporary file in the target's directory, fsync'ed, then renamed over the target
// (a symbolic link is followed), so a failed write (disk full, a file-size limit) leaves the
// previous file intact. The target must be a regular file or not exist.
void write_safetensors(const std::string& path, const Safetensors& file);
// An output path that may be written: not a directory, device or other non-regular file, and not
// the same file as `in` (device and inode compared, so another path to it is caught too).
void check_output_path(const std::string& out, const std::string& in);

// The tensors of a `hila run` input file (q k v g lam beta cu_seqlens h0.*; do dht.* with
// backward) as a Problem; the tensors taken are removed from f (what is left is ignored).
Problem problem_from_file(const OpConfig& cfg, Safetensors& f, bool backward);

}  // namespace hila::tools
