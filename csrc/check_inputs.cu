// The data-dependent checks of fused_moe(validate=True) (moe_fp4_check_inputs): whether the
// hidden states and the router weights are finite, and the extremes of the expert ids and of the
// expert map, in one kernel and one read-back. One body (check_slice) for the device and the
// host oracle (device = MOE_FP4_HOST), built with the pipeline kernels.
//
// Device: one grid-stride kernel over all four inputs (x in 16-byte vectors, its unaligned head
// and tail element by element), each thread's partial answer reduced over its warp and block,
// one set of atomics per block into a __device__ scratch; the last block to finish (fence, then
// a ticket counter) moves the answer to a __device__ result area and resets the scratch and the
// counter for the next call, and writes the answer straight into mapped pinned host memory, then
// (after a system-scope fence) the call's sequence number. The launcher waits for that number by
// polling the host word (no copy launched, no stream synchronization: both cost microseconds of
// host time at decode), asking the stream now and then whether it has finished or failed, so a
// kernel that never writes ends the wait with an error. Calls are serialized by a per-device mutex
// (the scratch and the host buffer are per device).
#include <climits>
#include <cstring>
#include <mutex>

#include "moe_fp4/common.hpp"
#include "moe_fp4/pipeline.hpp"

namespace moe_fp4 {
namespace {

constexpr int kCheckThreads = 256;
constexpr int kCheckWarps = kCheckThreads / 32;
constexpr int kCheckBlocksPerSm = 4;
// Work units (vectors of x, weights, ids or map entries) a thread takes before another block is
// added: M = 1 at H = 7168 (896 vectors of x) is one block.
constexpr int64_t kUnitsPerThread = 8;
constexpr int kUnroll = 4;  // vectors of x in flight per thread

// One thread's, one block's or the whole grid's partial answer.
struct CheckAcc {
  uint32_t bad_x;  // non-zero: some element of x is inf or NaN
  uint32_t bad_w;  // non-zero: some weight is inf or NaN
  int64_t ids_min, ids_max, map_min, map_max;
};

MOE_FP4_HD CheckAcc neutral_acc() { return {0u, 0u, INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN}; }

MOE_FP4_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
MOE_FP4_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

MOE_FP4_HD void combine(CheckAcc& acc, const CheckAcc& other) {
  acc.bad_x |= other.bad_x;
  acc.bad_w |= other.bad_w;
  acc.ids_min = min64(acc.ids_min, other.ids_min);
  acc.ids_max = max64(acc.ids_max, other.ids_max);
  acc.map_min = min64(acc.map_min, other.map_min);
  acc.map_max = max64(acc.map_max, other.map_max);
}

// Non-zero iff one of the floats packed in `word` is inf or NaN. `exp` masks their exponent fields
// (0x7F807F80: two bf16, 0x7C007C00: two fp16, 0x7F800000: one fp32); adding the lowest bit of
// each field to the masked word carries into the bit just above the field (the float's sign bit)
// exactly when every bit of the field is set, and never further (so no field disturbs the next).
MOE_FP4_HD constexpr uint32_t nonfinite_bits(uint32_t word, uint32_t exp) {
  const uint32_t low = exp & ~(exp << 1);
  return ((word & exp) + low) & (exp + low);
}

constexpr uint32_t kExpBf16x2 = 0x7F807F80u, kExpFp16x2 = 0x7C007C00u, kExpFp32 = 0x7F800000u;
static_assert(nonfinite_bits(0x7F807F80u, kExpBf16x2) == 0x80008000u && nonfinite_bits(0xFF80u, kExpBf16x2) &&
                  nonfinite_bits(0x7FC10000u, kExpBf16x2) && !nonfinite_bits(0x7F7F7F7Fu, kExpBf16x2) &&
                  !nonfinite_bits(0xFBFF7BFFu, kExpFp16x2) && nonfinite_bits(0x7C010000u, kExpFp16x2) &&
                  nonfinite_bits(0xFF800000u, kExpFp32) && !nonfinite_bits(0xFF7FFFFFu, kExpFp32),
              "nonfinite_bits tells inf and NaN from the largest finite values");

// 16 bytes of x at a 16-byte aligned address.
MOE_FP4_HD uint4 load_vector(const uint4* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  uint4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#endif
}

MOE_FP4_HD uint32_t vector_bits(const uint4& v, uint32_t exp) {
  return nonfinite_bits(v.x, exp) | nonfinite_bits(v.y, exp) | nonfinite_bits(v.z, exp) | nonfinite_bits(v.w, exp);
}

MOE_FP4_HD int64_t id_at(const void* p, int dtype, int64_t i) {
  return dtype == MOE_FP4_INT32 ? int64_t(static_cast<const int32_t*>(p)[i]) : static_cast<const int64_t*>(p)[i];
}

// How x splits: `head` elements up to the first 16-byte boundary, `vectors` whole 16-byte vectors,
// then `tail` elements (head, tail < 8; x is 2-byte aligned).
struct XSplit {
  int64_t head, vectors, tail;

