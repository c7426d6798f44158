// Launchers of the pipeline kernels (routing.cu, quantize.cu, reduce.cu, sm90_prepare.cu,
// check_inputs.cu). The C entries in binding.cpp validate every argument first; these functions
// assume valid arguments and return a moe_fp4_status. device == MOE_FP4_HOST runs the kernel
// body on the host.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moe_fp4 {

// Device ordinals the library serves: [0, kMaxDevices) (per-device state is sized by it).
constexpr int kMaxDevices = 64;

// ------------------------------------------------------------------ routing

constexpr int kRoutingThreads = 256;            // one tile of ids per block iteration
// Up to this many slots with E + 1 > 2048 keys (else up to one tile, kRoutingThreads): one block,
// one launch. Measured on the H200 (Qwen3, M = 256: 2048 ids): 19 us in the one block, 15.6 us in
// three launches over chunks (kernel breakdown, no PDL).
constexpr int64_t kRoutingSingleLaunch = 1024;
// Past one tile up to this many slots (and E + 1 <= 2048 keys): one launch of one block per tile,
// each counting every id itself (routing.cu, routing_tiles_kernel, where it is measured).
constexpr int64_t kRoutingTilesMax = 16384;
// ... and up to 256 ids per key (kRoutingThreads * (E + 1)): with few experts a warp's counting
// atomics meet on few keys. Measured on the H100 (the routing stage alone, cold L2, µs, one block
// per tile -> three launches): Llama-4-Scout (E = 16, top-1) 8192 ids 12.6 -> 10.2
// (tests/results/h100-2026-12-06-s35, call s35a), 16384 ids 17.6 -> 13.5 (s34b); 4096 ids stay with
// one launch (9.6 against 10.2, s34b). Qwen3-30B-A3B and DeepSeek-V3 (E = 128, 256) are not affected.
constexpr int64_t routing_tiles_max(int32_t num_experts) {
  const int64_t per_key = kRoutingThreads * (int64_t(num_experts) + 1);
  return per_key < kRoutingTilesMax ? per_key : kRoutingTilesMax;
}

struct RoutingArgs {
  const int32_t* ids;  // [n]
  int64_t n;
  int32_t num_experts;
  int32_t* expert_offsets;      // [E+1]
  int32_t* blockscale_offsets;  // [E+1]
  int32_t* slot_to_flat;        // [n]
  int32_t* flat_to_slot;        // [n]
  void* workspace;
};

size_t routing_workspace_bytes(int64_t n, int32_t num_experts);
int launch_routing(const RoutingArgs& args, cudaStream_t stream);

// ------------------------------------------------------------------ grouped quantization

// Where the rows to quantize come from.
enum class RowSource {
  kGather,   // slot s -> x[slot_to_flat[s] / topk] (x[s] without slot_to_flat), times row_scale
  kSiluMul,  // slot s -> silu(h[s, :k]) * h[s, k:]
};

struct GroupedQuantArgs {
  const void* src;  // x [src_rows, k] or h [num_slots, 2k]
  int64_t src_rows;
  int64_t k;  // elements per quantized row
  const int32_t* slot_to_flat;  // kGather, may be null
  int32_t topk;
  const float* row_scale;  // kGather, may be null
  int64_t num_slots;
  const float* gs;  // [E]
  const int32_t* expert_offsets;
  const int32_t* blockscale_offsets;
  int32_t num_experts;
  uint8_t* packed;  // [num_slots, k/2], may be null when values is given
  uint8_t* scales;  // [scale_rows, scale_cols(k)], may be null when values is given
  int64_t scale_rows;
  void* values;  // optional [num_slots, k] in the source dtype: e2m1 * f32(block scale), exact
};

// dtype: MOE_FP4_BF16 or MOE_FP4_FP16 (the source's).
int launch_grouped_quantize(RowSource source, int dtype, const GroupedQuantArgs& args, int device,
                            cudaStream_t stream);

