// NVFP4 grouped GEMM for Hopper (sm_90a: H100, H200), built only for the 90a entry of
// MOE_FP4_CUDA_ARCHS. Hopper has no FP4 tensor cores: the weights (NVFP4, prepared by
// moe_fp4_sm90_prepare_weights, layout in include/moe_fp4/sm90_layout.cuh) are dequantized in
// registers to exact 16-bit values (times 2^-8) and fed as the register operand A of
//   wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}   (RS form)
// with the 16-bit activation tile as operand B from shared memory (128-byte swizzle, brought
// by TMA), fp32 accumulation, and out = alpha[e*S+h] * 2^8 * acc rounded to the 16-bit dtype.
//
// Swap-AB: weights are wgmma's M (64 rows per consumer warpgroup), tokens its N (the token
// tile BN). One CTA = WG consumer warpgroups (64*WG weight rows) + 1 producer warp. Per 64-wide
// K chunk the producer fills one stage of a STAGES-deep shared-memory ring (mbarriers full /
// empty, one transaction count per stage): the activation tile [BN x 64] by a 2-D TMA load
// (128-byte swizzle) and, for each consumer warp, its 512 code bytes and 64 scale bytes of the
// prepared layout by 1-D bulk copies (so the weight stream has STAGES chunks in flight without
// using registers). Each consumer lane reads its fragment (one 16-byte and one broadcast 8-byte
// shared load), dequantizes chunk c+1 while the 4 wgmmas of chunk c run (two register
// buffers; wgmma.wait_group 1 frees the older one and its stage), then the tile goes through
// shared memory for 16-byte stores.
//
// Static grid, no host synchronization: blockIdx.x is a token tile in [0, ceil(a_rows/BN) +
// min(E, a_rows)) (a bound on sum_e ceil(m_e/BN)), blockIdx.y a 64*WG-row weight tile. Each
// CTA scans expert_offsets (block-wide prefix sum of ceil(m_e/BN)) to find its expert and tile;
// CTAs past the last tile exit at once, empty experts own no tile. Rows past
// expert_offsets[E] (and offsets outside [0, a_rows]) are never written.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "moe_fp4/common.hpp"
#include "moe_fp4/gemm.hpp"
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

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_u32(bar)),
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

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void consumer_sync(int threads) {
  asm volatile("bar.sync 1, %0;\n" ::"r"(threads) : "memory");
}

// wgmma descriptor of a K-major, 128-byte-swizzled tile (rows of 128 bytes, 8-row groups
// 1024 bytes apart, LBO unused), starting `addr` (the tile base is 1024-byte aligned; the k16
// step j starts 32*j bytes into the swizzle row).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ int64_t clamp_row(int64_t v, int64_t rows) { return v < 0 ? 0 : (v > rows ? rows : v); }

// Block-wide: the expert and the tile within it of token tile `t` (s_tile[0] = -1 if none).
template <int BN>
__device__ __forceinline__ void find_tile(const Params& p, int t, int* s_tile, int* s_scan) {
  const int tid = threadIdx.x, nt = blockDim.x;
  const int E = p.num_experts;
  const int per = (E + nt - 1) / nt;
  const int lo = min(tid * per, E), hi = min(lo + per, E);
  int local = 0;
  int64_t prev = lo < hi ? clamp_row(p.offsets[lo], p.a_rows) : 0;
  for (int e = lo; e < hi; ++e) {
    const int64_t next = clamp_row(p.offsets[e + 1], p.a_rows);
    if (next > prev) local += int((next - prev + BN - 1) / BN);
    prev = next > prev ? next : prev;
  }
  const int lane = tid & 31, warp = tid >> 5;
  int incl = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) s_scan[warp] = incl;
  if (tid == 0) s_tile[0] = -1;
  __syncthreads();
  int excl = incl - local;
  for (int w = 0; w < warp; ++w) excl += s_scan[w];
  if (t >= excl && t < excl + local) {
    int64_t pr = clamp_row(p.offsets[lo], p.a_rows);
    for (int e = lo; e < hi; ++e) {
      const int64_t next = clamp_row(p.offsets[e + 1], p.a_rows);
      const int tiles = next > pr ? int((next - pr + BN - 1) / BN) : 0;
      if (t < excl + tiles) {
        s_tile[0] = e;
        s_tile[1] = t - excl;
        break;
      }
      excl += tiles;
      pr = next > pr ? next : pr;
    }
  }
  __syncthreads();
}

