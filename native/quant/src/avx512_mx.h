// AVX-512 E2M1 encoding by one fp32 addition, and the MX kernels (1x32 blocks, E8M0 scales).
//
// Part of the AVX-512 leaf kernels: included by avx512_kernels.h (which says how they keep the
// contract) inside namespace miles_quant::cpu::MQ_CPU_NS, after the parts before it there.
#pragma once

// ---- E2M1 by one fp32 addition (MXFP4 and NVFP4) ---------------------------------------

// The E2M1 code of |v| (sign not included) for a v that is not NaN: the lane-wise encode<E2M1>
// of |v| in 7 operations instead of the integer rounding's 11. |v| is clamped to [2^-4, 6]
// (every magnitude below 0.25 encodes to 0 and every one from 6 up, +Inf included, saturates to
// 6, so the clamp changes no code) and rounded onto the E2M1 grid by one fp32 addition: the grid
// step is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], so with M = 2^22, 2^23 or 2^24 picked by
// the exponent of |v|, |v| + M lies in M's binade, whose ulp is that step; the sum is M plus
// |v| rounded to nearest, ties to an even multiple of the step (the code's last bit, as RNE
// wants), and bits(sum) - bits(M) counts the steps. Adding the code of the binade's first grid
// point (0, 2 or 4 steps were skipped) gives the code: both M and bits(M) - that offset come
// from 16-entry tables indexed by the low 4 bits of the exponent field (123..129 here). The
// raw E2M1 cast (encode_run_v) uses it too, so test_elements.py checks it on ties, near-ties
// and random fp32; during development it matched encode<E2M1> on every non-NaN fp32 pattern.
static inline __m512i e2m1_magnitude(__m512 v) {
  constexpr int kM0 = 149 << 23, kM1 = 150 << 23, kM2 = 151 << 23;  // 2^22, 2^23, 2^24
  const __m512i mtab = _mm512_setr_epi32(kM1, kM2, 0, 0, 0, 0, 0, 0, 0, 0, 0, kM0, kM0, kM0, kM0, kM0);
  const __m512i ktab = _mm512_setr_epi32(kM1 - 2, kM2 - 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, kM0, kM0, kM0, kM0, kM0);
  __m512 r = _mm512_range_ps(v, _mm512_set1_ps(0.0625f), 0x0B);  // max(|v|, |2^-4|), sign cleared
  r = _mm512_min_ps(r, _mm512_set1_ps(E2M1::kMax));
  const __m512i e = _mm512_srli_epi32(_mm512_castps_si512(r), 23);
  const __m512 m = _mm512_castsi512_ps(_mm512_permutexvar_epi32(e, mtab));
  return _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(r, m)), _mm512_permutexvar_epi32(e, ktab));
}

// The E2M1 code of v (not NaN) with its sign: encode<E2M1, false>.
static inline __m512i e2m1_code(__m512 v) {
  const __m512i sign = _mm512_srli_epi32(_mm512_castps_si512(v), 28);
  return _mm512_ternarylogic_epi32(e2m1_magnitude(v), sign, simd::u32(8), 0xF8);  // a | (b & c)
}

// ---- MX: 1x32 blocks, E8M0 scales; 16 blocks of a row at a time ----------------------------

#include "avx512_bytes.h"  // kE2m1Grid11 (NVFP4 tables too), mx4/mx8_elements512_bf16_b (VBMI builds)

// E8M0 codes of 16 block amaxes (fp32 bits, none poisoned): the lane-wise e8m0_code<F>.
template <class F>
static inline __m512i e8m0_codes(ScaleRule rule, __m512i amax) {
  const __m512i zero = _mm512_setzero_si512();
  if (rule == ScaleRule::rceil) {
    const __m512 d = _mm512_div_ps(_mm512_castsi512_ps(amax), _mm512_set1_ps(F::kMax));
    const __m512i db = _mm512_castps_si512(d);
    const __m512i field = _mm512_srli_epi32(db, 23);
    const __m512i mant = _mm512_and_si512(db, simd::u32(0x007FFFFFu));
    __m512i code = _mm512_mask_add_epi32(field, _mm512_test_epi32_mask(mant, mant), field, simd::u32(1));
    const __m512i sub = _mm512_maskz_mov_epi32(_mm512_cmpgt_epu32_mask(mant, simd::u32(0x00400000u)), simd::u32(1));
    code = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(field, zero), code, sub);
    return _mm512_min_epu32(code, simd::u32(254));
  }
  __m512i r = amax;
  if (rule == ScaleRule::even)
    r = _mm512_and_si512(_mm512_add_epi32(amax, simd::u32(1u << (22 - F::kMbits))), simd::u32(0xFF800000u));
  // clamp((r >> 23) - 127 - emax, -127, 127) + 127 == clamp((r >> 23) - emax, 0, 254)
  const __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(r, 23), simd::u32(F::kEmax));
  return _mm512_min_epi32(_mm512_max_epi32(e, zero), simd::u32(254));
}

