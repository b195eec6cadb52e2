// The one binding file: miles_quant._ext, a thin nanobind layer over the CPU kernels (cpu.h).
// Each buffer arrives as two integers, the address and the size in bytes of a contiguous CPU
// tensor (data_ptr() and nbytes): converting a torch tensor through DLPack costs about 2 us, more
// than the work of a small call. The Python wrapper (miles_quant._native) allocates the outputs
// and checks devices, dtypes, shapes and contiguity; this layer checks the sizes again so a wrong
// call raises ValueError instead of writing out of bounds. Compute runs without the GIL.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "miles_quant/cpu.h"

namespace nb = nanobind;
using namespace miles_quant;

namespace {

int64_t itemsize(DType d) { return d == DType::f32 ? 4 : 2; }

DType to_dtype(int code) {
  if (code < 0 || code > 2) throw std::invalid_argument("dtype code must be 0 (f32), 1 (bf16), 2 (f16)");
  return static_cast<DType>(code);
}

Elem to_elem(int code) {
  if (code < 0 || code > 2) throw std::invalid_argument("element code must be 0 (e4m3), 1 (e5m2), 2 (e2m1)");
  return static_cast<Elem>(code);
}

void expect(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("miles_quant._ext: ") + what);
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A buffer of `nbytes` bytes at `addr`, which must be `want` bytes (`what` names it in the error).
template <class T = void>
T* buffer(uintptr_t addr, int64_t nbytes, int64_t want, const char* what) {
  if (nbytes != want) throw std::invalid_argument(std::string("miles_quant._ext: ") + what + " size");
  expect(addr != 0 || want == 0, what);
  return reinterpret_cast<T*>(addr);
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "miles_quant native CPU kernels (see miles_quant/_native.py for the Python wrapper)";

  m.def("isa", &cpu::isa, "Instruction set of the kernels in use: avx512, avx2 or generic.");

  m.def(
      "encode",
      [](uintptr_t x, int64_t x_nbytes, int elem, uintptr_t out, int64_t out_nbytes, int threads) {
        expect(x_nbytes >= 0 && x_nbytes % 4 == 0, "encode: x must be float32");
        const int64_t n = x_nbytes / 4;
        const Elem e = to_elem(elem);
        const float* xp = buffer<const float>(x, x_nbytes, 4 * n, "encode: x");
        uint8_t* op = buffer<uint8_t>(out, out_nbytes, n, "encode: out (one byte per input element)");
        nb::gil_scoped_release release;
        cpu::encode_elements(xp, n, e, op, threads);
      },
      nb::arg("x"), nb::arg("x_nbytes"), nb::arg("elem"), nb::arg("out"), nb::arg("out_nbytes"), nb::arg("threads"));

  m.def(
      "quantize_fp8",
      [](uintptr_t x, int64_t x_nbytes, int dtype, int64_t batch, int64_t rows, int64_t cols, int64_t tile_rows,
         int64_t tile_cols, bool per_matrix, int elem, uintptr_t out, int64_t out_nbytes, uintptr_t scales,
         int64_t scales_nbytes, int threads) {
        const DType d = to_dtype(dtype);
        const Elem e = to_elem(elem);
        expect(e != Elem::e2m1, "quantize_fp8: element must be e4m3 or e5m2");
        expect(batch >= 0 && rows >= 0 && cols >= 0 && tile_rows > 0 && tile_cols > 0, "quantize_fp8: bad sizes");
        const int64_t n = batch * rows * cols;
        const int64_t n_scales = per_matrix ? batch : batch * cdiv(rows, tile_rows) * cdiv(cols, tile_cols);
        Fp8Args a{buffer<const void>(x, x_nbytes, n * itemsize(d), "quantize_fp8: x"), d, batch, rows, cols,
                  tile_rows, tile_cols, per_matrix, e, buffer<uint8_t>(out, out_nbytes, n, "quantize_fp8: out"),
                  buffer<float>(scales, scales_nbytes, 4 * n_scales, "quantize_fp8: scales"), threads};
        nb::gil_scoped_release release;
        cpu::quantize_fp8(a);
      },
      nb::arg("x"), nb::arg("x_nbytes"), nb::arg("dtype"), nb::arg("batch"), nb::arg("rows"), nb::arg("cols"),
      nb::arg("tile_rows"), nb::arg("tile_cols"), nb::arg("per_matrix"), nb::arg("elem"), nb::arg("out"),
      nb::arg("out_nbytes"), nb::arg("scales"), nb::arg("scales_nbytes"), nb::arg("threads"));

  m.def(
      "quantize_mx",
      [](uintptr_t x, int64_t x_nbytes, int dtype, int64_t rows, int64_t cols, int elem, int rule, uintptr_t out,
         int64_t out_nbytes, uintptr_t scales, int64_t scales_nbytes, int threads) {
        const DType d = to_dtype(dtype);
        const Elem e = to_elem(elem);
        expect(rule >= 0 && rule <= 2, "quantize_mx: rule must be 0 (floor), 1 (rceil), 2 (even)");
        expect(rows >= 0 && cols >= 0, "quantize_mx: bad sizes");
        const int64_t per_row = e == Elem::e2m1 ? cdiv(cols, 2) : cols;
        MxArgs a{buffer<const void>(x, x_nbytes, rows * cols * itemsize(d), "quantize_mx: x"), d, rows, cols, e,
                 static_cast<ScaleRule>(rule), buffer<uint8_t>(out, out_nbytes, rows * per_row, "quantize_mx: out"),
                 buffer<uint8_t>(scales, scales_nbytes, rows * cdiv(cols, 32), "quantize_mx: scales"), threads};
        nb::gil_scoped_release release;
        cpu::quantize_mx(a);
      },
      nb::arg("x"), nb::arg("x_nbytes"), nb::arg("dtype"), nb::arg("rows"), nb::arg("cols"), nb::arg("elem"),
      nb::arg("rule"), nb::arg("out"), nb::arg("out_nbytes"), nb::arg("scales"), nb::arg("scales_nbytes"),
      nb::arg("threads"));

  m.def(
      "quantize_nvfp4",
      [](uintptr_t x, int64_t x_nbytes, int dtype, int64_t batch, int64_t rows, int64_t cols, bool tile16x16,
         uintptr_t out, int64_t out_nbytes, uintptr_t scales, int64_t scales_nbytes, uintptr_t global_scale,
         int64_t global_scale_nbytes, int threads, bool given_scale) {
        const DType d = to_dtype(dtype);
        expect(batch >= 0 && rows >= 0 && cols >= 0, "quantize_nvfp4: bad sizes");
        Nvfp4Args a{buffer<const void>(x, x_nbytes, batch * rows * cols * itemsize(d), "quantize_nvfp4: x"), d,
                    batch, rows, cols, tile16x16,
                    buffer<uint8_t>(out, out_nbytes, batch * rows * cdiv(cols, 2), "quantize_nvfp4: out"),
                    buffer<uint8_t>(scales, scales_nbytes, batch * rows * cdiv(cols, 16), "quantize_nvfp4: scales"),
                    buffer<float>(global_scale, global_scale_nbytes, 4 * batch, "quantize_nvfp4: global_scale"),
                    threads, given_scale};
        if (given_scale)
          for (int64_t b = 0; b < batch; ++b) {
            const uint32_t g = f32_bits(a.global_scale[b]);
            expect(g >= 0x00800000u && g < kF32InfBits, "quantize_nvfp4: a given global_scale must be a normal positive fp32");
          }
        nb::gil_scoped_release release;
        cpu::quantize_nvfp4(a);
      },
      nb::arg("x"), nb::arg("x_nbytes"), nb::arg("dtype"), nb::arg("batch"), nb::arg("rows"), nb::arg("cols"),
      nb::arg("tile16x16"), nb::arg("out"), nb::arg("out_nbytes"), nb::arg("scales"), nb::arg("scales_nbytes"),
      nb::arg("global_scale"), nb::arg("global_scale_nbytes"), nb::arg("threads"), nb::arg("given_scale") = false);

  m.def(
      "quantize_int4",
      [](uintptr_t x, int64_t x_nbytes, int dtype, int64_t rows, int64_t cols, int64_t group, int scale_dtype,
         uintptr_t out, int64_t out_nbytes, uintptr_t scales, int64_t scales_nbytes, int threads) {
        const DType d = to_dtype(dtype);
        const DType sd = to_dtype(scale_dtype);
        expect(rows >= 0 && cols >= 0 && group > 0 && group <= 128, "quantize_int4: bad sizes");
        Int4Args a{buffer<const void>(x, x_nbytes, rows * cols * itemsize(d), "quantize_int4: x"), d, rows, cols,
                   group, sd, buffer<uint8_t>(out, out_nbytes, rows * cdiv(cols, 2), "quantize_int4: out"),
                   buffer<void>(scales, scales_nbytes, rows * cdiv(cols, group) * itemsize(sd), "quantize_int4: scales"),
                   threads};
        nb::gil_scoped_release release;
        cpu::quantize_int4(a);
      },
      nb::arg("x"), nb::arg("x_nbytes"), nb::arg("dtype"), nb::arg("rows"), nb::arg("cols"), nb::arg("group"),
      nb::arg("scale_dtype"), nb::arg("out"), nb::arg("out_nbytes"), nb::arg("scales"), nb::arg("scales_nbytes"),
      nb::arg("threads"));

  m.def(
      "dequantize",
      [](uintptr_t data, int64_t data_nbytes, int code, int64_t batch, int64_t rows, int64_t cols, int64_t tile_rows,
         int64_t tile_cols, uintptr_t scales, int64_t scales_nbytes, int scale_kind, uintptr_t global_scale,
         int64_t global_scale_nbytes, uintptr_t out, int64_t out_nbytes, int out_dtype, int threads) {
        expect(code >= 0 && code <= 3, "dequantize: element code must be 0 (e4m3), 1 (e5m2), 2 (e2m1), 3 (int4)");
        expect(scale_kind >= 0 && scale_kind <= 4, "dequantize: scale kind must be 0 (f32) .. 4 (e4m3)");
        expect(batch >= 0 && rows >= 0 && cols >= 0 && tile_rows > 0 && tile_cols > 0, "dequantize: bad sizes");
        const Code c = static_cast<Code>(code);
        const ScaleKind sk = static_cast<ScaleKind>(scale_kind);
        const DType od = to_dtype(out_dtype);
        const bool packed = c == Code::e2m1 || c == Code::int4;
        const int64_t scale_size = sk == ScaleKind::f32 ? 4 : (sk == ScaleKind::bf16 || sk == ScaleKind::f16 ? 2 : 1);
        const int64_t n_scales = batch * cdiv(rows, tile_rows) * cdiv(cols, tile_cols);
        const float* g = nullptr;
        if (global_scale != 0 || global_scale_nbytes != 0)
          g = buffer<const float>(global_scale, global_scale_nbytes, 4 * batch, "dequantize: global_scale");
        DequantArgs a{buffer<const uint8_t>(data, data_nbytes, batch * rows * (packed ? cdiv(cols, 2) : cols), "dequantize: data"),
                      c, batch, rows, cols, tile_rows, tile_cols,
                      buffer<const void>(scales, scales_nbytes, n_scales * scale_size, "dequantize: scales"), sk, g,
                      buffer<void>(out, out_nbytes, batch * rows * cols * itemsize(od), "dequantize: out"), od, threads};
        nb::gil_scoped_release release;
        cpu::dequantize(a);
      },
      nb::arg("data"), nb::arg("data_nbytes"), nb::arg("code"), nb::arg("batch"), nb::arg("rows"), nb::arg("cols"),
      nb::arg("tile_rows"), nb::arg("tile_cols"), nb::arg("scales"), nb::arg("scales_nbytes"), nb::arg("scale_kind"),
      nb::arg("global_scale"), nb::arg("global_scale_nbytes"), nb::arg("out"), nb::arg("out_nbytes"),
      nb::arg("out_dtype"), nb::arg("threads"));
}
