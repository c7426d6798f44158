// Routing metadata (stages.routing): expert_offsets, blockscale_offsets, slot_to_flat and
// flat_to_slot, deterministic (ascending flat index within an expert).
//
// Ids are bucketed by key = id for ids in [0, E) and key = E ("not served") otherwise, so
// the not-served flat indices fill the slots past expert_offsets[E] (slot_to_flat = -1).
// The flat indices are cut into chunks of whole 256-id tiles:
//   count:   per chunk c, counts[c][key] (warp-aggregated atomics into a zeroed row);
//   scan:    per key, exclusive prefix of counts[.][key] over the chunks (in place), then
//            the prefix sums over experts of m_e and ceil(m_e/128)*128;
//   scatter: per tile, the stable rank of each id among the tile's earlier equal keys
//            (__match_any_sync within the warp, a shared-memory count over earlier warps);
//            slot = expert_offsets[key] + counts[c][key] + rank; then counts[c][key] advances
//            by the tile's count of key.
// Up to one tile of ids (up to kRoutingSingleLaunch for E + 1 > kTilesKeys), one block does all
// three steps in one launch (one chunk), with its counters and the expert offsets in shared memory
// for up to kSharedKeys keys (E+1) (else in the caller's workspace). Past one tile, up to
// routing_tiles_max(E) ids and kTilesKeys keys, one launch of one block per tile that waits for no other
// block: each counts all n ids itself (those before its tile and all of them, in shared memory), so
// it has the offsets and its tile's first ranks without the other blocks' counts
// (routing_tiles_kernel). Beyond, three launches with one block per chunk and the per-chunk rows in
// the workspace, for any E. Launched with PDL (launch.cuh), every routing kernel
// waits for its predecessor first and never allows its dependents early: the stages after
// the routing rely on its metadata being complete when they start.
#include "moe_fp4/common.hpp"
#include "moe_fp4/launch.cuh"
#include "moe_fp4/pipeline.hpp"

