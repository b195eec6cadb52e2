// INT4 (int4_g32, int4_g128) of bf16 inputs by mantissa tables: the contract's int4_code(x, s)
// without a division, 64 inputs per instruction on byte lanes. Needs AVX512-VBMI (vpermi2b,
// vpmultishiftqb); included by avx512_int4.h inside namespace miles_quant::cpu::MQ_CPU_NS,
// after int4_store_scales and before int4_rows_v, whose fp32 lanes (int4_codes) encode every
// group the tables leave. Without VBMI, kInt4Tables is false and the fp32 path runs everywhere.
//
// Why tables give the contract's bits. Take a group that is not poisoned, with stored scale s
// (store_scale: fp32, or rounded to bf16 / fp16 and widened back; a normal fp32 from about 1e-5
// to 2^126), s = s1 * 2^(E - 127) with s1 in [1, 2) and E its exponent field (110..252).
// - For a normal bf16 x = (1 + m/128) * 2^(e - 127), fl(|x| / s) = P_m * 2^(e - E) with P_m =
//   fl((1 + m/128) / s1) in [0.5, 2): dividing by a power of two is exact scaling while the
//   quotient is a normal fp32. Below that (quotients under 2^-126, and a zero or subnormal x,
//   for any E >= 2) both sides have a magnitude under 0.5: code 8. A quotient that overflows
//   (never in a group: |x| <= amax keeps it under 2^113) is +-Inf, 7 on both sides.
// - int4_code's magnitude RNE(min(|y|, 7)) of y = p * 2^b (p in [1, 2)) depends on b and on
//   which of eight classes p falls in, ties to even: {1}, (1, 1.125], (1.125, 1.25],
//   (1.25, 1.375), [1.375, 1.5), [1.5, 1.625], (1.625, 1.75), [1.75, 2) (a boundary is where
//   y is a tie: 0.5 at p = 1, b = -1; 1.5 at p = 1.5, b = 0; 2.5 and 3.5 at p = 1.25 and 1.75,
//   b = 1; 4.5, 5.5 and 6.5 at p = 1.125, 1.375 and 1.625, b = 2); b <= -2 gives 0 and b >= 3
//   gives 7 (kInt4Mag below lists the rest). With P_m = p * 2^o (o = -1 or 0), b = e - E + o.
// - The table byte of (s1, m) is o + 1 + 8 * class (at most 57). u = min(e -sat (E - 2), 6),
//   one saturating byte subtraction and one vpminub, gives w = u + o + 1 = b + 3 where e - E + 2
//   is in [0, 6]; where it is below 0, w <= 1 and b <= -3 (both code 0); above 6, w >= 6 and
//   b >= 4 (both 7). So the byte w + 8 * class (at most 63) indexes the magnitude exactly. The
//   sign is x's (zeros included: +-0 and a magnitude 0 both give 8); as bit 6 of that index it
//   makes one 128-byte vpermi2b return 8 + q or 8 - q (kInt4Grid).
// - s1 depends only on the group amax A's 7 mantissa bits mA (s = fl(A / 7) is exact scaling of
//   fl((1 + mA/128) / 7), and rounding a normal value to bf16 or to a normal fp16 is
//   scale-invariant too), or on nothing under the 1e-5 clamp: 129 tables per scale dtype,
//   indexed by mA (128 for the clamp), built at a reference exponent; for fp32 and bf16 scales
//   that is every case. fp16 scales below 2^-14 (fp16 subnormals keep fewer bits: amaxes from
//   7e-5 to 4.3e-4) or saturated at 65504 (amaxes above about 4.6e5) break it, so for fp16
//   the kernel compares the stored scale's mantissa field with the one its table was built for
//   (Int4Tables::sig) and sends a group that differs to the fp32 path. That check is all the
//   tables need: a table gives the codes of its s1 at every exponent, whatever chose it.
// Non-whole groups (the end of a row) and poisoned ones also take the fp32 path. Tables: 129 x
// 128 bytes per scale dtype (16.1 KiB; each built on its first use by 16,512 fp32 divisions),
// plus the 128-byte code grid. tools/bench/quant_int4_tables_probe.cpp checks int4_tab64
// against the fp32 lanes for every table, every E in [2, 254] and every finite bf16 x, and
// int4_tab_groups for every non-poisoned bf16 group amax, every bf16 x with |x| <= amax, every
// scale dtype and both group sizes (run by tests/test_quant_int4_tables.py).

