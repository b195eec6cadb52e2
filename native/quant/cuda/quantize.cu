// CUDA kernels of the precision contract. They reuse the integer-bit element code and the
// per-group arithmetic of contract.h (compiled __host__ __device__), so a group's scale and codes
// come from the same operations in the same order as on the CPU. Build flags (CMakeLists.txt):
// -fmad=false (no FMA contraction), -prec-div=true, no --use_fast_math, no -ftz.
//
// Layout: rows whose length is a multiple of 8, with aligned buffers, take the vectorized
// kernels (a thread per 8 elements, a 1-row group on adjacent lanes of a warp, an NVFP4 16x16
// tile per warp, a 128x128 FP8 tile per CTA); other shapes take the scalar kernels (a CTA per FP8
// tile, a thread per MX, INT4 or NVFP4 group or tile). Tensor-level amax (FP8 per tensor, the
// NVFP4 global scale) is an atomicMax over |x| bits, which order like the values with NaN above
// Inf.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "miles_quant/bits.h"
#include "miles_quant/contract.h"
#include "miles_quant/elements.h"
#include "quantize_cuda.h"

// A kernel launch, kernel<<<grid, block, 0, stream>>>(args) written MQ_LAUNCH(grid, block, stream,
// kernel)(args). The CPU emulator (cuda/emu, a test harness: -DMQ_CUDA_EMU with g++) defines it
// to run the same kernel source on CPU fibers.
#ifndef MQ_LAUNCH
#define MQ_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<grid, block, 0, stream>>>
#endif

namespace miles_quant {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__host__ __device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ uint32_t abs_bits(float v) { return f32_bits(v) & kF32AbsMask; }

template <DType D>
__device__ uint32_t block_amax(const void* x, int64_t C, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                               uint32_t* shared) {
  uint32_t m = 0;
  const int64_t w = c1 - c0, n = (r1 - r0) * w;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t r = r0 + i / w, c = c0 + i % w;
    const uint32_t a = abs_bits(load_f32<D>(x, r * C + c));
    m = a > m ? a : m;
  }
  shared[threadIdx.x] = m;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s && shared[threadIdx.x + s] > shared[threadIdx.x]) shared[threadIdx.x] = shared[threadIdx.x + s];
    __syncthreads();
  }
  const uint32_t out = shared[0];
  __syncthreads();
  return out;
}

template <DType D>
__global__ void amax_kernel(const void* x, int64_t per, uint32_t* amax) {
  const int64_t b = blockIdx.y;
  uint32_t m = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < per;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t a = abs_bits(load_f32<D>(x, b * per + i));
    m = a > m ? a : m;
  }
  atomicMax(amax + b, m);
}

// FP8 elements: Ada/Hopper and newer convert fp32 to E4M3/E5M2 in hardware (cvt.rn.satfinite),
// the same function as the contract's encode<F> on every finite and infinite fp32 input:
// tools/bench/quant_cuda_cvt_probe.cu compares all 2^32 patterns (0 differ on an H200, where the
// conversion ran 2.5x the elements/s of the integer-bit encode). They differ only on NaN, which
// these kernels never encode (a group holding a NaN is poisoned and written as the NaN code).
// E2M1 keeps the integer-bit encode (its hardware conversion needs sm_100a).
template <class F>
__device__ __forceinline__ uint32_t encode_fp8(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (F::kEbits + F::kMbits == 7) {
    return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, F::kMbits == 3 ? __NV_E4M3 : __NV_E5M2);
  } else {
    return encode<F>(x);
  }
#else
  return encode<F>(x);
#endif
}

// ---- FP8 ----------------------------------------------------------------------------------

template <DType D, class F>
__global__ void fp8_tiles_kernel(Fp8Args a) {
  __shared__ uint32_t shared[kThreads];
  const int64_t R = a.rows, C = a.cols, tr = a.tile_rows, tc = a.tile_cols;
  const int64_t nr = (R + tr - 1) / tr, nc = (C + tc - 1) / tc;
  const int64_t t = blockIdx.x;  // tile index in [0, B * nr * nc)
  const int64_t b = t / (nr * nc), i = (t / nc) % nr, j = t % nc;
  const int64_t r0 = b * R + i * tr, r1 = b * R + imin(R, (i + 1) * tr);
  const int64_t c0 = j * tc, c1 = imin(C, c0 + tc);
  const uint32_t amax = block_amax<D>(a.x, C, r0, r1, c0, c1, shared);
  const bool poisoned = is_poisoned(amax);
  const float s = poisoned ? bits_f32(kF32QuietNan) : fp8_scale<F>(bits_f32(amax));
  if (threadIdx.x == 0) a.scales[t] = s;
  const int64_t w = c1 - c0, n = (r1 - r0) * w;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    const int64_t idx = (r0 + k / w) * C + c0 + k % w;
    a.out[idx] = static_cast<uint8_t>(poisoned ? F::kNanCode : encode_fp8<F>(load_f32<D>(a.x, idx) / s));
  }
}

