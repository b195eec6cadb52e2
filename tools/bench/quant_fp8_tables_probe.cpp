// Exhaustive proof behind miles-quant's FP8 mantissa tables (native/quant/src/avx512_fp8_tables.h,
// the AVX512-VBMI build): for every bf16 group amax that is not poisoned (0 included, so the
// 1e-10 clamp too) and every bf16 input x with |x| <= amax (both signs; what a group with that
// amax can hold), fp8_tab_run's bytes equal the fp32 path's (fp8_run_v: encode(x / s) with a
// vdivps, itself tested against the PyTorch reference), for E4M3 and E5M2: 2.13 billion bytes.
// Also times both paths on one group in L1. Run by tests/test_quant_fp8_tables.py; by hand:
//
//   g++ -O2 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vbmi \
//       -ffp-contract=off -Inative/quant/include -Inative/quant/src \
//       tools/bench/quant_fp8_tables_probe.cpp -o /tmp/fp8probe && /tmp/fp8probe
#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "quant_probe_util.h"
#define MQ_CPU_NS avx512vbmi
#include "miles_quant/cpu_kernels.h"
#include "avx512_kernels.h"
using namespace miles_quant;
using namespace miles_quant::cpu::avx512vbmi;

static_assert(kFp8Tables, "compile with -mavx512vbmi");

template <class F>
uint64_t check(const char* name, uint64_t* checked) {
  std::vector<uint16_t> xs;
  std::vector<uint8_t> want, got;
  uint64_t bad = 0;
  for (uint32_t ab = 0; ab < 0x7F80u; ++ab) {  // every finite non-negative bf16 amax
    inputs_up_to(ab, &xs, &want, &got);
    const uint32_t amax = ab << 16;
    const float s = fp8_scale<F>(bits_f32(amax));
    const int64_t n = static_cast<int64_t>(xs.size());
    fp8_run_v<DType::bf16, F>(xs.data(), n, s, want.data());
    fp8_tab_run<F, false>(xs.data(), n, fp8_tab<F>(fp8_tables<F>(), amax, s), s, got.data());
    for (int64_t i = 0; i < n; ++i)
      if (want[i] != got[i] && bad++ < 10)
        std::printf("%s amax %04x x %04x: fp32 path %02x, table %02x\n", name, ab, xs[i], want[i], got[i]);
    *checked += static_cast<uint64_t>(n);
  }
  return bad;
}

template <class F>
void time_l1(const char* name) {
  std::vector<uint16_t> x(4096);
  for (int i = 0; i < 4096; ++i) x[i] = static_cast<uint16_t>(0x3f00 + (i * 37 % 300) + ((i & 1) << 15));
  std::vector<uint8_t> out(4096);
  const uint32_t amax = (0x3f00u + 299u) << 16;
  const float s = fp8_scale<F>(bits_f32(amax));
  const Fp8Tab tab = fp8_tab<F>(fp8_tables<F>(), amax, s);
  time_paths_l1(
      name, 4096.0, 20000, [&] { fp8_run_v<DType::bf16, F>(x.data(), 4096, s, out.data()); },
      [&] { fp8_tab_run<F, false>(x.data(), 4096, tab, s, out.data()); });
}

int main() {
  uint64_t checked = 0;
  const uint64_t bad = check<E4M3>("e4m3", &checked) + check<E5M2>("e5m2", &checked);
  std::printf("mismatching bytes: %llu of %llu (every bf16 amax x every |x| <= amax, E4M3 and E5M2)\n",
              static_cast<unsigned long long>(bad), static_cast<unsigned long long>(checked));
  time_l1<E4M3>("e4m3");
  time_l1<E5M2>("e5m2");
  return bad == 0 ? 0 : 1;
}
