// NVFP4 grouped GEMM for Hopper (sm_90a: H100, H200), built only for the 90a entry of
// MOE_FP4_CUDA_ARCHS. Hopper has no FP4 tensor cores: the weights (NVFP4, prepared by
// moe_fp4_sm90_prepare_weights, layout in include/moe_fp4/sm90_layout.cuh) are dequantized in
// registers to exact 16-bit values (times 2^-8) and fed as the register operand A of
//   wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}   (RS form)
// with the 16-bit activation tile as operand B from shared memory (128-byte swizzle, brought
// by TMA), fp32 accumulation, and out = alpha[e*S+h] * 2^8 * acc rounded to the 16-bit dtype.
//
// Swap-AB: weights are wgmma's M, tokens its N (the token tile BN). One CTA = WG x KS consumer
// warpgroups (64 * WG * RB weight rows: a warpgroup computes RB 64-row groups; KS K-slices,
// split K inside the CTA for the small token tiles when the grid is short of CTAs) + 1
// producer warp. For a long K and a short grid (decode of Llama-4-Scout, DeepSeek-V3) a tile's
// K is also split across the C = 2 to 8 CTAs of a thread-block cluster (grid z), whose fp32
// sums rank 0 adds in rank order through distributed shared memory: no workspace, and the
// result is deterministic for a given configuration.
// Per 64-wide K chunk (and slice) the producer fills one stage of a STAGES-deep shared-memory
// ring (mbarriers full / empty, one transaction count per stage): the activation tile [BN x 64]
// by a 2-D TMA load (128-byte swizzle) and the weights of each 64-row group by one bulk copy
// of codes and one of scales (the prepared layout interleaves a group's row blocks by chunk, so
// they are contiguous; a per-row-block copy per warp was 4x the copy operations and measurably
// slower). Each consumer lane reads its fragment of each of its RB row blocks (one 16-byte and
// one broadcast 8-byte shared load), dequantizes chunk c+1 while the wgmmas of chunk c run (two
// register buffers; wgmma.wait_group 1 frees the older one and its stage), then the slices'
// sums are added in slice order and the tile goes through shared memory for 16-byte stores.
// The small tiles' loop is unrolled over a turn of the ring and tests nothing per chunk but in
// the last turn: bf16 BN = 8 (RB = 2) issues 165 SASS instructions per chunk and warp there,
// 144 of them dequantization, for 2048 weights (139 for 1024 weights, 72 of them
// dequantization, with RB = 1 and the per-chunk tests before).
//
// Static grid, no host synchronization: blockIdx.x is a token tile in [0, min(ceil(a_rows/BN) +
// min(E, a_rows), a_rows)) (a bound on sum_e ceil(m_e/BN)), blockIdx.y a 64*WG*RB-row weight tile. Each
// CTA scans expert_offsets (block-wide prefix sum of ceil(m_e/BN)) to find its expert and tile;
// CTAs past the last tile exit at once, empty experts own no tile. The token tiles of 8, 16,
// 32 (one K-slice, no cluster; 32 with 4 stages), 48, 64, 80, 96, 112 (192 weight rows per CTA,
// with a producer warpgroup that hands its registers to the consumers) and 128 run persistent
// CTAs instead: CTAs-per-SM (as many as fit, by the occupancy API) x SMs of them, each keeping the prefix sums
// and the clamped offsets in shared memory and taking tiles blockIdx.x, + gridDim.x, ... of (token
// tile, weight tile) (a small tile takes whole turns of the ring, which its unrolled loop
// needs); the producer runs its ring on into the next tile while the consumers
// store the last one (the epilogue tile has its own shared memory there). Past finding the
// tiles, the only global loads besides the copies are each consumer's alpha values, issued
// before the tile's main loop. Rows past expert_offsets[E] (and offsets outside [0, a_rows])
// are never written.
//
// With silu_out (moe_fp4_sm90_gemm_silu, w13 prepared with sections = 2: gate and up rows
// interleaved by 8), the epilogue writes silu(gate) * up of each column instead (the epilogue
// tile holds both values of a column 8 rows apart), quantized and dequantized per 16 values with
// the expert's global scale for W4A4 (store_silu_tile): the SiLU-and-mul stage's values, bit for
// bit, one launch fewer. Built into the 8-token tile's kernels only (dispatch).
//
// Programmatic dependent launch (launch.cuh): a CTA finds its tile and its producer requests the
// first ring of weights while the previous kernel (the quantization) still runs; the activation
// loads and every store wait for it. At decode the GEMMs mostly wait for their weights (Nsight
// Compute's stall sampling at Qwen3 M = 1: the first chunk's wait is 22 % of the first GEMM's samples
// and 34 % of the second's, the dequantization ~12 % and ~7 %), yet asking the L2 for bytes earlier
// measured slower each way it was placed (tests/results/h100-2026-12-07-s40, whole forward): a CTA's
// own later chunks after its first ring turn (Qwen3 M = 1 +2.5 %, Llama-4-Scout M = 1 +9-12 %), or the
// second GEMM's weights by the fused first GEMM after its own loads (+4 % to +14 % at M = 1 to 16).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "moe_fp4/block_scan.cuh"
#include "moe_fp4/common.hpp"
#include "moe_fp4/gemm.hpp"
#include "moe_fp4/launch.cuh"
#include "moe_fp4/nvfp4.cuh"
#include "moe_fp4/sm90_layout.cuh"
#include "moe_fp4/sm90_wgmma.cuh"

