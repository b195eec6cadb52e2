// AVX2 quantization: the contract's per-group arithmetic (contract.h) on 8 fp32 lanes, for hosts
// without AVX-512 (AMD Zen 2 / Zen 3, Intel before Skylake-SP), where the scalar code of
// cpu_kernels.h ran at 0.08-0.35 of a one-thread memcpy.
//
// Included by cpu_isa_avx2.cpp (after immintrin.h and cpu_kernels.h) inside namespace
// miles_quant::cpu::avx2. Every lane-wise step is the twin of a scalar step of the contract, as in
// the AVX-512 kernels (avx512_kernels.h says why each is exact):
// - inputs widen to fp32 exactly: bf16 by a shift, fp16 by vcvtph2ps (F16C, which every AVX2
//   CPU has; the leaf is chosen only where both are there);
// - element encoding is simd::encode of avx512_simd.h (integer RNE for normal targets, one exact
//   fp32 addition for subnormal ones) and E2M1 is e2m1_magnitude of avx512_mx.h (one fp32
//   addition onto the grid, its two 8-entry tables indexed by the exponent's low 3 bits);
// - scales are computed for 8 groups at a time with single IEEE fp32 operations (vdivps,
//   vmulps, vmaxps / vminps as the contract's clamps on values that are not NaN; no FMA, no
//   reciprocal estimate); INT4 scales are stored by the scalar store_scale;
// - inputs are read 16 at a time as pairs (a lane holds elements 2i and 2i + 1), so that the
//   codes pack back lane by lane, element 2i in the low byte or nibble (pairs16).
// A tile row goes a chunk of groups at a time through three phases: amaxes, scales, codes
// (the comment at kChunkBytes says why).
// Groups whose amax is Inf or NaN (poisoned) are written with the contract's fill. Tails (a
// partial group, rows not a multiple of 16) are read from a zero-padded copy: a zero encodes to
// the pad code of every packed format (E2M1 0, INT4 8), and only the row's own bytes are written.
// test_isa.py and test_dequantize.py compare this build with the AVX-512 kernels and the PyTorch
// reference bit for bit on every bf16 and fp16 pattern.
#pragma once

namespace q2 {

// The vector steps below are small and called per 16 inputs from inside loops: forced inline, so
// that their constants stay in registers (GCC left the FP8 codes an out-of-line call per 16
// inputs, which cost 25% of the time).
#define MQ2_INLINE static inline __attribute__((always_inline))

using V = __m256;
using I = __m256i;

MQ2_INLINE I u32(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
MQ2_INLINE V f32(float v) { return _mm256_set1_ps(v); }
MQ2_INLINE I bits(V v) { return _mm256_castps_si256(v); }
MQ2_INLINE V as_f(I v) { return _mm256_castsi256_ps(v); }

// Bytes of input a prefetch requests ahead of the current position (see simd::kPrefetchAhead).
constexpr int64_t kAhead = 4096;

// 16 inputs as pairs: lane i of *even holds element 2i of pair i, *odd element 2i + 1, widened
// exactly. bf16 lanes hold pairs 0-7 in order. fp16 (widened by vcvtph2ps) and fp32 are split
// by vshufps from two vectors of 8, which leaves the pairs in lanes 0, 1, 4, 5 | 2, 3, 6, 7
// (kSwizzled): the packing puts them back in order for free (store16, store32), where fixing
// the lanes here took two more shuffles on the one shuffle port of an Intel core.
// vcvtph2ps is exact for every finite and infinite fp16, subnormals included (DAZ is clear on
// our threads); it quiets a signalling NaN, which only a poisoned group holds, and such a
// group's codes are never computed from its elements.
template <DType D>
constexpr bool kSwizzled = D != DType::bf16;

template <DType D>
MQ2_INLINE void pairs16(const typename In<D>::T* p, V* even, V* odd) {
  if constexpr (D == DType::bf16) {
    const I v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    *even = as_f(_mm256_slli_epi32(v, 16));
    *odd = as_f(_mm256_and_si256(v, u32(0xFFFF0000u)));
  } else {
    V a, b;
    if constexpr (D == DType::f32) {
      a = _mm256_loadu_ps(p);
      b = _mm256_loadu_ps(p + 8);
    } else {
      a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    }
    *even = _mm256_shuffle_ps(a, b, 0x88);  // elements 0, 2, 8, 10 | 4, 6, 12, 14
    *odd = _mm256_shuffle_ps(a, b, 0xDD);
  }
}

// pairs16 as magnitudes and signs: *even and *odd hold |x|, *sign element 2i's sign at bit 15
// and element 2i + 1's at bit 31 of lane i (the 16-bit inputs' own places; all else 0). The FP8
// and E2M1 codes encode |x| * factor or |x| / s and take the sign from here, once per pair
// (x / s and x * factor keep x's sign, zeros included: s and factor are positive).
template <DType D>
MQ2_INLINE void mag_pairs16(const typename In<D>::T* p, V* even, V* odd, I* sign) {
  if constexpr (D == DType::bf16) {
    const I v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    *sign = _mm256_and_si256(v, u32(0x80008000u));
    *even = as_f(_mm256_slli_epi32(_mm256_and_si256(v, u32(0x7FFFu)), 16));
    *odd = as_f(_mm256_and_si256(v, u32(0x7FFF0000u)));
  } else {
    V e, o;
    pairs16<D>(p, &e, &o);
    *sign = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(bits(e), 16), u32(0x8000u)),
                            _mm256_and_si256(bits(o), u32(0x80000000u)));
    *even = _mm256_and_ps(e, as_f(u32(kF32AbsMask)));
    *odd = _mm256_and_ps(o, as_f(u32(kF32AbsMask)));
  }
}

// ---- element codes ----------------------------------------------------------------------------

