// A CPU emulator of the part of CUDA that cuda/quantize.cu uses, so that its kernels run, as
// written, on a machine without a GPU: a test harness (tests/test_cuda_emu.py), never a backend.
//
// quantize.cu is compiled by g++ as C++ with -DMQ_CUDA_EMU and this directory first on the
// include path (its cuda_runtime.h and cuda_fp8.h lead here). Then:
// - a launch runs the kernel's blocks one after another; each CUDA thread of a block is a fiber
//   with its own stack (switched by a few instructions of our own on x86-64, by ucontext
//   elsewhere), and threadIdx / blockIdx hold the running fiber's indexes;
// - __syncthreads() parks the fiber until every thread of the block that has not returned is
//   parked there too; __shfl_xor_sync() until all 32 lanes of its warp are parked at a shuffle,
//   then each lane gets its partner's value. A shuffle that waits on a lane that returned, or a
//   barrier that threads reach by different paths (some at a shuffle, some at __syncthreads), is
//   reported as a failed launch: on a GPU both are undefined behaviour;
// - __shared__ variables are function statics: one per kernel, shared by the block's threads
//   (blocks run one at a time, so no two blocks share them at once);
// - atomicMax is a plain read-modify-write (one OS thread runs every fiber);
// - device memory is host memory (cudaMallocAsync is malloc), streams are ignored and launches
//   finish before they return.
// What this checks: the kernels' indexing, their reductions and their use of contract.h, bit for
// bit, through the real binding. What it cannot: nvcc's code generation (tests/test_cuda.py
// compiles it), the __CUDA_ARCH__ >= 890 hardware FP8 conversion (not compiled here:
// __CUDA_ARCH__ is undefined; tools/bench/quant_cuda_cvt_probe.cu checked it on an H200 for all
// 2^32 inputs), races between blocks, the memory model, and speed.
#pragma once

#include <ucontext.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

// ---- built-in types ---------------------------------------------------------------------------

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};

inline uint3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0};
inline dim3 blockDim, gridDim;

// ---- runtime API (the calls quantize.cu makes) --------------------------------------------------

typedef struct CUstream_st* cudaStream_t;
enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};

namespace mq_cuda_emu {

struct Errors {
  cudaError_t last = cudaSuccess;
  std::string message;  // why the last failed launch failed
};
inline Errors& errors() {
  static Errors e;
  return e;
}

inline void fail(cudaError_t e, std::string why) {
  if (errors().last == cudaSuccess) {
    errors().last = e;
    errors().message = std::move(why);
  }
}

// ---- fibers -------------------------------------------------------------------------------------

// A fiber's saved context. On x86-64, the stack pointer alone, switched by mq_emu_switch below:
// the callee-saved registers pushed on the fiber's own stack (no signal mask to save, which
// costs swapcontext a system call per switch: the emulated tests ran 6x as long with it).
// Elsewhere, ucontext.
#if defined(__x86_64__) && !defined(MQ_CUDA_EMU_UCONTEXT)
struct Context {
  void* sp = nullptr;
};

extern "C" void mq_emu_switch(void** save_sp, void* load_sp);
// Weak: each translation unit that includes this header assembles a copy; the linker keeps one.
asm(R"(
  .text
  .p2align 4
  .weak mq_emu_switch
  .type mq_emu_switch, @function
mq_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mq_emu_switch, .-mq_emu_switch
)");

inline void switch_context(Context& from, const Context& to) { mq_emu_switch(&from.sp, to.sp); }

// A context that starts entry (which must never return) on stack [base, base + size): six zero
// registers for mq_emu_switch to pop, then entry as the address its ret jumps to, then a null
// return address, so that entry begins with the stack aligned as after a call.
inline void make_context(Context& c, char* base, size_t size, void (*entry)(), Context*) {
  auto top = reinterpret_cast<uintptr_t>(base + size) & ~static_cast<uintptr_t>(15);
  auto* slot = reinterpret_cast<uintptr_t*>(top);
  slot[-1] = 0;
  slot[-2] = reinterpret_cast<uintptr_t>(entry);
  for (int k = 3; k <= 8; ++k) slot[-k] = 0;
  c.sp = slot - 8;
}
#else
struct Context {
  ucontext_t uc{};
};

inline void switch_context(Context& from, const Context& to) { swapcontext(&from.uc, &to.uc); }

inline void make_context(Context& c, char* base, size_t size, void (*entry)(), Context* link) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = base;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = &link->uc;
  makecontext(&c.uc, entry, 0);
}
#endif

