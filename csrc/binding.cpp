// The extern "C" entries of libmoe_fp4_cuda: every precondition is checked here, before any
// CUDA call, then the device is made current and the launcher runs; on return the calling
// thread's current context is the one it had (ContextRestorer). No C++ exception leaves an entry
// (guarded() turns one into MOE_FP4_ERROR_INTERNAL).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "moe_fp4/common.hpp"
#include "moe_fp4/gemm.hpp"
#include "moe_fp4/moe_fp4.h"
#include "moe_fp4/pipeline.hpp"

#ifndef MOE_FP4_PIPELINE_ARCHS
#error "CMake defines MOE_FP4_PIPELINE_ARCHS (the targets of the pipeline kernels)"
#endif
#ifndef MOE_FP4_GEMM_ARCHS
#error "CMake defines MOE_FP4_GEMM_ARCHS (the targets of the grouped GEMMs, possibly empty)"
#endif

namespace moe_fp4 {
namespace {

thread_local char g_last_error[1024] = "";

// Per-device attributes, cached: compute capability (10*major+minor) and SM count; 0 = unknown.
std::atomic<int> g_capability[kMaxDevices];
std::atomic<int> g_sm_count[kMaxDevices];

int query_device(int device) {
  if (g_capability[device].load(std::memory_order_relaxed) != 0) return MOE_FP4_OK;
  int major = 0, minor = 0, sms = 0;
  MOE_FP4_TRY(cuda_status(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute"));
  MOE_FP4_TRY(cuda_status(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute"));
  MOE_FP4_TRY(cuda_status(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute"));
  g_sm_count[device].store(sms, std::memory_order_relaxed);
  g_capability[device].store(10 * major + minor, std::memory_order_relaxed);
  return MOE_FP4_OK;
}

// ------------------------------------------------------------------ compiled targets

const char* archs_of(int component) {
  return component == MOE_FP4_GEMM ? MOE_FP4_GEMM_ARCHS : MOE_FP4_PIPELINE_ARCHS;
}

// Whether one target ("sm_100a", "sm_120f", "compute_90", ...) runs on major.minor:
// "a" targets on exactly that capability, "f" targets and plain SASS on the same major with
// an equal or higher minor, plain PTX on any equal or newer capability (JIT).
bool target_runs_on(const char* target, size_t len, int major, int minor) {
  const bool ptx = len > 8 && std::strncmp(target, "compute_", 8) == 0;
  const size_t prefix = ptx ? 8 : 3;
  if (len <= prefix) return false;
  int number = 0;
  size_t i = prefix;
  for (; i < len && target[i] >= '0' && target[i] <= '9'; ++i) number = number * 10 + (target[i] - '0');
  const char suffix = i < len ? target[i] : '\0';
  const int t_major = number / 10, t_minor = number % 10;
  if (suffix == 'a') return major == t_major && minor == t_minor;
  if (suffix == 'f' || !ptx) return major == t_major && minor >= t_minor;
  return major > t_major || (major == t_major && minor >= t_minor);
}

bool serves_capability(int component, int major, int minor) {
  const char* list = archs_of(component);
  while (*list) {
    const char* end = std::strchr(list, ',');
    const size_t len = end ? size_t(end - list) : std::strlen(list);
    if (target_runs_on(list, len, major, minor)) return true;
    list += len + (end ? 1 : 0);
  }
  return false;
}

int check_serves(int component, int major, int minor) {
  if (serves_capability(component, major, minor)) return MOE_FP4_OK;
  const char* built = archs_of(component);
  if (component == MOE_FP4_PIPELINE)
    return set_error(MOE_FP4_ERROR_UNSUPPORTED,
                     "the pipeline kernels of this library are built for %s, which does not run on sm_%d%d "
                     "(they need compute capability 9.0 or newer)",
                     built, major, minor);
  if (major == 9 && minor == 0)
    return set_error(MOE_FP4_ERROR_UNSUPPORTED,
                     "this library has no sm_90a grouped GEMM (its GEMMs are built for %s; add 90a to "
                     "MOE_FP4_CUDA_ARCHS); use backend='triton'",
                     *built ? built : "no target");
  if (major < 10)
    return set_error(MOE_FP4_ERROR_UNSUPPORTED,
                     "no NVFP4 GEMM path on sm_%d%d: this library's GEMMs need sm_90a (16-bit wgmma on dequantized "
                     "weights) or SM100/SM120/SM121 (block-scaled FP4 MMA) and are built for %s; use backend='triton'",
                     major, minor, *built ? built : "no target");
  if (!*built)
    return set_error(MOE_FP4_ERROR_UNSUPPORTED,
                     "this library was built without NVFP4 grouped GEMMs (no SM100/SM120 target in MOE_FP4_CUDA_ARCHS)");
  return set_error(MOE_FP4_ERROR_UNSUPPORTED, "this library's NVFP4 grouped GEMMs are built for %s, not for sm_%d%d",
                   built, major, minor);
}

// Makes `device` current and checks that this build has code of `component` for it.
int use_device(int component, int device) {
  if (device == MOE_FP4_HOST) {
    if (component == MOE_FP4_PIPELINE) return MOE_FP4_OK;
    return set_error(MOE_FP4_ERROR_UNSUPPORTED, "device: the grouped GEMM has no host mode (MOE_FP4_HOST)");
  }
  MOE_FP4_REQUIRE(device >= 0 && device < kMaxDevices,
                  "device: expected a CUDA device ordinal in [0, %d) or MOE_FP4_HOST (-1), got %d", kMaxDevices, device);
  MOE_FP4_TRY(cuda_status(cudaSetDevice(device), "cudaSetDevice"));
  MOE_FP4_TRY(query_device(device));
  const int cc = g_capability[device].load(std::memory_order_relaxed);
  if (check_serves(component, cc / 10, cc % 10) != MOE_FP4_OK) {
    char reason[sizeof(g_last_error)];
    std::snprintf(reason, sizeof(reason), "%s", g_last_error);
    return set_error(MOE_FP4_ERROR_UNSUPPORTED, "device %d: %s", device, reason);
  }
  return MOE_FP4_OK;
}

// ------------------------------------------------------------------ argument checks

int check_pointer(const char* name, const void* p, bool needed, size_t alignment) {
  if (!needed) return MOE_FP4_OK;
  MOE_FP4_REQUIRE(p != nullptr, "%s: expected a pointer, got NULL", name);
  MOE_FP4_REQUIRE(reinterpret_cast<uintptr_t>(p) % alignment == 0, "%s: expected a %zu-byte aligned address, got %p",
                  name, alignment, p);
  return MOE_FP4_OK;
}

int check_optional_pointer(const char* name, const void* p, size_t alignment) {
  return check_pointer(name, p, p != nullptr, alignment);
}

int check_dtype(const char* name, int dtype, bool allow_fp32) {
  MOE_FP4_REQUIRE(dtype == MOE_FP4_BF16 || dtype == MOE_FP4_FP16 || (allow_fp32 && dtype == MOE_FP4_FP32),
                  "%s: expected %s, got %d", name,
                  allow_fp32 ? "MOE_FP4_BF16 (0), MOE_FP4_FP16 (1) or MOE_FP4_FP32 (2)"
                             : "MOE_FP4_BF16 (0) or MOE_FP4_FP16 (1)",
                  dtype);
  return MOE_FP4_OK;
}

int check_experts(int32_t num_experts) {
  MOE_FP4_REQUIRE(num_experts >= 1, "num_experts: expected at least 1, got %d", int(num_experts));
  return MOE_FP4_OK;
}

// Slot counts index int32 buffers; the grouped scale rows must fit int32 offsets too.
int check_slots(int64_t num_slots, int32_t num_experts) {
  MOE_FP4_REQUIRE(num_slots >= 0 && num_slots <= INT32_MAX, "num_slots: expected a count in [0, 2^31), got %" PRId64,
                  num_slots);
  MOE_FP4_REQUIRE(grouped_scale_rows_bound(num_slots, num_experts) <= INT32_MAX,
                  "num_slots: %" PRId64 " slots over %d experts need more than 2^31 grouped scale rows", num_slots,
                  int(num_experts));
  return MOE_FP4_OK;
}

int check_row_length(const char* name, int64_t k, int multiple) {
  MOE_FP4_REQUIRE(k > 0 && k % multiple == 0 && k <= (int64_t(1) << 30),
                  "%s: expected a positive multiple of %d (at most 2^30), got %" PRId64, name, multiple, k);
  return MOE_FP4_OK;
}

// The outputs and routing inputs shared by both grouped quantizers.
int check_grouped_quantize(int64_t num_slots, const float* gs, const int32_t* expert_offsets,
                           const int32_t* blockscale_offsets, int32_t num_experts, const uint8_t* packed,
                           const uint8_t* scales, int64_t scale_rows, const void* values) {
  MOE_FP4_TRY(check_experts(num_experts));
  MOE_FP4_TRY(check_slots(num_slots, num_experts));
  const int64_t bound = grouped_scale_rows_bound(num_slots, num_experts);
  MOE_FP4_REQUIRE(scale_rows % 128 == 0 && scale_rows >= bound,
                  "scale_rows: expected a multiple of 128 of at least %" PRId64 " (the grouped bound for %" PRId64
                  " slots over %d experts), got %" PRId64,
                  bound, num_slots, int(num_experts), scale_rows);
  // gs NULL: the W4A16 rows (written unquantized), which have values only.
  MOE_FP4_REQUIRE(gs != nullptr || (values != nullptr && packed == nullptr && scales == nullptr),
                  "gs: expected a pointer (NULL only for the unquantized W4A16 rows: values given, packed and "
                  "scales NULL), got NULL");
  MOE_FP4_TRY(check_optional_pointer("gs", gs, 4));
  MOE_FP4_TRY(check_pointer("expert_offsets", expert_offsets, true, 4));
  MOE_FP4_TRY(check_pointer("blockscale_offsets", blockscale_offsets, true, 4));
  // With the dequantized output `values`, packed and scales are optional (Hopper needs only values).
  if (values != nullptr) {
    MOE_FP4_TRY(check_optional_pointer("values", values, 16));
    MOE_FP4_TRY(check_optional_pointer("packed", packed, 16));
    MOE_FP4_TRY(check_optional_pointer("scales", scales, 16));
    return MOE_FP4_OK;
  }
  MOE_FP4_TRY(check_pointer("packed", packed, num_slots > 0, 16));
  MOE_FP4_TRY(check_pointer("scales", scales, scale_rows > 0, 16));
  return MOE_FP4_OK;
}

// The routing entries' common checks: E, the slot count, the ids and the four outputs, and no host
// mode (`why_not_host`: the entry's reason; stages.routing is the reference).
int check_routing(const int32_t* topk_ids, int64_t num_slots, int32_t num_experts, const int32_t* expert_offsets,
                  const int32_t* blockscale_offsets, const int32_t* slot_to_flat, const int32_t* flat_to_slot,
                  int device, const char* why_not_host) {
  MOE_FP4_TRY(check_experts(num_experts));
  MOE_FP4_TRY(check_slots(num_slots, num_experts));
  MOE_FP4_TRY(check_pointer("topk_ids", topk_ids, num_slots > 0, 4));
  MOE_FP4_TRY(check_pointer("expert_offsets", expert_offsets, true, 4));
  MOE_FP4_TRY(check_pointer("blockscale_offsets", blockscale_offsets, true, 4));
  MOE_FP4_TRY(check_pointer("slot_to_flat", slot_to_flat, num_slots > 0, 4));
  MOE_FP4_TRY(check_pointer("flat_to_slot", flat_to_slot, num_slots > 0, 4));
  if (device == MOE_FP4_HOST)
    return set_error(MOE_FP4_ERROR_UNSUPPORTED, "device: %s; stages.routing is the reference", why_not_host);
  return MOE_FP4_OK;
}

template <class F>
int guarded(F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return set_error(MOE_FP4_ERROR_INTERNAL, "out of host memory");
  } catch (...) {
    return set_error(MOE_FP4_ERROR_INTERNAL, "unexpected C++ exception inside libmoe_fp4_cuda");
  }
}

// ------------------------------------------------------------------ launches of other kernels

// Every description of moe_fp4_launch_kernels well formed, and their free values num_free in all.
int check_kernel_launches(const moe_fp4_kernel_launch* const* launches, int32_t count, int32_t num_free) {
  int64_t frees = 0;
  for (int32_t i = 0; i < count; ++i) {
    const moe_fp4_kernel_launch* l = launches[i];
    MOE_FP4_REQUIRE(l != nullptr, "launches[%d]: expected a launch description, got NULL", int(i));
    MOE_FP4_REQUIRE(l->function != nullptr, "launches[%d].function: expected a CUfunction, got NULL", int(i));
    MOE_FP4_REQUIRE(l->block_x >= 1 && l->block_x <= 1024, "launches[%d].block_x: expected 1..1024 threads, got %u",
                    int(i), l->block_x);
    MOE_FP4_REQUIRE(l->num_params >= 0, "launches[%d].num_params: expected a count >= 0, got %d", int(i),
                    int(l->num_params));
    MOE_FP4_REQUIRE(l->params != nullptr || l->num_params == 0,
                    "launches[%d].params: expected %d parameter pointers, got NULL", int(i), int(l->num_params));
    for (int32_t p = 0; p < l->num_params; ++p)
      MOE_FP4_REQUIRE(l->params[p] != nullptr, "launches[%d].params[%d]: expected the parameter's storage, got NULL",
                      int(i), int(p));
    MOE_FP4_REQUIRE(l->num_free >= 0, "launches[%d].num_free: expected a count >= 0, got %d", int(i),
                    int(l->num_free));
    MOE_FP4_REQUIRE(l->num_free == 0 || (l->free_param != nullptr && l->free_bytes != nullptr),
                    "launches[%d]: expected free_param and free_bytes for its %d free values, got NULL", int(i),
                    int(l->num_free));
    for (int32_t j = 0; j < l->num_free; ++j) {
      const int32_t p = l->free_param[j], b = l->free_bytes[j];
      MOE_FP4_REQUIRE(p >= 0 && p < l->num_params, "launches[%d].free_param[%d]: expected a parameter in [0, %d), got %d",
                      int(i), int(j), int(l->num_params), int(p));
      MOE_FP4_REQUIRE(b == 1 || b == 2 || b == 4 || b == 8,
                      "launches[%d].free_bytes[%d]: expected 1, 2, 4 or 8 bytes, got %d", int(i), int(j), int(b));
    }
    frees += l->num_free;
  }
  MOE_FP4_REQUIRE(frees == num_free, "num_free: the launches take %" PRId64 " free values, got %d", frees,
                  int(num_free));
  return MOE_FP4_OK;
}

int launch_kernels(const moe_fp4_kernel_launch* const* launches, int32_t count, const uint64_t* free_values,
                   cudaStream_t stream) {
  static const auto launch = reinterpret_cast<PFN_cuLaunchKernelEx_v11060>(driver_entry("cuLaunchKernelEx", 11060));
  if (launch == nullptr) return set_error(MOE_FP4_ERROR_CUDA, "cuLaunchKernelEx is not available from the CUDA driver");
  for (int32_t i = 0; i < count; ++i) {
    const moe_fp4_kernel_launch& l = *launches[i];
    for (int32_t j = 0; j < l.num_free; ++j, ++free_values)  // little-endian: the low bytes of the value
      std::memcpy(l.params[l.free_param[j]], free_values, size_t(l.free_bytes[j]));
    if (uint64_t(l.grid_x) * l.grid_y * l.grid_z == 0) continue;
    CUlaunchAttribute attr[1];
    CUlaunchConfig config{};
    config.gridDimX = l.grid_x;
    config.gridDimY = l.grid_y;
    config.gridDimZ = l.grid_z;
    config.blockDimX = l.block_x;
    config.blockDimY = 1;
    config.blockDimZ = 1;
    config.sharedMemBytes = l.shared_bytes;
    config.hStream = reinterpret_cast<CUstream>(stream);
    config.attrs = attr;
    if (l.pdl) {
      attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attr[0].value.programmaticStreamSerializationAllowed = 1;
      config.numAttrs = 1;
    }
    const CUresult r = launch(&config, static_cast<CUfunction>(l.function), l.params, nullptr);
    if (r != CUDA_SUCCESS)
      return set_error(MOE_FP4_ERROR_CUDA, "launches[%d]: cuLaunchKernelEx failed (CUresult %d)", int(i), int(r));
  }
  return MOE_FP4_OK;
}

const GemmImpl* gemm_for_major(int major) {
#if defined(MOE_FP4_HAVE_GEMM_SM100)
  if (major == 10) return &kGemmSm100;
#endif
#if defined(MOE_FP4_HAVE_GEMM_SM120)
  if (major == 12) return &kGemmSm120;
#endif
  (void)major;
  return nullptr;
}

// The GEMM of the current device (use_device(MOE_FP4_GEMM, device) succeeded).
const GemmImpl* gemm_for_device(int device) {
  return gemm_for_major(g_capability[device].load(std::memory_order_relaxed) / 10);
}

// The FP4 x FP4 CUTLASS GEMM of the current device, or UNSUPPORTED (e.g. on sm_90, whose GEMM is
// moe_fp4_sm90_grouped_gemm).
int fp4_gemm_for_device(int device, const GemmImpl** impl) {
  *impl = gemm_for_device(device);
  if (*impl != nullptr) return MOE_FP4_OK;
  const int cc = g_capability[device].load(std::memory_order_relaxed);
  return set_error(MOE_FP4_ERROR_UNSUPPORTED,
                   "device %d (sm_%d): the FP4 x FP4 grouped GEMM needs SM100 or SM120/SM121; on sm_90 use "
                   "moe_fp4_sm90_grouped_gemm (16-bit activations, prepared weights)",
                   device, cc);
}

int gemm_for_arch(int arch, const GemmImpl** impl) {
  MOE_FP4_REQUIRE(arch == 100 || arch == 120, "arch: expected 100 (SM100) or 120 (SM120/SM121), got %d", arch);
  *impl = gemm_for_major(arch / 10);
  if (*impl == nullptr)
    return set_error(MOE_FP4_ERROR_UNSUPPORTED, "this library has no SM%d grouped GEMM (GEMMs built: %s)", arch,
                     *MOE_FP4_GEMM_ARCHS ? MOE_FP4_GEMM_ARCHS : "none");
  return MOE_FP4_OK;
}

// E experts x S sections = the GEMM's groups.
int check_groups(int32_t num_experts, int32_t sections) {
  MOE_FP4_TRY(check_experts(num_experts));
  MOE_FP4_REQUIRE(sections == 1 || sections == 2, "sections: expected 1 (w2) or 2 (w13: gate, up), got %d",
                  int(sections));
  MOE_FP4_REQUIRE(int64_t(num_experts) * sections <= INT32_MAX, "num_experts: %d experts x %d sections exceed 2^31 groups",
                  int(num_experts), int(sections));
  return MOE_FP4_OK;
}

int check_gemm_shape(int32_t num_experts, int32_t sections, int64_t n, int64_t k, int64_t a_rows,
                     int64_t a_scale_rows) {
  MOE_FP4_TRY(check_groups(num_experts, sections));
  MOE_FP4_REQUIRE(n > 0 && n <= INT32_MAX && n % sections == 0 && (n / sections) % 8 == 0,
                  "n: expected each of the %d sections to be a positive multiple of 8 columns (16-byte rows of the "
                  "16-bit output), got n = %" PRId64,
                  int(sections), n);
  MOE_FP4_REQUIRE(k > 0 && k <= INT32_MAX && k % 32 == 0,
                  "k: expected a positive multiple of 32 (16-byte rows of packed e2m1, as TMA needs), got %" PRId64, k);
  MOE_FP4_REQUIRE(a_rows >= 0 && a_rows <= INT32_MAX, "a_rows: expected a count in [0, 2^31), got %" PRId64, a_rows);
  MOE_FP4_REQUIRE(a_scale_rows >= 0 && a_scale_rows % 128 == 0,
                  "a_scale_rows: expected a multiple of 128 (whole 128-row scale regions), got %" PRId64, a_scale_rows);
  return MOE_FP4_OK;
}

// The prepared-weight shape of the sm_90a GEMM: n rows and k columns per expert.
int check_sm90_weights(int32_t num_experts, int64_t n, int64_t k) {
  MOE_FP4_TRY(check_experts(num_experts));
  MOE_FP4_REQUIRE(n > 0 && n % 16 == 0 && n <= (int64_t(1) << 21),
                  "n: expected a positive multiple of 16 (whole 16-row blocks of the prepared layout), at most 2^21, "
                  "got %" PRId64,
                  n);
  MOE_FP4_REQUIRE(k > 0 && k % 16 == 0 && k <= (int64_t(1) << 30),
                  "k: expected a positive multiple of 16 (whole e4m3 scale blocks), at most 2^30, got %" PRId64, k);
  MOE_FP4_REQUIRE(int64_t(num_experts) * n <= INT32_MAX, "num_experts: %d experts x n = %" PRId64
                  " rows exceed 2^31 weight rows", int(num_experts), n);
  return MOE_FP4_OK;
}

// Puts the calling thread's current CUDA context back as it was when constructed (NULL included),
// through the driver's cuCtxGetCurrent / cuCtxSetCurrent (looked up once, nothing links libcuda):
// unlike cudaSetDevice(previous), this never creates a context on a device the thread did not use.
// Does nothing where the driver calls are unavailable or the driver is not initialized yet.
class ContextRestorer {
 public:
  ContextRestorer() {
    const Calls& c = calls();
    active_ = c.get != nullptr && c.set != nullptr && c.get(&saved_) == CUDA_SUCCESS;
  }
  ~ContextRestorer() {
    if (active_) calls().set(saved_);
  }
  // Whether a context was current when constructed (known only where the driver calls exist).
  bool had_context() const { return active_ && saved_ != nullptr; }
  ContextRestorer(const ContextRestorer&) = delete;
  ContextRestorer& operator=(const ContextRestorer&) = delete;

 private:
  struct Calls {
    CUresult (*get)(CUcontext*) = nullptr;
    CUresult (*set)(CUcontext) = nullptr;
  };
  static const Calls& calls() {
    static const Calls c = [] {
      Calls found;
      found.get = reinterpret_cast<CUresult (*)(CUcontext*)>(driver_entry("cuCtxGetCurrent", 4000));
      found.set = reinterpret_cast<CUresult (*)(CUcontext)>(driver_entry("cuCtxSetCurrent", 4000));
      return found;
    }();
    return c;
  }
  CUcontext saved_ = nullptr;
  bool active_ = false;
};

// moe_fp4_sm90_prepare_weights and moe_fp4_sm90_restore_weights: the same checks, then `launch`.
int sm90_relayout(int (*launch)(const Sm90PrepareArgs&, int, cudaStream_t), const uint8_t* w, const uint8_t* scales,
                  int32_t num_experts, int64_t n, int64_t k, int32_t sections, uint8_t* w_out, uint8_t* scales_out,
                  int device, moe_fp4_stream_t stream) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_sm90_weights(num_experts, n, k));
    MOE_FP4_REQUIRE(sections == 1 || sections == 2,
                    "sections: expected 1, or 2 for w13 (gate rows, then up rows), got %d", int(sections));
    MOE_FP4_TRY(check_pointer("w", w, true, 16));
    MOE_FP4_TRY(check_pointer("scales", scales, true, 16));
    MOE_FP4_TRY(check_pointer("w_out", w_out, true, 16));
    MOE_FP4_TRY(check_pointer("scales_out", scales_out, true, 16));
    MOE_FP4_REQUIRE(w_out != w && scales_out != scales && static_cast<const void*>(w_out) != scales_out,
                    "w_out, scales_out: expected buffers distinct from w and scales (the re-layout is not in place)");
    const ContextRestorer restorer;  // the caller's context back on return
    MOE_FP4_TRY(use_device(MOE_FP4_PIPELINE, device));
    const Sm90PrepareArgs args{w, scales, num_experts, n, k, w_out, scales_out, sections};
    return launch(args, device, stream);
  });
}

int check_count(const char* name, int64_t numel) {
  MOE_FP4_REQUIRE(numel >= 0, "%s: expected a non-negative element count, got %" PRId64, name, numel);
  return MOE_FP4_OK;
}

// An index tensor of moe_fp4_check_inputs (`prefix`: "ids" or "map"): int32 or int64, a count, its
// pointer `name` (NULL only when empty).
int check_index_buffer(const char* name, const char* prefix, const void* p, int dtype, int64_t numel) {
  MOE_FP4_REQUIRE(dtype == MOE_FP4_INT32 || dtype == MOE_FP4_INT64,
                  "%s_dtype: expected MOE_FP4_INT32 (3) or MOE_FP4_INT64 (4), got %d", prefix, dtype);
  MOE_FP4_REQUIRE(numel >= 0, "%s_numel: expected a non-negative element count, got %" PRId64, prefix, numel);
  return check_pointer(name, p, numel > 0, dtype == MOE_FP4_INT32 ? 4 : 8);
}

// Refuses a stream that is capturing a CUDA graph (an entry that must synchronize it).
int check_not_capturing(cudaStream_t stream, const char* entry) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOE_FP4_TRY(cuda_status(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing"));
  MOE_FP4_REQUIRE(capture == cudaStreamCaptureStatusNone,
                  "stream: is capturing a CUDA graph; %s synchronizes the stream to read its answer back, which a "
                  "capture cannot hold (check the inputs outside the capture)",
                  entry);
  return MOE_FP4_OK;
}

int check_tile_tokens(int32_t tile_tokens) {
  bool known = tile_tokens == 0;
  for (const int t : kSm90TileTokens) known |= tile_tokens == t;
  MOE_FP4_REQUIRE(known, "tile_tokens: expected 0 (heuristic), 8, 16, 32, 48, 64, 80, 96, 112 or 128, got %d",
                  int(tile_tokens));
  return MOE_FP4_OK;
}

}  // namespace

int set_error(int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(g_last_error, sizeof(g_last_error), fmt, ap);
  va_end(ap);
  return code;
}

int cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return MOE_FP4_OK;
  return set_error(MOE_FP4_ERROR_CUDA, "%s: %s: %s", what, cudaGetErrorName(err), cudaGetErrorString(err));
}

int sm_count(int device) { return g_sm_count[device].load(std::memory_order_relaxed); }

void* driver_entry(const char* name, unsigned int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    return nullptr;
  return fn;
}

bool pdl_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("MOE_FP4_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

}  // namespace moe_fp4

using namespace moe_fp4;

extern "C" {

int moe_fp4_abi_version(void) { return MOE_FP4_ABI_VERSION; }

const char* moe_fp4_last_error(void) { return g_last_error; }

const char* moe_fp4_compiled_archs(int component) {
  return component == MOE_FP4_PIPELINE || component == MOE_FP4_GEMM ? archs_of(component) : "";
}

int moe_fp4_serves(int component, int major, int minor) {
  return guarded([&]() -> int {
    MOE_FP4_REQUIRE(component == MOE_FP4_PIPELINE || component == MOE_FP4_GEMM,
                    "component: expected MOE_FP4_PIPELINE (0) or MOE_FP4_GEMM (1), got %d", component);
    return check_serves(component, major, minor);
  });
}

int moe_fp4_routing_workspace_size(int64_t num_slots, int32_t num_experts, size_t* bytes) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_experts(num_experts));
    MOE_FP4_TRY(check_slots(num_slots, num_experts));
    MOE_FP4_TRY(check_pointer("bytes", bytes, true, 1));
    *bytes = routing_workspace_bytes(num_slots, num_experts);
    return MOE_FP4_OK;
  });
}

