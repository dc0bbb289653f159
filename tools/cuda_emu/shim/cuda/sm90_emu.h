// SPDX-License-Identifier: Apache-2.0
// Host emulator (tools/cuda_emu): the sm_90a building blocks of src/cuda/sm90.cuh on the host, so
// that the TMA + wgmma kernels run as written (with HILA_EMU_SM90=1):
//   - shared addresses are offsets into the emulator's dynamic shared memory (1024-aligned);
//   - wgmma (SS and RS, m64nNk16) is a collective of each warpgroup of 128 threads, issued by every
//     warpgroup of the block together (the kernels here keep their warpgroups in step): every
//     thread publishes its fragments, each warpgroup's first thread forms its D = A B (+ D) reading
//     the operands through the descriptors with the 128-byte swizzle applied to the shared address
//     (products exact, one fp32 rounding per k16 step, as mma.sync here), and each thread takes
//     its D fragment back. It completes at issue, so commit and wait are no-ops;
//   - TMA tile loads copy the box at issue, with the 128-byte swizzle and zeros past the tensor,
//     and complete their bytes on the mbarrier; mbarriers count arrivals and bytes per phase.
// The descriptor and swizzle reading here is the same as the GPU's for the kernels that passed on
// both (the sm_90a sweep and backward chunk kernel), which is what checks it.
#pragma once
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include <cuda.h>

namespace hila::cuda::sm90 {

inline uint32_t smem_u32(const void* p) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < emu::dyn_smem || c >= emu::dyn_smem + emu::kSmemOptin) emu::die("sm90 emu: not a shared-memory address");
  return uint32_t(c - emu::dyn_smem);
}
inline void wg_fence() {}
inline void wg_commit() {}
template <int N>
inline void wg_wait() {}
template <class R, int K>
inline void fence_regs(R (&)[K]) {}
inline void fence_barrier_init() {}
inline void fence_async_smem() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void prefetch_l2(const void*, uint32_t) {}

namespace detail {
struct WgIn {
  uint64_t a, b;
  int acc;
  uint32_t ar[4];
};
constexpr int kWgMaxThreads = 1024;
inline WgIn wg_in[kWgMaxThreads];
inline float wg_d[kWgMaxThreads][64];
inline uint32_t swizzled(uint32_t addr) { return addr ^ (((addr >> 7) & 7) << 4); }
template <class T>
inline float elem(uint32_t addr) {
  uint16_t u;
  std::memcpy(&u, emu::dyn_smem + swizzled(addr), 2);
  return emu::half_of<T>(u, 0);
}
struct Desc {
  uint32_t start, lbo, sbo;
};
inline Desc decode(uint64_t d) {
  if ((d >> 62) != 1) emu::die("sm90 emu: descriptor is not 128-byte swizzled");
  return {uint32_t(d & 0x3FFF) << 4, uint32_t((d >> 16) & 0x3FFF) << 4, uint32_t((d >> 32) & 0x3FFF) << 4};
}
// element (i = M or N index, k) of a K-major (mn = false) or MN-major operand
template <class T>
inline float operand(const Desc& d, bool mn, int i, int k) {
  return elem<T>(mn ? d.start + (i / 64) * d.lbo + (k / 8) * d.sbo + (k % 8) * 128 + (i % 64) * 2
                    : d.start + (i / 8) * d.sbo + (i % 8) * 128 + k * 2);
}
template <class T, int N>
inline void wgmma(float* d, const uint32_t* ar, uint64_t a, uint64_t b, bool acc, bool ta, bool tb) {
  const int nth = int(emu::bdim.x * emu::bdim.y * emu::bdim.z);
  if (nth % 128 || nth > kWgMaxThreads) emu::die("sm90 emu: wgmma needs a block of whole warpgroups");
  const int tid = emu::t_lin, g0 = tid - tid % 128;  // g0: the warpgroup's first thread
  wg_in[tid] = {a, b, int(acc), {ar ? ar[0] : 0u, ar ? ar[1] : 0u, ar ? ar[2] : 0u, ar ? ar[3] : 0u}};
  std::memcpy(wg_d[tid], d, sizeof(float) * (N / 2));
  __syncthreads();
  if (tid == g0) {
    WgIn* const wg_in = detail::wg_in + g0;  // this warpgroup's slots
    float(*const wg_d)[64] = detail::wg_d + g0;
    const Desc da = ar ? Desc{} : decode(wg_in[0].a), db = decode(wg_in[0].b);
    float A[64][16], B[16][N];
    for (int m = 0; m < 64; ++m)
      for (int k = 0; k < 16; ++k) {
        if (ar) {  // warp m / 16, lane (g = m % 8, t = (k % 8) / 2), register (m % 16) / 8 + 2 (k / 8)
          const int th = 32 * (m / 16) + 4 * (m % 8) + (k % 8) / 2;
          A[m][k] = emu::half_of<T>(wg_in[th].ar[(m % 16) / 8 + 2 * (k / 8)], k & 1);
        } else {
          A[m][k] = operand<T>(da, ta, m, k);
        }
      }
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < N; ++n) B[k][n] = operand<T>(db, tb, n, k);
    for (int th = 0; th < 128; ++th) {
      const int w = th / 32, g = (th % 32) / 4, t = th % 4;
      for (int j = 0; j < N / 8; ++j)
        for (int e = 0; e < 4; ++e) {
          const int r = 16 * w + g + 8 * (e >> 1), c = 8 * j + 2 * t + (e & 1);
          double s = 0;
          for (int k = 0; k < 16; ++k) s += double(A[r][k]) * double(B[k][c]);
          wg_d[th][4 * j + e] = float(s + (wg_in[th].acc ? double(wg_d[th][4 * j + e]) : 0.0));
        }
    }
  }
  __syncthreads();
  std::memcpy(d, wg_d[tid], sizeof(float) * (N / 2));
  __syncthreads();  // the slots are free again
}

