// SPDX-License-Identifier: Apache-2.0
// DecodeState: owns one state (StateView layout) for N sequences and grows its Fenwick slot
// capacity as positions cross powers of two (docs/math/LOGLINEAR.md §8: grown, never truncated). The
// memory lives on the state's device (CPU or CUDA); positions are also kept on the host, since slot
// growth and the lam-length check need them before anything is launched.
//
// Sharing: every operation takes the state's lock, so steps from several threads serialize (none
// is lost) and never see a state mid-growth. The memory blocks are reference-counted: a view taken
// with an owner keeps the blocks it shows alive after a later growth moves the state elsewhere.
#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "api/dispatch.h"
#include "core/access.h"
#include "core/problem.h"
#include "cpu/backend.h"
#include "hila/error.h"
#ifdef HILA_WITH_CUDA
#include "cuda/backend.h"
#endif

namespace hila {

namespace {

// Zero-initialised bytes on a device.
class Block {
 public:
  Block() = default;
  Block(size_t bytes, Device d) : dev_(d) {
    if (d.type == DeviceType::cpu) {
      host_.assign(bytes, 0);
      return;
    }
#ifdef HILA_WITH_CUDA
    dev_ptr_ = detail::cuda_alloc_zeroed(bytes, d.index);
#else
    throw Error("device", "expected cpu (this build of hila has no CUDA backend), got " + device_name(d));
#endif
  }
  ~Block() { release(); }
  Block(Block&& o) noexcept { *this = std::move(o); }
  Block& operator=(Block&& o) noexcept {
    if (this != &o) {
      release();
      host_ = std::move(o.host_);
      dev_ptr_ = o.dev_ptr_;
      dev_ = o.dev_;
      o.dev_ptr_ = nullptr;
    }
    return *this;
  }
  void* data() { return dev_.type == DeviceType::cpu ? static_cast<void*>(host_.data()) : dev_ptr_; }

 private:
  void release() noexcept {
#ifdef HILA_WITH_CUDA
    if (dev_ptr_) detail::cuda_free(dev_ptr_, dev_.index);
#endif
    dev_ptr_ = nullptr;
  }
  std::vector<unsigned char> host_;
  void* dev_ptr_ = nullptr;
  Device dev_{};
};

// to (contiguous, at least as large in every dim) <- from (strided), converting; zero elsewhere.
void copy_into_host(const TensorView& from, const TensorView& to) {
  std::array<int64_t, kMaxDims> idx{};
  const int64_t total = to.numel();
  for (int64_t n = 0; n < total; ++n) {
    int64_t fo = 0, too = 0;
    bool inside = true;
    for (int i = 0; i < to.ndim; ++i) {
      inside = inside && idx[i] < from.shape[i];
      fo += idx[i] * from.stride[i];
      too += idx[i] * to.stride[i];
    }
    detail::store(to, too, inside ? detail::load(from, fo) : 0.0);
    for (int i = to.ndim - 1; i >= 0; --i) {
      if (++idx[i] < to.shape[i]) break;
      idx[i] = 0;
    }
  }
}

void copy_into(const TensorView& from, const TensorView& to, void* stream) {
  if (to.device.type == DeviceType::cpu) return copy_into_host(from, to);
#ifdef HILA_WITH_CUDA
  detail::cuda_copy_state_part(to, from, stream);
#endif
}

}  // namespace

struct DecodeState::Impl {
  using BlockPtr = std::shared_ptr<Block>;
  OpConfig cfg;
  OpTraits traits{};
  int64_t N = 0, H = 0, dk = 0, dv = 0, dvp = 0, Ls = 1;
  DType dtype = DType::f32;
  Device device{};
  std::recursive_mutex mu;   // every operation on the state (recursive: step validates through position())
  std::vector<int64_t> pos;  // host copy of the positions, kept by step and load
  BlockPtr hpos;             // CPU: the positions the views show (and the step advances)
  BlockPtr dpos;             // CUDA: the positions on the device
  BlockPtr counters;         // CUDA: the step kernel's counters (cuda/backend.h), zero between steps
  BlockPtr S, P, Hs;

  bool on_cuda() const { return device.type == DeviceType::cuda; }
  int64_t esize() const { return dtype_size(dtype); }
  int64_t s_elems() const { return traits.has_S ? N * H * detail::packed_size(dk) : 0; }
  int64_t p_elems() const { return traits.has_P ? N * H * dk * dvp : 0; }
  int64_t h_elems(int64_t slots) const { return N * H * slots * dk * dvp; }
  size_t bytes(int64_t elems) const { return static_cast<size_t>(elems * esize()); }

