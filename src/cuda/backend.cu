// SPDX-License-Identifier: Apache-2.0
// CUDA backend: packs the strided, sequence-first inputs into head-major buffers padded to
// multiples of 16 columns (kernels then need no head-dim templates), runs the primitive kernels
// on the caller's stream, and unpacks outputs, states and gradients (summing dq/dk over the heads
// of a GQA group). Temporary buffers are stream-ordered allocations.
#include <algorithm>
#include <string>
#include <vector>

#include "core/host_mirror.h"
#include "cuda/backend.h"
#include "cuda/gla.cuh"
#include "hila/error.h"

namespace hila::cuda {

[[noreturn]] void fail(cudaError_t e, const char* expr, const char* file, int line) {
  throw std::runtime_error(std::string("hila: CUDA error ") + cudaGetErrorName(e) + " (" +
                           cudaGetErrorString(e) + ") in " + expr + " at " + file + ":" +
                           std::to_string(line));
}

namespace {

void d2h(void* dst, const void* src, size_t bytes, int device) {
  int prev = 0;
  HILA_CUDA_CHECK(cudaGetDevice(&prev));
  HILA_CUDA_CHECK(cudaSetDevice(device));
  HILA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  HILA_CUDA_CHECK(cudaSetDevice(prev));
}
const bool g_registered = (detail::register_device_to_host(&d2h), true);

// Stream-ordered device buffer.
template <class X>
class DevBuf {
 public:
  DevBuf() = default;
  DevBuf(size_t n, cudaStream_t s, bool zero = false) : n_(n), s_(s) {
    if (n == 0) return;
    HILA_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&p_), n * sizeof(X), s));
    if (zero) HILA_CUDA_CHECK(cudaMemsetAsync(p_, 0, n * sizeof(X), s));
  }
  ~DevBuf() {
    if (p_) cudaFreeAsync(p_, s_);
  }
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), n_(o.n_), s_(o.s_) { o.p_ = nullptr; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(s_, o.s_);
    return *this;
  }
  X* get() const { return p_; }

 private:
  X* p_ = nullptr;
  size_t n_ = 0;
  cudaStream_t s_ = nullptr;
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

// [B, T, X, d] (strided) -> packed [X][B*T][dp], zero beyond d; appends a ones column at `ones`.
template <class P>
__global__ void pack_rows(P* out, Strided in, int64_t T, int64_t X, int64_t Ttot, int d, int dp,
                          int ones) {
  const int64_t n = X * Ttot * dp;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(e % dp);
    const int64_t r = (e / dp) % Ttot, x = e / (dp * Ttot);
    const int64_t b = r / T, t = r % T;
    P v = to<P>(0.0f);
    if (c < d) v = to<P>(ld<Acc<P>>(in, b * in.s[0] + t * in.s[1] + x * in.s[2] + c * in.s[3]));
    else if (c == ones) v = to<P>(1.0f);
    out[e] = v;
  }
}

// packed [X*rep][Ttot][dp] (P) -> [B, T, X, d] (strided): out = mult * sum over rep heads.
template <class P>
__global__ void unpack_rows(Strided out, const P* in, int64_t T, int64_t X, int rep, int64_t Ttot,
                            int d, int dp, Acc<P> mult) {
  using R = Acc<P>;
  const int64_t n = X * Ttot * d;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(e % d);
    const int64_t r = (e / d) % Ttot, x = e / (d * Ttot);
    R acc = 0;
    for (int j = 0; j < rep; ++j) acc += from<R>(in[((x * rep + j) * Ttot + r) * dp + c]);
    const int64_t b = r / T, t = r % T;
    st<R>(out, b * out.s[0] + t * out.s[1] + x * out.s[2] + c * out.s[3], mult * acc);
  }
}

