// Shared by miles-quant's exhaustive probes (tools/bench/quant_*_probe.cpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

// Every 16-bit input bit pattern of magnitude bits 0..ab with both signs (what a group of amax
// bits ab can hold: |x| bits order like the values), zero-padded to a multiple of 32, into xs,
// and want / got sized to match (codes of one byte per input).
static inline void inputs_up_to(uint32_t ab, std::vector<uint16_t>* xs, std::vector<uint8_t>* want,
                                std::vector<uint8_t>* got) {
  xs->clear();
  for (uint32_t b = 0; b <= ab; ++b) {
    xs->push_back(static_cast<uint16_t>(b));
    xs->push_back(static_cast<uint16_t>(b | 0x8000u));
  }
  while (xs->size() % 32) xs->push_back(0);
  want->assign(xs->size(), 0);
  got->assign(xs->size(), 0);
}

// A kernel's fp32 path and its table path on the same small input (in L1), three rounds of
// `reps` calls each, printed as ns per element.
template <class Fp32Path, class TablePath>
static void time_paths_l1(const char* name, double elements_per_call, int reps, Fp32Path fp32_path, TablePath tables) {
  for (int r = 0; r < 3; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < reps; ++k) {
      fp32_path();
      asm volatile("" ::: "memory");
    }
    const auto t1 = std::chrono::steady_clock::now();
    for (int k = 0; k < reps; ++k) {
      tables();
      asm volatile("" ::: "memory");
    }
    const auto t2 = std::chrono::steady_clock::now();
    const double n = elements_per_call * reps;
    std::printf("%s in L1: fp32 path %.3f ns/el, tables %.3f ns/el\n", name,
                std::chrono::duration<double, std::nano>(t1 - t0).count() / n,
                std::chrono::duration<double, std::nano>(t2 - t1).count() / n);
  }
}
