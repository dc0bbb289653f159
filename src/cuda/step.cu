// SPDX-License-Identifier: Apache-2.0
// Decode step of every hila operator on the GPU: one fused kernel per step for all sequences and
// heads, states updated in place in the StateView layout (include/hila/ops.h), fp32 (fp64 for
// fp64 inputs). The CPU reference is cpu::op_step / cpu::prim_step.
//
// Per (sequence n, value head h, column tile) one block of kThreads threads runs the composition
// (HLA_SPEC §3.2 / §5.2 / §6.2, LOGLINEAR_SPEC §3.2, §6.3, §7), with q already scaled:
//   inner S (hla2, hla3):  S <- a_S S + k k^T          u = S q (+ ridge q)      [dk, dk] packed
//   inner P (ahla, hla3):  P <- a_P P + k v'^T         h = P^T q                [dk, dv']
//   outer, key = u or k, val = h or v', beta = 1 (mamba) or beta_t (delta):
//     every live slot l:   H_l <- a H_l                (mamba)
//                          H_l <- a (H_l - beta key (key^T H_l))   (delta: rank-1 erase, O(dk dv'))
//     o' = lam_0 beta (q.key) val + sum_live lam_l H_l^T q
//     merge (flat):        H_0 <- H_0 + beta key val^T
//     merge (Fenwick):     H_{r+1} <- sum_{l=1..r} H_l + beta key val^T, H_1..H_r <- 0,
//                          r = ctz(t+1): levels 1..r are the trailing ones of t (LOGLINEAR_SPEC §2.5)
//   normalize (HLA_SPEC §4): o = o'[:dv] / (o'[dv] + eps).
// The position t of each sequence is read from the state's pos on the device (sequences may be at
// different positions), so a step needs no host round trip.
//
// Grid: x = sequence * tiles + tile, y = head. Columns of P and H are independent in every update
// above, so blocks split dv' into tiles of kCols columns. Two things need more than a tile:
//  - u = S q needs all of S. Every tile reads S; a per-(n, h) counter elects the last block to
//    finish reading, which writes S back. Without counters (the functional step on a caller's
//    state, which has nowhere to keep them) S ops run one tile of all dv' columns per block.
//  - normalize divides by column dv of o': one tile of all dv' columns per block.
// pos advances once every block of a sequence is done: a per-sequence counter elects the last
// block, or (without counters) a second tiny kernel follows in stream order.
// Thread layout inside a column chunk: warp w = row group, lane = column, so each warp reads 32
// consecutive floats of one state row; rows r = w, w + kWarps, ... are held in registers
// (kRows = rows per thread >= dk / kWarps, a template parameter).
#include <cmath>
#include <string>
#include <utility>

#include "core/plan.h"
#include "cuda/runtime.cuh"
#include "cuda/step.h"
#include "hila/error.h"

namespace hila::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 32;     // columns per chunk (one per lane)
constexpr int kMaxLevels = 64;
constexpr int kMaxDk = 512;   // kRows <= 64 registers per thread per array
constexpr int kDeep = 4;      // Fenwick levels loaded together by the small-grid kernel

// Kernel parameters (by value). Element offsets, strides in elements; innermost stride 1.
template <class T>
struct StepArgs {
  using R = Acc<T>;
  const T *q, *k, *v;          // [N, G, dk], [N, G, dk], [N, H, dv]
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;
  T* o;                        // [N, H, dv]
  int64_t os0, os1;
  Strided g{TensorView{}}, lam{TensorView{}}, beta{TensorView{}};  // [N,H(,P)], [N,H,L], [N,H]
  bool has_g;
  int gcol[3];                 // gate column of S, P, outer (all 0 with tied gates)
  R* S;                        // [N, H, dk(dk+1)/2] packed upper triangle
  int64_t Ss0, Ss1;
  R* P;                        // [N, H, dk, dv']
  int64_t Ps0, Ps1;
  int Ps2;                     // row stride inside one head's matrix (dk * stride < 2^31)
  R* Hs;                       // [N, H, dk, dv'] or [N, H, Ls, dk, dv']
  int64_t Hs0, Hs1, Hsl;       // Hsl: slot stride (0 for flat)
  int Hs2;                     // row stride (dk * stride < 2^31)
  int64_t* pos;                // [N]
  int64_t poss;
  unsigned* seq_count;         // [N] blocks done per sequence (null: a second kernel advances pos)
  unsigned* s_count;           // [N, H] blocks done reading S (tiles > 1 only)
  int N, H, rep, dk, dv, dvp, tiles;
  bool has_S, has_P, fenwick, delta, normalize, l2;
  R scale, ridge, eps;
};

