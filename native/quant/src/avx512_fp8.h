// AVX-512 FP8 kernels: flat (per tensor), 1x128 rows and 128x128 bands.
//
// Part of the AVX-512 leaf kernels: included by avx512_kernels.h (which says how they keep the
// contract) inside namespace miles_quant::cpu::MQ_CPU_NS, after the parts before it there.
#pragma once

// ---- FP8 ----------------------------------------------------------------------------------

// FP8 byte codes of 32 bf16 inputs divided by vs, as 16-bit pairs (element 2i low): even and
// odd elements (load_bf16_pairs), their codes interleaved back lane by lane, so that one
// vpmovdw stores them: 4 fewer instructions per 32 inputs than widening 16 at a time.
template <class F>
static inline __m512i fp8_pairs32_bf16(const uint16_t* x, __m512 vs) {
  __m512 even, odd;
  simd::load_bf16_pairs(x, &even, &odd);
  const __m512i ce = simd::encode<F, false>(_mm512_div_ps(even, vs));
  const __m512i co = simd::encode<F, false>(_mm512_div_ps(odd, vs));
  return _mm512_or_si512(ce, _mm512_slli_epi32(co, 8));
}

#include "avx512_fp8_tables.h"  // kFp8Tables, fp8_group_tab, fp8_group_run (VBMI builds)

// Whether inputs of dtype D take the FP8 tables (bf16 and fp16 on VBMI builds).
template <DType D>
constexpr bool kFp8Tables16Bit = kFp8Tables && (D == DType::bf16 || D == DType::f16);

// x / s encoded, n inputs. kPrefetch: also request the lines kPrefetchAhead bytes ahead, 256
// bytes at a time (a long stream from memory).
template <DType D, class F, bool kPrefetch = false>
static void fp8_run_v(const typename In<D>::T* x, int64_t n, float s, uint8_t* out) {
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(*x));
  const auto prefetch = [&](int64_t i) {
    if constexpr (kPrefetch) {
      if (((i * kSize) & 255) == 0) {
        const char* ahead = reinterpret_cast<const char*>(x + i) + simd::kPrefetchAhead;
        for (int64_t k = 0; k < 256; k += 64) _mm_prefetch(ahead + k, _MM_HINT_T0);
      }
    }
  };
  const __m512 vs = _mm512_set1_ps(s);
  int64_t i = 0;
  if constexpr (D == DType::bf16) {
    for (; i + 32 <= n; i += 32) {
      prefetch(i);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(fp8_pairs32_bf16<F>(x + i, vs)));
    }
  }
  for (; i + 32 <= n; i += 32) {
    prefetch(i);
    const __m512 a = _mm512_div_ps(simd::load<D>(x + i, 0xFFFF), vs);
    const __m512 b = _mm512_div_ps(simd::load<D>(x + i + 16, 0xFFFF), vs);
    simd::store_bytes(out + i, simd::encode<F, false>(a), 0xFFFF);
    simd::store_bytes(out + i + 16, simd::encode<F, false>(b), 0xFFFF);
  }
  for (; i < n; i += 16) {
    const simd::Mask m = simd::tail_mask(n - i);
    simd::store_bytes(out + i, simd::encode<F, false>(_mm512_div_ps(simd::load<D>(x + i, m), vs)), m);
  }
}

template <DType D, class F>
static void fp8_flat_v(const Fp8Args& a, int64_t begin, int64_t n, uint32_t amax) {
  const auto* x = static_cast<const typename In<D>::T*>(a.x) + begin;
  if (is_poisoned(amax)) {
    std::memset(a.out + begin, F::kNanCode, static_cast<size_t>(n));
    return;
  }
  // The tensor-level scale is known only after a whole amax pass, so this pass streams its
  // input from memory again, with the lines kPrefetchAhead bytes ahead requested, as the amax
  // pass does: one call, so that the encode's constants are set up once.
  const float s = fp8_scale<F>(bits_f32(amax));
  if constexpr (kFp8Tables16Bit<D>) {
    const int64_t whole = n / 32 * 32;
    fp8_group_run<D, F, true>(x, whole, fp8_group_tab<D, F>(amax, s), s, a.out + begin);
    fp8_run_v<D, F>(x + whole, n - whole, s, a.out + begin + whole);
    return;
  }
  fp8_run_v<D, F, true>(x, n, s, a.out + begin);
}

