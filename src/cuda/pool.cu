// SPDX-License-Identifier: Apache-2.0
// PoolCall (pool.cuh): row gathers and scatters between a state pool and the N-row state a
// composition runs on, and the outputs of padding sequences.
#include <algorithm>
#include <vector>

#include "cuda/pool.cuh"

namespace hila::cuda {

namespace {

struct Dims5 {
  int64_t d[5];
};

// The row of sequence i, or -1 (padding) / -2 (outside [-1, P)).
__device__ __forceinline__ int64_t pool_row(const int* idx, int64_t idxs, int64_t i, int64_t P) {
  const int64_t row = idx[i * idxs];
  return row == -1 ? -1 : (row < 0 || row >= P) ? -2 : row;
}

// Offset in a strided tensor of row `row` and the row-major index `rem` within one row.
__device__ __forceinline__ int64_t row_offset(const Strided& t, int nd, const Dims5& shape, int64_t row, int64_t rem) {
  int64_t off = row * t.s[0];
  for (int k = nd - 1; k >= 1; --k) {
    off += (rem % shape.d[k]) * t.s[k];
    rem /= shape.d[k];
  }
  return off;
}

// dst [N, ...] (contiguous) <- src [P, ...] rows idx[i]: 0 for padding, NaN out of range.
template <class R>
__global__ void gather_part(R* dst, Strided src, int nd, Dims5 shape, int64_t inner, int64_t N, const int* idx,
                            int64_t idxs, int64_t P) {
  const int64_t n = N * inner;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / inner, row = pool_row(idx, idxs, i, P);
    dst[e] = row == -1 ? R(0) : row == -2 ? R(NAN) : ld<R>(src, row_offset(src, nd, shape, row, e % inner));
  }
}

// dst [P, ...] rows idx[i] <- src [N, ...] (contiguous), real in-range rows only.
template <class R>
__global__ void scatter_part(Strided dst, const R* src, int nd, Dims5 shape, int64_t inner, int64_t N, const int* idx,
                             int64_t idxs, int64_t P) {
  const int64_t n = N * inner;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / inner, row = pool_row(idx, idxs, i, P);
    if (row >= 0) st<R>(dst, row_offset(dst, nd, shape, row, e % inner), src[e]);
  }
}

__global__ void gather_pos(int64_t* dst, const int64_t* src, int64_t ss, int64_t N, const int* idx, int64_t idxs,
                           int64_t P) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = pool_row(idx, idxs, i, P);
    dst[i] = row >= 0 ? src[row * ss] : 0;
  }
}

__global__ void scatter_pos(int64_t* dst, int64_t ds, const int64_t* src, int64_t N, const int* idx, int64_t idxs,
                            int64_t P) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = pool_row(idx, idxs, i, P);
    if (row >= 0) dst[row * ds] = src[i];
  }
}

// o [B, T, X, d] rows row0[i] .. row0[i] + len[i] (row = b T + t) of the sequences that did not run
// on a pool row: 0 for padding, NaN out of range.
__global__ void fix_outputs(Strided o, const int64_t* row0, const int64_t* len, int64_t N, int64_t maxlen, int64_t T,
                            int64_t X, int64_t d, const int* idx, int64_t idxs, int64_t P) {
  const int64_t n = N * maxlen * X * d;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = e % d, x = (e / d) % X, j = (e / (d * X)) % maxlen, i = e / (d * X * maxlen);
    if (j >= len[i]) continue;
    const int64_t row = pool_row(idx, idxs, i, P);
    if (row >= 0) continue;
    const int64_t rr = row0[i] + j, b = rr / T, t = rr % T;
    st<float>(o, b * o.s[0] + t * o.s[1] + x * o.s[2] + c * o.s[3], row == -1 ? 0.f : NAN);
  }
}

// The part's sizes after the first (row) dimension: shape, and their product.
int64_t row_dims(const TensorView& t, Dims5& shape) {
  int64_t inner = 1;
  for (int k = 0; k < 5; ++k) shape.d[k] = k < t.ndim ? t.shape[k] : 1;
  for (int k = 1; k < t.ndim; ++k) inner *= t.shape[k];
  return inner;
}

const int* idx_ptr(const ForwardParams& p) { return static_cast<const int*>(p.state_indices.data); }

}  // namespace

