// The prepared NVFP4 weight layout of the sm_90a grouped GEMM (gemm_sm90.cu): how
// moe_fp4_sm90_prepare_weights re-lays codes and block scales, and how the GEMM turns them back
// into exact 16-bit values in registers. Host and device code (the prepare kernel has a host
// oracle); the register decoders are device-only. decode_scale and extract_codes invert the encoder
// (moe_fp4_sm90_restore_weights, host and device).
//
// ---------------------------------------------------------------- layout
// The GEMM puts weights on the M side of wgmma.m64nNk16 with A from registers. In a warp's
// 16x16 slice of the m64k16 A fragment, lane L (g = L/4, t = L%4) holds 4 registers of two
// 16-bit values each:
//   R0 = row g,   cols 2t, 2t+1      R1 = row g+8, cols 2t, 2t+1
//   R2 = row g,   cols 2t+8, 2t+9    R3 = row g+8, cols 2t+8, 2t+9
// i.e. 8 e2m1 codes (32 bits) per lane per k16 step, and exactly one block scale per row per
// step (a k16 step IS one 16-element scale block), so 2 scales per lane per step.
//
// Weights [E, n, k] (n % 16 == 0, k % 16 == 0) are cut into row blocks of 16 rows
// (rb = row / 16) and K chunks of 64 (4 steps). Per (expert e, row block rb) the codes take
// 8k bytes at (e * n/16 + rb) * 8k and the scales k bytes at (e * n/16 + rb) * k (so both
// buffers have exactly the bytes of the originals, E*n*k/2 and E*n*k/16):
//   full chunk c (c < k/64): codes at + 512c + 16L, one 16-byte vector per lane: word j = step j;
//                            scales at + 64c + 8g, 8 bytes per row pair (the 4 lanes of a g share
//                            them): [s(0,g) s(1,g) s(0,g+8) s(1,g+8) s(2,g) s(3,g) s(2,g+8) s(3,g+8)]
//                            (s(j,r) = scale of row r at step j);
//   tail chunk (k % 64 = 16s, s = 1..3 steps) after the full ones: codes at + 512(k/64) + 128j +
//                            4L, scales at + 64(k/64) + 16j + 2g as [s(j,g) s(j,g+8)].
// A warp reads its row block's chunk with one 128-bit and one (broadcast) 64-bit shared load
// per lane; in global memory the blocks of a 64-row group are interleaved by chunk (below).
// w13 (sections = 2: gate rows 0 .. n/2-1, then up rows) is prepared with its rows interleaved
// by 8: row block rb holds gate rows 8rb .. 8rb+7 as its rows 0-7 and up rows n/2 + 8rb .. as
// its rows 8-15, so lane L holds the gate (row g) and up (row g+8) values of the same column and
// token, which the GEMM's SiLU-and-mul epilogue combines in registers (sm90_prepare.cu, Unit).
//
// Bits of one step word (register slots, lo = even column, hi = odd column = lo + 16 bits):
//   R0 (slot X): mag bits m0 m1 m2 at 6 7 8, sign at 15        (hi: 22 23 24, 31)
//   R1 (slot Y): m0 m1 m2 at 3 4 5, sign at 12                 (hi: 19 20 21, 28)
//   R2 (slot Z): m0 m1 m2 at 0 1 2, sign at 9                  (hi: 16 17 18, 25)
//   R3 (slot V): m0 m1 m2 at 13 14 10, sign at 11              (hi: 29 30 26, 27)
// (m0 = code bit 0, ..., sign = code bit 3). X, Y and Z are the three disjoint translates of the
// bf16 pattern {6,7,8,15} (a search shows no fourth fits in 16 bits, for bf16 or fp16), so bf16
// decodes R0..R2 with one mask and at most one shift each, R3 with three shifts; fp16 needs
// one more shift and mask per register (decoders below; ~11 resp. ~15 integer ops per 8 values).
// (Session 6 measured a layout of 32-bit rotations that decodes bf16 in 9 ops, R3 in two pieces
// (a search over rotations finds none with fp16 below 17): bf16 per chunk 161 -> 145 SASS
// instructions, but the Qwen3 GEMMs ran equally fast (-3%..+2%, M = 1..4096) and fp16 5-15%
// slower, so the GEMM is not issue-bound on the decode there; not kept.)
//
// ---------------------------------------------------------------- scales
// The e4m3 block scale byte b is re-encoded as one byte q, so that both dtypes expand it with
// one shift and one mask:
//   value(b) = 2^E * (1 + f/8), E in [-9, 8], f in 0..7 (e4m3 subnormals m*2^-9 normalized)
//   q = ((E + 21) << 3) | f  in [0x60, 0xEF];  q = 0 for a zero scale; q = 0xFF for NaN (0x7F/0xFF).
// Negative scales (sign bit set) are stored as |b| with the block's code signs flipped, and a
// zero scale zeroes the block's codes: both leave every product code * scale unchanged.
// So the re-layout is invertible on non-negative scales (moe_fp4_sm90_restore_weights): every
// scale byte comes back, and the codes do but for the zeroed blocks. The inverse of q != 0:
//   E = (q >> 3) - 21, f = q & 7;  b = ((E + 7) << 3) | f for E >= -6 (normal),
//   else b = (8 + f) >> (-6 - E) (subnormal m * 2^-9 = (8 + f) * 2^(E-3), so m = (8 + f) * 2^(E+6);
//   the encoder normalized m << s with s = -6 - E, so the shift drops only zero bits).
//   bf16: bits (q << 4) | 0x7000 = 2^(E+21+224-127) (1+f/8) = scale * 2^118   (q = 0xFF: 0x7FF0, NaN)
//   fp16: bits  q << 7           = 2^(E+21-15)      (1+f/8) = scale * 2^6     (q = 0xFF: 0x7F80, NaN)
// Codes become, by masks only: fp16 (sign << 15) | (mag << 9) = e2m1 * 2^-14, bf16
// (sign << 15) | (mag << 6) = e2m1 * 2^-126 (code 1 = 0.5 is a subnormal in both). One 16-bit
// multiply (HMUL2, round to nearest, subnormals kept) per pair gives
//   fp16: e2m1 * 2^-14 * scale * 2^6  = e2m1 * scale * 2^-8
//   bf16: e2m1 * 2^-126 * scale * 2^118 = e2m1 * scale * 2^-8
// EXACTLY: e2m1 * scale has at most 6 significant bits and is a multiple of 2^-10 in
// [2^-10, 2688], so e2m1 * scale * 2^-8 lies in [2^-18, 10.5]: for bf16 a normal number with
// 6 <= 8 significant bits; for fp16 below 65504 and a multiple of 2^-18 >= 2^-24 (fp16's
// subnormal step), with <= 11 bits when normal. The operands never overflow (bf16 scale
// <= 448 * 2^118 < 2^127, fp16 scale <= 448 * 64 = 28672). Zero scales (q = 0, codes zeroed)
// give 0 in both (bf16: 0 * 2^97). So the register operand is the exact NVFP4 value times
// 2^-8, every fp32 product with a 16-bit activation is exact, and the GEMM multiplies its
// epilogue alpha by 2^8 itself: callers pass the plain alpha = 1 / (gs_a * gs_w).
#pragma once

