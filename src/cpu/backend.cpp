// SPDX-License-Identifier: Apache-2.0
// CPU backend: gathers each (sequence, head) from the strided, sequence-first tensors into
// contiguous compute-precision matrices (applying GQA, qk_l2norm, scale and the normalize column),
// runs the per-head composition (compose.h), and scatters outputs, states and gradients back.
// Work is parallel over sequences x heads; dq and dk are reduced over the heads of a group after.
#include <cmath>
#include <exception>
#include <mutex>

#include <omp.h>

#include "core/access.h"
#include "cpu/backend.h"
#include "cpu/compose.h"

namespace hila::detail {

using cpu::Canon;
using cpu::HeadView;
using cpu::Mat;
using cpu::OpGrads;
using cpu::OpPlan;
using cpu::OpState;
using cpu::PForm;

namespace {

// Offset of (b, row, head) in a tensor laid out [B, T, heads, ...] (with_t) or [N, heads, ...].
int64_t base(const TensorView& t, bool with_t, int64_t b, int64_t row, int64_t head) {
  return with_t ? b * t.stride[0] + row * t.stride[1] + head * t.stride[2]
                : b * t.stride[0] + head * t.stride[1];
}
int64_t inner(const TensorView& t) { return t.stride[t.ndim - 1]; }

int64_t packed_index(int64_t i, int64_t j, int64_t d) { return i * d - i * (i - 1) / 2 + (j - i); }

// Per-call geometry shared by gathers and scatters.
struct Geo {
  const Resolved* r;
  bool with_t;  // forward/backward tensors carry T; decode tensors do not
  int64_t heads_per_group() const { return r->H / r->G; }
};

template <class R>
void l2norm_rows(Mat<R>& x) {
  for (int64_t i = 0; i < x.r; ++i) {
    R s = 0;
    for (int64_t c = 0; c < x.c; ++c) s += x(i, c) * x(i, c);
    const R inv = R(1) / std::sqrt(s + R(kL2NormEps));
    for (int64_t c = 0; c < x.c; ++c) x(i, c) *= inv;
  }
}

// Rows of q or k for one sequence and group: [len, dk], l2-normalised and scaled as asked.
template <class R>
Mat<R> gather_qk(const Geo& G, const TensorView& t, const SeqInfo& s, int64_t grp, bool l2,
                 double scale) {
  Mat<R> m(s.len, G.r->dk, cpu::Uninit{});  // every row loaded below
  for (int64_t i = 0; i < s.len; ++i) {
    load_row<R>(t, base(t, G.with_t, s.b, s.row0 + i, grp), m.row(i), G.r->dk);
  }
  if (l2) l2norm_rows(m);
  if (scale != 1.0) cpu::scale<R>(m, R(scale));
  return m;
}

// Rows of a [.., H, cols] tensor for one head: [len, cols] (+ a ones column when asked).
template <class R>
Mat<R> gather_rows(const Geo& G, const TensorView& t, const SeqInfo& s, int64_t h, int64_t cols,
                   bool ones = false) {
  Mat<R> m(s.len, cols + (ones ? 1 : 0), cpu::Uninit{});  // every entry set below
  for (int64_t i = 0; i < s.len; ++i) {
    load_row<R>(t, base(t, G.with_t, s.b, s.row0 + i, h), m.row(i), cols);
    if (ones) m(i, cols) = 1;
  }
  return m;
}

// Rows [len, cols] of a [.., heads, cols] tensor for one head (or group) as a strided view, read
// or written in place when the tensor holds R already (no conversion, no copy); else an empty view.
template <class R>
cpu::MRef<R> row_view(const Geo& G, const TensorView& t, const SeqInfo& s, int64_t h, int64_t cols) {
  const bool holds_r = (t.dtype == DType::f32 && sizeof(R) == 4) || (t.dtype == DType::f64 && sizeof(R) == 8);
  if (!holds_r || s.len == 0 || inner(t) != 1) return {};
  const int64_t ld = G.with_t ? t.stride[1] : cols;  // decode tensors have one row
  return {static_cast<R*>(t.data) + base(t, G.with_t, s.b, s.row0, h), s.len, cols, ld};
}

template <class R>
std::vector<R> gather_col(const Geo& G, const TensorView& t, const SeqInfo& s, int64_t h,
                          int64_t col, bool has_col) {
  std::vector<R> out(static_cast<size_t>(s.len));
  for (int64_t i = 0; i < s.len; ++i) {
    const int64_t o = base(t, G.with_t, s.b, s.row0 + i, h) + (has_col ? col * inner(t) : 0);
    out[i] = R(load(t, o));
  }
  return out;
}

template <class R>
void scatter_rows(const Geo& G, const TensorView& t, const SeqInfo& s, int64_t h,
                  cpu::MRef<const R> m, int64_t cols) {
  for (int64_t i = 0; i < s.len; ++i) store_row<R>(t, base(t, G.with_t, s.b, s.row0 + i, h), m.row(i), cols);
}

// ---- states -------------------------------------------------------------------------------

template <class R>
Canon<R> read_mat(const TensorView& t, int64_t i, int64_t h, int64_t rows, int64_t cols) {
  Canon<R> c;
  c.slot.emplace_back(rows, cols);
  for (int64_t r = 0; r < rows; ++r) load_row<R>(t, offset(t, {i, h, r, 0}), c.slot[0].row(r), cols);
  return c;
}

// Packed symmetric S (row-major upper triangle). As a cotangent (d_final), <p, dp> =
// sum_{a<=b} S_ab dp_ab, so the dense cotangent is the upper triangle alone.
template <class R>
Canon<R> read_packed(const TensorView& t, int64_t i, int64_t h, int64_t d, bool cotangent) {
  std::vector<R> p(static_cast<size_t>(d * (d + 1) / 2));
  load_row<R>(t, offset(t, {i, h, 0}), p.data(), static_cast<int64_t>(p.size()));
  Canon<R> c;
  c.slot.emplace_back(d, d);
  Mat<R>& S = c.slot[0];
  for (int64_t a = 0; a < d; ++a)
    for (int64_t b = a; b < d; ++b) {
      S(a, b) = p[packed_index(a, b, d)];
      if (!cotangent) S(b, a) = S(a, b);
    }
  return c;
}

template <class R>
Canon<R> read_levels(const TensorView& t, int64_t i, int64_t h, int64_t pos, int64_t dk,
                     int64_t dvp) {
  Canon<R> c;
  const int64_t need = state_slots(pos);
  c.resize(need);
  for (int l = 1; l < need && l < t.shape[2]; ++l) {
    if (!((pos >> (l - 1)) & 1)) continue;
    Mat<R>& m = c.at(l, dk, dvp);
    for (int64_t r = 0; r < dk; ++r) load_row<R>(t, offset(t, {i, h, l, r, 0}), m.row(r), dvp);
  }
  return c;
}

template <class R>
OpState<R> read_state(const Resolved& r, const StateView& sv, int64_t i, int64_t h, int64_t pos,
                      bool cotangent) {
  OpState<R> st;
  if (!sv.defined()) return st;
  if (r.traits.has_S && sv.S.defined())
    st.S = read_packed<R>(sv.S, i, h, r.dk, cotangent);
  if (r.traits.has_P && sv.P.defined()) st.P = read_mat<R>(sv.P, i, h, r.dk, r.dvp);
  if (sv.H.defined())
    st.H = r.traits.loglinear ? read_levels<R>(sv.H, i, h, pos, r.dk, r.dvp)
                              : read_mat<R>(sv.H, i, h, r.dk, r.dvp);
  return st;
}

// Write a state (or the gradient of one: packed S then gets dS_ab + dS_ba off the diagonal).
// Fenwick slots from `slots` on are left alone (a decode step knows they are still zero).
template <class R>
void write_state(const Resolved& r, const StateView& sv, const OpState<R>& st, int64_t i,
                 int64_t h, bool gradient, int64_t slots = -1) {
  const int64_t dk = r.dk, dvp = r.dvp;
  if (sv.S.defined()) {
    std::vector<R> p(static_cast<size_t>(dk * (dk + 1) / 2), R(0));
    if (const Mat<R>* S = st.S.get(0))
      for (int64_t a = 0; a < dk; ++a)
        for (int64_t b = a; b < dk; ++b)
          p[packed_index(a, b, dk)] = gradient && a != b ? (*S)(a, b) + (*S)(b, a) : (*S)(a, b);
    store_row<R>(sv.S, offset(sv.S, {i, h, 0}), p.data(), static_cast<int64_t>(p.size()));
  }
  const std::vector<R> zeros(static_cast<size_t>(dvp), R(0));
  auto put = [&](const TensorView& t, const Mat<R>* m, auto... lead) {
    for (int64_t a = 0; a < dk; ++a)
      store_row<R>(t, offset(t, {i, h, lead..., a, 0}), m ? m->row(a) : zeros.data(), dvp);
  };
  if (sv.P.defined()) put(sv.P, st.P.get(0));
  if (sv.H.defined()) {
    if (r.traits.loglinear) {
      const int64_t n = slots < 0 ? sv.H.shape[2] : std::min(slots, sv.H.shape[2]);
      for (int64_t l = 0; l < n; ++l) put(sv.H, st.H.get(static_cast<int>(l)), l);
    } else {
      put(sv.H, st.H.get(0));
    }
  }
}

// ---- per-head inputs ------------------------------------------------------------------------

template <class R>
struct HeadInputs {
  Mat<R> q, k, v, lam;
  cpu::MRef<const R> kr, vr;  // k and v read in place (row_view), when set
  std::vector<R> g[3], beta;
  OpState<R> init;
  HeadView<R> view(const OpPlan& plan, int64_t n0) const {
    HeadView<R> x;
    x.q = q;
    x.k = kr.p ? kr : cpu::MRef<const R>(k);
    x.v = vr.p ? vr : cpu::MRef<const R>(v);
    for (int c = 0; c < 3; ++c) x.g[c] = g[c].empty() ? nullptr : g[c].data();
    if (!lam.empty()) x.lam = lam;
    if (!beta.empty()) x.beta = beta.data();
    x.n0 = n0;
    return x;
  }
};

template <class R>
HeadInputs<R> gather_head(const Geo& G, const TensorView& q, const TensorView& k,
                          const TensorView& v, const TensorView& g, const TensorView& lam,
                          const TensorView& beta, const StateView& init, const SeqInfo& s,
                          int64_t seq, int64_t h) {
  const Resolved& r = *G.r;
  const int64_t grp = h / G.heads_per_group();
  HeadInputs<R> in;
  const bool l2 = r.cfg.qk_l2norm;
  in.q = gather_qk<R>(G, q, s, grp, l2, r.scale);
  // k as given is read in place; v too unless it gets the ones column of normalize
  if (!l2) in.kr = row_view<R>(G, k, s, grp, r.dk);
  if (!in.kr.p) in.k = gather_qk<R>(G, k, s, grp, l2, 1.0);
  if (!r.cfg.normalize) in.vr = row_view<R>(G, v, s, h, r.dv);
  if (!in.vr.p) in.v = gather_rows<R>(G, v, s, h, r.dv, r.cfg.normalize);
  const int prims = r.traits.num_primitives;
  for (int c = 0; c < prims && r.gate_cols > 0; ++c) {
    if (r.gate_cols == 1) {
      if (c == 0) in.g[0] = gather_col<R>(G, g, s, h, 0, false);
      else in.g[c] = in.g[0];
    } else {
      in.g[c] = gather_col<R>(G, g, s, h, c, true);
    }
  }
  if (lam.defined()) in.lam = gather_rows<R>(G, lam, s, h, r.nL);
  if (beta.defined()) in.beta = gather_col<R>(G, beta, s, h, 0, false);
  in.init = read_state<R>(r, init, seq, h, s.n0, false);
  return in;
}

// Rough multiply-adds per (sequence, head): decides whether a parallel region pays.
int64_t work(const Resolved& r) {
  const int64_t state = r.dk * (r.dk + 3 * r.dvp) * (r.traits.loglinear ? 4 : 1);
  return state * std::max<int64_t>(1, r.T) * (r.form == Form::naive ? std::max<int64_t>(1, r.T) : 1);
}

PForm pform(Form f) { return static_cast<PForm>(static_cast<int>(f)); }

// Run body(seq, head) over all pairs, in parallel when cpu_parallel says the work pays for a
// parallel region (`work`: a rough count of multiply-adds per pair) and OpenMP has more than one
// thread to give; rethrow the first exception afterwards.
template <class F>
void parallel_heads(int64_t N, int64_t H, int64_t work, F body) {
  std::exception_ptr err;
  std::mutex mu;
  auto run = [&](int64_t item) {
    try {
      body(item / H, item % H);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!err) err = std::current_exception();
    }
  };
  if (cpu_parallel(N * H, work) && omp_get_max_threads() > 1) {
#pragma omp parallel for schedule(dynamic)
    for (int64_t item = 0; item < N * H; ++item) run(item);
  } else {  // no OpenMP region at all (an if(false) region still costs a runtime call)
    for (int64_t item = 0; item < N * H; ++item) run(item);
  }
  if (err) std::rethrow_exception(err);
}

// o rows of sequence s, head h set to zero (a padding sequence of a pooled call).
void zero_rows(const Geo& G, const TensorView& o, const SeqInfo& s, int64_t h, int64_t cols) {
  for (int64_t i = 0; i < s.len; ++i) {
    const int64_t b = base(o, G.with_t, s.b, s.row0 + i, h);
    for (int64_t c = 0; c < cols; ++c) store(o, b + c * inner(o), 0.0);
  }
}

// body(s, row, h) for every sequence s and head h in parallel, with the state row r.row(i) that
// sequence i reads and writes (a pool's row with state_indices); a padding sequence (row -1)
// computes nothing and gets o 0. Rows are distinct, so the items never share a row.
template <class F>
void for_each_sequence_head(const Resolved& r, const Geo& G, const TensorView& o, F body) {
  parallel_heads(static_cast<int64_t>(r.seqs.size()), r.H, work(r), [&](int64_t i, int64_t h) {
    const SeqInfo& s = r.seqs[i];
    const int64_t row = r.row(size_t(i));
    if (row < 0) return zero_rows(G, o, s, h, r.dv);
    body(s, row, h);
  });
}

template <class R>
void forward_impl(const Resolved& r, const ForwardParams& p) {
  const OpPlan plan = OpPlan::make(r.cfg);
  const Geo G{&r, true};
  for_each_sequence_head(r, G, p.o, [&](const SeqInfo& s, int64_t row, int64_t h) {
    const HeadInputs<R> in = gather_head<R>(G, p.q, p.k, p.v, p.g, p.lam, p.beta, p.init, s, row, h);
    // o written in place when it holds the compute type and is contiguous (its rows of distinct
    // heads and positions never share memory; op_forward writes every entry of O), else through a
    // copy
    Mat<R> Om;
    cpu::MRef<R> O = p.o.contiguous() ? row_view<R>(G, p.o, s, h, r.dv) : cpu::MRef<R>{};
    const bool in_place = O.p != nullptr;
    if (!in_place) {
      Om = Mat<R>(s.len, r.dv);
      O = Om;
    }
    const OpState<R> fin =
        cpu::op_forward<R>(plan, pform(r.form), r.chunk, in.view(plan, s.n0), in.init, O,
                           p.final_state.defined());
    if (!in_place) scatter_rows<R>(G, p.o, s, h, Om, r.dv);
    if (p.final_state.defined()) write_state<R>(r, p.final_state, fin, row, h, false);
  });
  if (p.final_state.pos.defined())
    for (size_t i = 0; i < r.seqs.size(); ++i)
      if (r.row(i) >= 0)
        store_int(p.final_state.pos, r.row(i) * p.final_state.pos.stride[0], r.seqs[i].n0 + r.seqs[i].len);
}

// dx = (dy - y (y . dy)) / sqrt(|x|^2 + eps), y = x / sqrt(|x|^2 + eps)   (docs/math/LOGLINEAR.md §6.1)
template <class R>
void l2norm_backward_row(const R* x, R* dy, int64_t n) {
  R s = 0;
  for (int64_t c = 0; c < n; ++c) s += x[c] * x[c];
  const R nrm = std::sqrt(s + R(kL2NormEps));
  R ydy = 0;
  for (int64_t c = 0; c < n; ++c) ydy += x[c] / nrm * dy[c];
  for (int64_t c = 0; c < n; ++c) dy[c] = (dy[c] - x[c] / nrm * ydy) / nrm;
}

template <class R>
void backward_impl(const Resolved& r, const BackwardParams& p) {
  const OpPlan plan = OpPlan::make(r.cfg);
  const Geo G{&r, true};
  const int64_t N = static_cast<int64_t>(r.seqs.size());
  // per (sequence, head) gradients of the (scaled, normalised) q and k, reduced per group below
  std::vector<Mat<R>> dq(static_cast<size_t>(N * r.H)), dk(static_cast<size_t>(N * r.H));
  parallel_heads(N, r.H, 3 * work(r), [&](int64_t i, int64_t h) {
    const SeqInfo& s = r.seqs[i];
    const HeadInputs<R> in = gather_head<R>(G, p.q, p.k, p.v, p.g, p.lam, p.beta, p.init, s, i, h);
    const HeadView<R> x = in.view(plan, s.n0);
    if (p.o.defined() || p.final_state.defined()) {
      Mat<R> O(s.len, r.dv);
      const OpState<R> fin = cpu::op_forward<R>(plan, pform(r.form), r.chunk, x, in.init, O,
                                                p.final_state.defined());
      if (p.o.defined()) scatter_rows<R>(G, p.o, s, h, O, r.dv);
      if (p.final_state.defined()) write_state<R>(r, p.final_state, fin, i, h, false);
    }
    Mat<R> dOm;
    cpu::MRef<const R> dO = row_view<R>(G, p.d_o, s, h, r.dv);  // read in place
    if (!dO.p) {
      dOm = gather_rows<R>(G, p.d_o, s, h, r.dv);
      dO = dOm;
    }
    const OpState<R> dfin = read_state<R>(r, p.d_final, i, h, s.n0 + s.len, true);
    OpGrads<R> gr = cpu::op_backward<R>(plan, pform(r.form), r.chunk, x, in.init, dO, dfin);
    dq[i * r.H + h] = std::move(gr.dq);
    dk[i * r.H + h] = std::move(gr.dk);
    if (p.dv.defined()) scatter_rows<R>(G, p.dv, s, h, gr.dv, r.dv);
    if (p.dg.defined()) {
      for (int64_t t = 0; t < s.len; ++t) {
        const int64_t o = base(p.dg, true, s.b, s.row0 + t, h);
        if (r.gate_cols == 1) {
          double acc = 0;
          for (int c = 0; c < r.traits.num_primitives; ++c) acc += gr.dg[c][t];
          store(p.dg, o, acc);
        } else {
          for (int c = 0; c < r.gate_cols; ++c) store(p.dg, o + c * inner(p.dg), gr.dg[c][t]);
        }
      }
    }
    if (p.dlam.defined()) scatter_rows<R>(G, p.dlam, s, h, gr.dlam, r.nL);
    if (p.dbeta.defined())
      for (int64_t t = 0; t < s.len; ++t) store(p.dbeta, base(p.dbeta, true, s.b, s.row0 + t, h), gr.dbeta[t]);
    if (p.d_init.defined()) write_state<R>(r, p.d_init, gr.dinit, i, h, true);
  });
  if (p.final_state.pos.defined())
    for (int64_t i = 0; i < N; ++i)
      store_int(p.final_state.pos, i * p.final_state.pos.stride[0], r.seqs[i].n0 + r.seqs[i].len);
  // dq = scale * sum_h dq^_h (then through l2norm); dk = sum_h dk_h (then through l2norm)
  const int64_t hpg = G.heads_per_group();
  for (int64_t i = 0; i < N; ++i) {
    const SeqInfo& s = r.seqs[i];
    for (int64_t grp = 0; grp < r.G; ++grp) {
      for (int which = 0; which < 2; ++which) {
        const TensorView& out = which == 0 ? p.dq : p.dk;
        if (!out.defined()) continue;
        const TensorView& src = which == 0 ? p.q : p.k;
        auto& parts = which == 0 ? dq : dk;
        // one head per group (no GQA): its gradient itself, else the sum over the group's heads
        Mat<R> sum;
        if (hpg > 1) {
          sum = Mat<R>(s.len, r.dk);
          for (int64_t h = grp * hpg; h < (grp + 1) * hpg; ++h) cpu::axpy<R>(sum, parts[i * r.H + h]);
        }
        Mat<R>& acc = hpg > 1 ? sum : parts[i * r.H + grp];
        if (which == 0) cpu::scale<R>(acc, R(r.scale));
        if (r.cfg.qk_l2norm) {
          const Mat<R> raw = gather_qk<R>(G, src, s, grp, false, 1.0);
          for (int64_t t = 0; t < s.len; ++t) l2norm_backward_row(raw.row(t), acc.row(t), r.dk);
        }
        scatter_rows<R>(G, out, s, grp, acc, r.dk);
      }
    }
  }
}

template <class R>
void step_impl(const Resolved& r, const StepParams& p, const StateView& sv) {
  const OpPlan plan = OpPlan::make(r.cfg);
  const Geo G{&r, false};
  // sequence i steps state row r.row(i) (-1: a padding row of a pool, o 0)
  for_each_sequence_head(r, G, p.o, [&](const SeqInfo& s, int64_t row, int64_t h) {
    HeadInputs<R> in = gather_head<R>(G, p.q, p.k, p.v, p.g, p.lam, p.beta, sv, s, row, h);
    std::vector<R> o(static_cast<size_t>(r.dv));
    cpu::op_step<R>(plan, in.view(plan, s.n0), 0, s.n0, in.init, o.data());
    cpu::MRef<const R> orow{o.data(), 1, r.dv, r.dv};
    scatter_rows<R>(G, p.o, s, h, orow, r.dv);
    write_state<R>(r, sv, in.init, row, h, false, state_slots(s.n0 + 1));
  });
  for (size_t i = 0; i < r.seqs.size(); ++i)
    if (r.row(i) >= 0) store_int(sv.pos, r.row(i) * sv.pos.stride[0], r.seqs[i].n0 + 1);
}

}  // namespace

// Allocation failures (validation bounds the memory up front; this is the backstop) become
// hila::Error("memory"), never an internal error. The output checks run in the dispatcher
// (src/api), for every backend.
void cpu_forward(const Resolved& r, const ForwardParams& p) {
  with_memory_errors("memory", [&] { return std::string("the CPU forward of ") + op_name(r.cfg.op); }, [&] {
    r.f64 ? forward_impl<double>(r, p) : forward_impl<float>(r, p);
  });
}
void cpu_backward(const Resolved& r, const BackwardParams& p) {
  with_memory_errors("memory", [&] { return std::string("the CPU backward of ") + op_name(r.cfg.op); }, [&] {
    r.f64 ? backward_impl<double>(r, p) : backward_impl<float>(r, p);
  });
}
void cpu_step(const Resolved& r, const StepParams& p, const StateView& state) {
  with_memory_errors("memory", [&] { return std::string("the CPU decode step of ") + op_name(r.cfg.op); }, [&] {
    r.f64 ? step_impl<double>(r, p, state) : step_impl<float>(r, p, state);
  });
}

}  // namespace hila::detail
