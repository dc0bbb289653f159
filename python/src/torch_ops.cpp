// SPDX-License-Identifier: Apache-2.0
// hila._torch_ops: hila's plain training call as a libtorch operator with a C++ autograd
// function, so that an eager forward + backward costs the dispatcher and the autograd engine
// what any aten op costs, without a Python autograd.Function or argument conversion per call.
//
//   torch.ops.hila_cpp.forward(q, k, v, g?, lam?, beta?, op, form, chunk, scale, normalize, eps,
//                              ridge, qk_l2norm, check_values, framework_workspace=False) -> o
//   torch.ops.hila_cpp.plan(op, form, chunk, scale, normalize, eps, ridge, qk_l2norm,
//                           check_values, framework_workspace=False) -> int
//   torch.ops.hila_cpp.forward_plan(q, k, v, g?, lam?, beta?, int plan) -> o
//
// forward_plan is forward on the configuration plan() numbered for those options (what
// hila.torch calls: seven arguments for the dispatcher to parse instead of sixteen).
//
// The module also has one plain Python function, the decode loop's in-place step (not an
// operator: hila.torch.step_ calls it directly, outside the dispatcher and autograd):
//
//   hila._torch_ops.step_(plan, q, k, v, g?, lam?, beta?, pos, S?, P?, H, max_position, counters?,
//                         out?) -> o
//
// q, k [N, G, dk]; v [N, H, dv]; g [N, H] or [N, H, P]; lam [N, H, L]; beta [N, H]; the state's
// parts pos [N], S, P, H as hila.State holds them (include/hila/ops.h, StateView); counters: int32
// StepParams::counters or None (counters with fewer than N + N * H elements, or on another device
// than H, are left out: the step then runs without them). o = out (the caller's [N, H, dv] tensor
// like v, returned as the same object) or empty_like(v); hila::step on the state in place under the
// state's lock (the one hila._C's in-place steps take), then the autograd version of each written
// tensor is advanced (saved copies of them are stale). The same calls as hila._C's step_inplace for the same
// arguments: the same bits, validation and errors (the library's checks of o name it 'out').
//
// q, k [B, T, G, dk]; v [B, T, H, dv]; g [B, T, H] or [B, T, H, P]; lam [B, T, H, L];
// beta [B, T, H]; o [B, T, H, dv]. No cu_seqlens, initial or final state: those calls stay on the
// Python road (python/hila/torch/ops.py), and so do torch.compile and the other cases that use the
// Python-registered torch.ops.hila.* ops. scale 0.0 means dk^-1/2.
//
// It makes exactly the calls of the Python road for the same call (hila.torch.ops: _Plain,
// _forward_call, _backward_call), so both give the same bits:
//   forward   o = empty_like(v), hila::forward(ForwardParams{cfg, form, chunk, q..beta, o})
//   backward  an uninitialised gradient (empty_like) for each input autograd needs, and
//             hila::backward(BackwardParams{cfg, bwd_form, chunk, q..beta, d_o, dq..dbeta});
//             bwd_form is chunk where the form has no backward.
// Inputs whose innermost stride is not 1 are read from contiguous copies (as _in does); CUDA
// calls run on the caller's current stream; with framework_workspace the call's device
// temporaries come from torch's caching allocator (hila.use_framework_workspace).
//
// The library: this module does not link libhila. hila._C (which does) lends its calls through
// the table of ext_api.h, published as the capsule hila._C._api and read when this module is
// imported: one copy of the library and its CUDA kernels per wheel and per process (its device
// pools, caches and knobs are shared with hila._C), and this translation unit compiles against
// hila's headers alone, with no CUDA code of its own.
//
// Errors: a hila::Error becomes hila.HilaError(message, argument), in forward and in backward
// (through autograd.grad), raised as a Python error the way torch's own bindings raise them
// (python_error of torch/csrc/Exceptions.h). Without a Python interpreter it is a
// c10::ValueError with the message.
#include <Python.h>

#include <ATen/DLConvertor.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>
#ifdef HILA_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "ext_api.h"

