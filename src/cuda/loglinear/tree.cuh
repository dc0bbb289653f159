// SPDX-License-Identifier: Apache-2.0
// Chunk-parallel tree form of log-linear Mamba-2 (docs/math/LOGLINEAR.md §3.3 "tree", §5.3), the
// tensor-core path for calls whose sequences start at chunk-aligned positions n0 = a0 C (a
// backward too). With C = 2^p and chunks numbered by absolute position,
// chunk N reads, for every set bit m-1 of N, the tree node
//   node_m[j],  j = (N >> (m-1)) - 1:  the tokens of chunks [j 2^{m-1}, (j+1) 2^{m-1}) decayed to
//   the end of that block, at level p + m, with the decay of the chunks in between as
//   gap_m(N) = sum_{m' < m, bit m'-1 of N} beta_{m'}[(N >> (m'-1)) - 1]   (sums of chunk totals).
// Nodes: node_1[j] = Z_j = K_j^T diag(e^{B_j - b}) V_j;  node_{m+1}[j] = e^{beta_m[2j+1]} node_m[2j] + node_m[2j+1];
//        beta_1[j] = B_j (chunk total log-gate),  beta_{m+1}[j] = beta_m[2j] + beta_m[2j+1].
// Initial state H0 at n0 = a0 C (canonical, decayed to n0 - 1; §2.5): the chunks before a0 are
// empty (Z = 0, beta = 0) except that the pure-prefix node node_m[(a0 >> (m-1)) - 1] is H0[p + m]
// for every set bit m-1 of a0 (the bucket B_{p+m}(n0), §2.2); the up pass starts from these as its
// pending left children, so a node that straddles n0 is e^{beta of its new chunks} H0[..] + its new
// part, which is the re-key of §2.4 done by the tree.
// Forward: O_N = (Lam o Gamma_c o Q^K^T) V + sum_m diag(lam^{p+m} e^{b + gap_m}) Q^ node_m[j_m].
// Backward: dnode_m[j] = sum over the reading chunks N of Q^_N^T diag(lam^{p+m} e^{b + gap_m(N)}) dO_N
//   (one long-K GEMM per node), pushed down the tree (dnode_m[2j] += e^{beta_m[2j+1]} dnode_{m+1}[j],
//   dnode_m[2j+1] += dnode_{m+1}[j]); then dZ_N = dnode_1[N] plays the part of the GLA chunk-end
//   cotangent, and per chunk  dQ^ = dA K + sum_m diag(lam^{p+m} e^{b+gap}) dO node_m^T,
//   dlam[i, p+m] = e^{b_i+gap} q^_i.(dO node_m^T)_i, dlam[i, LUT] from the intra block, dc = q^.dq^ - k.dk
//   (the initial levels' reads enter q^.dq^ like any other), and
//   dH0[p+m] = dnode_m[(a0 >> (m-1)) - 1] after the push-down (the initial nodes, §2.4 re-key adjoint).
//   dg per chunk: the chunk's reverse cumsum of dc plus the sum over the pairs crossing its end: rho
//   (the chunk's own state write, TreeArgs::rho) plus, for the sources before the chunk, the levels'
//   reads (sum of lam dlam per chunk) and the push-down's node terms A (tree_sm80.cu, tree_dg_rows_kernel;
//   docs/math/LOGLINEAR.md §5.3). The backward builds the nodes after the push-down, so that the
//   build forms A from each fp32 node as it forms it (TreeArgs::pcot, apart).
//   A final-state cotangent dHT (final state as in loglinear_final_kernel) adds e^{gap_m + B_r} dHT[p+m] to
//   the pending node of level m before the push-down, and w_s dHT[l_s] v_s and w_s dHT[l_s]^T k_s to dk,
//   dv of the last partial chunk's rows (level l_s, w_s = e^{B_r - b_s}); dg reads it through these.
//   The parts of long reading ranges (loglinear_wkv_kernel kPart) need a0 = 0.
// All nodes, their cotangents and beta are fp32.
//
// Layout (SeqNodes): level m of a sequence holds the nodes j in [lo_m, hi_m), lo_m = max(0,
// (a0 >> (m-1)) - 1), hi_m = (a0 + Nc) >> (m-1) (Nc chunks, the last maybe partial), at slots
// base + off_m + j - lo_m of a [slots][H][dk][dv] buffer. With a0 = 0 for every sequence base =
// 2 chunk0 and the sequence takes [2 chunk0, 2 chunk0 + 2 Nc); otherwise base comes from a per-call
// table (TreeArgs::nbase) and a sequence takes at most 2 Nc + 2 bitlen(a0 + Nc) slots.
#pragma once
#include "cuda/prims/mma.cuh"
#include "cuda/prims/tile.cuh"

