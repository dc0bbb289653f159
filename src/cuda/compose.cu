// SPDX-License-Identifier: Apache-2.0
// Every hila operator as a composition of primitives on the GPU, as cpu/compose.cpp does on the CPU
// (docs/math/HLA.md §2, §11; docs/math/LOGLINEAR.md §7; core/plan.h decides the composition for both):
//   gla / loglinear / gdn / loglinear_gdn:  O = prim(Q, K, V)
//   hla2:  U = GLA_gS(Q, K, K) (+ ridge Q),  O = prim_gY(Q, U, V)
//   ahla:  Hh = GLA_gP(Q, K, V),             O = prim_gE(Q, K, Hh)
//   hla3:  U, Hh as above,                    O = prim_gX(Q, U, Hh)
// The outer prim is the GLA primitive (gla/) or the log-linear one (loglinear/). Call packs the
// strided, sequence-first inputs into head-major buffers padded to multiples of 16 columns (the
// kernels then need no head-dim templates), or reads the caller's tensors in place where the
// tensor-core kernels can; the primitives run on the caller's stream, and outputs, states and
// gradients are unpacked (dq, dk summed over the heads of a GQA group). Temporary buffers come from
// the call's arena or the stream-ordered pool (runtime/runtime.cuh).
#include <algorithm>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "core/plan.h"
#include "cuda/compose.cuh"
#include "cuda/delta/delta.cuh"
#include "cuda/gla/gla.cuh"
#include "cuda/loglinear/loglinear.cuh"
#include "cuda/prims/pack.cuh"
#include "cuda/runtime/config.h"
#include "cuda/runtime/runtime.cuh"
#include "hila/error.h"

namespace hila::cuda {

namespace {

// An operand as the kernels read it: element (row r, head x, column c) at p + x*hs + r*ld + c;
// ld = hs = 0 is the packed layout [heads][Ttot][d_pad].
template <class T>
struct Operand {
  const T* p = nullptr;
  int64_t ld = 0, hs = 0;
};

// One call's inputs, states and the composition over GLA primitives (core/plan.h).
template <class T>
struct Call {
  using R = Acc<T>;
  const detail::Resolved& r;
  const detail::OpPlan plan;
  cudaStream_t s;
  int dkp, dvp, rep;
  int64_t Ttot, N, NH;
  DevBuf<T> qbuf, kbuf, vbuf;  // packed copies, when the caller's layout cannot be read in place
  Operand<T> q, k, v;
  DevBuf<R> g[3], b[3];  // packed log-gates and their chunk-local cumsums, per gate column
  DevBuf<R> S0, P0, H0;  // packed initial states (dense)
  SeqTables seqs;
  std::optional<LoglinearTables> tables;  // log-linear outer primitive: segments, n0, Fenwick slots
  DevBuf<R> lam;               // [H][Ttot][nL]
  // log-linear outer primitive in the chunk-parallel tree form (loglinear/tree.cuh): every sequence from a
  // chunk-aligned position (with its initial state when n0 > 0)
  const bool tree;
  static bool tree_form(const detail::Resolved& r, const ForwardParams& p) {
    if (!detail::OpPlan::make(r.cfg).fenwick) return false;
    return std::all_of(r.seqs.begin(), r.seqs.end(),
                       [&](const auto& x) { return x.n0 % kChunk == 0 && (x.n0 == 0 || p.init.H.defined()); }) &&
           loglinear_tree_usable<T>(pad16(r.dk), pad16(r.dvp));
  }