int moe_fp4_routing(const int32_t* topk_ids, int64_t num_slots, int32_t num_experts, int32_t* expert_offsets,
                    int32_t* blockscale_offsets, int32_t* slot_to_flat, int32_t* flat_to_slot, void* workspace,
                    size_t workspace_bytes, int device, moe_fp4_stream_t stream) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_routing(topk_ids, num_slots, num_experts, expert_offsets, blockscale_offsets, slot_to_flat,
                              flat_to_slot, device, "routing has no host mode (its kernels use warp intrinsics)"));
    const size_t need = routing_workspace_bytes(num_slots, num_experts);
    MOE_FP4_TRY(check_pointer("workspace", workspace, true, 16));
    MOE_FP4_REQUIRE(workspace_bytes >= need,
                    "workspace_bytes: expected at least %zu (moe_fp4_routing_workspace_size), got %zu", need,
                    workspace_bytes);
    const ContextRestorer restorer;  // the caller's context back on return
    MOE_FP4_TRY(use_device(MOE_FP4_PIPELINE, device));
    const RoutingArgs args{topk_ids, num_slots, num_experts, expert_offsets, blockscale_offsets,
                           slot_to_flat, flat_to_slot, workspace};
    return launch_routing(args, stream);
  });
}

int moe_fp4_quantize_rows(const void* x, int x_dtype, int64_t x_rows, int64_t k, const int32_t* slot_to_flat,
                          int32_t topk, const float* row_scale, int64_t num_slots, const float* gs,
                          const int32_t* expert_offsets, const int32_t* blockscale_offsets, int32_t num_experts,
                          uint8_t* packed, uint8_t* scales, int64_t scale_rows, void* values, int device,
                          moe_fp4_stream_t stream) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_dtype("x_dtype", x_dtype, false));
    MOE_FP4_TRY(check_row_length("k", k, 16));
    MOE_FP4_REQUIRE(x_rows >= 0 && x_rows <= INT32_MAX, "x_rows: expected a count in [0, 2^31), got %" PRId64, x_rows);
    MOE_FP4_TRY(check_pointer("x", x, x_rows > 0, 16));
    if (slot_to_flat != nullptr) {
      MOE_FP4_REQUIRE(topk >= 1, "topk: expected at least 1, got %d", int(topk));
      MOE_FP4_REQUIRE(num_slots == x_rows * topk,
                      "num_slots: expected x_rows * topk = %" PRId64 " * %d slots (slot_to_flat covers every routed "
                      "copy of every row), got %" PRId64,
                      x_rows, int(topk), num_slots);
      MOE_FP4_TRY(check_pointer("slot_to_flat", slot_to_flat, true, 4));
      MOE_FP4_TRY(check_optional_pointer("row_scale", row_scale, 4));
    } else {
      MOE_FP4_REQUIRE(row_scale == nullptr,
                      "row_scale: expected NULL without slot_to_flat (it is indexed by flat index), got %p",
                      static_cast<const void*>(row_scale));
      MOE_FP4_REQUIRE(num_slots == x_rows,
                      "num_slots: expected x_rows = %" PRId64 " without slot_to_flat (slot s is row s), got %" PRId64,
                      x_rows, num_slots);
    }
    MOE_FP4_TRY(check_grouped_quantize(num_slots, gs, expert_offsets, blockscale_offsets, num_experts, packed,
                                       scales, scale_rows, values));
    const ContextRestorer restorer;  // the caller's context back on return
    MOE_FP4_TRY(use_device(MOE_FP4_PIPELINE, device));
    const GroupedQuantArgs args{x, x_rows, k, slot_to_flat, topk, row_scale, num_slots, gs,
                                expert_offsets, blockscale_offsets, num_experts, packed, scales, scale_rows,
                                values};
    return launch_grouped_quantize(RowSource::kGather, x_dtype, args, device, stream);
  });
}