// The magnitude code of encode<F> for |f| bits u (sign clear), no NaN lane: simd::encode of
// avx512_simd.h without its sign and NaN steps.
template <class F>
MQ2_INLINE I encode_mag8(I u) {
  constexpr int kShift = 23 - F::kMbits, kEmin = 1 - F::kBias;
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + kEmin) << 23;
  constexpr uint32_t kMagicBits = static_cast<uint32_t>(127 + kEmin - F::kMbits + 23) << 23;
  constexpr uint32_t kRebias = static_cast<uint32_t>(127 - F::kBias) << 23;
  I cn = _mm256_add_epi32(u, u32(((1u << (kShift - 1)) - 1u) - kRebias));
  cn = _mm256_add_epi32(cn, _mm256_and_si256(_mm256_srli_epi32(u, kShift), u32(1)));
  cn = _mm256_srli_epi32(cn, kShift);
  const I cs = _mm256_sub_epi32(bits(_mm256_add_ps(as_f(u), as_f(u32(kMagicBits)))), u32(kMagicBits));
  const I normal = _mm256_cmpgt_epi32(u, u32(kMinNormalBits - 1));  // u < 2^31: signed compare
  return _mm256_min_epu32(_mm256_blendv_epi8(cs, cn, normal), u32(F::kMaxCode));
}

// encode<F> of 8 lanes (simd::encode of avx512_simd.h); kMayBeNan = false where no lane is NaN.
template <class F, bool kMayBeNan>
MQ2_INLINE I encode8(V f) {
  constexpr int kSignPos = F::kEbits + F::kMbits;
  const I b = bits(f);
  const I u = _mm256_and_si256(b, u32(kF32AbsMask));
  I c = encode_mag8<F>(u);
  I sign = _mm256_and_si256(_mm256_srli_epi32(b, 31 - kSignPos), u32(1u << kSignPos));
  if constexpr (kMayBeNan) {
    const I nan = _mm256_cmpgt_epi32(u, u32(kF32InfBits));
    if constexpr (F::kNanCode != 0) {
      c = _mm256_blendv_epi8(c, u32(F::kNanCode), nan);  // NaN keeps its sign: sign | 0x7F
    } else {
      c = _mm256_andnot_si256(nan, c);  // E2M1: NaN is +0
      sign = _mm256_andnot_si256(nan, sign);
    }
  }
  return _mm256_or_si256(c, sign);
}

// The E2M1 code of |v| (r = |v|, not NaN): e2m1_magnitude of avx512_mx.h. The exponent field of
// the clamped r is 123..129, whose low 3 bits (3..7, 0, 1) index the tables, as vpermd reads.
MQ2_INLINE I e2m1_mag8(V r) {
  constexpr int kM0 = 149 << 23, kM1 = 150 << 23, kM2 = 151 << 23;  // 2^22, 2^23, 2^24
  const I mtab = _mm256_setr_epi32(kM1, kM2, 0, kM0, kM0, kM0, kM0, kM0);
  const I ktab = _mm256_setr_epi32(kM1 - 2, kM2 - 4, 0, kM0, kM0, kM0, kM0, kM0);
  r = _mm256_min_ps(_mm256_max_ps(r, f32(0.0625f)), f32(E2M1::kMax));
  const I e = _mm256_srli_epi32(bits(r), 23);
  const I m = bits(_mm256_add_ps(r, as_f(_mm256_permutevar8x32_epi32(mtab, e))));
  return _mm256_sub_epi32(m, _mm256_permutevar8x32_epi32(ktab, e));
}

// The E2M1 code of v (not NaN) with its sign: e2m1_code of avx512_mx.h.
MQ2_INLINE I e2m1_code8(V v) {
  const I mag = e2m1_mag8(_mm256_and_ps(v, as_f(u32(kF32AbsMask))));
  return _mm256_or_si256(mag, _mm256_and_si256(_mm256_srli_epi32(bits(v), 28), u32(8)));
}

// INT4 offset-binary codes against the stored scale s: int4_codes of avx512_int4.h (vcvtps2dq is
// RNE under the round-to-nearest our threads select).
MQ2_INLINE I int4_code8(V v, V s) {
  const V y = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v, s), f32(-7.0f)), f32(7.0f));
  return _mm256_add_epi32(_mm256_cvtps_epi32(y), u32(8));
}

// The codes of 16 inputs given as pairs, one struct per way of scaling: lane i holds element
// 2i's code in bits 0-7 and element 2i + 1's in bits 16-23, signs included. kMag: the struct
// takes magnitudes and signs (mag_pairs16), else signed values (pairs16).
template <class F>
struct Fp8Div {  // FP8 with an fp32 scale: encode(x / s); the sign from bits 15 and 31 to 7 and 23
  static constexpr bool kPacked = false, kMag = true;
  V s;
  __attribute__((always_inline)) I operator()(V even, V odd, I sign) const {
    const I ce = encode_mag8<F>(bits(_mm256_div_ps(even, s)));
    const I co = encode_mag8<F>(bits(_mm256_div_ps(odd, s)));
    return _mm256_or_si256(_mm256_or_si256(ce, _mm256_slli_epi32(co, 16)), _mm256_srli_epi32(sign, 8));
  }
};
template <class F>
struct MulCode {  // MX and NVFP4: encode(x * factor); E2M1's sign to bits 3 and 19
  static constexpr bool kPacked = F::kEbits + F::kMbits == 3, kMag = true;
  V f;
  __attribute__((always_inline)) I operator()(V even, V odd, I sign) const {
    even = _mm256_mul_ps(even, f);
    odd = _mm256_mul_ps(odd, f);
    if constexpr (kPacked)
      return _mm256_or_si256(_mm256_or_si256(e2m1_mag8(even), _mm256_slli_epi32(e2m1_mag8(odd), 16)), _mm256_srli_epi32(sign, 12));
    const I ce = encode_mag8<F>(bits(even)), co = encode_mag8<F>(bits(odd));
    return _mm256_or_si256(_mm256_or_si256(ce, _mm256_slli_epi32(co, 16)), _mm256_srli_epi32(sign, 8));
  }
};
struct Int4Div {  // INT4: clamp(rne(x / s)) + 8
  static constexpr bool kPacked = true, kMag = false;
  V s;
  __attribute__((always_inline)) I operator()(V even, V odd, I) const {
    return _mm256_or_si256(int4_code8(even, s), _mm256_slli_epi32(int4_code8(odd, s), 16));
  }
};

