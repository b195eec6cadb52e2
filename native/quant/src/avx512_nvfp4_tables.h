// NVFP4 elements of bf16 inputs by mantissa tables: the contract's encode_E2M1(x * factor)
// without a multiplication, 64 inputs per instruction on byte lanes. Needs AVX512-VBMI
// (vpermi2b, vpermb); included by avx512_nvfp4.h inside namespace miles_quant::cpu::MQ_CPU_NS,
// after nvfp4_elements256 (the path it replaces). Without VBMI, kNvfp4Tables is false.
//
// Why tables give the contract's bits (a matrix that is not poisoned, a 1x16 block of code c):
// - factor = fl(inv / dec(c)) with inv = fl(1 / s_g) and dec(c) = (1 + j/8) * 2^E, j = c & 7
//   (block scales are clamped to [2^-6, 448]: always normal). Dividing by 2^E is exact scaling,
//   so factor's mantissa is that of fl(inv / (1 + j/8)): 8 possible mantissas per matrix, and
//   8 tables of 128 bytes (nvfp4_build_tables; 1024 fp32 products), built once per process for
//   each of the mantissas a global scale can have and patched for its exponent (nvfp4_tables_for).
// - For a normal bf16 x = (1 + m/128) * 2^(e - 127), fl(x * factor) = P_m * 2^(e - 127 + F - 127)
//   with P_m = fl((1 + m/128) * f1), f1 = factor with its exponent field set to 127, and F the
//   exponent field of factor (exact scaling while the product is a normal fp32; a smaller one
//   encodes to 0 either way). Write P_m = p * 2^o (p in [1, 2), o in 0..2).
// - E2M1's grid (0, 0.5, 1, 1.5, 2, 3, 4, 6) rounds a value p * 2^b, ties to even, by b and by
//   which of five classes p falls in: {1}, (1, 1.25], (1.25, 1.5), [1.5, 1.75), [1.75, 2)
//   (kE2m1Grid in avx512_bytes.h lists the codes; b <= -3 gives 0, b >= 3 saturates to 6.0).
// - So the table byte holds o and the class of P_m, and b = e + F - 251 + o - 3. With E the
//   code's exponent field (dec(c) = (1 + j/8) * 2^(E - 7)) F = F_j + 7 - E, F_j the exponent
//   field of fl(inv / (1 + j/8)), so b + 3 = U + o with U = e + F_j - 244 - E: one saturating
//   byte subtraction of the block's C = 242 + E - F_j from e and one 64-byte vpermb give the
//   code (kE2m1Grid11). A bf16 zero or subnormal x (e = 0) saturates to 0, a code 0, as
//   its product does (|x * factor| < 2^-70). The sign is x's (zeros included), as for x * factor.
// - The block scale codes need no division either: with the tensor amax's scale s_g fixed,
//   fl(fl(A / 6) / s_g) for a bf16 block amax A = (1 + m/128) * 2^(e - 127) is y_m * 2^(e - E_g)
//   (y_m = fl(fl((1 + m/128) / 6) / s_g') with s_g' = s_g at exponent field 127, E_g s_g's
//   field), so its E4M3 code before the clamps is 8 * e + bs[m] + K_g, one more 128-byte table;
//   clamping that code to [8, 126] is the contract's clamp of the value to [2^-6, 448] (a zero,
//   subnormal or tiny A gives a code far below 8).
// tools/bench/quant_nvfp4_tables_probe.cpp checks this against nvfp4_elements256 for every bf16
// input (NaN excepted), every block scale code 8..126 and all 129 global-scale mantissas a bf16
// tensor can have, at several exponents, and the block codes against nvfp4_block_code for every
// bf16 block amax up to the tensor's (run by tests/test_quant_nvfp4_tables.py).

#if defined(__AVX512VBMI__)
constexpr bool kNvfp4Tables = true;

