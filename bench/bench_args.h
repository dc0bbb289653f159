// SPDX-License-Identifier: Apache-2.0
// Command-line parsing shared by the host benchmarks (cpu_bench.cpp, host_bench.cpp).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace hila::bench {

// The value of the flag at argv[i], argv[i + 1], advancing i past it; a flag with no value ends
// the program with status 2 and "<flag> needs a value" on stderr.
inline std::string flag_value(int argc, char** argv, int& i) {
  if (i + 1 >= argc) {
    std::fprintf(stderr, "%s needs a value\n", argv[i]);
    std::exit(2);
  }
  return argv[++i];
}

}  // namespace hila::bench
