// Un-permute and top-k weighted sum (stages.moe_reduce), one kernel body for the device and
// the host oracle. Work unit: (token t, 8 consecutive columns), one 16-byte load per slot.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "moe_fp4/common.hpp"
#include "moe_fp4/launch.cuh"
#include "moe_fp4/nvfp4.cuh"
#include "moe_fp4/pipeline.hpp"

namespace moe_fp4 {
namespace {

constexpr int kColumns = 8;

constexpr int kSlotBatch = 8;  // slots whose indices, then rows, are loaded together

// out[t, 8g..8g+7] = sum over j of w[t,j] * y[flat_to_slot[t*topk+j]], in float32 in slot order,
// each product rounded to float32 before it is added; slots outside [0, y_rows) add nothing.
// The slots are taken kSlotBatch at a time: their indices are loaded together, then their rows,
// then added in order (one round trip per batch instead of two per slot).
template <typename TY, typename TO>
struct ReduceUnit {
  ReduceArgs a;

  MOE_FP4_HD void operator()(int64_t unit) const {
    const int64_t groups = a.hidden / kColumns;
    const int64_t t = unit / groups;
    const int64_t col = (unit % groups) * kColumns;
    float acc[kColumns];
    for (float& v : acc) v = 0.0f;
    for (int32_t j0 = 0; j0 < a.topk; j0 += kSlotBatch) {
      int64_t slot[kSlotBatch];
#pragma unroll
      for (int b = 0; b < kSlotBatch; ++b) {
        slot[b] = -1;
        if (j0 + b < a.topk) {
          const int64_t s = a.flat_to_slot[t * a.topk + j0 + b];
          slot[b] = s < a.y_rows ? s : -1;
        }
      }
      float y[kSlotBatch][kColumns], w[kSlotBatch];
#pragma unroll
      for (int b = 0; b < kSlotBatch; ++b) {
        if (slot[b] < 0) continue;
        load_as_float(static_cast<const TY*>(a.y) + slot[b] * a.hidden + col, y[b]);
        w[b] = a.weights != nullptr ? a.weights[t * a.topk + j0 + b] : 1.0f;
      }
#pragma unroll
      for (int b = 0; b < kSlotBatch; ++b) {
        if (slot[b] < 0) continue;
#pragma unroll
        for (int i = 0; i < kColumns; ++i)
          acc[i] = add_rn(acc[i], a.weights != nullptr ? mul_rn(y[b][i], w[b]) : y[b][i]);
      }
    }
    store_rounded8(static_cast<TO*>(a.out) + t * a.hidden + col, acc);
  }
};

template <typename TY>
int dispatch_out(int out_dtype, const ReduceArgs& a, int device, cudaStream_t stream) {
  const int64_t units = a.num_tokens * (a.hidden / kColumns);
  const char* what = "moe_reduce kernel launch";
  if (out_dtype == MOE_FP4_BF16) return for_each_unit(ReduceUnit<TY, __nv_bfloat16>{a}, units, device, stream, what);
  if (out_dtype == MOE_FP4_FP16) return for_each_unit(ReduceUnit<TY, __half>{a}, units, device, stream, what);
  return for_each_unit(ReduceUnit<TY, float>{a}, units, device, stream, what);
}

}  // namespace

int launch_moe_reduce(int y_dtype, int out_dtype, const ReduceArgs& args, int device, cudaStream_t stream) {
  if (y_dtype == MOE_FP4_BF16) return dispatch_out<__nv_bfloat16>(out_dtype, args, device, stream);
  return dispatch_out<__half>(out_dtype, args, device, stream);
}

}  // namespace moe_fp4
