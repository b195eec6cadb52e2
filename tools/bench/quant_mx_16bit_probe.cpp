// Exhaustive proof behind miles-quant's 16-bit-lane MX paths (mx4_elements512_h and
// mx8_elements512_h in native/quant/src/avx512_mx.h): their bytes equal the fp32 path's
// (mx_elements512_16, itself tested against the PyTorch reference), with and without a poisoned
// mask, for every non-NaN, non-Inf input a block with the code can hold (|x| * 2^(127 - code) <
// 2^(emax + 1), true of every input of a block under every scale rule):
// - bf16 inputs, every E8M0 code from kMx16MinCode (3 for E2M1, 11 for E4M3, 18 for E5M2) to 254;
// - fp16 inputs (subnormals included: the paths hand their vectors to the fp32 path), every code
//   from 64 to 160 (a block of finite fp16 inputs has a code in 88..142 under every rule; from
//   161 on, 127 - code no longer fits the 16-bit exponent delta and the path would be wrong).
// Compiled with -mavx512vbmi it also checks the byte-lane paths (avx512_bytes.h) the same way
// on bf16, unpoisoned (the kernel sends batches with a poisoned block to the 16-bit paths):
// MXFP4 (mx4_elements512_bf16_b) for every code from kMx4BytesMinCode (5) to 254, MXFP8
// (mx8_elements512_bf16_b) from kMx16MinCode<F>. Also times the MXFP4 and MXFP8 E4M3 elements
// each way in L1. Run by tests/test_quant_mx_16bit.py; by hand:
//
//   g++ -O3 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq [-mavx512vbmi] \
//       -ffp-contract=off -Inative/quant/include -Inative/quant/src \
//       tools/bench/quant_mx_16bit_probe.cpp -o /tmp/mx4probe && /tmp/mx4probe
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#define MQ_CPU_NS avx512
#include "miles_quant/cpu_kernels.h"
#include "avx512_kernels.h"
using namespace miles_quant;
using namespace miles_quant::cpu::avx512;

// Bytes of the 16-bit path that differ from the fp32 path, over every non-NaN, non-Inf input of
// type D (a poisoned block's codes are overwritten either way: checked with a poisoned mask too)
// and every code in [lo, hi]; inputs a block with that code cannot hold (|x| * 2^(127 - code) >=
// 2^(emax + 1)) are replaced by +0.
template <DType D, class F>
uint64_t check(const char* name, uint32_t lo, uint32_t hi, uint64_t* checked) {
  constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  constexpr size_t kBytes = kPacked ? 256 : 512;
  const uint32_t inf = D == DType::bf16 ? 0x7F80 : 0x7C00;
  std::vector<uint16_t> all;
  for (uint32_t b = 0; b < 65536; ++b)
    if ((b & inf) != inf) all.push_back(static_cast<uint16_t>(b));
  while (all.size() % 512) all.push_back(0);
  std::vector<uint8_t> want(kBytes), got(kBytes);
  uint64_t bad = 0;
  for (uint32_t cd = lo; cd <= hi; ++cd) {
    std::vector<uint16_t> xs(all);
    for (auto& y : xs) {
      const float v = D == DType::bf16 ? bf16_to_f32(y) : f16_to_f32(y);
      if (std::ldexp(std::fabs(v), 127 - static_cast<int>(cd)) >= std::ldexp(1.0f, F::kEmax + 1)) y = 0;
    }
    const __m512i code = simd::u32(cd);
    const __m512 mul = e8m0_inverses(code);
    for (size_t i = 0; i < xs.size(); i += 512) {
      for (simd::Mask poisoned : {simd::Mask{0}, simd::Mask{0x8421}}) {
        if (poisoned)
          mx_elements512_16<D, F, true>(&xs[i], mul, poisoned, want.data());
        else
          mx_elements512_16<D, F, false>(&xs[i], mul, 0, want.data());
        if constexpr (kPacked)
          mx4_elements512_h<D>(&xs[i], code, mul, poisoned, got.data());
        else
          mx8_elements512_h<D, F>(&xs[i], code, mul, poisoned, got.data());
        *checked += kBytes;
        for (size_t j = 0; j < kBytes; ++j)
          if (want[j] != got[j] && bad++ < 10)
            std::printf("%s code %u byte %zu of inputs from %04x: fp32 path %02x, 16-bit path %02x\n", name, cd, j, xs[i], want[j], got[j]);
        if constexpr (kMxBytes && D == DType::bf16) {
          if (poisoned || (kPacked && cd < kMx4BytesMinCode)) continue;
          std::fill(got.begin(), got.end(), 0xA5);
          if constexpr (kPacked)
            mx4_elements512_bf16_b(&xs[i], code, got.data());
          else
            mx8_elements512_bf16_b<F>(&xs[i], code, mul, got.data());
          *checked += kBytes;
          for (size_t j = 0; j < kBytes; ++j)
            if (want[j] != got[j] && bad++ < 10)
              std::printf("%s code %u byte %zu of inputs from %04x: fp32 path %02x, byte path %02x\n", name, cd, j, xs[i], want[j], got[j]);
        }
      }
    }
  }
  return bad;
}

