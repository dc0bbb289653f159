// SPDX-License-Identifier: Apache-2.0
// Host-side runtime pieces shared by every CUDA operator family: stream-ordered buffers, the
// strided-tensor view that pack/unpack kernels read, launch helpers, the per-call sequence tables,
// the device scope of a call and the device's limits. Defined here and in this folder's .cu files:
// arena.cu (Arena, scopes, poisoning, the pool), upload.cu (upload_async), streams.cu (SideStream),
// device.cu (CUDA errors, the value scans validation reads, a DecodeState's device memory);
// config.h has the environment knobs.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/problem.h"
#include "cuda/common.cuh"
#include "cuda/dispatch/heuristics.h"
#include "hila/tensor.h"

namespace hila::cuda {

// The call running on this thread: its device (made current for the call's duration, and put
// back only if it was another) and stream, and whether that stream is being captured into a CUDA
// graph (asked once per call, at its first upload). What the runtime helpers below would
// otherwise ask the driver at every upload or allocation.
class CallScope {
 public:
  CallScope(int device, cudaStream_t s);
  ~CallScope();
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
  int device() const { return dev_; }
  cudaStream_t stream() const { return s_; }
  bool capturing();
  static CallScope* current();

 private:
  int dev_, prev_;
  cudaStream_t s_;
  int capture_ = -1;  // unknown until asked
  CallScope* outer_;
};
// The current device: the call's, else the runtime's.
int current_device();

// Keep freed temporaries cached in the current device's default memory pool (its release
// threshold is 0 by default, which hands the memory back at every synchronization and makes the
// next call pay for fresh allocations). Once per device.
void keep_pool_cached();

// An allocation of `bytes` of device memory failed (cudaErrorMemoryAllocation; the error is
// cleared): hila::Error("memory", ...) naming the bytes, the device, its free memory and `what`.
[[noreturn]] void fail_device_memory(size_t bytes, int device, const char* what);

// Where one call's temporaries come from: a caller's workspace (ForwardParams::workspace) or, when
// none is installed on this thread, the stream-ordered pool. Blocks are 256-byte aligned and
// bump-allocated; a block is handed back when it and every block above it are released, so the
// peak follows the call's scopes. A measuring arena (no base) hands out stand-in addresses and
// records the peak: with it installed the call is a dry run (no launches, copies or memsets; see
// dry_run()) that sizes the workspace with the very code that will use it.
class Arena {
 public:
  Arena(void* base, size_t bytes);  // base == nullptr: measuring
  void* take(size_t bytes);
  void give(void* p);
  bool measuring() const { return base_ == 0; }
  size_t peak() const { return peak_; }

 private:
  uintptr_t base_ = 0;
  size_t cap_ = 0, top_ = 0, peak_ = 0;
  struct Block {
    size_t off, end;
    bool live;
  };
  std::vector<Block> blocks_;
};

// The arena installed on this thread for the duration of a scope (nullptr: the pool).
Arena* current_arena();
class ArenaScope {
 public:
  explicit ArenaScope(Arena* a);
  ~ArenaScope();
  ArenaScope(const ArenaScope&) = delete;
  ArenaScope& operator=(const ArenaScope&) = delete;

 private:
  Arena* prev_;
};
// True while a measuring arena is installed: launches, copies and memsets are skipped.
inline bool dry_run() {
  const Arena* a = current_arena();
  return a && a->measuring();
}

// Host code that enqueues work on a SideStream's stream runs inside a NoAllocScope: a temporary
// made there would be handed back, and reused by `main`, while the side stream may still use it
// (a caller's workspace is reused in the order of `main` only). DevBuf refuses it (a logic_error
// that names the rule, like hila's other internal invariants) instead of racing.
class NoAllocScope {
 public:
  NoAllocScope();
  ~NoAllocScope();
  NoAllocScope(const NoAllocScope&) = delete;
  NoAllocScope& operator=(const NoAllocScope&) = delete;
};
void check_alloc_allowed();  // throws inside a NoAllocScope

// HILA_POISON_SCRATCH=1 (the GPU tests set it; config.h): every temporary is filled with 0xff
// (NaN in every float dtype) unless it is asked for zeroed, and is followed by kScratchGuard more
// such bytes. A kernel that reads scratch it never wrote, or a little past a buffer (into the next
// arena block, where compute-sanitizer sees nothing), then gets NaN and fails its test.
bool poison_scratch();
inline constexpr size_t kScratchGuard = 1024;

// Stream-ordered device buffer (the current arena, else the current device's default pool).
template <class X>
class DevBuf {
 public:
  DevBuf() = default;
  DevBuf(size_t n, cudaStream_t s, bool zero = false) : n_(n), s_(s) {
    if (n == 0) return;
    check_alloc_allowed();
    const size_t body = n * sizeof(X), guard = poison_scratch() ? kScratchGuard : 0;
    if ((arena_ = current_arena())) {
      p_ = static_cast<X*>(arena_->take(body + guard));
      if (!arena_->measuring()) fill(body, guard, zero);
      return;
    }
    keep_pool_cached();
    const cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&p_), body + guard, s);
    if (e == cudaErrorMemoryAllocation) {
      p_ = nullptr;
      fail_device_memory(body + guard, current_device(), "a temporary of the call (from the stream-ordered pool)");
    }
    HILA_CUDA_CHECK(e);
    fill(body, guard, zero);
  }
  ~DevBuf() {
    if (!p_) return;
    if (arena_) arena_->give(p_);
    else cudaFreeAsync(p_, s_);
  }
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), n_(o.n_), s_(o.s_), arena_(o.arena_) { o.p_ = nullptr; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(s_, o.s_);
    std::swap(arena_, o.arena_);
    return *this;
  }
  X* get() const { return p_; }

 private:
  // zeros where asked; with a guard (poison_scratch) 0xff over the rest, the guard included
  void fill(size_t body, size_t guard, bool zero) {
    char* p = reinterpret_cast<char*>(p_);
    const size_t zeroed = zero ? body : 0;
    if (zeroed) HILA_CUDA_CHECK(cudaMemsetAsync(p, 0, zeroed, s_));
    if (guard) HILA_CUDA_CHECK(cudaMemsetAsync(p + zeroed, 0xff, body + guard - zeroed, s_));
  }
  X* p_ = nullptr;
  size_t n_ = 0;
  cudaStream_t s_ = nullptr;
  Arena* arena_ = nullptr;
};

