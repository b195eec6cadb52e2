// Leaf kernels compiled with -mavx2 (CMakeLists.txt); used only when the CPU has AVX2.
#define MQ_CPU_NS avx2
#include "miles_quant/cpu_kernels.h"

namespace miles_quant {
namespace cpu {
const Leaf& leaf_avx2() {
  static const Leaf leaf = avx2::make_leaf("avx2");
  return leaf;
}
}  // namespace cpu
}  // namespace miles_quant
