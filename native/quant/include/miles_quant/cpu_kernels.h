// CPU leaf kernels over raw pointers: one fused pass per group (amax, scale, cast, pack) over
// a range of rows or tiles. Torch-free; scheduling and threads live in src/cpu.cpp.
//
// This header is compiled once per instruction set (src/cpu_isa_*.cpp define MQ_CPU_NS). Leaf
// code uses no standard-library templates and all of it sits in that namespace or has
// internal linkage, so the linker never merges an AVX-512 copy into the generic path.
#pragma once

#include <cstdint>
#include <cstring>

#include "miles_quant/bits.h"
#include "miles_quant/contract.h"
#include "miles_quant/cpu.h"
#include "miles_quant/elements.h"
#include "miles_quant/kernel_args.h"

#ifndef MQ_CPU_NS
#define MQ_CPU_NS generic
#endif

namespace miles_quant {
namespace cpu {
namespace MQ_CPU_NS {

static inline int64_t lo(int64_t a, int64_t b) { return a < b ? a : b; }
static inline uint32_t hi(uint32_t a, uint32_t b) { return a > b ? a : b; }

// ---- input loading --------------------------------------------------------------------------

template <DType D>
struct In;
template <>
struct In<DType::f32> {
  using T = float;
  static inline float load(const T* p, int64_t i) { return p[i]; }
  static inline uint32_t amax_bits(const T* p, int64_t n) {
    uint32_t m = 0;  // |x| bits order like the values; NaN bits lie above Inf
    for (int64_t i = 0; i < n; ++i) m = hi(m, f32_bits(p[i]) & kF32AbsMask);
    return m;
  }
};
template <>
struct In<DType::bf16> {
  using T = uint16_t;
  static inline float load(const T* p, int64_t i) { return bf16_to_f32(p[i]); }
  static inline uint32_t amax_bits(const T* p, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; ++i) m = hi(m, p[i] & 0x7FFFu);
    return m << 16;
  }
};
template <>
struct In<DType::f16> {
  using T = uint16_t;
  static inline float load(const T* p, int64_t i) { return f16_to_f32(p[i]); }
  static inline uint32_t amax_bits(const T* p, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; ++i) m = hi(m, p[i] & 0x7FFFu);
    return f32_bits(f16_to_f32(static_cast<uint16_t>(m)));
  }
};

// amax bits of rows [r0, r1) x cols [c0, c1) of a row-major [*, C] matrix.
template <DType D>
static uint32_t tile_amax(const typename In<D>::T* x, int64_t C, int64_t r0, int64_t r1,
                          int64_t c0, int64_t c1) {
  uint32_t m = 0;
  for (int64_t r = r0; r < r1; ++r) m = hi(m, In<D>::amax_bits(x + r * C + c0, c1 - c0));
  return m;
}

// Packs n 4-bit codes (element 0 in the low nibble); an odd tail is paired with `pad`.
static inline void pack_nibbles(const uint8_t* codes, int64_t n, uint8_t pad, uint8_t* out) {
  const int64_t pairs = n / 2;
  for (int64_t i = 0; i < pairs; ++i)
    out[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
  if (n & 1) out[pairs] = static_cast<uint8_t>(codes[n - 1] | (pad << 4));
}

// ---- raw element casts ------------------------------------------------------------------------

template <class F>
static void encode_run(const float* x, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(encode<F>(x[i]));
}

static void encode_range(const float* x, int64_t n, Elem e, uint8_t* out) {
  if (e == Elem::e4m3) encode_run<E4M3>(x, n, out);
  if (e == Elem::e5m2) encode_run<E5M2>(x, n, out);
  if (e == Elem::e2m1) encode_run<E2M1>(x, n, out);
}

// ---- amax over a flat range -------------------------------------------------------------------

static uint32_t amax_range(DType d, const void* x, int64_t begin, int64_t n) {
  if (d == DType::f32) return In<DType::f32>::amax_bits(static_cast<const float*>(x) + begin, n);
  if (d == DType::bf16) return In<DType::bf16>::amax_bits(static_cast<const uint16_t*>(x) + begin, n);
  return In<DType::f16>::amax_bits(static_cast<const uint16_t*>(x) + begin, n);
}

// ---- FP8 with fp32 scales -------------------------------------------------------------------

template <DType D, class F>
static void fp8_run(const typename In<D>::T* x, int64_t n, float s, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(encode<F>(In<D>::load(x, i) / s));
}

// Elements [begin, begin + n) of the flat input with one scale group of amax `amax`.
template <DType D, class F>
static void fp8_flat_t(const Fp8Args& a, int64_t begin, int64_t n, uint32_t amax) {
  const auto* x = static_cast<const typename In<D>::T*>(a.x) + begin;
  if (is_poisoned(amax)) {
    std::memset(a.out + begin, F::kNanCode, static_cast<size_t>(n));
    return;
  }
  fp8_run<D, F>(x, n, fp8_scale<F>(bits_f32(amax)), a.out + begin);
}

// Tile rows [t0, t1) (of batch * ceil(rows / tile_rows)): every tile of those rows.
template <DType D, class F>
static void fp8_tiles_t(const Fp8Args& a, int64_t t0, int64_t t1) {
  const auto* x = static_cast<const typename In<D>::T*>(a.x);
  const int64_t R = a.rows, C = a.cols, tr = a.tile_rows, tc = a.tile_cols;
  const int64_t nr = (R + tr - 1) / tr, nc = (C + tc - 1) / tc;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t b = t / nr, i = t % nr;
    const int64_t r0 = b * R + i * tr, r1 = b * R + lo(R, (i + 1) * tr);
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t c0 = j * tc, c1 = lo(C, c0 + tc);
      const uint32_t amax = tile_amax<D>(x, C, r0, r1, c0, c1);
      float* scale = a.scales + t * nc + j;
      if (is_poisoned(amax)) {
        *scale = bits_f32(kF32QuietNan);
        for (int64_t r = r0; r < r1; ++r)
          std::memset(a.out + r * C + c0, F::kNanCode, static_cast<size_t>(c1 - c0));
        continue;
      }
      const float s = fp8_scale<F>(bits_f32(amax));
      *scale = s;
      for (int64_t r = r0; r < r1; ++r) fp8_run<D, F>(x + r * C + c0, c1 - c0, s, a.out + r * C + c0);
    }
  }
}