// (a named namespace: autograd shows the node as torch::autograd::CppNode<hila_cpp::PlainFunction>)
namespace hila_cpp {

using at::Tensor;
using hila::TensorView;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const hila_ext::Api* g_api = nullptr;  // hila._C's table, set at import
PyObject* g_hila_error = nullptr;      // hila._errors.HilaError

// ----------------------------------------------------------------------------- errors

[[noreturn]] void raise(const hila_ext::CallError& e) {
  if (g_hila_error != nullptr && Py_IsInitialized()) {
    const PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* exc = e.argument.empty()
                        ? PyObject_CallFunction(g_hila_error, "sO", e.what.c_str(), Py_None)
                        : PyObject_CallFunction(g_hila_error, "ss", e.what.c_str(), e.argument.c_str());
    if (exc != nullptr) {
      PyErr_SetObject(g_hila_error, exc);
      Py_DECREF(exc);
    }
    python_error err;  // (global namespace: torch/csrc/Exceptions.h)
    err.persist();  // takes the Python error: it is raised again where torch returns to Python
    PyGILState_Release(gil);
    throw err;
  }
  TORCH_CHECK_VALUE(false, e.what);
}

// Runs f; a hila::Error thrown in this module (reading the tensors) is raised as raise() does.
template <class F>
auto named(F&& f) {
  try {
    return f();
  } catch (const hila::Error& e) {
    raise({e.what(), e.argument()});
  }
}

// ----------------------------------------------------------------------------- tensors

// at::Tensor as hila::TensorView: hila._C's reading of the same tensor's DLPack capsule (dtype,
// device and dimension errors included).
TensorView view(const char* name, const Tensor& t) {
  TensorView v;
  if (!t.defined()) return v;
  // what the raw data pointer would misread: another layout, or a lazy negation / conjugation
  // (inputs have theirs applied by input(); a tensor the library writes cannot)
  if (t.layout() != at::kStrided)
    throw hila::Error(name, "expected a dense (strided) tensor, got layout " + c10::str(t.layout()));
  if (t.is_neg() || t.is_conj())
    throw hila::Error(name, "expected a tensor without a lazy negation or conjugation (call .resolve_neg() / "
                            ".resolve_conj() first), got one with it set");
  hila_ext::check_ndim(name, t.dim());
  const DLDataType dt = at::getDLDataType(t);
  v.dtype = hila_ext::dtype_from_dlpack(name, dt.code, dt.bits, dt.lanes);
  if (t.is_cuda())
    v.device = hila_ext::device_from_dlpack(name, hila_ext::kDLCUDA, t.get_device());
  else if (!t.is_cpu())
    throw hila::Error(name, "expected an array in host or CUDA memory, got a tensor on " + t.device().str());
  v.data = const_cast<void*>(t.const_data_ptr());
  v.ndim = static_cast<int>(t.dim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = t.size(i);
    v.stride[i] = t.stride(i);
  }
  return v;
}

// x with a lazy negation or conjugation applied (a copy; the raw data pointer would miss it).
Tensor resolved(const Tensor& x) {
  return x.defined() && (x.is_neg() || x.is_conj()) ? x.resolve_neg().resolve_conj() : x;
}

// An input as the library reads it in place: resolved, innermost stride 1, else a contiguous copy
// (incoming gradients are often expanded scalars, stride 0).
Tensor input(const Tensor& x0) {
  const Tensor x = resolved(x0);
  if (x.defined() && !x.is_contiguous() && x.dim() > 0 && x.stride(-1) != 1 && x.size(-1) > 1)
    return x.contiguous();
  return x;
}

Tensor input(const OptTensor& x) { return x ? input(*x) : Tensor(); }

// An output or gradient shaped like x, uninitialised: the library writes every element.
Tensor empty_output(const Tensor& x) { return at::empty_like(x, at::MemoryFormat::Contiguous); }

// ----------------------------------------------------------------------------- configurations

// What a call's options decide, made once per distinct options (hila.torch's _Spec).
struct Plan : torch::CustomClassHolder {
  hila::OpConfig cfg;
  hila::Form form = hila::Form::chunk, bwd_form = hila::Form::chunk;
  int64_t chunk = 64;
  bool framework_workspace = false;
};
using PlanPtr = c10::intrusive_ptr<Plan>;

using PlanKey = std::tuple<std::string, std::string, int64_t, double, bool, double, double, bool, bool, bool>;

// Plans by options: at most kMaxPlans distinct ones are kept (then the cache starts again; a
// call's autograd node holds its own plan).
PlanPtr plan_of(c10::string_view op, c10::string_view form, int64_t chunk, double scale, bool normalize,
                double eps, double ridge, bool qk_l2norm, bool check_values, bool framework_workspace) {
  TORCH_CHECK(g_api != nullptr, "hila_cpp::forward: hila._torch_ops was not imported (it needs hila._C)");
  constexpr size_t kMaxPlans = 256;
  static std::mutex mu;
  static std::map<PlanKey, PlanPtr> plans;
  thread_local PlanKey last_key;
  thread_local PlanPtr last;
  const auto same = [&](const PlanKey& k) {
    return std::get<2>(k) == chunk && std::get<3>(k) == scale && std::get<4>(k) == normalize &&
           std::get<5>(k) == eps && std::get<6>(k) == ridge && std::get<7>(k) == qk_l2norm &&
           std::get<8>(k) == check_values && std::get<9>(k) == framework_workspace &&
           std::get<0>(k) == op && std::get<1>(k) == form;
  };
  if (last && same(last_key)) return last;
  PlanKey key{std::string(op), std::string(form), chunk, scale, normalize, eps, ridge, qk_l2norm,
              check_values, framework_workspace};
  {
    std::lock_guard<std::mutex> g(mu);
    const auto it = plans.find(key);
    if (it != plans.end()) {
      last_key = std::move(key);
      last = it->second;
      return last;
    }
  }
  auto p = c10::make_intrusive<Plan>();
  hila_ext::CallError err;
  if (!g_api->resolve(std::get<0>(key).c_str(), std::get<1>(key).c_str(), &p->cfg.op, &p->form,
                      &p->bwd_form, &err))
    raise(err);
  p->cfg.scale = scale;
  p->cfg.normalize = normalize;
  p->cfg.eps = eps;
  p->cfg.ridge = ridge;
  p->cfg.qk_l2norm = qk_l2norm;
  p->cfg.check_values = check_values;
  p->chunk = chunk;
  p->framework_workspace = framework_workspace;
  {
    std::lock_guard<std::mutex> g(mu);
    if (plans.size() >= kMaxPlans) plans.clear();
    plans.emplace(key, p);
  }
  last_key = std::move(key);
  last = p;
  return p;
}

// ----------------------------------------------------------------------------- calls

// The inputs q..beta of a call (ForwardParams, BackwardParams) or a step (StepParams), in the
// order hila._C reads them (errors name the first bad one alike), the gates' kind and the caller's
// stream. Untied gates are told apart by their extra column axis: g of tied_ndim + 1 dimensions
// (g [B, T, H, P] for a call, [N, H, P] for a step). p.cfg is set.
template <class P>
void set_token_inputs(P& p, int tied_ndim, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                      const Tensor& lam, const Tensor& beta) {
  p.q = view("q", q);
  p.k = view("k", k);
  p.v = view("v", v);
  p.g = view("g", g);
  p.lam = view("lam", lam);
  p.beta = view("beta", beta);
  p.cfg.gates = p.g.defined() && p.g.ndim == tied_ndim + 1 ? hila::Gates::untied : hila::Gates::tied;
#ifdef HILA_WITH_CUDA
  if (q.is_cuda()) p.stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
#endif
}

// The inputs forward and backward share.
void set_inputs(hila::ForwardParams& p, const Plan& plan, hila::Form form, const Tensor& q, const Tensor& k,
                const Tensor& v, const Tensor& g, const Tensor& lam, const Tensor& beta) {
  p.cfg = plan.cfg;
  p.form = form;
  p.chunk = plan.chunk;
  set_token_inputs(p, 3, q, k, v, g, lam, beta);
}

// torch's caching allocator for the call's device temporaries where the plan asks for it: the
// returned tensor holds them until the call is enqueued (the allocator orders their reuse on the
// call's stream). An undefined tensor: the device's stream-ordered pool.
template <class P>
Tensor attach_workspace(P& p, const Plan& plan, const Tensor& q,
                        bool (*size)(const P&, size_t*, hila_ext::CallError*) noexcept) {
  if (!plan.framework_workspace || !q.is_cuda()) return {};
  size_t bytes = 0;
  hila_ext::CallError err;
  if (!size(p, &bytes, &err)) raise(err);
  if (bytes == 0) return {};
  Tensor ws = at::empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
  p.workspace = ws.data_ptr();
  p.workspace_bytes = bytes;
  return ws;
}

// The library call fn(&err), one of g_api's, without the GIL (a call from Python, through the
// dispatcher or not, holds it).
template <class F>
void call(F&& fn) {
  hila_ext::CallError err;
  bool ok;
  if (Py_IsInitialized() && PyGILState_Check()) {
    PyThreadState* ts = PyEval_SaveThread();
    ok = fn(&err);
    PyEval_RestoreThread(ts);
  } else {
    ok = fn(&err);
  }
  if (!ok) raise(err);
}

Tensor run_forward(const Plan& plan, const Tensor& q0, const Tensor& k0, const Tensor& v0,
                   const OptTensor& g0, const OptTensor& lam0, const OptTensor& beta0) {
  const Tensor q = input(q0), k = input(k0), v = input(v0), g = input(g0), lam = input(lam0),
               beta = input(beta0);
  Tensor o = empty_output(v0);
  hila::ForwardParams p;
  named([&] {
    set_inputs(p, plan, plan.form, q, k, v, g, lam, beta);
    p.o = view("o", o);
  });
  const Tensor ws = attach_workspace(p, plan, q, g_api->forward_workspace);
  call([&](hila_ext::CallError* e) { return g_api->forward(p, e); });
  return o;
}

// ----------------------------------------------------------------------------- autograd

struct PlainFunction : torch::autograd::Function<PlainFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const OptTensor& g, const OptTensor& lam, const OptTensor& beta, PlanPtr plan) {
    at::AutoDispatchBelowADInplaceOrView below;
    Tensor o = q.is_meta() ? empty_output(v) : run_forward(*plan, q, k, v, g, lam, beta);  // meta: shapes
    ctx->save_for_backward({q, k, v, g.value_or(Tensor()), lam.value_or(Tensor()), beta.value_or(Tensor())});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(std::move(plan));
    ctx->set_materialize_grads(false);
    return o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "hila: the backward of hila's operators is not differentiable "
                "(create_graph=True / double backward is not supported)");
    variable_list out(7);  // dq, dk, dv, dg, dlam, dbeta and nothing for the plan
    if (!grads[0].defined()) return out;
    const variable_list saved = ctx->get_saved_variables();  // q, k, v, g, lam, beta
    const PlanPtr plan = c10::static_intrusive_pointer_cast<Plan>(ctx->saved_data["plan"].toCapsule());
    at::AutoDispatchBelowADInplaceOrView below;
    // autograd numbers its edges over the inputs that were tensors (absent ones have none)
    size_t edge = 0;
    for (size_t i = 0; i < 6; ++i)
      if (saved[i].defined() && ctx->needs_input_grad(edge++)) out[i] = empty_output(saved[i]);
    Tensor in[6];
    for (size_t i = 0; i < 6; ++i) in[i] = input(saved[i]);
    const Tensor d_o = input(grads[0]);
    hila::BackwardParams p;
    named([&] {
      set_inputs(p, *plan, plan->bwd_form, in[0], in[1], in[2], in[3], in[4], in[5]);
      p.d_o = view("d_o", d_o);
      p.dq = view("dq", out[0]);
      p.dk = view("dk", out[1]);
      p.dv = view("dv", out[2]);
      p.dg = view("dg", out[3]);
      p.dlam = view("dlam", out[4]);
      p.dbeta = view("dbeta", out[5]);
    });
    const Tensor ws = attach_workspace(p, *plan, in[0], g_api->backward_workspace);
    call([&](hila_ext::CallError* e) { return g_api->backward(p, e); });
    return out;
  }
};

