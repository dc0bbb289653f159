// SPDX-License-Identifier: Apache-2.0
// CUDA backend: packs the strided, sequence-first inputs into head-major buffers padded to
// multiples of 16 columns (kernels then need no head-dim templates), runs the primitive kernels
// on the caller's stream, and unpacks outputs, states and gradients (summing dq/dk over the heads
// of a GQA group). Temporary buffers are stream-ordered allocations.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/host_mirror.h"
#include "core/plan.h"
#include "cuda/backend.h"
#include "cuda/delta/delta.cuh"
#include "cuda/gla/gla.cuh"
#include "cuda/loglinear/loglinear.cuh"
#include "cuda/prims/pack.cuh"
#include "cuda/runtime/runtime.cuh"
#include "hila/error.h"

namespace hila::cuda {

[[noreturn]] void fail(cudaError_t e, const char* expr, const char* file, int line) {
  throw std::runtime_error(std::string("hila: CUDA error ") + cudaGetErrorName(e) + " (" +
                           cudaGetErrorString(e) + ") in " + expr + " at " + file + ":" +
                           std::to_string(line));
}

namespace {

class PinnedRing {
 public:
  static constexpr size_t kBytes = size_t(4) << 20;
  void upload(void* dst, const void* src, size_t bytes, cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!base_) HILA_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&base_), kBytes));
    const size_t need = (bytes + 255) & ~size_t(255);
    if (need > kBytes) {  // larger than the ring: a plain (synchronizing) copy
      HILA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
      HILA_CUDA_CHECK(cudaStreamSynchronize(s));
      return;
    }
    if (head_ + need > kBytes) head_ = 0;
    // wait for earlier uploads whose bytes overlap [head_, head_ + need)
    while (!pending_.empty()) {
      const Pending& p = pending_.front();
      const bool overlap = p.off < head_ + need && head_ < p.off + p.len;
      if (!overlap && pending_.size() < 256) break;
      HILA_CUDA_CHECK(cudaEventSynchronize(p.done));
      HILA_CUDA_CHECK(cudaEventDestroy(p.done));
      pending_.pop_front();
    }
    std::memcpy(base_ + head_, src, bytes);
    HILA_CUDA_CHECK(cudaMemcpyAsync(dst, base_ + head_, bytes, cudaMemcpyHostToDevice, s));
    cudaEvent_t e;
    HILA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    HILA_CUDA_CHECK(cudaEventRecord(e, s));
    pending_.push_back({head_, need, e});
    head_ += need;
  }

 private:
  struct Pending {
    size_t off, len;
    cudaEvent_t done;
  };
  std::mutex mu_;
  char* base_ = nullptr;
  size_t head_ = 0;
  std::deque<Pending> pending_;
};

void d2h(void* dst, const void* src, size_t bytes, int device, void* stream) {
  DeviceScope scope(device);
  const auto s = static_cast<cudaStream_t>(stream);
  HILA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  HILA_CUDA_CHECK(cudaStreamSynchronize(s));
}

// first[0] = min row-major index of an element that is non-finite (or > 0 for gates).
__global__ void scan_kernel(unsigned long long* first, Strided t, int nd, int64_t s0, int64_t s1, int64_t s2,
                            int64_t s3, int64_t s4, int64_t n, bool contiguous, bool gates) {
  const int64_t shape[5] = {s0, s1, s2, s3, s4};
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    int64_t off = e;
    if (!contiguous) {
      off = 0;
      int64_t rem = e;
      for (int i = nd - 1; i >= 0; --i) {
        off += (rem % shape[i]) * t.s[i];
        rem /= shape[i];
      }
    }
    const double x = ld<double>(t, off);
    if (!isfinite(x) || (gates && x > 0)) atomicMin(first, static_cast<unsigned long long>(e));
  }
}

