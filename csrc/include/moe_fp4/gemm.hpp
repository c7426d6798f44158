// The interface between the C entries (binding.cpp) and the per-architecture grouped GEMM
// translation units (gemm_sm100.cu, gemm_sm120.cu), each built only for its own target.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moe_fp4 {

// One grouped GEMM call: E*S groups, group g = e*S + h (expert e, section h of N/S rows of B).
struct GemmArgs {
  const uint8_t* a;         // [a_rows, k/2]
  const uint8_t* a_scales;  // [a_scale_rows, scale_cols(k)]
  int64_t a_rows;
  int64_t a_scale_rows;
  const uint8_t* b;         // [E, n, k/2]
  const uint8_t* b_scales;  // [E, S, round_up(n/S, 128), scale_cols(k)]
  const float* alpha;       // [E*S]
  int32_t num_experts;
  int32_t sections;
  int64_t n;
  int64_t k;
  const int32_t* expert_offsets;      // [E+1]
  const int32_t* blockscale_offsets;  // [E+1]
  void* out;                          // [a_rows, n], 16-bit
  int out_dtype;                      // MOE_FP4_BF16 or MOE_FP4_FP16
  void* workspace;
  size_t workspace_bytes;
  int device;
  int sm_count;
};

// What a GEMM translation unit provides (all return a moe_fp4_status).
struct GemmImpl {
  int (*workspace_size)(int32_t groups, int out_dtype, int device, int sm_count, size_t* bytes);
  int (*run)(const GemmArgs& args, cudaStream_t stream);
  // Host-side checks of the wiring (moe_fp4_gemm_scale_offsets / moe_fp4_gemm_group_args).
  int (*scale_offsets)(int operand, int64_t rows, int64_t k, int64_t* offsets);
  int (*group_args)(const GemmArgs& host_args, int64_t* out);
};

#if defined(MOE_FP4_HAVE_GEMM_SM100)
extern const GemmImpl kGemmSm100;
#endif

// The sm_90a grouped GEMM (gemm_sm90.cu): 16-bit activations x prepared NVFP4 weights.
struct Sm90GemmArgs {
  const void* a;  // [a_rows, k], bf16 or fp16
  int a_dtype;    // also the output dtype
  int64_t a_rows;
  int64_t k;
  const uint8_t* w;         // prepared codes, E*n*k/2 bytes
  const uint8_t* w_scales;  // prepared scales, E*n*k/16 bytes
  const float* alpha;       // [E*S]
  int32_t num_experts;
  int32_t sections;
  int64_t n;
  const int32_t* expert_offsets;  // [E+1]
  void* out;                      // [a_rows, n]
  int tile_tokens;                // 0 = heuristic, else one of kSm90TileTokens
  int device;
  int sm_count;
  int slices = 0;                 // K-slices per CTA: 0 = heuristic, 1, or 2 (8- and 16-token tiles)
  int cta_splits = 0;             // CTAs per tile splitting K (a cluster): 0 = heuristic, 1 to 8
  int gs_splits = 0;              // K splits per tile through the workspace: 0 = heuristic, 1 (none) to 16
  void* workspace = nullptr;      // GS: tile counters (zero on entry, left zero) and partial sums
  size_t workspace_bytes = 0;     // 0: no GS plan
  void* silu_out = nullptr;       // moe_fp4_sm90_gemm_silu: h [a_rows, n/2] in place of out
  const float* silu_gs = nullptr; // [E]: h quantized with these (written dequantized); null: W4A16
};

// The token-tile widths the sm_90a GEMM has (gemm_sm90.cu, dispatch).
inline constexpr int kSm90TileTokens[] = {8, 16, 32, 48, 64, 80, 96, 112, 128};

// The configuration of one sm_90a GEMM call (the heuristics' choice where an override is 0).
struct Sm90Plan {
  int tile_tokens;
  int slices;
  int cta_splits;
  int gs_splits;  // > 1: K split through the workspace (the 8- and 16-token tiles, no cluster)
  int gs_tail;    // with gs_splits > 1: only the tiles of the grid's last round split, up to gs_splits ways
};

#if defined(MOE_FP4_HAVE_GEMM_SM90)
int sm90_grouped_gemm(const Sm90GemmArgs& args, cudaStream_t stream);
int sm90_tile_tokens(int64_t a_rows, int32_t num_experts);
Sm90Plan sm90_plan(int64_t a_rows, int32_t num_experts, int64_t n, int64_t k, int sm_count, int tile_tokens,
                   int slices, int cta_splits, int gs_splits = 1);
// The workspace bytes `plan` needs for a_rows rows, E experts and n weight rows on sm_count SMs
// (0 without GS): the tiles' counters (a 256-byte multiple), then the units' fp32 partial sums.
size_t sm90_workspace_bytes(const Sm90Plan& plan, int64_t a_rows, int32_t num_experts, int64_t n, int sm_count);
#endif
#if defined(MOE_FP4_HAVE_GEMM_SM120)
extern const GemmImpl kGemmSm120;
#endif

}  // namespace moe_fp4
