// AVX-512 NVFP4 kernels: 1x16 rows (batched, with the VBMI tables) and 16x16 tiles.
//
// Part of the AVX-512 leaf kernels: included by avx512_kernels.h (which says how they keep the
// contract) inside namespace miles_quant::cpu::MQ_CPU_NS, after the parts before it there.
#pragma once

// ---- NVFP4: 16-element blocks (1x16) or 16x16 tiles; 16 blocks along the row at a time -----

// nvfp4_block_code and nvfp4_block_factor (contract.h) for 16 block amaxes, lane-wise. The
// clamped block scale is at least 2^-6, the smallest normal E4M3, so its code decodes as normal.
// A poisoned amax (NaN or Inf: only with a given global scale) gives the NaN code 0x7F (and a
// finite factor); the caller writes its elements as +0 (nvfp4_zero_poisoned).
static inline __m512i nvfp4_codes(__m512i amax, __m512 sg, __m512 inv, __m512* factor) {
  __m512 bs = _mm512_div_ps(_mm512_div_ps(_mm512_castsi512_ps(amax), _mm512_set1_ps(E2M1::kMax)), sg);
  bs = _mm512_min_ps(_mm512_max_ps(bs, _mm512_set1_ps(kNvfp4BlockScaleMin)), _mm512_set1_ps(E4M3::kMax));
  // encode<E4M3> of a normal, positive value no larger than 448: the integer RNE alone (no
  // subnormal, sign or saturation step), with the exponent rebias folded in before the shift.
  const __m512i u = _mm512_castps_si512(bs);
  __m512i code = _mm512_add_epi32(u, simd::u32(((1u << 19) - 1u) - (120u << 23)));
  code = _mm512_srli_epi32(_mm512_add_epi32(code, _mm512_and_si512(_mm512_srli_epi32(u, 20), simd::u32(1))), 20);
  const __m512 dec = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(code, 20), simd::u32(120u << 23)));
  *factor = _mm512_div_ps(inv, dec);
  return _mm512_mask_mov_epi32(code, _mm512_cmpge_epu32_mask(amax, simd::u32(kF32InfBits)), simd::u32(E4M3::kNanCode));
}

// The elements of a batch's poisoned blocks (scale code 0x7F; only with a given global scale)
// to +0: `codes` the batch's 16 block codes, `out` its 128 packed bytes.
static inline void nvfp4_zero_poisoned(const uint8_t* codes, uint8_t* out) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  uint32_t bad = _mm_cmpeq_epi8_mask(c, _mm_set1_epi8(static_cast<char>(E4M3::kNanCode)));
  if (__builtin_expect(bad != 0, 0))
    for (; bad != 0; bad &= bad - 1) std::memset(out + 8 * __builtin_ctz(bad), 0, 8);
}

// 1x16, 16 whole blocks (256 contiguous inputs), no masks, in two halves so that the caller
// can compute the next batch's scales (a long dependency chain: amax, three divisions, E4M3)
// before this batch's elements, which then hide that latency.
// First half: the block amaxes and scales (stored); returns the 16 element factors.
template <DType D>
static inline __m512 nvfp4_scales256(const typename In<D>::T* x, __m512 sg, __m512 inv, uint8_t* scales) {
  prefetch_lines(reinterpret_cast<const char*>(x) + simd::kPrefetchAhead, 0, 256 * static_cast<int64_t>(sizeof(*x)));
  __m512i amax;
  if constexpr (D == DType::f32) {
    __m512i m[16];
    for (int k = 0; k < 16; ++k) m[k] = simd::abs_bits(_mm512_loadu_ps(x + 16 * k));
    amax = simd::reduce16(m);
  } else {
    __m512i h[8];
    for (int j = 0; j < 8; ++j) h[j] = _mm512_and_si512(_mm512_loadu_si512(x + 32 * j), _mm512_set1_epi16(0x7FFF));
    const __m512i h16 = block16_amax_halves(h);
    if constexpr (D == DType::bf16)
      amax = _mm512_slli_epi32(h16, 16);
    else
      amax = _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h16)));
  }
  __m512 factor;
  const __m512i code = nvfp4_codes(amax, sg, inv, &factor);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(scales), _mm512_cvtepi32_epi8(code));
  return factor;
}

