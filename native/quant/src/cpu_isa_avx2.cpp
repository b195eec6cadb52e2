// Leaf kernels compiled with -mavx2 (CMakeLists.txt); used only when the CPU has AVX2: the
// scalar kernels of cpu_kernels.h (auto-vectorized) and an explicit AVX2 dequantization.
#include <immintrin.h>

#define MQ_CPU_NS avx2
#include "miles_quant/cpu_kernels.h"

namespace miles_quant {
namespace cpu {
namespace avx2 {
#include "avx2_dequant.h"  // dequant_rows_avx2
}  // namespace avx2

const Leaf& leaf_avx2() {
  static const Leaf leaf = [] {
    Leaf l = avx2::make_leaf("avx2");
    l.dequant_rows = avx2::dequant_rows_avx2;
    return l;
  }();
  return leaf;
}
}  // namespace cpu
}  // namespace miles_quant