// Shared memory carve-up (in R elements), the same on host and device.
struct Smem {
  int q, k, key, vin, hh, oraw, lam, red, colred, colpart, total;
  __host__ __device__ Smem(int dk, int dvp, bool has_S) {
    int o = 0;
    q = o, o += dk;
    k = o, o += dk;
    key = o, o += dk;
    vin = o, o += dvp;
    hh = o, o += dvp;
    oraw = o, o += dvp;
    lam = o, o += kMaxLevels;
    red = o, o += kWarps;
    colred = o, o += kWarps * kCols;
    colpart = o, o += has_S ? kWarps * dk : 0;
    total = o;
  }
};

template <class R>
__device__ __forceinline__ R rexp(R x) {
  if constexpr (std::is_same_v<R, double>) return ::exp(x);
  else return ::expf(x);
}
template <class R>
__device__ __forceinline__ R rsqrt_eps(R s, R eps) {
  if constexpr (std::is_same_v<R, double>) return 1.0 / ::sqrt(s + eps);
  else return 1.0f / ::sqrtf(s + eps);
}

template <class R>
__device__ __forceinline__ R warp_sum(R x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Sum over the block; every thread gets the result. `red` is [kWarps] shared.
template <class R>
__device__ R block_sum(R x, R* red) {
  x = warp_sum(x);
  __syncthreads();  // earlier readers of red are done
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  R s = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[w];
  return s;
}

// Sum over the kWarps row groups of each lane's column partial; every thread gets its column's
// sum. `colred` is [kWarps, kCols] shared.
template <class R>
__device__ R column_sum(R x, R* colred) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  __syncthreads();
  colred[warp * kCols + lane] = x;
  __syncthreads();
  R s = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += colred[w * kCols + lane];
  return s;
}

// Offset of row i of the packed upper triangle, shifted so that row[j] = S_ij for j >= i.
__device__ __forceinline__ int64_t sym_row(int i, int dk) {
  return int64_t(i) * dk - int64_t(i) * (i - 1) / 2 - i;
}

// One sweep over the packed S (row-major upper triangle) of x_ij = a S_ij + k_i k_j: `store`
// writes x back; `accumulate` adds u = x q in two parts: row i's sum_{j>=i} x_ij q_j (a warp sum,
// to s_row[i]) and, by symmetry, x_ij q_i for j > i to the lane's column accumulators
// colacc[m] (j = lane + 32 m), which the caller sums over warps. Warp w takes rows w, w + kWarps,
// ..., kB rows at a time with all their loads issued first.
template <class R, int kM>
__device__ void sym_sweep(R* S, int dk, R aS, const R* s_k, const R* s_q, bool accumulate, bool store,
                          R* s_row, R (&colacc)[kM]) {
  constexpr int kB = kM >= 8 ? 2 : 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  for (int i0 = warp; i0 < dk; i0 += kWarps * kB) {
    R x[kB][kM];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int i = i0 + kWarps * b;
      const R* row = S + sym_row(i, dk);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const int j = lane + 32 * m;
        x[b][m] = (i < dk && j >= i && j < dk) ? row[j] : R(0);
      }
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int i = i0 + kWarps * b;
      if (i >= dk) break;  // uniform over the warp
      R* row = S + sym_row(i, dk);
      const R ki = s_k[i], qi = s_q[i];
      R ra = 0;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const int j = lane + 32 * m;
        if (j >= i && j < dk) {
          const R y = aS * x[b][m] + ki * s_k[j];
          if (store) row[j] = y;
          ra += y * s_q[j];
          if (j > i) colacc[m] += y * qi;
        }
      }
      if (accumulate) {
        ra = warp_sum(ra);
        if (lane == 0) s_row[i] = ra;
      }
    }
  }
}

