// The CUDA binding's calls (nanobind_cuda.cpp binds them as miles_quant._ext_cuda): each buffer is
// two integers, the device address and the size in bytes of a contiguous CUDA tensor (data_ptr()
// and nbytes; as in the CPU binding, DLPack costs more than a small launch); `stream` is a
// cudaStream_t as an integer (torch.cuda.current_stream().cuda_stream). Sizes are checked as in
// the CPU binding (std::invalid_argument: ValueError); launches are asynchronous and their errors
// throw std::runtime_error (RuntimeError). The CPU emulator's test library (cuda/emu) calls the
// same functions, so that its tests cover this argument mapping too.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "../cuda/quantize_cuda.h"

namespace miles_quant {
namespace cuda_calls {

inline int64_t itemsize(DType d) { return d == DType::f32 ? 4 : 2; }
inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline void expect(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("miles_quant._ext_cuda: ") + what);
}

// A device buffer of `nbytes` bytes at `addr`, which must be `want` bytes.
template <class T = void>
T* buffer(uintptr_t addr, int64_t nbytes, int64_t want, const char* what) {
  if (nbytes != want) throw std::invalid_argument(std::string("miles_quant._ext_cuda: ") + what + " size");
  expect(addr != 0 || want == 0, what);
  return reinterpret_cast<T*>(addr);
}

inline void check(int err, const char* what) {
  if (err != 0) throw std::runtime_error(std::string("miles_quant._ext_cuda: ") + what + " failed, cudaError " + std::to_string(err));
}

inline void* as_stream(uintptr_t s) { return reinterpret_cast<void*>(s); }

inline void quantize_fp8(uintptr_t x, int64_t x_nbytes, int dtype, int64_t batch, int64_t rows, int64_t cols,
                         int64_t tile_rows, int64_t tile_cols, bool per_matrix, int elem, uintptr_t out,
                         int64_t out_nbytes, uintptr_t scales, int64_t scales_nbytes, uintptr_t stream) {
  const DType d = static_cast<DType>(dtype);
  const int64_t n = batch * rows * cols;
  const int64_t n_scales = per_matrix ? batch : batch * cdiv(rows, tile_rows) * cdiv(cols, tile_cols);
  Fp8Args a{buffer<const void>(x, x_nbytes, n * itemsize(d), "quantize_fp8: x"), d, batch, rows, cols, tile_rows,
            tile_cols, per_matrix, static_cast<Elem>(elem), buffer<uint8_t>(out, out_nbytes, n, "quantize_fp8: out"),
            buffer<float>(scales, scales_nbytes, 4 * n_scales, "quantize_fp8: scales"), 0};
  check(cuda::quantize_fp8(a, as_stream(stream)), "quantize_fp8");
}

inline void quantize_mx(uintptr_t x, int64_t x_nbytes, int dtype, int64_t rows, int64_t cols, int elem, int rule,
                        uintptr_t out, int64_t out_nbytes, uintptr_t scales, int64_t scales_nbytes, uintptr_t stream) {
  const DType d = static_cast<DType>(dtype);
  const Elem e = static_cast<Elem>(elem);
  const int64_t per_row = e == Elem::e2m1 ? cdiv(cols, 2) : cols;
  MxArgs a{buffer<const void>(x, x_nbytes, rows * cols * itemsize(d), "quantize_mx: x"), d, rows, cols, e,
           static_cast<ScaleRule>(rule), buffer<uint8_t>(out, out_nbytes, rows * per_row, "quantize_mx: out"),
           buffer<uint8_t>(scales, scales_nbytes, rows * cdiv(cols, 32), "quantize_mx: scales"), 0};
  check(cuda::quantize_mx(a, as_stream(stream)), "quantize_mx");
}

inline void quantize_nvfp4(uintptr_t x, int64_t x_nbytes, int dtype, int64_t batch, int64_t rows, int64_t cols,
                           bool tile16x16, uintptr_t out, int64_t out_nbytes, uintptr_t scales, int64_t scales_nbytes,
                           uintptr_t global_scale, int64_t global_scale_nbytes, uintptr_t stream, bool given_scale) {
  const DType d = static_cast<DType>(dtype);
  // A given global_scale (device memory) was validated by the caller (miles_quant.quantize).
  Nvfp4Args a{buffer<const void>(x, x_nbytes, batch * rows * cols * itemsize(d), "quantize_nvfp4: x"), d, batch,
              rows, cols, tile16x16,
              buffer<uint8_t>(out, out_nbytes, batch * rows * cdiv(cols, 2), "quantize_nvfp4: out"),
              buffer<uint8_t>(scales, scales_nbytes, batch * rows * cdiv(cols, 16), "quantize_nvfp4: scales"),
              buffer<float>(global_scale, global_scale_nbytes, 4 * batch, "quantize_nvfp4: global_scale"), 0,
              given_scale};
  check(cuda::quantize_nvfp4(a, as_stream(stream)), "quantize_nvfp4");
}

inline void quantize_int4(uintptr_t x, int64_t x_nbytes, int dtype, int64_t rows, int64_t cols, int64_t group,
                          int scale_dtype, uintptr_t out, int64_t out_nbytes, uintptr_t scales, int64_t scales_nbytes,
                          uintptr_t stream) {
  const DType d = static_cast<DType>(dtype);
  const DType sd = static_cast<DType>(scale_dtype);
  Int4Args a{buffer<const void>(x, x_nbytes, rows * cols * itemsize(d), "quantize_int4: x"), d, rows, cols, group,
             sd, buffer<uint8_t>(out, out_nbytes, rows * cdiv(cols, 2), "quantize_int4: out"),
             buffer<void>(scales, scales_nbytes, rows * cdiv(cols, group) * itemsize(sd), "quantize_int4: scales"),
             0};
  check(cuda::quantize_int4(a, as_stream(stream)), "quantize_int4");
}

}  // namespace cuda_calls
}  // namespace miles_quant
