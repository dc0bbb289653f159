// SPDX-License-Identifier: Apache-2.0
// Chunk-parallel tree form of log-linear Mamba-2 on tensor cores (loglinear/tree.cuh has the math
// and the node layout). The chunk kernels are the GLA core's (gla.cuh: gla_output, gla_bwd_chunk)
// with the tree operands; this file builds the tree: beta, Z and the node levels (forward), the node
// cotangents and their push-down (backward).
#include <algorithm>

#include <cub/block/block_scan.cuh>

#include "cuda/dispatch/heuristics.h"
#include "cuda/gla/gla.cuh"
#include "cuda/loglinear/tree.cuh"
#include "cuda/loglinear/loglinear.cuh"
#include "cuda/loglinear/wkv.cuh"
#include "cuda/prims/mma.cuh"
#include "cuda/runtime/config.h"
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

namespace {

constexpr int kTile = 64;           // dk and dv tile of the node GEMMs
constexpr int kLdTile = kTile + 8;  // padded smem row (16-bit elements)
constexpr int kStages = 3;          // cp.async pipeline depth over the chunks of a node's range
// beta of every node (loglinear/tree.cuh): one block per (sequence, head); level by level. The chunks
// before a0 (pure prefix, the initial state already decayed to n0 - 1) have beta = 0.
template <class T>
__global__ void __launch_bounds__(256) loglinear_beta_kernel(GlaArgs<T> a, TreeArgs ta, float* beta) {
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int64_t len = a.len[seq], nc = (len + kChunk - 1) / kChunk;
  const SeqNodes sn = seq_nodes(ta, a.chunk0, seq, nc);
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot + a.row0[seq] : nullptr;
  int64_t off = sn.base;
  for (int64_t j = sn.lo(1) + threadIdx.x; j < sn.hi(1); j += blockDim.x) {  // beta_1[j] = B_j (local cumsum at the last row)
    const int64_t c = j - sn.a0;
    beta[(off + j - sn.lo(1)) * a.H + h] = c >= 0 && b ? b[c * kChunk + rows_in(len, c) - 1] : 0.f;
  }
  for (int m = 1, top = sn.top(); m < top; ++m) {
    __syncthreads();
    const int64_t next = off + sn.count(m), lo = sn.lo(m);
    auto child = [&](int64_t i) { return i >= lo ? beta[(off + i - lo) * a.H + h] : 0.f; };  // below lo: pure prefix
    for (int64_t j = sn.lo(m + 1) + threadIdx.x; j < sn.hi(m + 1); j += blockDim.x)
      beta[(next + j - sn.lo(m + 1)) * a.H + h] = child(2 * j) + child(2 * j + 1);
    off = next;
  }
}

// The weighted chunk sums of loglinear/wkv.cuh on mma.sync; grid (items, H, dk tiles x dv tiles of
// 64), 4 warps, warp w rows [16w, 16w+16) of the dk tile; kZ also writes out16 (the 16-bit
// GEMM-operand copy of node level 1).
template <class T, WkvMode kMode>
__global__ void __launch_bounds__(128) loglinear_wkv_kernel(GlaArgs<T> a, TreeArgs ta, float* out, T* out16, int split) {
  constexpr bool kQdO = kMode != kZ;
  extern __shared__ __align__(128) char smem[];
  constexpr size_t kTileBytes = size_t(kChunk) * kLdTile * sizeof(T);
  constexpr size_t kStage = 2 * kTileBytes + kChunk * sizeof(float);
  auto Xs = [&](int st) { return reinterpret_cast<T*>(smem + st * kStage); };
  auto Ys = [&](int st) { return reinterpret_cast<T*>(smem + st * kStage + kTileBytes); };
  auto Ws = [&](int st) { return reinterpret_cast<float*>(smem + st * kStage + 2 * kTileBytes); };
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const int h = blockIdx.y, nvt = (a.dv + kTile - 1) / kTile;
  const int k0 = (blockIdx.z / nvt) * kTile, v0 = (blockIdx.z % nvt) * kTile;
  const int bk = min(kTile, a.dk - k0), bv = min(kTile, a.dv - v0), nt = bv / 8;
  const bool active = 16 * w < bk;
  const WkvItem it = wkv_item<kMode>(a, ta, blockIdx.x, split);
  if (it.skip) return;
  const int seq = it.seq, m = it.m;
  const int64_t c_begin = it.c_begin, c_end = it.c_end, slot = it.slot;
  const int64_t len = a.len[seq], row0 = a.row0[seq];
  const T* X = kQdO ? a.q + (h / a.q_div) * head_stride(a.q_hs, a.Ttot, a.dk)
                     : a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk);
  const T* Y = kQdO ? a.dO + h * head_stride(a.dO_hs, a.Ttot, a.dv) : a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, a.dv);
  const int64_t ldx = kQdO ? row_ld(a.q_ld, a.dk) : row_ld(a.k_ld, a.dk);
  const int64_t ldy = kQdO ? row_ld(a.dO_ld, a.dv) : row_ld(a.v_ld, a.dv);
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const float sc = float(a.scale);
  const int n = int(c_end > c_begin ? c_end - c_begin : 0);
  float gap = 0.f;  // kRead / kPart: log-decay from the node's end to the start of the chunk being issued
  // chunk i of the range -> stage i % kStages: X / Y tiles (rows >= nr zero-filled) and the weights
  auto issue = [&](int i) {
    const int st = i % kStages;
    const int64_t cn = c_begin + i, r0 = row0 + cn * kChunk;
    const int nr = rows_in(len, cn);
    mma::async_rows(Xs(st), kLdTile, X, ldx, r0, nr, k0, bk, kChunk);
    mma::async_rows(Ys(st), kLdTile, Y, ldy, r0, nr, v0, bv, kChunk);
    mma::cp_async_commit();
    const float B = b ? b[r0 + nr - 1] : 0.f;
    if (threadIdx.x < kChunk) {
      const int r = threadIdx.x;
      float x = 0.f;
      if (r < nr) {
        const float bi = b ? b[r0 + r] : 0.f;
        x = kQdO ? sc * ta.lam[(int64_t(h) * a.Ttot + r0 + r) * ta.nL + kLogChunk + m] * __expf(bi + gap) : __expf(B - bi);
      }
      Ws(st)[r] = x;
    }
    gap += B;
  };
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < n) issue(i);
    else mma::cp_async_commit();
  }
  float acc[8][4];
  mma::zero(acc);
  for (int i = 0; i < n; ++i) {
    // chunk i has landed; the barrier also retires iteration i-1's reads of the stage refilled next
    mma::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (i + kStages - 1 < n) issue(i + kStages - 1);
    else mma::cp_async_commit();
    const int st = i % kStages;
    const float* ws = Ws(st);
    if (active)  // [64 (dk), C] x [C, 64 (dv)]
      mma::warp_gemm_tn_weighted<T, 8>(acc, Xs(st), kLdTile, 16 * w, Ys(st), kLdTile, nt, kChunk,
                                      [&](int k) { return ws[k]; });
  }
  if (!active) return;
  const int64_t at = (slot * a.H + h) * int64_t(a.dk) * a.dv;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int64_t x = fr.at<int64_t>(at, k0 + 16 * w, hf, a.dv, v0, j);
        *reinterpret_cast<float2*>(out + x) = make_float2(acc[j][2 * hf], acc[j][2 * hf + 1]);
        if (kMode == kZ) *reinterpret_cast<uint32_t*>(out16 + x) = mma::pack2<T>(acc[j][2 * hf], acc[j][2 * hf + 1]);
      }
}

