// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the safetensors reader on arbitrary bytes. Every input must either parse or
// fail with SafetensorsError / hila::Error; anything else (another exception, a crash, a leak or
// an out-of-bounds access under AddressSanitizer, a read of more than the file) is a finding.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "hila/hila.h"
#include "safetensors.h"

namespace {
// The input as a file: a memfd, read through its /proc path like any --in file.
std::string as_file(const uint8_t* data, size_t size, int& fd) {
  fd = memfd_create("hila-fuzz", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  for (size_t off = 0; off < size;) {
    const ssize_t w = write(fd, data + off, size - off);
    if (w <= 0) std::abort();
    off += size_t(w);
  }
  return "/proc/self/fd/" + std::to_string(fd);
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  hila::set_memory_limit(int64_t(256) << 20);  // a huge declared tensor is an error, not an OOM
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  int fd = -1;
  const std::string path = as_file(data, size, fd);
  try {
    const hila::tools::Safetensors f = hila::tools::read_safetensors(path);
    for (const auto& [name, b] : f.tensors)
      if (b.bytes.size() != size_t(b.numel()) * size_t(hila::dtype_size(b.dtype))) std::abort();
  } catch (const hila::tools::SafetensorsError&) {
  } catch (const hila::Error&) {
  }
  close(fd);
  return 0;
}