// The element loop works on bytes, 64 inputs at a time. With U = e + F_j - 244 - E (so that
// b + 3 = U + o, above), an element is 0 for U <= -2 and saturated for U >= 6 whatever o (0..2)
// and the class are, so u = min(max(U + 2, 0), 8), a byte, loses nothing: u = min(subs_u8(e, C),
// 8) with the block's C = 242 + E - F_j (72..248 for every global scale a tensor can have: F_j
// is 9..171, E 1..15). The table byte is o + 11 * class and w = u + o is b + 5, so one 64-byte
// lookup at u + table byte (at most 54) gives the code: kE2m1Grid11 (kE2m1Grid at
// 8 * (w - 2) + class, clamped to [0, 63]).
//
// One table instead of 8: for most global scales (118 of the 128 mantissas a bf16 tensor amax
// can have) integers A[m] and B[j] exist with t[j][m] = G[A[m] - B[j]] for one 128-byte G and
// every (j, m) (tools/gen_nvfp4_embeddings.py finds them by an integer program and writes them
// to avx512_nvfp4_embeddings.inc, keyed by the mantissa of 1 / s_g). The loop then looks up A by
// m and G by A[m] - B[j], both tables in registers, with B[j] a byte per block beside C: no
// table loads and no per-block masked lookups (0.124 -> 0.060 ns per element in L1). The kernel
// does not trust the file: nvfp4_embed builds G from t and uses it only when every (j, m) lands
// in [0, 127] on an entry holding its own t[j][m]; otherwise the 8 tables stay in use.
struct Nvfp4Tables {
  alignas(64) uint8_t t[8][128];  // [block scale mantissa j][x mantissa m] = o + 11 * class
  alignas(64) uint8_t bs[128];    // [block amax mantissa m]: bs[m] (above)
  alignas(64) int32_t cj[16];     // [j] = 242 - F_j (C = cj[j] + E); lanes 8-15 unused
  int32_t k_g;                    // K_g
  bool one;                       // t[j][m] = g[a[m] - bj[j]] for every (j, m): the one table
  alignas(64) uint8_t a[128];     // [m] = A[m]
  alignas(64) uint8_t g[128];     // G
  alignas(64) int32_t bj[16];     // [j] = B[j]; 0 without the one table; lanes 8-15 unused
  alignas(64) uint32_t cb[16];    // [j] = cj[j] mod 256 | B[j] << 8 (nvfp4_block_kk); lanes 8-15 0
};

// An entry of avx512_nvfp4_embeddings.inc: key = the mantissa bits of 1 / s_g, A[0] and A's
// increments as digits.
struct Nvfp4Embedding {
  uint32_t key;
  uint8_t b[8];
  uint8_t a0;
  const char* steps;  // 127 digits: A[m + 1] - A[m]
};
#include "avx512_nvfp4_embeddings.inc"

// Sets out->one, a, g and bj from the entry for 1 / s_g = inv (if any) and the tables t.
static inline void nvfp4_embed(float inv, Nvfp4Tables* out) {
  out->one = false;
  for (uint32_t j = 0; j < 16; ++j) out->bj[j] = 0;
  const uint32_t key = f32_bits(inv) & 0x007FFFFFu;
  const Nvfp4Embedding* e = std::lower_bound(std::begin(kNvfp4Embeddings), std::end(kNvfp4Embeddings), key,
                                             [](const Nvfp4Embedding& x, uint32_t k) { return x.key < k; });
  if (e == std::end(kNvfp4Embeddings) || e->key != key) return;
  uint32_t a = e->a0;
  for (uint32_t m = 0; m < 128; ++m) {
    if (m > 0) a += static_cast<uint32_t>(e->steps[m - 1] - '0');
    out->a[m] = static_cast<uint8_t>(a);
  }
  bool set[128] = {};
  for (uint32_t j = 0; j < 8; ++j) {
    for (uint32_t m = 0; m < 128; ++m) {
      const int32_t idx = static_cast<int32_t>(out->a[m]) - e->b[j];
      if (idx < 0 || idx > 127) return;
      if (set[idx] && out->g[idx] != out->t[j][m]) return;
      set[idx] = true;
      out->g[idx] = out->t[j][m];
    }
  }
  for (uint32_t i = 0; i < 128; ++i)
    if (!set[i]) out->g[i] = 0;  // reached by no input
  for (uint32_t j = 0; j < 8; ++j) out->bj[j] = e->b[j];
  out->one = true;
}

