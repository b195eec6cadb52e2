// What AVX-512 instructions cost on this machine, for choosing between equivalent instruction
// sequences in miles-quant's kernels (docs/benchmarks.md, "vector slots on Zen 4"): core cycles
// per instruction over 12 independent chains, of each instruction alone and beside as many
// vpaddb (the vpaddb's own cost subtracted). The core clock is taken from a 1-cycle dependent add
// chain, so the figures are cycles, not TSC ticks. On the AMD EPYC (Zen 4) host: alone, vpaddb /
// vpternlogd / vpmaddubsw 0.5 (two a cycle), vpshufb / vpermb / vpermd / vpackuswb / vshufi32x4
// and shifts / vpmaxuw / vpsubusb 1 (one a cycle each kind; a shuffle and a shift issue
// together), vpermt2b / vpmovwb / vpmovdb 2; beside vpaddb every 1-cycle one costs 0.5 (a slot
// of the two a cycle) and vpermt2b / vpmovwb / vpmovdb 1.5 (three slots).
//
//   g++ -O2 -march=native tools/bench/simd_slot_costs.cpp -o /tmp/slots && /tmp/slots
#include <immintrin.h>
#include <x86intrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

static double cycles_per_tsc() {
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t c0 = __rdtsc();
  int64_t x = 0;
  for (int64_t i = 0; i < 300000000; ++i) asm volatile("add $1, %0" : "+r"(x));
  const uint64_t c1 = __rdtsc();
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  const double ghz = 300000000.0 / ns;                      // one add a cycle
  return ghz / (static_cast<double>(c1 - c0) / ns);         // core cycles per TSC tick
}

// 12 chains; the first `nf` apply f, the rest g. Returns core cycles per instruction.
template <class F, class G>
static double run(F f, G g, int nf, double cpt) {
  __m512i a0 = _mm512_set1_epi8(1), a1 = _mm512_set1_epi8(2), a2 = _mm512_set1_epi8(3), a3 = _mm512_set1_epi8(4);
  __m512i a4 = _mm512_set1_epi8(5), a5 = _mm512_set1_epi8(6), a6 = _mm512_set1_epi8(7), a7 = _mm512_set1_epi8(8);
  __m512i a8 = a0, a9 = a1, a10 = a2, a11 = a3;
  const __m512i k = _mm512_set1_epi8(3);
  double best = 1e30;
  for (int rep = 0; rep < 15; ++rep) {
    const uint64_t t0 = __rdtsc();
    for (int it = 0; it < 100000; ++it) {
#define STEP(i, v) v = (i < nf ? f(v, k) : g(v, k));
      STEP(0, a0) STEP(1, a1) STEP(2, a2) STEP(3, a3) STEP(4, a4) STEP(5, a5)
      STEP(6, a6) STEP(7, a7) STEP(8, a8) STEP(9, a9) STEP(10, a10) STEP(11, a11)
#undef STEP
      asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8),
                   "+v"(a9), "+v"(a10), "+v"(a11));
    }
    const double c = static_cast<double>(__rdtsc() - t0) * cpt / (100000.0 * 12);
    if (c < best) best = c;
  }
  return best;
}

// One instruction, alone and mixed half and half with vpaddb (its own cost subtracted).
template <class F>
static void report(const char* name, F f, double cpt) {
  const auto add = [](__m512i a, __m512i k) { return _mm512_add_epi8(a, k); };
  const double alone = run(f, f, 12, cpt);
  const double mixed = run(f, add, 6, cpt) * 2 - run(add, add, 12, cpt);
  std::printf("%-12s %8.2f %18.2f\n", name, alone, mixed);
}

int main() {
  const double cpt = cycles_per_tsc();
  std::printf("core clock / TSC: %.2f\n%-12s %8s %18s\n", cpt, "instruction", "alone", "beside vpaddb");
#define OP(name, expr) report(name, [](__m512i a, __m512i k) { (void)k; return expr; }, cpt)
  OP("vpaddb", _mm512_add_epi8(a, k));
  OP("vpternlogd", _mm512_ternarylogic_epi32(a, k, a, 0xF8));
  OP("vpmaddubsw", _mm512_maddubs_epi16(a, k));
  OP("vpshufb", _mm512_shuffle_epi8(a, k));
  OP("vpermb", _mm512_permutexvar_epi8(k, a));
  OP("vpermd", _mm512_permutexvar_epi32(k, a));
  OP("vpackuswb", _mm512_packus_epi16(a, k));
  OP("vshufi32x4", _mm512_shuffle_i32x4(a, k, 0x88));
  OP("vpsrlw", _mm512_srli_epi16(a, 4));
  OP("vpmaxuw", _mm512_max_epu16(a, k));
  OP("vpsubusb", _mm512_subs_epu8(a, k));
  OP("vpermt2b", _mm512_permutex2var_epi8(a, k, a));
  OP("vpmovwb", _mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)));
  OP("vpmovdb", _mm512_castsi128_si512(_mm512_cvtepi32_epi8(a)));
#undef OP
  return 0;
}
