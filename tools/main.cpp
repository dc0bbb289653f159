// SPDX-License-Identifier: Apache-2.0
// `hila`: run one operator call on safetensors files, cross-check every form, or demo prefill +
// decode. See docs/CLI.md.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <new>
#include <stdexcept>
#include <exception>
#include <iostream>

#include "commands.h"
#include "device.h"
#include "hila/error.h"
#include "safetensors.h"

namespace hila::tools {

void add_device_option(CLI::App* sub, std::string& device) {
  sub->add_option("--device", device,
                  "where to run: cpu, cuda, cuda:N, or auto (the first GPU when there is one, else the CPU)")
      ->capture_default_str();
}

Device parse_device(const std::string& name) { return parse_device_name(name); }

Progress::Progress(std::string title)
    : title_(std::move(title)), tty_(isatty(STDERR_FILENO) != 0),
      start_(std::chrono::steady_clock::now()), last_(start_) {}

Progress::~Progress() { finish(); }

void Progress::update(const std::string& what, int done, int total) {
  using namespace std::chrono;
  const auto now = steady_clock::now();
  // Quiet for the first second, then at most ~10 Hz on a terminal and every 5 s in logs.
  if (now - start_ < seconds(1)) return;
  if (now - last_ < (tty_ ? milliseconds(100) : seconds(5)) && shown_) return;
  last_ = now;
  shown_ = true;
  const double secs = duration<double>(now - start_).count();
  std::fprintf(stderr, "%s%s [%d/%d] %s (%.0f s)%s", tty_ ? "\r\033[K" : "", title_.c_str(), done, total,
               what.c_str(), secs, tty_ ? "" : "\n");
  std::fflush(stderr);
}

void Progress::finish() {
  if (shown_ && tty_) std::fprintf(stderr, "\r\033[K");
  shown_ = false;
}

}  // namespace hila::tools

int main(int argc, char** argv) {
  using namespace hila::tools;
  // A write past the file-size limit (ulimit -f) then fails with EFBIG and is reported, instead of
  // the process dying mid-write.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"hila: sub-quadratic attention operators (GLA, HLA, log-linear, Gated DeltaNet)", "hila"};
  app.require_subcommand(1);
  const Command commands[] = {add_run_command(app), add_verify_command(app), add_demo_command(app)};
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help (rc 0) or the usage error
    return rc == 0 ? kExitOk : kExitBadInput;
  }
  try {
    for (const Command& c : commands)
      if (c.app->parsed()) return c.run();
  } catch (const hila::Error& e) {
    std::cerr << e.what() << '\n';
    return kExitBadInput;
  } catch (const SafetensorsError& e) {
    std::cerr << "hila: " << e.what() << '\n';
    return kExitBadInput;
  } catch (const std::bad_alloc& e) {  // sizes are checked up front; this is the backstop
    std::cerr << "hila: out of host memory (" << e.what() << "); the limit is " << hila::memory_limit()
              << " bytes (--max-memory, HILA_MAX_MEMORY)\n";
    return kExitBadInput;
  } catch (const std::length_error& e) {
    std::cerr << "hila: a size is too large to allocate (" << e.what() << ")\n";
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::cerr << "hila: internal error: " << e.what() << '\n';
    return kExitInternal;
  }
  return kExitOk;
}