enum class Park { run, sync, shfl, done };

struct Fiber {
  Context ctx;
  uint3 tid{};
  Park park = Park::run;
  uint32_t value = 0;  // a shuffle's operand, then its result
  int lane_mask = 0;
};

constexpr size_t kStackBytes = 64 * 1024;

struct Block {
  std::vector<Fiber> fibers;
  Context scheduler;
  size_t current = 0;
  const std::function<void()>* body = nullptr;
};

inline Block*& block() {
  static Block* b = nullptr;
  return b;
}

inline void park(Park why) {
  Block& b = *block();
  Fiber& f = b.fibers[b.current];
  f.park = why;
  switch_context(f.ctx, b.scheduler);
}

// A fiber's entry: the kernel as this thread, then back to the scheduler for good.
inline void fiber_main() {
  Block& b = *block();
  (*b.body)();
  Fiber& f = b.fibers[b.current];
  f.park = Park::done;
  switch_context(f.ctx, b.scheduler);
  __builtin_unreachable();
}

inline std::string where(const Block& b, size_t i) {
  const uint3 t = b.fibers[i].tid;
  return "thread (" + std::to_string(t.x) + "," + std::to_string(t.y) + "," + std::to_string(t.z) + ") of block (" +
         std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) + ")";
}

// Releases the threads parked at a barrier that every thread it waits for has reached: a warp's
// shuffle, or the block's __syncthreads. Returns false (and records why) when none can go on.
inline bool release(Block& b) {
  bool any = false;
  const size_t n = b.fibers.size();
  for (size_t w = 0; w < n; w += 32) {
    const size_t end = w + 32 < n ? w + 32 : n;
    size_t at_shfl = 0;
    for (size_t i = w; i < end; ++i) at_shfl += b.fibers[i].park == Park::shfl;
    if (at_shfl == 0) continue;
    if (at_shfl != end - w) {
      for (size_t i = w; i < end; ++i) {
        if (b.fibers[i].park == Park::done) {
          fail(cudaErrorLaunchFailure, "__shfl_xor_sync: lane " + std::to_string(i - w) + " (" + where(b, i) +
                                           ") returned before its warp's shuffle");
          return false;
        }
      }
      continue;  // the others parked at __syncthreads: reported below as a deadlock
    }
    std::vector<uint32_t> v(end - w);
    for (size_t i = w; i < end; ++i) v[i - w] = b.fibers[i].value;
    for (size_t i = w; i < end; ++i) {
      const size_t src = (i - w) ^ static_cast<size_t>(b.fibers[i].lane_mask);
      if (src >= end - w) {
        fail(cudaErrorLaunchFailure, "__shfl_xor_sync: partner lane outside a partial warp");
        return false;
      }
      b.fibers[i].value = v[src];
      b.fibers[i].park = Park::run;
    }
    any = true;
  }
  if (any) return true;
  size_t at_sync = 0, done = 0;
  for (const Fiber& f : b.fibers) {
    at_sync += f.park == Park::sync;
    done += f.park == Park::done;
  }
  if (at_sync > 0 && at_sync + done == n) {
    for (Fiber& f : b.fibers)
      if (f.park == Park::sync) f.park = Park::run;
    return true;
  }
  for (size_t i = 0; i < n; ++i) {
    if (b.fibers[i].park == Park::shfl) {
      fail(cudaErrorLaunchFailure, "deadlock: " + where(b, i) + " waits at a shuffle its warp does not reach (others at __syncthreads)");
      return false;
    }
  }
  fail(cudaErrorLaunchFailure, "deadlock: threads parked at different barriers");
  return false;
}

