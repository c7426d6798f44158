// NVFP4 grouped GEMM on CUTLASS 4.2, shared by gemm_sm100.cu and gemm_sm120.cu.
//
// One CUTLASS group per (expert e, section h): D[rows of e, cols of h] =
// alpha[e*S+h] * A_e . B_e[h]^T with A = packed e2m1 activations (RowMajor, K-major), B =
// packed e2m1 weights (ColumnMajor, i.e. K-major rows of N), both with e4m3 block scales in
// the 128x4 swizzled layout, fp32 accumulation, D 16-bit RowMajor with pitch n (a section's
// columns start at h*n/S), C = void (beta = 0). Sections share A; each has its own alpha,
// which is how gate and up with different global scales stay exact (w13: S = 2).
//
// A device setup kernel (grid-stride over groups, so any E) writes the per-group problem
// sizes, pointers, strides and scale-factor layouts from expert_offsets and
// blockscale_offsets: no host synchronization. Empty experts get M = 0, for which CUTLASS
// 4.2's group scheduler (PersistentTileSchedulerSm90Group, also behind the SM100 one)
// produces no tiles, so such a group never touches memory; K stays the real K (4.2 cannot
// take K = 0). A group whose offsets do not fit a_rows / a_scale_rows also gets M = 0.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <type_traits>

#include "moe_fp4/common.hpp"
#include "moe_fp4/gemm.hpp"

namespace moe_fp4::gemm {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using ElementAB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
constexpr int kAlignmentAB = 32;  // elements: 16 bytes of e2m1

// The CUTLASS kernel for one architecture configuration `Arch` and output type ElementD.
// Arch provides ArchTag, MmaTile, Cluster, KernelSchedule, EpilogueSchedule, EpilogueTile and
// kMaxSharedMemory.
template <class Arch, class ElementD>
struct Kernel {
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      typename Arch::ArchTag, cutlass::arch::OpClassBlockScaledTensorOp, typename Arch::MmaTile,
      typename Arch::Cluster, typename Arch::EpilogueTile, float, float, void, LayoutD*, kAlignmentD,
      ElementD, LayoutD*, kAlignmentD, typename Arch::EpilogueSchedule>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      typename Arch::ArchTag, cutlass::arch::OpClassBlockScaledTensorOp, ElementAB, LayoutA*, kAlignmentAB,
      ElementAB, LayoutB*, kAlignmentAB, float, typename Arch::MmaTile, typename Arch::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Arch::KernelSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  // CUTLASS 4.2 sizes the stages without the scheduler/tensormap storage: check the whole
  // kernel's shared memory against the device limit here.
  static_assert(sizeof(typename GemmKernel::SharedStorage) <= Arch::kMaxSharedMemory,
                "grouped GEMM shared storage exceeds the architecture's shared memory");

  // Per-group array element types, as the Arguments structs spell them.
  using MainArgs = typename Mainloop::Arguments;
  using EpiArgs = typename Epilogue::Arguments;
  using PtrA = std::remove_pointer_t<decltype(MainArgs::ptr_A)>;
  using PtrB = std::remove_pointer_t<decltype(MainArgs::ptr_B)>;
  using PtrSF = std::remove_pointer_t<decltype(MainArgs::ptr_SFA)>;
  using PtrD = std::remove_pointer_t<decltype(EpiArgs::ptr_D)>;
  using StrideA = std::remove_pointer_t<decltype(MainArgs::dA)>;
  using StrideB = std::remove_pointer_t<decltype(MainArgs::dB)>;
  using StrideD = std::remove_pointer_t<decltype(EpiArgs::dD)>;
  using LayoutSFA = std::remove_pointer_t<decltype(MainArgs::layout_SFA)>;
  using LayoutSFB = std::remove_pointer_t<decltype(MainArgs::layout_SFB)>;
  using ScaleConfig = typename Mainloop::Sm1xxBlkScaledConfig;
  using Shape = typename ProblemShape::UnderlyingProblemShape;
};

// ------------------------------------------------------------------ per-group arguments

// Group g = e*S + h in numbers: sizes and byte offsets from the base pointers.
struct GroupDesc {
  int m, n, k;
  int64_t a, b, sfa, sfb, d;  // byte offsets (d in bytes of a 2-byte element)
  int64_t ldd;                // row pitch of D in elements
};

MOE_FP4_HD GroupDesc describe_group(const GemmArgs& p, int64_t g) {
  const int64_t e = g / p.sections, h = g % p.sections;
  const int64_t ns = p.n / p.sections;
  const int64_t cp = scale_cols(p.k);
  const int64_t begin = p.expert_offsets[e], end = p.expert_offsets[e + 1];
  const int64_t sf_row = p.blockscale_offsets[e];
  int64_t m = end - begin;
  // Empty experts and offsets that do not fit the buffers produce no work.
  if (m < 0 || begin < 0 || end > p.a_rows || sf_row < 0 || sf_row + round_up(m, 128) > p.a_scale_rows) m = 0;
  GroupDesc d;
  d.m = int(m);
  d.n = int(ns);
  d.k = int(p.k);
  d.a = m > 0 ? begin * (p.k / 2) : 0;
  d.b = (e * p.n + h * ns) * (p.k / 2);
  d.sfa = m > 0 ? sf_row * cp : 0;
  d.sfb = (e * p.sections + h) * round_up(ns, 128) * cp;
  d.d = m > 0 ? (begin * p.n + h * ns) * 2 : 0;
  d.ldd = p.n;
  return d;
}

// Device arrays CUTLASS reads, one entry per group, carved out of the caller's workspace.
template <class K>
struct GroupArrays {
  typename K::Shape* shapes;
  typename K::PtrA* a;
  typename K::PtrB* b;
  typename K::PtrSF* sfa;
  typename K::PtrSF* sfb;
  typename K::PtrD* d;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideD* stride_d;
  typename K::LayoutSFA* layout_sfa;
  typename K::LayoutSFB* layout_sfb;