namespace moe_fp4 {
namespace sm90 {
namespace {

struct Params {
  const uint8_t* w;
  const uint8_t* ws;
  const float* alpha;
  const int32_t* offsets;
  void* out;
  int64_t a_rows;
  int32_t num_experts;
  int32_t sections;
  int32_t n;
  int32_t k;
  // GS (split K through global memory): K splits per tile (1 in a GS kernel: no split, no
  // workspace), the tiles' arrival counters (zero between launches) and their fp32 partial sums
  // [tile][split][quad][consumer thread].
  int32_t gsplits;
  // 1: only the tiles of the grid's last round (the tail) split, each in min(gsplits, CTAs / tail
  // tiles) K ranges, the tiles of the full rounds before it whole (the kernel counts the rounds from
  // its tile table); the counters and partial sums are then the tail's, at most one per CTA.
  int32_t gs_tail;
  int32_t* counters;
  float4* partials;
  // SiLU-and-mul in the epilogue (moe_fp4_sm90_gemm_silu; w13, sections = 2): the output
  // [a_rows, n/2] in place of out, and the global scales it is quantized with (null: W4A16).
  void* silu_out;
  const float* silu_gs;
};

// ---------------------------------------------------------------- PTX helpers

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

// On a barrier's shared address: the consumers keep their barriers' base address in a register,
// so that a stage is an immediate offset.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar))
      : "memory");
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// One lane of the (converged) warp: true in exactly one of them.
__device__ __forceinline__ bool elect_one() {
  uint32_t pred;
  asm volatile(
      "{\n.reg .pred p;\nelect.sync _|p, 0xFFFFFFFF;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(pred));
  return pred != 0;
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void consumer_sync(int threads) {
  asm volatile("bar.sync 1, %0;\n" ::"r"(threads) : "memory");
}

// Thread block clusters (split K across CTAs): the CTA's rank in its cluster and the cluster's
// size (1 and 0 for a launch without a cluster: every grid is a grid of 1-CTA clusters), the
// cluster-wide barrier (every thread of every CTA of the cluster arrives; release / acquire
// order the shared-memory partial sums), and a 16-byte load from another CTA's shared memory.
__device__ __forceinline__ uint32_t cluster_size() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(v));
  return v;
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(v));
  return v;
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory"); }
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t local_addr, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local_addr), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

// wgmma descriptor of a K-major, 128-byte-swizzled tile (rows of 128 bytes, 8-row groups
// 1024 bytes apart, LBO unused), starting `addr` (the tile base is 1024-byte aligned; the k16
// step j starts 32*j bytes into the swizzle row): the low word holds the start address >> 4
// and LBO = 1, the high word is the same for every tile (SBO = 1024 >> 4, 128-byte swizzle).
constexpr uint32_t kDescHi = (1024u >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t sw128_desc_lo(uint32_t addr) { return ((addr & 0x3FFFFu) >> 4) | (1u << 16); }
__device__ __forceinline__ uint64_t sw128_desc(uint32_t lo) { return (uint64_t(kDescHi) << 32) | lo; }

__device__ __forceinline__ int64_t clamp_row(int64_t v, int64_t rows) { return v < 0 ? 0 : (v > rows ? rows : v); }

// Block-wide: thread tid's experts [lo, hi) (E split into blockDim.x contiguous spans), their
// token tiles (`local`) and the token tiles of the experts before them (`before`); s_scan[w]
// ends up holding warp w's tiles. Ends with a __syncthreads. off0, off1: offsets[lo] and
// offsets[lo + 1] clamped to [0, a_rows] (if lo < hi), kept so that a thread with one expert
// (E <= blockDim.x, the common case) does not read them from global memory again.
struct ExpertSpan {
  int lo, hi, local, before;
  int64_t off0, off1;
};

__device__ __forceinline__ int tiles_between(int64_t a, int64_t b, int bn) { return b > a ? int((b - a + bn - 1) / bn) : 0; }

template <int BN>
__device__ __forceinline__ ExpertSpan scan_expert_tiles(const Params& p, int* s_scan) {
  const int tid = threadIdx.x, nt = blockDim.x;
  const int E = p.num_experts;
  const int per = (E + nt - 1) / nt;
  ExpertSpan sp;
  sp.lo = min(tid * per, E), sp.hi = min(sp.lo + per, E);
  sp.local = 0;
  sp.off0 = sp.lo < sp.hi ? clamp_row(__ldcg(&p.offsets[sp.lo]), p.a_rows) : 0;
  sp.off1 = 0;
  int64_t prev = sp.off0;
  for (int e = sp.lo; e < sp.hi; ++e) {
    const int64_t next = clamp_row(__ldcg(&p.offsets[e + 1]), p.a_rows);
    if (e == sp.lo) sp.off1 = next;
    sp.local += tiles_between(prev, next, BN);
    prev = next > prev ? next : prev;
  }
  sp.before = block_exclusive_sum(sp.local, s_scan);
  return sp;
}

// Block-wide: the expert and the tile within it of token tile `t` (s_tile[0] = -1 if none), and
// the expert's offsets[e] and offsets[e + 1] clamped to [0, a_rows] (s_tile[2], s_tile[3]; 32
// bits suffice: clamping an int32 offset v gives a value in [0, max(v, 0)]), so that next_tile
// reads no global memory. The first expert of a thread's span takes the offsets its scan loaded (no
// second read with one expert per thread); the others read them again. `pr` is the running
// maximum of the clamped offsets (what the tiles are counted from, as in scan_expert_tiles);
// `cur` the clamped offsets[e] itself (what next_tile computes the rows from).
template <int BN>
__device__ __forceinline__ void find_tile(const Params& p, int t, int* s_tile, int* s_scan) {
  if (threadIdx.x == 0) s_tile[0] = -1;
  const ExpertSpan sp = scan_expert_tiles<BN>(p, s_scan);
  if (t >= sp.before && t < sp.before + sp.local) {
    int excl = sp.before;
    int64_t pr = sp.off0, cur = sp.off0;
    for (int e = sp.lo; e < sp.hi; ++e) {
      const int64_t next = e == sp.lo ? sp.off1 : clamp_row(__ldcg(&p.offsets[e + 1]), p.a_rows);
      const int tiles = tiles_between(pr, next, BN);
      if (t < excl + tiles) {
        s_tile[0] = e;
        s_tile[1] = t - excl;
        s_tile[2] = int(cur);
        s_tile[3] = int(next);
        break;
      }
      excl += tiles;
      pr = next > pr ? next : pr;
      cur = next;
    }
  }
  __syncthreads();
}

// Shared memory: [STAGES activation stages][STAGES weight stages][barriers]; the epilogue tile
// and the split-K partial sums reuse the front. A stage holds one 64-wide K chunk for each of
// the KS K-slices: KS activation tiles [BN x 64] and KS weight slices (the codes of the CTA's
// kBlocks row blocks, 512 bytes each, then their scales, 64 bytes each).
template <int BN, int WG, int KS, int RB, int STAGES, bool P = false>
struct Smem {
  static constexpr int kRows = 64 * WG * RB;
  static constexpr int kBlocks = 4 * WG * RB;  // row blocks (16 weight rows each)
  static constexpr int kTileBytes = BN * 128;  // BN token rows x 64 16-bit values (1024-byte multiple)
  static constexpr int kStageBytes = KS * kTileBytes;
  static constexpr int kSliceBytes = kBlocks * (kChunkCodeBytes + kChunkScaleBytes);  // one K-slice's weights
  static constexpr int kWeightBytes = KS * kSliceBytes;
  static constexpr int kWeights = STAGES * kStageBytes;  // offset of the weight stages
  static constexpr int kPitch = kRows + 8;  // epilogue tile row (elements), padded against bank conflicts
  static constexpr int kPipeline = kWeights + STAGES * kWeightBytes;
  static constexpr int kEpilogue = BN * kPitch * 2;
  // Persistent CTAs (P) keep the ring running under the epilogue: the tile has its own region.
  static constexpr int kEpilogueAt = P ? (kPipeline + 15) / 16 * 16 : 0;
  static constexpr int kPartials = (kEpilogueAt + kEpilogue + 15) / 16 * 16;  // offset of the K-slices' partial sums
  static constexpr int kPartialBytes = (KS - 1) * WG * 128 * RB * (BN / 2) * 4;
  static constexpr int kFront = kPartials + kPartialBytes;
  static constexpr int kBarriers = ((kPipeline > kFront ? kPipeline : kFront) + 7) / 8 * 8;
  // P: the table, E + 1 tile prefix sums then the E + 1 clamped offsets (launch adds them).
  static constexpr int kTable = kBarriers + 2 * STAGES * 8;
  static constexpr int kBytes = kTable + 1024;  // + alignment slack
  static constexpr int kClusterPartialBytes = WG * 128 * RB * (BN / 2) * 4;  // a cluster rank's sums
  static_assert(P || kClusterPartialBytes <= kBarriers, "the cluster partial sums fit in front of the barriers");
  static_assert(kTileBytes % 1024 == 0, "128-byte swizzle atoms need 1024-byte aligned tiles");
  static_assert((STAGES & (STAGES - 1)) == 0, "a power-of-two ring: stage and phase by mask and shift");
};

// Block-wide, persistent CTAs: prefix[e] = the token tiles of experts 0 .. e-1 (e <= E), and
// offs[e] = offsets[e] clamped to [0, a_rows] (e <= E; 32 bits suffice, as in find_tile), which
// next_tile takes from shared memory instead of two dependent global loads per tile. As in
// find_tile, a thread's first expert reuses the offsets of its scan; `pr` is the running maximum
// that counts tiles, `cur` the clamped offset itself.
template <int BN>
__device__ __forceinline__ void tile_prefix(const Params& p, int* prefix, int* offs, int* s_scan) {
  const ExpertSpan sp = scan_expert_tiles<BN>(p, s_scan);
  int run = sp.before;
  int64_t pr = sp.off0, cur = sp.off0;
  for (int e = sp.lo; e < sp.hi; ++e) {
    prefix[e] = run;
    offs[e] = int(cur);
    const int64_t next = e == sp.lo ? sp.off1 : clamp_row(__ldcg(&p.offsets[e + 1]), p.a_rows);
    run += tiles_between(pr, next, BN);
    pr = next > pr ? next : pr;
    cur = next;
  }
  if (sp.lo < sp.hi && sp.hi == p.num_experts) offs[p.num_experts] = int(cur);  // the span with the last expert
  if (threadIdx.x == 0) {
    int total = 0;
    for (int w = 0; w < int(blockDim.x + 31) / 32; ++w) total += s_scan[w];
    prefix[p.num_experts] = total;
  }
  __syncthreads();
}

// The expert of token tile tt < prefix[E]: the largest e < E with prefix[e] <= tt (an empty
// expert shares its prefix with the next one, so the largest is the one with tiles).
__device__ __forceinline__ int expert_of_tile(const int* prefix, int num_experts, int tt) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (prefix[mid] <= tt) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Four 16-bit values at an 8-byte aligned address, as floats / rounded from floats.
template <typename T>
__device__ __forceinline__ void load4(const T* src, float (&v)[4]) {
  const uint2 word = *reinterpret_cast<const uint2*>(src);
  T e[4];
  static_assert(sizeof(e) == sizeof(word), "4 elements per 8 bytes");
  memcpy(e, &word, sizeof(word));
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = Element<T>::to_float(e[i]);
}

template <typename T>
__device__ __forceinline__ void store4(T* dst, const float (&v)[4]) {
  T e[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = Element<T>::from_float(v[i]);
  uint2 word;
  memcpy(&word, e, sizeof(word));
  *reinterpret_cast<uint2*>(dst) = word;
}

// The fused epilogue (moe_fp4_sm90_gemm_silu): from the GEMM's tile in shared memory (`pitch`
// elements per token, its values rounded to T as the GEMM writes them; sections = 2, so local rows
// 16j + i and 16j + 8 + i are the gate and up values of feature 8j + i), silu_mul of the tile's
// kRows / 2 features of each of its rows_valid tokens to silu_out rows row0 .., columns f0 ..: as
// computed (W4A16, silu_gs null), or (W4A4) each 16-feature block quantized with silu_gs[e] and
// written dequantized, as the values form of moe_fp4_silu_mul_quantize writes it. Every consumer
// thread takes 4 features of a token; the 4 threads of a block are consecutive lanes of one warp
// and combine their maxima by shuffles (abs_max, exact in any order), then each dequantizes its own
// 4 values (dequantize_on_grid): quantize_dequantize of the block, bit for bit, with a quarter of
// the serial work per thread.
template <typename T, int kRows, int BN>
__device__ __forceinline__ void store_silu_tile(const Params& p, const T* tile, int pitch, int e, int64_t row0,
                                                int rows_valid, int f0, int tid, int threads) {
  constexpr int kQuads = kRows / 8;  // 4-feature groups per token
  static_assert(kQuads % 4 == 0 && (BN * kQuads) % 32 == 0,
                "whole blocks per token and whole warps per pass (the shuffles take every lane)");
  const int inter = p.n / 2;  // (n % 32 == 0: a block of 16 features is all in or all out)
  T* const out = static_cast<T*>(p.silu_out);
  const bool quantize = p.silu_gs != nullptr;
  const float gs = quantize ? p.silu_gs[e] : 0.0f;
  for (int idx = tid; idx < BN * kQuads; idx += threads) {
    const int token = idx / kQuads, quad = idx % kQuads;  // features 4 quad .. 4 quad + 3
    const T* gate = tile + token * pitch + 16 * (quad >> 1) + 4 * (quad & 1);
    float g[4], u[4], v[4];
    load4(gate, g);
    load4(gate + 8, u);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = silu_mul<T>(g[i], u[i]);
    if (quantize) {
      float amax = abs_max(v);
      amax = nan_max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
      amax = nan_max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
      float sf_value, inv;
      scale_of_amax(amax, gs, sf_value, inv);
      dequantize_on_grid(v, sf_value, inv);
    }
    const int col = f0 + 4 * quad;
    if (token < rows_valid && col < inter) store4(out + (row0 + token) * int64_t(inter) + col, v);
  }
}

// The producer: one warp, or, for CTAs of 3 consumer warpgroups (192 weight rows, one CTA per
// SM), a warpgroup of which one warp works, so that it can hand its registers to the consumers
// with setmaxnreg (a warpgroup-wide instruction). Every warp of a CTA starts with the same
// registers, and an SM sub-partition has 16384: with one producer warp, 4 consumer warpgroups
// (17 warps, 5 on one sub-partition) get 96 per thread, where ptxas spilled the 80- to
// 128-token accumulators (session 17's first builds), and 3 (13 warps) would get 128 (not
// built). With a producer warpgroup, 3 consumer warpgroups start at 16384 / (4 * 32) = 128 and
// take what the producer gives back above kProducerRegs: (16 * 128 - 4 * 80) / 12 = 144 per
// thread.
constexpr bool producer_warpgroup(int wg, int ks) { return wg * ks == 3; }
constexpr int cta_threads(int wg, int ks) { return wg * ks * 128 + (producer_warpgroup(wg, ks) ? 128 : 32); }
constexpr int kProducerRegs = 80;  // ptxas (CUDA 13.0) spilled the producer's code at 40 and 56
constexpr int kLaunchRegs = 16384 / 128;  // per thread at launch, 4 warps per sub-partition
constexpr int kConsumerRegs = (16 * kLaunchRegs - 4 * kProducerRegs) / 12 / 8 * 8;  // a multiple of 8
static_assert(kConsumerRegs == 144, "3 consumer warpgroups: 144 registers per thread");

// The token tile whose kernels hold the fused SiLU-and-mul epilogue (store_silu_tile, chosen per call
// by silu_out); the others' kernels hold none (dispatch has the measurements).
constexpr int kSiluTileTokens = 8;

// One CTA: WG x KS consumer warpgroups and one producer warp. Consumer warpgroup w computes
// weight rows 64 RB * (w % WG) .. + 64 RB of the CTA over K-slice w / WG: the K chunks are split
// into KS contiguous slices of q = ceil(chunks / KS) (split-K inside the CTA, for the small token
// tiles, where a token tile per CTA leaves too few warps to hide the dequantization's latency).
// With RB = 2 each warpgroup issues two wgmmas per k16 step (its two 64-row groups, separate
// accumulators), so that the per-chunk work that is not dequantization (barrier wait, fences,
// wait_group, arrive, loop) is shared by 32 instead of 16 weight rows per warp.
// The slices' fp32 sums are added in slice order (deterministic) before the epilogue.
// CL: launched as clusters that split K (the cluster code only in these instantiations).
template <typename T, int BN, int WG, int KS, int RB, int STAGES, int MINB, bool CL, bool P, bool GS = false>
__global__ void __launch_bounds__(cta_threads(WG, KS), MINB) gemm_kernel(const __grid_constant__ CUtensorMap tmap,
                                                                       const Params p) {
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  using S = Smem<BN, WG, KS, RB, STAGES, P>;
  static_assert(!P || (KS == 1 && !CL), "persistent: the one-slice tiles without clusters");
  static_assert(!GS || (P && WG == 1 && BN <= 32), "split K through global memory: persistent small-tile CTAs");
  constexpr int kConsumers = WG * KS * 128;
  constexpr int kLog2Stages = STAGES == 2 ? 1 : STAGES == 4 ? 2 : STAGES == 8 ? 3 : 4;
  static_assert(STAGES >= 2 && STAGES <= 16, "2 to 16 stages");
  static_assert(RB == 1 || RB == 2, "one or two 64-row groups per warpgroup");

  extern __shared__ uint8_t smem_raw[];
  // 1024-byte aligned by pointer arithmetic on the __shared__ array (so that the compiler keeps
  // the shared address space and emits LDS/STS, not generic loads).
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::kBarriers);
  uint64_t* empty = full + STAGES;
  __shared__ int s_tile[4];  // one-tile CTAs: expert, tile, clamped offsets[e] and offsets[e + 1]
  __shared__ int s_scan[32];

  // The CTA's tiles: one (blockIdx.x a token tile, blockIdx.y a weight tile), or, persistent (P),
  // tiles i = blockIdx.x + j * gridDim.x of (token tiles) x (weight tiles), weight tile fastest,
  // found in the CTA's table of tile prefix sums (followed by the clamped offsets).
  int* const prefix = reinterpret_cast<int*>(smem + S::kTable);
  int* const offs = prefix + (p.num_experts + 1);
  const int ntiles_n = (p.n + S::kRows - 1) / S::kRows;
  int num_tiles = 1;
  int t_whole = 0, t_parts = 1;  // gs_tail: the whole tiles before the tail, and the tail's K ranges
  if constexpr (P) {
    tile_prefix<BN>(p, prefix, offs, s_scan);
    num_tiles = prefix[p.num_experts] * ntiles_n * (GS ? p.gsplits : 1);
    if (GS && p.gs_tail) {  // units: the whole tiles of the full rounds, then each tail tile's t_parts splits
      const int tiles = prefix[p.num_experts] * ntiles_n, C = int(gridDim.x);
      const int rounds = max(1, (tiles + C - 1) / C);
      t_whole = C * (rounds - 1);
      const int tail = tiles - t_whole;
      t_parts = tail > 0 ? min(p.gsplits, max(1, C / tail)) : 1;
      num_tiles = t_whole + tail * t_parts;
    }
  } else {
    find_tile<BN>(p, int(blockIdx.x), s_tile, s_scan);
    if (s_tile[0] < 0) return;
  }
  const int nchunks = (p.k + kChunk - 1) / kChunk;
  // Split K across the CTAs of a cluster (launched as clusters of C CTAs along grid z, one
  // cluster per tile; C = 1 without): rank z takes the chunks cbase .. cbase + cn - 1, and within
  // the CTA they split into the KS slices. Chunk indices below are local to the CTA (lc) unless
  // named global (cc = cbase + lc). GS: split z of a tile's p.gsplits takes them the same way
  // (set per unit by next_tile).
  const int csize = CL ? int(cluster_size()) : GS ? p.gsplits : 1, crank = CL ? int(cluster_rank()) : 0;
  const int cq = (nchunks + csize - 1) / csize;
  int cbase = 0, cn = 0, q = 0, q_ring = 0;  // q: chunks per K-slice (the last may have fewer, or none)
  // The consumers' loop of the small token tiles is unrolled over a whole turn of the ring
  // (kUnroll = STAGES, see the consumers), which needs every tile to start a turn: a persistent
  // CTA's tile then takes q_ring = q rounded up to whole turns of ring stages, the stages past q
  // carrying no data (the producer completes their phase with a plain arrive, the consumers wait
  // for it and free them, as for a short K-slice).
  constexpr int kUnroll = BN <= 32 ? STAGES : 2;
  auto set_range = [&](int rank, int cqr) {  // rank: the cluster rank, or GS's split of the unit
    cbase = min(rank * cqr, nchunks);
    cn = min(cqr, nchunks - cbase);
    q = (cn + KS - 1) / KS;
    q_ring = P && kUnroll == STAGES ? (q + STAGES - 1) / STAGES * STAGES : q;
  };
  set_range(crank, cq);
  // The tile's expert, token rows and weight rows (set by next_tile, from shared memory only:
  // start and end are offsets[e] and offsets[e + 1] clamped to [0, a_rows]).
  int e = 0, rows_valid = 0, n0 = 0;
  int64_t row0 = 0;
  int split = 0;  // GS: the unit's K split
  int u_parts = GS ? p.gsplits : 1, u_slot = 0;  // GS: the unit's tile's K splits and its counter / partial-sum slot
  auto next_tile = [&](int j) {  // false past the CTA's last tile
    int tile;
    int64_t start, end;
    if constexpr (P) {
      int i = int(blockIdx.x) + j * int(gridDim.x);
      if (i >= num_tiles) return false;
      if constexpr (GS) {
        if (p.gs_tail) {
          if (i < t_whole) {
            split = 0, u_parts = 1;
          } else {
            const int r = i - t_whole;
            split = r % t_parts, u_parts = t_parts;
            u_slot = r / t_parts;
            i = t_whole + u_slot;
          }
          set_range(split, (nchunks + u_parts - 1) / u_parts);
        } else {
          split = i % p.gsplits;
          i /= p.gsplits;
          u_slot = i;
          set_range(split, cq);
        }
      }
      const int tt = i / ntiles_n;
      e = expert_of_tile(prefix, p.num_experts, tt);
      tile = tt - prefix[e];
      n0 = (i % ntiles_n) * S::kRows;
      start = offs[e];
      end = offs[e + 1];
    } else {
      if (j > 0) return false;
      e = s_tile[0];
      tile = s_tile[1];
      n0 = int(blockIdx.y) * S::kRows;
      start = s_tile[2];
      end = s_tile[3];
    }
    row0 = start + int64_t(tile) * BN;
    rows_valid = int((end - row0) < BN ? (end - row0) : BN);
    return true;
  };
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumers);  // every consumer thread releases
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int nrb = p.n / kRowBlock;
  int rb0 = 0, valid_blocks = 0;  // the tile's first row block, and its row blocks below n (>= 1)
  const int full_chunks = p.k / kChunk;
  const int tail_steps = (p.k / 16) % kStepsPerChunk;
  auto code_bytes_of = [&](int cc) { return cc >= full_chunks ? 128u * tail_steps : uint32_t(kChunkCodeBytes); };
  auto scale_bytes_of = [&](int cc) { return cc >= full_chunks ? 16u * tail_steps : uint32_t(kChunkScaleBytes); };

  if (warp >= kConsumers / 32) {  // producer warp
    if constexpr (producer_warpgroup(WG, KS)) {  // its warpgroup's registers go to the consumers
      static_assert(MINB == 1, "the register budget above is for one CTA per SM");
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
      if (warp != kConsumers / 32) return;
    }
    // The producer's work per chunk is on the critical path: Nsight Compute of the 128-token
    // persistent CTAs (tests/results/h200-2026-12-03-s15/call1) found it never waiting for a free
    // stage while the consumers found 71% of their stages not yet full, with ~150 instructions
    // per chunk (per-lane jobs whose copy operands the compiler had to serialize lane by lane).
    // So each 64-row group's code and scale addresses are set once per tile and advance by a
    // constant per full chunk (the prepared layout's offsets, sm90_layout.cuh: groups are
    // code_block_offset(0, kGroupBlocks) bytes apart, and full chunk cc of a group of gb blocks
    // is cc * gb chunk-blocks in, as in code_chunk_offset), and one elected lane issues the
    // stage's copies: the activation tile and, per group, one copy of codes and one of scales.
    constexpr int kGroups = S::kBlocks / kGroupBlocks;  // 64-row groups of the CTA
    const int64_t group_codes = code_block_offset(0, kGroupBlocks, p.n, p.k);  // bytes between groups
    const int64_t group_scales = scale_block_offset(0, kGroupBlocks, p.n, p.k);
    const uint8_t* tile_codes = p.w;
    const uint8_t* tile_scales = p.ws;
    uint32_t weight_bytes = 0;  // all groups' bytes of a full chunk
    auto set_tile = [&]() {
      rb0 = n0 / kRowBlock;
      valid_blocks = max(0, min(S::kBlocks, nrb - rb0));
      tile_codes = p.w + code_block_offset(e, rb0, p.n, p.k);
      tile_scales = p.ws + scale_block_offset(e, rb0, p.n, p.k);
      weight_bytes = uint32_t(valid_blocks) * (kChunkCodeBytes + kChunkScaleBytes);
    };
    // c: the tile's chunk, s: its stage (chunk g0 + c of the CTA's ring).
    auto expect = [&](int c, int s) {
      uint32_t bytes = 0;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const int lc = ks * q + c, cc = cbase + lc;
        if (lc < cn)
          bytes += S::kTileBytes +
                   (cc < full_chunks ? weight_bytes : valid_blocks * (code_bytes_of(cc) + scale_bytes_of(cc)));
      }
      if (elect_one()) mbar_expect_tx(&full[s], bytes);
    };
    auto load_activations = [&](int c, int s) {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const int lc = ks * q + c, cc = cbase + lc;
        if (lc < cn && elect_one())
          tma_load_2d(smem + s * S::kStageBytes + ks * S::kTileBytes, &tmap, &full[s], cc * kChunk, int(row0));
      }
    };
    // A full chunk: one code and one scale copy per 64-row group (its row blocks are interleaved
    // by chunk in the prepared layout, so chunk cc of the group is at cc times its chunk bytes).
    // The tail chunk (k % 64 != 0): one copy per row block, lanes j = lane, lane + 32, ... as
    // before. Only the row blocks below n are brought.
    auto load_weights = [&](int c, int s) {
      uint8_t* wst = smem + S::kWeights + s * S::kWeightBytes;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const int lc = ks * q + c, cc = cbase + lc;
        if (lc >= cn) continue;
        uint8_t* slice = wst + ks * S::kSliceBytes;
        if (cc < full_chunks) {
          if (elect_one()) {
#pragma unroll
            for (int g = 0; g < kGroups; ++g) {
              const int blocks = min(kGroupBlocks, valid_blocks - g * kGroupBlocks);
              if (blocks <= 0) break;
              const uint32_t codes = uint32_t(blocks) * kChunkCodeBytes, scales = uint32_t(blocks) * kChunkScaleBytes;
              bulk_load(slice + g * kGroupBlocks * kChunkCodeBytes, tile_codes + g * group_codes + int64_t(cc) * codes,
                        codes, &full[s]);
              bulk_load(slice + S::kBlocks * kChunkCodeBytes + g * kGroupBlocks * kChunkScaleBytes,
                        tile_scales + g * group_scales + int64_t(cc) * scales, scales, &full[s]);
            }
          }
          continue;
        }
        for (int j = lane; j < 2 * S::kBlocks; j += 32) {
          const bool codes = j < S::kBlocks;
          const int w = codes ? j : j - S::kBlocks;  // row block
          if (w >= valid_blocks) continue;
          if (codes)
            bulk_load(slice + w * kChunkCodeBytes, p.w + code_chunk_offset(e, rb0 + w, cc, p.n, p.k), code_bytes_of(cc),
                      &full[s]);
          else
            bulk_load(slice + S::kBlocks * kChunkCodeBytes + w * kChunkScaleBytes,
                      p.ws + scale_chunk_offset(e, rb0 + w, cc, p.n, p.k), scale_bytes_of(cc), &full[s]);
        }
      }
    };
    // The first ring's weights do not depend on the previous kernel (only on the routing, which
    // has completed: launch.cuh): they are requested before waiting for it, the activations after.
    // A persistent CTA's later tiles continue the ring (chunk g0 + c, its stage and its turn).
    int g0 = 0;
    for (int j = 0; next_tile(j); ++j, g0 += q_ring) {
      set_tile();
      int c = 0;
      if (j == 0) {
        const int first = q < STAGES ? q : STAGES;
        for (c = 0; c < first; ++c) {
          expect(c, c);
          load_weights(c, c);
        }
        wait_for_predecessor();
        allow_dependents();
        for (c = 0; c < first; ++c) load_activations(c, c);
      }
      for (; c < q; ++c) {
        const int gc = g0 + c, st = gc & (STAGES - 1);
        if (gc >= STAGES) mbar_wait(smem_u32(&empty[st]), uint32_t((gc >> kLog2Stages) - 1) & 1u);
        expect(c, st);
        load_activations(c, st);
        load_weights(c, st);
      }
      for (; c < q_ring; ++c) {  // stages without data (persistent small tiles)
        const int gc = g0 + c, st = gc & (STAGES - 1);
        if (gc >= STAGES) mbar_wait(smem_u32(&empty[st]), uint32_t((gc >> kLog2Stages) - 1) & 1u);
        if (elect_one()) mbar_arrive(smem_u32(&full[st]));
      }
    }
    if (CL && csize > 1) {  // the producer warp takes part in the epilogue's two cluster barriers
      cluster_arrive();
      cluster_wait();
      cluster_arrive();
      cluster_wait();
    }
    return;
  }

  // ---------------------------------------------------------------- consumers
  if constexpr (producer_warpgroup(WG, KS)) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  wait_for_predecessor();  // before `out` is written (the previous kernel may still read it)
  allow_dependents();
  const int wg = warp >> 2, wl = warp & 3;
  const int wr = wg % WG, ks = KS == 1 ? 0 : wg / WG;  // row warpgroup and K-slice of this warpgroup
  const int g = lane >> 2, t4 = lane & 3;
  int my_n = 0, my_full = 0;  // this slice's chunks, global lo .. lo + my_n - 1, of which the first my_full are full
  // Local chunks 0 .. my_full - 1 are full; a slice that has the tail chunk has it last.
  auto set_slice = [&] {
    const int lo_local = min(ks * q, cn);
    my_n = min(lo_local + q, cn) - lo_local;
    my_full = max(0, min(my_n, full_chunks - (cbase + lo_local)));
  };
  set_slice();

  float acc[RB][BN / 2];

  // Row block r of this warp is the CTA's block (wr * RB + r) * 4 + wl: wgmma r of the warpgroup
  // computes the CTA's rows 64 * (wr * RB + r) .. + 64, one 64-row group of the prepared layout.
  // A row block past n (n % kRows != 0) is not brought by the producer: its warp reads stage
  // bytes that nobody wrote and computes garbage rows. The rows of a wgmma are independent and
  // the epilogue neither reads alpha for nor stores a row past n, so this needs no test.
  uint32_t A[2][RB][16];
  // This lane's words of a chunk: per row block 4 code words and 2 scale words (prepared layout).
  uint32_t w4[RB][4], s2[RB][2];
  constexpr int kNextCodes = kGroupBlocks * kChunkCodeBytes;  // row block r + 1: the next group
  constexpr int kNextScales = kGroupBlocks * kChunkScaleBytes;
  const int blk0 = wr * RB * kGroupBlocks + wl;
  const uint8_t* my_codes = smem + S::kWeights + ks * S::kSliceBytes + blk0 * kChunkCodeBytes;
  const uint8_t* my_scales =
      smem + S::kWeights + ks * S::kSliceBytes + S::kBlocks * kChunkCodeBytes + blk0 * kChunkScaleBytes;
  // Shared addresses of this lane's full-chunk words in stage 0 (a stage adds kWeightBytes) and
  // of the full barriers (a stage adds 8, the empty ones follow). Opaque to the compiler from
  // here on: kept in registers, not recomputed from the thread index at every chunk (which cost
  // ~20 instructions per chunk of 32 weights per lane); every stage is an immediate offset.
  uint32_t code_addr = smem_u32(my_codes + lane * 16), scale_addr = smem_u32(my_scales + g * 8);
  uint32_t full_addr = smem_u32(full);
  asm volatile("" : "+r"(code_addr), "+r"(scale_addr), "+r"(full_addr));
  const uint32_t empty_addr = full_addr + 8 * STAGES;
  // Low word of the wgmma descriptor of this slice's activation tile in stage 0. A stage or a
  // k16 step moves only its 14-bit start-address field (shared addresses < 2^18, so it never
  // carries out); the high word is a constant. Broadcast from lane 0 so that the compiler knows
  // it is warp-uniform (ks comes from the thread index): the descriptors live in uniform
  // registers, one 64-bit uniform add per wgmma (the 64-bit register add and two moves to
  // uniform registers per wgmma before; 20 more instructions per chunk without the broadcast
  // for KS = 2).
  const uint32_t desc_lo = __shfl_sync(0xFFFFFFFFu, sw128_desc_lo(smem_u32(smem) + ks * S::kTileBytes), 0);

  auto load_full = [&](int s) {
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(w4[r][0]), "=r"(w4[r][1]), "=r"(w4[r][2]), "=r"(w4[r][3])
                   : "r"(code_addr + uint32_t(s * S::kWeightBytes + r * kNextCodes)));
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                   : "=r"(s2[r][0]), "=r"(s2[r][1])
                   : "r"(scale_addr + uint32_t(s * S::kWeightBytes + r * kNextScales)));
    }
  };
  auto load_tail = [&](int s) {  // the tail chunk: 1..3 steps, one word and one scale pair per step
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const uint8_t* cw = my_codes + s * S::kWeightBytes + r * kNextCodes;
      const uint8_t* sw = my_scales + s * S::kWeightBytes + r * kNextScales;
      uint32_t x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool in = j < tail_steps;
        w4[r][j] = in ? *reinterpret_cast<const uint32_t*>(cw + j * 128 + lane * 4) : 0u;
        x[j] = in ? uint32_t(*reinterpret_cast<const uint16_t*>(sw + j * 16 + g * 2)) : 0u;
      }
      s2[r][0] = __byte_perm(x[0], x[1], 0x5140);  // [s(0,g) s(1,g) s(0,g+8) s(1,g+8)]
      s2[r][1] = __byte_perm(x[2], x[3], 0x5140);
    }
  };
  auto dequant = [&](uint32_t(&a)[RB][16]) {
#pragma unroll
    for (int r = 0; r < RB; ++r)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t sc =
            (j & 1) ? Decode<kBf16>::scale_odd(s2[r][j >> 1]) : Decode<kBf16>::scale_even(s2[r][j >> 1]);
        uint32_t v[4];
        dequant_step<kBf16>(w4[r][j], sc, v);
        a[r][4 * j + 0] = v[0], a[r][4 * j + 1] = v[1], a[r][4 * j + 2] = v[2], a[r][4 * j + 3] = v[3];
      }
  };
  // The 4 k16 steps of the chunk in stage s, in increasing K for each accumulator (RB wgmmas per
  // step, on the same activation descriptor). All 4 even in a tail chunk: there A is 0 past k
  // and TMA filled B with zeros.
  auto mma = [&](uint32_t(&a)[RB][16], int s) {
    wg_fence();
#pragma unroll
    for (int j = 0; j < kStepsPerChunk; ++j)
#pragma unroll
      for (int r = 0; r < RB; ++r)  // + 32 bytes per k16 step
        Wgmma<BN, kBf16>::run(acc[r], a[r][4 * j], a[r][4 * j + 1], a[r][4 * j + 2], a[r][4 * j + 3],
                              sw128_desc(desc_lo) + uint64_t(s * (S::kStageBytes >> 4) + 2 * j));
    wg_commit();
  };
  // Every consumer thread arrives on the stage's empty barrier (it counts consumer threads), so
  // each thread's reads of the stage are ordered before the producer's next copy into it by its
  // own release-arrive / acquire-wait pair. The earlier form, one arrive by lane 0 after a
  // __syncwarp, drew 8 racecheck hazards on wrapped rings (K > 512 per CTA) on the H200; this
  // form draws none, at the same GEMM times (tests/results/h200-2026-12-02/README.md).
  auto release = [&](int s) { mbar_arrive(empty_addr + 8 * s); };

  // Software pipeline: chunk c's wgmmas run while chunk c+1's words are read and dequantized; chunk c's
  // register buffer is c & 1. The small token tiles unroll the loop over a whole turn of the ring (kUnroll =
  // STAGES), so every stage index and shared address is a constant and the turn's phase bit is one
  // loop-carried value (the unrolled turn alone took BN = 8 from 193 to 131 SASS instructions per chunk,
  // 5-10% faster on the H200. Unrolled by 2 instead, on the H100, tests/results/h100-2026-12-06-s39 call
  // s39c, whole forwards: 6-13 % slower where the persistent kernels run (Llama-4-Scout M = 16 313.8 -> 347.8
  // µs); with the one-tile kernels alone unrolled by 2 (the M = 1 kernel's SASS 74 -> 55 KB) within 1.5 % but
  // Qwen3 M = 1 +5 %, M = 2 -3 %, one round). The wide tiles unroll by 2 (over the ring, BN = 64 ran 1.45x
  // slower). step: chunk c = c0 + u of the turn starting at c0 (a multiple of kUnroll, of parity `phase`):
  // its wgmmas, then, if `next`, chunk c+1's words (a full chunk, or the tail chunk if not `next_full`) and
  // their dequantization. Waiting for chunk c-1's wgmmas before the barrier wait and the loads of chunk c+1
  // keeps the dequantization from being scheduled above that wait, and ptxas then keeps two register buffers
  // (with the wait after the loads it gave the unrolled chunks more buffers: RB = 1 spilled, RB = 2 had its
  // wgmmas serialized).
  // A persistent CTA's tile starts at chunk g0 of its ring (the chunks of its earlier tiles).
  static_assert(STAGES % kUnroll == 0 && kUnroll % 2 == 0, "whole turns of the ring, even unroll");
  int g0 = 0;
  auto step = [&](int c0, int u, uint32_t phase, bool next, bool next_full) {
    const int c = c0 + u;
    const int s = kUnroll == STAGES ? u & (STAGES - 1) : (g0 + c) & (STAGES - 1), sn = (s + 1) & (STAGES - 1);
    mma(A[u & 1], s);
    wg_wait<1>();  // chunk c-1 done: its register buffer and its stage are free
    if (c > 0) release((s + STAGES - 1) & (STAGES - 1));
    if (next) {
      const uint32_t parity = kUnroll == STAGES ? phase ^ (uint32_t((u + 1) >> kLog2Stages) & 1u)
                                                : uint32_t((g0 + c + 1) >> kLog2Stages) & 1u;
      mbar_wait(full_addr + 8 * sn, parity);
      if (next_full)
        load_full(sn);
      else
        load_tail(sn);
      dequant(A[(u & 1) ^ 1]);
    }
  };
  for (int j = 0; next_tile(j); ++j, g0 += q_ring) {
    if constexpr (GS) set_slice();  // this unit's K range (next_tile set it)
    // The epilogue's alpha for this lane's rows rl0 and rl0 + 8 of each row group (rl0 below),
    // loaded as soon as the tile is known so that the loads' latency hides under the main loop
    // (in the epilogue it was exposed at every tile; the gain is not measured yet). Kept without
    // kAlphaFactor, which the epilogue applies: a multiply here would wait for the loads before
    // the loop. 0 for a row past n (0 * kAlphaFactor is the 0 the epilogue used there) and for
    // the warpgroups that store nothing (K-slices 1.., cluster ranks 1..).
    float al[RB][2];
#pragma unroll
    for (int r = 0; r < RB; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = n0 + (wr * RB + r) * 64 + wl * 16 + g + 8 * h;
        al[r][h] = 0.0f;
        // sections = 2: rows g of a 16-row block are gate rows, rows g + 8 up rows (sm90_prepare.cu)
        if (ks == 0 && crank == 0 && row < p.n) al[r][h] = p.alpha[int64_t(e) * p.sections + (p.sections == 2 ? h : 0)];
      }
#pragma unroll
    for (int r = 0; r < RB; ++r)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[r][i] = 0.0f;
    if (my_n > 0) {
      const int s0 = g0 & (STAGES - 1);
      mbar_wait(full_addr + 8 * s0, uint32_t(g0 >> kLog2Stages) & 1u);
      if (my_full > 0)
        load_full(s0);
      else
        load_tail(s0);
      dequant(A[0]);
    }
    // Whole turns of full chunks: the only test is whether the turn's last chunk is followed by a
    // chunk (and which). The rest of the slice, at most kUnroll - 1 full chunks and the tail
    // chunk, tests per chunk; the tail chunk shares the loop's code (with a wgmma sequence of its
    // own, ptxas serialized the RB = 2 wgmmas under the register limit of 3 CTAs per SM).
    int c0 = 0;
    uint32_t phase = uint32_t(g0 >> kLog2Stages) & 1u;  // the turn's parity (g0 starts a turn if kUnroll == STAGES)
    for (; c0 + kUnroll <= my_full; c0 += kUnroll, phase ^= 1u) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        step(c0, u, phase, u + 1 < kUnroll || c0 + kUnroll < my_n, u + 1 < kUnroll || c0 + kUnroll < my_full);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c0 + u < my_n) step(c0, u, phase, c0 + u + 1 < my_n, c0 + u + 1 < my_full);
    wg_wait<0>();
