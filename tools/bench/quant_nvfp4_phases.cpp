// Times the two passes of miles-quant's single-threaded NVFP4 1x16 kernel (AVX512-VBMI build)
// apart: the tensor amax pass (a pure read) and the block pass (scales and elements), the block
// pass both right after the amax pass and alone after the caches were flushed; the block pass on
// a matrix that fits in L2 (its compute cost, less the per-call table build, timed apart).
// docs/benchmarks.md quotes it:
//
//   g++ -O3 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vbmi \
//       -ffp-contract=off -Inative/quant/include -Inative/quant/src \
//       tools/bench/quant_nvfp4_phases.cpp -o /tmp/nvfp4phases && /tmp/nvfp4phases 8192 7168
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define MQ_CPU_NS avx512vbmi
#include "miles_quant/cpu_kernels.h"
#include "avx512_kernels.h"
using namespace miles_quant;
using namespace miles_quant::cpu::avx512vbmi;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  const int64_t R = argc > 1 ? std::atoll(argv[1]) : 8192, C = argc > 2 ? std::atoll(argv[2]) : 7168;
  const int64_t n = R * C;
  if (R <= 0 || C < 256 || C % 256 != 0) {
    std::fprintf(stderr, "usage: %s ROWS COLS (COLS a multiple of 256)\n", argv[0]);
    return 2;
  }
  std::vector<uint16_t> x(static_cast<size_t>(n));
  uint32_t s = 1;
  for (auto& v : x) {  // bf16 of magnitude 2^-31..2^0, random signs
    s = s * 1664525u + 1013904223u;
    v = static_cast<uint16_t>((0x3000 + (s >> 20) % 0x1000) | ((s >> 8) & 0x8000));
  }
  std::vector<uint8_t> out(static_cast<size_t>(n / 2)), sc(static_cast<size_t>(n / 16)), flush(size_t{256} << 20);
  float gs = 0;
  const Nvfp4Args a{x.data(), DType::bf16, 1, R, C, false, out.data(), sc.data(), &gs, 1};
  // Small enough for L2: the block pass's compute cost (its table build included once).
  const int64_t rl = std::max<int64_t>(2, (int64_t{512} << 10) / (2 * C));
  const Nvfp4Args al{x.data(), DType::bf16, 1, rl, C, false, out.data(), sc.data(), &gs, 1};
  Nvfp4Tables tables;
  const double b0 = now();
  for (int k = 0; k < 1000; ++k) {
    nvfp4_build_tables(nvfp4_global_scale(1.0f + k / 1000.0f), &tables);
    asm volatile("" : : "r"(&tables) : "memory");
  }
  const double build = (now() - b0) / 1000;
  std::printf("%lld x %lld bf16 (table build %.1f us), ns per element:\n", static_cast<long long>(R),
              static_cast<long long>(C), build * 1e6);
  for (int r = 0; r < 5; ++r) {
    std::memset(flush.data(), r, flush.size());
    const double t0 = now();
    uint32_t m = 0;
    for (int64_t b = 0; b < n; b += int64_t{1} << 16)
      m = std::max(m, simd::amax_stream<DType::bf16>(x.data() + b, std::min<int64_t>(int64_t{1} << 16, n - b)));
    const double t1 = now();
    gs = nvfp4_global_scale(bits_f32(m));
    nvfp4_rows_v<DType::bf16>(a, 0, R, &m);
    const double t2 = now();
    std::memset(flush.data(), r + 1, flush.size());
    const double t3 = now();
    nvfp4_rows_v<DType::bf16>(a, 0, R, &m);
    const double t4 = now();
    for (int k = 0; k < 3; ++k) nvfp4_rows_v<DType::bf16>(al, 0, rl, &m);
    const double t5 = now();
    std::printf("amax pass %.4f  block pass after it %.4f  (sum %.4f)  block pass alone, cold %.4f  in L2 %.4f\n",
                (t1 - t0) * 1e9 / n, (t2 - t1) * 1e9 / n, (t2 - t0) * 1e9 / n, (t4 - t3) * 1e9 / n,
                ((t5 - t4) / 3 - build) * 1e9 / static_cast<double>(rl * C));
  }
  return 0;
}