  Call(const detail::Resolved& r_, const ForwardParams& p, cudaStream_t s_)
      : r(r_), plan(detail::OpPlan::make(r_.cfg)), s(s_), dkp(pad16(r_.dk)), dvp(pad16(r_.dvp)),
        rep(int(r_.H / r_.G)), Ttot(r_.B * r_.T), N(int64_t(r_.seqs.size())), NH(N * r_.H), seqs(r_, s_, r_.chunk),
        tree(tree_form(r_, p)) {
    q = operand(p.q, r.G, int(r.dk), dkp, -1, qbuf);
    k = operand(p.k, r.G, int(r.dk), dkp, -1, kbuf);
    v = operand(p.v, r.H, int(r.dv), dvp, r.cfg.normalize ? int(r.dv) : -1, vbuf);
    for (int c = 0; c < r.gate_cols; ++c) {  // tied: one column serves every primitive
      g[c] = DevBuf<R>(size_t(r.H * Ttot), s);
      HILA_LAUNCH(pack_log_gates<R>, r.H * Ttot, s, g[c].get(), Strided(p.g), r.T, r.H, Ttot, c);
      b[c] = DevBuf<R>(size_t(r.H * Ttot), s);
      GlaArgs<T> a = args({}, 1, {}, 1, dvp, c);
      gla_chunk_cumsum<T>(a, b[c].get(), s);
    }
    if (p.init.S.defined()) {
      S0 = DevBuf<R>(size_t(NH * dkp * dkp), s);
      HILA_LAUNCH(pack_sym<R>, NH * dkp * dkp, s, S0.get(), Strided(p.init.S), NH, r.H, int(r.dk), dkp, false);
    }
    if (p.init.P.defined()) P0 = pack_dense(p.init.P);
    if (plan.fenwick) {
      tables.emplace(r, s);
      lam = DevBuf<R>(size_t(r.H * Ttot * r.nL), s);
      const Strided in(p.lam);
      HILA_LAUNCH(pack_lam<R>, r.H * Ttot * r.nL, s, lam.get(), in, LamIndex(in, r.T, r.H, Ttot, int(r.nL)));
    }
    if (p.init.H.defined()) H0 = pack_H(p.init.H, false);
  }
  // Outer state H: dense [N][H][dkp][dvp], or Fenwick [N][H][Ls][dkp][dvp] (docs/math/LOGLINEAR.md §8)
  // holding the slots live at n0 (initial) or at n0 + len (end of the call).
  int64_t slots() const { return plan.fenwick ? tables->Ls : 1; }
  DevBuf<R> pack_H(const TensorView& t, bool at_end) const {
    if (!plan.fenwick) return pack_dense(t);
    const int64_t n = NH * tables->Ls * dkp * dvp;
    DevBuf<R> b(size_t(n), s);
    HILA_LAUNCH(pack_levels<R>, n, s, b.get(), Strided(t), (at_end ? tables->d_nend : tables->d_n0).get(), NH, r.H,
                int(t.shape[2]), tables->Ls, int(r.dk), int(r.dvp), dkp, dvp);
    return b;
  }
  void unpack_H(const TensorView& out, const R* in) const {
    if (plan.fenwick)
      HILA_LAUNCH(unpack_levels<R>, NH * out.shape[2] * r.dk * r.dvp, s, Strided(out), in, NH, r.H, int(out.shape[2]),
                  tables->Ls, int(r.dk), int(r.dvp), dkp, dvp);
    else
      HILA_LAUNCH(unpack_state<R>, NH * r.dk * r.dvp, s, Strided(out), in, NH, r.H, int(r.dk), int(r.dvp), dkp, dvp);
  }
  // Arguments of the log-linear outer primitive; hst holds the live levels stored per segment.
  LoglinearArgs<T> loglinear_args(const GlaArgs<T>& base, R* hst, R* dlam = nullptr, bool want_final = false) const {
    LoglinearArgs<T> a;
    a.tree = tree, a.want_final = want_final;
    a.p = base;
    a.p.hbuf = nullptr;
    a.hst = hst;
    a.lam = lam.get(), a.nL = int(r.nL), a.Ls = tables->Ls;
    a.n0 = tables->d_n0.get(), a.seg0 = tables->d_seg0.get(), a.hoff = tables->d_hoff.get(), a.goff = tables->d_goff.get();
    a.seg_seq = tables->d_seg_seq.get(), a.nseg = tables->nseg;
    a.dlam = dlam;
    return a;
  }
  // The caller's [B, T, X, d] tensor in place, or packed into `buf` ([X][Ttot][dp], a ones column at `ones`).
  Operand<T> operand(const TensorView& t, int64_t X, int d, int dp, int ones, DevBuf<T>& buf) const {
    if (ones < 0 && d == dp && (!plan.fenwick || tree) && in_place_ok<T>(t, r.B, r.T))
      return {static_cast<const T*>(t.data), t.stride[1], t.stride[2]};
    buf = DevBuf<T>(size_t(X * Ttot * dp), s);
    pack(buf.get(), t, X, d, dp, ones);
    return {buf.get(), 0, 0};
  }
  // [B, T, X, d] -> packed [X][Ttot][dp] (a ones column at `ones`); 16 bytes per thread when the
  // caller's layout is one the tensor-core kernels could read in place
  void pack(T* out, const TensorView& t, int64_t X, int d, int dp, int ones) const {
    pack_to<T>(out, t, r, X, d, dp, ones, s);
  }
  DevBuf<R> pack_dense(const TensorView& t) const {
    DevBuf<R> b(size_t(NH * dkp * dvp), s);
    HILA_LAUNCH(pack_state<R>, NH * dkp * dvp, s, b.get(), Strided(t), NH, r.H, int(r.dk), int(r.dvp), dkp, dvp);
    return b;
  }
  const R* gate(int prim) const { return r.gate_cols == 0 ? nullptr : g[r.gate_cols == 1 ? 0 : prim].get(); }
  const R* gate_cumsum(int prim) const { return r.gate_cols == 0 ? nullptr : b[r.gate_cols == 1 ? 0 : prim].get(); }

