// miles_quant._ext_cuda: the CUDA kernels (cuda/quantize.cu) behind a thin nanobind layer, built
// only with -DMILES_QUANT_CUDA=ON. The calls and their argument checks are in cuda_calls.h.
#include <nanobind/nanobind.h>

#include "cuda_calls.h"

namespace nb = nanobind;
using namespace miles_quant;

NB_MODULE(_ext_cuda, m) {
  m.def("quantize_fp8", &cuda_calls::quantize_fp8);
  m.def("quantize_mx", &cuda_calls::quantize_mx);
  m.def("quantize_nvfp4", &cuda_calls::quantize_nvfp4);
  m.def("quantize_int4", &cuda_calls::quantize_int4);
}
