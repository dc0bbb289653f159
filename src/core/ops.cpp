// SPDX-License-Identifier: Apache-2.0
#include <string>

#include "hila/error.h"
#include "hila/ops.h"

namespace hila {

namespace {
constexpr const char* kOpNames[] = {"gla",           "hla2",           "ahla",
                                    "hla3",          "loglinear",      "loglinear_hla2",
                                    "loglinear_ahla", "loglinear_hla3", "gdn",
                                    "loglinear_gdn"};
constexpr const char* kFormNames[] = {"naive", "serial", "chunk", "scan"};

int bitlen(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

std::string joined(const char* const* names, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::string(names[i]);
  return s;
}
}  // namespace

const char* op_name(Op op) { return kOpNames[static_cast<int>(op)]; }
const char* form_name(Form f) { return kFormNames[static_cast<int>(f)]; }

Op parse_op(const std::string& name) {
  for (int i = 0; i < 10; ++i)
    if (name == kOpNames[i]) return static_cast<Op>(i);
  throw Error("op", "expected one of " + joined(kOpNames, 10) + ", got '" + name + "'");
}

Form parse_form(const std::string& name) {
  for (int i = 0; i < 4; ++i)
    if (name == kFormNames[i]) return static_cast<Form>(i);
  throw Error("form", "expected one of " + joined(kFormNames, 4) + ", got '" + name + "'");
}

const std::vector<Op>& all_ops() {
  static const std::vector<Op> ops = {Op::gla,          Op::hla2,           Op::ahla,
                                      Op::hla3,         Op::loglinear,      Op::loglinear_hla2,
                                      Op::loglinear_ahla, Op::loglinear_hla3, Op::gdn,
                                      Op::loglinear_gdn};
  return ops;
}

const std::vector<Form>& all_forms() {
  static const std::vector<Form> forms = {Form::naive, Form::serial, Form::chunk, Form::scan};
  return forms;
}

OpTraits op_traits(Op op) {
  //                       loglinear delta  S      P      prims hla_family
  switch (op) {
    case Op::gla:            return {false, false, false, false, 1, false};
    case Op::hla2:           return {false, false, true,  false, 2, true};
    case Op::ahla:           return {false, false, false, true,  2, true};
    case Op::hla3:           return {false, false, true,  true,  3, true};
    case Op::loglinear:      return {true,  false, false, false, 1, false};
    case Op::loglinear_hla2: return {true,  false, true,  false, 2, true};
    case Op::loglinear_ahla: return {true,  false, false, true,  2, true};
    case Op::loglinear_hla3: return {true,  false, true,  true,  3, true};
    case Op::gdn:            return {false, true,  false, false, 1, false};
    case Op::loglinear_gdn:  return {true,  true,  false, false, 1, false};
  }
  throw Error("op", "unknown operator id " + std::to_string(static_cast<int>(op)));
}

bool supports(Op op, Form form, bool backward) {
  if (!backward) return true;
  const OpTraits t = op_traits(op);
  switch (form) {
    case Form::naive:
    case Form::chunk: return true;
    case Form::serial: return !t.loglinear && !t.delta;
    case Form::scan: return false;
  }
  return false;
}

int64_t state_slots(int64_t n) { return bitlen(static_cast<uint64_t>(n)) + 1; }

int64_t levels_needed(int64_t n0, int64_t T) {
  return T <= 0 ? 0 : bitlen(static_cast<uint64_t>(n0 + T - 1)) + 1;
}

StateShape state_shape(const OpConfig& cfg, int64_t N, int64_t H, int64_t dk, int64_t dv,
                       int64_t max_pos) {
  const OpTraits t = op_traits(cfg.op);
  if (N < 0 || H < 0 || dk < 0 || dv < 0 || max_pos < 0)
    throw Error("state", "expected sizes and a position >= 0, got N = " + std::to_string(N) + ", H = " +
                                   std::to_string(H) + ", dk = " + std::to_string(dk) + ", dv = " +
                                   std::to_string(dv) + ", max_pos = " + std::to_string(max_pos));
  const int64_t dvp = dv + (cfg.normalize ? 1 : 0);
  // Every part's element count must fit in int64 (shapes that wrap would size buffers wrongly).
  int64_t packed = 0, nh = 0, n = 0, m = 0;
  const bool ok = !__builtin_mul_overflow(dk, dk + 1, &packed) && !__builtin_mul_overflow(N, H, &nh) &&
                  !__builtin_mul_overflow(nh, dk, &n) && !__builtin_mul_overflow(n, dvp, &n) &&
                  !__builtin_mul_overflow(n, int64_t(64), &n) &&  // up to 64 Fenwick slots
                  !__builtin_mul_overflow(nh, packed / 2, &m);
  if (!ok)
    throw Error("state", "the state of N = " + std::to_string(N) + " sequences, H = " + std::to_string(H) +
                                   ", dk = " + std::to_string(dk) + ", dv = " + std::to_string(dv) +
                                   " has more elements than int64 can count");
  StateShape s;
  s.S = t.has_S;
  s.P = t.has_P;
  s.H = true;
  s.levels = t.loglinear;
  if (s.S) s.S_shape = {N, H, packed / 2};
  if (s.P) s.P_shape = {N, H, dk, dvp};
  s.H_shape = t.loglinear ? std::vector<int64_t>{N, H, state_slots(max_pos), dk, dvp}
                          : std::vector<int64_t>{N, H, dk, dvp};
  return s;
}

}  // namespace hila