  // Base arguments of a primitive over (Q, key, value) with the given gate column.
  GlaArgs<T> args(const Operand<T>& key, int key_div, const Operand<T>& val, int val_div, int dval, int prim) const {
    GlaArgs<T> a;
    a.q = q.p, a.k = key.p, a.v = val.p;
    a.q_ld = q.ld, a.q_hs = q.hs, a.k_ld = key.ld, a.k_hs = key.hs, a.v_ld = val.ld, a.v_hs = val.hs;
    a.q_div = rep, a.k_div = key_div, a.v_div = val_div;
    a.g = gate(prim);
    a.b = gate_cumsum(prim);
    a.H = int(r.H), a.N = int(N), a.Ttot = Ttot, a.dk = dkp, a.dv = dval;
    a.row0 = seqs.d_row0.get(), a.len = seqs.d_len.get(), a.chunk0 = seqs.d_chunk0.get();
    a.chunk_seq = seqs.d_chunk_seq.get();
    a.nchunks = seqs.nchunks;
    a.C = int(r.chunk);
    a.scale = R(r.scale);
    return a;
  }
  GlaArgs<T> inner_S() const { return args(k, rep, k, rep, dkp, plan.gS); }
  GlaArgs<T> inner_P() const { return args(k, rep, v, 1, dvp, plan.gP); }

