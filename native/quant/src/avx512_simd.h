// AVX-512 building blocks: masks, loads, the lane-wise encode, amax reductions, prefetches.
//
// Part of the AVX-512 leaf kernels: included by avx512_kernels.h (which says how they keep the
// contract) inside namespace miles_quant::cpu::MQ_CPU_NS, after the parts before it there.
#pragma once

namespace simd {

using Mask = __mmask16;

static inline Mask tail_mask(int64_t n) {
  return n >= 16 ? static_cast<Mask>(0xFFFF) : static_cast<Mask>((1u << n) - 1u);
}
static inline __m512i u32(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }

// Up to 16 inputs (lanes past n are +0) widened to fp32, exactly.
template <DType D>
static inline __m512 load(const typename In<D>::T* p, Mask m) {
  if constexpr (D == DType::f32) {
    return _mm512_maskz_loadu_ps(m, p);
  } else if constexpr (D == DType::bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    // vcvtph2ps is exact for every finite and infinite fp16 (subnormals included, DAZ is clear
    // on our threads). It quiets signalling NaNs, which only ever feed the amax (any NaN is a
    // poisoned group) and are never encoded.
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
}

static inline __m512i abs_bits(__m512 v) {
  return _mm512_and_si512(_mm512_castps_si512(v), u32(kF32AbsMask));
}

// The vector twin of encode<F> (elements.h): RNE onto the element grid, saturate, keep the sign.
// Normal targets round on the integer bits exactly as round_mag_rne (bits.h); subnormal targets
// use one fp32 addition: for |x| < 2^emin, |x| + 2^(emin - M + 23) lies in a binade whose ulp is
// the element's subnormal step 2^(emin - M), so the (round-to-nearest-even) sum is
// 2^(emin - M + 23) + RNE(|x|) and its bits minus the constant's bits count the steps: the same
// code as the integer path, ties to even included (the constant's mantissa is zero, so the sum's
// last bit is the code's). Our threads run with round-to-nearest and without DAZ/FTZ.
// kMayBeNan = false where the caller knows no lane is NaN (scaled values of a group that is not
// poisoned are finite or +-Inf); +-Inf saturates either way.
template <class F, bool kMayBeNan>
static inline __m512i encode(__m512 f) {
  constexpr int kShift = 23 - F::kMbits, kEmin = 1 - F::kBias, kSignPos = F::kEbits + F::kMbits;
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + kEmin) << 23;
  constexpr uint32_t kMagicBits = static_cast<uint32_t>(127 + kEmin - F::kMbits + 23) << 23;
  constexpr uint32_t kRebias = static_cast<uint32_t>(127 - F::kBias) << 23;
  const __m512i b = _mm512_castps_si512(f);
  const __m512i u = _mm512_and_si512(b, u32(kF32AbsMask));
  // ((u + half - 1 + lsb) >> shift) - rebias, the rebias folded in before the shift (it is a
  // multiple of 2^shift and no larger than u for a normal target).
  __m512i cn = _mm512_add_epi32(u, u32(((1u << (kShift - 1)) - 1u) - kRebias));
  cn = _mm512_add_epi32(cn, _mm512_and_si512(_mm512_srli_epi32(u, kShift), u32(1)));
  cn = _mm512_srli_epi32(cn, kShift);
  const __m512 magic = _mm512_castsi512_ps(u32(kMagicBits));
  const __m512i cs = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(u), magic)), u32(kMagicBits));
  const Mask normal = _mm512_cmpge_epu32_mask(u, u32(kMinNormalBits));
  __m512i c = _mm512_min_epu32(_mm512_mask_blend_epi32(normal, cs, cn), u32(F::kMaxCode));
  const __m512i sign_src = _mm512_srli_epi32(b, 31 - kSignPos);
  const __m512i sign_bit = u32(1u << kSignPos);
  if constexpr (kMayBeNan) {
    const Mask nan = _mm512_cmpgt_epu32_mask(u, u32(kF32InfBits));
    if constexpr (F::kNanCode != 0) {
      c = _mm512_mask_mov_epi32(c, nan, u32(F::kNanCode));  // NaN keeps its sign: sign | 0x7F
    } else {
      c = _mm512_maskz_mov_epi32(static_cast<Mask>(~nan), c);  // E2M1: NaN is +0, no sign
      return _mm512_mask_ternarylogic_epi32(c, static_cast<Mask>(~nan), sign_src, sign_bit, 0xF8);
    }
  }
  return _mm512_ternarylogic_epi32(c, sign_src, sign_bit, 0xF8);  // c | (sign_src & sign_bit)
}