struct Mbar {
  int count = 1, arrived = 0;
  int64_t tx = 0;
  std::atomic<uint32_t> phase{0};
};
inline std::mutex mbar_mu;
inline std::map<const void*, Mbar>& mbars() {
  static std::map<const void*, Mbar> m;
  return m;
}
inline Mbar& mbar(const void* p) {
  std::lock_guard<std::mutex> lock(mbar_mu);
  return mbars()[p];
}
inline void mbar_progress(const void* p, int arrive, int64_t tx) {
  std::lock_guard<std::mutex> lock(mbar_mu);
  Mbar& s = mbars()[p];
  s.arrived += arrive, s.tx += tx;
  if (s.arrived >= s.count && s.tx == 0) s.arrived = 0, s.phase.fetch_add(1);
}
// the emulator's tensor map: base, rank, dims, strides (bytes), box
struct Tmap {
  const unsigned char* base;
  int rank;
  uint64_t dims[3], strides[2];
  uint32_t box[3];
};
static_assert(sizeof(Tmap) <= sizeof(CUtensorMap), "the emulator's tensor map fits CUtensorMap");
inline void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, const int* crd) {
  Tmap m;
  std::memcpy(&m, map, sizeof m);
  auto* out = static_cast<unsigned char*>(dst);
  if (smem_u32(out) % 1024) emu::die("sm90 emu: TMA destination not 1024-byte aligned (128-byte swizzle)");
  const uint32_t b1 = m.rank > 1 ? m.box[1] : 1, b2 = m.rank > 2 ? m.box[2] : 1;
  for (uint32_t c2 = 0; c2 < b2; ++c2)
    for (uint32_t c1 = 0; c1 < b1; ++c1)
      for (uint32_t c0 = 0; c0 < m.box[0]; ++c0) {
        const int64_t x0 = int64_t(crd[0]) + c0, x1 = m.rank > 1 ? int64_t(crd[1]) + c1 : 0,
                      x2 = m.rank > 2 ? int64_t(crd[2]) + c2 : 0;
        uint16_t v = 0;
        if (x0 >= 0 && x1 >= 0 && x2 >= 0 && uint64_t(x0) < m.dims[0] && (m.rank < 2 || uint64_t(x1) < m.dims[1]) &&
            (m.rank < 3 || uint64_t(x2) < m.dims[2]))
          std::memcpy(&v, m.base + x0 * 2 + x1 * int64_t(m.strides[0]) + (m.rank > 2 ? x2 * int64_t(m.strides[1]) : 0), 2);
        const uint32_t L = ((c2 * b1 + c1) * m.box[0] + c0) * 2, row = L / 128, wb = L % 128;
        std::memcpy(out + row * 128 + (((wb >> 4) ^ (row & 7)) << 4) + (wb & 15), &v, 2);
      }
  mbar_progress(bar, 0, -int64_t(m.box[0]) * b1 * b2 * 2);
}
// the store: the box at crd from the swizzled tile at src, elements past the dims not written
inline void tma_store(const CUtensorMap* map, const void* src, const int* crd) {
  Tmap m;
  std::memcpy(&m, map, sizeof m);
  const auto* in = static_cast<const unsigned char*>(src);
  if (smem_u32(in) % 1024) emu::die("sm90 emu: TMA source not 1024-byte aligned (128-byte swizzle)");
  auto* base = const_cast<unsigned char*>(m.base);
  const uint32_t b1 = m.rank > 1 ? m.box[1] : 1;
  if (m.rank > 2) emu::die("sm90 emu: TMA store of rank 3 not emulated");
  for (uint32_t c1 = 0; c1 < b1; ++c1)
    for (uint32_t c0 = 0; c0 < m.box[0]; ++c0) {
      const int64_t x0 = int64_t(crd[0]) + c0, x1 = m.rank > 1 ? int64_t(crd[1]) + c1 : 0;
      if (x0 < 0 || x1 < 0 || uint64_t(x0) >= m.dims[0] || (m.rank > 1 && uint64_t(x1) >= m.dims[1])) continue;
      const uint32_t L = (c1 * m.box[0] + c0) * 2, row = L / 128, wb = L % 128;
      std::memcpy(base + x0 * 2 + x1 * int64_t(m.strides[0]), in + row * 128 + (((wb >> 4) ^ (row & 7)) << 4) + (wb & 15),
                  2);
    }
}
}  // namespace detail

