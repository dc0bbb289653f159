// SPDX-License-Identifier: Apache-2.0
#include "safetensors.h"

#include <fcntl.h>
#include <libgen.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

namespace hila::tools {

// Tensor bytes are copied as they are, so the host must be little-endian like the format.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

using nlohmann::json;

// Same cap as the reference implementation: a header this large is corrupt, not big.
constexpr uint64_t kMaxHeader = 100u << 20;
// JSON nesting a valid header never exceeds: {name: {"shape": [..], "data_offsets": [..]}}.
constexpr int kMaxDepth = 8;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw SafetensorsError("safetensors file '" + path + "': " + what);
}

[[noreturn]] void fail_tensor(const std::string& path, const std::string& name, const std::string& what) {
  fail(path, "tensor '" + name + "': " + what);
}

std::string errno_str() { return std::strerror(errno); }

// What a non-regular file is, for the error message.
const char* file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISFIFO(m)) return "a FIFO (pipe)";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

// An open file descriptor, closed on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

// Exactly n bytes at `offset` (pread: bounded, never past what the header describes).
void read_exact(const std::string& path, int fd, void* dst, uint64_t n, uint64_t offset) {
  auto* p = static_cast<unsigned char*>(dst);
  while (n > 0) {
    const size_t want = size_t(std::min<uint64_t>(n, uint64_t(1) << 30));
    const ssize_t got = ::pread(fd, p, want, off_t(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      fail(path, "read error at byte " + std::to_string(offset) + ": " + errno_str());
    }
    if (got == 0) fail(path, "ends at byte " + std::to_string(offset) + " (did it shrink while being read?)");
    p += got;
    n -= uint64_t(got);
    offset += uint64_t(got);
  }
}

std::vector<int64_t> parse_shape(const std::string& path, const std::string& name, const json& j) {
  if (!j.is_array()) fail_tensor(path, name, "'shape' must be an array of integers");
  if (j.empty()) fail_tensor(path, name, "scalar (0-d) tensors are not supported");
  if (j.size() > size_t(kMaxDims))
    fail_tensor(path, name, "rank " + std::to_string(j.size()) + " exceeds " + std::to_string(kMaxDims));
  std::vector<int64_t> shape;
  for (const json& d : j) {
    if (!(d.is_number_unsigned() || d.is_number_integer()) || d.get<int64_t>() < 0 ||
        (d.is_number_unsigned() && d.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())))
      fail_tensor(path, name, "'shape' must hold integers in [0, 2^63), got " + j.dump());
    shape.push_back(d.get<int64_t>());
  }
  return shape;
}

// numel x element size, or max() on overflow (which then fails the size check). Sizes after a 0
// still count: a shape whose non-zero sizes overflow is rejected even though it holds no element.
uint64_t byte_size(const std::vector<int64_t>& shape, DType dt) {
  uint64_t extent = uint64_t(dtype_size(dt));
  bool zero = false;
  for (int64_t d : shape) {
    zero = zero || d == 0;
    const uint64_t f = uint64_t(std::max<int64_t>(d, 1));
    if (extent > uint64_t(std::numeric_limits<int64_t>::max()) / f) return std::numeric_limits<uint64_t>::max();
    extent *= f;
  }
  return zero ? 0 : extent;
}