// The tables of a matrix with global scale s_g (not NaN).
static inline void nvfp4_build_tables(float s_g, Nvfp4Tables* out) {
  const float inv = 1.0f / s_g;
  for (uint32_t j = 0; j < 8; ++j) {
    const float f = inv / decode<E4M3>((7u << 3) | j);  // dec = 1 + j/8
    const float f1 = bits_f32((f32_bits(f) & 0x007FFFFFu) | (127u << 23));
    for (uint32_t m = 0; m < 128; ++m) {
      const uint32_t p = f32_bits(bits_f32((127u << 23) | (m << 16)) * f1);
      const uint32_t o = (p >> 23) - 127u, frac = p & 0x007FFFFFu;
      const uint32_t cls = frac == 0 ? 0 : frac <= 0x200000u ? 1 : frac < 0x400000u ? 2 : frac < 0x600000u ? 3 : 4;
      out->t[j][m] = static_cast<uint8_t>(o + 11 * cls);
    }
    out->cj[j] = 242 - static_cast<int32_t>(f32_bits(f) >> 23);
  }
  for (uint32_t j = 8; j < 16; ++j) out->cj[j] = 0;
  const float sg1 = bits_f32((f32_bits(s_g) & 0x007FFFFFu) | (127u << 23));
  uint32_t r0 = 0;
  for (uint32_t m = 0; m < 128; ++m) {
    // y in [1/12, 1/3]: a normal E4M3 target, so round_mag_rne's integer path.
    const float y = (bits_f32((127u << 23) | (m << 16)) / E2M1::kMax) / sg1;
    const uint32_t r = round_mag_rne<E4M3::kMbits, E4M3::kBias>(f32_bits(y));
    if (m == 0) r0 = r;
    out->bs[m] = static_cast<uint8_t>(r - r0);
  }
  out->k_g = static_cast<int32_t>(r0) - 8 * static_cast<int32_t>(f32_bits(s_g) >> 23);
  nvfp4_embed(inv, out);
  for (uint32_t j = 0; j < 16; ++j)
    out->cb[j] = (static_cast<uint32_t>(out->cj[j]) & 0xFFu) | (static_cast<uint32_t>(out->bj[j]) << 8);
}

// Which bf16 amax mantissa the global scale s_g comes from (0..127, or 128 for the 1e-10 clamp),
// or -1 when s_g is no nvfp4_global_scale(A) of a finite bf16 A >= 0.
static inline int nvfp4_covered_mantissa(float s_g) {
  if (f32_bits(s_g) == f32_bits(nvfp4_global_scale(0.0f))) return 128;
  // s_g * 2688 is within two fp32 ulps of A: truncated to bf16 it is A or the bf16 below it.
  const uint32_t a = f32_bits(s_g * kNvfp4GlobalDivisor) & 0xFFFF0000u;
  for (const uint32_t c : {a, a + 0x10000u})
    if (c < kF32InfBits && f32_bits(nvfp4_global_scale(bits_f32(c))) == f32_bits(s_g)) return static_cast<int>((c >> 16) & 0x7Fu);
  return -1;
}

// Whether the tables hold for the global scale s_g: whether s_g is nvfp4_global_scale(A) for a
// finite bf16 A >= 0 (the 1e-10 clamp included), the scales quant_nvfp4_tables_probe.cpp
// covers. Always so for a computed scale; a given one (Nvfp4Args::given_scale) may not be.
static inline bool nvfp4_tables_cover(float s_g) { return nvfp4_covered_mantissa(s_g) >= 0; }

// The tables of a global scale the tables cover (nvfp4_tables_cover), without building them:
// everything in them but C's constant and K_g depends on s_g's mantissa alone (1 / s_g, the
// factors and the block scale quotients scale exactly with s_g's power of two), and a covered
// s_g has one of 129 mantissas (those of the 128 bf16 amax mantissas, and the clamp's). So each
// mantissa's tables are built once per process, at the exponent of an amax in [1, 2), and a
// scale 2^k times that one takes a copy with cj[j] + k (F_j - k) and K_g - 8k (about 0.1 us
// against 2 us for nvfp4_build_tables: a dynamic NVFP4 call builds per matrix, and small calls
// meet a new scale every time). quant_nvfp4_tables_probe.cpp checks the copies against
// nvfp4_build_tables for every covered scale.
struct Nvfp4TablesByMantissa {
  Nvfp4Tables t[129];  // [amax mantissa, or 128 for the 1e-10 clamp]
  uint32_t e[129];     // the exponent field of their global scale
};
static inline const Nvfp4TablesByMantissa& nvfp4_tables_by_mantissa() {
  static const Nvfp4TablesByMantissa* all = [] {
    auto* a = new Nvfp4TablesByMantissa;
    for (uint32_t i = 0; i < 129; ++i) {
      const float s_g = nvfp4_global_scale(i < 128 ? bits_f32((127u << 23) | (i << 16)) : 0.0f);
      nvfp4_build_tables(s_g, &a->t[i]);
      a->e[i] = f32_bits(s_g) >> 23;
    }
    return a;
  }();
  return *all;
}

