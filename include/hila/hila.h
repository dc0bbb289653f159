// SPDX-License-Identifier: Apache-2.0
#pragma once
#include "hila/build_info.h"
#include "hila/error.h"
#include "hila/ops.h"
#include "hila/tensor.h"
