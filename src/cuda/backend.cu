// SPDX-License-Identifier: Apache-2.0
// CUDA backend: packs the strided, sequence-first inputs into head-major buffers padded to
// multiples of 16 columns (kernels then need no head-dim templates), runs the primitive kernels
// on the caller's stream, and unpacks outputs, states and gradients (summing dq/dk over the heads
// of a GQA group). Temporary buffers are stream-ordered allocations.
#include <algorithm>
#include <string>
#include <vector>

#include "core/host_mirror.h"
#include "core/plan.h"
#include "cuda/backend.h"
#include "cuda/delta.cuh"
#include "cuda/gla.cuh"
#include "cuda/pack.cuh"
#include "cuda/runtime.cuh"
#include "hila/error.h"

namespace hila::cuda {

[[noreturn]] void fail(cudaError_t e, const char* expr, const char* file, int line) {
  throw std::runtime_error(std::string("hila: CUDA error ") + cudaGetErrorName(e) + " (" +
                           cudaGetErrorString(e) + ") in " + expr + " at " + file + ":" +
                           std::to_string(line));
}

namespace {

void d2h(void* dst, const void* src, size_t bytes, int device) {
  int prev = 0;
  HILA_CUDA_CHECK(cudaGetDevice(&prev));
  HILA_CUDA_CHECK(cudaSetDevice(device));
  HILA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  HILA_CUDA_CHECK(cudaSetDevice(prev));
}
const bool g_registered = (detail::register_device_to_host(&d2h), true);

// One call's packed inputs, states and the composition over GLA primitives (core/plan.h).
template <class T>
struct Call {
  using R = Acc<T>;
  const detail::Resolved& r;
  const detail::OpPlan plan;
  cudaStream_t s;
  int dkp, dvp, rep;
  int64_t Ttot, N, NH;
  DevBuf<T> q, k, v;
  DevBuf<R> g[3];
  DevBuf<R> S0, P0, H0;  // packed initial states (dense)
  SeqTables seqs;

  Call(const detail::Resolved& r_, const ForwardParams& p, cudaStream_t s_)
      : r(r_), plan(detail::OpPlan::make(r_.cfg)), s(s_), dkp(pad16(r_.dk)), dvp(pad16(r_.dvp)),
        rep(int(r_.H / r_.G)), Ttot(r_.B * r_.T), N(int64_t(r_.seqs.size())), NH(N * r_.H), seqs(r_, s_, kChunk) {
    q = DevBuf<T>(size_t(r.G * Ttot * dkp), s);
    k = DevBuf<T>(size_t(r.G * Ttot * dkp), s);
    v = DevBuf<T>(size_t(r.H * Ttot * dvp), s);
    HILA_LAUNCH(pack_rows<T>, r.G * Ttot * dkp, s, q.get(), Strided(p.q), r.T, r.G, Ttot, int(r.dk), dkp, -1);
    HILA_LAUNCH(pack_rows<T>, r.G * Ttot * dkp, s, k.get(), Strided(p.k), r.T, r.G, Ttot, int(r.dk), dkp, -1);
    HILA_LAUNCH(pack_rows<T>, r.H * Ttot * dvp, s, v.get(), Strided(p.v), r.T, r.H, Ttot, int(r.dv), dvp,
                r.cfg.normalize ? int(r.dv) : -1);
    for (int c = 0; c < r.gate_cols; ++c) {  // tied: one column serves every primitive
      g[c] = DevBuf<R>(size_t(r.H * Ttot), s);
      HILA_LAUNCH(pack_gates<R>, r.H * Ttot, s, g[c].get(), Strided(p.g), r.T, r.H, Ttot, c);
    }
    if (p.init.S.defined()) {
      S0 = DevBuf<R>(size_t(NH * dkp * dkp), s);
      HILA_LAUNCH(pack_sym<R>, NH * dkp * dkp, s, S0.get(), Strided(p.init.S), NH, r.H, int(r.dk), dkp, false);
    }
    if (p.init.P.defined()) P0 = pack_dense(p.init.P);
    if (p.init.H.defined()) H0 = pack_dense(p.init.H);
  }
  DevBuf<R> pack_dense(const TensorView& t) const {
    DevBuf<R> b(size_t(NH * dkp * dvp), s);
    HILA_LAUNCH(pack_state<R>, NH * dkp * dvp, s, b.get(), Strided(t), NH, r.H, int(r.dk), int(r.dvp), dkp, dvp);
    return b;
  }
  const R* gate(int prim) const { return r.gate_cols == 0 ? nullptr : g[r.gate_cols == 1 ? 0 : prim].get(); }

