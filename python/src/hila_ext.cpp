// SPDX-License-Identifier: Apache-2.0
// hila._C, the nanobind extension behind the Python package.
//
// Deliberately thin: it turns DLPack arrays (numpy, torch, cupy, jax, ...) into hila::TensorView
// (data, dtype, device, shape, strides in elements), calls the C++ API with the GIL released, and
// turns hila::Error into hila.HilaError (a ValueError carrying `.argument`). It never allocates a
// tensor: the callers (hila.ops for any array library, hila.torch for torch) pass the outputs, so
// memory always belongs to the caller's framework and device.
//
// Devices and streams: arrays on CUDA are recognised (DeviceType::cuda with the DLPack device id)
// and every call takes `stream`, the caller's cudaStream_t as an integer (0: the default stream),
// handed to the C++ params when they have a `stream` field. A library built without the CUDA
// backend (no HILA_WITH_CUDA) gets no device arrays at all: `require_host` rejects them here with
// a HilaError naming the argument.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ext_api.h"
#include "hila/hila.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using hila::DType;
using hila::Error;
using hila::OpConfig;
using hila::StateView;
using hila::TensorView;

using In = nb::ndarray<nb::ro>;  // any dtype, shape and device; read-only arrays accepted
using Out = nb::ndarray<>;       // written in place
using OptIn = std::optional<In>;
using OptOut = std::optional<Out>;
// A state as (pos, S, P, H), the order of hila.State; absent parts are None.
using StateIn = std::tuple<OptIn, OptIn, OptIn, OptIn>;
using StateOut = std::tuple<OptOut, OptOut, OptOut, OptOut>;

DType dtype_of(const std::string& name, nb::dlpack::dtype d) {
  return hila_ext::dtype_from_dlpack(name.c_str(), d.code, d.bits, d.lanes);
}

hila::Device device_of(const std::string& name, int type, int id) {
  return hila_ext::device_from_dlpack(name.c_str(), type, id);
}

// Without a CUDA backend, device memory never reaches the library (see the file comment).
void require_host(const std::string& name, const TensorView& t) {
#ifndef HILA_WITH_CUDA
  if (t.defined() && t.device.type != hila::DeviceType::cpu)
    throw Error(name, "expected a CPU array: this build of hila has no CUDA backend, got " +
                          hila::device_name(t.device));
#endif
}

// The caller's stream, for params that carry one (cudaStream_t; 0 is the default stream).
template <class P>
void set_stream(P& p, uintptr_t stream) {
  if constexpr (requires { p.stream; }) p.stream = reinterpret_cast<decltype(p.stream)>(stream);
}

template <class A>
TensorView view_of(const std::string& name, const A& a) {
  hila_ext::check_ndim(name.c_str(), static_cast<int64_t>(a.ndim()));
  TensorView t;
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.dtype = dtype_of(name, a.dtype());
  t.device = device_of(name, a.device_type(), a.device_id());
  t.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = static_cast<int64_t>(a.shape(i));
    t.stride[i] = a.stride(i);
  }
  require_host(name, t);
  return t;
}

template <class A>
TensorView view_of(const std::string& name, const std::optional<A>& a) {
  return a ? view_of(name, *a) : TensorView{};
}

template <class T>
StateView state_of(const std::string& prefix, const std::optional<T>& s) {
  StateView v;
  if (!s) return v;
  v.pos = view_of(prefix + ".pos", std::get<0>(*s));
  v.S = view_of(prefix + ".S", std::get<1>(*s));
  v.P = view_of(prefix + ".P", std::get<2>(*s));
  v.H = view_of(prefix + ".H", std::get<3>(*s));
  return v;
}

// Untied gates are told apart by their extra column axis: g [B, T, H, P] (or [N, H, P] per step).
OpConfig with_gates(OpConfig cfg, const TensorView& g, int tied_ndim) {
  cfg.gates = g.defined() && g.ndim == tied_ndim + 1 ? hila::Gates::untied : hila::Gates::tied;
  return cfg;
}

OpConfig make_config(const std::string& op, double scale, bool normalize, double eps, double ridge,
                     bool qk_l2norm, bool check_values) {
  OpConfig c;
  c.op = hila::parse_op(op);
  c.scale = scale;
  c.normalize = normalize;
  c.eps = eps;
  c.ridge = ridge;
  c.qk_l2norm = qk_l2norm;
  c.check_values = check_values;
  return c;
}

// ---------------------------------------------------------------------------------- calls

// The caller's framework provides the call's device temporaries: `alloc(nbytes)` returns a byte
// array on the call's device (or None: the device's stream-ordered pool). Asked only when the call
// needs a workspace (CUDA); the array is held in `keep` until the call has been enqueued, and the
// framework's allocator orders its reuse on the call's stream.
using Alloc = std::optional<nb::callable>;

// A workspace array as (device, data, bytes): any dtype and shape, contiguous, writable.
struct Span {
  hila::Device device;
  void* data = nullptr;
  size_t bytes = 0;
};
Span span_of(const nb::object& obj) {
  Out a;
  if (!nb::try_cast(obj, a))
    throw Error("workspace", "expected a writable DLPack array from the allocator, got " +
                                 std::string(nb::str(nb::type_name(obj.type())).c_str()));
  int64_t expect = 1;  // strides in elements, innermost first
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect)
      throw Error("workspace", "expected a contiguous array from the allocator, got stride " +
                                   std::to_string(a.stride(i)) + " in dimension " + std::to_string(i));
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return Span{device_of("workspace", a.device_type(), a.device_id()), a.data(), a.nbytes()};
}