#if defined(__AVX512VBMI__)
constexpr bool kInt4Tables = true;

// [8 * class + w]: the magnitude of the code of p * 2^(w - 3), p in class 0..7 (above); 64 bytes.
alignas(64) static constexpr uint8_t kInt4Mag[64] = {
    0, 0, 0, 1, 2, 4, 7, 7,  // p = 1: 0.5 ties to 0, 2.5 to 2, 4.5 to 4
    0, 0, 1, 1, 2, 4, 7, 7,  // (1, 1.125]
    0, 0, 1, 1, 2, 5, 7, 7,  // (1.125, 1.25]: 2.5 ties to 2
    0, 0, 1, 1, 3, 5, 7, 7,  // (1.25, 1.375)
    0, 0, 1, 1, 3, 6, 7, 7,  // [1.375, 1.5): 5.5 ties to 6
    0, 0, 1, 2, 3, 6, 7, 7,  // [1.5, 1.625]: 1.5 ties to 2, 6.5 to 6
    0, 0, 1, 2, 3, 7, 7, 7,  // (1.625, 1.75): above 6.5 is 7 (the clamp)
    0, 0, 1, 2, 4, 7, 7, 7,  // [1.75, 2): 3.5 ties to 4
};

// The offset-binary codes: [index] = 8 + magnitude for index < 64, 8 - magnitude of index - 64
// above (x negative; bit 6 of the index is x's sign).
struct Int4Grid {
  uint8_t g[128];
};
static constexpr Int4Grid int4_grid() {
  Int4Grid r{};
  for (int i = 0; i < 64; ++i) {
    r.g[i] = static_cast<uint8_t>(8 + kInt4Mag[i]);
    r.g[64 + i] = static_cast<uint8_t>(8 - kInt4Mag[i]);
  }
  return r;
}
alignas(64) static constexpr Int4Grid kInt4Grid = int4_grid();

struct Int4Tables {
  alignas(64) uint8_t t[129][128];  // [amax mantissa, or 128 for the 1e-5 clamp][x mantissa]
  uint32_t sig[129];                // mantissa field (fp32) of the s1 each table is for
  uint32_t clamp_below;             // amaxes (fp32 bits) below this have the clamped scale
};

// The class (above) of P's significand p, from P's fp32 mantissa field f (p = 1 + f / 2^23).
static inline uint32_t int4_class(uint32_t f) {
  if (f <= 0x200000u) return f == 0 ? 0 : f <= 0x100000u ? 1 : 2;  // {1}, (1, 1.125], (1.125, 1.25]
  if (f < 0x400000u) return f < 0x300000u ? 3 : 4;                  // (1.25, 1.375), [1.375, 1.5)
  return f <= 0x500000u ? 5 : f < 0x600000u ? 6 : 7;               // [1.5, 1.625], (1.625, 1.75), [1.75, 2)
}

// The tables of scale dtype sd. Reference amaxes 1 + i/128 give scales in [1/7, 2/7), normal in
// all three dtypes, so s1 is that of every normal stored scale of amax mantissa i; amax 0 gives
// the clamp's scale.
static inline void int4_build_tables(DType sd, Int4Tables* t) {
  // fl(A / 7) is monotone in A: binary search for the smallest A whose scale is not clamped.
  uint32_t lo_bits = 0, hi_bits = kF32InfBits;
  while (lo_bits < hi_bits) {
    const uint32_t mid = lo_bits + (hi_bits - lo_bits) / 2;
    if (bits_f32(mid) / kInt4Qmax < kInt4ScaleMin)
      lo_bits = mid + 1;
    else
      hi_bits = mid;
  }
  t->clamp_below = lo_bits;
  for (uint32_t i = 0; i < 129; ++i) {
    const float amax = i < 128 ? bits_f32((127u << 23) | (i << 16)) : 0.0f;
    uint32_t stored_bits = 0;  // store_scale's buffer (2 or 4 bytes)
    const float s = store_scale(int4_scale(amax), sd, &stored_bits, 0);
    t->sig[i] = f32_bits(s) & 0x007FFFFFu;
    const float s1 = bits_f32(t->sig[i] | (127u << 23));
    for (uint32_t m = 0; m < 128; ++m) {
      const uint32_t p = f32_bits(bits_f32((127u << 23) | (m << 16)) / s1);  // in [0.5, 2)
      t->t[i][m] = static_cast<uint8_t>((p >> 23) - 126u + 8u * int4_class(p & 0x007FFFFFu));
    }
  }
}

