// SPDX-License-Identifier: Apache-2.0
// GLA chunk gradients, sm90 tier (sm_90a: TMA + wgmma; gla/sm90.cuh), in place of the sm80 kernel
// where it applies (gla.cu, heuristics::gla_sm90_bwd_chunk). The math of bwd_chunk_sm80.cu (gla.cuh,
// docs/math/HLA.md §7.1), one warpgroup per (chunk, head):
//   P  = scale (Gamma o Q K^T)            dA = Gamma o (dO V^T)            [C,dk]x[dk,C], [C,dv]x[dv,C]
//   dQ^ = diag(e^b) dO Hp^T + dA K                                          [C,dv]x[dv,dk] + [C,C]x[C,dk]
//   dK = diag(w) V dH^T + scale dA^T Q^                                     [C,dv]x[dv,dk] + [C,C]x[C,dk]
//   dV = diag(w) K dH + P^T dO                                              [C,dk]x[dk,dv] + [C,C]x[C,dv]
//   dc = scale q^.dq^ - k.dk per row, w = e^{B-b}
//   dg = the reverse cumsum of dc in the chunk + <dH, H_end>, <dH, H_end> = e^B <dH, Hp> + sum_j w_j k_j.(V dH^T)_j
//        (a.dg_rows: dc per row instead, the last row's with <dH, H_end>)
// Every product is one m64nN wgmma chain (C = 64 rows = the warpgroup's M), operands in shared
// memory: the swizzled tiles serve K-major and, through the transpose flags, MN-major reads, so
// no tile is stored twice. Hp and dH share one buffer (dH lands once dQ has read Hp), which keeps
// the block at 112 KB for dk = dv = 128: two blocks per SM, one's loads under the other's math.
// <dH, Hp> is formed at the end from dH in shared memory and Hp read again from global memory (the
// block's own state, still in L2): no register holds Hp across the dH load, and no thread reads the
// buffer that the dH TMA overwrites.
// kTree, the log-linear tree form (loglinear/tree.cuh; bwd_chunk_sm80.cu's kTree): P and dA carry
// lam_i^{bitlen(i xor j)}, and their in-chunk level buckets of dP o (scale Gamma o Q K^T) give dlam
// of levels 0..p (summed in registers per row); dQ^ = dA K + sum_m diag(lam^{p+m} e^{b+gap_m}) dO node_m^T
// over the levels m the chunk reads, each node_m [dk][dv] in turn through the state buffer (the next
// one's TMA under this one's scaling and its dlam row dots), then dH = the chunk's dZ; rows' dc to dg,
// the state-write part of <dH, H_end> to ta.rho, and a last partial chunk's final-state rows (fin_dk,
// fin_dv) as in bwd_chunk_sm80.cu.
#include "cuda/dispatch/static_switch.h"
#include "cuda/gla/sm90.cuh"