// Second half: the 256 elements, packed.
template <DType D>
static inline void nvfp4_elements256(const typename In<D>::T* x, __m512 factor, uint8_t* out) {
  if constexpr (D == DType::bf16) {
    // 32 inputs at a time, split into their even (low halves, shifted up) and odd (high halves)
    // elements: both are exact fp32 widenings, and byte i of the packed output is the pair
    // (even i, odd i). Lanes 0-7 belong to block 2j, lanes 8-15 to block 2j + 1.
    const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int j = 0; j < 8; ++j) {
      const __m512 f = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32(2 * j)), factor);
      const __m512i v = _mm512_loadu_si512(x + 32 * j);
      const __m512i even = e2m1_magnitude(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), f));
      const __m512i odd = e2m1_magnitude(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(v, simd::u32(0xFFFF0000u))), f));
      // The signs (x * factor keeps x's sign, zeros included): bits 15 and 31 to bits 3 and 7.
      const __m512i w = _mm512_and_si512(v, simd::u32(0x80008000u));
      const __m512i sign = _mm512_or_si512(_mm512_srli_epi32(w, 12), _mm512_srli_epi32(w, 24));
      const __m512i bytes = _mm512_ternarylogic_epi32(even, _mm512_slli_epi32(odd, 4), sign, 0xFE);  // a | b | c
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * j), _mm512_cvtepi32_epi8(bytes));
    }
  } else {
    for (int k = 0; k < 16; ++k) {
      const __m512 v = _mm512_mul_ps(simd::load<D>(x + 16 * k, 0xFFFF), simd::lane(factor, k));
      simd::store_nibbles16(out + 8 * k, e2m1_code(v));
    }
  }
}

#include "avx512_nvfp4_tables.h"    // kNvfp4Tables, nvfp4_elements256_tab (VBMI builds)
#include "avx512_nvfp4_tables16.h"  // nvfp4_elements256_tab16 (fp16 inputs, VBMI builds)

// Rows the 1x16 kernel interleaves, batch by batch: two streams through memory keep more lines
// in flight than one (8192x7168 bf16: 0.21 ns per element against 0.24); 4, 6 or 8 were slower
// (0.23, 0.26, 0.28 ns with the tables).
constexpr int kNvfp4Streams = 2;