// The tree, elementwise in fp32, along the chunks of a sequence in order; grid (element blocks,
// N x H, segments), four elements per thread, the pending node of each level in `stk` (a binary
// counter, in shared memory).
//   up:   node_{m+1}[i] = e^{beta_m[2i+1]} node_m[2i] + node_m[2i+1] from level 1 (Z, fp32 in
//         `node`) over the full chunks; writes the 16-bit copies n16 of the nodes the chunks read
//         (levels >= 2, even i; level 1 comes from the Z kernel), with `pend` the nodes
//         pending at the end (TreeArgs::pend), and with ta.apart the node terms A of the even nodes
//         it forms (level 1 too: Z), from the fp32 node: per warp of 128 elements (TreeArgs::apart).
//   down: D_m[i] = R_m[i] + c D_{m+1}[i/2], c = e^{beta_m[i+1]} (i even) or 1 (i odd), with R the
//         read cotangents (fp32 in `node`, node slots; at levels m >= split the sum of the parts
//         in `parts` times e^{gap to the part}) and D = 0 past the end (no parent: c D = 0);
//         writes dZ = D_1 to n16 (16-bit, by global chunk). It is the push-down of §5.3.
//         With `pout` it also writes, for every even node (m, i) (the nodes chunks read), its
//         D_m[i] - R_m[i] to pout[slot] (the part of the node's cotangent from its ancestors'
//         readers and the final state; pout may be `node` itself: each element is read before it
//         is written, by the same thread); the builds dot it with the fp32 node for A_m[i]
//         (TreeArgs::pcot, apart). The initial state's nodes get their A here, from H0 (fp32), in
//         `apart` (per warp of 128 elements).
// In segments of S = 2^s chunks (TreePass; every sequence from position 0): the node (s + 1, g) is
// the root of chunks [g S, (g + 1) S), so the levels 1 .. s + 1 of a segment depend on its chunks
// only and the levels above on the roots only. Up: kLow, one block row per segment (grid z), forms
// the levels 1 .. s + 1 and leaves its complete root in fp32 in `root` (or the tree sweep does, in
// segments: TreeArgs::seg); kHigh then climbs from the roots as its leaves. Down: kHigh pushes down
// to the roots, D_{s+1}[g] into `root`; kLow per segment from there. Each node is formed by the same sums in the same order as in
// one pass (kWhole), so the results are the same bit for bit; the serial chain of a block is S + nc / S
// steps instead of nc.
enum TreePhase { kWhole, kLow, kHigh };
constexpr int kTreeThreads = 128;
struct TreePass {
  int s = 0;                // segments of 2^s chunks; 0 with kWhole
  TreePhase phase = kWhole;
  float* root = nullptr;    // per segment, fp32 [(chunk0 >> s) + seq + g][H][tile] (root_row): up, node (s + 1, g); down, D_{s+1}[g]
};