template <DType D, class F>
__global__ void fp8_flat_kernel(Fp8Args a, const uint32_t* amax) {
  const int64_t per = a.rows * a.cols, b = blockIdx.y;
  const bool poisoned = is_poisoned(amax[b]);
  const float s = poisoned ? 0.0f : fp8_scale<F>(bits_f32(amax[b]));
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < per;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t idx = b * per + i;
    a.out[idx] = static_cast<uint8_t>(poisoned ? F::kNanCode : encode_fp8<F>(load_f32<D>(a.x, idx) / s));
  }
  if (blockIdx.x == 0 && threadIdx.x == 0)
    a.scales[b] = poisoned ? bits_f32(kF32QuietNan) : s;
}

// ---- MX -------------------------------------------------------------------------------------

template <DType D, class F>
__global__ void mx_kernel(MxArgs a) {
  constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  const int64_t C = a.cols, nb = (C + 31) / 32;
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (g >= a.rows * nb) return;
  const int64_t r = g / nb, j0 = (g % nb) * 32, n = imin(32, C - j0);
  const int64_t base = r * C + j0;
  uint32_t amax = 0;
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t v = abs_bits(load_f32<D>(a.x, base + k));
    amax = v > amax ? v : amax;
  }
  const bool poisoned = is_poisoned(amax);
  const uint32_t sc = poisoned ? kE8M0Nan : e8m0_code<F>(a.rule, amax);
  const float m = poisoned ? 0.0f : e8m0_inverse(sc);
  a.scales[g] = static_cast<uint8_t>(sc);
  if (kPacked) {
    uint8_t* out = a.out + r * ((C + 1) / 2) + j0 / 2;
    for (int64_t k = 0; k < n; k += 2) {
      const uint32_t lo = poisoned ? 0u : encode_fp8<F>(load_f32<D>(a.x, base + k) * m);
      const uint32_t hi = (k + 1 < n && !poisoned) ? encode_fp8<F>(load_f32<D>(a.x, base + k + 1) * m) : 0u;
      out[k / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  } else {
    for (int64_t k = 0; k < n; ++k)
      a.out[base + k] = static_cast<uint8_t>(poisoned ? F::kNanCode : encode_fp8<F>(load_f32<D>(a.x, base + k) * m));
  }
}

// ---- NVFP4 ----------------------------------------------------------------------------------

// The global scale of matrix b: the caller's (a.given_scale; gamax is null then) or from its amax.
__device__ float nvfp4_matrix_scale(const Nvfp4Args& a, const uint32_t* gamax, int64_t b, bool* poisoned) {
  if (a.given_scale) {
    *poisoned = false;
    return a.global_scale[b];
  }
  *poisoned = is_poisoned(gamax[b]);
  return *poisoned ? 0.0f : nvfp4_global_scale(bits_f32(gamax[b]));
}

template <DType D>
__global__ void nvfp4_kernel(Nvfp4Args a, const uint32_t* gamax) {
  const int64_t R = a.rows, C = a.cols, tr = a.tile16x16 ? 16 : 1;
  const int64_t nr = (R + tr - 1) / tr, nc = (C + 15) / 16, out_stride = (C + 1) / 2;
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= a.batch * nr * nc) return;
  const int64_t b = t / (nr * nc), i = (t / nc) % nr, j = t % nc;
  const int64_t r0 = b * R + i * tr, r1 = b * R + imin(R, (i + 1) * tr);
  const int64_t c0 = j * 16, c1 = imin(C, c0 + 16);
  bool poisoned;
  const float sg = nvfp4_matrix_scale(a, gamax, b, &poisoned);
  uint32_t amax = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      const uint32_t v = abs_bits(load_f32<D>(a.x, r * C + c));
      amax = v > amax ? v : amax;
    }
  poisoned = poisoned || is_poisoned(amax);  // a block with NaN / Inf under a given global scale
  const uint32_t code = poisoned ? E4M3::kNanCode : nvfp4_block_code(bits_f32(amax), sg);
  const float factor = poisoned ? 0.0f : nvfp4_block_factor(1.0f / sg, code);
  for (int64_t r = r0; r < r1; ++r) {
    a.scales[r * nc + j] = static_cast<uint8_t>(code);
    uint8_t* out = a.out + r * out_stride + c0 / 2;
    for (int64_t c = c0; c < c1; c += 2) {
      const uint32_t lo = poisoned ? 0u : encode<E2M1>(load_f32<D>(a.x, r * C + c) * factor);
      const uint32_t hi = (c + 1 < c1 && !poisoned) ? encode<E2M1>(load_f32<D>(a.x, r * C + c + 1) * factor) : 0u;
      out[(c - c0) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

// ---- INT4 -----------------------------------------------------------------------------------

// The scale s rounded to its storage dtype sd and widened back (what the codes are computed
// against); written to scales[idx] unless scales is null.
__device__ float store_scale(float s, DType sd, void* scales, int64_t idx) {
  if (sd == DType::bf16 || sd == DType::f16) {
    const uint16_t h = sd == DType::bf16 ? f32_to_bf16(s) : f32_to_f16_satfinite(s);
    if (scales != nullptr) static_cast<uint16_t*>(scales)[idx] = h;
    return sd == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
  }
  if (scales != nullptr) static_cast<float*>(scales)[idx] = s;
  return s;
}

template <DType D>
__global__ void int4_kernel(Int4Args a) {
  const int64_t C = a.cols, gs = a.group, ng = (C + gs - 1) / gs;
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (g >= a.rows * ng) return;
  const int64_t r = g / ng, j0 = (g % ng) * gs, n = imin(gs, C - j0), base = r * C + j0;
  uint32_t amax = 0;
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t v = abs_bits(load_f32<D>(a.x, base + k));
    amax = v > amax ? v : amax;
  }
  const bool poisoned = is_poisoned(amax);
  const float s = store_scale(poisoned ? bits_f32(kF32QuietNan) : int4_scale(bits_f32(amax)), a.scale_dtype,
                              a.scales, g);
  uint8_t* out = a.out + r * ((C + 1) / 2) + j0 / 2;
  for (int64_t k = 0; k < n; k += 2) {
    const uint32_t lo = poisoned ? 8u : int4_code(load_f32<D>(a.x, base + k), s);
    const uint32_t hi = k + 1 >= n ? 8u : (poisoned ? 8u : int4_code(load_f32<D>(a.x, base + k + 1), s));
    out[k / 2] = static_cast<uint8_t>(lo | (hi << 4));
  }
}


// ---- vectorized paths -----------------------------------------------------------------------
// Where a row's length is a multiple of 8 and the buffers are aligned, each thread takes one
// chunk of 8 consecutive elements (one 16-byte load of bf16/fp16, two of fp32) and a 1-row group
// of G elements is G/8 adjacent lanes of a warp, whose amax meets by shuffles. Rows are padded
// to whole groups (lanes past the row's end hold amax 0, as the partial group has no such
// elements, and write nothing). Every lane of a group computes the group's scale with the same
// contract.h function as the scalar kernels above, so the bits are the same.

template <DType D>
__device__ __forceinline__ void load8(const void* x, int64_t i, float (&v)[8]) {
  if (D == DType::f32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + i);
    const float4 a = p[0], b = p[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + i);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // little endian: element 2k is the low half of word k
      const uint16_t lo = static_cast<uint16_t>(w[k] & 0xFFFFu), hi = static_cast<uint16_t>(w[k] >> 16);
      v[2 * k] = D == DType::bf16 ? bf16_to_f32(lo) : f16_to_f32(lo);
      v[2 * k + 1] = D == DType::bf16 ? bf16_to_f32(hi) : f16_to_f32(hi);
    }
  }
}