// The values-only kGather quantization (packed and scales null) in token order: each row of x read
// once and written to its topk slots (flat_to_slot [src_rows * topk], as launch_routing writes it;
// args.slot_to_flat and blockscale_offsets unused), the same bytes as launch_grouped_quantize's.
int launch_quantize_values_by_token(int dtype, const GroupedQuantArgs& args, const int32_t* flat_to_slot, int device,
                                    cudaStream_t stream);

// ------------------------------------------------------------------ routing + values quantization

// Up to this many slots moe_fp4_routing_quantize_values routes and quantizes in one launch (each
// CTA sorts every id in shared memory, one (key, index) word per thread: a bitonic sort).
constexpr int64_t kRoutingQuantizeMaxSlots = 256;

// launch_routing (routing.workspace unused) and the values-only kGather quantization (quant:
// packed and scales null; its slot_to_flat, expert_offsets and blockscale_offsets are ignored,
// the kernel routes them itself) in one kernel, writing the same bytes as the two.
// routing.n == quant.num_slots <= kRoutingQuantizeMaxSlots. dtype: the rows' (MOE_FP4_BF16 or
// MOE_FP4_FP16). No host mode.
int launch_routing_quantize_values(int dtype, const RoutingArgs& routing, const GroupedQuantArgs& quant, int device,
                                   cudaStream_t stream);

// ------------------------------------------------------------------ sm_90a weight preparation

struct Sm90PrepareArgs {
  const uint8_t* w;       // [E, n, k/2] packed e2m1
  const uint8_t* scales;  // [E, n, k/16] logical e4m3 block scales
  int32_t num_experts;
  int64_t n;  // % 16 == 0
  int64_t k;  // % 16 == 0
  uint8_t* w_out;       // E*n*k/2 bytes (sm90_layout.cuh)
  uint8_t* scales_out;  // E*n*k/16 bytes
  int32_t sections;     // 1, or 2 for w13: gate and up rows interleaved by 8 (sm90_prepare.cu, Unit)
};

int launch_sm90_prepare(const Sm90PrepareArgs& args, int device, cudaStream_t stream);
// The inverse (moe_fp4_sm90_restore_weights), on the same arguments with the roles swapped: w and
// scales are the prepared buffers, w_out and scales_out receive the canonical codes and scales.
int launch_sm90_restore(const Sm90PrepareArgs& args, int device, cudaStream_t stream);

// ------------------------------------------------------------------ top-k reduction

struct ReduceArgs {
  const void* y;  // [y_rows, hidden]
  int64_t y_rows;
  int64_t hidden;
  const int32_t* flat_to_slot;  // [num_tokens * topk]
  const float* weights;         // [num_tokens * topk] or null
  int64_t num_tokens;
  int32_t topk;
  void* out;  // [num_tokens, hidden]
};

int launch_moe_reduce(int y_dtype, int out_dtype, const ReduceArgs& args, int device, cudaStream_t stream);

// ------------------------------------------------------------------ input checks (fused_moe's validate)

struct CheckInputsArgs {
  const void* x;  // bf16/fp16 [x_numel], 2-byte aligned
  int x_dtype;
  int64_t x_numel;
  const float* weights;  // [weights_numel]
  int64_t weights_numel;
  const void* ids;  // int32/int64 [ids_numel]
  int ids_dtype;
  int64_t ids_numel;
  const void* map;  // int32/int64 [map_numel], null when map_numel == 0
  int map_dtype;
  int64_t map_numel;
};

constexpr int kCheckResultWords = 6;  // the entry's result (moe_fp4.h)

// moe_fp4_check_inputs on a current, valid device (one kernel writing into mapped pinned memory,
// which the call polls; serialized per device) or on the host; writes kCheckResultWords int64 to the
// host array `result`.
int check_inputs(const CheckInputsArgs& args, int64_t* result, int device, cudaStream_t stream);

}  // namespace moe_fp4
