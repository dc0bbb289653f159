// SPDX-License-Identifier: Apache-2.0
#pragma once
#include <stdexcept>
#include <string>

namespace hila {

// Every public entry point reports bad input by throwing hila::Error. The message names the
// argument, what was expected and what was given, e.g.
//   "hila: argument 'k': expected shape [2, 100, 4, 64] (same as q), got [2, 99, 4, 64]"
class Error : public std::runtime_error {
 public:
  Error(std::string arg, const std::string& what)
      : std::runtime_error("hila: argument '" + arg + "': " + what), arg_(std::move(arg)) {}
  // The argument named in the message ("q", "cu_seqlens", "chunk", "op", ...).
  const std::string& argument() const { return arg_; }

 private:
  std::string arg_;
};

}  // namespace hila