__device__ __forceinline__ uint32_t amax8(const float (&v)[8]) {
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint32_t a = abs_bits(v[k]);
    m = a > m ? a : m;
  }
  return m;
}

// Max over the L lanes of an aligned segment (L a power of two dividing 32); every lane of the
// warp must call it.
template <int L>
__device__ __forceinline__ uint32_t lanes_max(uint32_t m) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) {
    const uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, m, o);
    m = other > m ? other : m;
  }
  return m;
}

__device__ __forceinline__ void store8(uint8_t* out, const uint32_t (&c)[8]) {
  uint2 w;
  w.x = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
  w.y = c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24);
  *reinterpret_cast<uint2*>(out) = w;
}

__device__ __forceinline__ void store8_nibbles(uint8_t* out, const uint32_t (&c)[8]) {
  const uint32_t w = (c[0] | (c[1] << 4)) | ((c[2] | (c[3] << 4)) << 8) | ((c[4] | (c[5] << 4)) << 16) |
                     ((c[6] | (c[7] << 4)) << 24);
  *reinterpret_cast<uint32_t*>(out) = w;
}

// The chunk a thread owns in rows of C elements (C % 8 == 0), rows padded to groups of G.
template <int G>
struct Chunk {
  int64_t r, c;  // row, chunk within the padded row
  bool valid;    // inside the matrix (else amax 0, no stores)
  __device__ Chunk(int64_t rows, int64_t C) {
    const int64_t cpr = ((C + G - 1) / G) * (G / 8);
    const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    r = t / cpr;
    c = t - r * cpr;
    valid = r < rows && c * 8 < C;
  }
  __device__ bool leader() const { return valid && c % (G / 8) == 0; }
  __device__ int64_t group(int64_t C) const { return r * ((C + G - 1) / G) + c / (G / 8); }
};

