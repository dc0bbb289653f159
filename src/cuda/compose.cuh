// SPDX-License-Identifier: Apache-2.0
// The composition of every operator over its primitives on the GPU (compose.cu), as backend.cu
// calls it: one call on `stream`, temporaries from the current arena or the stream-ordered pool.
#pragma once
#include <cstddef>

#include "core/problem.h"
#include "cuda/common.cuh"

namespace hila::cuda {

template <class T>
void compose_forward(const detail::Resolved& r, const ForwardParams& p, cudaStream_t stream);
template <class T>
void compose_backward(const detail::Resolved& r, const BackwardParams& p, cudaStream_t stream);
// Shared memory (bytes) the kernels of the GLA family (fenwick: and the log-linear ones) need for
// these padded head dims.
template <class T>
size_t compose_smem_need(int dk, int dv, bool fenwick);

}  // namespace hila::cuda