StateView PoolCall::alloc_like(const StateView& pool) {
  auto part = [&](const TensorView& t) {
    if (!t.defined()) return TensorView{};
    int64_t shape[kMaxDims];
    int64_t n = N_;
    shape[0] = N_;
    for (int k = 1; k < t.ndim; ++k) shape[k] = t.shape[k], n *= t.shape[k];
    bufs_.emplace_back(size_t(n) * size_t(dtype_size(t.dtype)), s_);
    return TensorView::contiguous_view(bufs_.back().get(), t.dtype, shape, t.ndim, t.device);
  };
  return StateView{part(pool.pos), part(pool.S), part(pool.P), part(pool.H)};
}

PoolCall::PoolCall(const detail::Resolved& r, const ForwardParams& p, cudaStream_t s)
    : r_(r), s_(s), N_(int64_t(r.seqs.size())), P_(r.pool_rows) {
  init_ = alloc_like(p.init);
  if (p.final_state.defined()) final_ = alloc_like(p.final_state);
  const int* idx = idx_ptr(p);
  const int64_t is = p.state_indices.stride[0];
  if (N_ == 0) return;
  HILA_LAUNCH(gather_pos, N_, s, static_cast<int64_t*>(init_.pos.data), static_cast<const int64_t*>(p.init.pos.data),
              p.init.pos.stride[0], N_, idx, is, P_);
  for (const auto& [dst, src] : {std::pair<const TensorView*, const TensorView*>{&init_.S, &p.init.S},
                                 {&init_.P, &p.init.P}, {&init_.H, &p.init.H}}) {
    if (!dst->defined()) continue;
    Dims5 shape;
    const int64_t inner = row_dims(*src, shape);
    if (src->dtype == DType::f64)
      HILA_LAUNCH(gather_part<double>, N_ * inner, s, static_cast<double*>(dst->data), Strided(*src), src->ndim, shape,
                  inner, N_, idx, is, P_);
    else
      HILA_LAUNCH(gather_part<float>, N_ * inner, s, static_cast<float*>(dst->data), Strided(*src), src->ndim, shape,
                  inner, N_, idx, is, P_);
  }
}

void PoolCall::finish(const ForwardParams& p) const {
  if (N_ == 0) return;
  const int* idx = idx_ptr(p);
  const int64_t is = p.state_indices.stride[0];
  if (final_.defined()) {
    if (final_.pos.defined())
      HILA_LAUNCH(scatter_pos, N_, s_, static_cast<int64_t*>(p.final_state.pos.data), p.final_state.pos.stride[0],
                  static_cast<const int64_t*>(final_.pos.data), N_, idx, is, P_);
    for (const auto& [dst, src] : {std::pair<const TensorView*, const TensorView*>{&p.final_state.S, &final_.S},
                                   {&p.final_state.P, &final_.P}, {&p.final_state.H, &final_.H}}) {
      if (!src->defined()) continue;
      Dims5 shape;
      const int64_t inner = row_dims(*dst, shape);
      if (dst->dtype == DType::f64)
        HILA_LAUNCH(scatter_part<double>, N_ * inner, s_, Strided(*dst), static_cast<const double*>(src->data),
                    dst->ndim, shape, inner, N_, idx, is, P_);
      else
        HILA_LAUNCH(scatter_part<float>, N_ * inner, s_, Strided(*dst), static_cast<const float*>(src->data),
                    dst->ndim, shape, inner, N_, idx, is, P_);
    }
  }
  // o of the sequences without a row: the sequence table (rows b T + t) on the device
  std::vector<int64_t> tab(size_t(2 * N_));
  int64_t maxlen = 0;
  for (int64_t i = 0; i < N_; ++i) {
    const detail::SeqInfo& q = r_.seqs[size_t(i)];
    tab[size_t(i)] = q.b * r_.T + q.row0, tab[size_t(N_ + i)] = q.len;
    maxlen = std::max(maxlen, q.len);
  }
  if (maxlen == 0) return;
  const DevBuf<int64_t> d_tab = SeqTables::upload(tab, s_);
  HILA_LAUNCH(fix_outputs, N_ * maxlen * r_.H * r_.dv, s_, Strided(p.o), d_tab.get(), d_tab.get() + N_, N_, maxlen,
              r_.T, r_.H, r_.dv, idx, is, P_);
}

}  // namespace hila::cuda