// Loads the thread's chunk into v (left as is outside the matrix) and returns its group's amax
// (0 from lanes outside); every lane of the warp must call it.
template <DType D, int G>
__device__ __forceinline__ uint32_t group_amax(const void* x, const Chunk<G>& ch, int64_t C, float (&v)[8]) {
  if (ch.valid) load8<D>(x, ch.r * C + ch.c * 8, v);
  return lanes_max<G / 8>(ch.valid ? amax8(v) : 0u);
}

template <int G>
int64_t chunk_threads(int64_t rows, int64_t C) {
  return rows * ((C + G - 1) / G) * (G / 8);
}

template <DType D, class F>
__global__ void mx_vec_kernel(MxArgs a) {
  constexpr bool kPacked = F::kEbits + F::kMbits == 3;
  const int64_t C = a.cols;
  const Chunk<32> ch(a.rows, C);
  float v[8] = {};
  const uint32_t amax = group_amax<D>(a.x, ch, C, v);
  if (!ch.valid) return;
  const bool poisoned = is_poisoned(amax);
  const uint32_t sc = poisoned ? kE8M0Nan : e8m0_code<F>(a.rule, amax);
  const float m = poisoned ? 0.0f : e8m0_inverse(sc);
  if (ch.leader()) a.scales[ch.group(C)] = static_cast<uint8_t>(sc);
  uint32_t c[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) c[k] = poisoned ? (kPacked ? 0u : F::kNanCode) : encode_fp8<F>(v[k] * m);
  if (kPacked)
    store8_nibbles(a.out + ch.r * (C / 2) + ch.c * 4, c);
  else
    store8(a.out + ch.r * C + ch.c * 8, c);
}

template <DType D, int G>
__global__ void int4_vec_kernel(Int4Args a) {
  const int64_t C = a.cols;
  const Chunk<G> ch(a.rows, C);
  float v[8] = {};
  const uint32_t amax = group_amax<D>(a.x, ch, C, v);
  if (!ch.valid) return;
  const bool poisoned = is_poisoned(amax);
  const float s = store_scale(poisoned ? bits_f32(kF32QuietNan) : int4_scale(bits_f32(amax)), a.scale_dtype,
                              ch.leader() ? a.scales : nullptr, ch.group(C));
  uint32_t c[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) c[k] = poisoned ? 8u : int4_code(v[k], s);
  store8_nibbles(a.out + ch.r * (C / 2) + ch.c * 4, c);
}

