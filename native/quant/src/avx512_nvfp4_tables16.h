// NVFP4 elements of fp16 inputs by mantissa tables: encode_E2M1(x * factor) without the
// conversion and the multiplication, 32 inputs per step on 16-bit lanes. Needs AVX512-VBMI
// (vpermb); included by avx512_nvfp4.h inside namespace miles_quant::cpu::MQ_CPU_NS, after
// avx512_nvfp4_tables.h (whose argument this one extends) and nvfp4_elements256 (the fp32 path,
// which takes the rare steps the tables cannot). The block scale codes come from a table of the
// same form (nvfp4_build_tables16).
//
// Why tables give the contract's bits (a block of code c = (E << 3) | j that is not poisoned).
// - As for bf16 (avx512_nvfp4_tables.h): factor = fl(inv / dec(c)) has the mantissa of f_j =
//   fl(inv / (1 + j/8)), inv = fl(1 / s_g), and F = F_j + 7 - E for exponent field (F_j f_j's).
// - A normal fp16 x = (1 + m/1024) * 2^(e - 15) (m 10 bits, e 1..30) is the bf16 case with 10
//   mantissa bits and e + 112 for e: fl(x * factor) = P_m * 2^(...) with P_m = fl((1 + m/1024)
//   * f1_j) (f1_j = f_j at exponent field 127), P_m = p * 2^o, p in [1, 2), o in {0, 1} (P_m is
//   below 4), and u = min(max(e - C, 0), 8) with C = 130 + E - F_j (bf16's 242 + E - F_j less
//   112) gives b + 5 = u + o, b the exponent of the scaled value, as there.
// - E2M1 rounds p * 2^b by b and the class of p: {1}, (1, 1.25], (1.25, 1.5), [1.5, 1.75),
//   [1.75, 2). Class 4 at b rounds as class 0 at b + 1 for every b (kE2m1Grid), so the code is
//   kE2m1Grid4[4 * (u + o) + class] = kE2m1Grid4[4u + r] with r = 4o + class (class 4 counted
//   as class 0 of the next o): r(m) is 0..8 and never falls as m grows.
// - A table of 1024 entries is no single lookup, but r rises by one at a time and at most once
//   in any 16 consecutive m: P_m moves by at most 2^-9 a step and the class bounds are at least
//   0.25 apart; the one point class, p = 1 exactly, merges with class 4 before it and rises to
//   class 1 after it, one step each. So r(m) = D[k] + (m & 15 >= T[k]) with k = m >> 4, D[k] =
//   r(16k) and T[k] the first m & 15 where r rises (16 if none), and one byte holds both:
//   16 * D[k] + (16 - T[k]) mod 16, so that (byte + (m & 15)) >> 4 is r(m) (the carry out of the
//   low four bits is the rise). One 64-byte vpermb by m >> 4 per block (8 tables per matrix,
//   one per block scale mantissa j, two masked lookups per 32-input step of two blocks).
// - On a 16-bit lane: 64u + (m & 15) + byte, shifted right by four, is 4u + r (64u keeps the low
//   six bits clear), the index into kE2m1Grid4 (at most 32 + 8 = 40). 64u comes from the exponent
//   bits the table index x >> 4 already holds: ((x >> 4) & 0x7C0 | 0x800) -sat (64C + 0x800),
//   capped at 512; C is -31..24 for every global scale of a finite, non-zero fp16 tensor amax
//   (the all-zero tensor's scale, the 1e-10 clamp, takes the fp32 path: its C reaches -40), so
//   both stay positive 16-bit values.
// - e = 0 (zero or fp16 subnormal): a zero gets u = 0 where C >= 0, and the index is then r
//   (at most 8, b <= -3): code 0, sign kept, as x * factor. Where C >= 1 every x with e = 1
//   encodes to 0 (u = 0), so every fp16 subnormal (smaller) does too, as monotone rounding
//   gives: the same zero path holds. A batch with a block of C <= 0 masks zeros out of u
//   (their code is 0 whatever C) and gives any 32-input step with a subnormal x to the fp32
//   path: rare, a block whose scale is about 2^-8 of the tensor's or smaller.
// - e = 31 (Inf, NaN) only in poisoned blocks (with a given global scale): the caller zeroes them.
// tools/bench/quant_nvfp4_f16_tables_probe.cpp checks this against nvfp4_elements256<f16> for
// every finite fp16 input, every block scale code 8..126 and the global scales of every fp16
// amax mantissa at the largest and the smallest normal exponent and of every subnormal amax,
// where C reaches its ends (run by tests/test_quant_nvfp4_tables.py).