// ---- MX: 1x32 blocks, E8M0 scales -----------------------------------------------------------

template <DType D, class F>
static void mx_rows_t(const MxArgs& a, int64_t r0, int64_t r1) {
  constexpr int64_t kBlock = 32;
  constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  const auto* xs = static_cast<const typename In<D>::T*>(a.x);
  const int64_t C = a.cols;
  const int64_t out_stride = kPacked ? (C + 1) / 2 : C, scale_stride = (C + kBlock - 1) / kBlock;
  uint8_t codes[kBlock];
  for (int64_t r = r0; r < r1; ++r) {
    const auto* x = xs + r * C;
    uint8_t* out = a.out + r * out_stride;
    uint8_t* scales = a.scales + r * scale_stride;
    for (int64_t j = 0, blk = 0; j < C; j += kBlock, ++blk) {
      const int64_t n = lo(kBlock, C - j);
      const uint32_t amax = In<D>::amax_bits(x + j, n);
      uint32_t sc;
      if (is_poisoned(amax)) {
        sc = kE8M0Nan;
        for (int64_t k = 0; k < n; ++k) codes[k] = static_cast<uint8_t>(F::kNanCode);
      } else {
        sc = e8m0_code<F>(a.rule, amax);
        const float m = e8m0_inverse(sc);
        for (int64_t k = 0; k < n; ++k)
          codes[k] = static_cast<uint8_t>(encode<F>(In<D>::load(x + j, k) * m));
      }
      scales[blk] = static_cast<uint8_t>(sc);
      if (kPacked)
        pack_nibbles(codes, n, 0, out + j / 2);
      else
        std::memcpy(out + j, codes, static_cast<size_t>(n));
    }
  }
}

// ---- NVFP4: 1x16 or 16x16 blocks, E4M3 block scales, fp32 global scale per matrix ----------

template <DType D>
static void nvfp4_segment(const typename In<D>::T* x, int64_t n, float factor, uint8_t* out) {
  uint8_t codes[16];
  for (int64_t k = 0; k < n; ++k)
    codes[k] = static_cast<uint8_t>(encode<E2M1>(In<D>::load(x, k) * factor));
  pack_nibbles(codes, n, 0, out);
}