// Shared memory: [STAGES activation tiles][STAGES weight stages][barriers]; the epilogue tile
// reuses the front.
template <int BN, int WG, int STAGES>
struct Smem {
  static constexpr int kRows = 64 * WG;
  static constexpr int kWarps = 4 * WG;
  static constexpr int kStageBytes = BN * 128;  // BN token rows x 64 16-bit values (1024-byte multiple)
  static constexpr int kWeightBytes = kWarps * (kChunkCodeBytes + kChunkScaleBytes);
  static constexpr int kWeights = STAGES * kStageBytes;  // offset of the weight stages
  static constexpr int kPitch = kRows + 8;  // epilogue tile row (elements), padded against bank conflicts
  static constexpr int kPipeline = kWeights + STAGES * kWeightBytes;
  static constexpr int kEpilogue = BN * kPitch * 2;
  static constexpr int kBarriers = (kPipeline > kEpilogue ? kPipeline : kEpilogue);
  static constexpr int kBytes = kBarriers + 2 * STAGES * 8 + 1024;  // + alignment slack
  static_assert(kStageBytes % 1024 == 0, "128-byte swizzle atoms need 1024-byte aligned tiles");
};

template <typename T, int BN, int WG, int STAGES, int MINB>
__global__ void __launch_bounds__(WG * 128 + 32, MINB) gemm_kernel(const __grid_constant__ CUtensorMap tmap,
                                                                  const Params p) {
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  using S = Smem<BN, WG, STAGES>;
  constexpr int kConsumers = WG * 128;
  static_assert(STAGES >= 2, "at least double buffering");

  extern __shared__ uint8_t smem_raw[];
  // 1024-byte aligned by pointer arithmetic on the __shared__ array (so that the compiler keeps
  // the shared address space and emits LDS/STS, not generic loads).
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::kBarriers);
  uint64_t* empty = full + STAGES;
  __shared__ int s_tile[2];
  __shared__ int s_scan[32];

  find_tile<BN>(p, int(blockIdx.x), s_tile, s_scan);
  const int e = s_tile[0];
  if (e < 0) return;
  const int tile = s_tile[1];
  const int64_t start = clamp_row(p.offsets[e], p.a_rows);
  const int64_t end = clamp_row(p.offsets[e + 1], p.a_rows);
  const int64_t row0 = start + int64_t(tile) * BN;
  const int rows_valid = int((end - row0) < BN ? (end - row0) : BN);
  const int nchunks = (p.k + kChunk - 1) / kChunk;
  const int n0 = int(blockIdx.y) * S::kRows;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], WG * 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int nrb = p.n / kRowBlock;
  const int rb0 = n0 / kRowBlock;  // first row block of this CTA
  const int valid_warps = max(0, min(S::kWarps, nrb - rb0));
  const int full_chunks = p.k / kChunk;
  const int tail_steps = (p.k / 16) % kStepsPerChunk;

  if (warp == S::kWarps) {  // producer warp: lane 0 the activation tile, lanes 1.. the weights
    // Lane 1 + i copies warp i's codes, lane 1 + kWarps + i its scales.
    const int job = lane - 1;
    const bool codes_job = job >= 0 && job < valid_warps;
    const bool scales_job = job >= S::kWarps && job - S::kWarps < valid_warps;
    const int jw = codes_job ? job : job - S::kWarps;
    const uint8_t* src_codes = p.w + (codes_job ? code_block_offset(e, rb0 + jw, p.n, p.k) : 0);
    const uint8_t* src_scales = p.ws + (scales_job ? scale_block_offset(e, rb0 + jw, p.n, p.k) : 0);
    if (lane == 0 || codes_job || scales_job) {
      for (int c = 0; c < nchunks; ++c) {
        const int s = c % STAGES, u = c / STAGES;
        const bool tail = c >= full_chunks;
        const uint32_t code_bytes = tail ? 128u * tail_steps : uint32_t(kChunkCodeBytes);
        const uint32_t scale_bytes = tail ? 16u * tail_steps : uint32_t(kChunkScaleBytes);
        if (u > 0) mbar_wait(&empty[s], uint32_t(u - 1) & 1u);
        uint8_t* wst = smem + S::kWeights + s * S::kWeightBytes;
        if (lane == 0) {
          mbar_expect_tx(&full[s], S::kStageBytes + valid_warps * (code_bytes + scale_bytes));
          tma_load_2d(smem + s * S::kStageBytes, &tmap, &full[s], c * kChunk, int(row0));
        } else if (codes_job) {
          bulk_load(wst + jw * kChunkCodeBytes, src_codes + int64_t(c) * kChunkCodeBytes, code_bytes, &full[s]);
        } else {
          bulk_load(wst + S::kWarps * kChunkCodeBytes + jw * kChunkScaleBytes,
                    src_scales + int64_t(c) * kChunkScaleBytes, scale_bytes, &full[s]);
        }
      }
    }
    return;
  }

  // ---------------------------------------------------------------- consumers
  const int wg = warp >> 2, wl = warp & 3;
  const int g = lane >> 2, t4 = lane & 3;
  const bool valid = warp < valid_warps;

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;

  uint32_t A[2][16];

  // This lane's fragment of chunk c from its stage (codes and scales of the prepared layout).
  auto load = [&](int c, uint32_t(&w4)[4], uint32_t(&s2)[2]) {
    const uint8_t* wst = smem + S::kWeights + (c % STAGES) * S::kWeightBytes;
    const uint8_t* cw = wst + warp * kChunkCodeBytes;
    const uint8_t* sw = wst + S::kWarps * kChunkCodeBytes + warp * kChunkScaleBytes;
    if (!valid) {
      w4[0] = w4[1] = w4[2] = w4[3] = 0u;
      s2[0] = s2[1] = 0u;
    } else if (c < full_chunks) {
      const uint4 v = *reinterpret_cast<const uint4*>(cw + lane * 16);
      const uint2 sv = *reinterpret_cast<const uint2*>(sw + g * 8);
      w4[0] = v.x, w4[1] = v.y, w4[2] = v.z, w4[3] = v.w;
      s2[0] = sv.x, s2[1] = sv.y;
    } else {  // tail chunk: 1..3 steps, one word and one scale pair per step
      uint32_t x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool in = j < tail_steps;
        w4[j] = in ? *reinterpret_cast<const uint32_t*>(cw + j * 128 + lane * 4) : 0u;
        x[j] = in ? uint32_t(*reinterpret_cast<const uint16_t*>(sw + j * 16 + g * 2)) : 0u;
      }
      s2[0] = __byte_perm(x[0], x[1], 0x5140);  // [s(0,g) s(1,g) s(0,g+8) s(1,g+8)]
      s2[1] = __byte_perm(x[2], x[3], 0x5140);
    }
  };
  auto dequant = [&](const uint32_t(&w4)[4], const uint32_t(&s2)[2], uint32_t(&a)[16]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t sc = (j & 1) ? Decode<kBf16>::scale_odd(s2[j >> 1]) : Decode<kBf16>::scale_even(s2[j >> 1]);
      uint32_t r[4];
      dequant_step<kBf16>(w4[j], sc, r);
      a[4 * j + 0] = r[0], a[4 * j + 1] = r[1], a[4 * j + 2] = r[2], a[4 * j + 3] = r[3];
    }
  };

  {
    uint32_t w4[4], s2[2];
    mbar_wait(&full[0], 0u);
    load(0, w4, s2);
    dequant(w4, s2, A[0]);
  }

  for (int c0 = 0; c0 < nchunks; c0 += 2) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = c0 + i;
      if (c < nchunks) {
        const int s = c % STAGES;  // full[s] was waited for before dequantizing chunk c
        const uint32_t base = smem_u32(smem + s * S::kStageBytes);
        // All 4 steps even in a tail chunk: there A is 0 past k and TMA filled B with zeros.
        wg_fence();
#pragma unroll
        for (int j = 0; j < kStepsPerChunk; ++j)
          Wgmma<BN, kBf16>::run(acc, A[i & 1][4 * j], A[i & 1][4 * j + 1], A[i & 1][4 * j + 2], A[i & 1][4 * j + 3],
                                sw128_desc(base + 32u * j));
        wg_commit();
        wg_wait<1>();  // chunk c-1 done: its A buffer and its stage are free
        if (c > 0 && lane == 0) mbar_arrive(&empty[(c - 1) % STAGES]);
        if (c + 1 < nchunks) {  // dequantize chunk c+1 while chunk c's wgmmas run
          mbar_wait(&full[(c + 1) % STAGES], uint32_t((c + 1) / STAGES) & 1u);
          uint32_t w4[4], s2[2];
          load(c + 1, w4, s2);
          dequant(w4, s2, A[(i + 1) & 1]);
        }
      }
    }
  }
  wg_wait<0>();
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) asm volatile("" : "+f"(acc[i])::"memory");

  // ---------------------------------------------------------------- epilogue
  consumer_sync(kConsumers);  // every warpgroup is done with the pipeline's shared memory
  T* tile_out = reinterpret_cast<T*>(smem);
  const int rl0 = wg * 64 + wl * 16 + g;  // local rows rl0 and rl0 + 8
  const int rows_per_section = p.n / p.sections;
  float al[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = n0 + rl0 + 8 * h;
    al[h] = r < p.n ? p.alpha[int64_t(e) * p.sections + r / rows_per_section] * kAlphaFactor : 0.0f;
  }