// ----------------------------------------------------------------------------- the operator

#define HILA_OPTIONS                                                                              \
  c10::string_view op, c10::string_view form, int64_t chunk, double scale, bool normalize,       \
      double eps, double ridge, bool qk_l2norm, bool check_values, bool framework_workspace
#define HILA_OPTION_NAMES op, form, chunk, scale, normalize, eps, ridge, qk_l2norm, check_values, framework_workspace

// CPU / CUDA (no autograd: inference mode, or below the Autograd key)
Tensor forward_kernel(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& g, const OptTensor& lam,
                      const OptTensor& beta, HILA_OPTIONS) {
  return run_forward(*plan_of(HILA_OPTION_NAMES), q, k, v, g, lam, beta);
}

Tensor forward_autograd(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& g, const OptTensor& lam,
                        const OptTensor& beta, HILA_OPTIONS) {
  return PlainFunction::apply(q, k, v, g, lam, beta, plan_of(HILA_OPTION_NAMES));
}

// Plans by number for forward_plan: append-only (a number stays valid for the process), at most
// kMaxNumbered; plan() answers -1 beyond that and the caller passes the options instead.
constexpr size_t kMaxNumbered = 1 << 16;
std::mutex g_numbered_mu;
std::vector<PlanPtr> g_numbered;
std::map<const Plan*, int64_t> g_number_of;