// gates [B, T, H(, P)] column p -> [H][Ttot]; and back for dg.
template <class R>
__global__ void pack_gates(R* out, Strided in, int64_t T, int64_t H, int64_t Ttot, int p) {
  const int64_t n = H * Ttot;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e % Ttot, h = e / Ttot, b = r / T, t = r % T;
    out[e] = ld<R>(in, b * in.s[0] + t * in.s[1] + h * in.s[2] + p * in.s[3]);
  }
}
template <class R>
__global__ void unpack_gates(Strided out, const R* in, int64_t T, int64_t H, int64_t Ttot) {
  const int64_t n = H * Ttot;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e % Ttot, h = e / Ttot, b = r / T, t = r % T;
    st<R>(out, b * out.s[0] + t * out.s[1] + h * out.s[2], in[e]);
  }
}

// state [N, H, dk, dv] (strided) <-> packed [N][H][dkp][dvp]
template <class R>
__global__ void pack_state(R* out, Strided in, int64_t NH, int64_t H, int dk, int dv, int dkp, int dvp) {
  const int64_t n = NH * dkp * dvp;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(e % dvp), i = int((e / dvp) % dkp);
    const int64_t nh = e / (int64_t(dkp) * dvp);
    out[e] = (i < dk && j < dv) ? ld<R>(in, (nh / H) * in.s[0] + (nh % H) * in.s[1] + i * in.s[2] + j * in.s[3]) : R(0);
  }
}
template <class R>
__global__ void unpack_state(Strided out, const R* in, int64_t NH, int64_t H, int dk, int dv, int dkp, int dvp) {
  const int64_t n = NH * dk * dv;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(e % dv), i = int((e / dv) % dk);
    const int64_t nh = e / (int64_t(dk) * dv);
    st<R>(out, (nh / H) * out.s[0] + (nh % H) * out.s[1] + i * out.s[2] + j * out.s[3],
          in[(nh * dkp + i) * dvp + j]);
  }
}

unsigned grid_for(int64_t n) { return unsigned(std::clamp<int64_t>((n + 255) / 256, 1, 65535 * 4)); }
int pad16(int64_t d) { return int((d + 15) / 16 * 16); }

// Sequence tables on the device.
struct SeqTables {
  std::vector<int64_t> row0, len, chunk0;
  std::vector<int> chunk_seq;
  DevBuf<int64_t> d_row0, d_len, d_chunk0;
  DevBuf<int> d_chunk_seq;
  int64_t nchunks = 0;
  SeqTables(const detail::Resolved& r, cudaStream_t s) {
    for (size_t i = 0; i < r.seqs.size(); ++i) {
      const auto& q = r.seqs[i];
      row0.push_back(q.b * r.T + q.row0);
      len.push_back(q.len);
      chunk0.push_back(nchunks);
      const int64_t nc = (q.len + kChunk - 1) / kChunk;
      for (int64_t c = 0; c < nc; ++c) chunk_seq.push_back(int(i));
      nchunks += nc;
    }
    d_row0 = upload(row0, s);
    d_len = upload(len, s);
    d_chunk0 = upload(chunk0, s);
    d_chunk_seq = upload(chunk_seq, s);
  }
  template <class X>
  static DevBuf<X> upload(const std::vector<X>& v, cudaStream_t s) {
    DevBuf<X> b(v.size(), s);
    if (!v.empty()) HILA_CUDA_CHECK(cudaMemcpyAsync(b.get(), v.data(), v.size() * sizeof(X), cudaMemcpyHostToDevice, s));
    return b;
  }
};

// Packed inputs and the GlaArgs that read them.
template <class T>
struct Packed {
  using R = Acc<T>;
  int dkp, dvp;
  DevBuf<T> q, k, v;
  DevBuf<R> g, h0;
  SeqTables seqs;
  GlaArgs<T> args;

