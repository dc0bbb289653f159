// SPDX-License-Identifier: Apache-2.0
// Plain Gated DeltaNet (gdn) on the sm80 tier (tensor cores, delta.cuh), in the fla form of
// docs/math/LOGLINEAR.md §6.4 (the gated UT inverse, which equals the plain recurrence; oracles
// gdn_chunk_plain, gdn_plain_vjp_chunk). Per chunk of C = 64 rows, with the chunk-local cumsum b
// of the log-gates, B = b[C-1], w = e^{B-b}:
//   Tg = (I + tril_-1(diag(beta) (Gam o K K^T)))^-1     [C,C], Gam_ij = e^{b_i - b_j}
//   W  = Tg diag(beta e^b) K     [C,C]x[C,dk]          U = Tg diag(beta) V     [C,C]x[C,dv]
// along the chunks of a sequence, with S the state entering the chunk:
//   Vn = U - W S                 [C,dk]x[dk,dv]        S <- e^B S + K^T diag(w) Vn
// and the output is GLA's with Vn for the values (gla/output_sm80.cu):
//   O  = diag(e^b) Q^ S + (tril(Q^ K^T) o Gam) Vn      (Q^ = scale q)
// Backward, with dS the cotangent of the state at the chunk's end and A = tril(Q^ K^T) o Gam:
//   dVn = A^T dO + diag(w) K dS                        (the GLA dv, with Vn for v)
//   dS_in = e^B dS + Q^T diag(scale e^b) dO - W^T dVn  (the reverse sweep)
//   dq^, the GLA part of dk and dc = q^.dq^ - k.dk: GLA's chunk gradients with Vn for v
//   dW = -dVn S^T, dU = dVn, then through W, U and Tg:  tU = Tg^T dU, tW = Tg^T dW,
//   dTg = dU (beta V)^T + dW (beta e^b K)^T, dN = -tril_-1(Tg^T dTg Tg^T),
//   dv = diag(beta) tU, dk += diag(beta e^b) tW + (dAkk + dAkk^T) K with dAkk = diag(beta) dN o Gam,
//   dbeta = rowsum(tU o V) + e^b rowsum(tW o K) + rowsum(dN o Gam o K K^T),
//   db = dc + beta e^b rowsum(tW o K) + rowsum(L) - colsum(L), L = dAkk o K K^T, plus <dS, S_out> at
//   the chunk's last row; dg is its reverse cumsum inside the chunk. GLA's chunk kernel adds
//   <dS, S_out> = e^B <dS, S> + sum_j w_j k_j.(Vn dS^T)_j to the last row's dc from the same 16-bit dS
//   (dhbuf) as the rows' k.dk, so that the terms of dg reading dS cancel to fp32 rounding (dS in fp32
//   on one side and in 16 bits on the other gives a 1.2x larger dg error at slowly decaying gates).
// Kernels: wy_kernel (chunk-parallel: Tg in fp32 by 16 x 16 blocks, W and U by mma; for the
// backward also Tg in 16 bits and A^T dO), delta_sweep_kernel (sequential over the chunks of one
// (sequence x head, 64 value columns), the fp32 state in registers), the GLA output kernel;
// backward: delta_rsweep_kernel (the reverse sweep of dS, fp32 in registers), GLA's chunk-gradient
// kernel on Vn, then wy_bwd_kernel (chunk-parallel). On Hopper the two sweeps run as TMA + wgmma
// kernels instead where they apply (sweep_sm90.cu, heuristics::delta_sm90_sweep; HILA_DELTA_SM90=0:
// these sm80 sweeps everywhere). W, U, Vn, Tg, dvi and the per-chunk states and cotangents are
// stored in 16 bits (as fla's chunk_gated_delta_rule stores W, U, Vn and dv); the carries, the
// states in the sweeps and every accumulation are fp32.
// Chunks start at each sequence's first row: plain GDN does not depend on absolute positions.
#include <algorithm>
#include <optional>
#include <vector>

#include "core/plan.h"
#include "cuda/delta/delta.cuh"
#include "cuda/delta/gdn_call_sm80.cuh"
#include "cuda/delta/sm80.cuh"
#include "cuda/delta/sweep_sm90.cuh"
#include "cuda/dispatch/heuristics.h"
#include "cuda/prims/pack.cuh"
#include "cuda/runtime/config.h"

