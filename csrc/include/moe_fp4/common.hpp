// Internal helpers shared by every translation unit of libmoe_fp4_cuda: error recording,
// the host/device function qualifier and small integer utilities. No torch, no exceptions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moe_fp4/moe_fp4.h"

#if defined(__CUDACC__)
#define MOE_FP4_HD __host__ __device__ __forceinline__
#else
#define MOE_FP4_HD inline
#endif

namespace moe_fp4 {

// Records a printf-style message as this thread's last error and returns `code`.
int set_error(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// MOE_FP4_OK for cudaSuccess, else records "<what>: <CUDA error name>: <string>" and returns
// MOE_FP4_ERROR_CUDA.
int cuda_status(cudaError_t err, const char* what);

// Return MOE_FP4_ERROR_INVALID_ARGUMENT with the message unless `cond` holds.
#define MOE_FP4_REQUIRE(cond, ...)                                                   \
  do {                                                                               \
    if (!(cond)) return ::moe_fp4::set_error(MOE_FP4_ERROR_INVALID_ARGUMENT, __VA_ARGS__); \
  } while (0)

// Propagate a non-OK status.
#define MOE_FP4_TRY(expr)                    \
  do {                                       \
    int moe_fp4_status_ = (expr);            \
    if (moe_fp4_status_ != MOE_FP4_OK) return moe_fp4_status_; \
  } while (0)

MOE_FP4_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
MOE_FP4_HD int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Columns of a swizzled scale matrix for rows of k elements: ceil(k/16/4)*4.
MOE_FP4_HD int64_t scale_cols(int64_t k) { return round_up(k / 16, 4); }

// Rows of a grouped scale buffer that holds any routing of n rows over E experts
// (format.grouped_scale_rows_bound).
MOE_FP4_HD int64_t grouped_scale_rows_bound(int64_t n, int64_t E) {
  return round_up(n + 127 * (E < n ? E : n), 128);
}

// Blocks for a grid-stride loop over `units` with `threads` per block: enough to fill the
// device (`sm_count` SMs, 8 blocks each) but never more than the work.
inline unsigned grid_for(int64_t units, int threads, int sm_count) {
  int64_t want = ceil_div(units, threads);
  int64_t cap = int64_t(sm_count) * 8;
  return unsigned(want < cap ? (want > 0 ? want : 1) : cap);
}

// Multiprocessor count of `device` (cached; the device must be valid).
int sm_count(int device);

// A CUDA driver function by name and ABI version (cudaGetDriverEntryPointByVersion: the library
// links only the runtime, never libcuda); nullptr where the driver does not have it.
void* driver_entry(const char* name, unsigned int version);

// Whether the pipeline's kernels are launched with programmatic dependent launch (launch.cuh):
// yes unless the environment's MOE_FP4_PDL is "0" (read once).
bool pdl_enabled();

}  // namespace moe_fp4