// The codes of 16 inputs at p.
template <DType D, class Op>
MQ2_INLINE I codes16(const typename In<D>::T* p, const Op& op) {
  V e, o;
  if constexpr (Op::kMag) {
    I sign;
    mag_pairs16<D>(p, &e, &o, &sign);
    return op(e, o, sign);
  } else {
    pairs16<D>(p, &e, &o);
    return op(e, o, _mm256_setzero_si256());
  }
}

// codes16 of n < 16 inputs, the rest +0 (a zero encodes to the pad code of the packed formats).
template <DType D, class Op>
MQ2_INLINE I codes16_tail(const typename In<D>::T* p, int64_t n, const Op& op) {
  alignas(32) typename In<D>::T buf[16] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(*p));
  return codes16<D>(buf, op);
}

// ---- packing ----------------------------------------------------------------------------------

// Dwords 0 and 4, 1 and 5 of q (the two 128-bit halves interleaved) as 16 bytes.
MQ2_INLINE __m128i halves_interleaved(I q) {
  return _mm_unpacklo_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
}

// The low byte of each of 8 lanes, to 8 bytes in lane order (values <= 255).
MQ2_INLINE __m128i bytes8(I v) {
  const I p = _mm256_packus_epi32(v, v);  // words 0-3 0-3 | 4-7 4-7
  return halves_interleaved(_mm256_packus_epi16(p, p));  // bytes 0-3 (x4) | 4-7 (x4)
}

// Packed formats: byte 0 of lane i of v | v >> 12 holds lane i's nibble pair (codes at bits 0
// and 16, as codes16 leaves them); these vpshufb indexes gather those bytes of each 128-bit half
// to its bytes 0-3 (second = false) or 4-7.
MQ2_INLINE I nibble_bytes(I v, bool second) {
  const I idx = second ? _mm256_setr_epi8(-1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                          -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1)
                       : _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  return _mm256_shuffle_epi8(_mm256_or_si256(v, _mm256_srli_epi32(v, 12)), idx);
}

// 16 codes (codes16) to their bytes: 16 (FP8) or 8 (packed). kSwz: the pairs lie in lanes 0, 1,
// 4, 5 | 2, 3, 6, 7 (kSwizzled), so the halves interleave by words (packed: pair 2k, 2k + 1 of
// each half in turn) or dwords (FP8: 4 codes of each half in turn).
template <bool kPacked, bool kSwz>
MQ2_INLINE void store16(uint8_t* out, I w) {
  if constexpr (kPacked) {
    const I q = nibble_bytes(w, false);
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), kSwz ? _mm_unpacklo_epi16(lo, hi) : _mm_unpacklo_epi32(lo, hi));
  } else {
    const I p = _mm256_packus_epi16(w, w);  // in order (kSwz false): codes 0-7 0-7 | 8-15 8-15
    const __m128i b = kSwz ? halves_interleaved(p) : _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), b);
  }
}

// 32 codes (two codes16) to 32 (FP8) or 16 (packed) bytes.
template <bool kPacked, bool kSwz>
MQ2_INLINE void store32(uint8_t* out, I w0, I w1) {
  if constexpr (kPacked) {
    const I q = _mm256_or_si256(nibble_bytes(w0, false), nibble_bytes(w1, true));  // w0 0-3, w1 0-3 | w0 4-7, w1 4-7
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), kSwz ? _mm_unpacklo_epi16(lo, hi) : _mm_unpacklo_epi32(lo, hi));
  } else {
    const I p = _mm256_packus_epi16(w0, w1);  // in order (kSwz false): qwords w0 0-7, w1 0-7, w0 8-15, w1 8-15
    const I b = kSwz ? _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)) : _mm256_permute4x64_epi64(p, 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), b);
  }
}

// n inputs of one group coded by op to out: n bytes (FP8) or ceil(n / 2) (packed; the group
// starts at an even element). kPrefetch: request the lines kAhead bytes ahead (a long stream).
template <DType D, bool kPrefetch, class Op>
MQ2_INLINE void code_run(const typename In<D>::T* x, int64_t n, const Op& op, uint8_t* out) {
  constexpr bool kPacked = Op::kPacked;
  constexpr int64_t kOut = kPacked ? 1 : 2;  // output bytes per 2 elements
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if constexpr (kPrefetch) {
      const char* ahead = reinterpret_cast<const char*>(x + i) + kAhead;
      for (size_t k = 0; k < 32 * sizeof(*x); k += 64) _mm_prefetch(ahead + k, _MM_HINT_T0);
    }
    store32<kPacked, kSwizzled<D>>(out + i / 2 * kOut, codes16<D>(x + i, op), codes16<D>(x + i + 16, op));
  }
  if (i + 16 <= n) {
    store16<kPacked, kSwizzled<D>>(out + i / 2 * kOut, codes16<D>(x + i, op));
    i += 16;
  }
  if (i < n) {
    alignas(16) uint8_t buf[16];
    store16<kPacked, kSwizzled<D>>(buf, codes16_tail<D>(x + i, n - i, op));
    std::memcpy(out + i / 2 * kOut, buf, static_cast<size_t>(kPacked ? (n - i + 1) / 2 : n - i));
  }
}