template <class T, bool kDown>
__global__ void __launch_bounds__(kTreeThreads) loglinear_tree_kernel(const int64_t* lens, const int64_t* chunk0, int H, int64_t tile,
                                                      TreeArgs ta, float* node, T* n16, const float* parts,
                                                      int split, float* pout, float* apart, TreePass tp) {
  const int seq = blockIdx.y / H, h = blockIdx.y % H;
  const int64_t nc = (lens[seq] + kChunk - 1) / kChunk;
  const SeqNodes sn = seq_nodes(ta, chunk0, seq, nc);
  const int64_t base = sn.base, a0 = sn.a0;
  const int top = sn.top();  // levels 1..top hold nodes
  // SeqNodes::off and lo of the block's sequence, in shared memory (per-thread arrays indexed by
  // level would live in local memory)
  __shared__ int64_t off[kMaxLevels + 1], lo[kMaxLevels + 1];
  if (threadIdx.x == 0) {
    off[1] = 0;
    for (int m = 1; m <= top; ++m) {
      lo[m] = sn.lo(m);
      if (m < top) off[m + 1] = off[m] + sn.count(m);
    }
  }
  __syncthreads();
  const int64_t e_raw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  // the warps of the node terms A stay whole (their shuffles): a lane past the tile works on its
  // warp's first elements and stores nothing
  const bool valid = e_raw < tile, whole = kDown ? apart != nullptr : ta.apart != nullptr;
  if (nc == 0 || (whole ? (e_raw & ~int64_t(127)) >= tile : !valid)) return;
  const int64_t e = valid ? e_raw : (e_raw & ~int64_t(127));
  // this block's leaves: chunks [jb, je) in steps of 2^(mlo-1) at level mlo; levels climb below mcap
  const int s = tp.s, mlo = tp.phase == kHigh ? s + 1 : 1, mcap = tp.phase == kLow ? s + 1 : kMaxLevels + 1;
  const int64_t g = blockIdx.z, step = int64_t(1) << (mlo - 1);
  if (tp.phase == kHigh && top <= s) return;  // one segment holds every level
  // the segment roots (s + 1, g) in fp32: + g H tile (TreePass::root)
  float* root = tp.root ? tp.root + root_row(chunk0[seq], seq, s, h, H, tile) + e : nullptr;
  auto idx = [&](int m, int64_t i) { return base + off[m] + i - lo[m]; };  // global slot of node (m, i)
  auto at = [&](const float* p, int64_t slot) { return reinterpret_cast<const float4*>(p + (slot * H + h) * tile + e); };
  auto load = [&](int64_t slot) { return *at(node, slot); };
  auto put = [&](int64_t slot, float4 x) {
    if (!valid) return;
    uint2 u;
    u.x = mma::pack2<T>(x.x, x.y), u.y = mma::pack2<T>(x.z, x.w);
    *reinterpret_cast<uint2*>(n16 + (slot * H + h) * tile + e) = u;
  };
  auto axpy = [](float4& y, float f, const float4& x) { y.x += f * x.x, y.y += f * x.y, y.z += f * x.z, y.w += f * x.w; };
  auto decay = [&](int m, int64_t i) { return __expf(ta.beta[idx(m, i) * H + h]); };
  // A = <x, y> of this warp's 128 elements into a[slot] (TreeArgs::apart)
  auto node_dot = [&](float* a, int64_t slot, const float4& x, const float4& y) {
    const float d = warp_sum(valid ? x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w : 0.f);
    if ((threadIdx.x & 31) == 0) a[(slot * H + h) * apart_parts(tile) + (e >> 7)] = d;
  };
  // the counter: this thread's pending node of level m at stk_s[(m - mlo) kTreeThreads + thread], in
  // dynamic shared memory (launch_tree sizes it per phase)
  extern __shared__ float4 stk_s[];
  auto stk = [&](int m) -> float4& { return stk_s[(m - mlo) * kTreeThreads + threadIdx.x]; };
  if constexpr (!kDown) {
    // the initial state's levels p + m (set bits m-1 of a0): pending left children, read by chunk a0
    for (int m = 1; m <= top && (a0 >> (m - 1)); ++m)
      if ((a0 >> (m - 1)) & 1) {
        stk(m) = *reinterpret_cast<const float4*>(ta.h0 + ((int64_t(seq) * H + h) * ta.Ls + kLogChunk + m) * tile + e);
        put(idx(m, (a0 >> (m - 1)) - 1), stk(m));
      }
    const int64_t nf = lens[seq] / kChunk;  // full chunks
    // kLow: segment g's full chunks; kHigh: the complete segments' roots
    const int64_t jb = tp.phase == kLow ? a0 + (g << s) : a0;
    const int64_t je = tp.phase == kLow ? min(a0 + nf, a0 + ((g + 1) << s)) : tp.phase == kHigh ? ((a0 + nf) >> s) << s : a0 + nf;
    if (jb >= je && tp.phase == kLow) return;
    for (int64_t j = jb; j < je; j += step) {
      int m = mlo;
      int64_t i = j >> (mlo - 1);
      // Z_j = node_1[j], or (kHigh) the segment root
      float4 cur = tp.phase == kHigh ? *reinterpret_cast<const float4*>(root + (j >> s) * H * tile) : load(idx(m, i));
      while ((i & 1) && m < mcap) {  // cur = node_m[i] closes its parent node_{m+1}[i >> 1] with the left child on stk
        axpy(cur, decay(m, i), stk(m));
        i >>= 1, ++m;
        if (!(i & 1)) put(idx(m, i), cur);
      }
      // A of the node formed, (m, i even); level 1 too (Z, its 16-bit copy from the Z kernel); a
      // kHigh leaf that climbs no level is a root kLow formed
      if (ta.apart && !(i & 1) && (m > mlo || mlo == 1))
        node_dot(ta.apart, idx(m, i), cur, *at(ta.pcot, idx(m, i)));
      if (m == mcap) {  // kLow: the segment's root, the leaf of kHigh
        if (valid) *reinterpret_cast<float4*>(root + (j >> s) * H * tile) = cur;
      } else {
        stk(m) = cur;  // a left child (i even), pending its sibling
      }
    }
    // the pending nodes of the levels this block holds (kLow: those of the segment where the full chunks end)
    if (ta.pend && (tp.phase != kLow || g == (nf >> s)))
      for (int m = mlo; m < ta.lpend && m < mcap; ++m)
        if (valid && (((a0 + nf) >> (m - 1)) & 1))
          *reinterpret_cast<float4*>(ta.pend + ((int64_t(seq) * H + h) * ta.lpend + m) * tile + e) = stk(m);
  } else {  // leaves a0 + j; parts (m >= split) only with a0 = 0
    // the final-state cotangent of the pending node (m, i): fcoef dHT[p + m] (TreeArgs::dht)
    const int64_t nend = a0 + lens[seq] / kChunk;
    auto add_final = [&](float4& d, int m, int64_t i) {
      if (ta.dht && m < ta.lpend && ((nend >> (m - 1)) & 1) && i == (nend >> (m - 1)) - 1)
        axpy(d, ta.fcoef[(int64_t(seq) * H + h) * ta.lpend + m],
             *reinterpret_cast<const float4*>(ta.dht + ((int64_t(seq) * H + h) * ta.Ls + kLogChunk + m) * tile + e));
    };
    // kLow: segment g's chunks below the levels s + 1 .. top, its root's D from kHigh; kHigh: one
    // leaf per segment, the levels top .. s + 1
    const int64_t jb = tp.phase == kLow ? g << s : 0, je = tp.phase == kLow ? min(nc, (g + 1) << s) : nc;
    if (jb >= je) return;
    if (tp.phase == kLow && top > s) stk(s + 1) = *reinterpret_cast<const float4*>(root + g * H * tile);
    const int mhi = tp.phase == kLow ? s : top;
    for (int64_t j = jb; j < je; j += step) {
      // the ancestors of leaf a0 + j that differ from those of the leaf before: levels mlo .. ctz(a0 + j) + 1
      const int mtop = min(mhi, j == jb ? top : min(top, ctz64u(uint64_t(a0 + j)) + 1));
      for (int m = mtop; m >= mlo; --m) {
        const int64_t i = (a0 + j) >> (m - 1);
        float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < sn.hi(m)) {  // a complete node (pending ones get no cotangent: no final-state cotangent)
          // D = R + (final-state part + c D_parent); the bracket first, for A
          add_final(d, m, i);
          if (m < top && (i >> 1) < sn.hi(m + 1)) {
            const float c = (i & 1) ? 1.f : decay(m, i + 1);
            axpy(d, c, stk(m + 1));
          }
          const float4 pc = d;
          if (m < split) {
            if (!(i & 1)) axpy(d, 1.f, load(idx(m, i)));  // odd nodes are never read: R = 0
          } else if (!(i & 1) && ((i + 1) << (m - 1)) < nc) {  // R from the parts of its reading range
            const int64_t nb = (nc + kSplit - 1) / kSplit, c1 = min((i + 2) << (m - 1), nc);
            float gap = 0.f;
            for (int64_t b = ((i + 1) << (m - 1)) / kSplit; b * kSplit < c1; ++b) {
              axpy(d, __expf(gap), *at(parts, chunk0[seq] + (m - split) * nb + b));
              if ((b + 1) * kSplit < c1) gap += ta.beta[idx(kSplitBetaLevel, b) * H + h];
            }
          }
          if (pout && !(i & 1) && valid) *reinterpret_cast<float4*>(pout + (idx(m, i) * H + h) * tile + e) = pc;
        }
        stk(m) = d;
      }
      if (tp.phase == kHigh) {  // the root's D for kLow
        if (valid) *reinterpret_cast<float4*>(root + (j >> s) * H * tile) = stk(s + 1);
        continue;
      }
      if (j == 0 && (ta.dh0 || apart))  // dH0[p + m] = D of the initial node left of the ancestor of a0 (bit m-1 of a0)
        for (int m = 1; m <= top && (a0 >> (m - 1)); ++m) {
          if (!((a0 >> (m - 1)) & 1)) continue;
          const int64_t i0 = (a0 >> (m - 1)) - 1;
          float4 d = make_float4(0.f, 0.f, 0.f, 0.f);  // dHT when no full chunk of the call reached it
          add_final(d, m, i0);
          if (m < top && (i0 >> 1) < sn.hi(m + 1)) axpy(d, decay(m, i0 + 1), stk(m + 1));
          const float* h0 = ta.h0 + ((int64_t(seq) * H + h) * ta.Ls + kLogChunk + m) * tile;
          if (apart) node_dot(apart, idx(m, i0), d, *reinterpret_cast<const float4*>(h0 + e));
          axpy(d, 1.f, load(idx(m, i0)));  // its reads (R)
          if (ta.dh0 && valid)
            *reinterpret_cast<float4*>(ta.dh0 + ((int64_t(seq) * H + h) * ta.Ls + kLogChunk + m) * tile + e) = d;
        }
      put(chunk0[seq] + j, stk(1));
    }
  }
}