namespace moe_fp4 {
namespace {

constexpr int kThreads = kRoutingThreads;
constexpr int kScanThreads = 1024;
constexpr int64_t kMaxChunks = 256;  // keeps the per-key scan over chunks short
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kSharedKeys = 4096;  // counters + offsets: 32 KiB of shared memory

// A counter or offset written by other threads of the block (shared memory, or global memory
// through atomics / other launches: read past L1).
template <bool kShared>
__device__ __forceinline__ int load_counter(const int32_t* p) {
  if constexpr (kShared) return *p;
  return __ldcg(p);
}

struct ChunkPlan {
  int64_t chunk;   // ids per chunk (a multiple of kThreads)
  int64_t chunks;  // number of chunks
};

ChunkPlan plan_chunks(int64_t n) {
  if (n <= kRoutingSingleLaunch) return {kRoutingSingleLaunch, 1};
  const int64_t tiles = ceil_div(n, kThreads);
  const int64_t chunk = ceil_div(tiles, kMaxChunks) * kThreads;
  return {chunk, ceil_div(n, chunk)};
}

__device__ __forceinline__ int key_at(const int32_t* ids, int64_t i, int64_t end, int32_t num_experts) {
  if (i >= end) return -1;  // past the chunk: takes part in warp votes, never counted
  const int32_t id = ids[i];
  return (id >= 0 && id < num_experts) ? id : num_experts;
}

__device__ __forceinline__ bool is_group_leader(unsigned peers) {
  return int(threadIdx.x & 31) == __ffs(peers) - 1;
}

// row[key] += number of ids in [begin, end) with that key.
__device__ void count_keys(const int32_t* ids, int64_t begin, int64_t end, int32_t num_experts, int32_t* row) {
  for (int64_t start = begin; start < end; start += kThreads) {
    const int key = key_at(ids, start + threadIdx.x, end, num_experts);
    const unsigned peers = __match_any_sync(kFullMask, key);
    if (key >= 0 && is_group_leader(peers)) atomicAdd(&row[key], __popc(peers));
  }
}

// Exclusive prefix sums of (a, b) over the block, in place; the block totals are returned.
// blockDim.x must be a multiple of 32.
__device__ void block_exclusive_scan(int& a, int& b, int& total_a, int& total_b) {
  __shared__ int warp_a[32], warp_b[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int ia = a, ib = b;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int ta = __shfl_up_sync(kFullMask, ia, d), tb = __shfl_up_sync(kFullMask, ib, d);
    if (lane >= d) ia += ta, ib += tb;
  }
  if (lane == 31) warp_a[warp] = ia, warp_b[warp] = ib;
  __syncthreads();
  if (warp == 0) {
    int wa = lane < warps ? warp_a[lane] : 0, wb = lane < warps ? warp_b[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int ta = __shfl_up_sync(kFullMask, wa, d), tb = __shfl_up_sync(kFullMask, wb, d);
      if (lane >= d) wa += ta, wb += tb;
    }
    warp_a[lane] = wa, warp_b[lane] = wb;
  }
  __syncthreads();
  const int before_a = warp > 0 ? warp_a[warp - 1] : 0, before_b = warp > 0 ? warp_b[warp - 1] : 0;
  total_a = warp_a[warps - 1], total_b = warp_b[warps - 1];
  a = before_a + ia - a, b = before_b + ib - b;
  __syncthreads();  // warp_a/warp_b may be reused by the next call
}

// expert_offsets and blockscale_offsets [E+1] from the per-expert row counts m_e; the expert
// offsets also into `shared_offsets` when given.
// kGlobal false: the shared copy only (expert_offsets and blockscale_offsets are not written).
template <bool kShared, bool kGlobal = true>
__device__ void write_offsets(const int32_t* counts, int32_t num_experts, int32_t* expert_offsets,
                              int32_t* blockscale_offsets, int32_t* shared_offsets = nullptr) {
  int carry_rows = 0, carry_padded = 0;
  for (int32_t first = 0; first < num_experts; first += blockDim.x) {
    const int32_t e = first + threadIdx.x;
    const int m = e < num_experts ? load_counter<kShared>(&counts[e]) : 0;
    int rows = m, padded = (m + 127) / 128 * 128, total_rows, total_padded;
    block_exclusive_scan(rows, padded, total_rows, total_padded);
    if (e < num_experts) {
      if constexpr (kGlobal) {
        expert_offsets[e] = carry_rows + rows;
        blockscale_offsets[e] = carry_padded + padded;
      }
      if (shared_offsets != nullptr) shared_offsets[e] = carry_rows + rows;
    }
    carry_rows += total_rows, carry_padded += total_padded;
  }
  if (threadIdx.x == 0) {
    if constexpr (kGlobal) {
      expert_offsets[num_experts] = carry_rows;
      blockscale_offsets[num_experts] = carry_padded;
    }
    if (shared_offsets != nullptr) shared_offsets[num_experts] = carry_rows;
  }
}

// Assigns the slots of ids [begin, end). row[key] holds, on entry, the number of ids with
// that key before `begin`; it is advanced tile by tile. `offsets`: the expert offsets (E+1),
// in shared memory when kShared (then row is too).
template <bool kShared>
__device__ void scatter_keys(const RoutingArgs& a, int64_t begin, int64_t end, int32_t* row,
                             const int32_t* offsets) {
  __shared__ __align__(16) int tile_keys[kThreads];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t start = begin; start < end; start += kThreads) {
    const int64_t i = start + threadIdx.x;
    const int key = key_at(a.ids, i, end, a.num_experts);
    tile_keys[threadIdx.x] = key;
    __syncthreads();
    const unsigned peers = __match_any_sync(kFullMask, key);
    int rank = __popc(peers & ((1u << lane) - 1u));
    const int4* earlier = reinterpret_cast<const int4*>(tile_keys);
    for (int j = 0; j < warp * 8; ++j) {
      const int4 k4 = earlier[j];
      rank += int(k4.x == key) + int(k4.y == key) + int(k4.z == key) + int(k4.w == key);
    }
    if (key >= 0) {
      const int32_t slot = load_counter<kShared>(&offsets[key]) + load_counter<kShared>(&row[key]) + rank;
      const bool served = key < a.num_experts;
      a.flat_to_slot[i] = served ? slot : -1;
      a.slot_to_flat[slot] = served ? int32_t(i) : -1;
    }
    __syncthreads();  // row[] and tile_keys are read by everyone before they change
    if (key >= 0 && is_group_leader(peers)) atomicAdd(&row[key], __popc(peers));
    __syncthreads();
  }
}

__device__ void zero(int32_t* row, int64_t count) {
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) row[i] = 0;
}