template <class T, int N, int TA, int TB>
inline void wgmma(float (&d)[N / 2], uint64_t a, uint64_t b, bool acc) {
  detail::wgmma<T, N>(d, nullptr, a, b, acc, TA, TB);
}
template <class T, int N, int TB>
inline void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, bool acc) {
  detail::wgmma<T, N>(d, a, 0, b, acc, false, TB);
}
inline void mbar_init(uint64_t* bar, int count) {
  std::lock_guard<std::mutex> lock(detail::mbar_mu);
  detail::Mbar& s = detail::mbars()[bar];
  s.count = count, s.arrived = 0, s.tx = 0, s.phase.store(0);
}
inline void mbar_expect_tx(uint64_t* bar, uint32_t bytes) { detail::mbar_progress(bar, 1, bytes); }
inline void mbar_wait(uint64_t* bar, uint32_t parity) {
  detail::Mbar& s = detail::mbar(bar);
  while ((s.phase.load() & 1) == parity) std::this_thread::yield();
}
inline void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  const int crd[3] = {c0, c1, 0};
  detail::tma_load(dst, map, bar, crd);
}
inline void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  const int crd[3] = {c0, c1, c2};
  detail::tma_load(dst, map, bar, crd);
}
// stores complete at once here: the bulk-group waits have nothing to wait for
inline void tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  const int crd[3] = {c0, c1, 0};
  detail::tma_store(map, src, crd);
}
inline void bulk_commit() {}
template <int N>
inline void bulk_wait_read() {}
template <int N>
inline void bulk_wait() {}

}  // namespace hila::cuda::sm90
