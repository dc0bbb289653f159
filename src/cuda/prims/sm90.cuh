// SPDX-License-Identifier: Apache-2.0
// Hopper (sm_90a) building blocks: TMA tile loads into 128-byte-swizzled shared memory, completed
// on mbarriers, and warpgroup MMAs (wgmma) that read both operands from shared memory through
// matrix descriptors. Device code exists only in the sm_90a pass (HILA_SM90A); the host side
// encodes the tensor maps.
//
// Tile layout (the one TMA's SWIZZLE_128B writes and wgmma's 128-byte swizzle mode reads): a
// [rows][D] tile of 16-bit elements is D/64 column blocks back to back, each [rows][64] with
// 128-byte rows and 1024-byte alignment; the 16-byte chunk c of row r sits at chunk c ^ (r % 8).
// The same bytes serve as a K-major operand (K along the 64 columns) and as an MN-major one (K
// along the rows): wgmma's transpose flags pick the reading.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

// HILA_SM90A: the sm_90a device pass, or the host emulator (tools/cuda_emu), whose shim provides
// host versions of the PTX pieces below (cuda/sm90_emu.h).
#if (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)) || defined(HILA_CUDA_EMU)
#define HILA_SM90A 1
#else
#define HILA_SM90A 0
#endif

namespace hila::cuda::sm90 {

constexpr int kBlockCols = 64;  // 16-bit columns per swizzled block (128 bytes)

// Byte offset of element (r, c) of a swizzled [rows][D] tile.
__host__ __device__ constexpr uint32_t swz(int rows, int r, int c) {
  return uint32_t((c >> 6) * rows * 128 + r * 128 + ((((c & 63) >> 3) ^ (r & 7)) << 4) + ((c & 7) << 1));
}


// Matrix descriptor (PTX ISA, "matrix descriptor format"): start address, leading and stride byte
// offsets (16-byte units), 128-byte swizzle (layout type 1 in bits 62-63).
__host__ __device__ inline uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t((lbo >> 4) & 0x3FFF) << 16 | uint64_t((sbo >> 4) & 0x3FFF) << 32 |
         uint64_t(1) << 62;
}
// K-major operand: tile [rows = M or N][K] at `base`; k16 step kk (32 bytes into the row, or the
// next column block every 4 steps). Groups of 8 rows are 1024 bytes apart (SBO); LBO is unused.
__host__ __device__ inline uint64_t desc_k(uint32_t base, int rows, int kk) {
  return desc(base + uint32_t((kk >> 2) * rows * 128 + (kk & 3) * 32), 16, 1024);
}
// MN-major operand: tile [rows = K][MN] at `base`; k16 step kk is rows 16kk..16kk+15 (8-row groups
// 1024 bytes apart: SBO), the next 64 MN columns are the next column block (LBO = rows * 128).
__host__ __device__ inline uint64_t desc_mn(uint32_t base, int rows, int kk) {
  return desc(base + uint32_t(kk * 2048), uint32_t(rows * 128), 1024);
}

#if defined(HILA_CUDA_EMU)
}  // namespace hila::cuda::sm90
#include "cuda/sm90_emu.h"
namespace hila::cuda::sm90 {
#elif HILA_SM90A
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator accesses across wgmma issue / wait.
template <int K>
__device__ __forceinline__ void fence_regs(float (&d)[K]) {
#pragma unroll
  for (int i = 0; i < K; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int K>
__device__ __forceinline__ void fence_regs(uint32_t (&d)[K]) {
#pragma unroll
  for (int i = 0; i < K; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

#define HILA_WG_D8(o)                                                                                         \
  "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), \
      "+f"(d[o + 7])
#define HILA_WG_R32                                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define HILA_WG_R64                                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "   \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define HILA_WG_ASM(shape, types, regs, tail, setp, ...)                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " setp ", 0;\nwgmma.mma_async.sync.aligned." shape types \
               " " regs tail "}\n"                                                                        \
               : __VA_ARGS__                                                                              \
               : "l"(a), "l"(b), "r"(int(acc)), "n"(TA), "n"(TB))

// D[64, N] (+)= A[64, 16] B[16, N] in fp32 (acc = false: D = A B), both operands in shared memory;
// TA / TB = 1 read A / B MN-major. D is the warpgroup's fragment: warp w, lane (g = lane / 4,
// t = lane % 4) holds rows 16w + g (d[4j], d[4j+1]) and 16w + g + 8 (d[4j+2], d[4j+3]), columns
// 8j + 2t and 8j + 2t + 1 (the mma.sync m16n8 accumulator layout repeated over j < N/8).
template <class T, int N, int TA, int TB>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], uint64_t a, uint64_t b, bool acc) {
  static_assert(N == 64 || N == 128, "wgmma: N is 64 or 128");
  constexpr bool kHalf = std::is_same_v<T, __half>;
  if constexpr (N == 64 && kHalf)
    HILA_WG_ASM("m64n64k16", ".f32.f16.f16", HILA_WG_R32, "%32, %33, p, 1, 1, %35, %36;\n", "%34", HILA_WG_D8(0),
                HILA_WG_D8(8), HILA_WG_D8(16), HILA_WG_D8(24));
  else if constexpr (N == 64)
    HILA_WG_ASM("m64n64k16", ".f32.bf16.bf16", HILA_WG_R32, "%32, %33, p, 1, 1, %35, %36;\n", "%34", HILA_WG_D8(0),
                HILA_WG_D8(8), HILA_WG_D8(16), HILA_WG_D8(24));
  else if constexpr (kHalf)
    HILA_WG_ASM("m64n128k16", ".f32.f16.f16", HILA_WG_R64, "%64, %65, p, 1, 1, %67, %68;\n", "%66", HILA_WG_D8(0),
                HILA_WG_D8(8), HILA_WG_D8(16), HILA_WG_D8(24), HILA_WG_D8(32), HILA_WG_D8(40), HILA_WG_D8(48),
                HILA_WG_D8(56));
  else
    HILA_WG_ASM("m64n128k16", ".f32.bf16.bf16", HILA_WG_R64, "%64, %65, p, 1, 1, %67, %68;\n", "%66", HILA_WG_D8(0),
                HILA_WG_D8(8), HILA_WG_D8(16), HILA_WG_D8(24), HILA_WG_D8(32), HILA_WG_D8(40), HILA_WG_D8(48),
                HILA_WG_D8(56));
}
#undef HILA_WG_ASM

#define HILA_WG_ASM_RS(shape, types, regs, tail, setp, ...)                                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " setp ", 0;\nwgmma.mma_async.sync.aligned." shape types \
               " " regs tail "}\n"                                                                        \
               : __VA_ARGS__                                                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(acc)), "n"(TB))
