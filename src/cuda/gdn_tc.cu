// SPDX-License-Identifier: Apache-2.0
// Plain Gated DeltaNet (gdn) forward on tensor cores, in the fla form of LOGLINEAR_SPEC §6.4 (the
// gated UT inverse, which equals the plain recurrence; oracle gdn_chunk_plain). Per chunk of
// C = 64 rows, with the chunk-local cumsum b of the log-gates and B = b[C-1]:
//   Tg = (I + tril_-1(diag(beta) (Gam o K K^T)))^-1     [C,C], Gam_ij = e^{b_i - b_j}
//   W  = Tg diag(beta e^b) K     [C,C]x[C,dk]          U = Tg diag(beta) V     [C,C]x[C,dv]  (fp32)
// along the chunks of a sequence, with S the state entering the chunk:
//   Vn = U - W S                 [C,dk]x[dk,dv]        S <- e^B S + K^T diag(e^{B-b}) Vn
// and the output is GLA's with Vn for the values (gla_tc.cu output kernel):
//   O  = diag(e^b) Q^ S + (tril(Q^ K^T) o Gam) Vn      (Q^ = scale q)
// Kernels: wy_kernel (chunk-parallel: Tg by forward substitution in fp32, W and U by mma),
// delta_sweep_kernel (sequential over the chunks of one (sequence x head, 64 value columns), the
// fp32 state in registers), then the GLA output kernel. W, Vn and the state entering each chunk are
// stored in 16 bits as GEMM operands; Tg, U (Vn = U - W S may cancel), the state and every
// accumulation are fp32.
// Chunks start at each sequence's first row: plain GDN does not depend on absolute positions.
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "cuda/delta.cuh"
#include "cuda/gla.cuh"
#include "cuda/mma.cuh"
#include "cuda/pack.cuh"
#include "cuda/runtime.cuh"
#include "cuda/tile.cuh"

