// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: what `hila run` does with a file, the validator included. The first byte picks
// the operator, form, direction and options; the rest is a safetensors file whose tensors become
// the call (problem_from_file, as in the CLI). Every input must end in success or in
// SafetensorsError / hila::Error; anything else is a finding. Sizes are bounded by a 256 MiB
// memory limit, so a large declared shape must be refused up front, never allocated.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "hila/hila.h"
#include "problem.h"
#include "safetensors.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  hila::set_memory_limit(int64_t(256) << 20);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t sel = data[0];
  const int fd = memfd_create("hila-fuzz", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  if (size > 1 && write(fd, data + 1, size - 1) != ssize_t(size - 1)) std::abort();
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  hila::OpConfig cfg;
  cfg.op = hila::all_ops()[sel % 10];
  const hila::Form form = hila::all_forms()[(sel / 10) % 4];
  const bool backward = (sel / 40) % 2;
  cfg.normalize = (sel & 0x80) && hila::op_traits(cfg.op).hla_family;
  try {
    hila::tools::Safetensors f = hila::tools::read_safetensors(path);
    hila::tools::Problem p = hila::tools::problem_from_file(cfg, f, backward);
    if (!p.g.empty() && p.g.shape.size() == 4) p.spec.cfg.gates = hila::Gates::untied;
    if (backward && hila::supports(cfg.op, form, true))
      hila::tools::run_backward(p, form, 4);
    else
      hila::tools::run_forward(p, form, 4);
  } catch (const hila::tools::SafetensorsError&) {
  } catch (const hila::Error&) {
  }
  close(fd);
  return 0;
}
