// RMSNorm of bf16 rows (see include/miles_rollout/rms_norm.h).
//
// PyTorch computes the norm as separate ops (float32 upcast, pow, mean, add, rsqrt, mul, cast,
// weight product): eight passes and allocations per norm, several times the cost of the row's
// arithmetic. Here one pass per row, with the same float operations in the same order. The sum
// of squares follows PyTorch 2.13's CPU reduction of a contiguous float row, which works on
// 8-float vectors (found by testing candidate orders against torch on random rows; the tests
// pin it): vector j goes to accumulator j % 4 (rows of four vectors, summed in cascade levels
// of 16 rows), leftover vectors to accumulator 0, the accumulators are combined 0 + 1 + 2 + 3
// and the 8 lanes added one after another; 1 / sqrt(var + eps) is a correctly rounded square
// root and division, as torch.rsqrt. Same bits on every instruction set (the generic code
// emulates the 8 lanes; AVX2 and AVX-512 share the explicit 8-lane code).
#include "miles_rollout/rms_norm.h"

// GCC 12 reports the deliberately undefined operand inside its own AVX-512 intrinsics as
// maybe-uninitialized once they are inlined: a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cmath>
#include <vector>

#include "common.h"

namespace miles_rollout {
namespace {

using detail::bf16_to_f32;
using detail::f32_to_bf16;
using detail::Isa;
using detail::round_bf16;

constexpr int kLanes = 8;  // lanes of the reduction (PyTorch's float vectors here)
constexpr int kIlp = 4;       // accumulators (vectors per row of the reduction)
constexpr int kLevels = 4;    // cascade levels
constexpr int kLevelPower = 4;  // 16 rows per level for rows of up to 2^16 (ATen: max(4, log2/4))

int64_t level_power(int64_t rows) {
  int64_t log2 = 0;
  while ((int64_t{1} << log2) < rows) ++log2;
  return log2 / kLevels > kLevelPower ? log2 / kLevels : kLevelPower;
}

// ---- generic (16 lanes emulated) -------------------------------------------------------------

MILES_INLINE float sum_squares_generic(const float* sq, int64_t nvec) {
  float acc[kLevels][kIlp][kLanes] = {};
  const int64_t rows = nvec / kIlp;
  const int64_t power = level_power(rows);
  const int64_t step = int64_t{1} << power;
  const int64_t mask = step - 1;
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < kLanes; ++l)
          acc[0][k][l] = acc[0][k][l] + sq[(i * kIlp + k) * kLanes + l];
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < kLanes; ++l) {
          acc[j][k][l] = acc[j][k][l] + acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < kLanes; ++l)
        acc[0][k][l] = acc[0][k][l] + sq[(i * kIlp + k) * kLanes + l];
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < kLanes; ++l) acc[0][k][l] = acc[0][k][l] + acc[j][k][l];
  for (int64_t v = rows * kIlp; v < nvec; ++v)
    for (int l = 0; l < kLanes; ++l) acc[0][0][l] = acc[0][0][l] + sq[v * kLanes + l];
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < kLanes; ++l) acc[0][0][l] = acc[0][0][l] + acc[0][k][l];
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total = total + acc[0][0][l];
  return total;
}

MILES_INLINE float inv_rms(float sum_sq, int64_t d, float eps) {
  const float var = sum_sq / static_cast<float>(d);
  return 1.0f / std::sqrt(var + eps);
}

MILES_INLINE void rows_generic(const RmsNorm& a, float* sq) {
  const int64_t d = a.d;
  for (int64_t i = 0; i < a.a; ++i) {
    for (int64_t j = 0; j < a.b; ++j) {
      const uint16_t* x = a.x + i * a.x_stride_a + j * a.x_stride_b;
      const uint16_t* w = a.w + j * a.w_stride_b;
      uint16_t* out = a.out + (i * a.b + j) * d;
      for (int64_t e = 0; e < d; ++e) {
        const float f = bf16_to_f32(x[e]);
        sq[e] = f * f;
      }
      const float r = inv_rms(sum_squares_generic(sq, d / kLanes), d, a.eps);
      for (int64_t e = 0; e < d; ++e)
        out[e] = f32_to_bf16(bf16_to_f32(w[e]) * round_bf16(bf16_to_f32(x[e]) * r));
    }
  }
}