int64_t device_scan(const TensorView& t, bool gates, void* stream) {
  if (t.ndim > 5) return -2;
  DeviceScope scope(t.device.index);
  const auto s = static_cast<cudaStream_t>(stream);
  bool contiguous = true;
  int64_t expect = 1, shape[5] = {1, 1, 1, 1, 1};
  for (int i = t.ndim - 1; i >= 0; --i) {
    shape[i] = t.shape[i];
    if (t.shape[i] != 1 && t.stride[i] != expect) contiguous = false;
    expect *= t.shape[i];
  }
  DevBuf<unsigned long long> first(1, s);
  HILA_CUDA_CHECK(cudaMemsetAsync(first.get(), 0xff, sizeof(unsigned long long), s));
  const int64_t n = t.numel();
  HILA_LAUNCH(scan_kernel, n, s, first.get(), Strided(t), t.ndim, shape[0], shape[1], shape[2], shape[3], shape[4], n,
              contiguous, gates);
  unsigned long long host = 0;
  HILA_CUDA_CHECK(cudaMemcpyAsync(&host, first.get(), sizeof(host), cudaMemcpyDeviceToHost, s));
  HILA_CUDA_CHECK(cudaStreamSynchronize(s));
  return host == ~0ull ? -1 : static_cast<int64_t>(host);
}

const bool g_registered = (detail::register_device_to_host(&d2h), detail::register_device_scan(&device_scan), true);

}  // namespace

void keep_pool_cached() {
  static std::once_flag done[64];
  int dev = 0;
  HILA_CUDA_CHECK(cudaGetDevice(&dev));
  std::call_once(done[dev & 63], [dev] {
    cudaMemPool_t pool;
    HILA_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    uint64_t keep = UINT64_MAX;
    HILA_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  });
}

namespace {
// An upload inside CUDA graph capture: the bytes ride in the parameters of kernels (kept by value
// in the graph's kernel nodes), 2 KB per launch. A copy from the pinned ring would be captured as
// a copy node that reads the ring slot at every replay, after later calls may have reused it.
struct UploadPiece {
  unsigned char b[2048];
};
__global__ void upload_piece_kernel(unsigned char* dst, const UploadPiece p, unsigned n) {
  for (unsigned i = threadIdx.x; i < n; i += blockDim.x) dst[i] = p.b[i];
}
// HILA_UPLOAD_KERNEL=1 (tests): kernel uploads always, in pieces of 16 bytes
bool upload_forced() {
  static const bool forced = [] {
    const char* e = std::getenv("HILA_UPLOAD_KERNEL");
    return e && std::strcmp(e, "1") == 0;
  }();
  return forced;
}
// kernel uploads while s is being captured
bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  HILA_CUDA_CHECK(cudaStreamIsCapturing(s, &st));
  return st != cudaStreamCaptureStatusNone;
}
}  // namespace

void upload_async(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (dry_run()) return;
  if (upload_forced() || capturing(s)) {
    const size_t piece = upload_forced() ? 16 : sizeof(UploadPiece);
    for (size_t off = 0; off < bytes; off += piece) {
      UploadPiece p;
      const size_t n = std::min(bytes - off, piece);
      std::memcpy(p.b, static_cast<const unsigned char*>(src) + off, n);
      upload_piece_kernel<<<1, 256, 0, s>>>(static_cast<unsigned char*>(dst) + off, p, unsigned(n));
      HILA_CUDA_CHECK_LAUNCH();
    }
    return;
  }
  static PinnedRing rings[64];  // per device ordinal
  int dev = 0;
  HILA_CUDA_CHECK(cudaGetDevice(&dev));
  rings[dev & 63].upload(dst, src, bytes, s);
}

namespace {
thread_local Arena* t_arena = nullptr;
constexpr size_t kAlign = 256;
}  // namespace

Arena::Arena(void* base, size_t bytes) {
  if (!base) return;  // measuring: stand-in addresses from kAlign up, never dereferenced
  base_ = (reinterpret_cast<uintptr_t>(base) + kAlign - 1) & ~uintptr_t(kAlign - 1);
  const size_t skip = base_ - reinterpret_cast<uintptr_t>(base);
  cap_ = bytes > skip ? bytes - skip : 0;
}

void* Arena::take(size_t bytes) {
  const size_t off = top_, end = off + ((bytes + kAlign - 1) & ~(kAlign - 1));
  if (!measuring() && end > cap_)  // workspace_size() measured this call's peak: only a changed call gets here
    throw Error("workspace_bytes", "the workspace is too small for this call: it needs more than " +
                                       std::to_string(cap_) + " bytes (query hila::workspace_size with the same params)");
  blocks_.push_back({off, end, true});
  top_ = end;
  peak_ = std::max(peak_, top_);
  return reinterpret_cast<void*>((measuring() ? kAlign : base_) + off);
}