#pragma unroll
    for (int r = 0; r < RB; ++r)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) asm volatile("" : "+f"(acc[r][i])::"memory");
    // Release, in order, the stages of the slice's last chunk and of the chunks this (shorter)
    // slice does not have, so that every stage sees all consumer warps once per use.
    for (int c = max(my_n - 1, 0); c < q_ring; ++c) {
      const int gc = g0 + c;
      if (c >= my_n) mbar_wait(full_addr + 8 * (gc & (STAGES - 1)), uint32_t(gc >> kLog2Stages) & 1u);
      release(gc & (STAGES - 1));
    }

    // ---------------------------------------------------------------- epilogue
    consumer_sync(kConsumers);  // every warpgroup is done with the pipeline's shared memory
    const int tw = tid & 127;   // thread within the warpgroup
    if constexpr (KS > 1) {     // K-slices 1.. hand their sums to slice 0, which adds them in order
      float* partial = reinterpret_cast<float*>(smem + S::kPartials);
      if (ks > 0) {
#pragma unroll
        for (int r = 0; r < RB; ++r)
#pragma unroll
          for (int i = 0; i < BN / 2; ++i)
            partial[((((ks - 1) * WG + wr) * RB + r) * (BN / 2) + i) * 128 + tw] = acc[r][i];
      }
      consumer_sync(kConsumers);
      if (ks == 0) {
        for (int k2 = 1; k2 < KS; ++k2) {
#pragma unroll
          for (int r = 0; r < RB; ++r)
#pragma unroll
            for (int i = 0; i < BN / 2; ++i)
              acc[r][i] += partial[((((k2 - 1) * WG + wr) * RB + r) * (BN / 2) + i) * 128 + tw];
        }
      }
    }
    if (GS && u_parts > 1) {  // the tile's K splits meet in global memory; the last to arrive adds them in split order
      // Each unit writes its fp32 sums (float4 j of consumer thread tid at [unit][j][tid]); after the
      // consumers' barrier one thread counts the unit in with an acquire-release atomic, whose
      // release covers the other threads' writes ordered before it by the barrier and whose
      // acquire, followed by the barrier, orders the last unit's reads after every other unit's
      // writes (one fence and one round trip per unit; every thread's fence.sc before the count and
      // a second fence in the last unit, as before, cost Llama-4-Scout's GEMM2 at M = 16 with 4
      // splits 126.7 against 122.5 µs, DeepSeek-V3's GEMM2 at M = 16 with 2 splits 406.4 against
      // 359.9: tests/results/h100-2026-12-06-s36). The last reads the tile's partial sums of splits
      // 0, 1, ... in order (its own too), all of a split's loads before its adds, so the sum does not
      // depend on which unit arrives last, resets the counter for the next launch and stores the tile.
      constexpr int kQuads = RB * BN / 8;
      auto quad = [&](int jq) -> float* { return &acc[4 * jq / (BN / 2)][4 * jq % (BN / 2)]; };
      float4* const tile_part = p.partials + size_t(u_slot) * u_parts * (kQuads * 128);
      float4* const mine = tile_part + size_t(split) * (kQuads * 128);
#pragma unroll
      for (int jq = 0; jq < kQuads; ++jq) {
        const float* q4 = quad(jq);
        __stcg(&mine[jq * 128 + tid], make_float4(q4[0], q4[1], q4[2], q4[3]));
      }
      consumer_sync(kConsumers);
      if (tid == 0) {
        int arrived;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n"
                     : "=r"(arrived)
                     : "l"(&p.counters[u_slot])
                     : "memory");
        s_tile[0] = arrived == u_parts - 1;
      }
      consumer_sync(kConsumers);
      if (!s_tile[0]) continue;  // another unit of the tile adds and stores it
      float4 v[kQuads];
