// Probes behind docs/benchmarks.md "AMD EPYC (Zen 4) host": what one FP8 element costs in an L1
// loop (load + widen, the IEEE division, the encode, a reciprocal with an exact fallback), and an
// alternative encode checked against the kernels' over every non-NaN fp32 input. Not part of the
// build.
//
//   g++ -O3 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -ffp-contract=off \
//       -Inative/quant/include -Inative/quant/src tools/bench/quant_encode_probe.cpp -o /tmp/probe && /tmp/probe
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <chrono>
#include <vector>
#include <cstring>
#define MQ_CPU_NS avx512
#include "miles_quant/cpu_kernels.h"
#include "avx512_kernels.h"  // the kernels' own simd::encode, measured as "current"
using namespace miles_quant;
using cpu::avx512::simd::u32;  // the kernels' own helper
template <class F> static inline __m512i enc_cur(__m512 f) { return cpu::avx512::simd::encode<F, false>(f); }

template <class F> static inline __m512i enc_new(__m512 f) {
  constexpr int M = F::kMbits, kEmin = 1 - F::kBias, kSignPos = F::kEbits + F::kMbits;
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + kEmin) << 23;
  constexpr uint32_t kMaxBits = (static_cast<uint32_t>((F::kMaxCode >> M) - F::kBias + 127) << 23) |
                                ((F::kMaxCode & ((1u << M) - 1)) << (23 - M));
  constexpr uint32_t kMagicOff = static_cast<uint32_t>(23 - M) << 23;
  constexpr uint32_t kK1 = 0u - kMagicOff - (static_cast<uint32_t>(127 + kEmin) << M);
  const __m512i b = _mm512_castps_si512(f);
  const __m512i u = _mm512_min_epu32(_mm512_and_si512(b, u32(kF32AbsMask)), u32(kMaxBits));
  const __m512i e = _mm512_max_epu32(_mm512_and_si512(u, u32(kF32InfBits)), u32(kMinNormalBits));
  const __m512i s = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(u), _mm512_castsi512_ps(_mm512_add_epi32(e, u32(kMagicOff)))));
  const __m512i c = _mm512_add_epi32(_mm512_sub_epi32(s, e), _mm512_add_epi32(_mm512_srli_epi32(e, 23 - M), u32(kK1)));
  const __m512i sign_src = _mm512_srli_epi32(b, 31 - kSignPos);
  return _mm512_ternarylogic_epi32(c, sign_src, u32(1u << kSignPos), 0xF8);
}

// The reciprocal variant: q = x * (1 / s), and the exact division only for a vector with a lane
// within W fp32 ulps of a tie of a normal target or in the subnormal-target range (timed only).
template <class F> static inline __mmask16 near_tie(__m512 q) {
  constexpr int M = F::kMbits, kEmin = 1 - F::kBias;
  constexpr uint32_t W = 8, mask = (1u << (23 - M)) - 1, half = 1u << (22 - M);
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + kEmin) << 23;
  constexpr uint32_t kTinyBits = static_cast<uint32_t>(127 + kEmin - M - 3) << 23;
  const __m512i u = _mm512_and_si512(_mm512_castps_si512(q), u32(0x7FFFFFFF));
  const __m512i t = _mm512_and_si512(_mm512_add_epi32(u, u32(W - half)), u32(mask));
  return _mm512_cmplt_epu32_mask(t, u32(2 * W)) |
         _mm512_cmplt_epu32_mask(_mm512_sub_epi32(u, u32(kTinyBits)), u32(kMinNormalBits - kTinyBits));
}

template <class F> double bench_recip(const std::vector<float>& in, std::vector<uint8_t>& out) {
  const __m512 vs = _mm512_set1_ps(1.7f), vr = _mm512_set1_ps(1.0f / 1.7f);
  auto t0 = std::chrono::steady_clock::now();
  for (int rep = 0; rep < 2000; ++rep)
    for (size_t i = 0; i < in.size(); i += 16) {
      const __m512 x = _mm512_loadu_ps(&in[i]);
      __m512 q = _mm512_mul_ps(x, vr);
      if (__builtin_expect(near_tie<F>(q) != 0, 0)) q = _mm512_div_ps(x, vs);
      _mm_storeu_si128((__m128i*)&out[i], _mm512_cvtepi32_epi8(enc_cur<F>(q)));
    }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / (2000.0 * in.size()) * 1e9;
}

