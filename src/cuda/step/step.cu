// SPDX-License-Identifier: Apache-2.0
// Decode step of every hila operator on the GPU: one fused kernel per step for all sequences and
// heads, states updated in place in the StateView layout (include/hila/ops.h), fp32 (fp64 for
// fp64 inputs). The CPU reference is cpu::op_step / cpu::prim_step.
//
// Per (sequence n, value head h, column tile) one block of kThreads threads runs the composition
// (docs/math/HLA.md §3.2 / §5.2 / §6.2, docs/math/LOGLINEAR.md §3.2, §6.3, §7), with q already scaled:
//   inner S (hla2, hla3):  S <- a_S S + k k^T          u = S q (+ ridge q)      [dk, dk] packed
//   inner P (ahla, hla3):  P <- a_P P + k v'^T         h = P^T q                [dk, dv']
//   outer, key = u or k, val = h or v', beta = 1 (mamba) or beta_t (delta):
//     every live slot l:   H_l <- a H_l                (mamba)
//                          H_l <- a (H_l - beta key (key^T H_l))   (delta: rank-1 erase, O(dk dv'))
//     o' = lam_0 beta (q.key) val + sum_live lam_l H_l^T q
//     merge (flat):        H_0 <- H_0 + beta key val^T
//     merge (Fenwick):     H_{r+1} <- sum_{l=1..r} H_l + beta key val^T, H_1..H_r <- 0,
//                          r = ctz(t+1): levels 1..r are the trailing ones of t (docs/math/LOGLINEAR.md §2.5)
//   normalize (docs/math/HLA.md §4): o = o'[:dv] / (o'[dv] + eps).
// The position t of each sequence is read from the state's pos on the device (sequences may be at
// different positions), so a step needs no host round trip. With a state pool (state_indices)
// sequence n steps state row idx[n]: its S, P, H and pos; a padding row (-1) writes o = 0 and
// nothing else. A row outside [-1, P), or (with the caller's bound max_position) a position outside
// [0, max_position], writes o = NaN and nothing else: the host checked the Fenwick slots and λ
// levels against the bound, so such a step could read or write past them.
//
// Grid: x = sequence * tiles + tile, y = head. Columns of P and H are independent in every update
// above, so blocks split dv' into tiles of kCols columns. Two things need more than a tile:
//  - u = S q needs all of S. Every tile reads S; a per-(n, h) counter elects the last block to
//    finish reading, which writes S back. Without counters S ops run one tile of all dv' columns
//    per block.
//  - normalize divides by column dv of o': one tile of all dv' columns per block.
// pos advances once every block of a sequence is done: a per-sequence counter elects the last
// block, or (without counters) a second tiny kernel follows in stream order.
// Counters ([N] per sequence, then [N, H] per (sequence, head); step_counters_size) are a
// DecodeState's own, or the caller's StepParams::counters on a StateView: the same step, tiling
// and launch either way. Only a StateView step without them takes the one-tile / second-kernel
// road. Every block of the grid arrives once at each counter of its (n[, h]) that the launch uses,
// a block that skips its sequence too (block.cuh's arrive), and the last arrival resets it: the
// counters are zero after every step, whatever rows and positions it skipped.
// Thread layout inside a column chunk: warp w = row group, lane = column, so each warp reads 32
// consecutive floats of one state row; rows r = w, w + kWarps, ... are held in registers
// (kRows = rows per thread >= dk / kWarps, a template parameter).
// The kernel's stages are block.cuh's, one file each (kernel.cu runs them).
// State tiles stream through a ring in shared memory: the block's [dk, kCols] tiles of P (one per
// column chunk) and of H (per column chunk, every live slot) form one sequence of items; cp.async
// issues the first `stages` of them as soon as t is known, before the inputs are read and S is
// swept, and item i + stages while item i is processed. So the state loads, which are the bytes
// of a step, are in flight during the block's whole prologue and between its dependent phases.
#include <algorithm>
#include <string>
#include <utility>

#include "core/plan.h"
#include "cuda/dispatch/heuristics.h"
#include "cuda/step/args.cuh"
#include "cuda/step/step.cuh"
#include "hila/error.h"

