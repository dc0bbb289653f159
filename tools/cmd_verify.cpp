// SPDX-License-Identifier: Apache-2.0
// `hila verify`: every form of every operator, forward and backward, against the naive form on
// fresh random inputs, at edge shapes (T = 1, T not a multiple of the chunk, GQA, varlen with
// empty sequences, initial states, untied gates, normalize), in float64 and float32.
#include <cinttypes>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <tuple>

#include "commands.h"
#include "hila/error.h"
#include "problem.h"

namespace hila::tools {

namespace {

constexpr double kTolF64 = 1e-10;
// float32 against the float64 naive form: HLA_SPEC §8.2 measures ~1e-6 at T = 4096; shapes here
// are far shorter, so 1e-4 leaves room for gradients' cancellation without hiding real bugs.
constexpr double kTolF32 = 1e-4;

struct Case {
  std::string name;
  ProblemSpec spec;
};

std::vector<Case> cases_for(Op op, uint64_t seed) {
  const OpTraits tr = op_traits(op);
  std::vector<Case> cs;
  auto add = [&](std::string name, auto&& edit) {
    ProblemSpec s;
    s.cfg.op = op;
    s.seed = seed * 1000 + cs.size();
    edit(s);
    cs.push_back({std::move(name), s});
  };
  add("T=1", [](ProblemSpec& s) { s.T = 1; });
  add("B=2 T=100 G=2 H=4 dk=16", [](ProblemSpec& s) {
    s.B = 2, s.T = 100, s.G = 2, s.H = 4, s.dk = 16, s.dv = 8;
  });
  // Sequences cross chunk boundaries at both chunk sizes and start at positions where the
  // Fenwick levels are awkward (0, odd, 2^k, 2^k - 1); the init state has one spare slot and lam
  // two spare levels, both of which the library must accept and ignore.
  add("varlen [0,37,0,64,65,1] +h0", [](ProblemSpec& s) {
    s.H = 2, s.seqlens = {0, 37, 0, 64, 65, 1};
    s.init_state = true, s.init_pos = {0, 5, 64, 3, 1023, 129};
    s.init_extra_slots = 1, s.extra_levels = 2;
  });
  add("T=200 ungated", [](ProblemSpec& s) { s.T = 200, s.H = 2, s.dv = 16, s.gated = false; });
  if (tr.hla_family) {
    add(std::string("T=77 untied normalize") + (tr.has_S && !tr.has_P ? " ridge" : "") + " +h0@37",
        [&](ProblemSpec& s) {
          s.T = 77, s.H = 2;
          s.cfg.gates = Gates::untied, s.cfg.normalize = true;
          if (tr.has_S && !tr.has_P) s.cfg.ridge = 0.1;
          s.nonneg = true;  // positive denominators (HLA_SPEC §4)
          s.init_state = true, s.init_pos = {37};
        });
  } else if (tr.delta) {
    add("T=77 qk_l2norm scale=1 +h0@37", [](ProblemSpec& s) {
      s.T = 77, s.H = 2, s.cfg.qk_l2norm = true, s.cfg.scale = 1.0;
      s.init_state = true, s.init_pos = {37};
    });
  } else {
    add("T=77 scale=0.5 +h0@37", [](ProblemSpec& s) {
      s.T = 77, s.H = 2, s.cfg.scale = 0.5, s.init_state = true, s.init_pos = {37};
    });
  }
  return cs;
}

struct Variant {
  std::string label;
  Form form;
  int64_t chunk;
};

std::vector<Variant> variants() {
  std::vector<Variant> vs;
  for (Form f : all_forms()) {
    if (f == Form::chunk || f == Form::scan) {
      for (int64_t c : {16, 64}) vs.push_back({std::string(form_name(f)) + "/" + std::to_string(c), f, c});
    } else {
      vs.push_back({form_name(f), f, 64});
    }
  }
  return vs;
}

// One row of the table: the worst error over all cases of (op, variant, direction, dtype).
struct Row {
  double err = 0;
  std::string worst;  // "case: part" of the worst error, or the exception text
  bool threw = false;
  bool pass(double tol) const { return !threw && err <= tol; }
};

void record(Row& row, const std::string& case_name, const Result& got, const Result& ref) {
  for (const auto& [part, e] : compare(got, ref))
    if (!(e <= row.err)) {  // NaN-safe: inf and NaN always replace
      row.err = e;
      row.worst = case_name + ": " + part;
    }
}

struct VerifyOptions {
  std::string op;
  uint64_t seed = 0;
};

int verify(const VerifyOptions& opt) {
  std::vector<Op> ops = all_ops();
  if (!opt.op.empty()) ops = {parse_op(opt.op)};
  const std::vector<Variant> vars = variants();
  const DType dtypes[] = {DType::f64, DType::f32};

  std::printf("%-15s %-9s %-4s %-7s %11s  %-6s %s\n", "op", "form", "dir", "dtype", "max rel err", "result",
              "worst case: part");
  std::vector<std::string> failures;
  int rows = 0;
  Progress progress("verify");
  for (size_t oi = 0; oi < ops.size(); ++oi) {
    const Op op = ops[oi];
    // key: variant index, backward, dtype index
    std::map<std::tuple<size_t, bool, int>, Row> table;
    const std::vector<Case> cases = cases_for(op, opt.seed);
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const Case& c = cases[ci];
      progress.update(std::string(op_name(op)) + ": " + c.name, int(oi * cases.size() + ci), int(ops.size() * cases.size()));
      const Problem p64 = make_problem(c.spec);
      // The reference is computed once per case; if the naive form itself throws, every row of
      // this case records that (there is nothing to compare against).
      Result ref_fwd, ref_bwd;
      std::string ref_error;
      const bool naive_bwd = supports(op, Form::naive, true);
      try {
        ref_fwd = run_forward(p64, Form::naive);
        if (naive_bwd) ref_bwd = run_backward(p64, Form::naive);
      } catch (const std::exception& e) {
        ref_error = std::string("naive f64 reference threw: ") + e.what();
      }
      for (int di = 0; di < 2; ++di) {
        const Problem p = di == 0 ? p64 : cast_problem(p64, dtypes[di]);
        for (size_t vi = 0; vi < vars.size(); ++vi) {
          const Variant& v = vars[vi];
          for (bool bwd : {false, true}) {
            if (!supports(op, v.form, bwd) || (bwd && !naive_bwd)) continue;
            Row& row = table[{vi, bwd, di}];
            if (row.threw) continue;
            if (!ref_error.empty()) {
              row.threw = true, row.worst = c.name + ": " + ref_error;
              continue;
            }
            try {
              const Result got = bwd ? run_backward(p, v.form, v.chunk) : run_forward(p, v.form, v.chunk);
              record(row, c.name, got, bwd ? ref_bwd : ref_fwd);
            } catch (const std::exception& e) {
              row.threw = true;
              row.worst = c.name + ": threw: " + e.what();
            }
          }
        }
      }
    }
    progress.finish();
    for (const auto& [key, row] : table) {
      const auto& [vi, bwd, di] = key;
      const double tol = di == 0 ? kTolF64 : kTolF32;
      const bool ok = row.pass(tol);
      std::printf("%-15s %-9s %-4s %-7s %11.2e  %-6s %s\n", op_name(op), vars[vi].label.c_str(),
                  bwd ? "bwd" : "fwd", dtype_name(dtypes[di]), row.threw ? std::numeric_limits<double>::infinity() : row.err,
                  ok ? "PASS" : "FAIL", row.worst.c_str());
      ++rows;
      if (!ok)
        failures.push_back(std::string(op_name(op)) + " " + vars[vi].label + " " + (bwd ? "backward" : "forward") + " " +
                           dtype_name(dtypes[di]) + ": " + row.worst);
    }
    std::fflush(stdout);
  }
  if (failures.empty()) {
    std::printf("\nall %d checks passed (tolerance %.0e for float64, %.0e for float32 against naive float64)\n", rows,
                kTolF64, kTolF32);
    return kExitOk;
  }
  std::printf("\n%zu of %d checks FAILED:\n", failures.size(), rows);
  for (const std::string& f : failures) std::printf("  %s\n", f.c_str());
  return kExitCheckFailed;
}

}  // namespace

Command add_verify_command(CLI::App& app) {
  auto o = std::make_shared<VerifyOptions>();
  CLI::App* sub = app.add_subcommand("verify", "cross-check every form, forward and backward, against the naive form");
  sub->add_option("--op", o->op, "only this operator (default: all)");
  sub->add_option("--seed", o->seed, "seed of the random inputs")->capture_default_str();
  return {sub, [o] { return verify(*o); }};
}

}  // namespace hila::tools