  // Forward of the inner primitives: U (+ ridge) and Hh, with their final states / chunk states.
  struct Inner {
    DevBuf<T> U, Hh;
    DevBuf<R> Sf, Pf;
    DevBuf<StateOperand<T>> Sbuf, Pbuf;
  };
  Inner run_inner(bool with_chunk_states) const {
    Inner in;
    const size_t rowsU = size_t(r.H * Ttot * dkp), rowsH = size_t(r.H * Ttot * dvp);
    if (plan.has_S) {
      in.U = DevBuf<T>(rowsU, s);
      in.Sf = DevBuf<R>(size_t(NH * dkp * dkp), s);
      GlaArgs<T> a = inner_S();
      a.o = in.U.get(), a.h0 = S0.get(), a.ht = in.Sf.get();
      if (with_chunk_states) a.hbuf = (in.Sbuf = DevBuf<StateOperand<T>>(size_t(seqs.nchunks * r.H * dkp * dkp), s)).get();
      gla_forward<T>(a, s);
      if (plan.ridge != 0)
        HILA_LAUNCH(add_ridge<T>, int64_t(rowsU), s, in.U.get(), q.p, row_ld(q.ld, dkp), head_stride(q.hs, Ttot, dkp),
                    r.H, rep, Ttot, dkp, R(plan.ridge * r.scale));
    }
    if (plan.has_P) {
      in.Hh = DevBuf<T>(rowsH, s);
      in.Pf = DevBuf<R>(size_t(NH * dkp * dvp), s);
      GlaArgs<T> a = inner_P();
      a.o = in.Hh.get(), a.h0 = P0.get(), a.ht = in.Pf.get();
      if (with_chunk_states) a.hbuf = (in.Pbuf = DevBuf<StateOperand<T>>(size_t(seqs.nchunks * r.H * dkp * dvp), s)).get();
      gla_forward<T>(a, s);
    }
    return in;
  }
  GlaArgs<T> outer(const Inner& in) const {
    return args(plan.has_S ? Operand<T>{in.U.get()} : k, plan.has_S ? 1 : rep, plan.has_P ? Operand<T>{in.Hh.get()} : v,
                1, dvp, plan.gO);
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
    if (fin.H.defined()) unpack_H(fin.H, Hf);
    upload_final_positions(fin.pos, r, s);
  }
};

// Per-primitive gradient buffers (per head, accumulation type).
template <class T>
struct PrimGradBufs {
  using R = Acc<T>;
  DevBuf<R> dg, dh0;
  DevBuf<StateOperand<T>> dhbuf;
  // fenwick: the log-linear outer primitive (dh0 holds Fenwick slots; the segment sweep always
  // needs it as its working adjoint, the tree form only when asked for)
  PrimGradBufs(const Call<T>& c, int dval, bool want_dh0, cudaStream_t s, bool fenwick = false)
      : dg(size_t(c.r.H * c.Ttot), s),
        dh0(want_dh0 || (fenwick && !c.tree) ? size_t(c.NH * (fenwick ? c.slots() : 1) * c.dkp * dval) : 0, s),
        dhbuf(fenwick ? 0 : size_t(c.seqs.nchunks * c.r.H * c.dkp * dval), s) {}
  void attach(GlaArgs<T>& a) const { a.dg = dg.get(), a.dh0 = dh0.get(), a.dhbuf = dhbuf.get(); }
};

// One caller gradient (dq, dk or dv) of a composition (docs/math/HLA.md §7.2): the primitives' chunk
// kernels add their contributions into one fp32 per-head buffer [H][Ttot][dp] in place
// (GradOut::add), and the last one writes the caller's 16-bit tensor directly where its layout,
// the padding and GQA allow (no fp32 pass); otherwise finish() unpacks the buffer.
template <class T>
struct GradSum {
  using R = Acc<T>;
  const Call<T>& c;
  const TensorView& dst;
  int64_t X;  // heads of dst: G for dq, dk (rep q-heads each), H for dv
  int rep, d, dp;
  R mult;
  int left;  // contributions still to come
  DevBuf<R> buf;
  bool direct = false;
  GradSum(const Call<T>& c, const TensorView& dst, int64_t X, int rep, int d, int dp, R mult, int contributions)
      : c(c), dst(dst), X(X), rep(rep), d(d), dp(dp), mult(mult), left(contributions) {}
  // the next contribution's targets (out: the args' fp32 pointer); gradout: its kernels honor GradOut::p
  void route(R*& out, GradOut<T>& gt, bool gradout) {
    gt = GradOut<T>{};
    gt.add = buf.get();
    if (--left == 0 && gradout && rep == 1 && d == dp && in_place_ok<T>(dst, c.r.B, c.r.T)) {
      gt.p = static_cast<T*>(dst.data), gt.ld = dst.stride[1], gt.hs = dst.stride[2], gt.mult = float(mult);
      out = nullptr, direct = true;
      return;
    }
    if (!buf.get()) buf = DevBuf<R>(size_t(c.r.H * c.Ttot * dp), c.s);
    out = buf.get();
  }
  R* sum() const { return buf.get(); }
  void finish() const {
    if (dst.defined() && !direct) unpack_to<R>(dst, buf.get(), c.r, X, rep, d, dp, mult, c.s);
  }
};

// Where the outer primitive writes O': the caller's o in place when possible, else a packed
// buffer that write_output unpacks (and normalizes).
template <class T>
struct OutputTarget {
  DevBuf<T> buf;
  bool in_place = false;
  OutputTarget(const Call<T>& c, const TensorView& o, bool need_packed) {
    in_place = !need_packed && !c.plan.normalize && (!c.plan.fenwick || c.tree) &&
               in_place_ok<T>(o, c.r.B, c.r.T);
    if (!in_place) buf = DevBuf<T>(size_t(c.r.H * c.Ttot * c.dvp), c.s);
  }
  void attach(GlaArgs<T>& a, const TensorView& o) const {
    if (in_place) a.o = static_cast<T*>(o.data), a.o_ld = o.stride[1], a.o_hs = o.stride[2];
    else a.o = buf.get();
  }
};

// rows [row0[i], row0[i] + len[i]) of src -> dst, both [B, T, X, d] or [B, T, X] (d = 1; row = b T + t)
__global__ void copy_seq_rows(Strided dst, Strided src, const int64_t* row0, const int64_t* len, int64_t N,
                              int64_t maxlen, int64_t T, int64_t X, int d) {
  const int64_t n = N * maxlen * X * d;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(e % d);
    const int64_t x = (e / d) % X, j = (e / (d * X)) % maxlen, i = e / (d * X * maxlen);
    if (j >= len[i]) continue;
    const int64_t r = row0[i] + j, b = r / T, t = r % T;
    st<float>(dst, b * dst.s[0] + t * dst.s[1] + x * dst.s[2] + c * dst.s[3],
              ld<float>(src, b * src.s[0] + t * src.s[1] + x * src.s[2] + c * src.s[3]));
  }
}

template <class T>
void forward_call(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s);
template <class T>
void backward_call(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s);

// A log-linear call whose initial positions are not all multiples of the chunk (a prefill after
// some decode steps, a training segment that starts there), split in two calls that pass the state
// along, which equal one call (docs/math/LOGLINEAR.md §3.4): `head` holds every sequence's rows up to its
// next multiple of the chunk (at most 63; the segment sweep), `rest` the others from there (the tree
// form). Taken when the rest can run the tree form. Owns the state at the end of the heads (mid,
// and its cotangent dmid for a backward) in the public layout, and scratch tensors for the head
// call's row outputs, whose head rows are copied into the caller's tensors at the end.
template <class T>
struct HeadSplit {
  using R = Acc<T>;
  static bool wanted(const detail::Resolved& r, const ForwardParams& p) {
    if (!detail::OpPlan::make(r.cfg).fenwick || !p.init.H.defined() ||
        std::all_of(r.seqs.begin(), r.seqs.end(), [](const auto& x) { return x.n0 % kChunk == 0; }))
      return false;
    return loglinear_tree_usable<T>(pad16(r.dk), pad16(r.dvp));
  }
  const detail::Resolved& r;
  detail::Resolved head, rest;
  cudaStream_t s;
  Device dev;
  int64_t N = 0, maxlen = 0, mid_max = 0;
  std::vector<int64_t> row0, len;  // per sequence: its first row (b T + t) and head rows
  std::deque<DevBuf<char>> bufs;   // the mid states and scratch tensors

