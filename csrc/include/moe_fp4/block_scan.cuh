// Block-wide prefix sums on the device.
#pragma once

namespace moe_fp4 {

// The exclusive prefix sum of v over the threads of the block, in thread order (the sum of the
// threads before this one): a shuffle scan per warp, then each thread adds the totals of the
// warps before its own, which are left in s_warp[0 .. blockDim.x / 32) (one int per warp, shared
// memory). Every thread of the block calls it; blockDim.x is a multiple of 32. It synchronizes the
// block once, after writing s_warp: a caller that writes s_warp again (another call) synchronizes
// in between.
__device__ __forceinline__ int block_exclusive_sum(int v, int* s_warp) {
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  int incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int up = __shfl_up_sync(0xFFFFFFFFu, incl, d);
    if (lane >= d) incl += up;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  int before = incl - v;
  for (int w = 0; w < warp; ++w) before += s_warp[w];
  return before;
}

}  // namespace moe_fp4