// Tile rows [t0, t1) of batch * ceil(rows / tr), tr = 16 (16x16) or 1 (1x16).
template <DType D>
static void nvfp4_rows_t(const Nvfp4Args& a, int64_t t0, int64_t t1, const uint32_t* gamax) {
  const auto* x = static_cast<const typename In<D>::T*>(a.x);
  const int64_t R = a.rows, C = a.cols, tr = a.tile16x16 ? 16 : 1;
  const int64_t nr = (R + tr - 1) / tr, nc = (C + 15) / 16, out_stride = (C + 1) / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t b = t / nr, i = t % nr;
    const int64_t r0 = b * R + i * tr, r1 = b * R + lo(R, (i + 1) * tr);
    const bool poisoned = is_poisoned(gamax[b]);
    const float sg = a.global_scale[b];
    const float inv = 1.0f / sg;
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t c0 = j * 16, c1 = lo(C, c0 + 16);
      if (poisoned) {
        for (int64_t r = r0; r < r1; ++r) {
          a.scales[r * nc + j] = static_cast<uint8_t>(E4M3::kNanCode);
          std::memset(a.out + r * out_stride + c0 / 2, 0, static_cast<size_t>((c1 - c0 + 1) / 2));
        }
        continue;
      }
      // The block is the whole tile (16x16: one scale repeated on its rows; 1x16: one row).
      const uint32_t amax = tile_amax<D>(x, C, r0, r1, c0, c1);
      if (is_poisoned(amax)) {  // only with a given global scale: else the matrix is poisoned
        for (int64_t r = r0; r < r1; ++r) {
          a.scales[r * nc + j] = static_cast<uint8_t>(E4M3::kNanCode);
          std::memset(a.out + r * out_stride + c0 / 2, 0, static_cast<size_t>((c1 - c0 + 1) / 2));
        }
        continue;
      }
      const uint32_t code = nvfp4_block_code(bits_f32(amax), sg);
      const float factor = nvfp4_block_factor(inv, code);
      for (int64_t r = r0; r < r1; ++r) {
        a.scales[r * nc + j] = static_cast<uint8_t>(code);
        nvfp4_segment<D>(x + r * C + c0, c1 - c0, factor, a.out + r * out_stride + c0 / 2);
      }
    }
  }
}

// ---- INT4: symmetric groups along the row, scales in a storage dtype -------------------------

static inline float store_scale(float s, DType sd, void* scales, int64_t idx) {
  if (sd == DType::bf16) {
    const uint16_t h = f32_to_bf16(s);
    static_cast<uint16_t*>(scales)[idx] = h;
    return bf16_to_f32(h);
  }
  if (sd == DType::f16) {
    const uint16_t h = f32_to_f16_satfinite(s);
    static_cast<uint16_t*>(scales)[idx] = h;
    return f16_to_f32(h);
  }
  static_cast<float*>(scales)[idx] = s;
  return s;
}

template <DType D>
static void int4_rows_t(const Int4Args& a, int64_t r0, int64_t r1) {
  const auto* xs = static_cast<const typename In<D>::T*>(a.x);
  const int64_t C = a.cols, g = a.group;
  const int64_t out_stride = (C + 1) / 2, scale_stride = (C + g - 1) / g;
  uint8_t codes[128];
  for (int64_t r = r0; r < r1; ++r) {
    const auto* x = xs + r * C;
    uint8_t* out = a.out + r * out_stride;
    for (int64_t j = 0, blk = 0; j < C; j += g, ++blk) {
      const int64_t n = lo(g, C - j);
      const uint32_t amax = In<D>::amax_bits(x + j, n);
      const int64_t idx = r * scale_stride + blk;
      if (is_poisoned(amax)) {
        store_scale(bits_f32(kF32QuietNan), a.scale_dtype, a.scales, idx);
        std::memset(codes, 8, static_cast<size_t>(n));
      } else {
        const float s = store_scale(int4_scale(bits_f32(amax)), a.scale_dtype, a.scales, idx);
        for (int64_t k = 0; k < n; ++k)
          codes[k] = static_cast<uint8_t>(int4_code(In<D>::load(x + j, k), s));
      }
      pack_nibbles(codes, n, 8, out + j / 2);
    }
  }
}

// ---- dtype / element dispatch into the table the scheduler uses ------------------------------

#define MQ_BY_DTYPE(d, call_f32, call_bf16, call_f16) \
  do {                                                \
    if ((d) == DType::f32) {                          \
      call_f32;                                       \
    } else if ((d) == DType::bf16) {                  \
      call_bf16;                                      \
    } else {                                          \
      call_f16;                                       \
    }                                                 \
  } while (0)

