// The CPU scheduler: splits each quantizer into tasks over rows or tiles, runs them on threads,
// and picks the leaf kernels of the best instruction set the CPU has.
#include "miles_quant/cpu.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "miles_quant/bits.h"
#include "miles_quant/contract.h"
#include "miles_quant/elements.h"

#if defined(__x86_64__) || defined(__i386__)
#define MQ_X86 1
#include <cpuid.h>
#include <xmmintrin.h>
#endif

namespace miles_quant {
namespace cpu {

const Leaf& leaf_generic();
#if MQ_X86
const Leaf& leaf_avx2();
const Leaf& leaf_avx512();
const Leaf& leaf_avx512vbmi();
#endif

namespace {

const Leaf& leaf() {
  static const Leaf* chosen = [] {
    const char* force = std::getenv("MILES_QUANT_ISA");
    const std::string want = force ? force : "";
#if MQ_X86
    __builtin_cpu_init();
    // The AVX2 leaf also converts fp16 with F16C (CPUID.1:ECX bit 29), which every AVX2 CPU has.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
    const bool avx2 = __builtin_cpu_supports("avx2") && f16c;
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512dq");
    const bool vbmi = avx512 && __builtin_cpu_supports("avx512vbmi");
    if (want == "generic") return &leaf_generic();
    if (want == "avx2" && avx2) return &leaf_avx2();
    if (want == "avx512" && avx512) return &leaf_avx512();
    if (vbmi) return &leaf_avx512vbmi();
    if (avx512) return &leaf_avx512();
    if (avx2) return &leaf_avx2();
#endif
    return &leaf_generic();
  }();
  return *chosen;
}

// Round-to-nearest, no flush-to-zero, no denormals-are-zero for the current thread while alive
// (torch.set_flush_denormal or another library may have changed the caller's MXCSR).
class FpEnvGuard {
 public:
  FpEnvGuard() {
#if MQ_X86
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(0x8000u | 0x0040u | 0x6000u));  // FTZ, DAZ, rounding control
#endif
  }
  ~FpEnvGuard() {
#if MQ_X86
    _mm_setcsr(saved_);
#endif
  }
  FpEnvGuard(const FpEnvGuard&) = delete;
  FpEnvGuard& operator=(const FpEnvGuard&) = delete;

 private:
  unsigned saved_ = 0;
};

int resolve_threads(int threads) {
  if (threads > 0) return threads;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// Runs f(begin, end) over [0, n) on up to `threads` threads (the caller's thread included),
// each with at least `grain` items. Exception-safe: a thread that cannot be started (EAGAIN
// under a pids limit) leaves its range to the caller's thread, an exception from f is rethrown
// after every thread has been joined (a joinable std::thread destroyed by unwinding would call
// std::terminate and abort the whole process).
template <class Fn>
void parallel_for(int64_t n, int threads, int64_t grain, const Fn& f) {
  if (n <= 0) return;
  const int64_t max_tasks = std::max<int64_t>(1, n / std::max<int64_t>(1, grain));
  const int t = static_cast<int>(std::min<int64_t>(resolve_threads(threads), max_tasks));
  const int64_t chunk = (n + t - 1) / t;
  std::mutex error_mu;
  std::exception_ptr error;
  auto run = [&](int64_t b, int64_t e) noexcept {
    try {
      FpEnvGuard guard;
      f(b, e);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(t > 1 ? t - 1 : 0));
  int64_t inline_from = n;  // ranges from here on run on the caller's thread
  for (int i = 1; i < t; ++i) {
    const int64_t b = i * chunk, e = std::min(n, b + chunk);
    if (b >= e) break;
    try {
      pool.emplace_back(run, b, e);
    } catch (...) {
      inline_from = b;
      break;
    }
  }
  run(0, std::min(n, chunk));
  for (int64_t b = inline_from; b < n; b += chunk) run(b, std::min(n, b + chunk));
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

// Items per task so that a task touches at least ~64k elements.
int64_t grain_for(int64_t elems_per_item) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, elems_per_item));
}

constexpr int64_t kChunk = int64_t{1} << 16;

// Rows of groups one row tall (1xG: MX, NVFP4 1x16, INT4) are independent runs of whole groups
// when cols % G == 0, and the outputs ([rows, cols] or [rows, cols / 2] elements, [rows, cols /
// G] scales) are row-major without padding, so g consecutive rows are one row of g * cols with
// the same bytes in the same places. Narrow rows are merged that way (g the largest divisor of
// the rows per matrix with g * cols <= kMergedCols): the kernels' batched loops take whole 256-
// or 512-element batches of a row and leave a row's tail (and rows shorter than a batch) to
// slower code, so rows of 128-768 elements ran 1.4-4x slower per element than rows of 7168
// (docs/benchmarks.md, "Narrow rows"). FP8 1xN is left as it is: its kernel walks chunks of 4
// tiles whatever the row length, and merged rows measured no faster (0-8% slower).
constexpr int64_t kMergedCols = 8192;

int64_t merged_rows(int64_t rows, int64_t cols, int64_t group) {
  if (rows <= 1 || cols <= 0 || cols % group != 0 || cols * 2 > kMergedCols) return 1;
  for (int64_t g = std::min(rows, kMergedCols / cols); g > 1; --g)
    if (rows % g == 0) return g;
  return 1;
}

// Args `a` (MxArgs, Nvfp4Args, Int4Args: rows per matrix and cols) with narrow rows merged.
template <class Args>
Args with_merged_rows(const Args& in, int64_t group) {
  Args a = in;
  const int64_t g = merged_rows(a.rows, a.cols, group);
  a.rows /= g;
  a.cols *= g;
  return a;
}

// Per-matrix amax over B contiguous blocks of `per` elements.
std::vector<uint32_t> batch_amax(DType d, const void* x, int64_t B, int64_t per, int threads) {
  const Leaf& L = leaf();
  const int64_t chunks = std::max<int64_t>(1, (per + kChunk - 1) / kChunk);
  std::vector<uint32_t> partial(static_cast<size_t>(B * chunks), 0);
  parallel_for(B * chunks, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / chunks, s = (t % chunks) * kChunk, n = std::min(kChunk, per - s);
      if (n > 0) partial[static_cast<size_t>(t)] = L.amax(d, x, b * per + s, n);
    }
  });
  std::vector<uint32_t> out(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < chunks; ++c)
      out[static_cast<size_t>(b)] = std::max(out[static_cast<size_t>(b)], partial[static_cast<size_t>(b * chunks + c)]);
  return out;
}

}  // namespace