template <class F> bool exhaustive(const char* name) {
  uint64_t bad = 0;
  for (uint64_t base = 0; base < (1ull << 32); base += 16) {
    __m512i b = _mm512_add_epi32(u32((uint32_t)base), _mm512_setr_epi32(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15));
    __m512i a = enc_cur<F>(_mm512_castsi512_ps(b)), c = enc_new<F>(_mm512_castsi512_ps(b));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, u32(kF32AbsMask)), u32(kF32InfBits));
    __mmask16 ne = _mm512_mask_cmpneq_epi32_mask(~nan, a, c);
    if (ne) { if (bad < 5) { alignas(64) uint32_t x[16], y[16], z[16]; _mm512_store_si512(x,b); _mm512_store_si512(y,a); _mm512_store_si512(z,c);
      for (int i=0;i<16;++i) if ((ne>>i)&1) printf("%s %08x cur %x new %x\n", name, x[i], y[i], z[i]); }
      bad += __builtin_popcount(ne); }
  }
  printf("%s: %llu mismatches over all non-NaN fp32\n", name, (unsigned long long)bad);
  return bad == 0;
}

template <class F, int V> double bench(const std::vector<float>& in, std::vector<uint8_t>& out) {
  auto t0 = std::chrono::steady_clock::now();
  for (int rep = 0; rep < 2000; ++rep)
    for (size_t i = 0; i < in.size(); i += 16) {
      __m512 f = _mm512_div_ps(_mm512_loadu_ps(&in[i]), _mm512_set1_ps(1.7f));
      __m512i c = V == 0 ? enc_cur<F>(f) : enc_new<F>(f);
      _mm_storeu_si128((__m128i*)&out[i], _mm512_cvtepi32_epi8(c));
    }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / (2000.0 * in.size()) * 1e9;
}

// Load + widen + store alone, with the division, with a multiply instead (V = 0, 1, 2).
template <int V> double parts(const std::vector<uint16_t>& in, std::vector<uint8_t>& out) {
  auto t0 = std::chrono::steady_clock::now();
  const __m512 s = _mm512_set1_ps(1.7f);
  for (int rep = 0; rep < 4000; ++rep)
    for (size_t i = 0; i < in.size(); i += 16) {
      __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)&in[i])), 16));
      if (V == 1) f = _mm512_div_ps(f, s);
      if (V == 2) f = _mm512_mul_ps(f, s);
      _mm_storeu_si128((__m128i*)&out[i], _mm512_cvtepi32_epi8(_mm512_castps_si512(f)));
    }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / (4000.0 * in.size()) * 1e9;
}

int main() {
  bool ok = exhaustive<E4M3>("e4m3") & exhaustive<E5M2>("e5m2") & exhaustive<E2M1>("e2m1");
  std::vector<float> in(8192);
  std::vector<uint8_t> out(8192);
  std::vector<uint16_t> half(8192, 0x3f80);
  for (size_t i = 0; i < in.size(); ++i) in[i] = (float)((int)(i * 2654435761u % 2001) - 1000) * 0.37f;
  for (int r = 0; r < 3; ++r) {
    printf("load+widen+store %.3f, +div %.3f, +mul %.3f ns/el | ", parts<0>(half, out), parts<1>(half, out), parts<2>(half, out));
    printf("div+encode+store e4m3: current %.3f alternative %.3f; e2m1: %.3f / %.3f ns/el | ",
           bench<E4M3, 0>(in, out), bench<E4M3, 1>(in, out), bench<E2M1, 0>(in, out), bench<E2M1, 1>(in, out));
    printf("e4m3 reciprocal + check + encode + store %.3f ns/el\n", bench_recip<E4M3>(in, out));
  }
  return ok ? 0 : 1;
}