// ---- amax ---------------------------------------------------------------------------------------

// Accumulates |x| bits of n inputs (lane-wise unsigned max): fp32 as 8 lanes, bf16 / fp16 as 16
// half-width lanes (|x| bits of each format order like the values, NaN above Inf).
template <DType D>
MQ2_INLINE I acc_abs(const typename In<D>::T* x, int64_t n, I acc) {
  constexpr int64_t kStep = D == DType::f32 ? 8 : 16;
  const I abs = D == DType::f32 ? u32(kF32AbsMask) : _mm256_set1_epi16(0x7FFF);
  const auto take = [&](const void* p) {
    const I v = _mm256_and_si256(_mm256_loadu_si256(static_cast<const __m256i*>(p)), abs);
    acc = D == DType::f32 ? _mm256_max_epu32(acc, v) : _mm256_max_epu16(acc, v);
  };
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) take(x + i);
  if (i < n) {
    alignas(32) typename In<D>::T buf[kStep] = {};
    std::memcpy(buf, x + i, static_cast<size_t>(n - i) * sizeof(*x));
    take(buf);
  }
  return acc;
}

// 8 16-bit |x| bits as fp32 amax bits (exactly; a NaN stays above Inf).
template <DType D>
MQ2_INLINE I widen_amax(__m128i h) {
  if constexpr (D == DType::bf16) return _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
  return bits(_mm256_cvtph_ps(h));
}

// Lane k = the amax bits (fp32) of acc[k], for 8 accumulators as acc_abs leaves them: a
// transposing reduction (21 operations for 8 groups instead of a horizontal one per group).
template <DType D>
MQ2_INLINE I amax8(const I* m) {
  if constexpr (D == DType::f32) {
    I t[4], u[2];
    for (int k = 0; k < 4; ++k)  // dwords alternate m[2k], m[2k + 1]
      t[k] = _mm256_max_epu32(_mm256_unpacklo_epi32(m[2 * k], m[2 * k + 1]), _mm256_unpackhi_epi32(m[2 * k], m[2 * k + 1]));
    for (int k = 0; k < 2; ++k)  // each 128-bit half: m[4k .. 4k + 3]
      u[k] = _mm256_max_epu32(_mm256_unpacklo_epi64(t[2 * k], t[2 * k + 1]), _mm256_unpackhi_epi64(t[2 * k], t[2 * k + 1]));
    return _mm256_max_epu32(_mm256_permute2x128_si256(u[0], u[1], 0x20), _mm256_permute2x128_si256(u[0], u[1], 0x31));
  } else {
    I t[4], u[2];
    for (int k = 0; k < 4; ++k)  // words alternate m[2k], m[2k + 1]
      t[k] = _mm256_max_epu16(_mm256_unpacklo_epi16(m[2 * k], m[2 * k + 1]), _mm256_unpackhi_epi16(m[2 * k], m[2 * k + 1]));
    for (int k = 0; k < 2; ++k)  // words m[4k .. 4k + 3] twice
      u[k] = _mm256_max_epu16(_mm256_unpacklo_epi32(t[2 * k], t[2 * k + 1]), _mm256_unpackhi_epi32(t[2 * k], t[2 * k + 1]));
    const I z = _mm256_max_epu16(_mm256_unpacklo_epi64(u[0], u[1]), _mm256_unpackhi_epi64(u[0], u[1]));  // m[0..7] per half
    const __m128i h = _mm_max_epu16(_mm256_castsi256_si128(z), _mm256_extracti128_si256(z, 1));
    return widen_amax<D>(h);
  }
}

// The unsigned max of the 8 lanes.
MQ2_INLINE uint32_t hmax(I v) {
  v = _mm256_max_epu32(v, _mm256_permute2x128_si256(v, v, 0x01));
  v = _mm256_max_epu32(v, _mm256_shuffle_epi32(v, 0x4E));
  v = _mm256_max_epu32(v, _mm256_shuffle_epi32(v, 0xB1));
  return static_cast<uint32_t>(_mm256_cvtsi256_si32(v));
}