  // Total bytes at `slots` Fenwick slots, or -1 when the count overflows int64.
  int64_t total_bytes(int64_t slots) const {
    const int64_t packed = detail::packed_size(dk);
    const int64_t parts[] = {traits.has_S ? detail::checked_product({N, H, packed < 0 ? -1 : packed, esize()}) : 0,
                             traits.has_P ? detail::checked_product({N, H, dk, dvp, esize()}) : 0,
                             detail::checked_product({N, H, slots, dk, dvp, esize()}),
                             detail::checked_product({N, 16})};
    int64_t total = 0;
    for (int64_t b : parts)
      if (b < 0 || !detail::add_ok(total, b, &total)) return -1;
    return total;
  }
  // The memory of the state at `slots` slots fits in int64 and in hila::memory_limit() (host), or
  // in the configured limit and the device's free memory (CUDA; `growing`: the new H block only,
  // the rest is allocated already).
  void check_memory(int64_t slots, bool growing = false) const {
    const int64_t b = total_bytes(slots);
    const std::string what = "a decode state of N = " + std::to_string(N) + " sequences, H = " + std::to_string(H) +
                             ", dk = " + std::to_string(dk) + ", dv' = " + std::to_string(dvp) + ", " +
                             std::to_string(slots) + " slots";
    if (b < 0) throw Error("N/H/dk/dv", what + " has more bytes than int64 can count");
    if (!on_cuda()) detail::check_host_bytes("N/H/dk/dv", double(b), what);
#ifdef HILA_WITH_CUDA
    else detail::cuda_check_memory(double(b), growing ? double(h_elems(slots)) * double(esize()) : double(b), device.index, what);
#endif
  }
  BlockPtr block(size_t bytes) const {
    return detail::with_memory_errors("N/H/dk/dv", "a decode state",
                                      [&] { return std::make_shared<Block>(bytes, device); });
  }

  TensorView h_view(Block& b, int64_t slots) {
    return traits.loglinear ? TensorView::contiguous_view(b.data(), dtype, {N, H, slots, dk, dvp}, device)
                            : TensorView::contiguous_view(b.data(), dtype, {N, H, dk, dvp}, device);
  }

  StateView view() {
    StateView v;
    v.pos = TensorView::contiguous_view(on_cuda() ? dpos->data() : hpos->data(), DType::i64, {N}, device);
    if (traits.has_S) v.S = TensorView::contiguous_view(S->data(), dtype, {N, H, detail::packed_size(dk)}, device);
    if (traits.has_P) v.P = TensorView::contiguous_view(P->data(), dtype, {N, H, dk, dvp}, device);
    v.H = h_view(*Hs, Ls);
    return v;
  }
  // The blocks a view shows, kept alive together.
  std::shared_ptr<const void> owner() const {
    return std::make_shared<const std::vector<BlockPtr>>(std::vector<BlockPtr>{hpos, dpos, S, P, Hs});
  }
  // The host positions into the block the CPU views show.
  void publish_positions() {
    if (!on_cuda()) std::copy(pos.begin(), pos.end(), static_cast<int64_t*>(hpos->data()));
  }

  // Grow the slot dimension of H (log-linear only), keeping the contents. On CUDA the copy is
  // ordered on `stream` and completes before the old buffer is released (views holding it keep it).
  void grow(int64_t slots, void* stream) {
    if (!traits.loglinear || slots <= Ls) return;
    check_memory(slots, true);
    BlockPtr nh = block(bytes(h_elems(slots)));
    copy_into(h_view(*Hs, Ls), h_view(*nh, slots), stream);
#ifdef HILA_WITH_CUDA
    if (on_cuda()) detail::cuda_synchronize(stream, device.index);
#endif
    Hs = std::move(nh);
    Ls = slots;
  }

  // Slots that every sequence's next step needs: bitlen(pos + 1) + 1.
  int64_t slots_for_next_step() const {
    int64_t need = 1;
    for (int64_t x : pos) need = std::max(need, state_slots(x + 1));
    return need;
  }
};

DecodeState::DecodeState(const OpConfig& cfg, int64_t N, int64_t H, int64_t dk, int64_t dv,
                         DType dtype, Device device)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.cfg = cfg;
  s.traits = op_traits(cfg.op);
  if (N < 1 || H < 1 || dk < 1 || dv < 1)
    throw Error("N/H/dk/dv", "expected positive sizes, got N = " + std::to_string(N) + ", H = " +
                                 std::to_string(H) + ", dk = " + std::to_string(dk) + ", dv = " +
                                 std::to_string(dv));
  if (dtype != DType::f32 && dtype != DType::f64)
    throw Error("dtype", std::string("expected float32 or float64 for a decode state, got ") +
                             dtype_name(dtype));
#ifdef HILA_WITH_CUDA
  if (device.type != DeviceType::cpu && device.type != DeviceType::cuda)
    throw Error("device", "expected cpu or cuda, got " + device_name(device));
#else
  if (device.type != DeviceType::cpu)
    throw Error("device", "expected cpu (this build of hila has no CUDA backend), got " + device_name(device));
#endif
  s.N = N, s.H = H, s.dk = dk, s.dv = dv, s.dvp = dv + (cfg.normalize ? 1 : 0);
  s.dtype = dtype;
  s.device = device;
  s.Ls = s.traits.loglinear ? 2 : 1;  // slots(1): room for the first step
  s.check_memory(s.Ls);               // every size below is then known to fit
  detail::with_memory_errors("N/H/dk/dv", "a decode state", [&] { s.pos.assign(static_cast<size_t>(N), 0); });
  s.hpos = detail::with_memory_errors("N/H/dk/dv", "a decode state", [&] {  // host memory on every device
    return std::make_shared<Block>(s.on_cuda() ? 0 : static_cast<size_t>(N) * 8, Device{});
  });
#ifdef HILA_WITH_CUDA
  if (s.on_cuda()) {
    s.dpos = s.block(static_cast<size_t>(N) * 8);
    s.counters = std::make_shared<Block>(detail::cuda_step_counter_bytes(N, H), device);
  }
#endif
  s.S = s.block(s.bytes(s.s_elems()));
  s.P = s.block(s.bytes(s.p_elems()));
  s.Hs = s.block(s.bytes(s.h_elems(s.Ls)));
}

