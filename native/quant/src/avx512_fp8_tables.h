// FP8 (E4M3, E5M2) of bf16 inputs by mantissa tables: the contract's encode(x / s) without a
// division, 64 inputs per instruction on byte lanes (32 on 16-bit lanes where the byte path
// cannot take them, below). Needs AVX512-VBMI (vpermi2b, vpermt2b); included
// by avx512_fp8.h inside namespace miles_quant::cpu::MQ_CPU_NS, after fp8_pairs32_bf16
// (the fallback below). Without VBMI, kFp8Tables is false and the fp32 path runs everywhere.
//
// Why a table gives the contract's bits. Take a group that is not poisoned, with amax A (a bf16
// value: the max of |x| over bf16 inputs) and s = max(A, 1e-10) / max_elem in fp32.
// - s's mantissa depends only on A's 7 mantissa bits (dividing m * 2^e by max_elem is exact
//   scaling of fl(m / max_elem) by 2^e while s stays normal, which it always does), or on
//   nothing when the 1e-10 clamp applies: 129 possible mantissas, so 129 tables.
// - For a normal bf16 x = (1 + m/128) * 2^(e - 127), fl(x / s) = fl((1 + m/128) / s') * 2^(e -
//   E) where s' is s with its exponent field set to 127 and E is s's exponent field: the same
//   scaling argument, while the quotient is a normal fp32.
// - encode's integer rounding of a normal target is linear in the fp32 exponent: rn(v * 2^k) =
//   rn(v) + k * 2^M (round_mag_rne, bits.h; M = mantissa bits of the element). So the code of x,
//   before the sign, is c = e * 2^M + d[m] + K with d[m] = rn(y_m) - rn(y_0), y_m = fl((1 +
//   m/128) / s') (0..2^(M+1): one byte), and K = rn(y_0) - E * 2^M per group. The bf16 bits
//   give e * 2^M by a shift and a mask, and vpermi2b looks d[m] up for 64 bytes at once (the
//   low byte of a bf16 holds m in its low 7 bits, which are what the permute reads).
//   The tables store d[m] + rn(y_0) - (B - 1) * 2^M instead (B the element's bias: y_m is in
//   (0.5, 2], so that is rn(y_m) - rn(0.5), 0..2^(M+1) + 2^M) and K = (B - 1 - E) * 2^M: the
//   same sum c, with a K that is a multiple of 2^M.
// - On byte lanes (64 inputs a step): c = (e - G) * 2^M + d'[m] with G = E - B + 1 per group, so
//   u = e -sat G (one saturating byte subtraction) is e - G where that is >= 1, and there c >=
//   2^M is a normal target: code (u << M) + d'[m]. Where u = 0 (e <= G), c < 2^M except for
//   e - G in {0, -1} with a large d'[m], and c <= -M * 2^M for e - G <= -(M + 2), which encodes
//   to 0 (at c = -M * 2^M, half the smallest subnormal step, the tie goes to the even 0; the
//   probe below fails if the window starts one lower). A step with a lane at e - G in
//   [-(M + 1), 0] goes through the 16-bit lanes above (rare: |x| about 2^-19..2^-13 of the amax
//   for E4M3). G must be 0..255 (E >= B - 1: every s but those of amaxes below about 2^-115,
//   whose groups take the 16-bit lanes).
// - c >= 2^M: a normal target, or a value just below the smallest normal whose rounding carries
//   to it, which the subnormal grid rounds to the same code; that is the code. No saturation
//   step: |x| <= amax, so |x / s| rounds to at most max_elem (the probe below covers it).
//   c < -M * 2^M: the value is below half the smallest subnormal step and encodes to 0. In
//   between (subnormal targets: |x| between about 2^-19 and 2^-15 of the amax for E4M3, 2^-33
//   and 2^-30 for E5M2; rare) the 32 inputs are encoded again by the fp32 path. A bf16 zero or
//   subnormal x (e = 0) gives c < -M * 2^M and encodes to 0, as the division does (|x / s| <
//   2^-80).
// tools/bench/quant_fp8_tables_probe.cpp checks this against the fp32 path for every
// non-poisoned bf16 amax and every bf16 x with |x| <= amax, both formats (run by
// tests/test_quant_fp8_tables.py).