namespace hila::cuda {

using namespace gdn;

namespace {

// The state sweep; grid (N x H, 1, dv tiles of 64), 8 warps, warp w owns state rows [16w, 16w+16)
// (those < dk) and columns [v0, v0+64) in registers. Per chunk, double-buffered W, K [C, dk]
// (16-bit) and the gates arrive by cp.async, and U [C, 64] (16-bit) in one buffer, loaded for the
// next chunk once (2) has read it (one buffer keeps the block within half an SM's shared memory,
// two blocks per SM); then
//   (1) S -> 16-bit Ss (and hbuf: the state entering the chunk, for the output kernel)
//   (2) Vn = U - W Ss    [C,dk]x[dk,64]: warp w rows 16 (w % 4), columns 32 (w / 4); to Vns and Vn
//   (3) S = e^B S + K^T diag(e^{B-b}) Vns

template <class T>
__global__ void __launch_bounds__(kThreads, 2) delta_sweep_kernel(GlaArgs<T> a, const T* W, const T* U, T* Vn) {
  extern __shared__ __align__(128) char smem[];
  SweepTiles<T> s(smem, a.dk);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const SweepItem it(a);
  const int seq = it.seq, h = it.h, v0 = it.v0, bv = it.bv, nt = it.nt, nch = it.nch;
  const bool active = it.active;
  const int64_t len = it.len, row0 = it.row0;
  const T* Wh = W + int64_t(h) * a.Ttot * a.dk;
  const T* Uh = U + int64_t(h) * a.Ttot * a.dv;
  const T* Kh = a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk);
  const int64_t kld = row_ld(a.k_ld, a.dk);
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const int64_t sidx = (int64_t(seq) * a.H + h) * a.dk * a.dv;  // [N][H][dk][dv]
  float acc[8][4];  // rows 16w + g (+8), columns v0 + 8j + 2t (+1)
  load_state(acc, active, a.h0 ? a.h0 + sidx : nullptr, a.dv, v0, bv);
  auto issue = [&](int64_t c) { s.issue(c, Wh, Kh, kld, b, row0, len, a.dk); };  // W, K, b of chunk c
  auto issue_u = [&](int c) {  // U [C, bv], rows >= nr zero
    mma::async_rows(s.U, kLd, Uh, a.dv, row0 + int64_t(c) * kChunk, rows_in(len, c), v0, bv, kChunk);
    mma::cp_async_commit();
  };
  const int lo = min(a.c_lo, nch), hi = min(a.c_hi, nch);  // this launch's chunks (GlaArgs::c_lo)
  if (lo < hi) issue(lo), issue_u(lo);
  for (int c = lo; c < hi; ++c) {
    mma::cp_async_wait<0>();
    __syncthreads();  // chunk c has landed (U too); chunk c-1's reads of Ss, Vns and the other stage are done
    if (c + 1 < hi) issue(c + 1);
    const int st = c % kSweepStages, nr = rows_in(len, c);
    const int64_t r0 = row0 + int64_t(c) * kChunk;
    // (1) the state entering the chunk, 16-bit
    stash_state(acc, active, s.Ss, a.hbuf ? a.hbuf + ((a.chunk0[seq] + c) * a.H + h) * int64_t(a.dk) * a.dv : nullptr,
                a.dk, a.dv, v0, bv);
    __syncthreads();
    {  // (2) Vn = U - W Ss
      const int m0 = 16 * (w & 3), n0 = 32 * (w >> 2);
      float x[4][4];
      mma::zero(x);
      mma::warp_gemm<T, 4, false, true>(x, s.W(st), s.ldk, m0, s.Ss, kLd, n0, 4, 0, a.dk);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = fr.row(m0, hf), col = fr.col(n0, j);
          const float2 u = col < bv ? mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(s.U + i * kLd + col))
                                    : make_float2(0.f, 0.f);
          const uint32_t y = mma::pack2<T>(u.x - x[j][2 * hf], u.y - x[j][2 * hf + 1]);  // columns >= bv: 0
          *reinterpret_cast<uint32_t*>(s.Vns + i * kLd + col) = y;
          if (i < nr && col < bv) *reinterpret_cast<uint32_t*>(Vn + (int64_t(h) * a.Ttot + r0 + i) * a.dv + v0 + col) = y;
        }
    }
    __syncthreads();  // U and Ss are read
    if (c + 1 < hi) issue_u(c + 1);
    erase_add(acc, active, s.K(st), s.ldk, s.Vns, nt, s.b(st), nr);  // (3)
  }
  store_state(a.ht ? a.ht + sidx : nullptr, acc, active, a.dv, v0, bv);
}


