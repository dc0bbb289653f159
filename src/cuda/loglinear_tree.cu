// SPDX-License-Identifier: Apache-2.0
// Chunk-parallel tree form of log-linear Mamba-2 on tensor cores (ll_tree.cuh has the math and
// the node layout). The chunk kernels are the GLA core's (gla_tc.cu) with the tree operands; this
// file builds the tree: beta, Z and the node levels (forward), the node cotangents and their
// push-down (backward).
#include <cstdlib>
#include <cstring>

#include "cuda/gla.cuh"
#include "cuda/ll_tree.cuh"
#include "cuda/loglinear.cuh"
#include "cuda/mma.cuh"
#include "cuda/runtime.cuh"

namespace hila::cuda {

namespace {

constexpr int kTile = 64;           // dk and dv tile of the node GEMMs
constexpr int kLdTile = kTile + 8;  // padded smem row (16-bit elements)
constexpr int kStages = 3;          // cp.async pipeline depth over the chunks of a node's range
// Long reading ranges are summed in parts: levels m >= kSplitLevel (ranges of 2^{m-1} > kSplit
// chunks) take one part per aligned block of kSplit chunks, combined in the push-down.
constexpr int kSplit = 16, kSplitLevel = 6, kSplitBetaLevel = 5;  // node level kSplitBetaLevel spans kSplit chunks
static_assert((1 << (kSplitBetaLevel - 1)) == kSplit && kSplitLevel == kSplitBetaLevel + 1, "split levels");
enum WkvMode { kZ, kRead, kPart };

__device__ __forceinline__ int64_t chunks_of(const int64_t* len, int seq) {
  return (len[seq] + kChunk - 1) / kChunk;
}

// beta of every node (ll_tree.cuh): one block per (sequence, head); level by level.
template <class T>
__global__ void __launch_bounds__(256) ll_beta_kernel(GlaArgs<T> a, float* beta) {
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int64_t len = a.len[seq], nc = (len + kChunk - 1) / kChunk, base = 2 * a.chunk0[seq];
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot + a.row0[seq] : nullptr;
  for (int64_t j = threadIdx.x; j < nc; j += blockDim.x)  // beta_1[j] = B_j (chunk-local cumsum at its last row)
    beta[(base + j) * a.H + h] = b ? b[j * kChunk + rows_in(len, j) - 1] : 0.f;
  int64_t off = 0;
  for (int m = 1; (nc >> m) > 0; ++m) {
    __syncthreads();
    const int64_t next = off + (nc >> (m - 1));
    for (int64_t j = threadIdx.x; j < (nc >> m); j += blockDim.x)
      beta[(base + next + j) * a.H + h] = beta[(base + off + 2 * j) * a.H + h] + beta[(base + off + 2 * j + 1) * a.H + h];
    off = next;
  }
}

// out[slot] = sum over chunks N of a range of Xt_N^T diag(w_N) Y_N, fp32 [dk][dv] per (slot, head);
// grid (items, H, dk tiles x dv tiles of 64), 4 warps, warp w rows [16w, 16w+16) of the dk tile.
//   kZ (one chunk per item):  X = K, Y = V, w = e^{B-b}, slot = node_1 of the chunk; also to out16
//     (the 16-bit GEMM-operand copy of node level 1).
//   kRead (the read cotangent R of node (m, j) < split levels, one node slot per item):  X = Q, Y = dO
//     over the chunks that read the node (j even: [(j+1) 2^{m-1}, (j+2) 2^{m-1}); j odd: none, R = 0
//     and the slot is left unwritten),
//     w = scale lam^{p+m} e^{b + gap}, gap the sum of the totals of the range's earlier chunks.
//   kPart (levels m >= split): the same over block b of kSplit chunks of a reading range, into
//     slot chunk0 + (m - split) nb + b (nb = ceil(nc / kSplit) blocks per level), gap from the
//     block start.
template <class T, WkvMode kMode>
__global__ void __launch_bounds__(128) ll_wkv_kernel(GlaArgs<T> a, TreeArgs ta, float* out, T* out16, int split) {
  constexpr bool kQdO = kMode != kZ;
  extern __shared__ __align__(128) char smem[];
  constexpr size_t kTileBytes = size_t(kChunk) * kLdTile * sizeof(T);
  constexpr size_t kStage = 2 * kTileBytes + kChunk * sizeof(float);
  auto Xs = [&](int st) { return reinterpret_cast<T*>(smem + st * kStage); };
  auto Ys = [&](int st) { return reinterpret_cast<T*>(smem + st * kStage + kTileBytes); };
  auto Ws = [&](int st) { return reinterpret_cast<float*>(smem + st * kStage + 2 * kTileBytes); };
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int h = blockIdx.y, nvt = (a.dv + kTile - 1) / kTile;
  const int k0 = (blockIdx.z / nvt) * kTile, v0 = (blockIdx.z % nvt) * kTile;
  const int bk = min(kTile, a.dk - k0), bv = min(kTile, a.dv - v0), nt = bv / 8;
  const bool active = 16 * w < bk;
  int seq, m = 1;
  int64_t c_begin, c_end, slot;
  if constexpr (kMode == kRead) {
    slot = blockIdx.x;
    seq = a.chunk_seq[slot >> 1];
    const int64_t nc = chunks_of(a.len, seq);
    int64_t u = slot - 2 * a.chunk0[seq];
    for (;; ++m) {  // node (m, u) of the sequence
      const int64_t cnt = nc >> (m - 1);
      if (cnt == 0 || m >= split) return;  // a spare slot, or a level summed in parts
      if (u < cnt) break;
      u -= cnt;
    }
    if (u & 1) return;  // read by the chunks N with N >> (m-1) = u + 1 and bit m-1 set: none (R = 0)
    c_begin = (u + 1) << (m - 1);
    c_end = min((u + 2) << (m - 1), nc);
  } else if constexpr (kMode == kPart) {
    slot = blockIdx.x;
    seq = a.chunk_seq[slot];
    const int64_t nc = chunks_of(a.len, seq), nb = (nc + kSplit - 1) / kSplit, u = slot - a.chunk0[seq];
    m = split + int(u / nb);
    c_begin = (u % nb) * kSplit;
    if (m > bitlen64u(uint64_t(nc)) || !((c_begin >> (m - 1)) & 1)) return;  // no such level / not read
    c_end = min(c_begin + kSplit, nc);
  } else {
    const int64_t cg = blockIdx.x;
    seq = a.chunk_seq[cg];
    c_begin = cg - a.chunk0[seq], c_end = c_begin + 1;
    slot = 2 * a.chunk0[seq] + c_begin;
  }
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
    tc::async_rows(Xs(st), kLdTile, X, ldx, r0, nr, k0, bk, kChunk);
    tc::async_rows(Ys(st), kLdTile, Y, ldy, r0, nr, v0, bv, kChunk);
    tc::cp_async_commit();
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
    else tc::cp_async_commit();
  }
  float acc[8][4];
  tc::zero(acc);
  for (int i = 0; i < n; ++i) {
    // chunk i has landed; the barrier also retires iteration i-1's reads of the stage refilled next
    tc::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (i + kStages - 1 < n) issue(i + kStages - 1);
    else tc::cp_async_commit();
    const int st = i % kStages;
    const float* ws = Ws(st);
    if (active)  // [64 (dk), C] x [C, 64 (dv)]
      tc::warp_gemm_tn_weighted<T, 8>(acc, Xs(st), kLdTile, 16 * w, Ys(st), kLdTile, nt, kChunk,
                                      [&](int k) { return ws[k]; });
  }
  if (!active) return;
  const int64_t at = (slot * a.H + h) * int64_t(a.dk) * a.dv;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int64_t x = at + int64_t(k0 + 16 * w + g + 8 * hf) * a.dv + v0 + 8 * j + 2 * t;
        *reinterpret_cast<float2*>(out + x) = make_float2(acc[j][2 * hf], acc[j][2 * hf + 1]);
        if (kMode == kZ) *reinterpret_cast<uint32_t*>(out16 + x) = tc::pack2<T>(acc[j][2 * hf], acc[j][2 * hf + 1]);
      }
}