#if defined(__AVX512VBMI__)
// kE2m1Grid at 8 * (w - 2) + class (clamped to [0, 63]), stored at 4w + class: w = b + 5 in
// 0..10, class 0..3 (class 4 is class 0 at w + 1).
struct E2m1Grid4 {
  uint8_t g[64];
};
static constexpr E2m1Grid4 e2m1_grid4() {
  E2m1Grid4 r{};
  for (int w = 0; w <= 10; ++w) {
    for (int cls = 0; cls < 4; ++cls) {
      const int i = 8 * (w - 2) + cls;
      r.g[4 * w + cls] = kE2m1Grid[i < 0 ? 0 : i > 63 ? 63 : i];
    }
  }
  return r;
}
alignas(64) static constexpr E2m1Grid4 kE2m1Grid4 = e2m1_grid4();

// The tables of one global-scale mantissa (of the 1024 an fp16 tensor amax in [1, 2) gives).
struct Nvfp4Tables16 {
  alignas(64) uint8_t dt[8][64];  // [j][m >> 4] = 16 * D + (16 - T) mod 16 of r (above)
  alignas(64) uint8_t bs[64];     // [m >> 4]: the same of the block code offsets bs[m] (below)
  int32_t f[8];                   // F_j at the exponent field e
  int32_t r0;                     // the block code of y_0 (below)
  uint32_t e;                     // the exponent field of the global scale they were built for
  bool ok;                        // every step function had the shape above (always; else fp32)
};

// A matrix's view of its mantissa's tables: f[j] and K_g for its global scale's exponent.
struct Nvfp4Tab16 {
  const uint8_t* dt;          // Nvfp4Tables16::dt
  const uint8_t* bs;          // Nvfp4Tables16::bs
  alignas(64) int32_t f[16];  // [j] = F_j - 130 (so that C = E - f[j]); lanes 8-15 unused
  int32_t k_g;                // K_g (below)
  float inv;                  // 1 / s_g (the factors of the steps the fp32 path takes)
};

// The tables for global scale s_g (normal, positive). Block codes: as for bf16, the code of an
// fp16 block amax A (exact in fp32 as (1 + m/1024) * 2^(e - 127), e its fp32 exponent field,
// subnormal fp16 included) before the clamps is 8e + bs[m] + K_g with bs[m] = rn(y_m) - rn(y_0),
// y_m = fl(fl((1 + m/1024) / 6) / s_g'), K_g = rn(y_0) - 8 E_g (avx512_nvfp4_tables.h). bs[m]
// is 0..8, never falls and rises at most once in 16 steps of m (E4M3's grid is 1/8 of y apart, m
// moves y by 1/1024 of it), so it takes the element tables' form: (bs byte + (m & 15)) >> 4.
static inline void nvfp4_build_tables16(float s_g, Nvfp4Tables16* out) {
  const float inv = 1.0f / s_g;
  out->ok = true;
  uint32_t r[16];
  for (uint32_t j = 0; j < 8; ++j) {
    const float f = inv / decode<E4M3>((7u << 3) | j);  // dec = 1 + j/8
    const float f1 = bits_f32((f32_bits(f) & 0x007FFFFFu) | (127u << 23));
    out->f[j] = static_cast<int32_t>(f32_bits(f) >> 23);
    for (uint32_t k = 0; k < 64; ++k) {
      for (uint32_t i = 0; i < 16; ++i) {
        const uint32_t p = f32_bits(bits_f32((127u << 23) | ((16 * k + i) << 13)) * f1);
        const uint32_t o = (p >> 23) - 127u, frac = p & 0x007FFFFFu;
        const uint32_t cls = frac == 0 ? 0 : frac <= 0x200000u ? 1 : frac < 0x400000u ? 2 : frac < 0x600000u ? 3 : 4;
        r[i] = 4 * o + cls;
      }
      out->ok = step_table_byte(r, 8, &out->dt[j][k]) && out->ok;
    }
  }
  const float sg1 = bits_f32((f32_bits(s_g) & 0x007FFFFFu) | (127u << 23));
  for (uint32_t k = 0; k < 64; ++k) {
    for (uint32_t i = 0; i < 16; ++i) {
      // y in [1/12, 1/3]: a normal E4M3 target, so round_mag_rne's integer path.
      const float y = (bits_f32((127u << 23) | ((16 * k + i) << 13)) / E2M1::kMax) / sg1;
      r[i] = round_mag_rne<E4M3::kMbits, E4M3::kBias>(f32_bits(y));
    }
    if (k == 0) out->r0 = static_cast<int32_t>(r[0]);
    for (uint32_t i = 0; i < 16; ++i) r[i] -= static_cast<uint32_t>(out->r0);
    out->ok = step_table_byte(r, 8, &out->bs[k]) && out->ok;
  }
  out->e = f32_bits(s_g) >> 23;
}