// The lane-wise e8m0_inverse: 2^(127 - code) (code 254 gives the subnormal 2^-127).
static inline __m512 e8m0_inverses(__m512i code) {
  const __m512i v = _mm512_slli_epi32(_mm512_sub_epi32(simd::u32(254), code), 23);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(v, _mm512_cmpge_epu32_mask(code, simd::u32(254)), simd::u32(0x00400000u)));
}

// The elements of 16 whole blocks of 16-bit inputs (D: bf16 or fp16) scaled by mul (lane k:
// block k's 2^-e), 32 inputs (one block) at a time, split into even and odd elements (exact
// widenings, see load_bf16_pairs); the codes interleave back lane by lane: byte pairs for FP8
// elements, nibble pairs for E2M1 (encoded by e2m1_magnitude, 7 operations instead of encode's
// 13). Branch-free: a poisoned block's codes are overwritten, so that the compiler keeps every
// constant of the encodes in registers across the loop (a branch per block made GCC rebuild
// them per block). Used for bf16 batches with a code below kMx16MinCode (the 16-bit paths take
// the rest), and as those paths' reference in tools/bench/quant_mx_16bit_probe.cpp.
template <DType D, class F, bool kAnyPoisoned>
static inline void mx_elements512_16(const uint16_t* x, __m512 mul, simd::Mask poisoned, uint8_t* out) {
  constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  for (int k = 0; k < 16; ++k) {
    const __m512 f = simd::lane(mul, k);
    __m512 even, odd;
    simd::load_pairs<D>(x + 32 * k, &even, &odd);
    even = _mm512_mul_ps(even, f);
    odd = _mm512_mul_ps(odd, f);
    __m512i w;
    if constexpr (kPacked) {
      // x * 2^-e keeps x's sign (zeros included): bits 15 and 31 of a pair to bits 3 and 7.
      const __m512i sg = _mm512_and_si512(_mm512_loadu_si512(x + 32 * k), simd::u32(0x80008000u));
      const __m512i sign = _mm512_or_si512(_mm512_srli_epi32(sg, 12), _mm512_srli_epi32(sg, 24));
      w = _mm512_ternarylogic_epi32(e2m1_magnitude(even), _mm512_slli_epi32(e2m1_magnitude(odd), 4), sign, 0xFE);
    } else {
      w = _mm512_or_si512(simd::encode<F, false>(even), _mm512_slli_epi32((simd::encode<F, false>(odd)), 8));
    }
    if constexpr (kAnyPoisoned) {
      const simd::Mask pk = static_cast<simd::Mask>(0u - ((poisoned >> k) & 1u));
      w = _mm512_mask_mov_epi32(w, pk, simd::u32(kPacked ? F::kNanCode * 0x11u : F::kNanCode * 0x101u));
    }
    if constexpr (kPacked)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * k), _mm512_cvtepi32_epi8(w));
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * k), _mm512_cvtepi32_epi16(w));
  }
}

// The fields of the 16-bit inputs the 16-bit MX paths take: bf16 (8 exponent bits, 7 mantissa
// bits, bias 127) and fp16 (5, 10, 15).
template <DType D>
struct Half16 {
  static_assert(D == DType::bf16 || D == DType::f16, "16-bit inputs");
  static constexpr int kMbits = D == DType::bf16 ? 7 : 10;
  static constexpr int kBias = D == DType::bf16 ? 127 : 15;
};