// The tree, elementwise in fp32, along the chunks of a sequence in order; grid (element blocks,
// N x H), four elements per thread, per-level registers in `stk` (a binary counter).
//   up:   node_{m+1}[i] = e^{beta_m[2i+1]} node_m[2i] + node_m[2i+1] from level 1 (Z, fp32 in
//         `node`); writes the 16-bit copies n16 of the nodes the chunks read (levels >= 2, even i;
//         level 1 comes from the Z kernel).
//   down: D_m[i] = R_m[i] + c D_{m+1}[i/2], c = e^{beta_m[i+1]} (i even) or 1 (i odd), with R the
//         read cotangents (fp32 in `node`, node slots; at levels m >= split the sum of the parts
//         in `parts` times e^{gap to the part}) and D = 0 past the end (no parent: c D = 0);
//         writes dZ = D_1 to n16 (16-bit, by global chunk). It is the push-down of §5.3.
constexpr int kMaxLevels = 64;

template <class T, bool kDown>
__global__ void __launch_bounds__(256) ll_tree_kernel(const int64_t* lens, const int64_t* chunk0, int H, int64_t tile,
                                                      const float* beta, const float* node, T* n16,
                                                      const float* parts = nullptr, int split = kMaxLevels) {
  const int seq = blockIdx.y / H, h = blockIdx.y % H;
  const int64_t nc = (lens[seq] + kChunk - 1) / kChunk, base = 2 * chunk0[seq];
  const int64_t e = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (nc == 0 || e >= tile) return;
  const int top = bitlen64u(uint64_t(nc));  // levels 1..top hold nc >> (m-1) >= 1 nodes
  int64_t off[kMaxLevels + 1];              // node_off(nc, m)
  off[1] = 0;
  for (int m = 2; m <= top; ++m) off[m] = off[m - 1] + (nc >> (m - 2));
  auto load = [&](int64_t slot) { return *reinterpret_cast<const float4*>(node + ((base + slot) * H + h) * tile + e); };
  auto put = [&](int64_t idx, float4 x) {
    uint2 u;
    u.x = tc::pack2<T>(x.x, x.y), u.y = tc::pack2<T>(x.z, x.w);
    *reinterpret_cast<uint2*>(n16 + (idx * H + h) * tile + e) = u;
  };
  auto axpy = [](float4& y, float f, const float4& x) { y.x += f * x.x, y.y += f * x.y, y.z += f * x.z, y.w += f * x.w; };
  auto decay = [&](int m, int64_t i) { return __expf(beta[(base + off[m] + i) * H + h]); };
  float4 stk[kMaxLevels + 1];
  if constexpr (!kDown) {
    for (int64_t j = 0; j < nc; ++j) {
      float4 cur = load(j);  // Z_j = node_1[j]
      int m = 1;
      int64_t i = j;
      while (i & 1) {  // cur = node_m[i] closes its parent node_{m+1}[i >> 1] with the left child on stk
        axpy(cur, decay(m, i), stk[m]);
        i >>= 1, ++m;
        if (!(i & 1)) put(base + off[m] + i, cur);
      }
      stk[m] = cur;  // a left child (i even), pending its sibling
    }
  } else {
    for (int64_t j = 0; j < nc; ++j) {
      // the ancestors of leaf j that differ from those of leaf j - 1: levels 1 .. ctz(j) + 1
      const int mtop = j == 0 ? top : min(top, ctz64u(uint64_t(j)) + 1);
      for (int m = mtop; m >= 1; --m) {
        const int64_t i = j >> (m - 1);
        float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < (nc >> (m - 1))) {
          if (m < split) {
            if (!(i & 1)) d = load(off[m] + i);  // odd nodes are never read: R = 0
          } else if (!(i & 1) && ((i + 1) << (m - 1)) < nc) {  // R from the parts of its reading range
            const int64_t nb = (nc + kSplit - 1) / kSplit, c1 = min((i + 2) << (m - 1), nc);
            float gap = 0.f;
            for (int64_t b = ((i + 1) << (m - 1)) / kSplit; b * kSplit < c1; ++b) {
              axpy(d, __expf(gap), *reinterpret_cast<const float4*>(
                                       parts + ((chunk0[seq] + (m - split) * nb + b) * H + h) * tile + e));
              if ((b + 1) * kSplit < c1) gap += beta[(base + off[kSplitBetaLevel] + b) * H + h];
            }
          }
          if (m < top && (i >> 1) < (nc >> m)) {
            const float c = (i & 1) ? 1.f : decay(m, i + 1);
            axpy(d, c, stk[m + 1]);
          }
        }
        stk[m] = d;
      }
      put(chunk0[seq] + j, stk[1]);
    }
  }
}