template <class T>
size_t wkv_smem() {
  return kStages * (2 * size_t(kChunk) * kLdTile * sizeof(T) + kChunk * sizeof(float));
}

// The tree of a call: beta [slots][H] and the 16-bit node copies [slots][H][dk][dv] (tree.cuh:
// 2 nchunks slots when every sequence starts at position 0, else the SeqNodes totals with their
// bases in ta.nbase). Built by build_nodes. lstk: levels (plus one) of the deepest
// sequence, the depth of the up pass's stacks. seg: the up pass and the push-down in segments of
// 2^seg chunks (0: one pass; heuristics::loglinear_tree_segment), nseg segments in the longest sequence.
template <class T>
struct Tree {
  int64_t slots = 0;
  int lstk = 1;
  bool shifted = false;  // some sequence starts at n0 > 0
  int seg = 0;
  unsigned nseg = 1;
  DevBuf<int64_t> a0, nbase;
  DevBuf<int> slot_seq;
  DevBuf<float> beta;
  DevBuf<T> node16;
  TreeArgs ta;
  Tree(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t s) {
    std::vector<int64_t> va0, vbase;
    std::vector<int> vseq;
    int64_t max_nc = 0;
    for (size_t i = 0; i < t.n0.size(); ++i) {
      SeqNodes sn;
      sn.a0 = t.n0[i] / kChunk, sn.nc = (t.nend[i] - t.n0[i] + kChunk - 1) / kChunk, sn.base = slots;
      shifted = shifted || sn.a0 > 0;
      va0.push_back(sn.a0), vbase.push_back(sn.base);
      slots += sn.total();
      vseq.resize(size_t(slots), int(i));
      lstk = std::max(lstk, sn.top() + 1);
      max_nc = std::max(max_nc, sn.nc);
    }
    // one pass's threads: blocks of kTreeThreads, one thread per four state elements, per (sequence, head)
    const int64_t threads =
        (int64_t(a.p.dk) * a.p.dv / 4 + kTreeThreads - 1) / kTreeThreads * kTreeThreads * a.p.N * a.p.H;
    seg = heuristics::loglinear_tree_segment(shifted, max_nc, threads, sm_count(), config().loglinear_tree_segment);
    while (seg > 0 && ((max_nc - 1) >> seg) >= 65535) ++seg;  // grid z
    nseg = unsigned(seg > 0 ? std::max<int64_t>(1, ((max_nc - 1) >> seg) + 1) : 1);
    if (shifted) {
      a0 = SeqTables::upload(va0, s), nbase = SeqTables::upload(vbase, s), slot_seq = SeqTables::upload(vseq, s);
      ta.a0 = a0.get(), ta.nbase = nbase.get(), ta.slot_seq = slot_seq.get(), ta.h0 = a.p.h0;
    } else {
      slots = 2 * a.p.nchunks;  // base = 2 chunk0
    }
    beta = DevBuf<float>(size_t(slots * a.p.H), s);
    node16 = DevBuf<T>(size_t(slots * a.p.H * a.p.dk * a.p.dv), s);
    ta.lam = a.lam, ta.dlam = a.dlam, ta.nL = a.nL, ta.Ls = a.Ls, ta.node16 = node16.get(), ta.slots = slots, ta.beta = beta.get();
  }
};

