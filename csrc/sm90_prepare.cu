// Re-layout of NVFP4 weights for the sm_90a grouped GEMM (moe_fp4_sm90_prepare_weights): the
// layout and its exactness argument are in include/moe_fp4/sm90_layout.cuh. One kernel body for
// the device and the host oracle (device = MOE_FP4_HOST). Built with the pipeline kernels (for
// every target), so CI can run it on the host.
//
// Work unit: (expert e, row block rb, K chunk c, lane L): it reads the 2 x 4 code bytes and 2
// scale bytes per k16 step that lane L of the GEMM's warp needs and writes its 16 (or, in a
// tail chunk, 4 per step) code bytes; the lanes with t = 0 also write their row pair's 8 (2 per
// step) scale bytes. Every output byte is written exactly once.
#include <cstring>

#include "moe_fp4/common.hpp"
#include "moe_fp4/launch.cuh"
#include "moe_fp4/pipeline.hpp"
#include "moe_fp4/sm90_layout.cuh"

namespace moe_fp4 {
namespace {

using namespace sm90;

struct PrepareUnit {
  Sm90PrepareArgs a;

  MOE_FP4_HD void operator()(int64_t unit) const {
    const int64_t chunks = ceil_div(a.k, kChunk);
    const int64_t full = a.k / kChunk;
    const int lane = int(unit % 32);
    int64_t rest = unit / 32;
    const int64_t c = rest % chunks;
    rest /= chunks;
    const int64_t nrb = a.n / kRowBlock;
    const int64_t rb = rest % nrb;
    const int64_t e = rest / nrb;
    const int g = lane / 4, t = lane % 4;
    const int steps = c < full ? kStepsPerChunk : int((a.k / 16) % kStepsPerChunk);
    const int64_t row_bytes = a.k / 2, row_scales = a.k / 16;
    const int64_t row_g = e * a.n + rb * kRowBlock + g;  // row of [E*n]
    const int64_t row_g8 = row_g + 8;

    uint32_t words[kStepsPerChunk] = {0, 0, 0, 0};
    uint8_t q_g[kStepsPerChunk] = {0, 0, 0, 0}, q_g8[kStepsPerChunk] = {0, 0, 0, 0};
    for (int j = 0; j < steps; ++j) {
      const int64_t kb = c * kStepsPerChunk + j;  // k16 block = scale column
      const uint8_t s_g = a.scales[row_g * row_scales + kb];
      const uint8_t s_g8 = a.scales[row_g8 * row_scales + kb];
      // Register r: rows g (r even) / g+8 (r odd), columns 16kb + 2t (+8 for r >= 2).
      const uint8_t bytes[4] = {a.w[row_g * row_bytes + kb * 8 + t], a.w[row_g8 * row_bytes + kb * 8 + t],
                                a.w[row_g * row_bytes + kb * 8 + t + 4], a.w[row_g8 * row_bytes + kb * 8 + t + 4]};
      uint32_t word = 0;
      for (int r = 0; r < 4; ++r) {
        const uint8_t s = (r & 1) ? s_g8 : s_g;
        word |= place_codes(r, canonical_code(bytes[r] & 0xFu, s), canonical_code(uint32_t(bytes[r]) >> 4, s));
      }
      words[j] = word;
      q_g[j] = encode_scale(s_g);
      q_g8[j] = encode_scale(s_g8);
    }

    uint8_t* codes = a.w_out + code_chunk_offset(e, rb, c, a.n, a.k);
    uint8_t* scales = a.scales_out + scale_chunk_offset(e, rb, c, a.n, a.k);
    if (c < full) {
      std::memcpy(codes + lane * 16, words, 16);
      if (t == 0) {  // the 4 lanes of a row pair share its scales
        const uint8_t sq[8] = {q_g[0], q_g[1], q_g8[0], q_g8[1], q_g[2], q_g[3], q_g8[2], q_g8[3]};
        std::memcpy(scales + g * 8, sq, 8);
      }
    } else {
      for (int j = 0; j < steps; ++j) {
        std::memcpy(codes + j * 128 + lane * 4, &words[j], 4);
        if (t == 0) {
          const uint8_t sq[2] = {q_g[j], q_g8[j]};
          std::memcpy(scales + j * 16 + g * 2, sq, 2);
        }
      }
    }
  }
};

}  // namespace

int launch_sm90_prepare(const Sm90PrepareArgs& args, int device, cudaStream_t stream) {
  const int64_t units = int64_t(args.num_experts) * (args.n / kRowBlock) * ceil_div(args.k, kChunk) * 32;
  return for_each_unit(PrepareUnit{args}, units, device, stream, "sm90 weight preparation kernel launch");
}

}  // namespace moe_fp4