#if defined(__AVX512VBMI__)
constexpr bool kFp8Tables = true;

template <class F>
struct Fp8Tables {
  alignas(64) uint8_t d[129][128];  // [amax mantissa, or 128 for the 1e-10 clamp][x mantissa]: d'[m]
  int32_t base[129];                // (B - 1) * 2^M (see above)
};

template <class F>
static const Fp8Tables<F>& fp8_tables() {
  static const Fp8Tables<F> tables = [] {
    Fp8Tables<F> t;
    for (uint32_t i = 0; i < 129; ++i) {
      const float amax = i < 128 ? bits_f32((127u << 23) | (i << 16)) : 0.0f;
      const float s = fp8_scale<F>(amax);
      const float s1 = bits_f32((f32_bits(s) & 0x007FFFFFu) | (127u << 23));
      for (uint32_t m = 0; m < 128; ++m) {
        // y in (0.5, 2]: a normal target of either format, so round_mag_rne's integer path.
        const uint32_t r = round_mag_rne<F::kMbits, F::kBias>(f32_bits(bits_f32((127u << 23) | (m << 16)) / s1));
        t.d[i][m] = static_cast<uint8_t>(r - ((F::kBias - 1) << F::kMbits));  // rn(y_m) - rn(0.5)
      }
      t.base[i] = (F::kBias - 1) << F::kMbits;
    }
    return t;
  }();
  return tables;
}

// One group's table and constant K (amax bits as the kernels compute them, s its scale), from
// t = fp8_tables<F>() (fetched once per kernel call: it is a function-local static).
struct Fp8Tab {
  const uint8_t* d;
  int32_t k;
};
template <class F>
static inline Fp8Tab fp8_tab(const Fp8Tables<F>& t, uint32_t amax_bits, float s) {
  const uint32_t i = bits_f32(amax_bits) < kAmaxMin ? 128u : (amax_bits >> 16) & 0x7Fu;
  return {t.d[i], t.base[i] - static_cast<int32_t>((f32_bits(s) >> 23) << F::kMbits)};
}

// 32 bf16 inputs of a group on 16-bit lanes (ta, tb: its table; k: K as 16-bit lanes).
template <class F>
static inline void fp8_tab32(const uint16_t* x, __m512i ta, __m512i tb, __m512i k, float s, uint8_t* out) {
  constexpr int M = F::kMbits;
  const __m512i v = _mm512_loadu_si512(x);
  const __m512i d = _mm512_maskz_permutex2var_epi8(0x5555555555555555ull, ta, v, tb);  // d[m], 16-bit
  const __m512i e = _mm512_and_si512(_mm512_srli_epi16(v, 7 - M), _mm512_set1_epi16(static_cast<short>(0xFF << M)));
  const __m512i c = _mm512_add_epi16(_mm512_add_epi16(e, d), k);
  const __mmask32 low = _mm512_cmplt_epi16_mask(c, _mm512_set1_epi16(1 << M));
  const __mmask32 sub = _mm512_mask_cmpge_epi16_mask(low, c, _mm512_set1_epi16(static_cast<short>(-M * (1 << M))));
  if (__builtin_expect(sub != 0, 0)) {  // a subnormal target: the fp32 path for these 32
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(fp8_pairs32_bf16<F>(x, _mm512_set1_ps(s))));
    return;
  }
  __m512i r = _mm512_mask_mov_epi16(c, low, _mm512_setzero_si512());
  r = _mm512_ternarylogic_epi32(r, _mm512_srli_epi16(v, 8), _mm512_set1_epi16(0x80), 0xF8);  // sign to bit 7
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi16_epi8(r));
}