namespace hila::cuda {

namespace {

constexpr int kThreads = 256;      // 8 warps
constexpr int kMaxD = 128;         // dk (padded) held by one block: one 16-row state slice per warp
constexpr int kVT = 64;            // value columns per sweep block
constexpr int kLd = kVT + 8;       // padded smem row of a 64-column 16-bit tile
constexpr int kLdA = kChunk + 1;   // fp32 [C][C] rows
constexpr int kLdU = kVT + 4;      // fp32 [C][64] rows (16-byte aligned)

// Padded smem row (16-bit elements) of a [rows][d] tile: 16-byte rows, staggered banks.
__host__ __device__ constexpr int ld_of(int d) { return d + 8; }

// Tg, W and U of one chunk; grid (nchunks, H), 8 warps.
template <class T>
struct WyTiles {
  T *K, *V, *Tg;
  float *A, *beta, *b;
  int ldk, ldv;
  __host__ __device__ WyTiles(char* base, int dk, int dv, size_t* bytes = nullptr) : ldk(ld_of(dk)), ldv(ld_of(dv)) {
    size_t o = 0;
    auto take = [&](size_t n) {
      char* p = base ? base + o : nullptr;
      o += (n + 127) / 128 * 128;
      return p;
    };
    K = reinterpret_cast<T*>(take(size_t(kChunk) * ldk * sizeof(T)));
    V = reinterpret_cast<T*>(take(size_t(kChunk) * ldv * sizeof(T)));
    Tg = reinterpret_cast<T*>(take(size_t(kChunk) * kLd * sizeof(T)));
    A = reinterpret_cast<float*>(take(size_t(kChunk) * kLdA * sizeof(float)));
    beta = reinterpret_cast<float*>(take(kChunk * sizeof(float)));
    b = reinterpret_cast<float*>(take(kChunk * sizeof(float)));
    if (bytes) *bytes = o;
  }
};

template <class T>
__global__ void __launch_bounds__(kThreads) wy_kernel(GlaArgs<T> a, const float* beta, T* W, float* U) {
  extern __shared__ __align__(128) char smem[];
  WyTiles<T> s(smem, a.dk, a.dv);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t cg = blockIdx.x;
  const int h = blockIdx.y, seq = a.chunk_seq[cg];
  const int64_t c = cg - a.chunk0[seq], r0 = a.row0[seq] + c * kChunk;
  const int nr = rows_in(a.len[seq], c);
  tc::async_rows(s.K, s.ldk, a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk), row_ld(a.k_ld, a.dk), r0, nr, 0,
                 a.dk, kChunk);
  tc::async_rows(s.V, s.ldv, a.v + (h / a.v_div) * head_stride(a.v_hs, a.Ttot, a.dv), row_ld(a.v_ld, a.dv), r0, nr, 0,
                 a.dv, kChunk);
  tc::cp_async_commit();
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    s.beta[i] = i < nr ? beta[int64_t(h) * a.Ttot + r0 + i] : 0.f;
    s.b[i] = gate_at(a.b ? a.b + int64_t(h) * a.Ttot : nullptr, r0, i, nr);
  }
  tc::cp_async_wait<0>();
  __syncthreads();
  {  // A = tril_-1(diag(beta) (Gam o K K^T)), fp32: warp w rows 16 (w % 4), columns 32 (w / 4)
    const int m0 = 16 * (w & 3), n0 = 32 * (w >> 2);
    float x[4][4];
    tc::zero(x);
    if (n0 <= m0 + 15) tc::warp_gemm<T, 4, false, false>(x, s.K, s.ldk, m0, s.K, s.ldk, n0, 4, 0, a.dk);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = m0 + g + (e >> 1) * 8, col = n0 + 8 * j + 2 * t + (e & 1);
        s.A[i * kLdA + col] = col < i ? s.beta[i] * __expf(s.b[i] - s.b[col]) * x[j][e] : 0.f;
      }
  }
  __syncthreads();
  // Tg = (I + A)^-1 by forward substitution, row by row: Tg[i][j] = -sum_{j<=m<i} A[i][m] Tg[m][j]
  // (Tg[j][j] = 1), in place over A's rows (rows < i already hold Tg). Thread 4j + p sums the m = p
  // mod 4 terms of column j; the four partial sums meet by shuffles. Row i of A is read by all before
  // the barrier that precedes its overwrite.
  static_assert(kThreads == 4 * kChunk, "four threads per column");
  for (int i = 1; i < kChunk; ++i) {
    const int j = threadIdx.x >> 2, part = threadIdx.x & 3;
    float x = 0.f;
    if (j < i)
      for (int m = j + part; m < i; m += 4) x -= s.A[i * kLdA + m] * (m == j ? 1.f : s.A[m * kLdA + j]);
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    __syncthreads();  // every thread has read row i of A
    if (part == 0 && j < i) s.A[i * kLdA + j] = x;
    __syncthreads();
  }
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {  // the diagonal and the upper triangle
    const int i = e / kChunk, j = e % kChunk;
    if (j >= i) s.A[i * kLdA + j] = j == i ? 1.f : 0.f;
  }
  __syncthreads();
  // 16-bit operands: Tg, diag(beta e^b) K (in place of K) and diag(beta) V (in place of V)
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int i = e / kChunk, j = e % kChunk;
    s.Tg[i * kLd + j] = to<T>(s.A[i * kLdA + j]);
  }
  for (int e = threadIdx.x; e < kChunk * a.dk; e += blockDim.x) {
    const int i = e / a.dk, j = e % a.dk;
    s.K[i * s.ldk + j] = to<T>(float(s.K[i * s.ldk + j]) * s.beta[i] * __expf(s.b[i]));
  }
  for (int e = threadIdx.x; e < kChunk * a.dv; e += blockDim.x) {
    const int i = e / a.dv, j = e % a.dv;
    s.V[i * s.ldv + j] = to<T>(float(s.V[i * s.ldv + j]) * s.beta[i]);
  }
  __syncthreads();
  // W = Tg (beta e^b K)  [C,C]x[C,dk],  U = Tg (beta V)  [C,C]x[C,dv]: warp w rows 16 (w % 4),
  // column blocks of 64 from 64 (w / 4) in steps of 128
  const int m0 = 16 * (w & 3);
  auto product = [&](const T* X, int ldx, int d, auto* out) {
    for (int c0 = 64 * (w >> 2); c0 < d; c0 += 128) {
      const int nt = min(8, (d - c0) / 8);
      float acc[8][4];
      tc::zero(acc);
      tc::warp_gemm<T, 8, false, true>(acc, s.Tg, kLd, m0, X, ldx, c0, nt, 0, kChunk);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < nt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int i = m0 + g + 8 * hf;
            if (i >= nr) continue;
            auto* o = out + (int64_t(h) * a.Ttot + r0 + i) * d + c0 + 8 * j + 2 * t;
            if constexpr (std::is_same_v<std::remove_pointer_t<decltype(out)>, float>)
              *reinterpret_cast<float2*>(o) = make_float2(acc[j][2 * hf], acc[j][2 * hf + 1]);
            else
              *reinterpret_cast<uint32_t*>(o) = tc::pack2<T>(acc[j][2 * hf], acc[j][2 * hf + 1]);
          }
    }
  };
  product(s.K, s.ldk, a.dk, W);
  product(s.V, s.ldv, a.dv, U);
}