  // Lays the arrays out from `base` (nullptr: only measures); returns the bytes used.
  static size_t carve(char* base, int64_t groups, GroupArrays* out) {
    size_t used = 0;
    auto take = [&](auto*& field) {
      using T = std::remove_reference_t<decltype(*field)>;
      used = size_t(round_up(int64_t(used), 256));
      field = base ? reinterpret_cast<T*>(base + used) : nullptr;
      used += sizeof(T) * size_t(groups);
    };
    GroupArrays arr{};
    take(arr.shapes), take(arr.a), take(arr.b), take(arr.sfa), take(arr.sfb), take(arr.d);
    take(arr.stride_a), take(arr.stride_b), take(arr.stride_d), take(arr.layout_sfa), take(arr.layout_sfb);
    if (out) *out = arr;
    return size_t(round_up(int64_t(used), 256));
  }
};

template <class K>
MOE_FP4_HD typename K::LayoutSFA layout_sfa(int m, int n, int k) {
  return K::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
}

template <class K>
MOE_FP4_HD typename K::LayoutSFB layout_sfb(int m, int n, int k) {
  return K::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
}

template <class K>
__global__ void setup_groups_kernel(GemmArgs p, GroupArrays<K> arr, int64_t groups) {
  using namespace cute;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += int64_t(gridDim.x) * blockDim.x) {
    const GroupDesc d = describe_group(p, g);
    arr.shapes[g] = typename K::Shape(d.m, d.n, d.k);
    arr.a[g] = reinterpret_cast<typename K::PtrA>(p.a + d.a);
    arr.b[g] = reinterpret_cast<typename K::PtrB>(p.b + d.b);
    arr.sfa[g] = reinterpret_cast<typename K::PtrSF>(p.a_scales + d.sfa);
    arr.sfb[g] = reinterpret_cast<typename K::PtrSF>(p.b_scales + d.sfb);
    arr.d[g] = reinterpret_cast<typename K::PtrD>(static_cast<char*>(p.out) + d.d);
    typename K::StrideA sa{};
    typename K::StrideB sb{};
    typename K::StrideD sd{};
    get<0>(sa) = d.k;  // leading dimensions in elements
    get<0>(sb) = d.k;
    get<0>(sd) = d.ldd;
    arr.stride_a[g] = sa;
    arr.stride_b[g] = sb;
    arr.stride_d[g] = sd;
    arr.layout_sfa[g] = layout_sfa<K>(d.m, d.n, d.k);
    arr.layout_sfb[g] = layout_sfb<K>(d.m, d.n, d.k);
  }
}

// ------------------------------------------------------------------ entry points of one architecture

template <class Arch>
struct Entry {
  template <class ElementD>
  static typename Kernel<Arch, ElementD>::Gemm::Arguments arguments(const GroupArrays<Kernel<Arch, ElementD>>& arr,
                                                                    int64_t groups, const float* alpha, int device,
                                                                    int sm_count) {
    using K = Kernel<Arch, ElementD>;
    typename K::Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {int(groups), arr.shapes, nullptr};  // sizes live on the device only
    args.mainloop.ptr_A = arr.a;
    args.mainloop.dA = arr.stride_a;
    args.mainloop.ptr_B = arr.b;
    args.mainloop.dB = arr.stride_b;
    args.mainloop.ptr_SFA = arr.sfa;
    args.mainloop.layout_SFA = arr.layout_sfa;
    args.mainloop.ptr_SFB = arr.sfb;
    args.mainloop.layout_SFB = arr.layout_sfb;
    args.epilogue.thread.alpha_ptr = alpha;  // alpha[g]: one float per group
    args.epilogue.thread.dAlpha = {cute::_0{}, cute::_0{}, 1};
    args.epilogue.ptr_C = nullptr;
    args.epilogue.ptr_D = arr.d;
    args.epilogue.dD = arr.stride_d;
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;
    return args;
  }

