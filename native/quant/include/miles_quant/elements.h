// Element formats (E4M3, E5M2, E2M1) and E8M0 scale rules, on integer bits.
//
// The contract (packages/miles-quant/docs/contract.md) defines each function here; the PyTorch
// reference (miles_quant/_reference.py) implements the same definitions with tensor ops, and the
// tests compare the two bit for bit.
#pragma once

#include <cstdint>

#include "miles_quant/bits.h"

namespace miles_quant {

// OCP FP8 E4M3 ("fn": no Inf, one NaN per sign): bias 7, max 448 = 1.75 * 2^8.
struct E4M3 {
  static constexpr int kEbits = 4, kMbits = 3, kBias = 7, kEmax = 8;
  static constexpr uint32_t kMaxCode = 0x7E, kNanCode = 0x7F;
  static constexpr float kMax = 448.0f;
};
// OCP FP8 E5M2 (IEEE-like, has Inf): bias 15, max 57344 = 1.75 * 2^15.
struct E5M2 {
  static constexpr int kEbits = 5, kMbits = 2, kBias = 15, kEmax = 15;
  static constexpr uint32_t kMaxCode = 0x7B, kNanCode = 0x7F;
  static constexpr float kMax = 57344.0f;
};
// OCP FP4 E2M1 (no Inf, no NaN): bias 1, values 0, .5, 1, 1.5, 2, 3, 4, 6.
struct E2M1 {
  static constexpr int kEbits = 2, kMbits = 1, kBias = 1, kEmax = 2;
  static constexpr uint32_t kMaxCode = 0x7, kNanCode = 0x0;  // no NaN code: NaN encodes as +0
  static constexpr float kMax = 6.0f;
};

enum class Elem : int { e4m3 = 0, e5m2 = 1, e2m1 = 2 };
enum class ScaleRule : int { floor = 0, rceil = 1, even = 2 };

// fp32 -> element code: round to nearest even, saturate to +-max (finite overflow and +-Inf),
// sign kept (also for zero), NaN -> kNanCode with the sign for FP8, +0 for E2M1.
template <class F>
MQ_HD uint32_t encode(float f) {
  const uint32_t b = f32_bits(f);
  const uint32_t u = b & kF32AbsMask;
  uint32_t c = round_mag_rne<F::kMbits, F::kBias>(u);
  c = c > F::kMaxCode ? F::kMaxCode : c;
  const uint32_t sign = (b >> 31) << (F::kEbits + F::kMbits);
  const uint32_t nan = F::kNanCode == 0 ? 0u : (sign | F::kNanCode);
  return u > kF32InfBits ? nan : (c | sign);
}

// Element code -> fp32 (exact). E4M3 0x7F/0xFF and E5M2 exponent-all-ones follow OCP.
template <class F>
MQ_HD float decode(uint32_t code) {
  constexpr int kBits = F::kEbits + F::kMbits;
  const uint32_t sign = ((code >> kBits) & 1u) << 31;
  const uint32_t mag = code & ((1u << kBits) - 1u);
  const uint32_t e = mag >> F::kMbits;
  const uint32_t m = mag & ((1u << F::kMbits) - 1u);
  constexpr uint32_t kEmaxField = (1u << F::kEbits) - 1u;
  uint32_t out;
  if (e == 0) {
    // m * 2^(1 - bias - mbits): exact.
    const float unit = bits_f32(static_cast<uint32_t>(127 + 1 - F::kBias - F::kMbits) << 23);
    out = f32_bits(static_cast<float>(m) * unit);
  } else {
    out = ((e - F::kBias + 127) << 23) | (m << (23 - F::kMbits));
  }
  if (F::kMbits == 3 && F::kEbits == 4 && mag == 0x7F) out = kF32QuietNan;  // E4M3 NaN
  if (F::kEbits == 5 && e == kEmaxField) out = m == 0 ? kF32InfBits : kF32QuietNan;  // E5M2
  return bits_f32(out | sign);
}

// --- E8M0 scales (MX). A code c stands for 2^(c - 127); 255 is NaN. -------------------------

constexpr uint32_t kE8M0Nan = 0xFF;

MQ_HD uint32_t clamp_e8m0_exponent(int e) {
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  return static_cast<uint32_t>(e + 127);
}

// FLOOR (OCP MX v1.0): X = 2^(floor(log2 amax) - emax_elem). floor(log2) is the fp32 exponent
// field; for subnormal amax the field says -127 >= the true value, and both clamp to code 0
// because emax_elem >= 2.
template <class F>
MQ_HD uint32_t e8m0_floor(uint32_t amax_bits) {
  return clamp_e8m0_exponent(static_cast<int>(amax_bits >> 23) - 127 - F::kEmax);
}

// EVEN (torchao ScaleCalculationMode.EVEN): round amax to the element's mantissa width (half
// up on the bits), then FLOOR.
template <class F>
MQ_HD uint32_t e8m0_even(uint32_t amax_bits) {
  const uint32_t r = (amax_bits + (1u << (22 - F::kMbits))) & 0xFF800000u;
  return clamp_e8m0_exponent(static_cast<int>(r >> 23) - 127 - F::kEmax);
}

// RCEIL (NVIDIA, cvt.rp.satfinite.ue8m0x2.f32 applied to amax / max_elem): the descale
// d = amax / max_elem in fp32 (RN), rounded up to a power of two on its bits.
template <class F>
MQ_HD uint32_t e8m0_rceil(float amax) {
  const uint32_t d = f32_bits(amax / F::kMax);
  const uint32_t field = d >> 23;
  const uint32_t mant = d & 0x007FFFFFu;
  // fp32 subnormal descale: <= 2^-127 (mantissa 0x400000) rounds up to code 0, else to code 1.
  uint32_t code = field == 0 ? (mant > 0x00400000u ? 1u : 0u) : field + (mant != 0 ? 1u : 0u);
  return code > 254u ? 254u : code;
}

template <class F>
MQ_HD uint32_t e8m0_code(ScaleRule rule, uint32_t amax_bits) {
  if (rule == ScaleRule::rceil) return e8m0_rceil<F>(bits_f32(amax_bits));
  if (rule == ScaleRule::even) return e8m0_even<F>(amax_bits);
  return e8m0_floor<F>(amax_bits);
}

// The factor that maps a block onto the element grid: 2^(127 - code), exact in fp32 for every
// code 0..254 (code 254 gives the subnormal 2^-127).
MQ_HD float e8m0_inverse(uint32_t code) {
  return bits_f32(code >= 254u ? 0x00400000u : (254u - code) << 23);
}

// The dequantization multiplier 2^(code - 127) (code 0 is the subnormal 2^-127; 255 is NaN).
MQ_HD float e8m0_value(uint32_t code) {
  return bits_f32(code == 255u ? kF32QuietNan : (code == 0u ? 0x00400000u : code << 23));
}

}  // namespace miles_quant
