// SPDX-License-Identifier: Apache-2.0
// A user's program against an installed hila: gated linear attention (gla) on a tiny problem with
// hila::forward (chunk form), checked against the recurrence computed here in double:
//   H_t = e^{g_t} H_{t-1} + k_t v_tᵀ,  o_t = H_tᵀ (scale q_t)     H: [dk, dv] per head
// and the version macros against hila::build_info(). Exit status 0 when everything matches.
#include <hila/hila.h>
#include <hila/version.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

int main() {
  static_assert(HILA_VERSION == HILA_VERSION_MAJOR * 10000 + HILA_VERSION_MINOR * 100 + HILA_VERSION_PATCH);
  const hila::BuildInfo& info = hila::build_info();
  std::printf("hila %s (header %s), CUDA backend: %s, compiler %s\n", info.version.c_str(), HILA_VERSION_STRING,
              info.cuda ? "yes" : "no", info.compiler.c_str());
  if (info.version != HILA_VERSION_STRING) {
    std::printf("FAIL: build_info().version %s != HILA_VERSION_STRING %s\n", info.version.c_str(), HILA_VERSION_STRING);
    return 1;
  }

  const int64_t B = 1, T = 37, G = 1, H = 2, dk = 8, dv = 4;
  std::vector<float> q(B * T * G * dk), k(q.size()), v(B * T * H * dv), g(B * T * H), o(v.size(), NAN);
  for (size_t i = 0; i < q.size(); ++i) q[i] = float(std::sin(0.37 * double(i))), k[i] = float(std::cos(0.23 * double(i)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(std::sin(0.11 * double(i) + 1.0));
  for (size_t i = 0; i < g.size(); ++i) g[i] = float(-0.02 - 0.3 * (0.5 + 0.5 * std::sin(0.7 * double(i))));

  hila::ForwardParams p;
  p.cfg.op = hila::Op::gla;
  p.form = hila::Form::chunk;
  p.chunk = 16;  // T = 37: two full chunks and a partial one
  p.q = hila::TensorView::contiguous_view(q.data(), hila::DType::f32, {B, T, G, dk});
  p.k = hila::TensorView::contiguous_view(k.data(), hila::DType::f32, {B, T, G, dk});
  p.v = hila::TensorView::contiguous_view(v.data(), hila::DType::f32, {B, T, H, dv});
  p.g = hila::TensorView::contiguous_view(g.data(), hila::DType::f32, {B, T, H});
  p.o = hila::TensorView::contiguous_view(o.data(), hila::DType::f32, {B, T, H, dv});
  try {
    hila::forward(p);
  } catch (const hila::Error& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }

  // The reference recurrence in double; the relative max error must be at float32 level.
  const double scale = 1.0 / std::sqrt(double(dk));
  double err = 0, ref_max = 0;
  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> S(dk * dv, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      const double a = std::exp(double(g[t * H + h]));
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) S[i * dv + j] = a * S[i * dv + j] + double(k[t * dk + i]) * v[(t * H + h) * dv + j];
      for (int64_t j = 0; j < dv; ++j) {
        double ref = 0;
        for (int64_t i = 0; i < dk; ++i) ref += scale * q[t * dk + i] * S[i * dv + j];
        const double got = o[(t * H + h) * dv + j];
        if (!std::isfinite(got)) {
          std::printf("FAIL: o[t=%lld, h=%lld, %lld] = %g\n", (long long)t, (long long)h, (long long)j, got);
          return 1;
        }
        err = std::fmax(err, std::fabs(got - ref));
        ref_max = std::fmax(ref_max, std::fabs(ref));
      }
    }
  }
  const double rel = err / ref_max;
  std::printf("gla chunk forward, B=%lld T=%lld H=%lld dk=%lld dv=%lld: max |o - ref| / max |ref| = %.2e\n",
              (long long)B, (long long)T, (long long)H, (long long)dk, (long long)dv, rel);
  if (!(ref_max > 0.1 && rel < 1e-5)) {
    std::printf("FAIL: expected a relative error below 1e-5 (max |ref| = %g)\n", ref_max);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