#pragma unroll
      for (int jq = 0; jq < kQuads; ++jq) v[jq] = __ldcg(&tile_part[jq * 128 + tid]);
#pragma unroll 4
      for (int sp = 1; sp < u_parts; ++sp) {
#pragma unroll
        for (int jq = 0; jq < kQuads; ++jq) {
          const float4 w = __ldcg(&tile_part[size_t(sp) * (kQuads * 128) + jq * 128 + tid]);
          v[jq].x += w.x, v[jq].y += w.y, v[jq].z += w.z, v[jq].w += w.w;
        }
      }
#pragma unroll
      for (int jq = 0; jq < kQuads; ++jq) {
        float* q4 = quad(jq);
        q4[0] = v[jq].x, q4[1] = v[jq].y, q4[2] = v[jq].z, q4[3] = v[jq].w;
      }
      if (tid == 0) p.counters[u_slot] = 0;
    }
    if (CL && csize > 1) {  // ranks 1.. of the cluster hand their sums to rank 0, which adds them in order
      // Rank r's partial sums stay in its own shared memory (the front, free now), float4 j of
      // consumer thread ct (warpgroup wr of slice 0) at (j * WG * 128 + ct) * 16 bytes; rank 0
      // reads them through the cluster's shared-memory window between the two cluster barriers
      // (after the first every rank has written, after the second rank 0 has read).
      constexpr int kQuads = RB * BN / 8;  // float4s per thread: accumulators 4j .. 4j + 3 of acc[RB][BN / 2]
      const int ct = wr * 128 + tw;
      float4* cpart = reinterpret_cast<float4*>(smem);
      auto quad = [&](int j) -> float* { return &acc[4 * j / (BN / 2)][4 * j % (BN / 2)]; };  // BN / 2 % 4 == 0
      if (KS > 1) consumer_sync(kConsumers);  // the slices' partial sums (which this overlaps) are read
      if (crank > 0 && ks == 0) {
#pragma unroll
        for (int j = 0; j < kQuads; ++j) {
          const float* q4 = quad(j);
          cpart[j * WG * 128 + ct] = make_float4(q4[0], q4[1], q4[2], q4[3]);
        }
      }
      cluster_arrive();
      cluster_wait();
      if (crank == 0 && ks == 0) {
        for (int r2 = 1; r2 < csize; ++r2) {
#pragma unroll
          for (int j = 0; j < kQuads; ++j) {
            const float4 v = ld_cluster_f4(smem_u32(&cpart[j * WG * 128 + ct]), uint32_t(r2));
            float* q4 = quad(j);
            q4[0] += v.x, q4[1] += v.y, q4[2] += v.z, q4[3] += v.w;
          }
        }
      }
      cluster_arrive();
      if (crank > 0) {  // its shared memory must outlive rank 0's reads
        cluster_wait();
        return;
      }
    }
    // The tile [BN tokens x kRows rows] goes through shared memory (tile_out, row-major by token) for
    // 16-byte stores, each value rounded to T. Fused (silu_out), the same tile: store_silu_tile then reads
    // a feature's gate and up values from it (sections = 2: local rows 16j + i and 16j + 8 + i are
    // feature 8j + i's), with all the CTA's consumer threads, and the main loop and its registers stay
    // the plain kernel's.
    T* tile_out = reinterpret_cast<T*>(smem + S::kEpilogueAt);
    if (ks == 0) {
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        const int rl0 = (wr * RB + r) * 64 + wl * 16 + g;  // local rows rl0 and rl0 + 8
        const float alf[2] = {al[r][0] * kAlphaFactor, al[r][1] * kAlphaFactor};
#pragma unroll
        for (int nc = 0; nc < BN / 8; ++nc) {
#pragma unroll
          for (int qd = 0; qd < 4; ++qd) {
            const int token = 8 * nc + 2 * t4 + (qd & 1);
            const int rl = rl0 + 8 * (qd >> 1);
            const float v = acc[r][4 * nc + qd] * alf[qd >> 1];
            if constexpr (kBf16)
              tile_out[token * S::kPitch + rl] = __float2bfloat16_rn(v);
            else
              tile_out[token * S::kPitch + rl] = __float2half_rn(v);
          }
        }
      }
    }
    consumer_sync(kConsumers);
    // sections = 2: local rows 8v .. 8v + 7 are gate rows (v even) or up rows (v odd) of the prepared
    // block n0 / 16 + v / 2, i.e. canonical columns 8 (n0 / 16 + v / 2) (+ n / 2 for up) onwards.
    auto store_tile = [&] {
      constexpr int kVec = S::kRows / 8;
      T* out = static_cast<T*>(p.out);
      const bool gate_up = p.sections == 2;
      for (int idx = tid; idx < BN * kVec; idx += kConsumers) {
        const int token = idx / kVec, v = idx % kVec;
        const int col = gate_up ? (v & 1) * (p.n / 2) + n0 / 2 + 8 * (v >> 1) : n0 + v * 8;
        if (token < rows_valid && n0 + v * 8 < p.n)
          *reinterpret_cast<uint4*>(out + (row0 + token) * int64_t(p.n) + col) =
              *reinterpret_cast<const uint4*>(tile_out + token * S::kPitch + v * 8);
      }
    };
    if constexpr (BN == kSiluTileTokens) {
      if (p.silu_out != nullptr)
        store_silu_tile<T, S::kRows, BN>(p, tile_out, S::kPitch, e, row0, rows_valid, n0 / 2, tid, kConsumers);
      else
        store_tile();
    } else {
      store_tile();
    }
    if (CL && csize > 1) cluster_wait();  // the second cluster barrier (arrived at before the epilogue)
  }  // tiles
}

