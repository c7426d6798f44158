// The NVFP4 quantizer of moe_fp4/format.py as host/device code, bit for bit.
//
// One block of 16 values x_i (already rounded to the input dtype, held as float) with the
// quantize-direction global scale gs:
//   amax = max |x_i|                (NaN propagates, as torch.amax)
//   s32  = (amax * RCP6) * gs       (two float32 multiplications, RCP6 = fp32(1/6))
//   sf   = e4m3(min(s32, 448))      (round to nearest even incl. subnormals; NaN stays NaN)
//   inv  = gs / f32(sf), 0 if f32(sf) is not > 0   (one correctly rounded division)
//   code = signbit(x_i) << 3 | m(|x_i * inv|), m = the half-to-even threshold sum
// Every float operation is an explicit round-to-nearest intrinsic on the device (no FMA
// contraction, no approximate reciprocal); the host build uses -ffp-contract=off.
// The E2M1 rounding is the threshold sum in software on every architecture: it needs no
// FP4 conversion instruction, so sm_90a computes exactly what sm_100a/sm_120a compute.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "moe_fp4/common.hpp"

namespace moe_fp4 {

constexpr int kBlock = 16;
// fp32(1/6) = 0x3E2AAAAB, written exactly.
constexpr float kRcp6 = 0.16666667163372039794921875f;
constexpr float kE4m3Max = 448.0f;

MOE_FP4_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MOE_FP4_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

MOE_FP4_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

MOE_FP4_HD float exp_f32(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);  // the CUDA math library's expf, as torch's exp on CUDA (not __expf)
#else
  return std::exp(x);
#endif
}

MOE_FP4_HD uint32_t sign_bit(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x) >> 31;
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u >> 31;
#endif
}

// ------------------------------------------------------------------ element types

template <typename T> struct Element;
template <> struct Element<__nv_bfloat16> {
  MOE_FP4_HD static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  MOE_FP4_HD static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};
template <> struct Element<__half> {
  MOE_FP4_HD static float to_float(__half v) { return __half2float(v); }
  MOE_FP4_HD static __half from_float(float v) { return __float2half_rn(v); }
};
template <> struct Element<float> {
  MOE_FP4_HD static float to_float(float v) { return v; }
  MOE_FP4_HD static float from_float(float v) { return v; }
};

// x rounded to T and back: the value torch holds after `.to(T)`.
template <typename T>
MOE_FP4_HD float round_to(float x) {
  return Element<T>::to_float(Element<T>::from_float(x));
}

// Loads N consecutive 16-bit values (N % 8 == 0) from a 16-byte aligned address as floats.
template <typename T, int N>
MOE_FP4_HD void load_as_float(const T* src, float (&v)[N]) {
  static_assert(sizeof(T) == 2 && N % 8 == 0, "16-bit elements, whole 16-byte vectors");
  const uint4* p = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < N / 8; ++i) {
    uint4 word = p[i];
    T e[8];
    static_assert(sizeof(e) == sizeof(word), "8 elements per vector");
    std::memcpy(e, &word, sizeof(word));
#pragma unroll
    for (int j = 0; j < 8; ++j) v[i * 8 + j] = Element<T>::to_float(e[j]);
  }
}

// Stores 8 floats rounded to T at a 16-byte aligned address.
template <typename T>
MOE_FP4_HD void store_rounded8(T* dst, const float (&v)[8]) {
  T e[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) e[j] = Element<T>::from_float(v[j]);
  uint4* p = reinterpret_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < int(sizeof(e) / sizeof(uint4)); ++i) {
    uint4 word;
    std::memcpy(&word, reinterpret_cast<const char*>(e) + i * sizeof(uint4), sizeof(word));
    p[i] = word;
  }
}

// Stores one block of 16 floats rounded to T at a 16-byte aligned address.
template <typename T>
MOE_FP4_HD void store_block16(T* dst, const float (&v)[kBlock]) {
  store_rounded8(dst, reinterpret_cast<const float(&)[8]>(v[0]));
  store_rounded8(dst + 8, reinterpret_cast<const float(&)[8]>(v[8]));
}

