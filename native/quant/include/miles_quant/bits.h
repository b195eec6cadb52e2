// Bit-level helpers shared by the CPU and CUDA kernels: float <-> bits, exact widening of
// bf16/fp16 to fp32, and round-to-nearest-even narrowing of fp32 to bf16/fp16.
//
// Everything here is integer arithmetic or exact float operations, so the result does not depend
// on the compiler's floating-point flags (FTZ/DAZ, contraction, fast-math).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MQ_HD __host__ __device__ __forceinline__
#else
// static: every translation unit keeps its own copy, so units compiled for different ISAs
// (cpu_dispatch.h) never share an inlined helper through the linker.
#define MQ_HD static inline
#endif

namespace miles_quant {

// Input dtypes accepted by the quantizers (codes shared with the Python binding).
enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };

MQ_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

MQ_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

constexpr uint32_t kF32AbsMask = 0x7FFFFFFFu;
constexpr uint32_t kF32InfBits = 0x7F800000u;
constexpr uint32_t kF32QuietNan = 0x7FC00000u;

// bf16 bits -> fp32 (exact).
MQ_HD float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// fp16 bits -> fp32 (exact, subnormals included, NaN payload kept).
MQ_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7FFFu;
  // Normal: rebias the exponent (15 -> 127). Inf/NaN: all-ones exponent. Subnormal: em * 2^-24,
  // exact in fp32 (em < 2^10), computed without touching a subnormal float.
  const uint32_t normal = (em << 13) + (112u << 23);
  const uint32_t special = (em << 13) | kF32InfBits;
  const uint32_t sub = f32_bits(static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-08f);
  const uint32_t mag = em >= 0x7C00u ? special : (em >= 0x0400u ? normal : sub);
  return bits_f32(mag | sign);
}

// fp32 -> bf16 bits, round to nearest even (IEEE; overflow gives Inf, NaN stays NaN).
MQ_HD uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & kF32AbsMask) > kF32InfBits) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Round-to-nearest-even of a finite fp32 magnitude (bits u, sign cleared) onto a binary float
// format with M mantissa bits and exponent bias BIAS whose exponent range lies inside fp32's
// normal range. Returns the format's magnitude code (exponent << M | mantissa), unsaturated.
template <int M, int BIAS>
MQ_HD uint32_t round_mag_rne(uint32_t u) {
  constexpr int kShift = 23 - M;
  constexpr int kMinNormalField = 127 + 1 - BIAS;  // fp32 exponent field of the target's 2^emin
  const int e = static_cast<int>(u >> 23);
  // Normal target: drop kShift mantissa bits with RNE; a carry moves into the exponent.
  const uint32_t rn = (u + ((1u << (kShift - 1)) - 1u) + ((u >> kShift) & 1u)) >> kShift;
  const uint32_t cn = rn - (static_cast<uint32_t>(127 - BIAS) << M);
  // Subnormal target: count units of 2^(emin - M). fp32 subnormal inputs (e == 0) are far below
  // half the smallest target subnormal for every format used here, so they round to 0.
  const uint32_t mant = (u & 0x007FFFFFu) | 0x00800000u;
  int d = kShift + (kMinNormalField - e);
  d = d < 1 ? 1 : (d > 31 ? 31 : d);
  const uint32_t rs = (mant + ((1u << (d - 1)) - 1u) + ((mant >> d) & 1u)) >> d;
  return e >= kMinNormalField ? cn : rs;
}

// fp32 -> fp16 bits, round to nearest even; NaN stays NaN (0x7E00 with the sign). Finite
// overflow and Inf give +-65504 with kSaturate (stored scales, finite and in range by contract),
// else Inf (IEEE: dequantized outputs).
template <bool kSaturate>
MQ_HD uint16_t f32_to_f16(float f) {
  const uint32_t b = f32_bits(f);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t u = b & kF32AbsMask;
  if (u > kF32InfBits) return static_cast<uint16_t>(sign | 0x7E00u);
  constexpr uint32_t kTop = kSaturate ? 0x7BFFu : 0x7C00u;
  uint32_t c = round_mag_rne<10, 15>(u);
  c = c > kTop ? kTop : c;
  return static_cast<uint16_t>(sign | c);
}
MQ_HD uint16_t f32_to_f16_satfinite(float f) { return f32_to_f16<true>(f); }
MQ_HD uint16_t f32_to_f16_rne(float f) { return f32_to_f16<false>(f); }

// Element i of a contiguous input of dtype D, widened to fp32 (exact).
template <DType D>
MQ_HD float load_f32(const void* p, int64_t i) {
  if (D == DType::f32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return D == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}

}  // namespace miles_quant
