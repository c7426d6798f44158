// Re-layout of NVFP4 weights for the sm_90a grouped GEMM (moe_fp4_sm90_prepare_weights) and its
// inverse (moe_fp4_sm90_restore_weights): the layout and its exactness argument are in
// include/moe_fp4/sm90_layout.cuh. One kernel body each for the device and the host oracle
// (device = MOE_FP4_HOST). Built with the pipeline kernels (for every target), so CI can run
// them on the host.
//
// Work unit (both directions): (expert e, row block rb, K chunk c, lane L). Prepare reads the
// 2 x 4 code bytes and 2 scale bytes per k16 step that lane L of the GEMM's warp needs and writes
// its 16 (or, in a tail chunk, 4 per step) code bytes; the lanes with t = 0 also write their row
// pair's 8 (2 per step) scale bytes. Restore reads those prepared bytes and writes the canonical
// ones the same unit of prepare read (the t = 0 lanes the scales). Over all units each output
// byte is written exactly once, in both directions.
#include <cstring>

#include "moe_fp4/common.hpp"
#include "moe_fp4/launch.cuh"
#include "moe_fp4/pipeline.hpp"
#include "moe_fp4/sm90_layout.cuh"

namespace moe_fp4 {
namespace {

using namespace sm90;

// The codecs invert the encoder exactly (the restore contract rests on these).
constexpr bool scales_round_trip() {
  for (int b = 0; b <= 0x7F; ++b)  // zero, the subnormals 0x01..0x07, the normals, NaN 0x7F
    if (decode_scale(encode_scale(uint8_t(b))) != b) return false;
  return true;
}
static_assert(scales_round_trip(), "decode_scale must invert encode_scale on every non-negative e4m3 byte");
constexpr bool codes_round_trip() {
  uint32_t used = 0;
  for (int slot = 0; slot < 4; ++slot) {
    const uint32_t bits = place_codes(slot, 0xFu, 0xFu);
    if (used & bits) return false;  // the slots' bits are disjoint ...
    used |= bits;
    for (uint32_t byte = 0; byte < 256; ++byte)  // ... and each slot's byte comes back, all bits of w set elsewhere
      if (extract_codes(slot, place_codes(slot, byte & 0xFu, byte >> 4) | ~bits) != byte) return false;
  }
  return used == 0xFFFFFFFFu;  // and fill the step word
}
static_assert(codes_round_trip(), "extract_codes must invert place_codes");
// The GEMM's register decoders read the layout place_codes writes: for every slot and every pair
// of codes (the other slots' bits all set), each half of the slot's register is the dtype's
// pattern of its code, (sign << 15) | (mag << 6) for bf16, (sign << 15) | (mag << 9) for fp16.
template <bool kBf16>
constexpr bool decoders_read_the_layout() {
  const int mag_shift = kBf16 ? 6 : 9;
  for (int slot = 0; slot < 4; ++slot) {
    const uint32_t bits = place_codes(slot, 0xFu, 0xFu);
    for (uint32_t lo = 0; lo < 16; ++lo)
      for (uint32_t hi = 0; hi < 16; ++hi) {
        const uint32_t want_lo = ((lo >> 3) << 15) | ((lo & 7u) << mag_shift);
        const uint32_t want_hi = ((hi >> 3) << 15) | ((hi & 7u) << mag_shift);
        uint32_t r[4] = {0, 0, 0, 0};
        decode_codes<kBf16>(place_codes(slot, lo, hi) | ~bits, r);
        if (r[slot] != (want_lo | (want_hi << 16))) return false;
      }
  }
  return true;
}
static_assert(decoders_read_the_layout<true>(), "the bf16 decoder must read the bits place_codes writes");
static_assert(decoders_read_the_layout<false>(), "the fp16 decoder must read the bits place_codes writes");

// Where work unit `unit` is (the decomposition at the top), and where its bytes are in the
// canonical buffers: codes [E*n, k/2], scales [E*n, k/16].
struct Unit {
  int64_t e, rb, c;
  int lane, g, t;
  bool full;   // a full chunk (else the tail chunk)
  int steps;   // its k16 steps
  int64_t row; // the canonical row of the block's row g, as a row of [E*n]
  int64_t hi;  // and of its row g+8: row + hi

