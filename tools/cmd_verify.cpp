// SPDX-License-Identifier: Apache-2.0
// `hila verify`: every form of every operator, forward and backward, against the naive form on
// fresh random inputs, at edge shapes (T = 1, T not a multiple of the chunk, GQA, varlen with
// empty sequences, initial states, untied gates, normalize), in float64, float32, bfloat16 and
// float16.
#include <algorithm>
#include <cstdio>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <tuple>

#include "commands.h"
#include "hila/error.h"
#include "problem.h"

namespace hila::tools {

namespace {

constexpr double kTolF64 = 1e-10;
// float32 against the float64 naive form: docs/math/HLA.md §8.2 measures ~1e-6 at T = 4096; shapes here
// are far shorter, so 1e-4 leaves room for gradients' cancellation without hiding real bugs.
constexpr double kTolF32 = 1e-4;
// Some gradients are exactly zero in exact arithmetic (dg at T = 1 without an initial state: the
// gate multiplies an empty state) and come out as rounding noise of the other gradients' size.
// They are judged against 1% of the largest reference gradient instead of their own maximum.
constexpr double kGradFloor = 1e-2;

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
          s.nonneg = true;  // positive denominators (docs/math/HLA.md §4)
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

// How a dtype is judged. float64 and float32 against fixed tolerances; bf16 / f16 by STYLE.md's
// rule: at most twice the error of the naive form run in that dtype (which computes in float64 and
// rounds its outputs once), per output tensor, with the dtype's unit roundoff as the least error
// the naive form is credited with (its float32 state parts are otherwise near-exact).
struct Precision {
  DType dtype;
  double tol;        // on the error, or on the ratio to naive when relative
  bool relative;
  double roundoff;   // unit roundoff of the dtype
};
const Precision kPrecisions[] = {
    {DType::f64, kTolF64, false, 0x1p-53},
    {DType::f32, kTolF32, false, 0x1p-24},
    {DType::bf16, 2.0, true, 0x1p-8},
    {DType::f16, 2.0, true, 0x1p-11},
};

// One row of the table: the worst over all cases of (op, variant, direction, dtype).
struct Row {
  double score = 0;   // error, or error / naive error for relative precisions
  double err = 0;     // error of the worst-scoring tensor
  std::string worst;  // "case: part" of the worst score, or the exception text
  bool threw = false;
};

using Errors = std::vector<std::pair<std::string, double>>;

void record(Row& row, const std::string& case_name, const Errors& errs, const Errors* naive, double roundoff) {
  for (size_t i = 0; i < errs.size(); ++i) {
    const auto& [part, e] = errs[i];
    // Both come from compare() on results of the same problem, so the parts line up.
    const double base = naive && i < naive->size() && (*naive)[i].first == part ? (*naive)[i].second : 0;
    const double score = naive ? e / std::max(base, roundoff) : e;
    if (!(score <= row.score)) {  // NaN-safe: inf and NaN always replace
      row.score = score;
      row.err = e;
      row.worst = case_name + ": " + part;
      if (naive) {
        char buf[32];
        std::snprintf(buf, sizeof buf, " (%.2gx naive)", score);
        row.worst += buf;
      }
    }
  }
}

struct VerifyOptions {
  std::string op;
  uint64_t seed = 0;
};

Result run(const Problem& p, Form form, int64_t chunk, bool bwd) {
  return bwd ? run_backward(p, form, chunk) : run_forward(p, form, chunk);
}

int verify(const VerifyOptions& opt) {
  std::vector<Op> ops = all_ops();
  if (!opt.op.empty()) ops = {parse_op(opt.op)};
  const std::vector<Variant> vars = variants();
  constexpr int kNumPrec = int(std::size(kPrecisions));

  std::printf("%-15s %-9s %-4s %-8s %11s %9s  %-6s %s\n", "op", "form", "dir", "dtype", "max rel err", "tol",
              "result", "worst case: tensor");
  std::vector<std::string> failures;
  int rows = 0;
  Progress progress("verify");
  for (size_t oi = 0; oi < ops.size(); ++oi) {
    const Op op = ops[oi];
    std::map<std::tuple<size_t, bool, int>, Row> table;  // (variant, backward, precision)
    const std::vector<Case> cases = cases_for(op, opt.seed);
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const Case& c = cases[ci];
      progress.update(std::string(op_name(op)) + ": " + c.name, int(oi * cases.size() + ci),
                      int(ops.size() * cases.size()));
      const Problem p64 = make_problem(c.spec);
      for (int pi = 0; pi < kNumPrec; ++pi) {
        const Precision& prec = kPrecisions[pi];
        // The reference is naive float64 on exactly the rounded inputs, so the error measures the
        // computation in that dtype, not the rounding of the inputs.
        const Problem p = prec.dtype == DType::f64 ? p64 : cast_problem(p64, prec.dtype);
        const Problem p_ref = prec.dtype == DType::f64 ? p64 : cast_problem(p, DType::f64);
        for (bool bwd : {false, true}) {
          if (bwd && !supports(op, Form::naive, true)) continue;
          Result ref;
          Errors naive_errs;
          std::string ref_error;
          try {
            ref = run(p_ref, Form::naive, 64, bwd);
            if (prec.relative) naive_errs = compare(run(p, Form::naive, 64, bwd), ref, kGradFloor);
          } catch (const std::exception& e) {
            ref_error = std::string("naive reference threw: ") + e.what();
          }
          for (size_t vi = 0; vi < vars.size(); ++vi) {
            const Variant& v = vars[vi];
            if (!supports(op, v.form, bwd)) continue;
            Row& row = table[{vi, bwd, pi}];
            if (row.threw) continue;
            try {
              if (!ref_error.empty()) throw std::runtime_error(ref_error);
              const Errors errs = compare(run(p, v.form, v.chunk, bwd), ref, kGradFloor);
              record(row, c.name, errs, prec.relative ? &naive_errs : nullptr, prec.roundoff);
            } catch (const std::exception& e) {
              row.threw = true;
              row.score = row.err = std::numeric_limits<double>::infinity();
              row.worst = c.name + ": threw: " + e.what();
            }
          }
        }
      }
    }
    progress.finish();
    for (const auto& [key, row] : table) {
      const auto& [vi, bwd, pi] = key;
      const Precision& prec = kPrecisions[pi];
      const bool ok = !row.threw && row.score <= prec.tol;
      char tol[16];
      std::snprintf(tol, sizeof tol, prec.relative ? "%.0fx naive" : "%.0e", prec.tol);
      std::printf("%-15s %-9s %-4s %-8s %11.2e %9s  %-6s %s\n", op_name(op), vars[vi].label.c_str(),
                  bwd ? "bwd" : "fwd", dtype_name(prec.dtype), row.err, tol, ok ? "PASS" : "FAIL",
                  row.worst.empty() ? "-" : row.worst.c_str());
      ++rows;
      if (!ok)
        failures.push_back(std::string(op_name(op)) + " " + vars[vi].label + " " + (bwd ? "backward" : "forward") +
                           " " + dtype_name(prec.dtype) + ": " + row.worst);
    }
    std::fflush(stdout);
  }
  if (failures.empty()) {
    std::printf("\nall %d checks passed\n", rows);
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
