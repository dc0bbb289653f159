// SPDX-License-Identifier: Apache-2.0
// `hila run`: one forward (or forward + backward) call on tensors from a safetensors file.
#include <iostream>
#include <memory>

#include "commands.h"
#include "hila/error.h"
#include "problem.h"
#include "safetensors.h"

namespace hila::tools {

namespace {

struct RunOptions {
  std::string op, form = "chunk", in, out, gates = "tied", device = "cpu", max_memory;
  int64_t chunk = 64;
  bool backward = false, no_check_values = false;
  OpConfig cfg;  // scalar flags are parsed straight into it
};

void put(Safetensors& f, const std::string& name, Buffer& b) {
  if (!b.empty()) f.tensors[name] = std::move(b);
}

void put_state(Safetensors& f, const std::string& prefix, StateBuffers& s) {
  put(f, prefix + ".pos", s.pos);
  put(f, prefix + ".S", s.S);
  put(f, prefix + ".P", s.P);
  put(f, prefix + ".H", s.H);
}

int run(const RunOptions& o) {
  const Device dev = parse_device(o.device);
  OpConfig cfg = o.cfg;
  cfg.op = parse_op(o.op);
  cfg.gates = o.gates == "untied" ? Gates::untied : Gates::tied;
  cfg.check_values = !o.no_check_values;
  const Form form = parse_form(o.form);
  if (!o.max_memory.empty()) hila::set_memory_limit(hila::parse_memory_size(o.max_memory, "max-memory"));
  check_output_path(o.out, o.in);  // before any work: --out must not be --in (or a directory)

  Safetensors in = read_safetensors(o.in);
  Problem p = problem_from_file(cfg, in, o.backward);
  for (const auto& [name, b] : in.tensors)
    std::cerr << "hila: warning: ignoring tensor '" << name << "' in " << o.in
              << (name == "do" || name.rfind("dht.", 0) == 0 ? " (only read with --backward)" : "") << '\n';

  Result r = o.backward ? run_backward(p, form, o.chunk, dev) : run_forward(p, form, o.chunk, dev);

  Safetensors out;
  out.metadata = {{"op", op_name(cfg.op)},
                  {"form", form_name(form)},
                  {"chunk", std::to_string(o.chunk)},
                  {"direction", o.backward ? "backward" : "forward"}};
  put(out, "o", r.o);
  put_state(out, "ht", r.final_state);
  if (o.backward) {
    put(out, "dq", r.dq);
    put(out, "dk", r.dk);
    put(out, "dv", r.dv);
    put(out, "dg", r.dg);
    put(out, "dlam", r.dlam);
    put(out, "dbeta", r.dbeta);
    put_state(out, "dh0", r.d_init);
  }
  write_safetensors(o.out, out);
  return kExitOk;
}

}  // namespace

Command add_run_command(CLI::App& app) {
  auto o = std::make_shared<RunOptions>();
  CLI::App* sub = app.add_subcommand("run", "run one operator call on tensors from a safetensors file");
  sub->add_option("--op", o->op, "operator: gla, hla2, ahla, hla3, loglinear, loglinear_hla2, loglinear_ahla, "
                                 "loglinear_hla3, gdn, loglinear_gdn")->required();
  sub->add_option("--form", o->form, "naive, serial, chunk or scan")->capture_default_str();
  sub->add_option("--in", o->in, "input file: q k v [g lam beta cu_seqlens do h0.pos h0.S h0.P h0.H dht.S dht.P dht.H]")
      ->required();
  sub->add_option("--out", o->out, "output file: o ht.* [dq dk dv dg dlam dbeta dh0.*]")->required();
  sub->add_flag("--backward", o->backward, "also compute gradients (reads do and optional dht.*)");
  sub->add_option("--chunk", o->chunk, "chunk size, a power of two (chunk and scan forms)")->capture_default_str();
  sub->add_flag("--normalize", o->cfg.normalize, "HLA family: o = num / (den + eps)");
  sub->add_option("--eps", o->cfg.eps, "epsilon of --normalize")->capture_default_str();
  sub->add_option("--scale", o->cfg.scale, "query scale; 0 means dk^-1/2")->capture_default_str();
  sub->add_option("--ridge", o->cfg.ridge, "hla2 / loglinear_hla2: S + ridge * I")->capture_default_str();
  sub->add_option("--gates", o->gates, "tied (one log-gate per head) or untied (one per primitive)")
      ->check(CLI::IsMember({"tied", "untied"}))
      ->capture_default_str();
  sub->add_flag("--qk-l2norm", o->cfg.qk_l2norm, "gdn / loglinear_gdn: L2-normalize q and k in the kernel");
  sub->add_flag("--no-check-values", o->no_check_values, "skip the g <= 0 and finiteness checks on inputs");
  sub->add_option("--max-memory", o->max_memory,
                  "host memory the call may take, e.g. 8G (default: the machine's memory or HILA_MAX_MEMORY); "
                  "a larger call fails up front, naming the tensor");
  add_device_option(sub, o->device);
  return {sub, [o] { return run(*o); }};
}

}  // namespace hila::tools
