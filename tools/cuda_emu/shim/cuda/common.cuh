// SPDX-License-Identifier: Apache-2.0
// Host emulation of src/cuda/common.cuh (see tools/cuda_emu/run.sh). CUDA qualifiers vanish; every
// CUDA thread of a block is a std::thread (blocks run one at a time); thread and block indices are
// thread-locals; __syncthreads is a std::barrier over the block. Warp-level operations (shuffles,
// ballots, mma.sync m16n8k16, ldmatrix x4 / x4.trans) run cooperatively: the 32 lanes of a warp
// write their operands to a per-warp scratch area, meet at a per-warp std::barrier(32), each lane
// computes its own result registers from all lanes' operands (exact PTX fragment layouts), and meet
// again. cp.async copies are queued per thread and land at cp.async.wait_group (group bookkeeping as
// in PTX; HILA_EMU_CP_ASYNC=eager lands them at issue instead), with src_bytes zero-fill. smem_gemm
// (WMMA on the GPU) takes the FMA path, with the same 16-bit operand rounding and fp32 accumulation.
// Misuse that the GPU would punish is reported and aborts: warp operations with partial masks, in
// sequential (HILA_LAUNCH) kernels or after lanes of the warp exited; misaligned ldmatrix / cp.async
// addresses; dynamic shared memory above the H100/H200 opt-in; block sizes that are not whole warps.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <semaphore>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n)
// __shared__ is left undefined on purpose: gen.py rewrites it in src/cuda/*.cu; anywhere else it
// is a compile error rather than a silently thread-private variable.
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
namespace emu {
inline thread_local dim3 tid, bid;
inline thread_local int t_lin = 0;  // linear thread index in the block
inline dim3 bdim{256, 1, 1}, gdim;
inline bool threaded = false;  // false while a HILA_LAUNCH (grid-stride) kernel runs sequentially
inline const char* kname = "";
constexpr int kMaxWarps = 32;
inline std::barrier<>* bar = nullptr;
inline std::barrier<>* warpbar[kMaxWarps] = {};
inline std::atomic<int> wexited[kMaxWarps];
alignas(16) inline unsigned char wscratch[kMaxWarps][2][32][32];  // double-buffered per warp
inline thread_local int wparity = 0;
alignas(1024) inline unsigned char dyn_smem[kSmemOptin];
[[noreturn]] inline void die(const char* msg) {
  std::fprintf(stderr, "cuda_emu: %s: %s (block %u,%u,%u thread %d)\n", kname, msg, bid.x, bid.y, bid.z, t_lin);
  std::fflush(stderr);
  std::abort();
}
inline void warp_sync() {
  if (!threaded) die("warp-synchronous operation in a kernel launched with HILA_LAUNCH (run sequentially)");
  const int w = t_lin / 32;
  if (wexited[w].load(std::memory_order_relaxed)) die("warp-synchronous operation after lanes of the warp exited");
  warpbar[w]->arrive_and_wait();
}
inline void full_mask(unsigned m) {
  if (m != 0xffffffffu) die("warp operation with a partial mask (only full warps are emulated)");
}
// Every lane publishes `mine`; after the warp barrier f(get) runs with get(lane) = that lane's value.
// The scratch area alternates between two buffers: a lane can only overwrite a buffer two operations
// later, after every lane has passed the barrier of the operation in between, so one barrier suffices.
template <class M, class F>
auto warp_exchange(const M& mine, F f) {
  static_assert(sizeof(M) <= sizeof(wscratch[0][0]) && std::is_trivially_copyable_v<M>);
  const int w = t_lin / 32, l = t_lin % 32;
  const int p = wparity;
  wparity ^= 1;
  std::memcpy(wscratch[w][p][l], &mine, sizeof(M));
  warp_sync();
  auto get = [w, p](int lane) {
    M x;
    std::memcpy(&x, wscratch[w][p][lane], sizeof(M));
    return x;
  };
  return f(get);
}

// cp.async: per-thread queue of committed groups
struct Copy {
  void* dst;
  const void* src;
  int n, src_bytes;
};
inline const bool cp_eager = [] {
  const char* e = std::getenv("HILA_EMU_CP_ASYNC");
  return e && std::string(e) == "eager";
}();
inline thread_local std::vector<Copy> cp_open;
inline thread_local std::deque<std::vector<Copy>> cp_groups;
inline void cp_land(const Copy& c) {
  if (c.src_bytes) std::memcpy(c.dst, c.src, size_t(c.src_bytes));
  std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, size_t(c.n - c.src_bytes));
}
inline void cp_async(void* dst, const void* src, int n, int src_bytes) {
  if (uintptr_t(dst) % n || uintptr_t(src) % n) die("cp.async address not aligned to the copy size");
  if (src_bytes < 0 || src_bytes > n) die("cp.async src_bytes out of range");
  if (cp_eager) cp_land({dst, src, n, src_bytes});
  else cp_open.push_back({dst, src, n, src_bytes});
}
inline void cp_commit() {
  cp_groups.push_back(std::move(cp_open));
  cp_open.clear();
}
inline void cp_wait(int pending) {
  while (int(cp_groups.size()) > pending) {
    for (const Copy& c : cp_groups.front()) cp_land(c);
    cp_groups.pop_front();
  }
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32, d += a b. Fragments (PTX ISA,
// "Matrix Fragments for mma.m16n8k16", g = lane / 4, t = lane % 4; low half = lower column / k):
//   A [16 x 16]: a[0] (g, 2t..2t+1), a[1] (g+8, 2t..), a[2] (g, 2t+8..), a[3] (g+8, 2t+8..)
//   B [16 x 8]:  b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C, D [16 x 8]: d[0..1] (g, 2t..2t+1), d[2..3] (g+8, 2t..2t+1)
template <class T>
inline float half_of(uint32_t r, int hi) {
  const uint16_t b = uint16_t(hi ? r >> 16 : r & 0xffffu);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return float(__nv_bfloat16::from_bits(b));
  else {
    __half h;
    std::memcpy(&h.x, &b, 2);
    return float(h);
  }
}
struct MmaIn {
  uint32_t a[4], b[2];
};
template <class T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const int l = t_lin % 32, g = l >> 2, t = l & 3;
  warp_exchange(MmaIn{{a[0], a[1], a[2], a[3]}, {b0, b1}}, [&](auto get) {
    MmaIn all[32];
    for (int i = 0; i < 32; ++i) all[i] = get(i);
    auto A = [&](int r, int k) { return half_of<T>(all[(r & 7) * 4 + ((k & 7) >> 1)].a[(r >> 3) + 2 * (k >> 3)], k & 1); };
    auto B = [&](int k, int n) { return half_of<T>(all[n * 4 + ((k & 7) >> 1)].b[k >> 3], k & 1); };
    for (int e = 0; e < 4; ++e) {
      const int r = g + 8 * (e >> 1), n = 2 * t + (e & 1);
      double s = 0;  // 16-bit products are exact; one rounding to fp32 at the end
      for (int k = 0; k < 16; ++k) s += double(A(r, k)) * double(B(k, n));
      d[e] = float(s + double(d[e]));
    }
    return 0;
  });
}
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i..8i+7 give the row addresses of
// matrix i (16 bytes each); lane l receives in r[i] the elements (row l/4, columns 2(l%4), +1) of
// matrix i, or with .trans those of its transpose: (rows 2(l%4), +1, column l/4).
inline void ldmatrix_x4(uint32_t (&r)[4], const void* p, bool trans) {
  if (uintptr_t(p) % 16) die("ldmatrix row address not 16-byte aligned");
  const int l = t_lin % 32;
  warp_exchange(p, [&](auto get) {
    auto at = [&](int lane, int col) { return uint32_t(static_cast<const uint16_t*>(get(lane))[col]); };
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = trans ? at(8 * i + 2 * (l & 3), l >> 2) : at(8 * i + (l >> 2), 2 * (l & 3));
      const uint32_t hi = trans ? at(8 * i + 2 * (l & 3) + 1, l >> 2) : at(8 * i + (l >> 2), 2 * (l & 3) + 1);
      r[i] = lo | (hi << 16);
    }
    return 0;
  });
}
}  // namespace emu
#define threadIdx (emu::tid)
#define blockIdx (emu::bid)
#define blockDim (emu::bdim)
#define gridDim (emu::gdim)
inline void __syncthreads() {
  if (!emu::threaded) emu::die("__syncthreads in a kernel launched with HILA_LAUNCH (run sequentially)");
  emu::bar->arrive_and_wait();
}
inline void __syncwarp(unsigned m = 0xffffffffu) { emu::full_mask(m), emu::warp_sync(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
[[noreturn]] inline void __trap() { emu::die("__trap"); }
template <class X>
X __shfl_sync(unsigned m, X v, int src, int width = 32) {
  emu::full_mask(m);
  const int l = emu::t_lin % 32;
  return emu::warp_exchange(v, [&](auto get) { return get((l & ~(width - 1)) + (src & (width - 1))); });
}
template <class X>
X __shfl_xor_sync(unsigned m, X v, int mask, int width = 32) {
  emu::full_mask(m);
  const int l = emu::t_lin % 32, s = l ^ mask;
  return emu::warp_exchange(v, [&](auto get) { return s / width <= l / width ? get(s) : v; });
}
template <class X>
X __shfl_up_sync(unsigned m, X v, int off, int width = 32) {
  emu::full_mask(m);
  const int l = emu::t_lin % 32;
  return emu::warp_exchange(v, [&](auto get) { return (l % width) >= off ? get(l - off) : v; });
}
template <class X>
X __shfl_down_sync(unsigned m, X v, int off, int width = 32) {
  emu::full_mask(m);
  const int l = emu::t_lin % 32;
  return emu::warp_exchange(v, [&](auto get) { return (l % width) + off < width ? get(l + off) : v; });
}
inline unsigned __ballot_sync(unsigned m, int p) {
  emu::full_mask(m);
  return emu::warp_exchange(int(p != 0), [&](auto get) {
    unsigned b = 0;
    for (int i = 0; i < 32; ++i) b |= unsigned(get(i)) << i;
    return b;
  });
}
inline int __any_sync(unsigned m, int p) { return __ballot_sync(m, p) != 0; }
inline int __all_sync(unsigned m, int p) { return __ballot_sync(m, p) == 0xffffffffu; }
template <class X>
X atomicAdd(X* p, X v) { return std::atomic_ref<X>(*p).fetch_add(v); }
template <class X>
X atomicMin(X* p, X v) {
  std::atomic_ref<X> r(*p);
  X cur = r.load();
  while (v < cur && !r.compare_exchange_weak(cur, v)) {}
  return cur;
}
inline int __clz(int x) { return x ? __builtin_clz(unsigned(x)) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline float __expf(float x) { return std::exp(x); }
using std::exp;
using std::isfinite;
using std::max;
using std::min;

namespace hila::cuda {
template <class T> inline auto float_or(T x) { if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) return float(x); else return x; }
[[noreturn]] void fail(cudaError_t e, const char* expr, const char* file, int line);
#define HILA_CUDA_CHECK(expr)                                                   \
  do {                                                                          \
    cudaError_t hila_e_ = (expr);                                               \
    if (hila_e_ != cudaSuccess) ::hila::cuda::fail(hila_e_, #expr, __FILE__, __LINE__); \
  } while (0)
#define HILA_CUDA_CHECK_LAUNCH() (void)0
#define HILA_FOR_EACH_DTYPE(M) M(__nv_bfloat16) M(__half) M(float) M(double)
template <class T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <class T>
constexpr bool kTensorCore = std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;
template <class T>
inline T to(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(x);
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(x);
  else return static_cast<T>(x);
}
template <class T>
inline T to(double x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(float(x));
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(float(x));
  else return static_cast<T>(x);
}
template <class A, class T>
inline A from(T x) { return static_cast<A>(float_or(x)); }
template <class T>
constexpr int ld_of(int cols) { return cols + (kTensorCore<T> ? 8 : (std::is_same_v<T, double> ? 2 : 4)); }
template <class T, bool TA, bool TB>
void smem_gemm(Acc<T>* C, int ldc, const T* A, int lda, const T* B, int ldb, int M, int N, int K, bool acc) {
  using R = Acc<T>;
  for (int e = threadIdx.x; e < M * N; e += blockDim.x) {
    const int i = e / N, j = e % N;
    R s = acc ? C[i * ldc + j] : R(0);
    for (int k = 0; k < K; ++k) {
      const R a = R(float_or(TA ? A[k * lda + i] : A[i * lda + k]));
      const R b = R(float_or(TB ? B[j * ldb + k] : B[k * ldb + j]));
      s += a * b;
    }
    C[i * ldc + j] = s;
  }
  __syncthreads();
}
}  // namespace hila::cuda

namespace emu {
// Persistent worker threads (created on first use, reused by every block): worker i runs thread i.
class Pool {
 public:
  void run(unsigned n, const std::function<void(unsigned)>& f) {
    job_ = &f;
    for (; started_ < n; ++started_) {
      go_[started_] = std::make_unique<std::binary_semaphore>(0);
      std::thread([this, i = started_] {
        for (;;) {
          go_[i]->acquire();
          (*job_)(i);
          done_.release();
        }
      }).detach();
    }
    for (unsigned i = 0; i < n; ++i) go_[i]->release();
    for (unsigned i = 0; i < n; ++i) done_.acquire();
  }

 private:
  const std::function<void(unsigned)>* job_ = nullptr;
  unsigned started_ = 0;
  std::unique_ptr<std::binary_semaphore> go_[1024];
  std::counting_semaphore<1024> done_{0};
};
inline std::mutex launch_mu;  // one launch at a time, whichever host thread makes it
inline Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: its threads block until the process exits
  return *p;
}
// HILA_LAUNCH kernels (grid-stride loops without barriers): the 256 threads of each block in turn.
template <class K, class... A>
void launch_seq(K kernel, dim3 grid, const A&... args) {
  std::lock_guard<std::mutex> lock(launch_mu);
  gdim = grid, bdim = dim3(256), threaded = false, kname = "HILA_LAUNCH kernel";
  for (unsigned bx = 0; bx < grid.x; ++bx)
    for (unsigned t = 0; t < 256; ++t) {
      tid = dim3(t), t_lin = int(t), bid = dim3(bx);
      kernel(args...);
    }
}
// kernel<<<grid, block, smem, stream>>>(args): the blocks in turn, each on block-size std::threads.
template <class K, class... A>
void launch(const char* name, K kernel, dim3 grid, dim3 block, size_t smem, const A&... args) {
  std::lock_guard<std::mutex> lock(launch_mu);
  kname = name;
  const unsigned nt = block.x * block.y * block.z;
  if (nt == 0 || nt > 1024 || nt % 32) die("block size is not a whole number of warps (1..32)");
  if (smem > size_t(kSmemOptin)) die("dynamic shared memory above the 232448-byte opt-in");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) die("invalid grid");
  gdim = grid, bdim = block, threaded = true;
  const int nw = int(nt / 32);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::memset(dyn_smem, 0xff, smem);  // poison: reads of unwritten shared memory give NaN
        std::barrier<> b(nt);
        bar = &b;
        std::vector<std::unique_ptr<std::barrier<>>> wb;
        for (int w = 0; w < nw; ++w) {
          wb.push_back(std::make_unique<std::barrier<>>(32));
          warpbar[w] = wb.back().get();
          wexited[w] = 0;
        }
        pool().run(nt, [&](unsigned t) {
            tid = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
            t_lin = int(t), wparity = 0;
            bid = dim3(bx, by, bz);
            kernel(args...);
            cp_wait(0);  // copies still in flight land (as on the GPU)
            for (const Copy& c : cp_open) cp_land(c);
            cp_open.clear();
            wexited[t / 32].fetch_add(1);
            warpbar[t / 32]->arrive_and_drop();
            bar->arrive_and_drop();  // exited threads no longer take part in __syncthreads
          });
      }
  threaded = false;
}
}  // namespace emu