// The final canonical state of a tree-form forward (§2.5, §3.4) at n = n0 + len = (a0 + nf) C + r,
// into ht [N][H][Ls][dk][dv] (every slot written); grid (N x H, 1, dk tiles x dv tiles of 64), 4 warps:
//   levels l <= p live in r:  K^T diag(e^{B_r - b} 1[bucket l of r]) V over the partial chunk's rows
//   levels p + m, bit m-1 of a0 + nf set:  e^{gap_m(a0 + nf) + B_r} X_m   (B_r: the partial chunk's
//     total), X_m = pend[m], or H0[p + m] when no full chunk of the call reached that node
//     ((a0 + nf) >> (m-1) == a0 >> (m-1): the re-key of the initial level is the identity)
//   all other slots zero.
template <class T>
__global__ void __launch_bounds__(128) loglinear_final_kernel(GlaArgs<T> a, TreeArgs ta, float* ht) {
  __shared__ __align__(128) T Ks[kChunk * kLdTile];
  __shared__ __align__(128) T Vs[kChunk * kLdTile];
  __shared__ float bs[kChunk];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const mma::Frag fr{g, t};  // this lane's rows and columns of the accumulator tiles
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H, nvt = (a.dv + kTile - 1) / kTile;
  const int k0 = (blockIdx.z / nvt) * kTile, v0 = (blockIdx.z % nvt) * kTile;
  const int bk = min(kTile, a.dk - k0), bv = min(kTile, a.dv - v0), nt = bv / 8;
  const bool active = 16 * w < bk;
  const int64_t len = a.len[seq], nf = len / kChunk, nc = (len + kChunk - 1) / kChunk, r0 = a.row0[seq] + nf * kChunk;
  const SeqNodes sn = seq_nodes(ta, a.chunk0, seq, nc);
  const int64_t n = sn.a0 + nf;  // absolute chunk of the end position
  const int r = int(len - nf * kChunk);
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  if (r > 0) {
    mma::async_rows(Ks, kLdTile, a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk), row_ld(a.k_ld, a.dk), r0, r, k0,
                   bk, kChunk);
    mma::async_rows(Vs, kLdTile, a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, a.dv), row_ld(a.v_ld, a.dv), r0, r, v0,
                   bv, kChunk);
  }
  mma::cp_async_commit();
  if (threadIdx.x < kChunk) bs[threadIdx.x] = (b && int(threadIdx.x) < r) ? b[r0 + threadIdx.x] : 0.f;
  mma::cp_async_wait<0>();
  __syncthreads();
  const float Br = r > 0 ? bs[r - 1] : 0.f;
  for (int l = 0; l < ta.Ls; ++l) {
    float acc[8][4];
    mma::zero(acc);
    if (l >= 1 && l <= kLogChunk && ((r >> (l - 1)) & 1)) {
      const int lo = (r >> l) << l, hi = lo + (1 << (l - 1));
      if (active)  // [64 (dk), C] x [C, 64 (dv)] over the bucket's rows
        mma::warp_gemm_tn_weighted<T, 8>(acc, Ks, kLdTile, 16 * w, Vs, kLdTile, nt, kChunk,
                                        [&](int k) { return k >= lo && k < hi ? __expf(Br - bs[k]) : 0.f; });
    } else if (l > kLogChunk && ((n >> (l - kLogChunk - 1)) & 1)) {
      const int m = l - kLogChunk;
      float gap = 0.f;  // nf = 0: every node below is an initial level (beta = 0)
      if (nf > 0)
        for_each_read(ta, sn, n, h, a.H, [&](int mm, int64_t, float gm) {
          if (mm == m) gap = gm;
        });
      const float f = __expf(gap + Br);
      const bool initial = (n >> (m - 1)) == (sn.a0 >> (m - 1));
      const float* src = initial ? ta.h0 + ((int64_t(seq) * a.H + h) * ta.Ls + l) * int64_t(a.dk) * a.dv
                                 : ta.pend + ((int64_t(seq) * a.H + h) * ta.lpend + m) * int64_t(a.dk) * a.dv;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (active && j < nt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const float2 x = *reinterpret_cast<const float2*>(fr.at<int64_t>(src, k0 + 16 * w, hf, a.dv, v0, j));
            acc[j][2 * hf] = f * x.x, acc[j][2 * hf + 1] = f * x.y;
          }
    }
    float* dst = ht + ((int64_t(seq) * a.H + h) * ta.Ls + l) * int64_t(a.dk) * a.dv;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (active && j < nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          *reinterpret_cast<float2*>(fr.at<int64_t>(dst, k0 + 16 * w, hf, a.dv, v0, j)) =
              make_float2(acc[j][2 * hf], acc[j][2 * hf + 1]);
  }
}

// The final-state cotangent dHT = ta.dht in a tree backward (loglinear/tree.cuh); grid N x H, 256 threads:
//   fcoef[m] = e^{gap_m(n) + B_r} for the pending node of each set bit m-1 of n = a0 + nf (the
//     push-down adds fcoef[m] dHT[p + m] to it; B_r: the partial chunk's total, 0 without one);
//   the partial chunk's rows s < r (level l = bitlen(r xor s), w = e^{B_r - b_s}), fp32:
//     fin_dk[s] = w dHT[l] v_s   [dk, dv] x [dv]      fin_dv[s] = w dHT[l]^T k_s   [dv, dk] x [dk]
//   an empty sequence: dH0 = dHT (its final state is its initial one) when dh0 is set.
template <class T>
__global__ void __launch_bounds__(256) loglinear_final_bwd_kernel(GlaArgs<T> a, TreeArgs ta, float* fcoef, float* fin_dk,
                                                           float* fin_dv, float* dh0) {
  __shared__ float bs[kChunk];
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int64_t len = a.len[seq], nf = len / kChunk, nc = (len + kChunk - 1) / kChunk;
  const int r = int(len - nf * kChunk);
  const int64_t tile = int64_t(a.dk) * a.dv, sh = int64_t(seq) * a.H + h;
  const float* dht = ta.dht + sh * ta.Ls * tile;
  if (len == 0) {
    if (dh0)
      for (int64_t e = threadIdx.x; e < ta.Ls * tile; e += blockDim.x) dh0[sh * ta.Ls * tile + e] = dht[e];
    return;
  }
  const SeqNodes sn = seq_nodes(ta, a.chunk0, seq, nc);
  const int64_t n = sn.a0 + nf, r0 = a.row0[seq] + nf * kChunk;
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  if (threadIdx.x < kChunk) bs[threadIdx.x] = b && int(threadIdx.x) < r ? b[r0 + threadIdx.x] : 0.f;
  __syncthreads();
  const float Br = r > 0 ? bs[r - 1] : 0.f;
  if (threadIdx.x == 0)
    for_each_read(ta, sn, n, h, a.H, [&](int m, int64_t, float gap) {
      if (m < ta.lpend) fcoef[sh * ta.lpend + m] = __expf(gap + Br);
    });
  const T* v = a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, a.dv);
  const T* k = a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk);
  const int64_t ldv = row_ld(a.v_ld, a.dv), ldk = row_ld(a.k_ld, a.dk);
  for (int64_t e = threadIdx.x; e < int64_t(r) * a.dk; e += blockDim.x) {  // fin_dk
    const int i = int(e / a.dk), c = int(e % a.dk), l = 32 - __clz(r ^ i);
    const float* M = dht + int64_t(l) * tile + int64_t(c) * a.dv;
    const T* vr = v + (r0 + i) * ldv;
    float x = 0.f;
    for (int j = 0; j < a.dv; ++j) x += M[j] * float(vr[j]);
    fin_dk[(sh * kChunk + i) * a.dk + c] = __expf(Br - bs[i]) * x;
  }
  for (int64_t e = threadIdx.x; e < int64_t(r) * a.dv; e += blockDim.x) {  // fin_dv
    const int i = int(e / a.dv), c = int(e % a.dv), l = 32 - __clz(r ^ i);
    const float* M = dht + int64_t(l) * tile + c;
    const T* kr = k + (r0 + i) * ldk;
    float x = 0.f;
    for (int j = 0; j < a.dk; ++j) x += M[int64_t(j) * a.dv] * float(kr[j]);
    fin_dv[(sh * kChunk + i) * a.dv + c] = __expf(Br - bs[i]) * x;
  }
}