// The whole batches of 1x16 rows r[0, n), n <= kNvfp4Streams, interleaved batch by batch. Each
// row is software-pipelined: the next batch's amax and scales (a chain of three divisions) are
// computed before this batch's elements, which hide its latency. Tab: block codes and elements
// by the mantissa tables (bf16 and fp16 with kNvfp4Tables: Nvfp4TabOf<D>), tables[k] those of
// row k's matrix; else the fp32 path (tables unused). Given: the global scale was given, so single blocks may be poisoned (with a
// computed one nothing is, and the dynamic call skips those checks).
template <DType D>
using Nvfp4TabOf = std::conditional_t<D == DType::f16, Nvfp4Tab16, Nvfp4Tables>;
template <DType D, bool Tab, bool Given>
static void nvfp4_row_group(const Nvfp4Args& a, const int64_t* r, int n, const Nvfp4TabOf<D>* const* tables) {
  using T = typename In<D>::T;
  constexpr bool kTab = Tab && D == DType::bf16, kTab16 = Tab && D == DType::f16;
  static_assert(!Tab || (D != DType::f32 && kNvfp4Tables), "the tables take bf16 and fp16 inputs on VBMI builds");
  const int64_t R = a.rows, C = a.cols, nc = (C + 15) / 16, out_stride = (C + 1) / 2;
  const int64_t batches = C / 256;
  struct Row {
    const T* x;
    uint8_t* scales;
    uint8_t* out;
    __m512 sg, inv, f;  // the fp32 path: global scale, its inverse, the batch's element factors
    __m512i k;          // the tables: the batch's nvfp4_block_kk
    const Nvfp4TabOf<D>* tables;
  };
  // The first half of batch q of row w (its scales), and the second (its elements).
  const auto scales = [](Row& w, int64_t q, __m512* f, __m512i* k) {
    if constexpr (kTab)
      *k = nvfp4_scales256_tab<Given>(w.x + q * 256, *w.tables, w.scales + q * 16);
    else if constexpr (kTab16)
      nvfp4_scales256_tab16<Given>(w.x + q * 256, *w.tables, w.scales + q * 16);
    else
      *f = nvfp4_scales256<D>(w.x + q * 256, w.sg, w.inv, w.scales + q * 16);
  };
  const auto elements = [](const Row& w, int64_t q) {
    if constexpr (kTab)
      nvfp4_elements256_tab(w.x + q * 256, w.k, w.scales + q * 16, *w.tables, w.out + q * 128);
    else if constexpr (kTab16)
      nvfp4_elements256_tab16(w.x + q * 256, w.scales + q * 16, *w.tables, w.out + q * 128);
    else
      nvfp4_elements256<D>(w.x + q * 256, w.f, w.out + q * 128);
    if constexpr (Given) nvfp4_zero_poisoned(w.scales + q * 16, w.out + q * 128);
  };
  Row rows[kNvfp4Streams];
  for (int k = 0; k < n; ++k) {
    const float g = a.global_scale[r[k] / R];
    rows[k] = {static_cast<const T*>(a.x) + r[k] * C, a.scales + r[k] * nc, a.out + r[k] * out_stride,
               _mm512_set1_ps(g), _mm512_set1_ps(1.0f / g), _mm512_setzero_ps(), _mm512_setzero_si512(), tables[k]};
    scales(rows[k], 0, &rows[k].f, &rows[k].k);
  }
  for (int64_t q = 0; q + 1 < batches; ++q) {
    for (int k = 0; k < n; ++k) {
      Row& w = rows[k];
      __m512 f = w.f;
      __m512i kk = w.k;
      scales(w, q + 1, &f, &kk);
      elements(w, q);
      w.f = f;
      w.k = kk;
    }
  }
  for (int k = 0; k < n; ++k) elements(rows[k], batches - 1);
}

// 16x16 tiles by the tables (bf16 and fp16, VBMI): the whole 256-column batches of the 16 rows from r0
// (one full tile row). Per batch: the 16 tiles' amaxes (|x| maxima over the 16 rows, reduced as
// the 1x16 kernel reduces one row's blocks), their codes (repeated on the 16 rows' scales), then
// each row's elements by the 1x16 element loop with those codes. Given: as nvfp4_row_group.
// The tile rows' prefetch: each of the 16 rows' lines two batches (1 KiB) ahead, into L2
// (prefetcht1). One batch ahead into L1 (prefetcht0), as the 1x16 kernel does for its two
// streams, left 16 rows of misses waiting: 8192x7168 0.29-0.32 -> 0.24-0.26 ns per element;
// one batch ahead into L2, three batches, prefetcht2, or whole 1 KiB runs every other batch were
// no better (docs/benchmarks.md, "NVFP4 16x16 tiles by the tables").
constexpr int64_t kTileRowAhead = 512;  // elements