// D[64, N] (+)= A[64, 16] B[16, N] with A from registers: warp w's mma.sync m16n8k16 A fragment of
// rows 16w..16w+15 (a[0]: row g, k 2t..; a[1]: row g+8; a[2], a[3]: k + 8), B in shared memory.
template <class T, int N, int TB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, bool acc) {
  static_assert(N == 64 || N == 128, "wgmma_rs: N is 64 or 128");
  constexpr bool kHalf = std::is_same_v<T, __half>;
  if constexpr (N == 64 && kHalf)
    HILA_WG_ASM_RS("m64n64k16", ".f32.f16.f16", HILA_WG_R32, "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n", "%37",
                   HILA_WG_D8(0), HILA_WG_D8(8), HILA_WG_D8(16), HILA_WG_D8(24));
  else if constexpr (N == 64)
    HILA_WG_ASM_RS("m64n64k16", ".f32.bf16.bf16", HILA_WG_R32, "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n", "%37",
                   HILA_WG_D8(0), HILA_WG_D8(8), HILA_WG_D8(16), HILA_WG_D8(24));
  else if constexpr (kHalf)
    HILA_WG_ASM_RS("m64n128k16", ".f32.f16.f16", HILA_WG_R64, "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n", "%69",
                   HILA_WG_D8(0), HILA_WG_D8(8), HILA_WG_D8(16), HILA_WG_D8(24), HILA_WG_D8(32), HILA_WG_D8(40),
                   HILA_WG_D8(48), HILA_WG_D8(56));
  else
    HILA_WG_ASM_RS("m64n128k16", ".f32.bf16.bf16", HILA_WG_R64, "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n", "%69",
                   HILA_WG_D8(0), HILA_WG_D8(8), HILA_WG_D8(16), HILA_WG_D8(24), HILA_WG_D8(32), HILA_WG_D8(40),
                   HILA_WG_D8(48), HILA_WG_D8(56));
}
#undef HILA_WG_ASM_RS
#undef HILA_WG_R64
#undef HILA_WG_R32
#undef HILA_WG_D8

// mbarriers (one phase per use here: parity 0 for the first completion)
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// The calling thread arrives and the phase completes once `bytes` more have landed.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// Generic-proxy writes to shared memory made visible to the async proxy (wgmma, TMA) that follows.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Pull [p, p + bytes) into L2 (p 16-byte aligned, bytes a multiple of 16); nothing to wait for.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

// TMA tile loads (box of the tensor map) completing on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// TMA tile store: the box of the tensor map at coordinates {c0, c1} from the swizzled tile at src
// (generic writes to src fenced with fence_async_smem and ordered before by a barrier). The
// thread's stores form bulk groups (bulk_commit); bulk_wait_read<N> returns once all but the N
// newest groups have read their shared memory, bulk_wait<N> once their writes are complete.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif  // HILA_CUDA_EMU / HILA_SM90A

#if HILA_SM90A
// D (+)= sum over k16 steps kk < ksteps of A(kk) B(kk) (the first step overwrites D unless add):
// tiles at shared addresses a, b with ra, rb rows, read K-major (TA / TB = 0: desc_k) or MN-major
// (desc_mn).
template <class T, int N, int TA, int TB>
__device__ __forceinline__ void wgmma_chain(float (&d)[N / 2], uint32_t a, int ra, uint32_t b, int rb, int ksteps,
                                            bool add = false) {
#pragma unroll
  for (int kk = 0; kk < ksteps; ++kk)
    wgmma<T, N, TA, TB>(d, TA ? desc_mn(a, ra, kk) : desc_k(a, ra, kk), TB ? desc_mn(b, rb, kk) : desc_k(b, rb, kk),
                        add || kk > 0);
}

#endif

// Host: a tensor map over 16-bit elements, dims[0] contiguous (2 or 3 dims; strides of dims 1..
// in elements, multiples of 8, increasing), box {64, box[1], box[2]}, 128-byte swizzle, elements
// past the dims read as zeros. False when the driver refuses it (the caller then takes the
// portable path).
bool encode_tile_map(CUtensorMap* map, bool f16, const void* base, int rank, const uint64_t* dims,
                     const uint64_t* strides, const uint32_t* box);

// True when the current device runs this build's sm_90a code (binary and PTX version 9.0 of
// `kernel`; the answer is kept per device, for every kernel of the sm_90a sources).
bool runs_sm90a(const void* kernel);

}  // namespace hila::cuda::sm90