// The state sweep; grid (N x H, 1, dv tiles of 64), 8 warps, warp w owns state rows [16w, 16w+16)
// (those < dk) and columns [v0, v0+64) in registers. Per chunk, double-buffered W, K [C, dk]
// (16-bit), U [C, 64] (fp32) and the gates arrive by cp.async; then
//   (1) S -> 16-bit Ss (and hbuf: the state entering the chunk, for the output kernel)
//   (2) Vn = U - W Ss    [C,dk]x[dk,64]: warp w rows 16 (w % 4), columns 32 (w / 4); to Vns and Vn
//   (3) S = e^B S + K^T diag(e^{B-b}) Vns
constexpr int kSweepStages = 2;
template <class T>
struct SweepTiles {
  T *Ss, *Vns;
  int ldk;
  size_t stage_bytes;
  char* base;
  __host__ __device__ SweepTiles(char* base_, int dk, size_t* bytes = nullptr) : ldk(ld_of(dk)), base(base_) {
    stage_bytes = size_t(2) * kChunk * ldk * sizeof(T) + (size_t(kChunk) * kLdU + kChunk) * sizeof(float);
    stage_bytes = (stage_bytes + 127) / 128 * 128;
    char* p = base ? base + kSweepStages * stage_bytes : nullptr;
    Ss = reinterpret_cast<T*>(p);
    Vns = reinterpret_cast<T*>(p ? p + size_t(dk) * kLd * sizeof(T) : nullptr);
    if (bytes) *bytes = kSweepStages * stage_bytes + (size_t(dk) + kChunk) * kLd * sizeof(T);
  }
  __device__ T* W(int st) const { return reinterpret_cast<T*>(base + st * stage_bytes); }
  __device__ T* K(int st) const { return W(st) + kChunk * ldk; }
  __device__ float* U(int st) const { return reinterpret_cast<float*>(K(st) + kChunk * ldk); }
  __device__ float* b(int st) const { return U(st) + kChunk * kLdU; }
};

