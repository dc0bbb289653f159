// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's entry points (backend.h): what a call may run on the device, the device scope
// and the call's workspace (the caller's, checked, or the pool; a measuring arena for
// workspace_size), and the dtype of the kernels. The work itself is the composition (compose.cu)
// and the decode step (step/).
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/backend.h"
#include "cuda/compose.cuh"
#include "cuda/dispatch/static_switch.h"
#include "cuda/pool.cuh"
#include "cuda/prims/tile.cuh"
#include "cuda/runtime/runtime.cuh"
#include "cuda/step/step.cuh"
#include "hila/error.h"

namespace hila::detail {

void cuda_check_supported(const Resolved& r, DType dt) {
  if (r.form != Form::chunk)
    throw Error("form", std::string("expected chunk on a CUDA device (the naive, serial and scan forms "
                                    "run on the CPU backend), got ") + form_name(r.form));
  // The GLA family takes any power of two up to kChunk (its kernels hold a shorter chunk like a
  // partial one); the log-linear and delta kernels index levels and WY blocks by the 64-row chunk.
  const bool fixed = r.traits.loglinear || r.traits.delta;
  if (fixed ? r.chunk != cuda::kChunk : (r.chunk < 1 || r.chunk > cuda::kChunk || (r.chunk & (r.chunk - 1))))
    throw Error("chunk", std::string("expected ") +
                             (fixed ? std::to_string(cuda::kChunk) + " for " + op_name(r.cfg.op)
                                    : "a power of two up to " + std::to_string(cuda::kChunk)) +
                             " on a CUDA device, got " + std::to_string(r.chunk));
  if (r.traits.delta) return;  // the delta sweeps keep their matrices in global scratch (delta/)
  const size_t optin = cuda::smem_optin();
  const size_t need = HILA_DTYPE_SWITCH(dt, T, [&] {
    return cuda::compose_smem_need<T>(cuda::pad16(r.dk), cuda::pad16(r.dvp), r.traits.loglinear);
  });
  if (need > optin)
    throw Error("dk", std::string("expected head dims whose tiles fit in shared memory (") +
                          std::to_string(optin) + " bytes per block on this device), got dk = " +
                          std::to_string(r.dk) + ", dv = " + std::to_string(r.dv) + " in " + dtype_name(dt) +
                          ", which needs " + std::to_string(need) + "; use bfloat16/float16 or smaller head dims");
}

namespace {

// The composition in the operand type T, for p's direction.
template <class T>
void compose(const Resolved& r, const ForwardParams& p, cudaStream_t s) {
  cuda::compose_forward<T>(r, p, s);
}
template <class T>
void compose(const Resolved& r, const BackwardParams& p, cudaStream_t s) {
  cuda::compose_backward<T>(r, p, s);
}
template <class P>
void compose_dtype(const Resolved& r, const P& p, cudaStream_t s) {
  HILA_DTYPE_SWITCH(p.q.dtype, T, [&] { compose<T>(r, p, s); });
}
// A forward on a state pool runs on the gathered rows (cuda/pool.cuh); anything else as it is.
template <class P>
void compose_call(const Resolved& r, const P& p, cudaStream_t s) {
  if constexpr (std::is_same_v<P, ForwardParams>) {
    if (p.state_indices.defined()) {
      const cuda::PoolCall pool(r, p, s);
      ForwardParams q = p;
      q.init = pool.init(), q.final_state = pool.final();
      q.state_indices = {}, q.init_pos_host = {};
      compose_dtype(r, q, s);
      pool.finish(p);
      return;
    }
  }
  compose_dtype(r, p, s);
}

// ---- the workspace size of a call, measured once per call signature and host thread

// A 64-bit signature of everything a call's temporaries depend on: options, the layout of every
// tensor (shape, strides, dtype, which are given, the low bits of the address that the in-place
// and TMA paths test), the sequence table with its positions, and the knobs. workspace_size()
// stores its dry run's result under it, so the call that follows (which checks its workspace, or
// its memory need) finds it instead of planning twice; a collision could only misjudge that
// check, and the arena still refuses to run past the caller's workspace (runtime/arena.cu).
struct Signature {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  void add(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull + h;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    h = x ^ (x >> 31);
  }
  void add(double x) {
    uint64_t u;
    std::memcpy(&u, &x, 8);
    add(u);
  }
  void add(const TensorView& t) {
    add(uint64_t(t.ndim + 1));
    if (!t.defined()) return;
    add(uint64_t(t.dtype) << 32 | uint64_t(t.device.index));
    add(uint64_t(reinterpret_cast<uintptr_t>(t.data) & 255));
    for (int i = 0; i < t.ndim; ++i) add(uint64_t(t.shape[i])), add(uint64_t(t.stride[i]));
  }
  void add(const StateView& s) { add(s.pos), add(s.S), add(s.P), add(s.H); }
};

uint64_t signature(const Resolved& r, const ForwardParams& p, bool backward) {
  Signature g;
  const OpConfig& c = p.cfg;
  g.add(uint64_t(c.op) | uint64_t(c.normalize) << 8 | uint64_t(c.gates) << 9 | uint64_t(c.qk_l2norm) << 10 |
        uint64_t(backward) << 11 | uint64_t(p.form) << 12);
  g.add(c.scale), g.add(c.eps), g.add(c.ridge), g.add(uint64_t(p.chunk));
  g.add(uint64_t(reinterpret_cast<uintptr_t>(&cuda::config())));  // the knobs (reload_config makes new ones)
  for (const TensorView* t : {&p.q, &p.k, &p.v, &p.g, &p.lam, &p.beta, &p.cu_seqlens, &p.o, &p.state_indices}) g.add(*t);
  g.add(p.init), g.add(p.final_state);
  for (const SeqInfo& q : r.seqs) g.add(uint64_t(q.b)), g.add(uint64_t(q.row0)), g.add(uint64_t(q.len)), g.add(uint64_t(q.n0));
  return g.h;
}
uint64_t signature(const Resolved& r, const BackwardParams& p) {
  Signature g;
  g.add(signature(r, static_cast<const ForwardParams&>(p), true));
  for (const TensorView* t : {&p.d_o, &p.dq, &p.dk, &p.dv, &p.dg, &p.dlam, &p.dbeta}) g.add(*t);
  g.add(p.d_final), g.add(p.d_init);
  return g.h;
}
uint64_t signature(const Resolved& r, const ForwardParams& p) { return signature(r, p, false); }

struct SizeCache {
  struct Entry {
    uint64_t key = 0;
    size_t bytes = 0;
    bool used = false;
  };
  Entry e[8];
  int next = 0;
  bool find(uint64_t key, size_t& bytes) const {
    for (const Entry& x : e)
      if (x.used && x.key == key) return bytes = x.bytes, true;
    return false;
  }
  void put(uint64_t key, size_t bytes) {
    for (Entry& x : e)
      if (x.used && x.key == key) return void(x.bytes = bytes);
    e[next] = {key, bytes, true};
    next = (next + 1) % 8;
  }
};
thread_local SizeCache t_sizes;

// The call as a dry run under a measuring arena: the peak of its temporaries.
template <class P>
size_t dry_run_size(const Resolved& r, const P& p) {
  cuda::Arena arena(nullptr, 0);
  {
    const cuda::ArenaScope in(&arena);
    compose_call(r, p, static_cast<cudaStream_t>(p.stream));
  }
  return arena.peak() ? arena.peak() + 256 : 0;  // + the slack of aligning the caller's pointer
}

template <class P>
size_t size_of_call(const Resolved& r, const P& p, uint64_t key) {
  size_t bytes = 0;
  if (t_sizes.find(key, bytes)) return bytes;
  bytes = dry_run_size(r, p);
  t_sizes.put(key, bytes);
  return bytes;
}

int64_t view_bytes(const TensorView& t) {
  return t.defined() ? t.numel() * dtype_size(t.dtype) : 0;
}
int64_t state_bytes(const StateView& s) {
  return view_bytes(s.pos) + view_bytes(s.S) + view_bytes(s.P) + view_bytes(s.H);
}
// Bytes of a call's tensors: (inputs, outputs).
std::pair<int64_t, int64_t> io_bytes(const ForwardParams& p) {
  int64_t in = 0;
  for (const TensorView* t : {&p.q, &p.k, &p.v, &p.g, &p.lam, &p.beta}) in += view_bytes(*t);
  return {in + state_bytes(p.init), view_bytes(p.o) + state_bytes(p.final_state)};
}
std::pair<int64_t, int64_t> io_bytes(const BackwardParams& p) {
  auto [in, out] = io_bytes(static_cast<const ForwardParams&>(p));
  in += view_bytes(p.d_o) + state_bytes(p.d_final);
  for (const TensorView* t : {&p.dq, &p.dk, &p.dv, &p.dg, &p.dlam, &p.dbeta}) out += view_bytes(*t);
  return {in, out + state_bytes(p.d_init)};
}

// Device memory, before anything of a call on the stream-ordered pool is launched: its temporaries
// against what the device can give (its free memory plus what the pool keeps cached and unused),
// and temporaries + outputs against the configured limit (hila::set_memory_limit,
// HILA_MAX_MEMORY) when there is one. A call whose tensors are small next to the device (below
// 1/512 of its memory) is not measured for this (that would plan it twice), nor is the device
// asked while the stream is being captured: an allocation that fails anyway is reported as
// hila::Error("memory") where it happens.
template <class P>
void check_device_memory(const Resolved& r, const P& p, int device) {
  const int64_t limit = configured_memory_limit();
  const auto [in, out] = io_bytes(p);
  const size_t total = cuda::device_total_memory();
  if (limit == 0 && double(in + out) < double(total) / 512) return;
  const size_t need = size_of_call(r, p, signature(r, p));
  if (limit > 0 && double(need) + double(out) > double(limit))
    throw Error("memory", "needs " + bytes_str(double(need) + double(out)) + " of device memory on cuda:" +
                              std::to_string(device) + " (temporaries " + bytes_str(double(need)) + ", outputs " +
                              bytes_str(double(out)) + "), more than the " + bytes_str(double(limit)) +
                              " hila may take (HILA_MAX_MEMORY or hila::set_memory_limit)");
  if (need == 0) return;
  // Under stream capture the device is not asked: a graph's temporaries are its memory nodes,
  // allocated when it is instantiated and launched, so the free memory now says nothing about
  // them, and a call that is not stream work may invalidate a cudaStreamCaptureModeGlobal capture.
  if (cuda::CallScope* c = cuda::CallScope::current(); c && c->capturing()) return;
  size_t free_b = 0, tot = 0;
  HILA_CUDA_CHECK(cudaMemGetInfo(&free_b, &tot));
  uint64_t reserved = 0, used = 0;
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess &&
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved) == cudaSuccess &&
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used) == cudaSuccess) {
  } else {
    (void)cudaGetLastError();
    reserved = used = 0;
  }
  const double cached = reserved > used ? double(reserved - used) : 0.0;
  if (double(need) > double(free_b) + cached)
    throw Error("memory", "needs " + bytes_str(double(need)) + " of device memory on cuda:" + std::to_string(device) +
                              " for the call's temporaries, more than the " + bytes_str(double(free_b) + cached) +
                              " available (" + bytes_str(double(free_b)) + " free, " + bytes_str(cached) +
                              " cached in the stream-ordered pool); pass a workspace or make the call smaller");
}

