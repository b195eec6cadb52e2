// CPU quantizers: the entry points the binding calls. Each takes the raw-pointer arguments of
// kernel_args.h, validates nothing (the Python wrapper does), releases nothing, and splits the
// work over `threads` threads (<= 0: all hardware threads).
#pragma once

#include <cstdint>

#include "miles_quant/kernel_args.h"

namespace miles_quant {
namespace cpu {

// Leaf kernels of one instruction set (src/cpu_isa_*.cpp), called by the scheduler in cpu.cpp.
struct Leaf {
  const char* name;
  uint32_t (*amax)(DType d, const void* x, int64_t begin, int64_t n);
  void (*encode)(const float* x, int64_t n, Elem e, uint8_t* out);
  void (*fp8_flat)(const Fp8Args& a, int64_t begin, int64_t n, uint32_t amax);
  void (*fp8_tiles)(const Fp8Args& a, int64_t t0, int64_t t1);
  void (*mx_rows)(const MxArgs& a, int64_t r0, int64_t r1);
  void (*nvfp4_rows)(const Nvfp4Args& a, int64_t t0, int64_t t1, const uint32_t* gamax);
  void (*int4_rows)(const Int4Args& a, int64_t r0, int64_t r1);
  // Rows [r0, r1) of the batch * rows output rows.
  void (*dequant_rows)(const DequantArgs& a, int64_t r0, int64_t r1);
};

void quantize_fp8(const Fp8Args& a);
void quantize_mx(const MxArgs& a);
void quantize_nvfp4(const Nvfp4Args& a);
void quantize_int4(const Int4Args& a);
void dequantize(const DequantArgs& a);
// Raw element casts (round to nearest even, saturating; see elements.h).
void encode_elements(const float* x, int64_t n, Elem e, uint8_t* out, int threads);

// The instruction set the kernels run with ("avx512vbmi", "avx512", "avx2" or "generic"),
// chosen once at run time; MILES_QUANT_ISA=<name> forces a lower one.
const char* isa();

}  // namespace cpu
}  // namespace miles_quant
