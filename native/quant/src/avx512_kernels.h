// AVX-512 leaf kernels: the same per-group arithmetic as cpu_kernels.h, 16 fp32 lanes at a time.
//
// Included by avx512_leaf.h (cpu_isa_avx512.cpp, compiled with -mavx512f/bw/vl/dq, and
// cpu_isa_avx512vbmi.cpp, with -mavx512vbmi too), after cpu_kernels.h, inside namespace
// miles_quant::cpu::MQ_CPU_NS. Every vector step is the lane-wise twin of a scalar
// step of the contract: element encoding is the round-to-nearest-even of bits.h/elements.h on
// 32-bit lanes (integer for normal targets, one exact fp32 addition for subnormal ones, see
// encode; E2M1 in the quantizers by one fp32 addition onto its grid, see e2m1_magnitude),
// divisions and multiplications are single IEEE fp32 operations (vdivps / vmulps,
// exact like their scalar forms; no FMA, no reciprocal estimate), and scales follow contract.h
// operation for operation, for 16 groups at a time: their amaxes come out of one transposing
// reduction (reduce16), and whole batches of 16 blocks take unmasked paths. Tails run through
// masked loads (zero lanes never change an amax and encode to the pad code) and masked stores,
// so no byte outside a row is touched. Large inputs are streamed with software prefetches and
// in two to four interleaved streams (see kPrefetchAhead): that changes the order in which
// groups are visited, never their arithmetic. The tests compare this path with the AVX2 and generic
// builds of the scalar code and with the PyTorch reference bit for bit.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <iterator>

