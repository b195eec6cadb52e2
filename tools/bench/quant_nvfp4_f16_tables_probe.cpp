// Exhaustive proof behind miles-quant's NVFP4 tables for fp16 inputs (native/quant/src/
// avx512_nvfp4_tables16.h, the AVX512-VBMI build).
// - Which global scales take them: nvfp4_covered_mantissa16 names the amax mantissa of the
//   scale of every finite, non-zero fp16 tensor amax, and refuses the all-zero tensor's scale
//   and every fp32 value one ulp away from a covered scale.
// - nvfp4_tab16_for's view (the mantissa's tables, built once, with F_j patched for the
//   exponent) equals nvfp4_build_tables16 for each covered scale.
// - Block scales: nvfp4_block_codes_tab16 equals nvfp4_block_code (contract.h) for every finite
//   fp16 block amax (above the tensor amax too: a given global scale, quantize(...,
//   global_scale=), saturates those), and gives the NaN code for Inf and NaN with Given, under
//   the 3,071 global scales below.
// - Elements: nvfp4_elements256_tab16's bytes equal the fp32 path's (nvfp4_elements256<f16>:
//   encode_E2M1(x * factor) with a vmulps, itself tested against the PyTorch reference) for
//   every finite fp16 input x, every block scale code 8..126 (16 different codes per batch of 16
//   blocks, rotated so that every input meets every code) and the global scale of every fp16
//   tensor amax mantissa at the largest and the smallest normal exponent (2^15, 2^-14) and of
//   every subnormal fp16 amax: where C reaches its ends (-31 and 24), the steps that meet a
//   subnormal x in a block of C <= 0 (the fp32 path's) included.
// Also times both paths on one batch in L1. Run by tests/test_quant_nvfp4_tables.py; by hand:
//
//   g++ -O2 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vbmi \
//       -ffp-contract=off -Inative/quant/include -Inative/quant/src \
//       tools/bench/quant_nvfp4_f16_tables_probe.cpp -o /tmp/nvfp4f16 && /tmp/nvfp4f16
#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#define MQ_CPU_NS avx512vbmi
#include "miles_quant/cpu_kernels.h"
#include "avx512_kernels.h"
#include "quant_probe_util.h"
using namespace miles_quant;
using namespace miles_quant::cpu::avx512vbmi;

static_assert(kNvfp4Tables, "compile with -mavx512vbmi");

