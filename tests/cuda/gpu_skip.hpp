// How the CUDA tests skip where there is no GPU: CI builds and links them on machines with the toolkit and
// no device, and runs them to this skip, which gives the device probe's answer and the test suite.
//   class CudaThing : public tg::testing::GpuTest {};   // every TEST_F(CudaThing, ...) skips without a GPU
//   TEST(CudaOther, Case) { TG_SKIP_WITHOUT_GPU(); ... }  // or in a test body
#pragma once

#include <gtest/gtest.h>

#include <typegrad/typegrad.hpp>

/// Skips the running test when there is no CUDA device; the reason starts with the probe's answer ("no CUDA
/// device: <driver error>", or "no CUDA backend in this build").
#define TG_SKIP_WITHOUT_GPU()                                                                   \
  if (tg::backend::cuda::device_count() == 0)                                                   \
  GTEST_SKIP() << tg::backend::cuda::device_description() << "; "                               \
               << ::testing::UnitTest::GetInstance()->current_test_info()->test_suite_name() \
               << " runs only on a GPU machine (scripts/gpu-check.sh)"

namespace tg::testing {

/// A fixture whose tests skip without a CUDA device.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override { TG_SKIP_WITHOUT_GPU(); }
};

}  // namespace tg::testing