#pragma unroll
  for (int nc = 0; nc < BN / 8; ++nc) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int token = 8 * nc + 2 * t4 + (q & 1);
      const int rl = rl0 + 8 * (q >> 1);
      const float v = acc[4 * nc + q] * al[q >> 1];
      if constexpr (kBf16)
        tile_out[token * S::kPitch + rl] = __float2bfloat16_rn(v);
      else
        tile_out[token * S::kPitch + rl] = __float2half_rn(v);
    }
  }
  consumer_sync(kConsumers);
  constexpr int kVec = S::kRows / 8;
  T* out = static_cast<T*>(p.out);
  for (int idx = tid; idx < BN * kVec; idx += kConsumers) {
    const int token = idx / kVec, v = idx % kVec;
    const int col = n0 + v * 8;
    if (token < rows_valid && col < p.n)
      *reinterpret_cast<uint4*>(out + (row0 + token) * int64_t(p.n) + col) =
          *reinterpret_cast<const uint4*>(tile_out + token * S::kPitch + v * 8);
  }
}

// ---------------------------------------------------------------- host side

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  });
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

template <typename T, int BN, int WG, int STAGES, int MINB>
int launch(const Sm90GemmArgs& a, cudaStream_t stream) {
  using S = Smem<BN, WG, STAGES>;
  static_assert(S::kBytes <= 227 * 1024, "shared memory per block");
  auto kernel = gemm_kernel<T, BN, WG, STAGES, MINB>;
  static std::atomic<uint64_t> configured{0};  // one bit per device ordinal < 64
  const uint64_t bit = uint64_t(1) << (a.device & 63);
  if (!(configured.load(std::memory_order_acquire) & bit)) {
    MOE_FP4_TRY(cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes),
                            "cudaFuncSetAttribute (sm90 grouped GEMM shared memory)"));
    configured.fetch_or(bit, std::memory_order_acq_rel);
  }
  CUtensorMap map;
  std::memset(&map, 0, sizeof(map));
  MOE_FP4_TRY(make_tensor_map(&map, a.a, a.a_dtype, a.a_rows, a.k, BN));
  const int64_t tiles = ceil_div(a.a_rows, BN) + (a.num_experts < a.a_rows ? a.num_experts : a.a_rows);
  if (tiles > INT32_MAX)
    return set_error(MOE_FP4_ERROR_INVALID_ARGUMENT, "a_rows: %lld rows need more than 2^31 token tiles",
                     static_cast<long long>(a.a_rows));
  const dim3 grid(unsigned(tiles), unsigned(ceil_div(a.n, S::kRows)));
  Params p{a.w, a.w_scales, a.alpha, a.expert_offsets, a.out, a.a_rows, a.num_experts, a.sections,
           int32_t(a.n), int32_t(a.k)};
  kernel<<<grid, WG * 128 + 32, S::kBytes, stream>>>(map, p);
  return cuda_status(cudaGetLastError(), "sm90 grouped GEMM kernel launch");
}