// Resident blocks per SM the register budget is sized for: the step is memory bound, so more
// loads in flight beat the few spills this costs (ptxas -v: <= 20 bytes at kRows = 16 in fp32).
// kDepth > 1 (several Fenwick levels loaded at once, for grids too small to fill the device)
// trades occupancy for fewer dependent round trips per block.
template <class T, int kRows, int kDepth>
constexpr int kMinBlocks = kDepth > 1 ? (std::is_same_v<T, double> ? 1 : 2)
                           : std::is_same_v<T, double> ? (kRows <= 8 ? 4 : kRows <= 16 ? 2 : 1)
                                                       : (kRows <= 16 ? 4 : kRows <= 32 ? 2 : 1);

template <class T, int kRows, int kDepth>
__global__ void __launch_bounds__(kThreads, (kMinBlocks<T, kRows, kDepth>)) step_kernel(const StepArgs<T> a) {
  using R = Acc<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  R* sm = reinterpret_cast<R*>(smem_raw);
  const Smem L(a.dk, a.dvp, a.has_S);
  R *s_q = sm + L.q, *s_k = sm + L.k, *s_key = sm + L.key, *s_vin = sm + L.vin, *s_hh = sm + L.hh,
    *s_oraw = sm + L.oraw, *s_lam = sm + L.lam, *s_red = sm + L.red, *s_colred = sm + L.colred,
    *s_colpart = sm + L.colpart;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const int n = blockIdx.x / a.tiles, tile = blockIdx.x % a.tiles, h = blockIdx.y;
  const int grp = h / a.rep, dk = a.dk, dvp = a.dvp;
  // this block's columns of P, H and o'
  const int cbeg = a.tiles == 1 ? 0 : tile * kCols;
  const int cend = a.tiles == 1 ? dvp : min(dvp, cbeg + kCols);
  const int64_t t = a.pos[n * a.poss];

  // ---- inputs: q (scaled), k (l2-normalised for qk_l2norm), v' = [v | 1], gates, lam
  for (int c = tid; c < dk; c += kThreads) {
    s_q[c] = from<R>(a.q[n * a.qs0 + grp * a.qs1 + c]);
    s_k[c] = from<R>(a.k[n * a.ks0 + grp * a.ks1 + c]);
  }
  for (int c = tid; c < dvp; c += kThreads) s_vin[c] = c < a.dv ? from<R>(a.v[n * a.vs0 + h * a.vs1 + c]) : R(1);
  const int nlev = a.fenwick ? 64 - __clzll(t) : 0;  // live levels are <= bitlen(t)
  for (int l = tid; l <= nlev; l += kThreads)
    s_lam[l] = a.fenwick ? ld<R>(a.lam, n * a.lam.s[0] + h * a.lam.s[1] + l * a.lam.s[2]) : R(1);
  __syncthreads();
  R qs = a.scale, ks = 1;
  if (a.l2) {  // LOGLINEAR_SPEC §6.1: x / sqrt(|x|^2 + 1e-6)
    R sq = 0, sk = 0;
    for (int c = tid; c < dk; c += kThreads) sq += s_q[c] * s_q[c], sk += s_k[c] * s_k[c];
    sq = block_sum(sq, s_red);
    sk = block_sum(sk, s_red);
    qs *= rsqrt_eps(sq, R(1e-6));
    ks = rsqrt_eps(sk, R(1e-6));
  }
  __syncthreads();
  for (int c = tid; c < dk; c += kThreads) s_q[c] *= qs, s_k[c] *= ks;
  __syncthreads();
  auto gate = [&](int prim) -> R {
    if (!a.has_g) return R(1);
    return rexp(ld<R>(a.g, n * a.g.s[0] + h * a.g.s[1] + a.gcol[prim] * a.g.s[2]));
  };
  const R beta = a.delta ? ld<R>(a.beta, n * a.beta.s[0] + h * a.beta.s[1]) : R(1);

  // ---- inner S (packed symmetric): S <- a S + k k^T, u = S q + ridge q.
  if (a.has_S) {
    const R aS = gate(0);
    R* S = a.S + n * a.Ss0 + h * a.Ss1;
    constexpr int kM = kRows * kWarps / 32;  // >= dk / 32
    R colacc[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) colacc[m] = 0;
    // With several column tiles every block of (n, h) needs all of S: each reads it, and the last
    // block to finish reading (a counter per (n, h)) writes the update.
    const bool shared_S = a.tiles > 1;
    sym_sweep<R, kM>(S, dk, aS, s_k, s_q, true, !shared_S, s_key, colacc);
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const int j = lane + 32 * m;
      if (j < dk) s_colpart[warp * dk + j] = colacc[m];
    }
    __syncthreads();
    for (int j = tid; j < dk; j += kThreads) {
      R u = s_key[j];
      for (int w = 0; w < kWarps; ++w) u += s_colpart[w * dk + j];
      s_key[j] = u + a.ridge * s_q[j];
    }
    if (shared_S) {
      __shared__ int s_last;
      if (tid == 0) {
        unsigned* cnt = a.s_count + int64_t(n) * a.H + h;
        __threadfence();
        s_last = atomicAdd(cnt, 1u) == unsigned(a.tiles - 1);
        if (s_last) *cnt = 0;  // ready for the next step (stream order)
      }
      __syncthreads();
      if (s_last) sym_sweep<R, kM>(S, dk, aS, s_k, s_q, false, true, s_key, colacc);
    }
  } else {
    for (int c = tid; c < dk; c += kThreads) s_key[c] = s_k[c];
  }
  __syncthreads();

  // ---- inner P: P <- a P + k v'^T, h = P^T q (this block's columns)
  if (a.has_P) {
    const R aP = gate(1);
    R* P = a.P + n * a.Ps0 + h * a.Ps1;
    for (int c0 = cbeg; c0 < cend; c0 += kCols) {
      const int c = c0 + lane;
      const bool active = c < cend;
      R x[kRows];  // all loads first, then the stores
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int r = warp + kWarps * j;
        x[j] = (active && r < dk) ? P[r * a.Ps2 + c] : R(0);
      }
      const R vc = active ? s_vin[c] : R(0);
      R part = 0;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int r = warp + kWarps * j;
        if (active && r < dk) {
          const R y = aP * x[j] + s_k[r] * vc;
          P[r * a.Ps2 + c] = y;
          part += s_q[r] * y;
        }
      }
      part = column_sum(part, s_colred);
      if (active && warp == 0) s_hh[c] = part;
    }
    __syncthreads();
  }
  const R* s_val = a.has_P ? s_hh : s_vin;

  // ---- outer primitive (flat or Fenwick; mamba or delta)
  const R aO = gate(2);
  R qkey = 0;
  for (int c = tid; c < dk; c += kThreads) qkey += s_q[c] * s_key[c];
  qkey = block_sum(qkey, s_red);
  const R diag = s_lam[0] * beta * qkey;  // lam_0 beta (q . key)
  R* Hh = a.Hs + n * a.Hs0 + h * a.Hs1;
  const int rr = a.fenwick ? __ffsll(static_cast<unsigned long long>(t + 1)) - 1 : 0;  // ctz(t+1)
  const int target = a.fenwick ? rr + 1 : 0;
  const int lfirst = a.fenwick ? 1 : 0;
  for (int c0 = cbeg; c0 < cend; c0 += kCols) {
    const int c = c0 + lane;
    const bool active = c < cend;
    R merged[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) merged[j] = 0;
    R opart = 0;
    // live slots in batches of kDepth, each batch's loads issued before any of it is processed
    for (int next = lfirst;;) {
      int lv[kDepth];
      int nb = 0;
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        while (next <= nlev && a.fenwick && !((t >> (next - 1)) & 1)) ++next;  // dead slots: never read
        lv[d] = next <= nlev ? next++ : -1;
        nb += lv[d] >= 0;
      }
      if (nb == 0) break;
      R x[kDepth][kRows];
#pragma unroll
      for (int d = 0; d < kDepth; ++d)
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          const int r = warp + kWarps * j;
          x[d][j] = (lv[d] >= 0 && active && r < dk) ? Hh[lv[d] * a.Hsl + r * a.Hs2 + c] : R(0);
        }
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        const int l = lv[d];
        if (l < 0) break;  // uniform over the block
        R* Hl = Hh + l * a.Hsl;
        if (a.delta) {  // kh = key^T H_l (column c), then H_l <- a (H_l - beta key kh)
          R kp = 0;
#pragma unroll
          for (int j = 0; j < kRows; ++j) {
            const int r = warp + kWarps * j;
            if (r < dk) kp += s_key[r] * x[d][j];
          }
          const R kh = column_sum(kp, s_colred);
#pragma unroll
          for (int j = 0; j < kRows; ++j) {
            const int r = warp + kWarps * j;
            if (r < dk) x[d][j] = aO * (x[d][j] - beta * s_key[r] * kh);
          }
        } else {
#pragma unroll
          for (int j = 0; j < kRows; ++j) x[d][j] *= aO;
        }
        const R lw = s_lam[l];
        const bool merge = !a.fenwick || l <= rr;
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          const int r = warp + kWarps * j;
          if (r < dk) {
            opart += lw * s_q[r] * x[d][j];
            if (merge) merged[j] += x[d][j];
            if (active && (a.fenwick || !merge)) Hl[r * a.Hs2 + c] = merge ? R(0) : x[d][j];
          }
        }
      }
    }
    // the merge target (flat: slot 0 itself) gets the token: + beta key val^T
    R* Ht = Hh + target * a.Hsl;
    const R bv = active ? beta * s_val[c] : R(0);
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int r = warp + kWarps * j;
      if (active && r < dk) Ht[r * a.Hs2 + c] = merged[j] + s_key[r] * bv;
    }
    opart = column_sum(opart, s_colred);
    if (active && warp == 0) s_oraw[c] = opart + diag * s_val[c];
  }
  __syncthreads();

  // ---- output in v's dtype (normalize: the denominator column dv is in this block, tiles == 1)
  T* o = a.o + n * a.os0 + h * a.os1;
  const int oend = min(cend, a.dv);
  if (a.normalize) {
    const R den = s_oraw[a.dv] + a.eps;
    for (int c = cbeg + tid; c < oend; c += kThreads) o[c] = to<T>(s_oraw[c] / den);
  } else {
    for (int c = cbeg + tid; c < oend; c += kThreads) o[c] = to<T>(s_oraw[c]);
  }
  // the last block of sequence n (every thread of every block has read t by now) advances pos
  if (a.seq_count && tid == 0) {
    unsigned* cnt = a.seq_count + n;
    if (atomicAdd(cnt, 1u) == unsigned(a.H * a.tiles - 1)) {
      *cnt = 0;
      a.pos[n * a.poss] = t + 1;
    }
  }
}