namespace miles_quant {
namespace cpu {
namespace MQ_CPU_NS {
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

#include "avx512_fp8_tables.h"  // kFp8Tables, fp8_tab, fp8_tab_run (VBMI builds)

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
  if constexpr (D == DType::bf16 && kFp8Tables) {
    const int64_t whole = n / 32 * 32;
    fp8_tab_run<F, true>(x, whole, fp8_tab<F>(fp8_tables<F>(), amax, s), s, a.out + begin);
    fp8_run_v<D, F>(x + whole, n - whole, s, a.out + begin + whole);
    return;
  }
  fp8_run_v<D, F, true>(x, n, s, a.out + begin);
}

// Software prefetch of lines [b0, b1) of p into L1. On the project's VMs the hardware
// prefetchers leave a single-threaded streaming kernel waiting on memory about half of the
// time: a cast of 112 MiB of bf16 ran at 0.52 ns per element without and 0.24 with prefetches.
static inline void prefetch_lines(const void* p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; b += 64) _mm_prefetch(static_cast<const char*>(p) + b, _MM_HINT_T0);
}

// nb whole bf16 tiles of one row, tc (a multiple of 32) inputs each, tile k divided by s[k]:
// fp8_run_v's bf16 loop for all of them in one branch-free loop (a poisoned tile's codes are
// overwritten), so that the encode's constants stay in registers across tiles instead of being
// rebuilt per call. kPrefetch: request each tile's lines kPrefetchAhead bytes ahead first.
// With kFp8Tables, tile k is encoded by its table tab[k] (fp8_tab_run) and a poisoned tile is
// filled with NaN codes.
template <class F, bool kPrefetch>
static inline void fp8_tiles_row_bf16(const uint16_t* x, int64_t nb, int64_t tc, const float* s, const Fp8Tab* tab,
                                      simd::Mask poisoned, uint8_t* out) {
  if constexpr (kFp8Tables) {
    for (int64_t k = 0; k < nb; ++k) {
      if constexpr (kPrefetch) prefetch_lines(reinterpret_cast<const char*>(x + k * tc) + simd::kPrefetchAhead, 0, tc * 2);
      if ((poisoned >> k) & 1)
        std::memset(out + k * tc, F::kNanCode, static_cast<size_t>(tc));
      else
        fp8_tab_run<F, false>(x + k * tc, tc, tab[k], s[k], out + k * tc);
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
// or a column chunk of it that fits in L2: at most kBandBytes of input) at a time, in two
// passes. The amax pass reads the band, which is (nearly) contiguous memory, as kStreams row
// groups in turn, a tile of each at a time, with prefetches kPrefetchAhead bytes ahead: several
// long streams keep more lines in flight than the column-strided walk of a tile. The cast pass
// then reads the band again, from L2, row by row. 8192x7168 bf16, one thread: 0.36 ns per
// element against 0.44 for chunks of 4 tiles with the amax of the next one interleaved.
template <DType D, class F>
static void fp8_bands_v(const Fp8Args& a, int64_t t0, int64_t t1) {
  using T = typename In<D>::T;
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(T)), kBandBytes = int64_t{2} << 20;
  constexpr int64_t kStreams = 4, kMaxTiles = 64;
  const auto* x = static_cast<const T*>(a.x);
  const int64_t R = a.rows, C = a.cols, tr = a.tile_rows, tc = a.tile_cols;
  const int64_t nr = (R + tr - 1) / tr, nc = (C + tc - 1) / tc;
  // Tiles per band: a multiple of 16 (the scale batch), at least 16, at most kMaxTiles.
  int64_t cw = kBandBytes / (tr * tc * kSize) / 16 * 16;
  cw = cw < 16 ? 16 : (cw > kMaxTiles ? kMaxTiles : cw);
  __m512i acc[kMaxTiles];
  alignas(64) float s[kMaxTiles];
  alignas(64) uint32_t amax_bits[kMaxTiles];
  [[maybe_unused]] const Fp8Tables<F>& tables = fp8_tables<F>();
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
      if constexpr (D == DType::bf16 && kFp8Tables)
        for (int64_t k = 0; k < nb; ++k) tab[k] = fp8_tab<F>(tables, amax_bits[k], s[k]);
      const int64_t cb = j0 * tc;
      const bool whole = D == DType::bf16 && tc % 32 == 0 && lo(C, cb + nb * tc) - cb == nb * tc;
      for (int64_t r = r0; r < r1; ++r) {
        if constexpr (D == DType::bf16) {
          if (whole) {  // one branch-free loop per 16 tiles of the row (fp8_tiles_row_bf16)
            for (int64_t k0 = 0; k0 < nb; k0 += 16) {
              const int64_t c0 = cb + k0 * tc;
              fp8_tiles_row_bf16<F, true>(x + r * C + c0, lo(16, nb - k0), tc, s + k0, tab + k0, poisoned[k0 / 16],
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
  constexpr bool kTab = D == DType::bf16 && kFp8Tables;
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
  [[maybe_unused]] const Fp8Tables<F>& tables = fp8_tables<F>();
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
      for (int64_t k = 0; k < c.nb; ++k) tab[k] = fp8_tab<F>(tables, amax_bits[k], s[k]);
    }
  };
  const auto cast = [&](const Chunk& c) {
    const int64_t r = c.r;
    if constexpr (D == DType::bf16) {
      if (tc % 32 == 0 && c.ce - c.cb == c.nb * tc) {  // whole tiles: one branch-free loop
        fp8_tiles_row_bf16<F, false>(x + r * C + c.cb, c.nb, tc, s, tab, poisoned, a.out + r * C + c.cb);
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

// ---- E2M1 by one fp32 addition (MXFP4 and NVFP4) ---------------------------------------

// The E2M1 code of |v| (sign not included) for a v that is not NaN: the lane-wise encode<E2M1>
// of |v| in 7 operations instead of the integer rounding's 11. |v| is clamped to [2^-4, 6]
// (every magnitude below 0.25 encodes to 0 and every one from 6 up, +Inf included, saturates to
// 6, so the clamp changes no code) and rounded onto the E2M1 grid by one fp32 addition: the grid
// step is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], so with M = 2^22, 2^23 or 2^24 picked by
// the exponent of |v|, |v| + M lies in M's binade, whose ulp is that step; the sum is M plus
// |v| rounded to nearest, ties to an even multiple of the step (the code's last bit, as RNE
// wants), and bits(sum) - bits(M) counts the steps. Adding the code of the binade's first grid
// point (0, 2 or 4 steps were skipped) gives the code: both M and bits(M) - that offset come
// from 16-entry tables indexed by the low 4 bits of the exponent field (123..129 here). The
// raw E2M1 cast (encode_run_v) uses it too, so test_elements.py checks it on ties, near-ties
// and random fp32; during development it matched encode<E2M1> on every non-NaN fp32 pattern.
static inline __m512i e2m1_magnitude(__m512 v) {
  constexpr int kM0 = 149 << 23, kM1 = 150 << 23, kM2 = 151 << 23;  // 2^22, 2^23, 2^24
  const __m512i mtab = _mm512_setr_epi32(kM1, kM2, 0, 0, 0, 0, 0, 0, 0, 0, 0, kM0, kM0, kM0, kM0, kM0);
  const __m512i ktab = _mm512_setr_epi32(kM1 - 2, kM2 - 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, kM0, kM0, kM0, kM0, kM0);
  __m512 r = _mm512_range_ps(v, _mm512_set1_ps(0.0625f), 0x0B);  // max(|v|, |2^-4|), sign cleared
  r = _mm512_min_ps(r, _mm512_set1_ps(E2M1::kMax));
  const __m512i e = _mm512_srli_epi32(_mm512_castps_si512(r), 23);
  const __m512 m = _mm512_castsi512_ps(_mm512_permutexvar_epi32(e, mtab));
  return _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(r, m)), _mm512_permutexvar_epi32(e, ktab));
}

// The E2M1 code of v (not NaN) with its sign: encode<E2M1, false>.
static inline __m512i e2m1_code(__m512 v) {
  const __m512i sign = _mm512_srli_epi32(_mm512_castps_si512(v), 28);
  return _mm512_ternarylogic_epi32(e2m1_magnitude(v), sign, simd::u32(8), 0xF8);  // a | (b & c)
}

// ---- MX: 1x32 blocks, E8M0 scales; 16 blocks of a row at a time ----------------------------

#include "avx512_bytes.h"  // kE2m1Grid11 (NVFP4 tables too), mx4/mx8_elements512_bf16_b (VBMI builds)

// E8M0 codes of 16 block amaxes (fp32 bits, none poisoned): the lane-wise e8m0_code<F>.
template <class F>
static inline __m512i e8m0_codes(ScaleRule rule, __m512i amax) {
  const __m512i zero = _mm512_setzero_si512();
  if (rule == ScaleRule::rceil) {
    const __m512 d = _mm512_div_ps(_mm512_castsi512_ps(amax), _mm512_set1_ps(F::kMax));
    const __m512i db = _mm512_castps_si512(d);
    const __m512i field = _mm512_srli_epi32(db, 23);
    const __m512i mant = _mm512_and_si512(db, simd::u32(0x007FFFFFu));
    __m512i code = _mm512_mask_add_epi32(field, _mm512_test_epi32_mask(mant, mant), field, simd::u32(1));
    const __m512i sub = _mm512_maskz_mov_epi32(_mm512_cmpgt_epu32_mask(mant, simd::u32(0x00400000u)), simd::u32(1));
    code = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(field, zero), code, sub);
    return _mm512_min_epu32(code, simd::u32(254));
  }
  __m512i r = amax;
  if (rule == ScaleRule::even)
    r = _mm512_and_si512(_mm512_add_epi32(amax, simd::u32(1u << (22 - F::kMbits))), simd::u32(0xFF800000u));
  // clamp((r >> 23) - 127 - emax, -127, 127) + 127 == clamp((r >> 23) - emax, 0, 254)
  const __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(r, 23), simd::u32(F::kEmax));
  return _mm512_min_epi32(_mm512_max_epi32(e, zero), simd::u32(254));
}

// The lane-wise e8m0_inverse: 2^(127 - code) (code 254 gives the subnormal 2^-127).
static inline __m512 e8m0_inverses(__m512i code) {
  const __m512i v = _mm512_slli_epi32(_mm512_sub_epi32(simd::u32(254), code), 23);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(v, _mm512_cmpge_epu32_mask(code, simd::u32(254)), simd::u32(0x00400000u)));
}

// The elements of 16 whole bf16 blocks scaled by mul (lane k: block k's 2^-e), 32 inputs (one
// block) at a time, split into even and odd elements (two instructions for 32 exact widenings,
// see load_bf16_pairs); the codes interleave back lane by lane: byte pairs for FP8 elements,
// nibble pairs for E2M1 (encoded by e2m1_magnitude, 7 operations instead of encode's 13).
// Branch-free: a poisoned block's codes are overwritten, so that the compiler keeps every
// constant of the encodes in registers across the loop (a branch per block made GCC rebuild
// them per block). Used for batches with a code below kMx16MinCode (the 16-bit paths take the
// rest), and as those paths' reference in tools/bench/quant_mx_16bit_probe.cpp.
template <class F, bool kAnyPoisoned>
static inline void mx_elements512_bf16(const uint16_t* x, __m512 mul, simd::Mask poisoned, uint8_t* out) {
  constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  for (int k = 0; k < 16; ++k) {
    const __m512 f = simd::lane(mul, k);
    __m512 even, odd;
    simd::load_bf16_pairs(x + 32 * k, &even, &odd);
    even = _mm512_mul_ps(even, f);
    odd = _mm512_mul_ps(odd, f);
    __m512i w;
    if constexpr (kPacked) {
      // x * 2^-e keeps x's sign (zeros included): bits 15 and 31 of a pair to bits 3 and 7.
      const __m512i sg = _mm512_and_si512(_mm512_loadu_si512(x + 32 * k), simd::u32(0x80008000u));
      const __m512i sign = _mm512_or_si512(_mm512_srli_epi32(sg, 12), _mm512_srli_epi32(sg, 24));
      w = _mm512_ternarylogic_epi32(e2m1_magnitude(even), _mm512_slli_epi32(e2m1_magnitude(odd), 4), sign, 0xFE);
    } else {
      w = _mm512_or_si512(simd::encode<F, false>(even), _mm512_slli_epi32(simd::encode<F, false>(odd), 8));
    }
    if constexpr (kAnyPoisoned) {
      const simd::Mask pk = static_cast<simd::Mask>(0u - ((poisoned >> k) & 1u));
      w = _mm512_mask_mov_epi32(w, pk, simd::u32(kPacked ? F::kNanCode * 0x11u : F::kNanCode * 0x101u));
    }
    if constexpr (kPacked)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * k), _mm512_cvtepi32_epi8(w));
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * k), _mm512_cvtepi32_epi16(w));
  }
}

// The 16-bit MX paths' scaling: per block, 127 - code in the bf16 exponent field's position,
// in both 16-bit halves of lane k (mx16_deltas); then |x| * 2^(127 - code) of 32 bf16 inputs as
// bits, by adding it to the exponent field of every non-zero |x| (mx16_scaled).
static inline __m512i mx16_deltas(__m512i code) {
  const __m512i delta = _mm512_and_si512(_mm512_slli_epi32(_mm512_sub_epi32(simd::u32(127), code), 7), simd::u32(0xFFFF));
  return _mm512_or_si512(delta, _mm512_slli_epi32(delta, 16));
}
static inline __m512i mx16_scaled(__m512i v, __m512i deltas, int k) {
  const __m512i u = _mm512_and_si512(v, simd::u32(0x7FFF7FFFu));
  const __m512i dk = _mm512_permutexvar_epi32(_mm512_set1_epi32(k), deltas);
  return _mm512_mask_add_epi16(u, _mm512_test_epi16_mask(u, u), u, dk);
}

// MXFP4 elements of 16 whole bf16 blocks on 16-bit lanes, 32 inputs per instruction instead of
// 16. For E8M0 codes of at least 3 it gives mx_elements512_bf16's bytes exactly (every non-NaN,
// non-Inf bf16 input whose scaled magnitude is below 2^(emax + 1) = 8, as every input of a block
// is under every scale rule, against every code 3..254: tools/bench/quant_mx_16bit_probe.cpp):
// - |x| * 2^(127 - code) is an exact power-of-two scaling, so it is an addition to the bf16
//   exponent field; a result below the normal range (a negative or small field) and a bf16
//   subnormal input (whose "exponent" the addition makes up) both stand for a magnitude below
//   2^(1 - code) <= 0.25, which encodes to 0 either way (the compares below are signed, so an
//   underflowed field reads as below 0.25); zeros are left alone.
// - From 1.0 up: the integer RNE onto one mantissa bit (E2M1 bias 1), saturated at code 7 (6.0).
// - Below 1.0: 0.5 (code 1) above 0.25, 1.0 (code 2) from 0.75, ties to even.
// Poisoned blocks get zero bytes (E2M1 has no NaN: the contract's +0), like the fp32 path.
static inline void mx4_elements512_bf16_h(const uint16_t* x, __m512i code, simd::Mask poisoned, uint8_t* out) {
  const __m512i d16 = mx16_deltas(code);
  const __m512i one = _mm512_set1_epi16(1);
  const __m512i bias = _mm512_set1_epi16(static_cast<short>(31 - (126 << 7)));  // half - 1, rebias
  for (int k = 0; k < 16; ++k) {
    const __m512i v = _mm512_loadu_si512(x + 32 * k);
    const __m512i r = mx16_scaled(v, d16, k);
    __m512i cn = _mm512_add_epi16(_mm512_add_epi16(r, bias), _mm512_and_si512(_mm512_srli_epi16(r, 6), one));
    cn = _mm512_min_epu16(_mm512_srli_epi16(cn, 6), _mm512_set1_epi16(7));
    const __mmask32 half = _mm512_cmpgt_epi16_mask(r, _mm512_set1_epi16(0x3E80));   // > 0.25
    const __mmask32 whole = _mm512_cmpge_epi16_mask(r, _mm512_set1_epi16(0x3F40));  // >= 0.75
    const __m512i cs = _mm512_maskz_mov_epi16(half, one);
    __m512i c = _mm512_mask_add_epi16(cs, whole, cs, one);
    c = _mm512_mask_mov_epi16(c, _mm512_cmpge_epi16_mask(r, _mm512_set1_epi16(0x3F80)), cn);
    c = _mm512_ternarylogic_epi32(c, _mm512_srli_epi16(v, 12), _mm512_set1_epi16(8), 0xF8);  // sign to bit 3
    c = _mm512_maskz_mov_epi32(static_cast<simd::Mask>(~(0u - ((poisoned >> k) & 1u))), c);
    // 16-bit codes (element 2i low) to nibble pairs: the high half's code to bits 4-7.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * k), _mm512_cvtepi32_epi8(_mm512_or_si512(c, _mm512_srli_epi32(c, 12))));
  }
}

// The smallest E8M0 code for which mx4/mx8_elements512_bf16_h are exact: 2 - emin + M (3 for E2M1,
// 11 for E4M3, 18 for E5M2). Below it a bf16 subnormal input, whose exponent field the 16-bit
// path would make up, could scale to a non-zero code.
template <class F>
constexpr uint32_t kMx16MinCode = static_cast<uint32_t>(2 + (F::kBias - 1) + F::kMbits);

// MXFP8 (E4M3, E5M2) elements of 16 whole bf16 blocks on 16-bit lanes, for E8M0 codes of at
// least kMx16MinCode<F>: the same bytes as mx_elements512_bf16 (every non-NaN, non-Inf bf16
// input a block can hold, every code: tools/bench/quant_mx_16bit_probe.cpp). |x| * 2^(127 -
// code) is an addition to the bf16 exponent field (see mx4_elements512_bf16_h for why an
// underflowed field or a subnormal input is harmless); normal targets round on the integer bits
// (encode's integer path on 16 bits); magnitudes up to half the smallest subnormal step encode
// to 0. A block holding a magnitude between that and the smallest normal (a subnormal target:
// |x| within about 2^-18..2^-14 of the block amax, rare) is encoded again by the fp32 path.
template <class F>
static inline void mx8_elements512_bf16_h(const uint16_t* x, __m512i code, __m512 mul, simd::Mask poisoned, uint8_t* out) {
  constexpr int kShift = 7 - F::kMbits, kEmin = 1 - F::kBias;
  constexpr int kMinNormal = (127 + kEmin) << 7, kZeroMax = (127 + kEmin - F::kMbits - 1) << 7;
  constexpr int kRound = ((1 << (kShift - 1)) - 1) - ((127 - F::kBias) << 7);
  const __m512i d16 = mx16_deltas(code);
  const __m512i one = _mm512_set1_epi16(1);
  for (int k = 0; k < 16; ++k) {
    const __m512i v = _mm512_loadu_si512(x + 32 * k);
    const __m512i r = mx16_scaled(v, d16, k);
    __m512i c = _mm512_add_epi16(_mm512_add_epi16(r, _mm512_set1_epi16(static_cast<short>(kRound))), _mm512_and_si512(_mm512_srli_epi16(r, kShift), one));
    c = _mm512_min_epu16(_mm512_srli_epi16(c, kShift), _mm512_set1_epi16(static_cast<short>(F::kMaxCode)));
    c = _mm512_maskz_mov_epi16(_mm512_cmpge_epi16_mask(r, _mm512_set1_epi16(static_cast<short>(kMinNormal))), c);
    c = _mm512_ternarylogic_epi32(c, _mm512_srli_epi16(v, 8), _mm512_set1_epi16(0x80), 0xF8);  // sign to bit 7
    const __mmask32 sub = _mm512_cmpgt_epi16_mask(r, _mm512_set1_epi16(static_cast<short>(kZeroMax))) &
                          _mm512_cmplt_epi16_mask(r, _mm512_set1_epi16(static_cast<short>(kMinNormal)));
    if (__builtin_expect(sub != 0, 0)) {
      __m512 even, odd;
      simd::load_bf16_pairs(x + 32 * k, &even, &odd);
      const __m512 f = simd::lane(mul, k);
      c = _mm512_or_si512(simd::encode<F, false>(_mm512_mul_ps(even, f)), _mm512_slli_epi32(simd::encode<F, false>(_mm512_mul_ps(odd, f)), 16));
    }
    c = _mm512_mask_mov_epi32(c, static_cast<simd::Mask>(0u - ((poisoned >> k) & 1u)), simd::u32(F::kNanCode * 0x10001u));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * k), _mm512_cvtepi16_epi8(c));  // 16-bit codes to bytes
  }
}