// amax bits of one accumulator.
template <DType D>
MQ2_INLINE uint32_t amax1(I acc) {
  if constexpr (D == DType::f32) return hmax(acc);
  const __m128i h = _mm_max_epu16(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  return hmax(widen_amax<D>(h));
}

// amax over a long flat range (a tensor-level scale), as simd::amax_stream: kStreams sub-ranges
// in turn, 256 bytes at a time, with lines kStreamAhead bytes ahead requested into L2.
template <DType D>
MQ2_INLINE uint32_t amax_stream(const typename In<D>::T* x, int64_t n) {
  using T = typename In<D>::T;
  constexpr int64_t kStreams = 8, kStreamAhead = 4096, kStep = 256 / static_cast<int64_t>(sizeof(T));
  const int64_t per = n / (kStreams * kStep) * kStep;
  I acc = _mm256_setzero_si256();
  for (int64_t i = 0; i < per; i += kStep) {
    for (int64_t s = 0; s < kStreams; ++s) {
      const T* p = x + s * per + i;
      const char* ahead = reinterpret_cast<const char*>(p) + kStreamAhead;
      for (int64_t k = 0; k < 256; k += 64) _mm_prefetch(ahead + k, _MM_HINT_T1);
      acc = acc_abs<D>(p, kStep, acc);
    }
  }
  return amax1<D>(acc_abs<D>(x + kStreams * per, n - kStreams * per, acc));
}

// Each tile row (a row, or 16 / 128 rows for 16x16 and 128x128 tiles) is quantized a chunk of
// groups at a time in three phases: the amaxes of all the chunk's groups (chunk_amax), then
// their scales, 8 at a time on the vector, then the codes, row by row, group by group. Scales
// of different batches do not depend on each other, so their divisions overlap instead of
// stalling the code loop of each batch (NVFP4 1x16 spent half its time in the amax and scale
// steps when they ran per batch of 8 blocks: 0.46 -> 0.34 ns per element, one thread, bf16).
// A chunk's inputs are about kChunkBytes (at least 8 groups): short phases, so that
// out-of-order execution still overlaps a chunk's amax loads with the codes of the one before
// (16 KiB chunks were 10% slower for MX and INT4 than batches of 8 groups; 0.5 KiB no better
// than 1 KiB).
constexpr int64_t kChunkBytes = 1024;
// The most groups a chunk holds: the smallest group is 16 bf16 / fp16 inputs (NVFP4), 32 bytes.
constexpr int64_t kMaxGroups = kChunkBytes / 32;

MQ2_INLINE int64_t chunk_groups(int64_t tile_rows, int64_t g, int64_t size) {
  const int64_t cg = kChunkBytes / (tile_rows * g * size) / 8 * 8;
  return cg < 8 ? 8 : (cg > kMaxGroups ? kMaxGroups : cg);
}

// The amax bits of 8 whole groups of G columns from column c of rows [r0, r1) of a row-major
// [*, C] matrix, group k in lane k. Fully unrolled, so that the 8 accumulators stay in
// registers (indexed by a loop variable they lived on the stack: a load and a store per input
// vector).
template <DType D, int64_t G>
MQ2_INLINE I batch_amax(const typename In<D>::T* x, int64_t C, int64_t r0, int64_t r1, int64_t c) {
  constexpr int64_t kStep = D == DType::f32 ? 8 : 16;
  static_assert(G % kStep == 0, "whole vectors per group");
  const I abs = D == DType::f32 ? u32(kF32AbsMask) : _mm256_set1_epi16(0x7FFF);
  I acc[8];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_si256();
  for (int64_t r = r0; r < r1; ++r) {
    const auto* row = x + r * C + c;
    const char* ahead = reinterpret_cast<const char*>(row) + kAhead;
#pragma GCC unroll 64
    for (int64_t b = 0; b < 8 * G * static_cast<int64_t>(sizeof(*x)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
#pragma GCC unroll 16
      for (int64_t i = 0; i < G; i += kStep) {
        const I v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k * G + i)), abs);
        acc[k] = D == DType::f32 ? _mm256_max_epu32(acc[k], v) : _mm256_max_epu16(acc[k], v);
      }
    }
  }
  return amax8<D>(acc);
}

// batch_amax for nb <= 8 groups of g columns, the last clipped at column C (lanes past nb: 0).
template <DType D>
static I batch_amax_part(const typename In<D>::T* x, int64_t C, int64_t r0, int64_t r1, int64_t c, int64_t g, int64_t nb) {
  I acc[8];
  for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_si256();
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t k = 0; k < nb; ++k) acc[k] = acc_abs<D>(x + r * C + c + k * g, lo(g, C - c - k * g), acc[k]);
  return amax8<D>(acc);
}

// The amax bits of ng groups of g columns (G: g known at compile time, else 0) from column c0
// of rows [r0, r1), to amax[0, ng), 8 at a time (amax has room for ng rounded up to 8).
template <DType D, int64_t G>
MQ2_INLINE void chunk_amax(const typename In<D>::T* x, int64_t C, int64_t r0, int64_t r1, int64_t c0, int64_t g,
                           int64_t ng, uint32_t* amax) {
  for (int64_t j0 = 0; j0 < ng; j0 += 8) {
    const int64_t nb = lo(8, ng - j0), cb = c0 + j0 * g;
    I m;
    if constexpr (G != 0) {
      if (nb == 8 && cb + 8 * G <= C)
        m = batch_amax<D, G>(x, C, r0, r1, cb);
      else
        m = batch_amax_part<D>(x, C, r0, r1, cb, g, nb);
    } else {
      m = batch_amax_part<D>(x, C, r0, r1, cb, g, nb);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(amax + j0), m);
  }
}

// n inputs of one group coded by op (code_run), unrolled when the group is whole and G known.
template <DType D, int64_t G, class Op>
MQ2_INLINE void code_group(const typename In<D>::T* x, int64_t n, const Op& op, uint8_t* out) {
  constexpr int64_t kOut = Op::kPacked ? 1 : 2;
  if constexpr (G != 0 && G % 16 == 0) {
    if (n == G) {
      int64_t i = 0;
      for (; i + 32 <= G; i += 32) store32<Op::kPacked, kSwizzled<D>>(out + i / 2 * kOut, codes16<D>(x + i, op), codes16<D>(x + i + 16, op));
      if (i < G) store16<Op::kPacked, kSwizzled<D>>(out + i / 2 * kOut, codes16<D>(x + i, op));
      return;
    }
  }
  code_run<D, false>(x, n, op, out);
}

// Lanes whose amax is Inf or NaN (a poisoned group): all ones.
MQ2_INLINE I poisoned_lanes(I amax) { return _mm256_cmpgt_epi32(amax, u32(kF32InfBits - 1)); }

// ---- raw casts and flat amax (the Leaf's encode and amax) ---------------------------------------

template <class F>
static void encode_run(const float* x, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; i += 8) {
    alignas(32) float buf[8] = {};
    const int64_t m = lo(8, n - i);
    std::memcpy(buf, x + i, static_cast<size_t>(m) * sizeof(float));
    const V v = _mm256_load_ps(buf);
    I c;
    if constexpr (F::kEbits + F::kMbits == 3)
      c = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_and_si256(bits(v), u32(kF32AbsMask)), u32(kF32InfBits)), e2m1_code8(v));
    else
      c = encode8<F, true>(v);
    alignas(16) uint8_t b[16];
    _mm_storel_epi64(reinterpret_cast<__m128i*>(b), bytes8(c));
    std::memcpy(out + i, b, static_cast<size_t>(m));
  }
}