void Arena::give(void* p) {
  const size_t off = reinterpret_cast<uintptr_t>(p) - (measuring() ? kAlign : base_);
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it)
    if (it->off == off && it->live) {
      it->live = false;
      break;
    }
  while (!blocks_.empty() && !blocks_.back().live) blocks_.pop_back();
  top_ = blocks_.empty() ? 0 : blocks_.back().end;
}

namespace {
// an event that has captured `from`'s work so far, waited for by `to`
cudaError_t link(cudaStream_t from, cudaStream_t to) {
  cudaEvent_t e;
  cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  if (err != cudaSuccess) return err;
  err = cudaEventRecord(e, from);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(to, e, 0);
  const cudaError_t d = cudaEventDestroy(e);  // released once the wait is satisfied
  return err != cudaSuccess ? err : d;
}
}  // namespace

SideStream::SideStream(cudaStream_t main) : main_(main), side_(main) {
  static const bool off = [] {
    const char* e = std::getenv("HILA_SIDE_STREAM");
    return e && std::strcmp(e, "0") == 0;
  }();
  if (off || dry_run()) return;
  // one non-blocking stream per (host thread, device), kept for the thread's lifetime
  thread_local std::vector<cudaStream_t> streams;
  int dev = 0;
  HILA_CUDA_CHECK(cudaGetDevice(&dev));
  if (streams.size() <= size_t(dev)) streams.resize(size_t(dev) + 1, nullptr);
  if (!streams[size_t(dev)]) HILA_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[size_t(dev)], cudaStreamNonBlocking));
  side_ = streams[size_t(dev)];
  HILA_CUDA_CHECK(link(main_, side_));
}

void SideStream::join() {
  if (joined_ || side_ == main_) return;
  joined_ = true;
  HILA_CUDA_CHECK(link(side_, main_));
}

// an exception between fork and join: still order main after the side's work (no throw here)
SideStream::~SideStream() {
  if (!joined_ && side_ != main_) link(side_, main_);
}