DecodeState::~DecodeState() = default;
DecodeState::DecodeState(DecodeState&&) noexcept = default;
DecodeState& DecodeState::operator=(DecodeState&&) noexcept = default;

const OpConfig& DecodeState::config() const { return impl_->cfg; }
int64_t DecodeState::batch() const { return impl_->N; }
int64_t DecodeState::heads() const { return impl_->H; }
int64_t DecodeState::dk() const { return impl_->dk; }
int64_t DecodeState::dv() const { return impl_->dv; }
DType DecodeState::dtype() const { return impl_->dtype; }
Device DecodeState::device() const { return impl_->device; }
int64_t DecodeState::slots() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->Ls;
}
int64_t DecodeState::position(int64_t seq) const {
  if (seq < 0 || seq >= impl_->N)
    throw Error("seq", "expected 0 <= seq < " + std::to_string(impl_->N) + ", got " + std::to_string(seq));
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->pos[seq];
}
// load() and reserve() copy on the default stream; on CUDA they first wait for the whole device,
// so a step still running on another stream cannot race with them.
void DecodeState::reserve(int64_t max_pos) {
  Impl& s = *impl_;
  if (max_pos < 0 || max_pos > detail::kMaxPosition)
    throw Error("max_pos", "expected a position in [0, 2^62], got " + std::to_string(max_pos));
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  if (!s.traits.loglinear || state_slots(max_pos) <= s.Ls) return;
#ifdef HILA_WITH_CUDA
  if (s.on_cuda()) detail::cuda_device_synchronize(s.device.index);
#endif
  s.grow(state_slots(max_pos), nullptr);
}
StateView DecodeState::view() {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->view();
}

StateView DecodeState::view(std::shared_ptr<const void>& owner) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  owner = impl_->owner();
  return impl_->view();
}

int64_t DecodeState::bytes_per_sequence() const {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  return (s.s_elems() + s.p_elems() + s.h_elems(s.Ls)) * s.esize() / s.N + 8;
}

void DecodeState::load(const StateView& in) {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  detail::check_state("state", in, s.cfg, s.N, s.H, s.dk, s.dv, nullptr, true, false, s.device);
  const std::vector<int64_t> pos = detail::read_positions(in.pos);
  detail::check_state("state", in, s.cfg, s.N, s.H, s.dk, s.dv, &pos, true, s.cfg.check_values, s.device);
  int64_t need = 1;
  for (int64_t p : pos) need = std::max(need, state_slots(p + 1));
#ifdef HILA_WITH_CUDA
  if (s.on_cuda()) detail::cuda_device_synchronize(s.device.index);
#endif
  if (s.traits.loglinear) s.grow(std::max(need, in.H.shape[2]), nullptr);
  std::copy(pos.begin(), pos.end(), s.pos.begin());
  s.publish_positions();
  if (s.on_cuda()) {
#ifdef HILA_WITH_CUDA
    detail::cuda_upload(s.dpos->data(), s.pos.data(), s.pos.size() * 8, s.device.index);
#endif
  }
  StateView dst = s.view();
  if (s.traits.has_S) copy_into(in.S, dst.S, nullptr);
  if (s.traits.has_P) copy_into(in.P, dst.P, nullptr);
  copy_into(in.H, dst.H, nullptr);
#ifdef HILA_WITH_CUDA
  if (s.on_cuda()) detail::cuda_synchronize(nullptr, s.device.index);
#endif
}

void step(const StepParams& p, DecodeState& state) {
  DecodeState::Impl& s = *state.impl();
  std::lock_guard<std::recursive_mutex> lock(s.mu);  // one step at a time: none lost, none torn
  const detail::Resolved r = detail::resolve_step(p, state);
  s.grow(s.slots_for_next_step(), p.stream);
  try {
    detail::run_step(r, p, s.view(), s.on_cuda() ? s.counters->data() : nullptr);
  } catch (...) {
    // A step that failed its output check (o or the state it wrote) has advanced the state already
    // (on CUDA the kernel advanced the device positions): keep the host copy of the positions true
    // to it, as the slot growth of the next step reads it.
    s.pos = detail::read_positions(s.view().pos);
    throw;
  }
  for (int64_t& x : s.pos) ++x;  // the step advanced the view's positions (CPU) or the device copy
}

}  // namespace hila
