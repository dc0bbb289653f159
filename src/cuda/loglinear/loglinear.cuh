// SPDX-License-Identifier: Apache-2.0
// Log-linear Mamba-2 on the GPU (docs/math/LOGLINEAR.md §2-5), on the packed head-major buffers of
// gla/gla.cuh. Two forms: the segment sweep (portable tier, every dtype: sweep_portable.cu) and the
// chunk-parallel tree form (bf16 / fp16 on the GLA sm80 / sm90 kernels: tree.cuh, tree_sm80.cu);
// loglinear.cu runs the form compose.cu chose. The sweep's math:
//   o_t = sum_{n0<=s<=t} lam_t^{l(t,s)} Gamma_{t,s} (q^_t.k_s) v_s + e^{c_t} sum_{l live at n0} lam_t^{l(t,sigma_l(n0))} H0[l]^T q^_t
// with l(t,s) = bitlen(t xor s) on absolute int64 positions. A call is cut into segments [s,e)
// that never cross an absolute multiple of kChunk (§3.3); per segment, rows i, j:
//   O    = (Lam o Gamma_c o Q^K^T) V + sum_{l live at s} diag(lam^{l(s+i, sigma_l(s))} e^{b_i}) Q^ H[l]
//   H'[l(e, sigma_l(s))] += e^B H[l]                          (re-key, §2.4)
//   H'[L] += K^T diag(e^{B-b} 1[l(e, s+j) = L]) V               (new tokens by target level)
// Fenwick states are fp32 (fp64 for fp64) [N][H][Ls][dk][dv], slot = level, canonical (§2.5).
//
// Sweep forward: one block per (value tile of 64 columns, sequence x head) sweeps its segments in order;
//   the level states live in the final-state buffer (global, L2-resident), one [dk, 64] tile each.
//   When the live levels entering each segment are stored (always in the backward; in a forward
//   when they fit a quarter of the free memory) the sweep carries the states alone and the outputs
//   run chunk-parallel, one block per (segment, head) over all dv columns.
// Calls from chunk-aligned positions (training from 0 or from a state, prefill, continuation;
//   a call from an unaligned position is split by compose.cu into the rows up to the next aligned
//   one, swept, and the rest) with 16-bit operands take the chunk-parallel tree form instead
//   (loglinear/tree.cuh, loglinear/tree_sm80.cu; LoglinearArgs::tree).
// Sweep backward (§5.2): (1) the same sweep stores the live levels entering every segment (compact:
//   popcount(s) tiles per segment at hoff[g]); (2) a reverse sweep per (value tile, sequence x
//   head) carries one adjoint per live level, stores the adjoints of the levels the segment's own
//   tokens land in (goff[g]: one tile per aligned chunk, at most p+1 for the last segment) and the
//   re-key part of dB, and ends with d_init; (3) one block per (segment, head) forms dq^, dk, dv,
//   dlam and dg from those:
//   intra: dP = dO V^T, dA = dP o M, dQ^ = dA K, dK = dA^T Q^, dV = P^T dO, dlam via the in-chunk LUT
//   reads: Y = dO H[l]^T, dQ^ += diag(lam e^b) Y, dlam[i, lv_i] += e^{b_i} q^_i.Y_i
//   new tokens: dK += diag(w 1_L) V dH'[L]^T, dV += diag(w 1_L) K dH'[L], w = e^{B-b}
//   dB += <dH'[l(e, sigma_l(s))], e^B H[l]> + sum_j w_j (K dH'[L])_j.v_j;  dg = reverse local cumsum of db
// A segment holding a reset (a floored gate) forms Gamma_c and w from sums restarted at each reset
// and stops dg's cumsum there (prims/resets.cuh; docs/math/HLA.md §1, "Resets inside a chunk").
#pragma once
#include <vector>

#include "cuda/gla/gla.cuh"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