template <class F>
static void fp8_flat_f(const Fp8Args& a, int64_t begin, int64_t n, uint32_t amax) {
  MQ_BY_DTYPE(a.dtype, (fp8_flat_t<DType::f32, F>(a, begin, n, amax)),
              (fp8_flat_t<DType::bf16, F>(a, begin, n, amax)),
              (fp8_flat_t<DType::f16, F>(a, begin, n, amax)));
}
static void fp8_flat(const Fp8Args& a, int64_t begin, int64_t n, uint32_t amax) {
  if (a.elem == Elem::e4m3)
    fp8_flat_f<E4M3>(a, begin, n, amax);
  else
    fp8_flat_f<E5M2>(a, begin, n, amax);
}

template <class F>
static void fp8_tiles_f(const Fp8Args& a, int64_t t0, int64_t t1) {
  MQ_BY_DTYPE(a.dtype, (fp8_tiles_t<DType::f32, F>(a, t0, t1)),
              (fp8_tiles_t<DType::bf16, F>(a, t0, t1)), (fp8_tiles_t<DType::f16, F>(a, t0, t1)));
}
static void fp8_tiles(const Fp8Args& a, int64_t t0, int64_t t1) {
  if (a.elem == Elem::e4m3)
    fp8_tiles_f<E4M3>(a, t0, t1);
  else
    fp8_tiles_f<E5M2>(a, t0, t1);
}

template <class F>
static void mx_rows_f(const MxArgs& a, int64_t r0, int64_t r1) {
  MQ_BY_DTYPE(a.dtype, (mx_rows_t<DType::f32, F>(a, r0, r1)), (mx_rows_t<DType::bf16, F>(a, r0, r1)),
              (mx_rows_t<DType::f16, F>(a, r0, r1)));
}
static void mx_rows(const MxArgs& a, int64_t r0, int64_t r1) {
  if (a.elem == Elem::e4m3) mx_rows_f<E4M3>(a, r0, r1);
  if (a.elem == Elem::e5m2) mx_rows_f<E5M2>(a, r0, r1);
  if (a.elem == Elem::e2m1) mx_rows_f<E2M1>(a, r0, r1);
}

static void nvfp4_rows(const Nvfp4Args& a, int64_t t0, int64_t t1, const uint32_t* gamax) {
  MQ_BY_DTYPE(a.dtype, (nvfp4_rows_t<DType::f32>(a, t0, t1, gamax)),
              (nvfp4_rows_t<DType::bf16>(a, t0, t1, gamax)),
              (nvfp4_rows_t<DType::f16>(a, t0, t1, gamax)));
}

static void int4_rows(const Int4Args& a, int64_t r0, int64_t r1) {
  MQ_BY_DTYPE(a.dtype, (int4_rows_t<DType::f32>(a, r0, r1)), (int4_rows_t<DType::bf16>(a, r0, r1)),
              (int4_rows_t<DType::f16>(a, r0, r1)));
}

#undef MQ_BY_DTYPE

// ---- dequantization (contract.md sec. 5): value(code) * scale in fp32, one RNE rounding -------

// The value of every code (decode<F> of each, exact), built once per process.
struct DqValues {
  float e4m3[256], e5m2[256], e2m1[16], int4[16];
};
static inline const DqValues& dq_values() {
  static const DqValues t = [] {
    DqValues v{};
    for (uint32_t c = 0; c < 256; ++c) {
      v.e4m3[c] = decode<E4M3>(c);
      v.e5m2[c] = decode<E5M2>(c);
    }
    for (uint32_t c = 0; c < 16; ++c) {
      v.e2m1[c] = decode<E2M1>(c);
      v.int4[c] = static_cast<float>(static_cast<int32_t>(c) - 8);
    }
    return v;
  }();
  return t;
}

// Scale j of a row whose scales start at index `base` (matrix b), decoded to fp32; NVFP4: times
// the matrix's global scale first.
static inline float dq_scale(const DequantArgs& a, int64_t base, int64_t j, int64_t b) {
  const int64_t i = base + j;
  float s;
  switch (a.scale_kind) {
    case ScaleKind::f32:
      s = static_cast<const float*>(a.scales)[i];
      break;
    case ScaleKind::bf16:
      s = bf16_to_f32(static_cast<const uint16_t*>(a.scales)[i]);
      break;
    case ScaleKind::f16:
      s = f16_to_f32(static_cast<const uint16_t*>(a.scales)[i]);
      break;
    case ScaleKind::e8m0:
      s = e8m0_value(static_cast<const uint8_t*>(a.scales)[i]);
      break;
    default:
      s = dq_values().e4m3[static_cast<const uint8_t*>(a.scales)[i]];
      break;
  }
  return a.global_scale != nullptr ? a.global_scale[b] * s : s;
}

