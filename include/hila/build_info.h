// SPDX-License-Identifier: Apache-2.0
// What this build of hila contains, and whether its CUDA backend can run here.
#pragma once
#include <string>
#include <vector>

namespace hila {

struct BuildInfo {
  std::string version;  // "MAJOR.MINOR.PATCH", as HILA_VERSION_STRING of <hila/version.h>
  int version_major = 0, version_minor = 0, version_patch = 0;
  bool cuda = false;                    // the CUDA backend is compiled in
  std::string cuda_version;             // the CUDA toolkit it was compiled with ("" without CUDA)
  std::vector<std::string> cuda_archs;  // device code ("sm_90a", "sm_80") and PTX ("compute_90")
  std::string cuda_gencode;             // the nvcc -gencode flags behind cuda_archs
  bool openmp = false;                  // CPU backend parallel over sequences x heads
  std::string openmp_version;           // OpenMP specification version, e.g. "4.5"
  std::string compiler;                 // C++ compiler id and version, e.g. "GNU 12.2.0"
  std::string build_type;               // CMake build type, e.g. "Release"
};

// Fixed at build time; the same object on every call.
const BuildInfo& build_info();

// CUDA devices this process can use: 0 without the CUDA backend, without a driver new enough for
// the CUDA runtime hila was built with, or without a device. When 0 and `why` is given, *why says
// which (the CUDA runtime's message); otherwise *why is cleared.
int cuda_device_count(std::string* why = nullptr);

}  // namespace hila