  // Base arguments of a primitive over (Q, key, value) with the given gate column.
  GlaArgs<T> args(const T* key, int key_div, const T* val, int val_div, int dval, int prim) const {
    GlaArgs<T> a;
    a.q = q.get(), a.k = key, a.v = val;
    a.q_div = rep, a.k_div = key_div, a.v_div = val_div;
    a.g = gate(prim);
    a.H = int(r.H), a.N = int(N), a.Ttot = Ttot, a.dk = dkp, a.dv = dval;
    a.row0 = seqs.d_row0.get(), a.len = seqs.d_len.get(), a.chunk0 = seqs.d_chunk0.get();
    a.chunk_seq = seqs.d_chunk_seq.get();
    a.nchunks = seqs.nchunks;
    a.scale = R(r.scale);
    return a;
  }
  GlaArgs<T> inner_S() const { return args(k.get(), rep, k.get(), rep, dkp, plan.gS); }
  GlaArgs<T> inner_P() const { return args(k.get(), rep, v.get(), 1, dvp, plan.gP); }

  // Forward of the inner primitives: U (+ ridge) and Hh, with their final states / chunk states.
  struct Inner {
    DevBuf<T> U, Hh;
    DevBuf<R> Sf, Pf, Sbuf, Pbuf;
  };
  Inner run_inner(bool with_chunk_states) const {
    Inner in;
    const size_t rowsU = size_t(r.H * Ttot * dkp), rowsH = size_t(r.H * Ttot * dvp);
    if (plan.has_S) {
      in.U = DevBuf<T>(rowsU, s);
      in.Sf = DevBuf<R>(size_t(NH * dkp * dkp), s);
      GlaArgs<T> a = inner_S();
      a.o = in.U.get(), a.h0 = S0.get(), a.ht = in.Sf.get();
      if (with_chunk_states) a.hbuf = (in.Sbuf = DevBuf<R>(size_t(seqs.nchunks * r.H * dkp * dkp), s)).get();
      gla_forward<T>(a, s);
      if (plan.ridge != 0)
        HILA_LAUNCH(add_ridge<T>, int64_t(rowsU), s, in.U.get(), q.get(), r.H, rep, Ttot * dkp, R(plan.ridge * r.scale));
    }
    if (plan.has_P) {
      in.Hh = DevBuf<T>(rowsH, s);
      in.Pf = DevBuf<R>(size_t(NH * dkp * dvp), s);
      GlaArgs<T> a = inner_P();
      a.o = in.Hh.get(), a.h0 = P0.get(), a.ht = in.Pf.get();
      if (with_chunk_states) a.hbuf = (in.Pbuf = DevBuf<R>(size_t(seqs.nchunks * r.H * dkp * dvp), s)).get();
      gla_forward<T>(a, s);
    }
    return in;
  }
  GlaArgs<T> outer(const Inner& in) const {
    return args(plan.has_S ? in.U.get() : k.get(), plan.has_S ? 1 : rep, plan.has_P ? in.Hh.get() : v.get(), 1, dvp,
                plan.gO);
  }