template <DType D>
__global__ void nvfp4_vec_kernel(Nvfp4Args a, const uint32_t* gamax) {
  const int64_t C = a.cols;
  const Chunk<16> ch(a.batch * a.rows, C);
  float v[8] = {};
  const uint32_t amax = group_amax<D>(a.x, ch, C, v);
  if (!ch.valid) return;
  bool poisoned;
  const float sg = nvfp4_matrix_scale(a, gamax, ch.r / a.rows, &poisoned);
  poisoned = poisoned || is_poisoned(amax);  // a block with NaN / Inf under a given global scale
  const uint32_t code = poisoned ? E4M3::kNanCode : nvfp4_block_code(bits_f32(amax), sg);
  const float factor = poisoned ? 0.0f : nvfp4_block_factor(1.0f / sg, code);
  if (ch.leader()) a.scales[ch.group(C)] = static_cast<uint8_t>(code);
  uint32_t c[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) c[k] = poisoned ? 0u : encode<E2M1>(v[k] * factor);
  store8_nibbles(a.out + ch.r * (C / 2) + ch.c * 4, c);
}

// NVFP4 16x16 tiles (C % 8 == 0): a warp per tile, lane 2k + h holding row k of the tile and
// its columns 8h .. 8h + 7, so the tile's amax meets over the whole warp. Lanes past the matrix's
// last row or column (a partial tile) hold amax 0 and store nothing; each row's h = 0 lane writes
// the tile's block code on that row, as the scalar kernel does.
template <DType D>
__global__ void nvfp4_tile_vec_kernel(Nvfp4Args a, const uint32_t* gamax) {
  const int64_t R = a.rows, C = a.cols, nr = (R + 15) / 16, nc = (C + 15) / 16;
  const int64_t t = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t b = t / (nr * nc), j = t % nc, rr = ((t / nc) % nr) * 16 + lane / 2;
  const int64_t r = b * R + rr, c = j * 16 + (lane % 2) * 8;
  const bool valid = t < a.batch * nr * nc && rr < R && c < C;
  float v[8] = {};
  if (valid) load8<D>(a.x, r * C + c, v);
  const uint32_t amax = lanes_max<32>(valid ? amax8(v) : 0u);
  if (!valid) return;
  bool poisoned;
  const float sg = nvfp4_matrix_scale(a, gamax, b, &poisoned);
  poisoned = poisoned || is_poisoned(amax);  // a tile with NaN / Inf under a given global scale
  const uint32_t code = poisoned ? E4M3::kNanCode : nvfp4_block_code(bits_f32(amax), sg);
  const float factor = poisoned ? 0.0f : nvfp4_block_factor(1.0f / sg, code);
  if (lane % 2 == 0) a.scales[r * nc + j] = static_cast<uint8_t>(code);
  uint32_t codes[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) codes[k] = poisoned ? 0u : encode<E2M1>(v[k] * factor);
  store8_nibbles(a.out + r * (C / 2) + c / 2, codes);
}

// FP8 1x128 (tile_rows 1, tile_cols 128): scales [batch * rows, ceil(cols / 128)].
template <DType D, class F>
__global__ void fp8_1x128_vec_kernel(Fp8Args a) {
  const int64_t C = a.cols;
  const Chunk<128> ch(a.batch * a.rows, C);
  float v[8] = {};
  const uint32_t amax = group_amax<D>(a.x, ch, C, v);
  if (!ch.valid) return;
  const bool poisoned = is_poisoned(amax);
  const float s = poisoned ? bits_f32(kF32QuietNan) : fp8_scale<F>(bits_f32(amax));
  if (ch.leader()) a.scales[ch.group(C)] = s;
  uint32_t c[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) c[k] = poisoned ? F::kNanCode : encode_fp8<F>(v[k] / s);
  store8(a.out + ch.r * C + ch.c * 8, c);
}

// FP8 128x128 tiles, C % 8 == 0: one CTA of 256 threads per tile, 16 chunks x 16 rows a pass.
template <DType D, class F>
__global__ void fp8_block_vec_kernel(Fp8Args a) {
  __shared__ uint32_t warp_max[kThreads / 32];
  const int64_t R = a.rows, C = a.cols;
  const int64_t nr = (R + 127) / 128, nc = (C + 127) / 128;
  const int64_t t = blockIdx.x;
  const int64_t b = t / (nr * nc), i = (t / nc) % nr, j = t % nc;
  const int64_t r0 = b * R + i * 128, r1 = b * R + imin(R, (i + 1) * 128);
  const int64_t col = j * 128 + (threadIdx.x % 16) * 8;
  const bool col_ok = col < C;
  uint32_t m = 0;
  float v[8];
  for (int64_t r = r0 + threadIdx.x / 16; r < r1; r += kThreads / 16) {
    if (!col_ok) break;
    load8<D>(a.x, r * C + col, v);
    const uint32_t x = amax8(v);
    m = x > m ? x : m;
  }
  m = lanes_max<32>(m);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  uint32_t amax = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) amax = warp_max[w] > amax ? warp_max[w] : amax;
  const bool poisoned = is_poisoned(amax);
  const float s = poisoned ? bits_f32(kF32QuietNan) : fp8_scale<F>(bits_f32(amax));
  if (threadIdx.x == 0) a.scales[t] = s;
  if (!col_ok) return;
  for (int64_t r = r0 + threadIdx.x / 16; r < r1; r += kThreads / 16) {
    load8<D>(a.x, r * C + col, v);
    uint32_t c[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) c[k] = poisoned ? F::kNanCode : encode_fp8<F>(v[k] / s);
    store8(a.out + r * C + col, c);
  }
}

