// The AVX-512 leaf compiled with -mavx512vbmi too (CMakeLists.txt); used only when the CPU has
// it. The same kernels as cpu_isa_avx512.cpp, plus the ones that need VBMI's byte permutes:
// FP8 of bf16 inputs by mantissa tables (avx512_fp8_tables.h).
#define MQ_CPU_NS avx512vbmi
#include "avx512_leaf.h"

namespace miles_quant {
namespace cpu {
const Leaf& leaf_avx512vbmi() {
  static const Leaf leaf = avx512vbmi::make_avx512_leaf("avx512vbmi");
  return leaf;
}
}  // namespace cpu
}  // namespace miles_quant
