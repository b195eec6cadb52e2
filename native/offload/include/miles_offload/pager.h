// miles-offload native pager: bulk file I/O between aligned host buffers and files opened with
// O_DIRECT, through io_uring (liburing) or, where io_uring is unavailable, a pread/pwrite thread
// pool. Torch-free: buffers are raw pointers and sizes.
//
// One transfer (read or write of `len` bytes at `offset`) is cut into `block_size` requests and
// kept `queue_depth` deep: io_uring gets them in batches (one io_uring_submit per refill), the
// thread pool hands them to its workers. Buffers registered with `register_buffers` are used with
// READ_FIXED/WRITE_FIXED (no per-request page pinning in the kernel). Transfers are blocking and
// a Pager serves one transfer at a time (a mutex serialises callers); use one Pager per thread
// for concurrent reads and writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace miles_offload {

enum class Backend { io_uring = 0, threads = 1 };

struct PagerOptions {
  unsigned queue_depth = 32;        // requests in flight per transfer (io_uring SQ size; pool threads)
  std::size_t block_size = 1 << 20;  // bytes per request; a multiple of 4096
  bool force_threads = false;       // skip io_uring (tests, or an environment override)
};

struct PagerStats {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t requests = 0;      // read/write requests issued (including resubmitted short ones)
  uint64_t fixed_requests = 0;  // of those, READ_FIXED/WRITE_FIXED on registered buffers
  uint64_t submit_calls = 0;  // io_uring_submit calls (0 with the thread pool)
};

class Pager {
 public:
  explicit Pager(const PagerOptions& options);
  ~Pager();
  Pager(const Pager&) = delete;
  Pager& operator=(const Pager&) = delete;

  Backend backend() const;
  // Why io_uring is not in use ("" when it is): the io_uring_queue_init error, or the override.
  const std::string& fallback_reason() const;
  unsigned queue_depth() const;
  std::size_t block_size() const;

  // Registers buffers for fixed-buffer I/O (replacing earlier ones). Returns 0, or a negative
  // errno when the kernel refuses (the buffers then stay plain, which is slower but correct).
  int register_buffers(const std::vector<std::pair<void*, std::size_t>>& buffers);

  // Blocking transfers; throw std::system_error on an I/O error or an unexpected end of file.
  // With `crc` non-null, also compute the CRC-32C of buf[crc_from, len) into *crc, overlapped
  // with the I/O: with io_uring a read checksums the blocks that have arrived while later ones
  // are in flight, and a write checksums each block just before submitting it.
  void read(int fd, uint64_t offset, void* buf, std::size_t len, uint32_t* crc = nullptr,
            std::size_t crc_from = 0);
  void write(int fd, uint64_t offset, const void* buf, std::size_t len, uint32_t* crc = nullptr,
             std::size_t crc_from = 0);

  PagerStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// CRC-32C (Castagnoli), the storage checksum of the bucket files. `crc` is the running value
// (0 to start); SSE4.2 instructions when the CPU has them, a table otherwise.
uint32_t crc32c(uint32_t crc, const void* data, std::size_t len);

// Whether this build links liburing (false: only the thread pool exists).
bool built_with_io_uring();

}  // namespace miles_offload
