// SPDX-License-Identifier: Apache-2.0
// Warp-level tensor-core pieces of the fast (bf16/fp16) kernels: mma.sync m16n8k16 with fp32
// accumulators, ldmatrix fragment loads from shared memory and cp.async copies. Runs on sm_80+;
// on sm_90a the GLA sweeps and backward chunk kernel use wgmma and TMA instead (sm90.cuh).
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4), which the kernels rely on to
// scale rows and columns in registers:
//   A [16, 16]: a[0] = (g, 2t..2t+1)  a[1] = (g+8, 2t..)  a[2] = (g, 2t+8..)  a[3] = (g+8, 2t+8..)
//   B [16,  8]: b[0] = (k 2t..2t+1, n g)  b[1] = (k 2t+8.., n g)
//   C [16,  8]: c[0..1] = (g, 2t..2t+1)  c[2..3] = (g+8, 2t..2t+1)
// An accumulator pair of n-tiles (2j, 2j+1) converted to 16-bit is the A fragment of k-tile j.
#pragma once
#include "cuda/common.cuh"

namespace hila::cuda::mma {

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}
template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
  else return __half22float2(*reinterpret_cast<__half2*>(&x));
}

// e^x on the special-function unit with denormals flushed: one FMUL and one MUFU.EX2 (__expf
// adds a range fix-up for results below 2^-126, which the gate weights never need).
#ifdef HILA_CUDA_EMU
inline float fexp(float x) { return __expf(x); }
#else
__device__ __forceinline__ float fexp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}
#endif

#ifdef HILA_CUDA_EMU  // host emulator (tools/cuda_emu): warp-cooperative versions in its shim
template <class T>
inline void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { emu::mma_m16n8k16<T>(d, a, b0, b1); }
inline void ldsm_x4(uint32_t (&r)[4], const void* p) { emu::ldmatrix_x4(r, p, false); }
inline void ldsm_x4_t(uint32_t (&r)[4], const void* p) { emu::ldmatrix_x4(r, p, true); }
#else
// d += a b  ([16,16] x [16,8], fp32 accumulate)
template <class T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
#endif  // HILA_CUDA_EMU

// Fragment loads from a 16-bit tile in shared memory with leading dimension ld (elements).
// A = X[m0.., k0..] with X stored row-major [m][k].
template <class T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* X, int ld, int m0, int k0) {
  const int l = threadIdx.x & 31;
  ldsm_x4(a, X + (m0 + (l & 15)) * ld + k0 + ((l >> 4) << 3));
}
// A = Xt^T with Xt stored row-major [k][m] (e.g. K^T from K [token][dk]).
template <class T>
__device__ __forceinline__ void load_a_t(uint32_t (&a)[4], const T* Xt, int ld, int m0, int k0) {
  const int l = threadIdx.x & 31;
  ldsm_x4_t(a, Xt + (k0 + (l & 7) + ((l >> 4) << 3)) * ld + m0 + (((l >> 3) & 1) << 3));
}
// B fragments of two n-tiles (n0..n0+7, n0+8..n0+15) over k0..k0+15, B = Y^T with Y stored
// row-major [n][k] (e.g. B = K^T from K [token][dk] in Q K^T): b[0..1] tile n0, b[2..3] tile n0+8.
template <class T>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* Y, int ld, int n0, int k0) {
  const int l = threadIdx.x & 31;
  ldsm_x4(b, Y + (n0 + (l & 7) + ((l >> 4) << 3)) * ld + k0 + (((l >> 3) & 1) << 3));
}
// Same, with B stored row-major [k][n] (e.g. V [token][dv] in P V).
template <class T>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* B, int ld, int n0, int k0) {
  const int l = threadIdx.x & 31;
  ldsm_x4_t(b, B + (k0 + (l & 7) + (((l >> 3) & 1) << 3)) * ld + n0 + ((l >> 4) << 3));
}