  // Checks the configuration with CUTLASS's can_implement (host only) and sizes the workspace:
  // the per-group arrays, then CUTLASS's own (tensormaps per SM, scheduler).
  template <class ElementD>
  static int plan(int64_t groups, int device, int sm_count, size_t* bytes) {
    using K = Kernel<Arch, ElementD>;
    GroupArrays<K> arr{};
    const size_t own = GroupArrays<K>::carve(nullptr, groups, &arr);
    const auto args = arguments<ElementD>(arr, groups, nullptr, device, sm_count);
    const cutlass::Status st = K::Gemm::can_implement(args);
    if (st != cutlass::Status::kSuccess)
      return set_error(MOE_FP4_ERROR_INTERNAL, "CUTLASS can_implement: %s", cutlass::cutlassGetStatusString(st));
    *bytes = own + K::Gemm::get_workspace_size(args);
    return MOE_FP4_OK;
  }

  static int workspace_size(int32_t groups, int out_dtype, int device, int sm_count, size_t* bytes) {
    return out_dtype == MOE_FP4_BF16 ? plan<cutlass::bfloat16_t>(groups, device, sm_count, bytes)
                                     : plan<cutlass::half_t>(groups, device, sm_count, bytes);
  }

  template <class ElementD>
  static int run_typed(const GemmArgs& p, cudaStream_t stream) {
    using K = Kernel<Arch, ElementD>;
    const int64_t groups = int64_t(p.num_experts) * p.sections;
    size_t need = 0;
    MOE_FP4_TRY(plan<ElementD>(groups, p.device, p.sm_count, &need));
    MOE_FP4_REQUIRE(need <= p.workspace_bytes,
                    "workspace_bytes: expected at least %zu (moe_fp4_grouped_gemm_workspace_size), got %zu", need,
                    p.workspace_bytes);
    GroupArrays<K> arr{};
    const size_t own = GroupArrays<K>::carve(static_cast<char*>(p.workspace), groups, &arr);
    const auto args = arguments<ElementD>(arr, groups, p.alpha, p.device, p.sm_count);

    setup_groups_kernel<K><<<grid_for(groups, 128, p.sm_count), 128, 0, stream>>>(p, arr, groups);
    MOE_FP4_TRY(cuda_status(cudaGetLastError(), "grouped GEMM setup kernel launch"));

    typename K::Gemm gemm;
    cutlass::Status st = gemm.initialize(args, static_cast<char*>(p.workspace) + own, stream);
    if (st != cutlass::Status::kSuccess)
      return set_error(MOE_FP4_ERROR_INTERNAL, "CUTLASS initialize: %s", cutlass::cutlassGetStatusString(st));
    st = gemm.run(stream);
    if (st != cutlass::Status::kSuccess)
      return set_error(MOE_FP4_ERROR_INTERNAL, "CUTLASS run: %s", cutlass::cutlassGetStatusString(st));
    return cuda_status(cudaGetLastError(), "grouped GEMM launch");
  }

  static int run(const GemmArgs& p, cudaStream_t stream) {
    return p.out_dtype == MOE_FP4_BF16 ? run_typed<cutlass::bfloat16_t>(p, stream)
                                       : run_typed<cutlass::half_t>(p, stream);
  }

  // The SF layouts are the same for both output types; bf16 names the kernel.
  using LayoutKernel = Kernel<Arch, cutlass::bfloat16_t>;

  static int scale_offsets(int operand, int64_t rows, int64_t k, int64_t* offsets) {
    const int64_t cols = k / 16;
    auto fill = [&](const auto& layout) {  // layout(m or n, k, l): k in elements, 16 per scale
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) offsets[r * cols + c] = layout(int(r), int(c * 16), 0);
    };
    if (operand == 0)
      fill(layout_sfa<LayoutKernel>(int(rows), 1, int(k)));
    else
      fill(layout_sfb<LayoutKernel>(1, int(rows), int(k)));
    return MOE_FP4_OK;
  }

  static int group_args(const GemmArgs& p, int64_t* out) {
    const int64_t groups = int64_t(p.num_experts) * p.sections;
    for (int64_t g = 0; g < groups; ++g) {
      const GroupDesc d = describe_group(p, g);
      const int64_t row[9] = {d.m, d.n, d.k, d.a, d.b, d.sfa, d.sfb, d.d, d.ldd};
      for (int i = 0; i < 9; ++i) out[g * 9 + i] = row[i];
    }
    return MOE_FP4_OK;
  }

  static constexpr GemmImpl impl() { return GemmImpl{&workspace_size, &run, &scale_offsets, &group_args}; }
};

}  // namespace moe_fp4::gemm
