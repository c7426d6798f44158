// One kernel body for the device and the host: an element-wise stage is a functor `Body` with
// a __host__ __device__ operator()(int64_t unit); for_each_unit runs it for every unit as a
// grid-stride kernel, or serially on the host for device == MOE_FP4_HOST (the host oracle).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moe_fp4/common.hpp"

namespace moe_fp4 {

// ------------------------------------------------------------------ programmatic dependent launch
// The pipeline's kernels are launched with programmatic stream serialization (PDL, sm_90 and
// newer; every architecture this library builds): a kernel may be scheduled while its
// predecessor in the stream still runs, once every CTA of the predecessor has called
// allow_dependents() (or exited), and must call wait_for_predecessor() before it reads what the
// predecessor wrote or writes what the predecessor reads. So the launch and prologue of each
// stage overlap the tail of the one before. Each kernel waits before it touches the previous
// stage's data and allows its dependents right after; the routing kernels never allow them
// early (they run to completion first), so that any later stage may read the routing metadata
// before its own wait (the sm_90a GEMM finds its tile and prefetches weights that way). With no
// programmatic predecessor both instructions are no-ops. MOE_FP4_PDL=0 in the environment (read
// once) launches everything with plain stream order instead.

__device__ __forceinline__ void wait_for_predecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization allowed
// (when pdl_enabled()), as clusters of cluster_z CTAs along grid z when cluster_z > 1 (grid.z a
// multiple of it); returns the launch's CUDA error.
template <typename... Params, typename... Args>
cudaError_t launch_kernel_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, unsigned cluster_z,
                                   cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[2];
  unsigned count = 0;
  if (pdl_enabled()) {
    attr[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (cluster_z > 1) {
    attr[count].id = cudaLaunchAttributeClusterDimension;
    attr[count].val.clusterDim.x = 1;
    attr[count].val.clusterDim.y = 1;
    attr[count].val.clusterDim.z = cluster_z;
    ++count;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...);
}

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          Args&&... args) {
  return launch_kernel_clusters(kernel, grid, block, smem, 1u, stream, static_cast<Args&&>(args)...);
}

constexpr int kUnitThreads = 256;

template <class Body>
__global__ void __launch_bounds__(kUnitThreads) for_each_unit_kernel(Body body, int64_t units) {
  wait_for_predecessor();
  allow_dependents();
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
  return cuda_status(launch_kernel(for_each_unit_kernel<Body>, dim3(grid_for(units, kUnitThreads, sm_count(device))),
                                   dim3(kUnitThreads), 0, stream, body, units),
                     what);
}

}  // namespace moe_fp4