// After every head of every sequence has stepped: pos <- pos + 1.
__global__ void advance_positions(int64_t* pos, int64_t stride, int N) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) pos[i * stride] += 1;
}

// The runtime -> template switch: rows per thread for the head dim, and the level batch depth
// (deep batches for log-linear grids with fewer blocks than about 4 per SM, dk <= 128).
template <class T>
void launch_step(const StepArgs<T>& a, dim3 grid, size_t smem, bool deep, cudaStream_t s) {
  auto go = [&](auto kernel) {
    if (smem > 48 * 1024)
      HILA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<grid, kThreads, smem, s>>>(a);
    HILA_CUDA_CHECK_LAUNCH();
  };
  const int rows = (a.dk + kWarps - 1) / kWarps;
  if (deep && rows <= 16) {
    if (rows <= 4) go(step_kernel<T, 4, kDeep>);
    else if (rows <= 8) go(step_kernel<T, 8, kDeep>);
    else go(step_kernel<T, 16, kDeep>);
    return;
  }
  if (rows <= 4) go(step_kernel<T, 4, 1>);
  else if (rows <= 8) go(step_kernel<T, 8, 1>);
  else if (rows <= 16) go(step_kernel<T, 16, 1>);
  else if (rows <= 32) go(step_kernel<T, 32, 1>);
  else go(step_kernel<T, 64, 1>);
}