template <class P>
void attach_workspace(P& p, const Alloc& alloc, nb::object& keep) {
  if (!alloc || p.q.device.type == hila::DeviceType::cpu) return;
  size_t bytes = 0;
  {
    nb::gil_scoped_release nogil;
    bytes = hila::workspace_size(p);
  }
  if (bytes == 0) return;
  keep = (*alloc)(bytes);
  if (keep.is_none()) return;
  const Span ws = span_of(keep);
  if (ws.device.type != p.q.device.type || ws.device.index != p.q.device.index || ws.bytes < bytes)
    throw Error("workspace", "expected " + std::to_string(bytes) + " bytes on " + hila::device_name(p.q.device) +
                                 " from the allocator, got " + std::to_string(ws.bytes) + " bytes on " +
                                 hila::device_name(ws.device));
  p.workspace = ws.data;
  p.workspace_bytes = ws.bytes;
}

// Host copies of device values (cu_seqlens, initial positions) that spare their reads.
struct HostCopies {
  OptIn cu_seqlens, init_pos;
};

// The inputs forward and backward share (BackwardParams extends ForwardParams).
void set_inputs(hila::ForwardParams& p, const OpConfig& cfg, const std::string& form, int64_t chunk,
                const In& q, const In& k, const In& v, const OptIn& g, const OptIn& lam,
                const OptIn& beta, const OptIn& cu_seqlens, const std::optional<StateIn>& init,
                const OptOut& o, const std::optional<StateOut>& final_state, uintptr_t stream,
                const HostCopies& host) {
  p.form = hila::parse_form(form);
  p.chunk = chunk;
  p.q = view_of("q", q);
  p.k = view_of("k", k);
  p.v = view_of("v", v);
  p.g = view_of("g", g);
  p.lam = view_of("lam", lam);
  p.beta = view_of("beta", beta);
  p.cu_seqlens = view_of("cu_seqlens", cu_seqlens);
  p.init = state_of("init", init);
  p.o = view_of("o", o);
  p.final_state = state_of("final_state", final_state);
  p.cu_seqlens_host = view_of("cu_seqlens_host", host.cu_seqlens);
  p.init_pos_host = view_of("init_pos_host", host.init_pos);
  p.cfg = with_gates(cfg, p.g, 3);
  set_stream(p, stream);
}

void forward(const OpConfig& cfg, const std::string& form, int64_t chunk, const In& q, const In& k,
             const In& v, const OptIn& g, const OptIn& lam, const OptIn& beta,
             const OptIn& cu_seqlens, const std::optional<StateIn>& init, const Out& o,
             const std::optional<StateOut>& final_state, uintptr_t stream, const Alloc& workspace,
             const OptIn& cu_seqlens_host, const OptIn& init_pos_host, const OptIn& state_indices) {
  hila::ForwardParams p;
  set_inputs(p, cfg, form, chunk, q, k, v, g, lam, beta, cu_seqlens, init, o, final_state, stream,
             HostCopies{cu_seqlens_host, init_pos_host});
  p.state_indices = view_of("state_indices", state_indices);
  nb::object keep;
  attach_workspace(p, workspace, keep);
  nb::gil_scoped_release nogil;
  hila::forward(p);
}

void backward(const OpConfig& cfg, const std::string& form, int64_t chunk, const In& q,
              const In& k, const In& v, const OptIn& g, const OptIn& lam, const OptIn& beta,
              const OptIn& cu_seqlens, const std::optional<StateIn>& init, const In& d_o,
              const std::optional<StateIn>& d_final, const OptOut& dq, const OptOut& dk,
              const OptOut& dv, const OptOut& dg, const OptOut& dlam, const OptOut& dbeta,
              const std::optional<StateOut>& d_init, const OptOut& o,
              const std::optional<StateOut>& final_state, uintptr_t stream, const Alloc& workspace,
              const OptIn& cu_seqlens_host, const OptIn& init_pos_host) {
  hila::BackwardParams p;
  set_inputs(p, cfg, form, chunk, q, k, v, g, lam, beta, cu_seqlens, init, o, final_state, stream,
             HostCopies{cu_seqlens_host, init_pos_host});
  p.d_o = view_of("d_o", d_o);
  p.d_final = state_of("d_final", d_final);
  p.dq = view_of("dq", dq);
  p.dk = view_of("dk", dk);
  p.dv = view_of("dv", dv);
  p.dg = view_of("dg", dg);
  p.dlam = view_of("dlam", dlam);
  p.dbeta = view_of("dbeta", dbeta);
  p.d_init = state_of("d_init", d_init);
  nb::object keep;
  attach_workspace(p, workspace, keep);
  nb::gil_scoped_release nogil;
  hila::backward(p);
}

hila::StepParams step_params(const OpConfig& cfg, const In& q, const In& k, const In& v,
                             const OptIn& g, const OptIn& lam, const OptIn& beta, const Out& o,
                             uintptr_t stream) {
  hila::StepParams p;
  p.q = view_of("q", q);
  p.k = view_of("k", k);
  p.v = view_of("v", v);
  p.g = view_of("g", g);
  p.lam = view_of("lam", lam);
  p.beta = view_of("beta", beta);
  p.o = view_of("o", o);
  p.cfg = with_gates(cfg, p.g, 2);
  set_stream(p, stream);
  return p;
}