template <class T, WkvMode kMode>
void launch_wkv(const GlaArgs<T>& p, const TreeArgs& ta, float* out, T* out16, int split, cudaStream_t s,
                int64_t slots = 0) {
  const unsigned items = unsigned(kMode == kRead ? slots : p.nchunks);
  if constexpr (kMode != kZ)
    if (heuristics::loglinear_wkv_sm90(p.dk, p.dv, p.Ttot, config().gla_sm90) &&
        loglinear_wkv_sm90(p, ta, kMode, out, split, items, s))
      return;
  const dim3 grid(items, p.H, unsigned(((p.dk + kTile - 1) / kTile) * ((p.dv + kTile - 1) / kTile)));
  set_smem(loglinear_wkv_kernel<T, kMode>, wkv_smem<T>());
  if (dry_run()) return;  // dry run: workspace_size
  loglinear_wkv_kernel<T, kMode><<<grid, 128, wkv_smem<T>(), s>>>(p, ta, out, out16, split);
  HILA_CUDA_CHECK_LAUNCH();
}

// Rows of the segment roots of a call (TreePass::root, TreeArgs::roots, root_row).
template <class T>
size_t root_rows(const GlaArgs<T>& p, int seg) {
  return size_t((p.nchunks >> seg) + p.N + 1);
}

// The up pass (kDown false) or the push-down over the tree of a call: in one pass, or in segments of
// 2^tr.seg chunks (TreePass; tr.nseg of them in the longest sequence): up kLow then kHigh, down
// kHigh (the roots' D into a temporary) then kLow. `roots`: up, the segments' levels are built (the
// tree sweep in segments) and their roots are there: kHigh only.
template <class T, bool kDown>
void launch_tree(const GlaArgs<T>& p, const Tree<T>& tr, float* node, T* n16, cudaStream_t s,
                 const float* parts = nullptr, int split = kMaxLevels, float* pout = nullptr, float* apart = nullptr,
                 float* roots = nullptr) {
  const int64_t tile = int64_t(p.dk) * p.dv;
  const dim3 grid(unsigned((tile / 4 + kTreeThreads - 1) / kTreeThreads), unsigned(p.N * p.H));
  DevBuf<float> own(tr.seg && !roots ? root_rows(p, tr.seg) * p.H * tile : 0, s);
  float* root = roots ? roots : own.get();
  // the counter's levels: kLow 1 .. s + 1, kHigh s + 1 .. top, kWhole 1 .. top (top < lstk)
  const auto smem = [&](TreePhase ph) {
    const int levels = ph == kLow ? tr.seg + 1 : ph == kHigh ? tr.lstk - tr.seg - 1 : tr.lstk;
    return size_t(std::max(levels, 1)) * kTreeThreads * sizeof(float4);
  };
  set_smem(loglinear_tree_kernel<T, kDown>, smem(kWhole) > smem(kLow) ? smem(kWhole) : smem(kLow), true);
  if (dry_run()) return;  // dry run: workspace_size
  auto pass = [&](TreePhase ph, unsigned z) {
    loglinear_tree_kernel<T, kDown><<<dim3(grid.x, grid.y, z), kTreeThreads, smem(ph), s>>>(
        p.len, p.chunk0, p.H, tile, tr.ta, node, n16, parts, split, pout, apart, TreePass{tr.seg, ph, root});
    HILA_CUDA_CHECK_LAUNCH();
  };
  if (!tr.seg) pass(kWhole, 1);
  else if (kDown) pass(kHigh, 1), pass(kLow, tr.nseg);
  else if (roots) pass(kHigh, 1);
  else pass(kLow, tr.nseg), pass(kHigh, 1);
}

// The gate gradient of the tree form per chunk (docs/math/LOGLINEAR.md §5.3): for row t of chunk c
// (absolute n = a0 + c),  dg_t = sum_{t <= i in chunk} dc_i + Y_c,  with Y_c the sum of dP_ij P_ij over
// the pairs i >= (n+1) C > j (the final state counting as a reader after the last row), split by the
// source j:
//   Y_c = rho_c + X(n):  rho_c the sources in chunk c (the chunk kernel: sum_j k_j . dk_j over the
//   state-write parts of dk_j, from the same 16-bit dZ as the rows' k . dk, so that its large parts
//   cancel exactly, as in GLA), X(n) the sources before boundary n read past chunk c:
//   X(n) = sum_{m: bit m-1 of n} ( sum_{r in [n + 1, e_m(n))} sigma_m(r)  +  A_m[(n >> (m-1)) - 1] ),
// with D_m(n) = node_m[(n >> (m-1)) - 1] the nodes of the set bits m-1 of n, each read at level p + m
// by the chunks [n, e_m(n)), e_m(n) = ((n >> (m-1)) + 1) << (m-1), and by its ancestors' readers and
// the final state:
//   sigma_m(r) = sum_{i in chunk r} lam[i, p+m] dlam[i, p+m]   (one level's read by chunk r, dotted with dO),
// A from the builds (TreeArgs::apart: the push-down's D - R dotted with the fp32 node, so that A
// carries no rounding of a 16-bit node copy). Every term is one read of one node, so no
// rounding is carried along the sequence.

// sig[cg][h][m] = sigma_m(chunk cg) for m = 1 .. lstk - 1 (levels past nL - p - 1: 0); grid (nchunks, H),
// kChunk threads (one row each).
template <class T>
__global__ void __launch_bounds__(kChunk) tree_sigma_kernel(GlaArgs<T> a, TreeArgs ta, int lstk, float* sig) {
  __shared__ float red[kChunk / 32][kMaxLevels + 1];
  const int64_t cg = blockIdx.x;
  const int h = blockIdx.y, seq = a.chunk_seq[cg];
  const int64_t c = cg - a.chunk0[seq];
  const int nr = rows_in(a.len[seq], c), i = threadIdx.x, lane = i & 31, w = i >> 5;
  const int64_t row = (int64_t(h) * a.Ttot + a.row0[seq] + c * kChunk + i) * ta.nL;
  for (int m = 1; m < lstk; ++m) {
    const int l = kLogChunk + m;
    const float x = warp_sum((i < nr && l < ta.nL) ? ta.lam[row + l] * ta.dlam[row + l] : 0.f);
    if (lane == 0) red[w][m] = x;
  }
  __syncthreads();
  for (int m = 1 + i; m < lstk; m += kChunk) {
    float x = 0.f;
#pragma unroll
    for (int k = 0; k < kChunk / 32; ++k) x += red[k][m];
    sig[(cg * a.H + h) * lstk + m] = x;
  }
}