  MOE_FP4_HD XSplit(const void* x, int64_t numel) {
    const int64_t misalign = int64_t(reinterpret_cast<uintptr_t>(x) % 16);
    head = min64(numel, misalign == 0 ? 0 : (16 - misalign) / 2);
    vectors = (numel - head) / 8;
    tail = numel - head - vectors * 8;
  }
  // The elements of x outside the vectors (its head and tail), checked one by one.
  MOE_FP4_HD int64_t scalars() const { return head + tail; }
};

// The partial answer over the units first, first + stride, ... of every input: the whole answer
// with (0, 1) on the host, a thread's share in the grid-stride kernel.
MOE_FP4_HD void check_slice(const CheckInputsArgs& a, int64_t first, int64_t stride, CheckAcc& acc) {
  const uint32_t exp = a.x_dtype == MOE_FP4_BF16 ? kExpBf16x2 : kExpFp16x2;
  const XSplit s(a.x, a.x_numel);
  const uint16_t* x16 = static_cast<const uint16_t*>(a.x);
  const uint4* vec = reinterpret_cast<const uint4*>(x16 + s.head);
  uint32_t bad = 0;
  int64_t i = first;
  for (; i + (kUnroll - 1) * stride < s.vectors; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load_vector(vec + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) bad |= vector_bits(v[u], exp);
  }
  for (; i < s.vectors; i += stride) bad |= vector_bits(load_vector(vec + i), exp);
  for (i = first; i < s.scalars(); i += stride) bad |= nonfinite_bits(x16[i < s.head ? i : i + s.vectors * 8], exp);
  acc.bad_x |= bad;

  const uint32_t* w = reinterpret_cast<const uint32_t*>(a.weights);
  for (i = first; i < a.weights_numel; i += stride) acc.bad_w |= nonfinite_bits(w[i], kExpFp32);
  for (i = first; i < a.ids_numel; i += stride) {
    const int64_t id = id_at(a.ids, a.ids_dtype, i);
    acc.ids_min = min64(acc.ids_min, id);
    acc.ids_max = max64(acc.ids_max, id);
  }
  for (i = first; i < a.map_numel; i += stride) {
    const int64_t id = id_at(a.map, a.map_dtype, i);
    acc.map_min = min64(acc.map_min, id);
    acc.map_max = max64(acc.map_max, id);
  }
}

// The entry's result (moe_fp4.h): flags as 0/1, extremes as they are.
MOE_FP4_HD void write_result(const CheckAcc& acc, int64_t* result) {
  result[0] = acc.bad_x != 0;
  result[1] = acc.bad_w != 0;
  result[2] = acc.ids_min;
  result[3] = acc.ids_max;
  result[4] = acc.map_min;
  result[5] = acc.map_max;
}

// ------------------------------------------------------------------ device

// The grid's running answer (neutral between calls) and the count of blocks that added to it.
struct CheckScratch {
  unsigned int bad_x, bad_w;
  long long ids_min, ids_max, map_min, map_max;
  unsigned int blocks_done;
};
__device__ CheckScratch g_check_scratch = {0u, 0u, LLONG_MAX, LLONG_MIN, LLONG_MAX, LLONG_MIN, 0u};

// Where the last block writes: the result words, then word kCheckResultWords = the call's number.
struct CheckOut {
  long long* words;  // mapped pinned host memory (kCheckResultWords + 1 words)
  long long seq;
};

__device__ __forceinline__ CheckAcc shfl_xor(const CheckAcc& v, int mask) {
  constexpr unsigned kAll = 0xFFFFFFFFu;
  return {__shfl_xor_sync(kAll, v.bad_x, mask), __shfl_xor_sync(kAll, v.bad_w, mask),
          __shfl_xor_sync(kAll, v.ids_min, mask), __shfl_xor_sync(kAll, v.ids_max, mask),
          __shfl_xor_sync(kAll, v.map_min, mask), __shfl_xor_sync(kAll, v.map_max, mask)};
}

__device__ __forceinline__ void warp_combine(CheckAcc& acc) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) combine(acc, shfl_xor(acc, mask));
}

// Reads a scratch word and puts its neutral value back.
__device__ __forceinline__ long long take(long long* p, long long neutral) {
  return static_cast<long long>(atomicExch(reinterpret_cast<unsigned long long*>(p),
                                           static_cast<unsigned long long>(neutral)));
}