// A per-token view [N, ...] as a call of one token [N, 1, ...].
TensorView one_token(const std::string& name, const TensorView& t, int ndim, const char* layout) {
  if (!t.defined()) return t;
  if (t.ndim != ndim)
    throw Error(name, "expected " + std::to_string(ndim) + " dimensions " + layout + ", got " +
                          std::to_string(t.ndim) + " dimensions " + t.shape_str());
  TensorView r = t;
  r.ndim = ndim + 1;
  for (int i = ndim - 1; i >= 1; --i) {
    r.shape[i + 1] = t.shape[i];
    r.stride[i + 1] = t.stride[i];
  }
  r.shape[1] = 1;
  r.stride[1] = 0;
  return r;
}

// One decode step on a caller-owned state (pos, S, P, H), written to `state_out`: a forward call
// over one token with the state as initial and `state_out` as final state, so it needs no copies
// and runs on every device forward runs on. The chunk form (chunk 64, the size every backend
// takes) covers one token exactly like the serial form. A log-linear `state_out.H` needs the
// slots of the new positions (hila.torch keeps the capacity of the cache it was built for).
void step_state(const OpConfig& cfg, const In& q, const In& k, const In& v, const OptIn& g,
                const OptIn& lam, const OptIn& beta, const StateIn& state, const Out& o,
                const StateOut& state_out, uintptr_t stream) {
  const hila::StepParams s = step_params(cfg, q, k, v, g, lam, beta, o, stream);
  hila::ForwardParams p;
  p.cfg = s.cfg;
  p.form = hila::Form::chunk;
  p.chunk = 64;
  p.q = one_token("q", s.q, 3, "[N, G, dk]");
  p.k = one_token("k", s.k, 3, "[N, G, dk]");
  p.v = one_token("v", s.v, 3, "[N, H, dv]");
  p.g = one_token("g", s.g, s.g.ndim == 3 ? 3 : 2, "[N, H] (or [N, H, P] with untied gates)");
  p.lam = one_token("lam", s.lam, 3, "[N, H, L]");
  p.beta = one_token("beta", s.beta, 2, "[N, H]");
  p.o = one_token("o", s.o, 3, "[N, H, dv]");
  p.init = state_of("state", std::optional<StateIn>(state));
  p.final_state = state_of("state_out", std::optional<StateOut>(state_out));
  set_stream(p, stream);
  if (!p.init.pos.defined()) throw Error("state.pos", "is required (int64 [N] positions), got nothing");
  nb::gil_scoped_release nogil;
  try {
    hila::forward(p);
  } catch (const Error& e) {
    // Name the states as the caller does: init.* -> state.*, final_state.* -> state_out.*
    const std::string& arg = e.argument();
    const std::string what = std::string(e.what()).substr(std::string("hila: argument '" + arg + "': ").size());
    for (const auto& [from, to] : {std::pair<std::string, std::string>{"init", "state"}, {"final_state", "state_out"}})
      if (arg.rfind(from + ".", 0) == 0) throw Error(to + arg.substr(from.size()), what);
    throw;
  }
}

// One fused decode step in place on a caller-owned state (pos, S, P, H): hila::step(StepParams,
// StateView), the library's decode kernel on every backend. The state (pos included) is advanced
// in its own memory; a log-linear H needs bitlen(pos + 1) + 1 slots (never grown here). Arguments
// are named as the Python caller names them (q, ..., o, state.pos, state.S, state.P, state.H).
// Steps in place of one caller-owned state serialize: the state is identified by the address of
// its positions, and a step holds that state's lock from reading the positions to writing them,
// so two threads stepping one state never lose an update (on CUDA the lock covers the enqueue:
// steps of one state belong on one stream). States at other addresses step in parallel.
class StateLocks {
 public:
  // The lock of the state whose positions are at `key`, held for the caller until release(key):
  // every acquire of one key before its last release gets the same mutex.
  std::shared_ptr<std::mutex> acquire(const void* key) {
    std::lock_guard<std::mutex> g(mu_);
    auto& e = locks_[key];
    if (!e.m) e.m = std::make_shared<std::mutex>();
    ++e.users;
    return e.m;
  }
  void release(const void* key) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = locks_.find(key);
    if (--it->second.users == 0) locks_.erase(it);
  }

  // One step's hold of a state's lock (step_inplace: a state not bound).
  class Guard {
   public:
    Guard(StateLocks& l, const void* key) : l_(l), key_(key), m_(l.acquire(key)) { m_->lock(); }
    ~Guard() {
      m_->unlock();
      l_.release(key_);
    }

   private:
    StateLocks& l_;
    const void* key_;
    std::shared_ptr<std::mutex> m_;
  };

 private:
  struct Entry {
    std::shared_ptr<std::mutex> m;
    int users = 0;
  };
  std::mutex mu_;
  std::map<const void*, Entry> locks_;
};
StateLocks g_state_locks;

// hila::step on a caller-owned state; the caller holds the state's lock (and not the GIL).
void step_named(const hila::StepParams& p, const StateView& s) {
  try {
    hila::step(p, s);
  } catch (const Error& e) {
    // The library names the state's parts state.* already; an initial-state check reports init.*.
    const std::string& arg = e.argument();
    if (arg.rfind("init.", 0) != 0) throw;
    const std::string what = std::string(e.what()).substr(std::string("hila: argument '" + arg + "': ").size());
    throw Error("state" + arg.substr(4), what);
  }
}