// 16 whole blocks (512 contiguous inputs): the masked loop below without masks or branches.
template <DType D, class F>
static inline void mx_batch512(const typename In<D>::T* x, ScaleRule rule, uint8_t* scales, uint8_t* out) {
  constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  const char* ahead = reinterpret_cast<const char*>(x) + simd::kPrefetchAhead;
  for (int64_t b = 0; b < 512 * static_cast<int64_t>(sizeof(*x)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
  __m512i amax;
  if constexpr (D == DType::f32) {
    __m512i m[16];
    for (int k = 0; k < 16; ++k)
      m[k] = _mm512_max_epu32(simd::abs_bits(_mm512_loadu_ps(x + 32 * k)), simd::abs_bits(_mm512_loadu_ps(x + 32 * k + 16)));
    amax = simd::reduce16(m);
  } else {
    // A block is one vector of 32 halves (76 operations for the 16 amaxes, see amax16).
    __m512i m[16];
    for (int k = 0; k < 16; ++k) m[k] = _mm512_and_si512(_mm512_loadu_si512(x + 32 * k), _mm512_set1_epi16(0x7FFF));
    amax = amax16<D>(m);
  }
  const simd::Mask poisoned = _mm512_cmpge_epu32_mask(amax, simd::u32(kF32InfBits));
  const __m512i code = _mm512_mask_mov_epi32(e8m0_codes<F>(rule, amax), poisoned, simd::u32(kE8M0Nan));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(scales), _mm512_cvtepi32_epi8(code));
  const __m512 mul = e8m0_inverses(code);
  if constexpr (D == DType::bf16) {
    if (_mm512_cmplt_epu32_mask(code, simd::u32(kMx16MinCode<F>)) == 0) {  // 16-bit lanes
      if constexpr (kPacked) {
        if (kMxBytes && poisoned == 0 && _mm512_cmplt_epu32_mask(code, simd::u32(kMx4BytesMinCode)) == 0)
          mx4_elements512_bf16_b(x, code, out);  // byte lanes (VBMI)
        else
          mx4_elements512_bf16_h(x, code, poisoned, out);
      } else {
        if (kMxBytes && poisoned == 0)
          mx8_elements512_bf16_b<F>(x, code, mul, out);  // byte lanes (VBMI)
        else
          mx8_elements512_bf16_h<F>(x, code, mul, poisoned, out);
      }
      return;
    }
    if (poisoned == 0)
      mx_elements512_bf16<F, false>(x, mul, 0, out);
    else
      mx_elements512_bf16<F, true>(x, mul, poisoned, out);
    return;
  }
  for (int k = 0; k < 16; ++k) {
    __m512i c0 = simd::u32(F::kNanCode), c1 = c0;
    if (!((poisoned >> k) & 1)) {
      const __m512 f = simd::lane(mul, k);
      c0 = simd::encode<F, false>(_mm512_mul_ps(simd::load<D>(x + 32 * k, 0xFFFF), f));
      c1 = simd::encode<F, false>(_mm512_mul_ps(simd::load<D>(x + 32 * k + 16, 0xFFFF), f));
    }
    if constexpr (kPacked) {
      simd::store_nibbles16(out + 16 * k, c0);
      simd::store_nibbles16(out + 16 * k + 8, c1);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * k), _mm512_cvtepi32_epi8(c0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * k + 16), _mm512_cvtepi32_epi8(c1));
    }
  }
}