template <class T>
__global__ void __launch_bounds__(kThreads) delta_sweep_kernel(GlaArgs<T> a, const T* W, const float* U, T* Vn) {
  extern __shared__ __align__(128) char smem[];
  SweepTiles<T> s(smem, a.dk);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int seq = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int v0 = blockIdx.z * kVT, bv = min(kVT, a.dv - v0), nt = bv / 8;
  const bool active = 16 * w < a.dk;
  const int64_t len = a.len[seq], row0 = a.row0[seq];
  const int nch = int((len + kChunk - 1) / kChunk);
  const T* Wh = W + int64_t(h) * a.Ttot * a.dk;
  const float* Uh = U + int64_t(h) * a.Ttot * a.dv;
  const T* Kh = a.k + (h / a.k_div) * head_stride(a.k_hs, a.Ttot, a.dk);
  const int64_t kld = row_ld(a.k_ld, a.dk);
  const float* b = a.b ? a.b + int64_t(h) * a.Ttot : nullptr;
  const int64_t sidx = (int64_t(seq) * a.H + h) * a.dk * a.dv;  // [N][H][dk][dv]
  float acc[8][4];  // rows 16w + g (+8), columns v0 + 8j + 2t (+1)
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 16 * w + g + (e >> 1) * 8, col = v0 + 8 * j + 2 * t + (e & 1);
      acc[j][e] = (a.h0 && active && j < nt) ? float(a.h0[sidx + int64_t(r) * a.dv + col]) : 0.f;
    }
  auto issue = [&](int c) {
    const int st = c % kSweepStages;
    const int64_t r0 = row0 + int64_t(c) * kChunk;
    const int nr = rows_in(len, c);
    tc::async_rows(s.W(st), s.ldk, Wh, a.dk, r0, nr, 0, a.dk, kChunk);
    tc::async_rows(s.K(st), s.ldk, Kh, kld, r0, nr, 0, a.dk, kChunk);
    for (int e = threadIdx.x; e < kChunk * (bv / 4); e += blockDim.x) {  // U [C, bv] fp32, rows >= nr zero
      const int i = e / (bv / 4), j = (e % (bv / 4)) * 4;
      const bool in = i < nr;
      tc::cp_async16(s.U(st) + i * kLdU + j, in ? Uh + (r0 + i) * a.dv + v0 + j : Uh, in ? 16 : 0);
    }
    if (threadIdx.x < kChunk) {
      const bool in = b && int(threadIdx.x) < nr;
      tc::cp_async4(s.b(st) + threadIdx.x, in ? static_cast<const void*>(b + r0 + threadIdx.x) : Wh, in ? 4 : 0);
    }
    tc::cp_async_commit();
  };
  if (nch > 0) issue(0);
  else tc::cp_async_commit();
  for (int c = 0; c < nch; ++c) {
    tc::cp_async_wait<0>();
    __syncthreads();  // chunk c has landed; chunk c-1's reads of Ss, Vns and the other stage are done
    if (c + 1 < nch) issue(c + 1);
    else tc::cp_async_commit();
    const int st = c % kSweepStages, nr = rows_in(len, c);
    const int64_t r0 = row0 + int64_t(c) * kChunk;
    // (1) the state entering the chunk, 16-bit
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (active && j < nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = 16 * w + g + 8 * hf, col = 8 * j + 2 * t;
          const uint32_t x = tc::pack2<T>(acc[j][2 * hf], acc[j][2 * hf + 1]);
          *reinterpret_cast<uint32_t*>(s.Ss + r * kLd + col) = x;
          if (a.hbuf)
            *reinterpret_cast<uint32_t*>(a.hbuf + ((a.chunk0[seq] + c) * a.H + h) * int64_t(a.dk) * a.dv +
                                         int64_t(r) * a.dv + v0 + col) = x;
        }
    if (nt < 8)  // columns past the tile's end: zero, so the Vn product reads no stale values
      for (int e = threadIdx.x; e < a.dk * (kVT - bv); e += blockDim.x)
        s.Ss[(e / (kVT - bv)) * kLd + bv + e % (kVT - bv)] = to<T>(0.f);
    __syncthreads();
    {  // (2) Vn = U - W Ss
      const int m0 = 16 * (w & 3), n0 = 32 * (w >> 2);
      float x[4][4];
      tc::zero(x);
      tc::warp_gemm<T, 4, false, true>(x, s.W(st), s.ldk, m0, s.Ss, kLd, n0, 4, 0, a.dk);
      const float* Ut = s.U(st);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = m0 + g + 8 * hf, col = n0 + 8 * j + 2 * t;
          const float2 u = col < bv ? *reinterpret_cast<const float2*>(Ut + i * kLdU + col) : make_float2(0.f, 0.f);
          const uint32_t y = tc::pack2<T>(u.x - x[j][2 * hf], u.y - x[j][2 * hf + 1]);  // columns >= bv: 0
          *reinterpret_cast<uint32_t*>(s.Vns + i * kLd + col) = y;
          if (i < nr && col < bv) *reinterpret_cast<uint32_t*>(Vn + (int64_t(h) * a.Ttot + r0 + i) * a.dv + v0 + col) = y;
        }
    }
    __syncthreads();
    // (3) S = e^B S + K^T diag(e^{B-b}) Vn   [dk, C] x [C, 64]
    const float* bt = s.b(st);
    const float B = bt[nr - 1], decay = __expf(B);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] *= decay;
    if (active)
      tc::warp_gemm_tn_weighted<T, 8>(acc, s.K(st), s.ldk, 16 * w, s.Vns, kLd, nt, kChunk,
                                      [&](int k) { return __expf(B - bt[k]); });
  }
  if (a.ht && active) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 16 * w + g + (e >> 1) * 8, col = v0 + 8 * j + 2 * t + (e & 1);
          a.ht[sidx + int64_t(r) * a.dv + col] = acc[j][e];
        }
  }
}

