// AVX2 quantization: the contract's per-group arithmetic (contract.h) on 8 fp32 lanes, for hosts
// without AVX-512 (AMD Zen 2 / Zen 3, Intel before Skylake-SP), where the scalar code of
// cpu_kernels.h ran at 0.08-0.35 of a one-thread memcpy.
//
// Included by cpu_isa_avx2.cpp (after immintrin.h and cpu_kernels.h) inside namespace
// miles_quant::cpu::avx2. Every lane-wise step is the twin of a scalar step of the contract, as in
// the AVX-512 kernels (avx512_kernels.h says why each is exact):
// - inputs widen to fp32 exactly: bf16 by a shift; fp16 (no F16C assumed) by placing its bits
//   at bit 13 and one exact multiplication by 2^112 (subnormal halves are fp32 subnormals there,
//   and DAZ is clear on our threads), Inf and NaN patched in by a compare;
// - element encoding is simd::encode of avx512_simd.h (integer RNE for normal targets, one exact
//   fp32 addition for subnormal ones) and E2M1 is e2m1_magnitude of avx512_mx.h (one fp32
//   addition onto the grid, its two 8-entry tables indexed by the exponent's low 3 bits);
// - scales are computed for 8 groups at a time with single IEEE fp32 operations (vdivps,
//   vmulps, vmaxps / vminps as the contract's clamps on values that are not NaN; no FMA, no
//   reciprocal estimate); INT4 scales are stored by the scalar store_scale;
// - 16-bit inputs are read 16 at a time as pairs (lane i: elements 2i and 2i + 1), so that the
//   codes pack back lane by lane, element 2i in the low byte or nibble.
// Groups whose amax is Inf or NaN (poisoned) are written with the contract's fill. Tails (a
// partial group, rows not a multiple of 16) are read from a zero-padded copy: a zero encodes to
// the pad code of every packed format (E2M1 0, INT4 8), and only the row's own bytes are written.
// test_isa.py and test_dequantize.py compare this build with the AVX-512 kernels and the PyTorch
// reference bit for bit on every bf16 and fp16 pattern.
#pragma once

