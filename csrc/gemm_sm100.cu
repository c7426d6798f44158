// NVFP4 grouped GEMM for SM100 (B200, GB200), built only for sm_100a.
//
// Configuration: the pointer-array tcgen05 kernel with the 1-SM
// NVF4 mainloop (UTCOMMA block-scaled MMA, scale factors copied to tensor memory), tile
// 128x128x128, cluster 1x1x1, epilogue tile 128x64, C = void: the configuration vLLM runs for
// its SM100 NVFP4 MoE. bf16 and fp16 D share the mainloop.
#include "moe_fp4/grouped_gemm.cuh"

#if !defined(CUTLASS_ARCH_MMA_SM100_SUPPORTED)
#error "CUTLASS does not support SM100 with this nvcc (needs CUDA 12.8 or newer)"
#endif

namespace moe_fp4 {
namespace {

struct Sm100Config {
  using ArchTag = cutlass::arch::Sm100;
  using MmaTile = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmNvf4Sm100;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm;
  using EpilogueTile = cute::Shape<cute::_128, cute::_64>;
  static constexpr size_t kMaxSharedMemory = 232448;  // B200 per-block opt-in limit
};

}  // namespace

extern const GemmImpl kGemmSm100 = gemm::Entry<Sm100Config>::impl();

}  // namespace moe_fp4
