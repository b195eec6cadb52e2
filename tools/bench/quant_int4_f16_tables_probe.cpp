// Exhaustive proof behind miles-quant's INT4 tables for fp16 inputs (native/quant/src/
// avx512_int4_tables16.h, the AVX512-VBMI build).
// - Tables: every table of every scale dtype (1025 each: the 1024 amax mantissas and the clamp)
//   has the step shape, and int4_tab16_step's codes equal the fp32 lanes' (int4_codes: x / s,
//   clamp, vcvtps2dq; itself tested against the PyTorch reference) for every fp16 x and every
//   scale s1 * 2^(E - 127) with the table's s1 and C = E - 114 in [1, 26], all the kernel takes.
// - Groups: int4_tab_groups16 inside the whole kernel path for every 7th fp16 group amax, every
//   fp16 x with |x| <= amax, every scale dtype and both group sizes, against the fp32 lanes, and
//   which groups it leaves to them.
// Also times both paths on 128 inputs in L1. Run by tests/test_quant_int4_tables.py; by hand:
//
//   g++ -O2 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vbmi \
//       -ffp-contract=off -Inative/quant/include -Inative/quant/src \
//       tools/bench/quant_int4_f16_tables_probe.cpp -o /tmp/int4f16 && /tmp/int4f16
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

static_assert(kInt4Tables, "compile with -mavx512vbmi");

// The fp32 lanes' codes of 32 fp16 inputs under scale s, paired as int4_tab16_step pairs them.
static __m512i fp32_pairs(const uint16_t* x, float s) {
  alignas(64) uint32_t c[32];
  const __m512 vs = _mm512_set1_ps(s);
  _mm512_store_si512(c, int4_codes(simd::load<DType::f16>(x, 0xFFFF), vs));
  _mm512_store_si512(c + 16, int4_codes(simd::load<DType::f16>(x + 16, 0xFFFF), vs));
  alignas(64) uint32_t d[16];
  for (int i = 0; i < 16; ++i) d[i] = c[2 * i] + 16 * c[2 * i + 1];
  return _mm512_load_si512(d);
}