// A lane's place in an m16n8 accumulator tile (the C / D fragment above; a wgmma m64 accumulator
// repeats it per warp, rows 16w..): element e = 2 hf + c (c = e & 1) of n-tile j sits at row
// m0 + g + 8 hf and column n0 + 8 j + 2 t + c, with g = lane / 4, t = lane % 4.
//   row / col (row_of / col_of: by element e) give the indices;
//   at<I>(base, ...) gives base + I(row) * ld + col, the element's place in a row-major matrix of
//   leading dimension ld (I: the type the row is widened to; base a pointer or an offset), and
//   off<I>(...) the same offset without a base. They add the column's terms one by one, as the
//   address expressions they replace did, so that the kernels compile to the same code.
struct Frag {
  int g, t;
  __device__ __forceinline__ int row(int m0, int hf) const { return m0 + g + 8 * hf; }
  __device__ __forceinline__ int col(int n0, int j) const { return n0 + 8 * j + 2 * t; }
  __device__ __forceinline__ int row_of(int m0, int e) const { return m0 + g + (e >> 1) * 8; }
  __device__ __forceinline__ int col_of(int n0, int j, int e) const { return n0 + 8 * j + 2 * t + (e & 1); }
  template <class I, class B, class L>
  __device__ __forceinline__ auto at(B base, int m0, int hf, L ld, int n0, int j) const {
    return base + I(m0 + g + 8 * hf) * ld + n0 + 8 * j + 2 * t;
  }
  template <class I, class B, class L>
  __device__ __forceinline__ auto at_of(B base, int m0, int e, L ld, int n0, int j) const {
    return base + I(m0 + g + (e >> 1) * 8) * ld + n0 + 8 * j + 2 * t + (e & 1);
  }
  template <class I, class L>
  __device__ __forceinline__ I off(int m0, int hf, L ld, int n0, int j) const {
    return I(m0 + g + 8 * hf) * ld + n0 + 8 * j + 2 * t;
  }
  template <class I, class L>
  __device__ __forceinline__ I off_of(int m0, int e, L ld, int n0, int j) const {
    return I(m0 + g + (e >> 1) * 8) * ld + n0 + 8 * j + 2 * t + (e & 1);
  }
};

template <int NT>
__device__ __forceinline__ void zero(float (&x)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) x[j][0] = x[j][1] = x[j][2] = x[j][3] = 0.f;
}

// acc[16 x 8*NT] += A B over k in [0, K) for column tiles n0 + 8j, j < nt (nt even).
//   A rows m0.. of X [m][k] (kA = false) or of Xt^T, Xt [k][m] (kA = true);
//   B = Y^T, Y [n][k] (kB = false) or B [k][n] (kB = true).
// The fragment loads of a k step are issued together before its mma, so that they pipeline.
template <class T, int NT, bool kA, bool kB>
__device__ __forceinline__ void warp_gemm_cols(float (&acc)[NT][4], const T* A, int lda, int m0, const T* B, int ldb,
                                               int n0, int nt, int k_begin, int k_end) {
  for (int k = k_begin; k < k_end; k += 16) {
    uint32_t fa[4], fb[NT / 2][4];
    if constexpr (kA) load_a_t(fa, A, lda, m0, k);
    else load_a(fa, A, lda, m0, k);
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj)
      if (2 * jj < nt) {
        if constexpr (kB) load_b_kn(fb[jj], B, ldb, n0 + 16 * jj, k);
        else load_b_nk(fb[jj], B, ldb, n0 + 16 * jj, k);
      }
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj)
      if (2 * jj < nt) {
        mma<T>(acc[2 * jj], fa, fb[jj][0], fb[jj][1]);
        mma<T>(acc[2 * jj + 1], fa, fb[jj][2], fb[jj][3]);
      }
  }
}
// All NT column tiles (the common case) get a literal count: no guards between the loads.
template <class T, int NT, bool kA, bool kB>
__device__ __forceinline__ void warp_gemm(float (&acc)[NT][4], const T* A, int lda, int m0, const T* B, int ldb, int n0,
                                          int nt, int k_begin, int k_end) {
  if (nt == NT) warp_gemm_cols<T, NT, kA, kB>(acc, A, lda, m0, B, ldb, n0, NT, k_begin, k_end);
  else warp_gemm_cols<T, NT, kA, kB>(acc, A, lda, m0, B, ldb, n0, nt, k_begin, k_end);
}