  void write_output(const TensorView& o, const T* Oraw) const {
    if (plan.normalize)
      HILA_LAUNCH(unpack_normalized<T>, r.H * Ttot * r.dv, s, Strided(o), Oraw, r.T, r.H, Ttot, int(r.dv), dvp, R(plan.eps));
    else
      HILA_LAUNCH(unpack_rows<T>, r.H * Ttot * r.dv, s, Strided(o), Oraw, r.T, r.H, 1, Ttot, int(r.dv), dvp, R(1));
  }
  void write_states(const StateView& fin, const Inner& in, const R* Hf) const {
    if (!fin.defined()) return;
    if (fin.S.defined())
      HILA_LAUNCH(unpack_sym<R>, NH * r.dk * (r.dk + 1) / 2, s, Strided(fin.S), in.Sf.get(), NH, r.H, int(r.dk), dkp, false);
    if (fin.P.defined())
      HILA_LAUNCH(unpack_state<R>, NH * r.dk * r.dvp, s, Strided(fin.P), in.Pf.get(), NH, r.H, int(r.dk), int(r.dvp), dkp, dvp);
    if (fin.H.defined())
      HILA_LAUNCH(unpack_state<R>, NH * r.dk * r.dvp, s, Strided(fin.H), Hf, NH, r.H, int(r.dk), int(r.dvp), dkp, dvp);
    if (fin.pos.defined()) {
      std::vector<int64_t> pos;
      for (const auto& x : r.seqs) pos.push_back(x.n0 + x.len);
      HILA_CUDA_CHECK(cudaMemcpyAsync(fin.pos.data, pos.data(), pos.size() * 8, cudaMemcpyHostToDevice, s));
      HILA_CUDA_CHECK(cudaStreamSynchronize(s));  // `pos` is a host temporary
    }
  }
};

// Per-primitive gradient buffers (per head, accumulation type).
template <class T>
struct PrimGradBufs {
  using R = Acc<T>;
  DevBuf<R> dq, dk, dv, dg, dh0, dhbuf;
  PrimGradBufs(const Call<T>& c, int dval, bool want_dh0, cudaStream_t s)
      : dq(size_t(c.r.H * c.Ttot * c.dkp), s), dk(size_t(c.r.H * c.Ttot * c.dkp), s),
        dv(size_t(c.r.H * c.Ttot * dval), s), dg(size_t(c.r.H * c.Ttot), s),
        dh0(want_dh0 ? size_t(c.NH * c.dkp * dval) : 0, s),
        dhbuf(size_t(c.seqs.nchunks * c.r.H * c.dkp * dval), s) {}
  void attach(GlaArgs<T>& a) const {
    a.dq = dq.get(), a.dk_ = dk.get(), a.dv_ = dv.get(), a.dg = dg.get(), a.dh0 = dh0.get(), a.dhbuf = dhbuf.get();
  }
};

template <class P>
void unpack_to(const TensorView& out, const P* in, const detail::Resolved& r, int64_t X, int rep, int d, int dp,
               Acc<P> mult, cudaStream_t s) {
  HILA_LAUNCH(unpack_rows<P>, X * r.B * r.T * d, s, Strided(out), in, r.T, X, rep, r.B * r.T, d, dp, mult);
}

template <class T>
void forward_impl(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) {
  using R = Acc<T>;
  if (r.traits.delta) return delta_forward<T>(r, p, s);  // gdn, loglinear_gdn: cuda/delta.cu
  const Call<T> c(r, p, s);
  const auto in = c.run_inner(false);
  DevBuf<T> O(size_t(r.H * c.Ttot * c.dvp), s);
  DevBuf<R> Hf(size_t(c.NH * c.dkp * c.dvp), s);
  GlaArgs<T> a = c.outer(in);
  a.o = O.get(), a.h0 = c.H0.get(), a.ht = Hf.get();
  gla_forward<T>(a, s);
  c.write_output(p.o, O.get());
  c.write_states(p.final_state, in, Hf.get());
}

// VJP of the composition (HLA_SPEC §7.2): outer primitive first, then the inner ones with the
// outer key / value gradients as their output cotangents.
template <class T>
void backward_impl(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) {
  using R = Acc<T>;
  if (r.traits.delta) return delta_backward<T>(r, p, s);  // gdn, loglinear_gdn: cuda/delta.cu
  const Call<T> c(r, p, s);
  const auto& plan = c.plan;
  const int64_t rowsK = r.H * c.Ttot * c.dkp, rowsV = r.H * c.Ttot * c.dvp;
  const auto in = c.run_inner(true);
  // outer forward with its chunk states (and O' when normalizing or when o is asked for)
  DevBuf<T> O(size_t(rowsV), s);
  DevBuf<R> Hf(size_t(c.NH * c.dkp * c.dvp), s), Hbuf(size_t(c.seqs.nchunks * r.H * c.dkp * c.dvp), s);
  GlaArgs<T> a = c.outer(in);
  a.o = O.get(), a.h0 = c.H0.get(), a.ht = Hf.get(), a.hbuf = Hbuf.get();
  gla_forward<T>(a, s);
  if (p.o.defined()) c.write_output(p.o, O.get());
  c.write_states(p.final_state, in, Hf.get());
  // cotangents of O' and of the final states
  DevBuf<T> dO(size_t(rowsV), s);
  HILA_LAUNCH(pack_rows<T>, rowsV, s, dO.get(), Strided(p.d_o), r.T, r.H, c.Ttot, int(r.dv), c.dvp, -1);
  if (plan.normalize)
    HILA_LAUNCH(normalized_cotangent<T>, r.H * c.Ttot, s, dO.get(), O.get(), r.H * c.Ttot, int(r.dv), c.dvp, R(plan.eps));
  DevBuf<R> dSf, dPf, dHf;
  if (p.d_final.S.defined()) {
    dSf = DevBuf<R>(size_t(c.NH * c.dkp * c.dkp), s);
    HILA_LAUNCH(pack_sym<R>, c.NH * c.dkp * c.dkp, s, dSf.get(), Strided(p.d_final.S), c.NH, r.H, int(r.dk), c.dkp, true);
  }
  if (p.d_final.P.defined()) dPf = c.pack_dense(p.d_final.P);
  if (p.d_final.H.defined()) dHf = c.pack_dense(p.d_final.H);
  // outer
  PrimGradBufs<T> go(c, c.dvp, p.d_init.H.defined(), s);
  a.dO = dO.get(), a.dht = dHf.get();
  go.attach(a);
  gla_backward<T>(a, s);
  DevBuf<R> dq(size_t(rowsK), s), dk(size_t(rowsK), s), dv(size_t(rowsV), s), dg[3];
  HILA_LAUNCH((axpy_k<R, R>), rowsK, s, dq.get(), go.dq.get(), rowsK, R(1), false);
  if (!plan.has_S) HILA_LAUNCH((axpy_k<R, R>), rowsK, s, dk.get(), go.dk.get(), rowsK, R(1), false);
  else HILA_CUDA_CHECK(cudaMemsetAsync(dk.get(), 0, size_t(rowsK) * sizeof(R), s));
  if (!plan.has_P) HILA_LAUNCH((axpy_k<R, R>), rowsV, s, dv.get(), go.dv.get(), rowsV, R(1), false);
  dg[plan.gO] = std::move(go.dg);
  DevBuf<R> dP0, dS0;
  if (plan.has_P) {  // Hh = GLA_gP(Q, K, V'): cotangent = outer value gradient
    DevBuf<T> dHh(size_t(rowsV), s);
    HILA_LAUNCH((axpy_k<T, R>), rowsV, s, dHh.get(), go.dv.get(), rowsV, R(1), false);
    PrimGradBufs<T> gp(c, c.dvp, p.d_init.P.defined(), s);
    GlaArgs<T> b = c.inner_P();
    b.hbuf = in.Pbuf.get(), b.ht = in.Pf.get(), b.h0 = c.P0.get(), b.dO = dHh.get(), b.dht = dPf.get();
    gp.attach(b);
    gla_backward<T>(b, s);
    HILA_LAUNCH((axpy_k<R, R>), rowsK, s, dq.get(), gp.dq.get(), rowsK, R(1), true);
    HILA_LAUNCH((axpy_k<R, R>), rowsK, s, dk.get(), gp.dk.get(), rowsK, R(1), true);
    HILA_LAUNCH((axpy_k<R, R>), rowsV, s, dv.get(), gp.dv.get(), rowsV, R(1), false);
    dg[plan.gP] = std::move(gp.dg);
    dP0 = std::move(gp.dh0);
  }
  if (plan.has_S) {  // U = GLA_gS(Q, K, K) + ridge Q^: cotangent = outer key gradient
    DevBuf<T> dU(size_t(rowsK), s);
    HILA_LAUNCH((axpy_k<T, R>), rowsK, s, dU.get(), go.dk.get(), rowsK, R(1), false);
    if (plan.ridge != 0)  // dq^ += ridge dU (the unpack multiplies by scale)
      HILA_LAUNCH((axpy_k<R, R>), rowsK, s, dq.get(), go.dk.get(), rowsK, R(plan.ridge), true);
    PrimGradBufs<T> gs(c, c.dkp, p.d_init.S.defined(), s);
    GlaArgs<T> b = c.inner_S();
    b.hbuf = in.Sbuf.get(), b.ht = in.Sf.get(), b.h0 = c.S0.get(), b.dO = dU.get(), b.dht = dSf.get();
    gs.attach(b);
    gla_backward<T>(b, s);
    HILA_LAUNCH((axpy_k<R, R>), rowsK, s, dq.get(), gs.dq.get(), rowsK, R(1), true);
    HILA_LAUNCH((axpy_k<R, R>), rowsK, s, dk.get(), gs.dk.get(), rowsK, R(1), true);
    HILA_LAUNCH((axpy_k<R, R>), rowsK, s, dk.get(), gs.dv.get(), rowsK, R(1), true);  // K is also the value
    dg[plan.gS] = std::move(gs.dg);
    dS0 = std::move(gs.dh0);
  }
  if (p.dq.defined()) unpack_to<R>(p.dq, dq.get(), r, r.G, c.rep, int(r.dk), c.dkp, R(r.scale), s);
  if (p.dk.defined()) unpack_to<R>(p.dk, dk.get(), r, r.G, c.rep, int(r.dk), c.dkp, R(1), s);
  if (p.dv.defined()) unpack_to<R>(p.dv, dv.get(), r, r.H, 1, int(r.dv), c.dvp, R(1), s);
  if (p.dg.defined()) {
    const int prims = r.traits.num_primitives;
    if (r.gate_cols == 1) {  // tied: sum over primitives
      for (int i = 1; i < prims; ++i)
        HILA_LAUNCH((axpy_k<R, R>), r.H * c.Ttot, s, dg[0].get(), dg[i].get(), r.H * c.Ttot, R(1), true);
      HILA_LAUNCH(unpack_gates<R>, r.H * c.Ttot, s, Strided(p.dg), dg[0].get(), r.T, r.H, c.Ttot, 0);
    } else {
      for (int i = 0; i < prims; ++i)
        HILA_LAUNCH(unpack_gates<R>, r.H * c.Ttot, s, Strided(p.dg), dg[i].get(), r.T, r.H, c.Ttot, i);
    }
  }
  if (p.d_init.S.defined())
    HILA_LAUNCH(unpack_sym<R>, c.NH * r.dk * (r.dk + 1) / 2, s, Strided(p.d_init.S), dS0.get(), c.NH, r.H, int(r.dk), c.dkp, true);
  if (p.d_init.P.defined())
    HILA_LAUNCH(unpack_state<R>, c.NH * r.dk * r.dvp, s, Strided(p.d_init.P), dP0.get(), c.NH, r.H, int(r.dk), int(r.dvp), c.dkp, c.dvp);
  if (p.d_init.H.defined())
    HILA_LAUNCH(unpack_state<R>, c.NH * r.dk * r.dvp, s, Strided(p.d_init.H), go.dh0.get(), c.NH, r.H, int(r.dk), int(r.dvp), c.dkp, c.dvp);
}

template <template <class> class F, class... Args>
void by_dtype(DType dt, Args&&... args) {
  switch (dt) {
    case DType::bf16: F<__nv_bfloat16>::run(args...); break;
    case DType::f16: F<__half>::run(args...); break;
    case DType::f32: F<float>::run(args...); break;
    case DType::f64: F<double>::run(args...); break;
    default: throw Error("q", std::string("expected a floating dtype, got ") + dtype_name(dt));
  }
}
template <class T>
struct Fwd {
  static void run(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) { forward_impl<T>(r, p, s); }
};
template <class T>
struct Bwd {
  static void run(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) { backward_impl<T>(r, p, s); }
};

size_t smem_need(DType dt, int dk, int dv) {
  switch (dt) {
    case DType::bf16: return gla_smem_need<__nv_bfloat16>(dk, dv);
    case DType::f16: return gla_smem_need<__half>(dk, dv);
    case DType::f32: return gla_smem_need<float>(dk, dv);
    default: return gla_smem_need<double>(dk, dv);
  }
}

}  // namespace

}  // namespace hila::cuda

