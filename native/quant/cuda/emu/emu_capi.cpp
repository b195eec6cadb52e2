// The emulated CUDA binding as a C library for ctypes (tests/test_cuda_emu.py): the calls of
// bindings/cuda_calls.h, the ones miles_quant._ext_cuda binds, over quantize.cu compiled for the
// CPU emulator (mq_cuda_emu.h). Each returns 0, or 1 for std::invalid_argument (the binding's
// ValueError) or 2 for std::runtime_error (its RuntimeError), with the message in err.
#include <cstdio>
#include <stdexcept>

#include "../../bindings/cuda_calls.h"
#include "mq_cuda_emu.h"

namespace {

template <class Call>
int guarded(char* err, int errlen, const Call& call) {
  mq_cuda_emu::errors().message.clear();
  try {
    call();
    return 0;
  } catch (const std::invalid_argument& e) {
    std::snprintf(err, static_cast<size_t>(errlen), "%s", e.what());
    return 1;
  } catch (const std::runtime_error& e) {
    std::snprintf(err, static_cast<size_t>(errlen), "%s (emulator: %s)", e.what(), mq_cuda_emu::errors().message.c_str());
    return 2;
  }
}

}  // namespace

using namespace miles_quant;

extern "C" {

int mq_emu_quantize_fp8(uintptr_t x, int64_t x_nbytes, int dtype, int64_t batch, int64_t rows, int64_t cols,
                        int64_t tile_rows, int64_t tile_cols, bool per_matrix, int elem, uintptr_t out,
                        int64_t out_nbytes, uintptr_t scales, int64_t scales_nbytes, uintptr_t stream, char* err,
                        int errlen) {
  return guarded(err, errlen, [&] {
    cuda_calls::quantize_fp8(x, x_nbytes, dtype, batch, rows, cols, tile_rows, tile_cols, per_matrix, elem, out,
                             out_nbytes, scales, scales_nbytes, stream);
  });
}

int mq_emu_quantize_mx(uintptr_t x, int64_t x_nbytes, int dtype, int64_t rows, int64_t cols, int elem, int rule,
                       uintptr_t out, int64_t out_nbytes, uintptr_t scales, int64_t scales_nbytes, uintptr_t stream,
                       char* err, int errlen) {
  return guarded(err, errlen, [&] {
    cuda_calls::quantize_mx(x, x_nbytes, dtype, rows, cols, elem, rule, out, out_nbytes, scales, scales_nbytes, stream);
  });
}

int mq_emu_quantize_nvfp4(uintptr_t x, int64_t x_nbytes, int dtype, int64_t batch, int64_t rows, int64_t cols,
                          bool tile16x16, uintptr_t out, int64_t out_nbytes, uintptr_t scales, int64_t scales_nbytes,
                          uintptr_t global_scale, int64_t global_scale_nbytes, uintptr_t stream, bool given_scale,
                          char* err, int errlen) {
  return guarded(err, errlen, [&] {
    cuda_calls::quantize_nvfp4(x, x_nbytes, dtype, batch, rows, cols, tile16x16, out, out_nbytes, scales,
                               scales_nbytes, global_scale, global_scale_nbytes, stream, given_scale);
  });
}

int mq_emu_quantize_int4(uintptr_t x, int64_t x_nbytes, int dtype, int64_t rows, int64_t cols, int64_t group,
                         int scale_dtype, uintptr_t out, int64_t out_nbytes, uintptr_t scales, int64_t scales_nbytes,
                         uintptr_t stream, char* err, int errlen) {
  return guarded(err, errlen, [&] {
    cuda_calls::quantize_int4(x, x_nbytes, dtype, rows, cols, group, scale_dtype, out, out_nbytes, scales,
                              scales_nbytes, stream);
  });
}

}  // extern "C"