int moe_fp4_quantize_values_by_token(const void* x, int x_dtype, int64_t x_rows, int64_t k,
                                     const int32_t* flat_to_slot, int32_t topk, const float* row_scale,
                                     int64_t num_slots, const float* gs, const int32_t* expert_offsets,
                                     int32_t num_experts, void* values, int device, moe_fp4_stream_t stream) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_dtype("x_dtype", x_dtype, false));
    MOE_FP4_TRY(check_row_length("k", k, 16));
    MOE_FP4_REQUIRE(x_rows >= 0 && x_rows <= INT32_MAX, "x_rows: expected a count in [0, 2^31), got %" PRId64, x_rows);
    MOE_FP4_TRY(check_pointer("x", x, x_rows > 0, 16));
    MOE_FP4_REQUIRE(topk >= 1, "topk: expected at least 1, got %d", int(topk));
    MOE_FP4_REQUIRE(num_slots == x_rows * topk,
                    "num_slots: expected x_rows * topk = %" PRId64 " * %d slots (flat_to_slot names every routed "
                    "copy of every row), got %" PRId64,
                    x_rows, int(topk), num_slots);
    MOE_FP4_TRY(check_experts(num_experts));
    MOE_FP4_TRY(check_slots(num_slots, num_experts));
    MOE_FP4_TRY(check_pointer("flat_to_slot", flat_to_slot, num_slots > 0, 4));
    MOE_FP4_TRY(check_optional_pointer("row_scale", row_scale, 4));
    MOE_FP4_TRY(check_optional_pointer("gs", gs, 4));  // NULL: the W4A16 rows, unquantized
    MOE_FP4_TRY(check_pointer("expert_offsets", expert_offsets, true, 4));
    MOE_FP4_TRY(check_pointer("values", values, num_slots > 0, 16));
    const ContextRestorer restorer;  // the caller's context back on return
    MOE_FP4_TRY(use_device(MOE_FP4_PIPELINE, device));
    const GroupedQuantArgs args{x, x_rows, k, nullptr, topk, row_scale, num_slots, gs,
                                expert_offsets, nullptr, num_experts, nullptr, nullptr, 0, values};
    return launch_quantize_values_by_token(x_dtype, args, flat_to_slot, device, stream);
  });
}