  HeadSplit(const detail::Resolved& r_, const ForwardParams& p, cudaStream_t s_)
      : r(r_), head(r_), rest(r_), s(s_), dev(p.q.device), N(int64_t(r_.seqs.size())) {
    for (int64_t i = 0; i < N; ++i) {
      const detail::SeqInfo& x = r.seqs[size_t(i)];
      const int64_t h = std::min(x.len, (kChunk - x.n0 % kChunk) % kChunk);
      head.seqs[size_t(i)].len = h;
      rest.seqs[size_t(i)].row0 += h, rest.seqs[size_t(i)].len -= h, rest.seqs[size_t(i)].n0 += h;
      row0.push_back(x.b * r.T + x.row0), len.push_back(h);
      mid_max = std::max(mid_max, x.n0 + h), maxlen = std::max(maxlen, h);
    }
  }
  TensorView alloc(DType dt, const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    bufs.emplace_back(size_t(n * dtype_size(dt)), s);
    return TensorView::contiguous_view(bufs.back().get(), dt, shape.data(), int(shape.size()), dev);
  }
  // A state at the end of the heads (fp32, fp64 for fp64 inputs), the parts the op has.
  StateView state() {
    const StateShape sh = state_shape(r.cfg, N, r.H, r.dk, r.dv, mid_max);
    constexpr DType kR = sizeof(R) == 8 ? DType::f64 : DType::f32;
    StateView st;
    st.pos = alloc(DType::i64, {N});
    if (sh.S) st.S = alloc(kR, sh.S_shape);
    if (sh.P) st.P = alloc(kR, sh.P_shape);
    st.H = alloc(kR, sh.H_shape);
    return st;
  }
  TensorView scratch_like(const TensorView& t) {
    return t.defined() ? alloc(t.dtype, std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim)) : TensorView{};
  }
  // The heads' forward from the caller's initial state: the final state into a new `mid` state,
  // o into scratch (copy_head_rows moves its head rows). Returns the params it ran with.
  ForwardParams head_forward(const ForwardParams& p) {
    ForwardParams f = p;
    f.final_state = state();
    f.o = scratch_like(p.o);
    forward_call<T>(head, f, s);
    return f;
  }
  // The head rows of src (a scratch tensor of the head call) into dst.
  void copy_head_rows(const TensorView& dst, const TensorView& src) const {
    if (!dst.defined() || maxlen == 0) return;
    const int64_t X = dst.shape[2];
    const int d = dst.ndim > 3 ? int(dst.shape[3]) : 1;
    const DevBuf<int64_t> d_row0 = SeqTables::upload(row0, s), d_len = SeqTables::upload(len, s);
    HILA_LAUNCH(copy_seq_rows, N * maxlen * X * d, s, Strided(dst), Strided(src), d_row0.get(), d_len.get(), N, maxlen,
                r.T, X, d);
  }
};

// Forward: the heads (final state: mid; o rows to scratch), then the rest from mid.
template <class T>
void forward_split_head(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) {
  HeadSplit<T> sp(r, p, s);
  const ForwardParams f = sp.head_forward(p);
  ForwardParams p2 = p;
  p2.init = f.final_state;
  forward_call<T>(sp.rest, p2, s);
  sp.copy_head_rows(p.o, f.o);
}

// Backward: the heads' forward (mid, o rows), the rest's backward from mid (d_init: dmid; the
// caller's d_final, final state and gradient rows), then the heads' backward with dmid as their
// final-state cotangent (the caller's d_init; gradient rows to scratch).
template <class T>
void backward_split_head(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) {
  HeadSplit<T> sp(r, p, s);
  const ForwardParams f = sp.head_forward(p);
  BackwardParams b2 = p;
  b2.init = f.final_state;
  b2.d_init = sp.state();
  b2.d_init.pos = {};
  backward_call<T>(sp.rest, b2, s);
  BackwardParams b1 = p;
  b1.final_state = {}, b1.o = {};
  b1.d_final = b2.d_init;
  b1.dq = sp.scratch_like(p.dq), b1.dk = sp.scratch_like(p.dk), b1.dv = sp.scratch_like(p.dv);
  b1.dg = sp.scratch_like(p.dg), b1.dlam = sp.scratch_like(p.dlam);
  backward_call<T>(sp.head, b1, s);
  sp.copy_head_rows(p.o, f.o);
  sp.copy_head_rows(p.dq, b1.dq), sp.copy_head_rows(p.dk, b1.dk), sp.copy_head_rows(p.dv, b1.dv);
  sp.copy_head_rows(p.dg, b1.dg), sp.copy_head_rows(p.dlam, b1.dlam);
}

// One forward of the composition (docs/math/HLA.md §11): the inner primitives, then the outer one.
template <class T>
void forward_call(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) {
  using R = Acc<T>;
  const Call<T> c(r, p, s);
  const auto in = c.run_inner(false);
  const OutputTarget<T> O(c, p.o, false);
  DevBuf<R> Hf(size_t(c.NH * c.slots() * c.dkp * c.dvp), s);
  GlaArgs<T> a = c.outer(in);
  O.attach(a, p.o);
  a.h0 = c.H0.get(), a.ht = Hf.get();
  if (c.plan.fenwick) loglinear_forward<T>(c.loglinear_args(a, nullptr, nullptr, p.final_state.H.defined()), *c.tables, s);
  else gla_forward<T>(a, s);
  if (!O.in_place) c.write_output(p.o, O.buf.get());
  c.write_states(p.final_state, in, Hf.get());
}