// One fiber per thread of a block of bd threads, each to start at fiber_main on its own stack.
inline void make_fibers(Block& b, const dim3& bd) {
  const size_t n = static_cast<size_t>(bd.x) * bd.y * bd.z;
  b.fibers.resize(n);
  static std::vector<char> pool;  // the stacks, kept from launch to launch
  if (pool.size() < n * kStackBytes) pool.resize(n * kStackBytes);
  size_t i = 0;
  for (unsigned z = 0; z < bd.z; ++z)
    for (unsigned y = 0; y < bd.y; ++y)
      for (unsigned x = 0; x < bd.x; ++x, ++i) {
        Fiber& f = b.fibers[i];
        f.tid = {x, y, z};
        make_context(f.ctx, pool.data() + i * kStackBytes, kStackBytes, fiber_main, &b.scheduler);
      }
}

// Runs body as every thread of the current block; false if a barrier could not be met.
inline bool run_block(const dim3& bd, const std::function<void()>& body) {
  Block b;
  b.body = &body;
  make_fibers(b, bd);
  const size_t n = b.fibers.size();
  Block* saved = block();
  block() = &b;
  bool ok = true;
  for (;;) {
    for (size_t k = 0; k < n; ++k) {
      if (b.fibers[k].park != Park::run) continue;
      b.current = k;
      threadIdx = b.fibers[k].tid;
      switch_context(b.scheduler, b.fibers[k].ctx);
    }
    bool all_done = true;
    for (const Fiber& f : b.fibers) all_done = all_done && f.park == Park::done;
    if (all_done) break;
    if (!release(b)) {
      ok = false;
      break;
    }
  }
  block() = saved;
  return ok;
}

// A launch: the kernel's grid, block by block; launch(kernel, grid, block, stream)(args...).
template <class... P>
auto launch(void (*kernel)(P...), dim3 grid, dim3 bd, cudaStream_t) {
  return [=](auto&&... args) {
    if (bd.x * bd.y * bd.z == 0 || bd.x * bd.y * bd.z > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        grid.y > 65535 || grid.z > 65535) {
      fail(cudaErrorInvalidConfiguration, "invalid launch configuration");
      return;
    }
    const std::tuple<P...> params(args...);
    const std::function<void()> body = [&] { std::apply(kernel, params); };
    blockDim = bd;
    gridDim = grid;
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          blockIdx = {x, y, z};
          if (!run_block(bd, body)) return;
        }
  };
}

}  // namespace mq_cuda_emu

#define MQ_LAUNCH(grid, block, stream, ...) ::mq_cuda_emu::launch(__VA_ARGS__, grid, block, stream)

inline void __syncthreads() { mq_cuda_emu::park(mq_cuda_emu::Park::sync); }

inline uint32_t __shfl_xor_sync(unsigned mask, uint32_t v, int lane_mask, int width = 32) {
  using namespace mq_cuda_emu;
  if (mask != 0xFFFFFFFFu || width != 32) fail(cudaErrorLaunchFailure, "__shfl_xor_sync: only full warps are emulated");
  Block& b = *block();
  b.fibers[b.current].value = v;
  b.fibers[b.current].lane_mask = lane_mask;
  park(Park::shfl);
  return b.fibers[b.current].value;
}

inline unsigned atomicMax(unsigned* address, unsigned v) {
  const unsigned old = *address;
  if (v > old) *address = v;
  return old;
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = mq_cuda_emu::errors().last;
  mq_cuda_emu::errors().last = cudaSuccess;
  return e;
}

template <class T>
cudaError_t cudaMallocAsync(T** p, size_t n, cudaStream_t) {
  *p = static_cast<T*>(std::malloc(n > 0 ? n : 1));
  return *p != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}

inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  return cudaSuccess;
}

inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  std::free(p);
  return cudaSuccess;
}