// Which fp16 amax mantissa (0..1023) the global scale s_g is nvfp4_global_scale(A) of, for a
// finite fp16 A > 0; -1 for any other s_g (the all-zero tensor's scale included, above).
static inline int nvfp4_covered_mantissa16(float s_g) {
  if (!(s_g > 0.0f) || f32_bits(s_g) >= kF32InfBits) return -1;
  // s_g * 2688 is within two fp32 ulps of A, so A is the fp16 nearest it or a neighbour.
  const uint32_t h = f32_to_f16_satfinite(s_g * kNvfp4GlobalDivisor);
  for (const uint32_t c : {h - 1u, h, h + 1u}) {
    if (c == 0 || c > 0x7BFFu) continue;
    const float a = f16_to_f32(static_cast<uint16_t>(c));
    if (f32_bits(nvfp4_global_scale(a)) == f32_bits(s_g)) return static_cast<int>((f32_bits(a) >> 13) & 0x3FFu);
  }
  return -1;
}

// The tables of mantissa i, built on first use (about 24 us each) and kept for the process: every
// fp16 tensor amax is one of 1024 mantissas at one of 40 exponents, and a dynamic call meets a
// new one with every tensor. A race builds twice and keeps one.
static inline const Nvfp4Tables16& nvfp4_tables16_of(int i) {
  static std::atomic<const Nvfp4Tables16*> cache[1024];
  const Nvfp4Tables16* t = cache[i].load(std::memory_order_acquire);
  if (t != nullptr) return *t;
  auto* built = new Nvfp4Tables16;
  nvfp4_build_tables16(nvfp4_global_scale(bits_f32((127u << 23) | (static_cast<uint32_t>(i) << 13))), built);
  if (cache[i].compare_exchange_strong(t, built, std::memory_order_acq_rel)) return *built;
  delete built;
  return *t;
}

// The view of the tables for global scale s_g; false (out untouched) when the tables do not
// cover s_g (nvfp4_covered_mantissa16) or did not hold.
static inline bool nvfp4_tab16_for(float s_g, Nvfp4Tab16* out) {
  const int i = nvfp4_covered_mantissa16(s_g);
  if (i < 0) return false;
  const Nvfp4Tables16& t = nvfp4_tables16_of(i);
  if (!t.ok) return false;
  const int32_t k = static_cast<int32_t>(f32_bits(s_g) >> 23) - static_cast<int32_t>(t.e);
  out->dt = &t.dt[0][0];
  out->bs = t.bs;
  for (int j = 0; j < 8; ++j) out->f[j] = t.f[j] - k - 130;
  for (int j = 8; j < 16; ++j) out->f[j] = 0;
  out->k_g = t.r0 - 8 * static_cast<int32_t>(f32_bits(s_g) >> 23);
  out->inv = 1.0f / s_g;
  return true;
}