// nvfp4_build_tables(s_g, out) for a covered s_g, from nvfp4_tables_by_mantissa; false (out
// untouched) when s_g is not covered.
static inline bool nvfp4_tables_for(float s_g, Nvfp4Tables* out) {
  const int i = nvfp4_covered_mantissa(s_g);
  if (i < 0) return false;
  const Nvfp4TablesByMantissa& all = nvfp4_tables_by_mantissa();
  *out = all.t[i];
  const int32_t k = static_cast<int32_t>(f32_bits(s_g) >> 23) - static_cast<int32_t>(all.e[i]);
  for (uint32_t j = 0; j < 8; ++j) {
    out->cj[j] += k;
    out->cb[j] = (static_cast<uint32_t>(out->cj[j]) & 0xFFu) | (out->cb[j] & 0xFF00u);
  }
  out->k_g -= 8 * k;
  return true;
}

// The E4M3 block scale codes of 16 blocks from their bf16 amaxes (low 16 bits of each lane; the
// high bits may hold anything): nvfp4_block_code lane-wise.
static inline __m512i nvfp4_block_codes_tab(__m512i h16, const Nvfp4Tables& t) {
  const __m512i d = _mm512_maskz_permutex2var_epi8(0x1111111111111111ull, _mm512_load_si512(t.bs), h16, _mm512_load_si512(t.bs + 64));
  const __m512i e8 = _mm512_and_si512(_mm512_srli_epi32(h16, 4), simd::u32(0x7F8));
  const __m512i c = _mm512_add_epi32(_mm512_add_epi32(e8, d), _mm512_set1_epi32(t.k_g));
  return _mm512_min_epi32(_mm512_max_epi32(c, simd::u32(8)), simd::u32(E4M3::kMaxCode));
}

// nvfp4_block_kk's vpermb index: byte 2, 0, 1 of dword k to bytes k, 16 + k, 32 + k.
struct Nvfp4KkGather {
  uint8_t b[64];
};
static constexpr Nvfp4KkGather nvfp4_kk_gather() {
  Nvfp4KkGather r{};
  for (int k = 0; k < 16; ++k) {
    r.b[k] = static_cast<uint8_t>(4 * k + 2);
    r.b[16 + k] = static_cast<uint8_t>(4 * k);
    r.b[32 + k] = static_cast<uint8_t>(4 * k + 1);
  }
  return r;
}
alignas(64) static constexpr Nvfp4KkGather kNvfp4KkGather = nvfp4_kk_gather();

// The bytes a batch of 16 blocks needs, from their codes (lane k: block k's code, below 128):
// bytes 0-15 the codes (the scales row's bytes), 16-31 their C (above), 32-47 their B (0
// without the one table). One dword lookup gives C's constant and B, one byte addition adds E
// (a byte's wrap-around is the truncation C's byte always had), one vpermb gathers the three
// rows: 7 operations instead of 14 for three narrowing conversions and an insert.
static inline __m512i nvfp4_block_kk(__m512i code, const Nvfp4Tables& t) {
  const __m512i cb = _mm512_permutexvar_epi32(_mm512_and_si512(code, simd::u32(7)), _mm512_load_si512(t.cb));
  const __m512i all = _mm512_or_si512(_mm512_add_epi8(cb, _mm512_srli_epi32(code, 3)), _mm512_slli_epi32(code, 16));
  return _mm512_permutexvar_epi8(_mm512_load_si512(kNvfp4KkGather.b), all);
}

