/*
 * libmoe_fp4_cuda: the C ABI of moe_fp4's CUDA pipeline kernels and NVFP4 grouped GEMMs.
 *
 * Plain C: raw pointers, sizes, dtype enums and a CUDA stream. No torch, no Python, no C++
 * exception ever leaves the library. Every entry returns a moe_fp4_status; on failure
 * moe_fp4_last_error() (thread-local) holds a message that names the argument, what was
 * expected and what came. Nothing allocates device memory: where scratch space is needed the
 * caller passes a workspace sized by the matching *_workspace_size query (the one exception,
 * moe_fp4_check_inputs, keeps 64 bytes of static __device__ scratch and 56 bytes of mapped pinned
 * host memory per device).
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
 * while it runs (this library links its own static CUDA runtime) and puts the thread's current
 * CUDA context back as it found it on return, so a caller's current device (torch's) never
 * changes. Pipeline entries also accept
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

#define MOE_FP4_ABI_VERSION 11
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

/* The integer codes (ABI 4) describe index tensors (moe_fp4_check_inputs). */
typedef enum moe_fp4_dtype {
  MOE_FP4_BF16 = 0,
  MOE_FP4_FP16 = 1,
  MOE_FP4_FP32 = 2,
  MOE_FP4_INT32 = 3,
  MOE_FP4_INT64 = 4
} moe_fp4_dtype;

typedef enum moe_fp4_component {
  MOE_FP4_PIPELINE = 0, /* routing, quantize_rows, silu_mul_quantize, moe_reduce */
  MOE_FP4_GEMM = 1      /* NVFP4 grouped GEMM */
} moe_fp4_component;

/* ------------------------------------------------------------------ library */

MOE_FP4_API int moe_fp4_abi_version(void);

/* The message of the last failed call on this thread ("" if none). */
MOE_FP4_API const char* moe_fp4_last_error(void);

/* Comma-separated targets this build holds code for, e.g. "sm_90a,sm_100a,sm_120f,compute_90"
 * for MOE_FP4_PIPELINE or "sm_90a,sm_100a,sm_120f" for MOE_FP4_GEMM ("" when none; sm_90a is
 * moe_fp4_sm90_grouped_gemm, the others moe_fp4_grouped_gemm). */
MOE_FP4_API const char* moe_fp4_compiled_archs(int component);

/* MOE_FP4_OK if this build has code of `component` that runs on compute capability
 * major.minor, else MOE_FP4_ERROR_UNSUPPORTED with the reason. Touches no GPU. */
MOE_FP4_API int moe_fp4_serves(int component, int major, int minor);

/* ------------------------------------------------------------------ pipeline kernels */