Arena* current_arena() { return t_arena; }
namespace {
thread_local int t_no_alloc = 0;
}
NoAllocScope::NoAllocScope() { ++t_no_alloc; }
NoAllocScope::~NoAllocScope() { --t_no_alloc; }
void check_alloc_allowed() {
  if (t_no_alloc > 0)
    throw std::logic_error("hila: a temporary was requested for work on hila's side stream, which must not "
                           "allocate (it would race with the caller's stream over the workspace); please report this");
}
bool poison_scratch() {
  static const bool on = [] {
    const char* e = std::getenv("HILA_POISON_SCRATCH");
    return e && *e && std::strcmp(e, "0") != 0;
  }();
  return on;
}
ArenaScope::ArenaScope(Arena* a) : prev_(t_arena) { t_arena = a; }
ArenaScope::~ArenaScope() { t_arena = prev_; }

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
  std::optional<LlTables> ll;  // log-linear outer primitive: segments, n0, Fenwick slots
  DevBuf<R> lam;               // [H][Ttot][nL]
  // log-linear outer primitive in the chunk-parallel tree form (ll_tree.cuh): every sequence from a
  // chunk-aligned position (with its initial state when n0 > 0)
  const bool tree;
  static bool tree_form(const detail::Resolved& r, const ForwardParams& p) {
    if (!detail::OpPlan::make(r.cfg).fenwick) return false;
    return std::all_of(r.seqs.begin(), r.seqs.end(),
                       [&](const auto& x) { return x.n0 % kChunk == 0 && (x.n0 == 0 || p.init.H.defined()); }) &&
           ll_tree_usable<T>(pad16(r.dk), pad16(r.dvp));
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
      HILA_LAUNCH(pack_gates<R>, r.H * Ttot, s, g[c].get(), Strided(p.g), r.T, r.H, Ttot, c);
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
      ll.emplace(r, s);
      lam = DevBuf<R>(size_t(r.H * Ttot * r.nL), s);
      HILA_LAUNCH(pack_lam<R>, r.H * Ttot * r.nL, s, lam.get(), Strided(p.lam), r.T, r.H, Ttot, int(r.nL));
    }
    if (p.init.H.defined()) H0 = pack_H(p.init.H, false);
  }
  // Outer state H: dense [N][H][dkp][dvp], or Fenwick [N][H][Ls][dkp][dvp] (LOGLINEAR_SPEC §8)
  // holding the slots live at n0 (initial) or at n0 + len (end of the call).
  int64_t slots() const { return plan.fenwick ? ll->Ls : 1; }
  DevBuf<R> pack_H(const TensorView& t, bool at_end) const {
    if (!plan.fenwick) return pack_dense(t);
    const int64_t n = NH * ll->Ls * dkp * dvp;
    DevBuf<R> b(size_t(n), s);
    HILA_LAUNCH(pack_levels<R>, n, s, b.get(), Strided(t), (at_end ? ll->d_nend : ll->d_n0).get(), NH, r.H,
                int(t.shape[2]), ll->Ls, int(r.dk), int(r.dvp), dkp, dvp);
    return b;
  }
  void unpack_H(const TensorView& out, const R* in) const {
    if (plan.fenwick)
      HILA_LAUNCH(unpack_levels<R>, NH * out.shape[2] * r.dk * r.dvp, s, Strided(out), in, NH, r.H, int(out.shape[2]),
                  ll->Ls, int(r.dk), int(r.dvp), dkp, dvp);
    else
      HILA_LAUNCH(unpack_state<R>, NH * r.dk * r.dvp, s, Strided(out), in, NH, r.H, int(r.dk), int(r.dvp), dkp, dvp);
  }
  // Arguments of the log-linear outer primitive; hst holds the live levels stored per segment.
  LlArgs<T> ll_args(const GlaArgs<T>& base, R* hst, R* dlam = nullptr, bool want_final = false) const {
    LlArgs<T> a;
    a.tree = tree, a.want_final = want_final;
    a.p = base;
    a.p.hbuf = nullptr;
    a.hst = hst;
    a.lam = lam.get(), a.nL = int(r.nL), a.Ls = ll->Ls;
    a.n0 = ll->d_n0.get(), a.seg0 = ll->d_seg0.get(), a.hoff = ll->d_hoff.get(), a.goff = ll->d_goff.get();
    a.seg_seq = ll->d_seg_seq.get(), a.nseg = ll->nseg;
    a.dlam = dlam;
    return a;
  }
  // The caller's [B, T, X, d] tensor in place, or packed into `buf` ([X][Ttot][dp], a ones column at `ones`).
  Operand<T> operand(const TensorView& t, int64_t X, int d, int dp, int ones, DevBuf<T>& buf) const {
    if (ones < 0 && d == dp && (!plan.fenwick || tree) && !plan.delta && in_place_ok<T>(t, r.B, r.T))
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
    if (fin.pos.defined()) {
      std::vector<int64_t> pos;
      for (const auto& x : r.seqs) pos.push_back(x.n0 + x.len);
      upload_async(fin.pos.data, pos.data(), pos.size() * 8, s);
    }
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

// One caller gradient (dq, dk or dv) of a composition (HLA_SPEC §7.2): the primitives' chunk
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
    in_place = !need_packed && !c.plan.normalize && (!c.plan.fenwick || c.tree) && !c.plan.delta &&
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
// along, which equal one call (LOGLINEAR_SPEC §3.4): `head` holds every sequence's rows up to its
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
    return ll_tree_usable<T>(pad16(r.dk), pad16(r.dvp));
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

template <class T>
void forward_impl(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) {
  if (r.traits.delta) return delta_forward<T>(r, p, s);  // gdn, loglinear_gdn: cuda/delta.cu
  if (HeadSplit<T>::wanted(r, p)) return forward_split_head<T>(r, p, s);
  forward_call<T>(r, p, s);
}

// One forward of the composition (HLA_SPEC §11): the inner primitives, then the outer one.
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
  if (c.plan.fenwick) ll_forward<T>(c.ll_args(a, nullptr, nullptr, p.final_state.H.defined()), *c.ll, s);
  else gla_forward<T>(a, s);
  if (!O.in_place) c.write_output(p.o, O.buf.get());
  c.write_states(p.final_state, in, Hf.get());
}