// q^ or k rows of [X][Ttot][dp] (first d columns) -> x / sqrt(|x|^2 + kL2Eps) (LOGLINEAR_SPEC §6.1), in place.
template <class T>
__global__ void l2norm_rows(T* x, int64_t rows, int d, int dp) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows;
       r += int64_t(gridDim.x) * blockDim.x / 32) {
    T* row = x + r * dp;
    float ss = 0.f;
    for (int j = lane; j < d; j += 32) ss += float(row[j]) * float(row[j]);
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = 1.f / sqrtf(ss + float(kL2Eps));
    for (int j = lane; j < d; j += 32) row[j] = to<T>(float(row[j]) * inv);
  }
}

size_t wy_smem(int dk, int dv) {
  size_t bytes = 0;
  WyTiles<__nv_bfloat16>(nullptr, dk, dv, &bytes);
  return bytes;
}
size_t sweep_smem(int dk) {
  size_t bytes = 0;
  SweepTiles<__nv_bfloat16>(nullptr, dk, &bytes);
  return bytes;
}

}  // namespace

template <class T>
bool gdn_tc_usable(const detail::Resolved& r) {
  if constexpr (!kTensorCore<T>) {
    return false;
  } else {
    if (r.cfg.op != Op::gdn) return false;
    if (const char* env = std::getenv("HILA_GDN_TC"); env && std::strcmp(env, "0") == 0) return false;
    const int dk = pad16(r.dk), dv = pad16(r.dv);
    if (dk > kMaxD || dv > 256) return false;
    int dev = 0, optin = 0;
    HILA_CUDA_CHECK(cudaGetDevice(&dev));
    HILA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return std::max({wy_smem(dk, dv), sweep_smem(dk), tc_output_smem(dk, dv, sizeof(T))}) <= size_t(optin);
  }
}

