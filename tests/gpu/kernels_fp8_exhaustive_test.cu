// The device's float -> e4m3 conversion used by the data-path kernels (hardware cvt on sm_89+)
// against layouts' float_to_e4m3 (what the CPU twins use) for all 2^32 float bit patterns.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>

#include "common/datapath_math.h"
#include "kvferry/kernels/device.h"

namespace kvferry {
namespace {

__global__ void compare_all(unsigned long long* mismatches, unsigned* first) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long local = 0;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t{1} << 32);
       i += stride) {
    const float x = bits_float(static_cast<uint32_t>(i));
    if (kernels::detail::to_e4m3(x) != float_to_e4m3(x)) {
      ++local;
      atomicMin(first, static_cast<unsigned>(i));
    }
  }
  if (local) atomicAdd(mismatches, local);
}

TEST(KernelsGpuFp8, DeviceConversionMatchesHostForAllFloats) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  unsigned long long* count = nullptr;
  unsigned* first = nullptr;
  ASSERT_EQ(cudaMallocManaged(&count, sizeof *count), cudaSuccess);
  ASSERT_EQ(cudaMallocManaged(&first, sizeof *first), cudaSuccess);
  *count = 0;
  *first = 0xffffffffu;
  compare_all<<<1024, 256>>>(count, first);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(*count, 0ull) << "first mismatch at float bits 0x" << std::hex << *first << ": device "
                          << int(kernels::detail::to_e4m3(bits_float(*first))) << " host "
                          << int(float_to_e4m3(bits_float(*first)));
  cudaFree(count);
  cudaFree(first);
}

}  // namespace
}  // namespace kvferry
