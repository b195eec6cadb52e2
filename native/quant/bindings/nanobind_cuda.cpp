// miles_quant._ext_cuda: the CUDA kernels (cuda/quantize.cu) behind a thin nanobind layer, built
// only with -DMILES_QUANT_CUDA=ON. Buffers are CUDA arrays (DLPack); `stream` is a cudaStream_t
// as an integer (torch.cuda.current_stream().cuda_stream). Sizes are checked as in the CPU
// binding; launches are asynchronous and errors raise RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "../cuda/quantize_cuda.h"

namespace nb = nanobind;
using namespace miles_quant;

using Any = nb::ndarray<nb::c_contig, nb::device::cuda>;
using U8 = nb::ndarray<uint8_t, nb::c_contig, nb::device::cuda>;
using F32 = nb::ndarray<float, nb::c_contig, nb::device::cuda>;

namespace {

int64_t itemsize(DType d) { return d == DType::f32 ? 4 : 2; }
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

void expect(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("miles_quant._ext_cuda: ") + what);
}

void check(int err, const char* what) {
  if (err != 0) throw std::runtime_error(std::string("miles_quant._ext_cuda: ") + what + " failed, cudaError " + std::to_string(err));
}

void* as_stream(uintptr_t s) { return reinterpret_cast<void*>(s); }

}  // namespace

NB_MODULE(_ext_cuda, m) {
  m.def("quantize_fp8", [](Any x, int dtype, int64_t batch, int64_t rows, int64_t cols, int64_t tile_rows,
                           int64_t tile_cols, bool per_matrix, int elem, U8 out, F32 scales, uintptr_t stream) {
    const DType d = static_cast<DType>(dtype);
    expect(static_cast<int64_t>(x.nbytes()) == batch * rows * cols * itemsize(d), "quantize_fp8: x size");
    expect(static_cast<int64_t>(out.size()) == batch * rows * cols, "quantize_fp8: out size");
    const int64_t n_scales = per_matrix ? batch : batch * cdiv(rows, tile_rows) * cdiv(cols, tile_cols);
    expect(static_cast<int64_t>(scales.size()) == n_scales, "quantize_fp8: scales size");
    Fp8Args a{x.data(), d, batch, rows, cols, tile_rows, tile_cols, per_matrix, static_cast<Elem>(elem),
              out.data(), scales.data(), 0};
    check(cuda::quantize_fp8(a, as_stream(stream)), "quantize_fp8");
  });
  m.def("quantize_mx", [](Any x, int dtype, int64_t rows, int64_t cols, int elem, int rule, U8 out, U8 scales,
                          uintptr_t stream) {
    const DType d = static_cast<DType>(dtype);
    const Elem e = static_cast<Elem>(elem);
    expect(static_cast<int64_t>(x.nbytes()) == rows * cols * itemsize(d), "quantize_mx: x size");
    expect(static_cast<int64_t>(out.size()) == rows * (e == Elem::e2m1 ? cdiv(cols, 2) : cols), "quantize_mx: out size");
    expect(static_cast<int64_t>(scales.size()) == rows * cdiv(cols, 32), "quantize_mx: scales size");
    MxArgs a{x.data(), d, rows, cols, e, static_cast<ScaleRule>(rule), out.data(), scales.data(), 0};
    check(cuda::quantize_mx(a, as_stream(stream)), "quantize_mx");
  });
  m.def("quantize_nvfp4", [](Any x, int dtype, int64_t batch, int64_t rows, int64_t cols, bool tile16x16, U8 out,
                             U8 scales, F32 global_scale, uintptr_t stream, bool given_scale) {
    const DType d = static_cast<DType>(dtype);
    expect(static_cast<int64_t>(x.nbytes()) == batch * rows * cols * itemsize(d), "quantize_nvfp4: x size");
    expect(static_cast<int64_t>(out.size()) == batch * rows * cdiv(cols, 2), "quantize_nvfp4: out size");
    expect(static_cast<int64_t>(scales.size()) == batch * rows * cdiv(cols, 16), "quantize_nvfp4: scales size");
    expect(static_cast<int64_t>(global_scale.size()) == batch, "quantize_nvfp4: global_scale size");
    // A given global_scale (device memory) was validated by the caller (miles_quant.quantize).
    Nvfp4Args a{x.data(), d, batch, rows, cols, tile16x16, out.data(), scales.data(), global_scale.data(), 0,
                given_scale};
    check(cuda::quantize_nvfp4(a, as_stream(stream)), "quantize_nvfp4");
  });
  m.def("quantize_int4", [](Any x, int dtype, int64_t rows, int64_t cols, int64_t group, int scale_dtype, U8 out,
                            Any scales, uintptr_t stream) {
    const DType d = static_cast<DType>(dtype);
    const DType sd = static_cast<DType>(scale_dtype);
    expect(static_cast<int64_t>(x.nbytes()) == rows * cols * itemsize(d), "quantize_int4: x size");
    expect(static_cast<int64_t>(out.size()) == rows * cdiv(cols, 2), "quantize_int4: out size");
    expect(static_cast<int64_t>(scales.nbytes()) == rows * cdiv(cols, group) * itemsize(sd), "quantize_int4: scales size");
    Int4Args a{x.data(), d, rows, cols, group, sd, out.data(), scales.data(), 0};
    check(cuda::quantize_int4(a, as_stream(stream)), "quantize_int4");
  });
}
