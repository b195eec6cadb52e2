// Leaf kernels compiled with -mavx512f/bw/vl/dq (CMakeLists.txt); used only when the CPU has them.
#define MQ_CPU_NS avx512
#include "miles_quant/cpu_kernels.h"

namespace miles_quant {
namespace cpu {
const Leaf& leaf_avx512() {
  static const Leaf leaf = avx512::make_leaf("avx512");
  return leaf;
}
}  // namespace cpu
}  // namespace miles_quant
