// Arguments of the quantizers (CPU and CUDA): raw pointers to contiguous buffers and sizes.
// Shapes and the layouts of the outputs are documented in packages/miles-quant/docs/contract.md.
#pragma once

#include <cstdint>

#include "miles_quant/bits.h"
#include "miles_quant/elements.h"

namespace miles_quant {

// FP8 with fp32 scales. x is [batch, rows, cols]. per_matrix: one scale per [rows, cols]
// matrix, scales [batch]. Otherwise groups are tiles of tile_rows x tile_cols (the last tile in
// each direction may be partial) and scales are [batch, ceil(rows/tile_rows),
// ceil(cols/tile_cols)]. out holds one E4M3/E5M2 byte per element.
struct Fp8Args {
  const void* x;
  DType dtype;
  int64_t batch, rows, cols, tile_rows, tile_cols;
  bool per_matrix;
  Elem elem;
  uint8_t* out;
  float* scales;
  int threads;
};

// MX: x is [rows, cols], blocks of 32 along cols (the last may be partial); scales (E8M0 codes)
// are [rows, ceil(cols/32)]; out is [rows, cols] bytes for FP8 elements or [rows, ceil(cols/2)]
// packed bytes for E2M1.
struct MxArgs {
  const void* x;
  DType dtype;
  int64_t rows, cols;
  Elem elem;
  ScaleRule rule;
  uint8_t* out;
  uint8_t* scales;
  int threads;
};

// NVFP4: x is [batch, rows, cols]; out [batch * rows, ceil(cols/2)] packed E2M1; scales (E4M3
// codes) [batch * rows, ceil(cols/16)] (a 16x16 tile's scale repeated on its 16 rows);
// global_scale [batch] fp32: written (from each matrix's amax), or read when given_scale (the
// caller's, a normal positive fp32 each; no amax pass, and a 1x16 block or 16x16 tile holding a
// NaN or Inf is poisoned alone: scale code 0x7F, elements +0).
struct Nvfp4Args {
  const void* x;
  DType dtype;
  int64_t batch, rows, cols;
  bool tile16x16;
  uint8_t* out;
  uint8_t* scales;
  float* global_scale;
  int threads;
  bool given_scale = false;
};

// INT4: x is [rows, cols], groups of `group` along cols; out [rows, ceil(cols/2)] packed
// offset-binary codes (q + 8); scales [rows, ceil(cols/group)] in scale_dtype.
struct Int4Args {
  const void* x;
  DType dtype;
  int64_t rows, cols, group;
  DType scale_dtype;
  uint8_t* out;
  void* scales;
  int threads;
};

// Dequantization: codes and scales back to floats, value(code) * scale in fp32, then one RNE
// rounding to out_dtype with every NaN written as the dtype's canonical quiet NaN (fp32
// 0x7FC00000, bf16 0x7FC0, fp16 0x7E00). data is [batch * rows, cols] bytes (FP8 codes) or
// [batch * rows, ceil(cols / 2)] packed nibbles (E2M1, INT4 offset-binary), element 0 in the low
// nibble. Element (b, r, c) takes scale [b, r / tile_rows, c / tile_cols] of a row-major
// [batch, ceil(rows / tile_rows), ceil(cols / tile_cols)] array, times global_scale[b] first
// when global_scale is not null (NVFP4: the product of the scales, then the element).
enum class Code : int { e4m3 = 0, e5m2 = 1, e2m1 = 2, int4 = 3 };
enum class ScaleKind : int { f32 = 0, bf16 = 1, f16 = 2, e8m0 = 3, e4m3 = 4 };

struct DequantArgs {
  const uint8_t* data;
  Code code;
  int64_t batch, rows, cols, tile_rows, tile_cols;
  const void* scales;
  ScaleKind scale_kind;
  const float* global_scale;
  void* out;
  DType out_dtype;
  int threads;
};

}  // namespace miles_quant
