// Exhaustive proof behind miles-quant's NVFP4 mantissa tables (native/quant/src/
// avx512_nvfp4_tables.h, the AVX512-VBMI build). Block scales: nvfp4_block_codes_tab equals
// nvfp4_block_code (contract.h) for every finite bf16 block amax, up to the tensor amax and
// above it (a given global scale, quantize(..., global_scale=), saturates those). Which given
// scales take the tables: nvfp4_tables_cover holds for the global scale of every finite bf16
// tensor amax and for no fp32 value one ulp away from one; nvfp4_tables_for's copies equal
// nvfp4_build_tables for each of those scales. Elements:
// nvfp4_elements256_tab's bytes equal the fp32
// path's (nvfp4_elements256: encode_E2M1(x * factor) with a vmulps, itself tested against the
// PyTorch reference) for every non-NaN bf16 input x, every block scale code 8..126 (2^-6..448,
// all the clamp allows; 16 different codes per batch of 16 blocks, rotated so that every input
// meets every code) and every global scale a bf16 tensor can have up to its exponent: all 128
// mantissas of the tensor amax and the 1e-10 clamp, at amax exponents from 2^-33 to 2^127.
// Also times both paths on one batch in L1. Run by tests/test_quant_nvfp4_tables.py; by hand:
//
//   g++ -O2 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vbmi \
//       -ffp-contract=off -Inative/quant/include -Inative/quant/src \
//       tools/bench/quant_nvfp4_tables_probe.cpp -o /tmp/nvfp4probe && /tmp/nvfp4probe
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#define MQ_CPU_NS avx512vbmi
#include "miles_quant/cpu_kernels.h"
#include "avx512_kernels.h"
using namespace miles_quant;
using namespace miles_quant::cpu::avx512vbmi;

static_assert(kNvfp4Tables, "compile with -mavx512vbmi");

