// Pager: io_uring transfers with a pread/pwrite thread-pool fallback (see pager.h).
#include "miles_offload/pager.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>

#ifdef MILES_OFFLOAD_HAVE_URING
#include <liburing.h>
#endif

namespace miles_offload {

namespace {

// Sentinel errno for a read that hit the end of the file before `len` bytes.
constexpr int kEof = ENODATA;

[[noreturn]] void fail(int err, bool write) {
  if (err == kEof) throw std::system_error(err, std::generic_category(), "unexpected end of file");
  throw std::system_error(err, std::generic_category(), write ? "pwrite" : "pread");
}

// One blocking transfer on the thread pool: workers take `block_size` chunks by index.
struct Job {
  int fd = -1;
  uint64_t offset = 0;
  char* buf = nullptr;
  std::size_t len = 0;
  std::size_t block = 0;
  std::size_t chunks = 0;
  bool write = false;
  std::atomic<std::size_t> next{0};
  std::atomic<std::size_t> finished{0};
  std::atomic<int> err{0};
};

void run_chunk(Job& job, std::size_t i) {
  std::size_t pos = i * job.block;
  const std::size_t end = std::min(job.len, pos + job.block);
  while (pos < end && job.err.load(std::memory_order_relaxed) == 0) {
    const ssize_t r = job.write ? ::pwrite(job.fd, job.buf + pos, end - pos, job.offset + pos)
                                : ::pread(job.fd, job.buf + pos, end - pos, job.offset + pos);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      int expected = 0;
      job.err.compare_exchange_strong(expected, errno);
    } else if (r == 0) {
      int expected = 0;
      job.err.compare_exchange_strong(expected, job.write ? EIO : kEof);
    } else {
      pos += static_cast<std::size_t>(r);
    }
  }
}

}  // namespace

struct Pager::Impl {
  PagerOptions opt;
  Backend backend = Backend::threads;
  std::string reason;
  std::mutex call_mu;  // one transfer at a time
  PagerStats st;

#ifdef MILES_OFFLOAD_HAVE_URING
  io_uring ring{};
  bool ring_ok = false;
  std::vector<std::pair<char*, std::size_t>> regs;
#endif

  // Thread pool (only started with the threads backend).
  std::vector<std::thread> workers;
  std::mutex pool_mu;
  std::condition_variable work_cv, done_cv;
  std::shared_ptr<Job> job;
  uint64_t generation = 0;
  bool stop = false;

  void start_pool() {
    const unsigned n = std::max(1u, std::min(opt.queue_depth, 64u));
    for (unsigned t = 0; t < n; ++t) {
      try {
        workers.emplace_back([this] { worker(); });
      } catch (...) {
        // Fewer workers only lower the parallelism (they share the chunks); with none, stop
        // and join so that no joinable thread is destroyed (std::terminate), then report.
        if (!workers.empty()) return;
        throw;
      }
    }
  }

  void worker() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> j;
      {
        std::unique_lock<std::mutex> lock(pool_mu);
        work_cv.wait(lock, [&] { return stop || generation != seen; });
        if (stop) return;
        seen = generation;
        j = job;
      }
      if (!j) continue;  // woke after that transfer finished (the caller already reset it)
      for (;;) {
        const std::size_t i = j->next.fetch_add(1);
        if (i >= j->chunks) break;
        run_chunk(*j, i);
        if (j->finished.fetch_add(1) + 1 == j->chunks) {
          std::lock_guard<std::mutex> lock(pool_mu);
          done_cv.notify_all();
        }
      }
    }
  }

  void pool_xfer(int fd, uint64_t offset, char* buf, std::size_t len, bool write) {
    auto j = std::make_shared<Job>();
    j->fd = fd;
    j->offset = offset;
    j->buf = buf;
    j->len = len;
    j->block = opt.block_size;
    j->chunks = (len + opt.block_size - 1) / opt.block_size;
    j->write = write;
    {
      std::unique_lock<std::mutex> lock(pool_mu);
      job = j;
      ++generation;
      work_cv.notify_all();
      done_cv.wait(lock, [&] { return j->finished.load() == j->chunks; });
      job.reset();
    }
    st.requests += j->chunks;
    if (const int err = j->err.load()) fail(err, write);
  }

