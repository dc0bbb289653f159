// SPDX-License-Identifier: Apache-2.0
// The tensors of a `hila run` input file as a Problem (shared by the CLI and the fuzz targets).
#include <string>
#include <utility>
#include <vector>

#include "hila/error.h"
#include "safetensors.h"

namespace hila::tools {

namespace {

Buffer take(Safetensors& f, const std::string& name) {
  auto it = f.tensors.find(name);
  if (it == f.tensors.end()) return Buffer{};
  Buffer b = std::move(it->second);
  f.tensors.erase(it);
  return b;
}

StateBuffers take_state(Safetensors& f, const std::string& prefix, bool with_pos) {
  StateBuffers s;
  if (with_pos) s.pos = take(f, prefix + ".pos");
  s.S = take(f, prefix + ".S");
  s.P = take(f, prefix + ".P");
  s.H = take(f, prefix + ".H");
  return s;
}

void require_rank4(const Buffer& b, const char* name, const char* layout) {
  if (b.empty()) throw Error(name, std::string("required tensor missing from the input file"));
  if (b.shape.size() != 4)
    throw Error(name, std::string("expected a tensor of rank 4 ") + layout + ", got " + shape_str(b.shape));
}

std::vector<int64_t> int_values(const Buffer& b) {
  std::vector<int64_t> out(static_cast<size_t>(b.numel()));
  for (int64_t i = 0; i < b.numel(); ++i)  // i64 read exactly: positions may exceed 2^53
    out[size_t(i)] = b.dtype == DType::i64 ? b.data<int64_t>()[i] : int64_t(b.get(i));
  return out;
}

}  // namespace

// The file's tensors as a Problem, so that run_forward / run_backward allocate the outputs exactly
// as they do for the tests. Shapes beyond what allocation needs are left to hila's validation.
Problem problem_from_file(const OpConfig& cfg, Safetensors& f, bool backward) {
  Problem p;
  p.q = take(f, "q");
  p.k = take(f, "k");
  p.v = take(f, "v");
  p.g = take(f, "g");
  p.lam = take(f, "lam");
  p.beta = take(f, "beta");
  p.cu_seqlens = take(f, "cu_seqlens");
  p.init = take_state(f, "h0", true);
  if (backward) {
    p.d_o = take(f, "do");
    p.d_final = take_state(f, "dht", false);
    if (p.d_o.empty()) throw Error("do", "required with --backward: the cotangent of o, shaped like o");
  }
  require_rank4(p.q, "q", "[B, T, G, dk]");
  require_rank4(p.v, "v", "[B, T, H, dv]");

  ProblemSpec& s = p.spec;
  s.cfg = cfg;
  s.B = p.v.shape[0];
  s.T = p.v.shape[1];
  s.H = p.v.shape[2];
  s.dv = p.v.shape[3];
  s.G = p.q.shape[2];
  s.dk = p.q.shape[3];
  s.dtype = p.v.dtype;
  s.gated = !p.g.empty();
  if (p.cu_seqlens.shape.size() == 1 && p.cu_seqlens.numel() >= 2 && !is_float(p.cu_seqlens.dtype)) {
    const std::vector<int64_t> cu = int_values(p.cu_seqlens);
    for (size_t i = 0; i + 1 < cu.size(); ++i) {  // hila's validation rejects bad offsets by name
      int64_t len;
      s.seqlens.push_back(__builtin_sub_overflow(cu[i + 1], cu[i], &len) || len < 0 ? 0 : len);
    }
  }
  s.init_state = !p.init.empty();
  if (p.init.pos.shape.size() == 1 && p.init.pos.numel() == p.num_seqs() && !is_float(p.init.pos.dtype))
    s.init_pos = int_values(p.init.pos);
  return p;
}

}  // namespace hila::tools
