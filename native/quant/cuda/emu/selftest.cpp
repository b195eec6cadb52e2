// Checks of the CPU emulator itself (mq_cuda_emu.h), run by tests/test_cuda_emu.py: the CUDA
// semantics quantize.cu relies on, computed the emulated way and the plain way, and the
// undefined behaviour the emulator must refuse. Prints one "name ok|FAIL detail" line each and
// exits 1 if any failed.
#include <cstdio>
#include <string>
#include <vector>

#include "mq_cuda_emu.h"

namespace {

int failures = 0;

void report(const char* name, bool ok, const std::string& detail = "") {
  std::printf("%s %s %s\n", name, ok ? "ok" : "FAIL", detail.c_str());
  failures += ok ? 0 : 1;
}

// Max over aligned segments of L lanes by xor shuffles, as quantize.cu's lanes_max.
template <int L>
__global__ void segment_max(const unsigned* in, unsigned* out) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  unsigned m = in[t];
  for (int o = L / 2; o > 0; o >>= 1) {
    const unsigned other = __shfl_xor_sync(0xFFFFFFFFu, m, o);
    m = other > m ? other : m;
  }
  out[t] = m;
}

// A block-wide sum through shared memory and __syncthreads, as quantize.cu's block_amax; also
// blockIdx / gridDim in a 2-D grid.
__global__ void block_sum(const unsigned* in, unsigned* out) {
  __shared__ unsigned s[256];
  const int64_t b = blockIdx.y * static_cast<int64_t>(gridDim.x) + blockIdx.x;
  s[threadIdx.x] = in[b * blockDim.x + threadIdx.x];
  __syncthreads();
  for (unsigned k = blockDim.x / 2; k > 0; k >>= 1) {
    if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[b] = s[0];
  __syncthreads();
}

// Undefined behaviour on a GPU: lanes that returned are waited for at a shuffle.
__global__ void early_return_then_shuffle(unsigned* out) {
  if (threadIdx.x % 32 >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFu, threadIdx.x, 1);
}

// Undefined behaviour: half of each warp at a shuffle, the other half at __syncthreads.
__global__ void divergent_barriers(unsigned* out) {
  if (threadIdx.x % 2 == 0) {
    out[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFu, threadIdx.x, 2);
  } else {
    __syncthreads();
  }
}

// Threads that return before a __syncthreads count as arrived (what GPUs do since Volta).
__global__ void return_before_barrier(unsigned* out) {
  if (threadIdx.x >= 100) return;
  out[threadIdx.x] = threadIdx.x;
  __syncthreads();
  out[100 + threadIdx.x] = out[threadIdx.x] + out[99 - threadIdx.x];
}

__global__ void atomic_max(const unsigned* in, unsigned* out) {
  atomicMax(out, in[blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x]);
}

std::string failed_launch() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : std::to_string(e) + ": " + mq_cuda_emu::errors().message;
}

template <int L>
void check_segment_max(const char* name) {
  const int n = 512;
  std::vector<unsigned> in(n), out(n, 0);
  for (int i = 0; i < n; ++i) in[i] = static_cast<unsigned>((i * 2654435761u) >> 7);
  MQ_LAUNCH(n / 256, 256, nullptr, segment_max<L>)(in.data(), out.data());
  const std::string err = failed_launch();
  bool ok = err.empty();
  for (int i = 0; i < n && ok; ++i) {
    unsigned m = 0;
    for (int k = i / L * L; k < i / L * L + L; ++k) m = in[k] > m ? in[k] : m;
    ok = out[i] == m;
  }
  report(name, ok, err);
}

}  // namespace

int main() {
  check_segment_max<2>("shuffle_xor_segments_of_2");
  check_segment_max<4>("shuffle_xor_segments_of_4");
  check_segment_max<16>("shuffle_xor_segments_of_16");
  check_segment_max<32>("shuffle_xor_whole_warps");

  {
    const unsigned gx = 3, gy = 2;
    std::vector<unsigned> in(gx * gy * 256), out(gx * gy, 0);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<unsigned>(i % 1000);
    MQ_LAUNCH(dim3(gx, gy), 256, nullptr, block_sum)(in.data(), out.data());
    const std::string err = failed_launch();
    bool ok = err.empty();
    for (unsigned b = 0; b < gx * gy && ok; ++b) {
      unsigned s = 0;
      for (unsigned t = 0; t < 256; ++t) s += in[b * 256 + t];
      ok = out[b] == s;
    }
    report("syncthreads_block_sum_2d_grid", ok, err);
  }
  {
    std::vector<unsigned> out(256, 0);
    MQ_LAUNCH(1, 256, nullptr, return_before_barrier)(out.data());
    const std::string err = failed_launch();
    bool ok = err.empty();
    for (unsigned t = 0; t < 100 && ok; ++t) ok = out[100 + t] == 99;
    report("returned_threads_pass_syncthreads", ok, err);
  }
  {
    std::vector<unsigned> in(1024), out(1, 0);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<unsigned>((i * 40503u) % 65521u);
    unsigned m = 0;
    for (unsigned v : in) m = v > m ? v : m;
    MQ_LAUNCH(4, 256, nullptr, atomic_max)(in.data(), out.data());
    const std::string err = failed_launch();
    report("atomic_max", err.empty() && out[0] == m, err);
  }
  {
    std::vector<unsigned> out(256, 0);
    MQ_LAUNCH(1, 256, nullptr, early_return_then_shuffle)(out.data());
    const std::string err = failed_launch();
    report("refuses_shuffle_with_returned_lanes", err.find("returned before its warp's shuffle") != std::string::npos, err);
  }
  {
    std::vector<unsigned> out(256, 0);
    MQ_LAUNCH(1, 256, nullptr, divergent_barriers)(out.data());
    const std::string err = failed_launch();
    report("refuses_divergent_barriers", err.find("deadlock") != std::string::npos, err);
  }
  {
    std::vector<unsigned> out(1, 0);
    MQ_LAUNCH(1, 2048, nullptr, return_before_barrier)(out.data());
    const std::string err = failed_launch();
    report("refuses_blocks_over_1024_threads", err.find("invalid launch configuration") != std::string::npos, err);
  }
  return failures == 0 ? 0 : 1;
}