// Small n: everything in one block, one launch. kShared: the E+1 counters and offsets in
// dynamic shared memory (E < kSharedKeys); else one row of E+1 counters in the workspace.
template <bool kShared>
__global__ void __launch_bounds__(kThreads) routing_single_kernel(RoutingArgs a) {
  extern __shared__ int32_t shared_keys[];  // kShared: counters [E+1], expert offsets [E+1]
  const int64_t keys = int64_t(a.num_experts) + 1;
  int32_t* row = kShared ? shared_keys : static_cast<int32_t*>(a.workspace);
  int32_t* offsets = kShared ? shared_keys + keys : nullptr;
  wait_for_predecessor();
  zero(row, keys);
  __syncthreads();
  count_keys(a.ids, 0, a.n, a.num_experts, row);
  __syncthreads();
  write_offsets<kShared>(row, a.num_experts, a.expert_offsets, a.blockscale_offsets, offsets);
  __syncthreads();
  zero(row, keys);
  __syncthreads();
  scatter_keys<kShared>(a, 0, a.n, row, kShared ? offsets : a.expert_offsets);
}

// before[key] = the ids in [0, begin) with that key, all[key] = those in [begin, n) (the caller then
// adds before into all): one shared-memory atomic per id. Each thread loads kCountLoads ids (a tile
// apart) before it counts any, so that their loads are in flight together.
constexpr int kCountLoads = 8;
__device__ void count_before_and_from(const int32_t* ids, int64_t n, int64_t begin, int32_t num_experts,
                                      int32_t* before, int32_t* from) {
  for (int64_t start = 0; start < n; start += kCountLoads * kThreads) {
    int key[kCountLoads];
#pragma unroll
    for (int j = 0; j < kCountLoads; ++j) key[j] = key_at(ids, start + j * kThreads + threadIdx.x, n, num_experts);
#pragma unroll
    for (int j = 0; j < kCountLoads; ++j)
      if (key[j] >= 0) atomicAdd(start + j * kThreads + threadIdx.x < begin ? &before[key[j]] : &from[key[j]], 1);
  }
}

// One tile of ids per block (kThreads < n <= routing_tiles_max(E), E + 1 <= kTilesKeys keys), one
// launch. Every block counts all n ids (above; the ids are 1 to 64 KB, read from L2 by all but the
// first blocks), derives the offsets itself (block 0 also writes them) and scatters its own tile
// with the counts of the ids before it as the starting ranks: the same slots as the one-block and
// three-launch paths, with no block waiting for another. It replaces three launches (count, scan,
// scatter: 9.2 us before the first quantization starts at Qwen3 M = 256 on the H100, warm,
// tests/results/h100-2026-12-06-s33/s33a/timeline.log) and, up to 1024 ids, the one block's serial
// loop over the tiles. Measured on the H100 (tests/results/h100-2026-12-06-s34, call s34b: the
// routing stage alone, cold L2, µs, the earlier paths -> this kernel): Qwen3-30B-A3B (E = 128, top-8)
// M = 64 / 128 / 256 / 512 / 1024 / 2048: 10.1 / 14.8 / 12.2 / 12.6 / 16.5 / 21.8 -> 7.7 / 7.6 / 8.5 /
// 9.7 / 12.8 / 18.3 (whole forward 165.0 / 178.9 / 183.3 / 237.5 / 286.8 / 524.2 -> 163.2 / 170.8 /
// 179.8 / 234.5 / 282.7 / 518.8); DeepSeek-V3 (E = 256) M = 256 14.0 -> 8.4, M = 2048 30.1 -> 18.2;
// Llama-4-Scout (E = 16, top-1) M = 1024 14.1 -> 7.5, 4096 10.2 -> 9.6 but 16384 13.5 -> 17.6 (its few
// keys meet in a warp's atomics; 4 us of a 7.9 ms forward), hence also routing_tiles_max's bound by E.
// Counting with warp-aggregated atomics (__match_any_sync per id, s34a) cost more per id than it saved:
// Qwen3 M = 2048 31.0 us, M = 4096 (32768 ids) 54.4 against three launches' 22.3, hence
// kRoutingTilesMax. With every id on one key, each warp's atomics serialize (a few microseconds more
// at 16384 ids, never wrong).
constexpr int64_t kTilesKeys = 2048;  // all, before and offsets: 24 KiB of shared memory
__global__ void __launch_bounds__(kThreads) routing_tiles_kernel(RoutingArgs a) {
  extern __shared__ int32_t shared_keys[];  // all [E+1], before [E+1], offsets [E+1]
  const int64_t keys = int64_t(a.num_experts) + 1;
  int32_t* all = shared_keys;
  int32_t* before = shared_keys + keys;
  int32_t* offsets = shared_keys + 2 * keys;
  const int64_t begin = int64_t(blockIdx.x) * kThreads, end = begin + kThreads < a.n ? begin + kThreads : a.n;
  wait_for_predecessor();
  zero(all, 2 * keys);
  __syncthreads();
  count_before_and_from(a.ids, a.n, begin, a.num_experts, before, all);
  __syncthreads();
  for (int64_t key = threadIdx.x; key < keys; key += blockDim.x) all[key] += before[key];
  __syncthreads();
  if (blockIdx.x == 0)
    write_offsets<true, true>(all, a.num_experts, a.expert_offsets, a.blockscale_offsets, offsets);
  else
    write_offsets<true, false>(all, a.num_experts, nullptr, nullptr, offsets);
  __syncthreads();
  scatter_keys<true>(a, begin, end, before, offsets);
}