// The reverse sweep of the backward; grid (N x H, 1, dv tiles of 64), 8 warps, warp w owns the
// cotangent rows [16w, 16w+16) (those < dk) and columns [v0, v0+64) in registers, from dS_T (a.dht,
// else 0). Per chunk, last first, double-buffered Q, K, W [C, dk], dO, dvi [C, 64] (16-bit) and the
// gates arrive by cp.async; then
//   (1) dS -> 16-bit dSs (and dhbuf: the cotangent at the chunk's end, for the gradient kernels)
//   (2) dVn = dvi + diag(w) K dSs    [C,dk]x[dk,64]: warp w rows 16 (w % 4), columns 32 (w / 4)
//   (3) dS = e^B dS + Q^T diag(scale e^b) dO - W^T dVn    [dk,C]x[C,64], twice
// and the cotangent of the initial state goes to a.dh0.

template <class T>
__global__ void __launch_bounds__(kThreads) delta_rsweep_kernel(GlaArgs<T> a, const T* W, const T* dvi) {
  extern __shared__ __align__(128) char smem[];
  RsweepTiles<T> s(smem, a.dk);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const SweepItem it(a);
  const int seq = it.seq, h = it.h, v0 = it.v0, bv = it.bv, nt = it.nt, nch = it.nch;
  const bool active = it.active;
  const int64_t len = it.len, row0 = it.row0;
  const T* Qh = a.q + (h / a.q_div) * head_stride(a.q_hs, a.Ttot, a.dk);
  const T* Kh = a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk);
  const int64_t qld = row_ld(a.q_ld, a.dk), kld = row_ld(a.k_ld, a.dk);
  const T* Wh = W + int64_t(h) * a.Ttot * a.dk;
  const T* dOh = a.dO + h * head_stride(a.dO_hs, a.Ttot, a.dv);
  const int64_t dold = row_ld(a.dO_ld, a.dv);
  const T* dvih = dvi + int64_t(h) * a.Ttot * a.dv;
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const int64_t sidx = (int64_t(seq) * a.H + h) * a.dk * a.dv;  // [N][H][dk][dv]
  const float sc = float(a.scale);
  float acc[8][4];  // rows 16w + g (+8), columns v0 + 8j + 2t (+1)
  load_state(acc, active, a.dht ? a.dht + sidx : nullptr, a.dv, v0, bv);
  auto issue = [&](int c) {
    const int st = c & 1;
    const int64_t r0 = row0 + int64_t(c) * kChunk;
    const int nr = rows_in(len, c);
    mma::async_rows(s.Q(st), s.ldk, Qh, qld, r0, nr, 0, a.dk, kChunk);
    mma::async_rows(s.K(st), s.ldk, Kh, kld, r0, nr, 0, a.dk, kChunk);
    mma::async_rows(s.W(st), s.ldk, Wh, a.dk, r0, nr, 0, a.dk, kChunk);
    mma::async_rows(s.dO(st), kLd, dOh, dold, r0, nr, v0, bv, kChunk);
    mma::async_rows(s.dvi(st), kLd, dvih, a.dv, r0, nr, v0, bv, kChunk);
    if (threadIdx.x < kChunk) {
      const bool in = b && int(threadIdx.x) < nr;
      mma::cp_async4(s.b(st) + threadIdx.x, in ? static_cast<const void*>(b + r0 + threadIdx.x) : dvih, in ? 4 : 0);
    }
    mma::cp_async_commit();
  };
  const int lo = min(a.c_lo, nch), hi = min(a.c_hi, nch);  // this launch's chunks (GlaArgs::c_lo), last first
  if (lo < hi) issue(hi - 1);
  else mma::cp_async_commit();
  for (int c = hi - 1; c >= lo; --c) {
    mma::cp_async_wait<0>();
    __syncthreads();  // chunk c has landed; chunk c+1's reads of dSs, dVns and the other stage are done
    if (c > lo) issue(c - 1);
    else mma::cp_async_commit();
    const int st = c & 1, nr = rows_in(len, c);
    const int64_t cg = a.chunk0[seq] + c;
    // (1) the cotangent at the chunk's end, 16-bit
    stash_state(acc, active, s.dSs, a.dhbuf + (cg * a.H + h) * int64_t(a.dk) * a.dv, a.dk, a.dv, v0, bv);
    __syncthreads();
    const float* bt = s.b(st);
    const float B = bt[nr - 1];
    {  // (2) dVn = dvi + diag(e^{B-b}) K dSs
      const int m0 = 16 * (w & 3), n0 = 32 * (w >> 2);
      float x[4][4];
      mma::zero(x);
      mma::warp_gemm<T, 4, false, true>(x, s.K(st), s.ldk, m0, s.dSs, kLd, n0, 4, 0, a.dk);
      const T* Dt = s.dvi(st);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = fr.row(m0, hf), col = fr.col(n0, j);
          const float wi = __expf(B - bt[i]);
          const float2 u = col < bv ? mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(Dt + i * kLd + col))
                                    : make_float2(0.f, 0.f);
          *reinterpret_cast<uint32_t*>(s.dVns + i * kLd + col) =
              mma::pack2<T>(u.x + wi * x[j][2 * hf], u.y + wi * x[j][2 * hf + 1]);  // columns >= bv: 0
        }
    }
    __syncthreads();
    // (3) dS = e^B dS + Q^T diag(scale e^b) dO - W^T dVn
    const float decay = __expf(B);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] *= decay;
    if (active) {
      mma::warp_gemm_tn_weighted<T, 8>(acc, s.Q(st), s.ldk, 16 * w, s.dO(st), kLd, nt, kChunk,
                                      [&](int k) { return sc * __expf(bt[k]); });
      mma::warp_gemm_tn_weighted<T, 8>(acc, s.W(st), s.ldk, 16 * w, s.dVns, kLd, nt, kChunk, [](int) { return -1.f; });
    }
  }
  store_state(a.dh0 ? a.dh0 + sidx : nullptr, acc, active, a.dv, v0, bv);
}