// The E4M3 block scale codes of 16 blocks from their fp16 amaxes (low 16 bits of each lane; the
// high bits may hold anything): nvfp4_block_code lane-wise, by the bs table (above). With Given
// (the global scale was given) a block holding a NaN or Inf gets the NaN code 0x7F, as
// nvfp4_codes gives it; the caller zeroes its elements.
template <bool Given>
static inline __m512i nvfp4_block_codes_tab16(__m512i h16, const Nvfp4Tab16& t) {
  const __m512i a = _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h16)));
  const __m512i b = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, _mm512_srli_epi32(a, 17), _mm512_load_si512(t.bs));
  const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(a, 13), simd::u32(15));
  const __m512i d = _mm512_srli_epi32(_mm512_add_epi32(b, lo), 4);  // bs[m]
  const __m512i e8 = _mm512_slli_epi32(_mm512_srli_epi32(a, 23), 3);
  __m512i c = _mm512_add_epi32(_mm512_add_epi32(e8, d), _mm512_set1_epi32(t.k_g));
  c = _mm512_min_epi32(_mm512_max_epi32(c, simd::u32(8)), simd::u32(E4M3::kMaxCode));
  if constexpr (Given) c = _mm512_mask_mov_epi32(c, _mm512_cmpge_epu32_mask(a, simd::u32(kF32InfBits)), simd::u32(E4M3::kNanCode));
  return c;
}

// The first half of an fp16 batch by the tables: its 16 block codes to `scales`.
template <bool Given>
static inline void nvfp4_scales256_tab16(const uint16_t* x, const Nvfp4Tab16& t, uint8_t* scales) {
  prefetch_lines(reinterpret_cast<const char*>(x) + simd::kPrefetchAhead, 0, 512);
  __m512i h[8];
  for (int j = 0; j < 8; ++j) h[j] = _mm512_and_si512(_mm512_loadu_si512(x + 32 * j), _mm512_set1_epi16(0x7FFF));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(scales), _mm512_cvtepi32_epi8(nvfp4_block_codes_tab16<Given>(block16_amax_halves(h), t)));
}

// The 8 steps of one batch (256 inputs, 16 blocks) by the tables: cw[k] holds 64 * C + 0x800 of
// block k in both halves, dt the matrix's tables. Per step, u comes from the exponent bits the
// table index already holds: ((x >> 4) & 0x7C0 | 0x800) -sat cw, capped at 512, is 64u (C >= -31
// keeps cw's halves positive), and the step's two blocks' cw are two dword broadcasts from memory.
// Risky (a block with C <= 0): zeros are masked out of u and a step holding an fp16 subnormal is
// left for the fp32 path: returns those steps (bit s).
template <bool Risky>
static inline uint32_t nvfp4_tab16_pass(const uint16_t* x, const uint32_t* cw, const uint8_t* codes, const uint8_t* dt,
                                        uint8_t* out) {
  const __m512i grid = _mm512_load_si512(kE2m1Grid4.g);
  const __m512i exp16 = _mm512_set1_epi16(0x7C00), e64 = _mm512_set1_epi16(0x07C0), top = _mm512_set1_epi16(0x0800);
  const __m512i cap = _mm512_set1_epi16(512), low4 = _mm512_set1_epi16(15), eight = _mm512_set1_epi16(8);
  const __m512i pair = _mm512_set1_epi32(0x00100001);  // element 2i * 1 + element 2i + 1 * 16
  const __m512i runs = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  constexpr __mmask64 kLow = 0x5555555555555555ull, kLowA = 0x0000000055555555ull, kLowB = 0x5555555500000000ull;
  uint32_t redo = 0;
  for (int g = 0; g < 2; ++g) {
    __m512i d[4];
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {
      const int s = 4 * g + h;
      const __m512i v = _mm512_loadu_si512(x + 32 * s);
      const __m512i idx = _mm512_srli_epi16(v, 4);  // low byte: m >> 4 (vpermb reads 6 bits)
      __m512i b = _mm512_maskz_permutexvar_epi8(kLowA, idx, _mm512_load_si512(dt + 64 * (codes[2 * s] & 7)));
      b = _mm512_mask_permutexvar_epi8(b, kLowB, idx, _mm512_load_si512(dt + 64 * (codes[2 * s + 1] & 7)));
      const __m512i c = _mm512_mask_set1_epi32(_mm512_set1_epi32(static_cast<int>(cw[2 * s])), 0xFF00, static_cast<int>(cw[2 * s + 1]));
      const __m512i y = _mm512_ternarylogic_epi32(idx, e64, top, 0xEA);  // (e << 6) | 0x800
      __m512i q;
      if constexpr (Risky) {
        const __mmask32 normal = _mm512_test_epi16_mask(v, exp16);
        const __mmask32 tiny = _mm512_mask_test_epi16_mask(static_cast<__mmask32>(~normal), v, _mm512_set1_epi16(0x3FF));
        redo |= static_cast<uint32_t>(tiny != 0) << s;
        q = _mm512_maskz_subs_epu16(normal, y, c);
      } else {
        q = _mm512_subs_epu16(y, c);
      }
      q = _mm512_min_epu16(q, cap);                                         // 64u
      __m512i w = _mm512_ternarylogic_epi32(q, v, low4, 0xF8);              // 64u | (m & 15)
      w = _mm512_srli_epi16(_mm512_add_epi16(w, b), 4);                     // 4u + r
      __m512i code = _mm512_maskz_permutexvar_epi8(kLow, w, grid);
      code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi16(idx, 8), eight, 0xF8);  // sign (bit 15) to bit 3
      d[h] = _mm512_madd_epi16(code, pair);
    }
    const __m512i p = _mm512_packus_epi16(_mm512_packus_epi32(d[0], d[1]), _mm512_packus_epi32(d[2], d[3]));
    _mm512_storeu_si512(out + 64 * g, _mm512_permutexvar_epi32(runs, p));
  }
  return redo;
}