// The 16-bit MX paths' scaling: per block, 127 - code in the exponent field's position, in both
// 16-bit halves of lane k (mx16_deltas); then |x| * 2^(127 - code) of 32 inputs as bits, by
// adding it to the exponent field of every non-zero |x| (mx16_scaled). For fp16 inputs a
// block's code lies in 88..142 under every rule; a block holding a normal input (amax >= 2^-14)
// has a code of at least 98, so 127 - code is -15..29 and its shifted delta fits a signed 16-bit
// lane, and the sum of a normal input stays below the Inf field (|x| * 2^(127 - code) < 2^(emax
// + 1)). Below 98 the delta wraps, but such a block holds only zeros (left alone) and
// subnormals (the fp32 path).
template <DType D>
static inline __m512i mx16_deltas(__m512i code) {
  const __m512i delta =
      _mm512_and_si512(_mm512_slli_epi32(_mm512_sub_epi32(simd::u32(127), code), Half16<D>::kMbits), simd::u32(0xFFFF));
  return _mm512_or_si512(delta, _mm512_slli_epi32(delta, 16));
}
static inline __m512i mx16_scaled(__m512i v, __m512i deltas, int k) {
  const __m512i u = _mm512_and_si512(v, simd::u32(0x7FFF7FFFu));
  const __m512i dk = _mm512_permutexvar_epi32(_mm512_set1_epi32(k), deltas);
  return _mm512_mask_add_epi16(u, _mm512_test_epi16_mask(u, u), u, dk);
}

// fp16 subnormal inputs among 32 (their "exponent field" is no power of two: the addition above
// would make one up); none for bf16, whose 16-bit paths run only for codes that send its
// subnormals to 0.
template <DType D>
static inline __mmask32 mx16_subnormal_inputs(__m512i v) {
  if constexpr (D == DType::bf16) return 0;
  const __m512i u = _mm512_and_si512(v, simd::u32(0x7FFF7FFFu));
  return _mm512_test_epi16_mask(u, u) & _mm512_cmplt_epu16_mask(u, _mm512_set1_epi16(0x400));
}

// MXFP4 elements of 16 whole blocks of 16-bit inputs (bf16 or fp16) on 16-bit lanes, 32 inputs
// per instruction instead of 16. It gives mx_elements512_16's bytes exactly (every non-NaN,
// non-Inf input whose scaled magnitude is below 2^(emax + 1) = 8, as every input of a block is
// under every scale rule; for bf16 every code 3..254, for fp16 every code a block can have:
// tools/bench/quant_mx_16bit_probe.cpp):
// - |x| * 2^(127 - code) is an exact power-of-two scaling, so it is an addition to the
//   exponent field; a result below the normal range (a negative or small field) stands for a
//   magnitude below 2^-14 (fp16) or 2^(1 - code) <= 0.25 (bf16, code >= 3, where a subnormal
//   input's made-up exponent lands there too), which encodes to 0 either way (the compares
//   below are signed, so an underflowed field reads as below 0.25); zeros are left alone. A
//   vector holding an fp16 subnormal input is encoded by the fp32 path instead.
// - From 1.0 up: the integer RNE onto one mantissa bit (E2M1 bias 1), saturated at code 7 (6.0).
// - Below 1.0: 0.5 (code 1) above 0.25, 1.0 (code 2) from 0.75, ties to even.
// Poisoned blocks get zero bytes (E2M1 has no NaN: the contract's +0), like the fp32 path.
template <DType D>
static inline void mx4_elements512_h(const uint16_t* x, __m512i code, __m512 mul, simd::Mask poisoned, uint8_t* out) {
  constexpr int kM = Half16<D>::kMbits, kB = Half16<D>::kBias, kShift = kM - 1;
  constexpr int kQuarter = (kB - 2) << kM, kThreeQuarters = ((kB - 1) << kM) | (1 << (kM - 1)), kOne = kB << kM;
  const __m512i d16 = mx16_deltas<D>(code);
  const __m512i one = _mm512_set1_epi16(1);
  const __m512i bias = _mm512_set1_epi16(static_cast<short>(((1 << (kShift - 1)) - 1) - ((kB - 1) << kM)));
  for (int k = 0; k < 16; ++k) {
    const __m512i v = _mm512_loadu_si512(x + 32 * k);
    const __m512i r = mx16_scaled(v, d16, k);
    __m512i cn = _mm512_add_epi16(_mm512_add_epi16(r, bias), _mm512_and_si512(_mm512_srli_epi16(r, kShift), one));
    cn = _mm512_min_epu16(_mm512_srli_epi16(cn, kShift), _mm512_set1_epi16(7));
    const __mmask32 half = _mm512_cmpgt_epi16_mask(r, _mm512_set1_epi16(kQuarter));             // > 0.25
    const __mmask32 whole = _mm512_cmpge_epi16_mask(r, _mm512_set1_epi16(kThreeQuarters));      // >= 0.75
    const __m512i cs = _mm512_maskz_mov_epi16(half, one);
    __m512i c = _mm512_mask_add_epi16(cs, whole, cs, one);
    c = _mm512_mask_mov_epi16(c, _mm512_cmpge_epi16_mask(r, _mm512_set1_epi16(kOne)), cn);
    c = _mm512_ternarylogic_epi32(c, _mm512_srli_epi16(v, 12), _mm512_set1_epi16(8), 0xF8);  // sign to bit 3
    if (__builtin_expect(mx16_subnormal_inputs<D>(v) != 0, 0)) {
      __m512 even, odd;
      simd::load_pairs<D>(x + 32 * k, &even, &odd);
      const __m512 f = simd::lane(mul, k);
      c = _mm512_or_si512(e2m1_code(_mm512_mul_ps(even, f)), _mm512_slli_epi32(e2m1_code(_mm512_mul_ps(odd, f)), 16));
    }
    c = _mm512_maskz_mov_epi32(static_cast<simd::Mask>(~(0u - ((poisoned >> k) & 1u))), c);
    // 16-bit codes (element 2i low) to nibble pairs: the high half's code to bits 4-7.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * k), _mm512_cvtepi32_epi8(_mm512_or_si512(c, _mm512_srli_epi32(c, 12))));
  }
}