// The state sweep on stream st: Vn, the states entering each chunk (hbuf) and the final states (ht),
// into buffers allocated before (sweep_buffers; it allocates nothing, so it may run on a side stream).
template <class T>
void sweep_buffers(GdnCall<T>& x) {
  x.Vn = DevBuf<T>(size_t(x.r.H * x.Ttot * x.dv), x.s);
  x.hbuf = DevBuf<T>(size_t(x.seqs.nchunks * x.r.H * x.dk * x.dv), x.s);
  x.a.hbuf = x.hbuf.get();
}
// The forward sweep with the call's arguments a (x.a, or a piece of it), on stream st.
template <class T>
void gdn_sweep(const GdnCall<T>& x, const GlaArgs<T>& a, cudaStream_t st) {
  if (x.NH == 0) return;
  if (heuristics::delta_sm90_sweep(x.dk, x.dv, x.Ttot, config().delta_sm90) &&
      delta_sweep_sm90(a, x.W.get(), x.U.get(), x.Vn.get(), st))
    return;
  const size_t bytes = sweep_smem(x.dk);
  set_smem(delta_sweep_kernel<T>, bytes);
  if (dry_run()) return;  // dry run: workspace_size
  delta_sweep_kernel<T><<<dim3(unsigned(x.NH), 1, unsigned((x.dv + kVT - 1) / kVT)), kThreads, bytes, st>>>(
      a, x.W.get(), x.U.get(), x.Vn.get());
  HILA_CUDA_CHECK_LAUNCH();
}

// The reverse sweep (a: the call's arguments with dht, dh0, dhbuf, or a piece of them), on stream st.
template <class T>
void gdn_rsweep(const GdnCall<T>& x, const GlaArgs<T>& a, const T* dvi, cudaStream_t st) {
  if (x.NH == 0) return;
  if (heuristics::delta_sm90_sweep(x.dk, x.dv, x.Ttot, config().delta_sm90) &&
      delta_rsweep_sm90(a, x.W.get(), dvi, st))
    return;
  const size_t bytes = rsweep_smem(x.dk);
  set_smem(delta_rsweep_kernel<T>, bytes);
  if (dry_run()) return;  // dry run: workspace_size
  delta_rsweep_kernel<T><<<dim3(unsigned(x.NH), 1, unsigned((x.dv + kVT - 1) / kVT)), kThreads, bytes, st>>>(
      a, x.W.get(), dvi);
  HILA_CUDA_CHECK_LAUNCH();
}

