// SPDX-License-Identifier: Apache-2.0
// One gdn / loglinear_gdn call on the delta rule's sm80 tier (gdn_call_sm80.cu): its packed
// operands and the forward pass that gdn_sm80.cu and loglinear_gdn_sm80.cu share.
#pragma once
#include <functional>

#include "core/problem.h"
#include "cuda/delta/wy_sm80.cuh"
#include "cuda/gla/gla.cuh"

namespace hila::cuda::gdn {

// One call's packed operands and the forward pass shared by the forward and the backward: q, k
// [G][Ttot][dk] (l2-normalised when asked; the backward's chain rule reads the caller's raw q, k), v [H][Ttot][dv], the gates' chunk cumsum b and beta [H][Ttot], the
// initial and final states [N][H][dk][dv] (fp32), W, U, Vn and the states entering each chunk.
template <class T>
struct GdnCall {
  using R = Acc<T>;
  const detail::Resolved& r;
  cudaStream_t s;
  SeqTables seqs;
  int dk, dv, rep;
  int64_t Ttot, N, NH, max_chunks = 0;  // max_chunks: the longest sequence's
  DevBuf<T> q, k, v, W, U, Vn, hbuf;
  DevBuf<R> g, beta, bsum, h0, ht;
  DevBuf<float> k_rstd, q_rstd;  // [G][Ttot] 1 / sqrt(|x|^2 + eps) of each raw row of k, q (qk_l2norm)
  GlaArgs<T> a;

  // backward: the rstd of q and k kept for the chain rules (qk_l2norm)
  GdnCall(const detail::Resolved& r_, const ForwardParams& p, cudaStream_t s_, bool backward);
  // The caller's [B, T, X, d] tensor read in place (ld, hs set), or packed into buf [X][Ttot][dp].
  const T* operand(const TensorView& t, int64_t X, int d, int dp, DevBuf<T>& buf, int64_t& ld, int64_t& hs) const;
  // W, U (and, for the backward, Tg and dvi = A^T dO from a.dO): wy_kernel.
  // With ll.qeff set, loglinear_gdn's Qeff, intra output and final in-chunk levels too (LoglinearWy).
  void wy(T* tg = nullptr, T* dvi = nullptr, LoglinearWy<T> ll = {});
  // wy() in pieces: the buffers W (and U) once, then wy_kernel over the chunks [lo, hi) of every sequence.
  void wy_buffers(bool with_u = true);
  void wy_piece(T* tg, T* dvi, int lo, int hi);
  // o = the GLA output with the values Vn (into the caller's tensor in place when its layout allows).
  // With `run`, run(args) launches the output kernel (gla_output) instead, e.g. piece by piece.
  void output(const TensorView& o, const std::function<void(const GlaArgs<T>&)>& run = {});
  // Whether wy_bwd_kernel can write the final dk into the caller's tensor (through the l2norm chain
  // when it is on: one head per group, the caller's layout read in place); if so, wb set for it.
  bool dk_in_wy_bwd(const BackwardParams& p, WyBwdArgs<T>& wb) const;
  // Whether GLA's chunk-gradient kernel may write dq into the caller's tensor (one head per group,
  // the layout in place; through the l2norm chain rule on the sm90 kernel only: gla_bwd_chunk says
  // whether it did); if so, out set for it.
  bool dq_in_chunk_kernel(const BackwardParams& p, GradOut<T>& out) const;
  // The gradients into the caller's tensors: dq (w.r.t. q^, times scale), dk = dk1 + dk2 (dk2 may be
  // null), dv, dg, dbeta (packed [H][Ttot][..] fp32; dq, dk1, dvb null: written in place), through the
  // l2norm chain when it is on.
  void write_grads(const BackwardParams& p, const R* dq, const R* dk1, const R* dk2, const R* dvb, const R* dg,
                   const R* dbeta) const;
  void write_final(const StateView& fin);
};

}  // namespace hila::cuda::gdn