// ---------------------------------------------------------------- host side

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static const auto fn =
      reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(driver_entry("cuTensorMapEncodeTiled", 12000));
  return fn;
}

// Activation map: [a_rows, k] 16-bit row-major, box = 64 K elements (128 bytes) x BN rows,
// 128-byte swizzle, out-of-bounds elements read as zeros.
int make_tensor_map(CUtensorMap* map, const void* a, int dtype, int64_t a_rows, int64_t k, int box_rows) {
  auto fn = encode_fn();
  if (fn == nullptr)
    return set_error(MOE_FP4_ERROR_CUDA, "cuTensorMapEncodeTiled is not available from the CUDA driver");
  const cuuint64_t dims[2] = {cuuint64_t(k), cuuint64_t(a_rows)};
  const cuuint64_t strides[1] = {cuuint64_t(k) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kChunk), cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = fn(map, dtype == MOE_FP4_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                        2, const_cast<void*>(a), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return set_error(MOE_FP4_ERROR_CUDA, "cuTensorMapEncodeTiled failed for the activations (CUresult %d)", int(r));
  return MOE_FP4_OK;
}

constexpr int kMaxSmem = 227 * 1024;  // dynamic shared memory per block on sm_90

// A persistent kernel may take all the dynamic shared memory its static variables leave (its
// tile table grows with E): found once per kernel; -1 (error set) if the runtime cannot say.
template <typename T, int BN, int WG, int KS, int RB, int STAGES, int MINB, bool CL, bool P, bool GS = false>
int dynamic_smem_limit() {
  static std::atomic<int> limit{0};
  int v = limit.load(std::memory_order_acquire);
  if (v == 0) {
    cudaFuncAttributes fa{};
    if (cuda_status(cudaFuncGetAttributes(&fa, gemm_kernel<T, BN, WG, KS, RB, STAGES, MINB, CL, P, GS>),
                    "cudaFuncGetAttributes (sm90 grouped GEMM)") != MOE_FP4_OK)
      return -1;
    v = kMaxSmem - int(fa.sharedSizeBytes);
    limit.store(v, std::memory_order_release);
  }
  return v;
}

// CTAs of a persistent kernel that fit on one SM with `smem` bytes of dynamic shared memory (at
// most MINB; its registers allow MINB by its launch bounds). The grid is this times the SMs: in
// a grid of MINB per SM whose CTAs do not all fit, the rest run, all their tiles, after the first
// ones finish (session 15's persistent 32-token tile with 8 stages needs 77.6 KiB, so 2 fit in an
// SM's 228 KB, not 3: it lost up to 23%). Also large E, whose table grows the shared memory. One
// entry per kernel and device ordinal (the last shared-memory size asked; threads racing on it
// can at worst pair a key with another size's count, which changes the grid, and the result only
// of a tail split, whose K ranges the grid's size sets: a persistent CTA takes whatever tiles its
// index gives it); -1 (error set) if the runtime cannot say.
template <typename T, int BN, int WG, int KS, int RB, int STAGES, int MINB, bool CL, bool P, bool GS = false>
int persistent_ctas_per_sm(size_t smem, int device) {
  struct Entry {
    std::atomic<uint64_t> key{0};  // (smem + 1) << 8 | device ordinal, 0: empty
    std::atomic<int> ctas{0};
  };
  static Entry cache;
  const uint64_t key = (uint64_t(smem) + 1) << 8 | uint64_t(device & 0xFF);
  if (cache.key.load(std::memory_order_acquire) == key) return cache.ctas.load(std::memory_order_relaxed);
  int ctas = 0;
  if (cuda_status(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, gemm_kernel<T, BN, WG, KS, RB, STAGES, MINB, CL, P, GS>,
                                                                cta_threads(WG, KS), smem),
                  "cudaOccupancyMaxActiveBlocksPerMultiprocessor (sm90 grouped GEMM)") != MOE_FP4_OK)
    return -1;
  ctas = std::max(1, std::min(ctas, MINB));
  cache.ctas.store(ctas, std::memory_order_relaxed);
  cache.key.store(key, std::memory_order_release);
  return ctas;
}

// A bound on the token tiles of BN rows, sum_e ceil(m_e / BN) (see launch).
int64_t token_tile_bound(int64_t a_rows, int32_t num_experts, int bn) {
  return std::min<int64_t>(ceil_div(a_rows, bn) + (num_experts < a_rows ? num_experts : a_rows), a_rows);
}

// GS's workspace: the tiles' counters in a fixed region of kGsMaxTiles int32 (so that calls of
// other shapes on the same workspace, whose partial sums start at the same place, never write
// where a counter is), then each unit's fp32 partial sums (units = tiles x splits; kRows x BN
// floats, as float4s).
constexpr int64_t kGsMaxTiles = 16384;
// The GS kernel's CTAs per SM at most (its MINB): the tail split's workspace holds a partial tile for each.
constexpr int kGsCtasPerSm = 3;
struct GsLayout {
  size_t counter_bytes, partial_bytes;
  size_t total() const { return counter_bytes + partial_bytes; }
};
GsLayout gs_layout(int64_t tiles, int64_t splits, int rows, int bn) {
  return {size_t(kGsMaxTiles) * 4, size_t(tiles) * size_t(splits) * size_t(rows) * size_t(bn) * 4};
}

