// SPDX-License-Identifier: Apache-2.0
#include "device.h"

#include <cstring>

#ifdef HILA_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "hila/error.h"

namespace hila::tools {

namespace {

int64_t contiguous_bytes(const TensorView& t, const char* what) {
  int64_t expect = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.stride[i] != expect)
      throw Error("device", std::string(what) + ": expected a contiguous host tensor, got shape " + t.shape_str());
    expect *= t.shape[i];
  }
  return t.numel() * dtype_size(t.dtype);
}

#ifdef HILA_WITH_CUDA
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error("device", std::string(what) + ": " + cudaGetErrorString(e));
}
#endif

[[noreturn]] void no_cuda() {
  throw Error("device", "expected cpu: this build of hila has no CUDA backend, so the CLI cannot use a GPU");
}

}  // namespace

bool cuda_device_present() {
#ifdef HILA_WITH_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

Device parse_device_name(const std::string& name) {
  if (name == "cpu") return Device{};
  if (name == "auto") return cuda_device_present() ? Device{DeviceType::cuda, 0} : Device{};
  if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
#ifndef HILA_WITH_CUDA
    no_cuda();
#else
    int index = 0;
    if (name.size() > 5) {
      try {
        size_t used = 0;
        index = std::stoi(name.substr(5), &used);
        if (used != name.size() - 5 || index < 0) throw std::invalid_argument(name);
      } catch (const std::exception&) {
        throw Error("device", "expected cpu, auto, cuda or cuda:N, got '" + name + "'");
      }
    }
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)
      throw Error("device", "expected a CUDA device for '" + name + "', but this machine has none (use cpu or auto)");
    if (index >= n)
      throw Error("device", "expected a CUDA device index below " + std::to_string(n) + ", got '" + name + "'");
    return Device{DeviceType::cuda, index};
#endif
  }
  throw Error("device", "expected cpu, auto, cuda or cuda:N, got '" + name + "'");
}

struct DeviceMirror::Block {
  void* dev = nullptr;
  void* host = nullptr;  // the host view an output is copied back to (nullptr for inputs)
  size_t bytes = 0;
  ~Block() {
#ifdef HILA_WITH_CUDA
    if (dev) cudaFree(dev);
#endif
  }
};

DeviceMirror::DeviceMirror(Device dev) : dev_(dev) {
  if (dev.type != DeviceType::cuda) throw Error("device", "DeviceMirror needs a CUDA device, got " + device_name(dev));
#ifndef HILA_WITH_CUDA
  no_cuda();
#endif
}

DeviceMirror::~DeviceMirror() = default;

TensorView DeviceMirror::input(const TensorView& host) {
  if (!host.defined()) return host;
  const int64_t bytes = contiguous_bytes(host, "input");
  auto b = std::make_unique<Block>();
  b->bytes = size_t(bytes);
#ifdef HILA_WITH_CUDA
  check(cudaSetDevice(dev_.index), "cudaSetDevice");
  check(cudaMalloc(&b->dev, std::max<size_t>(b->bytes, 1)), "cudaMalloc");
  if (bytes) check(cudaMemcpy(b->dev, host.data, b->bytes, cudaMemcpyHostToDevice), "cudaMemcpy to the device");
#endif
  TensorView v = host;
  v.data = b->dev;
  v.device = dev_;
  blocks_.push_back(std::move(b));
  return v;
}

TensorView DeviceMirror::output(const TensorView& host) {
  if (!host.defined()) return host;
  TensorView v = input(host);
  Block& b = *blocks_.back();
  b.host = host.data;
#ifdef HILA_WITH_CUDA
  if (b.bytes) check(cudaMemset(b.dev, 0xff, b.bytes), "cudaMemset");  // poison: every output must be written
#endif
  return v;
}

void* DeviceMirror::scratch(size_t bytes) {
  auto b = std::make_unique<Block>();
  b->bytes = bytes;
#ifdef HILA_WITH_CUDA
  check(cudaSetDevice(dev_.index), "cudaSetDevice");
  check(cudaMalloc(&b->dev, std::max<size_t>(bytes, 1)), "cudaMalloc");
  if (bytes) check(cudaMemset(b->dev, 0xff, bytes), "cudaMemset");
#endif
  void* p = b->dev;
  blocks_.push_back(std::move(b));
  return p;
}