// Device memory of `device`: the workspace pointers verified on this thread (cudaPointerGetAttributes
// once per pointer, not per call).
bool workspace_on(const void* ws, int device) {
  thread_local const void* seen[4] = {};
  thread_local int seen_dev[4] = {};
  thread_local int next = 0;
  for (int i = 0; i < 4; ++i)
    if (seen[i] == ws) return seen_dev[i] == device;
  cudaPointerAttributes at{};
  HILA_CUDA_CHECK(cudaPointerGetAttributes(&at, ws));
  if ((at.type != cudaMemoryTypeDevice && at.type != cudaMemoryTypeManaged) || at.device != device)
    throw Error("workspace", "expected device memory on cuda:" + std::to_string(device) + " (like q), got " +
                                 (at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged
                                      ? "memory of cuda:" + std::to_string(at.device)
                                      : std::string("host memory")));
  seen[next] = ws, seen_dev[next] = device, next = (next + 1) % 4;
  return true;
}

// Runs the call on the caller's workspace when there is one (after checking its size and device),
// else on the pool (after checking the device's memory).
template <class P>
void run_call(const Resolved& r, const P& p) {
  cuda::CallScope scope(p.q.device.index, static_cast<cudaStream_t>(p.stream));
  cuda_check_supported(r, p.q.dtype);
  const auto s = static_cast<cudaStream_t>(p.stream);
  if (!p.workspace) {
    check_device_memory(r, p, p.q.device.index);
    return compose_call(r, p, s);
  }
  workspace_on(p.workspace, p.q.device.index);
  const size_t need = size_of_call(r, p, signature(r, p));
  if (p.workspace_bytes < need)
    throw Error("workspace_bytes", "expected at least " + std::to_string(need) +
                                       " bytes for this call (hila::workspace_size), got " + std::to_string(p.workspace_bytes));
  cuda::Arena arena(p.workspace, p.workspace_bytes);
  const cuda::ArenaScope in(&arena);
  compose_call(r, p, s);
}

