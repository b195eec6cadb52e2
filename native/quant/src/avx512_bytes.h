// Byte-lane kernels for bf16 inputs, 64 inputs per instruction, one byte a lane: MXFP4 and MXFP8
// elements (mx4_elements512_bf16_b, mx8_elements512_bf16_b) and the E2M1 grid they share with
// the NVFP4 mantissa tables (avx512_nvfp4_tables.h). Need AVX512-VBMI (vpermi2b, vpermb);
// included by avx512_mx.h inside namespace miles_quant::cpu::MQ_CPU_NS, before the MX
// kernels. Without VBMI, kMxBytes is false and the 16-bit paths (mx4/mx8_elements512_h) run
// instead. Every routine gathers the low bytes (exponent bit 0 and the 7 mantissa bits m) and the
// high bytes (sign, exponent bits 7..1) of 64 inputs with two vpermt2b, then works on the
// exponent field e = 2 * (high & 0x7F) + (low >> 7) and on m.
//
// The grid. E2M1's values (0, 0.5, 1, 1.5, 2, 3, 4, 6) round a magnitude p * 2^b (p in [1, 2)),
// ties to even, by b and by which of five classes p falls in: {1}, (1, 1.25], (1.25, 1.5),
// [1.5, 1.75), [1.75, 2); b <= -3 gives 0 and b >= 3 saturates to 6.0. kE2m1Grid lists the
// codes at 8 * (b + 3) + class. The byte loops index it by w + 11 * class with w = b + 5 clamped
// to [0, 8] (a byte w loses nothing: every b <= -3 is 0 and every b >= 3 is 7): kE2m1Grid11.
//
// MX scaling. A block's E8M0 code `code` scales by the power of two 2^(127 - code), so a normal
// bf16 x = (1 + m/128) * 2^(e - 127) scales to (1 + m/128) * 2^(e - code) exactly.
//
// MXFP4 (why mx4_elements512_bf16_b gives mx_elements512_16's bytes): p = 1 + m/128 (its class
// depends on m alone: 0 | 1..32 | 33..63 | 64..95 | 96..127, one static 128-byte table kMx4Class
// holds 11 * class) and b = e - code. So w = min(e -sat (code - 5), 8), one saturating byte
// subtraction and one vpminub, for every code >= 5 (kMx4BytesMinCode): then a zero or subnormal x
// (e = 0) gets w = 0, a code 0, and its scaled magnitude is below 2^(1 - code) <= 2^-4, which
// encodes to 0 as well. The sign is x's (zeros included), as the fp32 path's.
//
// MXFP8 (E4M3, E5M2 with M mantissa bits and bias B; mx8_elements512_bf16_b): the target's
// exponent field is E = e - code + B, so u = e -sat (code - B) is E where E >= 1 (a normal
// target) and 0 elsewhere. A normal target's code is (u << M) + R[m], R[m] = m rounded to M bits
// to nearest even (0..2^M: a carry into the exponent is the addition's), then saturated at the
// largest finite code, as encode's integer path. Where u = 0, a target with E in [-M, 0] is
// subnormal and may be non-zero (e + M + 1 > code - B picks them); such a 64-input step is
// encoded again by the fp32 path (rare: |x| within about 2^-18..2^-14 of the block amax). Below
// that every magnitude is at most half the smallest subnormal step: code 0. Needs code >= B + M
// + 1 (kMx16MinCode, as the 16-bit path), so that a zero or subnormal x (e = 0) is never picked.
//
// Poisoned blocks are not handled here (the caller takes the 16-bit path for a batch that holds
// one). tools/bench/quant_mx_16bit_probe.cpp checks both byte routines against the fp32 path for
// every non-NaN, non-Inf bf16 input a block can hold and every code they take
// (tests/test_quant_mx_16bit.py).
#pragma once

// codes[8 * (b + 3) + class]: the E2M1 code of p * 2^b, p in class 0..4 (above); 64 bytes.
alignas(64) static constexpr uint8_t kE2m1Grid[64] = {
    0, 0, 0, 0, 0, 0, 0, 0,  // b = -3: [0.125, 0.25)
    0, 1, 1, 1, 1, 0, 0, 0,  // b = -2: 0.25 ties to 0, above it 0.5
    1, 1, 1, 2, 2, 0, 0, 0,  // b = -1: 0.75 ties to 1.0
    2, 2, 3, 3, 4, 0, 0, 0,  // b = 0: 1.25 ties to 1.0, 1.75 to 2.0
    4, 4, 5, 5, 6, 0, 0, 0,  // b = 1: 2.5 ties to 2, 3.5 to 4
    6, 6, 7, 7, 7, 0, 0, 0,  // b = 2: 5 ties to 4, above it 6
    7, 7, 7, 7, 7, 7, 7, 7,  // b = 3 (and above, by the clamp): saturated
    7, 7, 7, 7, 7, 7, 7, 7,
};