const char* isa() { return leaf().name; }

void encode_elements(const float* x, int64_t n, Elem e, uint8_t* out, int threads) {
  const Leaf& L = leaf();
  parallel_for(n, threads, kChunk, [&](int64_t b, int64_t end) { L.encode(x + b, end - b, e, out + b); });
}

void quantize_fp8(const Fp8Args& a) {
  const Leaf& L = leaf();
  const int64_t B = a.batch, R = a.rows, C = a.cols;
  const int64_t nr = (R + a.tile_rows - 1) / a.tile_rows;
  if (a.per_matrix) {
    // One scale per [R, C] matrix: an amax pass over everything, then a cast pass in chunks.
    const int64_t per = R * C;
    const std::vector<uint32_t> amax = batch_amax(a.dtype, a.x, B, per, a.threads);
    for (int64_t b = 0; b < B; ++b) {
      const uint32_t m = amax[static_cast<size_t>(b)];
      a.scales[b] = is_poisoned(m) ? bits_f32(kF32QuietNan)
                                   : (a.elem == Elem::e4m3 ? fp8_scale<E4M3>(bits_f32(m))
                                                           : fp8_scale<E5M2>(bits_f32(m)));
    }
    const int64_t chunks = std::max<int64_t>(1, (per + kChunk - 1) / kChunk);
    parallel_for(B * chunks, a.threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / chunks, s = (t % chunks) * kChunk, n = std::min(kChunk, per - s);
        if (n > 0) L.fp8_flat(a, b * per + s, n, amax[static_cast<size_t>(b)]);
      }
    });
    return;
  }
  parallel_for(B * nr, a.threads, grain_for(a.tile_rows * C),
               [&](int64_t t0, int64_t t1) { L.fp8_tiles(a, t0, t1); });
}

void quantize_mx(const MxArgs& in) {
  const Leaf& L = leaf();
  const MxArgs a = with_merged_rows(in, 32);
  parallel_for(a.rows, a.threads, grain_for(a.cols),
               [&](int64_t r0, int64_t r1) { L.mx_rows(a, r0, r1); });
}

void quantize_nvfp4(const Nvfp4Args& in) {
  const Leaf& L = leaf();
  // 1x16 only (16x16 tiles span 16 rows); within each matrix: its rows share its global scale.
  Nvfp4Args a = in.tile16x16 ? in : with_merged_rows(in, 16);
  const int64_t B = a.batch, R = a.rows, C = a.cols, tr = a.tile16x16 ? 16 : 1;
  // A given global scale needs no amax pass: no matrix is poisoned as a whole (gamax 0), and
  // the kernels poison each block holding a NaN or Inf on its own.
  const std::vector<uint32_t> gamax =
      a.given_scale ? std::vector<uint32_t>(static_cast<size_t>(B), 0u) : batch_amax(a.dtype, a.x, B, R * C, a.threads);
  for (int64_t b = 0; b < B && !a.given_scale; ++b) {
    const uint32_t m = gamax[static_cast<size_t>(b)];
    a.global_scale[b] = is_poisoned(m) ? bits_f32(kF32QuietNan) : nvfp4_global_scale(bits_f32(m));
  }
  const int64_t nr = (R + tr - 1) / tr;
  parallel_for(B * nr, a.threads, grain_for(tr * C),
               [&](int64_t t0, int64_t t1) { L.nvfp4_rows(a, t0, t1, gamax.data()); });
}

void quantize_int4(const Int4Args& in) {
  const Leaf& L = leaf();
  const Int4Args a = with_merged_rows(in, in.group);
  parallel_for(a.rows, a.threads, grain_for(a.cols),
               [&](int64_t r0, int64_t r1) { L.int4_rows(a, r0, r1); });
}

void dequantize(const DequantArgs& a) {
  const Leaf& L = leaf();
  parallel_for(a.batch * a.rows, a.threads, grain_for(a.cols),
               [&](int64_t r0, int64_t r1) { L.dequant_rows(a, r0, r1); });
}

}  // namespace cpu
}  // namespace miles_quant