#if defined(__AVX512VBMI__)
// Tab: Nvfp4Tables (bf16: block codes and elements by nvfp4_codes_tab / nvfp4_elements256_tab)
// or Nvfp4Tab16 (fp16: nvfp4_block_codes_tab16 / nvfp4_elements256_tab16).
template <bool Given, class Tab>
static void nvfp4_tile_row16_tab(const Nvfp4Args& a, int64_t r0, const Tab& t) {
  constexpr bool kF16 = std::is_same_v<Tab, Nvfp4Tab16>;
  const int64_t C = a.cols, nc = (C + 15) / 16, out_stride = (C + 1) / 2;
  const auto* x = static_cast<const uint16_t*>(a.x) + r0 * C;
  const __m512i abs = _mm512_set1_epi16(0x7FFF);
  for (int64_t q = 0; q < C / 256; ++q) {
    __m512i h[8];
    for (int j = 0; j < 8; ++j) h[j] = _mm512_setzero_si512();
    for (int64_t r = 0; r < 16; ++r) {
      const uint16_t* p = x + r * C + q * 256;
      for (int64_t b = 0; b < 512; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kTileRowAhead) + b, _MM_HINT_T1);
      for (int j = 0; j < 8; ++j) h[j] = _mm512_max_epu16(h[j], _mm512_and_si512(_mm512_loadu_si512(p + 32 * j), abs));
    }
    [[maybe_unused]] __m512i kk;
    __m128i codes;
    if constexpr (kF16) {
      codes = _mm512_cvtepi32_epi8(nvfp4_block_codes_tab16<Given>(block16_amax_halves(h), t));
    } else {
      kk = nvfp4_block_kk(nvfp4_codes_tab<Given>(block16_amax_halves(h), t), t);
      codes = _mm512_castsi512_si128(kk);
    }
    for (int64_t r = 0; r < 16; ++r) {
      uint8_t* sc = a.scales + (r0 + r) * nc + q * 16;
      uint8_t* out = a.out + (r0 + r) * out_stride + q * 128;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(sc), codes);
      if constexpr (kF16)
        nvfp4_elements256_tab16(x + r * C + q * 256, sc, t, out);
      else
        nvfp4_elements256_tab(x + r * C + q * 256, kk, sc, t, out);
      if constexpr (Given) nvfp4_zero_poisoned(sc, out);
    }
  }
}
#else
template <bool Given, class Tab>
static void nvfp4_tile_row16_tab(const Nvfp4Args&, int64_t, const Tab&) {}
#endif

// The mantissa tables of one matrix at a time, fetched when the matrix changes. get(a, b): the
// tables for matrix b, or nullptr when they do not hold for its global scale (a computed one
// always is one the tables were proven for; a given one only when some bf16 tensor amax gives
// it, nvfp4_tables_cover): the fp32 path then, same bits. They come from the tables of the
// scale's mantissa, built once per process (nvfp4_tables_for: a copy and three patched fields,
// about 0.1 us; building them took about 2 us, more than a one-token call's elements, and a
// dynamic call meets a new scale with every tensor: docs/benchmarks.md, "the cost of a small call").
// fp16 (Nvfp4Tab16): the scale must be one of a finite, non-zero fp16 amax (nvfp4_tab16_for).
template <DType D>
struct Nvfp4MatrixTables {
  Nvfp4TabOf<D> tables;
  int64_t matrix = -1;
  bool ok = false;
  const Nvfp4TabOf<D>* get(const Nvfp4Args& a, int64_t b) {
    if (matrix != b) {
      matrix = b;
      if constexpr (D == DType::f16)
        ok = nvfp4_tab16_for(a.global_scale[b], &tables);
      else
        ok = nvfp4_tables_for(a.global_scale[b], &tables);
    }
    return ok ? &tables : nullptr;
  }
};