// hila::step on a caller-owned state under its lock (the GIL released).
void step_locked(const hila::StepParams& p, const StateView& s) {
  nb::gil_scoped_release nogil;
  const StateLocks::Guard lock(g_state_locks, s.pos.data);
  step_named(p, s);
}

// The parts every caller-owned state of a step has.
const StateView& require_step_state(const StateView& s) {
  if (!s.pos.defined()) throw Error("state.pos", "is required (int64 [N] positions), got nothing");
  if (!s.H.defined()) throw Error("state.H", "is required (the operator's outer state), got nothing");
  return s;
}

StateView caller_state(const StateOut& state) {
  return require_step_state(state_of("state", std::optional<StateOut>(state)));
}

void step_inplace(const OpConfig& cfg, const In& q, const In& k, const In& v, const OptIn& g,
                  const OptIn& lam, const OptIn& beta, const StateOut& state, const Out& o,
                  uintptr_t stream, const OptIn& state_indices, int64_t max_position, const OptOut& counters) {
  hila::StepParams p = step_params(cfg, q, k, v, g, lam, beta, o, stream);
  p.state_indices = view_of("state_indices", state_indices);
  p.max_position = max_position;
  p.counters = view_of("counters", counters);
  step_locked(p, caller_state(state));
}

// An array lent for one call as an unconsumed DLPack capsule (what torch.utils.dlpack.to_dlpack
// returns): its DLTensor read in place, the capsule left as it is. The caller's reference keeps
// the capsule, hence the memory, alive for the call; the capsule's own destructor frees it later.
// Saves the import of a consumed capsule (an owning handle per array) on the decode hot path.
// Capsule layouts (DLPack): "dltensor" holds a DLManagedTensor {DLTensor, ctx, deleter};
// "dltensor_versioned" a DLManagedTensorVersioned {version, ctx, deleter, flags, DLTensor}.
struct DLPackVersioned {
  uint32_t major, minor;
  void* manager_ctx;
  void (*deleter)(void*);
  uint64_t flags;  // bit 0: read-only
  nb::dlpack::dltensor dl_tensor;
};

TensorView lent_view(const char* name, nb::handle cap, bool writable) {
  PyObject* c = cap.ptr();
  const nb::dlpack::dltensor* t = nullptr;
  bool read_only = false;
  if (PyCapsule_IsValid(c, "dltensor")) {
    t = static_cast<const nb::dlpack::dltensor*>(PyCapsule_GetPointer(c, "dltensor"));
  } else if (PyCapsule_IsValid(c, "dltensor_versioned")) {
    const auto* m = static_cast<const DLPackVersioned*>(PyCapsule_GetPointer(c, "dltensor_versioned"));
    if (m->major != 1)
      throw Error(name, "expected a DLPack 1.x capsule, got version " + std::to_string(m->major));
    t = &m->dl_tensor;
    read_only = (m->flags & 1) != 0;
  } else {
    throw Error(name, "expected an unused DLPack capsule, got " + std::string(nb::str(nb::type_name(cap.type())).c_str()));
  }
  if (writable && read_only) throw Error(name, "expected a writable array, got a read-only one");
  if (t->ndim < 0 || t->ndim > hila::kMaxDims)
    throw Error(name, "expected at most " + std::to_string(hila::kMaxDims) + " dimensions, got " +
                          std::to_string(t->ndim));
  TensorView v;
  v.data = static_cast<char*>(t->data) + t->byte_offset;
  v.dtype = dtype_of(name, t->dtype);
  v.device = device_of(name, t->device.device_type, t->device.device_id);
  v.ndim = t->ndim;
  int64_t compact = 1;  // strides == nullptr: compact row-major
  for (int i = t->ndim - 1; i >= 0; --i) {
    v.shape[i] = t->shape[i];
    v.stride[i] = t->strides ? t->strides[i] : compact;
    compact *= t->shape[i];
  }
  require_host(name, v);
  return v;
}

TensorView lent_view_or_none(const char* name, nb::handle cap) {
  return cap.is_none() ? TensorView{} : lent_view(name, cap, false);
}

// A caller-owned state bound once for many in-place steps (hila.torch's decode loop): its parts
// are taken over DLPack once and held (so their arrays stay alive while this object lives), and
// it holds the state's lock entry (the one step_inplace takes for these positions) for its life,
// so a step locks that mutex without a lookup. A step reads the token's arrays from lent capsules
// (lent_view) and runs step_inplace's hila::step: the same validation of every argument, the same
// lock, the same errors. The caller must not re-point the state's arrays at other memory
// (hila.torch compares their data pointers before each step).
class BoundState {
 public:
  explicit BoundState(const StateOut& state)
      : parts_(state), view_(caller_state(parts_)), mu_(g_state_locks.acquire(view_.pos.data)) {}
  ~BoundState() { g_state_locks.release(view_.pos.data); }
  BoundState(const BoundState&) = delete;
  BoundState& operator=(const BoundState&) = delete;