namespace hila::cuda {


__host__ __device__ __forceinline__ int bitlen64u(uint64_t x) {
#ifdef __CUDA_ARCH__
  return x ? 64 - __clzll(int64_t(x)) : 0;
#else
  return x ? 64 - __builtin_clzll(x) : 0;
#endif
}

__host__ __device__ __forceinline__ int ctz64u(uint64_t x) {  // x > 0
#ifdef __CUDA_ARCH__
  return __ffsll(int64_t(x)) - 1;
#else
  return __builtin_ctzll(x);
#endif
}

// Node layout of one sequence (above): chunks a0 .. a0 + nc - 1, slots from base.
struct SeqNodes {
  int64_t base = 0, a0 = 0, nc = 0;
  __host__ __device__ int64_t lo(int m) const {
    const int64_t x = (a0 >> (m - 1)) - 1;
    return x > 0 ? x : 0;
  }
  __host__ __device__ int64_t hi(int m) const { return (a0 + nc) >> (m - 1); }
  __host__ __device__ int64_t count(int m) const {
    const int64_t x = hi(m) - lo(m);
    return x > 0 ? x : 0;
  }
  __host__ __device__ int top() const { return bitlen64u(uint64_t(a0 + nc)); }  // levels 1..top may hold nodes
  __host__ __device__ int64_t off(int m) const {  // slots of levels 1 .. m-1
    int64_t o = 0;
    for (int x = 1; x < m; ++x) o += count(x);
    return o;
  }
  __host__ __device__ int64_t total() const { return off(top() + 1); }
  __host__ __device__ int64_t slot(int m, int64_t j) const { return base + off(m) + j - lo(m); }
};

// Tree operands of the chunk kernels (unused by plain GLA).
struct TreeArgs {
  const float* lam = nullptr;  // [H][Ttot][nL]
  float* dlam = nullptr;       // [H][Ttot][nL] (backward)
  int nL = 1;
  const void* node16 = nullptr;  // [slots][H][dk][dv] 16-bit GEMM-operand copies of the nodes
  int64_t slots = 0;             // node slots of node16 (and beta)
  const void* dz16 = nullptr;    // [nchunks][H][dk][dv] 16-bit dZ = dnode_1 after the push-down (backward)
  const float* beta = nullptr;   // [slots][H]
  // sequences from chunk-aligned n0 > 0: a0 = n0 / C and the node bases per
  // sequence (device, [N]); nullptr: a0 = 0 and base = 2 chunk0. h0: the initial Fenwick state
  // [N][H][Ls][dk][dv] fp32 (nullptr: none)
  const int64_t* a0 = nullptr;
  const int64_t* nbase = nullptr;
  const int* slot_seq = nullptr;  // [slots]: the sequence of each node slot (nullptr: chunk_seq[slot / 2])
  const float* h0 = nullptr;
  float* dh0 = nullptr;           // backward: the initial state's adjoint, same layout (nullptr: not wanted)
  int Ls = 0;  // Fenwick slots of h0, dh0 and dht (LoglinearArgs::Ls)
  // forward with a final state: the nodes pending after the full chunks of each sequence (the
  // set bits m-1 of a0 + len / C), fp32 [N][H][lpend][dk][dv] at level m, written by the tree build
  float* pend = nullptr;
  int lpend = 0;
  // backward with a final-state cotangent dht (Fenwick [N][H][Ls][dk][dv] fp32): the pending node
  // at level m gains fcoef[seq][h][m] dht[p + m] in the push-down ([N][H][lpend]); the last partial
  // chunk's rows gain fin_dk [N][H][C][dk], fin_dv [N][H][C][dv] in dk, dv (loglinear_final_bwd_kernel)
  const float* dht = nullptr;
  const float *fcoef = nullptr, *fin_dk = nullptr, *fin_dv = nullptr;
  // backward with gates: the chunk kernel writes rho[cg][h] = the pairs (i past the chunk, j in it)
  // of the chunk's dg term, sum_j k_j . dk_j over its state-write parts (w_j (V dZ^T)_j + fin_dk_j),
  // from the same products as its rows' dc (tree_dg_rows_kernel adds the rest of Y_c)
  float* rho = nullptr;
  // backward with gates: the builds (tree_close, loglinear_tree_kernel's up pass) write the node
  // terms A_m[j] = <pcot, node_m[j]> of every node they form, from the fp32 node: pcot [slots][H][dk][dv]
  // is the part of the node's cotangent from its ancestors and the final state (the push-down's D - R);
  // apart [slots][H][ceil(dk dv / 128)] takes one partial sum per warp of 128 elements (or of one
  // 64 x 64 state tile's 16 rows, at (tile index) * 4 + warp), zero elsewhere (tree_dg_rows_kernel sums them)
  const float* pcot = nullptr;
  float* apart = nullptr;
  // the build in the state sweep in segments of 2^seg chunks (seg > 0; every sequence from position
  // 0): one block per segment forms the levels 1 .. seg + 1 of its chunks and leaves the segment's
  // root, node (seg + 1, g), in fp32 in roots [(chunk0 >> seg) + seq + g][H][dk][dv] (the up pass
  // of loglinear/tree_sm80.cu forms the levels above from them)
  int seg = 0;
  float* roots = nullptr;
};

// The chunks a sweep block walks (gla/sweep_sm80.cu, sweep_sm90.cu): all of its sequence's (the
// tree: its full chunks), or with the tree in segments (ta.seg > 0) the full chunks of segment g,
// [cbeg, cbeg + nch); skip: a segment with none (the block has nothing to do).
struct SweepChunks {
  int64_t cbeg = 0, nfull = 0;  // nfull: the sequence's full chunks
  int nch = 0;
  bool skip = false;
};
template <bool kTree>
__device__ __forceinline__ SweepChunks sweep_chunks(const TreeArgs& ta, int64_t len, int C, unsigned g) {
  SweepChunks r;
  r.nfull = len / C;
  r.nch = int(kTree ? r.nfull : (len + C - 1) / C);
  if (kTree && ta.seg > 0) {
    r.cbeg = int64_t(g) << ta.seg;
    const int64_t cend = min(r.nfull, r.cbeg + (int64_t(1) << ta.seg));
    r.skip = cend <= r.cbeg;
    r.nch = r.skip ? 0 : int(cend - r.cbeg);
  }
  return r;
}

// The first root of sequence seq (chunks from chunk0) for head h in a [.][H][tile] table of segment
// roots of 2^s chunks (TreeArgs::roots): + g H tile for segment g. A sequence's segments start at
// (chunk0 >> s) + seq, so the table holds (nchunks >> s) + N + 1 rows.
__host__ __device__ __forceinline__ int64_t root_row(int64_t chunk0, int seq, int s, int h, int H, int64_t tile) {
  return (((chunk0 >> s) + seq) * H + h) * tile;
}

// The number of partial sums per node of TreeArgs::apart.
__host__ __device__ __forceinline__ int64_t apart_parts(int64_t tile) { return (tile + 127) / 128; }

__device__ __forceinline__ SeqNodes seq_nodes(const TreeArgs& ta, const int64_t* chunk0, int seq, int64_t nc) {
  SeqNodes sn;
  sn.a0 = ta.a0 ? ta.a0[seq] : 0;
  sn.base = ta.nbase ? ta.nbase[seq] : 2 * chunk0[seq];
  sn.nc = nc;
  return sn;
}

// Slot of the first (lowest) level read by chunk n > 0 (absolute): m = ctz(n) + 1, j = (n >> (m-1)) - 1.
__host__ __device__ __forceinline__ int64_t first_read_slot(const SeqNodes& sn, int64_t n) {
  int m = 1;
  while (!((n >> (m - 1)) & 1)) ++m;
  return sn.slot(m, (n >> (m - 1)) - 1);
}

// Calls `f(m, slot, gap)` for every level read by chunk n (absolute) of its sequence (ascending
// m), where slot is the node's global slot and gap the log-decay from the node's end to the chunk start.
template <class F>
__device__ __forceinline__ void for_each_read(const TreeArgs& ta, const SeqNodes& sn, int64_t n, int h, int H, F f) {
  float gap = 0.f;
  int64_t off = sn.base;
  for (int m = 1, top = bitlen64u(uint64_t(n)); m <= top; ++m) {
    if ((n >> (m - 1)) & 1) {
      const int64_t slot = off + (n >> (m - 1)) - 1 - sn.lo(m);
      f(m, slot, gap);
      gap += ta.beta[slot * H + h];
    }
    off += sn.count(m);
  }
}

// The 16-bit copy of node `slot` for head h: [dk][dv] in ta.node16 ([slots][H][dk][dv]).
template <class T>
__device__ __forceinline__ T* node16_at(const TreeArgs& ta, int64_t slot, int h, int H, int dk, int dv) {
  return static_cast<T*>(const_cast<void*>(ta.node16)) + (slot * H + h) * int64_t(dk) * dv;
}

// The tree build inside a state sweep (gla/sweep_sm80.cu's sweep_kernel<kTree>, gla/sweep_sm90.cu's
// sweep_sm90_kernel<kTree>): one block of kThreads per (sequence x head, 64 x 64 state tile) with the
// tile in registers, thread element (j, e) at state row k0 + 16w + g + 8(e >> 1) and column
// v0 + 8j + 2t + (e & 1) (w the warp, g = lane / 4, t = lane % 4; the mma.sync accumulator layout and
// the wgmma m64n64 one alike). `at(j, e)` is that element; j < nt of 8 column groups are valid and
// `active` says the thread's rows are. Each thread keeps its own elements of the pending left
// children in fp32 in `stack` (lstk levels per block, see TreeStack), so the build needs no barriers.
template <int kThreads>
struct TreeStack {
  float4* p;  // this block's [lstk][8][kThreads] float4
  __device__ explicit TreeStack(float* stack, int lstk)
      : p(reinterpret_cast<float4*>(stack) +
          ((int64_t(blockIdx.x) * gridDim.y + blockIdx.y) * gridDim.z + blockIdx.z) * lstk * 8 * kThreads) {}
  template <class At>
  __device__ __forceinline__ void put(int m, At&& at) const {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      p[(m * 8 + j) * kThreads + threadIdx.x] = make_float4(at(j, 0), at(j, 1), at(j, 2), at(j, 3));
  }
  // acc += f * level m
  template <class At>
  __device__ __forceinline__ void add(int m, float f, At&& at) const {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float4 x = p[(m * 8 + j) * kThreads + threadIdx.x];
      at(j, 0) += f * x.x, at(j, 1) += f * x.y, at(j, 2) += f * x.z, at(j, 3) += f * x.w;
    }
  }
};