// nvfp4_block_codes_tab, and with Given (the global scale was given, Nvfp4Args::given_scale)
// the NaN code 0x7F for a block holding a NaN or Inf; the caller writes its elements as +0
// (nvfp4_zero_poisoned). With a computed scale no block of a matrix that is not poisoned can.
template <bool Given>
static inline __m512i nvfp4_codes_tab(__m512i h16, const Nvfp4Tables& t) {
  const __m512i code = nvfp4_block_codes_tab(h16, t);
  if constexpr (!Given) return code;
  const __mmask16 poisoned = _mm512_cmpge_epu32_mask(_mm512_and_si512(h16, simd::u32(0xFFFF)), simd::u32(0x7F80));
  return _mm512_mask_mov_epi32(code, poisoned, simd::u32(E4M3::kNanCode));
}

// The first half of a bf16 batch (nvfp4_scales256's, by the tables): its 16 block codes to
// `scales`; returns their nvfp4_block_kk.
template <bool Given>
static inline __m512i nvfp4_scales256_tab(const uint16_t* x, const Nvfp4Tables& t, uint8_t* scales) {
  prefetch_lines(reinterpret_cast<const char*>(x) + simd::kPrefetchAhead, 0, 512);
  __m512i h[8];
  for (int j = 0; j < 8; ++j) h[j] = _mm512_and_si512(_mm512_loadu_si512(x + 32 * j), _mm512_set1_epi16(0x7FFF));
  const __m512i kk = nvfp4_block_kk(nvfp4_codes_tab<Given>(block16_amax_halves(h), t), t);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(scales), _mm512_castsi512_si128(kk));
  return kk;
}

// The one-table loop's byte lanes. Two vpackuswb split 64 bf16 inputs (v0: inputs 0-31, v1:
// 32-63) into low and high bytes without vpermt2b (3 vector slots on Zen 4, against 1 for a
// vpackuswb, an and or a shift): 128-bit lane L of the result holds inputs 8L..8L+7 of v0 in its
// bytes 0-7 and of v1 in bytes 8-15, so byte (L, i) is an input of block (i < 8 ? 0 : 2) + L / 2
// of the 64 (kNvfp4StepBlock, offset by the C row of nvfp4_block_kk). The codes go back to input
// order at the end: vpmaddubsw pairs neighbours (both in one half lane), one vpackuswb packs two
// such 64-input steps, and one vpermd puts its 4-byte runs in place (instead of two vpmovwb).
struct Nvfp4StepBlock {
  uint8_t b[64];
};
static constexpr Nvfp4StepBlock nvfp4_step_block() {
  Nvfp4StepBlock r{};
  for (int l = 0; l < 4; ++l)
    for (int i = 0; i < 16; ++i) r.b[16 * l + i] = static_cast<uint8_t>(16 + (i < 8 ? 0 : 2) + l / 2);
  return r;
}
alignas(64) static constexpr Nvfp4StepBlock kNvfp4StepBlock = nvfp4_step_block();