// The smallest E8M0 code for which the 16-bit paths are exact on bf16 inputs: 2 - emin + M (3
// for E2M1, 11 for E4M3, 18 for E5M2). Below it a bf16 subnormal input, whose exponent field
// the 16-bit path would make up, could scale to a non-zero code. (fp16 subnormals go to the
// fp32 path vector by vector instead: mx16_subnormal_inputs.)
template <class F>
constexpr uint32_t kMx16MinCode = static_cast<uint32_t>(2 + (F::kBias - 1) + F::kMbits);

// MXFP8 (E4M3, E5M2) elements of 16 whole blocks of 16-bit inputs on 16-bit lanes (for bf16,
// codes of at least kMx16MinCode<F>): the same bytes as mx_elements512_16 (every non-NaN,
// non-Inf input a block can hold, every code: tools/bench/quant_mx_16bit_probe.cpp). |x| *
// 2^(127 - code) is an addition to the exponent field (see mx4_elements512_h for why an
// underflowed field is harmless); normal targets round on the integer bits (encode's integer
// path on 16 bits); magnitudes up to half the smallest subnormal step encode to 0. A vector
// holding a magnitude between that and the smallest normal (a subnormal target: |x| within about
// 2^-18..2^-14 of the block amax, rare; for fp16 and E5M2 every scaled magnitude below 2^-14,
// which fp16 cannot hold as a normal) or an fp16 subnormal input is encoded by the fp32 path.
template <DType D, class F>
static inline void mx8_elements512_h(const uint16_t* x, __m512i code, __m512 mul, simd::Mask poisoned, uint8_t* out) {
  constexpr int kM = Half16<D>::kMbits, kB = Half16<D>::kBias;
  constexpr int kShift = kM - F::kMbits, kEmin = 1 - F::kBias;
  constexpr int kMinNormal = (kB + kEmin) << kM;
  // The largest magnitude that encodes to 0; below the normal range of the input type (fp16 and
  // E5M2), the largest underflowed field instead: every scaled magnitude under 2^-14 then counts
  // as a subnormal target.
  constexpr int kZeroMax = kB + kEmin - F::kMbits - 1 > 0 ? (kB + kEmin - F::kMbits - 1) << kM : -(32 << kM);
  constexpr int kRound = ((1 << (kShift - 1)) - 1) - ((kB - F::kBias) << kM);
  static_assert(kMinNormal > 0 && kMinNormal < 0x8000, "the smallest normal target is a positive 16-bit field");
  const __m512i d16 = mx16_deltas<D>(code);
  const __m512i one = _mm512_set1_epi16(1);
  for (int k = 0; k < 16; ++k) {
    const __m512i v = _mm512_loadu_si512(x + 32 * k);
    const __m512i r = mx16_scaled(v, d16, k);
    __m512i c = _mm512_add_epi16(_mm512_add_epi16(r, _mm512_set1_epi16(static_cast<short>(kRound))), _mm512_and_si512(_mm512_srli_epi16(r, kShift), one));
    c = _mm512_min_epu16(_mm512_srli_epi16(c, kShift), _mm512_set1_epi16(static_cast<short>(F::kMaxCode)));
    c = _mm512_maskz_mov_epi16(_mm512_cmpge_epi16_mask(r, _mm512_set1_epi16(static_cast<short>(kMinNormal))), c);
    c = _mm512_ternarylogic_epi32(c, _mm512_srli_epi16(v, 8), _mm512_set1_epi16(0x80), 0xF8);  // sign to bit 7
    __mmask32 sub = _mm512_cmpgt_epi16_mask(r, _mm512_set1_epi16(static_cast<short>(kZeroMax))) &
                    _mm512_cmplt_epi16_mask(r, _mm512_set1_epi16(static_cast<short>(kMinNormal)));
    if constexpr (D == DType::f16) {
      const __m512i u = _mm512_and_si512(v, simd::u32(0x7FFF7FFFu));
      sub = (sub & _mm512_test_epi16_mask(u, u)) | mx16_subnormal_inputs<D>(v);
    }
    if (__builtin_expect(sub != 0, 0)) {
      __m512 even, odd;
      simd::load_pairs<D>(x + 32 * k, &even, &odd);
      const __m512 f = simd::lane(mul, k);
      c = _mm512_or_si512(simd::encode<F, false>(_mm512_mul_ps(even, f)), _mm512_slli_epi32((simd::encode<F, false>(_mm512_mul_ps(odd, f))), 16));
    }
    c = _mm512_mask_mov_epi32(c, static_cast<simd::Mask>(0u - ((poisoned >> k) & 1u)), simd::u32(F::kNanCode * 0x10001u));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * k), _mm512_cvtepi16_epi8(c));  // 16-bit codes to bytes
  }
}

