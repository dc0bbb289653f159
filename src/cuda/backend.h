// SPDX-License-Identifier: Apache-2.0
#pragma once
#include "core/problem.h"

namespace hila::detail {

// Whether the CUDA backend runs this validated call; otherwise throws hila::Error naming what
// is not available on the device yet.
void cuda_check_supported(const Resolved& r, DType dtype);
void cuda_forward(const Resolved& r, const ForwardParams& p);
void cuda_backward(const Resolved& r, const BackwardParams& p);
// Peak bytes of the call's temporaries (a dry run under a measuring arena), plus alignment slack.
size_t cuda_workspace_size(const Resolved& r, const ForwardParams& p);
size_t cuda_workspace_size(const Resolved& r, const BackwardParams& p);

}  // namespace hila::detail
