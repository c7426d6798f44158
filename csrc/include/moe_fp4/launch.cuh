// One kernel body for the device and the host: an element-wise stage is a functor `Body` with
// a __host__ __device__ operator()(int64_t unit); for_each_unit runs it for every unit as a
// grid-stride kernel, or serially on the host for device == MOE_FP4_HOST (the host oracle).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moe_fp4/common.hpp"

namespace moe_fp4 {

constexpr int kUnitThreads = 256;

template <class Body>
__global__ void __launch_bounds__(kUnitThreads) for_each_unit_kernel(Body body, int64_t units) {
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += int64_t(gridDim.x) * blockDim.x)
    body(u);
}

template <class Body>
int for_each_unit(const Body& body, int64_t units, int device, cudaStream_t stream, const char* what) {
  if (units == 0) return MOE_FP4_OK;
  if (device == MOE_FP4_HOST) {
    for (int64_t u = 0; u < units; ++u) body(u);
    return MOE_FP4_OK;
  }
  for_each_unit_kernel<Body><<<grid_for(units, kUnitThreads, sm_count(device)), kUnitThreads, 0, stream>>>(body, units);
  return cuda_status(cudaGetLastError(), what);
}

}  // namespace moe_fp4
