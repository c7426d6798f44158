/*
 * libmoe_fp4_cuda: the C ABI of moe_fp4's CUDA pipeline kernels and NVFP4 grouped GEMMs.
 *
 * Plain C: raw pointers, sizes, dtype enums and a CUDA stream. No torch, no Python, no C++
 * exception ever leaves the library. Every entry returns a moe_fp4_status; on failure
 * moe_fp4_last_error() (thread-local) holds a message that names the argument, what was
 * expected and what came. Nothing allocates device memory: where scratch space is needed the
 * caller passes a workspace sized by the matching *_workspace_size query.
 *
 * The buffers and their semantics are those of moe_fp4/stages.py (the torch reference of every
 * stage); the docstrings there are the contract. In short, with E experts and n = M*topk slots:
 *
 *   expert_offsets[E+1]      prefix sums of the rows m_e routed to each expert
 *   blockscale_offsets[E+1]  prefix sums of ceil(m_e/128)*128 (row offsets of the scale regions)
 *   grouped scales           [scale_rows, Cp] bytes, Cp = ceil(K/64)*4; expert e's 128x4-swizzled
 *                            region starts at row blockscale_offsets[e]; every byte that holds
 *                            no scale is written as zero.
 *
 * Devices: `device` is a CUDA device ordinal; the entry makes it current on the calling thread
 * (this library links its own static CUDA runtime). Pipeline entries also accept
 * device = MOE_FP4_HOST: they then run the very same kernel body serially on the host, on host
 * memory, as a test oracle for machines without a GPU (stream is ignored).
 */
#ifndef MOE_FP4_H_
#define MOE_FP4_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MOE_FP4_API __attribute__((visibility("default")))
#else
#define MOE_FP4_API
#endif

#define MOE_FP4_ABI_VERSION 1
#define MOE_FP4_HOST (-1)

/* Same type as cudaStream_t; NULL is the legacy default stream of `device`. */
typedef struct CUstream_st* moe_fp4_stream_t;

typedef enum moe_fp4_status {
  MOE_FP4_OK = 0,
  MOE_FP4_ERROR_INVALID_ARGUMENT = 1, /* a precondition failed (Python raises ValueError) */
  MOE_FP4_ERROR_UNSUPPORTED = 2,      /* no code for this device or mode in this build */
  MOE_FP4_ERROR_CUDA = 3,             /* the CUDA runtime reported an error */
  MOE_FP4_ERROR_INTERNAL = 4          /* a CUTLASS status or an unexpected failure */
} moe_fp4_status;

typedef enum moe_fp4_dtype { MOE_FP4_BF16 = 0, MOE_FP4_FP16 = 1, MOE_FP4_FP32 = 2 } moe_fp4_dtype;

typedef enum moe_fp4_component {
  MOE_FP4_PIPELINE = 0, /* routing, quantize_rows, silu_mul_quantize, moe_reduce */
  MOE_FP4_GEMM = 1      /* NVFP4 grouped GEMM */
} moe_fp4_component;

/* ------------------------------------------------------------------ library */

MOE_FP4_API int moe_fp4_abi_version(void);

/* The message of the last failed call on this thread ("" if none). */
MOE_FP4_API const char* moe_fp4_last_error(void);

/* Comma-separated targets this build holds code for, e.g. "sm_90a,sm_100a,sm_120f,compute_90"
 * for MOE_FP4_PIPELINE or "sm_100a,sm_120f" for MOE_FP4_GEMM ("" when none). */
MOE_FP4_API const char* moe_fp4_compiled_archs(int component);

/* MOE_FP4_OK if this build has code of `component` that runs on compute capability
 * major.minor, else MOE_FP4_ERROR_UNSUPPORTED with the reason. Touches no GPU. */
MOE_FP4_API int moe_fp4_serves(int component, int major, int minor);

/* ------------------------------------------------------------------ pipeline kernels */

/* Routing metadata of topk_ids int32 [num_slots] (= [M, topk] flattened): stages.routing.
 * Ids outside [0, E) (e.g. -1) are not served. Deterministic: ascending flat index within an
 * expert. One launch when num_slots <= 4096, three otherwise. */
MOE_FP4_API int moe_fp4_routing_workspace_size(int64_t num_slots, int32_t num_experts, size_t* bytes);
MOE_FP4_API int moe_fp4_routing(const int32_t* topk_ids, int64_t num_slots, int32_t num_experts,
                                int32_t* expert_offsets, int32_t* blockscale_offsets,
                                int32_t* slot_to_flat, int32_t* flat_to_slot, void* workspace,
                                size_t workspace_bytes, int device, moe_fp4_stream_t stream);

/* stages.quantize_rows: slot s < expert_offsets[E] of expert e holds row x[slot_to_flat[s] / topk]
 * (x[s] when slot_to_flat is NULL, which needs num_slots == x_rows), optionally times
 * row_scale[slot_to_flat[s]] (float32, rounded back to x's dtype), quantized with gs[e].
 * x: bf16/fp16 [x_rows, k], k % 16 == 0. packed: uint8 [num_slots, k/2] (rows past
 * expert_offsets[E] zeroed). scales: [scale_rows, ceil(k/64)*4], scale_rows a multiple of 128
 * and >= the grouped bound num_slots + 127*min(E, num_slots) rounded up to 128. */