// Pieces of the call's WY kernel and sweeps (heuristics::delta_sweep_pieces), run together
// where they exceed one; backward: both sweeps run at once.
template <class T>
int gdn_pieces(const GdnCall<T>& x, bool backward) {
  const int64_t tiles = x.NH * ((x.dv + kVT - 1) / kVT);  // (sequence x head, 64 value columns)
  return heuristics::delta_sweep_pieces((backward ? 2 : 1) * tiles, x.max_chunks, device_info(),
                                        config().delta_pieces);
}

// gdn's WY kernel and sweeps in pieces of `span` chunks of every sequence (heuristics::
// delta_sweep_pieces). run(): the WY pieces on the caller's stream, each sweep's walk over a piece on
// a side stream once the piece's WY is done (x.W, x.U, Vn, hbuf are allocated before: the side
// streams allocate nothing): the forward sweep (side lane 1) first piece to last, its state carried in
// x.ht; with rev (the backward's reverse sweep: its dht, dh0 = the carry, dhbuf) the reverse sweep
// (lane 2) last piece to first, its cotangent carried in rev->dh0, the WY pieces alternating between
// the two ends, the first piece first: a sequence's partial last chunk reads (and masks) up to 63 rows
// past its end, the next sequences' first rows, in chunk 0 (past the last row: TMA's zeros), and the
// sm90 reverse sweep's W^T (-dVn) multiplies those rows of W by zero rows of -dVn, so they must hold
// the WY kernel's finite values, never unwritten memory. Both lanes run at the greatest stream
// priority: as WY blocks finish, the sweeps' blocks take the SMs first. In the forward (no rev) the
// sweep marks each piece done (SideStream::mark), and the output kernel runs on the caller's stream
// piece by piece (wait(k)) while the sweep walks the next pieces; its reads of the next sequence's
// rows of Vn (a partial last chunk) are of piece 0, done before any other. (In the backward the chunk
// gradients and the WY backward wait for both sweeps: per piece they would start only after half
// the sweeps' walk, and on an H100 they cost more than they overlapped.)
template <class T>
class GdnPieces {
 public:
  GdnPieces(const GdnCall<T>& x, int pieces)
      : max_(x.max_chunks), span_((x.max_chunks + pieces - 1) / pieces), P_(int((x.max_chunks + span_ - 1) / span_)) {}
  int count() const { return P_; }
  GlaArgs<T> piece(GlaArgs<T> a, int k) const {
    a.c_lo = int(k * span_), a.c_hi = int(std::min<int64_t>((k + 1) * span_, max_));
    return a;
  }
  void run(GdnCall<T>& x, T* tg, T* dvi, const GlaArgs<T>* rev) {
    std::vector<char> done(size_t(P_), 0);
    std::optional<SideStream> bwd;
    int next_f = 0, next_r = P_ - 1;  // each sweep's next piece
    for (int i = 0; i < P_; ++i) {
      const int k = !rev ? i : i % 2 == 0 ? i / 2 : P_ - 1 - i / 2;  // rev: 0, P-1, 1, P-2, ...
      const GlaArgs<T> w = piece(x.a, k);
      x.wy_piece(tg, dvi, w.c_lo, w.c_hi);
      done[size_t(k)] = 1;
      if (next_f < P_ && done[size_t(next_f)]) {
        if (fwd_) fwd_->follow();
        else fwd_.emplace(x.s, 1);
        fwd_->run([&](cudaStream_t st) {
          for (; next_f < P_ && done[size_t(next_f)]; ++next_f) {
            GlaArgs<T> a = piece(x.a, next_f);
            a.h0 = next_f == 0 ? x.a.h0 : x.ht.get(), a.ht = x.ht.get();
            gdn_sweep(x, a, st);
            if (!rev) fwd_->mark(next_f);
          }
        });
      }
      if (rev && next_r >= 0 && done[size_t(next_r)]) {
        if (bwd) bwd->follow();
        else bwd.emplace(x.s, 2);
        bwd->run([&](cudaStream_t st) {
          for (; next_r >= 0 && done[size_t(next_r)]; --next_r) {
            GlaArgs<T> a = piece(*rev, next_r);
            if (next_r != P_ - 1) a.dht = rev->dh0;
            gdn_rsweep(x, a, dvi, st);
          }
        });
      }
    }
    if (bwd) bwd->join();
    if (rev) join();
  }
  void wait(int k) const {  // the caller's stream waits for the forward sweep's piece k (forward only)
    if (fwd_) fwd_->wait_mark(k);
  }
  void join() {
    if (fwd_) fwd_->join();
  }