template <DType D, class F>
static void mx_rows_v(const MxArgs& a, int64_t r0, int64_t r1) {
  constexpr int64_t kBlock = 32;
  constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  const auto* xs = static_cast<const typename In<D>::T*>(a.x);
  const int64_t C = a.cols, nblk = (C + kBlock - 1) / kBlock;
  const int64_t out_stride = kPacked ? (C + 1) / 2 : C;
  const __m512i nan_codes = simd::u32(F::kNanCode);
  __m512i m[16];
  alignas(64) float mul[16];
  for (int64_t r = r0; r < r1; ++r) {
    const auto* x = xs + r * C;
    uint8_t* out = a.out + r * out_stride;
    uint8_t* scales = a.scales + r * nblk;
    int64_t b0 = 0;
    for (; (b0 + 16) * kBlock <= C; b0 += 16)
      mx_batch512<D, F>(x + b0 * kBlock, a.rule, scales + b0, out + (kPacked ? b0 * 16 : b0 * kBlock));
    for (; b0 < nblk; b0 += 16) {
      const int64_t nb = lo(16, nblk - b0);
      for (int64_t k = 0; k < 16; ++k) m[k] = _mm512_setzero_si512();
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t j = (b0 + k) * kBlock, n = lo(kBlock, C - j);
        m[k] = simd::amax_lanes<D>(simd::acc_abs<D>(x + j, n, _mm512_setzero_si512()));
      }
      const __m512i amax = simd::reduce16(m);
      const simd::Mask poisoned = _mm512_cmpge_epu32_mask(amax, simd::u32(kF32InfBits));
      const __m512i code = _mm512_mask_mov_epi32(e8m0_codes<F>(a.rule, amax), poisoned, simd::u32(kE8M0Nan));
      simd::store_bytes(scales + b0, code, simd::tail_mask(nb));
      _mm512_store_ps(mul, e8m0_inverses(code));
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t j = (b0 + k) * kBlock, n = lo(kBlock, C - j), n1 = n > 16 ? n - 16 : 0;
        const simd::Mask m0 = simd::tail_mask(n), m1 = simd::tail_mask(n1);
        __m512i c0 = nan_codes, c1 = nan_codes;
        if (!((poisoned >> k) & 1)) {
          const __m512 f = _mm512_set1_ps(mul[k]);
          c0 = simd::encode<F, false>(_mm512_mul_ps(simd::load<D>(x + j, m0), f));
          c1 = simd::encode<F, false>(_mm512_mul_ps(simd::load<D>(x + j + 16, m1), f));
        }
        if constexpr (kPacked) {
          simd::store_nibbles(out + j / 2, c0, n);
          if (n1 > 0) simd::store_nibbles(out + j / 2 + 8, c1, n1);
        } else {
          simd::store_bytes(out + j, c0, m0);
          if (n1 > 0) simd::store_bytes(out + j + 16, c1, m1);
        }
      }
    }
  }
}