int main() {
  uint64_t checked = 0;
  uint64_t bad = check<DType::bf16, E2M1>("bf16 mxfp4", kMx16MinCode<E2M1>, 254, &checked);
  bad += check<DType::bf16, E4M3>("bf16 mxfp8_e4m3", kMx16MinCode<E4M3>, 254, &checked);
  bad += check<DType::bf16, E5M2>("bf16 mxfp8_e5m2", kMx16MinCode<E5M2>, 254, &checked);
  bad += check<DType::f16, E2M1>("fp16 mxfp4", 64, 160, &checked);
  bad += check<DType::f16, E4M3>("fp16 mxfp8_e4m3", 64, 160, &checked);
  bad += check<DType::f16, E5M2>("fp16 mxfp8_e5m2", 64, 160, &checked);
  std::printf("mismatching bytes: %llu of %llu (all non-NaN bf16 and fp16 inputs x E8M0 codes, three formats)\n",
              static_cast<unsigned long long>(bad), static_cast<unsigned long long>(checked));
  std::vector<uint8_t> want(512), got(512);
  std::vector<uint16_t> t(512);
  for (int i = 0; i < 512; ++i) t[i] = static_cast<uint16_t>(0x3f00 + (i * 37 % 300) + ((i & 1) << 15));
  const __m512i code = simd::u32(127);
  const __m512 mul = e8m0_inverses(code);
  auto time = [](auto f) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int n = 0; n < 100000; ++n) {
      f();
      asm volatile("" ::: "memory");
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / (100000.0 * 512 / 1e9);
  };
  for (int r = 0; r < 3; ++r) {
    const double a = time([&] { mx_elements512_16<DType::bf16, E2M1, false>(t.data(), mul, 0, want.data()); });
    const double b = time([&] { mx4_elements512_h<DType::bf16>(t.data(), code, mul, 0, got.data()); });
    const double c = kMxBytes ? time([&] { mx4_elements512_bf16_b(t.data(), code, got.data()); }) : 0.0;
    const double d = time([&] { mx_elements512_16<DType::bf16, E4M3, false>(t.data(), mul, 0, want.data()); });
    const double e = time([&] { mx8_elements512_h<DType::bf16, E4M3>(t.data(), code, mul, 0, got.data()); });
    const double f = kMxBytes ? time([&] { mx8_elements512_bf16_b<E4M3>(t.data(), code, mul, got.data()); }) : 0.0;
    std::printf("elements in L1, ns/el: MXFP4 fp32 path %.3f, 16-bit %.3f, bytes %.3f; MXFP8 E4M3 fp32 path %.3f, 16-bit %.3f, bytes %.3f\n", a, b, c, d, e, f);
  }
  return bad == 0 ? 0 : 1;
}
