// The precision contract's per-group arithmetic, shared by the CPU and CUDA kernels. Each line
// is one fp32 operation in the order packages/miles-quant/docs/contract.md states; the PyTorch
// reference does the same operations in the same order.
#pragma once

#include <cstdint>

#include "miles_quant/bits.h"
#include "miles_quant/elements.h"

namespace miles_quant {

// FP8 (all granularities) and the NVFP4 global scale: amax is raised to at least this before
// dividing (SGLang/vLLM per_token_group_quant_fp8 use the same eps), so an all-zero group gets a
// tiny finite scale and quantizes to zeros.
constexpr float kAmaxMin = 1e-10f;
// NVFP4: global scale = amax / (448 * 6); block scales are clamped to [2^-6, 448] (torchao).
constexpr float kNvfp4GlobalDivisor = 2688.0f;
constexpr float kNvfp4BlockScaleMin = 0.015625f;
// INT4 symmetric: scale = amax / 7, at least 1e-5 (slime/miles QAT); codes in [-7, 7].
constexpr float kInt4Qmax = 7.0f;
constexpr float kInt4ScaleMin = 1e-5f;

// A group whose amax is Inf or NaN is "poisoned": its scale is NaN and it dequantizes to NaN.
MQ_HD bool is_poisoned(uint32_t amax_bits) { return amax_bits >= kF32InfBits; }

MQ_HD float clamp_amax(float amax) { return amax < kAmaxMin ? kAmaxMin : amax; }

// FP8: the stored scale s (dequantization multiplier) and elements encode(x / s).
template <class F>
MQ_HD float fp8_scale(float amax) {
  return clamp_amax(amax) / F::kMax;
}

MQ_HD float nvfp4_global_scale(float amax) { return clamp_amax(amax) / kNvfp4GlobalDivisor; }

// NVFP4 block scale: ((amax_b / 6) / s_global) clamped to [2^-6, 448], then RNE to E4M3.
MQ_HD uint32_t nvfp4_block_code(float amax_b, float s_global) {
  float bs = (amax_b / E2M1::kMax) / s_global;
  bs = bs < kNvfp4BlockScaleMin ? kNvfp4BlockScaleMin : bs;
  bs = bs > E4M3::kMax ? E4M3::kMax : bs;
  return encode<E4M3>(bs);
}

// NVFP4 element factor: (1 / s_global) / decoded block scale; elements encode(x * factor).
MQ_HD float nvfp4_block_factor(float inv_global, uint32_t block_code) {
  return inv_global / decode<E4M3>(block_code);
}

MQ_HD float int4_scale(float amax) {
  const float s = amax / kInt4Qmax;
  return s < kInt4ScaleMin ? kInt4ScaleMin : s;
}

// INT4 code (offset binary, q + 8) of x with the scale as stored (already rounded to the storage
// dtype and widened back): q = clamp(rne(x / s), -7, 7).
MQ_HD uint32_t int4_code(float x, float s) {
  float y = x / s;
  y = y < -8.0f ? -8.0f : (y > 8.0f ? 8.0f : y);
#if defined(__CUDA_ARCH__)
  int q = __float2int_rn(y);
#else
  // Round half to even with the 1.5 * 2^23 trick: exact for |y| <= 2^22 under round-to-nearest.
  const float r = (y + 12582912.0f) - 12582912.0f;
  int q = static_cast<int>(r);
#endif
  q = q < -7 ? -7 : (q > 7 ? 7 : q);
  return static_cast<uint32_t>(q + 8);
}

// ---- Dequantization: value(code) * scale in fp32, one RNE rounding to the output dtype --------

// Canonical quiet NaNs of the dequantized outputs (whatever the payload of the NaN computed).
constexpr uint16_t kBf16QuietNan = 0x7FC0u;
constexpr uint16_t kF16QuietNan = 0x7E00u;

}  // namespace miles_quant