namespace hila::detail {

void cuda_check_supported(const Resolved& r, DType dt) {
  if (r.traits.loglinear && !r.traits.delta)
    throw Error("op", std::string("expected gla, hla2, ahla, hla3, gdn or loglinear_gdn on a CUDA device "
                                  "(log-linear Mamba-2 and the log-linear HLA family run on the CPU backend "
                                  "so far), got ") + op_name(r.cfg.op));
  if (r.form != Form::chunk)
    throw Error("form", std::string("expected chunk on a CUDA device (the naive, serial and scan forms "
                                    "run on the CPU backend), got ") + form_name(r.form));
  if (r.chunk != cuda::kChunk)
    throw Error("chunk", "expected " + std::to_string(cuda::kChunk) + " on a CUDA device, got " +
                             std::to_string(r.chunk));
  if (r.traits.delta) return;  // the delta sweeps keep their matrices in global scratch (cuda/delta.cu)
  int dev = 0, optin = 0;
  HILA_CUDA_CHECK(cudaGetDevice(&dev));
  HILA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  const size_t need = cuda::smem_need(dt, cuda::pad16(r.dk), cuda::pad16(r.dvp));
  if (need > size_t(optin))
    throw Error("dk", std::string("expected head dims whose tiles fit in shared memory (") +
                          std::to_string(optin) + " bytes per block on this device), got dk = " +
                          std::to_string(r.dk) + ", dv = " + std::to_string(r.dv) + " in " + dtype_name(dt) +
                          ", which needs " + std::to_string(need) + "; use bfloat16/float16 or smaller head dims");
}

void cuda_forward(const Resolved& r, const ForwardParams& p) {
  cuda::DeviceScope scope(p.q.device.index);
  cuda_check_supported(r, p.q.dtype);
  cuda::by_dtype<cuda::Fwd>(p.q.dtype, r, p, static_cast<cudaStream_t>(p.stream));
}

void cuda_backward(const Resolved& r, const BackwardParams& p) {
  cuda::DeviceScope scope(p.q.device.index);
  cuda_check_supported(r, p.q.dtype);
  cuda::by_dtype<cuda::Bwd>(p.q.dtype, r, p, static_cast<cudaStream_t>(p.stream));
}

}  // namespace hila::detail