template <class S>
size_t persistent_smem(const Sm90GemmArgs& a) {
  return S::kBytes + 8 * size_t(a.num_experts + 1);  // the table: prefix sums and clamped offsets
}

// Whether the persistent kernel's shared memory (its table included) fits for these experts.
template <typename T, int BN, int WG, int KS, int RB, int STAGES, int MINB, bool GS = false>
bool persistent_fits(const Sm90GemmArgs& a) {
  const int limit = dynamic_smem_limit<T, BN, WG, KS, RB, STAGES, MINB, false, true, GS>();
  return limit > 0 && persistent_smem<Smem<BN, WG, KS, RB, STAGES, true>>(a) <= size_t(limit);
}

template <typename T, int BN, int WG, int KS, int RB, int STAGES, int MINB, bool CL = false, bool P = false,
          bool GS = false>
int launch(const Sm90GemmArgs& a, int splits, cudaStream_t stream, bool tail = false) {
  using S = Smem<BN, WG, KS, RB, STAGES, P>;
  static_assert(S::kBytes <= kMaxSmem, "shared memory per block");
  if (!CL && !GS && splits != 1)
    return set_error(MOE_FP4_ERROR_INTERNAL, "sm90 grouped GEMM: a K split across %d CTAs without cluster code", splits);
  auto kernel = gemm_kernel<T, BN, WG, KS, RB, STAGES, MINB, CL, P, GS>;
  const size_t smem = P ? persistent_smem<S>(a) : S::kBytes;
  const int limit = P ? dynamic_smem_limit<T, BN, WG, KS, RB, STAGES, MINB, CL, P, GS>() : S::kBytes;
  if (limit < 0) return MOE_FP4_ERROR_CUDA;
  if (smem > size_t(limit))
    return set_error(MOE_FP4_ERROR_INTERNAL, "sm90 grouped GEMM: %d experts do not fit a persistent CTA's table",
                     int(a.num_experts));
  static std::atomic<uint64_t> configured{0};  // one bit per device ordinal < 64
  const uint64_t bit = uint64_t(1) << (a.device & 63);
  if (!(configured.load(std::memory_order_acquire) & bit)) {
    MOE_FP4_TRY(cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit),
                            "cudaFuncSetAttribute (sm90 grouped GEMM shared memory)"));
    configured.fetch_or(bit, std::memory_order_acq_rel);
  }
  CUtensorMap map;
  std::memset(&map, 0, sizeof(map));
  MOE_FP4_TRY(make_tensor_map(&map, a.a, a.a_dtype, a.a_rows, a.k, BN));
  // A bound on the token tiles, sum_e ceil(m_e / BN): at most one partial tile per non-empty expert
  // besides the full ones, and never more tiles than rows (each holds one at least: non-decreasing
  // offsets, clamped to [0, a_rows] as in find_tile and tile_prefix, partition at most a_rows
  // rows; offsets that are not prefix sums break the contract, and could exceed the first bound
  // too). The second bound matters at decode: at one row (Llama-4-Scout M = 1) the first gave 2
  // token tiles, and the grid's CTAs of the one that does not exist, which exit at once, still
  // took slots among the real ones (our reading of Nsight Compute's SMs active 69% of GEMM1's
  // cycles, 91% with this bound). Measured on the H200 (tests/results/h200-2026-12-04-s20/call2,
  // sm90_gemm_check --sweep-splits, cold µs, two rounds): Llama-4-Scout GEMM1 at M = 1 29.6 / 29.5
  // -> 25.7 / 25.8 (whole forward 58.3 -> 54.6); its GEMM2 with clusters of 8, 25.7 / 24.7 -> 17.2
  // / 17.1 (see sm90_plan).
  const int64_t tiles = token_tile_bound(a.a_rows, a.num_experts, BN);
  if (tiles > INT32_MAX)
    return set_error(MOE_FP4_ERROR_INVALID_ARGUMENT, "a_rows: %lld rows need more than 2^31 token tiles",
                     static_cast<long long>(a.a_rows));
  const int64_t ntiles_n = ceil_div(a.n, S::kRows);
  // Persistent: as many CTAs per SM as fit (MINB, or fewer when the shared memory does not allow
  // it), or fewer CTAs for a grid that is short of tiles.
  int per_sm = 1;
  if constexpr (P) {
    per_sm = persistent_ctas_per_sm<T, BN, WG, KS, RB, STAGES, MINB, CL, P, GS>(smem, a.device);
    if (per_sm < 0) return MOE_FP4_ERROR_CUDA;
  }
  const int64_t units = tiles * ntiles_n * (GS ? splits : 1);
  const int64_t ctas = P ? std::min<int64_t>(units, int64_t(per_sm) * (a.sm_count > 0 ? a.sm_count : 1)) : tiles;
  const dim3 grid(unsigned(ctas), unsigned(P ? 1 : ntiles_n), unsigned(CL ? splits : 1));
  Params p{a.w, a.w_scales, a.alpha, a.expert_offsets, a.out, a.a_rows, a.num_experts, a.sections,
           int32_t(a.n), int32_t(a.k), 1, 0, nullptr, nullptr, a.silu_out, a.silu_gs};
  if (GS && splits > 1) {  // (GS with one split: the persistent small tiles' plain plans, no workspace)
    static_assert(!GS || S::kRows * BN == (RB * BN / 8) * 128 * 4, "a unit's partial sums: a float4 per quad and thread");
    if (tiles * ntiles_n > kGsMaxTiles)  // (so units, at most 16 splits of each, fit in an int)
      return set_error(MOE_FP4_ERROR_INVALID_ARGUMENT,
                       "gs_splits: a K split through the workspace takes at most %lld tiles, this call has up to %lld",
                       static_cast<long long>(kGsMaxTiles), static_cast<long long>(tiles * ntiles_n));
    // gs_tail: at most one tail unit per CTA, so as many partial tiles as CTAs (and as many counters)
    const GsLayout ws = tail ? gs_layout(ctas, 1, S::kRows, BN) : gs_layout(tiles * ntiles_n, splits, S::kRows, BN);
    if (a.workspace == nullptr || a.workspace_bytes < ws.total())
      return set_error(MOE_FP4_ERROR_INVALID_ARGUMENT, "workspace_bytes: expected at least %zu for %d K splits, got %zu",
                       ws.total(), splits, a.workspace == nullptr ? size_t(0) : a.workspace_bytes);
    p.gsplits = splits;
    p.gs_tail = tail;
    p.counters = static_cast<int32_t*>(a.workspace);
    p.partials = reinterpret_cast<float4*>(static_cast<uint8_t*>(a.workspace) + ws.counter_bytes);
  }
  return cuda_status(
      launch_kernel_clusters(kernel, grid, dim3(cta_threads(WG, KS)), smem, unsigned(CL ? splits : 1), stream, map, p),
      "sm90 grouped GEMM kernel launch");
}

// The 80- to 112-token tiles: persistent 192-row CTAs (3 consumer warpgroups, 8 stages, one per
// SM), or, when E's tile table does not fit beside their ring, the one-tile 128-token CTAs.
template <typename T, int BN>
int launch_rows192(const Sm90GemmArgs& a, int splits, cudaStream_t stream) {
  if (persistent_fits<T, BN, 3, 1, 1, 8, 1>(a)) return launch<T, BN, 3, 1, 1, 8, 1, false, true>(a, splits, stream);
  return launch<T, 128, 2, 1, 1, 8, 1>(a, splits, stream);
}

// The 48- and 64-token tiles: two persistent 128-row CTAs per SM (2 consumer warpgroups, a
// 4-stage ring), or, when E's tile table does not fit, one-tile CTAs with 8 stages.
template <typename T, int BN>
int launch_rows128x2(const Sm90GemmArgs& a, int splits, cudaStream_t stream) {
  if (persistent_fits<T, BN, 2, 1, 1, 4, 2>(a)) return launch<T, BN, 2, 1, 1, 4, 2, false, true>(a, splits, stream);
  return launch<T, BN, 2, 1, 1, 8, 2>(a, splits, stream);
}

// The fused first GEMM (silu_out: w13 [n, k], gate and up rows interleaved) is followed by the
// second GEMM of w2 [k, n / 2] on the same rows: whether that GEMM's heuristic plan, with the
// workspace a forward gives it, splits K through the workspace.
bool second_gemm_splits(const Sm90GemmArgs& a) {
  return sm90_plan(a.a_rows, a.num_experts, a.k, a.n / 2, a.sm_count, 0, 0, 0, 0).gs_splits > 1;
}

// The 8- and 16-token tiles: a K split through the workspace (GS, persistent CTAs) or across a
// cluster, else persistent one-slice CTAs (3 per SM) where E's tile table fits, two K-slices per
// 64-row CTA, or one-tile CTAs. A GS plan whose table does not fit takes the cluster of as many
// CTAs (up to 8), which groups the sums the same way (the same bits); a tail split's runs unsplit.
// A fused first GEMM whose second GEMM splits K through the workspace runs unsplit in the GS kernel
// (gsplits = 1: a plain unit's epilogue), so that both GEMMs of the forward run one kernel: as
// kernels of their own the fused forward ran slower than the unfused one there (Llama-4-Scout M = 2-4,
// tests/results/h100-2026-12-06-s34: the second kernel's code fetched cold, as in the note at
// dispatch). Measured on the H100 (tests/results/h100-2026-12-06-s36, call s36b, whole forward, two
// rounds, unfused -> fused in the GS kernel): Llama-4-Scout M = 2 90.8 / 90.8 -> 86.1 / 86.4 µs, M = 4
// 118.9 / 118.6 -> 112.7 / 113.2. Not for every plan: the plain persistent tiles in the GS kernel
// (one split) ran 1.5-2.5 % slower than in their own (Qwen3 M = 16 120.5 / 120.0 -> 123.2 / 123.2,
// DeepSeek-V3 M = 1 108.0 -> 110.1, Llama-4-Scout M = 64 401.1 / 402.2 -> 409.7 / 410.9).
template <typename T, int BN>
int launch_small(const Sm90GemmArgs& a, const Sm90Plan& plan, cudaStream_t stream) {
  const int c = plan.cta_splits, g = plan.gs_splits;
  // A tail split whose tile table does not fit (E in the tens of thousands) runs unsplit below: the
  // cluster of its 8 splits would split every tile, the grid the tail split exists to avoid.
  const bool gs_fits = g > 1 && persistent_fits<T, BN, 1, 1, 2, 8, kGsCtasPerSm, true>(a);
  if (g > 1 && (gs_fits || !plan.gs_tail)) {
    if (g <= 8 && !gs_fits) return launch<T, BN, 1, 1, 2, 8, 3, true>(a, g, stream);
    return launch<T, BN, 1, 1, 2, 8, kGsCtasPerSm, false, true, true>(a, g, stream, plan.gs_tail != 0);
  }
  if (c > 1) return launch<T, BN, 1, 1, 2, 8, 3, true>(a, c, stream);
  if (plan.slices == 2) return launch<T, BN, 1, 2, 1, 8, 2>(a, c, stream);  // 288 threads
  if (a.silu_out != nullptr && second_gemm_splits(a)) {
    if (persistent_fits<T, BN, 1, 1, 2, 8, kGsCtasPerSm, true>(a))
      return launch<T, BN, 1, 1, 2, 8, kGsCtasPerSm, false, true, true>(a, 1, stream);
  } else if (persistent_fits<T, BN, 1, 1, 2, 8, 3>(a)) {
    return launch<T, BN, 1, 1, 2, 8, 3, false, true>(a, c, stream);
  }
  return launch<T, BN, 1, 1, 2, 8, 3>(a, c, stream);
}

