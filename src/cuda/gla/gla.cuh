// SPDX-License-Identifier: Apache-2.0
// The GLA primitive on the GPU (docs/math/HLA.md §1, §7.1), on packed head-major buffers:
//   x [heads][Ttot][d_pad] (d_pad a multiple of 16, zero padded), sequences are row ranges;
// the tensor-core tiers also read and write the caller's [B, T, H, d] tensors in place (GlaArgs).
// Per chunk c of C rows, with b the chunk-local cumsum of the log-gates and B = b[C-1]:
//   O_c = (Gamma_c o Q^_c K_c^T) V_c + diag(e^b) Q^_c H            [C,dk]x[dk,C], [C,C]x[C,dv], [C,dk]x[dk,dv]
//   H  <- e^B H + K_c^T diag(e^{B-b}) V_c                          [dk,C]x[C,dv]
// Backward: the forward's sweep stores the state entering every chunk (hbuf); a reverse sweep
// stores the state cotangent at every chunk end (dhbuf); then the chunks are independent:
//   dA = (dO V^T) o Gamma;  dQ^ = dA K + diag(e^b) dO Hp^T;  dK = dA^T Q^ + diag(w) V dH^T;
//   dV = (Gamma o Q^K^T)^T dO + diag(w) K dH;  dc = q^.dq^ - k.dk  (w = e^{B-b})
// and the gate gradient is the reverse cumsum of dc inside the chunk plus one boundary term
// (docs/math/HLA.md §7.1, "the gate gradient per chunk"):  dg_s = sum_{s <= i in chunk} dc_i + <dH, H_end>,
//   <dH, H_end> = e^B <dH, Hp> + sum_j w_j k_j . (V dH^T)_j          (H_end = e^B Hp + K^T diag(w) V)
// so no rounding is carried from one chunk's dg to another's.
// Stages, one file per stage and kernel tier (gla.cu chooses the tier):
//   gates           gates.cu                            chunk cumsum b
//   state sweep     sweep_{portable,sm80,sm90}.cu       H through the chunks (forward / reverse)
//   output          sweep_portable.cu, output_sm80.cu   O from the states entering the chunks
//   fused forward   fused_fwd_{sm80,sm90}.cu            sweep and output in one kernel
//   chunk grads     bwd_chunk_{portable,sm80,sm90}.cu   dq, dk, dv, dg per chunk
// Tiers: portable (fp32 / fp64, shared-memory tile GEMMs), sm80 (bf16 / fp16 on mma.sync), sm90
// (sm_90a: TMA + wgmma).
#pragma once
#include "cuda/prims/mma.cuh"
#include "cuda/prims/tile.cuh"