int moe_fp4_routing_quantize_values(const int32_t* topk_ids, const void* x, int x_dtype, int64_t x_rows, int64_t k,
                                    int32_t topk, const float* row_scale, const float* gs, int32_t num_experts,
                                    int32_t* expert_offsets, int32_t* blockscale_offsets, int32_t* slot_to_flat,
                                    int32_t* flat_to_slot, void* values, int device, moe_fp4_stream_t stream) {
  static_assert(MOE_FP4_ROUTING_QUANTIZE_MAX_SLOTS == kRoutingQuantizeMaxSlots, "one limit for the header and kernel");
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_dtype("x_dtype", x_dtype, false));
    MOE_FP4_TRY(check_row_length("k", k, 16));
    MOE_FP4_REQUIRE(topk >= 1, "topk: expected at least 1, got %d", int(topk));
    MOE_FP4_REQUIRE(x_rows >= 0 && x_rows <= kRoutingQuantizeMaxSlots / topk,
                    "x_rows: expected x_rows * topk <= %d slots (MOE_FP4_ROUTING_QUANTIZE_MAX_SLOTS; more take "
                    "moe_fp4_routing and moe_fp4_quantize_rows), got %" PRId64 " rows * topk %d",
                    int(kRoutingQuantizeMaxSlots), x_rows, int(topk));
    const int64_t num_slots = x_rows * topk;
    MOE_FP4_TRY(check_pointer("x", x, num_slots > 0, 16));
    MOE_FP4_TRY(check_optional_pointer("row_scale", row_scale, 4));
    MOE_FP4_TRY(check_optional_pointer("gs", gs, 4));  // NULL: the W4A16 rows, unquantized
    MOE_FP4_TRY(check_pointer("values", values, num_slots > 0, 16));
    MOE_FP4_TRY(check_routing(topk_ids, num_slots, num_experts, expert_offsets, blockscale_offsets, slot_to_flat,
                              flat_to_slot, device, "the fused routing has no host mode (as moe_fp4_routing)"));
    const ContextRestorer restorer;  // the caller's context back on return
    MOE_FP4_TRY(use_device(MOE_FP4_PIPELINE, device));
    const RoutingArgs routing{topk_ids, num_slots, num_experts, expert_offsets, blockscale_offsets,
                              slot_to_flat, flat_to_slot, nullptr};
    const GroupedQuantArgs quant{x, x_rows, k, nullptr, topk, row_scale, num_slots, gs,
                                 nullptr, nullptr, num_experts, nullptr, nullptr, 0, values};
    return launch_routing_quantize_values(x_dtype, routing, quant, device, stream);
  });
}

