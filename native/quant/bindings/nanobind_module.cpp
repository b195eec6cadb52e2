// The one binding file: miles_quant._ext, a thin nanobind layer over the CPU kernels (cpu.h).
// Buffers arrive through DLPack as contiguous CPU arrays; the Python wrapper (miles_quant._native)
// allocates the outputs and checks dtypes and shapes, and this layer checks sizes again so a
// wrong call raises ValueError instead of writing out of bounds. Compute runs without the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "miles_quant/cpu.h"

namespace nb = nanobind;
using namespace miles_quant;

using Any = nb::ndarray<nb::c_contig, nb::device::cpu>;
using U8 = nb::ndarray<uint8_t, nb::c_contig, nb::device::cpu>;
using F32 = nb::ndarray<float, nb::c_contig, nb::device::cpu>;

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

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "miles_quant native CPU kernels (see miles_quant/_native.py for the Python wrapper)";

  m.def("isa", &cpu::isa, "Instruction set of the kernels in use: avx512, avx2 or generic.");

  m.def(
      "encode",
      [](F32 x, int elem, U8 out, int threads) {
        expect(x.size() == out.size(), "encode: out must have one byte per input element");
        const Elem e = to_elem(elem);
        nb::gil_scoped_release release;
        cpu::encode_elements(x.data(), static_cast<int64_t>(x.size()), e, out.data(), threads);
      },
      nb::arg("x"), nb::arg("elem"), nb::arg("out"), nb::arg("threads"));

  m.def(
      "quantize_fp8",
      [](Any x, int dtype, int64_t batch, int64_t rows, int64_t cols, int64_t tile_rows,
         int64_t tile_cols, bool per_matrix, int elem, U8 out, F32 scales, int threads) {
        const DType d = to_dtype(dtype);
        const Elem e = to_elem(elem);
        expect(e != Elem::e2m1, "quantize_fp8: element must be e4m3 or e5m2");
        expect(batch >= 0 && rows >= 0 && cols >= 0 && tile_rows > 0 && tile_cols > 0, "quantize_fp8: bad sizes");
        const int64_t n = batch * rows * cols;
        expect(static_cast<int64_t>(x.nbytes()) == n * itemsize(d), "quantize_fp8: x size");
        expect(static_cast<int64_t>(out.size()) == n, "quantize_fp8: out size");
        const int64_t n_scales = per_matrix ? batch : batch * cdiv(rows, tile_rows) * cdiv(cols, tile_cols);
        expect(static_cast<int64_t>(scales.size()) == n_scales, "quantize_fp8: scales size");
        Fp8Args a{x.data(), d, batch, rows, cols, tile_rows, tile_cols, per_matrix, e, out.data(), scales.data(),
                  threads};
        nb::gil_scoped_release release;
        cpu::quantize_fp8(a);
      },
      nb::arg("x"), nb::arg("dtype"), nb::arg("batch"), nb::arg("rows"), nb::arg("cols"),
      nb::arg("tile_rows"), nb::arg("tile_cols"), nb::arg("per_matrix"), nb::arg("elem"), nb::arg("out"), nb::arg("scales"),
      nb::arg("threads"));

  m.def(
      "quantize_mx",
      [](Any x, int dtype, int64_t rows, int64_t cols, int elem, int rule, U8 out, U8 scales, int threads) {
        const DType d = to_dtype(dtype);
        const Elem e = to_elem(elem);
        expect(rule >= 0 && rule <= 2, "quantize_mx: rule must be 0 (floor), 1 (rceil), 2 (even)");
        expect(rows >= 0 && cols >= 0, "quantize_mx: bad sizes");
        const int64_t per_row = e == Elem::e2m1 ? cdiv(cols, 2) : cols;
        expect(static_cast<int64_t>(x.nbytes()) == rows * cols * itemsize(d), "quantize_mx: x size");
        expect(static_cast<int64_t>(out.size()) == rows * per_row, "quantize_mx: out size");
        expect(static_cast<int64_t>(scales.size()) == rows * cdiv(cols, 32), "quantize_mx: scales size");
        MxArgs a{x.data(), d, rows, cols, e, static_cast<ScaleRule>(rule), out.data(), scales.data(), threads};
        nb::gil_scoped_release release;
        cpu::quantize_mx(a);
      },
      nb::arg("x"), nb::arg("dtype"), nb::arg("rows"), nb::arg("cols"), nb::arg("elem"),
      nb::arg("rule"), nb::arg("out"), nb::arg("scales"), nb::arg("threads"));

  m.def(
      "quantize_nvfp4",
      [](Any x, int dtype, int64_t batch, int64_t rows, int64_t cols, bool tile16x16, U8 out, U8 scales,
         F32 global_scale, int threads, bool given_scale) {
        const DType d = to_dtype(dtype);
        expect(batch >= 0 && rows >= 0 && cols >= 0, "quantize_nvfp4: bad sizes");
        expect(static_cast<int64_t>(x.nbytes()) == batch * rows * cols * itemsize(d), "quantize_nvfp4: x size");
        expect(static_cast<int64_t>(out.size()) == batch * rows * cdiv(cols, 2), "quantize_nvfp4: out size");
        expect(static_cast<int64_t>(scales.size()) == batch * rows * cdiv(cols, 16), "quantize_nvfp4: scales size");
        expect(static_cast<int64_t>(global_scale.size()) == batch, "quantize_nvfp4: global_scale size");
        Nvfp4Args a{x.data(), d, batch, rows, cols, tile16x16, out.data(), scales.data(), global_scale.data(), threads,
                    given_scale};
        if (given_scale)
          for (int64_t b = 0; b < batch; ++b) {
            const uint32_t g = f32_bits(a.global_scale[b]);
            expect(g >= 0x00800000u && g < kF32InfBits, "quantize_nvfp4: a given global_scale must be a normal positive fp32");
          }
        nb::gil_scoped_release release;
        cpu::quantize_nvfp4(a);
      },
      nb::arg("x"), nb::arg("dtype"), nb::arg("batch"), nb::arg("rows"), nb::arg("cols"),
      nb::arg("tile16x16"), nb::arg("out"), nb::arg("scales"), nb::arg("global_scale"), nb::arg("threads"),
      nb::arg("given_scale") = false);

  m.def(
      "quantize_int4",
      [](Any x, int dtype, int64_t rows, int64_t cols, int64_t group, int scale_dtype, U8 out, Any scales,
         int threads) {
        const DType d = to_dtype(dtype);
        const DType sd = to_dtype(scale_dtype);
        expect(rows >= 0 && cols >= 0 && group > 0 && group <= 128, "quantize_int4: bad sizes");
        expect(static_cast<int64_t>(x.nbytes()) == rows * cols * itemsize(d), "quantize_int4: x size");
        expect(static_cast<int64_t>(out.size()) == rows * cdiv(cols, 2), "quantize_int4: out size");
        expect(static_cast<int64_t>(scales.nbytes()) == rows * cdiv(cols, group) * itemsize(sd),
               "quantize_int4: scales size");
        Int4Args a{x.data(), d, rows, cols, group, sd, out.data(), scales.data(), threads};
        nb::gil_scoped_release release;
        cpu::quantize_int4(a);
      },
      nb::arg("x"), nb::arg("dtype"), nb::arg("rows"), nb::arg("cols"), nb::arg("group"),
      nb::arg("scale_dtype"), nb::arg("out"), nb::arg("scales"), nb::arg("threads"));
}