// P[cg][h][m] = sum_{r' >= r} sigma_m(r') over the sequence's chunks (fp64, so that a range
// P_m(n + 1) - P_m(end) keeps the precision of its own terms however long the sequence); one block
// per (sequence, head), the levels in turn.
template <class T>
__global__ void __launch_bounds__(256) tree_dg_scan_kernel(GlaArgs<T> a, TreeArgs ta, int lstk, const float* sig, double* P) {
  using Scan = cub::BlockScan<double, 256>;
  __shared__ typename Scan::TempStorage tmp;
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int64_t nc = chunks_of(a.len, seq), c0 = a.chunk0[seq];
  if (nc == 0) return;
  const int top = seq_nodes(ta, a.chunk0, seq, nc).top();
  for (int m = 1; m <= top && m < lstk; ++m) {
    double carry = 0.0;
    for (int64_t base = nc; base > 0; base -= 256) {  // tiles from the end, reversed
      const int64_t c = base - 1 - threadIdx.x, x = ((c0 + c) * a.H + h) * lstk + m;
      double incl, total;
      Scan(tmp).InclusiveSum(c >= 0 ? double(sig[x]) : 0.0, incl, total);
      if (c >= 0) P[x] = incl + carry;
      carry += total;
      __syncthreads();
    }
  }
}

// dg rows: dg_t = (suffix sum of dc over the chunk's rows from t) + Y_c, Y_c = rho_c (in Y) + X(n)
// (above, from P and the node terms' warp parts in apart); grid (nchunks, H), one warp: lane 0
// takes the sigma ranges, the lanes share the node terms' parts.
template <class T>
__global__ void __launch_bounds__(32) tree_dg_rows_kernel(GlaArgs<T> a, TreeArgs ta, int lstk, const double* P,
                                                          const float* apart, int64_t tile, const float* Y) {
  using R = Acc<T>;
  const int64_t cg = blockIdx.x;
  const int h = blockIdx.y, seq = a.chunk_seq[cg], lane = threadIdx.x;
  const int64_t nc = chunks_of(a.len, seq), c0 = a.chunk0[seq], c = cg - c0, r0 = a.row0[seq] + c * kChunk;
  const SeqNodes sn = seq_nodes(ta, a.chunk0, seq, nc);
  const int top = sn.top(), nw = int(apart_parts(tile));
  const int64_t n = sn.a0 + c;  // the boundary before chunk c (absolute)
  float x = 0.f;
  for (int m = 1; m <= top && m < lstk; ++m) {
    if (!((n >> (m - 1)) & 1)) continue;
    const int64_t j = (n >> (m - 1)) - 1, end = ((j + 2) << (m - 1)) - sn.a0;  // relative end of the readers
    if (lane == 0 && c + 1 < nc)  // the reads by chunks c + 1 .. end - 1
      x += float(P[((c0 + c + 1) * a.H + h) * lstk + m] - (end < nc ? P[((c0 + end) * a.H + h) * lstk + m] : 0.0));
    const float* ap = apart + (sn.slot(m, j) * a.H + h) * nw;
    for (int k = lane; k < nw; k += 32) x += ap[k];
  }
  x = warp_sum(x);
  const int nr = rows_in(a.len[seq], c), i0 = 2 * lane, i1 = i0 + 1;
  R* dg = a.dg + int64_t(h) * a.Ttot + r0;
  chunk_dg(dg, i0 < nr ? dg[i0] : R(0), i1 < nr ? dg[i1] : R(0), R(Y[cg * a.H + h] + x), nr);
}

// beta of every node.
template <class T>
void build_beta(const GlaArgs<T>& p, Tree<T>& tr, cudaStream_t s) {
  if (dry_run()) return;  // dry run: workspace_size
  loglinear_beta_kernel<T><<<unsigned(p.N * p.H), 256, 0, s>>>(p, tr.ta, tr.beta.get());
  HILA_CUDA_CHECK_LAUNCH();
}

// Z into node level 1 and the upper node levels, after build_beta (and tr.ta.pend when set, lstk
// levels; with tr.ta.apart the node terms A): heuristics::loglinear_tree_build picks the tree sweep
// (whole sequences, or segments of 2^tr.seg chunks and the up pass above them from their roots) or
// the chunk-parallel build (Z per chunk, then the up pass).
template <class T>
void build_nodes(const GlaArgs<T>& p, Tree<T>& tr, int lstk, cudaStream_t s) {
  using heuristics::TreeBuild;
  const int64_t tile = int64_t(p.dk) * p.dv;
  switch (heuristics::loglinear_tree_build(gla_sweep_blocks(p), sm_count(), tr.seg, config().loglinear_tree_sweep)) {
    case TreeBuild::sweep: {
      DevBuf<float> stack(gla_tree_sweep_stack(p, lstk, 1), s);
      gla_tree_sweep(p, tr.ta, stack.get(), lstk, 1, s);
      break;
    }
    case TreeBuild::sweep_segments: {
      const int lseg = std::min(tr.seg + 1, lstk);  // the stack's levels: below the root, within the tree
      DevBuf<float> stack(gla_tree_sweep_stack(p, lseg, tr.nseg), s), roots(root_rows(p, tr.seg) * p.H * tile, s);
      TreeArgs ta = tr.ta;
      ta.seg = tr.seg, ta.roots = roots.get();
      gla_tree_sweep(p, ta, stack.get(), lseg, tr.nseg, s);
      launch_tree<T, false>(p, tr, nullptr, tr.node16.get(), s, nullptr, kMaxLevels, nullptr, nullptr, roots.get());
      break;
    }
    case TreeBuild::chunks: {
      DevBuf<float> z(size_t(tr.slots * p.H * tile), s);
      launch_wkv<T, kZ>(p, tr.ta, z.get(), tr.node16.get(), kMaxLevels, s);
      launch_tree<T, false>(p, tr, z.get(), tr.node16.get(), s);
      break;
    }
  }
}

}  // namespace

template <class T>
bool loglinear_tree_usable(int dk, int dv) {
  if constexpr (!kTensorCore<T>) {
    return false;
  } else {
    if (!heuristics::loglinear_tree(true, dk, dv, config().loglinear_tree)) return false;
    const size_t optin = smem_optin();
    return std::max({gla_bwd_chunk_smem(dk, dv, true), gla_output_smem(dk, dv, sizeof(T)), wkv_smem<T>()}) <= optin;
  }
}

