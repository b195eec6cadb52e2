// AVX-512 dequantization: value(code) * scale in fp32, one RNE rounding to the output dtype,
// every NaN written as the dtype's canonical quiet NaN (dq_store in cpu_kernels.h, 16 lanes).
//
// Part of the AVX-512 leaf kernels: included by avx512_kernels.h inside namespace
// miles_quant::cpu::MQ_CPU_NS, after the parts before it there.
//
// Every step is exact or one IEEE fp32 operation, like its scalar twin:
// - E4M3 codes: the 7 magnitude bits shifted to bit 20 are an fp32 whose value is the code's
//   value times 2^-120 (normal codes: exponent e - 7 + 127 - 120 = e; subnormal codes land on
//   fp32 subnormals with the same mantissa), so one multiplication by 2^120 is exact (DAZ is
//   clear on our threads); the sign is or-ed in, 0x7F / 0xFF are NaN.
// - E5M2 codes are the top byte of an fp16: vcvtph2ps is exact (Inf and NaN included).
// - E2M1 and INT4 nibbles take their value from a 16-entry table (vpermps).
// - Scales: fp32 as stored, bf16 / fp16 widened exactly, E8M0 2^(c-127) by its bits, NVFP4's
//   E4M3 block scale decoded as above and multiplied by the global scale first (the contract's
//   order). Then one vmulps by the element's value.
// - bf16 output: RNE by the integer carry of f32_to_bf16; fp16: vcvtps2ph with RNE (overflow to
//   Inf, subnormals exact like f32_to_f16_rne). NaN lanes get the canonical code.
// Shapes the vector loops do not cover (a group width that is neither a multiple of 16, or of 32
// for packed codes, nor the whole row; the last < 32 elements of a packed row) run through the
// scalar dequant_cols.
#pragma once

namespace dq {

static inline __m512 e4m3_values(__m512i c) {
  const __m512i mag = _mm512_and_si512(c, simd::u32(0x7F));
  __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 20)), _mm512_set1_ps(0x1p120f));
  v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), _mm512_slli_epi32(_mm512_and_si512(c, simd::u32(0x80)), 24)));
  const simd::Mask nan = _mm512_cmpeq_epi32_mask(mag, simd::u32(0x7F));
  return _mm512_mask_mov_ps(v, nan, _mm512_castsi512_ps(simd::u32(kF32QuietNan)));
}

// 16 codes (bytes; lanes past m are code 0) -> fp32 values.
static inline __m512 fp8_values(const uint8_t* p, simd::Mask m, Code code) {
  const __m128i b = _mm_maskz_loadu_epi8(m, p);
  if (code == Code::e4m3) return e4m3_values(_mm512_cvtepu8_epi32(b));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
}

// 32 codes at p -> the values of the even (lane k: code 2k) and the odd codes, so that they
// store like the nibble pairs (store32).
static inline void fp8_pairs(const uint8_t* p, Code code, __m512* even, __m512* odd) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  if (code == Code::e4m3) {
    *even = e4m3_values(_mm512_and_si512(w, simd::u32(0xFF)));
    *odd = e4m3_values(_mm512_srli_epi32(w, 8));
  } else {  // E5M2 codes are the top bytes of fp16s
    *even = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32(w, 8)));
    *odd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(w, simd::u32(0xFF00))));
  }
}

// Scales i .. i + n - 1 (n <= 16) of a, decoded to fp32 and times g when has_g.
static inline __m512 scales16(const DequantArgs& a, int64_t i, int64_t n, float g) {
  const simd::Mask m = simd::tail_mask(n);
  __m512 s;
  switch (a.scale_kind) {
    case ScaleKind::f32:
      s = _mm512_maskz_loadu_ps(m, static_cast<const float*>(a.scales) + i);
      break;
    case ScaleKind::bf16:
      s = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(a.scales) + i)), 16));
      break;
    case ScaleKind::f16:
      s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(a.scales) + i));
      break;
    case ScaleKind::e8m0: {
      const __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, static_cast<const uint8_t*>(a.scales) + i));
      __m512i v = _mm512_slli_epi32(c, 23);
      v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(c, _mm512_setzero_si512()), simd::u32(0x00400000u));
      v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(c, simd::u32(kE8M0Nan)), simd::u32(kF32QuietNan));
      s = _mm512_castsi512_ps(v);
      break;
    }
    default:
      s = e4m3_values(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, static_cast<const uint8_t*>(a.scales) + i)));
      break;
  }
  return a.global_scale != nullptr ? _mm512_mul_ps(_mm512_set1_ps(g), s) : s;
}

// The decoded scales of one row, 16 groups at a time.
struct Window {
  alignas(64) float s[16];
  int64_t first = -1;
};
static inline float scale_at(const DequantArgs& a, int64_t base, int64_t nc, float g, Window& w, int64_t j) {
  if (w.first < 0 || j < w.first || j >= w.first + 16) {
    w.first = j;
    _mm512_store_ps(w.s, scales16(a, base + j, lo(16, nc - j), g));
  }
  return w.s[j - w.first];
}

static inline __m512 canonical(__m512 v) {
  return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(simd::u32(kF32QuietNan)));
}