namespace q2 {

using V = __m256;
using I = __m256i;

static inline I u32(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
static inline V f32(float v) { return _mm256_set1_ps(v); }
static inline I bits(V v) { return _mm256_castps_si256(v); }
static inline V as_f(I v) { return _mm256_castsi256_ps(v); }

// Bytes of input a prefetch requests ahead of the current position (see simd::kPrefetchAhead).
constexpr int64_t kAhead = 2048;

// fp16 bits in the low half of each lane (the high half is ignored) -> fp32, exactly.
static inline V f16_widen(I h) {
  const I sh = _mm256_slli_epi32(_mm256_and_si256(h, u32(0x7FFF)), 13);
  const I sign = _mm256_slli_epi32(_mm256_and_si256(h, u32(0x8000)), 16);
  const I mag = bits(_mm256_mul_ps(as_f(sh), f32(0x1p112f)));
  const I special = _mm256_cmpgt_epi32(sh, u32((0x7BFFu << 13) | 0x1FFFu));  // Inf or NaN
  return as_f(_mm256_or_si256(_mm256_blendv_epi8(mag, _mm256_or_si256(sh, u32(kF32InfBits)), special), sign));
}

// 16 inputs as pairs: lane i of *even is element 2i, of *odd element 2i + 1, widened exactly.
template <DType D>
static inline void pairs16(const typename In<D>::T* p, V* even, V* odd) {
  if constexpr (D == DType::f32) {
    const V a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
    // vshufps picks elements 0, 2, 8, 10 | 4, 6, 12, 14: qwords 0, 2, 1, 3 put them in order.
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
  } else {
    const I v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (D == DType::bf16) {
      *even = as_f(_mm256_slli_epi32(v, 16));
      *odd = as_f(_mm256_and_si256(v, u32(0xFFFF0000u)));
    } else {
      *even = f16_widen(v);
      *odd = f16_widen(_mm256_srli_epi32(v, 16));
    }
  }
}

// n < 16 inputs as pairs, the rest +0.
template <DType D>
static inline void pairs16_tail(const typename In<D>::T* p, int64_t n, V* even, V* odd) {
  alignas(32) typename In<D>::T buf[16] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(*p));
  pairs16<D>(buf, even, odd);
}

// ---- element codes ----------------------------------------------------------------------------

// encode<F> of 8 lanes (simd::encode of avx512_simd.h); kMayBeNan = false where no lane is NaN.
template <class F, bool kMayBeNan>
static inline I encode8(V f) {
  constexpr int kShift = 23 - F::kMbits, kEmin = 1 - F::kBias, kSignPos = F::kEbits + F::kMbits;
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + kEmin) << 23;
  constexpr uint32_t kMagicBits = static_cast<uint32_t>(127 + kEmin - F::kMbits + 23) << 23;
  constexpr uint32_t kRebias = static_cast<uint32_t>(127 - F::kBias) << 23;
  const I b = bits(f);
  const I u = _mm256_and_si256(b, u32(kF32AbsMask));
  I cn = _mm256_add_epi32(u, u32(((1u << (kShift - 1)) - 1u) - kRebias));
  cn = _mm256_add_epi32(cn, _mm256_and_si256(_mm256_srli_epi32(u, kShift), u32(1)));
  cn = _mm256_srli_epi32(cn, kShift);
  const I cs = _mm256_sub_epi32(bits(_mm256_add_ps(as_f(u), as_f(u32(kMagicBits)))), u32(kMagicBits));
  const I normal = _mm256_cmpgt_epi32(u, u32(kMinNormalBits - 1));  // u < 2^31: signed compare
  I c = _mm256_min_epu32(_mm256_blendv_epi8(cs, cn, normal), u32(F::kMaxCode));
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

// The E2M1 code of v (not NaN) with its sign: e2m1_code of avx512_mx.h. The exponent field of
// the clamped |v| is 123..129, whose low 3 bits (3..7, 0, 1) index the tables, as vpermd reads.
static inline I e2m1_code8(V v) {
  constexpr int kM0 = 149 << 23, kM1 = 150 << 23, kM2 = 151 << 23;  // 2^22, 2^23, 2^24
  const I mtab = _mm256_setr_epi32(kM1, kM2, 0, kM0, kM0, kM0, kM0, kM0);
  const I ktab = _mm256_setr_epi32(kM1 - 2, kM2 - 4, 0, kM0, kM0, kM0, kM0, kM0);
  V r = _mm256_and_ps(v, as_f(u32(kF32AbsMask)));
  r = _mm256_min_ps(_mm256_max_ps(r, f32(0.0625f)), f32(E2M1::kMax));
  const I e = _mm256_srli_epi32(bits(r), 23);
  const I m = bits(_mm256_add_ps(r, as_f(_mm256_permutevar8x32_epi32(mtab, e))));
  const I mag = _mm256_sub_epi32(m, _mm256_permutevar8x32_epi32(ktab, e));
  return _mm256_or_si256(mag, _mm256_and_si256(_mm256_srli_epi32(bits(v), 28), u32(8)));
}

// INT4 offset-binary codes against the stored scale s: int4_codes of avx512_int4.h (vcvtps2dq is
// RNE under the round-to-nearest our threads select).
static inline I int4_code8(V v, V s) {
  const V y = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v, s), f32(-7.0f)), f32(7.0f));
  return _mm256_add_epi32(_mm256_cvtps_epi32(y), u32(8));
}

// The codes of a group's pairs: lane i holds element 2i's code in its low byte (FP8) or nibble
// (packed formats) and element 2i + 1's above it. One struct per way of scaling.
template <class F>
struct Fp8Div {  // FP8 with an fp32 scale: encode(x / s)
  static constexpr bool kPacked = false;
  V s;
  I operator()(V even, V odd) const {
    return _mm256_or_si256(encode8<F, false>(_mm256_div_ps(even, s)),
                           _mm256_slli_epi32(encode8<F, false>(_mm256_div_ps(odd, s)), 8));
  }
};
template <class F>
struct MulCode {  // MX and NVFP4: encode(x * factor)
  static constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  V f;
  I operator()(V even, V odd) const {
    even = _mm256_mul_ps(even, f);
    odd = _mm256_mul_ps(odd, f);
    if constexpr (kPacked) return _mm256_or_si256(e2m1_code8(even), _mm256_slli_epi32(e2m1_code8(odd), 4));
    return _mm256_or_si256(encode8<F, false>(even), _mm256_slli_epi32(encode8<F, false>(odd), 8));
  }
};
struct Int4Div {  // INT4: clamp(rne(x / s)) + 8
  static constexpr bool kPacked = true;
  V s;
  I operator()(V even, V odd) const { return _mm256_or_si256(int4_code8(even, s), _mm256_slli_epi32(int4_code8(odd, s), 4)); }
};