// Per-matrix amax of matrices of `per` elements (per % 8 == 0): one atomicMax per warp.
template <DType D>
__global__ void amax_vec_kernel(const void* x, int64_t per, uint32_t* amax) {
  const int64_t b = blockIdx.y, chunks = per / 8;
  uint32_t m = 0;
  float v[8];
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    load8<D>(x, b * per + i * 8, v);
    const uint32_t a = amax8(v);
    m = a > m ? a : m;
  }
  m = lanes_max<32>(m);
  if (threadIdx.x % 32 == 0) atomicMax(amax + b, m);
}

template <DType D, class F>
__global__ void fp8_flat_vec_kernel(Fp8Args a, const uint32_t* amax) {
  const int64_t per = a.rows * a.cols, b = blockIdx.y, chunks = per / 8;
  const bool poisoned = is_poisoned(amax[b]);
  const float s = poisoned ? 0.0f : fp8_scale<F>(bits_f32(amax[b]));
  float v[8];
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t idx = b * per + i * 8;
    load8<D>(a.x, idx, v);
    uint32_t c[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) c[k] = poisoned ? F::kNanCode : encode_fp8<F>(v[k] / s);
    store8(a.out + idx, c);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) a.scales[b] = poisoned ? bits_f32(kF32QuietNan) : s;
}

// ---- launchers --------------------------------------------------------------------------------

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

unsigned grid_for(int64_t n) { return static_cast<unsigned>(cdiv(n > 0 ? n : 1, kThreads)); }

bool aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

// The vectorized kernels need rows of whole chunks of 8 and 16-byte aligned input (8-byte
// aligned FP8 output, 4-byte aligned packed output); anything else takes the scalar kernels.
bool vec_ok(const void* x, int64_t cols, const uint8_t* out, bool packed) {
  return cols > 0 && cols % 8 == 0 && aligned(x, 16) && aligned(out, packed ? 4 : 8);
}

template <template <DType> class K, class Args>
int by_dtype(const Args& a, cudaStream_t s) {
  if (a.dtype == DType::f32) return K<DType::f32>::run(a, s);
  if (a.dtype == DType::bf16) return K<DType::bf16>::run(a, s);
  return K<DType::f16>::run(a, s);
}

// The per-matrix kernels take matrix b of a stack as blockIdx.y, which CUDA limits to 65535:
// larger stacks (experts) go in slices of at most that many matrices, one launch each.
constexpr int64_t kMaxGridY = 65535;

template <DType D>
const void* matrices_from(const void* x, int64_t b0, int64_t per) {
  return static_cast<const char*>(x) + b0 * per * (D == DType::f32 ? 4 : 2);
}

// Per-matrix amax into a temporary device buffer (freed stream-ordered by the caller).
template <DType D>
uint32_t* matrix_amax(const void* x, int64_t B, int64_t per, cudaStream_t s) {
  uint32_t* amax = nullptr;
  if (cudaMallocAsync(&amax, sizeof(uint32_t) * (B > 0 ? B : 1), s) != cudaSuccess) return nullptr;
  cudaMemsetAsync(amax, 0, sizeof(uint32_t) * (B > 0 ? B : 1), s);
  if (per <= 0) return amax;
  const bool vec = per % 8 == 0 && aligned(x, 16);  // then every slice is aligned too
  const unsigned gx = static_cast<unsigned>(imin(cdiv(vec ? per / 8 : per, kThreads), 1024));
  for (int64_t b0 = 0; b0 < B; b0 += kMaxGridY) {
    const dim3 grid(gx, static_cast<unsigned>(imin(kMaxGridY, B - b0)));
    const void* xs = matrices_from<D>(x, b0, per);
    if (vec)
      MQ_LAUNCH(grid, kThreads, s, amax_vec_kernel<D>)(xs, per, amax + b0);
    else
      MQ_LAUNCH(grid, kThreads, s, amax_kernel<D>)(xs, per, amax + b0);
  }
  return amax;
}

