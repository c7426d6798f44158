// NVFP4 grouped GEMM for SM120 and SM121 (RTX 50xx, RTX PRO 6000, DGX Spark), built only for
// the family target sm_120f: one cubin for compute capability 12.0 and 12.1.
//
// Configuration: the SM90-style pointer-array shell with the
// cooperative block-scaled SM120 mainloop (mma.sync ... kind::mxf4nvf4.block_scale, 2 MMA
// warpgroups + 1 producer warpgroup), tile 128x128x128, cluster 1x1x1 (the only one SM120
// supports), C = void. bf16 and fp16 D instantiate the same mainloop; they differ only in
// the epilogue's conversion and both fit 101376 bytes of shared memory (static_assert in
// grouped_gemm.cuh).
#include "moe_fp4/grouped_gemm.cuh"

#if !defined(CUTLASS_ARCH_MMA_SM120_SUPPORTED)
#error "CUTLASS does not support SM120 with this nvcc (needs CUDA 12.8 or newer)"
#endif

namespace moe_fp4 {
namespace {

struct Sm120Config {
  using ArchTag = cutlass::arch::Sm120;  // SM121 too: CUTLASS has no Sm121 tag
  using MmaTile = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto;
  static constexpr size_t kMaxSharedMemory = 101376;  // opt-in limit of SM120/SM121
};

}  // namespace

extern const GemmImpl kGemmSm120 = gemm::Entry<Sm120Config>::impl();

}  // namespace moe_fp4