#include <cstdint>

#include "moe_fp4/common.hpp"

namespace moe_fp4::sm90 {

constexpr int kRowBlock = 16;   // rows per warp (one m16 slice of wgmma's m64)
constexpr int kChunk = 64;      // K elements per chunk (4 k16 steps)
constexpr int kStepsPerChunk = 4;
constexpr int kChunkCodeBytes = 512;   // 32 lanes x 16 bytes
constexpr int kChunkScaleBytes = 64;   // 8 row pairs x 8 bytes
constexpr float kAlphaFactor = 256.0f; // 2^8: the register operand is value * 2^-8
constexpr uint8_t kScaleNaN = 0xFF;

// Bit positions (m0, m1, m2, sign) of the lo element of each register slot; hi = +16.
constexpr MOE_FP4_HD uint32_t slot_bit(int slot, int bit) {
  // X (R0), Y (R1), Z (R2), V (R3)
  constexpr int pos[4][4] = {{6, 7, 8, 15}, {3, 4, 5, 12}, {0, 1, 2, 9}, {13, 14, 10, 11}};
  return uint32_t(pos[slot][bit]);
}

// The re-encoded scale byte q of an e4m3 byte (sign ignored; see above).
constexpr MOE_FP4_HD uint8_t encode_scale(uint8_t b) {
  const uint32_t mag = b & 0x7Fu;
  if (mag == 0x7Fu) return kScaleNaN;
  if (mag == 0u) return 0;
  int e = int(mag >> 3);
  uint32_t m = mag & 7u;
  int E = 0;
  uint32_t f = 0;
  if (e > 0) {
    E = e - 7;
    f = m;
  } else {  // subnormal m * 2^-9, m = 1..7: normalize
    int shift = 0;  // m << shift in [8, 15]
    while ((m << shift) < 8u) ++shift;
    E = -6 - shift;          // m*2^-9 = (m << shift) / 8 * 2^(-6-shift)
    f = (m << shift) - 8u;
  }
  return uint8_t(((E + 21) << 3) | int(f));
}

// The e4m3 byte of a re-encoded scale q (formula above): decode_scale(encode_scale(b)) == b for
// every non-negative b, NaN 0x7F included (a compile-time check in sm90_prepare.cu). Bytes that
// encode_scale never writes (0x01..0x5F, 0xF0..0xFE) decode to unspecified bytes.
constexpr MOE_FP4_HD uint8_t decode_scale(uint8_t q) {
  if (q == 0) return 0;
  if (q == kScaleNaN) return 0x7F;
  const int E = int(q >> 3) - 21;
  const uint32_t f = q & 7u;
  if (E >= -6) return uint8_t(((E + 7) << 3) | int(f));
  return uint8_t((8u + f) >> (-6 - E));  // -6 - E in [1, 15]: no undefined shift
}

// Canonical 4-bit code for the GEMM: sign flipped by a negative scale, zero for a zero scale.
MOE_FP4_HD uint32_t canonical_code(uint32_t code, uint8_t scale_byte) {
  const uint32_t mag = scale_byte & 0x7Fu;
  if (mag == 0u) return 0u;
  if ((scale_byte & 0x80u) && mag != 0x7Fu) code ^= 8u;
  return code & 0xFu;
}

// The 16-bit patterns of the 4 registers of a step word (bf16: (sign << 15) | (mag << 6) in
// each half, fp16: (sign << 15) | (mag << 9)): masks and shifts only. Host and device, so that
// sm90_prepare.cu checks them against place_codes for every code at compile time.
template <bool kBf16>
constexpr MOE_FP4_HD void decode_codes(uint32_t w, uint32_t (&r)[4]) {
  if constexpr (kBf16) {
    r[0] = w & 0x81C081C0u;
    r[1] = (w << 3) & 0x81C081C0u;
    r[2] = (w << 6) & 0x81C081C0u;
    r[3] = ((w >> 7) & 0x00C000C0u) | ((w >> 2) & 0x01000100u) | ((w << 4) & 0x80008000u);
  } else {
    const uint32_t w3 = w << 3, w6 = w << 6;
    r[0] = (w & 0x80008000u) | (w3 & 0x0E000E00u);
    r[1] = (w3 & 0x80008000u) | (w6 & 0x0E000E00u);
    r[2] = (w6 & 0x80008000u) | ((w << 9) & 0x0E000E00u);
    r[3] = ((w >> 4) & 0x06000600u) | ((w << 1) & 0x08000800u) | ((w << 4) & 0x80008000u);
  }
}

// Places the (canonical) codes lo/hi of register slot `slot` into a step word.
constexpr MOE_FP4_HD uint32_t place_codes(int slot, uint32_t lo, uint32_t hi) {
  uint32_t w = 0;
  for (int bit = 0; bit < 4; ++bit) {
    w |= ((lo >> bit) & 1u) << slot_bit(slot, bit);
    w |= ((hi >> bit) & 1u) << (slot_bit(slot, bit) + 16);
  }
  return w;
}

// The inverse of place_codes: the two codes of register slot `slot` in a step word as one
// canonical byte, lo | hi << 4 (the even column in the low nibble). The four slots' bits are
// disjoint, so the other slots' codes in w do not leak in (checked in sm90_prepare.cu).
constexpr MOE_FP4_HD uint32_t extract_codes(int slot, uint32_t w) {
  uint32_t lo = 0, hi = 0;
  for (int bit = 0; bit < 4; ++bit) {
    lo |= ((w >> slot_bit(slot, bit)) & 1u) << bit;
    hi |= ((w >> (slot_bit(slot, bit) + 16)) & 1u) << bit;
  }
  return lo | (hi << 4);
}

// Byte offsets of row block (e, rb) in the prepared code / scale buffers (the start of its
// group's region when rb is a group's first block).
MOE_FP4_HD int64_t code_block_offset(int64_t e, int64_t rb, int64_t n, int64_t k) {
  return (e * (n / kRowBlock) + rb) * (k * kRowBlock / 2);
}
MOE_FP4_HD int64_t scale_block_offset(int64_t e, int64_t rb, int64_t n, int64_t k) {
  return (e * (n / kRowBlock) + rb) * (k * kRowBlock / 16);
}

// Row blocks are stored in groups of kGroupBlocks (64 rows: one consumer warpgroup of the GEMM)
// so that a CTA's weights of one K chunk are one contiguous copy: within the region of a group
// of gb blocks (gb = 4, or fewer in an expert's last group when n % 64 != 0), full chunk c of
// block j (0 <= j < gb) is at c * gb * 512 + j * 512 (codes) and c * gb * 64 + j * 64
// (scales); the tail chunk of block j after all full chunks, at full * gb * 512 + j * 128 * s
// (codes) and full * gb * 64 + j * 16 * s (scales), s = tail steps. Inside a block's chunk the
// bytes are as described above.
constexpr int kGroupBlocks = 4;
MOE_FP4_HD int64_t group_blocks(int64_t rb, int64_t n) {
  const int64_t rest = n / kRowBlock - rb / kGroupBlocks * kGroupBlocks;
  return rest < kGroupBlocks ? rest : kGroupBlocks;
}
// Offsets of block rb's chunk c (full: c < k/64; else the tail chunk) in the prepared buffers.
MOE_FP4_HD int64_t code_chunk_offset(int64_t e, int64_t rb, int64_t c, int64_t n, int64_t k) {
  const int64_t g0 = rb / kGroupBlocks * kGroupBlocks, j = rb - g0, gb = group_blocks(rb, n), full = k / kChunk;
  const int64_t base = code_block_offset(e, g0, n, k);
  if (c < full) return base + (c * gb + j) * kChunkCodeBytes;
  return base + full * gb * kChunkCodeBytes + j * 128 * ((k / 16) % kStepsPerChunk);
}
MOE_FP4_HD int64_t scale_chunk_offset(int64_t e, int64_t rb, int64_t c, int64_t n, int64_t k) {
  const int64_t g0 = rb / kGroupBlocks * kGroupBlocks, j = rb - g0, gb = group_blocks(rb, n), full = k / kChunk;
  const int64_t base = scale_block_offset(e, g0, n, k);
  if (c < full) return base + (c * gb + j) * kChunkScaleBytes;
  return base + full * gb * kChunkScaleBytes + j * 16 * ((k / 16) % kStepsPerChunk);
}
// Within a block's chunk (full or tail), the offset of lane L's step word j in the codes and of
// s(j, g + 8 * hi) in the scales (the orders described at the top).
MOE_FP4_HD int chunk_word_offset(bool full, int lane, int j) { return full ? lane * 16 + j * 4 : j * 128 + lane * 4; }
MOE_FP4_HD int chunk_scale_offset(bool full, int g, int j, int hi) {
  return full ? g * 8 + (j / 2) * 4 + hi * 2 + (j % 2) : j * 16 + g * 2 + hi;
}

#if defined(__CUDACC__)
// ---------------------------------------------------------------- device decoders

template <bool kBf16>
struct Decode;

template <>
struct Decode<true> {  // bf16 patterns: (sign << 15) | (mag << 6)
  static __device__ __forceinline__ void codes(uint32_t w, uint32_t (&r)[4]) { decode_codes<true>(w, r); }
  // Scale pairs {row g, row g+8} of steps 2i and 2i+1 from scale word i.
  static __device__ __forceinline__ uint32_t scale_even(uint32_t s) { return ((s << 4) & 0x0FF00FF0u) | 0x70007000u; }
  static __device__ __forceinline__ uint32_t scale_odd(uint32_t s) { return ((s >> 4) & 0x0FF00FF0u) | 0x70007000u; }
};

template <>
struct Decode<false> {  // fp16 patterns: (sign << 15) | (mag << 9)
  static __device__ __forceinline__ void codes(uint32_t w, uint32_t (&r)[4]) { decode_codes<false>(w, r); }
  static __device__ __forceinline__ uint32_t scale_even(uint32_t s) { return (s << 7) & 0x7F807F80u; }
  static __device__ __forceinline__ uint32_t scale_odd(uint32_t s) { return (s >> 1) & 0x7F807F80u; }
};

// c (two 16-bit codes) times the lo or hi 16-bit half of s, broadcast; exact (see above).
template <bool kBf16, bool kHi>
__device__ __forceinline__ uint32_t scale_mul(uint32_t c, uint32_t s) {
  uint32_t d;
  if constexpr (kBf16) {
    if constexpr (kHi)
      asm("{\n.reg .b16 l, h;\n.reg .b32 b;\nmov.b32 {l, h}, %2;\nmov.b32 b, {h, h};\nmul.rn.bf16x2 %0, %1, b;\n}\n"
          : "=r"(d) : "r"(c), "r"(s));
    else
      asm("{\n.reg .b16 l, h;\n.reg .b32 b;\nmov.b32 {l, h}, %2;\nmov.b32 b, {l, l};\nmul.rn.bf16x2 %0, %1, b;\n}\n"
          : "=r"(d) : "r"(c), "r"(s));
  } else {
    if constexpr (kHi)
      asm("{\n.reg .b16 l, h;\n.reg .b32 b;\nmov.b32 {l, h}, %2;\nmov.b32 b, {h, h};\nmul.rn.f16x2 %0, %1, b;\n}\n"
          : "=r"(d) : "r"(c), "r"(s));
    else
      asm("{\n.reg .b16 l, h;\n.reg .b32 b;\nmov.b32 {l, h}, %2;\nmov.b32 b, {l, l};\nmul.rn.f16x2 %0, %1, b;\n}\n"
          : "=r"(d) : "r"(c), "r"(s));
  }
  return d;
}

// The 4 A registers of one k16 step: 8 exact weight values * 2^-8.
template <bool kBf16>
__device__ __forceinline__ void dequant_step(uint32_t w, uint32_t s_pair, uint32_t (&a)[4]) {
  uint32_t c[4];
  Decode<kBf16>::codes(w, c);
  a[0] = scale_mul<kBf16, false>(c[0], s_pair);  // row g
  a[1] = scale_mul<kBf16, true>(c[1], s_pair);   // row g+8
  a[2] = scale_mul<kBf16, false>(c[2], s_pair);  // row g
  a[3] = scale_mul<kBf16, true>(c[3], s_pair);   // row g+8
}
#endif

}  // namespace moe_fp4::sm90