// ---- packing ----------------------------------------------------------------------------------

// The low byte of each of 8 lanes, to 8 bytes in lane order (values <= 255).
static inline __m128i bytes8(I v) {
  const I p = _mm256_packus_epi32(v, v);  // words 0-3 0-3 | 4-7 4-7
  const I q = _mm256_packus_epi16(p, p);  // bytes 0-3 (x4) | 4-7 (x4)
  return _mm_unpacklo_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
}

// 16 codes as pairs (w: FP8 byte pairs or nibble pairs) to their bytes: 16 (FP8) or 8 (packed).
template <bool kPacked>
static inline void store16(uint8_t* out, I w) {
  if constexpr (kPacked) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), bytes8(w));
  } else {
    const I p = _mm256_packus_epi32(w, w);  // 16-bit pairs 0-3 0-3 | 4-7 4-7
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08)));
  }
}

// 32 codes as two vectors of pairs to 32 (FP8) or 16 (packed) bytes.
template <bool kPacked>
static inline void store32(uint8_t* out, I w0, I w1) {
  const I p = _mm256_packus_epi32(w0, w1);  // pairs w0 0-3, w1 0-3 | w0 4-7, w1 4-7
  if constexpr (kPacked) {
    const I q = _mm256_packus_epi16(p, p);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm_unpacklo_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(p, 0xD8));
  }
}

// n inputs of one group coded by op to out: n bytes (FP8) or ceil(n / 2) (packed; the group
// starts at an even element). kPrefetch: request the lines kAhead bytes ahead (a long stream).
template <DType D, bool kPrefetch, class Op>
static inline void code_run(const typename In<D>::T* x, int64_t n, const Op& op, uint8_t* out) {
  constexpr bool kPacked = Op::kPacked;
  constexpr int64_t kOut = kPacked ? 1 : 2;  // output bytes per 2 elements
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if constexpr (kPrefetch) {
      const char* ahead = reinterpret_cast<const char*>(x + i) + kAhead;
      for (size_t k = 0; k < 32 * sizeof(*x); k += 64) _mm_prefetch(ahead + k, _MM_HINT_T0);
    }
    V e0, o0, e1, o1;
    pairs16<D>(x + i, &e0, &o0);
    pairs16<D>(x + i + 16, &e1, &o1);
    store32<kPacked>(out + i / 2 * kOut, op(e0, o0), op(e1, o1));
  }
  if (i + 16 <= n) {
    V e, o;
    pairs16<D>(x + i, &e, &o);
    store16<kPacked>(out + i / 2 * kOut, op(e, o));
    i += 16;
  }
  if (i < n) {
    V e, o;
    pairs16_tail<D>(x + i, n - i, &e, &o);
    alignas(16) uint8_t buf[16];
    store16<kPacked>(buf, op(e, o));
    std::memcpy(out + i / 2 * kOut, buf, static_cast<size_t>(kPacked ? (n - i + 1) / 2 : n - i));
  }
}

// ---- amax ---------------------------------------------------------------------------------------

// Accumulates |x| bits of n inputs (lane-wise unsigned max): fp32 as 8 lanes, bf16 / fp16 as 16
// half-width lanes (|x| bits of each format order like the values, NaN above Inf).
template <DType D>
static inline I acc_abs(const typename In<D>::T* x, int64_t n, I acc) {
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

// 16-bit |x| bits (the low half of each lane) as fp32 amax bits.
template <DType D>
static inline I widen_amax(I h) {
  if constexpr (D == DType::bf16) return _mm256_slli_epi32(h, 16);
  return bits(f16_widen(h));  // exact; a NaN stays above Inf
}

// Lane k = the amax bits (fp32) of acc[k], for 8 accumulators as acc_abs leaves them: a
// transposing reduction (21 operations for 8 groups instead of a horizontal one per group).
template <DType D>
static inline I amax8(const I* m) {
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
    return widen_amax<D>(_mm256_cvtepu16_epi32(h));
  }
}