 private:
  int64_t max_, span_;
  int P_;
  std::optional<SideStream> fwd_;  // forked from the caller's stream after the first WY piece
};

}  // namespace

template <class T>
bool gdn_sm80_usable(const detail::Resolved& r, bool backward) {
  if constexpr (!kTensorCore<T>) {
    return false;
  } else {
    if (r.cfg.op != Op::gdn) return false;
    const int dk = pad16(r.dk), dv = pad16(r.dv);
    if (!heuristics::delta_sm80(dk, dv, config().gdn_tc)) return false;
    const size_t optin = smem_optin();
    size_t need = std::max({wy_smem(dk, dv, backward), sweep_smem(dk), gla_output_smem(dk, dv, sizeof(T))});
    if (backward) need = std::max({need, rsweep_smem(dk), gla_bwd_chunk_smem(dk, dv), wy_bwd_smem(dk, dv)});
    return need <= optin;
  }
}

template <class T>
void gdn_sm80_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) {
  if constexpr (kTensorCore<T>) {
    GdnCall<T> x(r, p, s, false);
    if (const int pieces = gdn_pieces(x, false); pieces > 1) {
      x.wy_buffers();
      sweep_buffers(x);
      GdnPieces<T> pc(x, pieces);
      pc.run(x, nullptr, nullptr, nullptr);
      x.output(p.o, [&](const GlaArgs<T>& b) {  // each piece's output once the sweep is past it
        for (int k = 0; k < pc.count(); ++k) {
          pc.wait(k);
          gla_output(pc.piece(b, k), s);
        }
      });
      pc.join();
    } else {
      x.wy();
      sweep_buffers(x);
      gdn_sweep(x, x.a, s);
      x.output(p.o);
    }
    x.write_final(p.final_state);
  }
}