// nb whole 16-bit tiles (bf16, or fp16 with the tables) of one row, tc (a multiple of 32) inputs
// each, tile k divided by s[k]: fp8_run_v's bf16 loop for all of them in one branch-free loop (a
// poisoned tile's codes are overwritten), so that the encode's constants stay in registers
// across tiles instead of being rebuilt per call. kPrefetch: request each tile's lines
// kPrefetchAhead bytes ahead first. With kFp8Tables, tile k is encoded by its table tab[k]
// (fp8_group_run) and a poisoned tile is filled with NaN codes.
template <DType D, class F, bool kPrefetch>
static inline void fp8_tiles_row16(const uint16_t* x, int64_t nb, int64_t tc, const float* s, const Fp8Tab* tab,
                                   simd::Mask poisoned, uint8_t* out) {
  static_assert(D == DType::bf16 || kFp8Tables16Bit<D>, "fp16 tiles need the tables");
  if constexpr (kFp8Tables) {
    for (int64_t k = 0; k < nb; ++k) {
      if constexpr (kPrefetch) prefetch_lines(reinterpret_cast<const char*>(x + k * tc) + simd::kPrefetchAhead, 0, tc * 2);
      if ((poisoned >> k) & 1)
        std::memset(out + k * tc, F::kNanCode, static_cast<size_t>(tc));
      else
        fp8_group_run<D, F, false>(x + k * tc, tc, tab[k], s[k], out + k * tc);
    }
    return;
  }
  const __m512i nan_pair = simd::u32(F::kNanCode * 0x101u);
  for (int64_t k = 0; k < nb; ++k) {
    if constexpr (kPrefetch) prefetch_lines(reinterpret_cast<const char*>(x + k * tc) + simd::kPrefetchAhead, 0, tc * 2);
    const __m512 vs = _mm512_set1_ps(s[k]);
    const simd::Mask pk = static_cast<simd::Mask>(0u - ((poisoned >> k) & 1u));
    for (int64_t i = k * tc; i < (k + 1) * tc; i += 32) {
      const __m512i w = _mm512_mask_mov_epi32(fp8_pairs32_bf16<F>(x + i, vs), pk, nan_pair);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(w));
    }
  }
}