// VJP of the composition (docs/math/HLA.md §7.2), in the stages of run(): the outer primitive's forward,
// the cotangents of O' and of the final states, the outer primitive's backward, then the inner
// ones with the outer key / value gradients as their output cotangents, and the gradients out.
// dq, dk, dv accumulate in the chunk kernels (GradSum), the last contribution writing the caller's
// tensor where it can. Every temporary lives to the end of the call and is taken in the order of
// the stages (the order the workspace size is measured in).
template <class T>
struct BackwardCall {
  using R = Acc<T>;
  const detail::Resolved& r;
  const BackwardParams& p;
  cudaStream_t s;
  const Call<T> c;
  const detail::OpPlan& plan;
  const typename Call<T>::Inner in;
  const int64_t rowsK, rowsV;                // elements of [H][Ttot][dkp], [H][Ttot][dvp]
  GlaArgs<T> a;                              // the outer primitive
  GlaArgs<T> fwd;                            // its forward, when it runs beside the reverse sweep
  bool beside = false;
  DevBuf<R> Hf;                              // the outer final state
  DevBuf<StateOperand<T>> Hbuf;              // GLA outer: the state entering each chunk
  DevBuf<R> Hst;                             // log-linear sweep: the live levels entering each segment
  std::optional<OutputTarget<T>> O;          // O' (normalize needs it; o when asked for)
  DevBuf<T> dObuf;                           // dO' packed, when not read in place
  DevBuf<R> dSf, dPf, dHf;                   // final-state cotangents, packed
  bool outer_gradout = false, fold_S = false;
  std::optional<GradSum<T>> gq, gk, gv;
  std::optional<PrimGradBufs<T>> go, gp, gs;  // outer, inner P, inner S
  DevBuf<T> dU, dHh;                         // outer key / value gradients: the inner cotangents
  DevBuf<R> dU32, dHh32;                     // the same in fp32, where the outer cannot write 16 bits
  DevBuf<R> dlam;
  const R* dg[3] = {};                       // per-primitive dg (per gate column)

  BackwardCall(const detail::Resolved& r_, const BackwardParams& p_, cudaStream_t s_)
      : r(r_), p(p_), s(s_), c(r_, p_, s_), plan(c.plan), in(c.run_inner(true)), rowsK(r_.H * c.Ttot * c.dkp),
        rowsV(r_.H * c.Ttot * c.dvp) {}

  void run() {
    outer_forward();
    cotangents();
    outer_backward();
    if (plan.has_P) inner_P_backward();
    if (plan.has_S) inner_S_backward();
    write_gradients();
  }

  // The outer primitive's forward: its chunk states, and O' only when normalizing (the cotangent
  // needs it) or when o is asked for. GLA outer without normalize: dO does not depend on O', so the
  // forward runs inside gla_backward, beside the reverse sweep (the outputs it feeds are written
  // after).
  void outer_forward() {
    Hf = DevBuf<R>(size_t(c.NH * c.slots() * c.dkp * c.dvp), s);
    Hbuf = DevBuf<StateOperand<T>>(plan.fenwick ? 0 : size_t(c.seqs.nchunks * r.H * c.dkp * c.dvp), s);
    a = c.outer(in);
    // log-linear: the tree form (no stored levels) or the sweep (the live levels entering each segment)
    Hst = DevBuf<R>(plan.fenwick && !c.tree ? size_t(c.tables->stored_levels() * r.H * c.dkp * c.dvp) : 0, s);
    if (plan.normalize || p.o.defined()) {
      O.emplace(c, p.o, plan.normalize);
      O->attach(a, p.o);
    }
    a.h0 = c.H0.get(), a.ht = Hf.get(), a.hbuf = Hbuf.get();
    fwd = a;
    beside = !plan.fenwick && !plan.normalize;
    if (plan.fenwick) {
      if (!c.tree || a.o || p.final_state.H.defined())
        loglinear_forward<T>(c.loglinear_args(a, Hst.get(), nullptr, p.final_state.H.defined()), *c.tables, s);
    } else if (!beside) {
      gla_forward<T>(a, s);
    }
    if (!beside) forward_outputs();
    a.o = nullptr;
  }
  void forward_outputs() const {
    if (p.o.defined() && !O->in_place) c.write_output(p.o, O->buf.get());
    c.write_states(p.final_state, in, Hf.get());
  }