int moe_fp4_silu_mul_quantize(const void* h, int h_dtype, int64_t num_slots, int64_t inter, const float* gs,
                              const int32_t* expert_offsets, const int32_t* blockscale_offsets,
                              int32_t num_experts, uint8_t* packed, uint8_t* scales, int64_t scale_rows,
                              void* values, int device, moe_fp4_stream_t stream) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_dtype("h_dtype", h_dtype, false));
    MOE_FP4_TRY(check_row_length("inter", inter, 16));
    MOE_FP4_TRY(check_grouped_quantize(num_slots, gs, expert_offsets, blockscale_offsets, num_experts,
                                       packed, scales, scale_rows, values));
    MOE_FP4_TRY(check_pointer("h", h, num_slots > 0, 16));
    const ContextRestorer restorer;  // the caller's context back on return
    MOE_FP4_TRY(use_device(MOE_FP4_PIPELINE, device));
    const GroupedQuantArgs args{h, num_slots, inter, nullptr, 1, nullptr, num_slots, gs,
                                expert_offsets, blockscale_offsets, num_experts, packed, scales, scale_rows,
                                values};
    return launch_grouped_quantize(RowSource::kSiluMul, h_dtype, args, device, stream);
  });
}

int moe_fp4_moe_reduce(const void* y, int y_dtype, int64_t y_rows, int64_t hidden, const int32_t* flat_to_slot,
                       const float* topk_weights, int64_t num_tokens, int32_t topk, void* out, int out_dtype,
                       int device, moe_fp4_stream_t stream) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_dtype("y_dtype", y_dtype, false));
    MOE_FP4_TRY(check_dtype("out_dtype", out_dtype, true));
    MOE_FP4_TRY(check_row_length("hidden", hidden, 8));
    MOE_FP4_REQUIRE(y_rows >= 0 && y_rows <= INT32_MAX, "y_rows: expected a count in [0, 2^31), got %" PRId64, y_rows);
    MOE_FP4_REQUIRE(topk >= 1, "topk: expected at least 1, got %d", int(topk));
    MOE_FP4_REQUIRE(num_tokens >= 0 && num_tokens * topk <= INT32_MAX,
                    "num_tokens: expected num_tokens * topk in [0, 2^31), got %" PRId64 " * %d", num_tokens, int(topk));
    MOE_FP4_TRY(check_pointer("y", y, y_rows > 0, 16));
    MOE_FP4_TRY(check_pointer("flat_to_slot", flat_to_slot, num_tokens > 0, 4));
    MOE_FP4_TRY(check_optional_pointer("topk_weights", topk_weights, 4));
    MOE_FP4_TRY(check_pointer("out", out, num_tokens > 0, 16));
    const ContextRestorer restorer;  // the caller's context back on return
    MOE_FP4_TRY(use_device(MOE_FP4_PIPELINE, device));
    const ReduceArgs args{y, y_rows, hidden, flat_to_slot, topk_weights, num_tokens, topk, out};
    return launch_moe_reduce(y_dtype, out_dtype, args, device, stream);
  });
}