namespace hila::cuda {

namespace {

using decode::kCols;
using decode::kThreads;
using decode::Smem;
using decode::StepArgs;

// SM count and opt-in shared memory per block of the call's device (runtime.cuh reads them once
// per device: a step is on the decode hot path).
heuristics::Device device_limits() { return device_info(); }

// The kernel's arguments: the step's inputs, the state's parts in place, and the composition.
template <class T>
StepArgs<T> step_args(const detail::Resolved& r, const detail::OpPlan& plan, const StepParams& p, const StateView& sv) {
  using R = Acc<T>;
  StepArgs<T> a{};
  a.q = static_cast<const T*>(p.q.data), a.k = static_cast<const T*>(p.k.data), a.v = static_cast<const T*>(p.v.data);
  a.qs0 = p.q.stride[0], a.qs1 = p.q.stride[1], a.ks0 = p.k.stride[0], a.ks1 = p.k.stride[1];
  a.vs0 = p.v.stride[0], a.vs1 = p.v.stride[1];
  a.o = static_cast<T*>(p.o.data), a.os0 = p.o.stride[0], a.os1 = p.o.stride[1];
  a.g = Strided(p.g), a.lam = Strided(p.lam), a.beta = Strided(p.beta);
  a.has_g = r.gate_cols > 0;
  a.gcol[0] = r.gate_cols > 1 ? plan.gS : 0;
  a.gcol[1] = r.gate_cols > 1 ? plan.gP : 0;
  a.gcol[2] = r.gate_cols > 1 ? plan.gO : 0;
  if (plan.has_S) a.S = static_cast<R*>(sv.S.data), a.Ss0 = sv.S.stride[0], a.Ss1 = sv.S.stride[1];
  if (plan.has_P)
    a.P = static_cast<R*>(sv.P.data), a.Ps0 = sv.P.stride[0], a.Ps1 = sv.P.stride[1], a.Ps2 = int(sv.P.stride[2]);
  a.Hs = static_cast<R*>(sv.H.data), a.Hs0 = sv.H.stride[0], a.Hs1 = sv.H.stride[1];
  const int64_t hrow = plan.fenwick ? sv.H.stride[3] : sv.H.stride[2];
  a.Hsl = plan.fenwick ? sv.H.stride[2] : 0;
  a.Hs2 = int(hrow);
  for (const auto& [name, stride] : {std::pair<const char*, int64_t>{"state.H", hrow},
                                     {"state.P", plan.has_P ? sv.P.stride[2] : 0}})
    if (stride * r.dk >= (int64_t(1) << 31))
      throw Error(name, "expected a row stride below 2^31 / dk for the CUDA decode step, got " +
                            std::to_string(stride));
  a.pos = static_cast<int64_t*>(sv.pos.data), a.poss = sv.pos.stride[0];
  a.idx = p.state_indices.defined() ? static_cast<const int*>(p.state_indices.data) : nullptr;
  a.idxs = p.state_indices.defined() ? p.state_indices.stride[0] : 0;
  a.rows = sv.pos.shape[0];
  a.max_pos = r.max_position;
  a.N = int(r.B), a.H = int(r.H), a.rep = int(r.H / r.G), a.dk = int(r.dk), a.dv = int(r.dv), a.dvp = int(r.dvp);
  a.has_S = plan.has_S, a.has_P = plan.has_P, a.fenwick = plan.fenwick, a.delta = plan.delta;
  a.normalize = plan.normalize, a.l2 = r.cfg.qk_l2norm;
  a.scale = R(r.scale), a.ridge = R(plan.ridge), a.eps = R(plan.eps);
  return a;
}

// The grid's column tiles, S in shared memory or not, and the ring depth (heuristics.h), with the
// step's counters when there are any (a DecodeState's, or StepParams::counters). Returns the block's shared memory (bytes).
template <class T>
size_t step_layout(const detail::Resolved& r, const detail::OpPlan& plan, void* counters, StepArgs<T>& a) {
  using R = Acc<T>;
  const heuristics::Device lim = device_limits();
  a.tiles = heuristics::step_tiles(plan.normalize, plan.has_S, counters != nullptr, int64_t(a.N) * a.H, a.dvp, kCols,
                                   lim.sms);
  if (counters) {
    a.seq_count = static_cast<unsigned*>(counters);
    a.s_count = a.seq_count + a.N;
  }
  a.s_smem = heuristics::step_s_in_smem(plan.has_S, a.dk, kThreads, size_t(decode::sym_size(a.dk)) * sizeof(R));
  // ring items: P's column chunks, then H's (every live slot per chunk; at most kMaxStages count)
  const int nchunk = a.tiles == 1 ? (a.dvp + kCols - 1) / kCols : 1;
  const int64_t max_items = (plan.has_P ? nchunk : 0) + int64_t(nchunk) * (plan.fenwick ? decode::kMaxStages : 1);
  const int item_bytes = a.dk * kCols * int(sizeof(R));
  auto smem_of = [&](int stages) { return size_t(Smem(a.dk, a.dvp, a.has_S, stages, a.s_smem).total) * sizeof(R); };
  a.stages = heuristics::step_ring_stages(max_items, item_bytes, lim.smem_optin, smem_of);
  const size_t smem = smem_of(a.stages);
  if (smem > lim.smem_optin)
    throw Error("q", "expected a head dim whose decode step fits this device's shared memory (" +
                         std::to_string(lim.smem_optin) + " bytes per block), got dk = " + std::to_string(r.dk) +
                         ", which needs " + std::to_string(smem));
  return smem;
}

}  // namespace

template <class T>
void decode_step(const detail::Resolved& r, const StepParams& p, const StateView& sv, void* counters, cudaStream_t s) {
  const detail::OpPlan plan = detail::OpPlan::make(r.cfg);
  StepArgs<T> a = step_args<T>(r, plan, p, sv);
  const size_t smem = step_layout<T>(r, plan, counters, a);
  if (r.B > 0) {
    decode::launch_step<T>(a, dim3(unsigned(int64_t(a.N) * a.tiles), unsigned(a.H)), smem, s);
    if (!counters) decode::launch_advance_positions<T>(a, s);
  }
}

#define HILA_INSTANTIATE(T)                                                                                  \
  template void decode_step<T>(const detail::Resolved&, const StepParams&, const StateView&, void*, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