template <DType D>
struct Fp8Launch {
  static int run(const Fp8Args& a, cudaStream_t s) {
    const bool e4m3 = a.elem == Elem::e4m3;
    if (a.per_matrix) {
      const int64_t per = a.rows * a.cols;
      uint32_t* amax = matrix_amax<D>(a.x, a.batch, per, s);
      if (amax == nullptr) return static_cast<int>(cudaGetLastError());
      const bool vec = per % 8 == 0 && per > 0 && aligned(a.x, 16) && aligned(a.out, 8);
      const unsigned gx = static_cast<unsigned>(imin(cdiv(vec ? per / 8 : (per > 0 ? per : 1), kThreads), 4096));
      for (int64_t b0 = 0; b0 < a.batch; b0 += kMaxGridY) {  // slices of the stack (kMaxGridY)
        Fp8Args sl = a;
        sl.batch = imin(kMaxGridY, a.batch - b0);
        sl.x = matrices_from<D>(a.x, b0, per);
        sl.out = a.out + b0 * per;
        sl.scales = a.scales + b0;
        const dim3 grid(gx, static_cast<unsigned>(sl.batch));
        if (vec && e4m3)
          MQ_LAUNCH(grid, kThreads, s, fp8_flat_vec_kernel<D, E4M3>)(sl, amax + b0);
        else if (vec)
          MQ_LAUNCH(grid, kThreads, s, fp8_flat_vec_kernel<D, E5M2>)(sl, amax + b0);
        else if (e4m3)
          MQ_LAUNCH(grid, kThreads, s, fp8_flat_kernel<D, E4M3>)(sl, amax + b0);
        else
          MQ_LAUNCH(grid, kThreads, s, fp8_flat_kernel<D, E5M2>)(sl, amax + b0);
      }
      cudaFreeAsync(amax, s);
      return static_cast<int>(cudaGetLastError());
    }
    const int64_t tiles = a.batch * cdiv(a.rows, a.tile_rows) * cdiv(a.cols, a.tile_cols);
    const bool vec = tiles > 0 && vec_ok(a.x, a.cols, a.out, false);
    if (vec && a.tile_rows == 1 && a.tile_cols == 128) {
      const unsigned grid = grid_for(chunk_threads<128>(a.batch * a.rows, a.cols));
      if (e4m3)
        MQ_LAUNCH(grid, kThreads, s, fp8_1x128_vec_kernel<D, E4M3>)(a);
      else
        MQ_LAUNCH(grid, kThreads, s, fp8_1x128_vec_kernel<D, E5M2>)(a);
    } else if (vec && a.tile_rows == 128 && a.tile_cols == 128) {
      if (e4m3)
        MQ_LAUNCH(static_cast<unsigned>(tiles), kThreads, s, fp8_block_vec_kernel<D, E4M3>)(a);
      else
        MQ_LAUNCH(static_cast<unsigned>(tiles), kThreads, s, fp8_block_vec_kernel<D, E5M2>)(a);
    } else if (tiles > 0) {
      if (e4m3)
        MQ_LAUNCH(static_cast<unsigned>(tiles), kThreads, s, fp8_tiles_kernel<D, E4M3>)(a);
      else
        MQ_LAUNCH(static_cast<unsigned>(tiles), kThreads, s, fp8_tiles_kernel<D, E5M2>)(a);
    }
    return static_cast<int>(cudaGetLastError());
  }
};