// The size query: a dry run, remembered for the call that follows.
template <class P>
size_t measure(const Resolved& r, const P& p) {
  cuda::CallScope scope(p.q.device.index, static_cast<cudaStream_t>(p.stream));
  cuda_check_supported(r, p.q.dtype);
  const size_t bytes = dry_run_size(r, p);
  t_sizes.put(signature(r, p), bytes);
  return bytes;
}

}  // namespace

void cuda_forward(const Resolved& r, const ForwardParams& p) { run_call(r, p); }
void cuda_backward(const Resolved& r, const BackwardParams& p) { run_call(r, p); }
size_t cuda_workspace_size(const Resolved& r, const ForwardParams& p) { return measure(r, p); }
size_t cuda_workspace_size(const Resolved& r, const BackwardParams& p) { return measure(r, p); }

size_t cuda_step_counter_bytes(int64_t N, int64_t H) { return cuda::step_counter_bytes(N, H); }

void cuda_step(const Resolved& r, const StepParams& p, const StateView& state, void* counters) {
  cuda::CallScope scope(p.q.device.index, static_cast<cudaStream_t>(p.stream));
  if (r.dk > cuda::kStepMaxDk)
    throw Error("q", "expected head dim dk <= " + std::to_string(cuda::kStepMaxDk) +
                         " for a decode step on a CUDA device, got " + std::to_string(r.dk));
  const cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  HILA_DTYPE_SWITCH(p.q.dtype, T, [&] { cuda::decode_step<T>(r, p, state, counters, s); });
}

}  // namespace hila::detail