template <class T>
void step_impl(const detail::Resolved& r, const StepParams& p, const StateView& sv, void* counters,
               cudaStream_t s) {
  using R = Acc<T>;
  const detail::OpPlan plan = detail::OpPlan::make(r.cfg);
  StepArgs<T> a{};
  a.q = static_cast<const T*>(p.q.data), a.k = static_cast<const T*>(p.k.data), a.v = static_cast<const T*>(p.v.data);
  a.qs0 = p.q.stride[0], a.qs1 = p.q.stride[1], a.ks0 = p.k.stride[0], a.ks1 = p.k.stride[1];
  a.vs0 = p.v.stride[0], a.vs1 = p.v.stride[1];
  a.o = static_cast<T*>(p.o.data), a.os0 = p.o.stride[0], a.os1 = p.o.stride[1];
  a.g = Strided(p.g), a.lam = Strided(p.lam), a.beta = Strided(p.beta);
  a.has_g = r.gate_cols > 0;
  a.gcol[0] = r.gate_cols > 1 ? plan.gS : 0;
  a.gcol[1] = r.gate_cols > 1 ? plan.gP : 0;
  a.gcol[2] = r.gate_cols > 1 ? plan.gO : 0;
  if (plan.has_S) a.S = static_cast<R*>(sv.S.data), a.Ss0 = sv.S.stride[0], a.Ss1 = sv.S.stride[1];
  if (plan.has_P)
    a.P = static_cast<R*>(sv.P.data), a.Ps0 = sv.P.stride[0], a.Ps1 = sv.P.stride[1], a.Ps2 = int(sv.P.stride[2]);
  a.Hs = static_cast<R*>(sv.H.data), a.Hs0 = sv.H.stride[0], a.Hs1 = sv.H.stride[1];
  const int64_t hrow = plan.fenwick ? sv.H.stride[3] : sv.H.stride[2];
  a.Hsl = plan.fenwick ? sv.H.stride[2] : 0;
  a.Hs2 = int(hrow);
  for (const auto& [name, stride] : {std::pair<const char*, int64_t>{"state.H", hrow},
                                     {"state.P", plan.has_P ? sv.P.stride[2] : 0}})
    if (stride * r.dk >= (int64_t(1) << 31))
      throw Error(name, "expected a row stride below 2^31 / dk for the CUDA decode step, got " +
                            std::to_string(stride));
  a.pos = static_cast<int64_t*>(sv.pos.data), a.poss = sv.pos.stride[0];
  a.N = int(r.B), a.H = int(r.H), a.rep = int(r.H / r.G), a.dk = int(r.dk), a.dv = int(r.dv), a.dvp = int(r.dvp);
  a.has_S = plan.has_S, a.has_P = plan.has_P, a.fenwick = plan.fenwick, a.delta = plan.delta;
  a.normalize = plan.normalize, a.l2 = r.cfg.qk_l2norm;
  a.scale = R(r.scale), a.ridge = R(plan.ridge), a.eps = R(plan.eps);
  // Column tiles: all of dv' in one block for normalize (the denominator column) and, without
  // the counters a DecodeState owns, for S (see the kernel); else kCols columns per block.
  const bool one_tile = plan.normalize || (plan.has_S && counters == nullptr);
  a.tiles = one_tile ? 1 : (a.dvp + kCols - 1) / kCols;
  if (counters) {
    a.seq_count = static_cast<unsigned*>(counters);
    a.s_count = a.seq_count + a.N;
  }
  const size_t smem = size_t(Smem(a.dk, a.dvp, a.has_S).total) * sizeof(R);
  if (r.B > 0) {
    const int64_t blocks = int64_t(a.N) * a.tiles * a.H;
    int dev = 0, sms = 0;
    HILA_CUDA_CHECK(cudaGetDevice(&dev));
    HILA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const bool deep = plan.fenwick && blocks < 4 * int64_t(sms);
    launch_step<T>(a, dim3(unsigned(int64_t(a.N) * a.tiles), unsigned(a.H)), smem, deep, s);
    if (!counters) {
      advance_positions<<<unsigned((a.N + 255) / 256), 256, 0, s>>>(a.pos, a.poss, a.N);
      HILA_CUDA_CHECK_LAUNCH();
    }
  }
}