  // sections = 2 (w13: gate rows 0 .. n/2-1, then up rows): prepared row block rb holds gate rows
  // 8rb .. 8rb+7 as its rows 0-7 and up rows 8rb .. 8rb+7 as its rows 8-15, so that a lane of the
  // GEMM holds the gate and the up value of one column (rows g and g+8 of its fragment).
  MOE_FP4_HD Unit(int64_t unit, int64_t n, int64_t k, int32_t sections) {
    const int64_t chunks = ceil_div(k, kChunk), nrb = n / kRowBlock;
    lane = int(unit % 32);
    int64_t rest = unit / 32;
    c = rest % chunks;
    rest /= chunks;
    rb = rest % nrb;
    e = rest / nrb;
    g = lane / 4, t = lane % 4;
    full = c < k / kChunk;
    steps = full ? kStepsPerChunk : int((k / 16) % kStepsPerChunk);
    const bool gate_up = sections == 2;
    row = e * n + rb * (gate_up ? kRowBlock / 2 : kRowBlock) + g;
    hi = gate_up ? n / 2 : 8;
  }
  // The canonical code byte of register r at step j: two codes of row g (r even) or g+8 (r odd),
  // columns 16kb + 2t (+8 for r >= 2), kb = the step's k16 block.
  MOE_FP4_HD int64_t code_byte(int64_t k, int j, int r) const {
    return (row + hi * (r & 1)) * (k / 2) + (c * kStepsPerChunk + j) * 8 + t + 4 * (r >> 1);
  }
  // The canonical scale byte of row g (upper = 0) or g + 8 (upper = 1) at step j.
  MOE_FP4_HD int64_t scale_byte(int64_t k, int j, int upper) const {
    return (row + hi * upper) * (k / 16) + c * kStepsPerChunk + j;
  }
};

int64_t unit_count(int32_t num_experts, int64_t n, int64_t k) {
  return int64_t(num_experts) * (n / kRowBlock) * ceil_div(k, kChunk) * 32;
}

struct PrepareUnit {
  Sm90PrepareArgs a;

  MOE_FP4_HD void operator()(int64_t unit) const {
    const Unit u(unit, a.n, a.k, a.sections);
    const int lane = u.lane, g = u.g, t = u.t, steps = u.steps;

    uint32_t words[kStepsPerChunk] = {0, 0, 0, 0};
    uint8_t q_g[kStepsPerChunk] = {0, 0, 0, 0}, q_g8[kStepsPerChunk] = {0, 0, 0, 0};
    for (int j = 0; j < steps; ++j) {
      const uint8_t s_g = a.scales[u.scale_byte(a.k, j, 0)];
      const uint8_t s_g8 = a.scales[u.scale_byte(a.k, j, 1)];
      uint32_t word = 0;
      for (int r = 0; r < 4; ++r) {
        const uint8_t s = (r & 1) ? s_g8 : s_g;
        const uint32_t b = a.w[u.code_byte(a.k, j, r)];
        word |= place_codes(r, canonical_code(b & 0xFu, s), canonical_code(b >> 4, s));
      }
      words[j] = word;
      q_g[j] = encode_scale(s_g);
      q_g8[j] = encode_scale(s_g8);
    }

    uint8_t* codes = a.w_out + code_chunk_offset(u.e, u.rb, u.c, a.n, a.k);
    uint8_t* scales = a.scales_out + scale_chunk_offset(u.e, u.rb, u.c, a.n, a.k);
    if (u.full) {
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

// The inverse: a.w, a.scales are prepared, a.w_out, a.scales_out canonical. Zeroed blocks stay
// zero; scales come back byte for byte (decode_scale).
struct RestoreUnit {
  Sm90PrepareArgs a;

  MOE_FP4_HD void operator()(int64_t unit) const {
    const Unit u(unit, a.n, a.k, a.sections);
    const uint8_t* codes = a.w + code_chunk_offset(u.e, u.rb, u.c, a.n, a.k);
    const uint8_t* scales = a.scales + scale_chunk_offset(u.e, u.rb, u.c, a.n, a.k);
    for (int j = 0; j < u.steps; ++j) {
      uint32_t word;
      std::memcpy(&word, codes + chunk_word_offset(u.full, u.lane, j), 4);
      for (int r = 0; r < 4; ++r) a.w_out[u.code_byte(a.k, j, r)] = uint8_t(extract_codes(r, word));
      if (u.t == 0)  // the 4 lanes of a row pair share its scales: one writes them
        for (int hi = 0; hi < 2; ++hi)
          a.scales_out[u.scale_byte(a.k, j, hi)] = decode_scale(scales[chunk_scale_offset(u.full, u.g, j, hi)]);
    }
  }
};

}  // namespace

int launch_sm90_prepare(const Sm90PrepareArgs& args, int device, cudaStream_t stream) {
  return for_each_unit(PrepareUnit{args}, unit_count(args.num_experts, args.n, args.k), device, stream,
                       "sm90 weight preparation kernel launch");
}

int launch_sm90_restore(const Sm90PrepareArgs& args, int device, cudaStream_t stream) {
  return for_each_unit(RestoreUnit{args}, unit_count(args.num_experts, args.n, args.k), device, stream,
                       "sm90 weight restore kernel launch");
}

}  // namespace moe_fp4
