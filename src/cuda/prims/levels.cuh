// SPDX-License-Identifier: Apache-2.0
// Fenwick level helpers on the device (docs/math/LOGLINEAR.md §2) and the pack / unpack kernels between the
// caller's canonical states and a dense per-(sequence, head) level workspace:
//   caller  [N, H, Ls_x, dk, dv] (Fenwick, slot = level) or [N, H, dk, dv] (flat: one slot)
//   ws      [N*H][Ls][dk][dv] in the compute type; slots not live at the sequence's position are 0.
// "Flat" is the degenerate level structure of plain GLA / GDN: one slot (0), every pair at level 0.
#pragma once
#include "cuda/runtime/runtime.cuh"

namespace hila::cuda {

__host__ __device__ inline int lvl_bitlen(uint64_t x) {
#ifdef __CUDA_ARCH__
  return x ? 64 - __clzll(static_cast<long long>(x)) : 0;
#else
  return x ? 64 - __builtin_clzll(x) : 0;
#endif
}
// sigma_l(n) = (n >> l) << l: start of bucket l of position n (§2.2).
__host__ __device__ inline int64_t lvl_sigma(int64_t n, int l) { return l >= 63 ? 0 : (n >> l) << l; }

// The level structure of one call: Fenwick (log-linear operators) or flat.
struct LvlGrid {
  bool fenwick = false;
  // level of the pair (t, s), s <= t: bitlen(t xor s) (§2.1)
  __host__ __device__ int level(int64_t t, int64_t s) const { return fenwick ? lvl_bitlen(uint64_t(t ^ s)) : 0; }
  // whether slot l of the canonical state at n can be non-zero (§2.5)
  __host__ __device__ bool live(int64_t n, int l) const {
    return fenwick ? (l >= 1 && l <= 63 && ((n >> (l - 1)) & 1)) : l == 0;
  }
  // level at which query t >= n reads bucket l of the state at n; with t = e also the slot the
  // bucket re-keys into when the state advances to e (nesting lemma, §2.4)
  __host__ __device__ int read_level(int64_t t, int64_t n, int l) const {
    return fenwick ? lvl_bitlen(uint64_t(t ^ lvl_sigma(n, l))) : 0;
  }
  // slots of the canonical state at n: bitlen(n) + 1, or 1 flat
  __host__ __device__ int slots(int64_t n) const { return fenwick ? lvl_bitlen(uint64_t(n)) + 1 : 1; }
  // index of live slot l among the live slots of n (compact per-position storage)
  __host__ __device__ int rank(int64_t n, int l) const {
#ifdef __CUDA_ARCH__
    return fenwick ? __popcll(static_cast<unsigned long long>(n) & ((1ull << (l - 1)) - 1)) : 0;
#else
    return fenwick ? __builtin_popcountll(static_cast<unsigned long long>(n) & ((1ull << (l - 1)) - 1)) : 0;
#endif
  }
  __host__ __device__ int nlive(int64_t n) const {
#ifdef __CUDA_ARCH__
    return fenwick ? __popcll(static_cast<unsigned long long>(n)) : 1;
#else
    return fenwick ? __builtin_popcountll(static_cast<unsigned long long>(n)) : 1;
#endif
  }
};

// caller state (strided) -> ws [NH][Ls][dk][dv]; only the slots live at pos[seq] are read (a
// cotangent d_final is read the same way: dead slots are never used, §2.5).
template <class R>
__global__ void lvl_pack_state(R* ws, Strided in, int64_t NH, int64_t H, int Ls, int64_t Ls_in, int dk, int dv,
                               const int64_t* pos, LvlGrid grid) {
  const int64_t n = NH * Ls * dk * dv;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(e % dv), i = int((e / dv) % dk), l = int((e / (int64_t(dk) * dv)) % Ls);
    const int64_t nh = e / (int64_t(Ls) * dk * dv), seq = nh / H, h = nh % H;
    R x = 0;
    if (grid.fenwick) {
      if (l < Ls_in && grid.live(pos[seq], l))
        x = ld<R>(in, seq * in.s[0] + h * in.s[1] + l * in.s[2] + i * in.s[3] + j * in.s[4]);
    } else {
      x = ld<R>(in, seq * in.s[0] + h * in.s[1] + i * in.s[2] + j * in.s[3]);
    }
    ws[e] = x;
  }
}

// ws [NH][Ls][dkp][dvp] (dkp >= dk, dvp >= dv: padded) -> caller state [.., dk, dv] with Ls_out slots
// (zero beyond Ls; the workspace already holds zeros at dead slots).
template <class R>
__global__ void lvl_unpack_state(Strided out, const R* ws, int64_t NH, int64_t H, int Ls, int64_t Ls_out, int dk,
                                 int dv, int dkp, int dvp, LvlGrid grid) {
  const int64_t n = NH * Ls_out * dk * dv;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(e % dv), i = int((e / dv) % dk);
    const int64_t l = (e / (int64_t(dk) * dv)) % Ls_out;
    const int64_t nh = e / (Ls_out * dk * dv), seq = nh / H, h = nh % H;
    const R x = l < Ls ? ws[((nh * Ls + l) * dkp + i) * dvp + j] : R(0);
    if (grid.fenwick) st<R>(out, seq * out.s[0] + h * out.s[1] + l * out.s[2] + i * out.s[3] + j * out.s[4], x);
    else st<R>(out, seq * out.s[0] + h * out.s[1] + i * out.s[2] + j * out.s[3], x);
  }
}

}  // namespace hila::cuda