static void encode_v(const float* x, int64_t n, Elem e, uint8_t* out) {
  if (e == Elem::e4m3) encode_run<E4M3>(x, n, out);
  if (e == Elem::e5m2) encode_run<E5M2>(x, n, out);
  if (e == Elem::e2m1) encode_run<E2M1>(x, n, out);
}

static uint32_t amax_v(DType d, const void* x, int64_t begin, int64_t n) {
  if (d == DType::f32) return amax_stream<DType::f32>(static_cast<const float*>(x) + begin, n);
  if (d == DType::bf16) return amax_stream<DType::bf16>(static_cast<const uint16_t*>(x) + begin, n);
  return amax_stream<DType::f16>(static_cast<const uint16_t*>(x) + begin, n);
}

// ---- FP8 ----------------------------------------------------------------------------------------

template <DType D, class F>
static void fp8_flat(const Fp8Args& a, int64_t begin, int64_t n, uint32_t amax) {
  if (is_poisoned(amax)) {
    std::memset(a.out + begin, F::kNanCode, static_cast<size_t>(n));
    return;
  }
  const Fp8Div<F> op{f32(fp8_scale<F>(bits_f32(amax)))};
  code_run<D, true>(static_cast<const typename In<D>::T*>(a.x) + begin, n, op, a.out + begin);
}

// Tile rows [t0, t1) of batch * ceil(rows / tile_rows): 1xN rows, 1x128 groups or 128x128
// tiles (G = 128 for tiles 128 wide).
template <DType D, class F, int64_t G>
static void fp8_tiles(const Fp8Args& a, int64_t t0, int64_t t1) {
  using T = typename In<D>::T;
  const auto* x = static_cast<const T*>(a.x);
  const int64_t R = a.rows, C = a.cols, tr = a.tile_rows, tc = G != 0 ? G : a.tile_cols;
  const int64_t nr = (R + tr - 1) / tr, nc = (C + tc - 1) / tc, cg = chunk_groups(tr, tc, sizeof(T));
  alignas(32) uint32_t amax[kMaxGroups];
  alignas(32) float s[kMaxGroups];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t b = t / nr, i = t % nr;
    const int64_t r0 = b * R + i * tr, r1 = b * R + lo(R, (i + 1) * tr);
    for (int64_t j0 = 0; j0 < nc; j0 += cg) {
      const int64_t ng = lo(cg, nc - j0), c0 = j0 * tc;
      chunk_amax<D, G>(x, C, r0, r1, c0, tc, ng, amax);
      for (int64_t k = 0; k < ng; k += 8) {
        const I m = _mm256_load_si256(reinterpret_cast<const __m256i*>(amax + k));
        const V sv = _mm256_div_ps(_mm256_max_ps(as_f(m), f32(kAmaxMin)), f32(F::kMax));  // fp8_scale
        _mm256_store_ps(s + k, _mm256_blendv_ps(sv, as_f(u32(kF32QuietNan)), as_f(poisoned_lanes(m))));
      }
      std::memcpy(a.scales + t * nc + j0, s, static_cast<size_t>(ng) * sizeof(float));
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t k = 0; k < ng; ++k) {
          const int64_t c = c0 + k * tc, n = lo(tc, C - c);
          if (is_poisoned(amax[k]))
            std::memset(a.out + r * C + c, F::kNanCode, static_cast<size_t>(n));
          else
            code_group<D, G>(x + r * C + c, n, Fp8Div<F>{f32(s[k])}, a.out + r * C + c);
        }
      }
    }
  }
}

// Rows [r0, r1) of a row-major [*, C] matrix of groups of g columns along the row, a chunk of
// at most cg groups at a time: f(row, first group, groups, their amaxes) after chunk_amax.
template <DType D, int64_t G, class Fn>
MQ2_INLINE void row_chunks(const typename In<D>::T* xs, int64_t r0, int64_t r1, int64_t C, int64_t g, const Fn& f) {
  const int64_t ng_row = (C + g - 1) / g, cg = chunk_groups(1, g, sizeof(*xs));
  alignas(32) uint32_t amax[kMaxGroups];
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j0 = 0; j0 < ng_row; j0 += cg) {
      const int64_t ng = lo(cg, ng_row - j0);
      chunk_amax<D, G>(xs + r * C, C, 0, 1, j0 * g, g, ng, amax);
      f(r, j0, ng, static_cast<const uint32_t*>(amax));
    }
  }
}

// ---- MX: 1x32 blocks, E8M0 scales ----------------------------------------------------------------

// e8m0_code<F> of 8 block amaxes (not poisoned): e8m0_codes of avx512_mx.h.
template <class F>
MQ2_INLINE I e8m0_codes(ScaleRule rule, I amax) {
  if (rule == ScaleRule::rceil) {
    const I d = bits(_mm256_div_ps(as_f(amax), f32(F::kMax)));
    const I field = _mm256_srli_epi32(d, 23);
    const I mant = _mm256_and_si256(d, u32(0x007FFFFFu));
    const I code = _mm256_sub_epi32(field, _mm256_andnot_si256(_mm256_cmpeq_epi32(mant, _mm256_setzero_si256()), u32(0xFFFFFFFFu)));
    const I sub = _mm256_and_si256(_mm256_cmpgt_epi32(mant, u32(0x00400000u)), u32(1));
    return _mm256_min_epu32(_mm256_blendv_epi8(code, sub, _mm256_cmpeq_epi32(field, _mm256_setzero_si256())), u32(254));
  }
  I r = amax;
  if (rule == ScaleRule::even) r = _mm256_and_si256(_mm256_add_epi32(amax, u32(1u << (22 - F::kMbits))), u32(0xFF800000u));
  const I e = _mm256_sub_epi32(_mm256_srli_epi32(r, 23), u32(F::kEmax));
  return _mm256_min_epi32(_mm256_max_epi32(e, _mm256_setzero_si256()), u32(254));
}