template <DType D>
static void nvfp4_rows_v(const Nvfp4Args& a, int64_t t0, int64_t t1, const uint32_t* gamax) {
  const auto* x = static_cast<const typename In<D>::T*>(a.x);
  const int64_t R = a.rows, C = a.cols, tr = a.tile16x16 ? 16 : 1;
  const int64_t nr = (R + tr - 1) / tr, nc = (C + 15) / 16, out_stride = (C + 1) / 2;
  // 1x16 rows of at least one whole batch: the whole batches first, kNvfp4Streams rows at a time,
  // t0 + i, t0 + g + i, t0 + 2g + i, ... (rows of a poisoned matrix are left to the loop below).
  // Stream k keeps the mantissa tables of the matrix its rows are in (rebuilt when that changes).
  const bool batched = tr == 1 && C >= 256;
  if (batched) {
    Nvfp4MatrixTables<D> tables[kNvfp4Streams];
    const int64_t g = (t1 - t0 + kNvfp4Streams - 1) / kNvfp4Streams;
    for (int64_t i = 0; i < g; ++i) {
      int64_t r[kNvfp4Streams], rf[kNvfp4Streams];
      const Nvfp4TabOf<D>* tab[kNvfp4Streams];
      int n = 0, nf = 0;  // rows by the tables, rows by the fp32 path
      for (int k = 0; k < kNvfp4Streams; ++k) {
        const int64_t row = t0 + k * g + i;
        if (row >= t1 || is_poisoned(gamax[row / R])) continue;
        if constexpr (D != DType::f32 && kNvfp4Tables) {
          if (const Nvfp4TabOf<D>* t = tables[k].get(a, row / R)) {
            r[n] = row;
            tab[n++] = t;
            continue;
          }
        }
        rf[nf++] = row;
      }
      if constexpr (D != DType::f32 && kNvfp4Tables) {
        if (n > 0) (a.given_scale ? nvfp4_row_group<D, true, true> : nvfp4_row_group<D, true, false>)(a, r, n, tab);
      }
      if (nf > 0) (a.given_scale ? nvfp4_row_group<D, false, true> : nvfp4_row_group<D, false, false>)(a, rf, nf, tab);
    }
  }
  __m512i m[16];
  alignas(64) float factor[16];
  alignas(64) uint32_t codes[16];
  [[maybe_unused]] Nvfp4MatrixTables<D> tile_tables;  // 16x16 (bf16 and fp16, VBMI)
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t b = t / nr, i = t % nr;
    const int64_t r0 = b * R + i * tr, r1 = b * R + lo(R, (i + 1) * tr);
    if (is_poisoned(gamax[b])) {
      for (int64_t r = r0; r < r1; ++r) {
        std::memset(a.scales + r * nc, E4M3::kNanCode, static_cast<size_t>(nc));
        std::memset(a.out + r * out_stride, 0, static_cast<size_t>(out_stride));
      }
      continue;
    }
    const __m512 sg = _mm512_set1_ps(a.global_scale[b]);
    const __m512 inv = _mm512_set1_ps(1.0f / a.global_scale[b]);
    int64_t jb = batched ? C / 256 * 16 : 0;  // the blocks the batched loops did not take
    if constexpr (D != DType::f32 && kNvfp4Tables) {
      if (tr == 16 && r1 - r0 == 16 && C >= 256) {
        if (const Nvfp4TabOf<D>* tt = tile_tables.get(a, b)) {
          using Tab = Nvfp4TabOf<D>;
          (a.given_scale ? nvfp4_tile_row16_tab<true, Tab> : nvfp4_tile_row16_tab<false, Tab>)(a, r0, *tt);
          jb = C / 256 * 16;
        }
      }
    }
    for (int64_t j0 = jb; j0 < nc; j0 += 16) {
      const int64_t nb = lo(16, nc - j0);
      for (int64_t k = 0; k < 16; ++k) m[k] = _mm512_setzero_si512();
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t c0 = (j0 + k) * 16;
        const int64_t n = lo(16, C - c0);
        __m512i acc = _mm512_setzero_si512();
        for (int64_t r = r0; r < r1; ++r) acc = simd::acc_abs<D>(x + r * C + c0, n, acc);
        m[k] = simd::amax_lanes<D>(acc);
      }
      __m512 fv;
      const __m512i code = nvfp4_codes(simd::reduce16(m), sg, inv, &fv);
      _mm512_store_ps(factor, fv);
      _mm512_store_si512(codes, code);
      for (int64_t r = r0; r < r1; ++r) simd::store_bytes(a.scales + r * nc + j0, code, simd::tail_mask(nb));
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t c0 = (j0 + k) * 16, n = lo(16, C - c0);
        if (codes[k] == E4M3::kNanCode) {  // poisoned (a given global scale): elements +0
          for (int64_t r = r0; r < r1; ++r) std::memset(a.out + r * out_stride + c0 / 2, 0, static_cast<size_t>((n + 1) / 2));
          continue;
        }
        const simd::Mask mk = simd::tail_mask(n);
        const __m512 f = _mm512_set1_ps(factor[k]);
        for (int64_t r = r0; r < r1; ++r) {
          const __m512 v = _mm512_mul_ps(simd::load<D>(x + r * C + c0, mk), f);
          simd::store_nibbles(a.out + r * out_stride + c0 / 2, simd::encode<E2M1, false>(v), n);
        }
      }
    }
  }
}