// n (a multiple of 32) bf16 inputs of one group with table t and scale s (for the fallback) to
// FP8 bytes, 64 a step on byte lanes (above), a last 32 and groups with G outside 0..255 on
// 16-bit lanes. kPrefetch: request the lines kPrefetchAhead bytes ahead, 256 bytes at a time.
template <class F, bool kPrefetch>
static inline void fp8_tab_run(const uint16_t* x, int64_t n, Fp8Tab t, float s, uint8_t* out) {
  constexpr int M = F::kMbits;
  const __m512i ta = _mm512_loadu_si512(t.d), tb = _mm512_loadu_si512(t.d + 64);
  const __m512i k = _mm512_set1_epi16(static_cast<short>(t.k));
  const int32_t G = -(t.k >> M);  // K = -G * 2^M
  int64_t i = 0;
  if (G >= 0 && G <= 255) {
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i g = _mm512_set1_epi8(static_cast<char>(G)), near = _mm512_set1_epi8(M + 2);
    for (; i + 64 <= n; i += 64) {
      if constexpr (kPrefetch) {
        if ((i & 127) == 0) {
          const char* ahead = reinterpret_cast<const char*>(x + i) + simd::kPrefetchAhead;
          for (int b = 0; b < 256; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
        }
      }
      const simd::Bf16Bytes b = simd::bf16_bytes(x + i);
      const __m512i u = _mm512_subs_epu8(b.e, g);
      const __mmask64 normal = _mm512_test_epi8_mask(u, u);
      const __m512i near_sub = _mm512_subs_epu8(_mm512_adds_epu8(b.e, near), g);  // e - G >= -(M + 1)
      if (__builtin_expect(_mm512_mask_test_epi8_mask(~normal, near_sub, near_sub) != 0, 0)) {
        fp8_tab32<F>(x + i, ta, tb, k, s, out + i);
        fp8_tab32<F>(x + i + 32, ta, tb, k, s, out + i + 32);
        continue;
      }
      __m512i q = _mm512_add_epi8(_mm512_slli_epi16(u, M), _mm512_permutex2var_epi8(ta, b.lo, tb));
      q = _mm512_maskz_mov_epi8(normal, q);
      q = _mm512_ternarylogic_epi32(q, b.hi, sign, 0xF8);  // x's sign to bit 7
      _mm512_storeu_si512(out + i, q);
    }
  }
  for (; i < n; i += 32) {
    if constexpr (kPrefetch) {
      if ((i & 127) == 0) {
        const char* ahead = reinterpret_cast<const char*>(x + i) + simd::kPrefetchAhead;
        for (int b = 0; b < 256; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
      }
    }
    fp8_tab32<F>(x + i, ta, tb, k, s, out + i);
  }
}

// ---- fp16 inputs -----------------------------------------------------------------------------
// The same argument for fp16 x = (1 + m/1024) * 2^(e - 15) (m 10 bits, e 5 bits): it is the
// bf16 case with e + 112 for e, so c = e * 2^M + d[m] + K + 112 * 2^M, and s's mantissa depends
// only on the amax's 10 mantissa bits (an fp16 amax, normal or subnormal, is a normal fp32 whose
// mantissa has at most 10 bits): 1025 tables. A 1024-entry table is no single lookup, but d[m]
// is a step function that rises by at most 1 within any 16 consecutive m: y_m moves by 1 / (1024
// s') per step, the rounding grid's spacing at y is at least y / 2^(M+1) and y * s' >= 1, so
// rises are at least 2^(9 - M) >= 64 apart. So each table is two 64-byte tables, looked up by m's
// top 6 bits (vpermb, 16-bit lanes): D[k] = d[16k] and T[k] = the first j in 1..15 with
// d[16k + j] = D[k] + 1 (16 if none), and d[m] = D[m >> 4] + (m & 15 >= T[m >> 4]).
// nvfp4-style byte lanes do not fit (m straddles the two bytes), so this works on 16-bit lanes,
// 32 inputs a step, as fp8_tab32 does. Lanes with e = 0: a zero encodes to 0 (sign kept); an
// fp16 subnormal is not (1 + m/1024) * 2^(e - 15) and, unlike a bf16 one, can scale to a
// non-zero code, so a step holding one goes through the fp32 path, as does a step with a
// subnormal target. tools/bench/quant_fp8_f16_tables_probe.cpp checks every fp16 amax and
// every fp16 x with |x| <= amax, both formats, against the fp32 path.
template <class F>
struct Fp8Tables16 {
  struct Table {
    alignas(64) uint8_t d[64];  // D[k]
    alignas(64) uint8_t t[64];  // T[k]
  };
  Table tab[1025];  // [amax mantissa (10 bits), or 1024 for the 1e-10 clamp]
  bool ok[1025];    // the step-function shape held while building (it always does; else fp32)
};

template <class F>
static const Fp8Tables16<F>& fp8_tables16() {
  static const Fp8Tables16<F>* tables = [] {
    auto* t = new Fp8Tables16<F>;
    for (uint32_t i = 0; i < 1025; ++i) {
      const float amax = i < 1024 ? bits_f32((127u << 23) | (i << 13)) : 0.0f;
      const float s1 = bits_f32((f32_bits(fp8_scale<F>(amax)) & 0x007FFFFFu) | (127u << 23));
      uint8_t d[1024];
      for (uint32_t m = 0; m < 1024; ++m) {
        const uint32_t r = round_mag_rne<F::kMbits, F::kBias>(f32_bits(bits_f32((127u << 23) | (m << 13)) / s1));
        d[m] = static_cast<uint8_t>(r - ((F::kBias - 1) << F::kMbits));
      }
      bool ok = true;
      for (uint32_t k = 0; k < 64; ++k) {
        const uint8_t base = d[16 * k];
        uint8_t first = 16;
        for (uint32_t j = 1; j < 16; ++j) {
          const uint8_t v = d[16 * k + j];
          if (v != base && first == 16) first = static_cast<uint8_t>(j);
          ok = ok && v == (j >= first ? base + 1 : base);
        }
        t->tab[i].d[k] = base;
        t->tab[i].t[k] = first;
      }
      t->ok[i] = ok;
    }
    return t;
  }();
  return *tables;
}

// One fp16 group's tables (d: D, d + 64: T; nullptr when they do not hold) and K + 112 * 2^M.
template <class F>
static inline Fp8Tab fp8_tab16(const Fp8Tables16<F>& t, uint32_t amax_bits, float s) {
  const uint32_t i = bits_f32(amax_bits) < kAmaxMin ? 1024u : (amax_bits >> 13) & 0x3FFu;
  const int32_t k = ((F::kBias - 1 + 112) << F::kMbits) - static_cast<int32_t>((f32_bits(s) >> 23) << F::kMbits);
  return {t.ok[i] ? t.tab[i].d : nullptr, k};
}

// n (a multiple of 32) fp16 inputs of one group with tables t and scale s (for the fp32 path)
// to FP8 bytes, 32 a step (above). kPrefetch: as fp8_tab_run.
template <class F, bool kPrefetch>
static inline void fp8_tab16_run(const uint16_t* x, int64_t n, Fp8Tab t, float s, uint8_t* out) {
  constexpr int M = F::kMbits;
  const __m512 vs = _mm512_set1_ps(s);
  const auto fp32_path = [&](int64_t i) {
    for (int64_t h = i; h < i + 32; h += 16)
      simd::store_bytes(out + h, simd::encode<F, false>(_mm512_div_ps(simd::load<DType::f16>(x + h, 0xFFFF), vs)), 0xFFFF);
  };
  if (t.d == nullptr) {
    for (int64_t i = 0; i < n; i += 32) fp32_path(i);
    return;
  }
  const __m512i dd = _mm512_load_si512(t.d), tt = _mm512_load_si512(t.d + 64);
  const __m512i k = _mm512_set1_epi16(static_cast<short>(t.k)), one = _mm512_set1_epi16(1);
  const __m512i low4 = _mm512_set1_epi16(15), emask = _mm512_set1_epi16(static_cast<short>(0x1F << M));
  const __m512i exp16 = _mm512_set1_epi16(0x7C00), man16 = _mm512_set1_epi16(0x3FF);
  const __m512i normal_min = _mm512_set1_epi16(1 << M), sub_min = _mm512_set1_epi16(static_cast<short>(-M * (1 << M)));
  const __m512i sign = _mm512_set1_epi16(0x80);
  constexpr __mmask64 kLow = 0x5555555555555555ull;
  for (int64_t i = 0; i < n; i += 32) {
    if constexpr (kPrefetch) {
      if ((i & 127) == 0) {
        const char* ahead = reinterpret_cast<const char*>(x + i) + simd::kPrefetchAhead;
        for (int b = 0; b < 256; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
      }
    }
    const __m512i v = _mm512_loadu_si512(x + i);
    const __m512i idx = _mm512_srli_epi16(v, 4);  // low byte: m >> 4 (vpermb reads 6 bits)
    const __m512i d = _mm512_maskz_permutexvar_epi8(kLow, idx, dd);
    const __m512i step = _mm512_maskz_permutexvar_epi8(kLow, idx, tt);
    const __mmask32 up = _mm512_cmpge_epu16_mask(_mm512_and_si512(v, low4), step);
    __m512i c = _mm512_add_epi16(_mm512_add_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 10 - M), emask), d), k);
    c = _mm512_mask_add_epi16(c, up, c, one);
    const __mmask32 normal = _mm512_test_epi16_mask(v, exp16);  // e > 0 (finite: the group is not poisoned)
    const __mmask32 low = _mm512_mask_cmplt_epi16_mask(normal, c, normal_min);
    const __mmask32 sub = _mm512_mask_cmpge_epi16_mask(low, c, sub_min);                // a subnormal target
    const __mmask32 tiny = _mm512_mask_test_epi16_mask(static_cast<__mmask32>(~normal), v, man16);  // x subnormal
    if (__builtin_expect((sub | tiny) != 0, 0)) {
      fp32_path(i);
      continue;
    }
    __m512i r = _mm512_maskz_mov_epi16(normal & static_cast<__mmask32>(~low), c);
    r = _mm512_ternarylogic_epi32(r, _mm512_srli_epi16(v, 8), sign, 0xF8);  // sign to bit 7
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi16_epi8(r));
  }
}