// 16 whole 1x16 bf16 blocks (256 inputs) whose block scale codes are codes[0, 16) and whose
// nvfp4_block_kk is kk, packed: the bytes of nvfp4_elements256<bf16>.
static inline void nvfp4_elements256_tab(const uint16_t* x, __m512i kk, const uint8_t* codes, const Nvfp4Tables& t,
                                         uint8_t* out) {
  const __m512i grid = _mm512_load_si512(kE2m1Grid11.g);
  const __m512i eight = _mm512_set1_epi8(8), four = _mm512_set1_epi8(4), sixteen = _mm512_set1_epi8(16);
  const __m512i nibbles = _mm512_set1_epi16(0x1001);  // element 2i * 1 + element 2i + 1 * 16
  if (t.one) {
    const __m512i a0 = _mm512_load_si512(t.a), a1 = _mm512_load_si512(t.a + 64);
    const __m512i g0 = _mm512_load_si512(t.g), g1 = _mm512_load_si512(t.g + 64);
    const __m512i low = _mm512_set1_epi16(0xFF);
    const __m512i runs = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i cidx = _mm512_load_si512(kNvfp4StepBlock.b);  // lane: its block's C byte in kk
    for (int d = 0; d < 2; ++d) {
      __m512i m[2];
      for (int s = 0; s < 2; ++s) {
        const uint16_t* p = x + 128 * d + 64 * s;
        const __m512i v0 = _mm512_loadu_si512(p), v1 = _mm512_loadu_si512(p + 32);
        const __m512i lo = _mm512_packus_epi16(_mm512_and_si512(v0, low), _mm512_and_si512(v1, low));
        const __m512i hi = _mm512_packus_epi16(_mm512_srli_epi16(v0, 8), _mm512_srli_epi16(v1, 8));
        const __m512i e = _mm512_ternarylogic_epi32(_mm512_add_epi8(hi, hi), _mm512_srli_epi16(lo, 7), _mm512_set1_epi8(1), 0xF8);
        const __m512i am = _mm512_permutex2var_epi8(a0, lo, a1);  // A[m]: vpermi2b ignores bit 7
        const __m512i b = _mm512_permutexvar_epi8(_mm512_add_epi8(cidx, sixteen), kk);
        const __m512i tab = _mm512_permutex2var_epi8(g0, _mm512_sub_epi8(am, b), g1);
        const __m512i c = _mm512_permutexvar_epi8(cidx, kk);
        cidx = _mm512_add_epi8(cidx, four);
        const __m512i u = _mm512_min_epu8(_mm512_subs_epu8(e, c), eight);
        __m512i code = _mm512_permutexvar_epi8(_mm512_add_epi8(u, tab), grid);
        code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi16(hi, 4), eight, 0xF8);  // sign (bit 7) to bit 3
        m[s] = _mm512_maddubs_epi16(code, nibbles);
      }
      _mm512_storeu_si512(out + 64 * d, _mm512_permutexvar_epi32(runs, _mm512_packus_epi16(m[0], m[1])));
    }
    return;
  }
  // 8 tables: 64 inputs (4 blocks) a step in input order (simd::bf16_bytes), each block's table
  // by a masked lookup.
  __m512i quad = _mm512_set_epi64(0x1313131313131313ll, 0x1313131313131313ll, 0x1212121212121212ll,
                                  0x1212121212121212ll, 0x1111111111111111ll, 0x1111111111111111ll,
                                  0x1010101010101010ll, 0x1010101010101010ll);  // lane i: C of block 4g + i / 16
  for (int g = 0; g < 4; ++g) {
    const simd::Bf16Bytes v = simd::bf16_bytes(x + 64 * g);
    __m512i tb[4];
    for (int b = 0; b < 4; ++b) {
      const uint8_t* tj = t.t[codes[4 * g + b] & 7];
      tb[b] = _mm512_maskz_permutex2var_epi8(0xFFFFull << (16 * b), _mm512_load_si512(tj), v.lo, _mm512_load_si512(tj + 64));
    }
    const __m512i tab = _mm512_or_si512(_mm512_ternarylogic_epi32(tb[0], tb[1], tb[2], 0xFE), tb[3]);
    const __m512i c = _mm512_permutexvar_epi8(quad, kk);
    quad = _mm512_add_epi8(quad, four);
    const __m512i u = _mm512_min_epu8(_mm512_subs_epu8(v.e, c), eight);
    __m512i code = _mm512_permutexvar_epi8(_mm512_add_epi8(u, tab), grid);
    code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi16(v.hi, 4), eight, 0xF8);  // sign (bit 7) to bit 3
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * g), _mm512_cvtepi16_epi8(_mm512_maddubs_epi16(code, nibbles)));
  }
}
#else
constexpr bool kNvfp4Tables = false;
struct Nvfp4Tables {};
static inline bool nvfp4_tables_cover(float) { return false; }
static inline void nvfp4_build_tables(float, Nvfp4Tables*) {}
static inline bool nvfp4_tables_for(float, Nvfp4Tables*) { return false; }
template <bool Given>
static inline __m512i nvfp4_scales256_tab(const uint16_t*, const Nvfp4Tables&, uint8_t*) { return _mm512_setzero_si512(); }
static inline void nvfp4_elements256_tab(const uint16_t*, __m512i, const uint8_t*, const Nvfp4Tables&, uint8_t*) {}
#endif
