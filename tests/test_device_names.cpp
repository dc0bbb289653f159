// SPDX-License-Identifier: Apache-2.0
// The CLI's device names (tools/device.h): cpu, auto (the first GPU when there is one), cuda[:N];
// anything else, or a GPU that the build or the machine lacks, is a clear hila::Error("device").
#include <gtest/gtest.h>

#include "device.h"
#include "hila/error.h"

namespace hila::tools {
namespace {

void expect_device_error(const std::string& name, const std::string& fragment) {
  try {
    parse_device_name(name);
    ADD_FAILURE() << "expected hila::Error for '" << name << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "device") << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(DeviceNames, CpuAutoAndCuda) {
  EXPECT_EQ(parse_device_name("cpu").type, DeviceType::cpu);
  const Device a = parse_device_name("auto");
  EXPECT_EQ(a.type, cuda_device_present() ? DeviceType::cuda : DeviceType::cpu);
  expect_device_error("gpu", "expected cpu, auto, cuda or cuda:N, got 'gpu'");
  if (!cuda_device_present()) {
    expect_device_error("cuda", "CUDA");
    expect_device_error("cuda:1", "CUDA");
  } else {
    EXPECT_EQ(parse_device_name("cuda").type, DeviceType::cuda);
    expect_device_error("cuda:999", "index");
    expect_device_error("cuda:x", "expected cpu, auto, cuda or cuda:N");
  }
}

// Token views drop the T axis of a [1, T, ...] view, on any device.
TEST(DeviceNames, TokenViews) {
  Buffer b(DType::f32, {1, 5, 2, 3});
  for (int64_t i = 0; i < b.numel(); ++i) b.set(i, double(i));
  const TensorView t = token_of(b.view(), 3);
  ASSERT_EQ(t.ndim, 3);
  EXPECT_EQ(t.shape[0], 1);
  EXPECT_EQ(t.shape[1], 2);
  EXPECT_EQ(t.shape[2], 3);
  EXPECT_EQ(static_cast<const float*>(t.data)[0], 18.f);
  EXPECT_THROW(token_of(b.view(), 5), std::invalid_argument);
}

}  // namespace
}  // namespace hila::tools