__global__ void __launch_bounds__(kCheckThreads) check_inputs_kernel(CheckInputsArgs a, CheckOut out) {
  __shared__ CheckAcc warps[kCheckWarps];
  CheckAcc acc = neutral_acc();
  check_slice(a, int64_t(blockIdx.x) * kCheckThreads + threadIdx.x, int64_t(gridDim.x) * kCheckThreads, acc);
  warp_combine(acc);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = acc;
  __syncthreads();
  if (warp != 0) return;
  acc = lane < kCheckWarps ? warps[lane] : neutral_acc();
  warp_combine(acc);
  if (lane != 0) return;
  CheckScratch& s = g_check_scratch;
  if (acc.bad_x) atomicOr(&s.bad_x, 1u);
  if (acc.bad_w) atomicOr(&s.bad_w, 1u);
  atomicMin(&s.ids_min, static_cast<long long>(acc.ids_min));
  atomicMax(&s.ids_max, static_cast<long long>(acc.ids_max));
  atomicMin(&s.map_min, static_cast<long long>(acc.map_min));
  atomicMax(&s.map_max, static_cast<long long>(acc.map_max));
  __threadfence();  // this block's atomics before its ticket
  if (atomicAdd(&s.blocks_done, 1u) != gridDim.x - 1) return;
  __threadfence();  // every other block's atomics before the reads below
  CheckAcc total;
  total.bad_x = atomicExch(&s.bad_x, 0u);
  total.bad_w = atomicExch(&s.bad_w, 0u);
  total.ids_min = take(&s.ids_min, LLONG_MAX);
  total.ids_max = take(&s.ids_max, LLONG_MIN);
  total.map_min = take(&s.map_min, LLONG_MAX);
  total.map_max = take(&s.map_max, LLONG_MIN);
  atomicExch(&s.blocks_done, 0u);
  int64_t words[kCheckResultWords];
  write_result(total, words);
  volatile long long* host = out.words;
  for (int i = 0; i < kCheckResultWords; ++i) host[i] = words[i];
  __threadfence_system();  // the answer is visible to the host before the number that announces it
  host[kCheckResultWords] = out.seq;
}

// Per device: the lock that serializes calls (they share the scratch and the host buffer), the
// mapped pinned buffer (set up by the first call) and the number of the last call.
struct DeviceState {
  std::mutex mutex;
  long long* host = nullptr;
  long long* mapped = nullptr;  // the device's address of `host`
  long long seq = 0;
};
DeviceState g_devices[kMaxDevices];

// Polls `host[kCheckResultWords]` until it reads `seq` (an acquire load: on a weakly ordered host
// CPU the result words are read after it). Every kQueryEvery reads it asks the stream: still
// running goes on; finished (or failed) without the number ends the wait with an error.
bool announced(long long* host, long long seq) {
  return __atomic_load_n(host + kCheckResultWords, __ATOMIC_ACQUIRE) == seq;
}

int wait_for_result(long long* host, long long seq, cudaStream_t stream) {
  constexpr int kQueryEvery = 64;
  for (int spins = 1;; ++spins) {
    if (announced(host, seq)) return MOE_FP4_OK;
    if (spins % kQueryEvery) continue;
    const cudaError_t st = cudaStreamQuery(stream);
    if (st == cudaErrorNotReady) continue;
    if (announced(host, seq)) return MOE_FP4_OK;  // written just before the stream finished
    MOE_FP4_TRY(cuda_status(st, "the check_inputs kernel"));
    return set_error(MOE_FP4_ERROR_CUDA, "the check_inputs kernel finished without writing its result");
  }
}

int check_on_device(const CheckInputsArgs& a, int64_t* result, int device, cudaStream_t stream) {
  DeviceState& d = g_devices[device];
  std::lock_guard<std::mutex> lock(d.mutex);
  if (d.host == nullptr) {
    void* host = nullptr;
    MOE_FP4_TRY(cuda_status(cudaHostAlloc(&host, (kCheckResultWords + 1) * sizeof(long long),
                                          cudaHostAllocMapped | cudaHostAllocPortable),
                            "cudaHostAlloc of the check result"));
    void* mapped = nullptr;
    const cudaError_t st = cudaHostGetDevicePointer(&mapped, host, 0);
    if (st != cudaSuccess) {
      cudaFreeHost(host);
      return cuda_status(st, "cudaHostGetDevicePointer of the check result");
    }
    std::memset(host, 0, (kCheckResultWords + 1) * sizeof(long long));
    d.host = static_cast<long long*>(host);
    d.mapped = static_cast<long long*>(mapped);
  }
  const XSplit s(a.x, a.x_numel);
  const int64_t units = max64(max64(s.vectors, s.scalars()), max64(max64(a.weights_numel, a.ids_numel), a.map_numel));
  const int64_t want = ceil_div(max64(units, 1), kCheckThreads * kUnitsPerThread);
  const int64_t cap = int64_t(sm_count(device)) * kCheckBlocksPerSm;
  const long long seq = ++d.seq;
  // A plain launch (no programmatic dependent launch): the kernel starts after all work before it.
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(min64(want, cap)));
  config.blockDim = dim3(kCheckThreads);
  config.stream = stream;
  MOE_FP4_TRY(cuda_status(cudaLaunchKernelEx(&config, check_inputs_kernel, a, CheckOut{d.mapped, seq}),
                          "check_inputs kernel launch"));
  MOE_FP4_TRY(wait_for_result(d.host, seq, stream));
  for (int i = 0; i < kCheckResultWords; ++i) result[i] = d.host[i];
  return MOE_FP4_OK;
}

}  // namespace

int check_inputs(const CheckInputsArgs& args, int64_t* result, int device, cudaStream_t stream) {
  if (device != MOE_FP4_HOST) return check_on_device(args, result, device, stream);
  CheckAcc acc = neutral_acc();
  check_slice(args, 0, 1, acc);
  write_result(acc, result);
  return MOE_FP4_OK;
}

}  // namespace moe_fp4