// acc[16 x 8*NT] += Xt^T diag(w) Y over the `rows` tokens of a chunk: rows m0.. of Xt^T (Xt
// [token][m], e.g. K), Y [token][n] (e.g. V), columns 8j, j < nt; w(token) is the token weight
// (e^{B-b} for a state update). The weights scale the A fragments in registers.
template <class T, int NT, class W>
__device__ __forceinline__ void warp_gemm_tn_weighted(float (&acc)[NT][4], const T* Xt, int ldx, int m0, const T* Y,
                                                      int ldy, int nt, int rows, W w) {
  const int t = threadIdx.x & 3;
  for (int kk = 0; kk < rows / 16; ++kk) {
    uint32_t fa[4], fb[NT / 2][4];
    load_a_t(fa, Xt, ldx, m0, 16 * kk);
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj)  // all B fragments first: the loads overlap the scaling below
      if (2 * jj < nt) load_b_kn(fb[jj], Y, ldy, 16 * jj, 16 * kk);
    // token weights of the k index held by this thread: 16kk + 2t (+1), 16kk + 2t + 8 (+1)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int k = 16 * kk + 2 * t + 8 * hf;
      const float w0 = w(k), w1 = w(k + 1);
#pragma unroll
      for (int m = 0; m < 2; ++m) {  // a[2hf + m]: rows g / g+8, tokens k, k+1
        const float2 x = unpack2<T>(fa[2 * hf + m]);
        fa[2 * hf + m] = pack2<T>(x.x * w0, x.y * w1);
      }
    }
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj)
      if (2 * jj < nt) {
        mma<T>(acc[2 * jj], fa, fb[jj][0], fb[jj][1]);
        mma<T>(acc[2 * jj + 1], fa, fb[jj][2], fb[jj][3]);
      }
  }
}

// <acc, X> over this thread's accumulator entries of rows i0 (acc[j][0..1]) and i1 (acc[j][2..3]),
// columns c0 + 8j + 2t (+1), j < nt; X a 16-bit smem tile [rows][ld]. Added to d0, d1.
template <class T, int NT>
__device__ __forceinline__ void dot_rows(const float (&acc)[NT][4], const T* X, int ld, int i0, int i1, int c0, int nt,
                                         float& d0, float& d1) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < NT; ++j)
    if (j < nt) {
      const int col = c0 + 8 * j + 2 * t;
      const float2 x0 = unpack2<T>(*reinterpret_cast<const uint32_t*>(X + i0 * ld + col));
      const float2 x1 = unpack2<T>(*reinterpret_cast<const uint32_t*>(X + i1 * ld + col));
      d0 += acc[j][0] * x0.x + acc[j][1] * x0.y;
      d1 += acc[j][2] * x1.x + acc[j][3] * x1.y;
    }
}

// Column half ch (0 or 1) of d columns (d a multiple of 16) in the chunk kernels that split a
// [C, d] product between two warps per row block: columns [c0, c0 + 8 nt), halves 16-aligned.
__host__ __device__ inline void col_half(int d, int ch, int& c0, int& nt) {
  const int half = ((d / 16 + 1) / 2) * 16;
  c0 = ch * half;
  nt = (d - c0 < half ? (d - c0 > 0 ? d - c0 : 0) : half) / 8;
}

#ifdef HILA_CUDA_EMU  // host emulator: copies queued per thread, landing at wait_group
inline void cp_async16(void* dst, const void* src, int src_bytes) { emu::cp_async(dst, src, 16, src_bytes); }
inline void cp_async4(void* dst, const void* src, int src_bytes) { emu::cp_async(dst, src, 4, src_bytes); }
inline void cp_async_commit() { emu::cp_commit(); }
template <int N>
inline void cp_async_wait() { emu::cp_wait(N); }
#else
// 16-byte global -> shared copy; src_bytes < 16 zero-fills the rest (0: all zero).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
// 4-byte global -> shared copy (src_bytes 0: zero).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
#endif  // HILA_CUDA_EMU

