// Leaf kernels compiled with -mavx2 -mf16c (CMakeLists.txt); used only when the CPU has both.
// Explicit AVX2 quantizers (avx2_quant.h) and dequantization (avx2_dequant.h) in place of the scalar
// kernels of cpu_kernels.h, which stay for what those leave to them (tails, odd tile widths).
#include <immintrin.h>

#define MQ_CPU_NS avx2
#include "miles_quant/cpu_kernels.h"

namespace miles_quant {
namespace cpu {
namespace avx2 {
#include "avx2_dequant.h"  // dequant_rows_avx2
#include "avx2_quant.h"    // q2::
}  // namespace avx2

const Leaf& leaf_avx2() {
  static const Leaf leaf = [] {
    Leaf l = avx2::make_leaf("avx2");
    l.amax = avx2::q2::amax_v;
    l.encode = avx2::q2::encode_v;
    l.fp8_flat = avx2::q2::fp8_flat_v;
    l.fp8_tiles = avx2::q2::fp8_tiles_v;
    l.mx_rows = avx2::q2::mx_rows_v;
    l.nvfp4_rows = avx2::q2::nvfp4_rows_v;
    l.int4_rows = avx2::q2::int4_rows_v;
    l.dequant_rows = avx2::dequant_rows_avx2;
    return l;
  }();
  return leaf;
}
}  // namespace cpu
}  // namespace miles_quant
