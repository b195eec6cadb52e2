// Probe for the CUDA quantizers (native/quant/cuda): is the contract's integer-bit FP8 encode
// (elements.h, encode<F>) the same function as Hopper's hardware conversion
// cvt.rn.satfinite.{e4m3,e5m2}x2.f32, and what does each step of a quantizer cost in arithmetic?
//
// 1. Every one of the 2^32 fp32 bit patterns through both: mismatches counted per class (finite,
//    Inf, NaN), the first few printed. The kernels need equality only on finite inputs (a group
//    holding Inf or NaN is poisoned and written without encoding).
// 2. Elements per second of encode<E4M3>(x / s), encode<E4M3>(x * m), the hardware conversion of
//    x / s, and x / s alone, on values made in registers (no memory traffic): the arithmetic
//    ceiling of a kernel, to compare with its measured rate (elements/s = GB/s / bytes per el).
//
// Build and run on a GPU machine (sm_89 or newer):
//   nvcc -std=c++17 -O2 -fmad=false -prec-div=true -prec-sqrt=true -ftz=false \
//        -Inative/quant/include -arch=native tools/bench/quant_cuda_cvt_probe.cu -o /tmp/cvt
//   /tmp/cvt
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "miles_quant/bits.h"
#include "miles_quant/elements.h"

using namespace miles_quant;

template <class F>
__device__ __forceinline__ uint32_t hw(float x) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, F::kMbits == 3 ? __NV_E4M3 : __NV_E5M2);
}

template <class F>
__global__ void compare(uint32_t hi, unsigned long long* counts, uint32_t* first) {
  const uint32_t u = (hi << 24) | (blockIdx.x * blockDim.x + threadIdx.x);
  const float x = bits_f32(u);
  const uint32_t a = encode<F>(x), b = hw<F>(x);
  if (a == b) return;
  const uint32_t mag = u & 0x7FFFFFFFu;
  const int cls = mag < 0x7F800000u ? 0 : (mag == 0x7F800000u ? 1 : 2);
  const unsigned long long n = atomicAdd(counts + cls, 1ull);
  if (cls == 0 && n < 4) {
    first[3 * n] = u;
    first[3 * n + 1] = a;
    first[3 * n + 2] = b;
  }
}

enum class Op { div_encode, mul_encode, div_hw, div_only };

template <Op O>
__global__ void rate(int64_t n, float s, uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const float x = static_cast<float>(static_cast<int32_t>(i & 0xFFFFF) - 0x80000) * 0.000244140625f;
    if (O == Op::div_encode) acc ^= encode<E4M3>(x / s);
    if (O == Op::mul_encode) acc ^= encode<E4M3>(x * s);
    if (O == Op::div_hw) acc ^= hw<E4M3>(x / s);
    if (O == Op::div_only) acc ^= f32_bits(x / s);
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

template <class F>
static void exhaustive(const char* name) {
  unsigned long long* counts;
  uint32_t* first;
  cudaMalloc(&counts, 3 * sizeof(unsigned long long));
  cudaMalloc(&first, 12 * sizeof(uint32_t));
  cudaMemset(counts, 0, 3 * sizeof(unsigned long long));
  for (uint32_t hi = 0; hi < 256; ++hi) compare<F><<<(1u << 24) / 256, 256>>>(hi, counts, first);
  unsigned long long c[3];
  uint32_t f[12];
  cudaMemcpy(c, counts, sizeof(c), cudaMemcpyDeviceToHost);
  cudaMemcpy(f, first, sizeof(f), cudaMemcpyDeviceToHost);
  std::printf("%s: encode vs cvt.rn.satfinite over 2^32 fp32: mismatching finite %llu, Inf %llu, NaN %llu\n",
              name, c[0], c[1], c[2]);
  for (unsigned long long k = 0; k < (c[0] < 4 ? c[0] : 4); ++k)
    std::printf("  x bits 0x%08x: encode 0x%02x, cvt 0x%02x\n", f[3 * k], f[3 * k + 1], f[3 * k + 2]);
  cudaFree(counts);
  cudaFree(first);
}

template <Op O>
static void time_op(const char* name) {
  const int64_t n = int64_t{1} << 32;
  const int blocks = 132 * 16, threads = 256;
  uint32_t* sink;
  cudaMalloc(&sink, sizeof(uint32_t) * blocks * threads);
  rate<O><<<blocks, threads>>>(n / 16, 0.37f, sink);  // warm-up
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  rate<O><<<blocks, threads>>>(n, 0.37f, sink);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  std::printf("%-28s %7.0f G elements/s\n", name, n / (ms * 1e-3) / 1e9);
  cudaFree(sink);
}

int main() {
  cudaDeviceProp p;
  cudaGetDeviceProperties(&p, 0);
  std::printf("device: %s, %d SMs\n", p.name, p.multiProcessorCount);
  exhaustive<E4M3>("e4m3");
  exhaustive<E5M2>("e5m2");
  time_op<Op::div_encode>("encode<E4M3>(x / s)");
  time_op<Op::mul_encode>("encode<E4M3>(x * m)");
  time_op<Op::div_hw>("cvt.rn.satfinite(x / s)");
  time_op<Op::div_only>("x / s only");
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("cuda: %s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