// Per-call segment tables: per sequence its start position n0 and first global segment; per
// segment the offsets of its stored incoming levels (hoff, popcount(s)) and of the adjoints of its
// new-token levels (goff). Ls = Fenwick slots of the internal states, max_i bitlen(n0_i + len_i) + 1.
struct LoglinearTables {
  std::vector<int64_t> n0, nend, seg0, hoff, goff;
  DevBuf<int64_t> d_n0, d_nend, d_seg0, d_hoff, d_goff;
  DevBuf<int> d_seg_seq;
  int64_t nseg = 0;
  int Ls = 1;
  int64_t stored_levels() const { return hoff.back(); }  // tiles of hst per head
  LoglinearTables(const detail::Resolved& r, cudaStream_t s);
};

// Arguments: `p` carries the GLA fields with the same meaning (q, k, v, g, sizes, sequence rows,
// scale, o, dO, dq, dk_, dv_, dg) except that p.h0, p.ht, p.dht, p.dh0 are Fenwick states
// [N][H][Ls][dk][dv]. Unless `tree`, p.ht is required by the forward (it is the working state) and
// p.dh0 by the backward (the working adjoint).
template <class T>
struct LoglinearArgs {
  using R = Acc<T>;
  GlaArgs<T> p;
  const R* lam = nullptr;            // [H][Ttot][nL]
  int nL = 1;
  int Ls = 1;
  const int64_t *n0 = nullptr, *seg0 = nullptr, *hoff = nullptr, *goff = nullptr;  // device
  const int* seg_seq = nullptr;      // [nseg] sequence of each segment
  int64_t nseg = 0;
  R* hst = nullptr;                  // [hoff[nseg]][H][dk][dv] live levels entering each segment
  R* dst = nullptr;                  // [goff[nseg]][H][dk][dv] adjoints of each segment's token levels
  R* dBpart = nullptr;               // [nseg][H][dv / 64] re-key part of dB per value tile
  R* dlam = nullptr;                 // [H][Ttot][nL]
  bool tree = false;                 // the chunk-parallel tree form (below); hst unused, p.dh0 optional
  bool want_final = false;           // tree: write the final state p.ht (the sweep always does)
};

// Forward: writes p.o (if set), p.ht (final canonical state) and hst (if set).
template <class T>
void loglinear_forward(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t stream);
// Backward: needs the inputs, p.dO, p.dht (optional), and writes p.dq, p.dk_, p.dv_, p.dg, dlam,
// p.dh0 (d_init). Reads hst when set (from a loglinear_forward with hst, [t.stored_levels()][H][dk][dv]);
// otherwise recomputes it. Allocates dst and dBpart on the stream.
template <class T>
void loglinear_backward(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t stream);

// The segment sweep (sweep_portable.cu), and the shared memory its kernels need for these head
// dims (bytes).
template <class T>
void loglinear_sweep_forward(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t stream);
template <class T>
void loglinear_sweep_backward(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t stream);
template <class T>
size_t loglinear_smem_need(int dk, int dv);

// Chunk-parallel tree form (tree.cuh, tree_sm80.cu), taken by loglinear_forward / loglinear_backward
// when a.tree, where loglinear_tree_usable: 16-bit operands, 32 <= dk <= 128, dv <= 128, its
// kernels' shared memory, and HILA_LOGLINEAR_TREE is not 0 (heuristics::loglinear_tree). The caller
// sets it when every sequence starts at a chunk-aligned position (n0 % kChunk == 0; the initial
// state p.h0 when n0 > 0); the forward writes the final state p.ht when want_final, the backward
// takes the final-state cotangent p.dht when set and writes dH0 into p.dh0 when set. Unlike the
// sweep it reads q, k, v, dO and writes o, dq, dk, dv in the callers' row layouts (GlaArgs::*_ld, *_hs).
template <class T>
bool loglinear_tree_usable(int dk, int dv);
template <class T>
void loglinear_tree_forward(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t stream);
template <class T>
void loglinear_tree_backward(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t stream);

}  // namespace hila::cuda