StateView DeviceMirror::input(const StateView& s) { return StateView{input(s.pos), input(s.S), input(s.P), input(s.H)}; }
StateView DeviceMirror::output(const StateView& s) {
  return StateView{output(s.pos), output(s.S), output(s.P), output(s.H)};
}

void DeviceMirror::finish() {
#ifdef HILA_WITH_CUDA
  check(cudaSetDevice(dev_.index), "cudaSetDevice");
  check(cudaDeviceSynchronize(), "the device");
  for (auto& b : blocks_)
    if (b->host && b->bytes) {
      check(cudaMemcpy(b->host, b->dev, b->bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to the host");
      b->host = nullptr;
    }
#endif
}

void device_synchronize(Device dev) {
  if (dev.type == DeviceType::cpu) return;
#ifdef HILA_WITH_CUDA
  check(cudaSetDevice(dev.index), "cudaSetDevice");
  check(cudaDeviceSynchronize(), "the device");
#else
  no_cuda();
#endif
}

StateBuffers fetch_state(const StateView& dev) {
  auto one = [&](const TensorView& t) {
    if (!t.defined()) return Buffer{};
    Buffer b(t.dtype, std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim));
    const int64_t bytes = contiguous_bytes(t, "state");
    if (t.device.type == DeviceType::cpu) {
      if (bytes) std::memcpy(b.bytes.data(), t.data, size_t(bytes));
      return b;
    }
#ifdef HILA_WITH_CUDA
    check(cudaSetDevice(t.device.index), "cudaSetDevice");
    check(cudaDeviceSynchronize(), "the device");
    if (bytes) check(cudaMemcpy(b.bytes.data(), t.data, size_t(bytes), cudaMemcpyDeviceToHost), "cudaMemcpy to the host");
#else
    no_cuda();
#endif
    return b;
  };
  return StateBuffers{one(dev.pos), one(dev.S), one(dev.P), one(dev.H)};
}

namespace {
// Maps every tensor of a forward call onto the device (inputs copied, outputs mirrored).
void map_forward(ForwardParams& p, DeviceMirror& m) {
  p.q = m.input(p.q), p.k = m.input(p.k), p.v = m.input(p.v), p.g = m.input(p.g);
  p.lam = m.input(p.lam), p.beta = m.input(p.beta), p.cu_seqlens = m.input(p.cu_seqlens);
  p.init = m.input(p.init);
  p.o = m.output(p.o);
  p.final_state = m.output(p.final_state);
}


// An exactly sized, poisoned workspace for the call (Temporaries::workspace).
template <class P>
void give_workspace(P& d, DeviceMirror& m, Temporaries tmp) {
  if (tmp == Temporaries::pool || tmp == Temporaries::graph_pool) return;
  d.workspace_bytes = workspace_size(d);
  d.workspace = d.workspace_bytes ? m.scratch(d.workspace_bytes) : nullptr;
}
#if defined(HILA_WITH_CUDA) && !defined(HILA_CUDA_EMU)
// A captured graph must not copy from host memory: a replay reads that memory when it runs, after
// the host may have reused it (hila's per-call tables go up through a pinned ring otherwise).
void expect_no_host_copies(cudaGraph_t g) {
  size_t n = 0;
  check(cudaGraphGetNodes(g, nullptr, &n), "cudaGraphGetNodes");
  std::vector<cudaGraphNode_t> nodes(n);
  check(cudaGraphGetNodes(g, nodes.data(), &n), "cudaGraphGetNodes");
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    check(cudaGraphNodeGetType(node, &type), "cudaGraphNodeGetType");
    if (type != cudaGraphNodeTypeMemcpy) continue;
    cudaMemcpy3DParms m{};
    check(cudaGraphMemcpyNodeGetParams(node, &m), "cudaGraphMemcpyNodeGetParams");
    cudaPointerAttributes at{};
    const bool host_src = m.kind == cudaMemcpyHostToDevice || m.kind == cudaMemcpyHostToHost ||
                          (m.kind == cudaMemcpyDefault && m.srcPtr.ptr &&
                           cudaPointerGetAttributes(&at, m.srcPtr.ptr) == cudaSuccess &&
                           at.type != cudaMemoryTypeDevice && at.type != cudaMemoryTypeManaged);
    if (host_src)
      throw Error("graph", "the captured call copies from host memory, which a replay would read when it runs");
  }
}
#endif

// call(d) directly, or (Temporaries::graph, graph_pool) captured on a new non-blocking stream into
// a CUDA graph (which must not copy from host memory), instantiated and launched twice on that
// stream: the outputs stay poisoned unless the replays write them
template <class P, class F>
void run_call(P& d, Temporaries tmp, F call) {
  if (tmp != Temporaries::graph && tmp != Temporaries::graph_pool) return call(d);
#if defined(HILA_CUDA_EMU)
  (void)d;
  throw GraphCaptureUnsupported("the host emulator has no stream capture");
#elif defined(HILA_WITH_CUDA)
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  struct Cleanup {
    cudaStream_t s;
    cudaGraph_t g = nullptr;
    cudaGraphExec_t x = nullptr;
    ~Cleanup() {
      if (x) cudaGraphExecDestroy(x);
      if (g) cudaGraphDestroy(g);
      cudaStreamDestroy(s);
    }
  } c{s};
  d.stream = s;
  // the mirror's copies and poison memsets ran on the legacy stream, which a non-blocking stream
  // does not wait for: without this they can land in the middle of the replays
  check(cudaDeviceSynchronize(), "the device");
  if (cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) != cudaSuccess) {
    (void)cudaGetLastError();
    throw GraphCaptureUnsupported("cudaStreamBeginCapture: stream capture is not available here");
  }
  try {
    call(d);
  } catch (...) {
    (void)cudaStreamEndCapture(s, &c.g);  // ends the (invalidated) capture; its error is the call's
    (void)cudaGetLastError();
    throw;
  }
  check(cudaStreamEndCapture(s, &c.g), "cudaStreamEndCapture");
  expect_no_host_copies(c.g);
  check(cudaGraphInstantiate(&c.x, c.g, 0), "cudaGraphInstantiate");
  check(cudaGraphLaunch(c.x, s), "cudaGraphLaunch");
  check(cudaGraphLaunch(c.x, s), "cudaGraphLaunch (again)");
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
#else
  no_cuda();
#endif
}
}  // namespace