// The unsigned max of the 8 lanes.
static inline uint32_t hmax(I v) {
  v = _mm256_max_epu32(v, _mm256_permute2x128_si256(v, v, 0x01));
  v = _mm256_max_epu32(v, _mm256_shuffle_epi32(v, 0x4E));
  v = _mm256_max_epu32(v, _mm256_shuffle_epi32(v, 0xB1));
  return static_cast<uint32_t>(_mm256_cvtsi256_si32(v));
}

// amax bits of one accumulator.
template <DType D>
static inline uint32_t amax1(I acc) {
  if constexpr (D == DType::f32) return hmax(acc);
  const __m128i h = _mm_max_epu16(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  return hmax(widen_amax<D>(_mm256_cvtepu16_epi32(h)));
}

// amax over a long flat range (a tensor-level scale), as simd::amax_stream: kStreams sub-ranges
// in turn, 256 bytes at a time, with lines kStreamAhead bytes ahead requested into L2.
template <DType D>
static inline uint32_t amax_stream(const typename In<D>::T* x, int64_t n) {
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

// Lane k = the amax bits of group k (k < nb <= 8; lanes past nb are 0): groups of g columns from
// column c0 of rows [r0, r1) of a row-major [*, C] matrix, the last clipped at column C.
template <DType D>
static inline I group_amax8(const typename In<D>::T* x, int64_t C, int64_t r0, int64_t r1, int64_t c0, int64_t g, int64_t nb) {
  I acc[8];
  for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_si256();
  for (int64_t r = r0; r < r1; ++r) {
    const auto* row = x + r * C;
    const char* ahead = reinterpret_cast<const char*>(row + c0) + kAhead;
    for (int64_t b = 0; b < nb * g * static_cast<int64_t>(sizeof(*x)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    for (int64_t k = 0; k < nb; ++k) {
      const int64_t c = c0 + k * g;
      acc[k] = acc_abs<D>(row + c, lo(g, C - c), acc[k]);
    }
  }
  return amax8<D>(acc);
}

// Bit k set: lane k's amax is Inf or NaN (a poisoned group).
static inline int poisoned8(I amax) {
  return _mm256_movemask_ps(as_f(_mm256_cmpgt_epi32(amax, u32(kF32InfBits - 1))));
}

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

// Tile rows [t0, t1), 8 tiles of a tile row at a time: their amaxes (one pass over the tiles'
// rows), 8 scales, then the codes row by row (the tiles' inputs again, now from cache: 8 tiles of
// 128x128 bf16 are 256 KiB).
template <DType D, class F>
static void fp8_tiles(const Fp8Args& a, int64_t t0, int64_t t1) {
  const auto* x = static_cast<const typename In<D>::T*>(a.x);
  const int64_t R = a.rows, C = a.cols, tr = a.tile_rows, tc = a.tile_cols;
  const int64_t nr = (R + tr - 1) / tr, nc = (C + tc - 1) / tc;
  alignas(32) float s[8];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t b = t / nr, i = t % nr;
    const int64_t r0 = b * R + i * tr, r1 = b * R + lo(R, (i + 1) * tr);
    for (int64_t j0 = 0; j0 < nc; j0 += 8) {
      const int64_t nb = lo(8, nc - j0), c0 = j0 * tc;
      const I amax = group_amax8<D>(x, C, r0, r1, c0, tc, nb);
      const int poisoned = poisoned8(amax);
      const V sv = _mm256_div_ps(_mm256_max_ps(as_f(amax), f32(kAmaxMin)), f32(F::kMax));  // fp8_scale
      _mm256_store_ps(s, _mm256_blendv_ps(sv, as_f(u32(kF32QuietNan)), as_f(_mm256_cmpgt_epi32(amax, u32(kF32InfBits - 1)))));
      std::memcpy(a.scales + t * nc + j0, s, static_cast<size_t>(nb) * sizeof(float));
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t k = 0; k < nb; ++k) {
          const int64_t c = c0 + k * tc, n = lo(tc, C - c);
          if ((poisoned >> k) & 1)
            std::memset(a.out + r * C + c, F::kNanCode, static_cast<size_t>(n));
          else
            code_run<D, false>(x + r * C + c, n, Fp8Div<F>{f32(s[k])}, a.out + r * C + c);
        }
      }
    }
  }
}

// ---- MX: 1x32 blocks, E8M0 scales ----------------------------------------------------------------

// e8m0_code<F> of 8 block amaxes (not poisoned): e8m0_codes of avx512_mx.h.
template <class F>
static inline I e8m0_codes(ScaleRule rule, I amax) {
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
static inline V e8m0_inverses(I code) {
  const I v = _mm256_slli_epi32(_mm256_sub_epi32(u32(254), code), 23);
  return as_f(_mm256_blendv_epi8(v, u32(0x00400000u), _mm256_cmpeq_epi32(code, u32(254))));
}

template <DType D, class F>
static void mx_rows(const MxArgs& a, int64_t r0, int64_t r1) {
  constexpr int64_t kBlock = 32;
  constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  const auto* xs = static_cast<const typename In<D>::T*>(a.x);
  const int64_t C = a.cols, out_stride = kPacked ? (C + 1) / 2 : C, nblk = (C + kBlock - 1) / kBlock;
  alignas(32) float inv[8];
  for (int64_t r = r0; r < r1; ++r) {
    const auto* x = xs + r * C;
    uint8_t* out = a.out + r * out_stride;
    for (int64_t j0 = 0; j0 < nblk; j0 += 8) {
      const int64_t nb = lo(8, nblk - j0), c0 = j0 * kBlock;
      const I amax = group_amax8<D>(x, C, 0, 1, c0, kBlock, nb);
      const int poisoned = poisoned8(amax);
      const I bad = _mm256_cmpgt_epi32(amax, u32(kF32InfBits - 1));
      const I code = _mm256_blendv_epi8(e8m0_codes<F>(a.rule, amax), u32(kE8M0Nan), bad);
      _mm256_store_ps(inv, e8m0_inverses(code));
      alignas(16) uint8_t sc[16];
      _mm_storel_epi64(reinterpret_cast<__m128i*>(sc), bytes8(code));
      std::memcpy(a.scales + r * nblk + j0, sc, static_cast<size_t>(nb));
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t c = c0 + k * kBlock, n = lo(kBlock, C - c);
        uint8_t* o = out + (kPacked ? c / 2 : c);
        if ((poisoned >> k) & 1)
          std::memset(o, static_cast<int>(F::kNanCode), static_cast<size_t>(kPacked ? (n + 1) / 2 : n));
        else
          code_run<D, false>(x + c, n, MulCode<F>{f32(inv[k])}, o);
      }
    }
  }
}

// ---- NVFP4: 1x16 or 16x16 blocks, E4M3 block scales ------------------------------------------------

// Tile rows [t0, t1) (tr = 16 for 16x16, else 1), 8 blocks of a tile row at a time.
template <DType D>
static void nvfp4_rows(const Nvfp4Args& a, int64_t t0, int64_t t1, const uint32_t* gamax) {
  const auto* x = static_cast<const typename In<D>::T*>(a.x);
  const int64_t R = a.rows, C = a.cols, tr = a.tile16x16 ? 16 : 1;
  const int64_t nr = (R + tr - 1) / tr, nc = (C + 15) / 16, out_stride = (C + 1) / 2;
  alignas(32) float factor[8];
  alignas(16) uint8_t sc[16];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t b = t / nr, i = t % nr;
    const int64_t r0 = b * R + i * tr, r1 = b * R + lo(R, (i + 1) * tr);
    const bool matrix_poisoned = is_poisoned(gamax[b]);
    const float sg = a.global_scale[b];
    const V inv = f32(1.0f / sg);
    for (int64_t j0 = 0; j0 < nc; j0 += 8) {
      const int64_t nb = lo(8, nc - j0), c0 = j0 * 16;
      int poisoned = 0xFF;
      I code = u32(E4M3::kNanCode);
      if (!matrix_poisoned) {
        const I amax = group_amax8<D>(x, C, r0, r1, c0, 16, nb);
        poisoned = poisoned8(amax);
        // nvfp4_block_code: ((amax / 6) / s_global) clamped to [2^-6, 448], RNE to E4M3.
        V bs = _mm256_div_ps(_mm256_div_ps(as_f(amax), f32(E2M1::kMax)), f32(sg));
        bs = _mm256_min_ps(_mm256_max_ps(bs, f32(kNvfp4BlockScaleMin)), f32(E4M3::kMax));
        code = _mm256_blendv_epi8(encode8<E4M3, false>(bs), u32(E4M3::kNanCode), _mm256_cmpgt_epi32(amax, u32(kF32InfBits - 1)));
        // nvfp4_block_factor: (1 / s_global) / decode<E4M3>(code); codes are 0x08..0x7E here
        // (bits at bit 20 are the value times 2^-120, as in avx2_dequant.h).
        const V scale = _mm256_mul_ps(as_f(_mm256_slli_epi32(code, 20)), f32(0x1p120f));
        _mm256_store_ps(factor, _mm256_div_ps(inv, scale));
      }
      _mm_storel_epi64(reinterpret_cast<__m128i*>(sc), bytes8(code));
      for (int64_t r = r0; r < r1; ++r) {
        std::memcpy(a.scales + r * nc + j0, sc, static_cast<size_t>(nb));
        for (int64_t k = 0; k < nb; ++k) {
          const int64_t c = c0 + k * 16, n = lo(16, C - c);
          uint8_t* o = a.out + r * out_stride + c / 2;
          if ((poisoned >> k) & 1)
            std::memset(o, 0, static_cast<size_t>((n + 1) / 2));
          else
            code_run<D, false>(x + r * C + c, n, MulCode<E2M1>{f32(factor[k])}, o);
        }
      }
    }
  }
}