  // o: the data pointer of a C-contiguous array shaped, typed and placed like v (hila.torch makes
  // it with torch.empty_like(v, memory_format=torch.contiguous_format) for the call). counters: a
  // lent capsule of StepParams::counters, or None.
  void step(const OpConfig& cfg, nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle lam,
            nb::handle beta, uintptr_t o, uintptr_t stream, int64_t max_position, nb::handle counters) const {
    hila::StepParams p;
    p.q = lent_view("q", q, false);
    p.k = lent_view("k", k, false);
    p.v = lent_view("v", v, false);
    p.g = lent_view_or_none("g", g);
    p.lam = lent_view_or_none("lam", lam);
    p.beta = lent_view_or_none("beta", beta);
    if (o == 0) throw Error("o", "expected the data pointer of an output like v, got 0");
    p.o = TensorView::contiguous_view(reinterpret_cast<void*>(o), p.v.dtype, p.v.shape.data(), p.v.ndim, p.v.device);
    p.cfg = with_gates(cfg, p.g, 2);
    set_stream(p, stream);
    p.max_position = max_position;
    if (!counters.is_none()) p.counters = lent_view("counters", counters, true);
    nb::gil_scoped_release nogil;
    const std::lock_guard<std::mutex> lock(*mu_);
    step_named(p, view_);
  }

 private:
  StateOut parts_;
  StateView view_;
  std::shared_ptr<std::mutex> mu_;
};

// ---------------------------------------------------------------------------------- DecodeState

DType state_dtype(const std::string& name) {
  if (name == "float32") return DType::f32;
  if (name == "float64") return DType::f64;
  throw Error("dtype", "expected 'float32' or 'float64' for a decode state, got '" + name + "'");
}

// A state part as an array aliasing the DecodeState's memory, kept alive by `owner` (a capsule
// holding the blocks of the view: a later growth of the state moves it to new memory, the arrays
// keep the old): a numpy array in host memory; on a CUDA device a framework-neutral nanobind
// ndarray carrying the DLPack device (cuda, index), which torch.from_dlpack / cupy.from_dlpack take
// without a copy.
nb::object state_array(const TensorView& t, nb::handle owner) {
  size_t shape[hila::kMaxDims];
  for (int i = 0; i < t.ndim; ++i) shape[i] = static_cast<size_t>(t.shape[i]);
  nb::dlpack::dtype dt = t.dtype == DType::i64   ? nb::dtype<int64_t>()
                         : t.dtype == DType::f64 ? nb::dtype<double>()
                                                 : nb::dtype<float>();
  if (t.device.type == hila::DeviceType::cpu)
    return nb::cast(nb::ndarray<nb::numpy>(t.data, static_cast<size_t>(t.ndim), shape, owner,
                                           nullptr, dt, nb::device::cpu::value));
  return nb::cast(nb::ndarray<>(t.data, static_cast<size_t>(t.ndim), shape, owner, nullptr, dt,
                                nb::device::cuda::value, t.device.index));
}

nb::object part_or_none(const TensorView& t, nb::handle owner) {
  return t.defined() ? state_array(t, owner) : nb::none();
}

// hila::Device from a DLPack device (type code, id): kDLCPU (1) or kDLCUDA (2).
hila::Device dlpack_device(int type, int id) {
  if (type == nb::device::cpu::value) return {};
  if (type == nb::device::cuda::value) {
    if (id < 0) throw Error("device", "expected a CUDA device index >= 0, got " + std::to_string(id));
    return {hila::DeviceType::cuda, id};
  }
  throw Error("device", "expected a CPU (DLPack type 1) or CUDA (DLPack type 2) device, got DLPack "
                        "device type " + std::to_string(type));
}

nb::dict traits_dict(const std::string& op) {
  const hila::OpTraits t = hila::op_traits(hila::parse_op(op));
  nb::dict d;
  d["loglinear"] = t.loglinear;
  d["delta"] = t.delta;
  d["has_S"] = t.has_S;
  d["has_P"] = t.has_P;
  d["num_primitives"] = t.num_primitives;
  d["hla_family"] = t.hla_family;
  return d;
}

nb::dict state_shape_dict(const OpConfig& cfg, int64_t N, int64_t H, int64_t dk, int64_t dv,
                          int64_t max_pos) {
  const hila::StateShape s = hila::state_shape(cfg, N, H, dk, dv, max_pos);
  nb::dict d;
  d["pos"] = nb::cast(std::vector<int64_t>{N});
  d["S"] = s.S ? nb::cast(s.S_shape) : nb::none();
  d["P"] = s.P ? nb::cast(s.P_shape) : nb::none();
  d["H"] = nb::cast(s.H_shape);
  return d;
}

// ---------------------------------------------------------------------------------- lent calls
//
// hila_ext::Api (ext_api.h): the calls hila._torch_ops makes through this module's copy of the
// library. Its views come from at::Tensor, not DLPack: the host-only rule of view_of is applied
// here, in the order of the arguments, before the library sees them.

void require_host(const char* name, const StateView& s) {
  const std::string n(name);
  require_host(n + ".pos", s.pos);
  require_host(n + ".S", s.S);
  require_host(n + ".P", s.P);
  require_host(n + ".H", s.H);
}

void require_host_params(const hila::ForwardParams& p) {
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"q", &p.q}, {"k", &p.k}, {"v", &p.v},
                                {"g", &p.g}, {"lam", &p.lam}, {"beta", &p.beta}, {"cu_seqlens", &p.cu_seqlens}})
    require_host(name, *t);
  require_host("init", p.init);
  require_host("o", p.o);
  require_host("final_state", p.final_state);
}