// kE2m1Grid at 8 * (w - 2) + class (clamped to [0, 63]), stored at w + 11 * class: w in 0..8,
// class in 0..4 (at most index 52).
struct E2m1Grid11 {
  uint8_t g[64];
};
static constexpr E2m1Grid11 e2m1_grid11() {
  E2m1Grid11 r{};
  for (int w = 0; w <= 10; ++w) {
    for (int cls = 0; cls <= 4; ++cls) {
      const int i = 8 * (w - 2) + cls;
      r.g[w + 11 * cls] = kE2m1Grid[i < 0 ? 0 : i > 63 ? 63 : i];
    }
  }
  return r;
}
alignas(64) static constexpr E2m1Grid11 kE2m1Grid11 = e2m1_grid11();

// [m] = 11 * class of p = 1 + m/128 (above), m the 7 mantissa bits of a bf16.
struct Mx4Class {
  uint8_t t[128];
};
static constexpr Mx4Class mx4_class() {
  Mx4Class r{};
  for (int m = 0; m < 128; ++m) r.t[m] = static_cast<uint8_t>(11 * (m == 0 ? 0 : m <= 32 ? 1 : m < 64 ? 2 : m < 96 ? 3 : 4));
  return r;
}
alignas(64) static constexpr Mx4Class kMx4Class = mx4_class();

// The smallest E8M0 code the MXFP4 byte path takes (above).
constexpr uint32_t kMx4BytesMinCode = 5;

// [m] = RNE(m / 2^(7 - M)), m the 7 mantissa bits of a bf16, for M = F::kMbits (0..2^M).
template <class F>
struct MxRound {
  uint8_t t[128];
};
template <class F>
static constexpr MxRound<F> mx_round() {
  MxRound<F> r{};
  constexpr int kShift = 7 - F::kMbits;
  for (int m = 0; m < 128; ++m) r.t[m] = static_cast<uint8_t>((m + (1 << (kShift - 1)) - 1 + ((m >> kShift) & 1)) >> kShift);
  return r;
}
template <class F>
alignas(64) static constexpr MxRound<F> kMxRound = mx_round<F>();

// The one-byte step table of the fp16 NVFP4 and INT4 paths (avx512_nvfp4_tables16.h,
// avx512_int4_tables16.h): for 16 consecutive values v of a step function that rises by one at
// T (16: no rise), 16 * v[0] + (16 - T) mod 16, so that (byte + i) >> 4 = v[i] for i in 0..15
// (the carry out of the low four bits is the rise). False when v does not have that shape or
// v[0] exceeds vmax (at most 14, so that the byte fits).
static inline bool step_table_byte(const uint32_t* v, uint32_t vmax, uint8_t* out) {
  uint32_t t = 16;
  bool ok = v[0] <= vmax && vmax <= 14;
  for (uint32_t i = 1; i < 16; ++i) {
    if (t == 16 && v[i] != v[0]) t = i;
    ok = ok && v[i] == (i >= t ? v[0] + 1 : v[0]);
  }
  *out = static_cast<uint8_t>(16 * v[0] + ((16 - t) & 15));
  return ok;
}

#if defined(__AVX512VBMI__)
constexpr bool kMxBytes = true;