// Large n, step 1: counts[c][key] for chunk c = blockIdx.x.
__global__ void __launch_bounds__(kThreads) routing_count_kernel(RoutingArgs a, int64_t chunk) {
  const int64_t keys = int64_t(a.num_experts) + 1;
  int32_t* row = static_cast<int32_t*>(a.workspace) + blockIdx.x * keys;
  const int64_t begin = blockIdx.x * chunk;
  wait_for_predecessor();
  zero(row, keys);
  __syncthreads();
  count_keys(a.ids, begin, begin + chunk < a.n ? begin + chunk : a.n, a.num_experts, row);
}

// Large n, step 2 (one block): per key, the exclusive prefix over chunks in place, the totals
// in the row after the last chunk, then the offsets. Up to 32 chunks: one warp per key, lane c
// holding chunk c's count (a warp-wide scan). This was the kernel for every chunk count before
// session 15 (then with kMaxChunks / 32 counts per lane); for up to 32 chunks it stays faster
// than the coalesced form below: 15.3 / 17.2 against 20.9 / 21.5 us for the routing stage at
// M = 256 / 1024 of Qwen3 (8 / 32 chunks) on the H200, tests/results/h200-2026-12-03-s15
// (call 1, qa_base; call 2, qf0).
constexpr int64_t kWarpScanChunks = 32;
__global__ void __launch_bounds__(kScanThreads) routing_scan_warps_kernel(RoutingArgs a, int64_t chunks) {
  const int64_t keys = int64_t(a.num_experts) + 1;
  int32_t* counts = static_cast<int32_t*>(a.workspace);
  int32_t* totals = counts + chunks * keys;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  wait_for_predecessor();
  for (int64_t key = warp; key < keys; key += warps) {
    const int v = lane < chunks ? __ldcg(&counts[lane * keys + key]) : 0;
    int incl = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int t = __shfl_up_sync(kFullMask, incl, d);
      if (lane >= d) incl += t;
    }
    if (lane < chunks) counts[lane * keys + key] = incl - v;
    if (lane == 31) totals[key] = incl;
  }
  __syncthreads();
  write_offsets<false>(totals, a.num_experts, a.expert_offsets, a.blockscale_offsets);
}

// More chunks (up to kMaxChunks): the same results, the block taking the keys kScanKeys at a
// time: thread (g, j) of kScanGroups x kScanKeys holds key kb + j over the chunks of group g
// (kMaxChunks / kScanGroups of them), so that each load and store of a chunk's row is one
// coalesced run of kScanKeys counters (a warp per key with its lanes along the chunks touched a
// separate sector per counter: ~70 us for one block at n = 131072 on the H200,
// tests/results/h200-2026-12-03-s14/call3/ncu_qwen.txt; this form: routing 67.0 -> 28.4 us at
// Qwen3 M = 16384, 36.7 -> 22.7 at M = 4096, tests/results/h200-2026-12-03-s15). The group sums meet in shared memory;
// the integer sums are exact, so the result does not depend on the order.
constexpr int kScanKeys = 64;
constexpr int kScanGroups = kScanThreads / kScanKeys;
constexpr int kScanPerGroup = int(kMaxChunks / kScanGroups);
static_assert(kScanKeys * kScanGroups == kScanThreads && kScanPerGroup * kScanGroups == kMaxChunks,
              "the scan block covers kScanKeys keys and kMaxChunks chunks");