// ------------------------------------------------------------------ the quantizer

// e4m3 (float8_e4m3fn) byte of min(s, 448), rounded to nearest even (subnormals included).
// The device conversion is PTX cvt.rn.satfinite.e4m3x2.f32; the host one is the same
// header's software rounding. A NaN stays NaN (0x7F) as in torch.
MOE_FP4_HD uint8_t e4m3_from_float(float s) {
  s = s > kE4m3Max ? kE4m3Max : s;
  return uint8_t(__nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3));
}

MOE_FP4_HD float e4m3_to_float(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(b), __NV_E4M3)));
}

// Code 0..7 of |y| on the E2M1 grid [0, .5, 1, 1.5, 2, 3, 4, 6]: half to even, saturating at 6.
// Ties after an even code round down (strict >), ties after an odd code round up (>=).
MOE_FP4_HD uint32_t e2m1_magnitude(float v) {
  return uint32_t(v > 0.25f) + uint32_t(v >= 0.75f) + uint32_t(v > 1.25f) + uint32_t(v >= 1.75f) +
         uint32_t(v > 2.5f) + uint32_t(v >= 3.5f) + uint32_t(v > 5.0f);
}

// NaN-propagating max (a NaN in either gives a NaN): one instruction on the device (max.NaN,
// sm_80+; its NaN is the canonical one, which only ever reaches the e4m3 conversion, where every
// NaN is 0x7F).
MOE_FP4_HD float nan_max(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a > b || a != a) ? a : b;
#endif
}

// max |x_i| over N values, NaN-propagating (the max is exact, so partial maxima of a block combine
// in any order to the same value: the fused epilogue's four lanes per block, gemm_sm90.cu).
template <int N>
MOE_FP4_HD float abs_max(const float (&x)[N]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) amax = nan_max(fabsf(x[i]), amax);
  return amax;
}

// The e4m3 scale byte of a block whose abs_max is amax, with global scale gs, its value and the
// multiplier `inv` that takes the block's values onto the E2M1 grid (0 for a zero scale).
MOE_FP4_HD uint8_t scale_of_amax(float amax, float gs, float& sf_value, float& inv) {
  const uint8_t sf = e4m3_from_float(mul_rn(mul_rn(amax, kRcp6), gs));
  sf_value = e4m3_to_float(sf);
  inv = sf_value > 0.0f ? div_rn(gs, sf_value) : 0.0f;
  return sf;
}

// The same for one block of 16 values.
MOE_FP4_HD uint8_t block_scale(const float (&x)[kBlock], float gs, float& sf_value, float& inv) {
  return scale_of_amax(abs_max(x), gs, sf_value, inv);
}

// Quantizes one block of 16 values with global scale gs. Writes the 8 packed bytes (element
// 2j in the low nibble of byte j) as two little-endian words and returns the e4m3 scale byte.
MOE_FP4_HD uint8_t quantize_block(const float (&x)[kBlock], float gs, uint32_t (&packed)[2]) {
  float sf_value, inv;
  const uint8_t sf = block_scale(x, gs, sf_value, inv);
  packed[0] = packed[1] = 0;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
    const float y = mul_rn(x[i], inv);
    const uint32_t code = (sign_bit(x[i]) << 3) | e2m1_magnitude(fabsf(y));
    packed[i / 8] |= code << (4 * (i % 8));
  }
  return sf;
}