// e8m0_inverse lane-wise: 2^(127 - code), code 254 the subnormal 2^-127.
MQ2_INLINE V e8m0_inverses(I code) {
  const I v = _mm256_slli_epi32(_mm256_sub_epi32(u32(254), code), 23);
  return as_f(_mm256_blendv_epi8(v, u32(0x00400000u), _mm256_cmpeq_epi32(code, u32(254))));
}

template <DType D, class F>
static void mx_rows(const MxArgs& a, int64_t r0, int64_t r1) {
  constexpr int64_t kBlock = 32;
  constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  const auto* xs = static_cast<const typename In<D>::T*>(a.x);
  const int64_t C = a.cols, out_stride = kPacked ? (C + 1) / 2 : C, nblk = (C + kBlock - 1) / kBlock;
  alignas(32) float inv[kMaxGroups];
  alignas(16) uint8_t sc[kMaxGroups + 8];
  row_chunks<D, kBlock>(xs, r0, r1, C, kBlock, [&](int64_t r, int64_t j0, int64_t ng, const uint32_t* amax) {
    for (int64_t k = 0; k < ng; k += 8) {
      const I m = _mm256_load_si256(reinterpret_cast<const __m256i*>(amax + k));
      const I code = _mm256_blendv_epi8(e8m0_codes<F>(a.rule, m), u32(kE8M0Nan), poisoned_lanes(m));
      _mm256_store_ps(inv + k, e8m0_inverses(code));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(sc + k), bytes8(code));
    }
    std::memcpy(a.scales + r * nblk + j0, sc, static_cast<size_t>(ng));
    for (int64_t k = 0; k < ng; ++k) {
      const int64_t c = (j0 + k) * kBlock, n = lo(kBlock, C - c);
      uint8_t* o = a.out + r * out_stride + (kPacked ? c / 2 : c);
      if (is_poisoned(amax[k]))
        std::memset(o, static_cast<int>(F::kNanCode), static_cast<size_t>(kPacked ? (n + 1) / 2 : n));
      else
        code_group<D, kBlock>(xs + r * C + c, n, MulCode<F>{f32(inv[k])}, o);
    }
  });
}

// ---- NVFP4: 1x16 or 16x16 blocks, E4M3 block scales ------------------------------------------------

// Tile rows [t0, t1) (tr = 16 for 16x16, else 1).
template <DType D>
static void nvfp4_rows(const Nvfp4Args& a, int64_t t0, int64_t t1, const uint32_t* gamax) {
  using T = typename In<D>::T;
  const auto* x = static_cast<const T*>(a.x);
  const int64_t R = a.rows, C = a.cols, tr = a.tile16x16 ? 16 : 1;
  const int64_t nr = (R + tr - 1) / tr, nc = (C + 15) / 16, out_stride = (C + 1) / 2;
  const int64_t cg = chunk_groups(tr, 16, sizeof(T));
  alignas(32) uint32_t amax[kMaxGroups];
  alignas(32) float factor[kMaxGroups];
  alignas(16) uint8_t sc[kMaxGroups + 8];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t b = t / nr, i = t % nr;
    const int64_t r0 = b * R + i * tr, r1 = b * R + lo(R, (i + 1) * tr);
    const bool matrix_poisoned = is_poisoned(gamax[b]);
    const float sg = a.global_scale[b];
    const V inv = f32(1.0f / sg);
    for (int64_t j0 = 0; j0 < nc; j0 += cg) {
      const int64_t ng = lo(cg, nc - j0), c0 = j0 * 16;
      if (matrix_poisoned) {
        for (int64_t r = r0; r < r1; ++r) {
          std::memset(a.scales + r * nc + j0, E4M3::kNanCode, static_cast<size_t>(ng));
          std::memset(a.out + r * out_stride + c0 / 2, 0, static_cast<size_t>((lo(C, c0 + ng * 16) - c0 + 1) / 2));
        }
        continue;
      }
      chunk_amax<D, 16>(x, C, r0, r1, c0, 16, ng, amax);
      for (int64_t k = 0; k < ng; k += 8) {
        const I m = _mm256_load_si256(reinterpret_cast<const __m256i*>(amax + k));
        // nvfp4_block_code: ((amax / 6) / s_global) clamped to [2^-6, 448], RNE to E4M3.
        V bs = _mm256_div_ps(_mm256_div_ps(as_f(m), f32(E2M1::kMax)), f32(sg));
        bs = _mm256_min_ps(_mm256_max_ps(bs, f32(kNvfp4BlockScaleMin)), f32(E4M3::kMax));
        const I code = _mm256_blendv_epi8(encode8<E4M3, false>(bs), u32(E4M3::kNanCode), poisoned_lanes(m));
        // nvfp4_block_factor: (1 / s_global) / decode<E4M3>(code); codes are 0x08..0x7E here
        // (bits at bit 20 are the value times 2^-120, as in avx2_dequant.h).
        const V scale = _mm256_mul_ps(as_f(_mm256_slli_epi32(code, 20)), f32(0x1p120f));
        _mm256_store_ps(factor + k, _mm256_div_ps(inv, scale));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(sc + k), bytes8(code));
      }
      for (int64_t r = r0; r < r1; ++r) {
        std::memcpy(a.scales + r * nc + j0, sc, static_cast<size_t>(ng));
        int64_t k = 0;
        // Two whole blocks at a time (one 16-byte store); a pair with a poisoned block, and the
        // row's tail, one block at a time.
        for (; k + 2 <= ng && c0 + (k + 2) * 16 <= C; k += 2) {
          if (is_poisoned(amax[k]) || is_poisoned(amax[k + 1])) break;
          const auto* xk = x + r * C + c0 + k * 16;
          store32<true, kSwizzled<D>>(a.out + r * out_stride + c0 / 2 + k * 8, codes16<D>(xk, MulCode<E2M1>{f32(factor[k])}),
                        codes16<D>(xk + 16, MulCode<E2M1>{f32(factor[k + 1])}));
        }
        for (; k < ng; ++k) {
          const int64_t c = c0 + k * 16, n = lo(16, C - c);
          uint8_t* o = a.out + r * out_stride + c / 2;
          if (is_poisoned(amax[k]))  // only with a given global scale: else the matrix is poisoned
            std::memset(o, 0, static_cast<size_t>((n + 1) / 2));
          else
            code_group<D, 16>(x + r * C + c, n, MulCode<E2M1>{f32(factor[k])}, o);
        }
      }
    }
  }
}

