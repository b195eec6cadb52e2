// Internal helpers shared by the kernels: bf16 conversions (round to nearest even, NaN ->
// 0x7FC0, c10::BFloat16's rule), the instruction-set attributes, and the run-time choice.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MILES_X86 1
#define MILES_AVX2 __attribute__((target("avx2,fma")))
#define MILES_AVX512 __attribute__((target("avx512f,avx2,fma")))
#endif
#define MILES_INLINE inline __attribute__((always_inline))

namespace miles_rollout {
namespace detail {

enum class Isa { kGeneric, kAvx2, kAvx512 };

// The implementation every kernel dispatches to (set at load time, or by use_isa for tests).
Isa active_isa();

MILES_INLINE float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

MILES_INLINE float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

MILES_INLINE uint16_t f32_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

MILES_INLINE float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#ifdef MILES_X86
MILES_AVX512 MILES_INLINE __m512 load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// bf16 bits in the low half of each 32-bit lane.
MILES_AVX512 MILES_INLINE __m512i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}

MILES_AVX512 MILES_INLINE __m512 round_bf16_v(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16));
}

MILES_AVX512 MILES_INLINE void store_bf16(uint16_t* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
}
#endif

}  // namespace detail
}  // namespace miles_rollout