template <DType SD>
static const Int4Tables& int4_tables_of() {
  static const Int4Tables tables = [] {
    Int4Tables t;
    int4_build_tables(SD, &t);
    return t;
  }();
  return tables;
}
static inline const Int4Tables& int4_tables(DType sd) {
  if (sd == DType::f32) return int4_tables_of<DType::f32>();
  return sd == DType::bf16 ? int4_tables_of<DType::bf16>() : int4_tables_of<DType::f16>();
}

// 64 bf16 inputs (v0: elements 0-31, v1: 32-63) to 32 packed bytes (element 0 in the low
// nibble). Inputs 0-31 use table (a0, a1) and lanes 0-31 of c, inputs 32-63 table (b0, b1) and
// lanes 32-63 of c (c: E - 2 of the group's stored scale); with kTwo false (a0, a1) serves all
// 64 (one group, or the first half only of a lone 32-group).
template <bool kTwo>
static inline __m256i int4_tab64(__m512i v0, __m512i v1, __m512i a0, __m512i a1, __m512i b0, __m512i b1, __m512i c) {
  // Byte lane i: the low byte of input i (exponent bit 0 and the mantissa m, the table index;
  // vpermi2b reads bits 0-6), its exponent field e (bits 7-14), and bits 9-16 of it (the sign at
  // bit 6; the rest is masked off below): two vpmultishiftqb put e and bits 9-16 of each input in
  // its two bytes, and three vpermt2b gather the 64 lanes (simd::bf16_lo_idx: the low byte of
  // each 16-bit lane; + 1: the high byte).
  const __m512i lo_idx = simd::bf16_lo_idx();
  const __m512i hi_idx = _mm512_add_epi8(lo_idx, _mm512_set1_epi8(1));
  const __m512i fields = _mm512_set1_epi64(0x3937292719170907ll);  // bit offsets 16j + 7, 16j + 9
  const __m512i f0 = _mm512_multishift_epi64_epi8(fields, v0), f1 = _mm512_multishift_epi64_epi8(fields, v1);
  const __m512i lo = _mm512_permutex2var_epi8(v0, lo_idx, v1);
  const __m512i e = _mm512_permutex2var_epi8(f0, lo_idx, f1);
  const __m512i sign = _mm512_permutex2var_epi8(f0, hi_idx, f1);
  __m512i tab = _mm512_permutex2var_epi8(a0, lo, a1);  // o + 1 + 8 * class
  if constexpr (kTwo) tab = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, tab, _mm512_permutex2var_epi8(b0, lo, b1));
  const __m512i w = _mm512_add_epi8(_mm512_min_epu8(_mm512_subs_epu8(e, c), _mm512_set1_epi8(6)), tab);
  const __m512i idx = _mm512_ternarylogic_epi32(w, sign, _mm512_set1_epi8(0x40), 0xF8);  // w | (sign & 0x40)
  const __m512i code = _mm512_permutex2var_epi8(_mm512_load_si512(kInt4Grid.g), idx, _mm512_load_si512(kInt4Grid.g + 64));
  return _mm512_cvtepi16_epi8(_mm512_maddubs_epi16(code, _mm512_set1_epi16(0x1001)));  // 2i + 16 * (2i + 1)
}