// ---- NVFP4: 16-element blocks (1x16) or 16x16 tiles; 16 blocks along the row at a time -----

// nvfp4_block_code and nvfp4_block_factor (contract.h) for 16 block amaxes, lane-wise. The
// clamped block scale is at least 2^-6, the smallest normal E4M3, so its code decodes as normal.
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
  return code;
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

#include "avx512_nvfp4_tables.h"  // kNvfp4Tables, nvfp4_elements256_tab (VBMI builds)

// Rows the 1x16 kernel interleaves, batch by batch: two streams through memory keep more lines
// in flight than one (8192x7168 bf16: 0.21 ns per element against 0.24); 4, 6 or 8 were slower
// (0.23, 0.26, 0.28 ns with the tables).
constexpr int kNvfp4Streams = 2;

// The whole batches of 1x16 rows r[0, n), n <= kNvfp4Streams, interleaved batch by batch. Each
// row is software-pipelined: the next batch's amax and scales (a chain of three divisions) are
// computed before this batch's elements, which hide its latency. tables[k]: the mantissa
// tables of row k's matrix (bf16 with kNvfp4Tables; else unused).
template <DType D>
static void nvfp4_row_group(const Nvfp4Args& a, const int64_t* r, int n, const Nvfp4Tables* const* tables) {
  using T = typename In<D>::T;
  constexpr bool kTab = D == DType::bf16 && kNvfp4Tables;  // block codes and elements by tables
  const int64_t R = a.rows, C = a.cols, nc = (C + 15) / 16, out_stride = (C + 1) / 2;
  const int64_t batches = C / 256;
  struct Row {
    const T* x;
    uint8_t* scales;
    uint8_t* out;
    __m512 sg, inv, f;  // the fp32 path: global scale, its inverse, the batch's element factors
    __m512i k;          // the tables: the batch's nvfp4_block_c
    const Nvfp4Tables* tables;
  };
  // The first half of batch q of row w (its scales), and the second (its elements).
  const auto scales = [](Row& w, int64_t q, __m512* f, __m512i* k) {
    if constexpr (kTab)
      *k = nvfp4_scales256_tab(w.x + q * 256, *w.tables, w.scales + q * 16);
    else
      *f = nvfp4_scales256<D>(w.x + q * 256, w.sg, w.inv, w.scales + q * 16);
  };
  const auto elements = [](const Row& w, int64_t q) {
    if constexpr (kTab)
      nvfp4_elements256_tab(w.x + q * 256, w.k, w.scales + q * 16, *w.tables, w.out + q * 128);
    else
      nvfp4_elements256<D>(w.x + q * 256, w.f, w.out + q * 128);
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
    Nvfp4Tables tables[kNvfp4Streams];
    int64_t matrix[kNvfp4Streams];
    for (int k = 0; k < kNvfp4Streams; ++k) matrix[k] = -1;
    const int64_t g = (t1 - t0 + kNvfp4Streams - 1) / kNvfp4Streams;
    for (int64_t i = 0; i < g; ++i) {
      int64_t r[kNvfp4Streams];
      const Nvfp4Tables* tab[kNvfp4Streams];
      int n = 0;
      for (int k = 0; k < kNvfp4Streams; ++k) {
        const int64_t row = t0 + k * g + i;
        if (row >= t1 || is_poisoned(gamax[row / R])) continue;
        if constexpr (D == DType::bf16 && kNvfp4Tables) {
          if (matrix[k] != row / R) {
            matrix[k] = row / R;
            nvfp4_build_tables(a.global_scale[row / R], &tables[k]);
          }
        }
        r[n] = row;
        tab[n++] = &tables[k];
      }
      if (n > 0) nvfp4_row_group<D>(a, r, n, tab);
    }
  }
  __m512i m[16];
  alignas(64) float factor[16];
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
    for (int64_t j0 = batched ? C / 256 * 16 : 0; j0 < nc; j0 += 16) {
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
      for (int64_t r = r0; r < r1; ++r) simd::store_bytes(a.scales + r * nc + j0, code, simd::tail_mask(nb));
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t c0 = (j0 + k) * 16, n = lo(16, C - c0);
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

// ---- INT4 -----------------------------------------------------------------------------------

// Offset-binary INT4 codes of 16 lanes against the stored scale s (int4_code in contract.h):
// RNE(clamp(x / s, -8, 8)) clamped to [-7, 7], + 8. RNE is monotone and +-7 are integers, so
// that equals RNE(clamp(x / s, -7, 7)) (x / s is finite or +-Inf: the group is not poisoned),
// one clamp instead of two. RNE is vcvtps2dq under round-to-nearest, which our threads select.
static inline __m512i int4_codes(__m512 v, __m512 s) {
  __m512 y = _mm512_div_ps(v, s);
  y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-7.0f)), _mm512_set1_ps(7.0f));
  return _mm512_add_epi32(_mm512_cvtps_epi32(y), _mm512_set1_epi32(8));
}

