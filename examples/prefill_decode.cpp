// SPDX-License-Identifier: Apache-2.0
// Prefill a prompt with the chunk form, then decode token by token with the serial form.
// Built and run as a test, so the README example stays correct.
#include <hila/hila.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  using namespace hila;
  const int64_t B = 1, T = 100, G = 1, H = 2, dk = 16, dv = 16, steps = 8;
  std::mt19937 rng(0);
  std::normal_distribution<float> nrm;
  auto randn = [&](int64_t n) { std::vector<float> x(n); for (auto& e : x) e = nrm(rng); return x; };
  std::vector<float> q = randn(B * T * G * dk), k = randn(B * T * G * dk), v = randn(B * T * H * dv);
  std::vector<float> g(B * T * H, -0.05f), o(B * T * H * dv);

  OpConfig cfg;
  cfg.op = Op::hla2;  // symmetric second-order linear attention

  // Prefill: chunk form, writes o and the final state (S packed, Y).
  StateShape ss = state_shape(cfg, B, H, dk, dv, T);
  std::vector<int64_t> pos(B);
  std::vector<float> S(B * H * dk * (dk + 1) / 2), Y(B * H * dk * dv);
  ForwardParams p;
  p.cfg = cfg;
  p.form = Form::chunk;
  p.q = TensorView::contiguous_view(q.data(), DType::f32, {B, T, G, dk});
  p.k = TensorView::contiguous_view(k.data(), DType::f32, {B, T, G, dk});
  p.v = TensorView::contiguous_view(v.data(), DType::f32, {B, T, H, dv});
  p.g = TensorView::contiguous_view(g.data(), DType::f32, {B, T, H});
  p.o = TensorView::contiguous_view(o.data(), DType::f32, {B, T, H, dv});
  p.final_state.pos = TensorView::contiguous_view(pos.data(), DType::i64, {B});
  p.final_state.S = TensorView::contiguous_view(S.data(), DType::f32, ss.S_shape.data(), 3);
  p.final_state.H = TensorView::contiguous_view(Y.data(), DType::f32, ss.H_shape.data(), 4);
  forward(p);

  // Decode: load the prefill state and step one token at a time (constant-size state).
  DecodeState st(cfg, B, H, dk, dv, DType::f32);
  st.load(p.final_state);
  for (int s = 0; s < steps; ++s) {
    std::vector<float> qt = randn(B * G * dk), kt = randn(B * G * dk), vt = randn(B * H * dv);
    std::vector<float> gt(B * H, -0.05f), ot(B * H * dv);
    StepParams sp;
    sp.cfg = cfg;
    sp.q = TensorView::contiguous_view(qt.data(), DType::f32, {B, G, dk});
    sp.k = TensorView::contiguous_view(kt.data(), DType::f32, {B, G, dk});
    sp.v = TensorView::contiguous_view(vt.data(), DType::f32, {B, H, dv});
    sp.g = TensorView::contiguous_view(gt.data(), DType::f32, {B, H});
    sp.o = TensorView::contiguous_view(ot.data(), DType::f32, {B, H, dv});
    step(sp, st);
    if (!std::isfinite(ot[0])) return 1;
  }
  std::printf("decoded %d tokens after a %d-token prefill; position %lld, state %lld bytes/sequence\n",
              static_cast<int>(steps), static_cast<int>(T), static_cast<long long>(st.position(0)),
              static_cast<long long>(st.bytes_per_sequence()));
  return st.position(0) == T + steps ? 0 : 1;
}