#ifdef MILES_OFFLOAD_HAVE_URING
  int find_registered(const char* p, std::size_t n) const {
    for (std::size_t i = 0; i < regs.size(); ++i) {
      if (p >= regs[i].first && p + n <= regs[i].first + regs[i].second) return static_cast<int>(i);
    }
    return -1;
  }

  void uring_xfer(int fd, uint64_t offset, char* buf, std::size_t len, bool write,
                  uint32_t* crc, std::size_t crc_from) {
    // Checksum state: bytes [crc_from, crc_pos) are folded into `running`. Reads advance it over
    // the blocks that have completed contiguously; writes checksum a block before submitting it.
    const std::size_t bs = opt.block_size;
    const std::size_t nblocks = (len + bs - 1) / bs;
    std::vector<char> block_done(crc != nullptr && !write ? nblocks : 0, 0);
    std::size_t crc_pos = crc_from;
    uint32_t running = 0;
    auto fold = [&](std::size_t upto) {
      if (upto > crc_pos) {
        running = crc32c(running, buf + crc_pos, upto - crc_pos);
        crc_pos = upto;
      }
    };
    std::size_t first_pending = 0;  // reads: first block not yet known complete
    struct Slot {
      std::size_t pos = 0;
      std::size_t left = 0;
    };
    const unsigned qd = opt.queue_depth;
    std::vector<Slot> slots(qd);
    std::vector<unsigned> free_slots;
    for (unsigned s = qd; s > 0; --s) free_slots.push_back(s - 1);
    auto prep = [&](unsigned s) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      // At most queue_depth requests are prepared or in flight, and the SQ has that many entries.
      if (sqe == nullptr) throw std::logic_error("miles_offload pager: submission queue full");
      char* p = buf + slots[s].pos;
      const unsigned n = static_cast<unsigned>(slots[s].left);
      const uint64_t off = offset + slots[s].pos;
      const int bi = find_registered(p, n);
      if (bi >= 0) ++st.fixed_requests;
      if (write) {
        if (bi >= 0) io_uring_prep_write_fixed(sqe, fd, p, n, off, bi);
        else io_uring_prep_write(sqe, fd, p, n, off);
      } else {
        if (bi >= 0) io_uring_prep_read_fixed(sqe, fd, p, n, off, bi);
        else io_uring_prep_read(sqe, fd, p, n, off);
      }
      io_uring_sqe_set_data64(sqe, s);
      ++st.requests;
    };
    std::size_t next = 0;
    unsigned inflight = 0;
    int err = 0;
    for (;;) {
      while (err == 0 && inflight < qd && next < len) {
        const unsigned s = free_slots.back();
        free_slots.pop_back();
        slots[s].pos = next;
        slots[s].left = std::min(opt.block_size, len - next);
        next += slots[s].left;
        if (crc != nullptr && write) fold(next);
        prep(s);
        ++inflight;
      }
      if (inflight == 0) break;
      int r = io_uring_submit_and_wait(&ring, 1);
      ++st.submit_calls;
      if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
        // The ring is unusable: nothing more can be reaped safely.
        fail(-r, write);
      }
      io_uring_cqe* cqe = nullptr;
      unsigned head = 0;
      unsigned seen = 0;
      io_uring_for_each_cqe(&ring, head, cqe) {
        ++seen;
        const unsigned s = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
        const int res = cqe->res;
        if (res == -EAGAIN || res == -EINTR) {
          prep(s);  // retry the same range
        } else if (res < 0 || res == 0) {
          if (err == 0) err = res < 0 ? -res : (write ? EIO : kEof);
          --inflight;
          free_slots.push_back(s);
        } else if (static_cast<std::size_t>(res) < slots[s].left) {
          slots[s].pos += static_cast<std::size_t>(res);  // short transfer: resubmit the rest
          slots[s].left -= static_cast<std::size_t>(res);
          prep(s);
        } else {
          --inflight;
          free_slots.push_back(s);
          if (!block_done.empty()) block_done[(slots[s].pos + slots[s].left - 1) / bs] = 1;
        }
      }
      io_uring_cq_advance(&ring, seen);
      if (!block_done.empty() && err == 0) {
        // Refill first so the disk stays busy, then checksum what has arrived in order.
        while (inflight < qd && next < len) {
          const unsigned s = free_slots.back();
          free_slots.pop_back();
          slots[s].pos = next;
          slots[s].left = std::min(opt.block_size, len - next);
          next += slots[s].left;
          prep(s);
          ++inflight;
        }
        if (io_uring_sq_ready(&ring) > 0) {
          io_uring_submit(&ring);
          ++st.submit_calls;
        }
        while (first_pending < nblocks && block_done[first_pending]) ++first_pending;
        fold(std::min(len, first_pending * bs));
      }
    }
    if (err != 0) fail(err, write);
    if (crc != nullptr) {
      fold(len);
      *crc = running;
    }
  }