template <class T>
void backward_impl(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) {
  if (r.traits.delta) return delta_backward<T>(r, p, s);  // gdn, loglinear_gdn: cuda/delta.cu
  if (HeadSplit<T>::wanted(r, p)) return backward_split_head<T>(r, p, s);
  backward_call<T>(r, p, s);
}

// VJP of the composition (HLA_SPEC §7.2): outer primitive first, then the inner ones with the
// outer key / value gradients as their output cotangents. dq, dk, dv accumulate in the chunk
// kernels (GradSum), the last contribution writing the caller's tensor where it can.
template <class T>
void backward_call(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) {
  using R = Acc<T>;
  const Call<T> c(r, p, s);
  const auto& plan = c.plan;
  const int64_t rowsK = r.H * c.Ttot * c.dkp, rowsV = r.H * c.Ttot * c.dvp;
  const auto in = c.run_inner(true);
  // outer forward: its chunk states, and O' only when normalizing (the cotangent needs it) or when o is asked for
  DevBuf<R> Hf(size_t(c.NH * c.slots() * c.dkp * c.dvp), s);
  DevBuf<StateOperand<T>> Hbuf(plan.fenwick ? 0 : size_t(c.seqs.nchunks * r.H * c.dkp * c.dvp), s);
  GlaArgs<T> a = c.outer(in);
  // log-linear: the tree form (no stored levels) or the sweep (the live levels entering each segment)
  const bool tree = c.tree;
  DevBuf<R> Hst(plan.fenwick && !tree ? size_t(c.ll->stored_levels() * r.H * c.dkp * c.dvp) : 0, s);
  std::optional<OutputTarget<T>> O;
  if (plan.normalize || p.o.defined()) {
    O.emplace(c, p.o, plan.normalize);
    O->attach(a, p.o);
  }
  a.h0 = c.H0.get(), a.ht = Hf.get(), a.hbuf = Hbuf.get();
  // GLA outer without normalize: dO does not depend on O', so the forward runs inside
  // gla_backward, beside the reverse sweep (the outputs it feeds are written after)
  const GlaArgs<T> fwd = a;
  const bool beside = !plan.fenwick && !plan.normalize;
  if (plan.fenwick) {
    if (!tree || a.o || p.final_state.H.defined())
      ll_forward<T>(c.ll_args(a, Hst.get(), nullptr, p.final_state.H.defined()), *c.ll, s);
  } else if (!beside) {
    gla_forward<T>(a, s);
  }
  auto forward_outputs = [&] {
    if (p.o.defined() && !O->in_place) c.write_output(p.o, O->buf.get());
    c.write_states(p.final_state, in, Hf.get());
  };
  if (!beside) forward_outputs();
  a.o = nullptr;
  // cotangents of O' and of the final states
  DevBuf<T> dObuf;
  if (!plan.normalize && (!plan.fenwick || tree) && !plan.delta && in_place_ok<T>(p.d_o, r.B, r.T)) {
    a.dO = static_cast<const T*>(p.d_o.data), a.dO_ld = p.d_o.stride[1], a.dO_hs = p.d_o.stride[2];
  } else {
    dObuf = DevBuf<T>(size_t(rowsV), s);
    c.pack(dObuf.get(), p.d_o, r.H, int(r.dv), c.dvp, -1);
    if (plan.normalize)
      HILA_LAUNCH(normalized_cotangent<T>, r.H * c.Ttot, s, dObuf.get(), O->buf.get(), r.H * c.Ttot, int(r.dv), c.dvp,
                  R(plan.eps));
    a.dO = dObuf.get();
  }
  DevBuf<R> dSf, dPf, dHf;
  if (p.d_final.S.defined()) {
    dSf = DevBuf<R>(size_t(c.NH * c.dkp * c.dkp), s);
    HILA_LAUNCH(pack_sym<R>, c.NH * c.dkp * c.dkp, s, dSf.get(), Strided(p.d_final.S), c.NH, r.H, int(r.dk), c.dkp, true);
  }
  if (p.d_final.P.defined()) dPf = c.pack_dense(p.d_final.P);
  if (p.d_final.H.defined()) dHf = c.pack_H(p.d_final.H, true);
  // outer, then the inner primitives with the outer key / value gradients as their output
  // cotangents; dq, dk, dv collect in GradSums (the outer's kernels honor GradOut where they are
  // the tensor-core GLA kernels or the tree form; the inner ones are GLA primitives)
  const bool outer_gradout = kTensorCore<T> && (!plan.fenwick || tree) && !plan.delta;
  GradSum<T> gq(c, p.dq, r.G, c.rep, int(r.dk), c.dkp, R(r.scale), 1 + plan.has_P + plan.has_S);
  // the inner S primitive's value is its key: the tensor-core kernels fold dv into dk
  // (GlaArgs::value_is_key), one contribution; elsewhere two
  // (HILA_FOLD_S=0: two, for A/B)
  static const bool fold_env = [] {
    const char* e = std::getenv("HILA_FOLD_S");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  const bool fold_S = kTensorCore<T> && fold_env;
  GradSum<T> gk(c, p.dk, r.G, c.rep, int(r.dk), c.dkp, R(1), (plan.has_S ? (fold_S ? 1 : 2) : 1) + plan.has_P);
  GradSum<T> gv(c, p.dv, r.H, 1, int(r.dv), c.dvp, R(1), 1);
  PrimGradBufs<T> go(c, c.dvp, p.d_init.H.defined(), s, plan.fenwick);
  a.dht = dHf.get();
  go.attach(a);
  gq.route(a.dq, a.dq_out, outer_gradout);
  // the outer key gradient dU (has_S) and value gradient dHh (has_P) are 16-bit GEMM operands of
  // the inner backwards: written so directly where the outer honors GradOut (and dU is not also
  // needed in fp32 for the ridge), else through an fp32 buffer
  DevBuf<T> dU, dHh;
  DevBuf<R> dU32, dHh32;
  auto cotangent = [&](DevBuf<T>& d16, DevBuf<R>& d32, R*& out, GradOut<T>& gt, int dp, bool direct) {
    d16 = DevBuf<T>(size_t(r.H * c.Ttot * dp), s);
    if (direct) {
      gt = GradOut<T>{d16.get(), dp, c.Ttot * dp, 1.f};
    } else {
      d32 = DevBuf<R>(size_t(r.H * c.Ttot * dp), s);
      out = d32.get();
    }
  };
  if (plan.has_S) cotangent(dU, dU32, a.dk_, a.dk_out, c.dkp, outer_gradout && plan.ridge == 0);
  else gk.route(a.dk_, a.dk_out, outer_gradout);
  if (plan.has_P) cotangent(dHh, dHh32, a.dv_, a.dv_out, c.dvp, outer_gradout);
  else gv.route(a.dv_, a.dv_out, outer_gradout);
  DevBuf<R> dlam(plan.fenwick ? size_t(r.H * c.Ttot * r.nL) : 0, s);
  if (plan.fenwick) ll_backward<T>(c.ll_args(a, Hst.get(), dlam.get()), *c.ll, s);
  else gla_backward<T>(a, s, beside ? &fwd : nullptr);
  if (beside) forward_outputs();
  auto to16 = [&](DevBuf<T>& d16, const DevBuf<R>& d32, int64_t n) {
    if (d32.get()) HILA_LAUNCH((axpy_k<T, R>), n, s, d16.get(), d32.get(), n, R(1), false);
  };
  const R* dg[3] = {};
  dg[plan.gO] = go.dg.get();
  std::optional<PrimGradBufs<T>> gp, gs;
  if (plan.has_P) {  // Hh = GLA_gP(Q, K, V'): cotangent = outer value gradient
    to16(dHh, dHh32, rowsV);
    gp.emplace(c, c.dvp, p.d_init.P.defined(), s);
    GlaArgs<T> b = c.inner_P();
    b.hbuf = in.Pbuf.get(), b.ht = in.Pf.get(), b.h0 = c.P0.get(), b.dO = dHh.get(), b.dht = dPf.get();
    gp->attach(b);
    gq.route(b.dq, b.dq_out, kTensorCore<T>);
    gk.route(b.dk_, b.dk_out, kTensorCore<T>);
    gv.route(b.dv_, b.dv_out, kTensorCore<T>);
    gla_backward<T>(b, s);
    dg[plan.gP] = gp->dg.get();
  }
  if (plan.has_S) {  // U = GLA_gS(Q, K, K) + ridge Q^: cotangent = outer key gradient
    to16(dU, dU32, rowsK);
    if (plan.ridge != 0)  // dq^ += ridge dU (the unpack multiplies by scale)
      HILA_LAUNCH((axpy_k<R, R>), rowsK, s, gq.sum(), dU32.get(), rowsK, R(plan.ridge), true);
    gs.emplace(c, c.dkp, p.d_init.S.defined(), s);
    GlaArgs<T> b = c.inner_S();
    b.hbuf = in.Sbuf.get(), b.ht = in.Sf.get(), b.h0 = c.S0.get(), b.dO = dU.get(), b.dht = dSf.get();
    gs->attach(b);
    gq.route(b.dq, b.dq_out, kTensorCore<T>);
    gk.route(b.dk_, b.dk_out, kTensorCore<T>);
    if (fold_S) {
      b.value_is_key = true;
    } else {  // the kernel writes dk, then adds it to dv's target in place (the same threads own
              // the same elements of both, dk = dv here)
      gk.route(b.dv_, b.dv_out, kTensorCore<T>);
    }
    gla_backward<T>(b, s);
    dg[plan.gS] = gs->dg.get();
  }
  gq.finish(), gk.finish(), gv.finish();
  if (p.dg.defined()) {
    const int prims = r.traits.num_primitives;
    if (r.gate_cols == 1) {  // tied: sum over primitives (into the outer's buffer)
      for (int i = 0; i < prims; ++i)
        if (i != plan.gO) HILA_LAUNCH((axpy_k<R, R>), r.H * c.Ttot, s, go.dg.get(), dg[i], r.H * c.Ttot, R(1), true);
      HILA_LAUNCH(unpack_gates<R>, r.H * c.Ttot, s, Strided(p.dg), go.dg.get(), r.T, r.H, c.Ttot, 0);
    } else {
      for (int i = 0; i < prims; ++i)
        HILA_LAUNCH(unpack_gates<R>, r.H * c.Ttot, s, Strided(p.dg), dg[i], r.T, r.H, c.Ttot, i);
    }
  }
  if (p.d_init.S.defined())
    HILA_LAUNCH(unpack_sym<R>, c.NH * r.dk * (r.dk + 1) / 2, s, Strided(p.d_init.S), gs->dh0.get(), c.NH, r.H, int(r.dk), c.dkp, true);
  if (p.d_init.P.defined())
    HILA_LAUNCH(unpack_state<R>, c.NH * r.dk * r.dvp, s, Strided(p.d_init.P), gp->dh0.get(), c.NH, r.H, int(r.dk), int(r.dvp), c.dkp, c.dvp);
  if (p.d_init.H.defined()) c.unpack_H(p.d_init.H, go.dh0.get());
  if (p.dlam.defined())
    HILA_LAUNCH(unpack_lam<R>, r.H * c.Ttot * r.nL, s, Strided(p.dlam), dlam.get(), r.T, r.H, c.Ttot, int(r.nL));
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

template <class T>
size_t smem_need_t(int dk, int dv, bool fenwick) {
  return fenwick ? std::max(gla_smem_need<T>(dk, dv), ll_smem_need<T>(dk, dv)) : gla_smem_need<T>(dk, dv);
}
size_t smem_need(DType dt, int dk, int dv, bool fenwick) {
  switch (dt) {
    case DType::bf16: return smem_need_t<__nv_bfloat16>(dk, dv, fenwick);
    case DType::f16: return smem_need_t<__half>(dk, dv, fenwick);
    case DType::f32: return smem_need_t<float>(dk, dv, fenwick);
    default: return smem_need_t<double>(dk, dv, fenwick);
  }
}

}  // namespace

}  // namespace hila::cuda