  Packed(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s)
      : dkp(pad16(r.dk)), dvp(pad16(r.dvp)), seqs(r, s) {
    const int64_t Ttot = r.B * r.T;
    q = DevBuf<T>(size_t(r.G * Ttot * dkp), s);
    k = DevBuf<T>(size_t(r.G * Ttot * dkp), s);
    v = DevBuf<T>(size_t(r.H * Ttot * dvp), s);
    pack_rows<T><<<grid_for(r.G * Ttot * dkp), 256, 0, s>>>(q.get(), Strided(p.q), r.T, r.G, Ttot, int(r.dk), dkp, -1);
    HILA_CUDA_CHECK_LAUNCH();
    pack_rows<T><<<grid_for(r.G * Ttot * dkp), 256, 0, s>>>(k.get(), Strided(p.k), r.T, r.G, Ttot, int(r.dk), dkp, -1);
    HILA_CUDA_CHECK_LAUNCH();
    pack_rows<T><<<grid_for(r.H * Ttot * dvp), 256, 0, s>>>(v.get(), Strided(p.v), r.T, r.H, Ttot, int(r.dv), dvp,
                                                            r.cfg.normalize ? int(r.dv) : -1);
    HILA_CUDA_CHECK_LAUNCH();
    if (p.g.defined()) {
      g = DevBuf<R>(size_t(r.H * Ttot), s);
      pack_gates<R><<<grid_for(r.H * Ttot), 256, 0, s>>>(g.get(), Strided(p.g), r.T, r.H, Ttot, 0);
      HILA_CUDA_CHECK_LAUNCH();
    }
    const int64_t N = int64_t(r.seqs.size());
    if (p.init.H.defined()) {
      h0 = DevBuf<R>(size_t(N * r.H * dkp * dvp), s);
      pack_state<R><<<grid_for(N * r.H * dkp * dvp), 256, 0, s>>>(h0.get(), Strided(p.init.H), N * r.H, r.H,
                                                                   int(r.dk), int(r.dvp), dkp, dvp);
      HILA_CUDA_CHECK_LAUNCH();
    }
    GlaArgs<T>& a = args;
    a.q = q.get(), a.k = k.get(), a.v = v.get();
    a.q_div = a.k_div = int(r.H / r.G);
    a.v_div = 1;
    a.g = g.get();
    a.H = int(r.H), a.N = int(N), a.Ttot = Ttot, a.dk = dkp, a.dv = dvp;
    a.row0 = seqs.d_row0.get(), a.len = seqs.d_len.get(), a.chunk0 = seqs.d_chunk0.get();
    a.chunk_seq = seqs.d_chunk_seq.get();
    a.nchunks = seqs.nchunks;
    a.scale = R(r.scale);
    a.h0 = h0.get();
  }
};

template <class T>
void unpack_state_to(const TensorView& out, const Acc<T>* in, const detail::Resolved& r, int dkp, int dvp,
                     cudaStream_t s) {
  const int64_t NH = int64_t(r.seqs.size()) * r.H;
  unpack_state<Acc<T>><<<grid_for(NH * r.dk * r.dvp), 256, 0, s>>>(Strided(out), in, NH, r.H, int(r.dk),
                                                                     int(r.dvp), dkp, dvp);
  HILA_CUDA_CHECK_LAUNCH();
}

template <class T>
void write_final(const detail::Resolved& r, const StateView& fin, const Packed<T>& pk, const Acc<T>* ht,
                 cudaStream_t s) {
  if (!fin.defined()) return;
  if (fin.H.defined()) unpack_state_to<T>(fin.H, ht, r, pk.dkp, pk.dvp, s);
  if (fin.pos.defined()) {
    std::vector<int64_t> pos;
    for (const auto& q : r.seqs) pos.push_back(q.n0 + q.len);
    HILA_CUDA_CHECK(cudaMemcpyAsync(fin.pos.data, pos.data(), pos.size() * 8, cudaMemcpyHostToDevice, s));
    HILA_CUDA_CHECK(cudaStreamSynchronize(s));  // `pos` is a host temporary
  }
}

