// Multithreaded strided copies (see include/miles_transfer/strided_copy.h).
//
// The work is cut into tasks of about kChunk bytes: runs of whole rows of one job, or a slice of
// one long row. Threads take tasks from a shared atomic counter, so uneven jobs balance out.
#include "miles_transfer/strided_copy.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

namespace miles_transfer {
namespace {

constexpr int64_t kChunk = 256 * 1024;

struct Task {
  int64_t job;
  int64_t row_begin, row_end;    // rows [row_begin, row_end) of the job
  int64_t byte_begin, byte_end;  // bytes of each row (a slice when one row is cut)
};

// Byte offsets of row `row` (a flat index over shape[0..ndim-2]).
inline void row_offsets(const Job& j, int64_t row, int64_t* so, int64_t* dof) {
  int64_t s = 0, d = 0;
  for (int k = j.ndim - 2; k >= 0; --k) {
    const int64_t n = j.shape[k];
    const int64_t i = row % n;
    row /= n;
    s += i * j.src_strides[k];
    d += i * j.dst_strides[k];
  }
  *so = s;
  *dof = d;
}

void run_task(const Job* jobs, const Task& t) {
  const Job& j = jobs[t.job];
  const int64_t len = t.byte_end - t.byte_begin;
  int64_t so = 0, dof = 0;
  row_offsets(j, t.row_begin, &so, &dof);
  // Walk the rows with an odometer instead of re-deriving offsets per row.
  int64_t idx[kMaxDims] = {0};
  {
    int64_t row = t.row_begin;
    for (int k = j.ndim - 2; k >= 0; --k) {
      idx[k] = row % j.shape[k];
      row /= j.shape[k];
    }
  }
  for (int64_t r = t.row_begin; r < t.row_end; ++r) {
    std::memcpy(j.dst + dof + t.byte_begin, j.src + so + t.byte_begin, static_cast<size_t>(len));
    for (int k = j.ndim - 2; k >= 0; --k) {
      so += j.src_strides[k];
      dof += j.dst_strides[k];
      if (++idx[k] < j.shape[k]) break;
      so -= j.src_strides[k] * j.shape[k];
      dof -= j.dst_strides[k] * j.shape[k];
      idx[k] = 0;
    }
  }
}

std::vector<Task> make_tasks(const Job* jobs, int64_t n_jobs, int64_t* total) {
  std::vector<Task> tasks;
  *total = 0;
  for (int64_t ji = 0; ji < n_jobs; ++ji) {
    const Job& j = jobs[ji];
    int64_t rows = 1;
    for (int k = 0; k + 1 < j.ndim; ++k) rows *= j.shape[k];
    const int64_t row_bytes = j.shape[j.ndim - 1];
    if (rows == 0 || row_bytes == 0) continue;
    *total += rows * row_bytes;
    if (row_bytes >= kChunk) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < row_bytes; b += kChunk)
          tasks.push_back({ji, r, r + 1, b, std::min(row_bytes, b + kChunk)});
    } else {
      const int64_t per = std::max<int64_t>(1, kChunk / row_bytes);
      for (int64_t r = 0; r < rows; r += per)
        tasks.push_back({ji, r, std::min(rows, r + per), 0, row_bytes});
    }
  }
  return tasks;
}

}  // namespace

void copy_jobs(const Job* jobs, int64_t n_jobs, int threads) {
  int64_t total = 0;
  const std::vector<Task> tasks = make_tasks(jobs, n_jobs, &total);
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  // Small copies are not worth a thread start (tens of microseconds).
  const int64_t useful = std::min<int64_t>(n_tasks, total / (4 * kChunk) + 1);
  const int n_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, useful)));
  if (n_threads <= 1) {
    for (const Task& t : tasks) run_task(jobs, t);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    for (int64_t i = next.fetch_add(1); i < n_tasks; i = next.fetch_add(1)) run_task(jobs, tasks[i]);
  };
  std::vector<std::thread> pool;
  pool.reserve(n_threads - 1);
  for (int i = 1; i < n_threads; ++i) {
    // A thread that cannot start (EAGAIN under a pids limit) is not an error: the tasks are
    // shared, so the threads already running and the caller's thread do them. Letting the
    // exception unwind past joinable threads would call std::terminate.
    try {
      pool.emplace_back(worker);
    } catch (...) {
      break;
    }
  }
  worker();
  for (std::thread& th : pool) th.join();
}

}  // namespace miles_transfer