/* Routing metadata of topk_ids int32 [num_slots] (= [M, topk] flattened): stages.routing.
 * Ids outside [0, E) (e.g. -1) are not served. Deterministic: ascending flat index within an
 * expert. One launch when num_slots <= 1024, three otherwise. */
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
 * and >= the grouped bound num_slots + 127*min(E, num_slots) rounded up to 128.
 * values (optional, NULL for none; ABI 2): x's dtype [num_slots, k], 16-byte aligned, receives the
 * exactly dequantized rows e2m1(code) * f32(block scale) rounded to x's dtype (exact: at most 6
 * significant bits in [2^-10, 2688]); the global scale is NOT applied (it goes to the GEMM's
 * alpha); rows past expert_offsets[E] are zeroed. This is the activation operand of
 * moe_fp4_sm90_grouped_gemm for W4A4. When values is given, packed and scales may be NULL
 * (their stores are skipped); scale_rows keeps its precondition. Every other output is
 * bit-identical with or without values.
 * gs NULL (ABI 9, values only: packed = scales = NULL): the W4A16 operand, rows NOT quantized;
 * values receive the rows as selected above (times row_scale rounded to x's dtype), rows past
 * expert_offsets[E] zeroed: stages.w4a16_rows. */
MOE_FP4_API int moe_fp4_quantize_rows(const void* x, int x_dtype, int64_t x_rows, int64_t k,
                                      const int32_t* slot_to_flat, int32_t topk,
                                      const float* row_scale, int64_t num_slots, const float* gs,
                                      const int32_t* expert_offsets,
                                      const int32_t* blockscale_offsets, int32_t num_experts,
                                      uint8_t* packed, uint8_t* scales, int64_t scale_rows,
                                      void* values, int device, moe_fp4_stream_t stream);

/* (ABI 11) moe_fp4_quantize_rows' values-only gather form (packed = scales = NULL) in token order:
 * each block of x [x_rows, k] is read once and written to the topk slots of its row,
 * flat_to_slot[t * topk + j] (int32 [x_rows * topk], as moe_fp4_routing writes it: -1 for an id
 * not served), quantized with gs[e] of the slot's expert (gs NULL: the W4A16 rows, unquantized),
 * times row_scale[t * topk + j] (float32 or NULL, rounded back to x's dtype) first. num_slots ==
 * x_rows * topk; values x's dtype [num_slots, k], 16-byte aligned. Writes the same bytes as
 * moe_fp4_quantize_rows with the routing's slot_to_flat (rows past expert_offsets[E] zeroed), when
 * flat_to_slot and slot_to_flat are the routing's (a slot that no flat index names is not
 * written). The slot-order kernel reads x once per slot; this one once per row. */
MOE_FP4_API int moe_fp4_quantize_values_by_token(const void* x, int x_dtype, int64_t x_rows, int64_t k,
                                                 const int32_t* flat_to_slot, int32_t topk,
                                                 const float* row_scale, int64_t num_slots, const float* gs,
                                                 const int32_t* expert_offsets, int32_t num_experts, void* values,
                                                 int device, moe_fp4_stream_t stream);

/* (ABI 7) moe_fp4_routing and moe_fp4_quantize_rows' values-only form (packed = scales = NULL,
 * slot_to_flat as routed) in ONE launch, for decode: num_slots = x_rows * topk <=
 * MOE_FP4_ROUTING_QUANTIZE_MAX_SLOTS. topk_ids int32 [num_slots]; x bf16/fp16 [x_rows, k], k % 16
 * == 0; row_scale float32 [num_slots] or NULL; gs float32 [E]; the routing outputs as
 * moe_fp4_routing writes them (no workspace); values x's dtype [num_slots, k], 16-byte aligned.
 * Writes the same bytes as moe_fp4_routing followed by moe_fp4_quantize_rows (gs NULL: the
 * W4A16 rows, unquantized, as there). No host mode. */
#define MOE_FP4_ROUTING_QUANTIZE_MAX_SLOTS 256
MOE_FP4_API int moe_fp4_routing_quantize_values(const int32_t* topk_ids, const void* x, int x_dtype,
                                                int64_t x_rows, int64_t k, int32_t topk,
                                                const float* row_scale, const float* gs,
                                                int32_t num_experts, int32_t* expert_offsets,
                                                int32_t* blockscale_offsets, int32_t* slot_to_flat,
                                                int32_t* flat_to_slot, void* values, int device,
                                                moe_fp4_stream_t stream);

/* stages.silu_mul_quantize: act = silu(h[:, :inter]) * h[:, inter:] (silu in float32 rounded to
 * h's dtype, the product rounded to h's dtype), then per-expert quantization with gs[e].
 * h: bf16/fp16 [num_slots, 2*inter], inter % 16 == 0. Outputs as moe_fp4_quantize_rows, k = inter,
 * including the optional values [num_slots, inter] in h's dtype, and gs NULL for the W4A16 rows
 * (act itself, not quantized: stages.w4a16_silu_mul). */
MOE_FP4_API int moe_fp4_silu_mul_quantize(const void* h, int h_dtype, int64_t num_slots,
                                          int64_t inter, const float* gs,
                                          const int32_t* expert_offsets,
                                          const int32_t* blockscale_offsets, int32_t num_experts,
                                          uint8_t* packed, uint8_t* scales, int64_t scale_rows,
                                          void* values, int device, moe_fp4_stream_t stream);

/* stages.moe_reduce: out[t] = sum_j w[t,j] * y[flat_to_slot[t*topk+j]] over slots >= 0, in float32
 * in slot order j = 0..topk-1 (each product rounded to float32, then added), rounded once to
 * out_dtype. topk_weights NULL gives the plain sum. y: bf16/fp16 [y_rows, hidden], hidden % 8 == 0;
 * out: bf16/fp16/fp32 [num_tokens, hidden]. */
MOE_FP4_API int moe_fp4_moe_reduce(const void* y, int y_dtype, int64_t y_rows, int64_t hidden,
                                   const int32_t* flat_to_slot, const float* topk_weights,
                                   int64_t num_tokens, int32_t topk, void* out, int out_dtype,
                                   int device, moe_fp4_stream_t stream);

/* The data-dependent checks of fused_moe(validate=True), ABI 4: one kernel over all inputs, then
 * the answer comes back to the host through pinned memory and the entry synchronizes `stream`.
 * x: bf16/fp16 [x_numel] (x_dtype MOE_FP4_BF16/MOE_FP4_FP16), contiguous, 2-byte aligned (read in
 * 16-byte vectors from its first 16-byte boundary on); weights: float32 [weights_numel]; ids:
 * int32/int64 [ids_numel] (ids_dtype MOE_FP4_INT32/MOE_FP4_INT64); expert_map: int32/int64
 * [map_numel] (map_dtype), or NULL with map_numel == 0 (map_dtype is then ignored). Every buffer
 * contiguous, on `device` (host memory for MOE_FP4_HOST), aligned to its element size; a pointer
 * may be NULL where its count is 0. result: host int64 [6], written on success:
 *   result[0]  1 if some element of x is inf or NaN (an all-ones exponent field), else 0
 *   result[1]  1 if some weight is inf or NaN, else 0
 *   result[2]  min of ids, result[3]  max of ids        (no ids: INT64_MAX, INT64_MIN)
 *   result[4]  min of expert_map, result[5]  max of it  (no map: INT64_MAX, INT64_MIN)
 * On a device: one grid-stride kernel (a single block for small inputs, at most 4 per SM), launched
 * plainly (no programmatic dependent launch: it starts after everything before it in `stream`);
 * its last block writes the 48-byte answer and then the call's number into mapped pinned host
 * memory, which the call polls (asking cudaStreamQuery(stream) now and then, so a failed or
 * finished kernel ends the wait with an error): no copy and no stream synchronization. Calls on
 * one device are serialized (a per-device lock, a static scratch the kernel leaves neutral for the
 * next call); the first call on a device allocates its mapped pinned buffer. Refused
 * (MOE_FP4_ERROR_INVALID_ARGUMENT) while `stream` is capturing a CUDA graph: the answer must reach
 * the host. device = MOE_FP4_HOST computes the same result serially on the host (stream ignored). */
MOE_FP4_API int moe_fp4_check_inputs(const void* x, int x_dtype, int64_t x_numel, const float* weights,
                                     int64_t weights_numel, const void* ids, int ids_dtype, int64_t ids_numel,
                                     const void* expert_map, int map_dtype, int64_t map_numel, int64_t* result,
                                     int device, moe_fp4_stream_t stream);

/* ------------------------------------------------------------------ grouped GEMM (SM100, SM120/SM121) */
/* (On sm_90 these two entries return MOE_FP4_ERROR_UNSUPPORTED: use moe_fp4_sm90_grouped_gemm.) */

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

/* ------------------------------------------------------------------ grouped GEMM (sm_90a: H100, H200) */

/* Hopper has no FP4 tensor cores. Its GEMM keeps the weights NVFP4 (in the prepared layout below),
 * dequantizes them in registers to exact 16-bit values and runs 16-bit wgmma (RS form, weights
 * = register operand, activations = shared-memory operand) with fp32 accumulation. The
 * activations are 16-bit: the `values` output of moe_fp4_quantize_rows / moe_fp4_silu_mul_quantize
 * (W4A4: exactly dequantized NVFP4 rows, global scale in alpha) or raw bf16/fp16 rows (W4A16).
 *
 * Prepared layout (details and exactness proof: csrc/include/moe_fp4/sm90_layout.cuh). Per
 * expert e and 16-row block rb, codes take 8k bytes at (e*n/16 + rb)*8k and scales k bytes at
 * (e*n/16 + rb)*k; within them every 64-element K chunk is 512 code bytes + 64 scale bytes in
 * wgmma register-fragment order (lane L of the warp: one 16-byte code vector = its 4 k16 steps;
 * one 8-byte scale vector per row pair g = L/4), a last partial chunk (k % 64 = 16, 32, 48) one
 * 4-byte word per lane and 2 scale bytes per row pair per k16 step. Codes are bit-interleaved for mask-and-shift decoding; a
 * block with a zero scale has its codes zeroed and a negative scale flips its codes' signs (the
 * products are unchanged); scales are re-encoded in one byte, q = ((E+21) << 3) | f for
 * 2^E*(1+f/8), 0 for zero, 0xFF for NaN. The prepared buffers have exactly the byte sizes of the
 * originals (so they can replace them) and work for bf16 and fp16 activations alike. */

/* Byte sizes of the prepared buffers of [E, n, k] weights: E*n*k/2 and E*n*k/16, i.e. the sizes of
 * w and scales themselves (no extra bytes). n % 16 == 0, k % 16 == 0. */
MOE_FP4_API int moe_fp4_sm90_prepared_sizes(int32_t num_experts, int64_t n, int64_t k, size_t* w_bytes,
                                            size_t* scale_bytes);

/* Re-lays w uint8 [E, n, k/2] (packed e2m1, element 2j in the low nibble) and the LOGICAL
 * row-major e4m3 block scales uint8 [E, n, k/16] (not swizzled) into w_out / scales_out (same
 * byte sizes, distinct buffers, 16-byte aligned). n % 16 == 0 (n <= 2^21), k % 16 == 0. A kernel
 * on `device`, or the same code serially on the host for device = MOE_FP4_HOST.
 * sections (ABI 10): 1, or 2 for w13 (gate rows 0 .. n/2-1, then up rows), whose gate and up rows
 * the prepared layout interleaves by 8 (each 16-row block holds 8 gate rows and the 8 up rows of the
 * same columns), which moe_fp4_sm90_grouped_gemm with sections = 2 and moe_fp4_sm90_gemm_silu read. */
MOE_FP4_API int moe_fp4_sm90_prepare_weights(const uint8_t* w, const uint8_t* scales, int32_t num_experts,
                                             int64_t n, int64_t k, int32_t sections, uint8_t* w_out,
                                             uint8_t* scales_out, int device, moe_fp4_stream_t stream);

/* The inverse (ABI 3; sections ABI 10, as the preparation's): reads the prepared w [E*n*k/2 bytes]
 * and scales [E*n*k/16 bytes] and writes
 * the canonical w_out uint8 [E, n, k/2] (packed e2m1, element 2j in the low nibble) and the logical
 * row-major e4m3 scales_out uint8 [E, n, k/16]. Same preconditions as
 * moe_fp4_sm90_prepare_weights (distinct buffers, 16-byte aligned, n % 16 == 0, k % 16 == 0;
 * device may be MOE_FP4_HOST). For canonical inputs with non-negative scale bytes (0x00..0x7F),
 * restoring their preparation gives back the scales byte for byte and the codes with the codes
 * of every zero-scale block zeroed (as the prepared layout holds them). */
MOE_FP4_API int moe_fp4_sm90_restore_weights(const uint8_t* w, const uint8_t* scales, int32_t num_experts,
                                             int64_t n, int64_t k, int32_t sections, uint8_t* w_out,
                                             uint8_t* scales_out, int device, moe_fp4_stream_t stream);

/* The token-tile width the heuristic picks for a_rows rows over E experts (host only), from
 * r = ceil(a_rows / min(E, a_rows)) and its cover c = r + 1.5 sqrt(r): 8 for r <= 4, 16 for r <= 8,
 * 32 for c <= 32 (r <= 24), 48 for c <= 48 (r <= 38), 64 for c <= 64, else the one of 80, 96, 112
 * of least ceil(c / t) * (t + 60) (tuned on an H200 with csrc/tests/sm90_gemm_check --sweep;
 * gemm_sm90.cu, sm90_tile_tokens, has the measurements). */
MOE_FP4_API int moe_fp4_sm90_gemm_tile_tokens(int64_t a_rows, int32_t num_experts, int32_t* tile_tokens);

/* out[r, c] = alpha[e*S + c/(n/S)] * sum_k a[r, k] * W_e[c, k] for the rows r of expert e
 * (expert_offsets[e] <= r < expert_offsets[e+1]; int32 prefix sums on the device, E+1 entries),
 * fp32 accumulation, rounded to a's dtype; W_e the NVFP4 weights e2m1 * f32(block scale) in the
 * prepared layout. alpha: float32 [E*S], the plain 1/(gs_a*gs_w) (W4A4) or 1/gs_w (W4A16): the
 * kernel applies its internal power of two (2^8) itself. a: bf16/fp16 [a_rows, k] row-major;
 * out: a's dtype [a_rows, n]; rows past expert_offsets[E] and rows of offsets outside
 * [0, a_rows] are not written. S (sections) = 2 for w13 (gate rows, then up rows, each with its
 * alpha; the weights prepared with sections = 2, ABI 10), 1 for w2; n % 16 == 0, n % S == 0, k % 16 == 0, 16-byte aligned a, w, w_scales, out.
 * tile_tokens: 0 for the heuristic (moe_fp4_sm90_gemm_tile_tokens) or 8, 16, 32, 48, 64, 80, 96, 112, 128. Any E,
 * empty experts cost nothing, no host synchronization, no workspace, CUDA-graph capturable.
 * Deterministic: the same inputs give the same bits (the order of the fp32 sums depends on the
 * configuration, which depends on a_rows and E: a row's result may differ in its last bits
 * between calls with different a_rows). Runs only on sm_90 devices of a build with the 90a
 * target; no host mode. */
MOE_FP4_API int moe_fp4_sm90_grouped_gemm(const void* a, int a_dtype, int64_t a_rows, int64_t k, const uint8_t* w,
                                          const uint8_t* w_scales, const float* alpha, int32_t num_experts,
                                          int32_t sections, int64_t n, const int32_t* expert_offsets, void* out,
                                          int32_t tile_tokens, int device, moe_fp4_stream_t stream);

/* (ABI 8) moe_fp4_sm90_grouped_gemm with a workspace, which lets the heuristic split K through
 * global memory (GS) where that is faster than a thread-block cluster (sm90_plan in gemm_sm90.cu):
 * each (tile, K split) unit writes its fp32 sums to the workspace and the tile's last unit to
 * arrive adds them in split order (deterministic, as every configuration is). workspace: at least
 * moe_fp4_sm90_gemm_workspace_size bytes for this call's a_rows, E, n, k and tile_tokens and the
 * device's SM count, 16-byte aligned, **zero before its first use**: its counters are left zero by
 * every call, so it must not be shared with calls that may run at the same time, nor written
 * between calls. NULL or a smaller workspace: the plan without GS (as moe_fp4_sm90_grouped_gemm).
 * Where the unsplit grid needs a short second round, only that round's tiles split (the tail split):
 * their grouping of the sums follows the routed tile count, so there a row's last bits may also
 * depend on which experts the call's other rows hit. */
MOE_FP4_API int moe_fp4_sm90_grouped_gemm_ws(const void* a, int a_dtype, int64_t a_rows, int64_t k, const uint8_t* w,
                                             const uint8_t* w_scales, const float* alpha, int32_t num_experts,
                                             int32_t sections, int64_t n, const int32_t* expert_offsets, void* out,
                                             int32_t tile_tokens, void* workspace, size_t workspace_bytes, int device,
                                             moe_fp4_stream_t stream);

/* (ABI 10) The MoE's first GEMM with SiLU-and-mul in its epilogue: the product of
 * moe_fp4_sm90_grouped_gemm_config with sections = 2 (w13, prepared with sections = 2), whose
 * gate and up values g, u of each row and column c < n/2 (rounded to a's dtype, as that GEMM
 * writes them) become h = silu(g) * u as moe_fp4_silu_mul_quantize computes it (the SiLU and the
 * product each rounded to a's dtype), written to values [a_rows, n/2] (a's dtype, 16-byte aligned)
 * instead of the [a_rows, n] product: with gs (float32 [E], the quantize-direction global scales of
 * h), each 16-value block NVFP4-quantized with gs[e] and written dequantized, as
 * moe_fp4_silu_mul_quantize's values output (W4A4); with gs NULL, h itself (W4A16). Bit for bit what
 * that GEMM and moe_fp4_silu_mul_quantize write for the rows of experts; rows past
 * expert_offsets[E] are not written (moe_fp4_silu_mul_quantize zeroes them). Built for the
 * 8-token tile (tile_tokens 0 takes it up to 4 rows per expert, see moe_fp4_sm90_gemm_tile_tokens),
 * whose kernels the plain GEMM runs too: a call of rows whose tile is wider fails with INVALID_ARGUMENT,
 * nothing launched (a_rows = 0 returns OK at once, as the GEMM does). n % 32 == 0; the configuration arguments, workspace and every other precondition as
 * moe_fp4_sm90_grouped_gemm_config. */
MOE_FP4_API int moe_fp4_sm90_gemm_silu(const void* a, int a_dtype, int64_t a_rows, int64_t k, const uint8_t* w,
                                       const uint8_t* w_scales, const float* alpha, int32_t num_experts, int64_t n,
                                       const int32_t* expert_offsets, const float* gs, void* values,
                                       int32_t tile_tokens, int32_t slices, int32_t cta_splits, int32_t gs_splits,
                                       void* workspace, size_t workspace_bytes, int device, moe_fp4_stream_t stream);

/* (ABI 8) The workspace bytes moe_fp4_sm90_grouped_gemm_ws can use for these shapes on a device
 * with sm_count SMs (host only): 0 where its plan does not split K through the workspace. */
MOE_FP4_API int moe_fp4_sm90_gemm_workspace_size(int64_t a_rows, int32_t num_experts, int64_t n, int64_t k,
                                                 int32_t tile_tokens, int32_t sm_count, size_t* bytes);

/* (ABI 6; ABI 8 added gs_splits and the workspace) moe_fp4_sm90_grouped_gemm with the rest of its
 * configuration chosen by the caller (for tuning and tests; 0 = the heuristic's choice): slices = K
 * slices per CTA (1 or 2; 2 only for 8- and 16-token tiles, where it means 64-row CTAs of two
 * consumer warpgroups; ignored for wider tiles), cta_splits = CTAs per tile that split K between
 * them as a thread-block cluster, their fp32 sums added in rank order through distributed shared
 * memory (1 to 8; only for the 8-, 16- and 32-token tiles, with one slice per CTA: cta_splits > 1
 * makes slices 1, and wider tiles take 1), gs_splits = K splits per tile through the workspace
 * (as moe_fp4_sm90_grouped_gemm_ws; 1 to 16, only for the 8- and 16-token tiles without a
 * cluster split; 0 = the heuristic's, which uses the workspace if one is given; > 1 needs a
 * workspace of moe_fp4_sm90_gemm_workspace_size's layout for that plan). Every configuration
 * computes the same products; moe_fp4_sm90_gemm_plan reports the configuration a call runs, but for
 * the heuristic's tail split (gs_splits = 8 there: only the last round's tiles split, up to 8 ways),
 * which an explicit gs_splits does not select. */
MOE_FP4_API int moe_fp4_sm90_grouped_gemm_config(const void* a, int a_dtype, int64_t a_rows, int64_t k,
                                                 const uint8_t* w, const uint8_t* w_scales, const float* alpha,
                                                 int32_t num_experts, int32_t sections, int64_t n,
                                                 const int32_t* expert_offsets, void* out, int32_t tile_tokens,
                                                 int32_t slices, int32_t cta_splits, int32_t gs_splits,
                                                 void* workspace, size_t workspace_bytes, int device,
                                                 moe_fp4_stream_t stream);

/* (ABI 6; ABI 8 added with_workspace and gs_splits) The configuration the heuristics choose for a
 * call of moe_fp4_sm90_grouped_gemm (with_workspace 0) or moe_fp4_sm90_grouped_gemm_ws with a
 * large enough workspace (1) on a device with sm_count SMs (host only): token tile, K slices per
 * CTA, CTAs per tile, K splits through the workspace. */
MOE_FP4_API int moe_fp4_sm90_gemm_plan(int64_t a_rows, int32_t num_experts, int64_t n, int64_t k, int32_t sm_count,
                                       int32_t with_workspace, int32_t* tile_tokens, int32_t* slices,
                                       int32_t* cta_splits, int32_t* gs_splits);

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

/* ------------------------------------------------------------------ launches of other kernels (ABI 5) */

/* One launch of a kernel the caller compiled and loaded (a CUfunction: Triton's compiled kernels
 * are what moe_fp4 passes), for moe_fp4_launch_kernels. The caller owns the parameter storage
 * (`params`: one pointer per kernel parameter, as cuLaunchKernelEx's kernelParams) and keeps it,
 * the arrays and the function alive while the description is used. */
typedef struct moe_fp4_kernel_launch {
  void* function;            /* CUfunction, loaded in the primary context of `device` */
  uint32_t grid_x, grid_y, grid_z;
  uint32_t block_x;          /* threads per block (blockDim.y = blockDim.z = 1) */
  uint32_t shared_bytes;     /* dynamic shared memory */
  int32_t pdl;               /* non-zero: programmatic stream serialization (dependent launch) */
  int32_t num_params;
  void** params;
  int32_t num_free;          /* parameters written from the call's free_values before the launch */
  const int32_t* free_param; /* [num_free] which parameter, in [0, num_params) */
  const int32_t* free_bytes; /* [num_free] its size: 1, 2, 4 or 8 bytes */
} moe_fp4_kernel_launch;

/* Launches count kernels in order on `stream` (one cuLaunchKernelEx each, none for an empty
 * grid): a Triton forward's prepared launches for the cost of one call. launches[i] points to the
 * i-th description; free_values holds, launch after launch, the values of each launch's free
 * parameters (num_free in all, the sum of the launches' num_free), each written into its
 * parameter's storage as its low free_bytes bytes (little-endian) before that launch. `device`
 * must be the calling thread's current CUDA device (it stays current). Writes the descriptions'
 * storage, so one description is not used by two calls at once. Every description is checked
 * before the first launch; a failed launch stops the rest (the earlier ones are queued). */
MOE_FP4_API int moe_fp4_launch_kernels(const moe_fp4_kernel_launch* const* launches, int32_t count,
                                       const uint64_t* free_values, int32_t num_free, int device,
                                       moe_fp4_stream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_FP4_H_ */