template <typename T>
int dispatch(const Sm90GemmArgs& a, int tile_tokens, cudaStream_t stream) {
  switch (tile_tokens) {
    // BN, consumer warpgroups, stages, min CTAs per SM (shared memory per CTA in brackets)
    case 8: return launch<T, 8, 1, 12, 4>(a, stream);     // [40 KB]: 5 CTAs per SM
    case 16: return launch<T, 16, 1, 12, 4>(a, stream);   // [52 KB]: 4
    case 32: return launch<T, 32, 1, 8, 3>(a, stream);    // [51 KB]: 4
    case 64: return launch<T, 64, 2, 6, 1>(a, stream);    // [76 KB]: 2
    default: return launch<T, 128, 2, 6, 1>(a, stream);   // [124 KB]: 1
    // (BN = 256 needs ~190 registers per consumer thread and spills under ptxas's choice here.)
  }
}

}  // namespace
}  // namespace sm90

int sm90_tile_tokens(int64_t a_rows, int32_t num_experts) {
  // r = a_rows / min(E, a_rows) is the mean number of rows of a non-empty expert (at least).
  // Measured on the H200 (csrc/tests/sm90_gemm_check --sweep, Qwen3-30B-A3B GEMM1 and GEMM2,
  // M = 1..4096 tokens, top-8 of 128): the best tile holds about 2r rows up to r = 16 (routing
  // is skewed, and a partial tile still costs a pass over the expert's weights), 64 at r = 64,
  // 128 beyond.
  const int64_t experts = num_experts < a_rows ? num_experts : (a_rows > 0 ? a_rows : 1);
  const int64_t rows = ceil_div(a_rows > 0 ? a_rows : 1, experts);
  if (rows <= 4) return 8;
  if (rows <= 8) return 16;
  if (rows <= 16) return 32;
  if (rows <= 64) return 64;
  return 128;
}

int sm90_grouped_gemm(const Sm90GemmArgs& a, cudaStream_t stream) {
  const int tile = a.tile_tokens > 0 ? a.tile_tokens : sm90_tile_tokens(a.a_rows, a.num_experts);
  if (a.a_dtype == MOE_FP4_BF16) return sm90::dispatch<__nv_bfloat16>(a, tile, stream);
  return sm90::dispatch<__half>(a, tile, stream);
}

}  // namespace moe_fp4
