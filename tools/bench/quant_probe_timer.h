// The L1 timer of miles-quant's exhaustive probes (tools/bench/quant_*_probe.cpp): a kernel's
// fp32 path and its table path on the same small input, three rounds of `reps` calls each,
// printed as ns per element.
#pragma once

#include <chrono>
#include <cstdio>

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
