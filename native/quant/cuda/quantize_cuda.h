// CUDA quantizers for the same contract as the CPU kernels (kernel_args.h layouts, contract.h
// arithmetic). Pointers are device pointers; work is enqueued on `stream` (a cudaStream_t) and
// the return value is the cudaError_t of the launches (0 = success). `threads` is ignored.
#pragma once

#include "miles_quant/kernel_args.h"

namespace miles_quant {
namespace cuda {

int quantize_fp8(const Fp8Args& a, void* stream);
int quantize_mx(const MxArgs& a, void* stream);
int quantize_nvfp4(const Nvfp4Args& a, void* stream);
int quantize_int4(const Int4Args& a, void* stream);

}  // namespace cuda
}  // namespace miles_quant