// Before the first chunk: the initial state's levels p + m (set bits m-1 of a0) are the pending left
// children, read by chunk a0: onto the stack and into their node slots. r = k0 + 16w + g, c0 = v0 + 2t.
template <class T, int kThreads, class At>
__device__ __forceinline__ void tree_seed(const TreeArgs& ta, const SeqNodes& sn, const TreeStack<kThreads>& stk, int lstk,
                                          int seq, int h, int H, int dk, int dv, int r, int c0, bool active, int nt,
                                          At&& at) {
  for (int m = 1; m < lstk && (sn.a0 >> (m - 1)); ++m) {
    if (!((sn.a0 >> (m - 1)) & 1)) continue;
    const float* src = ta.h0 + ((int64_t(seq) * H + h) * ta.Ls + kLogChunk + m) * dk * dv;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        at(j, e) = (active && j < nt) ? src[int64_t(r + (e >> 1) * 8) * dv + c0 + 8 * j + (e & 1)] : 0.f;
    stk.put(m, at);
    if (active)
      mma::store_tile16(node16_at<T>(ta, sn.slot(m, (sn.a0 >> (m - 1)) - 1), h, H, dk, dv), dv, r, c0, nt, at);
  }
}

// After chunk c's Z_c is in the registers: while its node index (level m) is odd it closes its
// parent, acc <- e^{beta_m[i]} stk[m] + acc; the node it ends as (m, i even) goes onto the stack and
// into its slot (read by chunk (i + 1) 2^{m-1}). In segments (ta.seg > 0) the climb stops at the
// segment's root (seg + 1, i), which goes to `root` (this sequence's and head's first root,
// root_row) in fp32 instead of onto the stack; an odd root is read by no chunk (no 16-bit copy).
template <class T, int kThreads, class At>
__device__ __forceinline__ void tree_close(const TreeArgs& ta, const SeqNodes& sn, const TreeStack<kThreads>& stk,
                                           int64_t c, int h, int H, int dk, int dv, int r, int c0, bool active, int nt,
                                           At&& at, float* root = nullptr) {
  const int mcap = ta.seg > 0 ? ta.seg + 1 : kMaxLevels + 1;
  int m = 1;
  int64_t i = sn.a0 + c;
  while ((i & 1) && m < mcap) {
    stk.add(m, mma::fexp(ta.beta[sn.slot(m, i) * H + h]), at);
    i >>= 1, ++m;
  }
  if (m == mcap) {
    if (active) {
      float* dst = root + i * H * int64_t(dk) * dv;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < nt) {
          *reinterpret_cast<float2*>(dst + int64_t(r) * dv + c0 + 8 * j) = make_float2(at(j, 0), at(j, 1));
          *reinterpret_cast<float2*>(dst + int64_t(r + 8) * dv + c0 + 8 * j) = make_float2(at(j, 2), at(j, 3));
        }
    }
    if (i & 1) return;
  } else {
    stk.put(m, at);
  }
  if (active)
    mma::store_tile16(node16_at<T>(ta, sn.slot(m, i), h, H, dk, dv), dv, r, c0, nt, at);
  if (ta.apart && active) {  // A_m[i] = <pcot, node_m[i]> over this warp's 16 rows of the tile (fp32)
    const int64_t slot = sn.slot(m, i), tile = int64_t(dk) * dv;
    const float* pc = ta.pcot + (slot * H + h) * tile;
    float x = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) x += at(j, e) * pc[int64_t(r + 8 * (e >> 1)) * dv + c0 + 8 * j + (e & 1)];
    x = warp_sum(x);
    const int part = ((r >> 6) * ((dv + 63) / 64) + (c0 >> 6)) * 4 + ((r >> 4) & 3);
    if ((threadIdx.x & 31) == 0) ta.apart[(slot * H + h) * apart_parts(tile) + part] = x;
  }
}