// The backward (file comment): the forward recomputed with Tg and dvi, the reverse sweep, GLA's
// chunk gradients on Vn (dq^, GLA's part of dk, dVn, dc), then the WY backward. The recomputed
// forward sweep (Vn, hbuf) runs on a side stream beside the reverse sweep, which reads none of its
// outputs: few long sequences leave both latency-bound sweeps far from filling the GPU (at
// B = 1, H = 16, dv = 128, 32 blocks each).
template <class T>
void gdn_sm80_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) {
  if constexpr (kTensorCore<T>) {
    using R = Acc<T>;
    GdnCall<T> x(r, p, s, true);
    const int64_t H = r.H, Ttot = x.Ttot, dk = x.dk, dv = x.dv, nch = x.seqs.nchunks;
    DevBuf<T> dO, tg(size_t(nch * H * kChunk * kChunk), s);
    x.a.dO = x.operand(p.d_o, H, int(r.dv), int(dv), dO, x.a.dO_ld, x.a.dO_hs);
    DevBuf<T> dvi(size_t(H * Ttot * dv), s);
    // the reverse sweep's arguments: dhbuf (the cotangents at the chunk ends) and dS_0; in pieces,
    // dS_0's buffer carries the cotangent from piece to piece
    const int pieces = gdn_pieces(x, true);
    DevBuf<R> dht(p.d_final.H.defined() ? size_t(x.NH * dk * dv) : 0, s);
    DevBuf<R> dh0(p.d_init.H.defined() || pieces > 1 ? size_t(x.NH * dk * dv) : 0, s);
    if (p.d_final.H.defined())
      HILA_LAUNCH(pack_state<R>, x.NH * dk * dv, s, dht.get(), Strided(p.d_final.H), x.NH, H, int(r.dk), int(r.dv),
                  int(dk), int(dv));
    DevBuf<T> dhbuf(size_t(nch * H * dk * dv), s);
    GlaArgs<T> a = x.a;
    a.dht = dht.get(), a.dh0 = dh0.get(), a.dhbuf = dhbuf.get();
    if (pieces > 1) {
      x.wy_buffers();
      sweep_buffers(x);
      a.hbuf = x.a.hbuf;
      GdnPieces<T>(x, pieces).run(x, tg.get(), dvi.get(), &a);
    } else {
      x.wy(tg.get(), dvi.get());
      sweep_buffers(x);
      a.hbuf = x.a.hbuf;
      // the recomputed forward sweep on a side stream beside the reverse sweep
      std::optional<SideStream> side;
      if (x.NH > 0) side.emplace(s).run([&](cudaStream_t st) { gdn_sweep(x, x.a, st); });
      gdn_rsweep(x, a, dvi.get(), s);
      if (side) side->join();
    }
    x.output(p.o);
    x.write_final(p.final_state);
    // GLA's chunk gradients with the values Vn: dq^, GLA's part of dk, dVn (16-bit) and dc (the last
    // row's with <dS, S_out>, from the same 16-bit dS as the rows' k.dk)
    // the WY backward; dk and dv straight into the caller's tensors where their layouts allow
    WyBwdArgs<T> wb;
    const bool dk_direct = x.dk_in_wy_bwd(p, wb);
    DevBuf<R> dq(size_t(H * Ttot * dk), s), dkb(size_t(H * Ttot * dk), s);  // dkb: GLA's part of dk
    DevBuf<R> dkw(dk_direct ? 0 : size_t(H * Ttot * dk), s);               // the WY part, unless direct
    // dv straight into the caller's tensor where its layout allows (no fp32 copy, no unpack pass)
    const bool dv_direct = int(r.dv) == dv && in_place_ok<T>(p.dv, r.B, r.T);
    DevBuf<R> dg(size_t(H * Ttot), s), dvb(dv_direct ? 0 : size_t(H * Ttot * dv), s), dbeta(size_t(H * Ttot), s);
    DevBuf<T> dvn(size_t(H * Ttot * dv), s);
    a.v = x.Vn.get(), a.v_ld = a.v_hs = 0;
    a.dq = dq.get(), a.dk_ = dkb.get(), a.dg = dg.get(), a.dg_rows = true;  // wy_bwd_kernel sums dg per chunk
    a.dv_out = {dvn.get(), dv, Ttot * dv, 1.f};
    // dq straight into the caller's tensor where its layout allows (through the l2norm chain rule
    // where the sm90 kernel runs; else dq to the fp32 buffer and the chain-rule pass)
    const bool dq_try = x.dq_in_chunk_kernel(p, a.dq_out);
    const bool dq_direct = gla_bwd_chunk(a, s) && dq_try;
    wb.beta = x.beta.get(), wb.tg = tg.get(), wb.dvn = dvn.get();
    wb.dk = dk_direct ? dkb.get() : dkw.get(), wb.dv = dvb.get(), wb.dg = dg.get(), wb.dbeta = dbeta.get();
    if (dv_direct) wb.dv16 = static_cast<T*>(p.dv.data), wb.dv16_ld = p.dv.stride[1], wb.dv16_hs = p.dv.stride[2];
    if (nch > 0) launch_wy_bwd(x.a, wb, s);  // the raw values v
    x.write_grads(p, dq_direct ? nullptr : dq.get(), dk_direct ? nullptr : dkb.get(), dkw.get(),
                  dv_direct ? nullptr : dvb.get(), dg.get(), dbeta.get());
    if (p.d_init.H.defined())
      HILA_LAUNCH(unpack_state<R>, x.NH * r.dk * r.dv, s, Strided(p.d_init.H), dh0.get(), x.NH, H, int(r.dk),
                  int(r.dv), int(dk), int(dv));
  }
}

#define HILA_INSTANTIATE(T)                                                                            \
  template bool gdn_sm80_usable<T>(const detail::Resolved&, bool);                                     \
  template void gdn_sm80_forward<T>(const detail::Resolved&, const ForwardParams&, cudaStream_t);      \
  template void gdn_sm80_backward<T>(const detail::Resolved&, const BackwardParams&, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