template <class T>
void gdn_tc_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) {
  if constexpr (kTensorCore<T>) {
    using R = Acc<T>;
    const SeqTables seqs(r, s, kChunk);
    const int dk = pad16(r.dk), dv = pad16(r.dv), rep = int(r.H / r.G);
    const int64_t Ttot = r.B * r.T, N = int64_t(r.seqs.size()), NH = N * r.H;
    // packed operands: q, k [G][Ttot][dk] (l2-normalised when asked), v [H][Ttot][dv], g, beta [H][Ttot]
    DevBuf<T> q(size_t(r.G * Ttot * dk), s), k(size_t(r.G * Ttot * dk), s), v(size_t(r.H * Ttot * dv), s);
    DevBuf<R> g(r.gate_cols > 0 ? size_t(r.H * Ttot) : 0, s), beta(size_t(r.H * Ttot), s);
    HILA_LAUNCH(pack_rows<T>, r.G * Ttot * dk, s, q.get(), Strided(p.q), r.T, r.G, Ttot, int(r.dk), dk, -1);
    HILA_LAUNCH(pack_rows<T>, r.G * Ttot * dk, s, k.get(), Strided(p.k), r.T, r.G, Ttot, int(r.dk), dk, -1);
    HILA_LAUNCH(pack_rows<T>, r.H * Ttot * dv, s, v.get(), Strided(p.v), r.T, r.H, Ttot, int(r.dv), dv, -1);
    if (r.cfg.qk_l2norm && Ttot > 0 && !dry_run()) {  // one warp per row (dry run: workspace_size)
      for (T* x : {q.get(), k.get()}) {
        l2norm_rows<T><<<grid_for(r.G * Ttot * 32), 256, 0, s>>>(x, r.G * Ttot, int(r.dk), dk);
        HILA_CUDA_CHECK_LAUNCH();
      }
    }
    if (r.gate_cols > 0) HILA_LAUNCH(pack_gates<R>, r.H * Ttot, s, g.get(), Strided(p.g), r.T, r.H, Ttot, 0);
    HILA_LAUNCH(pack_gates<R>, r.H * Ttot, s, beta.get(), Strided(p.beta), r.T, r.H, Ttot, 0);
    GlaArgs<T> a;
    a.q = q.get(), a.k = k.get(), a.q_div = a.k_div = rep, a.v_div = 1;
    a.g = g.get(), a.H = int(r.H), a.N = int(N), a.Ttot = Ttot, a.dk = dk, a.dv = dv;
    a.row0 = seqs.d_row0.get(), a.len = seqs.d_len.get(), a.chunk0 = seqs.d_chunk0.get();
    a.chunk_seq = seqs.d_chunk_seq.get(), a.nchunks = seqs.nchunks;
    a.scale = R(r.scale);
    DevBuf<R> bsum(a.g ? size_t(r.H * Ttot) : 0, s);
    if (a.g) {
      gla_chunk_cumsum(a, bsum.get(), s);
      a.b = bsum.get();
    }
    DevBuf<R> h0(p.init.H.defined() ? size_t(NH * dk * dv) : 0, s), ht(size_t(NH * dk * dv), s);
    if (p.init.H.defined())
      HILA_LAUNCH(pack_state<R>, NH * dk * dv, s, h0.get(), Strided(p.init.H), NH, r.H, int(r.dk), int(r.dv), dk, dv);
    a.h0 = h0.get(), a.ht = ht.get();
    a.v = v.get();
    DevBuf<T> W(size_t(r.H * Ttot * dk), s), Vn(size_t(r.H * Ttot * dv), s);
    DevBuf<float> U(size_t(r.H * Ttot * dv), s);
    DevBuf<T> hbuf(size_t(seqs.nchunks * r.H * dk * dv), s), O(size_t(r.H * Ttot * dv), s);
    if (seqs.nchunks > 0) {
      const size_t wb = wy_smem(dk, dv);
      set_smem(wy_kernel<T>, wb);
      if (!dry_run()) {  // dry run: workspace_size
        wy_kernel<T><<<dim3(unsigned(seqs.nchunks), unsigned(r.H)), kThreads, wb, s>>>(a, beta.get(), W.get(), U.get());
        HILA_CUDA_CHECK_LAUNCH();
      }
    }
    a.hbuf = hbuf.get();
    if (NH > 0) {
      const size_t sb = sweep_smem(dk);
      set_smem(delta_sweep_kernel<T>, sb);
      if (!dry_run()) {  // dry run: workspace_size
        delta_sweep_kernel<T><<<dim3(unsigned(NH), 1, unsigned((dv + kVT - 1) / kVT)), kThreads, sb, s>>>(
            a, W.get(), U.get(), Vn.get());
        HILA_CUDA_CHECK_LAUNCH();
      }
    }
    if (seqs.nchunks > 0) {  // O = GLA output with the values Vn
      a.v = Vn.get(), a.o = O.get();
      tc_output(a, s);
      HILA_LAUNCH(unpack_rows<T>, r.H * Ttot * r.dv, s, Strided(p.o), O.get(), r.T, r.H, 1, Ttot, int(r.dv), dv, R(1));
    }
    const StateView& fin = p.final_state;
    if (fin.H.defined())
      HILA_LAUNCH(unpack_state<R>, NH * r.dk * r.dv, s, Strided(fin.H), ht.get(), NH, r.H, int(r.dk), int(r.dv), dk, dv);
    if (fin.pos.defined()) {
      std::vector<int64_t> pos;
      for (const auto& x : r.seqs) pos.push_back(x.n0 + x.len);
      upload_async(fin.pos.data, pos.data(), pos.size() * 8, s);
    }
  }
}

#define HILA_INSTANTIATE(T)                                                                       \
  template bool gdn_tc_usable<T>(const detail::Resolved&);                                        \
  template void gdn_tc_forward<T>(const detail::Resolved&, const ForwardParams&, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda
