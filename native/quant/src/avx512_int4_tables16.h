// INT4 (int4_g32, int4_g128) of fp16 inputs by mantissa tables: int4_code(x, s) without the
// conversion and the division, 32 inputs per step on 16-bit lanes. Needs AVX512-VBMI (vpermb,
// vpermi2b); included by avx512_int4.h after avx512_int4_tables.h (whose argument this one
// extends: read that first), inside namespace miles_quant::cpu::MQ_CPU_NS.
//
// Why tables give the contract's bits (a whole group that is not poisoned, stored scale s = s1 *
// 2^(E - 127), s1 in [1, 2)).
// - A normal fp16 x = (1 + m/1024) * 2^(e - 15) is the bf16 case with 10 mantissa bits and e +
//   112 for e: fl(|x| / s) = P_m * 2^(e - 15 - E + 127), P_m = fl((1 + m/1024) / s1) = p * 2^o in
//   (0.5, 2), o = -1 or 0, and with u = min(max(e - C, 0), 6), C = E - 114, w = u + o + 1 is
//   b + 3 where that is in [0, 7] (b the exponent of the quotient), and gives the same magnitude
//   outside it (kInt4Mag's columns 0-1 are all 0, 6-7 all 7).
// - The magnitude depends on w and on the class of p (int4_class: {1} and seven intervals). As
//   with E2M1 (avx512_nvfp4_tables16.h), class {1} at w rounds as class 7, [1.75, 2), at w - 1,
//   for every w (kInt4Mag's row 0 is row 7 shifted by one column). Counting p = 1 as the top class
//   of the binade below, the ordinal r = 7(o + 1) + class - 1 is 0..13, rises by one at a time
//   and at most once in 16 steps of m (the class bounds are 1/8 of p apart, a step of m moves P
//   by at most 1/1024): one 64-byte table per scale in the one-byte step form of the NVFP4 fp16
//   tables, (byte + (m & 15)) >> 4 = r.
// - The magnitude of (w, class) is then kInt4Grid's at 7u + r = 7w + class - 1 (at most 55), and
//   the sign as bit 6 picks 8 + q or 8 - q in one vpermi2b (kInt4Grid7). 7u comes from a 64-byte
//   lookup of 7e + 28 by the exponent bits, one saturating byte subtraction of 7C + 28 and a cap
//   at 42: all bytes for C in [0, 26] (E in 114..140, every scale an fp16 amax gives above 2^-12).
// - e = 0 (zero or fp16 subnormal): where C >= 1, u = 0 for every x with e <= 1, so |x / s| is
//   below 0.5 (magnitude 0) for e = 1 and, RNE being monotone, for the smaller subnormals: code 8
//   with either sign, as int4_code gives. Groups with C <= 0 (stored scale below 2^-13: group
//   amaxes below about 1.7e-3, the all-zero group's clamped 1e-5 included) take the fp32 path.
// - s1 depends only on the group amax's 10 mantissa bits (1025 tables per scale dtype, the clamp
//   included), with the fp16-scale exceptions of avx512_int4_tables.h (checked by sig the same
//   way). Tables: 1025 x 64 bytes per scale dtype, built on first use by 1,049,600 divisions.
// tools/bench/quant_int4_f16_tables_probe.cpp checks every table against the fp32 lanes for
// every fp16 x and every C in [1, 26], and int4_tab_groups16 for every fp16 group amax, every
// fp16 x with |x| <= amax, every scale dtype and both group sizes (run by
// tests/test_quant_int4_tables.py).

#if defined(__AVX512VBMI__)
// [i] = 8 + the magnitude at index i = 7w + class - 1 (class 1..7, w 0..7; index 55 and above
// unused), [64 + i] = 8 - it.
struct Int4Grid7 {
  uint8_t g[128];
};
static constexpr Int4Grid7 int4_grid7() {
  Int4Grid7 r{};
  for (int w = 0; w < 8; ++w) {
    for (int cls = 1; cls < 8; ++cls) {
      const int i = 7 * w + cls - 1;
      r.g[i] = static_cast<uint8_t>(8 + kInt4Mag[8 * cls + w]);
      r.g[64 + i] = static_cast<uint8_t>(8 - kInt4Mag[8 * cls + w]);
    }
  }
  return r;
}
alignas(64) static constexpr Int4Grid7 kInt4Grid7 = int4_grid7();

// [e + 32 * sign] = 7e + 28 (the sign bit is what vpermb reads as bit 5 of x >> 10).
struct Int4Exp7 {
  uint8_t g[64];
};
static constexpr Int4Exp7 int4_exp7() {
  Int4Exp7 r{};
  for (int i = 0; i < 64; ++i) r.g[i] = static_cast<uint8_t>(7 * (i & 31) + 28);
  return r;
}
alignas(64) static constexpr Int4Exp7 kInt4Exp7 = int4_exp7();

struct Int4Tables16 {
  alignas(64) uint8_t t[1025][64];  // [amax mantissa (10 bits), or 1024 for the 1e-5 clamp][m >> 4]
  uint32_t sig[1025];               // mantissa field (fp32) of the s1 each table is for
  uint32_t clamp_below;             // amaxes (fp32 bits) below this have the clamped scale
  bool ok;                          // every table had the step shape (always; else fp32 path)
};

// The tables of scale dtype sd: reference amaxes 1 + i/1024 (scales in [1/7, 2/7), normal in all
// three dtypes) and 0 (the clamp).
static inline void int4_build_tables16(DType sd, Int4Tables16* t) {
  t->clamp_below = int4_tables(sd).clamp_below;
  t->ok = true;
  for (uint32_t i = 0; i < 1025; ++i) {
    const float amax = i < 1024 ? bits_f32((127u << 23) | (i << 13)) : 0.0f;
    uint32_t stored_bits = 0;
    const float s = store_scale(int4_scale(amax), sd, &stored_bits, 0);
    t->sig[i] = f32_bits(s) & 0x007FFFFFu;
    const float s1 = bits_f32(t->sig[i] | (127u << 23));
    for (uint32_t k = 0; k < 64; ++k) {
      uint32_t r[16];
      for (uint32_t j = 0; j < 16; ++j) {
        const uint32_t p = f32_bits(bits_f32((127u << 23) | ((16 * k + j) << 13)) / s1);  // in (0.5, 2)
        const uint32_t o1 = (p >> 23) - 126u, cls = int4_class(p & 0x007FFFFFu);
        r[j] = 7 * o1 + cls - 1;  // p = 1 (cls 0): the top class of the binade below
      }
      t->ok = step_table_byte(r, 13, &t->t[i][k]) && t->ok;
    }
  }
}

template <DType SD>
static const Int4Tables16& int4_tables16_of() {
  static const Int4Tables16* tables = [] {
    auto* t = new Int4Tables16;
    int4_build_tables16(SD, t);
    return t;
  }();
  return *tables;
}
static inline const Int4Tables16& int4_tables16(DType sd) {
  if (sd == DType::f32) return int4_tables16_of<DType::f32>();
  return sd == DType::bf16 ? int4_tables16_of<DType::bf16>() : int4_tables16_of<DType::f16>();
}

// One 32-input step: v's codes by table tab and c7 = 7C + 28 (low byte of each 16-bit lane),
// paired: dword i = code 2i + 16 * code 2i + 1.
static inline __m512i int4_tab16_step(__m512i v, __m512i tab, __m512i c7) {
  constexpr __mmask64 kLow = 0x5555555555555555ull;
  const __m512i b = _mm512_maskz_permutexvar_epi8(kLow, _mm512_srli_epi16(v, 4), tab);  // by m >> 4
  const __m512i t = _mm512_maskz_permutexvar_epi8(kLow, _mm512_srli_epi16(v, 10), _mm512_load_si512(kInt4Exp7.g));
  const __m512i u7 = _mm512_min_epu8(_mm512_subs_epu8(t, c7), _mm512_set1_epi16(42));  // 7u
  const __m512i r = _mm512_srli_epi16(_mm512_add_epi16(b, _mm512_and_si512(v, _mm512_set1_epi16(15))), 4);
  const __m512i idx = _mm512_ternarylogic_epi32(_mm512_add_epi16(u7, r), _mm512_srli_epi16(v, 9), _mm512_set1_epi16(64), 0xF8);
  const __m512i code = _mm512_maskz_permutex2var_epi8(kLow, _mm512_load_si512(kInt4Grid7.g), idx, _mm512_load_si512(kInt4Grid7.g + 64));
  return _mm512_madd_epi16(code, _mm512_set1_epi32(0x00100001));
}

