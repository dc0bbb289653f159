// SPDX-License-Identifier: Apache-2.0
// DecodeState: owns one state (StateView layout) for N sequences and grows its Fenwick slot
// capacity as positions cross powers of two (LOGLINEAR_SPEC §8: grown, never truncated).
#include <algorithm>
#include <vector>

#include "core/access.h"
#include "core/problem.h"
#include "cpu/backend.h"
#include "hila/error.h"

namespace hila {

struct DecodeState::Impl {
  OpConfig cfg;
  OpTraits traits{};
  int64_t N = 0, H = 0, dk = 0, dv = 0, dvp = 0, Ls = 1;
  DType dtype = DType::f32;
  Device device{};
  std::vector<int64_t> pos;
  std::vector<unsigned char> S, P, Hs;

  int64_t esize() const { return dtype_size(dtype); }
  int64_t s_elems() const { return traits.has_S ? N * H * dk * (dk + 1) / 2 : 0; }
  int64_t p_elems() const { return traits.has_P ? N * H * dk * dvp : 0; }
  int64_t h_elems(int64_t slots) const { return N * H * slots * dk * dvp; }

  StateView view() {
    StateView v;
    v.pos = TensorView::contiguous_view(pos.data(), DType::i64, {N}, device);
    if (traits.has_S) v.S = TensorView::contiguous_view(S.data(), dtype, {N, H, dk * (dk + 1) / 2}, device);
    if (traits.has_P) v.P = TensorView::contiguous_view(P.data(), dtype, {N, H, dk, dvp}, device);
    v.H = traits.loglinear
              ? TensorView::contiguous_view(Hs.data(), dtype, {N, H, Ls, dk, dvp}, device)
              : TensorView::contiguous_view(Hs.data(), dtype, {N, H, dk, dvp}, device);
    return v;
  }

  // Grow the slot dimension of H (log-linear only), keeping the contents.
  void grow(int64_t slots) {
    if (!traits.loglinear || slots <= Ls) return;
    std::vector<unsigned char> nh(static_cast<size_t>(h_elems(slots) * esize()), 0);
    const int64_t block = Ls * dk * dvp * esize(), nblock = slots * dk * dvp * esize();
    for (int64_t nh_i = 0; nh_i < N * H; ++nh_i)
      std::copy_n(Hs.data() + nh_i * block, block, nh.data() + nh_i * nblock);
    Hs.swap(nh);
    Ls = slots;
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
  if (device.type != DeviceType::cpu)
    throw Error("device", "expected cpu (decode states and the step kernels run on the CPU backend so "
                          "far), got " + device_name(device));
  s.N = N, s.H = H, s.dk = dk, s.dv = dv, s.dvp = dv + (cfg.normalize ? 1 : 0);
  s.dtype = dtype;
  s.device = device;
  s.pos.assign(static_cast<size_t>(N), 0);
  s.S.assign(static_cast<size_t>(s.s_elems() * s.esize()), 0);
  s.P.assign(static_cast<size_t>(s.p_elems() * s.esize()), 0);
  s.Ls = s.traits.loglinear ? 2 : 1;  // slots(1): room for the first step
  s.Hs.assign(static_cast<size_t>(s.h_elems(s.Ls) * s.esize()), 0);
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
int64_t DecodeState::slots() const { return impl_->Ls; }
int64_t DecodeState::position(int64_t seq) const {
  if (seq < 0 || seq >= impl_->N)
    throw Error("seq", "expected 0 <= seq < " + std::to_string(impl_->N) + ", got " + std::to_string(seq));
  return impl_->pos[seq];
}
void DecodeState::reserve(int64_t max_pos) { impl_->grow(state_slots(max_pos)); }
StateView DecodeState::view() { return impl_->view(); }

int64_t DecodeState::bytes_per_sequence() const {
  const Impl& s = *impl_;
  return (s.s_elems() + s.p_elems() + s.h_elems(s.Ls)) * s.esize() / s.N + 8;
}

void DecodeState::load(const StateView& in) {
  Impl& s = *impl_;
  detail::check_state("state", in, s.cfg, s.N, s.H, s.dk, s.dv, nullptr, true, false, s.device);
  const std::vector<int64_t> pos = detail::read_positions(in.pos);
  detail::check_state("state", in, s.cfg, s.N, s.H, s.dk, s.dv, &pos, true, s.cfg.check_values, s.device);
  int64_t need = 1;
  for (int64_t p : pos) need = std::max(need, state_slots(p + 1));
  if (s.traits.loglinear) s.grow(std::max(need, in.H.shape[2]));
  s.pos = pos;
  StateView dst = s.view();
  auto copy = [](const TensorView& from, const TensorView& to) {
    // element-wise with conversion; `to` is contiguous and at least as large in every dim
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
  };
  if (s.traits.has_S) copy(in.S, dst.S);
  if (s.traits.has_P) copy(in.P, dst.P);
  copy(in.H, dst.H);
}

void step(const StepParams& p, DecodeState& state) {
  const detail::Resolved r = detail::resolve_step(p, state);
  DecodeState::Impl& s = *state.impl();
  if (s.traits.loglinear) {
    int64_t need = 1;
    for (int64_t x : s.pos) need = std::max(need, state_slots(x + 1));
    s.grow(need);
  }
  detail::cpu_step(r, p, s.view());
}

}  // namespace hila