__global__ void __launch_bounds__(kScanThreads) routing_scan_kernel(RoutingArgs a, int64_t chunks) {
  __shared__ int group_sum[kScanGroups][kScanKeys];
  const int64_t keys = int64_t(a.num_experts) + 1;
  int32_t* counts = static_cast<int32_t*>(a.workspace);
  int32_t* totals = counts + chunks * keys;
  const int j = int(threadIdx.x) % kScanKeys, g = int(threadIdx.x) / kScanKeys;
  const int64_t c0 = int64_t(g) * kScanPerGroup;
  wait_for_predecessor();
  for (int64_t kb = 0; kb < keys; kb += kScanKeys) {
    const int64_t key = kb + j;
    // All of the group's counts are loaded before any is rewritten: loads and stores to the
    // same array in one loop serialized every load behind the previous store (a chain of L2
    // round trips per chunk, 15 -> 25 us for the routing at M = 256 on the H200,
    // tests/results/h200-2026-12-03-s15/call1).
    int v[kScanPerGroup];
    int sum = 0;
#pragma unroll
    for (int i = 0; i < kScanPerGroup; ++i) {
      v[i] = key < keys && c0 + i < chunks ? __ldcg(&counts[(c0 + i) * keys + key]) : 0;
      sum += v[i];
    }
    group_sum[g][j] = sum;
    __syncthreads();
    int running = 0;
    for (int h = 0; h < g; ++h) running += group_sum[h][j];
    if (key < keys) {
#pragma unroll
      for (int i = 0; i < kScanPerGroup; ++i) {
        if (c0 + i < chunks) counts[(c0 + i) * keys + key] = running;
        running += v[i];
      }
      if (g == kScanGroups - 1) totals[key] = running;
    }
    __syncthreads();  // group_sum is rewritten by the next keys
  }
  __syncthreads();
  write_offsets<false>(totals, a.num_experts, a.expert_offsets, a.blockscale_offsets);
}

// Large n, step 3: slots of chunk c = blockIdx.x.
__global__ void __launch_bounds__(kThreads) routing_scatter_kernel(RoutingArgs a, int64_t chunk) {
  const int64_t keys = int64_t(a.num_experts) + 1;
  int32_t* row = static_cast<int32_t*>(a.workspace) + blockIdx.x * keys;
  const int64_t begin = blockIdx.x * chunk;
  wait_for_predecessor();
  scatter_keys<false>(a, begin, begin + chunk < a.n ? begin + chunk : a.n, row, a.expert_offsets);
}

}  // namespace

size_t routing_workspace_bytes(int64_t n, int32_t num_experts) {
  const ChunkPlan plan = plan_chunks(n);
  const int64_t rows = plan.chunks == 1 ? 1 : plan.chunks + 1;  // + the totals row
  return size_t(rows * (int64_t(num_experts) + 1) * int64_t(sizeof(int32_t)));
}

int launch_routing(const RoutingArgs& args, cudaStream_t stream) {
  const ChunkPlan plan = plan_chunks(args.n);
  const int64_t keys = int64_t(args.num_experts) + 1;
  if (args.n > kThreads && args.n <= routing_tiles_max(args.num_experts) && keys <= kTilesKeys) {
    return cuda_status(launch_kernel(routing_tiles_kernel, dim3(unsigned(ceil_div(args.n, int64_t(kThreads)))),
                                     dim3(kThreads), size_t(3 * keys) * sizeof(int32_t), stream, args),
                       "routing kernel launch");
  }
  if (plan.chunks == 1) {
    const bool shared = keys <= kSharedKeys;
    return cuda_status(launch_kernel(shared ? routing_single_kernel<true> : routing_single_kernel<false>, dim3(1),
                                     dim3(kThreads), shared ? size_t(2 * keys) * sizeof(int32_t) : 0, stream, args),
                       "routing kernel launch");
  }
  const dim3 chunks(unsigned(plan.chunks));
  MOE_FP4_TRY(cuda_status(launch_kernel(routing_count_kernel, chunks, dim3(kThreads), 0, stream, args, plan.chunk),
                          "routing count kernel launch"));
  MOE_FP4_TRY(cuda_status(launch_kernel(plan.chunks <= kWarpScanChunks ? routing_scan_warps_kernel : routing_scan_kernel,
                                        dim3(1), dim3(kScanThreads), 0, stream, args, plan.chunks),
                          "routing scan kernel launch"));
  return cuda_status(launch_kernel(routing_scatter_kernel, chunks, dim3(kThreads), 0, stream, args, plan.chunk),
                     "routing scatter kernel launch");
}

}  // namespace moe_fp4