int64_t plan_number(HILA_OPTIONS) {
  const PlanPtr p = plan_of(HILA_OPTION_NAMES);
  std::lock_guard<std::mutex> g(g_numbered_mu);
  const auto it = g_number_of.find(p.get());
  if (it != g_number_of.end()) return it->second;
  if (g_numbered.size() >= kMaxNumbered) return -1;
  g_numbered.push_back(p);
  return g_number_of[p.get()] = static_cast<int64_t>(g_numbered.size() - 1);
}

PlanPtr numbered(int64_t n) {
  std::lock_guard<std::mutex> g(g_numbered_mu);
  TORCH_CHECK(n >= 0 && static_cast<size_t>(n) < g_numbered.size(), "hila_cpp::forward_plan: no plan ", n,
              " (numbers come from hila_cpp::plan)");
  return g_numbered[static_cast<size_t>(n)];
}

Tensor forward_plan_kernel(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& g,
                           const OptTensor& lam, const OptTensor& beta, int64_t plan) {
  return run_forward(*numbered(plan), q, k, v, g, lam, beta);
}

Tensor forward_plan_autograd(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& g,
                             const OptTensor& lam, const OptTensor& beta, int64_t plan) {
  return PlainFunction::apply(q, k, v, g, lam, beta, numbered(plan));
}

