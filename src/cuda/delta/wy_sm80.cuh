// SPDX-License-Identifier: Apache-2.0
// The WY chunks of the delta rule's sm80 tier (wy_sm80.cu), shared by gdn and loglinear_gdn: the
// chunk-parallel forward (Tg, W, U; with LoglinearWy also Qeff, the lambda-masked intra output and the
// final state's in-chunk levels) and the WY backward.
#pragma once
#include "cuda/delta/sm80.cuh"
#include "cuda/gla/gla.cuh"

namespace hila::cuda::gdn {

// loglinear_gdn's part of wy_kernel (qeff set): with M = P TgU = (tril(Q^ K^T) o Gam) Tg diag(beta)
// [C,C]x[C,C], the chunk's effective queries and intra output (docs/math/LOGLINEAR.md §6.4 in the gated form,
// which needs M explicitly because Lam does not factor through Tg):
//   Qeff = diag(e^b) Q^ - (M diag(e^b)) K      [C,C]x[C,dk]   (a level's read is Qeff S)
//   O    = (M o Lam) V                          [C,C]x[C,dv]   Lam_ij = lam_i^{bitlen(i xor j)}
// and, in the last chunk of a sequence whose length T = F C + r has r > 0, the final state's
// in-chunk levels l <= p (bit l-1 of r set, bucket rows [sigma, sigma + 2^{l-1}), sigma = (r >> l) << l):
//   fin[l] = K^T diag(e^{B-b}) (TgU 1_bucket) V    [dk,C]x([C,C]x[C,dv])
template <class T>
struct LoglinearWy {
  const float* lam = nullptr;  // [H][Ttot][nL]
  int nL = 0;
  T* qeff = nullptr;           // [H][Ttot][dk] out
  T* u16 = nullptr;            // [H][Ttot][dv] out: U in 16 bits (the level sweeps use it only as a GEMM operand)
  float* o = nullptr;          // [H][Ttot][dv] out (nullptr: no output wanted, the product is skipped)
  float* fin = nullptr;        // [N][H][Ls][dk][dv] (zeroed) or nullptr: no final state
  int Ls = 0;
};

// wy_bwd_kernel's inputs and outputs besides GlaArgs (k, v, b, chunk tables, hbuf).
template <class T>
struct WyBwdArgs {
  const float* beta = nullptr;  // [H][Ttot]
  const T* tg = nullptr;        // [nchunks][H][C][C]: Tg (wy_kernel)
  const T* dvn = nullptr;       // [H][Ttot][dv]: dVn (GLA's dv with Vn for v, 16-bit)
  // loglinear_gdn (loglinear_grad_kernel, loglinear_intra_bwd_kernel): dW given [H][Ttot][dk] (16-bit) instead of
  // -dVn Hp^T, an extra cotangent of TgU = Tg diag(beta) [nchunks][H][C][C] (fp32), and dv added to
  const T* dw = nullptr;
  const float* dtgu = nullptr;
  bool dv_add = false;
  // [H][Ttot][dk]: the WY part of dk written here, or (dk16 set: one head per group) dy = the other
  // parts read from here plus the WY part, and the final dk written into the caller's 16-bit tensor,
  // row r0 + i of head h at dk16 + h dk16_hs + (r0 + i) dk16_ld, through the l2norm chain rule when
  // k_rstd [H][Ttot] is given: dk = (dy - y (y.dy)) k_rstd with y the normalised k (a.k)
  float* dk = nullptr;
  T* dk16 = nullptr;
  int64_t dk16_ld = 0, dk16_hs = 0;
  const float* k_rstd = nullptr;
  float* dv = nullptr;          // [H][Ttot][dv] out, or (dv16 set) not written:
  T* dv16 = nullptr;            // the caller's 16-bit dv, row r0 + i of head h at dv16 + h dv16_hs + (r0 + i) dv16_ld
  int64_t dv16_ld = 0, dv16_hs = 0;
  float* dg = nullptr;          // [H][Ttot]: GLA's dc in, dg out
  float* dbeta = nullptr;       // [H][Ttot] out
};

// wy_kernel on grid (nchunks, H) of the call `a` (its k, v, q, dO, b, chunk tables): W [H][Ttot][dk]
// and U [H][Ttot][dv] (16-bit; U unused with ll.qeff), with tg (the backward's recompute) Tg in
// 16 bits [nchunks][H][C][C] and dvi = A^T dO (16-bit [H][Ttot][dv]).
template <class T>
void launch_wy(const GlaArgs<T>& a, const float* beta, T* W, T* U, T* tg, T* dvi, const LoglinearWy<T>& ll,
               cudaStream_t s);
size_t wy_smem(int dk, int dv, bool bwd, bool ll = false);
// wy_bwd_kernel on grid (nchunks, H) of the call `a` (the raw values v).
template <class T>
void launch_wy_bwd(const GlaArgs<T>& a, const WyBwdArgs<T>& x, cudaStream_t s);
size_t wy_bwd_smem(int dk, int dv);

}  // namespace hila::cuda::gdn