// out lane i = the unsigned max over the 16 lanes of m[i]: a transposing reduction (48 ops for
// 16 vectors instead of a horizontal reduction per vector).
static inline __m512i reduce16(const __m512i* m) {
  __m512i w[8], y[4], z[2];
  for (int k = 0; k < 8; ++k) {  // w[k]: 8 partials of m[2k], then 8 of m[2k+1]
    const __m512i a = m[2 * k], b = m[2 * k + 1];
    w[k] = _mm512_max_epu32(_mm512_shuffle_i32x4(a, b, 0x44), _mm512_shuffle_i32x4(a, b, 0xEE));
  }
  for (int k = 0; k < 4; ++k) {  // y[k]: quarter j holds 4 partials of m[4k + j]
    const __m512i a = w[2 * k], b = w[2 * k + 1];
    y[k] = _mm512_max_epu32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xDD));
  }
  for (int k = 0; k < 2; ++k) {  // z[k]: quarter j holds 2 partials of m[4k + j], 2 of m[4k + 8 + j]
    const __m512i a = y[k], b = y[k + 2];
    z[k] = _mm512_max_epu32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
  }
  const __m512i t0 = _mm512_max_epu32(z[0], _mm512_shuffle_epi32(z[0], _MM_PERM_CDAB));
  const __m512i t1 = _mm512_max_epu32(z[1], _mm512_shuffle_epi32(z[1], _MM_PERM_CDAB));
  // Lane 4j + t now holds m[j + 4t]; transpose that 4x4 back.
  const __m512i r = _mm512_mask_blend_epi32(0xAAAA, t0, t1);
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_epi32(idx, r);
}

// Byte codes of 16 lanes to out[0, n).
static inline void store_bytes(uint8_t* out, __m512i codes, Mask m) {
  _mm512_mask_cvtepi32_storeu_epi8(out, m, codes);
}

// 16 four-bit codes to 8 bytes (element 0 in the low nibble); writes ceil(n / 2) bytes. A lane
// past n holds the code of +0 (masked loads), which is the contract's pad nibble.
static inline void store_nibbles(uint8_t* out, __m512i codes, int64_t n) {
  const __m512i pairs = _mm512_or_si512(codes, _mm512_srli_epi64(codes, 28));
  const int64_t bytes = n >= 16 ? 8 : (n + 1) / 2;
  _mm512_mask_cvtepi64_storeu_epi8(out, static_cast<__mmask8>((1u << bytes) - 1u), pairs);
}

// Accumulates |x| bits of n inputs (lane-wise unsigned max) into acc: fp32 as 16 lanes, bf16 and
// fp16 as 32 half-width lanes (|x| bits of every format order like the values, NaN above Inf).
template <DType D>
static inline __m512i acc_abs(const typename In<D>::T* x, int64_t n, __m512i acc) {
  if constexpr (D == DType::f32) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_max_epu32(acc, abs_bits(_mm512_loadu_ps(x + i)));
    if (i < n) acc = _mm512_max_epu32(acc, abs_bits(_mm512_maskz_loadu_ps(tail_mask(n - i), x + i)));
    return acc;
  } else {
    const __m512i abs16 = _mm512_set1_epi16(0x7FFF);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_loadu_si512(x + i), abs16));
    if (i < n) {
      const __mmask32 k = static_cast<__mmask32>((1ull << (n - i)) - 1u);
      acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_maskz_loadu_epi16(k, x + i), abs16));
    }
    return acc;
  }
}