void forward_on(const ForwardParams& p, Device dev, Temporaries tmp) {
  if (dev.type == DeviceType::cpu) return forward(p);
  DeviceMirror m(dev);
  ForwardParams d = p;
  map_forward(d, m);
  give_workspace(d, m, tmp);
  run_call(d, tmp, [](const ForwardParams& x) { forward(x); });
  m.finish();
}

void backward_on(const BackwardParams& p, Device dev, Temporaries tmp) {
  if (dev.type == DeviceType::cpu) return backward(p);
  DeviceMirror m(dev);
  BackwardParams d = p;
  map_forward(d, m);
  d.d_o = m.input(d.d_o);
  d.d_final = m.input(d.d_final);
  d.dq = m.output(d.dq), d.dk = m.output(d.dk), d.dv = m.output(d.dv), d.dg = m.output(d.dg);
  d.dlam = m.output(d.dlam), d.dbeta = m.output(d.dbeta);
  d.d_init = m.output(d.d_init);
  give_workspace(d, m, tmp);
  run_call(d, tmp, [](const BackwardParams& x) { backward(x); });
  m.finish();
}

TensorView token_of(const TensorView& full, int64_t t) {
  if (!full.defined()) return full;
  if (full.ndim < 2 || full.shape[0] != 1 || t < 0 || t >= full.shape[1])
    throw std::invalid_argument("token_of: needs a [1, T, ...] view and 0 <= t < T, got " + full.shape_str() +
                                " and t = " + std::to_string(t));
  TensorView v = full;
  v.data = static_cast<char*>(full.data) + t * full.stride[1] * dtype_size(full.dtype);
  v.ndim = full.ndim - 1;
  for (int i = 1; i < v.ndim; ++i) v.shape[i] = full.shape[i + 1], v.stride[i] = full.stride[i + 1];
  return v;
}

}  // namespace hila::tools