template <class T>
void loglinear_tree_forward(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t s) {
  if constexpr (kTensorCore<T>) {
    if ((!a.p.o && !a.want_final) || a.p.N == 0 || a.p.H == 0) return;
    Tree<T> tr(a, t, s);
    const int lstk = tr.lstk;
    DevBuf<float> pend(a.want_final ? size_t(int64_t(a.p.N) * a.p.H * lstk * a.p.dk * a.p.dv) : 0, s);
    tr.ta.pend = pend.get(), tr.ta.lpend = a.want_final ? lstk : 0;
    if (a.p.nchunks > 0) build_beta(a.p, tr, s), build_nodes(a.p, tr, lstk, s);
    if (a.p.o && a.p.nchunks > 0) gla_output(a.p, s, &tr.ta);
    if (a.want_final && !dry_run()) {  // dry run: workspace_size
      loglinear_final_kernel<T><<<dim3(unsigned(a.p.N * a.p.H), 1, unsigned(((a.p.dk + kTile - 1) / kTile) * ((a.p.dv + kTile - 1) / kTile))),
                           128, 0, s>>>(a.p, tr.ta, a.p.ht);
      HILA_CUDA_CHECK_LAUNCH();
    }
  }
}

template <class T>
void loglinear_tree_backward(const LoglinearArgs<T>& a, const LoglinearTables& t, cudaStream_t s) {
  if constexpr (kTensorCore<T>) {
    if (a.p.N == 0 || a.p.H == 0) return;
    const int64_t tile = int64_t(a.p.dk) * a.p.dv, NH = int64_t(a.p.N) * a.p.H;
    if (!dry_run()) {  // dry run: workspace_size
      HILA_CUDA_CHECK(cudaMemsetAsync(a.dlam, 0, size_t(a.p.H) * a.p.Ttot * a.nL * sizeof(float), s));
      // dH0: the initial levels' cotangents from the push-down (dHT for empty sequences), zero elsewhere
      if (a.p.dh0) HILA_CUDA_CHECK(cudaMemsetAsync(a.p.dh0, 0, size_t(NH * a.Ls * tile) * sizeof(float), s));
    }
    Tree<T> tr(a, t, s);
    tr.ta.dh0 = a.p.dh0;
    // a final-state cotangent: the pending nodes' coefficients and loglinear_final_bwd_kernel's terms
    const bool fin = a.p.dht != nullptr;
    DevBuf<float> fcoef(fin ? size_t(NH * tr.lstk) : 0, s);
    DevBuf<float> fin_dk(fin ? size_t(NH * kChunk * a.p.dk) : 0, s), fin_dv(fin ? size_t(NH * kChunk * a.p.dv) : 0, s);
    if (fin) {
      tr.ta.lpend = tr.lstk;
      tr.ta.dht = a.p.dht, tr.ta.fcoef = fcoef.get();
      tr.ta.fin_dk = fin_dk.get(), tr.ta.fin_dv = fin_dv.get();
    }
    // the nodes are built after the push-down, so that the build forms the node terms A of dg from
    // the fp32 nodes (TreeArgs::pcot, apart); beta first (the reads' gaps, fcoef)
    if (a.p.nchunks > 0) build_beta(a.p, tr, s);
    if (fin && !dry_run()) {  // dry run: workspace_size
      loglinear_final_bwd_kernel<T><<<unsigned(NH), 256, 0, s>>>(a.p, tr.ta, fcoef.get(), fin_dk.get(), fin_dv.get(), a.p.dh0);
      HILA_CUDA_CHECK_LAUNCH();
    }
    if (a.p.nchunks == 0) return;
    DevBuf<float> dnode(size_t(tr.slots * a.p.H * tile), s);
    DevBuf<T> dz16(size_t(a.p.nchunks * a.p.H * tile), s);
    // parts of the long reading ranges: (top - 5) ceil(nc / 16) <= nc slots per sequence while every
    // sequence starts at 0 and has at most 2^20 chunks; otherwise the ranges are summed whole (from
    // n0 > 0 a range within the call has at most nc chunks, the length of the tree sweep)
    const int split = heuristics::loglinear_tree_parts(tr.shifted, a.p.Ttot, a.p.N, kChunk) ? kSplitLevel : kMaxLevels;
    DevBuf<float> parts(split < kMaxLevels ? size_t(a.p.nchunks * a.p.H * tile) : 0, s);
    launch_wkv<T, kRead>(a.p, tr.ta, dnode.get(), nullptr, split, s, tr.slots);
    if (split < kMaxLevels) launch_wkv<T, kPart>(a.p, tr.ta, parts.get(), nullptr, split, s);
    // dg per chunk (tree_dg_rows_kernel): the node terms A, [slots][H][apart_parts(tile)], zero where no
    // node is formed; the push-down leaves D - R of the even nodes in dnode (in place of R)
    const bool gates = a.p.dg != nullptr;
    DevBuf<float> apart(gates ? size_t(tr.slots * a.p.H * apart_parts(tile)) : 0, s, true);
    launch_tree<T, true>(a.p, tr, dnode.get(), dz16.get(), s, parts.get(), split, gates ? dnode.get() : nullptr,
                         apart.get());
    tr.ta.pcot = gates ? dnode.get() : nullptr, tr.ta.apart = apart.get();
    build_nodes(a.p, tr, tr.lstk, s);
    tr.ta.pcot = nullptr, tr.ta.apart = nullptr;
    tr.ta.dz16 = dz16.get();
    DevBuf<float> Y(gates ? size_t(a.p.nchunks * a.p.H) : 0, s);  // Y_c per chunk: rho_c (tree_dg_rows_kernel adds X(n))
    tr.ta.rho = Y.get();
    gla_bwd_chunk(a.p, s, &tr.ta);  // dq, dk, dv, dlam, the rows' dc in dg and rho in Y
    const size_t nsig = gates ? size_t(a.p.nchunks * a.p.H * tr.lstk) : 0;
    DevBuf<float> sig(nsig, s);
    DevBuf<double> P(nsig, s);
    if (gates && !dry_run()) {  // dry run: workspace_size
      tree_sigma_kernel<T><<<dim3(unsigned(a.p.nchunks), a.p.H), kChunk, 0, s>>>(a.p, tr.ta, tr.lstk, sig.get());
      HILA_CUDA_CHECK_LAUNCH();
      tree_dg_scan_kernel<T><<<unsigned(NH), 256, 0, s>>>(a.p, tr.ta, tr.lstk, sig.get(), P.get());
      HILA_CUDA_CHECK_LAUNCH();
      tree_dg_rows_kernel<T><<<dim3(unsigned(a.p.nchunks), a.p.H), 32, 0, s>>>(a.p, tr.ta, tr.lstk, P.get(), apart.get(),
                                                                                tile, Y.get());
      HILA_CUDA_CHECK_LAUNCH();
    }
  }
}

#define HILA_INSTANTIATE(T)                                                          \
  template bool loglinear_tree_usable<T>(int, int);                                         \
  template void loglinear_tree_forward<T>(const LoglinearArgs<T>&, const LoglinearTables&, cudaStream_t);  \
  template void loglinear_tree_backward<T>(const LoglinearArgs<T>&, const LoglinearTables&, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