// ---- INT4: symmetric groups along the row, scales in a storage dtype -----------------------------

template <DType D>
static void int4_rows(const Int4Args& a, int64_t r0, int64_t r1) {
  const auto* xs = static_cast<const typename In<D>::T*>(a.x);
  const int64_t C = a.cols, g = a.group, out_stride = (C + 1) / 2, ng = (C + g - 1) / g;
  alignas(32) float s[8];
  for (int64_t r = r0; r < r1; ++r) {
    const auto* x = xs + r * C;
    uint8_t* out = a.out + r * out_stride;
    for (int64_t j0 = 0; j0 < ng; j0 += 8) {
      const int64_t nb = lo(8, ng - j0), c0 = j0 * g;
      const I amax = group_amax8<D>(x, C, 0, 1, c0, g, nb);
      const int poisoned = poisoned8(amax);
      // int4_scale: max(amax / 7, 1e-5), then stored in the scale dtype and widened back.
      _mm256_store_ps(s, _mm256_max_ps(_mm256_div_ps(as_f(amax), f32(kInt4Qmax)), f32(kInt4ScaleMin)));
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t idx = r * ng + j0 + k, c = c0 + k * g, n = lo(g, C - c);
        if ((poisoned >> k) & 1) {
          store_scale(bits_f32(kF32QuietNan), a.scale_dtype, a.scales, idx);
          std::memset(out + c / 2, 0x88, static_cast<size_t>((n + 1) / 2));
        } else {
          const float sk = store_scale(s[k], a.scale_dtype, a.scales, idx);
          code_run<D, false>(x + c, n, Int4Div{f32(sk)}, out + c / 2);
        }
      }
    }
  }
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