// MXFP4 elements of 16 whole bf16 blocks (512 inputs) of E8M0 codes `code` (lane k: block k's,
// every one >= kMx4BytesMinCode, none poisoned), packed: the bytes of mx_elements512_16.
static inline void mx4_elements512_bf16_b(const uint16_t* x, __m512i code, uint8_t* out) {
  const __m512i grid = _mm512_load_si512(kE2m1Grid11.g);
  const __m512i cls0 = _mm512_load_si512(kMx4Class.t), cls1 = _mm512_load_si512(kMx4Class.t + 64);
  const __m512i one = _mm512_set1_epi8(1), eight = _mm512_set1_epi8(8);
  const __m512i nibbles = _mm512_set1_epi16(0x1001);  // element 2i * 1 + element 2i + 1 * 16
  // Byte k: block k's code - 5 (bytes 0-15).
  const __m512i kk = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(_mm512_sub_epi32(code, _mm512_set1_epi32(5))));
  // Lanes 0-31 of a step take block 2g's byte, lanes 32-63 block 2g + 1's.
  __m512i pair = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, _mm512_setzero_si512(), one);
  const __m512i two = _mm512_set1_epi8(2);
  for (int g = 0; g < 8; ++g) {
    const simd::Bf16Bytes b = simd::bf16_bytes(x + 64 * g);
    const __m512i cls = _mm512_permutex2var_epi8(cls0, b.lo, cls1);  // 11 * class of the low 7 bits
    const __m512i c = _mm512_permutexvar_epi8(pair, kk);
    pair = _mm512_add_epi8(pair, two);
    const __m512i w = _mm512_min_epu8(_mm512_subs_epu8(b.e, c), eight);
    __m512i q = _mm512_permutexvar_epi8(_mm512_add_epi8(w, cls), grid);
    q = _mm512_ternarylogic_epi32(q, _mm512_srli_epi16(b.hi, 4), eight, 0xF8);  // sign (bit 7) to bit 3
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * g), _mm512_cvtepi16_epi8(_mm512_maddubs_epi16(q, nibbles)));
  }
}

// MXFP8 elements (F = E4M3 or E5M2) of 16 whole bf16 blocks (512 inputs) of E8M0 codes `code`
// (lane k: block k's, every one >= kMx16MinCode<F>, none poisoned) and their inverses `mul`
// (e8m0_inverses): the bytes of mx_elements512_16.
template <class F>
static inline void mx8_elements512_bf16_b(const uint16_t* x, __m512i code, __m512 mul, uint8_t* out) {
  constexpr int kM = F::kMbits;
  const __m512i r0 = _mm512_load_si512(kMxRound<F>.t), r1 = _mm512_load_si512(kMxRound<F>.t + 64);
  const __m512i one = _mm512_set1_epi8(1), sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i near = _mm512_set1_epi8(kM + 1), max_code = _mm512_set1_epi8(static_cast<char>(F::kMaxCode));
  // Byte k: block k's code - B (bytes 0-15).
  const __m512i kk = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(_mm512_sub_epi32(code, _mm512_set1_epi32(F::kBias))));
  __m512i pair = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, _mm512_setzero_si512(), one);
  const __m512i two = _mm512_set1_epi8(2);
  for (int g = 0; g < 8; ++g) {
    const simd::Bf16Bytes b = simd::bf16_bytes(x + 64 * g);
    const __m512i c = _mm512_permutexvar_epi8(pair, kk);
    pair = _mm512_add_epi8(pair, two);
    const __m512i u = _mm512_subs_epu8(b.e, c);
    const __mmask64 normal = _mm512_test_epi8_mask(u, u);
    const __m512i near_sub = _mm512_subs_epu8(_mm512_adds_epu8(b.e, near), c);
    if (__builtin_expect(_mm512_mask_test_epi8_mask(~normal, near_sub, near_sub) != 0, 0)) {
      // A subnormal target: these two blocks through the fp32 path.
      for (int h = 0; h < 2; ++h) {
        __m512 even, odd;
        simd::load_bf16_pairs(x + 64 * g + 32 * h, &even, &odd);
        const __m512 f = simd::lane(mul, 2 * g + h);
        const __m512i w = _mm512_or_si512(simd::encode<F, false>(_mm512_mul_ps(even, f)), _mm512_slli_epi32((simd::encode<F, false>(_mm512_mul_ps(odd, f))), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * g + 32 * h), _mm512_cvtepi16_epi8(w));
      }
      continue;
    }
    __m512i q = _mm512_add_epi8(_mm512_slli_epi16(u, kM), _mm512_permutex2var_epi8(r0, b.lo, r1));
    q = _mm512_maskz_mov_epi8(normal, _mm512_min_epu8(q, max_code));
    q = _mm512_ternarylogic_epi32(q, b.hi, sign, 0xF8);  // x's sign to bit 7
    _mm512_storeu_si512(out + 64 * g, q);
  }
}
#else
constexpr bool kMxBytes = false;
static inline void mx4_elements512_bf16_b(const uint16_t*, __m512i, uint8_t*) {}
template <class F>
static inline void mx8_elements512_bf16_b(const uint16_t*, __m512i, __m512, uint8_t*) {}
#endif
