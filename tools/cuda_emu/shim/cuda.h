// SPDX-License-Identifier: Apache-2.0
// Host emulator (tools/cuda_emu): the driver API types the sm_90a sources name. A tensor map holds
// the emulator's own description of the tensor (cuda/sm90_emu.h).
#pragma once
struct alignas(64) CUtensorMap {
  unsigned long long opaque[16];
};