  // Cotangents of O' (the caller's dO in place where the kernels read it; normalize: through the
  // division, docs/math/HLA.md §4) and of the final states.
  void cotangents() {
    if (!plan.normalize && (!plan.fenwick || c.tree) && in_place_ok<T>(p.d_o, r.B, r.T)) {
      a.dO = static_cast<const T*>(p.d_o.data), a.dO_ld = p.d_o.stride[1], a.dO_hs = p.d_o.stride[2];
    } else {
      dObuf = DevBuf<T>(size_t(rowsV), s);
      c.pack(dObuf.get(), p.d_o, r.H, int(r.dv), c.dvp, -1);
      if (plan.normalize)
        HILA_LAUNCH(normalized_cotangent<T>, r.H * c.Ttot, s, dObuf.get(), O->buf.get(), r.H * c.Ttot, int(r.dv),
                    c.dvp, R(plan.eps));
      a.dO = dObuf.get();
    }
    if (p.d_final.S.defined()) {
      dSf = DevBuf<R>(size_t(c.NH * c.dkp * c.dkp), s);
      HILA_LAUNCH(pack_sym<R>, c.NH * c.dkp * c.dkp, s, dSf.get(), Strided(p.d_final.S), c.NH, r.H, int(r.dk), c.dkp,
                  true);
    }
    if (p.d_final.P.defined()) dPf = c.pack_dense(p.d_final.P);
    if (p.d_final.H.defined()) dHf = c.pack_H(p.d_final.H, true);
  }

  // The outer primitive's backward. dq, dk, dv collect in GradSums (the outer's kernels honor
  // GradOut where they are the tensor-core GLA kernels or the tree form; the inner ones are GLA
  // primitives). The inner S primitive's value is its key: the tensor-core kernels fold dv into dk
  // (GlaArgs::value_is_key), one contribution; elsewhere, and with HILA_FOLD_S=0 (for A/B), two.
  void outer_backward() {
    outer_gradout = kTensorCore<T> && (!plan.fenwick || c.tree);
    gq.emplace(c, p.dq, r.G, c.rep, int(r.dk), c.dkp, R(r.scale), 1 + plan.has_P + plan.has_S);
    fold_S = kTensorCore<T> && config().fold_s;
    gk.emplace(c, p.dk, r.G, c.rep, int(r.dk), c.dkp, R(1), (plan.has_S ? (fold_S ? 1 : 2) : 1) + plan.has_P);
    gv.emplace(c, p.dv, r.H, 1, int(r.dv), c.dvp, R(1), 1);
    go.emplace(c, c.dvp, p.d_init.H.defined(), s, plan.fenwick);
    a.dht = dHf.get();
    go->attach(a);
    gq->route(a.dq, a.dq_out, outer_gradout);
    // the outer key gradient dU (has_S) and value gradient dHh (has_P) are 16-bit GEMM operands of
    // the inner backwards: written so directly where the outer honors GradOut (and dU is not also
    // needed in fp32 for the ridge), else through an fp32 buffer
    if (plan.has_S) inner_cotangent(dU, dU32, a.dk_, a.dk_out, c.dkp, outer_gradout && plan.ridge == 0);
    else gk->route(a.dk_, a.dk_out, outer_gradout);
    if (plan.has_P) inner_cotangent(dHh, dHh32, a.dv_, a.dv_out, c.dvp, outer_gradout);
    else gv->route(a.dv_, a.dv_out, outer_gradout);
    dlam = DevBuf<R>(plan.fenwick ? size_t(r.H * c.Ttot * r.nL) : 0, s);
    if (plan.fenwick) loglinear_backward<T>(c.loglinear_args(a, Hst.get(), dlam.get()), *c.tables, s);
    else gla_backward<T>(a, s, beside ? &fwd : nullptr);
    if (beside) forward_outputs();
    dg[plan.gO] = go->dg.get();
  }
  void inner_cotangent(DevBuf<T>& d16, DevBuf<R>& d32, R*& out, GradOut<T>& gt, int dp, bool direct) {
    d16 = DevBuf<T>(size_t(r.H * c.Ttot * dp), s);
    if (direct) {
      gt = GradOut<T>{d16.get(), dp, c.Ttot * dp, 1.f};
    } else {
      d32 = DevBuf<R>(size_t(r.H * c.Ttot * dp), s);
      out = d32.get();
    }
  }
  // the fp32 cotangent, where the outer wrote one, into its 16-bit operand
  void to16(DevBuf<T>& d16, const DevBuf<R>& d32, int64_t n) const {
    if (d32.get()) HILA_LAUNCH((axpy_k<T, R>), n, s, d16.get(), d32.get(), n, R(1), false);
  }

  // Hh = GLA_gP(Q, K, V'): its cotangent is the outer value gradient.
  void inner_P_backward() {
    to16(dHh, dHh32, rowsV);
    gp.emplace(c, c.dvp, p.d_init.P.defined(), s);
    GlaArgs<T> b = c.inner_P();
    b.hbuf = in.Pbuf.get(), b.ht = in.Pf.get(), b.h0 = c.P0.get(), b.dO = dHh.get(), b.dht = dPf.get();
    gp->attach(b);
    gq->route(b.dq, b.dq_out, kTensorCore<T>);
    gk->route(b.dk_, b.dk_out, kTensorCore<T>);
    gv->route(b.dv_, b.dv_out, kTensorCore<T>);
    gla_backward<T>(b, s);
    dg[plan.gP] = gp->dg.get();
  }

