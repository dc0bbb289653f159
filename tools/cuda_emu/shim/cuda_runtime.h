// SPDX-License-Identifier: Apache-2.0
// Host emulation of the CUDA runtime API pieces hila uses (device memory = host memory). Device
// allocations are registered, so that cudaPointerGetAttributes tells them from host memory and the
// default pool reports its used bytes (current and high-water mark) like the real one.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2 };
typedef cudaError_t cudaError;
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef struct CUmemPool_st* cudaMemPool_t;
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice, cudaMemcpyHostToHost, cudaMemcpyDefault };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin, cudaDevAttrMultiProcessorCount };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize, cudaFuncAttributePreferredSharedMemoryCarveout };
enum cudaSharedCarveout { cudaSharedmemCarveoutDefault = -1, cudaSharedmemCarveoutMaxShared = 100, cudaSharedmemCarveoutMaxL1 = 0 };
enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold, cudaMemPoolAttrUsedMemCurrent, cudaMemPoolAttrUsedMemHigh,
                       cudaMemPoolAttrReservedMemCurrent, cudaMemPoolAttrReservedMemHigh };
enum cudaMemoryType { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2, cudaMemoryTypeManaged = 3 };
struct cudaPointerAttributes {
  cudaMemoryType type = cudaMemoryTypeUnregistered;
  int device = 0;
  void* devicePointer = nullptr;
  void* hostPointer = nullptr;
};
constexpr unsigned cudaEventDisableTiming = 2;
struct alignas(8) float2 { float x, y; };
struct alignas(16) double2 { double x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }

namespace emu {
constexpr int kSmemOptin = 232448;  // H100 / H200 opt-in dynamic shared memory per block
constexpr int kSMs = 132;           // H200
struct Alloc { size_t n; bool pooled; };
struct Registry {
  std::mutex mu;
  std::map<uintptr_t, Alloc> live;
  uint64_t pool_cur = 0, pool_high = 0;
};
inline Registry& registry() { static Registry r; return r; }
inline void* dev_alloc(size_t n, bool pooled) {
  void* p = std::malloc(n ? n : 1);
  std::memset(p, 0xff, n);  // poisoned like fresh device memory (NaN in every float type)
  auto& r = registry();
  std::lock_guard<std::mutex> l(r.mu);
  r.live[uintptr_t(p)] = {n, pooled};
  if (pooled) r.pool_cur += n, r.pool_high = std::max(r.pool_high, r.pool_cur);
  return p;
}
inline void dev_free(void* p) {
  if (!p) return;
  auto& r = registry();
  {
    std::lock_guard<std::mutex> l(r.mu);
    auto it = r.live.find(uintptr_t(p));
    if (it == r.live.end()) { std::fprintf(stderr, "cuda_emu: cudaFree of a pointer that is not a device allocation\n"); std::abort(); }
    if (it->second.pooled) r.pool_cur -= it->second.n;
    r.live.erase(it);
  }
  std::free(p);
}
inline bool is_device(const void* q) {
  auto& r = registry();
  std::lock_guard<std::mutex> l(r.mu);
  auto it = r.live.upper_bound(uintptr_t(q));
  if (it == r.live.begin()) return false;
  --it;
  return uintptr_t(q) < it->first + std::max<size_t>(it->second.n, 1);
}
}  // namespace emu

inline const char* cudaGetErrorName(cudaError_t) { return "emu"; }
inline const char* cudaGetErrorString(cudaError_t) { return "emu"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline cudaError_t cudaGetDeviceCount(int* n) { *n = 1; return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaMemGetInfo(size_t* f, size_t* t) { *f = size_t(64) << 30; *t = size_t(80) << 30; return cudaSuccess; }
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  *v = a == cudaDevAttrMultiProcessorCount ? emu::kSMs : emu::kSmemOptin;
  return cudaSuccess;
}
template <class F>
inline cudaError_t cudaFuncSetAttribute(F*, cudaFuncAttribute, int v) { return v > emu::kSmemOptin ? cudaErrorInvalidValue : cudaSuccess; }
inline cudaError_t cudaMalloc(void** p, size_t n) { *p = emu::dev_alloc(n, false); return cudaSuccess; }
inline cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t) { *p = emu::dev_alloc(n, true); return cudaSuccess; }
inline cudaError_t cudaFree(void* p) { emu::dev_free(p); return cudaSuccess; }
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) { emu::dev_free(p); return cudaSuccess; }
inline cudaError_t cudaMallocHost(void** p, size_t n) { *p = std::malloc(n ? n : 1); return cudaSuccess; }
inline cudaError_t cudaFreeHost(void* p) { std::free(p); return cudaSuccess; }
inline cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) { std::memcpy(d, s, n); return cudaSuccess; }
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t) { std::memcpy(d, s, n); return cudaSuccess; }
inline cudaError_t cudaMemset(void* p, int v, size_t n) { std::memset(p, v, n); return cudaSuccess; }
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) { std::memset(p, v, n); return cudaSuccess; }
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { *e = reinterpret_cast<cudaEvent_t>(new char); return cudaSuccess; }
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
inline cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t = nullptr) { return cudaSuccess; }
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) { delete reinterpret_cast<char*>(e); return cudaSuccess; }
// streams: the emulator runs every launch at once, in issue order, so a second stream is only a name
constexpr unsigned cudaStreamNonBlocking = 1;
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* st, unsigned) { *st = reinterpret_cast<cudaStream_t>(new char); return cudaSuccess; }
inline cudaError_t cudaStreamCreateWithPriority(cudaStream_t* st, unsigned f, int) { return cudaStreamCreateWithFlags(st, f); }
inline cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return cudaSuccess;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return cudaSuccess; }
inline cudaError_t cudaStreamDestroy(cudaStream_t st) { delete reinterpret_cast<char*>(st); return cudaSuccess; }
// stream capture: never active on the emulator
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1, cudaStreamCaptureStatusInvalidated = 2 };
inline cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* st) { *st = cudaStreamCaptureStatusNone; return cudaSuccess; }
inline cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* p, int) { *p = reinterpret_cast<cudaMemPool_t>(&emu::registry()); return cudaSuccess; }
inline cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr a, void* v) {
  auto& r = emu::registry();
  std::lock_guard<std::mutex> l(r.mu);
  if (a == cudaMemPoolAttrUsedMemHigh || a == cudaMemPoolAttrReservedMemHigh) r.pool_high = *static_cast<uint64_t*>(v);
  return cudaSuccess;
}
inline cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t, cudaMemPoolAttr a, void* v) {
  auto& r = emu::registry();
  std::lock_guard<std::mutex> l(r.mu);
  uint64_t x = 0;
  if (a == cudaMemPoolAttrUsedMemCurrent || a == cudaMemPoolAttrReservedMemCurrent) x = r.pool_cur;
  else if (a == cudaMemPoolAttrUsedMemHigh || a == cudaMemPoolAttrReservedMemHigh) x = r.pool_high;
  *static_cast<uint64_t*>(v) = x;
  return cudaSuccess;
}
inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* at, const void* p) {
  *at = {};
  at->type = emu::is_device(p) ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
  return cudaSuccess;
}