Tensor forward_plan_meta(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& g,
                         const OptTensor& lam, const OptTensor& beta, int64_t plan) {
  return empty_output(v);
}

// Meta / fake tensors: o's shape, dtype and device
Tensor forward_meta(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& g, const OptTensor& lam,
                    const OptTensor& beta, HILA_OPTIONS) {
  return empty_output(v);
}

}  // namespace hila_cpp

TORCH_LIBRARY(hila_cpp, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? lam, Tensor? beta, str op, str form, "
        "int chunk, float scale, bool normalize, float eps, float ridge, bool qk_l2norm, bool check_values, "
        "bool framework_workspace=False) -> Tensor");
  m.def("plan(str op, str form, int chunk, float scale, bool normalize, float eps, float ridge, bool qk_l2norm, "
        "bool check_values, bool framework_workspace=False) -> int");
  m.def("forward_plan(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? lam, Tensor? beta, int plan) -> Tensor");
}
TORCH_LIBRARY_IMPL(hila_cpp, CompositeExplicitAutograd, m) { m.impl("plan", &hila_cpp::plan_number); }
TORCH_LIBRARY_IMPL(hila_cpp, CPU, m) {
  m.impl("forward", &hila_cpp::forward_kernel);
  m.impl("forward_plan", &hila_cpp::forward_plan_kernel);
}
TORCH_LIBRARY_IMPL(hila_cpp, CUDA, m) {
  m.impl("forward", &hila_cpp::forward_kernel);
  m.impl("forward_plan", &hila_cpp::forward_plan_kernel);
}
TORCH_LIBRARY_IMPL(hila_cpp, Meta, m) {
  m.impl("forward", &hila_cpp::forward_meta);
  m.impl("forward_plan", &hila_cpp::forward_plan_meta);
}
TORCH_LIBRARY_IMPL(hila_cpp, Autograd, m) {
  m.impl("forward", &hila_cpp::forward_autograd);
  m.impl("forward_plan", &hila_cpp::forward_plan_autograd);
}