int moe_fp4_check_inputs(const void* x, int x_dtype, int64_t x_numel, const float* weights, int64_t weights_numel,
                         const void* ids, int ids_dtype, int64_t ids_numel, const void* expert_map, int map_dtype,
                         int64_t map_numel, int64_t* result, int device, moe_fp4_stream_t stream) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_dtype("x_dtype", x_dtype, false));
    MOE_FP4_TRY(check_count("x_numel", x_numel));
    MOE_FP4_TRY(check_pointer("x", x, x_numel > 0, 2));
    MOE_FP4_TRY(check_count("weights_numel", weights_numel));
    MOE_FP4_TRY(check_pointer("weights", weights, weights_numel > 0, 4));
    MOE_FP4_TRY(check_index_buffer("ids", "ids", ids, ids_dtype, ids_numel));
    if (expert_map != nullptr) {
      MOE_FP4_TRY(check_index_buffer("expert_map", "map", expert_map, map_dtype, map_numel));
    } else {
      MOE_FP4_REQUIRE(map_numel == 0, "map_numel: expected 0 without expert_map (NULL), got %" PRId64, map_numel);
    }
    MOE_FP4_TRY(check_pointer("result", result, true, 8));
    const CheckInputsArgs args{x, x_dtype, x_numel, weights, weights_numel, ids, ids_dtype, ids_numel,
                               expert_map, map_dtype, map_numel};
    if (device == MOE_FP4_HOST) return check_inputs(args, result, device, stream);
    const ContextRestorer restorer;
    MOE_FP4_TRY(use_device(MOE_FP4_PIPELINE, device));
    MOE_FP4_TRY(check_not_capturing(stream, "moe_fp4_check_inputs"));
    return check_inputs(args, result, device, stream);
  });
}

int moe_fp4_grouped_gemm_workspace_size(int32_t num_experts, int32_t sections, int out_dtype, int device,
                                        size_t* bytes) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_dtype("out_dtype", out_dtype, false));
    MOE_FP4_TRY(check_groups(num_experts, sections));
    MOE_FP4_TRY(check_pointer("bytes", bytes, true, 1));
    const ContextRestorer restorer;  // the caller's context back on return
    MOE_FP4_TRY(use_device(MOE_FP4_GEMM, device));
    const GemmImpl* impl = nullptr;
    MOE_FP4_TRY(fp4_gemm_for_device(device, &impl));
    return impl->workspace_size(num_experts * sections, out_dtype, device, sm_count(device), bytes);
  });
}

int moe_fp4_grouped_gemm(const uint8_t* a, const uint8_t* a_scales, int64_t a_rows, int64_t a_scale_rows,
                         const uint8_t* b, const uint8_t* b_scales, const float* alpha, int32_t num_experts,
                         int32_t sections, int64_t n, int64_t k, const int32_t* expert_offsets,
                         const int32_t* blockscale_offsets, void* out, int out_dtype, void* workspace,
                         size_t workspace_bytes, int device, moe_fp4_stream_t stream) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_dtype("out_dtype", out_dtype, false));
    MOE_FP4_TRY(check_gemm_shape(num_experts, sections, n, k, a_rows, a_scale_rows));
    MOE_FP4_TRY(check_pointer("a", a, a_rows > 0, 16));
    MOE_FP4_TRY(check_pointer("a_scales", a_scales, a_rows > 0, 16));
    MOE_FP4_TRY(check_pointer("b", b, true, 16));
    MOE_FP4_TRY(check_pointer("b_scales", b_scales, true, 16));
    MOE_FP4_TRY(check_pointer("alpha", alpha, true, 4));
    MOE_FP4_TRY(check_pointer("expert_offsets", expert_offsets, true, 4));
    MOE_FP4_TRY(check_pointer("blockscale_offsets", blockscale_offsets, true, 4));
    MOE_FP4_TRY(check_pointer("out", out, a_rows > 0, 16));
    MOE_FP4_TRY(check_pointer("workspace", workspace, true, 256));
    const ContextRestorer restorer;  // the caller's context back on return
    MOE_FP4_TRY(use_device(MOE_FP4_GEMM, device));
    const GemmImpl* impl = nullptr;
    MOE_FP4_TRY(fp4_gemm_for_device(device, &impl));
    if (a_rows == 0) return MOE_FP4_OK;  // every group is empty
    const GemmArgs args{a, a_scales, a_rows, a_scale_rows, b, b_scales, alpha, num_experts, sections, n, k,
                        expert_offsets, blockscale_offsets, out, out_dtype, workspace, workspace_bytes, device,
                        sm_count(device)};
    return impl->run(args, stream);
  });
}

int moe_fp4_gemm_scale_offsets(int arch, int operand, int64_t rows, int64_t k, int64_t* offsets) {
  return guarded([&]() -> int {
    const GemmImpl* impl = nullptr;
    MOE_FP4_TRY(gemm_for_arch(arch, &impl));
    MOE_FP4_REQUIRE(operand == 0 || operand == 1, "operand: expected 0 (A, SFA) or 1 (B, SFB), got %d", operand);
    MOE_FP4_REQUIRE(rows >= 1 && rows <= (1 << 20), "rows: expected a count in [1, 2^20], got %" PRId64, rows);
    MOE_FP4_REQUIRE(k >= 16 && k % 16 == 0 && k <= (1 << 20), "k: expected a multiple of 16 in [16, 2^20], got %" PRId64, k);
    MOE_FP4_TRY(check_pointer("offsets", offsets, true, 8));
    return impl->scale_offsets(operand, rows, k, offsets);
  });
}

int moe_fp4_gemm_plan(int arch, int out_dtype, int32_t num_experts, int32_t sections, int sm_count,
                      size_t* workspace_bytes) {
  return guarded([&]() -> int {
    const GemmImpl* impl = nullptr;
    MOE_FP4_TRY(gemm_for_arch(arch, &impl));
    MOE_FP4_TRY(check_dtype("out_dtype", out_dtype, false));
    MOE_FP4_TRY(check_groups(num_experts, sections));
    MOE_FP4_REQUIRE(sm_count >= 1, "sm_count: expected at least 1, got %d", sm_count);
    MOE_FP4_TRY(check_pointer("workspace_bytes", workspace_bytes, true, 1));
    return impl->workspace_size(num_experts * sections, out_dtype, 0, sm_count, workspace_bytes);
  });
}

int moe_fp4_gemm_group_args(int arch, const int32_t* expert_offsets, const int32_t* blockscale_offsets,
                            int32_t num_experts, int32_t sections, int64_t n, int64_t k, int64_t a_rows,
                            int64_t a_scale_rows, int64_t* out) {
  return guarded([&]() -> int {
    const GemmImpl* impl = nullptr;
    MOE_FP4_TRY(gemm_for_arch(arch, &impl));
    MOE_FP4_TRY(check_gemm_shape(num_experts, sections, n, k, a_rows, a_scale_rows));
    MOE_FP4_TRY(check_pointer("expert_offsets", expert_offsets, true, 4));
    MOE_FP4_TRY(check_pointer("blockscale_offsets", blockscale_offsets, true, 4));
    MOE_FP4_TRY(check_pointer("out", out, true, 8));
    GemmArgs args{};
    args.num_experts = num_experts, args.sections = sections, args.n = n, args.k = k;
    args.a_rows = a_rows, args.a_scale_rows = a_scale_rows;
    args.expert_offsets = expert_offsets, args.blockscale_offsets = blockscale_offsets;
    return impl->group_args(args, out);
  });
}