// 16 lanes of fp32 bit patterns whose unsigned max is the amax bits of what acc saw.
template <DType D>
static inline __m512i amax_lanes(__m512i acc) {
  if constexpr (D == DType::f32) {
    return acc;
  } else {
    const __m256i h = _mm256_max_epu16(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    if constexpr (D == DType::bf16) return _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    return _mm512_castps_si512(_mm512_cvtph_ps(h));  // exact; a NaN stays above Inf
  }
}

// 16 four-bit codes to 8 bytes, no mask (a full block).
static inline void store_nibbles16(uint8_t* out, __m512i codes) {
  const __m512i pairs = _mm512_or_si512(codes, _mm512_srli_epi64(codes, 28));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi8(pairs));
}

// 32 bf16 inputs widened to fp32 as two vectors, exactly: lane i of `even` is element 2i and
// lane i of `odd` element 2i + 1 (a bf16 is the high half of its fp32). Two instructions for 32
// inputs instead of four, and the codes pack back lane by lane (store_nibble_pairs) with
// element 2i in the low nibble, as the packed layouts want.
static inline void load_bf16_pairs(const void* p, __m512* even, __m512* odd) {
  const __m512i v = _mm512_loadu_si512(p);
  *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  *odd = _mm512_castsi512_ps(_mm512_and_si512(v, u32(0xFFFF0000u)));
}

// load_bf16_pairs for fp16 inputs (vcvtph2ps widens exactly, subnormals included).
static inline void load_f16_pairs(const void* p, __m512* even, __m512* odd) {
  const __m512i v = _mm512_loadu_si512(p);
  *even = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
  *odd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
}

// load_bf16_pairs or load_f16_pairs by the input type.
template <DType D>
static inline void load_pairs(const void* p, __m512* even, __m512* odd) {
  static_assert(D == DType::bf16 || D == DType::f16, "16-bit inputs");
  if constexpr (D == DType::bf16)
    load_bf16_pairs(p, even, odd);
  else
    load_f16_pairs(p, even, odd);
}

// 32 four-bit codes (lane i of lo: element 2i, of hi: element 2i + 1) to 16 bytes.
static inline void store_nibble_pairs(uint8_t* out, __m512i lo, __m512i hi) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4))));
}

// Lane k of v in every lane.
static inline __m512 lane(__m512 v, int k) { return _mm512_permutexvar_ps(_mm512_set1_epi32(k), v); }

// amax bits of n inputs (the same value as In<D>::amax_bits).
template <DType D>
static inline uint32_t amax(const typename In<D>::T* x, int64_t n) {
  return _mm512_reduce_max_epu32(amax_lanes<D>(acc_abs<D>(x, n, _mm512_setzero_si512())));
}

// The byte-lane kernels (VBMI) of avx512_fp8_tables.h, avx512_bytes.h, avx512_nvfp4_tables.h and
// avx512_int4_tables.h work on 64 bf16 inputs held in two vectors (elements 0-31, 32-63).
// bf16_lo_idx: the vpermt2b index that gathers the low byte of each 16-bit lane (+ 1: the high
// byte), so that lane i holds element i.
static inline __m512i bf16_lo_idx() {
  return _mm512_set_epi64(0x7E7C7A7876747270ll, 0x6E6C6A6866646260ll, 0x5E5C5A5856545250ll, 0x4E4C4A4846444240ll,
                          0x3E3C3A3836343230ll, 0x2E2C2A2826242220ll, 0x1E1C1A1816141210ll, 0x0E0C0A0806040200ll);
}
#if defined(__AVX512VBMI__)
// 64 bf16 inputs x[0, 64) on byte lanes: lane i of lo is input i's low byte (exponent bit 0 and
// the 7 mantissa bits m, which vpermi2b reads as a table index), of hi its high byte (sign,
// exponent bits 7..1), of e its exponent field 2 * (hi & 0x7F) + (lo >> 7) (the sign leaves the
// byte; the word shift keeps the bit wanted inside each byte).
struct Bf16Bytes {
  __m512i lo, hi, e;
};
static inline Bf16Bytes bf16_bytes(const uint16_t* x) {
  const __m512i v0 = _mm512_loadu_si512(x), v1 = _mm512_loadu_si512(x + 32);
  const __m512i lo_idx = bf16_lo_idx(), hi_idx = _mm512_add_epi8(lo_idx, _mm512_set1_epi8(1));
  const __m512i lo = _mm512_permutex2var_epi8(v0, lo_idx, v1), hi = _mm512_permutex2var_epi8(v0, hi_idx, v1);
  const __m512i e = _mm512_ternarylogic_epi32(_mm512_add_epi8(hi, hi), _mm512_srli_epi16(lo, 7), _mm512_set1_epi8(1), 0xF8);
  return {lo, hi, e};
}
#endif