template <class T>
size_t wkv_smem() {
  return kStages * (2 * size_t(kChunk) * kLdTile * sizeof(T) + kChunk * sizeof(float));
}

// The tree of a call: beta [2 nchunks][H] and the 16-bit node copies [2 nchunks][H][dk][dv].
// Built by the tree sweep (gla_tc.cu) when it has enough blocks to fill the GPU (sequences x
// heads x 64 x 64 tiles >= half the SMs); otherwise chunk-parallel: Z (fp32 and 16-bit, one block
// per chunk) and the up pass over the levels.
template <class T>
struct Tree {
  DevBuf<float> beta;
  DevBuf<T> node16;
  TreeArgs ta;
  Tree(const LlArgs<T>& a, cudaStream_t s)
      : beta(size_t(2 * a.p.nchunks * a.p.H), s), node16(size_t(2 * a.p.nchunks * a.p.H * a.p.dk * a.p.dv), s) {
    ta.lam = a.lam, ta.dlam = a.dlam, ta.nL = a.nL, ta.node16 = node16.get(), ta.beta = beta.get();
  }
};

int sm_count() {
  static const int n = [] {
    int dev = 0, x = 0;
    HILA_CUDA_CHECK(cudaGetDevice(&dev));
    HILA_CUDA_CHECK(cudaDeviceGetAttribute(&x, cudaDevAttrMultiProcessorCount, dev));
    return x;
  }();
  return n;
}

