// Leaf kernels compiled for the baseline instruction set of the target.
#define MQ_CPU_NS generic
#include "miles_quant/cpu_kernels.h"

namespace miles_quant {
namespace cpu {
const Leaf& leaf_generic() {
  static const Leaf leaf = generic::make_leaf("generic");
  return leaf;
}
}  // namespace cpu
}  // namespace miles_quant