template <class P>
void unpack_to(const TensorView& out, const P* in, const detail::Resolved& r, int64_t X, int rep, int d, int dp,
               Acc<P> mult, cudaStream_t s) {
  const int64_t Ttot = r.B * r.T;
  unpack_rows<P><<<grid_for(X * Ttot * d), 256, 0, s>>>(Strided(out), in, r.T, X, rep, Ttot, d, dp, mult);
  HILA_CUDA_CHECK_LAUNCH();
}

template <class T>
void forward_impl(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) {
  using R = Acc<T>;
  Packed<T> pk(r, p, s);
  const int64_t Ttot = r.B * r.T, N = int64_t(r.seqs.size());
  DevBuf<T> o(size_t(r.H * Ttot * pk.dvp), s);
  DevBuf<R> ht(size_t(N * r.H * pk.dkp * pk.dvp), s);
  GlaArgs<T> a = pk.args;
  a.o = o.get();
  a.ht = ht.get();
  gla_forward<T>(a, s);
  unpack_to<T>(p.o, o.get(), r, r.H, 1, int(r.dv), pk.dvp, R(1), s);
  write_final<T>(r, p.final_state, pk, ht.get(), s);
}

template <class T>
void backward_impl(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) {
  using R = Acc<T>;
  Packed<T> pk(r, p, s);
  const int64_t Ttot = r.B * r.T, N = int64_t(r.seqs.size());
  const size_t state = size_t(N * r.H * pk.dkp * pk.dvp);
  const size_t chunks = size_t(pk.seqs.nchunks * r.H * pk.dkp * pk.dvp);
  DevBuf<T> o(p.o.defined() ? size_t(r.H * Ttot * pk.dvp) : 0, s), dO(size_t(r.H * Ttot * pk.dvp), s);
  DevBuf<R> ht(state, s), hbuf(chunks, s), dhbuf(chunks, s), dht, dh0;
  pack_rows<T><<<grid_for(r.H * Ttot * pk.dvp), 256, 0, s>>>(dO.get(), Strided(p.d_o), r.T, r.H, Ttot, int(r.dv),
                                                              pk.dvp, -1);
  HILA_CUDA_CHECK_LAUNCH();
  if (p.d_final.H.defined()) {
    dht = DevBuf<R>(state, s);
    pack_state<R><<<grid_for(int64_t(state)), 256, 0, s>>>(dht.get(), Strided(p.d_final.H), N * r.H, r.H,
                                                           int(r.dk), int(r.dvp), pk.dkp, pk.dvp);
    HILA_CUDA_CHECK_LAUNCH();
  }
  if (p.d_init.H.defined()) dh0 = DevBuf<R>(state, s);
  DevBuf<R> dq(size_t(r.H * Ttot * pk.dkp), s), dk(size_t(r.H * Ttot * pk.dkp), s),
      dv(size_t(r.H * Ttot * pk.dvp), s), dg(size_t(r.H * Ttot), s);
  GlaArgs<T> a = pk.args;
  a.o = o.get();
  a.ht = ht.get();
  a.hbuf = hbuf.get();
  gla_forward<T>(a, s);
  a.dO = dO.get();
  a.dht = dht.get();
  a.dh0 = dh0.get();
  a.dhbuf = dhbuf.get();
  a.dq = dq.get(), a.dk_ = dk.get(), a.dv_ = dv.get(), a.dg = dg.get();
  gla_backward<T>(a, s);
  const int rep = int(r.H / r.G);
  if (p.o.defined()) unpack_to<T>(p.o, o.get(), r, r.H, 1, int(r.dv), pk.dvp, R(1), s);
  if (p.dq.defined()) unpack_to<R>(p.dq, dq.get(), r, r.G, rep, int(r.dk), pk.dkp, R(r.scale), s);
  if (p.dk.defined()) unpack_to<R>(p.dk, dk.get(), r, r.G, rep, int(r.dk), pk.dkp, R(1), s);
  if (p.dv.defined()) unpack_to<R>(p.dv, dv.get(), r, r.H, 1, int(r.dv), pk.dvp, R(1), s);
  if (p.dg.defined()) {
    unpack_gates<R><<<grid_for(r.H * Ttot), 256, 0, s>>>(Strided(p.dg), dg.get(), r.T, r.H, Ttot);
    HILA_CUDA_CHECK_LAUNCH();
  }
  if (p.d_init.H.defined()) unpack_state_to<T>(p.d_init.H, dh0.get(), r, pk.dkp, pk.dvp, s);
  write_final<T>(r, p.final_state, pk, ht.get(), s);
}