template <class T, WkvMode kMode>
void launch_wkv(const GlaArgs<T>& p, const TreeArgs& ta, float* out, T* out16, int split, cudaStream_t s) {
  const unsigned items = unsigned(kMode == kRead ? 2 * p.nchunks : p.nchunks);
  const dim3 grid(items, p.H, unsigned(((p.dk + kTile - 1) / kTile) * ((p.dv + kTile - 1) / kTile)));
  set_smem(ll_wkv_kernel<T, kMode>, wkv_smem<T>());
  if (dry_run()) return;  // dry run: workspace_size
  ll_wkv_kernel<T, kMode><<<grid, 128, wkv_smem<T>(), s>>>(p, ta, out, out16, split);
  HILA_CUDA_CHECK_LAUNCH();
}

template <class T, bool kDown>
void launch_tree(const int64_t* len, const int64_t* chunk0, int NH, int H, int64_t tile, const float* beta,
                 const float* node, T* n16, cudaStream_t s, const float* parts = nullptr, int split = kMaxLevels) {
  if (dry_run()) return;  // dry run: workspace_size
  ll_tree_kernel<T, kDown><<<dim3(unsigned((tile / 4 + 255) / 256), unsigned(NH)), 256, 0, s>>>(
      len, chunk0, H, tile, beta, node, n16, parts, split);
  HILA_CUDA_CHECK_LAUNCH();
}

// beta, Z into node level 1, and the upper node levels.
template <class T>
void build_tree(const GlaArgs<T>& p, Tree<T>& tr, cudaStream_t s) {
  if (!dry_run()) {  // dry run: workspace_size
    ll_beta_kernel<T><<<unsigned(p.N * p.H), 256, 0, s>>>(p, tr.beta.get());
    HILA_CUDA_CHECK_LAUNCH();
  }
  const char* env = std::getenv("HILA_LOGLINEAR_TREE_SWEEP");  // 0 / 1: force the choice (tests)
  const bool sweep = env ? std::strcmp(env, "0") != 0 : 2 * tc_sweep_blocks(p) >= sm_count();
  if (sweep) {
    const int lstk = bitlen64u(uint64_t((p.Ttot + kChunk - 1) / kChunk)) + 1;  // levels of the longest sequence
    DevBuf<float> stack(tc_tree_sweep_stack(p, lstk), s);
    tc_tree_sweep(p, tr.ta, stack.get(), lstk, s);
  } else {
    DevBuf<float> z(size_t(2 * p.nchunks * p.H * p.dk * p.dv), s);
    launch_wkv<T, kZ>(p, tr.ta, z.get(), tr.node16.get(), kMaxLevels, s);
    launch_tree<T, false>(p.len, p.chunk0, p.N * p.H, p.H, int64_t(p.dk) * p.dv, tr.beta.get(), z.get(),
                          tr.node16.get(), s);
  }
}

}  // namespace