// Writes v as output element i: RNE to the output dtype, every NaN as the canonical quiet NaN.
template <DType O>
static inline void dq_store(void* out, int64_t i, float v) {
  const bool nan = (f32_bits(v) & kF32AbsMask) > kF32InfBits;
  if constexpr (O == DType::f32)
    static_cast<float*>(out)[i] = nan ? bits_f32(kF32QuietNan) : v;
  else if constexpr (O == DType::bf16)
    static_cast<uint16_t*>(out)[i] = nan ? kBf16QuietNan : f32_to_bf16(v);
  else
    static_cast<uint16_t*>(out)[i] = nan ? kF16QuietNan : f32_to_f16_rne(v);
}

// Output row R (of batch * rows): its matrix (*b) and the index of its first scale, that of tile
// row r / tile_rows of matrix b in the [batch, ceil(rows / tile_rows), ceil(cols / tile_cols)]
// scales.
static inline int64_t dq_row_scales(const DequantArgs& a, int64_t R, int64_t* b) {
  const int64_t nr = (a.rows + a.tile_rows - 1) / a.tile_rows, nc = (a.cols + a.tile_cols - 1) / a.tile_cols;
  *b = R / a.rows;
  return (*b * nr + R % a.rows / a.tile_rows) * nc;
}

// Columns [c0, c1) of output row R (of batch * rows): value(code) * scale, one group at a time.
template <DType O, bool kPacked>
static inline void dequant_cols_t(const DequantArgs& a, const float* values, int64_t R, int64_t c0, int64_t c1) {
  const int64_t C = a.cols, tc = a.tile_cols;
  int64_t b;
  const int64_t base = dq_row_scales(a, R, &b);
  const uint8_t* x = a.data + R * (kPacked ? (C + 1) / 2 : C);
  for (int64_t c = c0; c < c1;) {
    const int64_t j = c / tc, end = lo(c1, (j + 1) * tc);
    const float s = dq_scale(a, base, j, b);
    if constexpr (kPacked) {
      // Whole bytes (an even and an odd element) in the middle; a lone nibble at either end.
      auto one = [&](int64_t k) { dq_store<O>(a.out, R * C + k, values[(x[k / 2] >> ((k & 1) * 4)) & 0xFu] * s); };
      if (c < end && (c & 1)) one(c++);
      for (; c + 2 <= end; c += 2) {
        const uint32_t byte = x[c / 2];
        dq_store<O>(a.out, R * C + c, values[byte & 0xFu] * s);
        dq_store<O>(a.out, R * C + c + 1, values[byte >> 4] * s);
      }
      if (c < end) one(c++);
    } else {
      for (; c < end; ++c) dq_store<O>(a.out, R * C + c, values[x[c]] * s);
    }
  }
}

template <DType O>
static inline void dequant_cols_o(const DequantArgs& a, int64_t R, int64_t c0, int64_t c1) {
  const DqValues& v = dq_values();
  switch (a.code) {
    case Code::e4m3:
      return dequant_cols_t<O, false>(a, v.e4m3, R, c0, c1);
    case Code::e5m2:
      return dequant_cols_t<O, false>(a, v.e5m2, R, c0, c1);
    case Code::e2m1:
      return dequant_cols_t<O, true>(a, v.e2m1, R, c0, c1);
    default:
      return dequant_cols_t<O, true>(a, v.int4, R, c0, c1);
  }
}

// Columns [c0, c1) of output row R.
static inline void dequant_cols(const DequantArgs& a, int64_t R, int64_t c0, int64_t c1) {
  if (a.out_dtype == DType::f32) dequant_cols_o<DType::f32>(a, R, c0, c1);
  if (a.out_dtype == DType::bf16) dequant_cols_o<DType::bf16>(a, R, c0, c1);
  if (a.out_dtype == DType::f16) dequant_cols_o<DType::f16>(a, R, c0, c1);
}

static void dequant_rows(const DequantArgs& a, int64_t r0, int64_t r1) {
  for (int64_t R = r0; R < r1; ++R) dequant_cols(a, R, 0, a.cols);
}

static inline Leaf make_leaf(const char* name) {
  Leaf l;
  l.name = name;
  l.amax = amax_range;
  l.encode = encode_range;
  l.fp8_flat = fp8_flat;
  l.fp8_tiles = fp8_tiles;
  l.mx_rows = mx_rows;
  l.nvfp4_rows = nvfp4_rows;
  l.int4_rows = int4_rows;
  l.dequant_rows = dequant_rows;
  return l;
}

}  // namespace MQ_CPU_NS
}  // namespace cpu
}  // namespace miles_quant