// ----------------------------------------------------------------------------- the Python module

namespace hila_cpp {

// ImportError unless torch is the version this module was compiled against (libtorch has no
// stable C++ ABI: after a torch upgrade hila.torch takes its Python road until a rebuild).
bool same_torch() {
  PyObject* torch = PyImport_ImportModule("torch");
  if (torch == nullptr) return false;
  PyObject* version = PyObject_GetAttrString(torch, "__version__");
  Py_DECREF(torch);
  if (version == nullptr) return false;
  PyObject* text = PyObject_Str(version);  // torch.__version__ is a str subclass
  Py_DECREF(version);
  if (text == nullptr) return false;
  const char* v = PyUnicode_AsUTF8(text);
  const bool same = v != nullptr && std::string(v) == HILA_TORCH_VERSION;
  if (v != nullptr && !same)
    PyErr_Format(PyExc_ImportError, "hila._torch_ops was built against torch %s, this is torch %s",
                 HILA_TORCH_VERSION, v);
  Py_DECREF(text);
  return same;
}

// ImportError unless hila._C lends a table this module was compiled for.
bool load_api() {
  if (!same_torch()) return false;
  PyObject* c = PyImport_ImportModule("hila._C");
  if (c == nullptr) return false;
  PyObject* cap = PyObject_GetAttrString(c, "_api");
  Py_DECREF(c);
  if (cap == nullptr) return false;
  const auto* api = static_cast<const hila_ext::Api*>(PyCapsule_GetPointer(cap, hila_ext::kApiCapsule));
  Py_DECREF(cap);
  if (api == nullptr) return false;
  const uint32_t cuda =
#ifdef HILA_WITH_CUDA
      1;
#else
      0;
#endif
  if (api->version != hila_ext::kApiVersion || api->forward_params_size != sizeof(hila::ForwardParams) ||
      api->backward_params_size != sizeof(hila::BackwardParams) ||
      api->step_params_size != sizeof(hila::StepParams) || api->cuda != cuda) {
    PyErr_SetString(PyExc_ImportError,
                    "hila._torch_ops: hila._C is from another build (its table of calls does not match)");
    return false;
  }
  PyObject* errors = PyImport_ImportModule("hila._errors");
  if (errors == nullptr) return false;
  g_hila_error = PyObject_GetAttrString(errors, "HilaError");  // kept for the process
  Py_DECREF(errors);
  if (g_hila_error == nullptr) return false;
  g_api = api;
  return true;
}

// ----------------------------------------------------------------------------- the decode step

// Argument i of step_ as a tensor (None: undefined where the argument is optional); TypeError
// naming it otherwise, which hila.torch takes as "not this road" (its general road names it).
const Tensor* tensor_arg(PyObject* obj, const char* name, bool optional) {
  static const Tensor none;
  if (optional && obj == Py_None) return &none;
  if (!THPVariable_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "hila._torch_ops.step_: argument '%s': expected a tensor%s, got %s", name,
                 optional ? " or None" : "", Py_TYPE(obj)->tp_name);
    return nullptr;
  }
  return &THPVariable_Unpack(obj);
}

// The library's error e about o, for a step that writes the caller's `out`: named 'out'.
hila_ext::CallError as_out(hila_ext::CallError e) {
  if (e.argument != "o") return e;
  e.argument = "out";
  const std::string from = "argument 'o'";
  if (const size_t at = e.what.find(from); at != std::string::npos) e.what.replace(at, from.size(), "argument 'out'");
  return e;
}