#endif

  void xfer(int fd, uint64_t offset, char* buf, std::size_t len, bool write, uint32_t* crc,
            std::size_t crc_from) {
    std::lock_guard<std::mutex> lock(call_mu);
    if (crc != nullptr) *crc = 0;
    crc_from = std::min(crc_from, len);
    if (len == 0) return;
#ifdef MILES_OFFLOAD_HAVE_URING
    if (backend == Backend::io_uring) {
      uring_xfer(fd, offset, buf, len, write, crc, crc_from);
      (write ? st.bytes_written : st.bytes_read) += len;
      return;
    }
#endif
    // Thread pool: checksum before a write, after a read (no overlap).
    if (crc != nullptr && write) *crc = crc32c(0, buf + crc_from, len - crc_from);
    pool_xfer(fd, offset, buf, len, write);
    if (crc != nullptr && !write) *crc = crc32c(0, buf + crc_from, len - crc_from);
    (write ? st.bytes_written : st.bytes_read) += len;
  }
};

Pager::Pager(const PagerOptions& options) : impl_(new Impl) {
  if (options.queue_depth < 1 || options.queue_depth > 4096)
    throw std::invalid_argument("queue_depth must be in [1, 4096]");
  if (options.block_size == 0 || options.block_size % 4096 != 0 || options.block_size > (1u << 30))
    throw std::invalid_argument("block_size must be a positive multiple of 4096, at most 1 GiB");
  impl_->opt = options;
#ifdef MILES_OFFLOAD_HAVE_URING
  if (options.force_threads) {
    impl_->reason = "io_uring disabled by the caller";
  } else {
    // COOP_TASKRUN (Linux 5.19+): completions are processed when the submitter enters the
    // kernel anyway, without interrupting it; older kernels refuse the flag, so retry without.
    int r = -EINVAL;
#ifdef IORING_SETUP_COOP_TASKRUN
    r = io_uring_queue_init(options.queue_depth, &impl_->ring, IORING_SETUP_COOP_TASKRUN);
#endif
    if (r == -EINVAL) r = io_uring_queue_init(options.queue_depth, &impl_->ring, 0);
    if (r == 0) {
      impl_->ring_ok = true;
      impl_->backend = Backend::io_uring;
    } else {
      impl_->reason = std::string("io_uring_queue_init failed: ") +
                      std::error_code(-r, std::generic_category()).message();
    }
  }
#else
  impl_->reason = "built without liburing";
#endif
  if (impl_->backend == Backend::threads) impl_->start_pool();
}

Pager::~Pager() {
  {
    std::lock_guard<std::mutex> lock(impl_->pool_mu);
    impl_->stop = true;
    impl_->work_cv.notify_all();
  }
  for (auto& t : impl_->workers) t.join();
#ifdef MILES_OFFLOAD_HAVE_URING
  if (impl_->ring_ok) io_uring_queue_exit(&impl_->ring);
#endif
}

Backend Pager::backend() const { return impl_->backend; }
const std::string& Pager::fallback_reason() const { return impl_->reason; }
unsigned Pager::queue_depth() const { return impl_->opt.queue_depth; }
std::size_t Pager::block_size() const { return impl_->opt.block_size; }

int Pager::register_buffers(const std::vector<std::pair<void*, std::size_t>>& buffers) {
  std::lock_guard<std::mutex> lock(impl_->call_mu);
#ifdef MILES_OFFLOAD_HAVE_URING
  if (impl_->backend != Backend::io_uring) return 0;
  if (!impl_->regs.empty()) {
    io_uring_unregister_buffers(&impl_->ring);
    impl_->regs.clear();
  }
  if (buffers.empty()) return 0;
  std::vector<iovec> iov;
  for (const auto& b : buffers) iov.push_back(iovec{b.first, b.second});
  const int r = io_uring_register_buffers(&impl_->ring, iov.data(), static_cast<unsigned>(iov.size()));
  if (r < 0) return r;
  for (const auto& b : buffers) impl_->regs.emplace_back(static_cast<char*>(b.first), b.second);
  return 0;
#else
  (void)buffers;
  return 0;
#endif
}

void Pager::read(int fd, uint64_t offset, void* buf, std::size_t len, uint32_t* crc,
                 std::size_t crc_from) {
  impl_->xfer(fd, offset, static_cast<char*>(buf), len, false, crc, crc_from);
}

void Pager::write(int fd, uint64_t offset, const void* buf, std::size_t len, uint32_t* crc,
                  std::size_t crc_from) {
  impl_->xfer(fd, offset, const_cast<char*>(static_cast<const char*>(buf)), len, true, crc,
              crc_from);
}

PagerStats Pager::stats() const {
  std::lock_guard<std::mutex> lock(impl_->call_mu);
  return impl_->st;
}

bool built_with_io_uring() {
#ifdef MILES_OFFLOAD_HAVE_URING
  return true;
#else
  return false;
#endif
}

}  // namespace miles_offload
