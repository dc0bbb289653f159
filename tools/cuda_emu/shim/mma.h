// SPDX-License-Identifier: Apache-2.0
// (empty: the emulator has no WMMA; kTensorCore is false for every type)
#pragma once