// Prefetch distance of the streaming kernels (bytes of input ahead of the current position).
// On the project's VMs the hardware prefetchers leave a single-threaded stream waiting on
// memory about half of the time (a cast of 112 MiB of bf16: 0.52 ns per element without,
// 0.24 with prefetches 1 KiB ahead; 2 KiB was best for NVFP4 in a sweep of 1-8 KiB).
constexpr int64_t kPrefetchAhead = 2048;

// amax over a long flat range (a tensor-level scale): a pure read at memory speed. It reads
// kAmaxStreams sub-ranges in turn, 256 bytes at a time, each with its lines kAmaxAhead bytes
// ahead requested into L2 (prefetcht1): several streams keep more lines in flight than one, and
// L2 prefetches more than L1 ones. 112 MiB of bf16 on the AMD EPYC host, ns per element: one
// stream 0.10-0.11, four with prefetcht0 2 KiB ahead 0.075-0.085, eight with prefetcht1 4 KiB
// ahead 0.067-0.071 (16 streams, 8-16 KiB, prefetcht2: no better).
constexpr int64_t kAmaxStreams = 8;
constexpr int64_t kAmaxAhead = 4096;

template <DType D>
static inline uint32_t amax_stream(const typename In<D>::T* x, int64_t n) {
  using T = typename In<D>::T;
  constexpr int64_t kStep = 256 / static_cast<int64_t>(sizeof(T));
  const int64_t per = n / (kAmaxStreams * kStep) * kStep;  // whole steps per stream
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i < per; i += kStep) {
    for (int64_t s = 0; s < kAmaxStreams; ++s) {
      const T* p = x + s * per + i;
      const char* ahead = reinterpret_cast<const char*>(p) + kAmaxAhead;
      for (int64_t k = 0; k < 256; k += 64) _mm_prefetch(ahead + k, _MM_HINT_T1);
      acc = acc_abs<D>(p, kStep, acc);
    }
  }
  acc = acc_abs<D>(x + kAmaxStreams * per, n - kAmaxStreams * per, acc);
  return _mm512_reduce_max_epu32(amax_lanes<D>(acc));
}

}  // namespace simd

// Block amaxes of 16 blocks of 16 halves (bf16 / fp16 |x| bits, which order like the values)
// given as 8 vectors of 32: h[j] holds block 2j in its low half, block 2j + 1 in its high half.
// Returns the 16 maxima, block b in lane b, in the low 16 bits of 32-bit lanes (the high bits
// are not cleared). A transposing reduction on 16-bit lanes: 35 operations for 16 blocks.
static inline __m512i block16_amax_halves(const __m512i* h) {
  __m512i w[4], v[2];
  for (int k = 0; k < 4; ++k) {  // quarter q of w[k]: 8 partial maxima of block 4k + q
    const __m512i a = h[2 * k], b = h[2 * k + 1];
    w[k] = _mm512_max_epu16(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xDD));
  }
  for (int k = 0; k < 2; ++k) {  // quarter q of v[k]: 4 partials of block 8k + q, then of 8k + 4 + q
    const __m512i a = w[2 * k], b = w[2 * k + 1];
    v[k] = _mm512_max_epu16(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
  }
  // Pairs of 32-bit words within each quarter hold one block: fold them, then interleave the two
  // vectors so that quarter q holds blocks q, 8 + q, 4 + q, 12 + q (two partials each).
  const __m512i v0 = _mm512_max_epu16(v[0], _mm512_shuffle_epi32(v[0], _MM_PERM_CDAB));
  const __m512i v1 = _mm512_max_epu16(v[1], _mm512_shuffle_epi32(v[1], _MM_PERM_CDAB));
  __m512i z = _mm512_mask_blend_epi32(0xAAAA, v0, v1);
  z = _mm512_max_epu16(z, _mm512_srli_epi32(z, 16));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  return _mm512_permutexvar_epi32(order, z);
}