template <DType D>
struct MxLaunch {
  static int run(const MxArgs& a, cudaStream_t s) {
    const int64_t groups = a.rows * cdiv(a.cols, 32);
    if (groups > 0 && vec_ok(a.x, a.cols, a.out, a.elem == Elem::e2m1)) {
      const unsigned grid = grid_for(chunk_threads<32>(a.rows, a.cols));
      if (a.elem == Elem::e4m3) MQ_LAUNCH(grid, kThreads, s, mx_vec_kernel<D, E4M3>)(a);
      if (a.elem == Elem::e5m2) MQ_LAUNCH(grid, kThreads, s, mx_vec_kernel<D, E5M2>)(a);
      if (a.elem == Elem::e2m1) MQ_LAUNCH(grid, kThreads, s, mx_vec_kernel<D, E2M1>)(a);
    } else if (groups > 0) {
      if (a.elem == Elem::e4m3) MQ_LAUNCH(grid_for(groups), kThreads, s, mx_kernel<D, E4M3>)(a);
      if (a.elem == Elem::e5m2) MQ_LAUNCH(grid_for(groups), kThreads, s, mx_kernel<D, E5M2>)(a);
      if (a.elem == Elem::e2m1) MQ_LAUNCH(grid_for(groups), kThreads, s, mx_kernel<D, E2M1>)(a);
    }
    return static_cast<int>(cudaGetLastError());
  }
};

__global__ void nvfp4_global_only(Nvfp4Args a, const uint32_t* gamax) {
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (b < a.batch)
    a.global_scale[b] = is_poisoned(gamax[b]) ? bits_f32(kF32QuietNan) : nvfp4_global_scale(bits_f32(gamax[b]));
}

template <DType D>
struct Nvfp4Launch {
  static int run(const Nvfp4Args& a, cudaStream_t s) {
    // A given global scale needs no amax pass; else the global scales first (also for matrices
    // with no elements), then the blocks.
    uint32_t* gamax = a.given_scale ? nullptr : matrix_amax<D>(a.x, a.batch, a.rows * a.cols, s);
    if (gamax == nullptr && !a.given_scale) return static_cast<int>(cudaGetLastError());
    if (a.batch > 0 && !a.given_scale) MQ_LAUNCH(grid_for(a.batch), kThreads, s, nvfp4_global_only)(a, gamax);
    const int64_t tiles = a.batch * cdiv(a.rows, a.tile16x16 ? 16 : 1) * cdiv(a.cols, 16);
    const bool vec = tiles > 0 && vec_ok(a.x, a.cols, a.out, true);
    if (vec && !a.tile16x16)
      MQ_LAUNCH(grid_for(chunk_threads<16>(a.batch * a.rows, a.cols)), kThreads, s, nvfp4_vec_kernel<D>)(a, gamax);
    else if (vec)
      MQ_LAUNCH(grid_for(tiles * 32), kThreads, s, nvfp4_tile_vec_kernel<D>)(a, gamax);
    else if (tiles > 0)
      MQ_LAUNCH(grid_for(tiles), kThreads, s, nvfp4_kernel<D>)(a, gamax);
    if (gamax != nullptr) cudaFreeAsync(gamax, s);
    return static_cast<int>(cudaGetLastError());
  }
};

template <DType D>
struct Int4Launch {
  static int run(const Int4Args& a, cudaStream_t s) {
    const int64_t groups = a.rows * cdiv(a.cols, a.group);
    const bool vec = groups > 0 && vec_ok(a.x, a.cols, a.out, true);
    if (vec && a.group == 32)
      MQ_LAUNCH(grid_for(chunk_threads<32>(a.rows, a.cols)), kThreads, s, int4_vec_kernel<D, 32>)(a);
    else if (vec && a.group == 128)
      MQ_LAUNCH(grid_for(chunk_threads<128>(a.rows, a.cols)), kThreads, s, int4_vec_kernel<D, 128>)(a);
    else if (groups > 0)
      MQ_LAUNCH(grid_for(groups), kThreads, s, int4_kernel<D>)(a);
    return static_cast<int>(cudaGetLastError());
  }
};

}  // namespace

int quantize_fp8(const Fp8Args& a, void* stream) {
  return by_dtype<Fp8Launch>(a, static_cast<cudaStream_t>(stream));
}
int quantize_mx(const MxArgs& a, void* stream) { return by_dtype<MxLaunch>(a, static_cast<cudaStream_t>(stream)); }
int quantize_nvfp4(const Nvfp4Args& a, void* stream) {
  return by_dtype<Nvfp4Launch>(a, static_cast<cudaStream_t>(stream));
}
int quantize_int4(const Int4Args& a, void* stream) {
  return by_dtype<Int4Launch>(a, static_cast<cudaStream_t>(stream));
}

}  // namespace cuda
}  // namespace miles_quant