// The stored INT4 scales of 16 groups (store_scale in cpu_kernels.h, lane-wise): writes the
// first nb to `dst` in the storage dtype and returns them widened back to fp32. Poisoned lanes
// store the canonical quiet NaN of the dtype.
static inline __m512 int4_store_scales(__m512i amax, simd::Mask poisoned, DType sd, void* dst, int64_t nb) {
  __m512 s = _mm512_div_ps(_mm512_castsi512_ps(amax), _mm512_set1_ps(kInt4Qmax));
  s = _mm512_max_ps(s, _mm512_set1_ps(kInt4ScaleMin));
  const simd::Mask m = simd::tail_mask(nb);
  if (sd == DType::bf16) {
    const __m512i u = _mm512_castps_si512(s);
    __m512i h = _mm512_add_epi32(u, _mm512_add_epi32(simd::u32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), simd::u32(1))));
    h = _mm512_mask_mov_epi32(_mm512_srli_epi32(h, 16), poisoned, simd::u32(0x7FC0));
    _mm512_mask_cvtepi32_storeu_epi16(dst, m, h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  }
  if (sd == DType::f16) {
    // RNE to fp16; anything above 65504 rounds to at most Inf and saturates to 65504 (the
    // contract's satfinite), so clamping first gives the same code.
    __m256i h = _mm512_cvtps_ph(_mm512_min_ps(s, _mm512_set1_ps(65504.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    h = _mm256_mask_mov_epi16(h, poisoned, _mm256_set1_epi16(0x7E00));
    _mm256_mask_storeu_epi16(dst, m, h);
    return _mm512_cvtph_ps(h);
  }
  s = _mm512_mask_mov_ps(s, poisoned, _mm512_castsi512_ps(simd::u32(kF32QuietNan)));
  _mm512_mask_storeu_ps(dst, m, s);
  return s;
}

#include "avx512_int4_tables.h"  // kInt4Tables, int4_tab_groups (VBMI builds)

template <DType D>
static void int4_rows_v(const Int4Args& a, int64_t r0, int64_t r1) {
  const auto* xs = static_cast<const typename In<D>::T*>(a.x);
  const int64_t C = a.cols, g = a.group;
  const int64_t out_stride = (C + 1) / 2, ng = (C + g - 1) / g;
  const int64_t scale_size = a.scale_dtype == DType::f32 ? 4 : 2;
  __m512i m[16];
  for (int64_t r = r0; r < r1; ++r) {
    const auto* x = xs + r * C;
    uint8_t* out = a.out + r * out_stride;
    for (int64_t j0 = 0; j0 < ng; j0 += 16) {
      const int64_t nb = lo(16, ng - j0);
      for (int64_t k = 0; k < 16; ++k) m[k] = _mm512_setzero_si512();
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t j = (j0 + k) * g;
        const char* ahead = reinterpret_cast<const char*>(x + j) + simd::kPrefetchAhead;
        for (int64_t b = 0; b < g * static_cast<int64_t>(sizeof(*x)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
        m[k] = simd::amax_lanes<D>(simd::acc_abs<D>(x + j, lo(g, C - j), _mm512_setzero_si512()));
      }
      const __m512i amax = simd::reduce16(m);
      const simd::Mask poisoned = _mm512_cmpge_epu32_mask(amax, simd::u32(kF32InfBits));
      uint8_t* dst = static_cast<uint8_t*>(a.scales) + (r * ng + j0) * scale_size;
      const __m512 sv = int4_store_scales(amax, poisoned, a.scale_dtype, dst, nb);
      simd::Mask done = 0;  // groups the mantissa tables encoded; the fp32 lanes do the rest
      if constexpr (D == DType::bf16 && kInt4Tables)
        done = int4_tab_groups(x + j0 * g, C - j0 * g, g, nb, amax, sv, poisoned, a.scale_dtype, out + j0 * g / 2);
      for (int64_t k = 0; k < nb; ++k) {
        if ((done >> k) & 1) continue;
        const int64_t j = (j0 + k) * g, n = lo(g, C - j);
        const bool bad = (poisoned >> k) & 1;
        const __m512 s = simd::lane(sv, static_cast<int>(k));
        int64_t i0 = 0;
        if constexpr (D == DType::bf16) {
          for (; i0 + 32 <= n; i0 += 32) {
            if (bad) {
              std::memset(out + (j + i0) / 2, 0x88, 16);
              continue;
            }
            __m512 ev, od;
            simd::load_bf16_pairs(x + j + i0, &ev, &od);
            simd::store_nibble_pairs(out + (j + i0) / 2, int4_codes(ev, s), int4_codes(od, s));
          }
        }
        for (int64_t i = i0; i < n; i += 16) {
          const simd::Mask mk = simd::tail_mask(n - i);
          // Lanes past the row are 0 / s = 0 -> code 8, the pad nibble; poisoned groups write 8s.
          const __m512i c = bad ? simd::u32(8) : int4_codes(simd::load<D>(x + j + i, mk), s);
          if (n - i >= 16)
            simd::store_nibbles16(out + (j + i) / 2, c);
          else
            simd::store_nibbles(out + (j + i) / 2, c, n - i);
        }
      }
    }
  }
}

// ---- raw casts and amax ---------------------------------------------------------------------

template <class F>
static void encode_run_v(const float* x, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const simd::Mask m = simd::tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    if constexpr (F::kEbits + F::kMbits == 3) {
      // The quantizers' E2M1 encoding (e2m1_code), so that the element tests check it on raw
      // values; NaN (which quantizers never encode) becomes +0 as the contract says.
      const simd::Mask nan = _mm512_cmpgt_epu32_mask(simd::abs_bits(v), simd::u32(kF32InfBits));
      simd::store_bytes(out + i, _mm512_maskz_mov_epi32(static_cast<simd::Mask>(~nan), e2m1_code(v)), m);
    } else {
      simd::store_bytes(out + i, simd::encode<F, true>(v), m);
    }
  }
}

}  // namespace MQ_CPU_NS
}  // namespace cpu
}  // namespace miles_quant