// Lane k = the amax bits (fp32) of acc[k], for 16 accumulators of |x| bits as acc_abs leaves
// them (16 fp32 lanes, or 32 bf16 / fp16 lanes). Half-width accumulators fold pairwise into
// block16_amax_halves' layout (3 operations a pair) and reduce on 16-bit lanes: 59 operations
// instead of 112 for widening each (amax_lanes) and reduce16.
template <DType D>
static inline __m512i amax16(const __m512i* acc) {
  if constexpr (D == DType::f32) {
    return simd::reduce16(acc);
  } else {
    __m512i h[8];
    for (int j = 0; j < 8; ++j) {
      const __m512i a = acc[2 * j], b = acc[2 * j + 1];
      h[j] = _mm512_max_epu16(_mm512_shuffle_i32x4(a, b, 0x44), _mm512_shuffle_i32x4(a, b, 0xEE));
    }
    const __m512i h16 = block16_amax_halves(h);
    if constexpr (D == DType::bf16) return _mm512_slli_epi32(h16, 16);
    return _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h16)));  // exact; NaN stays above Inf
  }
}

// Lane k (k < 4) = the amax bits (fp32) of acc[k], for 4 accumulators of bf16 / fp16 |x| bits
// (32 half-width lanes each); lanes 4-15 are 0. A transposing reduction on 16-bit lanes: 17
// operations instead of amax16's 59 with 12 zero accumulators.
template <DType D>
static inline __m512i amax4(const __m512i* acc) {
  // Quarter q of b: 8 partial maxima of acc[q].
  const __m512i a01 = _mm512_max_epu16(_mm512_shuffle_i32x4(acc[0], acc[1], 0x44), _mm512_shuffle_i32x4(acc[0], acc[1], 0xEE));
  const __m512i a23 = _mm512_max_epu16(_mm512_shuffle_i32x4(acc[2], acc[3], 0x44), _mm512_shuffle_i32x4(acc[2], acc[3], 0xEE));
  __m512i b = _mm512_max_epu16(_mm512_shuffle_i32x4(a01, a23, 0x88), _mm512_shuffle_i32x4(a01, a23, 0xDD));
  b = _mm512_max_epu16(b, _mm512_shuffle_epi32(b, _MM_PERM_BADC));
  b = _mm512_max_epu16(b, _mm512_shuffle_epi32(b, _MM_PERM_CDAB));
  b = _mm512_max_epu16(b, _mm512_srli_epi32(b, 16));  // the max of quarter q in its low word
  const __m512i h = _mm512_maskz_permutexvar_epi32(0x000F, _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), b);
  if constexpr (D == DType::bf16) return _mm512_slli_epi32(h, 16);
  const __m512i f = _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(h, simd::u32(0xFFFF)))));
  return _mm512_maskz_mov_epi32(0x000F, f);  // exact; NaN stays above Inf
}

// Software prefetch of lines [b0, b1) of p into L1. On the project's VMs the hardware
// prefetchers leave a single-threaded streaming kernel waiting on memory about half of the
// time: a cast of 112 MiB of bf16 ran at 0.52 ns per element without and 0.24 with prefetches.
static inline void prefetch_lines(const void* p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; b += 64) _mm_prefetch(static_cast<const char*>(p) + b, _MM_HINT_T0);
}
