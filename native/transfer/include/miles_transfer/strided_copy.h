// Strided byte-box copies for weight re-sharding: torch-free, raw pointers and sizes.
//
// A Job copies an n-dimensional box of bytes: `shape` extents, `src_strides` / `dst_strides`
// in bytes, and the innermost dimension contiguous on both sides (its stride is 1 and not
// stored). copy_jobs spreads the rows of all jobs over `threads` threads (chunks of about
// 256 KiB; a long row is cut into chunks too) and returns when every byte is written. Boxes
// must not overlap between jobs' destinations (re-sharding plans never do); bounds are the
// caller's responsibility (the Python wrapper checks them).
#pragma once

#include <cstdint>

namespace miles_transfer {

constexpr int kMaxDims = 6;

struct Job {
  const uint8_t* src;
  uint8_t* dst;
  int ndim;                      // 1..kMaxDims; shape[ndim - 1] is the contiguous row length
  int64_t shape[kMaxDims];
  int64_t src_strides[kMaxDims];  // bytes; entry ndim - 1 unused (1)
  int64_t dst_strides[kMaxDims];
};

// Copies every job; threads <= 1 runs on the calling thread.
void copy_jobs(const Job* jobs, int64_t n_jobs, int threads);

}  // namespace miles_transfer
