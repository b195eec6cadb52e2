// The AVX-512 leaf: dispatch from the Leaf table to the explicit kernels of avx512_kernels.h.
// Included by cpu_isa_avx512.cpp and cpu_isa_avx512vbmi.cpp, each of which defines MQ_CPU_NS
// (its own namespace, so that the two builds never share a symbol) and its compile flags.
#pragma once

#include "miles_quant/cpu_kernels.h"

#include "avx512_kernels.h"

namespace miles_quant {
namespace cpu {
namespace MQ_CPU_NS {
namespace {

template <template <DType> class K, class... Args>
void by_dtype(DType d, Args&&... args) {
  if (d == DType::f32)
    K<DType::f32>::run(args...);
  else if (d == DType::bf16)
    K<DType::bf16>::run(args...);
  else
    K<DType::f16>::run(args...);
}

template <class F>
struct Fp8Flat {
  template <DType D>
  struct K {
    static void run(const Fp8Args& a, int64_t b, int64_t n, uint32_t m) { fp8_flat_v<D, F>(a, b, n, m); }
  };
};
template <class F>
struct Fp8Tiles {
  template <DType D>
  struct K {
    static void run(const Fp8Args& a, int64_t t0, int64_t t1) { fp8_tiles_v<D, F>(a, t0, t1); }
  };
};
template <class F>
struct MxRows {
  template <DType D>
  struct K {
    static void run(const MxArgs& a, int64_t r0, int64_t r1) { mx_rows_v<D, F>(a, r0, r1); }
  };
};
template <DType D>
struct Nvfp4Rows {
  static void run(const Nvfp4Args& a, int64_t t0, int64_t t1, const uint32_t* g) { nvfp4_rows_v<D>(a, t0, t1, g); }
};
template <DType D>
struct Int4Rows {
  static void run(const Int4Args& a, int64_t r0, int64_t r1) { int4_rows_v<D>(a, r0, r1); }
};
template <DType D>
struct Amax {
  static void run(const void* x, int64_t begin, int64_t n, uint32_t* out) {
    *out = simd::amax_stream<D>(static_cast<const typename In<D>::T*>(x) + begin, n);
  }
};

uint32_t amax_v(DType d, const void* x, int64_t begin, int64_t n) {
  uint32_t m = 0;
  by_dtype<Amax>(d, x, begin, n, &m);
  return m;
}

void encode_v(const float* x, int64_t n, Elem e, uint8_t* out) {
  if (e == Elem::e4m3) encode_run_v<E4M3>(x, n, out);
  if (e == Elem::e5m2) encode_run_v<E5M2>(x, n, out);
  if (e == Elem::e2m1) encode_run_v<E2M1>(x, n, out);
}

void fp8_flat_d(const Fp8Args& a, int64_t begin, int64_t n, uint32_t amax) {
  if (a.elem == Elem::e4m3)
    by_dtype<Fp8Flat<E4M3>::K>(a.dtype, a, begin, n, amax);
  else
    by_dtype<Fp8Flat<E5M2>::K>(a.dtype, a, begin, n, amax);
}

void fp8_tiles_d(const Fp8Args& a, int64_t t0, int64_t t1) {
  if (a.elem == Elem::e4m3)
    by_dtype<Fp8Tiles<E4M3>::K>(a.dtype, a, t0, t1);
  else
    by_dtype<Fp8Tiles<E5M2>::K>(a.dtype, a, t0, t1);
}

void mx_rows_d(const MxArgs& a, int64_t r0, int64_t r1) {
  if (a.elem == Elem::e4m3) by_dtype<MxRows<E4M3>::K>(a.dtype, a, r0, r1);
  if (a.elem == Elem::e5m2) by_dtype<MxRows<E5M2>::K>(a.dtype, a, r0, r1);
  if (a.elem == Elem::e2m1) by_dtype<MxRows<E2M1>::K>(a.dtype, a, r0, r1);
}

void nvfp4_rows_d(const Nvfp4Args& a, int64_t t0, int64_t t1, const uint32_t* gamax) {
  by_dtype<Nvfp4Rows>(a.dtype, a, t0, t1, gamax);
}

void int4_rows_d(const Int4Args& a, int64_t r0, int64_t r1) { by_dtype<Int4Rows>(a.dtype, a, r0, r1); }

}  // namespace

// The leaf of this build: the scalar kernels of cpu_kernels.h with the explicit AVX-512 ones
// above in place of the hot loops.
static inline Leaf make_avx512_leaf(const char* name) {
  Leaf l = make_leaf(name);
  l.amax = amax_v;
  l.encode = encode_v;
  l.fp8_flat = fp8_flat_d;
  l.fp8_tiles = fp8_tiles_d;
  l.mx_rows = mx_rows_d;
  l.nvfp4_rows = nvfp4_rows_d;
  l.int4_rows = int4_rows_d;
  l.dequant_rows = dequant_rows_v;
  return l;
}

}  // namespace MQ_CPU_NS
}  // namespace cpu
}  // namespace miles_quant