// The wide tiles (48 tokens and more), without SiLU-and-mul.
template <typename T>
int dispatch_wide(const Sm90GemmArgs& a, const Sm90Plan& plan, cudaStream_t stream) {
  const int c = plan.cta_splits;
  switch (plan.tile_tokens) {
    // The wide tiles run persistent CTAs (grid = CTAs per SM x SMs, each looping over tiles with
    // its ring running on under the epilogue); a table of 2 (E + 1) ints that does not fit in the
    // shared memory left (E past ~3400 for 128 tokens, ~20000 for 64) takes the one-tile CTAs.
    // Measured on the H200 (tests/results/h200-2026-12-03-s13, csrc/tests/sm90_gemm_check --sweep,
    // µs, one-tile -> persistent): Qwen3 GEMM1 / GEMM2 at M = 1024 (64 tokens) 221.8 -> 194.4 / 148.7 -> 121.7,
    // M = 4096 655.4 -> 520.8 / 461.2 -> 302.0, M = 16384 2273.4 -> 1781.4 / 1546.2 -> 1007.2;
    // DeepSeek-V3 M = 4096 6877 -> 5769 / 3848 -> 2947; Llama-4-Scout GEMM2 M = 1024 332.1 -> 346.6
    // (the one loss). A one-tile CTA paid ~6 µs per tile outside its main loop (finding its tile,
    // filling the ring, the epilogue), exposed with 1-2 CTAs per SM. Tried: 8 stages and 1 CTA per
    // SM for 64 tokens (1.4x slower), 256-row CTAs (RB = 2) for 64 tokens (GEMM1 7% slower),
    // 4 stages for 128 (GEMM2 5% slower); 2 one-tile 128-token CTAs per SM need <= 96 registers
    // (ptxas spills).
    // The 80-, 96- and 112-token tiles: persistent CTAs of 3 consumer warpgroups (192 weight rows)
    // and a producer warpgroup, one per SM, 144 registers per consumer thread (see cta_threads).
    // Token tiles sized to the experts' rows (sm90_tile_tokens): at 64 rows per expert one 80-token
    // tile holds most experts, where 64-token tiles take two for about half of them (twice the
    // weight dequantization and traffic); and 192 rows per CTA read each activation tile from L2
    // for 1.5x the MMAs of 128. Measured on the H200 (tests/results/h200-2026-12-04-s17/call2,
    // sm90_gemm_check --sweep --rounds 2, cold µs, best tile against the one it replaces): Qwen3
    // GEMM1 at M = 1024 187.3 (64) -> 138.5 (80), M = 1536 206.0 (128) -> 186.3 (112), M = 4096
    // 496.5 (128) -> 447.3 (96), M = 16384 1654.1 (128) -> 1503.3 (112). Tried: 256-row CTAs of 4
    // warpgroups (96 registers per thread: the 64-token one, without spills, lost 3-10% to the
    // two 64-token CTAs per SM; the wider ones spilled), 128 tokens on 192 rows (4 stages: 3-14%
    // slower than 112), 4 stages for 80 (5-6% slower than 8), 96 (within 1%) and 112 (call 3,
    // st112.log: 1-7% slower at 9 of 12 points of Qwen3 and Llama-4-Scout M = 1536-16384, 1% faster
    // at 2).
    case 80: return launch_rows192<T, 80>(a, c, stream);    // [166.4 KiB + table]
    case 96: return launch_rows192<T, 96>(a, c, stream);    // [188.6 KiB + table]
    case 112: return launch_rows192<T, 112>(a, c, stream);  // [210.9 KiB + table]
    // Two 48- or 64-token CTAs of 128 rows per SM (by registers: 91 with a bound of 2 for 64).
    // 48 tokens, for 25-38 rows per expert: measured on the H200 (tests/results/
    // h200-2026-12-04-s17/call5/sweep.log, sm90_gemm_check --sweep --rounds 2, cold µs, 64 -> 48
    // at r = 32): DeepSeek-V3 GEMM1 / GEMM2 at M = 1024 2291.7 -> 2026.6 / 1173.8 -> 1057.7, Qwen3
    // at M = 512 129.6 -> 120.4 / 76.4 -> 71.5, Llama-4-Scout at M = 512 384.4 -> 359.1 / 231.4 ->
    // 214.3 (the 48-token tile on the 192-row CTAs beat 64 on 5 of the 6 but lost to this one on
    // all 6). Session 18 call 1 (sweep48.log) again: 48 best at r = 32 on 5 of 6 GEMMs
    // (Llama-4-Scout's GEMM2: 32 by 5%); at r = 40 three GEMMs each way within 8%, so 64 keeps r > 38.
    case 48: return launch_rows128x2<T, 48>(a, c, stream);  // [55.8 KiB + table; one-tile 85.1 KiB]
    case 64: return launch_rows128x2<T, 64>(a, c, stream);  // [68.1 KiB + table; one-tile 101.1 KiB]
    default:
      if (persistent_fits<T, 128, 2, 1, 1, 8, 1>(a)) return launch<T, 128, 2, 1, 1, 8, 1, false, true>(a, c, stream);  // [199.1 KiB + table]
      return launch<T, 128, 2, 1, 1, 8, 1>(a, c, stream);   // [165.1 KiB]
    // (BN = 256 needs ~190 registers per consumer thread and spills under ptxas's choice here.)
  }
}

template <typename T>
int dispatch(const Sm90GemmArgs& a, const Sm90Plan& plan, cudaStream_t stream) {
  const bool cluster = plan.cta_splits > 1;
  const int c = plan.cta_splits;
  // Persistent CTAs also for the one-slice 8- and 16-token tiles (3 per SM, the ring unrolled
  // over whole turns: a tile takes its chunks rounded up to whole turns of stages). Measured on
  // the H200 (csrc/tests/sm90_gemm_check --bench-only, tests/results/h200-2026-12-03-s15/call3,
  // µs, one-tile -> persistent): Qwen3 GEMM1 / GEMM2 at M = 16 (8 tokens) 65.4 -> 56.9 /
  // 41.2 -> 36.1, M = 64 (16 tokens) 93.9 -> 84.5 / 60.8 -> 51.5; Llama-4-Scout GEMM1 M = 16
  // 200.5 -> 178.2, M = 64 286.0 -> 244.2. The 32-token tile with 8 stages lost (Qwen3 GEMM2
  // at M = 256 68.1 -> 83.9, Llama-4-Scout GEMM1 305.2 -> 376.2) on a grid of 3 CTAs per SM of
  // which 2 fit; with 4 stages it gains (case 32).
  // SiLU-and-mul in the epilogue (moe_fp4_sm90_gemm_silu) is built into the 8-token tile's kernels
  // only (kSiluTileTokens), chosen per call by silu_out, so that a forward's fused first GEMM and its
  // plain second GEMM (the same tile: the same rows per expert) run the same kernel. Measured on the
  // H100 (tests/results/h100-2026-12-06-s32, benchmarks/fusion_ab.py --backend cutlass, whole
  // forward): with the fused epilogue in kernels of their own (cb48014) the fused forwards were
  // 7-35 % slower than without the fusion (Qwen3 M = 2 59.8 against 45.5 µs, M = 16 137.6 against
  // 124.3), though each GEMM alone ran as fast as before (Nsight Compute, caches flushed): our reading
  // is the second kernel's code fetched cold after the first's. In one kernel the fused forwards
  // were faster than the plain kernels' unfused ones at 1-4 rows per expert (Qwen3 M = 16 120.3
  // against 124.3, DeepSeek-V3 M = 1 108.8 against 111.0; level at Qwen3 M = 2), slower at 8-16 rows
  // (the 16- and 32-token tiles: Qwen3 M = 256 198.8 against 186.3, where the persistent 32-token
  // kernel with both epilogues spills 40 bytes). The other tiles' kernels hold no fused epilogue:
  // as a runtime branch it cost the wide ones 11-18 % (tests/results/h100-2026-12-06-s31).
  if (a.silu_out != nullptr && plan.tile_tokens != kSiluTileTokens)
    return set_error(MOE_FP4_ERROR_INVALID_ARGUMENT,
                     "tile_tokens: SiLU-and-mul in the GEMM's epilogue is built for the 8-token tile (at most 4 "
                     "rows per expert with the heuristic), this call's tile is %d tokens",
                     plan.tile_tokens);
  switch (plan.tile_tokens) {
    // BN, row warpgroups, K-slices, row groups per warpgroup, stages, min CTAs per SM, clusters
    // (Smem::kBytes in brackets). The one-slice small tiles compute 128 rows per warpgroup
    // (RB = 2): 115-127 registers per thread, so 3 CTAs per SM (BN = 8 and 16 ran 4 CTAs of 64
    // rows with RB = 1, which fits the 96 registers of 4 CTAs). K split across a cluster: the
    // one-slice 8-, 16- and 32-token tiles (sm90_plan).
    case 8: return launch_small<T, 8>(a, plan, stream);    // [45.1 KiB; two slices 53.1 KiB]
    case 16: return launch_small<T, 16>(a, plan, stream);  // [53.1 KiB; two slices 69.1 KiB]
    case 32:
      if (cluster) return launch<T, 32, 1, 1, 2, 8, 3, true>(a, c, stream);
      // Persistent 32-token CTAs with 4 stages, so 3 fit per SM: with 8 stages the persistent CTA
      // needs 77.6 KiB (2 per SM). Measured on the H200 (tests/results/h200-2026-12-03-s16/call1,
      // csrc/tests/sm90_gemm_check --bench-only, cold µs, one-tile 8 stages -> persistent 8
      // stages on the occupancy grid (2 per SM) -> persistent 4 stages): Qwen3 GEMM1 at M = 256
      // 111.2 -> 99.9 -> 94.1, GEMM2 68.9 -> 69.0 -> 55.5.
      if (persistent_fits<T, 32, 1, 1, 2, 4, 3>(a)) return launch<T, 32, 1, 1, 2, 4, 3, false, true>(a, c, stream);  // [43.6 KiB + table]
      return launch<T, 32, 1, 1, 2, 8, 3>(a, c, stream);           // [69.1 KiB]
    default:
      break;
  }
  return dispatch_wide<T>(a, plan, stream);
}

}  // namespace
}  // namespace sm90

int sm90_tile_tokens(int64_t a_rows, int32_t num_experts) {
  // r = a_rows / min(E, a_rows) is the mean number of rows of a non-empty expert (at least).
  // Measured on the H200 (csrc/tests/sm90_gemm_check --sweep, Qwen3-30B-A3B GEMM1 and GEMM2,
  // M = 1..4096 tokens, top-8 of 128; tests/results/h200-2026-12-01/session2): the best tile
  // holds about 2r rows up to r = 16 (routing is skewed, and a partial tile still costs a pass
  // over the expert's weights), 64 at r = 64 (also at M = 1024: 248 vs 277 us for GEMM1), 128
  // beyond. With the 128-row CTAs of the small tiles (session 5, tests/results/h200-2026-12-01/
  // session5), 16 rows won at r = 4 (M = 64: GEMM1 104.1 vs 111.4 us with 8, GEMM2 70.5 vs 69.9;
  // the persistent 8-token CTAs of session 15 turned that round, below).
  // With persistent 32-token CTAs (session 16, tests/results/h200-2026-12-03-s16/call4), 16 rows
  // still win at r = 8: whole forward with 32 from r > 4 instead, Qwen3 M = 128 169.4 -> 176.1 us,
  // Llama-4-Scout M = 128 451.9 -> 495.8, DeepSeek-V3 M = 256 2085.7 -> 2364.3.
  //
  // Past 8 rows, the tile is chosen for the spread of the experts' rows: with near-uniform routing
  // an expert's rows are about Poisson(r), so r + 1.5 sqrt(r) of them hold most experts. Up to 32
  // of them the 32-token tile (DeepSeek-V3 M = 768, r = 24, session 17 call 5: GEMM1 / GEMM2
  // 1664.9 / 848.3 µs against 2305.4 / 1165.3 with 64 tokens; at r = 32 it beat 64 by 2-10% on
  // Qwen3 and Llama-4-Scout and lost 1% on DeepSeek-V3, not changed); up to 48 the 48-token tile
  // and up to 64 the 64-token tile (two CTAs of 128 rows per SM; at r = 32, 48 beat 64 by 6-13%
  // and 32 by 3-13% on 5 of the 6 GEMMs, losing 2% to 32 on Llama-4-Scout's GEMM2: session 17
  // call 5); beyond, the 192-row CTAs' 80-, 96- or
  // 112-token tile that costs least, counting each tile as its tokens plus 60 tokens' worth of
  // fixed cost (its pass over the expert's weights: dequantization, the ring, the epilogue), i.e.
  // ceil((r + 1.5 sqrt(r)) / t) * (t + 60). Fitted to session 17's sweep (tests/results/
  // h200-2026-12-04-s17/call2, all three layers, r = 32 .. 1024, which had no 48-token tile on
  // 128 rows), whose best tile it picked at 29 of its 30 GEMMs: r = 48 -> 64; r = 64 -> 80;
  // 96 -> 112; 128 -> 80 (two tiles); 256 -> 96 (three; Llama-4-Scout's GEMM2 ran 4% faster with
  // 112); 512, 1024 -> 112.
  //
  // The persistent 8-token tile up to cover 8 (r <= 4; session 18 call 1, sm90_gemm_check
  // --sweep-splits, cold µs, 16 -> 8 tokens at r = 4: Qwen3 M = 64 GEMM1 / GEMM2 84.2 -> 80.3 /
  // 51.5 -> 49.2, Llama-4-Scout M = 64 243.4 -> 231.2 / 150.3 -> 142.2).
  const int64_t experts = num_experts < a_rows ? num_experts : (a_rows > 0 ? a_rows : 1);
  const int64_t rows = ceil_div(a_rows > 0 ? a_rows : 1, experts);
  const double cover = double(rows) + 1.5 * std::sqrt(double(rows));
  if (cover <= 8.0) return 8;  // rows <= 4
  if (rows <= 8) return 16;
  if (cover <= 32.0) return 32;  // rows <= 24
  if (cover <= 48.0) return 48;  // rows <= 38
  if (cover <= 64.0) return 64;
  int best = 0;
  double best_cost = 0.0;
  for (const int t : {112, 96, 80}) {  // ties: the wider tile (fewer passes over the weights)
    const double cost = std::ceil(cover / t) * (t + 60);
    if (best == 0 || cost < best_cost) best = t, best_cost = cost;
  }
  return best;
}

