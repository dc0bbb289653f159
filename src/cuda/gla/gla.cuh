// SPDX-License-Identifier: Apache-2.0
// The GLA primitive on the GPU (HLA_SPEC §1, §7.1), on packed head-major buffers:
//   x [heads][Ttot][d_pad] (d_pad a multiple of 16, zero padded), sequences are row ranges.
// Forward: one block per (value tile of 64 columns, sequence x head) sweeps the chunks of its
// sequence in order, keeping its [dk, 64] state tile in fp32 shared memory:
//   O_c = (Gamma_c o Q^_c K_c^T) V_c + diag(e^b) Q^_c H            [C,dk]x[dk,C], [C,C]x[C,64], [C,dk]x[dk,64]
//   H  <- e^B H + K_c^T diag(e^{B-b}) V_c                          [dk,C]x[C,64]
// Backward: the same sweep stores the state entering every chunk (hbuf); a reverse sweep stores
// the state cotangent at every chunk end (dhbuf); then one block per (chunk, head) forms
//   dA = (dO V^T) o Gamma;  dQ^ = dA K + diag(e^b) dO Hp^T;  dK = dA^T Q^ + diag(w) V dH^T;
//   dV = (Gamma o Q^K^T)^T dO + diag(w) K dH;  dc = q^.dq^ - k.dk  (w = e^{B-b})
// and dg is the reverse cumsum of dc per sequence (plus <dH_T, H_T> at the last token).
#pragma once
#include "cuda/prims/mma.cuh"
#include "cuda/prims/tile.cuh"

namespace hila::cuda {

constexpr int kBV = 64;     // value columns per block in the sequential sweeps

// Per-chunk states stored for later kernels are GEMM operands only: 16-bit for the tensor-core
// path, the accumulator type otherwise. The carries themselves stay in Acc<T>.
template <class T>
using StateOperand = std::conditional_t<kTensorCore<T>, T, Acc<T>>;

// Where a chunk kernel puts one gradient (dq, dk or dv). By default the fp32 per-head buffer
// (a.dq, a.dk_, a.dv_: [H][Ttot][d]); with p set (tensor-core path, no GQA) the caller's 16-bit
// tensor instead: head h at p + h*hs, rows of ld, values times mult. With add set, add[h][row][c]
// (fp32, the buffer's layout; it may be the buffer itself) is added first: the contributions of
// the primitives before this one in a composition (HLA_SPEC §7.2).
template <class T>
struct GradOut {
  T* p = nullptr;
  int64_t ld = 0, hs = 0;
  float mult = 1.f;
  const Acc<T>* add = nullptr;
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
};

// b = chunk-local inclusive cumsum of a.g per (chunk, head) into [H][Ttot] (no-op without gates).
template <class T>
void gla_chunk_cumsum(const GlaArgs<T>& a, Acc<T>* b, cudaStream_t stream);
// Tensor-core path (bf16/fp16; gla_tc.cu): the state sweep (reverse = cotangent sweep) and the
// chunk-parallel output kernel, which reads hbuf.
template <class T>
void tc_sweep(const GlaArgs<T>& a, bool reverse, cudaStream_t stream);
// The log-linear tree built by the sweep (ll_tree.cuh; needs ta.beta, writes ta.node16): one block
// per (sequence x head, 64 x 64 state tile), tc_sweep_blocks of them, with a per-block fp32 level
// stack of lstk levels (tc_tree_sweep_stack floats).
struct TreeArgs;
template <class T>
void tc_tree_sweep(const GlaArgs<T>& a, const TreeArgs& ta, float* stack, int lstk, cudaStream_t stream);
template <class T>
int64_t tc_sweep_blocks(const GlaArgs<T>& a);
template <class T>
size_t tc_tree_sweep_stack(const GlaArgs<T>& a, int lstk);
// With `tree` (log-linear tree form, ll_tree.cuh) the state terms read the tree nodes instead of
// hbuf / dhbuf and the intra block carries lam.
template <class T>
void tc_output(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree = nullptr);
// The forward in one kernel (state in registers, no per-chunk states through global memory unless
// a.hbuf is set): for dk <= 128, dv a multiple of 64 and enough opt-in shared memory, chosen when
// its (sequence x head x 64-column value tile) blocks fill the GPU (HILA_GLA_FUSED=0/1 forces the
// choice among the calls it can run).
template <class T>
bool tc_fused_forward_wanted(const GlaArgs<T>& a);
template <class T>
void tc_fused_forward(const GlaArgs<T>& a, cudaStream_t stream);
template <class T>
void tc_bwd_chunk(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree = nullptr);  // per-chunk dq, dk, dv, dc
// The same on Hopper (gla_sm90.cu: TMA + wgmma) for dk, dv in {64, 128}: false (nothing launched)
// where it does not apply (not an sm_90a device or build, other head dims, layouts TMA cannot
// describe, HILA_GLA_SM90=0), and tc_bwd_chunk then runs the portable kernel.
template <class T>
bool tc_bwd_chunk_sm90(const GlaArgs<T>& a, cudaStream_t stream);
// The state sweep on Hopper (gla_sm90.cu) for dk, dv multiples of 64; false as above.
template <class T>
bool tc_sweep_sm90(const GlaArgs<T>& a, bool reverse, cudaStream_t stream);
// The log-linear tree build in that sweep (tc_tree_sweep's arguments); false as above.
template <class T>
bool tc_tree_sweep_sm90(const GlaArgs<T>& a, const TreeArgs& ta, float* stack, int lstk, cudaStream_t stream);
// The one-kernel forward on Hopper (gla_sm90.cu) for dk of 64 or 128, dv a multiple of 64; false as above.
template <class T>
bool tc_fused_forward_sm90(const GlaArgs<T>& a, cudaStream_t stream);
size_t tc_output_smem(int dk, int dv, size_t esize);
size_t tc_bwd_smem(int dk, int dv, bool tree = false);
// dg: reverse cumsum per (sequence, head) of the per-row dc in a.dg (plus <dht, ht> at the last token).
template <class T>
void gla_dg(const GlaArgs<T>& a, cudaStream_t stream);

// Effective layout of an operand with d (padded) columns.
__host__ __device__ inline int64_t row_ld(int64_t ld, int d) { return ld ? ld : d; }
__host__ __device__ inline int64_t head_stride(int64_t hs, int64_t Ttot, int d) { return hs ? hs : Ttot * d; }

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
    *reinterpret_cast<uint32_t*>(gt.p + h * gt.hs + r * gt.ld + col) = tc::pack2<T>(gt.mult * v0, gt.mult * v1);
  else
    *reinterpret_cast<float2*>(out + prow * ld + col) = make_float2(v0, v1);
}

// Launchers (on `stream`). Forward writes o (if set), ht, hbuf.
template <class T>
void gla_forward(const GlaArgs<T>& a, cudaStream_t stream);
// Backward: needs hbuf (from a forward with hbuf set) and writes dhbuf, dh0, dq, dk_, dv_, dg.
// With `recompute`, that forward (its b and hbuf given: it allocates nothing) runs first, on a
// side stream beside the reverse sweep.
template <class T>
void gla_backward(const GlaArgs<T>& a, cudaStream_t stream, const GlaArgs<T>* recompute = nullptr);
// Shared memory the kernels need for these head dims (bytes); 0 if they do not fit the device.
template <class T>
size_t gla_smem_need(int dk, int dv);

}  // namespace hila::cuda