template <class T>
bool ll_tree_usable(int dk, int dv) {
  if constexpr (!kTensorCore<T>) {
    return false;
  } else {
    if (const char* env = std::getenv("HILA_LOGLINEAR_TREE"); env && std::strcmp(env, "0") == 0) return false;
    // one dQ pass per warp (dk <= 128) that every warp takes part in (dk >= 32); dv tiles of the output
    if (dk < 32 || dk > 128 || dv > 128) return false;
    int dev = 0, optin = 0;
    HILA_CUDA_CHECK(cudaGetDevice(&dev));
    HILA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return std::max({tc_bwd_smem(dk, dv, true), tc_output_smem(dk, dv, sizeof(T)), wkv_smem<T>()}) <= size_t(optin);
  }
}

template <class T>
void ll_tree_forward(const LlArgs<T>& a, cudaStream_t s) {
  if constexpr (kTensorCore<T>) {
    if (!a.p.o || a.p.N == 0 || a.p.H == 0 || a.p.nchunks == 0) return;
    Tree<T> tr(a, s);
    build_tree(a.p, tr, s);
    tc_output(a.p, s, &tr.ta);
  }
}

template <class T>
void ll_tree_backward(const LlArgs<T>& a, cudaStream_t s) {
  if constexpr (kTensorCore<T>) {
    if (a.p.N == 0 || a.p.H == 0) return;
    if (!dry_run())  // dry run: workspace_size
      HILA_CUDA_CHECK(cudaMemsetAsync(a.dlam, 0, size_t(a.p.H) * a.p.Ttot * a.nL * sizeof(float), s));
    if (a.p.nchunks == 0) return;
    Tree<T> tr(a, s);
    build_tree(a.p, tr, s);
    const int64_t tile = int64_t(a.p.dk) * a.p.dv;
    DevBuf<float> dnode(size_t(2 * a.p.nchunks * a.p.H * tile), s);
    DevBuf<T> dz16(size_t(a.p.nchunks * a.p.H * tile), s);
    // parts of the long reading ranges: (top - 5) ceil(nc / 16) <= nc slots per sequence while every
    // sequence has at most 2^20 chunks; beyond that the ranges are summed whole
    const int split = a.p.Ttot / kChunk + a.p.N <= (int64_t(1) << 20) ? kSplitLevel : kMaxLevels;
    DevBuf<float> parts(split < kMaxLevels ? size_t(a.p.nchunks * a.p.H * tile) : 0, s);
    launch_wkv<T, kRead>(a.p, tr.ta, dnode.get(), nullptr, split, s);
    if (split < kMaxLevels) launch_wkv<T, kPart>(a.p, tr.ta, parts.get(), nullptr, split, s);
    launch_tree<T, true>(a.p.len, a.p.chunk0, a.p.N * a.p.H, a.p.H, tile, tr.beta.get(), dnode.get(), dz16.get(), s,
                         parts.get(), split);
    tr.ta.dz16 = dz16.get();
    tc_bwd_chunk(a.p, s, &tr.ta);
    GlaArgs<T> p = a.p;
    p.dht = nullptr;
    gla_dg(p, s);
  }
}

#define HILA_INSTANTIATE(T)                                                          \
  template bool ll_tree_usable<T>(int, int);                                         \
  template void ll_tree_forward<T>(const LlArgs<T>&, cudaStream_t);                   \
  template void ll_tree_backward<T>(const LlArgs<T>&, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