// A strided tensor as kernels see it: up to 5 dims, runtime dtype.
struct Strided {
  void* p = nullptr;
  DType dt = DType::f32;
  int64_t s[5] = {0, 0, 0, 0, 0};
  explicit Strided(const TensorView& t) {
    p = t.data;
    dt = t.dtype;
    for (int i = 0; i < t.ndim && i < 5; ++i) s[i] = t.stride[i];
  }
};

template <class R>
__device__ R ld(const Strided& t, int64_t off) {
  switch (t.dt) {
    case DType::f64: return R(static_cast<const double*>(t.p)[off]);
    case DType::f32: return R(static_cast<const float*>(t.p)[off]);
    case DType::bf16: return R(__bfloat162float(static_cast<const __nv_bfloat16*>(t.p)[off]));
    case DType::f16: return R(__half2float(static_cast<const __half*>(t.p)[off]));
    default: return R(0);
  }
}
template <class R>
__device__ void st(const Strided& t, int64_t off, R x) {
  switch (t.dt) {
    case DType::f64: static_cast<double*>(t.p)[off] = double(x); break;
    case DType::f32: static_cast<float*>(t.p)[off] = float(x); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(t.p)[off] = __float2bfloat16_rn(float(x)); break;
    case DType::f16: static_cast<__half*>(t.p)[off] = __float2half_rn(float(x)); break;
    default: break;
  }
}

inline unsigned grid_for(int64_t n) { return heuristics::grid_stride_blocks(n); }
inline int pad16(int64_t d) { return int((d + 15) / 16 * 16); }
#define HILA_LAUNCH(kernel, n, s, ...)                        \
  do {                                                        \
    if (::hila::cuda::dry_run()) break;                       \
    kernel<<<grid_for(n), 256, 0, s>>>(__VA_ARGS__);          \
    HILA_CUDA_CHECK_LAUNCH();                                 \
  } while (0)

// Host-to-device uploads of small per-call tables without a stream synchronization: the bytes
// go through a pinned ring buffer (per device), and a slot is reused only after the copy that
// read it has completed (an event per upload). A pageable cudaMemcpyAsync would instead wait for
// all earlier work on the stream, leaving the GPU idle while the host prepares the next call.
void upload_async(void* dst, const void* src, size_t bytes, cudaStream_t s);