// 16 whole blocks (512 contiguous inputs): the masked loop below without masks or branches.
template <DType D, class F>
static inline void mx_batch512(const typename In<D>::T* x, ScaleRule rule, uint8_t* scales, uint8_t* out) {
  constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  const char* ahead = reinterpret_cast<const char*>(x) + simd::kPrefetchAhead;
  for (int64_t b = 0; b < 512 * static_cast<int64_t>(sizeof(*x)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
  __m512i amax;
  if constexpr (D == DType::f32) {
    __m512i m[16];
    for (int k = 0; k < 16; ++k)
      m[k] = _mm512_max_epu32(simd::abs_bits(_mm512_loadu_ps(x + 32 * k)), simd::abs_bits(_mm512_loadu_ps(x + 32 * k + 16)));
    amax = simd::reduce16(m);
  } else {
    // A block is one vector of 32 halves (76 operations for the 16 amaxes, see amax16).
    __m512i m[16];
    for (int k = 0; k < 16; ++k) m[k] = _mm512_and_si512(_mm512_loadu_si512(x + 32 * k), _mm512_set1_epi16(0x7FFF));
    amax = amax16<D>(m);
  }
  const simd::Mask poisoned = _mm512_cmpge_epu32_mask(amax, simd::u32(kF32InfBits));
  const __m512i code = _mm512_mask_mov_epi32(e8m0_codes<F>(rule, amax), poisoned, simd::u32(kE8M0Nan));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(scales), _mm512_cvtepi32_epi8(code));
  const __m512 mul = e8m0_inverses(code);
  if constexpr (D == DType::bf16) {
    if (_mm512_cmplt_epu32_mask(code, simd::u32(kMx16MinCode<F>)) == 0) {  // 16-bit lanes
      if constexpr (kPacked) {
        if (kMxBytes && poisoned == 0 && _mm512_cmplt_epu32_mask(code, simd::u32(kMx4BytesMinCode)) == 0)
          mx4_elements512_bf16_b(x, code, out);  // byte lanes (VBMI)
        else
          mx4_elements512_h<D>(x, code, mul, poisoned, out);
      } else {
        if (kMxBytes && poisoned == 0)
          mx8_elements512_bf16_b<F>(x, code, mul, out);  // byte lanes (VBMI)
        else
          mx8_elements512_h<D, F>(x, code, mul, poisoned, out);
      }
      return;
    }
    if (poisoned == 0)
      mx_elements512_16<D, F, false>(x, mul, 0, out);
    else
      mx_elements512_16<D, F, true>(x, mul, poisoned, out);
    return;
  }
  if constexpr (D == DType::f16) {  // 16-bit lanes for every code (subnormal inputs: fp32 path)
    if constexpr (kPacked)
      mx4_elements512_h<D>(x, code, mul, poisoned, out);
    else
      mx8_elements512_h<D, F>(x, code, mul, poisoned, out);
    return;
  }
  for (int k = 0; k < 16; ++k) {
    __m512i c0 = simd::u32(F::kNanCode), c1 = c0;
    if (!((poisoned >> k) & 1)) {
      const __m512 f = simd::lane(mul, k);
      c0 = simd::encode<F, false>(_mm512_mul_ps(simd::load<D>(x + 32 * k, 0xFFFF), f));
      c1 = simd::encode<F, false>(_mm512_mul_ps(simd::load<D>(x + 32 * k + 16, 0xFFFF), f));
    }
    if constexpr (kPacked) {
      simd::store_nibbles16(out + 16 * k, c0);
      simd::store_nibbles16(out + 16 * k + 8, c1);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * k), _mm512_cvtepi32_epi8(c0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * k + 16), _mm512_cvtepi32_epi8(c1));
    }
  }
}