namespace hila::detail {

void cuda_check_supported(const Resolved& r, DType dt) {
  if (r.form != Form::chunk)
    throw Error("form", std::string("expected chunk on a CUDA device (the naive, serial and scan forms "
                                    "run on the CPU backend), got ") + form_name(r.form));
  // The GLA family takes any power of two up to kChunk (its kernels hold a shorter chunk like a
  // partial one); the log-linear and delta kernels index levels and WY blocks by the 64-row chunk.
  const bool fixed = r.traits.loglinear || r.traits.delta;
  if (fixed ? r.chunk != cuda::kChunk : (r.chunk < 1 || r.chunk > cuda::kChunk || (r.chunk & (r.chunk - 1))))
    throw Error("chunk", std::string("expected ") +
                             (fixed ? std::to_string(cuda::kChunk) + " for " + op_name(r.cfg.op)
                                    : "a power of two up to " + std::to_string(cuda::kChunk)) +
                             " on a CUDA device, got " + std::to_string(r.chunk));
  if (r.traits.delta) return;  // the delta sweeps keep their matrices in global scratch (cuda/delta.cu)
  const size_t optin = cuda::smem_optin();
  const size_t need = cuda::smem_need(dt, cuda::pad16(r.dk), cuda::pad16(r.dvp), r.traits.loglinear);
  if (need > optin)
    throw Error("dk", std::string("expected head dims whose tiles fit in shared memory (") +
                          std::to_string(optin) + " bytes per block on this device), got dk = " +
                          std::to_string(r.dk) + ", dv = " + std::to_string(r.dv) + " in " + dtype_name(dt) +
                          ", which needs " + std::to_string(need) + "; use bfloat16/float16 or smaller head dims");
}

namespace {
// Runs Impl (Fwd / Bwd) on the caller's workspace when there is one (after checking its size and
// device), else on the pool.
template <template <class> class Impl, class P>
void run_call(const Resolved& r, const P& p) {
  cuda::DeviceScope scope(p.q.device.index);
  cuda_check_supported(r, p.q.dtype);
  const auto s = static_cast<cudaStream_t>(p.stream);
  if (!p.workspace) return cuda::by_dtype<Impl>(p.q.dtype, r, p, s);
  cudaPointerAttributes at{};
  HILA_CUDA_CHECK(cudaPointerGetAttributes(&at, p.workspace));
  if ((at.type != cudaMemoryTypeDevice && at.type != cudaMemoryTypeManaged) || at.device != p.q.device.index)
    throw Error("workspace", "expected device memory on " + device_name(p.q.device) + " (like q), got " +
                                 (at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged
                                      ? "memory of cuda:" + std::to_string(at.device)
                                      : std::string("host memory")));
  const size_t need = cuda_workspace_size(r, p);
  if (p.workspace_bytes < need)
    throw Error("workspace_bytes", "expected at least " + std::to_string(need) +
                                       " bytes for this call (hila::workspace_size), got " + std::to_string(p.workspace_bytes));
  cuda::Arena arena(p.workspace, p.workspace_bytes);
  const cuda::ArenaScope in(&arena);
  cuda::by_dtype<Impl>(p.q.dtype, r, p, s);
}

template <template <class> class Impl, class P>
size_t measure(const Resolved& r, const P& p) {
  cuda::DeviceScope scope(p.q.device.index);
  cuda_check_supported(r, p.q.dtype);
  cuda::Arena arena(nullptr, 0);
  {
    const cuda::ArenaScope in(&arena);
    cuda::by_dtype<Impl>(p.q.dtype, r, p, static_cast<cudaStream_t>(p.stream));
  }
  return arena.peak() ? arena.peak() + 256 : 0;  // + the slack of aligning the caller's pointer
}
}  // namespace

void cuda_forward(const Resolved& r, const ForwardParams& p) { run_call<cuda::Fwd>(r, p); }
void cuda_backward(const Resolved& r, const BackwardParams& p) { run_call<cuda::Bwd>(r, p); }
size_t cuda_workspace_size(const Resolved& r, const ForwardParams& p) { return measure<cuda::Fwd>(r, p); }
size_t cuda_workspace_size(const Resolved& r, const BackwardParams& p) { return measure<cuda::Bwd>(r, p); }

}  // namespace hila::detail