// Sequence tables on the device: per sequence its first row (b T + t), length and first chunk
// ([N] int64 each), per chunk its sequence ([nchunks] int32), in one buffer and one upload.
struct SeqTables {
  template <class X>
  struct Part {  // a table inside d_all (get(), as a DevBuf's)
    const X* p = nullptr;
    const X* get() const { return p; }
  };
  int64_t nchunks = 0;
  DevBuf<int64_t> d_all;
  Part<int64_t> d_row0, d_len, d_chunk0;
  Part<int> d_chunk_seq;
  SeqTables(const detail::Resolved& r, cudaStream_t s, int64_t chunk) {
    const size_t N = r.seqs.size();
    for (const auto& q : r.seqs) nchunks += (q.len + chunk - 1) / chunk;
    // [row0 | len | chunk0] int64, then chunk_seq as int32 pairs
    std::vector<int64_t> h(3 * N + size_t(nchunks + 1) / 2, 0);
    int* cs = reinterpret_cast<int*>(h.data() + 3 * N);
    int64_t c0 = 0;
    for (size_t i = 0; i < N; ++i) {
      const auto& q = r.seqs[i];
      h[i] = q.b * r.T + q.row0, h[N + i] = q.len, h[2 * N + i] = c0;
      const int64_t nc = (q.len + chunk - 1) / chunk;
      for (int64_t c = 0; c < nc; ++c) cs[c0 + c] = int(i);
      c0 += nc;
    }
    d_all = upload(h, s);
    d_row0.p = d_all.get(), d_len.p = d_all.get() + N, d_chunk0.p = d_all.get() + 2 * N;
    d_chunk_seq.p = reinterpret_cast<const int*>(d_all.get() + 3 * N);
  }
  template <class X>
  static DevBuf<X> upload(const std::vector<X>& v, cudaStream_t s) {
    DevBuf<X> b(v.size(), s);
    if (!v.empty()) upload_async(b.get(), v.data(), v.size() * sizeof(X), s);
    return b;
  }
};

// A final state's positions (pos: [N] int64 on the device, undefined: nothing to write): n0 + len of
// every sequence of the call.
inline void upload_final_positions(const TensorView& pos, const detail::Resolved& r, cudaStream_t s) {
  if (!pos.defined()) return;
  std::vector<int64_t> p;
  for (const auto& x : r.seqs) p.push_back(x.n0 + x.len);
  upload_async(pos.data, p.data(), p.size() * 8, s);
}

// A device made current for the duration of a scope (put back only if it was another).
class DeviceScope {
 public:
  explicit DeviceScope(int dev) : dev_(dev) {
    HILA_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != dev) HILA_CUDA_CHECK(cudaSetDevice(dev));
  }
  ~DeviceScope() {
    if (prev_ != dev_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0, dev_ = 0;
};


// Work enqueued beside the caller's stream: side() is a stream of this host thread and device
// (one per `lane`: 0 at the default priority, the backwards' recomputed sweeps; 1 and 2 at the
// device's greatest priority, for latency-bound sweeps that share the GPU with a chunk-parallel
// kernel on `main`, whose blocks then yield SMs to theirs; gdn's pieces) that first waits for
// everything enqueued on `main` so far;
// follow() makes it wait again for what `main` has since; join() (or the destructor) makes `main`
// wait for the work enqueued on side(). All waits are events (the fork / join pattern graph capture
// accepts; the CudaGraph tests capture it). In a dry run (workspace_size), and with
// HILA_SIDE_STREAM=0 (everything on the caller's stream, in order), side() is `main`. Work put on
// side() must not allocate (NoAllocScope): a caller's workspace is reused in the order of `main`;
// run(work) calls work(side()) inside one. mark(i) records the side's work so far as its mark i (an
// event of this thread, device, lane and i), and wait_mark(i) makes `main` wait for the last record
// of mark i: the work enqueued on main after it may start once side() has done that much.
inline constexpr int kSideLanes = 3;
class SideStream {
 public:
  explicit SideStream(cudaStream_t main, int lane = 0);
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  cudaStream_t side() const { return side_; }
  template <class F>
  void run(F&& work) const;
  void follow() const;
  void mark(int i) const;
  void wait_mark(int i) const;
  void join();

 private:
  cudaStream_t main_, side_;
  int lane_;
  bool joined_ = false;
};
template <class F>
void SideStream::run(F&& work) const {
  const NoAllocScope no_alloc;
  work(side_);
}

// Multiprocessors of the current device (read once per device).
int sm_count();
// Dynamic shared memory one block may opt into on the current device (bytes; read once per device).
size_t smem_optin();
// Total memory of the current device (bytes; read once per device).
size_t device_total_memory();

// What the launch policies (dispatch/heuristics.h) know of the device.
inline heuristics::Device device_info() { return heuristics::Device{sm_count(), smem_optin()}; }

// Whether `kernel` has been opted into at least `bytes` of dynamic shared memory on the current
// device (note_smem records it): the attribute is set once per kernel and device, not per launch.
bool smem_set(const void* kernel, size_t bytes);
void note_smem(const void* kernel, size_t bytes);

// Opts a kernel into `bytes` of dynamic shared memory; with max_carveout also into the carveout
// that gives the SM's unified memory to shared memory (kernels with several large blocks per SM).
// Both attributes are set once per kernel and device, not per launch.
template <class F>
void set_smem(F* kernel, size_t bytes, bool max_carveout = false) {
  const void* k = reinterpret_cast<const void*>(kernel);
  if (smem_set(k, bytes)) return;
  HILA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  if (max_carveout)
    HILA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         int(cudaSharedmemCarveoutMaxShared)));
  note_smem(k, bytes);
}

}  // namespace hila::cuda