// The E2M1 grid value of the code e2m1_magnitude gives |v| (v >= 0, or NaN), without the code, in
// six operations: c = min(v, 6) rounded to one significant bit after the point of the binade of
// max(c, 1), which is the E2M1 grid from 1 up (1, 1.5 | 2, 3 | 4, 6) and the multiples of 0.5 below
// it (0, 0.5): adding and subtracting t = 2^22 * 2^floor(log2 max(c, 1)) (that float's exponent
// field plus 22) puts c where the float spacing is that step, so the IEEE add rounds it half to
// even, and the even multiples are the even codes (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5
// -> 2, 3.5 -> 4, 5 -> 4). Clamping first keeps t <= 2^24 and the result <= 6. The same function
// as the Triton kernels' e2m1_round (triton_kernels/numerics_details/_nvfp4.py), whose numpy model
// matched the threshold sum on all 2^31 non-negative floats but NaN. A NaN gives 6 where the code
// gives 0, which only a block with a NaN scale can hold (its values are NaN either way).
MOE_FP4_HD float e2m1_round(float v) {
  const float c = fminf(v, 6.0f);
  const float m = fmaxf(c, 1.0f);
  uint32_t b;
  std::memcpy(&b, &m, sizeof(b));
  b = (b & 0x7F800000u) + 0x0B000000u;
  float t;
  std::memcpy(&t, &b, sizeof(b));
  return add_rn(add_rn(c, t), -t);
}

// |q| with the sign bit of x (q >= 0): one bit operation where a select of -q costs two.
MOE_FP4_HD float with_sign_of(float q, float x) {
  uint32_t qb, xb;
  std::memcpy(&qb, &q, sizeof(qb));
  std::memcpy(&xb, &x, sizeof(xb));
  qb |= xb & 0x80000000u;
  std::memcpy(&q, &qb, sizeof(qb));
  return q;
}

// silu(g) * u as the reference computes it from gate and up values held in T (stages.silu_mul):
// the SiLU rounded to T, then the product rounded to T. The SiLU-and-mul quantization kernel's
// reader and the sm_90a GEMM's fused epilogue (gemm_sm90.cu) both compute it here.
template <typename T>
MOE_FP4_HD float silu_mul(float g, float u) {
  const float silu = round_to<T>(div_rn(g, add_rn(1.0f, exp_f32(-g))));
  return round_to<T>(mul_rn(silu, u));
}

// Values of a block whose scale is sf_value with multiplier inv (scale_of_amax), replaced by their
// dequantized values, e2m1 * sf_value (the global scale left out): quantize_block's values without
// its codes, e2m1_round of the scaled magnitude with the value's sign. Any N values of the block.
template <int N>
MOE_FP4_HD void dequantize_on_grid(float (&v)[N], float sf_value, float inv) {
  // inv = gs / scale overflows to inf where a global scale past 2^118 meets a small scale; the format
  // core's x * inf is then inf (code 7) for x != 0 and NaN (code 0) for a zero, which e2m1_round does
  // not give for NaN. Split in two factors there: any nonzero float times 2^254 is past 6 and zero stays
  // zero. Elsewhere (x * inv) * 1 is x * inv exactly.
  // Where inv is 0 (a zero or NaN scale, or gs / scale underflowed) the format core's x * 0 is 0, or NaN
  // (code 0) for an inf or NaN x: magnitude 0 for the whole block (times a NaN scale still NaN).
  const bool over = isinf(inv);
  const float inv_a = over ? 0x1p127f : inv, inv_b = over ? 0x1p127f : 1.0f;
  if (inv > 0.0f) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      v[i] = mul_rn(with_sign_of(e2m1_round(fabsf(mul_rn(mul_rn(v[i], inv_a), inv_b))), v[i]), sf_value);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = mul_rn(with_sign_of(0.0f, v[i]), sf_value);
  }
}

// One block of 16 values quantized with global scale gs and replaced by its dequantized values.
MOE_FP4_HD void quantize_dequantize(float (&v)[kBlock], float gs) {
  float sf_value, inv;
  block_scale(v, gs, sf_value, inv);
  dequantize_on_grid(v, sf_value, inv);
}

// Byte offset of logical scale (r, 4q..4q+3) in a swizzled 128x4 region that starts at row
// `base` of a buffer with `cp` scale columns (format.swizzled_offset, 4 columns at once).
MOE_FP4_HD int64_t swizzled_word_offset(int64_t base, int64_t r, int64_t q, int64_t cp) {
  return base * cp + (r / 128) * (cp / 4) * 512 + q * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4;
}

}  // namespace moe_fp4
