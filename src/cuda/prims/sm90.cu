// SPDX-License-Identifier: Apache-2.0
// Host side of the Hopper building blocks (sm90.cuh): tensor maps through the driver entry point
// (no link against libcuda) and the check that a kernel runs as sm_90a code.
#include <cstdlib>
#include <cstring>
#if !defined(HILA_CUDA_EMU)
#include <cudaTypedefs.h>
#endif

#include <mutex>

#include "cuda/common.cuh"
#include "cuda/prims/sm90.cuh"
#include "cuda/runtime/config.h"

namespace hila::cuda::sm90 {

#if defined(HILA_CUDA_EMU)  // host emulator: its own tensor map (cuda/sm90_emu.h), sm_90a on request
bool encode_tile_map(CUtensorMap* map, bool, const void* base, int rank, const uint64_t* dims, const uint64_t* strides,
                     const uint32_t* box) {
  if (rank < 2 || rank > 3 || reinterpret_cast<uintptr_t>(base) % 16) return false;
  detail::Tmap m{static_cast<const unsigned char*>(base), rank, {1, 1, 1}, {0, 0}, {uint32_t(kBlockCols), 1, 1}};
  for (int i = 0; i < rank; ++i) m.dims[i] = dims[i];
  for (int i = 1; i < rank; ++i) m.box[i] = box[i];
  for (int i = 0; i + 1 < rank; ++i) {
    m.strides[i] = strides[i] * 2;
    if (m.strides[i] % 16 || (i && m.strides[i] < m.strides[i - 1])) return false;
  }
  std::memset(map, 0, sizeof(CUtensorMap));
  std::memcpy(map, &m, sizeof m);
  return true;
}
// HILA_EMU_SM90=1 runs the sm_90a kernels on the emulator (the sm80 ones otherwise)
bool runs_sm90a(const void*) { return config().emu_sm90; }
#else
namespace {
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}
}  // namespace

bool encode_tile_map(CUtensorMap* map, bool f16, const void* base, int rank, const uint64_t* dims,
                     const uint64_t* strides, const uint32_t* box_dims) {
  const auto fn = encode_fn();
  if (!fn || rank < 2 || rank > 3 || reinterpret_cast<uintptr_t>(base) % 16) return false;
  cuuint64_t gdim[3], gstride[2];
  cuuint32_t box[3] = {uint32_t(kBlockCols), 1, 1}, estride[3] = {1, 1, 1};
  for (int i = 0; i < rank; ++i) gdim[i] = dims[i];
  for (int i = 1; i < rank; ++i) box[i] = box_dims[i];
  for (int i = 0; i + 1 < rank; ++i) {
    gstride[i] = strides[i] * 2;  // bytes
    if (gstride[i] % 16 || gstride[i] >= (uint64_t(1) << 40) || (i && gstride[i] < gstride[i - 1])) return false;
  }
  return fn(map, f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, cuuint32_t(rank),
            const_cast<void*>(base), gdim, gstride, box, estride, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool runs_sm90a(const void* kernel) {
  constexpr int kMaxDev = 64;
  static int known[kMaxDev] = {};  // 0 unknown, 1 yes, 2 no
  static std::mutex m;
  int dev = 0;
  HILA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(m);
  if (dev >= kMaxDev) return false;
  if (!known[dev]) {
    cudaFuncAttributes attr{};
    HILA_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    known[dev] = attr.binaryVersion == 90 && attr.ptxVersion == 90 ? 1 : 2;
  }
  return known[dev] == 1;
}
#endif  // HILA_CUDA_EMU

}  // namespace hila::cuda::sm90