void norm_plain(const RmsNorm& a, float* sq) { rows_generic(a, sq); }

#ifdef MILES_X86
MILES_AVX2 MILES_INLINE __m256 load8_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

MILES_AVX2 MILES_INLINE __m256 square(const uint16_t* x, int64_t v) {
  const __m256 f = load8_bf16(x + v * kLanes);
  return _mm256_mul_ps(f, f);
}

MILES_AVX2 MILES_INLINE float sum_squares_simd(const uint16_t* x, int64_t nvec) {
  __m256 acc[kLevels][kIlp];
  for (int j = 0; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) acc[j][k] = _mm256_setzero_ps();
  const int64_t rows = nvec / kIlp;
  const int64_t power = level_power(rows);
  const int64_t step = int64_t{1} << power;
  const int64_t mask = step - 1;
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], square(x, i * kIlp + k));
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], square(x, i * kIlp + k));
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  for (int64_t v = rows * kIlp; v < nvec; ++v) acc[0][0] = _mm256_add_ps(acc[0][0], square(x, v));
  for (int k = 1; k < kIlp; ++k) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, acc[0][0]);
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total = total + lanes[l];
  return total;
}

MILES_AVX2 void norm_avx2(const RmsNorm& a, float*) {
  const int64_t d = a.d;
  for (int64_t i = 0; i < a.a; ++i) {
    for (int64_t j = 0; j < a.b; ++j) {
      const uint16_t* x = a.x + i * a.x_stride_a + j * a.x_stride_b;
      const uint16_t* w = a.w + j * a.w_stride_b;
      uint16_t* out = a.out + (i * a.b + j) * d;
      const float r = inv_rms(sum_squares_simd(x, d / kLanes), d, a.eps);
      for (int64_t e = 0; e < d; ++e)
        out[e] = f32_to_bf16(bf16_to_f32(w[e]) * round_bf16(bf16_to_f32(x[e]) * r));
    }
  }
}

// AVX-512: the same sum (8-lane vectors), the output pass 16 values at a time.
using detail::load_bf16;
using detail::round_bf16_v;
using detail::store_bf16;

MILES_AVX512 void norm_avx512(const RmsNorm& a, float*) {
  const int64_t d = a.d;
  for (int64_t i = 0; i < a.a; ++i) {
    for (int64_t j = 0; j < a.b; ++j) {
      const uint16_t* x = a.x + i * a.x_stride_a + j * a.x_stride_b;
      const uint16_t* w = a.w + j * a.w_stride_b;
      uint16_t* out = a.out + (i * a.b + j) * d;
      const __m512 r = _mm512_set1_ps(inv_rms(sum_squares_simd(x, d / kLanes), d, a.eps));
      for (int64_t e = 0; e < d; e += 16) {
        const __m512 y = round_bf16_v(_mm512_mul_ps(load_bf16(x + e), r));
        store_bf16(out + e, _mm512_mul_ps(load_bf16(w + e), y));
      }
    }
  }
}
#endif  // MILES_X86

}  // namespace

void rms_norm(const RmsNorm& a) {
#ifdef MILES_X86
  if (detail::active_isa() == Isa::kAvx512) return norm_avx512(a, nullptr);
  if (detail::active_isa() == Isa::kAvx2) return norm_avx2(a, nullptr);
#endif
  static thread_local std::vector<float> scratch;
  if (scratch.size() < static_cast<size_t>(a.d)) scratch.resize(static_cast<size_t>(a.d));
  norm_plain(a, scratch.data());
}

}  // namespace miles_rollout
