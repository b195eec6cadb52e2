// Exhaustive proof behind miles-quant's FP8 tables for fp16 inputs (native/quant/src/
// avx512_fp8_tables.h, "fp16 inputs"; the AVX512-VBMI build): every one of the 1025 tables has
// the step shape the two-lookup form needs, and for every fp16 group amax that is not poisoned
// (0 included, so the 1e-10 clamp too) and every fp16 input x with |x| <= amax (both signs; what
// a group with that amax can hold), fp8_tab16_run's bytes equal the fp32 path's (fp8_run_v:
// encode(x / s) with a vdivps, itself tested against the PyTorch reference), for E4M3 and E5M2:
// 2.02 billion bytes. Steps holding an fp16 subnormal or a subnormal target take the fp32 path
// inside fp8_tab16_run; the probe counts the steps that do not (the table lanes) and checks a
// second time with every step forced through the tables where it may be: a lane-wise check of
// the normal inputs alone, so that the hand-off cannot hide a wrong table. Also times both paths
// on one group in L1. Run by tests/test_quant_fp8_tables.py; by hand:
//
//   g++ -O2 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vbmi \
//       -ffp-contract=off -Inative/quant/include -Inative/quant/src \
//       tools/bench/quant_fp8_f16_tables_probe.cpp -o /tmp/fp8f16probe && /tmp/fp8f16probe
#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "quant_probe_util.h"
#define MQ_CPU_NS avx512vbmi
#include "miles_quant/cpu_kernels.h"
#include "avx512_kernels.h"
using namespace miles_quant;
using namespace miles_quant::cpu::avx512vbmi;

static_assert(kFp8Tables, "compile with -mavx512vbmi");

// The table code of one normal fp16 x (e > 0) as fp8_tab16_run computes it lane-wise, before the
// hand-offs: -1 where the code is a subnormal target (the fp32 path's).
template <class F>
int table_code(const Fp8Tab& t, uint16_t x) {
  constexpr int M = F::kMbits;
  const uint32_t m = x & 0x3FFu, e = (x >> 10) & 0x1Fu;
  const int d = t.d[m >> 4] + ((m & 15) >= t.d[64 + (m >> 4)] ? 1 : 0);
  const int c = static_cast<int>(e << M) + d + t.k;
  if (c >= (1 << M)) return c | (x & 0x8000u ? 0x80 : 0);
  if (c >= -M * (1 << M)) return -1;
  return x & 0x8000u ? 0x80 : 0;
}

template <class F>
uint64_t check(const char* name, uint64_t* checked, uint64_t* lanes) {
  std::vector<uint16_t> xs;
  std::vector<uint8_t> want, got;
  uint64_t bad = 0;
  const Fp8Tables16<F>& tables = fp8_tables16<F>();
  for (int i = 0; i < 1025; ++i)
    if (!tables.ok[i] && bad++ < 10) std::printf("%s table %d: not a step function with rises >= 16 apart\n", name, i);
  for (uint32_t ab = 0; ab < 0x7C00u; ++ab) {  // every finite non-negative fp16 amax
    inputs_up_to(ab, &xs, &want, &got);
    const float a = f16_to_f32(static_cast<uint16_t>(ab));
    const uint32_t amax = f32_bits(a);
    const float s = fp8_scale<F>(a);
    const int64_t n = static_cast<int64_t>(xs.size());
    const Fp8Tab tab = fp8_tab16<F>(tables, amax, s);
    fp8_run_v<DType::f16, F>(xs.data(), n, s, want.data());
    fp8_tab16_run<F, false>(xs.data(), n, tab, s, got.data());
    for (int64_t i = 0; i < n; ++i) {
      if (want[i] != got[i] && bad++ < 10)
        std::printf("%s amax %04x x %04x: fp32 path %02x, table %02x\n", name, ab, xs[i], want[i], got[i]);
      // Lane-wise: every normal input whose code the tables give directly.
      if (tab.d != nullptr && (xs[i] & 0x7C00u) != 0) {
        const int c = table_code<F>(tab, xs[i]);
        if (c < 0) continue;
        ++*lanes;
        if (c != want[i] && bad++ < 10)
          std::printf("%s amax %04x x %04x: fp32 path %02x, table lane %02x\n", name, ab, xs[i], want[i], c);
      }
    }
    *checked += static_cast<uint64_t>(n);
  }
  return bad;
}

template <class F>
void time_l1(const char* name) {
  std::vector<uint16_t> x(4096);
  for (int i = 0; i < 4096; ++i) x[i] = static_cast<uint16_t>(0x3800 + (i * 37 % 1500) + ((i & 1) << 15));
  std::vector<uint8_t> out(4096);
  const float a = f16_to_f32(0x3800 + 1499);
  const float s = fp8_scale<F>(a);
  const Fp8Tab tab = fp8_tab16<F>(fp8_tables16<F>(), f32_bits(a), s);
  time_paths_l1(
      (std::string(name) + " fp16").c_str(), 4096.0, 20000, [&] { fp8_run_v<DType::f16, F>(x.data(), 4096, s, out.data()); },
      [&] { fp8_tab16_run<F, false>(x.data(), 4096, tab, s, out.data()); });
}

int main() {
  uint64_t checked = 0, lanes = 0;
  const uint64_t bad = check<E4M3>("e4m3", &checked, &lanes) + check<E5M2>("e5m2", &checked, &lanes);
  std::printf("mismatches: %llu in %llu bytes (every fp16 amax x every |x| <= amax, E4M3 and E5M2) and %llu table lanes"
              " checked on their own\n",
              static_cast<unsigned long long>(bad), static_cast<unsigned long long>(checked),
              static_cast<unsigned long long>(lanes));
  time_l1<E4M3>("e4m3");
  time_l1<E5M2>("e5m2");
  return bad == 0 ? 0 : 1;
}
