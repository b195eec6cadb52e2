// AVX-512 INT4 kernels: group-wise symmetric codes and stored scales.
//
// Part of the AVX-512 leaf kernels: included by avx512_kernels.h (which says how they keep the
// contract) inside namespace miles_quant::cpu::MQ_CPU_NS, after the parts before it there.
#pragma once

// ---- INT4 -----------------------------------------------------------------------------------

// Offset-binary INT4 codes of 16 lanes against the stored scale s (int4_code in contract.h):
// RNE(clamp(x / s, -8, 8)) clamped to [-7, 7], + 8. RNE is monotone and +-7 are integers, so
// that equals RNE(clamp(x / s, -7, 7)) (x / s is finite or +-Inf: the group is not poisoned),
// one clamp instead of two. RNE is vcvtps2dq under round-to-nearest, which our threads select.
static inline __m512i int4_codes(__m512 v, __m512 s) {
  __m512 y = _mm512_div_ps(v, s);
  y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-7.0f)), _mm512_set1_ps(7.0f));
  return _mm512_add_epi32(_mm512_cvtps_epi32(y), _mm512_set1_epi32(8));
}

// The stored INT4 scales of 16 groups (store_scale in cpu_kernels.h, lane-wise): writes the
// first nb to `dst` in the storage dtype and returns them widened back to fp32. Poisoned lanes
// store the canonical quiet NaN of the dtype.
static inline __m512 int4_store_scales(__m512i amax, simd::Mask poisoned, DType sd, void* dst, int64_t nb) {
  __m512 s = _mm512_div_ps(_mm512_castsi512_ps(amax), _mm512_set1_ps(kInt4Qmax));
  s = _mm512_max_ps(s, _mm512_set1_ps(kInt4ScaleMin));
  const simd::Mask m = simd::tail_mask(nb);
  if (sd == DType::bf16) {
    const __m512i u = _mm512_castps_si512(s);
    __m512i h = _mm512_add_epi32(u, _mm512_add_epi32(simd::u32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), simd::u32(1))));
    h = _mm512_mask_mov_epi32(_mm512_srli_epi32(h, 16), poisoned, simd::u32(0x7FC0));
    _mm512_mask_cvtepi32_storeu_epi16(dst, m, h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  }
  if (sd == DType::f16) {
    // RNE to fp16; anything above 65504 rounds to at most Inf and saturates to 65504 (the
    // contract's satfinite), so clamping first gives the same code.
    __m256i h = _mm512_cvtps_ph(_mm512_min_ps(s, _mm512_set1_ps(65504.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    h = _mm256_mask_mov_epi16(h, poisoned, _mm256_set1_epi16(0x7E00));
    _mm256_mask_storeu_epi16(dst, m, h);
    return _mm512_cvtph_ps(h);
  }
  s = _mm512_mask_mov_ps(s, poisoned, _mm512_castsi512_ps(simd::u32(kF32QuietNan)));
  _mm512_mask_storeu_ps(dst, m, s);
  return s;
}

#include "avx512_int4_tables.h"    // kInt4Tables, int4_tab_groups (VBMI builds)
#include "avx512_int4_tables16.h"  // int4_tab_groups16 (fp16 inputs, VBMI builds)

template <DType D>
static void int4_rows_v(const Int4Args& a, int64_t r0, int64_t r1) {
  const auto* xs = static_cast<const typename In<D>::T*>(a.x);
  const int64_t C = a.cols, g = a.group;
  const int64_t out_stride = (C + 1) / 2, ng = (C + g - 1) / g;
  const int64_t scale_size = a.scale_dtype == DType::f32 ? 4 : 2;
  __m512i m[16];
  for (int64_t r = r0; r < r1; ++r) {
    const auto* x = xs + r * C;
    uint8_t* out = a.out + r * out_stride;
    for (int64_t j0 = 0; j0 < ng; j0 += 16) {
      const int64_t nb = lo(16, ng - j0);
      for (int64_t k = 0; k < 16; ++k) m[k] = _mm512_setzero_si512();
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t j = (j0 + k) * g;
        const char* ahead = reinterpret_cast<const char*>(x + j) + simd::kPrefetchAhead;
        for (int64_t b = 0; b < g * static_cast<int64_t>(sizeof(*x)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
        m[k] = simd::amax_lanes<D>(simd::acc_abs<D>(x + j, lo(g, C - j), _mm512_setzero_si512()));
      }
      const __m512i amax = simd::reduce16(m);
      const simd::Mask poisoned = _mm512_cmpge_epu32_mask(amax, simd::u32(kF32InfBits));
      uint8_t* dst = static_cast<uint8_t*>(a.scales) + (r * ng + j0) * scale_size;
      const __m512 sv = int4_store_scales(amax, poisoned, a.scale_dtype, dst, nb);
      simd::Mask done = 0;  // groups the mantissa tables encoded; the fp32 lanes do the rest
      if constexpr (D == DType::bf16 && kInt4Tables)
        done = int4_tab_groups(x + j0 * g, C - j0 * g, g, nb, amax, sv, poisoned, a.scale_dtype, out + j0 * g / 2);
      if constexpr (D == DType::f16 && kInt4Tables)
        done = int4_tab_groups16(x + j0 * g, C - j0 * g, g, nb, amax, sv, poisoned, a.scale_dtype, out + j0 * g / 2);
      for (int64_t k = 0; k < nb; ++k) {
        if ((done >> k) & 1) continue;
        const int64_t j = (j0 + k) * g, n = lo(g, C - j);
        const bool bad = (poisoned >> k) & 1;
        const __m512 s = simd::lane(sv, static_cast<int>(k));
        int64_t i0 = 0;
        if constexpr (D == DType::bf16) {
          for (; i0 + 32 <= n; i0 += 32) {
            if (bad) {
              std::memset(out + (j + i0) / 2, 0x88, 16);
              continue;
            }
            __m512 ev, od;
            simd::load_bf16_pairs(x + j + i0, &ev, &od);
            simd::store_nibble_pairs(out + (j + i0) / 2, int4_codes(ev, s), int4_codes(od, s));
          }
        }
        for (int64_t i = i0; i < n; i += 16) {
          const simd::Mask mk = simd::tail_mask(n - i);
          // Lanes past the row are 0 / s = 0 -> code 8, the pad nibble; poisoned groups write 8s.
          const __m512i c = bad ? simd::u32(8) : int4_codes(simd::load<D>(x + j + i, mk), s);
          if (n - i >= 16)
            simd::store_nibbles16(out + (j + i) / 2, c);
          else
            simd::store_nibbles(out + (j + i) / 2, c, n - i);
        }
      }
    }
  }
}