int moe_fp4_sm90_prepared_sizes(int32_t num_experts, int64_t n, int64_t k, size_t* w_bytes, size_t* scale_bytes) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_sm90_weights(num_experts, n, k));
    MOE_FP4_TRY(check_pointer("w_bytes", w_bytes, true, 1));
    MOE_FP4_TRY(check_pointer("scale_bytes", scale_bytes, true, 1));
    *w_bytes = size_t(num_experts) * size_t(n) * size_t(k / 2);
    *scale_bytes = size_t(num_experts) * size_t(n) * size_t(k / 16);
    return MOE_FP4_OK;
  });
}

int moe_fp4_sm90_prepare_weights(const uint8_t* w, const uint8_t* scales, int32_t num_experts, int64_t n, int64_t k,
                                 int32_t sections, uint8_t* w_out, uint8_t* scales_out, int device,
                                 moe_fp4_stream_t stream) {
  return sm90_relayout(launch_sm90_prepare, w, scales, num_experts, n, k, sections, w_out, scales_out, device, stream);
}

int moe_fp4_sm90_restore_weights(const uint8_t* w, const uint8_t* scales, int32_t num_experts, int64_t n, int64_t k,
                                 int32_t sections, uint8_t* w_out, uint8_t* scales_out, int device,
                                 moe_fp4_stream_t stream) {
  return sm90_relayout(launch_sm90_restore, w, scales, num_experts, n, k, sections, w_out, scales_out, device, stream);
}

int moe_fp4_sm90_gemm_tile_tokens(int64_t a_rows, int32_t num_experts, int32_t* tile_tokens) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_experts(num_experts));
    MOE_FP4_REQUIRE(a_rows >= 0 && a_rows <= INT32_MAX, "a_rows: expected a count in [0, 2^31), got %" PRId64, a_rows);
    MOE_FP4_TRY(check_pointer("tile_tokens", tile_tokens, true, 4));
#if defined(MOE_FP4_HAVE_GEMM_SM90)
    *tile_tokens = sm90_tile_tokens(a_rows, num_experts);
    return MOE_FP4_OK;
#else
    return set_error(MOE_FP4_ERROR_UNSUPPORTED, "this library was built without the sm_90a grouped GEMM");
#endif
  });
}

namespace {

int check_sm90_config(int32_t tile_tokens, int32_t slices, int32_t cta_splits, int32_t gs_splits) {
  MOE_FP4_TRY(check_tile_tokens(tile_tokens));
  MOE_FP4_REQUIRE(slices >= 0 && slices <= 2, "slices: expected 0 (heuristic), 1 or 2, got %d", int(slices));
  MOE_FP4_REQUIRE(cta_splits >= 0 && cta_splits <= 8, "cta_splits: expected 0 (heuristic) or 1 to 8, got %d",
                  int(cta_splits));
  MOE_FP4_REQUIRE(gs_splits >= 0 && gs_splits <= 16, "gs_splits: expected 0 (heuristic) or 1 to 16, got %d",
                  int(gs_splits));
  MOE_FP4_REQUIRE(gs_splits <= 1 || ((tile_tokens == 8 || tile_tokens == 16) && cta_splits <= 1),
                  "gs_splits: a K split through the workspace (%d) needs tile_tokens 8 or 16 and no cluster split, "
                  "got tile_tokens %d, cta_splits %d",
                  int(gs_splits), int(tile_tokens), int(cta_splits));
  return MOE_FP4_OK;
}

int sm90_gemm_entry(const void* a, int a_dtype, int64_t a_rows, int64_t k, const uint8_t* w, const uint8_t* w_scales,
                    const float* alpha, int32_t num_experts, int32_t sections, int64_t n,
                    const int32_t* expert_offsets, void* out, int32_t tile_tokens, int32_t slices, int32_t cta_splits,
                    int32_t gs_splits, void* workspace, size_t workspace_bytes, int device,
                    moe_fp4_stream_t stream, void* silu_out = nullptr, const float* silu_gs = nullptr) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_dtype("a_dtype", a_dtype, false));
    MOE_FP4_TRY(check_groups(num_experts, sections));
    MOE_FP4_TRY(check_sm90_weights(num_experts, n, k));
    MOE_FP4_REQUIRE(n % sections == 0, "n: expected a multiple of sections = %d (gate rows, then up rows), got %" PRId64,
                    int(sections), n);
    MOE_FP4_REQUIRE(a_rows >= 0 && a_rows <= INT32_MAX, "a_rows: expected a count in [0, 2^31), got %" PRId64, a_rows);
    MOE_FP4_TRY(check_sm90_config(tile_tokens, slices, cta_splits, gs_splits));
    MOE_FP4_TRY(check_optional_pointer("workspace", workspace, 16));
    MOE_FP4_REQUIRE(gs_splits <= 1 || workspace != nullptr,
                    "workspace: gs_splits = %d splits K through the workspace, got NULL", int(gs_splits));
    MOE_FP4_TRY(check_pointer("a", a, a_rows > 0, 16));
    MOE_FP4_TRY(check_pointer("w", w, true, 16));
    MOE_FP4_TRY(check_pointer("w_scales", w_scales, true, 16));
    MOE_FP4_TRY(check_pointer("alpha", alpha, true, 4));
    MOE_FP4_TRY(check_pointer("expert_offsets", expert_offsets, true, 4));
    if (silu_out == nullptr) MOE_FP4_TRY(check_pointer("out", out, a_rows > 0, 16));
    if (device == MOE_FP4_HOST)
      return set_error(MOE_FP4_ERROR_UNSUPPORTED,
                       "device: the sm_90a grouped GEMM has no host mode (MOE_FP4_HOST); it needs an sm_90 GPU");
    const ContextRestorer restorer;  // the caller's context back on return
    MOE_FP4_TRY(use_device(MOE_FP4_GEMM, device));
    const int cc = g_capability[device].load(std::memory_order_relaxed);
    if (cc != 90)
      return set_error(MOE_FP4_ERROR_UNSUPPORTED,
                       "device %d: moe_fp4_sm90_grouped_gemm runs on sm_90 (H100, H200), this device is sm_%d; use "
                       "moe_fp4_grouped_gemm",
                       device, cc);
#if defined(MOE_FP4_HAVE_GEMM_SM90)
    if (a_rows == 0) return MOE_FP4_OK;
    Sm90GemmArgs args{a, a_dtype, a_rows, k, w, w_scales, alpha, num_experts, sections, n, expert_offsets, out,
                      int(tile_tokens), device, sm_count(device)};
    args.slices = slices;
    args.cta_splits = cta_splits;
    args.gs_splits = gs_splits;
    args.workspace = workspace;
    args.workspace_bytes = workspace != nullptr ? workspace_bytes : 0;
    args.silu_out = silu_out;
    args.silu_gs = silu_gs;
    return sm90_grouped_gemm(args, stream);
#else
    return set_error(MOE_FP4_ERROR_UNSUPPORTED, "this library was built without the sm_90a grouped GEMM");
#endif
  });
}

}  // namespace

