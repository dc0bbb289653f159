// SPDX-License-Identifier: Apache-2.0
#include "safetensors.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <vector>

#include <nlohmann/json.hpp>

namespace hila::tools {

// Tensor bytes are copied as they are, so the host must be little-endian like the format.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

using nlohmann::json;

// Same cap as the reference implementation: a header this large is corrupt, not big.
constexpr uint64_t kMaxHeader = 100u << 20;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw SafetensorsError("safetensors file '" + path + "': " + what);
}

[[noreturn]] void fail_tensor(const std::string& path, const std::string& name, const std::string& what) {
  fail(path, "tensor '" + name + "': " + what);
}

std::vector<int64_t> parse_shape(const std::string& path, const std::string& name, const json& j) {
  if (!j.is_array()) fail_tensor(path, name, "'shape' must be an array of integers");
  if (j.empty()) fail_tensor(path, name, "scalar (0-d) tensors are not supported");
  if (j.size() > size_t(kMaxDims))
    fail_tensor(path, name, "rank " + std::to_string(j.size()) + " exceeds " + std::to_string(kMaxDims));
  std::vector<int64_t> shape;
  for (const json& d : j) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0)
      fail_tensor(path, name, "'shape' must hold non-negative integers, got " + j.dump());
    shape.push_back(d.get<int64_t>());
  }
  return shape;
}

// numel x element size, or max() on overflow (which then fails the size check).
uint64_t byte_size(const std::vector<int64_t>& shape, DType dt) {
  uint64_t n = uint64_t(dtype_size(dt));
  for (int64_t d : shape) {
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / uint64_t(d))
      return std::numeric_limits<uint64_t>::max();
    n *= uint64_t(d);
  }
  return n;
}

}  // namespace

const char* safetensors_dtype(DType dt) {
  switch (dt) {
    case DType::f64: return "F64";
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
  }
  return "?";
}

DType parse_safetensors_dtype(const std::string& name) {
  for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64})
    if (name == safetensors_dtype(dt)) return dt;
  throw std::invalid_argument("unsupported dtype '" + name + "' (hila reads F64, F32, BF16, F16, I32, I64)");
}

Safetensors read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, std::string("cannot open for reading: ") + std::strerror(errno));
  const std::vector<unsigned char> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail(path, "read error");

  if (file.size() < 8) fail(path, "shorter than the 8-byte header length");
  uint64_t hlen;
  std::memcpy(&hlen, file.data(), 8);
  if (hlen > kMaxHeader) fail(path, "header length " + std::to_string(hlen) + " exceeds 100 MiB");
  if (hlen > file.size() - 8)
    fail(path, "header length " + std::to_string(hlen) + " runs past the end of the file (" +
                   std::to_string(file.size()) + " bytes)");
  const char* hbegin = reinterpret_cast<const char*>(file.data() + 8);
  json header;
  try {
    header = json::parse(hbegin, hbegin + hlen);
  } catch (const json::parse_error& e) {
    fail(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail(path, "header must be a JSON object");

  const unsigned char* data = file.data() + 8 + hlen;
  const uint64_t data_size = file.size() - 8 - hlen;
  Safetensors out;
  struct Range {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Range> ranges;

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(path, "'__metadata__' must be an object of strings");
      for (const auto& [key, val] : entry.items()) {
        if (!val.is_string()) fail(path, "'__metadata__' entry '" + key + "' must be a string");
        out.metadata[key] = val.get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) fail_tensor(path, name, "entry must be an object");
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!entry.contains(key)) fail_tensor(path, name, std::string("missing '") + key + "'");
    if (!entry["dtype"].is_string()) fail_tensor(path, name, "'dtype' must be a string");
    DType dt;
    try {
      dt = parse_safetensors_dtype(entry["dtype"].get<std::string>());
    } catch (const std::invalid_argument& e) {
      fail_tensor(path, name, e.what());
    }
    std::vector<int64_t> shape = parse_shape(path, name, entry["shape"]);
    const json& off = entry["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail_tensor(path, name, "'data_offsets' must be [begin, end] with non-negative integers");
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_size)
      fail_tensor(path, name, "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                                  "] lie outside the data section of " + std::to_string(data_size) + " bytes");
    const uint64_t want = byte_size(shape, dt);
    if (end - begin != want)
      fail_tensor(path, name, std::string("data_offsets span ") + std::to_string(end - begin) +
                                  " bytes, but shape " + shape_str(shape) + " of " +
                                  safetensors_dtype(dt) + " needs " + std::to_string(want));
    Buffer b(dt, std::move(shape));
    if (want) std::memcpy(b.bytes.data(), data + begin, size_t(want));
    out.tensors.emplace(name, std::move(b));
    if (want) ranges.push_back({begin, end, name});
  }

  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].begin < ranges[i - 1].end)
      fail(path, "tensors '" + ranges[i - 1].name + "' and '" + ranges[i].name + "' overlap");
  return out;
}

void write_safetensors(const std::string& path, const Safetensors& file) {
  json header = json::object();
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  uint64_t offset = 0;
  std::vector<const Buffer*> order;
  for (const auto& [name, b] : file.tensors) {
    if (b.empty()) continue;
    if (name == "__metadata__") throw SafetensorsError("safetensors: '__metadata__' is not a tensor name");
    const uint64_t n = b.bytes.size();
    header[name] = {{"dtype", safetensors_dtype(b.dtype)}, {"shape", b.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
    order.push_back(&b);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t hlen = text.size();

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail(path, std::string("cannot open for writing: ") + std::strerror(errno));
  out.write(reinterpret_cast<const char*>(&hlen), 8);
  out.write(text.data(), std::streamsize(text.size()));
  for (const Buffer* b : order) out.write(reinterpret_cast<const char*>(b->bytes.data()), std::streamsize(b->bytes.size()));
  out.close();
  if (!out) fail(path, "write error");
}

}  // namespace hila::tools
