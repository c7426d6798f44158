// Per-expert NVFP4 quantization of grouped rows (stages.quantize_rows and
// stages.silu_mul_quantize), one kernel body for the device and the host oracle.
//
// Work unit: (scale row p, column quad q) over the whole grouped scale buffer, so that every
// byte of it is written exactly once. A unit whose row p is local row r < m_e of expert e's
// region quantizes slot expert_offsets[e] + r, blocks 4q..4q+3 (64 elements), writes their
// packed bytes and the 4 scale bytes as one word; every other unit writes a zero word
// (padding rows and columns, rows past blockscale_offsets[E]). Units with
// expert_offsets[E] <= p < num_slots also zero packed row p. Inconsistent offsets can only
// make a unit skip its data: every store is bounds-checked.
//
// Optional dequantized output (`values`, the Hopper GEMM's 16-bit activation operand): the
// unit that writes the packed bytes of blocks 4q..4q+3 of a slot also writes their 64 values
// e2m1(code) * f32(scale byte) rounded to the source dtype. That product is exact in both
// bf16 and fp16: |e2m1| <= 6 has 2 significant bits and e4m3 4, so the product has at most
// 6, and its magnitude lies in [2^-10, 2688] (0.5 * 2^-9 .. 6 * 448), inside both formats'
// normal ranges (bf16 from 2^-126, fp16 from 2^-14 up to 65504). The global scale is left to
// the GEMM's alpha. Rows expert_offsets[E] <= p < num_slots are written as zeros like packed.
// packed and scales may be null when values is given (their stores are skipped); with both null
// the kernel runs over the slots only (QuantizeValuesUnit), as the Hopper GEMM needs no codes;
// on a device its CTAs first copy expert_offsets to shared memory (quantize_values_kernel).
// W4A16 (values only, gs null): the rows are not quantized; values receive them as RowReader
// reads them (the source's values, times row_scale or through silu_mul with the reference's
// roundings), the same units and zeros otherwise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "moe_fp4/block_scan.cuh"
#include "moe_fp4/common.hpp"
#include "moe_fp4/launch.cuh"
#include "moe_fp4/nvfp4.cuh"
#include "moe_fp4/pipeline.hpp"