namespace hila::cuda {

constexpr int kBV = 64;     // value columns per block in the portable sweeps

// Per-chunk states stored for later kernels are GEMM operands only: 16-bit for the tensor-core
// path, the accumulator type otherwise. The carries themselves stay in Acc<T>.
template <class T>
using StateOperand = std::conditional_t<kTensorCore<T>, T, Acc<T>>;

// Where a chunk kernel puts one gradient (dq, dk or dv). By default the fp32 per-head buffer
// (a.dq, a.dk_, a.dv_: [H][Ttot][d]); with p set (tensor-core path, no GQA) the caller's 16-bit
// tensor instead: head h at p + h*hs, rows of ld, values times mult. With add set, add[h][row][c]
// (fp32, the buffer's layout; it may be the buffer itself) is added first: the contributions of
// the primitives before this one in a composition (docs/math/HLA.md §7.2).
// For dq, with p set and rstd given ([H][Ttot], one head per group: the rows' 1 / |x| of q's l2
// normalisation, qk_l2norm), the sm90 chunk-gradient kernel writes the gradient of the raw q,
// (dy - y (y.dy)) rstd with dy = mult dq^ and y the normalised row (its q tile); gla_bwd_chunk
// says whether it did (the sm80 kernel writes the fp32 buffer instead).
template <class T>
struct GradOut {
  T* p = nullptr;
  int64_t ld = 0, hs = 0;
  float mult = 1.f;
  const Acc<T>* add = nullptr;
  const float* rstd = nullptr;
};

template <class T>
struct GlaArgs {
  using R = Acc<T>;
  const T *q = nullptr, *k = nullptr, *v = nullptr;  // packed [heads][Ttot][d_pad]
  int q_div = 1, k_div = 1, v_div = 1;              // source head = h / div
  // Row layouts of q, k, v, o, dO for the tensor-core path: element (row r, head x, column c) at
  // x * hs + r * ld + c; 0 = packed (ld = d, hs = Ttot * d). The caller's [B, T, H, d] tensors are
  // read and written in place when their strides allow (ld, hs multiples of 8, unit columns).
  int64_t q_ld = 0, q_hs = 0, k_ld = 0, k_hs = 0, v_ld = 0, v_hs = 0, o_ld = 0, o_hs = 0, dO_ld = 0, dO_hs = 0;
  const R* g = nullptr;                             // [H][Ttot] log-gates, nullptr = 0
  const R* b = nullptr;                             // [H][Ttot] chunk-local cumsum of g (gla_chunk_cumsum)
  int H = 1, N = 1;
  int64_t Ttot = 0;
  int dk = 16, dv = 16;                             // padded, multiples of 16
  const int64_t *row0 = nullptr, *len = nullptr, *chunk0 = nullptr;  // [N] (device)
  const int* chunk_seq = nullptr;                   // [nchunks] sequence of each chunk (device)
  int64_t nchunks = 0;
  // Chunk rows C (a power of two <= kChunk; Resolved::chunk). Chunk c of a sequence is its rows
  // [cC, cC + C). The kernels' row tiles stay kChunk: a chunk of C < kChunk rows is held like a
  // sequence's partial last chunk (rows past it zero-filled or masked by nr = rows_in(len, c, C)).
  int C = kChunk;
  // The delta rule's pipelined pieces (heuristics::delta_sweep_pieces): the chunks [c_lo, c_hi) of
  // every sequence that its WY kernel and state sweeps cover in one launch (default: all). A sweep
  // over a piece takes its state from h0 (dht) and leaves it in ht (dh0).
  int c_lo = 0, c_hi = INT32_MAX;
  R scale = 1;
  // forward
  T* o = nullptr;                                   // [H][Ttot][dv]
  const R* h0 = nullptr;                            // [N][H][dk][dv]
  R* ht = nullptr;                                  // [N][H][dk][dv]
  StateOperand<T>* hbuf = nullptr;                                // [nchunks][H][dk][dv]: state entering each chunk
  // backward
  const T* dO = nullptr;                            // [H][Ttot][dv]
  const R* dht = nullptr;                           // [N][H][dk][dv]
  R* dh0 = nullptr;                                 // [N][H][dk][dv]
  StateOperand<T>* dhbuf = nullptr;                               // [nchunks][H][dk][dv]: cotangent at each chunk end
  R *dq = nullptr, *dk_ = nullptr, *dv_ = nullptr;  // per head [H][Ttot][d]
  GradOut<T> dq_out, dk_out, dv_out;                // when set: written there instead
  // the value is the key (the inner S primitive of the HLA family, dk = dv): the tensor-core
  // kernels add the value-role gradient into the key's and write dk only (dv_, dv_out unused)
  bool value_is_key = false;
  R* dg = nullptr;                                  // [H][Ttot]
  // the chunk kernels write the per-row dc = q^.dq^ - k.dk into dg instead of the gate gradient, the
  // chunk's last row plus <dH, H_end>, for a caller that adds its own terms and sums per chunk (the
  // delta rule's WY backward). <dH, H_end> = e^B <dH, Hp> + sum_j w_j k_j.(V dH^T)_j is formed from
  // the same 16-bit dH as the rows' k.dk, so the terms of dg that read dH cancel to fp32 rounding.
  bool dg_rows = false;
};

// The chunk that block x of a chunk-parallel grid (grid_chunks(a) blocks on its x axis) takes: every
// chunk of the call (its sequence from chunk_seq), or, for a piece [c_lo, c_hi) of every sequence
// (GlaArgs::c_lo), N x (c_hi - c_lo) blocks, those past their sequence's chunks idle (!valid).
struct GridChunk {
  int seq;
  int64_t c, cg;  // chunk in its sequence, in the call
  bool valid;
  template <class A>
  __device__ GridChunk(const A& a, unsigned x) {
    if (a.c_hi == INT32_MAX) {
      cg = x, seq = a.chunk_seq[x], c = int64_t(x) - a.chunk0[seq], valid = true;
    } else {
      const unsigned span = unsigned(a.c_hi - a.c_lo);
      seq = int(x / span), c = a.c_lo + int64_t(x % span), cg = a.chunk0[seq] + c, valid = c * a.C < a.len[seq];
    }
  }
};
template <class A>
int64_t grid_chunks(const A& a) {
  return a.c_hi == INT32_MAX ? a.nchunks : int64_t(a.N) * (a.c_hi - a.c_lo);
}

// ---- the primitive (gla.cu) --------------------------------------------------------------------------
// Launchers (on `stream`). Forward writes o (if set), ht, hbuf.
template <class T>
void gla_forward(const GlaArgs<T>& a, cudaStream_t stream);
// Backward: needs hbuf (from a forward with hbuf set) and writes dhbuf, dh0, dq, dk_, dv_, dg (the
// chunk kernels finish dg themselves).
// With `recompute`, that forward (its b and hbuf given: it allocates nothing) runs first, on a
// side stream beside the reverse sweep.
template <class T>
void gla_backward(const GlaArgs<T>& a, cudaStream_t stream, const GlaArgs<T>* recompute = nullptr);
// Shared memory the kernels need for these head dims (bytes); 0 if they do not fit the device.
template <class T>
size_t gla_smem_need(int dk, int dv);

// ---- its stages, for the other primitives built on them (log-linear tree, delta rule) ------------------
// gates.cu, every dtype: b = chunk-local inclusive cumsum of a.g per (chunk, head) into [H][Ttot]
// (no-op without gates).
template <class T>
void gla_chunk_cumsum(const GlaArgs<T>& a, Acc<T>* b, cudaStream_t stream);
// bf16 / fp16 (gla.cu picks the tier of each: sm90 where heuristics.h chooses it, else sm80):
// the state sweep (reverse: the cotangent sweep; stores hbuf / dhbuf);
template <class T>
void gla_sweep(const GlaArgs<T>& a, bool reverse, cudaStream_t stream);
// the log-linear tree built by the sweep (loglinear/tree.cuh; needs ta.beta, writes ta.node16): one
// block per (sequence x head, 64 x 64 state tile), gla_sweep_blocks of them, times nseg with
// segments (TreeArgs::seg; nseg segments in the longest sequence), with a per-block fp32 level
// stack of lstk levels (gla_tree_sweep_stack floats);
struct TreeArgs;
template <class T>
void gla_tree_sweep(const GlaArgs<T>& a, const TreeArgs& ta, float* stack, int lstk, unsigned nseg, cudaStream_t stream);
template <class T>
int64_t gla_sweep_blocks(const GlaArgs<T>& a);
template <class T>
size_t gla_tree_sweep_stack(const GlaArgs<T>& a, int lstk, unsigned nseg);
// the chunk-parallel output kernel, which reads hbuf (with `tree`: the tree's nodes, and the intra
// block carries lam);
template <class T>
void gla_output(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree = nullptr);
// the forward in one kernel (state in registers, no per-chunk states through global memory unless
// a.hbuf is set), for the calls heuristics::gla_fused_forward chooses;
template <class T>
void gla_fused_forward(const GlaArgs<T>& a, cudaStream_t stream);
// the per-chunk gradients dq, dk, dv, dg (with `tree`, from the tree's nodes and dZ, or a.dg_rows:
// the rows' dc in place of dg, the last row's plus <dH, H_end>). False when a.dq_out.rstd is set and dq went to the fp32 buffer a.dq
// instead (GradOut).
template <class T>
bool gla_bwd_chunk(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree = nullptr);
// Shared memory of the sm80 output and chunk-gradient kernels, and of the sm80 fused forward.
size_t gla_output_smem(int dk, int dv, size_t esize);
size_t gla_bwd_chunk_smem(int dk, int dv, bool tree = false);
size_t gla_fused_forward_smem(int dk);

// ---- the tiers' launchers (one file per stage and tier) ----------------------------------------------
// portable (fp32 / fp64; sweep_portable.cu, bwd_chunk_portable.cu): the forward sweep writes o too.
template <class T>
void gla_sweep_portable(const GlaArgs<T>& a, bool reverse, cudaStream_t stream);
template <class T>
void gla_bwd_chunk_portable(const GlaArgs<T>& a, cudaStream_t stream);
template <class T>
size_t gla_sweep_portable_smem(int dk);
template <class T>
size_t gla_bwd_chunk_portable_smem(int dk, int dv);
// sm80 (bf16 / fp16 on mma.sync; sweep_sm80.cu, output_sm80.cu, fused_fwd_sm80.cu, bwd_chunk_sm80.cu).
template <class T>
void gla_sweep_sm80(const GlaArgs<T>& a, bool reverse, cudaStream_t stream);
template <class T>
void gla_tree_sweep_sm80(const GlaArgs<T>& a, const TreeArgs& ta, float* stack, int lstk, unsigned nseg,
                         cudaStream_t stream);
template <class T>
void gla_output_sm80(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree);
template <class T>
void gla_fused_forward_sm80(const GlaArgs<T>& a, cudaStream_t stream);
template <class T>
void gla_bwd_chunk_sm80(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree);
// sm90 (sm_90a: TMA + wgmma; sweep_sm90.cu, output_sm90.cu, fused_fwd_sm90.cu, bwd_chunk_sm90.cu), for the calls
// heuristics.h gives them: false (nothing launched) where this device does not run the build's
// sm_90a code or TMA cannot describe the operands, and gla.cu then runs the sm80 kernel.
template <class T>
bool gla_sweep_sm90(const GlaArgs<T>& a, bool reverse, cudaStream_t stream);
template <class T>
bool gla_tree_sweep_sm90(const GlaArgs<T>& a, const TreeArgs& ta, float* stack, int lstk, unsigned nseg,
                         cudaStream_t stream);
template <class T>
bool gla_output_sm90(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree);
template <class T>
bool gla_fused_forward_sm90(const GlaArgs<T>& a, cudaStream_t stream);
template <class T>
bool gla_bwd_chunk_sm90(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree = nullptr);

// Effective layout of an operand with d (padded) columns.
__host__ __device__ inline int64_t row_ld(int64_t ld, int d) { return ld ? ld : d; }
__host__ __device__ inline int64_t head_stride(int64_t hs, int64_t Ttot, int d) { return hs ? hs : Ttot * d; }

// Element (i, j) of the causal score block P = scale Gamma o Q K^T from x = (Q K^T)_ij: scale
// e^{b_i - b_j} x for j <= i < nr, else 0; kTree: times lam_i^{bitlen(i xor j)} (aligned chunks,
// docs/math/LOGLINEAR.md §2.6; lr = row i of lam). The output and fused-forward kernels of both tiers.
template <bool kTree>
__device__ __forceinline__ float score_elem(float x, int i, int j, int nr, float sc, float bi, float bj, const float* lr) {
  if (!(j <= i && i < nr)) return 0.f;
  float p = x * sc * mma::fexp(bi - bj);
  if constexpr (kTree) p *= lr[32 - __clz(i ^ j)];
  return p;
}

// The tensor-core chunk kernels' gradient store: values (v0, v1) of row r (prow = h Ttot + r in
// the fp32 buffers [H][Ttot][ld]) and columns col, col + 1, plus gt.add, to gt.p or out.
template <class T>
__device__ __forceinline__ void store_grad2(float* out, int ld, const GradOut<T>& gt, int h, int64_t r, int64_t prow,
                                            int col, float v0, float v1) {
  if (gt.add) {
    const float2 x = *reinterpret_cast<const float2*>(gt.add + prow * ld + col);
    v0 += x.x, v1 += x.y;
  }
  if (gt.p)
    *reinterpret_cast<uint32_t*>(gt.p + h * gt.hs + r * gt.ld + col) = mma::pack2<T>(gt.mult * v0, gt.mult * v1);
  else
    *reinterpret_cast<float2*>(out + prow * ld + col) = make_float2(v0, v1);
}

}  // namespace hila::cuda