  // U = GLA_gS(Q, K, K) + ridge Q^: its cotangent is the outer key gradient.
  void inner_S_backward() {
    to16(dU, dU32, rowsK);
    if (plan.ridge != 0)  // dq^ += ridge dU (the unpack multiplies by scale)
      HILA_LAUNCH((axpy_k<R, R>), rowsK, s, gq->sum(), dU32.get(), rowsK, R(plan.ridge), true);
    gs.emplace(c, c.dkp, p.d_init.S.defined(), s);
    GlaArgs<T> b = c.inner_S();
    b.hbuf = in.Sbuf.get(), b.ht = in.Sf.get(), b.h0 = c.S0.get(), b.dO = dU.get(), b.dht = dSf.get();
    gs->attach(b);
    gq->route(b.dq, b.dq_out, kTensorCore<T>);
    gk->route(b.dk_, b.dk_out, kTensorCore<T>);
    if (fold_S) {
      b.value_is_key = true;
    } else {  // the kernel writes dk, then adds it to dv's target in place (the same threads own
              // the same elements of both, dk = dv here)
      gk->route(b.dv_, b.dv_out, kTensorCore<T>);
    }
    gla_backward<T>(b, s);
    dg[plan.gS] = gs->dg.get();
  }

  // dq, dk, dv (where the last contribution did not write them), dg (summed over the primitives
  // with tied gates), the initial-state cotangents and dlam into the caller's tensors.
  void write_gradients() const {
    gq->finish(), gk->finish(), gv->finish();
    if (p.dg.defined()) {
      const int prims = r.traits.num_primitives;
      if (r.gate_cols == 1) {  // tied: sum over primitives (into the outer's buffer)
        for (int i = 0; i < prims; ++i)
          if (i != plan.gO) HILA_LAUNCH((axpy_k<R, R>), r.H * c.Ttot, s, go->dg.get(), dg[i], r.H * c.Ttot, R(1), true);
        HILA_LAUNCH(unpack_log_gate_grads<R>, r.H * c.Ttot, s, Strided(p.dg), go->dg.get(), c.g[0].get(), r.T, r.H,
                    c.Ttot, 0);
      } else {
        for (int i = 0; i < prims; ++i)
          HILA_LAUNCH(unpack_log_gate_grads<R>, r.H * c.Ttot, s, Strided(p.dg), dg[i], c.g[i].get(), r.T, r.H, c.Ttot, i);
      }
    }
    if (p.d_init.S.defined())
      HILA_LAUNCH(unpack_sym<R>, c.NH * r.dk * (r.dk + 1) / 2, s, Strided(p.d_init.S), gs->dh0.get(), c.NH, r.H,
                  int(r.dk), c.dkp, true);
    if (p.d_init.P.defined())
      HILA_LAUNCH(unpack_state<R>, c.NH * r.dk * r.dvp, s, Strided(p.d_init.P), gp->dh0.get(), c.NH, r.H, int(r.dk),
                  int(r.dvp), c.dkp, c.dvp);
    if (p.d_init.H.defined()) c.unpack_H(p.d_init.H, go->dh0.get());
    if (p.dlam.defined()) {
      const Strided out(p.dlam);
      HILA_LAUNCH(unpack_lam<R>, r.H * c.Ttot * r.nL, s, out, dlam.get(), LamIndex(out, r.T, r.H, c.Ttot, int(r.nL)));
    }
  }
};

template <class T>
void backward_call(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) {
  BackwardCall<T>(r, p, s).run();
}

}  // namespace

// The delta family (gdn, loglinear_gdn) is its outer primitive alone (OpPlan: no inner primitives,
// no normalize), as in cpu/compose.cpp, but that primitive reads the caller's tensors rather than
// Call's operands: its kernels take other layouts than the GLA kernels (the portable ones unpadded
// head dims, the tensor-core ones their own packing), l2-normalised q and k whose raw rows the
// backward's chain rule reads from the caller's tensors, and beta; packing them as Call does would change what a call
// allocates (its workspace size) and runs. delta/delta.cu is that primitive's entry.
template <class T>
void compose_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) {
  if (detail::OpPlan::make(r.cfg).delta) return delta_forward<T>(r, p, s);
  if (HeadSplit<T>::wanted(r, p)) return forward_split_head<T>(r, p, s);
  forward_call<T>(r, p, s);
}

template <class T>
void compose_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) {
  if (detail::OpPlan::make(r.cfg).delta) return delta_backward<T>(r, p, s);
  if (HeadSplit<T>::wanted(r, p)) return backward_split_head<T>(r, p, s);
  backward_call<T>(r, p, s);
}

template <class T>
size_t compose_smem_need(int dk, int dv, bool fenwick) {
  return fenwick ? std::max(gla_smem_need<T>(dk, dv), loglinear_smem_need<T>(dk, dv)) : gla_smem_need<T>(dk, dv);
}

#define HILA_INSTANTIATE(T)                                                                        \
  template void compose_forward<T>(const detail::Resolved&, const ForwardParams&, cudaStream_t);   \
  template void compose_backward<T>(const detail::Resolved&, const BackwardParams&, cudaStream_t); \
  template size_t compose_smem_need<T>(int, int, bool);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