template <template <class> class F, class... Args>
void by_dtype(DType dt, Args&&... args) {
  switch (dt) {
    case DType::bf16: F<__nv_bfloat16>::run(args...); break;
    case DType::f16: F<__half>::run(args...); break;
    case DType::f32: F<float>::run(args...); break;
    case DType::f64: F<double>::run(args...); break;
    default: throw Error("q", std::string("expected a floating dtype, got ") + dtype_name(dt));
  }
}
template <class T>
struct Fwd {
  static void run(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s) { forward_impl<T>(r, p, s); }
};
template <class T>
struct Bwd {
  static void run(const detail::Resolved& r, const BackwardParams& p, cudaStream_t s) { backward_impl<T>(r, p, s); }
};

size_t smem_need(DType dt, int dk, int dv) {
  switch (dt) {
    case DType::bf16: return gla_smem_need<__nv_bfloat16>(dk, dv);
    case DType::f16: return gla_smem_need<__half>(dk, dv);
    case DType::f32: return gla_smem_need<float>(dk, dv);
    default: return gla_smem_need<double>(dk, dv);
  }
}

// Device and stream of a call: the device of q, made current for the duration.
class DeviceScope {
 public:
  explicit DeviceScope(int dev) {
    HILA_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != dev) HILA_CUDA_CHECK(cudaSetDevice(dev));
  }
  ~DeviceScope() { cudaSetDevice(prev_); }

 private:
  int prev_ = 0;
};

}  // namespace

}  // namespace hila::cuda

namespace hila::detail {

void cuda_check_supported(const Resolved& r, DType dt) {
  if (r.cfg.op != Op::gla)
    throw Error("op", std::string("expected gla on a CUDA device (the CUDA backend covers gla so far; ") +
                          op_name(r.cfg.op) + " runs on the CPU backend), got " + op_name(r.cfg.op));
  if (r.form != Form::chunk)
    throw Error("form", std::string("expected chunk on a CUDA device (the naive, serial and scan forms "
                                    "run on the CPU backend), got ") + form_name(r.form));
  if (r.chunk != cuda::kChunk)
    throw Error("chunk", "expected " + std::to_string(cuda::kChunk) + " on a CUDA device, got " +
                             std::to_string(r.chunk));
  int dev = 0, optin = 0;
  HILA_CUDA_CHECK(cudaGetDevice(&dev));
  HILA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  const size_t need = cuda::smem_need(dt, cuda::pad16(r.dk), cuda::pad16(r.dvp));
  if (need > size_t(optin))
    throw Error("dk", std::string("expected head dims whose tiles fit in shared memory (") +
                          std::to_string(optin) + " bytes per block on this device), got dk = " +
                          std::to_string(r.dk) + ", dv = " + std::to_string(r.dv) + " in " + dtype_name(dt) +
                          ", which needs " + std::to_string(need) + "; use bfloat16/float16 or smaller head dims");
}

void cuda_forward(const Resolved& r, const ForwardParams& p) {
  cuda::DeviceScope scope(p.q.device.index);
  cuda_check_supported(r, p.q.dtype);
  cuda::by_dtype<cuda::Fwd>(p.q.dtype, r, p, static_cast<cudaStream_t>(p.stream));
}

void cuda_backward(const Resolved& r, const BackwardParams& p) {
  cuda::DeviceScope scope(p.q.device.index);
  cuda_check_supported(r, p.q.dtype);
  cuda::by_dtype<cuda::Bwd>(p.q.dtype, r, p, static_cast<cudaStream_t>(p.stream));
}

}  // namespace hila::detail
