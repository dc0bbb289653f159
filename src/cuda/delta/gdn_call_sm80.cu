// SPDX-License-Identifier: Apache-2.0
// One gdn / loglinear_gdn call's packed operands on the delta rule's sm80 tier (gdn_call_sm80.cuh).
#include <algorithm>
#include <vector>

#include "cuda/delta/delta.cuh"
#include "cuda/delta/gdn_call_sm80.cuh"
#include "cuda/prims/pack.cuh"

namespace hila::cuda::gdn {

template <class T>
GdnCall<T>::GdnCall(const detail::Resolved& r_, const ForwardParams& p, cudaStream_t s_, bool backward)
    : r(r_), s(s_), seqs(r_, s_, kChunk), dk(pad16(r_.dk)), dv(pad16(r_.dv)), rep(int(r_.H / r_.G)),
      Ttot(r_.B * r_.T), N(int64_t(r_.seqs.size())), NH(N * r_.H) {
  for (const auto& q : r.seqs) max_chunks = std::max<int64_t>(max_chunks, (q.len + kChunk - 1) / kChunk);
  const size_t nqk = size_t(r.G * Ttot * dk);
  q = DevBuf<T>(nqk, s), k = DevBuf<T>(nqk, s);
  if (r.cfg.qk_l2norm) {  // packed and normalised in one pass (the rstd: for the backward's chain rules)
    if (backward) k_rstd = DevBuf<float>(size_t(r.G * Ttot), s), q_rstd = DevBuf<float>(size_t(r.G * Ttot), s);
    launch_l2norm_pack<T>(q.get(), q_rstd.get(), p.q, r, int(r.dk), dk, s);
    launch_l2norm_pack<T>(k.get(), k_rstd.get(), p.k, r, int(r.dk), dk, s);
  } else {
    pack_to<T>(q.get(), p.q, r, r.G, int(r.dk), dk, -1, s);
    pack_to<T>(k.get(), p.k, r, r.G, int(r.dk), dk, -1, s);
  }
  a.v = operand(p.v, r.H, int(r.dv), dv, v, a.v_ld, a.v_hs);
  if (r.gate_cols > 0) {
    g = DevBuf<R>(size_t(r.H * Ttot), s);
    HILA_LAUNCH(pack_log_gates<R>, r.H * Ttot, s, g.get(), Strided(p.g), r.T, r.H, Ttot, 0);
  }
  beta = DevBuf<R>(size_t(r.H * Ttot), s);
  HILA_LAUNCH(pack_gates<R>, r.H * Ttot, s, beta.get(), Strided(p.beta), r.T, r.H, Ttot, 0);
  a.q = q.get(), a.k = k.get(), a.q_div = a.k_div = rep, a.v_div = 1;
  a.g = g.get(), a.H = int(r.H), a.N = int(N), a.Ttot = Ttot, a.dk = dk, a.dv = dv;
  a.row0 = seqs.d_row0.get(), a.len = seqs.d_len.get(), a.chunk0 = seqs.d_chunk0.get();
  a.chunk_seq = seqs.d_chunk_seq.get(), a.nchunks = seqs.nchunks;
  a.scale = R(r.scale);
  if (a.g) {
    bsum = DevBuf<R>(size_t(r.H * Ttot), s);
    gla_chunk_cumsum(a, bsum.get(), s);
    a.b = bsum.get();
  }
  if (p.init.H.defined()) {
    h0 = DevBuf<R>(size_t(NH * dk * dv), s);
    HILA_LAUNCH(pack_state<R>, NH * dk * dv, s, h0.get(), Strided(p.init.H), NH, r.H, int(r.dk), int(r.dv), dk, dv);
  }
  ht = DevBuf<R>(size_t(NH * dk * dv), s);
  a.h0 = h0.get(), a.ht = ht.get();
}

template <class T>
const T* GdnCall<T>::operand(const TensorView& t, int64_t X, int d, int dp, DevBuf<T>& buf, int64_t& ld,
                             int64_t& hs) const {
  if (d == dp && in_place_ok<T>(t, r.B, r.T)) {
    ld = t.stride[1], hs = t.stride[2];
    return static_cast<const T*>(t.data);
  }
  buf = DevBuf<T>(size_t(X * Ttot * dp), s);
  pack_to<T>(buf.get(), t, r, X, d, dp, -1, s);
  ld = hs = 0;
  return buf.get();
}

template <class T>
void GdnCall<T>::wy(T* tg, T* dvi, LoglinearWy<T> ll) {
  wy_buffers(!ll.qeff);
  if (seqs.nchunks == 0) return;
  launch_wy(a, beta.get(), W.get(), U.get(), tg, dvi, ll, s);
}

template <class T>
void GdnCall<T>::wy_buffers(bool with_u) {
  W = DevBuf<T>(size_t(r.H * Ttot * dk), s);
  if (with_u) U = DevBuf<T>(size_t(r.H * Ttot * dv), s);
}

template <class T>
void GdnCall<T>::wy_piece(T* tg, T* dvi, int lo, int hi) {
  if (seqs.nchunks == 0 || lo >= hi) return;
  GlaArgs<T> b = a;
  b.c_lo = lo, b.c_hi = hi;
  launch_wy(b, beta.get(), W.get(), U.get(), tg, dvi, {}, s);
}

template <class T>
void GdnCall<T>::output(const TensorView& o, const std::function<void(const GlaArgs<T>&)>& run) {
  if (seqs.nchunks == 0 || !o.defined()) return;
  const bool direct = int(r.dv) == dv && in_place_ok<T>(o, r.B, r.T);
  DevBuf<T> O(direct ? 0 : size_t(r.H * Ttot * dv), s);
  GlaArgs<T> b = a;
  b.v = Vn.get(), b.v_ld = b.v_hs = 0;
  b.o = direct ? static_cast<T*>(o.data) : O.get();
  if (direct) b.o_ld = o.stride[1], b.o_hs = o.stride[2];
  if (run) run(b);
  else gla_output(b, s);
  if (!direct) unpack_to<T>(o, O.get(), r, r.H, 1, int(r.dv), dv, R(1), s);
}

template <class T>
bool GdnCall<T>::dk_in_wy_bwd(const BackwardParams& p, WyBwdArgs<T>& wb) const {
  if (!p.dk.defined() || rep != 1 || int(r.dk) != dk || !in_place_ok<T>(p.dk, r.B, r.T)) return false;
  wb.dk16 = static_cast<T*>(p.dk.data), wb.dk16_ld = p.dk.stride[1], wb.dk16_hs = p.dk.stride[2];
  wb.k_rstd = k_rstd.get();  // nullptr without qk_l2norm
  return true;
}

template <class T>
bool GdnCall<T>::dq_in_chunk_kernel(const BackwardParams& p, GradOut<T>& out) const {
  if (!p.dq.defined() || rep != 1 || int(r.dk) != dk || !in_place_ok<T>(p.dq, r.B, r.T)) return false;
  out.p = static_cast<T*>(p.dq.data), out.ld = p.dq.stride[1], out.hs = p.dq.stride[2];
  out.mult = float(r.scale), out.rstd = q_rstd.get();  // rstd nullptr without qk_l2norm
  return true;
}

template <class T>
void GdnCall<T>::write_grads(const BackwardParams& p, const R* dq, const R* dk1, const R* dk2, const R* dvb,
                             const R* dg, const R* dbeta) const {
  if (Ttot == 0) return;
  if (p.dq.defined() && dq) launch_unpack_qk<T>(p.dq, dq, nullptr, p.q, r, int(r.dk), dk, R(r.scale), s);  // dq null: written
  if (p.dk.defined() && dk1) launch_unpack_qk<T>(p.dk, dk1, dk2, p.k, r, int(r.dk), dk, R(1), s);  // dk1 null: written
  if (p.dv.defined() && dvb) unpack_to<R>(p.dv, dvb, r, r.H, 1, int(r.dv), dv, R(1), s);  // dvb null: written in place
  if (p.dg.defined())
    HILA_LAUNCH(unpack_log_gate_grads<R>, r.H * Ttot, s, Strided(p.dg), dg, g.get(), r.T, r.H, Ttot, 0);
  if (p.dbeta.defined()) HILA_LAUNCH(unpack_gates<R>, r.H * Ttot, s, Strided(p.dbeta), dbeta, r.T, r.H, Ttot, 0);
}

template <class T>
void GdnCall<T>::write_final(const StateView& fin) {
  if (fin.H.defined())
    HILA_LAUNCH(unpack_state<R>, NH * r.dk * r.dv, s, Strided(fin.H), ht.get(), NH, r.H, int(r.dk), int(r.dv), dk, dv);
  upload_final_positions(fin.pos, r, s);
}

template struct GdnCall<__nv_bfloat16>;
template struct GdnCall<__half>;

}  // namespace hila::cuda::gdn