void require_host_params(const hila::BackwardParams& p) {
  require_host_params(static_cast<const hila::ForwardParams&>(p));
  require_host("d_o", p.d_o);
  require_host("d_final", p.d_final);
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"dq", &p.dq}, {"dk", &p.dk},
                                {"dv", &p.dv}, {"dg", &p.dg}, {"dlam", &p.dlam}, {"dbeta", &p.dbeta}})
    require_host(name, *t);
  require_host("d_init", p.d_init);
}

// Runs f, turning an exception into *err (false).
template <class F>
bool lent(hila_ext::CallError* err, F&& f) noexcept {
  try {
    f();
    return true;
  } catch (const Error& e) {
    *err = {e.what(), e.argument()};
  } catch (const std::exception& e) {
    *err = {e.what(), {}};
  } catch (...) {
    *err = {"hila: unknown exception", {}};
  }
  return false;
}

const hila_ext::Api g_api{
    hila_ext::kApiVersion,
    sizeof(hila::ForwardParams),
    sizeof(hila::BackwardParams),
#ifdef HILA_WITH_CUDA
    1,
#else
    0,
#endif
    [](const hila::ForwardParams& p, hila_ext::CallError* err) noexcept {
      return lent(err, [&] {
        require_host_params(p);
        hila::forward(p);
      });
    },
    [](const hila::BackwardParams& p, hila_ext::CallError* err) noexcept {
      return lent(err, [&] {
        require_host_params(p);
        hila::backward(p);
      });
    },
    [](const hila::ForwardParams& p, size_t* bytes, hila_ext::CallError* err) noexcept {
      return lent(err, [&] { *bytes = hila::workspace_size(p); });
    },
    [](const hila::BackwardParams& p, size_t* bytes, hila_ext::CallError* err) noexcept {
      return lent(err, [&] { *bytes = hila::workspace_size(p); });
    },
    [](const char* op, const char* form, hila::Op* op_out, hila::Form* form_out, hila::Form* bwd_out,
       hila_ext::CallError* err) noexcept {
      return lent(err, [&] {
        *op_out = hila::parse_op(op);
        *form_out = hila::parse_form(form);
        *bwd_out = hila::supports(*op_out, *form_out, true) ? *form_out : hila::Form::chunk;
      });
    },
    sizeof(hila::StepParams),
    [](const hila::StepParams& p, const StateView& s, hila_ext::CallError* err) noexcept {
      return lent(err, [&] {
        for (const auto& [name, t] :
             {std::pair<const char*, const TensorView*>{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"g", &p.g},
              {"lam", &p.lam}, {"beta", &p.beta}, {"o", &p.o}, {"state_indices", &p.state_indices},
              {"counters", &p.counters}})
          require_host(name, *t);
        require_host("state", s);
        require_step_state(s);
        const StateLocks::Guard lock(g_state_locks, s.pos.data);
        step_named(p, s);
      });
    },
};

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "hila's C++ operators over DLPack arrays (internal; use hila.ops or hila.torch).";

  // hila::Error -> hila.HilaError(message, argument), a ValueError subclass defined in Python.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      nb::object cls = nb::module_::import_("hila._errors").attr("HilaError");
      nb::object exc = cls(e.what(), e.argument());
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });

  nb::class_<OpConfig>(m, "Config", "Operator configuration (hila::OpConfig); gates are inferred from g.")
      .def(
          "__init__",
          [](OpConfig* self, const std::string& op, double scale, bool normalize, double eps,
             double ridge, bool qk_l2norm, bool check_values) {
            new (self) OpConfig(make_config(op, scale, normalize, eps, ridge, qk_l2norm, check_values));
          },
          "op"_a, nb::kw_only(), "scale"_a = 0.0, "normalize"_a = false, "eps"_a = 1e-6,
           "ridge"_a = 0.0, "qk_l2norm"_a = false, "check_values"_a = true)
      .def_prop_ro("op", [](const OpConfig& c) { return std::string(hila::op_name(c.op)); })
      .def_ro("scale", &OpConfig::scale)
      .def_ro("normalize", &OpConfig::normalize)
      .def_ro("eps", &OpConfig::eps)
      .def_ro("ridge", &OpConfig::ridge)
      .def_ro("qk_l2norm", &OpConfig::qk_l2norm)
      .def_ro("check_values", &OpConfig::check_values)
      .def("__repr__", [](const OpConfig& c) {
        return std::string("Config(op='") + hila::op_name(c.op) + "', scale=" + std::to_string(c.scale) +
               ", normalize=" + (c.normalize ? "True" : "False") + ", eps=" + std::to_string(c.eps) +
               ", ridge=" + std::to_string(c.ridge) + ", qk_l2norm=" + (c.qk_l2norm ? "True" : "False") +
               ", check_values=" + (c.check_values ? "True" : "False") + ")";
      });

  m.def("forward", &forward, "cfg"_a, "form"_a, "chunk"_a, "q"_a, "k"_a, "v"_a, "g"_a.none(),
        "lam"_a.none(), "beta"_a.none(), "cu_seqlens"_a.none(), "init"_a.none(), nb::kw_only(),
        "o"_a, "final_state"_a.none() = nb::none(), "stream"_a = 0, "workspace"_a.none() = nb::none(),
        "cu_seqlens_host"_a.none() = nb::none(), "init_pos_host"_a.none() = nb::none(),
        "state_indices"_a.none() = nb::none(),
        "hila::forward: writes o (and final_state) in place. workspace: optional alloc(nbytes) -> byte "
        "array on the call's device for its temporaries (None: the device's stream-ordered pool). "
        "cu_seqlens_host / init_pos_host: host copies of cu_seqlens and of the initial positions "
        "(spare their device reads); state_indices: int32 [N] rows of init / final_state pools.");
  m.def("backward", &backward, "cfg"_a, "form"_a, "chunk"_a, "q"_a, "k"_a, "v"_a, "g"_a.none(),
        "lam"_a.none(), "beta"_a.none(), "cu_seqlens"_a.none(), "init"_a.none(), "d_o"_a,
        "d_final"_a.none(), nb::kw_only(), "dq"_a.none() = nb::none(), "dk"_a.none() = nb::none(),
        "dv"_a.none() = nb::none(), "dg"_a.none() = nb::none(), "dlam"_a.none() = nb::none(),
        "dbeta"_a.none() = nb::none(), "d_init"_a.none() = nb::none(), "o"_a.none() = nb::none(),
        "final_state"_a.none() = nb::none(), "stream"_a = 0, "workspace"_a.none() = nb::none(),
        "cu_seqlens_host"_a.none() = nb::none(), "init_pos_host"_a.none() = nb::none(),
        "hila::backward: writes the requested gradients (and o, final_state) in place. workspace, "
        "cu_seqlens_host, init_pos_host: as in forward.");
  m.def("step", &step_state, "cfg"_a, "q"_a, "k"_a, "v"_a, "g"_a.none(), "lam"_a.none(),
        "beta"_a.none(), "state"_a, nb::kw_only(), "o"_a, "state_out"_a, "stream"_a = 0,
        "One decode step on a caller-owned state (pos, S, P, H); writes o and state_out.");

  m.def(
      "_bf16_view",
      [](nb::object obj) {
        nb::ndarray<uint16_t, nb::c_contig, nb::device::cpu> a;
        if (!nb::try_cast(obj, a)) throw Error("array", "expected a C-contiguous uint16 host array");
        size_t shape[hila::kMaxDims];
        if (a.ndim() > static_cast<size_t>(hila::kMaxDims))
          throw Error("array", "expected at most " + std::to_string(hila::kMaxDims) + " dimensions");
        for (size_t i = 0; i < a.ndim(); ++i) shape[i] = a.shape(i);
        return nb::ndarray<>(const_cast<uint16_t*>(a.data()), a.ndim(), shape, obj, nullptr,
                             nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1},
                             nb::device::cpu::value, 0);
      },
      "a"_a,
      "Internal: a C-contiguous uint16 numpy array holding bfloat16 bits (ml_dtypes' bfloat16 viewed as "
      "uint16) as a DLPack bfloat16 array aliasing it.");
  m.def(
      "_workspace_span",
      [](const nb::object& a) {
        const Span s = span_of(a);
        return std::make_tuple(std::string(hila::device_name(s.device)), s.bytes);
      },
      "a"_a, "Internal (tests): how a workspace array from an allocator is read: (device, bytes).");
  m.def("step_inplace", &step_inplace, "cfg"_a, "q"_a, "k"_a, "v"_a, "g"_a.none(), "lam"_a.none(),
        "beta"_a.none(), "state"_a, nb::kw_only(), "o"_a, "stream"_a = 0,
        "state_indices"_a.none() = nb::none(), "max_position"_a = -1, "counters"_a.none() = nb::none(),
        "hila::step(StepParams, StateView): one fused decode step on a caller-owned state "
        "(pos, S, P, H), updated in place; writes o. state_indices: int32 [N] rows of a state pool "
        "(-1: padding); max_position: the caller's bound on the positions (no host read); counters: "
        "StepParams::counters (int32, zeroed once, left zero by every step).");

  nb::class_<BoundState>(m, "BoundState",
                         "A caller-owned state (pos, S, P, H) taken over once for many step_inplace calls.")
      .def(nb::init<const StateOut&>(), "state"_a)
      .def("step", &BoundState::step, "cfg"_a, "q"_a, "k"_a, "v"_a, "g"_a.none(), "lam"_a.none(),
           "beta"_a.none(), "o"_a, "stream"_a, "max_position"_a = -1, "counters"_a.none() = nb::none(),
           "step_inplace on the bound state: one fused decode step, the state advanced in place; writes o. "
           "q, ..., beta, counters are DLPack capsules lent for the call (read, not consumed; g, lam, beta, "
           "counters may be None); o is the data pointer of a C-contiguous output shaped, typed and placed like v.");

  nb::class_<hila::DecodeState>(m, "DecodeState", "hila::DecodeState: an owning decode state.")
      .def(
          "__init__",
          [](hila::DecodeState* self, const OpConfig& cfg, int64_t N, int64_t H, int64_t dk,
             int64_t dv, const std::string& dtype, int device_type, int device_id) {
            const DType dt = state_dtype(dtype);
            const hila::Device dev = dlpack_device(device_type, device_id);
            nb::gil_scoped_release nogil;  // a CUDA state allocates and zeroes device memory
            new (self) hila::DecodeState(cfg, N, H, dk, dv, dt, dev);
          },
          "cfg"_a, "N"_a, "H"_a, "dk"_a, "dv"_a, "dtype"_a = "float32", nb::kw_only(),
          "device_type"_a = static_cast<int>(nb::device::cpu::value), "device_id"_a = 0)
      .def(
          "step",
          [](hila::DecodeState& s, const In& q, const In& k, const In& v, const OptIn& g,
             const OptIn& lam, const OptIn& beta, const Out& o, uintptr_t stream) {
            const hila::StepParams p = step_params(s.config(), q, k, v, g, lam, beta, o, stream);
            nb::gil_scoped_release nogil;
            hila::step(p, s);
          },
          "q"_a, "k"_a, "v"_a, "g"_a.none(), "lam"_a.none(), "beta"_a.none(), nb::kw_only(), "o"_a,
          "stream"_a = 0)
      .def(
          "load",
          [](hila::DecodeState& s, const StateIn& st) {
            const StateView v = state_of("state", std::optional<StateIn>(st));
            nb::gil_scoped_release nogil;
            s.load(v);
          },
          "state"_a)
      .def(
          "view",
          [](hila::DecodeState& s) {
            std::shared_ptr<const void> keep;
            StateView v;
            {
              nb::gil_scoped_release nogil;  // the state's lock may be held by a step
              v = s.view(keep);
            }
            nb::capsule owner(new std::shared_ptr<const void>(std::move(keep)), [](void* p) noexcept {
              delete static_cast<std::shared_ptr<const void>*>(p);
            });
            return nb::make_tuple(part_or_none(v.pos, owner), part_or_none(v.S, owner),
                                  part_or_none(v.P, owner), part_or_none(v.H, owner));
          },
          "(pos, S, P, H) aliasing the state (numpy in host memory, DLPack ndarrays on a CUDA "
          "device). The arrays keep their memory alive: after a step, load or reserve that grows "
          "the state into new memory they show the state as it was (writes to them are lost).")
      .def(
          "reserve",
          [](hila::DecodeState& s, int64_t max_pos) {
            nb::gil_scoped_release nogil;
            s.reserve(max_pos);
          },
          "max_pos"_a)
      .def(
          "position",
          [](const hila::DecodeState& s, int64_t seq) {
            nb::gil_scoped_release nogil;  // the state's lock may be held by a step
            return s.position(seq);
          },
          "seq"_a)
      .def_prop_ro("config", &hila::DecodeState::config)
      .def_prop_ro("batch", &hila::DecodeState::batch)
      .def_prop_ro("heads", &hila::DecodeState::heads)
      .def_prop_ro("dk", &hila::DecodeState::dk)
      .def_prop_ro("dv", &hila::DecodeState::dv)
      .def_prop_ro("slots",
                   [](const hila::DecodeState& s) {
                     nb::gil_scoped_release nogil;
                     return s.slots();
                   })
      .def_prop_ro("dtype", [](const hila::DecodeState& s) { return std::string(hila::dtype_name(s.dtype())); })
      .def_prop_ro(
          "device",
          [](const hila::DecodeState& s) {
            const hila::Device d = s.device();
            return d.type == hila::DeviceType::cuda
                       ? std::make_tuple(static_cast<int>(nb::device::cuda::value), d.index)
                       : std::make_tuple(static_cast<int>(nb::device::cpu::value), 0);
          },
          "The state's DLPack device (type, id): (1, 0) for the CPU, (2, index) for CUDA.")
      .def_prop_ro("bytes_per_sequence", [](const hila::DecodeState& s) {
        nb::gil_scoped_release nogil;
        return s.bytes_per_sequence();
      });

  // The table of lent calls (ext_api.h) for hila._torch_ops.
  m.attr("_api") = nb::capsule(&g_api, hila_ext::kApiCapsule);

  m.def("op_names", [] {
    std::vector<std::string> v;
    for (hila::Op op : hila::all_ops()) v.emplace_back(hila::op_name(op));
    return v;
  });
  m.def("form_names", [] {
    std::vector<std::string> v;
    for (hila::Form f : hila::all_forms()) v.emplace_back(hila::form_name(f));
    return v;
  });
  m.def("op_traits", &traits_dict, "op"_a);
  m.def(
      "supports",
      [](const std::string& op, const std::string& form, bool backward) {
        return hila::supports(hila::parse_op(op), hila::parse_form(form), backward);
      },
      "op"_a, "form"_a, "backward"_a);
  m.def("state_shape", &state_shape_dict, "cfg"_a, "N"_a, "H"_a, "dk"_a, "dv"_a, "max_pos"_a);
  m.def("state_slots", &hila::state_slots, "n"_a);
  m.def("memory_limit", &hila::memory_limit);
  m.def("step_counters_size", &hila::step_counters_size, "N"_a, "H"_a,
        "Elements of a step's counters (StepParams::counters) for N sequences and H value heads: N + N * H.");
  m.def("levels_needed", &hila::levels_needed, "n0"_a, "T"_a);

  // What this build contains (hila::build_info) and whether its CUDA backend can run here.
  m.attr("__version__") = hila::build_info().version;
  m.def("build_info", [] {
    const hila::BuildInfo& b = hila::build_info();
    nb::dict d;
    d["version"] = b.version;
    d["cuda"] = b.cuda;
    d["cuda_version"] = b.cuda_version;
    d["cuda_archs"] = b.cuda_archs;
    d["cuda_gencode"] = b.cuda_gencode;
    d["openmp"] = b.openmp;
    d["openmp_version"] = b.openmp_version;
    d["compiler"] = b.compiler;
    d["build_type"] = b.build_type;
    return d;
  });
  m.def("cuda_device_count", [] {
    std::string why;
    const int n = hila::cuda_device_count(&why);
    return std::make_tuple(n, why);
  }, "(count, reason): the CUDA devices this process can use and, when none, the CUDA runtime's reason.");
}