template <DType D, class F>
static void mx_rows_v(const MxArgs& a, int64_t r0, int64_t r1) {
  constexpr int64_t kBlock = 32;
  constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  const auto* xs = static_cast<const typename In<D>::T*>(a.x);
  const int64_t C = a.cols, nblk = (C + kBlock - 1) / kBlock;
  const int64_t out_stride = kPacked ? (C + 1) / 2 : C;
  const __m512i nan_codes = simd::u32(F::kNanCode);
  __m512i m[16];
  alignas(64) float mul[16];
  for (int64_t r = r0; r < r1; ++r) {
    const auto* x = xs + r * C;
    uint8_t* out = a.out + r * out_stride;
    uint8_t* scales = a.scales + r * nblk;
    int64_t b0 = 0;
    for (; (b0 + 16) * kBlock <= C; b0 += 16)
      mx_batch512<D, F>(x + b0 * kBlock, a.rule, scales + b0, out + (kPacked ? b0 * 16 : b0 * kBlock));
    for (; b0 < nblk; b0 += 16) {
      const int64_t nb = lo(16, nblk - b0);
      for (int64_t k = 0; k < 16; ++k) m[k] = _mm512_setzero_si512();
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t j = (b0 + k) * kBlock, n = lo(kBlock, C - j);
        m[k] = simd::amax_lanes<D>(simd::acc_abs<D>(x + j, n, _mm512_setzero_si512()));
      }
      const __m512i amax = simd::reduce16(m);
      const simd::Mask poisoned = _mm512_cmpge_epu32_mask(amax, simd::u32(kF32InfBits));
      const __m512i code = _mm512_mask_mov_epi32(e8m0_codes<F>(a.rule, amax), poisoned, simd::u32(kE8M0Nan));
      simd::store_bytes(scales + b0, code, simd::tail_mask(nb));
      _mm512_store_ps(mul, e8m0_inverses(code));
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t j = (b0 + k) * kBlock, n = lo(kBlock, C - j), n1 = n > 16 ? n - 16 : 0;
        const simd::Mask m0 = simd::tail_mask(n), m1 = simd::tail_mask(n1);
        __m512i c0 = nan_codes, c1 = nan_codes;
        if (!((poisoned >> k) & 1)) {
          const __m512 f = _mm512_set1_ps(mul[k]);
          c0 = simd::encode<F, false>(_mm512_mul_ps(simd::load<D>(x + j, m0), f));
          c1 = simd::encode<F, false>(_mm512_mul_ps(simd::load<D>(x + j + 16, m1), f));
        }
        if constexpr (kPacked) {
          simd::store_nibbles(out + j / 2, c0, n);
          if (n1 > 0) simd::store_nibbles(out + j / 2 + 8, c1, n1);
        } else {
          simd::store_bytes(out + j, c0, m0);
          if (n1 > 0) simd::store_bytes(out + j + 16, c1, m1);
        }
      }
    }
  }
}