Sm90Plan sm90_plan(int64_t a_rows, int32_t num_experts, int64_t n, int64_t k, int sm_count, int tile_tokens,
                   int slices, int cta_splits, int gs_splits) {
  Sm90Plan plan{};
  plan.gs_splits = 1;
  plan.tile_tokens = tile_tokens > 0 ? tile_tokens : sm90_tile_tokens(a_rows, num_experts);
  const int64_t rows = a_rows > 0 ? a_rows : 1;
  const int64_t experts = num_experts < rows ? num_experts : rows;
  const double sms = sm_count > 0 ? sm_count : 1;
  const int64_t chunks = ceil_div(k, 64);
  const bool small = plan.tile_tokens <= 16;
  // Split K across the C CTAs of a cluster (the 8- to 32-token tiles) when the grid is short of
  // CTAs: as many as keep the grid within 2.5 CTAs per SM and give each CTA at least 16 of the
  // 64-wide K chunks (at most 8), for a K of at least 40 chunks. The grid is estimated from the
  // expected number of non-empty experts, E (1 - (1 - 1/E)^a_rows), times the 128-row tiles of n. Measured on the H200
  // (session 18 call 1, csrc/tests/sm90_gemm_check --sweep-splits, cold µs, one CTA per tile ->
  // the rule's C): Llama-4-Scout GEMM2 (k = 8192) at M = 1 (40 CTAs) 46.9 -> 19.0 (C = 6; 4:
  // 22.5, 8: 24.7), at M = 4 (~145) 58.1 -> 44.2 (2), GEMM1 (k = 5120) at M = 1 (128) 31.8 ->
  // 29.1 (2; 3: 39.0). Left whole: DeepSeek-V3 GEMM1 at M = 1 (256 CTAs, k = 7168: 53.3 against
  // 71.3 with 2), Llama-4-Scout GEMM1 at M = 4 (~465: 50.9 against 76.6), GEMM2 at M = 16 (~412:
  // 114.0 against 119.5). The earlier rule (session 6: up to 1.2 waves of 3 CTAs per SM, C = 2 or
  // 4) predates the persistent one-slice CTAs, which made the unsplit grid faster. At least 16
  // chunks per CTA, not 20 (session 18), since the grid has no CTAs past the last token tile
  // (launch: at one row there were twice as many CTAs as tiles, and 8 CTAs per tile lost to 6):
  // session 20 call 2 (the same sweep, two rounds, cold µs): Llama-4-Scout GEMM2 at M = 1 18.7
  // (C = 6) -> 17.1 (C = 8). A K of fewer than 40 chunks stays whole as before: Qwen3's GEMM1 at
  // M = 1 (32 chunks, 96 tiles) ran faster alone with C = 2 (14.2 -> 13.3 against two K-slices
  // per CTA) but its whole forward slower (32.2 in call 2 -> 34.4 µs in call 4, the triton row
  // within 1%; in turns in call 5, 32.1 / 32.3 against 34.4 / 34.5). No other decode plan of the
  // three layers changes (M = 1 .. 64).
  const double active = num_experts * -std::expm1(double(rows) * std::log1p(-1.0 / num_experts));
  const double ctas = std::min(active, double(experts)) * double(ceil_div(n, 128));
  const int64_t by_grid = int64_t(2.5 * sms / std::max(ctas, 1.0));
  const int64_t by_k = chunks >= 40 ? chunks / 16 : 1;
  const int auto_splits = int(std::max<int64_t>(1, std::min<int64_t>({by_grid, by_k, 8})));
  const bool cluster = plan.tile_tokens <= 32 && auto_splits > 1;
  // Split K inside the CTA (2 slices, 64-row CTAs; only the 8- and 16-token tiles have them)
  // only when the grid would leave the GPU short of CTAs: (non-empty experts) x (64-row tiles)
  // below 2 per SM, as at decode (M = 1, top-8: 8 x n/64), and K is not split across CTAs.
  // Measured on the H200 (csrc/tests/sm90_gemm_check --sweep): 20.2 -> 16.3 us for GEMM1 at
  // M = 1, but 10-20% slower from M = 4 on, where the CTAs already fill the GPU.
  // Clusters only with the one-slice 8- to 32-token tiles (the instantiations that have them).
  plan.cta_splits = plan.tile_tokens > 32 ? 1 : cta_splits > 0 ? cta_splits : cluster ? auto_splits : 1;
  if (plan.cta_splits > 1)
    plan.slices = 1;
  else if (slices > 0)
    plan.slices = small ? slices : 1;
  else
    plan.slices = small && double(experts * ceil_div(n, 64)) < 2 * sms ? 2 : 1;
  // With a workspace (gs_splits 0: the heuristic's choice), the 8- and 16-token tiles split K of
  // at least 96 chunks through global memory instead of a cluster of 2 to 4 CTAs (GS: persistent CTAs, 3 per SM,
  // each unit (tile, K split) writes its fp32 sums to the workspace and the last of a tile to
  // arrive adds them in split order; deterministic, and the same grouping of the K sums as the
  // cluster of that size). Measured on the H200 (tests/results/h200-2026-12-04-s21, calls 2 and
  // 3, sm90_gemm_check --sweep-splits, cold µs): Llama-4-Scout GEMM2 at M = 4 44.2 (C = 2) ->
  // 43.1 (2 splits), GEMM1 at M = 1 25.9 (C = 2) -> 25.6 (2; 24.9 with 3); whole forward at
  // M = 4, the cluster -> GS (call 2, two rounds): 111.1 / 111.6 -> 103.2 / 103.0 µs, and 104.2
  // with every peer (call 4). Our reading (not profiled): under programmatic dependent launch the
  // persistent CTAs start, and request their weights, while the quantization still runs, where a
  // cluster must find its SMs free together. But GEMM1 at M = 1 (K = 80 chunks, C = 2 -> 2
  // splits) took the whole forward from 53.0 to 60.5 µs (call 4), not explained, although alone
  // it ran as fast: hence the K of at least 96 chunks (of the measured GEMMs that take a cluster
  // of 2 to 4, only Llama-4-Scout's GEMM2, K = 128 chunks; DeepSeek-V3's GEMM1, K = 112, runs
  // unsplit). Clusters of more CTAs stay (Llama-4-Scout GEMM2 at M = 1: C = 8 17.1 against 18.0
  // with 8 splits), as do the other plans (Qwen3 and DeepSeek-V3 at M = 1, 4, 16, DeepSeek-V3's
  // GEMM2 at M = 1 and 4 only: 2 to 12 splits
  // were slower than the best cluster or unsplit configuration of the same sweep at every point;
  // Llama-4-Scout GEMM2 at M = 16 gained with 2 splits, 113.4 -> 107.4, but GEMM1 at M = 4, with a
  // grid as short of a second round, lost, 50.7 -> 58.5: no rule here tells them apart).
  // The tail split (gs_tail): where the unsplit persistent grid needs a short second round, only
  // that round's tiles split, each in min(8, CTAs / tail) K ranges (the kernel counts the tiles
  // from its table); the full rounds run whole tiles with no workspace traffic. The expected grid
  // of (3, 4] CTAs per SM (the GS kernel runs 3 per SM) and K of at least 128 chunks: Llama-4-Scout
  // GEMM2 at M = 15 to 27. Measured on an H100 (tests/results/h100-2026-12-06-s38, call s38a, whole
  // forward, two rounds, unsplit -> this plan on (3, 5] CTAs per SM and 96 chunks): M = 16 336.7 /
  // 336.8 -> 315.3 / 314.7 µs (GEMM2 alone 138.2 -> 114.5), M = 24 365.2 / 365.4 -> 329.3 / 329.2,
  // but M = 32 (4.2 CTAs per SM) 420.2 / 420.7 -> 425.6 / 424.9 and M = 64 (4.8) 408.9 / 408.2 ->
  // 417.2 / 413.3, where the tail is long enough that its tiles split in 2 or not at all, and
  // DeepSeek-V3 GEMM1 at M = 2 (112 chunks, 3.8 CTAs per SM) 201.5 -> 203.9 (one round, on T2's
  // library, whose plan is the same there): hence the narrower rule. The sums of a tail tile are
  // grouped by its split, which the grid's size and the routed tile count set: the same inputs give
  // the same bits, but a row's last bits may depend on which experts the batch's other rows hit.
  const bool small_tile = plan.tile_tokens <= 16;
  if (small_tile && gs_splits > 1 && cta_splits <= 1) {
    plan.gs_splits = std::min(gs_splits, 16);
    plan.cta_splits = 1, plan.slices = 1;
  } else if (small_tile && gs_splits == 0 && cta_splits == 0 && plan.cta_splits >= 2 && plan.cta_splits <= 4 &&
             chunks >= 96) {
    plan.gs_splits = plan.cta_splits;
    plan.cta_splits = 1, plan.slices = 1;
  } else if (small_tile && gs_splits == 0 && cta_splits == 0 && plan.cta_splits == 1 && plan.slices == 1 &&
             chunks >= 128 && ctas > 3 * sms && ctas <= 4 * sms) {
    plan.gs_splits = 8;  // only the last round's tiles split, each in up to 8 K ranges
    plan.gs_tail = 1;
  }
  return plan;
}

size_t sm90_workspace_bytes(const Sm90Plan& plan, int64_t a_rows, int32_t num_experts, int64_t n, int sm_count) {
  if (plan.gs_splits <= 1 || plan.tile_tokens > 16) return 0;
  const int64_t tiles = sm90::token_tile_bound(a_rows, num_experts, plan.tile_tokens) * ceil_div(n, 128);
  if (tiles > sm90::kGsMaxTiles) return 0;
  if (plan.gs_tail) {  // one partial tile per CTA of the grid (launch: at most kGsCtasPerSm per SM)
    const int64_t ctas = sm90::kGsCtasPerSm * int64_t(sm_count > 0 ? sm_count : 1);
    return sm90::gs_layout(std::min<int64_t>(tiles * plan.gs_splits, ctas), 1, 128, plan.tile_tokens).total();
  }
  return sm90::gs_layout(tiles, plan.gs_splits, 128, plan.tile_tokens).total();
}

int sm90_grouped_gemm(const Sm90GemmArgs& a, cudaStream_t stream) {
  // A heuristic GS plan whose workspace is missing or short falls back to the plan without GS.
  Sm90Plan plan = sm90_plan(a.a_rows, a.num_experts, a.n, a.k, a.sm_count, a.tile_tokens, a.slices, a.cta_splits,
                            a.workspace != nullptr ? a.gs_splits : 1);
  const size_t need = plan.gs_splits > 1 ? sm90_workspace_bytes(plan, a.a_rows, a.num_experts, a.n, a.sm_count) : 0;
  if (a.gs_splits == 0 && plan.gs_splits > 1 && (need == 0 || need > a.workspace_bytes))
    plan = sm90_plan(a.a_rows, a.num_experts, a.n, a.k, a.sm_count, a.tile_tokens, a.slices, a.cta_splits, 1);
  if (a.a_dtype == MOE_FP4_BF16) return sm90::dispatch<__nv_bfloat16>(a, plan, stream);
  return sm90::dispatch<__half>(a, plan, stream);
}

}  // namespace moe_fp4
