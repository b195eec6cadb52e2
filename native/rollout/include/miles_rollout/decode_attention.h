// Decode attention for the miles-rollout engine: one new query token per running request
// against its rows of the KV cache, with transformers' eager bf16 attention numerics.
//
// Torch-free: tensors arrive as raw pointers, sizes and strides (elements). bf16 values are
// uint16_t bit patterns.
#pragma once

#include <cstdint>

namespace miles_rollout {

// One decode-attention call. Shapes (elements):
//   q       [n, kv_heads, group, head_dim], strides q_stride_{n,kv,g}; head_dim contiguous.
//   k, v    [batch_cap, kv_heads, t_cap, head_dim] contiguous (the layer's cache); only rows
//           0 .. n-1 and positions 0 .. lengths[b]-1 are read.
//   lengths [n] int64, each in [1, t_cap].
//   out     [n, kv_heads, group, head_dim] contiguous.
struct DecodeAttention {
  const uint16_t* q;
  int64_t q_stride_n;
  int64_t q_stride_kv;
  int64_t q_stride_g;
  const uint16_t* k;
  const uint16_t* v;
  int64_t t_cap;
  const int64_t* lengths;
  int64_t n;
  int64_t kv_heads;
  int64_t group;
  int64_t head_dim;  // a multiple of 16
  float scale;
  uint16_t* out;
};

// Computes, for every row b, kv head h and group member g (the query head h * group + g):
//   s_t = bf16(sum_d fp32(q_d) * fp32(K_t,d))        fp32 accumulation, one rounding
//   s_t = bf16(fp32(s_t) * scale)
//   p   = bf16(softmax_fp32(s_0 .. s_{len-1}))        max-subtract, exp, sum, divide
//   out = bf16(sum_t fp32(p_t) * fp32(V_t))
// Every instruction-set variant gives the same bits: each dot product and sum is accumulated
// in 16 lanes (element i in lane i % 16, fused multiply-add in order) and the lanes are added
// in one fixed tree (lane j + lane j+8, then +4, +2, +1); exp is the same polynomial everywhere.
// Returns 0, or the index + 1 of the first row whose length is outside [1, t_cap] (nothing is
// written then).
int64_t decode_attention(const DecodeAttention& args);

}  // namespace miles_rollout