// The groups of one batch of int4_rows_v (nb <= 16 groups of g inputs, x and out at its first
// group, n inputs left in the row; amax, sv and poisoned as int4_rows_v has them) that the
// tables cover: whole groups (g = 32 or 128), not poisoned, and with fp16 scales only those
// whose stored scale has the mantissa field of their table. Encodes those; returns their mask.
static inline simd::Mask int4_tab_groups(const uint16_t* x, int64_t n, int64_t g, int64_t nb, __m512i amax, __m512 sv,
                                         simd::Mask poisoned, DType sd, uint8_t* out) {
  if (g != 32 && g != 128) return 0;
  const Int4Tables& t = int4_tables(sd);
  const int64_t whole = lo(nb, n / g);
  const __m512i sb = _mm512_castps_si512(sv);
  const simd::Mask clamp = _mm512_cmplt_epu32_mask(amax, simd::u32(t.clamp_below));
  const __m512i iv = _mm512_mask_mov_epi32(_mm512_and_si512(_mm512_srli_epi32(amax, 16), simd::u32(0x7F)), clamp, simd::u32(128));
  simd::Mask ok = static_cast<simd::Mask>(~poisoned & simd::tail_mask(whole));
  if (sd == DType::f16) {  // the stored scale's mantissa field must be its table's (above)
    const __m512i sig = _mm512_i32gather_epi32(iv, t.sig, 4);
    ok = _mm512_mask_cmpeq_epi32_mask(ok, sig, _mm512_and_si512(sb, simd::u32(0x007FFFFFu)));
  }
  if (ok == 0) return 0;
  // The table numbers (at most 128), a byte each, in two GPRs: loading them one by one from a
  // stored vector stalled every batch (groups of 32 in L1: 0.10 ns/el that way, 0.065 this way).
  const __m128i ib = _mm512_cvtepi32_epi8(iv);
  const uint64_t ib_lo = static_cast<uint64_t>(_mm_cvtsi128_si64(ib)), ib_hi = static_cast<uint64_t>(_mm_extract_epi64(ib, 1));
  const auto table = [&](int64_t k) { return t.t[((k < 8 ? ib_lo : ib_hi) >> (8 * (k & 7))) & 0xFFu]; };
  // Byte k: E - 2 of group k's stored scale (always a normal fp32 above 2^-17: E - 2 >= 108).
  const __m512i cb = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(_mm512_sub_epi32(_mm512_srli_epi32(sb, 23), simd::u32(2))));
  const uint32_t okb = ok;
  if (g != 32) {
    for (int64_t k = 0; k < whole; ++k) {
      if (!((okb >> k) & 1)) continue;
      const uint8_t* ta = table(k);
      const __m512i a0 = _mm512_load_si512(ta), a1 = _mm512_load_si512(ta + 64);
      const __m512i c = _mm512_permutexvar_epi8(_mm512_set1_epi8(static_cast<char>(k)), cb);
      for (int64_t i = 0; i < g; i += 64) {
        const uint16_t* xi = x + k * g + i;
        const __m256i r = int4_tab64<false>(_mm512_loadu_si512(xi), _mm512_loadu_si512(xi + 32), a0, a1, a0, a1, c);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (k * g + i) / 2), r);
      }
    }
    return ok;
  }
  // Groups of 32: groups k and k + 1 (k even) share a step, c's lanes 32-63 are group k + 1's.
  __m512i pair = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, _mm512_setzero_si512(), _mm512_set1_epi8(1));
  for (int64_t k = 0; k < whole; k += 2, pair = _mm512_add_epi8(pair, _mm512_set1_epi8(2))) {
    const uint32_t both = (okb >> k) & 3u;
    if (both == 0) continue;
    const __m512i c = _mm512_permutexvar_epi8(pair, cb);
    if (both == 3) {
      const uint8_t *ta = table(k), *tb = table(k + 1);
      const __m256i r = int4_tab64<true>(_mm512_loadu_si512(x + k * 32), _mm512_loadu_si512(x + k * 32 + 32),
                                         _mm512_load_si512(ta), _mm512_load_si512(ta + 64), _mm512_load_si512(tb),
                                         _mm512_load_si512(tb + 64), c);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k * 16), r);
    } else {  // one group of the two: the half of a step that holds it
      const int64_t h = both == 2 ? 1 : 0;
      const uint8_t* ta = table(k + h);
      const __m512i v = _mm512_loadu_si512(x + (k + h) * 32);
      const __m256i r = int4_tab64<false>(v, v, _mm512_load_si512(ta), _mm512_load_si512(ta + 64), _mm512_setzero_si512(),
                                          _mm512_setzero_si512(), h ? _mm512_shuffle_i64x2(c, c, 0xEE) : c);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (k + h) * 16), _mm256_castsi256_si128(r));
    }
  }
  return ok;
}
#else
constexpr bool kInt4Tables = false;
static inline simd::Mask int4_tab_groups(const uint16_t*, int64_t, int64_t, int64_t, __m512i, __m512, simd::Mask, DType,
                                         uint8_t*) {
  return 0;
}
#endif