namespace hila::cuda {

namespace {

using namespace gla_sm90;

// Shared memory: 16-bit swizzled tiles (sm90.cuh), then the gates and the two mbarriers.
template <int DK, int DV>
struct BwdSm90Layout {
  static constexpr uint32_t kQ = 0, kK = kQ + kChunk * DK * 2, kV = kK + kChunk * DK * 2, kdO = kV + kChunk * DV * 2,
                            kS = kdO + kChunk * DV * 2,  // Hp, then dH: [DK][DV]
      kP = kS + DK * DV * 2, kdA = kP + kChunk * kChunk * 2, kB = kdA + kChunk * kChunk * 2,
                            kBar = kB + kChunk * 4, kBytes = kBar + 16;
};

// mh, mdh: the per-chunk states hbuf, dhbuf (kTree: the 16-bit nodes ta.node16 and dZ ta.dz16).
template <class T, int DK, int DV, bool kFold = false, bool kTree = false>
__global__ void __launch_bounds__(kSm90Threads, 2)
    bwd_chunk_sm90_kernel(const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                          const __grid_constant__ CUtensorMap mv, const __grid_constant__ CUtensorMap mdo,
                          const __grid_constant__ CUtensorMap mh, const __grid_constant__ CUtensorMap mdh,
                          unsigned order, GlaArgs<T> a, TreeArgs ta) {
  static_assert(!(kFold && kTree), "the tree form keeps dk and dv apart");
#if HILA_SM90A
  using L = BwdSm90Layout<DK, DV>;
  using namespace sm90;
  extern __shared__ __align__(1024) char smem[];
  const uint32_t s0 = smem_u32(smem);
  if (s0 & 1023) __trap();  // the swizzle needs 1024-byte aligned tiles
  float* bs = reinterpret_cast<float*>(smem + L::kB);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + L::kBar);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int64_t cg = blockIdx.x;
  const int h = blockIdx.y, seq = a.chunk_seq[cg];
  const int64_t c = cg - a.chunk0[seq], r0 = a.row0[seq] + c * a.C;
  const int nr = rows_in(a.len[seq], c, a.C);
  const int srow = int((cg * a.H + h) * DK);  // row of this chunk's state in hbuf / dhbuf / dz16 [.., DV]
  // kTree: the chunk's absolute index n reads the nodes of the set bits of n; the state buffer takes
  // those nodes in ascending level, then dZ (loads on bar[1], parity = the load's index & 1)
  const SeqNodes sn = kTree ? seq_nodes(ta, a.chunk0, seq, (a.len[seq] + a.C - 1) / a.C) : SeqNodes{};
  const int64_t n = sn.a0 + c;
  auto load_node = [&](int64_t slot) {  // node `slot` of head h into the state buffer (thread 0)
    mbar_expect_tx(&bar[1], DK * DV * 2);
    for (int cb = 0; cb < DV / 64; ++cb)
      tma_load_2d(smem + L::kS + cb * DK * 128, &mh, &bar[1], 64 * cb, int((slot * a.H + h) * DK));
  };
  auto load_dh = [&] {  // dH (the chunk-end cotangent; kTree: dZ) into the state buffer (thread 0)
    mbar_expect_tx(&bar[1], DK * DV * 2);
    for (int cb = 0; cb < DV / 64; ++cb) tma_load_2d(smem + L::kS + cb * DK * 128, &mdh, &bar[1], 64 * cb, srow);
  };
  if (tid == 0) {
    mbar_init(&bar[0], 1), mbar_init(&bar[1], 1);
    fence_barrier_init();
  }
  __syncthreads();
  if (tid == 0) {
    mbar_expect_tx(&bar[0], kChunk * (2 * DK + 2 * DV) * 2 + (kTree ? 0 : DK * DV * 2));  // Q, K, V, dO, Hp
    // bit i of `order`: input map i is swapped (input_map)
    auto in = [&](uint32_t off, const CUtensorMap* map, int i, int cb, int x) {
      load_rows(smem + off + cb * kChunk * 128, map, &bar[0], (order >> i) & 1, 64 * cb, r0, x);
    };
    for (int cb = 0; cb < DK / 64; ++cb) in(L::kQ, &mq, 0, cb, h / a.q_div), in(L::kK, &mk, 1, cb, h / a.k_div);
    for (int cb = 0; cb < DV / 64; ++cb) {
      in(L::kV, &mv, 2, cb, h / a.v_div), in(L::kdO, &mdo, 3, cb, h);
      if (!kTree) tma_load_2d(smem + L::kS + cb * DK * 128, &mh, &bar[0], 64 * cb, srow);
    }
    if (kTree) {  // the first level read, or dZ for chunk 0
      if (n > 0) load_node(first_read_slot(sn, n));
      else load_dh();
    }
    // the fp32 rows the epilogue adds (GradOut::add: the earlier primitives' dq, dk of a
    // composition), into L2 now rather than one dependent load per element at the end; dv's add
    // written by this block's own dk is not ready yet
    const int64_t prow = int64_t(h) * a.Ttot + r0;
    if (a.dq_out.add) prefetch_l2(a.dq_out.add + prow * DK, uint32_t(nr * DK * 4));
    if (a.dk_out.add) prefetch_l2(a.dk_out.add + prow * DK, uint32_t(nr * DK * 4));
  }
  const float* bg = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  if (tid < kChunk) bs[tid] = gate_at(bg, r0, tid, nr);
  __syncthreads();
  mbar_wait(&bar[0], 0);
  if (nr < kChunk) {  // rows past the sequence hold the next one's tokens (or TMA's zeros): zero them
    for (int e = tid; e < (kChunk - nr) * 8; e += kSm90Threads) {
      const int r = nr + e / 8, q = e % 8;
      const uint4 z = make_uint4(0, 0, 0, 0);
      for (int cb = 0; cb < DK / 64; ++cb) {
        *reinterpret_cast<uint4*>(smem + L::kQ + cb * kChunk * 128 + r * 128 + q * 16) = z;
        *reinterpret_cast<uint4*>(smem + L::kK + cb * kChunk * 128 + r * 128 + q * 16) = z;
      }
      for (int cb = 0; cb < DV / 64; ++cb) {
        *reinterpret_cast<uint4*>(smem + L::kV + cb * kChunk * 128 + r * 128 + q * 16) = z;
        *reinterpret_cast<uint4*>(smem + L::kdO + cb * kChunk * 128 + r * 128 + q * 16) = z;
      }
    }
    fence_async_smem();
    __syncthreads();
  }
  const float sc = float(a.scale), B = bs[kChunk - 1];
  const int i0 = 16 * w + g, i1 = i0 + 8;
  const float bi0 = bs[i0], bi1 = bs[i1];
  const int64_t rowbase = int64_t(h) * a.Ttot + r0;  // row of chunk row 0 in dg, lam, dlam (times nL)
  // kTree: lam of rows i0, i1 (rows >= nr read row nr - 1's; their products are zero)
  const float* lam0 = kTree ? ta.lam + (rowbase + min(i0, nr - 1)) * ta.nL : nullptr;
  const float* lam1 = kTree ? ta.lam + (rowbase + min(i1, nr - 1)) * ta.nL : nullptr;
  // P and dA: [C,dk]x[dk,C] and [C,dv]x[dv,C], masked and gated, to shared memory (16-bit)
  {
    float x[32], y[32];
    wg_fence();
    wgmma_chain<T, 64, 0, 0>(x, s0 + L::kQ, kChunk, s0 + L::kK, kChunk, DK / 16);
    wgmma_chain<T, 64, 0, 0>(y, s0 + L::kdO, kChunk, s0 + L::kV, kChunk, DV / 16);
    wg_commit();
    wg_wait<0>();
    fence_regs(x), fence_regs(y);
    // kTree: this thread's part of dlam[i, l] = sum over the bucket l = bitlen(i xor j) of row i of
    // dP o (scale Gamma o Q K^T), rows i0 (tl[0]) and i1 (tl[1])
    float tl[2][kLogChunk + 1] = {};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0, col = 8 * j + 2 * t;
        const float bi = hf ? bi1 : bi0;
        const bool in = i < nr;
        float g0 = in && col <= i ? mma::fexp(bi - bs[col]) : 0.f;
        float g1 = in && col + 1 <= i ? mma::fexp(bi - bs[col + 1]) : 0.f;
        float p0 = x[4 * j + 2 * hf] * sc * g0, p1 = x[4 * j + 2 * hf + 1] * sc * g1;
        if constexpr (kTree) {
          const float* lr = hf ? lam1 : lam0;
          const int l0 = 32 - __clz(i ^ col), l1 = 32 - __clz(i ^ (col + 1));
          const float t0 = y[4 * j + 2 * hf] * p0, t1 = y[4 * j + 2 * hf + 1] * p1;
#pragma unroll
          for (int l = 0; l <= kLogChunk; ++l) tl[hf][l] += (l0 == l ? t0 : 0.f) + (l1 == l ? t1 : 0.f);
          const float w0 = g0 != 0.f ? lr[l0] : 0.f, w1 = g1 != 0.f ? lr[l1] : 0.f;
          g0 *= w0, g1 *= w1, p0 *= w0, p1 *= w1;
        }
        const uint32_t off = swz(kChunk, i, col);
        *reinterpret_cast<uint32_t*>(smem + L::kP + off) = mma::pack2<T>(p0, p1);
        *reinterpret_cast<uint32_t*>(smem + L::kdA + off) =
            mma::pack2<T>(y[4 * j + 2 * hf] * g0, y[4 * j + 2 * hf + 1] * g1);
      }
    if constexpr (kTree) {  // the row's buckets over the quad, written where non-empty (the others are never read)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0;
#pragma unroll
        for (int l = 0; l <= kLogChunk; ++l) {
          float v = tl[hf][l];
          v += __shfl_xor_sync(0xffffffffu, v, 1), v += __shfl_xor_sync(0xffffffffu, v, 2);
          if (t == 0 && i < nr && (l == 0 || ((i >> (l - 1)) & 1))) ta.dlam[(rowbase + i) * ta.nL + l] = v;
        }
      }
    }
    fence_async_smem();
    __syncthreads();
  }
  // acc (N columns, the wgmma fragment) of rows < nr to the fp32 per-head buffer out [H][Ttot][N]
  // or the caller's tensor (GradOut; store_grad2)
  auto store = [&](float* out, const GradOut<T>& gt, const auto& acc) {
    constexpr int N = int(sizeof(acc) / sizeof(float)) * 2;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0;
        if (i < nr)
          store_grad2(out, N, gt, h, r0 + i, rowbase + i, 8 * j + 2 * t, acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
      }
  };
  // sum over this thread's columns of acc o X for rows i0 (d0) and i1 (d1); X a swizzled [C][N] tile
  auto dot_rows = [&](const auto& acc, uint32_t X, float& d0, float& d1) {
    constexpr int N = int(sizeof(acc) / sizeof(float)) * 2;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      const float2 x0 = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(smem + X + swz(kChunk, i0, 8 * j + 2 * t)));
      const float2 x1 = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(smem + X + swz(kChunk, i1, 8 * j + 2 * t)));
      d0 += acc[4 * j] * x0.x + acc[4 * j + 1] * x0.y;
      d1 += acc[4 * j + 2] * x1.x + acc[4 * j + 3] * x1.y;
    }
  };
  // acc <- diag(f_row) acc + s acc2 (rows i0, i1)
  auto combine = [&](auto& acc, const auto& acc2, float f0, float f1, float s) {
    constexpr int N = int(sizeof(acc) / sizeof(float)) * 2;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      acc[4 * j] = acc[4 * j] * f0 + s * acc2[4 * j], acc[4 * j + 1] = acc[4 * j + 1] * f0 + s * acc2[4 * j + 1];
      acc[4 * j + 2] = acc[4 * j + 2] * f1 + s * acc2[4 * j + 2];
      acc[4 * j + 3] = acc[4 * j + 3] * f1 + s * acc2[4 * j + 3];
    }
  };
  float dc0 = 0.f, dc1 = 0.f;  // this thread's partial dc of rows i0, i1
  uint32_t loads = 0;  // completed loads into the state buffer on bar[1] (kTree: the levels read)
  {  // dQ^ = diag(e^b) dO Hp^T + dA K: B = Hp K-major [dk][dv], K read MN-major
    float acc[DK / 2];
    if constexpr (kTree) {  // dA K, then per level read: acc += diag(lam^{p+m} e^{b+gap}) dO node_m^T
      wg_fence();
      wgmma_chain<T, DK, 0, 1>(acc, s0 + L::kdA, kChunk, s0 + L::kK, kChunk, kChunk / 16);
      wg_commit();
      wg_wait<0>();
      fence_regs(acc);
      for_each_read(ta, sn, n, h, a.H, [&](int m, int64_t, float gap) {
        float y[DK / 2];  // [C,dv]x[dv,dk]: node_m K-major [dk][dv]
        mbar_wait(&bar[1], loads & 1);
        ++loads;
        wg_fence();
        wgmma_chain<T, DK, 0, 0>(y, s0 + L::kdO, kChunk, s0 + L::kS, DK, DV / 16);
        wg_commit();
        wg_wait<0>();
        fence_regs(y);
        __syncthreads();  // node_m read by every warp: the next level, or dZ, may overwrite it
        if (tid == 0) {
          if (const uint64_t above = uint64_t(n) >> m) {  // the next level read: the next set bit of n
            const int m2 = m + 1 + ctz64u(above);
            load_node(sn.slot(m2, (n >> (m2 - 1)) - 1));
          } else {
            load_dh();
          }
        }
        const float f0 = mma::fexp(bi0 + gap), f1 = mma::fexp(bi1 + gap);
        const float c0 = lam0[kLogChunk + m] * f0, c1 = lam1[kLogChunk + m] * f1;
#pragma unroll
        for (int j = 0; j < DK / 8; ++j)
          acc[4 * j] += c0 * y[4 * j], acc[4 * j + 1] += c0 * y[4 * j + 1], acc[4 * j + 2] += c1 * y[4 * j + 2],
              acc[4 * j + 3] += c1 * y[4 * j + 3];
        float d0 = 0.f, d1 = 0.f;  // dlam[i, p+m] = scale e^{b_i+gap} q^_i . (dO node_m^T)_i
        dot_rows(y, L::kQ, d0, d1);
        d0 += __shfl_xor_sync(0xffffffffu, d0, 1), d0 += __shfl_xor_sync(0xffffffffu, d0, 2);
        d1 += __shfl_xor_sync(0xffffffffu, d1, 1), d1 += __shfl_xor_sync(0xffffffffu, d1, 2);
        if (t == 0) {
          if (i0 < nr) ta.dlam[(rowbase + i0) * ta.nL + kLogChunk + m] = sc * f0 * d0;
          if (i1 < nr) ta.dlam[(rowbase + i1) * ta.nL + kLogChunk + m] = sc * f1 * d1;
        }
      });
    } else {
      float acc2[DK / 2];
      wgmma_pair<T, DK, 0, 0, 0, 1>(acc, s0 + L::kdO, kChunk, s0 + L::kS, DK, DV / 16, acc2, s0 + L::kdA, s0 + L::kK);
      __syncthreads();  // Hp read by every warp: dH may overwrite it
      if (tid == 0) load_dh();
      combine(acc, acc2, mma::fexp(bi0), mma::fexp(bi1), 1.f);
    }
    float d0 = 0.f, d1 = 0.f;
    dot_rows(acc, L::kQ, d0, d1);
    dc0 += sc * d0, dc1 += sc * d1;
    const GradOut<T>& gq = a.dq_out;
    if (gq.rstd) {  // the raw q's gradient (GradOut): a row's y.dy over the quad that holds its columns
      for (float* v : {&d0, &d1}) *v += __shfl_xor_sync(0xffffffffu, *v, 1), *v += __shfl_xor_sync(0xffffffffu, *v, 2);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0;
        if (i >= nr) continue;
        const float yd = gq.mult * (hf ? d1 : d0), rs = gq.rstd[rowbase + i];
        T* o = gq.p + h * gq.hs + (r0 + i) * gq.ld;
#pragma unroll
        for (int j = 0; j < DK / 8; ++j) {
          const int col = 8 * j + 2 * t;
          const float2 y = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(smem + L::kQ + swz(kChunk, i, col)));
          *reinterpret_cast<uint32_t*>(o + col) = mma::pack2<T>((gq.mult * acc[4 * j + 2 * hf] - y.x * yd) * rs,
                                                                (gq.mult * acc[4 * j + 2 * hf + 1] - y.y * yd) * rs);
        }
      }
    } else {
      store(a.dq, a.dq_out, acc);
    }
  }
  const float w0 = mma::fexp(B - bi0), w1 = mma::fexp(B - bi1);
  constexpr bool fold = kFold;  // the value is the key (a.value_is_key): dk gains dv, no dv written
  static_assert(!kFold || DK == DV, "the value is the key only when dk = dv");
  mbar_wait(&bar[1], loads & 1);
  // kTree with a final-state cotangent: the last partial chunk's rows gain fin [C][d] (fp32, per
  // (sequence, head); loglinear_final_bwd_kernel) in dk (with kdot += k . fin, for ta.rho) and dv
  const bool fin_rows = kTree && ta.fin_dk && nr < kChunk;
  auto add_fin = [&](auto& acc, const float* fin, float* kdot) {
    constexpr int N = int(sizeof(acc) / sizeof(float)) * 2;
    const float* base = fin + (int64_t(seq) * a.H + h) * kChunk * N;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = hf ? i1 : i0, col = 8 * j + 2 * t;
        if (i < nr) {
          const float2 x = *reinterpret_cast<const float2*>(base + int64_t(i) * N + col);
          acc[4 * j + 2 * hf] += x.x, acc[4 * j + 2 * hf + 1] += x.y;
          if (kdot) {
            const float2 k = mma::unpack2<T>(*reinterpret_cast<const uint32_t*>(smem + L::kK + swz(kChunk, i, col)));
            *kdot += k.x * x.x + k.y * x.y;
          }
        }
      }
  };
  // this thread's part of <dH, H_end> (kTree: of ta.rho, the state-write term alone)
  const bool part = !kTree || ta.rho;
  float dpart = 0.f;
  {  // dK = diag(w) V dH^T + scale dA^T Q^: dH K-major [dk][dv]; dA and Q read MN-major
    float acc[DK / 2], acc2[DK / 2];
    wgmma_pair<T, DK, 0, 0, 1, 1>(acc, s0 + L::kV, kChunk, s0 + L::kS, DK, DV / 16, acc2, s0 + L::kdA, s0 + L::kQ);
    if (part) {  // sum_j w_j k_j . (V dH^T)_j, the state write's part of <dH, H_end>
      float d0 = 0.f, d1 = 0.f;
      dot_rows(acc, L::kK, d0, d1);
      dpart += w0 * d0 + w1 * d1;
    }
    combine(acc, acc2, w0, w1, sc);
    if (fin_rows) add_fin(acc, ta.fin_dk, part ? &dpart : nullptr);
    float d0 = 0.f, d1 = 0.f;
    dot_rows(acc, L::kK, d0, d1);  // dc reads the key-role gradient alone
    dc0 -= d0, dc1 -= d1;
    if constexpr (fold) {  // dK + dV, dV = diag(w) K dH + P^T dO: P^T dO added into acc in place
      wg_fence();
      wgmma_chain<T, DK, 0, 1>(acc2, s0 + L::kK, kChunk, s0 + L::kS, DK, DK / 16);
      wgmma_chain<T, DK, 1, 1>(acc, s0 + L::kP, kChunk, s0 + L::kdO, kChunk, kChunk / 16, true);
      wg_commit();
      wg_wait<0>();
      fence_regs(acc), fence_regs(acc2);
      combine(acc2, acc, w0, w1, 1.f);
      store(a.dk_, a.dk_out, acc2);
    } else {
      store(a.dk_, a.dk_out, acc);
    }
  }
  if constexpr (!fold) {  // dV = diag(w) K dH + P^T dO: dH read MN-major ([dk][dv], dv contiguous); P and dO MN-major
    float acc[DV / 2], acc2[DV / 2];
    wgmma_pair<T, DV, 0, 1, 1, 1>(acc, s0 + L::kK, kChunk, s0 + L::kS, DK, DK / 16, acc2, s0 + L::kP, s0 + L::kdO);
    combine(acc, acc2, w0, w1, 1.f);
    if (fin_rows) add_fin(acc, ta.fin_dv, nullptr);
    store(a.dv_, a.dv_out, acc);
  }
  dc0 += __shfl_xor_sync(0xffffffffu, dc0, 1), dc0 += __shfl_xor_sync(0xffffffffu, dc0, 2);
  dc1 += __shfl_xor_sync(0xffffffffu, dc1, 1), dc1 += __shfl_xor_sync(0xffffffffu, dc1, 2);
  if constexpr (!kTree) {  // e^B <dH, Hp>: 16-byte pieces p = tid + 128 x of the [DK][DV] state, row p / (DV / 8), columns
     // 8 (p % (DV / 8)) .. +8: Hp from hbuf (coalesced), dH from its swizzled tile
    constexpr int kUnits = DV / 8, kPieces = DK * kUnits / kSm90Threads;
    static_assert(kPieces * kSm90Threads == DK * kUnits, "whole 16-byte pieces per thread");
    const uint4* hp = reinterpret_cast<const uint4*>(a.hbuf + int64_t(srow) * DV);
    uint4 x[kPieces];
#pragma unroll
    for (int p = 0; p < kPieces; ++p) x[p] = hp[tid + p * kSm90Threads];
    float hd = 0.f;
#pragma unroll
    for (int p = 0; p < kPieces; ++p) {
      const int e = tid + p * kSm90Threads, r = e / kUnits;
      const uint4 y = *reinterpret_cast<const uint4*>(smem + L::kS + swz(DK, r, 8 * (e % kUnits)));
      const uint32_t xs[4] = {x[p].x, x[p].y, x[p].z, x[p].w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 u = mma::unpack2<T>(xs[q]), v = mma::unpack2<T>(ys[q]);
        hd += u.x * v.x + u.y * v.y;
      }
    }
    dpart += mma::fexp(B) * hd;
  }
  // dg = the reverse cumsum of dc in the chunk + <dH, H_end>, through the P tile (read by now)
  float* red = reinterpret_cast<float*>(smem + L::kP);  // [C] dc, [4] parts of <dH, H_end>
  dpart = warp_sum(dpart);
  __syncthreads();  // every warp's wgmmas that read P are complete
  if (t == 0) red[i0] = dc0, red[i1] = dc1;
  if (lane == 0) red[kChunk + w] = dpart;
  __syncthreads();
  const float D = red[kChunk] + red[kChunk + 1] + red[kChunk + 2] + red[kChunk + 3];
  if (kTree || a.dg_rows) {  // the rows' dc, the last row's with <dH, H_end> (kTree: D to ta.rho)
    const float Dl = kTree ? 0.f : D;
    if (t == 0) {
      if (i0 < nr) a.dg[rowbase + i0] = dc0 + (i0 == nr - 1 ? Dl : 0.f);
      if (i1 < nr) a.dg[rowbase + i1] = dc1 + (i1 == nr - 1 ? Dl : 0.f);
    }
    if (kTree && ta.rho && tid == 0) ta.rho[cg * a.H + h] = D;
  } else if (w == 0) {
    chunk_dg(a.dg + rowbase, 2 * lane < nr ? red[2 * lane] : 0.f, 2 * lane + 1 < nr ? red[2 * lane + 1] : 0.f, D, nr);
  }