static void fp8_tiles_v(const Fp8Args& a, int64_t t0, int64_t t1) {
  if (a.elem == Elem::e4m3)
    MQ2_BY_DTYPE(a.dtype, (fp8_tiles<kD, E4M3>(a, t0, t1)));
  else
    MQ2_BY_DTYPE(a.dtype, (fp8_tiles<kD, E5M2>(a, t0, t1)));
}

static void mx_rows_v(const MxArgs& a, int64_t r0, int64_t r1) {
  if (a.elem == Elem::e4m3) MQ2_BY_DTYPE(a.dtype, (mx_rows<kD, E4M3>(a, r0, r1)));
  if (a.elem == Elem::e5m2) MQ2_BY_DTYPE(a.dtype, (mx_rows<kD, E5M2>(a, r0, r1)));
  if (a.elem == Elem::e2m1) MQ2_BY_DTYPE(a.dtype, (mx_rows<kD, E2M1>(a, r0, r1)));
}

static void nvfp4_rows_v(const Nvfp4Args& a, int64_t t0, int64_t t1, const uint32_t* gamax) {
  MQ2_BY_DTYPE(a.dtype, (nvfp4_rows<kD>(a, t0, t1, gamax)));
}

static void int4_rows_v(const Int4Args& a, int64_t r0, int64_t r1) { MQ2_BY_DTYPE(a.dtype, (int4_rows<kD>(a, r0, r1))); }

#undef MQ2_BY_DTYPE

}  // namespace q2