namespace moe_fp4 {
namespace {

constexpr int kBlocksPerUnit = 4;

MOE_FP4_HD int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Largest e in [0, E] with offsets[e] <= row (E when row is past every region), for the
// blockscale or the expert offsets.
MOE_FP4_HD int32_t region_of(const int32_t* offsets, int32_t num_experts, int64_t row) {
  int32_t lo = 0, hi = num_experts;  // invariant: answer in [lo, hi]
  while (lo < hi) {
    int32_t mid = lo + (hi - lo + 1) / 2;
    if (offsets[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The 16 values of block c of the row that `slot` holds, as the reference rounds them.
template <typename T, RowSource kSource>
struct RowReader;

template <typename T>
struct RowReader<T, RowSource::kGather> {
  const T* row = nullptr;  // null: the slot has no valid source row (reads as zeros)
  bool scaled = false;
  float scale = 1.0f;

  MOE_FP4_HD RowReader(const GroupedQuantArgs& a, int64_t slot) {
    int64_t src_row = slot;
    if (a.slot_to_flat != nullptr) {
      const int64_t flat = a.slot_to_flat[slot];
      if (flat < 0 || flat >= a.src_rows * a.topk) return;
      src_row = int64_t(uint32_t(flat) / uint32_t(a.topk));  // 0 <= flat < 2^31 (an int32), topk >= 1: a 32-bit division
      if (a.row_scale != nullptr) {
        scaled = true;
        scale = a.row_scale[flat];
      }
    } else if (slot >= a.src_rows) {
      return;
    }
    row = static_cast<const T*>(a.src) + src_row * a.k;
  }

  MOE_FP4_HD void block(int64_t c, float (&v)[kBlock]) const {
    if (row == nullptr) {
      for (float& x : v) x = 0.0f;
      return;
    }
    load_as_float(row + c * kBlock, v);
    if (scaled) {
      for (float& x : v) x = round_to<T>(mul_rn(x, scale));
    }
  }
};

template <typename T>
struct RowReader<T, RowSource::kSiluMul> {
  const T* gate;  // h[slot, :k]
  const T* up;    // h[slot, k:]

  MOE_FP4_HD RowReader(const GroupedQuantArgs& a, int64_t slot)
      : gate(static_cast<const T*>(a.src) + slot * 2 * a.k), up(gate + a.k) {}

  MOE_FP4_HD void block(int64_t c, float (&v)[kBlock]) const {
    float g[kBlock], u[kBlock];
    load_as_float(gate + c * kBlock, g);
    load_as_float(up + c * kBlock, u);
#pragma unroll
    for (int i = 0; i < kBlock; ++i) v[i] = silu_mul<T>(g[i], u[i]);
  }
};

// The e2m1 value of a code: twice the magnitudes 0 .5 1 1.5 2 3 4 6 are the nibbles of one word.
MOE_FP4_HD float e2m1_value(uint32_t code) {
  const float mag = 0.5f * float((0xC8643210u >> (4u * (code & 7u))) & 0xFu);
  return (code & 8u) ? -mag : mag;
}

// Writes the 16 dequantized values of one block (packed words as quantize_block returns them).
template <typename T>
MOE_FP4_HD void store_block_values(T* dst, const uint32_t (&packed)[2], float sf_value) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = mul_rn(e2m1_value((packed[half] >> (4 * j)) & 0xFu), sf_value);
    store_rounded8(dst + 8 * half, v);
  }
}

template <typename T>
MOE_FP4_HD void zero_block_values(T* dst) {
  float v[kBlock];
  for (float& x : v) x = 0.0f;
  store_block16(dst, v);
}

template <typename T, RowSource kSource>
struct QuantizeUnit {
  GroupedQuantArgs a;

  MOE_FP4_HD void operator()(int64_t unit) const {
    const int64_t blocks = a.k / kBlock;
    const int64_t quads = ceil_div(blocks, kBlocksPerUnit);
    const int64_t cp = quads * kBlocksPerUnit;
    const int64_t row = unit / quads;
    const int64_t q = unit % quads;
    const int64_t first = q * kBlocksPerUnit;
    const int64_t last = first + kBlocksPerUnit < blocks ? first + kBlocksPerUnit : blocks;
    const int64_t routed = clamp64(a.expert_offsets[a.num_experts], 0, a.num_slots);
    const int64_t row_bytes = a.k / 2;

    T* const values = static_cast<T*>(a.values);
    if (row >= routed && row < a.num_slots) {  // slots left over by ids that are not served
      for (int64_t c = first; c < last; ++c) {
        if (a.packed != nullptr) *reinterpret_cast<uint2*>(a.packed + row * row_bytes + c * 8) = make_uint2(0u, 0u);
        if (values != nullptr) zero_block_values(values + row * a.k + c * kBlock);
      }
    }

    const int32_t e = region_of(a.blockscale_offsets, a.num_experts, row);
    const int64_t base = a.blockscale_offsets[e];
    const int64_t r = row - base;
    uint32_t word = 0;
    if (e < a.num_experts && r >= 0) {
      const int64_t begin = a.expert_offsets[e];
      const int64_t m = int64_t(a.expert_offsets[e + 1]) - begin;
      const int64_t region_rows = int64_t(a.blockscale_offsets[e + 1]) - base;
      const int64_t slot = begin + r;
      if (r < m && r < region_rows && slot >= 0 && slot < routed) {
        const RowReader<T, kSource> reader(a, slot);
        const float gs = a.gs[e];
        for (int64_t c = first; c < last; ++c) {
          float v[kBlock];
          reader.block(c, v);
          uint32_t packed[2];
          const uint32_t sf = quantize_block(v, gs, packed);
          if (a.packed != nullptr)
            *reinterpret_cast<uint2*>(a.packed + slot * row_bytes + c * 8) = make_uint2(packed[0], packed[1]);
          if (values != nullptr) store_block_values(values + slot * a.k + c * kBlock, packed, e4m3_to_float(uint8_t(sf)));
          word |= sf << (8 * (c - first));
        }
      }
    }
    const int64_t offset = swizzled_word_offset(base, r, q, cp);
    if (a.scales != nullptr && r >= 0 && offset >= 0 && offset + 4 <= a.scale_rows * cp)
      *reinterpret_cast<uint32_t*>(a.scales + offset) = word;
  }
};

// Block c of `reader`'s row into dst (16 values): quantized with gs[e] and written dequantized
// (W4A4), or with gs null as read, already rounded to T (W4A16: the rows unquantized).
template <typename T, RowSource kSource>
MOE_FP4_HD void store_block_operand(const RowReader<T, kSource>& reader, int64_t c, const float* gs, int32_t e,
                                    T* dst) {
  float v[kBlock];
  reader.block(c, v);
  if (gs != nullptr) quantize_dequantize(v, gs[e]);
  store_block16(dst, v);
}

// Values only (packed and scales null: the Hopper GEMM's operand): work unit (slot, block) over
// the slots alone, not over every padded scale row, one block per unit so that a decode batch's
// few rows still spread over many threads. The values are QuantizeUnit's (the same
// quantize_block of the same inputs); slots past expert_offsets[E], and any slot outside its
// expert's rows (inconsistent offsets), get zeros.
template <typename T, RowSource kSource>
struct QuantizeValuesUnit {
  GroupedQuantArgs a;
  const int32_t* offsets = nullptr;  // a copy of a.expert_offsets (the device kernel's in shared memory), else it

  MOE_FP4_HD const int32_t* offs() const { return offsets != nullptr ? offsets : a.expert_offsets; }

  // The expert holding `slot` (E if none): the largest e with expert_offsets[e] <= slot (an
  // empty expert shares its offset with the next, so the largest such e is the one with rows).
  MOE_FP4_HD int32_t expert_of(int64_t slot) const {
    const int64_t routed = clamp64(offs()[a.num_experts], 0, a.num_slots);
    return slot < routed ? region_of(offs(), a.num_experts, slot) : a.num_experts;
  }

  MOE_FP4_HD void operator()(int64_t unit) const {
    const int64_t slot = unit / (a.k / kBlock);
    run(slot, unit % (a.k / kBlock), expert_of(slot));
  }

  // Block c of the row of `slot` (unit slot * k / 16 + c), whose expert_of is e.
  MOE_FP4_HD void run(int64_t slot, int64_t c, int32_t e) const {
    T* const dst = static_cast<T*>(a.values) + slot * a.k + c * kBlock;
    if (e >= a.num_experts || slot >= int64_t(offs()[e + 1])) {
      zero_block_values(dst);
      return;
    }
    store_block_operand(RowReader<T, kSource>(a, slot), c, a.gs, e, dst);
  }
};

// Expert offsets a CTA of the values-only kernel copies to shared memory (E + 1 of them, up to
// 48 KB); with more experts the units read them from global memory. Each unit's expert is a
// binary search over the offsets: ~log2(E) dependent loads, which from global memory (L2) cost
// microseconds at decode, where the kernel is one short wave; one coalesced copy per CTA does not.
constexpr int64_t kStagedOffsets = 48 * 1024 / 4;

// The device kernel: CTA b takes the units [b * per_cta, (b + 1) * per_cta) (u = slot * bpr + c),
// its threads striding by the block, so that (measured with Nsight Compute on the H200 at
// Qwen3 M = 16384, tests/results/h200-2026-12-03-s14/call3/ncu_qwen.txt: issue-bound, ~575
// instructions per block of 16 values, ~40 of them two 64-bit divisions and ~110 the expert's
// binary search):
// - (slot, c) advance by the block's quotient and remainder, without divisions;
// - a thread's next slot is at most a few rows on, so its expert is the last one's while the slot
//   is inside that expert's rows: no search then. Only for offsets that never decrease (checked
//   by the CTA on its staged copy), where that expert is exactly expert_of's; otherwise every
//   unit searches as before;
// - the slots a CTA reads at any time are the same fraction of every expert's rows, and an
//   expert's rows hold ascending tokens (the routing), so the topk reads of a token row fall
//   close in time (L2 hits) instead of once per pass over the experts.
template <typename T, RowSource kSource>
__global__ void __launch_bounds__(kUnitThreads) quantize_values_kernel(GroupedQuantArgs a, int64_t units,
                                                                      int64_t per_cta) {
  extern __shared__ int32_t staged[];
  // Everything after the wait, the offsets too: this kernel may follow a routing launch that lets
  // it start early (the Triton routing kernels do, triton_kernels/_gdc.py, in a mixed stage set).
  wait_for_predecessor();
  allow_dependents();
  QuantizeValuesUnit<T, kSource> body{a};
  bool sorted = false;
  if (a.num_experts + 1 <= kStagedOffsets) {
    for (int i = threadIdx.x; i <= a.num_experts; i += blockDim.x) staged[i] = a.expert_offsets[i];
    __syncthreads();
    int ok = 1;
    for (int i = threadIdx.x; i < a.num_experts; i += blockDim.x) ok &= int(staged[i] <= staged[i + 1]);
    sorted = __syncthreads_and(ok) != 0;
    body.offsets = staged;
  }
  const int64_t bpr = a.k / kBlock, step = blockDim.x;
  const int64_t begin = int64_t(blockIdx.x) * per_cta;
  const int64_t end = begin + per_cta < units ? begin + per_cta : units;
  const int64_t ds = step / bpr, dc = step % bpr;
  int32_t e = a.num_experts;
  int64_t lo = 0, hi = 0;  // expert e's rows [lo, hi) (empty: none known)
  int64_t slot = (begin + threadIdx.x) / bpr, c = (begin + threadIdx.x) % bpr;
  for (int64_t u = begin + threadIdx.x; u < end; u += step) {
    if (!(sorted && slot >= lo && slot < hi)) {
      e = body.expert_of(slot);
      lo = e < a.num_experts ? body.offs()[e] : 0;
      hi = e < a.num_experts ? body.offs()[e + 1] : 0;
    }
    body.run(slot, c, e);
    slot += ds, c += dc;
    if (c >= bpr) c -= bpr, ++slot;
  }
}

template <typename T, RowSource kSource>
int quantize_values(const GroupedQuantArgs& a, int device, cudaStream_t stream) {
  const int64_t units = a.num_slots * (a.k / kBlock);
  if (units == 0) return MOE_FP4_OK;
  if (device == MOE_FP4_HOST)  // the host oracle: the same units, offsets read in place
    return for_each_unit(QuantizeValuesUnit<T, kSource>{a}, units, device, stream, "");
  const size_t smem = a.num_experts + 1 <= kStagedOffsets ? size_t(a.num_experts + 1) * 4 : 0;
  // Units per CTA: the grid_for grid's share, in whole blocks of threads.
  const int64_t ctas = grid_for(units, kUnitThreads, sm_count(device));
  const int64_t per_cta = ceil_div(ceil_div(units, ctas), int64_t(kUnitThreads)) * kUnitThreads;
  const dim3 grid(unsigned(ceil_div(units, per_cta)));
  return cuda_status(launch_kernel(quantize_values_kernel<T, kSource>, grid, dim3(kUnitThreads), smem, stream, a, units,
                                   per_cta),
                     "grouped quantization kernel launch (values)");
}

// ------------------------------------------------------------------ values by token (gather)

// The slot of flat index `flat` (flat_to_slot), or -1 where it has none below routed_slots (an id
// not served, or a slot out of range).
MOE_FP4_HD int64_t routed_slot_of(const int32_t* flat_to_slot, int64_t flat, int64_t routed_slots) {
  const int64_t slot = flat_to_slot[flat];
  return slot >= 0 && slot < routed_slots ? slot : -1;
}

// The values-only gather quantization in token order (moe_fp4_quantize_values_by_token): unit
// (row t of x, block c) reads x's block once and writes it to the topk slots of row t
// (flat_to_slot[t * topk + j]), each quantized with its expert's global scale, where the slot
// order (QuantizeValuesUnit) reads the row once per slot. At Qwen3-30B-A3B M = 16384 on the H100
// the slot-order kernel read 436 MB from DRAM for 64 MB of x (Nsight Compute: 14 % of its L2 read
// sectors hit; tests/results/h100-2026-12-06-s33), DRAM-bound at 955 MB in all. The values are
// QuantizeValuesUnit's bit for bit: per slot the same row (times row_scale[flat] rounded to T),
// the same quantize_dequantize with gs[e] (the block's maximum taken once per row when no row_scale
// changes it: abs_max is exact and does not depend on the slot), the same zeros for a slot outside
// its expert's rows. Units past the rows' zero the slots past expert_offsets[E] (the ids not
// served, whose flat_to_slot is -1). flat_to_slot and slot_to_flat must be moe_fp4_routing's (each
// routed slot the image of exactly one flat index): a slot that no flat index names is not
// written; every store is bounds-checked.
template <typename T>
struct TokenValuesUnit {
  GroupedQuantArgs a;                  // (slot_to_flat, blockscale_offsets, packed and scales unused)
  const int32_t* flat_to_slot;         // [x_rows * topk]
  int32_t groups;                      // the topk copies of a row split into this many units (token_groups)
  const int32_t* offsets = nullptr;    // a copy of a.expert_offsets (the device kernel's in shared memory), else it
  // The device kernel's table of slot buckets (null: a binary search per slot): bucket[b] is the
  // expert of slot b << shift, for offsets that never decrease (token_values_kernel builds it).
  const int32_t* bucket = nullptr;
  int shift = 0;

  // The expert of routed slot s: region_of's (the largest e with offsets[e] <= s), from the table by
  // stepping over the experts that end at or before s (the bucket's expert starts at or before it).
  MOE_FP4_HD int32_t expert_of(int64_t s) const {
    if (bucket == nullptr) return region_of(offs(), a.num_experts, s);
    int32_t e = bucket[s >> shift];
    while (int64_t(offs()[e + 1]) <= s) ++e;
    return e;
  }

  MOE_FP4_HD const int32_t* offs() const { return offsets != nullptr ? offsets : a.expert_offsets; }
  MOE_FP4_HD int64_t routed() const { return clamp64(offs()[a.num_experts], 0, a.num_slots); }
  MOE_FP4_HD T* dst(int64_t slot, int64_t c) const { return static_cast<T*>(a.values) + slot * a.k + c * kBlock; }

  // Block c of row t into its copies j of group g (j in [g * per, (g + 1) * per), per = ceil(topk / groups)).
  MOE_FP4_HD void row(int64_t t, int32_t g, int64_t c, int64_t routed_slots) const {
    float x[kBlock];
    load_as_float(static_cast<const T*>(a.src) + t * a.k + c * kBlock, x);
    const float amax = abs_max(x);  // the block's maximum for every slot without a row_scale
    const int32_t per = (a.topk + groups - 1) / groups;
    const int32_t j1 = (g + 1) * per < a.topk ? (g + 1) * per : a.topk;
    for (int32_t j = g * per; j < j1; ++j) {
      const int64_t flat = t * a.topk + j;
      const int64_t slot = routed_slot_of(flat_to_slot, flat, routed_slots);
      if (slot < 0) continue;
      const int32_t e = expert_of(slot);
      T* const out = dst(slot, c);
      if (e >= a.num_experts || slot >= int64_t(offs()[e + 1])) {
        zero_block_values(out);
        continue;
      }
      float v[kBlock];
      float m = amax;
      if (a.row_scale != nullptr) {
        const float scale = a.row_scale[flat];
#pragma unroll
        for (int i = 0; i < kBlock; ++i) v[i] = round_to<T>(mul_rn(x[i], scale));
        m = abs_max(v);
      } else {
#pragma unroll
        for (int i = 0; i < kBlock; ++i) v[i] = x[i];
      }
      if (a.gs != nullptr) {
        float sf_value, inv;
        scale_of_amax(m, a.gs[e], sf_value, inv);
        dequantize_on_grid(v, sf_value, inv);
      }
      store_block16(out, v);
    }
  }

  // The host oracle's unit: the rows' first (x_rows * groups * bpr units: unit (t * groups + g) * bpr
  // + c), then every slot's blocks, of which those past expert_offsets[E] are zeroed.
  MOE_FP4_HD void operator()(int64_t unit) const {
    const int64_t bpr = a.k / kBlock, rows = a.src_rows * groups * bpr;
    const int64_t r = routed();
    if (unit < rows) {
      const int64_t tg = unit / bpr;
      row(tg / groups, int32_t(tg % groups), unit % bpr, r);
      return;
    }
    const int64_t slot = (unit - rows) / bpr;
    if (slot >= r) zero_block_values(dst(slot, (unit - rows) % bpr));
  }
};

// Units per row: the topk copies of a row split into `groups` units while the rows' units alone
// would not fill the GPU's resident threads twice (a thread takes its copies one after another: at
// M = 64 of Qwen3-30B-A3B one unit per block would leave 8192 threads for 65536 copies), each
// group then reading the row's block again (from L2: few rows).
MOE_FP4_HD int32_t token_groups(int64_t x_rows, int64_t k, int32_t topk, int sms) {
  const int64_t units = x_rows * (k / kBlock), want = int64_t(sms) * 2048 * 2;
  if (units <= 0 || units >= want) return 1;
  const int64_t g = (want + units - 1) / units;
  const int32_t per = (topk + int32_t(g < topk ? g : topk) - 1) / int32_t(g < topk ? g : topk);
  return (topk + per - 1) / per;  // no group without copies
}

// Slot buckets of the values-by-token kernel's expert table (shared memory beside the offsets).
constexpr int kExpertBuckets = 1024;

// The device kernel: CTA b takes the row units [b * per_cta, (b + 1) * per_cta) (u = (t * groups
// + g) * bpr + c, advanced without divisions as in quantize_values_kernel), then the grid strides
// over the blocks of the slots past expert_offsets[E] (zeros). The expert offsets are staged in
// shared memory as there, with a table of kExpertBuckets slot buckets for offsets that never
// decrease and start at 0 (moe_fp4_routing's): a slot's expert is its bucket's, then a step or two
// over the experts that end before the slot, where a binary search over the offsets took ~100
// instructions per slot (a quarter of the kernel's, by the SASS), and the kernel was issue-bound
// (Nsight Compute at Qwen3 M = 16384: 72 % of issue slots busy, 68 MB read from DRAM for 64 MB of x).
template <typename T>
__global__ void __launch_bounds__(kUnitThreads) token_values_kernel(GroupedQuantArgs a, const int32_t* flat_to_slot,
                                                                   int32_t groups, int64_t per_cta) {
  extern __shared__ int32_t staged[];
  wait_for_predecessor();
  allow_dependents();
  TokenValuesUnit<T> body{a, flat_to_slot, groups};
  if (a.num_experts + 1 + kExpertBuckets <= kStagedOffsets) {
    for (int i = threadIdx.x; i <= a.num_experts; i += blockDim.x) staged[i] = a.expert_offsets[i];
    __syncthreads();
    body.offsets = staged;
    int ok = 1;
    for (int i = threadIdx.x; i < a.num_experts; i += blockDim.x) ok &= int(staged[i] <= staged[i + 1]);
    if (__syncthreads_and(ok) != 0 && staged[0] == 0) {
      // Bucket b of kExpertBuckets holds slots [b << shift, (b + 1) << shift): expert e with rows
      // [lo, hi) writes the buckets whose first slot it holds, ceil(lo / 2^shift) .. ceil(hi / 2^shift)
      // - 1, each bucket below the routed slots exactly once.
      int32_t* const table = staged + (a.num_experts + 1);
      const int64_t routed = body.routed();
      int shift = 0;
      while ((int64_t(kExpertBuckets) << shift) < routed) ++shift;
      const int64_t round = (int64_t(1) << shift) - 1;
      for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) {
        const int64_t lo = staged[e], hi = staged[e + 1] < routed ? staged[e + 1] : routed;
        for (int64_t b = (lo + round) >> shift; b < (hi + round) >> shift; ++b) table[b] = e;
      }
      __syncthreads();
      body.bucket = table;
      body.shift = shift;
    }
  }
  const int64_t routed = body.routed();
  const int64_t bpr = a.k / kBlock, step = blockDim.x, units = a.src_rows * groups * bpr;
  const int64_t begin = int64_t(blockIdx.x) * per_cta;
  const int64_t end = begin + per_cta < units ? begin + per_cta : units;
  const int64_t dr = step / bpr, dc = step % bpr;
  int64_t r = (begin + threadIdx.x) / bpr, c = (begin + threadIdx.x) % bpr;  // r = t * groups + g
  for (int64_t u = begin + threadIdx.x; u < end; u += step) {
    if (groups == 1)
      body.row(r, 0, c, routed);
    else
      body.row(r / groups, int32_t(r % groups), c, routed);
    r += dr, c += dc;
    if (c >= bpr) c -= bpr, ++r;
  }
  const int64_t tail = (a.num_slots - routed) * bpr;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < tail; u += int64_t(gridDim.x) * blockDim.x)
    zero_block_values(body.dst(routed + u / bpr, u % bpr));
}

template <typename T>
int quantize_values_by_token(const GroupedQuantArgs& a, const int32_t* flat_to_slot, int device, cudaStream_t stream) {
  const int64_t bpr = a.k / kBlock;
  if (a.num_slots == 0) return MOE_FP4_OK;
  // The host oracle: the same units (the groups of an H100's 132 SMs), offsets read in place.
  if (device == MOE_FP4_HOST) {
    const int32_t groups = token_groups(a.src_rows, a.k, a.topk, 132);
    return for_each_unit(TokenValuesUnit<T>{a, flat_to_slot, groups}, (a.src_rows * groups + a.num_slots) * bpr,
                         device, stream, "");
  }
  const size_t smem =
      a.num_experts + 1 + kExpertBuckets <= kStagedOffsets ? size_t(a.num_experts + 1 + kExpertBuckets) * 4 : 0;
  const int32_t groups = token_groups(a.src_rows, a.k, a.topk, sm_count(device));
  // The grid for the row units (at least one CTA: the tail's zeros), each CTA taking whole blocks of threads.
  const int64_t units = std::max<int64_t>(a.src_rows * groups * bpr, 1);
  const int64_t ctas = grid_for(units, kUnitThreads, sm_count(device));
  const int64_t per_cta = ceil_div(ceil_div(units, ctas), int64_t(kUnitThreads)) * kUnitThreads;
  const dim3 grid(unsigned(ceil_div(units, per_cta)));
  return cuda_status(launch_kernel(token_values_kernel<T>, grid, dim3(kUnitThreads), smem, stream, a, flat_to_slot,
                                   groups, per_cta),
                     "grouped quantization kernel launch (values by token)");
}

// ------------------------------------------------------------------ routing + quantization (decode)

// Work items of the routing outputs: expert_offsets [E+1], blockscale_offsets [E+1],
// flat_to_slot [n], slot_to_flat [n], in that order.
MOE_FP4_HD int64_t routing_items(int64_t n, int32_t num_experts) {
  return 2 * (int64_t(num_experts) + 1) + 2 * n;
}

// The number of entries of the ascending s_exp[0, n) below e.
__device__ __forceinline__ int lower_bound_key(const int* s_exp, int n, int64_t e) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (s_exp[mid] < e) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// stages.routing and the values-only gather quantization (quantize_values_kernel) in one launch,
// for n <= kRoutingQuantizeMaxSlots ids (decode, where each launch's latency is a large part of
// the forward). Every CTA routes all n ids in shared memory, as the routing kernels order them:
// key = id for ids in [0, E), else E (not served), and the slots are the ids sorted by (key, flat
// index) (a bitonic sort of 64-bit (key, index) words, one per thread: the experts in order, each
// expert's flat indices ascending, the not-served ones last). The CTAs share the writes of the
// four routing outputs (expert offsets and padded block-scale offsets by binary search over the
// slots' sorted keys), then quantize their share of the (slot, block) units with
// QuantizeValuesUnit's arithmetic, the slots' flat indices read from shared memory. The same
// bytes as launch_routing + the values kernel. Like the routing kernels it never allows its
// dependents early: the GEMM after it reads the expert offsets before its own wait (launch.cuh).
template <typename T>
__global__ void __launch_bounds__(kUnitThreads) routing_quantize_values_kernel(RoutingArgs r, GroupedQuantArgs q,
                                                                              int64_t units, int64_t per_cta) {
  constexpr int kMax = int(kRoutingQuantizeMaxSlots), kWarps = kUnitThreads / 32;
  static_assert(kMax == kUnitThreads, "one sorted (key, index) word per thread");
  __shared__ uint64_t s_sort[kMax];   // (key << 32) | flat index, sorted: slot order
  __shared__ int s_exp[kMax];         // by slot: its key (ascending)
  __shared__ int32_t s_flat[kMax];    // by slot: its flat index, -1 if not served
  __shared__ int s_slot[kMax];        // by flat index: its slot
  __shared__ int s_starts[kMax + 1];  // by slot: 128-row blocks of the scale layout that start before it
  __shared__ int s_warp[kWarps];
  const int n = int(r.n), tid = int(threadIdx.x);
  const int32_t E = r.num_experts;
  int width = 2;  // the sorted width: a power of two >= n
  while (width < n) width <<= 1;
  wait_for_predecessor();
  if (tid < width) {
    uint64_t word = ~uint64_t(0);  // padding: after every id
    if (tid < n) {
      const int32_t id = r.ids[tid];
      word = (uint64_t(uint32_t(id >= 0 && id < E ? id : E)) << 32) | uint32_t(tid);
    }
    s_sort[tid] = word;
  }
  __syncthreads();
  for (int k = 2; k <= width; k <<= 1) {  // bitonic: the words are distinct (they hold the index)
    for (int j = k >> 1; j > 0; j >>= 1) {
      const int other = tid ^ j;
      if (tid < width && other > tid) {
        const uint64_t a = s_sort[tid], b = s_sort[other];
        if ((a > b) == ((tid & k) == 0)) s_sort[tid] = b, s_sort[other] = a;
      }
      __syncthreads();
    }
  }
  if (tid < n) {
    const uint64_t word = s_sort[tid];
    const int key = int(word >> 32), t = int(uint32_t(word));
    s_exp[tid] = key;
    s_flat[tid] = key < E ? t : -1;
    s_slot[t] = tid;
  }
  __syncthreads();
  // A slot starts a 128-row block when it is served and its rank within its expert is a multiple
  // of 128; s_starts is the exclusive prefix sum of those over the slots (warp scans, then warps).
  int start = 0;
  if (tid < n) start = int(s_exp[tid] < E && (tid - lower_bound_key(s_exp, n, s_exp[tid])) % 128 == 0);
  const int before = block_exclusive_sum(start, s_warp);
  if (tid < n) s_starts[tid] = before;
  if (tid == (n > 0 ? n - 1 : 0)) s_starts[n] = before + start;  // (n = 0: thread 0, 0 + 0)
  __syncthreads();
  const int64_t items = routing_items(n, E), keys = int64_t(E) + 1;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + tid; i < items; i += int64_t(gridDim.x) * blockDim.x) {
    if (i < keys) {
      r.expert_offsets[i] = lower_bound_key(s_exp, n, i);
    } else if (i < 2 * keys) {
      r.blockscale_offsets[i - keys] = 128 * s_starts[lower_bound_key(s_exp, n, i - keys)];
    } else if (i < 2 * keys + n) {
      const int t = int(i - 2 * keys);
      r.flat_to_slot[t] = s_exp[s_slot[t]] < E ? s_slot[t] : -1;
    } else {
      const int s = int(i - 2 * keys - n);
      r.slot_to_flat[s] = s_flat[s];
    }
  }
  GroupedQuantArgs a = q;
  a.slot_to_flat = s_flat;  // RowReader's flat index of a slot, from shared memory
  const int64_t bpr = a.k / kBlock;
  const int64_t begin = int64_t(blockIdx.x) * per_cta;
  const int64_t end = begin + per_cta < units ? begin + per_cta : units;
  for (int64_t u = begin + tid; u < end; u += blockDim.x) {
    const int64_t slot = u / bpr, c = u % bpr;
    const int e = s_exp[slot];
    T* const dst = static_cast<T*>(a.values) + slot * a.k + c * kBlock;
    if (e >= E)
      zero_block_values(dst);
    else
      store_block_operand(RowReader<T, RowSource::kGather>(a, slot), c, a.gs, e, dst);
  }
}

template <typename T>
int routing_quantize_values(const RoutingArgs& r, const GroupedQuantArgs& q, int device, cudaStream_t stream) {
  const int64_t units = r.n * (q.k / kBlock);
  // CTAs: the values kernel's grid for the units (each CTA also routes every id: at most 2 per SM),
  // and enough for the routing outputs of a large E.
  const int sms = sm_count(device);
  const int64_t ctas = std::max<int64_t>(std::min<int64_t>(grid_for(units, kUnitThreads, sms), 2 * int64_t(sms)),
                                         grid_for(routing_items(r.n, r.num_experts), kUnitThreads, sms));
  const int64_t per_cta = ceil_div(ceil_div(units, ctas), int64_t(kUnitThreads)) * kUnitThreads;
  return cuda_status(launch_kernel(routing_quantize_values_kernel<T>, dim3(unsigned(ctas)), dim3(kUnitThreads), 0,
                                   stream, r, q, units, per_cta),
                     "routing and quantization kernel launch");
}

template <RowSource kSource>
int dispatch_dtype(int dtype, const GroupedQuantArgs& a, int device, cudaStream_t stream) {
  const int64_t quads = ceil_div(a.k / kBlock, kBlocksPerUnit);
  const char* what = "grouped quantization kernel launch";
  if (a.packed == nullptr && a.scales == nullptr) {  // values only
    if (dtype == MOE_FP4_BF16) return quantize_values<__nv_bfloat16, kSource>(a, device, stream);
    return quantize_values<__half, kSource>(a, device, stream);
  }
  const int64_t units = a.scale_rows * quads;
  if (dtype == MOE_FP4_BF16) return for_each_unit(QuantizeUnit<__nv_bfloat16, kSource>{a}, units, device, stream, what);
  return for_each_unit(QuantizeUnit<__half, kSource>{a}, units, device, stream, what);
}

}  // namespace

int launch_routing_quantize_values(int dtype, const RoutingArgs& routing, const GroupedQuantArgs& quant, int device,
                                   cudaStream_t stream) {
  // (n = 0 launches too: the offsets are written, all zero, as moe_fp4_routing writes them.)
  if (dtype == MOE_FP4_BF16) return routing_quantize_values<__nv_bfloat16>(routing, quant, device, stream);
  return routing_quantize_values<__half>(routing, quant, device, stream);
}

int launch_quantize_values_by_token(int dtype, const GroupedQuantArgs& args, const int32_t* flat_to_slot, int device,
                                    cudaStream_t stream) {
  if (dtype == MOE_FP4_BF16) return quantize_values_by_token<__nv_bfloat16>(args, flat_to_slot, device, stream);
  return quantize_values_by_token<__half>(args, flat_to_slot, device, stream);
}

int launch_grouped_quantize(RowSource source, int dtype, const GroupedQuantArgs& args, int device,
                            cudaStream_t stream) {
  if (source == RowSource::kGather) return dispatch_dtype<RowSource::kGather>(dtype, args, device, stream);
  return dispatch_dtype<RowSource::kSiluMul>(dtype, args, device, stream);
}

}  // namespace moe_fp4