int main() {
  // nvfp4_covered_mantissa16: the mantissa of every finite non-zero fp16 amax's scale, -1 one
  // fp32 ulp off each and for the all-zero tensor's scale.
  uint64_t cover_bad = 0, cover_checked = 0;
  for (uint32_t h = 1; h <= 0x7BFFu; ++h) {
    const float a = f16_to_f32(static_cast<uint16_t>(h));
    const float sg = nvfp4_global_scale(a);
    cover_checked += 3;
    if (nvfp4_covered_mantissa16(sg) != static_cast<int>((f32_bits(a) >> 13) & 0x3FFu) && cover_bad++ < 10)
      std::printf("cover: scale of %04x: mantissa %d\n", h, nvfp4_covered_mantissa16(sg));
    for (const uint32_t off : {f32_bits(sg) - 1u, f32_bits(sg) + 1u})
      if (nvfp4_covered_mantissa16(bits_f32(off)) >= 0 && cover_bad++ < 10)
        std::printf("cover: %08x (near the scale of %04x) covered\n", off, h);
  }
  ++cover_checked;
  if (nvfp4_covered_mantissa16(nvfp4_global_scale(0.0f)) >= 0 && cover_bad++ < 10) std::printf("cover: the 1e-10 clamp covered\n");
  std::printf("nvfp4_covered_mantissa16 wrong: %llu of %llu\n", static_cast<unsigned long long>(cover_bad),
              static_cast<unsigned long long>(cover_checked));

  // nvfp4_tab16_for against a fresh nvfp4_build_tables16, for every covered scale.
  uint64_t for_bad = 0, for_checked = 0, not_ok = 0;
  for (uint32_t h = 1; h <= 0x7BFFu; ++h) {
    const float sg = nvfp4_global_scale(f16_to_f32(static_cast<uint16_t>(h)));
    Nvfp4Tables16 built;
    nvfp4_build_tables16(sg, &built);
    not_ok += !built.ok;
    Nvfp4Tab16 got;
    ++for_checked;
    bool same = nvfp4_tab16_for(sg, &got) && std::memcmp(got.dt, built.dt, sizeof(built.dt)) == 0;
    same = same && std::memcmp(got.bs, built.bs, sizeof(built.bs)) == 0;
    same = same && got.k_g == built.r0 - 8 * static_cast<int32_t>(f32_bits(sg) >> 23) && got.inv == 1.0f / sg;
    for (int j = 0; j < 8; ++j) same = same && got.f[j] == built.f[j] - 130;
    if (!same && for_bad++ < 10) std::printf("nvfp4_tab16_for: the scale of %04x differs from nvfp4_build_tables16\n", h);
  }
  std::printf("nvfp4_tab16_for wrong: %llu of %llu (tables without the step shape: %llu)\n",
              static_cast<unsigned long long>(for_bad), static_cast<unsigned long long>(for_checked),
              static_cast<unsigned long long>(not_ok));

  std::vector<uint16_t> xs;
  for (uint32_t b = 0; b < 65536; ++b)
    if ((b & 0x7FFFu) < 0x7C00u) xs.push_back(static_cast<uint16_t>(b));  // every finite fp16
  while (xs.size() % 256) xs.push_back(0);
  const size_t n = xs.size();
  std::vector<uint8_t> want(n / 2), got(n / 2);
  std::vector<uint16_t> amaxes;
  for (uint32_t i = 0; i < 1024; ++i) {
    amaxes.push_back(static_cast<uint16_t>((30u << 10) | i));  // [2^15, 65504]
    amaxes.push_back(static_cast<uint16_t>((1u << 10) | i));   // [2^-14, 2^-13)
    if (i > 0) amaxes.push_back(static_cast<uint16_t>(i));     // subnormal
  }
  uint64_t bad = 0, checked = 0, scales = 0, bad_codes = 0, checked_codes = 0;
  alignas(64) uint8_t codes[16];
  alignas(64) float factors[16];
  for (const uint16_t ah : amaxes) {
    const float sg = nvfp4_global_scale(f16_to_f32(ah));
    const float inv = 1.0f / sg;
    Nvfp4Tab16 tab;
    if (!nvfp4_tab16_for(sg, &tab)) {
      if (bad++ < 10) std::printf("amax %04x: no tables\n", ah);
      continue;
    }
    ++scales;
    // Block codes: every fp16 block amax magnitude (Inf and NaN: the NaN code with Given), 16 at
    // a time, with noise in the lanes' high halves.
    alignas(64) uint32_t lanes[16], got16[16], given16[16];
    for (uint32_t b0 = 0; b0 <= 0x7FFFu; b0 += 16) {
      for (uint32_t k = 0; k < 16; ++k) lanes[k] = (b0 + k) | 0xABCD0000u;
      _mm512_store_si512(got16, nvfp4_block_codes_tab16<false>(_mm512_load_si512(lanes), tab));
      _mm512_store_si512(given16, nvfp4_block_codes_tab16<true>(_mm512_load_si512(lanes), tab));
      for (uint32_t k = 0; k < 16; ++k) {
        const uint32_t h = lanes[k] & 0xFFFFu;
        const bool finite = h < 0x7C00u;
        const uint32_t want_code = finite ? nvfp4_block_code(f16_to_f32(static_cast<uint16_t>(h)), sg) : E4M3::kNanCode;
        checked_codes += finite ? 2 : 1;
        if (((finite && got16[k] != want_code) || given16[k] != want_code) && bad_codes++ < 10)
          std::printf("amax %04x block amax %04x: block code %u, tables %u (given %u)\n", ah, h, want_code, got16[k], given16[k]);
      }
    }
    for (uint32_t t = 0; t < 119; ++t) {
      for (uint32_t k = 0; k < 16; ++k) {
        codes[k] = static_cast<uint8_t>(8 + (k + t) % 119);
        factors[k] = nvfp4_block_factor(inv, codes[k]);
      }
      const __m512 factor = _mm512_load_ps(factors);
      for (size_t b = 0; b < n; b += 256) nvfp4_elements256<DType::f16>(&xs[b], factor, &want[b / 2]);
      for (size_t b = 0; b < n; b += 256) nvfp4_elements256_tab16(&xs[b], codes, tab, &got[b / 2]);
      checked += n / 2;
      if (std::memcmp(want.data(), got.data(), n / 2) != 0) {
        for (size_t j = 0; j < n / 2; ++j)
          if (want[j] != got[j] && bad++ < 10)
            std::printf("amax %04x shift %u byte %zu (inputs %04x %04x, code %u): fp32 path %02x, tables %02x\n", ah, t, j,
                        xs[2 * j], xs[2 * j + 1], codes[(j / 8) % 16], want[j], got[j]);
      }
    }
  }
  std::printf("mismatching block codes: %llu of %llu (fp16 block amaxes x %llu global scales, computed and given)\n",
              static_cast<unsigned long long>(bad_codes), static_cast<unsigned long long>(checked_codes),
              static_cast<unsigned long long>(scales));
  std::printf("mismatching bytes: %llu of %llu (finite fp16 inputs x block codes x %llu global scales)\n",
              static_cast<unsigned long long>(bad), static_cast<unsigned long long>(checked),
              static_cast<unsigned long long>(scales));

  // L1 timing: one batch of moderate normal values (no subnormal: the tables' own path), block
  // codes 96..111 under the scale of amax 4.
  std::vector<uint16_t> x(256);
  for (int i = 0; i < 256; ++i) x[i] = static_cast<uint16_t>(0x3000 + (i * 397 % 3000) + ((i & 1) << 15));
  const float sg = nvfp4_global_scale(4.0f), inv = 1.0f / sg;
  Nvfp4Tab16 tab;
  nvfp4_tab16_for(sg, &tab);
  for (uint32_t k = 0; k < 16; ++k) {
    codes[k] = static_cast<uint8_t>(96 + k);
    factors[k] = nvfp4_block_factor(inv, codes[k]);
  }
  const __m512 factor = _mm512_load_ps(factors);
  time_paths_l1(
      "nvfp4 fp16 elements", 256.0, 400000, [&] { nvfp4_elements256<DType::f16>(x.data(), factor, want.data()); },
      [&] { nvfp4_elements256_tab16(x.data(), codes, tab, got.data()); });
  const __m512 vsg = _mm512_set1_ps(sg), vinv = _mm512_set1_ps(inv);
  time_paths_l1(
      "nvfp4 fp16 block scales", 256.0, 400000,
      [&] {
        const __m512 f = nvfp4_scales256<DType::f16>(x.data(), vsg, vinv, codes);
        _mm512_store_ps(factors, f);
      },
      [&] { nvfp4_scales256_tab16<false>(x.data(), tab, codes); });
  return bad == 0 && bad_codes == 0 && for_bad == 0 && cover_bad == 0 && not_ok == 0 ? 0 : 1;
}
