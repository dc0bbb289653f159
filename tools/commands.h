// SPDX-License-Identifier: Apache-2.0
// Subcommands of the `hila` CLI. Each add_* registers its options on a new subcommand and returns
// the function that runs it; main parses first and runs afterwards, so a hila::Error thrown by a
// command is never mistaken for a usage error.
#pragma once
#include <chrono>
#include <functional>
#include <string>

#include <CLI/CLI.hpp>

#include "hila/ops.h"

namespace hila::tools {

// Exit codes (docs/CLI.md).
constexpr int kExitOk = 0;
constexpr int kExitCheckFailed = 1;  // verify found a mismatch, demo an error above tolerance
constexpr int kExitBadInput = 2;     // hila::Error, unreadable file, bad command line
constexpr int kExitInternal = 3;     // any other exception (a bug in hila or the CLI)

struct Command {
  CLI::App* app;
  std::function<int()> run;
};

Command add_run_command(CLI::App& app);
Command add_verify_command(CLI::App& app);
Command add_demo_command(CLI::App& app);

// --device: the CLI works on host buffers, so only "cpu" is accepted (hila::Error otherwise).
void add_device_option(CLI::App* sub, std::string& device);
Device parse_device(const std::string& name);

// Progress for work that takes more than a second: a '\r'-rewritten line when stderr is a
// terminal, otherwise a plain line at most every few seconds (so logs stay short).
class Progress {
 public:
  explicit Progress(std::string title);
  ~Progress();
  void update(const std::string& what, int done, int total);
  void finish();

 private:
  std::string title_;
  bool tty_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace hila::tools