// Per-thread cp.async plan for [kRows, nc] 16-bit tiles (nc <= 64, a multiple of 8) taken from
// row blocks of a row-major source with row stride ld: thread e copies 16-byte vector e % 8 of rows
// e / 8 + (kThreads / 8) p, p < kPasses. Built once per block and unrolled over a compile-time
// pass count, so that a sweep issuing one tile per chunk pays one 64-bit multiply and a few adds
// per vector; async_rows (below) does the same stepping but sets it up on every call.
template <class T, int kThreads, int kRows>
struct TileStream {
  static constexpr int kStep = kThreads / 8, kPasses = kRows / kStep;
  static_assert(kThreads % 8 == 0 && kRows % kStep == 0, "whole passes of 8 vectors per row");
  const T* src;   // this thread's row and column of row block 0
  const T* safe;  // an address inside the source (row 0, this column): the dummy of zero-filled rows
  int64_t ld, ld_step;
  int soff, row;  // offset in the smem tile; first row of this thread
  bool on;        // this thread's vector lies inside the nc columns
  __device__ TileStream(const T* base, int64_t ld_, int c0, int nc, int lds) {
    row = int(threadIdx.x) >> 3;
    const int j = (int(threadIdx.x) & 7) * 8;
    on = j < nc;
    safe = base + c0 + j;
    src = safe + int64_t(row) * ld_;
    ld = ld_, ld_step = int64_t(kStep) * ld_;
    soff = row * lds + j;
  }
  // source rows [r0, r0 + nr) into tile s (leading dimension lds); rows >= nr zero-filled
  __device__ __forceinline__ void issue(T* s, int64_t r0, int nr, int lds) const {
    if (!on) return;
    const T* p = src + r0 * ld;
#pragma unroll
    for (int q = 0; q < kPasses; ++q) {
      const bool in = row + q * kStep < nr;
      cp_async16(s + soff + q * kStep * lds, in ? p : safe, in ? 16 : 0);
      p += ld_step;
    }
  }
};

// Rows [r0, r0+nr) (columns [c0, c0+nc)) of a packed [Ttot][ldg] buffer into smem [rows][lds]
// with cp.async; rows >= nr up to `rows` are zero-filled. nc is a multiple of 8 (16 bytes).
// When nc / 8 is a power of two dividing blockDim.x (every tile of the kernels: nc = 32..256 with
// 128 or 256 threads), each thread keeps one 16-byte column and steps rows by pointer increments
// (about 6 instructions per vector instead of the ~25 of per-element index arithmetic).
template <class T>
__device__ __forceinline__ void async_rows(T* s, int lds, const T* g, int64_t ldg, int64_t r0, int nr, int c0,
                                           int nc, int rows) {
  const int nv = nc / 8, nthr = int(blockDim.x);
  if ((nv & (nv - 1)) == 0 && (nthr & (nv - 1)) == 0) {
    const int lg = __ffs(nv) - 1, tid = int(threadIdx.x);
    const int i0 = tid >> lg, j = (tid & (nv - 1)) * 8, rstep = nthr >> lg;
    const T* safe = g + c0 + j;  // row 0 of this column: the (unread) source of zero-filled rows
    const T* gp = safe + (r0 + i0) * ldg;
    const int64_t gstep = int64_t(rstep) * ldg;
    T* sp = s + i0 * lds + j;
    const int sstep = rstep * lds;
    for (int i = i0; i < rows; i += rstep, gp += gstep, sp += sstep) {
      const bool in = i < nr;
      cp_async16(sp, in ? gp : safe, in ? 16 : 0);
    }
    return;
  }
  for (int e = threadIdx.x; e < rows * nv; e += blockDim.x) {
    const int i = e / nv, j = (e % nv) * 8;
    const bool in = i < nr;
    cp_async16(s + i * lds + j, g + (in ? (r0 + i) * ldg + c0 + j : 0), in ? 16 : 0);
  }
}

// The gate cumsums b[r0, r0 + nr) of a chunk (kChunk rows) into dst [kChunk] with cp.async
// (threads < kChunk; zeros past nr and without gates; `dummy` is any valid global address, the
// source of the zero-fill).
template <int kRows>
__device__ __forceinline__ void async_gates(float* dst, const float* b, int64_t r0, int nr, const void* dummy) {
  if (threadIdx.x < kRows) {
    const bool in = b && int(threadIdx.x) < nr;
    cp_async4(dst + threadIdx.x, in ? static_cast<const void*>(b + r0 + threadIdx.x) : dummy, in ? 4 : 0);
  }
}

// A warp's 64-column accumulator tile (mma.sync or wgmma m64 layout: element (j, e) = at(j, e) at
// row r + 8 (e >> 1), column c0 + 8j + (e & 1); j < nt valid) as the 16-bit GEMM operand into
// the [rows][ld] matrix at dst.
template <class T, class At>
__device__ __forceinline__ void store_tile16(T* dst, int ld, int r, int c0, int nt, At&& at) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        *reinterpret_cast<uint32_t*>(dst + int64_t(r + 8 * hf) * ld + c0 + 8 * j) =
            pack2<T>(at(j, 2 * hf), at(j, 2 * hf + 1));
}

}  // namespace hila::cuda::mma