MOE_FP4_API int moe_fp4_quantize_rows(const void* x, int x_dtype, int64_t x_rows, int64_t k,
                                      const int32_t* slot_to_flat, int32_t topk,
                                      const float* row_scale, int64_t num_slots, const float* gs,
                                      const int32_t* expert_offsets,
                                      const int32_t* blockscale_offsets, int32_t num_experts,
                                      uint8_t* packed, uint8_t* scales, int64_t scale_rows,
                                      int device, moe_fp4_stream_t stream);

/* stages.silu_mul_quantize: act = silu(h[:, :inter]) * h[:, inter:] (silu in float32 rounded to
 * h's dtype, the product rounded to h's dtype), then per-expert quantization with gs[e].
 * h: bf16/fp16 [num_slots, 2*inter], inter % 16 == 0. Outputs as moe_fp4_quantize_rows, k = inter. */
MOE_FP4_API int moe_fp4_silu_mul_quantize(const void* h, int h_dtype, int64_t num_slots,
                                          int64_t inter, const float* gs,
                                          const int32_t* expert_offsets,
                                          const int32_t* blockscale_offsets, int32_t num_experts,
                                          uint8_t* packed, uint8_t* scales, int64_t scale_rows,
                                          int device, moe_fp4_stream_t stream);

/* stages.moe_reduce: out[t] = sum_j w[t,j] * y[flat_to_slot[t*topk+j]] over slots >= 0, in float32
 * in slot order j = 0..topk-1 (each product rounded to float32, then added), rounded once to
 * out_dtype. topk_weights NULL gives the plain sum. y: bf16/fp16 [y_rows, hidden], hidden % 8 == 0;
 * out: bf16/fp16/fp32 [num_tokens, hidden]. */
MOE_FP4_API int moe_fp4_moe_reduce(const void* y, int y_dtype, int64_t y_rows, int64_t hidden,
                                   const int32_t* flat_to_slot, const float* topk_weights,
                                   int64_t num_tokens, int32_t topk, void* out, int out_dtype,
                                   int device, moe_fp4_stream_t stream);

/* ------------------------------------------------------------------ grouped GEMM (SM100, SM120/SM121) */

/* stages.grouped_gemm: D[rows of e, section h] = alpha[e*S+h] * A_e . B_e[h]^T, fp32 accumulation,
 * as E*S CUTLASS groups (S = sections: 2 for w13 = gate, up; 1 for w2). Groups of empty experts
 * produce no work. a: [a_rows, k/2] packed e2m1 grouped by expert_offsets; a_scales: grouped
 * [a_scale_rows, Cp]; b: [E, n, k/2]; b_scales: [E, S, ceil((n/S)/128)*128, Cp]
 * (stages.prepare_weight_scales); alpha: float32 [E*S]; out: bf16/fp16 [a_rows, n], rows past
 * expert_offsets[E] untouched. Needs k % 32 == 0, (n/S) % 8 == 0, 16-byte aligned pointers. */
MOE_FP4_API int moe_fp4_grouped_gemm_workspace_size(int32_t num_experts, int32_t sections,
                                                    int out_dtype, int device, size_t* bytes);
MOE_FP4_API int moe_fp4_grouped_gemm(const uint8_t* a, const uint8_t* a_scales, int64_t a_rows,
                                     int64_t a_scale_rows, const uint8_t* b,
                                     const uint8_t* b_scales, const float* alpha,
                                     int32_t num_experts, int32_t sections, int64_t n, int64_t k,
                                     const int32_t* expert_offsets,
                                     const int32_t* blockscale_offsets, void* out, int out_dtype,
                                     void* workspace, size_t workspace_bytes, int device,
                                     moe_fp4_stream_t stream);

/* ------------------------------------------------------------------ host-side checks of the GEMM wiring */

/* Byte offsets that the compiled GEMM of target `arch` (100 or 120) reads scale (r, c) from,
 * r < rows, c < k/16, for operand 0 (A, SFA) or 1 (B, SFB): CUTLASS's own scale-factor layout,
 * evaluated on the host. offsets: int64 [rows * (k/16)], row-major. */
MOE_FP4_API int moe_fp4_gemm_scale_offsets(int arch, int operand, int64_t rows, int64_t k, int64_t* offsets);

/* CUTLASS's can_implement for the GEMM of `arch` (100 or 120) with `out_dtype` and E*S groups,
 * run on the host, and the workspace it would need on a device with `sm_count` SMs. */
MOE_FP4_API int moe_fp4_gemm_plan(int arch, int out_dtype, int32_t num_experts, int32_t sections,
                                  int sm_count, size_t* workspace_bytes);

/* The per-group arguments the device setup kernel of `arch` writes, computed by the same code on
 * the host from host copies of expert_offsets/blockscale_offsets. For group g = e*S+h, 9 int64:
 * m, n, k, then byte offsets from the base pointers of A, B, SFA, SFB, D (D in bytes of a 2-byte
 * dtype), then the row pitch of D in elements. Groups whose offsets are inconsistent with a_rows
 * or a_scale_rows get m = 0 (no work). out: int64 [E*S*9]. */
MOE_FP4_API int moe_fp4_gemm_group_args(int arch, const int32_t* expert_offsets,
                                        const int32_t* blockscale_offsets, int32_t num_experts,
                                        int32_t sections, int64_t n, int64_t k, int64_t a_rows,
                                        int64_t a_scale_rows, int64_t* out);

#ifdef __cplusplus
}
#endif

#endif /* MOE_FP4_H_ */
