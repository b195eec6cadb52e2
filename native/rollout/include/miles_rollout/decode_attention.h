// Attention of query tokens against rows of the miles-rollout engine's KV cache: one new token
// per running request (decode), or every token of a prefill, each reading exactly its row's
// positions 0 .. length-1. bf16 has transformers' eager bf16 attention numerics; fp32 the same
// operations without the bf16 roundings. Because each query token's result depends only on its
// own query and its row's live positions (never on the batch, the padding or the cache size),
// the same token gets the same bits in a prefill, a decode step or after a prefix-cache hit.
//
// Torch-free: tensors arrive as raw pointers, sizes and strides (elements). bf16 values are
// uint16_t bit patterns, fp32 values floats.
#pragma once

#include <cstdint>

namespace miles_rollout {

// One attention call over n query tokens. Shapes (elements):
//   q       [n, kv_heads, group, head_dim], strides q_stride_{n,kv,g}; head_dim contiguous.
//   k, v    [batch_cap, kv_heads, t_cap, head_dim] contiguous (the layer's cache); query b
//           reads row rows[b] (row b when rows is null) at positions 0 .. lengths[b]-1 only.
//   rows    [n] int64 in [0, batch_cap), or null.
//   lengths [n] int64, each in [1, t_cap].
//   out     [n, kv_heads, group, head_dim] contiguous.
// Every pointer to elements is uint16_t (bf16 bits) when fp32 is false, float otherwise.
struct DecodeAttention {
  const void* q;
  int64_t q_stride_n;
  int64_t q_stride_kv;
  int64_t q_stride_g;
  const void* k;
  const void* v;
  int64_t batch_cap;
  int64_t t_cap;
  const int64_t* rows;
  const int64_t* lengths;
  int64_t n;
  int64_t kv_heads;
  int64_t group;
  int64_t head_dim;  // a multiple of 16
  float scale;
  bool fp32;
  void* out;
};

// Computes, for every query b, kv head h and group member g (the query head h * group + g):
//   s_t = bf16(sum_d fp32(q_d) * fp32(K_t,d))        fp32 accumulation, one rounding
//   s_t = bf16(fp32(s_t) * scale)
//   p   = bf16(softmax_fp32(s_0 .. s_{len-1}))        max-subtract, exp, sum, divide
//   out = bf16(sum_t fp32(p_t) * fp32(V_t))
// (fp32: the same without the bf16() roundings.)
// Every instruction-set variant gives the same bits: each dot product and sum is accumulated
// in 16 lanes (element i in lane i % 16, fused multiply-add in order) and the lanes are added
// in one fixed tree (lane j + lane j+8, then +4, +2, +1); exp is the same polynomial everywhere.
// Returns 0; or the index + 1 of the first query whose length is outside [1, t_cap], or minus
// (index + 1) of the first whose row is outside [0, batch_cap) (nothing is written then).
int64_t decode_attention(const DecodeAttention& args);

}  // namespace miles_rollout