#else
  __trap();  // launched only where runs_sm90a() holds
#endif
}


}  // namespace

// Once gla.cu has chosen this tier (heuristics::gla_sm90_bwd_chunk: dk, dv of 64 or 128, the
// per-chunk states given, or the tree's nodes and dZ); false where this device does not run the
// build's sm_90a code or TMA cannot describe the operands.
template <class T>
bool gla_bwd_chunk_sm90(const GlaArgs<T>& a, cudaStream_t stream, const TreeArgs* tree) {
  const int dk = a.dk, dv = a.dv;
  auto pick = [&](auto kernel, size_t bytes) -> bool {
    if (!ready_sm90(kernel, bytes)) return false;
    if (dry_run()) return true;  // dry run: workspace_size (no workspace either way)
    // q, k, v, dO: input_map; hbuf, dhbuf (the tree: node16, dz16): state_map
    CUtensorMap m[6];
    unsigned order = 0;
    bool sw_do = false;
    const T* st = tree ? static_cast<const T*>(tree->node16) : a.hbuf;
    const T* dst = tree ? static_cast<const T*>(tree->dz16) : a.dhbuf;
    if (!qkv_maps(a, m, order) || !input_map(&m[3], sw_do, a.dO, a.dO_ld, a.dO_hs, dv, a.H, a.Ttot) ||
        !state_map(&m[4], a, st, dk, tree ? tree->slots : a.nchunks) || !state_map(&m[5], a, dst, dk))
      return false;
    order |= unsigned(sw_do) << 3;
    kernel<<<dim3(unsigned(a.nchunks), unsigned(a.H)), kSm90Threads, bytes, stream>>>(m[0], m[1], m[2], m[3], m[4],
                                                                                       m[5], order, a,
                                                                                       tree ? *tree : TreeArgs{});
    HILA_CUDA_CHECK_LAUNCH();
    return true;
  };
  return HILA_HEADDIM_SWITCH(dk, DK, [&] {
    if (tree)  // dk and dv apart (bwd_chunk_sm80.cu's tree form does not fold either)
      return HILA_HEADDIM_SWITCH(dv, DV, [&] {
        return pick(bwd_chunk_sm90_kernel<T, DK, DV, false, true>, BwdSm90Layout<DK, DV>::kBytes);
      });
    if (a.value_is_key)  // the inner S primitive: dk = dv
      return pick(bwd_chunk_sm90_kernel<T, DK, DK, true>, BwdSm90Layout<DK, DK>::kBytes);
    return HILA_HEADDIM_SWITCH(dv, DV, [&] { return pick(bwd_chunk_sm90_kernel<T, DK, DV>, BwdSm90Layout<DK, DV>::kBytes); });
  });
}

template bool gla_bwd_chunk_sm90<__nv_bfloat16>(const GlaArgs<__nv_bfloat16>&, cudaStream_t, const TreeArgs*);
template bool gla_bwd_chunk_sm90<__half>(const GlaArgs<__half>&, cudaStream_t, const TreeArgs*);

}  // namespace hila::cuda
