// AVX2 dequantization: the AVX-512 kernel's steps (avx512_dequant.h) on 8 fp32 lanes, for hosts
// without AVX-512 (AMD Zen 2 / Zen 3, older Intel). The shapes the vector loops do not cover run
// through the scalar dequant_cols of cpu_kernels.h, the same function.
//
// Included by cpu_isa_avx2.cpp (after immintrin.h and cpu_kernels.h) inside namespace
// miles_quant::cpu::avx2.
// Every step is exact or one IEEE fp32 operation:
// - E4M3: the magnitude bits at bit 20 are an fp32 equal to the value times 2^-120 (subnormal
//   codes on fp32 subnormals; DAZ is clear on our threads), times 2^120 exactly; 0x7F is NaN.
// - E5M2: the magnitude bits at bit 21 are the value times 2^-112, times 2^112 exactly; the
//   exponent-all-ones codes are Inf (0x7C) and NaN (above).
// - E2M1 / INT4 nibbles: a 16-entry table by two vpermps and a blend on the index's bit 3.
// - bf16: RNE by the integer carry of f32_to_bf16; NaN lanes get the canonical code.
// - fp16: vcvtps2ph (F16C) with round-to-nearest-even, overflow to Inf as f32_to_f16_rne; NaN
//   lanes are made the canonical fp32 NaN first, which converts to the canonical 0x7E00.
#pragma once



namespace dq2 {

static inline __m256i u32(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }

static inline __m256 nan_to(__m256 v, __m256 mask) {
  return _mm256_blendv_ps(v, _mm256_castsi256_ps(u32(kF32QuietNan)), mask);
}

// Byte codes (8 lanes of 32 bits) -> fp32 values.
static inline __m256 fp8_values(__m256i c, Code code) {
  const __m256i mag = _mm256_and_si256(c, u32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, u32(0x80)), 24);
  __m256 v;
  __m256 nan;
  if (code == Code::e4m3) {
    v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)), _mm256_set1_ps(0x1p120f));
    nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, u32(0x7F)));
  } else {
    v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 21)), _mm256_set1_ps(0x1p112f));
    const __m256i inf = _mm256_cmpeq_epi32(mag, u32(0x7C));
    v = _mm256_blendv_ps(v, _mm256_castsi256_ps(u32(kF32InfBits)), _mm256_castsi256_ps(inf));
    nan = _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, u32(0x7C)));
  }
  v = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
  return nan_to(v, nan);
}

// Nibble codes (8 lanes, 0..15) -> fp32 values of the 16-entry table lo8 | hi8.
static inline __m256 nibble_values(__m256i c, __m256 lo8, __m256 hi8) {
  const __m256 a = _mm256_permutevar8x32_ps(lo8, c);
  const __m256 b = _mm256_permutevar8x32_ps(hi8, c);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
}

static inline __m256 canonical(__m256 v) { return nan_to(v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }

// bf16 bits of v in the low half of each lane, NaN canonical.
static inline __m256i bf16_halves(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(u32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(u, 16), u32(1))));
  const __m256i h = _mm256_srli_epi32(r, 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(h), _mm256_castsi256_ps(u32(kBf16QuietNan)), nan));
}

// 16 outputs at i from the values of elements i .. i + 7 (v0) and i + 8 .. i + 15 (v1).
template <DType O>
static inline void store_halves16(void* out, int64_t i, __m256 v0, __m256 v1) {
  if constexpr (O == DType::f32) {
    float* o = static_cast<float*>(out) + i;
    _mm256_storeu_ps(o, canonical(v0));
    _mm256_storeu_ps(o + 8, canonical(v1));
  } else if constexpr (O == DType::f16) {
    __m128i* o = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
    _mm_storeu_si128(o, _mm256_cvtps_ph(canonical(v0), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128(o + 1, _mm256_cvtps_ph(canonical(v1), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    const __m256i p = _mm256_packus_epi32(bf16_halves(v0), bf16_halves(v1));  // 128-bit lanes
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), _mm256_permute4x64_epi64(p, 0xD8));
  }
}

// 16 outputs at i from the even (lane k: element 2k) and odd values.
template <DType O>
static inline void store_pairs16(void* out, int64_t i, __m256 even, __m256 odd) {
  if constexpr (O == DType::f32 || O == DType::f16) {
    even = canonical(even);
    odd = canonical(odd);
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    const __m256 v0 = _mm256_permute2f128_ps(lo, hi, 0x20), v1 = _mm256_permute2f128_ps(lo, hi, 0x31);
    if constexpr (O == DType::f32) {
      float* o = static_cast<float*>(out) + i;
      _mm256_storeu_ps(o, v0);
      _mm256_storeu_ps(o + 8, v1);
    } else {
      __m128i* o = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
      _mm_storeu_si128(o, _mm256_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      _mm_storeu_si128(o + 1, _mm256_cvtps_ph(v1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  } else {
    const __m256i w = _mm256_or_si256(bf16_halves(even), _mm256_slli_epi32(bf16_halves(odd), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), w);
  }
}

template <DType O>
static void rows(const DequantArgs& a, int64_t r0, int64_t r1) {
  const int64_t C = a.cols, tc = a.tile_cols;
  const int64_t nc = (C + tc - 1) / tc;
  const bool packed = a.code == Code::e2m1 || a.code == Code::int4;
  const bool vector = tc % 16 == 0 || (!packed && nc == 1);
  const DqValues& values = dq_values();
  const float* table = a.code == Code::int4 ? values.int4 : values.e2m1;
  const __m256 lo8 = _mm256_loadu_ps(table), hi8 = _mm256_loadu_ps(table + 8);
  for (int64_t R = r0; R < r1; ++R) {
    if (!vector) {
      dequant_cols(a, R, 0, C);
      continue;
    }
    int64_t b;
    const int64_t base = dq_row_scales(a, R, &b);
    const uint8_t* x = a.data + R * (packed ? (C + 1) / 2 : C);
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t c1 = lo(C, (j + 1) * tc);
      const __m256 s = _mm256_set1_ps(dq_scale(a, base, j, b));
      int64_t c = j * tc;
      for (; c + 16 <= c1; c += 16) {
        if (packed) {
          const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + c / 2)));
          const __m256 even = nibble_values(_mm256_and_si256(bytes, u32(0xF)), lo8, hi8);
          const __m256 odd = nibble_values(_mm256_srli_epi32(bytes, 4), lo8, hi8);
          store_pairs16<O>(a.out, R * C + c, _mm256_mul_ps(even, s), _mm256_mul_ps(odd, s));
        } else {
          const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + c)));
          const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + c + 8)));
          store_halves16<O>(a.out, R * C + c, _mm256_mul_ps(fp8_values(b0, a.code), s),
                            _mm256_mul_ps(fp8_values(b1, a.code), s));
        }
      }
      if (c < c1) dequant_cols(a, R, c, c1);
    }
  }
}

}  // namespace dq2

static void dequant_rows_avx2(const DequantArgs& a, int64_t r0, int64_t r1) {
  if (a.out_dtype == DType::f32)
    dq2::rows<DType::f32>(a, r0, r1);
  else if (a.out_dtype == DType::bf16)
    dq2::rows<DType::bf16>(a, r0, r1);
  else
    dq2::rows<DType::f16>(a, r0, r1);
}