// The group table of an input dtype with tables (bf16: fp8_tab, f16: fp8_tab16), and its run.
template <DType D, class F>
static inline Fp8Tab fp8_group_tab(uint32_t amax_bits, float s) {
  if constexpr (D == DType::f16)
    return fp8_tab16<F>(fp8_tables16<F>(), amax_bits, s);
  else
    return fp8_tab<F>(fp8_tables<F>(), amax_bits, s);
}
template <DType D, class F, bool kPrefetch>
static inline void fp8_group_run(const uint16_t* x, int64_t n, Fp8Tab t, float s, uint8_t* out) {
  if constexpr (D == DType::f16)
    fp8_tab16_run<F, kPrefetch>(x, n, t, s, out);
  else
    fp8_tab_run<F, kPrefetch>(x, n, t, s, out);
}
#else
constexpr bool kFp8Tables = false;
template <class F>
struct Fp8Tables {};
template <class F>
static const Fp8Tables<F>& fp8_tables() {
  static const Fp8Tables<F> tables;
  return tables;
}
struct Fp8Tab {
  const uint8_t* d;
  int32_t k;
};
template <class F>
static inline Fp8Tab fp8_tab(const Fp8Tables<F>&, uint32_t, float) {
  return {nullptr, 0};
}
template <class F, bool kPrefetch>
static inline void fp8_tab_run(const uint16_t*, int64_t, Fp8Tab, float, uint8_t*) {}
template <DType D, class F>
static inline Fp8Tab fp8_group_tab(uint32_t, float) {
  return {nullptr, 0};
}
template <DType D, class F, bool kPrefetch>
static inline void fp8_group_run(const uint16_t*, int64_t, Fp8Tab, float, uint8_t*) {}
#endif