// 16 output halves (bf16 or fp16 bits in the low 16 bits of each lane) of v.
template <DType O>
static inline __m512i halves(__m512 v) {
  const simd::Mask nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  if constexpr (O == DType::bf16) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(simd::u32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), simd::u32(1))));
    return _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), nan, simd::u32(kBf16QuietNan));
  } else {
    const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_mask_mov_epi32(_mm512_cvtepu16_epi32(h), nan, simd::u32(kF16QuietNan));
  }
}

// Output elements i .. i + 15 (lanes in m).
template <DType O>
static inline void store16(void* out, int64_t i, __m512 v, simd::Mask m) {
  if constexpr (O == DType::f32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + i, m, canonical(v));
  } else {
    _mm512_mask_cvtepi32_storeu_epi16(static_cast<uint16_t*>(out) + i, m, halves<O>(v));
  }
}

// Output elements i .. i + 31 from the even (element 2k in lane k) and odd values.
template <DType O>
static inline void store32(void* out, int64_t i, __m512 even, __m512 odd) {
  if constexpr (O == DType::f32) {
    const __m512i lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi_idx = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    even = canonical(even);
    odd = canonical(odd);
    float* o = static_cast<float*>(out) + i;
    _mm512_storeu_ps(o, _mm512_permutex2var_ps(even, lo_idx, odd));
    _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(even, hi_idx, odd));
  } else {
    const __m512i w = _mm512_or_si512(halves<O>(even), _mm512_slli_epi32(halves<O>(odd), 16));
    _mm512_storeu_si512(static_cast<uint16_t*>(out) + i, w);
  }
}

template <DType O>
static void rows(const DequantArgs& a, int64_t r0, int64_t r1) {
  const int64_t C = a.cols, tc = a.tile_cols;
  const int64_t nc = (C + tc - 1) / tc;
  const bool packed = a.code == Code::e2m1 || a.code == Code::int4;
  const bool vector = packed ? (tc == 16 || tc % 32 == 0) : (tc % 16 == 0 || nc == 1);
  const DqValues& values = dq_values();  // the scalar code's tables: decode<E2M1>, q - 8
  const __m512 lut = _mm512_loadu_ps(a.code == Code::int4 ? values.int4 : values.e2m1);
  for (int64_t R = r0; R < r1; ++R) {
    if (!vector) {
      dequant_cols(a, R, 0, C);
      continue;
    }
    int64_t b;
    const int64_t base = dq_row_scales(a, R, &b);
    const float g = a.global_scale != nullptr ? a.global_scale[b] : 1.0f;
    Window w;
    if (!packed) {
      const uint8_t* x = a.data + R * C;
      for (int64_t j = 0; j < nc; ++j) {
        const int64_t c1 = lo(C, (j + 1) * tc);
        const __m512 s = _mm512_set1_ps(scale_at(a, base, nc, g, w, j));
        int64_t c = j * tc;
        for (; c + 32 <= c1; c += 32) {
          __m512 even, odd;
          fp8_pairs(x + c, a.code, &even, &odd);
          store32<O>(a.out, R * C + c, _mm512_mul_ps(even, s), _mm512_mul_ps(odd, s));
        }
        for (; c < c1; c += 16) {
          const simd::Mask m = simd::tail_mask(c1 - c);
          store16<O>(a.out, R * C + c, _mm512_mul_ps(fp8_values(x + c, m, a.code), s), m);
        }
      }
      continue;
    }
    const uint8_t* x = a.data + R * ((C + 1) / 2);
    auto step32 = [&](int64_t c, __m512 s) {
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + c / 2)));
      const __m512 even = _mm512_permutexvar_ps(_mm512_and_si512(bytes, simd::u32(0xF)), lut);
      const __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), lut);
      store32<O>(a.out, R * C + c, _mm512_mul_ps(even, s), _mm512_mul_ps(odd, s));
    };
    int64_t done = 0;
    if (tc == 16) {  // two blocks per 32 elements: lanes 0-7 hold the first block's elements
      for (int64_t c = 0; c + 32 <= C; c += 32) {
        const __m512 s0 = _mm512_set1_ps(scale_at(a, base, nc, g, w, c / 16));
        const __m512 s1 = _mm512_set1_ps(scale_at(a, base, nc, g, w, c / 16 + 1));
        step32(c, _mm512_mask_blend_ps(0xFF00, s0, s1));
        done = c + 32;
      }
      if (done < C) dequant_cols(a, R, done, C);
      continue;
    }
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t c1 = lo(C, (j + 1) * tc);
      const __m512 s = _mm512_set1_ps(scale_at(a, base, nc, g, w, j));
      int64_t c = j * tc;
      for (; c + 32 <= c1; c += 32) step32(c, s);
      if (c < c1) dequant_cols(a, R, c, c1);
    }
  }
}

}  // namespace dq

static void dequant_rows_v(const DequantArgs& a, int64_t r0, int64_t r1) {
  if (a.out_dtype == DType::f32) dq::rows<DType::f32>(a, r0, r1);
  if (a.out_dtype == DType::bf16) dq::rows<DType::bf16>(a, r0, r1);
  if (a.out_dtype == DType::f16) dq::rows<DType::f16>(a, r0, r1);
}
