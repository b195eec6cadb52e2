// Leaf kernels compiled with -mavx512f/bw/vl/dq (CMakeLists.txt); used only when the CPU has them
// (and not AVX512-VBMI, which gets cpu_isa_avx512vbmi.cpp). The hot loops are explicit AVX-512
// (avx512_kernels.h); the rest is the shared scalar code.
#define MQ_CPU_NS avx512
#include "avx512_leaf.h"

namespace miles_quant {
namespace cpu {
const Leaf& leaf_avx512() {
  static const Leaf leaf = avx512::make_avx512_leaf("avx512");
  return leaf;
}
}  // namespace cpu
}  // namespace miles_quant
