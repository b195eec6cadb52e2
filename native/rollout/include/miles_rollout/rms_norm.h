// RMSNorm of bf16 rows for the miles-rollout engine, with the bits of transformers' RMSNorm
// as PyTorch computes it on CPU (`w * F.rms_norm(x, None, eps)` in bf16):
//   var = sum_d fp32(x_d)^2 / D    (squares rounded to fp32, then summed in PyTorch's order for
//                                   a contiguous row of 16-float vectors: four accumulators over
//                                   vectors 4i+k, combined 0+1+2+3, then lanes 0..15 in turn)
//   y   = bf16(fp32(x_d) * (1 / sqrt(var + eps)))
//   out = bf16(fp32(w_d) * fp32(y))
// Torch-free: raw pointers, sizes and strides (elements); bf16 as uint16_t.
#pragma once

#include <cstdint>

namespace miles_rollout {

// x [a, b, d] with strides (x_stride_a, x_stride_b, 1); w [b, d] with row stride w_stride_b
// (0: one [d] weight for every row); out [a, b, d] contiguous. d: a positive multiple of 16.
struct RmsNorm {
  const uint16_t* x;
  int64_t a;
  int64_t b;
  int64_t d;
  int64_t x_stride_a;
  int64_t x_stride_b;
  const uint16_t* w;
  int64_t w_stride_b;
  float eps;
  uint16_t* out;
};

void rms_norm(const RmsNorm& args);

}  // namespace miles_rollout