int main() {
  std::vector<uint16_t> xs;
  for (uint32_t b = 0; b < 65536; ++b)
    if ((b & 0x7FFFu) < 0x7C00u) xs.push_back(static_cast<uint16_t>(b));  // every finite fp16
  while (xs.size() % 32) xs.push_back(0);
  uint64_t bad = 0, checked = 0, not_ok = 0;
  for (const DType sd : {DType::f32, DType::bf16, DType::f16}) {
    const Int4Tables16& t = int4_tables16(sd);
    not_ok += !t.ok;
    for (uint32_t i = 0; i < 1025; ++i) {
      const __m512i tab = _mm512_load_si512(t.t[i]);
      for (int32_t c = 1; c <= 26; ++c) {
        const float s = bits_f32(t.sig[i] | (static_cast<uint32_t>(c + 114) << 23));
        const __m512i c7 = _mm512_set1_epi16(static_cast<short>(7 * c + 28));
        for (size_t b = 0; b < xs.size(); b += 32) {
          const __m512i got = int4_tab16_step(_mm512_loadu_si512(&xs[b]), tab, c7);
          const __m512i want = fp32_pairs(&xs[b], s);
          checked += 32;
          const uint32_t diff = _mm512_cmpneq_epi32_mask(got, want);
          if (diff != 0 && bad++ < 10)
            std::printf("scale dtype %d table %u C %d inputs %04x..: lanes %04x differ\n", static_cast<int>(sd), i, c, xs[b], diff);
        }
      }
    }
  }
  std::printf("tables without the step shape: %llu\n", static_cast<unsigned long long>(not_ok));
  std::printf("mismatching codes: %llu of %llu (finite fp16 inputs x 3075 tables x C 1..26)\n",
              static_cast<unsigned long long>(bad), static_cast<unsigned long long>(checked));

  // Groups: int4_tab_groups16 with amax, scales and poisoned as int4_rows_v computes them.
  uint64_t gbad = 0, gchecked = 0, taken = 0, left = 0;
  std::vector<uint16_t> x;
  std::vector<uint8_t> got, want;
  for (const DType sd : {DType::f32, DType::bf16, DType::f16}) {
    for (const int64_t g : {int64_t{32}, int64_t{128}}) {
      for (uint32_t ah = 0; ah < 0x7C00u; ah += 7) {
        // Groups of every |x| <= amax (both signs), the first holding the amax itself.
        std::vector<uint16_t> vals;
        for (uint32_t h = 0; h <= ah; ++h) {
          vals.push_back(static_cast<uint16_t>(h));
          vals.push_back(static_cast<uint16_t>(h | 0x8000u));
        }
        const int64_t per = 16 * g;  // one batch of 16 groups per call
        for (size_t v0 = 0; v0 < vals.size(); v0 += static_cast<size_t>(per)) {
          x.assign(static_cast<size_t>(per), 0);
          for (int64_t k = 0; k < per && v0 + k < vals.size(); ++k) x[k] = vals[v0 + k];
          for (int64_t k = 0; k < 16; ++k) x[k * g] = static_cast<uint16_t>(ah);  // every group's amax
          alignas(64) uint32_t am[16];
          for (int64_t k = 0; k < 16; ++k) am[k] = f32_bits(f16_to_f32(static_cast<uint16_t>(ah)));
          const __m512i amax = _mm512_load_si512(am);
          uint8_t scales[64];
          const __m512 sv = int4_store_scales(amax, 0, sd, scales, 16);
          got.assign(static_cast<size_t>(per / 2), 0);
          want.assign(static_cast<size_t>(per / 2), 0);
          const simd::Mask done = int4_tab_groups16(x.data(), per, g, 16, amax, sv, 0, sd, got.data());
          taken += __builtin_popcount(done);
          left += 16 - __builtin_popcount(done);
          for (int64_t k = 0; k < 16; ++k) {
            const __m512 s = simd::lane(sv, static_cast<int>(k));
            for (int64_t i = 0; i < g; i += 16)
              simd::store_nibbles16(&want[(k * g + i) / 2], int4_codes(simd::load<DType::f16>(&x[k * g + i], 0xFFFF), s));
            if (!((done >> k) & 1)) continue;
            gchecked += g;
            if (std::memcmp(&got[k * g / 2], &want[k * g / 2], g / 2) != 0 && gbad++ < 10)
              std::printf("scale dtype %d g %lld amax %04x group %lld differs\n", static_cast<int>(sd), static_cast<long long>(g), ah,
                          static_cast<long long>(k));
          }
        }
      }
    }
  }
  std::printf("mismatching group inputs: %llu of %llu (groups by the tables: %llu, left to the fp32 lanes: %llu)\n",
              static_cast<unsigned long long>(gbad), static_cast<unsigned long long>(gchecked),
              static_cast<unsigned long long>(taken), static_cast<unsigned long long>(left));

  // L1 timing: 128 moderate fp16 inputs, one group.
  std::vector<uint16_t> xl(128);
  for (int i = 0; i < 128; ++i) xl[i] = static_cast<uint16_t>(0x3000 + (i * 397 % 3000) + ((i & 1) << 15));
  const Int4Tables16& t = int4_tables16(DType::f32);
  const uint32_t ti = ((f32_bits(1.75f) >> 13) & 0x3FFu);
  const __m512i tab = _mm512_load_si512(t.t[ti]);
  const float sl = bits_f32(t.sig[ti] | (125u << 23));
  const __m512i c7 = _mm512_set1_epi16(static_cast<short>(7 * (125 - 114) + 28));
  alignas(64) uint8_t out[64];
  time_paths_l1(
      "int4 fp16 elements", 128.0, 400000,
      [&] {
        const __m512 vs = _mm512_set1_ps(sl);
        for (int i = 0; i < 128; i += 16) simd::store_nibbles16(out + i / 2, int4_codes(simd::load<DType::f16>(&xl[i], 0xFFFF), vs));
      },
      [&] {
        __m512i d[4];
        for (int k = 0; k < 4; ++k) d[k] = int4_tab16_step(_mm512_loadu_si512(&xl[32 * k]), tab, c7);
        int4_tab16_store4(d, out);
      });
  return bad == 0 && gbad == 0 && not_ok == 0 ? 0 : 1;
}