template <class T>
struct Step {
  static void run(const detail::Resolved& r, const StepParams& p, const StateView& sv, void* counters,
                  cudaStream_t s) {
    step_impl<T>(r, p, sv, counters, s);
  }
};

struct Shape5 {
  int64_t d[5];
};

// ---- state copies for DecodeState: dst (contiguous, R) <- src (strided, any float dtype), with
// zero fill where dst is larger (more Fenwick slots) ----------------------------------------------
template <class R>
__global__ void copy_part(R* dst, int nd, Shape5 dshape, Strided src, Shape5 sshape, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = e, off = 0;
    bool inside = true;
    for (int i = nd - 1; i >= 0; --i) {
      const int64_t idx = rest % dshape.d[i];
      rest /= dshape.d[i];
      inside = inside && idx < sshape.d[i];
      off += idx * src.s[i];
    }
    dst[e] = inside ? ld<R>(src, off) : R(0);
  }
}

}  // namespace

}  // namespace hila::cuda

namespace hila::detail {

void cuda_copy_state_part(const TensorView& dst, const TensorView& src, void* stream) {
  using namespace hila::cuda;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  DeviceScope scope(dst.device.index);
  if (dst.ndim > 5 || src.ndim != dst.ndim)
    throw Error("state", "expected state parts of at most 5 matching dimensions, got " + src.shape_str() +
                             " -> " + dst.shape_str());
  Shape5 ds{}, ss{};
  for (int i = 0; i < 5; ++i) ds.d[i] = ss.d[i] = 1;
  for (int i = 0; i < dst.ndim; ++i) ds.d[i] = dst.shape[i], ss.d[i] = src.shape[i];
  const int64_t n = dst.numel();
  if (n == 0) return;
  if (dst.dtype == DType::f64) HILA_LAUNCH(copy_part<double>, n, s, static_cast<double*>(dst.data), dst.ndim, ds, Strided(src), ss, n);
  else HILA_LAUNCH(copy_part<float>, n, s, static_cast<float*>(dst.data), dst.ndim, ds, Strided(src), ss, n);
}

void* cuda_alloc_zeroed(size_t bytes, int device) {
  if (bytes == 0) return nullptr;
  cuda::DeviceScope scope(device);
  void* p = nullptr;
  HILA_CUDA_CHECK(cudaMalloc(&p, bytes));
  HILA_CUDA_CHECK(cudaMemset(p, 0, bytes));
  return p;
}

void cuda_free(void* p, int device) noexcept {
  if (!p) return;
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device);
  cudaFree(p);
  cudaSetDevice(prev);
}