// FP8 tiles taller than one row (128x128) of tile rows [t0, t1), one band of rows (a tile row,
// or a column chunk of it when the row is wider than kMaxTiles tiles or kBandBytes of input) at
// a time, in two passes. The amax pass reads the band, which is (nearly) contiguous memory, as
// kStreams row groups in turn, a tile of each at a time, with prefetches kPrefetchAhead bytes
// ahead: several long streams keep more lines in flight than the column-strided walk of a tile.
// The cast pass then reads the band again, from L2 / L3, row by row. 8192x7168 bf16, one thread:
// 0.36 ns per element against 0.44 for chunks of 4 tiles with the amax of the next one
// interleaved. A whole tile row is a band up to 256 bf16 tiles (32768 columns): column chunks
// cost more than a band larger than L2 (one thread, bf16, 7168x18432: 0.234 ns/el in chunks of
// 64 tiles, 0.153 as whole tile rows of 4.5 MiB; 2048x16384 0.252 -> 0.156).
template <DType D, class F>
static void fp8_bands_v(const Fp8Args& a, int64_t t0, int64_t t1) {
  using T = typename In<D>::T;
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(T)), kBandBytes = int64_t{8} << 20;
  constexpr int64_t kStreams = 4, kMaxTiles = 256;
  constexpr bool kRow16 = D == DType::bf16 || kFp8Tables16Bit<D>;
  const auto* x = static_cast<const T*>(a.x);
  const int64_t R = a.rows, C = a.cols, tr = a.tile_rows, tc = a.tile_cols;
  const int64_t nr = (R + tr - 1) / tr, nc = (C + tc - 1) / tc;
  // Tiles per band: a multiple of 16 (the scale batch), at least 16, at most kMaxTiles.
  int64_t cw = kBandBytes / (tr * tc * kSize) / 16 * 16;
  cw = cw < 16 ? 16 : (cw > kMaxTiles ? kMaxTiles : cw);
  __m512i acc[kMaxTiles];
  alignas(64) float s[kMaxTiles];
  alignas(64) uint32_t amax_bits[kMaxTiles];
  Fp8Tab tab[kMaxTiles];
  uint16_t poisoned[kMaxTiles / 16];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t b = t / nr, i = t % nr;
    const int64_t r0 = b * R + i * tr, r1 = b * R + lo(R, (i + 1) * tr), rows = r1 - r0;
    const int64_t per = (rows + kStreams - 1) / kStreams;  // rows per stream
    for (int64_t j0 = 0; j0 < nc; j0 += cw) {
      const int64_t nb = lo(cw, nc - j0);
      for (int64_t k = 0; k < nb; ++k) acc[k] = _mm512_setzero_si512();
      for (int64_t ri = 0; ri < per; ++ri) {
        for (int64_t k = 0; k < nb; ++k) {
          const int64_t c0 = (j0 + k) * tc, n = lo(C, c0 + tc) - c0;
          for (int64_t g = 0; g < kStreams; ++g) {
            const int64_t r = r0 + g * per + ri;
            if (r >= r1) break;
            const T* p = x + r * C + c0;
            prefetch_lines(reinterpret_cast<const char*>(p) + simd::kPrefetchAhead, 0, n * kSize);
            acc[k] = simd::acc_abs<D>(p, n, acc[k]);
          }
        }
      }
      for (int64_t k0 = 0; k0 < nb; k0 += 16) {
        const int64_t m16 = lo(16, nb - k0);
        __m512i m[16];
        for (int64_t k = 0; k < 16; ++k) m[k] = k < m16 ? acc[k0 + k] : _mm512_setzero_si512();
        const __m512i amax = amax16<D>(m);
        const simd::Mask bad = _mm512_cmpge_epu32_mask(amax, simd::u32(kF32InfBits));
        __m512 sv = _mm512_max_ps(_mm512_castsi512_ps(amax), _mm512_set1_ps(kAmaxMin));
        sv = _mm512_div_ps(sv, _mm512_set1_ps(F::kMax));
        sv = _mm512_mask_mov_ps(sv, bad, _mm512_castsi512_ps(simd::u32(kF32QuietNan)));
        _mm512_mask_storeu_ps(a.scales + t * nc + j0 + k0, simd::tail_mask(m16), sv);
        _mm512_storeu_ps(s + k0, sv);
        _mm512_storeu_si512(amax_bits + k0, amax);
        poisoned[k0 / 16] = bad;
      }
      if constexpr (kFp8Tables16Bit<D>)
        for (int64_t k = 0; k < nb; ++k) tab[k] = fp8_group_tab<D, F>(amax_bits[k], s[k]);
      const int64_t cb = j0 * tc;
      const bool whole = kRow16 && tc % 32 == 0 && lo(C, cb + nb * tc) - cb == nb * tc;
      for (int64_t r = r0; r < r1; ++r) {
        if constexpr (kRow16) {
          if (whole) {  // one branch-free loop per 16 tiles of the row (fp8_tiles_row16)
            for (int64_t k0 = 0; k0 < nb; k0 += 16) {
              const int64_t c0 = cb + k0 * tc;
              fp8_tiles_row16<D, F, true>(x + r * C + c0, lo(16, nb - k0), tc, s + k0, tab + k0, poisoned[k0 / 16],
                                          a.out + r * C + c0);
            }
            continue;
          }
        }
        for (int64_t k = 0; k < nb; ++k) {
          const int64_t c0 = (j0 + k) * tc, n = lo(C, c0 + tc) - c0;
          const T* p = x + r * C + c0;
          prefetch_lines(reinterpret_cast<const char*>(p) + simd::kPrefetchAhead, 0, n * kSize);
          if ((poisoned[k / 16] >> (k % 16)) & 1)
            std::memset(a.out + r * C + c0, F::kNanCode, static_cast<size_t>(n));
          else
            fp8_run_v<D, F>(p, n, s[k], a.out + r * C + c0);
        }
      }
    }
  }
}