// The header as JSON; duplicate keys (at any level) and deep nesting are errors.
json parse_header(const std::string& path, const std::string& text) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  std::string duplicate;
  bool too_deep = false;
  json header;
  try {
    header = json::parse(text, [&](int depth, json::parse_event_t ev, json& parsed) {
      using E = json::parse_event_t;
      if (depth > kMaxDepth) too_deep = true;
      if (too_deep) return false;  // stop building the value; reported below
      if (ev == E::object_start) keys.emplace_back();
      if (ev == E::object_end && !keys.empty()) keys.pop_back();
      if (ev == E::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second &&
          duplicate.empty())
        duplicate = parsed.get<std::string>();
      return true;
    });
  } catch (const json::exception& e) {
    fail(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (too_deep) fail(path, "header nests deeper than " + std::to_string(kMaxDepth) + " levels");
  if (!duplicate.empty()) fail(path, "header has the key '" + duplicate + "' twice");
  return header;
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
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is rejected below).
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (f.fd < 0) fail(path, "cannot open for reading: " + errno_str());
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) fail(path, "cannot stat: " + errno_str());
  if (!S_ISREG(st.st_mode))
    fail(path, std::string("is ") + file_kind(st.st_mode) + ", not a regular file");
  const uint64_t size = uint64_t(st.st_size);
  if (size < 8) fail(path, "shorter than the 8-byte header length (" + std::to_string(size) + " bytes)");

  uint64_t hlen;
  read_exact(path, f.fd, &hlen, 8, 0);
  if (hlen > kMaxHeader) fail(path, "header length " + std::to_string(hlen) + " exceeds 100 MiB");
  if (hlen > size - 8)
    fail(path, "header length " + std::to_string(hlen) + " runs past the end of the file (" +
                   std::to_string(size) + " bytes)");
  std::string text(size_t(hlen), '\0');
  read_exact(path, f.fd, text.data(), hlen, 8);
  const json header = parse_header(path, text);
  if (!header.is_object()) fail(path, "header must be a JSON object");

  const uint64_t data_start = 8 + hlen, data_size = size - data_start;
  Safetensors out;
  struct Entry {
    std::string name;
    DType dt;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;

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
                                  " bytes, but shape " + shape_str(shape) + " of " + safetensors_dtype(dt) +
                                  (want == std::numeric_limits<uint64_t>::max()
                                       ? " has more bytes than int64 can count"
                                       : " needs " + std::to_string(want)));
    entries.push_back({name, dt, std::move(shape), begin, end});
  }

  // The data section is exactly the tensors, back to back in some order: no overlap, no gap, no
  // trailing bytes (as the reference implementation requires). Zero-size tensors take no bytes.
  std::vector<const Entry*> order;
  for (const Entry& e : entries)
    if (e.end > e.begin) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) { return a->begin < b->begin; });
  uint64_t expect = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i]->begin < expect)
      fail(path, "tensors '" + order[i - 1]->name + "' and '" + order[i]->name + "' overlap");
    if (order[i]->begin > expect)
      fail(path, "bytes [" + std::to_string(expect) + ", " + std::to_string(order[i]->begin) +
                     ") of the data section belong to no tensor (a gap before '" + order[i]->name + "')");
    expect = order[i]->end;
  }
  if (expect != data_size)
    fail(path, std::to_string(data_size - expect) + " trailing bytes after the " + std::to_string(expect) +
                   " bytes of tensor data the header describes");

  // Only now, with every size known and bounded by the file, allocate and read.
  const Entry* largest = nullptr;
  for (const Entry* e : order)
    if (!largest || e->end - e->begin > largest->end - largest->begin) largest = e;
  if (largest)
    check_memory(largest->name, int64_t(expect),
                 "the tensors of '" + path + "' (the largest: '" + largest->name + "', " +
                     std::to_string(largest->end - largest->begin) + " bytes)");
  for (Entry& e : entries) {
    Buffer b(e.dt, std::move(e.shape));
    if (e.end > e.begin) read_exact(path, f.fd, b.bytes.data(), e.end - e.begin, data_start + e.begin);
    out.tensors.emplace(e.name, std::move(b));
  }
  return out;
}

// ----------------------------------------------------------------------------------------------
// Writing

namespace {

// The path a write replaces: a symbolic link is followed to the file it names (when that exists).
std::string write_target(const std::string& path) {
  struct stat lst {};
  if (::lstat(path.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode)) {
    char buf[PATH_MAX];
    if (::realpath(path.c_str(), buf)) return buf;
  }
  return path;
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void write_all(const std::string& path, int fd, const void* src, size_t n) {
  const auto* p = static_cast<const unsigned char*>(src);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(path, std::string("write error: ") + errno_str() +
                     (errno == EFBIG ? " (the file-size limit, ulimit -f)" : "") +
                     "; the previous file, if any, is left as it was");
    }
    p += w;
    n -= size_t(w);
  }
}

}  // namespace

void check_output_path(const std::string& out, const std::string& in) {
  struct stat so {}, si {};
  if (::stat(out.c_str(), &so) != 0) return;  // a new file
  if (S_ISDIR(so.st_mode)) fail(out, "is a directory; --out needs a file path");
  if (!S_ISREG(so.st_mode))
    fail(out, std::string("is ") + file_kind(so.st_mode) + "; --out must name a regular file (it is replaced)");
  if (!in.empty() && ::stat(in.c_str(), &si) == 0 && si.st_dev == so.st_dev && si.st_ino == so.st_ino)
    fail(out, "is the input file '" + in + "' (the same file); writing it would replace the inputs");
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

  // Atomic replacement: a temporary file in the target's directory, written, fsync'ed, then
  // renamed over the target. A failed write (disk full, file-size limit) leaves the old file.
  const std::string target = write_target(path);
  check_output_path(target, "");
  std::string tmpl = dir_of(target) + "/.hila-out-XXXXXX";
  const int fd = ::mkostemp(tmpl.data(), O_CLOEXEC);
  if (fd < 0) fail(path, "cannot create a temporary file in '" + dir_of(target) + "': " + errno_str());
  const std::string tmp = tmpl;
  try {
    Fd guard(fd);
    struct stat old {};
    mode_t mode;
    if (::stat(target.c_str(), &old) == 0) {
      mode = old.st_mode & 07777;  // keep the permissions of the file being replaced
    } else {
      const mode_t mask = ::umask(0);
      ::umask(mask);
      mode = 0666 & ~mask;
    }
    if (::fchmod(fd, mode) != 0) fail(path, "cannot set permissions: " + errno_str());
    write_all(path, fd, &hlen, 8);
    write_all(path, fd, text.data(), text.size());
    for (const Buffer* b : order) write_all(path, fd, b->bytes.data(), b->bytes.size());
    if (::fsync(fd) != 0) fail(path, "fsync failed: " + errno_str() + "; the previous file, if any, is left as it was");
    guard.fd = -1;
    if (::close(fd) != 0) fail(path, "close failed: " + errno_str() + "; the previous file, if any, is left as it was");
    if (::rename(tmp.c_str(), target.c_str()) != 0) fail(path, "cannot replace the file: " + errno_str());
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  const Fd dir(::open(dir_of(target).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.fd >= 0) ::fsync(dir.fd);  // the rename itself, durable (best effort)
}

}  // namespace hila::tools