void cuda_upload(void* dst, const void* src, size_t bytes, int device) {
  if (bytes == 0) return;
  cuda::DeviceScope scope(device);
  HILA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void cuda_device_synchronize(int device) {
  cuda::DeviceScope scope(device);
  HILA_CUDA_CHECK(cudaDeviceSynchronize());
}

void cuda_synchronize(void* stream, int device) {
  cuda::DeviceScope scope(device);
  HILA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

size_t cuda_step_counter_bytes(int64_t N, int64_t H) { return size_t(N + N * H) * sizeof(unsigned); }

void cuda_step(const Resolved& r, const StepParams& p, const StateView& state, void* counters) {
  cuda::DeviceScope scope(p.q.device.index);
  if (r.dk > cuda::kMaxDk)
    throw Error("q", "expected head dim dk <= " + std::to_string(cuda::kMaxDk) +
                         " for a decode step on a CUDA device, got " + std::to_string(r.dk));
  const cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  switch (p.q.dtype) {
    case DType::bf16: cuda::Step<__nv_bfloat16>::run(r, p, state, counters, s); break;
    case DType::f16: cuda::Step<__half>::run(r, p, state, counters, s); break;
    case DType::f32: cuda::Step<float>::run(r, p, state, counters, s); break;
    case DType::f64: cuda::Step<double>::run(r, p, state, counters, s); break;
    default: throw Error("q", std::string("expected a floating dtype, got ") + dtype_name(p.q.dtype));
  }
}

}  // namespace hila::detail