int moe_fp4_sm90_grouped_gemm(const void* a, int a_dtype, int64_t a_rows, int64_t k, const uint8_t* w,
                              const uint8_t* w_scales, const float* alpha, int32_t num_experts, int32_t sections,
                              int64_t n, const int32_t* expert_offsets, void* out, int32_t tile_tokens, int device,
                              moe_fp4_stream_t stream) {
  return sm90_gemm_entry(a, a_dtype, a_rows, k, w, w_scales, alpha, num_experts, sections, n, expert_offsets, out,
                         tile_tokens, 0, 0, 1, nullptr, 0, device, stream);
}

int moe_fp4_sm90_grouped_gemm_ws(const void* a, int a_dtype, int64_t a_rows, int64_t k, const uint8_t* w,
                                 const uint8_t* w_scales, const float* alpha, int32_t num_experts, int32_t sections,
                                 int64_t n, const int32_t* expert_offsets, void* out, int32_t tile_tokens,
                                 void* workspace, size_t workspace_bytes, int device, moe_fp4_stream_t stream) {
  return sm90_gemm_entry(a, a_dtype, a_rows, k, w, w_scales, alpha, num_experts, sections, n, expert_offsets, out,
                         tile_tokens, 0, 0, 0, workspace, workspace_bytes, device, stream);
}

int moe_fp4_sm90_grouped_gemm_config(const void* a, int a_dtype, int64_t a_rows, int64_t k, const uint8_t* w,
                                     const uint8_t* w_scales, const float* alpha, int32_t num_experts,
                                     int32_t sections, int64_t n, const int32_t* expert_offsets, void* out,
                                     int32_t tile_tokens, int32_t slices, int32_t cta_splits, int32_t gs_splits,
                                     void* workspace, size_t workspace_bytes, int device, moe_fp4_stream_t stream) {
  return sm90_gemm_entry(a, a_dtype, a_rows, k, w, w_scales, alpha, num_experts, sections, n, expert_offsets, out,
                         tile_tokens, slices, cta_splits, gs_splits, workspace, workspace_bytes, device, stream);
}

int moe_fp4_sm90_gemm_silu(const void* a, int a_dtype, int64_t a_rows, int64_t k, const uint8_t* w,
                           const uint8_t* w_scales, const float* alpha, int32_t num_experts, int64_t n,
                           const int32_t* expert_offsets, const float* gs, void* values, int32_t tile_tokens,
                           int32_t slices, int32_t cta_splits, int32_t gs_splits, void* workspace,
                           size_t workspace_bytes, int device, moe_fp4_stream_t stream) {
  const int status = guarded([&]() -> int {
    MOE_FP4_REQUIRE(n % 32 == 0, "n: expected a multiple of 32 (gate and up rows of whole 16-value blocks of h), got %"
                    PRId64, n);
    MOE_FP4_TRY(check_pointer("values", values, a_rows > 0, 16));
    MOE_FP4_TRY(check_optional_pointer("gs", gs, 4));
    return MOE_FP4_OK;
  });
  if (status != MOE_FP4_OK) return status;
  return sm90_gemm_entry(a, a_dtype, a_rows, k, w, w_scales, alpha, num_experts, 2, n, expert_offsets, nullptr,
                         tile_tokens, slices, cta_splits, gs_splits, workspace, workspace_bytes, device, stream, values,
                         gs);
}

int moe_fp4_sm90_gemm_workspace_size(int64_t a_rows, int32_t num_experts, int64_t n, int64_t k, int32_t tile_tokens,
                                     int32_t sm_count, size_t* bytes) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_experts(num_experts));
    MOE_FP4_TRY(check_sm90_weights(num_experts, n, k));
    MOE_FP4_REQUIRE(a_rows >= 0 && a_rows <= INT32_MAX, "a_rows: expected a count in [0, 2^31), got %" PRId64, a_rows);
    MOE_FP4_TRY(check_tile_tokens(tile_tokens));
    MOE_FP4_REQUIRE(sm_count > 0, "sm_count: expected a positive SM count, got %d", int(sm_count));
    MOE_FP4_TRY(check_pointer("bytes", bytes, true, 8));
#if defined(MOE_FP4_HAVE_GEMM_SM90)
    *bytes = sm90_workspace_bytes(sm90_plan(a_rows, num_experts, n, k, sm_count, tile_tokens, 0, 0, 0), a_rows,
                                  num_experts, n, sm_count);
    return MOE_FP4_OK;
#else
    return set_error(MOE_FP4_ERROR_UNSUPPORTED, "this library was built without the sm_90a grouped GEMM");
#endif
  });
}

int moe_fp4_sm90_gemm_plan(int64_t a_rows, int32_t num_experts, int64_t n, int64_t k, int32_t sm_count,
                           int32_t with_workspace, int32_t* tile_tokens, int32_t* slices, int32_t* cta_splits,
                           int32_t* gs_splits) {
  return guarded([&]() -> int {
    MOE_FP4_TRY(check_experts(num_experts));
    MOE_FP4_TRY(check_sm90_weights(num_experts, n, k));
    MOE_FP4_REQUIRE(a_rows >= 0 && a_rows <= INT32_MAX, "a_rows: expected a count in [0, 2^31), got %" PRId64, a_rows);
    MOE_FP4_REQUIRE(sm_count > 0, "sm_count: expected a positive SM count, got %d", int(sm_count));
    MOE_FP4_TRY(check_pointer("tile_tokens", tile_tokens, true, 4));
    MOE_FP4_TRY(check_pointer("slices", slices, true, 4));
    MOE_FP4_TRY(check_pointer("cta_splits", cta_splits, true, 4));
    MOE_FP4_TRY(check_pointer("gs_splits", gs_splits, true, 4));
    MOE_FP4_REQUIRE(with_workspace == 0 || with_workspace == 1, "with_workspace: expected 0 or 1, got %d",
                    int(with_workspace));
#if defined(MOE_FP4_HAVE_GEMM_SM90)
    const Sm90Plan plan = sm90_plan(a_rows, num_experts, n, k, sm_count, 0, 0, 0, with_workspace ? 0 : 1);
    *tile_tokens = plan.tile_tokens;
    *slices = plan.slices;
    *cta_splits = plan.cta_splits;
    *gs_splits = plan.gs_splits;
    return MOE_FP4_OK;
#else
    return set_error(MOE_FP4_ERROR_UNSUPPORTED, "this library was built without the sm_90a grouped GEMM");
#endif
  });
}

int moe_fp4_launch_kernels(const moe_fp4_kernel_launch* const* launches, int32_t count, const uint64_t* free_values,
                           int32_t num_free, int device, moe_fp4_stream_t stream) {
  return guarded([&]() -> int {
    MOE_FP4_REQUIRE(count >= 0, "count: expected a count of launches >= 0, got %d", int(count));
    MOE_FP4_REQUIRE(num_free >= 0, "num_free: expected a count of free values >= 0, got %d", int(num_free));
    MOE_FP4_TRY(check_pointer("launches", launches, count > 0, alignof(void*)));
    MOE_FP4_TRY(check_pointer("free_values", free_values, num_free > 0, 8));
    MOE_FP4_TRY(check_kernel_launches(launches, count, num_free));
    MOE_FP4_REQUIRE(device >= 0 && device < kMaxDevices, "device: expected a CUDA device ordinal in [0, %d), got %d",
                    kMaxDevices, device);
    int current = -1;
    MOE_FP4_TRY(cuda_status(cudaGetDevice(&current), "cudaGetDevice"));
    MOE_FP4_REQUIRE(current == device, "device: expected the current CUDA device (%d), got %d", current, device);
    const ContextRestorer restorer;  // the caller's context back on return
    // The driver launches in the current context: the caller's as it is, else the device's primary one.
    if (!restorer.had_context()) MOE_FP4_TRY(cuda_status(cudaSetDevice(device), "cudaSetDevice"));
    return launch_kernels(launches, count, free_values, stream);
  });
}

}  // extern "C"