// After the last full chunk (nch of them): the pending nodes, level m for each set bit m-1 of
// a0 + nch, into ta.pend (fp32, the final state's levels above the chunk).
template <int kThreads>
__device__ __forceinline__ void tree_pending(const TreeArgs& ta, const SeqNodes& sn, const TreeStack<kThreads>& stk,
                                             int lstk, int64_t nch, int seq, int h, int H, int dk, int dv, int r, int c0,
                                             int nt) {
  for (int m = 1; m < lstk; ++m) {
    if (!(((sn.a0 + nch) >> (m - 1)) & 1)) continue;
    float* dst = ta.pend + ((int64_t(seq) * H + h) * ta.lpend + m) * int64_t(dk) * dv;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nt) {
        const float4 x = stk.p[(m * 8 + j) * kThreads + threadIdx.x];
        *reinterpret_cast<float2*>(dst + int64_t(r) * dv + c0 + 8 * j) = make_float2(x.x, x.y);
        *reinterpret_cast<float2*>(dst + int64_t(r + 8) * dv + c0 + 8 * j) = make_float2(x.z, x.w);
      }
  }
}

// Columns [v0, v0+bv) of the 16-bit node copy in `slot` ([dk][dv] per (slot, head)) into smem
// [dk][ld] with cp.async (the caller commits and waits).
template <class T>
__device__ __forceinline__ void async_node(T* s, int ld, const TreeArgs& ta, int64_t slot, int h, int H, int dk, int dv,
                                           int v0, int bv) {
  mma::async_rows(s, ld, node16_at<T>(ta, slot, h, H, dk, dv), dv, 0, dk, v0, bv, dk);
}

}  // namespace hila::cuda