// ---- INT4: symmetric groups along the row, scales in a storage dtype -----------------------------

template <DType D, int64_t G>
static void int4_rows(const Int4Args& a, int64_t r0, int64_t r1) {
  const auto* xs = static_cast<const typename In<D>::T*>(a.x);
  const int64_t C = a.cols, g = G != 0 ? G : a.group, out_stride = (C + 1) / 2, ng_row = (C + g - 1) / g;
  alignas(32) float s[kMaxGroups];
  row_chunks<D, G>(xs, r0, r1, C, g, [&](int64_t r, int64_t j0, int64_t ng, const uint32_t* amax) {
    // int4_scale: max(amax / 7, 1e-5); stored in the scale dtype and widened back (store_scale).
    for (int64_t k = 0; k < ng; k += 8) {
      const V m = _mm256_load_ps(reinterpret_cast<const float*>(amax + k));
      _mm256_store_ps(s + k, _mm256_max_ps(_mm256_div_ps(m, f32(kInt4Qmax)), f32(kInt4ScaleMin)));
    }
    for (int64_t k = 0; k < ng; ++k) {
      const bool bad = is_poisoned(amax[k]);
      s[k] = store_scale(bad ? bits_f32(kF32QuietNan) : s[k], a.scale_dtype, a.scales, r * ng_row + j0 + k);
    }
    uint8_t* out = a.out + r * out_stride;
    for (int64_t k = 0; k < ng; ++k) {
      const int64_t c = (j0 + k) * g, n = lo(g, C - c);
      if (is_poisoned(amax[k]))
        std::memset(out + c / 2, 0x88, static_cast<size_t>((n + 1) / 2));
      else
        code_group<D, G>(xs + r * C + c, n, Int4Div{f32(s[k])}, out + c / 2);
    }
  });
}

// ---- dispatch into the Leaf -----------------------------------------------------------------------

#define MQ2_BY_DTYPE(d, call) \
  do {                        \
    if ((d) == DType::f32) {  \
      constexpr DType kD = DType::f32; \
      call;                   \
    } else if ((d) == DType::bf16) { \
      constexpr DType kD = DType::bf16; \
      call;                   \
    } else {                  \
      constexpr DType kD = DType::f16; \
      call;                   \
    }                         \
  } while (0)

static void fp8_flat_v(const Fp8Args& a, int64_t begin, int64_t n, uint32_t amax) {
  if (a.elem == Elem::e4m3)
    MQ2_BY_DTYPE(a.dtype, (fp8_flat<kD, E4M3>(a, begin, n, amax)));
  else
    MQ2_BY_DTYPE(a.dtype, (fp8_flat<kD, E5M2>(a, begin, n, amax)));
}

template <class F>
static void fp8_tiles_f(const Fp8Args& a, int64_t t0, int64_t t1) {
  if (a.tile_cols == 128)
    MQ2_BY_DTYPE(a.dtype, (fp8_tiles<kD, F, 128>(a, t0, t1)));
  else
    MQ2_BY_DTYPE(a.dtype, (fp8_tiles<kD, F, 0>(a, t0, t1)));
}

static void fp8_tiles_v(const Fp8Args& a, int64_t t0, int64_t t1) {
  if (a.elem == Elem::e4m3)
    fp8_tiles_f<E4M3>(a, t0, t1);
  else
    fp8_tiles_f<E5M2>(a, t0, t1);
}

static void mx_rows_v(const MxArgs& a, int64_t r0, int64_t r1) {
  if (a.elem == Elem::e4m3) MQ2_BY_DTYPE(a.dtype, (mx_rows<kD, E4M3>(a, r0, r1)));
  if (a.elem == Elem::e5m2) MQ2_BY_DTYPE(a.dtype, (mx_rows<kD, E5M2>(a, r0, r1)));
  if (a.elem == Elem::e2m1) MQ2_BY_DTYPE(a.dtype, (mx_rows<kD, E2M1>(a, r0, r1)));
}

static void nvfp4_rows_v(const Nvfp4Args& a, int64_t t0, int64_t t1, const uint32_t* gamax) {
  MQ2_BY_DTYPE(a.dtype, (nvfp4_rows<kD>(a, t0, t1, gamax)));
}

static void int4_rows_v(const Int4Args& a, int64_t r0, int64_t r1) {
  if (a.group == 32)
    MQ2_BY_DTYPE(a.dtype, (int4_rows<kD, 32>(a, r0, r1)));
  else if (a.group == 128)
    MQ2_BY_DTYPE(a.dtype, (int4_rows<kD, 128>(a, r0, r1)));
  else
    MQ2_BY_DTYPE(a.dtype, (int4_rows<kD, 0>(a, r0, r1)));
}

#undef MQ2_BY_DTYPE
#undef MQ2_INLINE

}  // namespace q2