// hila._torch_ops.step_ (the file comment): the arguments in order, positional only.
PyObject* step_(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  constexpr Py_ssize_t kArgs = 14;
  if (nargs != kArgs)
    return PyErr_Format(PyExc_TypeError, "hila._torch_ops.step_: expected %zd arguments, got %zd", kArgs, nargs);
  // q k v g lam beta pos S P H (args 1..10), then max_position (11), counters (12) and out (13)
  static constexpr const char* kName[] = {"q", "k", "v", "g", "lam", "beta", "state.pos", "state.S", "state.P",
                                          "state.H"};
  static constexpr bool kOptional[] = {false, false, false, true, true, true, false, true, true, false};
  const Tensor* t[10];
  for (int i = 0; i < 10; ++i)
    if ((t[i] = tensor_arg(args[i + 1], kName[i], kOptional[i])) == nullptr) return nullptr;
  const Tensor* counters = tensor_arg(args[12], "counters", true);
  const Tensor* out = counters == nullptr ? nullptr : tensor_arg(args[13], "out", true);
  if (out == nullptr) return nullptr;
  const int64_t plan_no = PyLong_AsLongLong(args[0]);
  const int64_t max_position = PyLong_AsLongLong(args[11]);
  if (PyErr_Occurred()) return nullptr;
  const PlanPtr plan = numbered(plan_no);
  if (out->defined() && out->requires_grad())
    raise({"hila: argument 'out': expected a tensor that does not require grad (step_ writes it in place and is "
           "not differentiable), got one that does",
           "out"});
  // the token's inputs with a lazy negation or conjugation applied (innermost strides as given:
  // the library names one it cannot read, and hila.torch then copies)
  Tensor in[6];
  for (int i = 0; i < 6; ++i) in[i] = resolved(*t[i]);
  const Tensor o = out->defined() ? *out : empty_output(in[2]);  // [N, H, dv] like v
  hila::StepParams p;
  hila::StateView s;
  p.cfg = plan->cfg;
  p.max_position = max_position;
  named([&] {
    set_token_inputs(p, 2, in[0], in[1], in[2], in[3], in[4], in[5]);
    p.o = view(out->defined() ? "out" : "o", o);
    // counters too small for this step (step_counters_size(N, H) = N + N * H elements) or on
    // another device than the state: a step without them (as hila.torch's _counters decides)
    const Tensor& H = *t[9];
    const int64_t N = in[0].dim() > 0 ? in[0].size(0) : 0;
    const bool fits = counters->defined() && H.dim() >= 2 && counters->numel() >= N + N * H.size(1) &&
                      counters->device() == H.device();
    p.counters = fits ? view("counters", *counters) : TensorView();
    s.pos = view("state.pos", *t[6]);
    s.S = view("state.S", *t[7]);
    s.P = view("state.P", *t[8]);
    s.H = view("state.H", *t[9]);
  });
  call([&](hila_ext::CallError* e) {
    const bool ok = g_api->step(p, s, e);
    if (!ok && out->defined()) *e = as_out(std::move(*e));
    return ok;
  });
  // what the kernel wrote behind autograd's back: saved copies of these tensors are now stale
  for (int i = 6; i < 10; ++i)
    if (t[i]->defined()) torch::autograd::impl::bump_version(*t[i]);
  if (out->defined()) {
    torch::autograd::impl::bump_version(*out);
    Py_INCREF(args[13]);
    return args[13];
  }
  return THPVariable_Wrap(o);
  END_HANDLE_TH_ERRORS
}

PyMethodDef g_methods[] = {
    {"step_", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&step_)), METH_FASTCALL,
     "step_(plan, q, k, v, g, lam, beta, pos, S, P, H, max_position, counters, out) -> o: one in-place decode "
     "step on a caller-owned state (internal; used by hila.torch.step_)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "_torch_ops",
                        "hila's plain training call as the libtorch operator torch.ops.hila_cpp.forward "
                        "with a C++ autograd function, and the in-place decode step (internal; used by "
                        "hila.torch.forward and hila.torch.step_).",
                        -1, g_methods};

}  // namespace hila_cpp

PyMODINIT_FUNC PyInit__torch_ops() {
  if (!hila_cpp::load_api()) return nullptr;
  return PyModule_Create(&hila_cpp::g_module);
}