int main() {
  // nvfp4_tables_cover: true on every computed global scale, false one fp32 ulp off each.
  uint64_t cover_bad = 0, cover_checked = 0;
  for (uint32_t h = 0; h < 0x7F80u; ++h) {
    const float sg = nvfp4_global_scale(bits_f32(h << 16));
    cover_checked += 3;
    if (!nvfp4_tables_cover(sg) && cover_bad++ < 10) std::printf("cover: scale of %04x not covered\n", h);
    for (const uint32_t off : {f32_bits(sg) - 1u, f32_bits(sg) + 1u})
      if (nvfp4_tables_cover(bits_f32(off)) && cover_bad++ < 10) std::printf("cover: %08x (near the scale of %04x) covered\n", off, h);
  }
  std::printf("nvfp4_tables_cover wrong: %llu of %llu\n", static_cast<unsigned long long>(cover_bad),
              static_cast<unsigned long long>(cover_checked));

  // nvfp4_tables_for (the per-mantissa tables, copied and patched for the exponent) against
  // nvfp4_build_tables, field by field, for the global scale of every finite bf16 amax.
  uint64_t for_bad = 0, for_checked = 0;
  {
    Nvfp4Tables built, got;
    for (uint32_t h = 0; h < 0x7F80u; ++h) {
      const float sg = nvfp4_global_scale(bits_f32(h << 16));
      nvfp4_build_tables(sg, &built);
      ++for_checked;
      bool same = nvfp4_tables_for(sg, &got);
      same = same && std::memcmp(built.t, got.t, sizeof(built.t)) == 0 && std::memcmp(built.bs, got.bs, sizeof(built.bs)) == 0;
      same = same && built.k_g == got.k_g && built.one == got.one;
      for (int j = 0; j < 8; ++j) same = same && built.cj[j] == got.cj[j] && built.bj[j] == got.bj[j] && built.cb[j] == got.cb[j];
      if (built.one) same = same && std::memcmp(built.a, got.a, 128) == 0 && std::memcmp(built.g, got.g, 128) == 0;
      if (!same && for_bad++ < 10) std::printf("nvfp4_tables_for: the scale of %04x differs from nvfp4_build_tables\n", h);
    }
    // A scale the tables do not cover is refused.
    for (const uint32_t h : {0x3F80u, 0x4321u, 0x0101u}) {
      const float sg = nvfp4_global_scale(bits_f32(h << 16));
      ++for_checked;
      if (nvfp4_tables_for(bits_f32(f32_bits(sg) + 1u), &got) && for_bad++ < 10)
        std::printf("nvfp4_tables_for: took a scale one ulp above that of %04x\n", h);
    }
  }
  std::printf("nvfp4_tables_for wrong: %llu of %llu\n", static_cast<unsigned long long>(for_bad),
              static_cast<unsigned long long>(for_checked));

  std::vector<uint16_t> xs;
  for (uint32_t b = 0; b < 65536; ++b)
    if ((b & 0x7FFFu) <= 0x7F80u) xs.push_back(static_cast<uint16_t>(b));  // all but NaN
  while (xs.size() % 256) xs.push_back(0);
  const size_t n = xs.size();
  std::vector<uint8_t> want(n / 2), got(n / 2);
  uint64_t bad = 0, checked = 0, bad_codes = 0, checked_codes = 0, one = 0, scales = 0;
  Nvfp4Tables tables;
  alignas(64) uint8_t codes[16];
  alignas(64) float factors[16];
  // Tensor amax exponent fields: 94 is the smallest at or above the 1e-10 clamp, 254 the largest.
  for (uint32_t ef : {94u, 100u, 120u, 127u, 140u, 180u, 220u, 254u}) {
    for (uint32_t i = 0; i <= 128; ++i) {
      if (i == 128 && ef != 94) continue;  // the clamp: one global scale
      const float amax = i < 128 ? bits_f32((ef << 23) | (i << 16)) : 0.0f;
      const float sg = nvfp4_global_scale(amax);
      const float inv = 1.0f / sg;
      nvfp4_build_tables(sg, &tables);
      one += tables.one;
      ++scales;
      // Block codes: every finite bf16 block amax, 16 at a time (those above the tensor's
      // occur with a given global scale).
      const uint32_t top = 0x7F7Fu;
      alignas(64) uint32_t lanes[16], got16[16];
      for (uint32_t b0 = 0; b0 <= top; b0 += 16) {
        for (uint32_t k = 0; k < 16; ++k) lanes[k] = (b0 + k <= top ? b0 + k : top) | 0xABCD0000u;  // high bits: noise
        _mm512_store_si512(got16, nvfp4_block_codes_tab(_mm512_load_si512(lanes), tables));
        for (uint32_t k = 0; k < 16; ++k) {
          const uint32_t want_code = nvfp4_block_code(bits_f32((lanes[k] & 0xFFFFu) << 16), sg);
          ++checked_codes;
          if (got16[k] != want_code && bad_codes++ < 10)
            std::printf("amax %08x block amax %04x: block code %u, tables %u\n", f32_bits(amax), lanes[k] & 0xFFFFu, want_code, got16[k]);
        }
      }
      for (uint32_t t = 0; t < 119; ++t) {
        for (uint32_t k = 0; k < 16; ++k) {
          codes[k] = static_cast<uint8_t>(8 + (k + t) % 119);
          factors[k] = nvfp4_block_factor(inv, codes[k]);
        }
        const __m512 factor = _mm512_load_ps(factors);
        const __m512i kk = nvfp4_block_kk(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes))), tables);
        for (size_t b = 0; b < n; b += 256) nvfp4_elements256<DType::bf16>(&xs[b], factor, &want[b / 2]);
        // The tables as built (the one table where it exists), then the 8 tables for the same scale.
        for (int pass = 0; pass < (tables.one ? 2 : 1); ++pass) {
          Nvfp4Tables eight = tables;
          if (pass == 1) eight.one = false;
          const __m512i kb = pass == 1 ? _mm512_maskz_mov_epi8(0xFFFFFFFFull, kk) : kk;  // B bytes 0 as nvfp4_block_kk
          for (size_t b = 0; b < n; b += 256) nvfp4_elements256_tab(&xs[b], kb, codes, eight, &got[b / 2]);
          checked += n / 2;
          if (std::memcmp(want.data(), got.data(), n / 2) != 0) {
            for (size_t j = 0; j < n / 2; ++j)
              if (want[j] != got[j] && bad++ < 10)
                std::printf("amax %08x shift %u byte %zu (inputs %04x %04x, code %u, %s): fp32 path %02x, tables %02x\n",
                            f32_bits(amax), t, j, xs[2 * j], xs[2 * j + 1], codes[(j / 8) % 16],
                            eight.one ? "one table" : "8 tables", want[j], got[j]);
          }
        }
      }
    }
  }
  std::printf("mismatching block codes: %llu of %llu (every finite bf16 block amax x global scales)\n",
              static_cast<unsigned long long>(bad_codes), static_cast<unsigned long long>(checked_codes));
  std::printf("mismatching bytes: %llu of %llu (non-NaN bf16 inputs x block codes x global scales, one table and 8)\n",
              static_cast<unsigned long long>(bad), static_cast<unsigned long long>(checked));
  std::printf("global scales with one table: %llu of %llu\n", static_cast<unsigned long long>(one),
              static_cast<unsigned long long>(scales));
  // L1 timing: one batch of moderate values, block codes 40..55.
  std::vector<uint16_t> x(256);
  for (int i = 0; i < 256; ++i) x[i] = static_cast<uint16_t>(0x3f00 + (i * 37 % 300) + ((i & 1) << 15));
  const float inv = 1.0f / nvfp4_global_scale(4.0f);
  nvfp4_build_tables(nvfp4_global_scale(4.0f), &tables);
  for (uint32_t k = 0; k < 16; ++k) {
    codes[k] = static_cast<uint8_t>(40 + k);
    factors[k] = nvfp4_block_factor(inv, codes[k]);
  }
  const __m512 factor = _mm512_load_ps(factors);
  const __m512i kk = nvfp4_block_kk(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes))), tables);
  Nvfp4Tables eight = tables;
  eight.one = false;
  const __m512i kk8 = _mm512_maskz_mov_epi8(0xFFFFFFFFull, kk);
  if (!tables.one) std::printf("(no one table for this scale: both timings are of the 8 tables)\n");
  constexpr int kReps = 400000;
  for (int r = 0; r < 3; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < kReps; ++k) {
      nvfp4_elements256<DType::bf16>(x.data(), factor, want.data());
      asm volatile("" ::: "memory");
    }
    const auto t1 = std::chrono::steady_clock::now();
    for (int k = 0; k < kReps; ++k) {
      nvfp4_elements256_tab(x.data(), kk, codes, tables, got.data());
      asm volatile("" ::: "memory");
    }
    const auto t2 = std::chrono::steady_clock::now();
    for (int k = 0; k < kReps; ++k) {
      nvfp4_elements256_tab(x.data(), kk8, codes, eight, got.data());
      asm volatile("" ::: "memory");
    }
    const auto t3 = std::chrono::steady_clock::now();
    const double el = 256.0 * kReps;
    std::printf("nvfp4 elements in L1: fp32 path %.3f ns/el, one table %.3f ns/el, 8 tables %.3f ns/el\n",
                std::chrono::duration<double, std::nano>(t1 - t0).count() / el,
                std::chrono::duration<double, std::nano>(t2 - t1).count() / el,
                std::chrono::duration<double, std::nano>(t3 - t2).count() / el);
  }
  return bad == 0 && bad_codes == 0 && for_bad == 0 && cover_bad == 0 ? 0 : 1;
}