// FP8 tiles one row tall (1x128, per channel) of rows [t0, t1) (tile rows are rows here);
// taller ones go to fp8_bands_v.
//
// The work is a sequence of chunks of up to kW tiles of one row, walked in order (no divisions
// per chunk). A chunk's tiles need their amax before any element is cast, so every input is
// read twice: the amax pass of chunk q + 1 runs before the cast pass of chunk q (whose input
// the amax pass brought into cache a chunk earlier), and the amax stream prefetches kAhead
// chunks ahead of itself. Memory traffic then overlaps the cast's arithmetic instead of
// stalling it. Scales are computed lane-wise (fp8_scale in contract.h) for a chunk's tiles at
// once, from one transposing reduction.
template <DType D, class F>
static void fp8_tiles_v(const Fp8Args& a, int64_t t0, int64_t t1) {
  if (a.tile_rows > 1) {
    fp8_bands_v<D, F>(a, t0, t1);
    return;
  }
  constexpr int64_t kW = 4, kAhead = 4;  // amax4 reduces exactly 4 accumulators
  constexpr bool kTab = kFp8Tables16Bit<D>;
  using T = typename In<D>::T;
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(T));
  const auto* x = static_cast<const T*>(a.x);
  const int64_t C = a.cols, tc = a.tile_cols, nc = (C + tc - 1) / tc;
  if (t0 >= t1 || nc == 0) return;
  struct Chunk {
    int64_t r, j0, nb, cb, ce;  // row, first tile, tiles; columns [cb, ce)
  };
  const auto make = [&](int64_t r, int64_t j0) {
    const int64_t nb = lo(kW, nc - j0), cb = j0 * tc;
    return Chunk{r, j0, nb, cb, lo(C, cb + nb * tc)};
  };
  const auto advance = [&](const Chunk& c) { return c.j0 + kW < nc ? make(c.r, c.j0 + kW) : make(c.r + 1, 0); };
  // The prefetch cursor, kAhead chunks ahead of the amax stream.
  Chunk pc = make(t0, 0);
  const auto prefetch_next = [&] {
    if (pc.r >= t1) return;
    prefetch_lines(x + pc.r * C + pc.cb, 0, (pc.ce - pc.cb) * kSize);
    pc = advance(pc);
  };
  __m512i acc[kW];
  const auto amax_chunk = [&](const Chunk& c) {
    prefetch_next();
    const T* row = x + c.r * C;
    for (int64_t k = 0; k < kW; ++k) acc[k] = _mm512_setzero_si512();
    for (int64_t k = 0; k < c.nb; ++k) {
      const int64_t c0 = c.cb + k * tc;
      acc[k] = simd::acc_abs<D>(row + c0, lo(C, c0 + tc) - c0, acc[k]);
    }
  };
  alignas(64) float s[16];
  alignas(64) uint32_t amax_bits[16];
  Fp8Tab tab[kW];
  simd::Mask poisoned = 0;
  // The scales of chunk c from acc: stored, and kept in s / poisoned (and tab).
  const auto finish = [&](const Chunk& c) {
    __m512i amax;
    if constexpr (D == DType::f32) {
      __m512i m16[16];  // acc's kW tiles (past c.nb: zero accumulators), then zeros
      for (int64_t k = 0; k < 16; ++k) m16[k] = k < kW ? acc[k] : _mm512_setzero_si512();
      amax = amax16<D>(m16);
    } else {
      amax = amax4<D>(acc);
    }
    poisoned = _mm512_cmpge_epu32_mask(amax, simd::u32(kF32InfBits));
    __m512 sv = _mm512_max_ps(_mm512_castsi512_ps(amax), _mm512_set1_ps(kAmaxMin));
    sv = _mm512_div_ps(sv, _mm512_set1_ps(F::kMax));
    sv = _mm512_mask_mov_ps(sv, poisoned, _mm512_castsi512_ps(simd::u32(kF32QuietNan)));
    _mm512_mask_storeu_ps(a.scales + c.r * nc + c.j0, simd::tail_mask(c.nb), sv);
    _mm512_store_ps(s, sv);
    if constexpr (kTab) {
      _mm512_store_si512(amax_bits, amax);
      for (int64_t k = 0; k < c.nb; ++k) tab[k] = fp8_group_tab<D, F>(amax_bits[k], s[k]);
    }
  };
  const auto cast = [&](const Chunk& c) {
    const int64_t r = c.r;
    if constexpr (D == DType::bf16 || kTab) {
      if (tc % 32 == 0 && c.ce - c.cb == c.nb * tc) {  // whole tiles: one branch-free loop
        fp8_tiles_row16<D, F, false>(x + r * C + c.cb, c.nb, tc, s, tab, poisoned, a.out + r * C + c.cb);
        return;
      }
    }
    for (int64_t k = 0; k < c.nb; ++k) {
      const int64_t c0 = c.cb + k * tc, n = lo(C, c0 + tc) - c0;
      if ((poisoned >> k) & 1)
        std::memset(a.out + r * C + c0, F::kNanCode, static_cast<size_t>(n));
      else
        fp8_run_v<D, F>(x + r * C + c0, n, s[k], a.out + r * C + c0);
    }
  };
  for (int64_t i = 0; i < kAhead; ++i) prefetch_next();
  Chunk cur = make(t0, 0);
  amax_chunk(cur);
  for (;;) {
    finish(cur);
    const Chunk next = advance(cur);
    const bool more = next.r < t1;
    if (more) amax_chunk(next);
    cast(cur);
    if (!more) break;
    cur = next;
  }
}