// 16 whole 1x16 fp16 blocks (256 inputs) whose block scale codes are codes[0, 16), packed: the
// bytes of nvfp4_elements256<f16>.
static inline void nvfp4_elements256_tab16(const uint16_t* x, const uint8_t* codes, const Nvfp4Tab16& t, uint8_t* out) {
  const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m512i fj = _mm512_permutexvar_epi32(_mm512_and_si512(code, simd::u32(7)), _mm512_load_si512(t.f));
  const __m512i cc = _mm512_sub_epi32(_mm512_srli_epi32(code, 3), fj);  // C
  const __m512i cw = _mm512_add_epi32(_mm512_slli_epi32(cc, 6), simd::u32(0x800));
  alignas(64) uint32_t cw2[16];
  _mm512_store_si512(cw2, _mm512_or_si512(cw, _mm512_slli_epi32(cw, 16)));
  uint32_t redo = 0;
  if (_mm512_cmple_epi32_mask(cc, _mm512_setzero_si512()) != 0)
    redo = nvfp4_tab16_pass<true>(x, cw2, codes, t.dt, out);
  else
    nvfp4_tab16_pass<false>(x, cw2, codes, t.dt, out);
  for (; redo != 0; redo &= redo - 1) {
    const int s = __builtin_ctz(redo);
    for (int k = 2 * s; k < 2 * s + 2; ++k) {
      const __m512 f = _mm512_set1_ps(nvfp4_block_factor(t.inv, codes[k]));
      const __m512 v = _mm512_mul_ps(simd::load<DType::f16>(x + 16 * k, 0xFFFF), f);
      simd::store_nibbles16(out + 8 * k, e2m1_code(v));
    }
  }
}
#else
struct Nvfp4Tab16 {};
static inline bool nvfp4_tab16_for(float, Nvfp4Tab16*) { return false; }
template <bool Given>
static inline void nvfp4_scales256_tab16(const uint16_t*, const Nvfp4Tab16&, uint8_t*) {}
template <bool Given>
static inline __m512i nvfp4_block_codes_tab16(__m512i, const Nvfp4Tab16&) { return _mm512_setzero_si512(); }
static inline void nvfp4_elements256_tab16(const uint16_t*, const uint8_t*, const Nvfp4Tab16&, uint8_t*) {}
#endif