// Four steps' paired codes to 64 packed bytes in input order.
static inline void int4_tab16_store4(const __m512i* d, uint8_t* out) {
  const __m512i runs = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i p = _mm512_packus_epi16(_mm512_packus_epi32(d[0], d[1]), _mm512_packus_epi32(d[2], d[3]));
  _mm512_storeu_si512(out, _mm512_permutexvar_epi32(runs, p));
}

// int4_tab_groups for fp16 inputs: the groups of one batch the tables cover (whole groups of 32
// or 128, not poisoned, C >= 1, and with fp16 scales only those whose stored scale has the
// mantissa field of their table). Encodes those; returns their mask.
static inline simd::Mask int4_tab_groups16(const uint16_t* x, int64_t n, int64_t g, int64_t nb, __m512i amax, __m512 sv,
                                           simd::Mask poisoned, DType sd, uint8_t* out) {
  if (g != 32 && g != 128) return 0;
  const Int4Tables16& t = int4_tables16(sd);
  if (!t.ok) return 0;
  const int64_t whole = lo(nb, n / g);
  const __m512i sb = _mm512_castps_si512(sv);
  const simd::Mask clamp = _mm512_cmplt_epu32_mask(amax, simd::u32(t.clamp_below));
  const __m512i iv = _mm512_mask_mov_epi32(_mm512_and_si512(_mm512_srli_epi32(amax, 13), simd::u32(0x3FF)), clamp, simd::u32(1024));
  const __m512i cc = _mm512_sub_epi32(_mm512_srli_epi32(sb, 23), simd::u32(114));  // C
  simd::Mask ok = static_cast<simd::Mask>(~poisoned & simd::tail_mask(whole));
  ok = _mm512_mask_cmpgt_epi32_mask(ok, cc, _mm512_setzero_si512());
  ok = _mm512_mask_cmple_epi32_mask(ok, cc, simd::u32(26));
  if (sd == DType::f16) {
    const __m512i sig = _mm512_i32gather_epi32(iv, t.sig, 4);
    ok = _mm512_mask_cmpeq_epi32_mask(ok, sig, _mm512_and_si512(sb, simd::u32(0x007FFFFFu)));
  }
  if (ok == 0) return 0;
  alignas(64) uint32_t ti[16], c7[16];
  _mm512_store_si512(ti, iv);
  _mm512_store_si512(c7, _mm512_add_epi32(_mm512_mullo_epi32(cc, simd::u32(7)), simd::u32(28)));
  const auto tab = [&](int64_t k) { return _mm512_load_si512(t.t[ti[k]]); };
  const auto cvec = [&](int64_t k) { return _mm512_set1_epi16(static_cast<short>(c7[k])); };
  const uint32_t okb = ok;
  if (g == 128) {
    for (int64_t k = 0; k < whole; ++k) {
      if (!((okb >> k) & 1)) continue;
      const __m512i tb = tab(k), c = cvec(k);
      __m512i d[4];
      for (int s = 0; s < 4; ++s) d[s] = int4_tab16_step(_mm512_loadu_si512(x + k * 128 + 32 * s), tb, c);
      int4_tab16_store4(d, out + k * 64);
    }
    return ok;
  }
  // Groups of 32: one step each, four to a store where all four are taken.
  for (int64_t k = 0; k < whole; k += 4) {
    const uint32_t four = (okb >> k) & 15u;
    if (four == 15u && k + 4 <= whole) {
      __m512i d[4];
      for (int s = 0; s < 4; ++s) d[s] = int4_tab16_step(_mm512_loadu_si512(x + (k + s) * 32), tab(k + s), cvec(k + s));
      int4_tab16_store4(d, out + k * 16);
      continue;
    }
    for (int64_t s = 0; s < 4 && k + s < whole; ++s) {
      if (!((four >> s) & 1)) continue;
      const __m512i d = int4_tab16_step(_mm512_loadu_si512(x + (k + s) * 32), tab(k + s), cvec(k + s));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (k + s) * 16), _mm512_cvtepi32_epi8(d));
    }
  }
  return ok;
}
#else
static inline simd::Mask int4_tab_groups16(const uint16_t*, int64_t, int64_t, int64_t, __m512i, __m512, simd::Mask, DType,
                                           uint8_t*) {
  return 0;
}
#endif
